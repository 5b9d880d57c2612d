"""Render transcripts as txt, json, jsonl, srt, vtt or tsv: text from a transcript,
nothing written (outputs.py puts it on stdout or in files).

The registry at the end (_RENDERERS) is the one list of formats: FORMATS, --format's
choices (FORMAT_CHOICES) and every check of a format's name are read from it.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from whisper_cli.errors import EXIT_USAGE, WhisperCliError
from whisper_cli.results import Segment, Transcript, Word

ALL = "all"  # --format all: every format

_TIME_DECIMALS = 3  # millisecond resolution, the same as the subtitle formats
_SCORE_DECIMALS = 4  # log-probs, probabilities and ratios: enough to compare runs
_LINE_BREAKS = re.compile(r"\s*[\t\r\n\v\f\x1c-\x1e\x85\u2028\u2029]+\s*")


@dataclass(frozen=True)
class SubtitleOptions:
    """How srt, vtt and tsv cut word-timed transcripts into cues (openai-whisper's options).

    Without max_line_width and max_line_count both, each segment stays one cue (split
    every max_words_per_line words); with both, words fill lines of at most
    max_line_width characters, max_line_count lines a cue (a pause over 3 s starts a new
    one). highlight_words: srt and vtt repeat each cue once per word, that word underlined.
    Segments without words are rendered as they are.
    """

    max_line_width: int | None = None
    max_line_count: int | None = None
    max_words_per_line: int | None = None
    highlight_words: bool = False

    @property
    def any(self) -> bool:
        return self != SubtitleOptions()

    def check(self, word_timestamps: bool) -> None:
        """openai-whisper's rules: a usage error without word timestamps, no-effect warnings."""
        if self.any and not word_timestamps:
            raise WhisperCliError(
                "--max-line-width, --max-line-count, --max-words-per-line and "
                "--highlight-words need --word-timestamps",
                exit_code=EXIT_USAGE,
            )
        for name in ("max_line_width", "max_line_count", "max_words_per_line"):
            value = getattr(self, name)
            if value is not None and value < 1:
                flag = "--" + name.replace("_", "-")
                raise WhisperCliError(f"{flag} must be at least 1", exit_code=EXIT_USAGE)
        if self.max_line_count and not self.max_line_width:
            warnings.warn("--max-line-count has no effect without --max-line-width", stacklevel=2)
        if self.max_words_per_line and self.max_line_width:
            warnings.warn("--max-words-per-line has no effect with --max-line-width", stacklevel=2)


def render(transcript: Transcript, fmt: str, subtitles: SubtitleOptions | None = None) -> str:
    """Return ``transcript`` rendered in ``fmt`` (one of FORMATS)."""
    return "".join(render_chunks(transcript, fmt, subtitles))


def render_chunks(
    transcript: Transcript,
    fmt: str,
    subtitles: SubtitleOptions | None = None,
    final: bool = True,
) -> list[str]:
    """``transcript`` rendered in ``fmt`` as pieces (lines, cues) that join to render().

    final=False: ``transcript`` holds the segments so far of one still being written;
    only the pieces that later segments cannot change are returned, so they are a prefix
    of the pieces of any transcript whose segments begin with these (what streams).
    json, one document, has no piece before the end.
    """
    return _RENDERERS[_check_format(fmt)](transcript, subtitles or SubtitleOptions(), final)


def formats_of(choice: str) -> tuple[str, ...]:
    """The formats a --format choice writes: every one for "all", else the one it names
    (a usage error where it names none)."""
    if choice == ALL:
        return FORMATS
    if choice not in FORMATS:
        raise WhisperCliError(
            f"invalid format {choice!r}; choose one of {', '.join(FORMATS)} or {ALL}",
            exit_code=EXIT_USAGE,
        )
    return (choice,)


def _check_format(fmt: str) -> str:
    """``fmt`` if it is one format (a usage error naming them otherwise)."""
    if fmt not in FORMATS:
        raise WhisperCliError(
            f"unknown output format {fmt!r}; choose from: {', '.join(FORMATS)}",
            exit_code=EXIT_USAGE,
        )
    return fmt


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


Cue = tuple[int, int, list[str]]  # start ms, end ms, text lines


def _cues(
    transcript: Transcript,
    options: SubtitleOptions,
    escape: Callable[[str], str] = str,
    final: bool = True,
) -> Iterator[Cue]:
    """(start ms, end ms, escaped text lines) of every cue that has text to show; not
    final: the cues later segments cannot change (see render_chunks)."""
    if any(s.words for s in transcript.segments):
        yield from _word_cues(transcript.segments, options, escape, final)
        return
    for segment in transcript.segments:
        lines = _cue_lines(escape(segment.text))
        if lines:
            yield (*_span_ms(segment), lines)


def _word_groups(
    segments: tuple[Segment, ...], o: SubtitleOptions, final: bool = True
) -> Iterator[list[Word]]:
    """Words grouped into cues, openai-whisper's algorithm (SubtitlesWriter): a word's
    text here begins with "\n" where it starts a new line of its cue. Each group is
    closed by the word after it, so the last one may grow: not final, it is held back
    where cues run across segments (a segment's own cues close with it)."""
    preserve_segments = o.max_line_count is None or o.max_line_width is None
    max_width = o.max_line_width or 1000
    per_line = o.max_words_per_line or 1000
    line_len, line_count = 0, 1
    cue: list[Word] = []
    last = next((w.start for s in segments for w in s.words), segments[0].start)
    for segment in segments:
        for chunk in range(0, len(segment.words), per_line):
            for i, word in enumerate(segment.words[chunk : chunk + per_line]):
                long_pause = not preserve_segments and word.start - last > 3.0
                has_room = line_len + len(word.word) <= max_width
                seg_break = i == 0 and len(cue) > 0 and preserve_segments
                if line_len > 0 and has_room and not long_pause and not seg_break:
                    line_len += len(word.word)  # the line goes on
                else:
                    text = word.word.strip()
                    if (
                        cue
                        and o.max_line_count is not None
                        and (long_pause or line_count >= o.max_line_count)
                    ) or seg_break:
                        yield cue  # a new cue
                        cue, line_count = [], 1
                    elif line_len > 0:
                        line_count += 1  # a new line in this cue
                        text = "\n" + text
                    line_len = len(text.strip())
                    word = Word(text, word.start, word.end, word.probability)
                cue.append(word)
                last = word.start
    if cue and (final or preserve_segments):
        yield cue


def _word_cues(
    segments: tuple[Segment, ...],
    o: SubtitleOptions,
    escape: Callable[[str], str],
    final: bool = True,
) -> Iterator[Cue]:
    for cue in _word_groups(segments, o, final):
        texts = [escape(w.word) for w in cue]
        start, end = _to_ms(cue[0].start), max(_to_ms(cue[0].start), _to_ms(cue[-1].end))
        plain = _cue_lines("".join(texts))
        if not plain:
            continue
        if not o.highlight_words:
            yield start, end, plain
            continue
        # Each word in turn underlined over its own time; gaps between words show the
        # plain cue (openai-whisper's --highlight_words).
        last = start
        for i, word in enumerate(cue):
            w_start = max(_to_ms(word.start), last)
            w_end = max(_to_ms(word.end), w_start)
            if w_start > last:
                yield last, w_start, plain
            marked = [_underline(t) if j == i else t for j, t in enumerate(texts)]
            yield w_start, w_end, _cue_lines("".join(marked))
            last = w_end


def _underline(text: str) -> str:
    """<u>text</u>, leading whitespace (a space, a line break) kept outside the tag."""
    body = text.lstrip()
    return text[: len(text) - len(body)] + f"<u>{body}</u>" if body else text


# --- renderers: each returns the pieces of its format (see render_chunks) -----------------


def _render_txt(transcript: Transcript, _: SubtitleOptions, final: bool) -> list[str]:
    if transcript.segments:
        lines = [_single_line(s.text) for s in transcript.segments]
    else:
        lines = [_single_line(transcript.text)] if final else []
    return [f"{line}\n" for line in lines if line]


def _render_srt(transcript: Transcript, options: SubtitleOptions, final: bool) -> list[str]:
    # Cues are separated by a blank line: each after the first opens with it.
    return [
        f"{chr(10) * (number > 1)}{number}\n{_timestamp(start, ',')} --> "
        f"{_timestamp(end, ',')}\n" + "\n".join(lines) + "\n"
        for number, (start, end, lines) in enumerate(
            _cues(transcript, options, final=final), start=1
        )
    ]


def _vtt_escape(line: str) -> str:
    # WebVTT cue text treats "<" and "&" as markup, and "-->" may not appear in it at all;
    # escaping ">" too turns any "-->" into "--&gt;".
    return line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _render_vtt(transcript: Transcript, options: SubtitleOptions, final: bool) -> list[str]:
    cues = [
        f"\n{_timestamp(start, '.')} --> {_timestamp(end, '.')}\n" + "\n".join(lines) + "\n"
        for start, end, lines in _cues(transcript, options, _vtt_escape, final)
    ]
    return ["WEBVTT\n", *cues]


def _render_tsv(transcript: Transcript, options: SubtitleOptions, final: bool) -> list[str]:
    """One row per cue (per segment unless words were cut into cues); no highlighting."""
    rows = ["start\tend\ttext\n"]
    plain = SubtitleOptions(
        options.max_line_width, options.max_line_count, options.max_words_per_line
    )
    for start, end, lines in _cues(transcript, plain, final=final):
        text = _single_line(" ".join(lines))
        if text:
            rows.append(f"{start}\t{end}\t{text}\n")
    return rows


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


def _word_dict(word: Word) -> dict[str, Any]:
    return {
        "word": word.word,
        "start": _to_ms(word.start) / 1000,
        "end": max(_to_ms(word.start), _to_ms(word.end)) / 1000,
        "probability": _number(word.probability, _SCORE_DECIMALS),
    }


def _transcript_fields(transcript: Transcript) -> dict[str, Any]:
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
        "warnings": [{"code": w.code, "message": w.message} for w in transcript.warnings],
    }


