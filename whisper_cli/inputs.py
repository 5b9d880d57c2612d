"""Expand the user's input arguments (files, directories, "-") into a list of inputs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from whisper_cli.errors import InputError

AUDIO_EXTENSIONS = frozenset(
    [
        ".wav",
        ".flac",
        ".ogg",
        ".oga",
        ".mp3",
        ".m4a",
        ".aac",
        ".opus",
        ".webm",
        ".mp4",
        ".mkv",
        ".mka",
        ".mov",
        ".wma",
        ".aif",
        ".aiff",
        ".caf",
        ".amr",
        ".3gp",
    ]
)


@dataclass(frozen=True)
class InputFile:
    """One input to transcribe."""

    path: str  # as the user named it, or as found below a directory argument
    # Where its outputs go below --output-dir: with --recursive, its folder relative to the
    # directory argument it was found in (the tree is mirrored); else directly in it.
    subdir: Path = Path()


@dataclass(frozen=True)
class Expanded:
    files: list[InputFile]
    errors: list[InputError]
    duplicates: list[str] = field(default_factory=list)  # named again; transcribed once


def expand_inputs(args: list[str], recursive: bool = False) -> Expanded:
    """Files as given (order kept), directories expanded to their audio files (sorted).

    A directory with no audio file is a per-input error; a missing path is left for the
    audio reader to report, so every problem with a file is worded in one place. A path
    named twice (also as ./x.wav and x.wav, or a file and its directory) is kept once;
    two names of one file (links) are two inputs, as they have two outputs.
    """
    files: list[InputFile] = []
    errors: list[InputError] = []
    duplicates: list[str] = []
    seen: set[str] = set()

    def add(path: str, subdir: Path = Path()) -> None:
        key = path if path == "-" else os.path.abspath(path)
        if key in seen:
            duplicates.append(path)
            return
        seen.add(key)
        files.append(InputFile(path, subdir))

    for arg in args:
        path = Path(arg)
        if arg != "-" and path.is_dir():
            pattern = "**/*" if recursive else "*"
            found = sorted(
                p
                for p in path.glob(pattern)
                if p.is_file() and p.suffix.lower() in AUDIO_EXTENSIONS
            )
            if not found:
                hint = "" if recursive else " (use --recursive for subdirectories)"
                errors.append(InputError(arg, f"directory contains no audio files{hint}"))
            for p in found:
                add(str(p), p.parent.relative_to(path) if recursive else Path())
        else:
            add(arg)
    return Expanded(files, errors, duplicates)
