"""Where transcripts go: stdout or files in an output directory, in one or more formats.

A run's outputs stream (OutputStream): each input's segments are rendered as soon as the
pipeline says they are final, to stdout at once (inputs one after another, in the order
given: a later input's text waits for the one before it to end) or into temp files that
become the outputs when their input ends. What streams is, piece for piece, what the
whole transcript renders to (formats.render_chunks); json, one document, comes at the end.

Every file is written atomically (AtomicFile, write_atomic): readers, and a run that
resumes, see an output whole or not at all, with the mode a plain open() would give it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import TextIO

from whisper_cli.errors import WhisperCliError
from whisper_cli.formats import ALL, SubtitleOptions, formats_of, render_chunks
from whisper_cli.inputs import InputFile
from whisper_cli.results import Segment, Transcript

STREAMABLE = ("txt", "jsonl")  # formats that concatenate cleanly on stdout


@dataclass(frozen=True)
class OutputPlan:
    formats: tuple[str, ...]
    output_dir: Path | None
    multiple_inputs: bool
    # Each input's outputs below output_dir, before the format's extension: its stem, in
    # its folder of a mirrored tree (transcribe --recursive, batch). Inputs not named
    # here take their stem, directly in output_dir.
    names: dict[str, PurePath] = field(default_factory=dict)
    # Folders prepare() created, so that a run that fails before writing leaves none.
    created: list[Path] = field(default_factory=list)
    subtitles: SubtitleOptions = field(default_factory=SubtitleOptions)  # word cues

    @classmethod
    def make(
        cls,
        fmt: str,
        output_dir: Path | None,
        inputs: list[InputFile],
        n_inputs: int,
        subtitles: SubtitleOptions | None = None,
        names: Mapping[str, str] | None = None,
    ) -> OutputPlan:
        """Validate a --format / --output-dir combination (a usage error if impossible).

        ``n_inputs`` counts every input argument, also those that already failed.
        ``names``: outputs the caller names (input path -> relative name, no extension).
        """
        formats = formats_of(fmt)
        if output_dir is not None and output_dir.exists() and not output_dir.is_dir():
            raise WhisperCliError(f"--output-dir {output_dir} exists and is not a directory")
        if output_dir is None:
            if fmt == ALL:
                raise WhisperCliError("--format all writes several files: give --output-dir")
            if n_inputs > 1 and fmt not in STREAMABLE:
                raise WhisperCliError(
                    f"--format {fmt} for several inputs needs --output-dir "
                    f"(only {' and '.join(STREAMABLE)} can go to stdout together)"
                )
        plan = cls(formats, output_dir, n_inputs > 1, subtitles=subtitles or SubtitleOptions())
        found = {i.path: (i.subdir / output_stem(i.path)).as_posix() for i in inputs}
        return plan.with_names(found | dict(names or {}))

    def with_names(self, names: Mapping[str, str]) -> OutputPlan:
        """This plan with these names of outputs, in place of its own (see ``names``)."""
        return dataclasses.replace(self, names={p: PurePath(n) for p, n in names.items()})

    def paths(self, input_path: str) -> list[Path]:
        assert self.output_dir is not None
        name = self.names.get(input_path) or PurePath(output_stem(input_path))
        return [self.output_dir / name.parent / f"{name.name}.{f}" for f in self.formats]

    def check_distinct(self, input_paths: list[str]) -> None:
        """Refuse two inputs whose outputs share a name (a/x.wav and a/x.mp3 -> x.txt).

        One would silently overwrite the other.
        """
        if self.output_dir is None:
            return
        seen: dict[Path, str] = {}
        for input_path in input_paths:
            target = self.paths(input_path)[0]
            other = seen.setdefault(target, input_path)
            if other != input_path:
                raise WhisperCliError(
                    f"{other} and {input_path} would both be written to "
                    f"{target.with_suffix('.*') if len(self.formats) > 1 else target}; "
                    "rename one, or give each its own --output-dir"
                )

    def prepare(self) -> None:
        """Create every output folder and prove it takes a file: before any work starts.

        A read-only directory, a path under a regular file or a full disk is found here,
        not after the model has loaded and the first input has been decoded.
        """
        if self.output_dir is None:
            return
        for folder in dict.fromkeys(p.parent for i in self.names for p in self.paths(i)):
            missing = [d for d in (folder, *folder.parents) if not d.exists()][::-1]
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                self.remove_created()
                raise WhisperCliError(
                    f"cannot create output directory {folder}: {exc.strerror or exc}"
                ) from exc
            self.created.extend(missing)
            try:
                with tempfile.TemporaryFile(dir=folder, prefix=".whisper-cli-") as probe:
                    probe.write(b"\n")
                    probe.flush()
                    os.fsync(probe.fileno())
            except OSError as exc:
                self.remove_created()
                raise WhisperCliError(
                    f"cannot write to output directory {folder}: {exc.strerror or exc}"
                ) from exc

    def remove_created(self) -> None:
        """Remove the folders prepare() created that are still empty (deepest first): a
        run, or an input, that failed leaves no empty folder behind."""
        for folder in reversed(self.created):
            with contextlib.suppress(OSError):
                folder.rmdir()
        self.created.clear()

    def is_done(self, input_path: str) -> bool:
        """All outputs of this input exist already (for --skip-existing)."""
        return self.output_dir is not None and all(p.exists() for p in self.paths(input_path))

    def emit(self, transcript: Transcript, stdout: TextIO) -> list[Path]:
        """Write one whole transcript; returns the files written (none when it went to
        stdout).

        Writing to stdout lets OSError through (BrokenPipeError, a full disk): what they
        mean is the caller's to say.
        """
        stream = OutputStream(self, [transcript.path], lambda text: _write(stdout, text))
        try:
            return stream.finish(transcript)
        finally:
            stream.abort()  # after a failure: no temp file left (after success: none open)


def _write(stdout: TextIO, text: str) -> None:
    stdout.write(text)
    stdout.flush()


@dataclass
class _Open:
    """An input whose outputs are being written."""

    segments: list[Segment] = field(default_factory=list)
    pieces: dict[str, int] = field(default_factory=dict)  # format -> pieces rendered so far
    files: dict[str, AtomicFile] = field(default_factory=dict)
    held: list[str] = field(default_factory=list)  # stdout text not written yet
    announced: bool = False  # its "==> path <==" line is out (txt, several inputs)
    ended: bool = False


class OutputStream:
    """The outputs of one run, written as each input's segments become final."""

    def __init__(self, plan: OutputPlan, paths: list[str], stdout: Callable[[str], None]):
        """paths: the run's inputs, in the order stdout gives them; stdout(text) writes
        (and flushes)."""
        self.plan = plan
        self._stdout = stdout
        self._order = list(dict.fromkeys(paths))
        self._open: dict[str, _Open] = {}

    def segments(self, path: str, segments: tuple[Segment, ...]) -> None:
        """More final segments of an input, in order."""
        state = self._open.setdefault(path, _Open())
        state.segments.extend(segments)
        self._render(path, state, Transcript(path, "", None, tuple(state.segments), 0.0), False)

    def finish(self, transcript: Transcript) -> list[Path]:
        """An input's whole transcript (its segments begin with those given so far); the
        files written (none for stdout)."""
        state = self._open.setdefault(transcript.path, _Open())
        self._render(transcript.path, state, transcript, True)
        state.ended = True
        written = []
        # Commit in the plan's order, not the order the temp files were opened (json's
        # opens last, at the end): within a run, an input's last format on disk means
        # its others are committed (what an interrupted run's caller can count on).
        for out in (state.files[f] for f in self.plan.formats if f in state.files):
            try:
                out.commit()
            except OSError as exc:
                raise WhisperCliError(f"cannot write {out.path}: {exc.strerror or exc}") from exc
            written.append(out.path)
        state.files.clear()
        if self.plan.output_dir is None:
            self._flush_stdout()
        else:
            del self._open[transcript.path]
        return written

    def drop(self, path: str) -> None:
        """An input failed: its files are not written (what it sent to stdout is out)."""
        state = self._open.pop(path, None)
        for out in state.files.values() if state else ():
            out.discard()
        if path in self._order:
            self._order.remove(path)
            self._flush_stdout()

    def abort(self) -> None:
        """The run stops: no output of an unfinished input is left, not even a temp file."""
        for state in self._open.values():
            for out in state.files.values():
                out.discard()
            state.files.clear()

    def _render(self, path: str, state: _Open, transcript: Transcript, final: bool) -> None:
        plan = self.plan
        if plan.output_dir is None:
            targets: list[tuple[str, Path | None]] = [(plan.formats[0], None)]
        else:
            targets = list(zip(plan.formats, plan.paths(path), strict=True))
        for fmt, target in targets:
            pieces = render_chunks(transcript, fmt, plan.subtitles, final)
            new = "".join(pieces[state.pieces.get(fmt, 0) :])
            state.pieces[fmt] = len(pieces)
            if target is None:
                state.held.append(new)
                continue
            if not new:
                continue
            try:
                if fmt not in state.files:
                    state.files[fmt] = AtomicFile(target)
                state.files[fmt].write(new)
            except OSError as exc:  # unwritable directory, disk full: the run cannot go on
                raise WhisperCliError(f"cannot write {target}: {exc.strerror or exc}") from exc
        if plan.output_dir is None:
            self._flush_stdout()

    def _flush_stdout(self) -> None:
        """Write what the inputs at the head of the order have; pass those that ended."""
        header = self.plan.formats[0] == "txt" and self.plan.multiple_inputs
        while self._order and self._order[0] in self._open:
            path = self._order[0]
            state = self._open[path]
            text = "".join(state.held)
            state.held.clear()
            if header and not state.announced and (text or state.ended):
                text = f"==> {path} <==\n" + text
                state.announced = True
            if text:
                self._stdout(text)
            if not state.ended:
                return
            self._order.pop(0)
            del self._open[path]


