"""Peak memory of a whole `whisper-cli transcribe` run on a generated 1-hour file.

jfk.flac plus 1 s of pause, tiled to 3600 s and written as FLAC block by block; the
CLI runs as a child process and its peak RSS is read from getrusage.

    python scripts/hour_memory.py --model models/tiny.en --dtype bf16
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

REPO = Path(__file__).resolve().parents[1]
JFK = REPO.parent / "shared" / "audio" / "jfk.flac"


def write_hour(path: Path) -> int:
    clip, rate = sf.read(JFK, dtype="float32", always_2d=True)
    unit = np.concatenate([soxr.resample(clip.mean(axis=1), rate, 16000), np.zeros(16000)]).astype(
        np.float32
    )
    written = 0
    with sf.SoundFile(path, "w", 16000, 1, format="FLAC") as f:
        while written < 3600 * 16000:
            f.write(unit)
            written += len(unit)
    return written // len(unit)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="models/tiny.en")
    parser.add_argument("--dtype", default="bf16")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hour.flac"
        repeats = write_hour(path)
        cli = [str(REPO / ".venv/bin/whisper-cli"), "transcribe", str(path), "-q"]
        started = time.perf_counter()
        done = subprocess.run(
            [*cli, "--model", args.model, "--dtype", args.dtype],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
        )
        wall = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    words = len(done.stdout.split())
    print(
        f"{args.model} {args.dtype}: wall {wall:.0f} s, peak RSS {peak:.0f} MiB, "
        f"{words} words for {repeats} x jfk.flac ({repeats * 22} reference words)"
    )


if __name__ == "__main__":
    main()
