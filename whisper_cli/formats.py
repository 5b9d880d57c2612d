"""Render transcripts as txt, json, jsonl, srt, vtt or tsv, and write them atomically."""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from whisper_cli.errors import EXIT_USAGE, WhisperCliError
from whisper_cli.results import Segment, Transcript

FORMATS = ("txt", "json", "jsonl", "srt", "vtt", "tsv")

_TIME_DECIMALS = 3  # millisecond resolution, the same as the subtitle formats
_SCORE_DECIMALS = 4  # log-probs, probabilities and ratios: enough to compare runs
_LINE_BREAKS = re.compile(r"\s*[\t\r\n\v\f\x1c-\x1e\x85\u2028\u2029]+\s*")


def render(transcript: Transcript, fmt: str) -> str:
    """Return ``transcript`` rendered in ``fmt`` (one of FORMATS)."""
    return _RENDERERS[_check_format(fmt)](transcript)


def output_path(out_dir: Path, input_path: str, fmt: str) -> Path:
    """Where the ``fmt`` output for ``input_path`` goes: ``out_dir/<stem>.<fmt>``."""
    fmt = _check_format(fmt)
    # A bare "/" or "." has no stem; name such outputs like stdin rather than ".txt".
    stem = "stdin" if input_path == "-" else Path(input_path).stem or "stdin"
    return Path(out_dir) / f"{stem}.{fmt}"


def write_atomic(path: Path, content: str) -> None:
    """Write ``content`` (UTF-8) to ``path`` so readers only ever see the old or the whole new file.

    The temp file lives in the target's directory because ``os.replace`` is only atomic
    within one filesystem. On any failure, Ctrl-C included, the temp file is removed and
    an existing target is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = _target_mode(path)
    tmp_name: str | None = None
    try:
        with tempfile.NamedTemporaryFile(
            "w",
            encoding="utf-8",
            newline="",  # keep "\n" as rendered on every platform
            dir=path.parent,
            prefix=f".{path.name}.",
            suffix=".tmp",
            delete=False,
        ) as tmp:
            tmp_name = tmp.name
            tmp.write(content)
            tmp.flush()
            os.fsync(tmp.fileno())
        # NamedTemporaryFile creates 0600; give the output the mode a plain open() would.
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, path)
    except BaseException:
        if tmp_name is not None:
            # Best effort: a failed unlink must not hide the original error.
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
        raise


def temp_files(path: Path) -> list[Path]:
    """Temp files of ``write_atomic(path, ...)`` left by a process killed while writing."""
    path = Path(path)
    return sorted(path.parent.glob(f"{glob.escape('.' + path.name)}.*.tmp"))


# --- format checks and file helpers -------------------------------------------------------


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise WhisperCliError(
            f"unknown output format {fmt!r}; choose from: {', '.join(FORMATS)}",
            exit_code=EXIT_USAGE,
        )
    return fmt


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


# --- times and text ------------------------------------------------------------------------


def _to_ms(seconds: float) -> int:
    """Whole milliseconds, rounded like openai-whisper; negative or non-finite become 0."""
    if not math.isfinite(seconds) or seconds <= 0:
        return 0
    return round(seconds * 1000)


def _span_ms(segment: Segment) -> tuple[int, int]:
    """(start, end) in ms with end >= start, so no writer emits a cue that ends before it starts."""
    start = _to_ms(segment.start)
    return start, max(start, _to_ms(segment.end))


def _timestamp(ms: int, decimal_marker: str) -> str:
    # Hours are not wrapped at 99: a long recording must keep its true offsets.
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    seconds, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{decimal_marker}{ms:03d}"


def _single_line(text: str) -> str:
    """Text on one line: tabs and line breaks become single spaces (txt rows, tsv cells)."""
    return _LINE_BREAKS.sub(" ", text).strip()


def _cue_lines(text: str) -> list[str]:
    """Non-blank, stripped lines of a cue; a blank line inside a cue would end it early."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def _cues(transcript: Transcript) -> Iterator[tuple[int, int, list[str]]]:
    """(start ms, end ms, text lines) of each segment that has text to show."""
    for segment in transcript.segments:
        lines = _cue_lines(segment.text)
        if lines:
            yield (*_span_ms(segment), lines)


