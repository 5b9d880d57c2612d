#!/usr/bin/env python3
"""Fetch the demo clip: pyannote.audio's two-speaker sample and its transcript.

The wheel is downloaded with pip (``--no-deps``; never installed, never imported) into a
temporary directory, and only ``sample.wav`` and ``sample.stm`` are unzipped.

    python scripts/fetch_demo.py --out-dir .cache/demo

Idempotent: nothing is downloaded when both files are already in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import zipfile
from pathlib import Path

from fetch_models import pip_download, sha256_of  # this folder is on sys.path

REQUIREMENT = "pyannote-audio==4.0.7"
WHEEL = "pyannote_audio-4.0.7-py3-none-any.whl"
WHEEL_SHA256 = "852ea15c4d85bc34773e618267603ffca6a521669a74d33742692cc67fc700d6"
MEMBERS = {
    "pyannote/audio/sample/sample.wav": "sample.wav",
    "pyannote/audio/sample/sample.stm": "sample.stm",
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def download_wheel(dest: Path) -> Path:
    """pip-download the pinned wheel into ``dest`` and check its hash."""
    pip_download(REQUIREMENT, dest)
    path = dest / WHEEL
    actual = sha256_of(path) if path.is_file() else "nothing"
    if actual != WHEEL_SHA256:
        raise RuntimeError(f"{WHEEL}: sha256 {actual} does not match the pinned {WHEEL_SHA256}")
    return path


def extract(wheel: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        for member, name in MEMBERS.items():
            target = out_dir / name
            partial = target.with_name(target.name + ".partial")
            partial.write_bytes(archive.read(member))
            os.replace(partial, target)  # never leave a half-written sample behind
            log(f"wrote {target}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path(".cache/demo"))
    args = parser.parse_args(argv)
    if all((args.out_dir / name).is_file() for name in MEMBERS.values()):
        log(f"demo files already in {args.out_dir}, skipped")
        return 0
    log(f"downloading {REQUIREMENT} ...")
    try:
        with tempfile.TemporaryDirectory(prefix="whisper-cli-demo-") as tmp:
            extract(download_wheel(Path(tmp)), args.out_dir)
    except (RuntimeError, OSError, KeyError, zipfile.BadZipFile) as e:
        log(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