def _segment_item(index: int, segment: Segment, words: bool) -> dict[str, Any]:
    item = _segment_dict(index, segment)
    if words:
        item["words"] = [_word_dict(w) for w in segment.words]
    return item


def _transcript_dict(transcript: Transcript) -> dict[str, Any]:
    words = any(s.words for s in transcript.segments)  # word timestamps were asked for
    return _transcript_fields(transcript) | {
        "segments": [_segment_item(i, s, words) for i, s in enumerate(transcript.segments)]
    }


def _json_line(data: dict[str, Any]) -> str:
    # allow_nan=False: the output must be valid JSON for any strict reader.
    return json.dumps(data, ensure_ascii=False, allow_nan=False) + "\n"


def _render_json(transcript: Transcript, _: SubtitleOptions, final: bool) -> list[str]:
    if not final:
        return []
    text = json.dumps(_transcript_dict(transcript), indent=2, ensure_ascii=False, allow_nan=False)
    return [text + "\n"]


def _render_jsonl(transcript: Transcript, _: SubtitleOptions, final: bool) -> list[str]:
    """A line per segment as it comes ("type": "segment", with its input's path), then a
    line for the whole input ("type": "transcript": its text, language, duration, ...)."""
    lines = [
        _json_line(
            {"type": "segment", "path": transcript.path, **_segment_item(i, s, bool(s.words))}
        )
        for i, s in enumerate(transcript.segments)
    ]
    if final:
        lines.append(_json_line({"type": "transcript", **_transcript_fields(transcript)}))
    return lines


# The registry of formats, in the order `--format all` writes them.
_RENDERERS: dict[str, Callable[[Transcript, SubtitleOptions, bool], list[str]]] = {
    "txt": _render_txt,
    "json": _render_json,
    "jsonl": _render_jsonl,
    "srt": _render_srt,
    "vtt": _render_vtt,
    "tsv": _render_tsv,
}
FORMATS = tuple(_RENDERERS)
FORMAT_CHOICES = (*FORMATS, ALL)  # what --format takes