# --- names and atomic files ----------------------------------------------------------------


def output_stem(input_path: str) -> str:
    """The name of an input's outputs, before the format's extension."""
    # A bare "/" or "." has no stem; name such outputs like stdin rather than ".txt".
    return "stdin" if input_path == "-" else Path(input_path).stem or "stdin"


def write_atomic(path: Path, content: str) -> None:
    """Write ``content`` (UTF-8) to ``path`` so readers only ever see the old or the whole new file.

    On any failure, Ctrl-C included, the temp file is removed and an existing target is
    left as it was.
    """
    out = AtomicFile(path)
    try:
        out.write(content)
        out.commit()
    except BaseException:
        out.discard()
        raise


class AtomicFile:
    """A file written piece by piece into a temp file beside ``path``, which becomes
    ``path`` at `commit` (readers see the old file or the whole new one, never a part);
    `discard` removes it, leaving an existing target as it was.

    The temp file lives in the target's directory because ``os.replace`` is only atomic
    within one filesystem.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._mode = _target_mode(self.path)
        self._file = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed by commit/discard
            "w",
            encoding="utf-8",
            newline="",  # keep "\n" as rendered on every platform
            dir=self.path.parent,
            prefix=f".{self.path.name}.",
            suffix=".tmp",
            delete=False,
        )

    def write(self, text: str) -> None:
        self._file.write(text)

    def commit(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        # NamedTemporaryFile creates 0600; give the output the mode a plain open() would.
        os.chmod(self._file.name, self._mode)
        os.replace(self._file.name, self.path)

    def discard(self) -> None:
        # Best effort: a failed unlink must not hide the error that led here.
        with contextlib.suppress(OSError):
            self._file.close()
        with contextlib.suppress(OSError):
            os.unlink(self._file.name)


def temp_files(path: Path) -> list[Path]:
    """Temp files of ``write_atomic(path, ...)`` left by a process killed while writing."""
    path = Path(path)
    return sorted(path.parent.glob(f"{glob.escape('.' + path.name)}.*.tmp"))


def _target_mode(path: Path) -> int:
    """Keep an existing file's permissions; otherwise use the umask default (like open())."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        return 0o666 & ~_current_umask()


def _current_umask() -> int:
    # The umask can only be read by setting it. Set the strictest value meanwhile so a
    # file another thread creates in that instant is never more open than intended.
    mask = os.umask(0o077)
    os.umask(mask)
    return mask
