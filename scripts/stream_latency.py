"""Time to first text and speech-to-text latency of `whisper-cli transcribe -` on a live feed.

Builds a feed of real speech (the ../shared/audio clips three times, 3 s apart, ~90 s),
writes it into the CLI's stdin at `--speed` times real time (as `ffmpeg -re` or a
recorder would), and reads stdout (jsonl) as it comes. For each clip: the time from its
last byte written to the last line of its text. Run it on a quiet machine:

    .venv/bin/python scripts/stream_latency.py --model models/tiny.en --latency auto 2 off
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import soundfile as sf

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "audio"
CLIPS = ("jfk.flac", "hotwords.mp3", "stereo_diarization.wav")
SR = 16000
GAP = 3.0
HEADER = 44  # bytes of a 16-bit PCM wav header


def build_feed() -> tuple[bytes, list[tuple[float, float]]]:
    from whisper_cli.audio import load_audio

    parts, spans, at = [], [], 0.0
    for _ in range(3):
        for name in CLIPS:
            clip = load_audio(SHARED / name)
            parts += [clip, np.zeros(round(GAP * SR), np.float32)]
            spans.append((at, at + len(clip) / SR))
            at += len(clip) / SR + GAP
    out = io.BytesIO()
    sf.write(out, np.concatenate(parts), SR, format="WAV", subtype="PCM_16")
    return out.getvalue(), spans


def run(data: bytes, spans, model: str, latency: str, speed: float) -> dict:
    command = [str(REPO / ".venv/bin/whisper-cli"), "transcribe", "-", "-m", model, "-f", "jsonl"]
    command += ["-q", "--latency", latency]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO)
    started = time.monotonic()
    written: list[tuple[float, int]] = []

    def feed() -> None:
        for start in range(0, len(data), 3200):
            proc.stdin.write(data[start : start + 3200])
            proc.stdin.flush()
            written.append((time.monotonic() - started, start + 3200))
            ahead = (start + 3200) / (2 * SR * speed) - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)
        proc.stdin.close()

    feeder = threading.Thread(target=feed)
    feeder.start()
    lines = [(time.monotonic() - started, json.loads(raw)) for raw in proc.stdout]
    proc.wait()
    feeder.join()
    segments = [(t, item) for t, item in lines if item["type"] == "segment"]
    gaps = []
    for start, end in spans:
        shown = [t for t, s in segments if start - 1.0 <= s["start"] < end]
        done = next(t for t, n in written if n >= HEADER + end * 2 * SR)
        gaps.append(round(max(shown) - done, 2) if shown else None)
    return {
        "latency": latency,
        "speed": speed,
        "feed_s": round(written[-1][0], 2),
        "first_text_s": round(segments[0][0], 2) if segments else None,
        "end_s": round(lines[-1][0], 2),
        "speech_to_text_s": gaps,
        "text": lines[-1][1]["text"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny.en")
    parser.add_argument("--speed", type=float, default=4.0)
    parser.add_argument("--latency", nargs="+", default=["auto", "2", "off"])
    args = parser.parse_args()
    data, spans = build_feed()
    for latency in args.latency:
        print(json.dumps(run(data, spans, args.model, latency, args.speed)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
