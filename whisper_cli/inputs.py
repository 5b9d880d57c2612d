"""Expand the user's input arguments (files, directories, "-") into a list of inputs."""

from __future__ import annotations

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


def expand_inputs(args: list[str], recursive: bool = False) -> tuple[list[str], list[InputError]]:
    """Files as given (order kept), directories expanded to their audio files (sorted).

    A directory with no audio file is a per-input error; a missing path is left for the
    audio reader to report, so every problem with a file is worded in one place.
    """
    paths: list[str] = []
    errors: list[InputError] = []
    for arg in args:
        path = Path(arg)
        if arg != "-" and path.is_dir():
            pattern = "**/*" if recursive else "*"
            found = sorted(
                str(p)
                for p in path.glob(pattern)
                if p.is_file() and p.suffix.lower() in AUDIO_EXTENSIONS
            )
            if not found:
                hint = "" if recursive else " (use --recursive for subdirectories)"
                errors.append(InputError(arg, f"directory contains no audio files{hint}"))
            paths.extend(found)
        else:
            paths.append(arg)
    return paths, errors