# --- renderers -----------------------------------------------------------------------------


def _render_txt(transcript: Transcript) -> str:
    if transcript.segments:
        lines = [_single_line(s.text) for s in transcript.segments]
    else:
        lines = [_single_line(transcript.text)]
    lines = [line for line in lines if line]
    return "".join(f"{line}\n" for line in lines)


def _render_srt(transcript: Transcript) -> str:
    cues = [
        f"{number}\n{_timestamp(start, ',')} --> {_timestamp(end, ',')}\n" + "\n".join(lines)
        for number, (start, end, lines) in enumerate(_cues(transcript), start=1)
    ]
    return "\n\n".join(cues) + "\n" if cues else ""


def _vtt_escape(line: str) -> str:
    # WebVTT cue text treats "<" and "&" as markup, and "-->" may not appear in it at all;
    # escaping ">" too turns any "-->" into "--&gt;".
    return line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _render_vtt(transcript: Transcript) -> str:
    cues = [
        f"{_timestamp(start, '.')} --> {_timestamp(end, '.')}\n"
        + "\n".join(_vtt_escape(line) for line in lines)
        for start, end, lines in _cues(transcript)
    ]
    return "WEBVTT\n\n" + "\n\n".join(cues) + "\n" if cues else "WEBVTT\n"


def _render_tsv(transcript: Transcript) -> str:
    rows = ["start\tend\ttext"]
    for segment in transcript.segments:
        text = _single_line(segment.text)
        if text:
            start, end = _span_ms(segment)
            rows.append(f"{start}\t{end}\t{text}")
    return "\n".join(rows) + "\n"


def _number(value: float | None, decimals: int) -> float | None:
    """Rounded float, or None where JSON has no number for it (NaN, ±inf)."""
    if value is None or not math.isfinite(value):
        return None
    return round(float(value), decimals)


def _segment_dict(index: int, segment: Segment) -> dict[str, Any]:
    start, end = _span_ms(segment)
    return {
        "id": index,
        "start": start / 1000,
        "end": end / 1000,
        "text": segment.text,
        "tokens": [int(token) for token in segment.tokens],
        "avg_logprob": _number(segment.avg_logprob, _SCORE_DECIMALS),
        "no_speech_prob": _number(segment.no_speech_prob, _SCORE_DECIMALS),
        "compression_ratio": _number(segment.compression_ratio, _SCORE_DECIMALS),
        "language": segment.language,
    }


def _transcript_dict(transcript: Transcript) -> dict[str, Any]:
    return {
        "path": transcript.path,
        "text": transcript.text,
        "language": transcript.language,
        "language_probability": _number(transcript.language_probability, _SCORE_DECIMALS),
        "duration": _number(transcript.duration, _TIME_DECIMALS),
        "model": transcript.model,
        "dtype": transcript.dtype,
        "timings": {
            name: _number(value, _TIME_DECIMALS) for name, value in transcript.timings.items()
        },
        "segments": [_segment_dict(i, s) for i, s in enumerate(transcript.segments)],
    }


def _render_json(transcript: Transcript) -> str:
    # allow_nan=False: the output must be valid JSON for any strict reader.
    text = json.dumps(_transcript_dict(transcript), indent=2, ensure_ascii=False, allow_nan=False)
    return text + "\n"


def _render_jsonl(transcript: Transcript) -> str:
    text = json.dumps(_transcript_dict(transcript), ensure_ascii=False, allow_nan=False)
    return text + "\n"


_RENDERERS: dict[str, Callable[[Transcript], str]] = {
    "txt": _render_txt,
    "json": _render_json,
    "jsonl": _render_jsonl,
    "srt": _render_srt,
    "vtt": _render_vtt,
    "tsv": _render_tsv,
}
