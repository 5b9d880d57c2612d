"""Where transcripts go: stdout or files in an output directory, in one or more formats."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from whisper_cli.errors import WhisperCliError
from whisper_cli.formats import FORMATS, SubtitleOptions, output_path, render, write_atomic
from whisper_cli.results import Transcript

STREAMABLE = ("txt", "jsonl")  # formats that concatenate cleanly on stdout


@dataclass(frozen=True)
class OutputPlan:
    formats: tuple[str, ...]
    output_dir: Path | None
    multiple_inputs: bool
    subtitles: SubtitleOptions = field(default_factory=SubtitleOptions)  # word cues

    @classmethod
    def make(
        cls,
        fmt: str,
        output_dir: Path | None,
        n_inputs: int,
        subtitles: SubtitleOptions | None = None,
    ) -> OutputPlan:
        """Validate a --format / --output-dir combination (a usage error if impossible)."""
        formats = FORMATS if fmt == "all" else (fmt,)
        if fmt != "all" and fmt not in FORMATS:
            raise WhisperCliError(
                f"invalid format {fmt!r}; choose one of {', '.join(FORMATS)} or all"
            )
        if output_dir is not None and output_dir.exists() and not output_dir.is_dir():
            raise WhisperCliError(f"--output-dir {output_dir} exists and is not a directory")
        if output_dir is None:
            if fmt == "all":
                raise WhisperCliError("--format all writes several files: give --output-dir")
            if n_inputs > 1 and fmt not in STREAMABLE:
                raise WhisperCliError(
                    f"--format {fmt} for several inputs needs --output-dir "
                    f"(only {' and '.join(STREAMABLE)} can go to stdout together)"
                )
        return cls(formats, output_dir, n_inputs > 1, subtitles or SubtitleOptions())

    def paths(self, input_path: str) -> list[Path]:
        assert self.output_dir is not None
        return [output_path(self.output_dir, input_path, f) for f in self.formats]

    def check_distinct(self, input_paths: list[str]) -> None:
        """Refuse two inputs whose outputs share a name (a/x.wav and a/sub/x.mp3 -> x.txt).

        One would silently overwrite the other; naming the same file twice is harmless.
        """
        if self.output_dir is None:
            return
        seen: dict[Path, str] = {}
        for input_path in input_paths:
            target = self.paths(input_path)[0]
            other = seen.setdefault(target, input_path)
            if other != input_path and not _same_file(other, input_path):
                raise WhisperCliError(
                    f"{other} and {input_path} would both be written to "
                    f"{target.with_suffix('.*') if len(self.formats) > 1 else target}; "
                    "rename one or transcribe them in separate runs"
                )

    def is_done(self, input_path: str) -> bool:
        """All outputs of this input exist already (for --skip-existing)."""
        return self.output_dir is not None and all(p.exists() for p in self.paths(input_path))

    def emit(self, transcript: Transcript, stdout: TextIO) -> list[Path]:
        """Write one transcript; returns the files written (none when it went to stdout)."""
        if self.output_dir is None:
            fmt = self.formats[0]
            if fmt == "txt" and self.multiple_inputs:
                stdout.write(f"==> {transcript.path} <==\n")
            stdout.write(render(transcript, fmt, self.subtitles))
            stdout.flush()
            return []
        written = []
        for fmt, path in zip(self.formats, self.paths(transcript.path), strict=True):
            try:
                write_atomic(path, render(transcript, fmt, self.subtitles))
            except OSError as exc:  # unwritable directory, disk full: the run cannot go on
                raise WhisperCliError(f"cannot write {path}: {exc.strerror or exc}") from exc
            written.append(path)
        return written


def _same_file(a: str, b: str) -> bool:
    try:
        return Path(a).samefile(b)
    except OSError:  # missing (reported later as an input error) or stdin
        return False
