"""Calibration data for the speech-map thresholds (options.Policy), on audio no test asserts on.

The shared clips are mixed with generated white and brown noise at several SNRs, and put
between stretches of generated non-speech (silence, noise, tones). For every segment the
model writes (with the segment-over-non-speech rule off) the script prints the share of
speech frames in its span, and whether its words are in the clip's reference, so the
threshold that separates real segments from invented ones can be read off; it also
prints the detector's speech share of each generated non-speech signal (false alarms).

    python scripts/calibrate_speech.py --model models/tiny.en [--model models/base]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from whisper_cli.audio import SAMPLE_RATE, load_audio  # noqa: E402
from whisper_cli.dtypes import resolve_policy  # noqa: E402
from whisper_cli.loading import load_model  # noqa: E402
from whisper_cli.options import Policy, TranscribeOptions  # noqa: E402
from whisper_cli.pipeline import Transcriber  # noqa: E402
from whisper_cli.speech import SpeechStream, load_detector  # noqa: E402

SHARED = REPO.parent / "shared" / "audio"
RATE = SAMPLE_RATE


def noise(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n)
    if kind == "brown":
        x = np.cumsum(x)
        x -= np.convolve(x, np.ones(800) / 800, mode="same")
    return (x / np.sqrt(np.mean(x**2))).astype(np.float32)


def at_snr(speech: np.ndarray, kind: str, snr_db: float, seed: int) -> np.ndarray:
    n = noise(kind, len(speech), seed)
    gain = np.sqrt(np.mean(speech**2) / 10 ** (snr_db / 10))
    return (speech + gain * n).astype(np.float32)


def tone(seconds: float, freqs: tuple[float, ...]) -> np.ndarray:
    t = np.arange(round(seconds * RATE)) / RATE
    return (0.3 * sum(np.sin(2 * np.pi * f * t) for f in freqs) / len(freqs)).astype(np.float32)


def clips() -> dict[str, tuple[np.ndarray, str]]:
    manifest = json.loads((SHARED / "manifest.json").read_text())["clips"]
    ref = {c["file"]: c for c in manifest}
    stereo = SHARED / "stereo_diarization.wav"
    licence = load_audio(SHARED / "multilingual.mp3")[: 28 * RATE]
    english = ref["multilingual.mp3"]["reference"].split(" Jedem")[0]
    return {
        "jfk": (load_audio(SHARED / "jfk.flac"), ref["jfk.flac"]["reference"]),
        "left": (load_audio(stereo, "left"), ref["stereo_diarization.wav"]["reference_left"]),
        "right": (load_audio(stereo, "right"), ref["stereo_diarization.wav"]["reference_right"]),
        "licence": (licence, english),
    }


def words(text: str) -> set[str]:
    return {w for w in "".join(c.lower() if c.isalnum() else " " for c in text).split()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=None)
    args = parser.parse_args()
    detector = load_detector()

    print("## detector speech share of generated non-speech (frames >= 0.5)")
    signals = {
        "white -40 dBFS": 0.01 * noise("white", 30 * RATE, 1),
        "white -20 dBFS": 0.1 * noise("white", 30 * RATE, 2),
        "brown -26 dBFS": 0.05 * noise("brown", 30 * RATE, 3),
        "brown -12 dBFS": 0.25 * noise("brown", 30 * RATE, 4),
        "440 Hz": tone(30.0, (440.0,)),
        "chord": tone(30.0, (220.0, 277.2, 329.6, 440.0)),
    }
    for name, x in signals.items():
        stream = SpeechStream(detector)
        stream.push(x)
        p = stream.map()
        print(f"{name:16s} speech share {np.mean(p >= 0.5):.3f}  max P {p.max():.2f}")

    print("\n## detector speech share of the clips in noise (frames >= 0.5)")
    inputs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (speech, reference) in clips().items():
            for kind in ("white", "brown"):
                for snr in (20, 10, 5, 0):
                    mixed = at_snr(speech, kind, snr, seed=snr)
                    stream = SpeechStream(detector)
                    stream.push(mixed)
                    share = np.mean(stream.map() >= 0.5)
                    print(f"{name:8s} {kind} {snr:2d} dB: speech share {share:.2f}")
                    # The noisy clip after 6 s of its noise alone and before 6 s of silence.
                    lead = at_snr(np.zeros(6 * RATE, np.float32), kind, snr, seed=snr + 1)
                    lead *= np.sqrt(np.mean(speech**2) / 10 ** (snr / 10)) / max(
                        np.sqrt(np.mean(lead**2)), 1e-9
                    )
                    audio = np.concatenate([lead, mixed, np.zeros(6 * RATE, np.float32)])
                    path = Path(tmp) / f"{name}_{kind}_{snr}.wav"
                    sf.write(path, audio, RATE, subtype="FLOAT")
                    inputs.append((str(path), reference))

        for model in args.model or [str(REPO / "models" / "tiny.en")]:
            loaded = load_model(model, resolve_policy("f32", "cpu"))
            t = Transcriber(loaded, TranscribeOptions(policy=Policy(segment_min_speech=0.0)))
            shares: list[tuple[float, bool, str]] = []
            real_segments = Transcriber._segments

            def spy(self, window, row, shares=shares, real_segments=real_segments):
                segments = real_segments(self, window, row)
                for s in segments:
                    share = window.speech_share(s.start - window.start, s.end - window.start)
                    shares.append((share, s.text))
                return segments

            Transcriber._segments = spy
            references = dict(inputs)
            t.run([p for p, _ in inputs], lambda r: None, print)
            Transcriber._segments = real_segments
            print(f"\n## {Path(model).name}: segments by speech share (share, in reference?)")
            known = set().union(*(words(r) for r in references.values()))
            rows = sorted((share, bool(words(text) & known), text) for share, text in shares)
            for share, real, text in rows:
                print(f"{share:.2f} {'real' if real else 'INVENTED'} {text.strip()[:70]}")


if __name__ == "__main__":
    main()
