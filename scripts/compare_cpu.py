"""Whole-process wall time and WER: whisper-cli vs transformers vs faster-whisper, on CPU.

Builds N minutes of real English speech from ../shared/audio (with its reference text),
then times each implementation as a separate process (load included), `--repeats`
times in round-robin order, and prints the median and the WER of each row. faster-whisper is not a
dependency: pass the Python of a throw-away environment that has it with --fw-python,
and the CTranslate2 model directories (make models leaves them under .cache/ct2).

    python scripts/compare_cpu.py --minutes 10 --repeats 3 --fw-python /tmp/fwenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "audio"

FW_BATCHED = """
import sys, faster_whisper as fw
m = fw.WhisperModel(sys.argv[1], device="cpu", compute_type=sys.argv[2], cpu_threads=2)
p = fw.BatchedInferencePipeline(model=m)
segs, _ = p.transcribe(sys.argv[3], batch_size=16, beam_size=1, temperature=0, language="en")
print(" ".join(s.text.strip() for s in segs))
"""
FW_SEQUENTIAL = """
import sys, faster_whisper as fw
m = fw.WhisperModel(sys.argv[1], device="cpu", compute_type=sys.argv[2], cpu_threads=2)
segs, _ = m.transcribe(sys.argv[3], beam_size=1, temperature=0, language="en",
    without_timestamps=False, vad_filter=False, condition_on_previous_text=False)
print(" ".join(s.text.strip() for s in segs))
"""
TRANSFORMERS = """
import sys, torch
from transformers import pipeline
dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[sys.argv[2]]
kw = {"language": "en"} if "tiny.en" not in sys.argv[1] else {}
asr = pipeline("automatic-speech-recognition", model=sys.argv[1], dtype=dtype, device="cpu")
if asr.tokenizer.pad_token is None:  # imported dirs carry tokenizer.json alone
    asr.tokenizer.pad_token = "<|endoftext|>"
import soundfile as sf
audio, rate = sf.read(sys.argv[3], dtype="float32")
out = asr({"raw": audio, "sampling_rate": rate}, chunk_length_s=30, batch_size=16,
    return_timestamps=True, generate_kwargs=kw)
print(out["text"])
"""


def build_speech(minutes: float, out: Path) -> str:
    """English real speech tiled to `minutes`, with pauses of varied length; its reference."""
    import soxr

    manifest = json.loads((SHARED / "manifest.json").read_text())
    clips = {c["file"]: c for c in manifest["clips"]}
    pieces = []

    def load(name, channel=None):
        audio, rate = sf.read(SHARED / name, dtype="float32", always_2d=True)
        audio = audio[:, channel] if channel is not None else audio.mean(axis=1)
        return soxr.resample(audio, rate, 16000).astype(np.float32)

    multi = load("multilingual.mp3")[: int(29.3 * 16000)]  # the English (MIT licence) half
    english_multi = clips["multilingual.mp3"]["reference"].split(" Jedem")[0]
    pieces = [
        (load("jfk.flac"), clips["jfk.flac"]["reference"]),
        (load("stereo_diarization.wav", 0), clips["stereo_diarization.wav"]["reference_left"]),
        (load("stereo_diarization.wav", 1), clips["stereo_diarization.wav"]["reference_right"]),
        (multi, english_multi),
    ]
    rng = np.random.default_rng(0)
    audio, text, total = [], [], 0
    target = int(minutes * 60 * 16000)
    while total < target:
        clip, ref = pieces[rng.integers(len(pieces))]
        pause = np.zeros(int(rng.choice([0.0, 0.3, 1.0, 2.0]) * 16000), dtype=np.float32)
        audio += [clip, pause]
        text.append(ref)
        total += len(clip) + len(pause)
    sf.write(out, np.concatenate(audio), 16000, subtype="PCM_16")
    return " ".join(text)


def wer(reference: str, hypothesis: str) -> float:
    import jiwer
    from whisper_normalizer.english import EnglishTextNormalizer

    norm = EnglishTextNormalizer()
    return jiwer.wer(norm(reference), norm(hypothesis))


def timed(cmd: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed: {done.stderr[-2000:]}")
    return wall, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="tiny.en,base")
    parser.add_argument("--dtypes", default="f32,bf16")
    parser.add_argument("--only", default="whisper-cli,transformers,fw-batched,fw-sequential")
    parser.add_argument("--fw-python", default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        reference = build_speech(args.minutes, wav)
        seconds = sf.info(wav).duration
        print(f"audio: {seconds:.0f} s of real English speech", file=sys.stderr)
        runs: list[tuple[tuple, list[str]]] = []
        for model in args.models.split(","):
            hf_dir, ct2_dir = REPO / "models" / model, REPO / ".cache" / "ct2" / model
            for dtype in args.dtypes.split(","):
                fw_type = {"f32": "float32", "bf16": "bfloat16"}[dtype]
                commands = {
                    "whisper-cli": [
                        str(REPO / ".venv/bin/whisper-cli"),
                        "transcribe",
                        str(wav),
                        "--model",
                        str(hf_dir),
                        "--dtype",
                        dtype,
                        "-q",
                        *(["--language", "en"] if model != "tiny.en" else []),
                    ],
                    "transformers": [
                        sys.executable,
                        "-c",
                        TRANSFORMERS,
                        str(hf_dir),
                        dtype,
                        str(wav),
                    ],
                }
                # CTranslate2 has no bfloat16 compute on CPU: faster-whisper runs f32 only.
                if args.fw_python and dtype == "f32":
                    commands["fw-batched"] = [
                        args.fw_python,
                        "-c",
                        FW_BATCHED,
                        str(ct2_dir),
                        fw_type,
                        str(wav),
                    ]
                    commands["fw-sequential"] = [
                        args.fw_python,
                        "-c",
                        FW_SEQUENTIAL,
                        str(ct2_dir),
                        fw_type,
                        str(wav),
                    ]
                for name, cmd in commands.items():
                    if name in args.only.split(","):
                        runs.append(((name, model, dtype), cmd))
        # Round-robin: repeat r of every run before repeat r + 1 of any, so that a slow
        # spell of a shared machine lands on all rows alike rather than on one.
        walls: dict[tuple, list[float]] = {key: [] for key, _ in runs}
        texts: dict[tuple, str] = {}
        for _ in range(args.repeats):
            for key, cmd in runs:
                wall, texts[key] = timed(cmd)
                walls[key].append(wall)
                print(f"{key}: {wall:.1f} s", file=sys.stderr, flush=True)
        for (name, model, dtype), _ in runs:
            key = (name, model, dtype)
            row = {
                "impl": name,
                "model": model,
                "dtype": dtype,
                "wall_s": round(statistics.median(walls[key]), 1),
                "walls": [round(w, 1) for w in walls[key]],
                "rtfx": round(seconds / statistics.median(walls[key]), 1),
                "wer": round(100 * wer(reference, texts[key]), 2),
                "words": len(texts[key].split()),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        print(f"reference words: {len(reference.split())}", file=sys.stderr)
    print("| impl | model | dtype | wall s (median) | RTFx | WER % | words |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['impl']} | {r['model']} | {r['dtype']} | {r['wall_s']} | {r['rtfx']} "
            f"| {r['wer']} | {r['words']} |"
        )


if __name__ == "__main__":
    main()
