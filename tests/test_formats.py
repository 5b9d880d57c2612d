"""Behaviour of the output formats.

The SRT and WebVTT checks go through small strict parsers so that a structural slip
(numbering, timestamp syntax, blank lines, escaping) fails here and not in a player.
"""

from __future__ import annotations

import json
import re

import pytest
from util import jsonl_records

from whisper_cli.errors import WhisperCliError
from whisper_cli.formats import FORMATS, render
from whisper_cli.results import Segment, Transcript

# --- strict parsers ------------------------------------------------------------------------

Cue = tuple[int, int, str]  # start ms, end ms, text (lines joined by "\n")

_SRT_TIME = r"(\d{2,}):([0-5]\d):([0-5]\d),(\d{3})"
_VTT_TIME = r"(\d{2,}):([0-5]\d):([0-5]\d)\.(\d{3})"
_SRT_TIMING = re.compile(rf"{_SRT_TIME} --> {_SRT_TIME}")
_VTT_TIMING = re.compile(rf"{_VTT_TIME} --> {_VTT_TIME}")
_VTT_ENTITY = re.compile(r"&(amp|lt|gt);")


def _ms(hours: str, minutes: str, seconds: str, millis: str) -> int:
    return ((int(hours) * 60 + int(minutes)) * 60 + int(seconds)) * 1000 + int(millis)


def _parse_timing(pattern: re.Pattern[str], line: str) -> tuple[int, int]:
    match = pattern.fullmatch(line)
    assert match, f"bad timing line {line!r}"
    groups = match.groups()
    return _ms(*groups[:4]), _ms(*groups[4:])


def _blocks(body: str) -> list[list[str]]:
    """Cue blocks of a body that must be cues separated by exactly one blank line."""
    assert "\r" not in body
    assert body.endswith("\n") and not body.endswith("\n\n"), "one final newline, no garbage"
    blocks = [block.split("\n") for block in body[:-1].split("\n\n")]
    for block in blocks:
        # An empty first line means "\n\n\n" somewhere: more than one blank line.
        assert all(line.strip() for line in block), f"blank or whitespace line in {block!r}"
    return blocks


def parse_srt(content: str) -> list[Cue]:
    if content == "":
        return []
    cues = []
    for number, block in enumerate(_blocks(content), start=1):
        assert len(block) >= 3, f"cue needs number, timing and text: {block!r}"
        assert block[0] == str(number), f"cue number {block[0]!r}, expected {number}"
        start, end = _parse_timing(_SRT_TIMING, block[1])
        assert all("-->" not in line for line in block[2:])
        cues.append((start, end, "\n".join(block[2:])))
    return cues


def _vtt_unescape(line: str) -> str:
    assert "<" not in line and ">" not in line and "-->" not in line, line
    assert "&" not in _VTT_ENTITY.sub("", line), f"bare '&' in {line!r}"
    return line.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def parse_vtt(content: str) -> list[Cue]:
    if content == "WEBVTT\n":
        return []
    assert content.startswith("WEBVTT\n\n"), "header, then one blank line"
    cues = []
    for block in _blocks(content[len("WEBVTT\n\n") :]):
        assert len(block) >= 2, f"cue needs timing and text: {block!r}"
        start, end = _parse_timing(_VTT_TIMING, block[0])
        cues.append((start, end, "\n".join(_vtt_unescape(line) for line in block[1:])))
    return cues


def assert_monotonic(cues: list[Cue]) -> None:
    for start, end, _ in cues:
        assert 0 <= start <= end
    starts = [start for start, _, _ in cues]
    assert starts == sorted(starts)


# --- fixtures ------------------------------------------------------------------------------


def make_transcript(*segments: Segment, **fields: object) -> Transcript:
    values: dict = {
        "path": "talks/keynote.wav",
        "text": "".join(s.text for s in segments),
        "language": "en",
        "segments": segments,
        "duration": 4000.0,
    }
    values.update(fields)
    return Transcript(**values)


SAMPLE = make_transcript(
    Segment(0.0, 2.5, " Hello world.", (50364, 2425, 1002), -0.123456, 0.012345, 1.23456, "en"),
    Segment(2.5, 5.25, " Ça va? Ünïcödé ✓", (123, 456), -0.5, 0.1, 1.5, "fr"),
    Segment(3723.0456, 3725.5, " Past the hour.", (), -0.25, 0.0, 1.0, "en"),
    language_probability=0.987654321,
    model="openai/whisper-tiny",
    dtype="float16",
    timings={"load": 1.23456789, "decode": 0.5},
)
SAMPLE_TEXTS = ["Hello world.", "Ça va? Ünïcödé ✓", "Past the hour."]


def one_cue(fmt: str, start: float, end: float, text: str = "hi") -> Cue:
    parse = parse_srt if fmt == "srt" else parse_vtt
    cues = parse(render(make_transcript(Segment(start, end, text)), fmt))
    assert len(cues) == 1
    return cues[0]


def timing_line(fmt: str, start: float, end: float) -> str:
    """The raw timing line of a one-cue render, to check the exact text."""
    lines = render(make_transcript(Segment(start, end, "hi")), fmt).splitlines()
    return lines[1] if fmt == "srt" else lines[2]


# --- srt / vtt -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_subtitles_parse_strictly_and_round_trip(fmt: str) -> None:
    content = render(SAMPLE, fmt)
    cues = parse_srt(content) if fmt == "srt" else parse_vtt(content)
    assert_monotonic(cues)
    assert [text for _, _, text in cues] == SAMPLE_TEXTS
    assert [(start, end) for start, end, _ in cues] == [
        (0, 2500),
        (2500, 5250),
        (3723046, 3725500),
    ]


def test_srt_exact_layout() -> None:
    content = render(make_transcript(Segment(0, 1, " a"), Segment(1, 2.5, " b")), "srt")
    assert content == "1\n00:00:00,000 --> 00:00:01,000\na\n\n2\n00:00:01,000 --> 00:00:02,500\nb\n"


def test_vtt_exact_layout() -> None:
    content = render(make_transcript(Segment(0, 1, " a")), "vtt")
    assert content == "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\na\n"


@pytest.mark.parametrize(
    ("start", "srt_time", "vtt_time"),
    [
        (0.0, "00:00:00,000", "00:00:00.000"),
        (1.0004, "00:00:01,000", "00:00:01.000"),
        (1.0006, "00:00:01,001", "00:00:01.001"),
        (59.9996, "00:01:00,000", "00:01:00.000"),  # rounds up across the minute
        (3599.9996, "01:00:00,000", "01:00:00.000"),  # ... and across the hour
        (3723.0456, "01:02:03,046", "01:02:03.046"),
        (100 * 3600 + 0.5, "100:00:00,500", "100:00:00.500"),  # hours don't wrap at 99
    ],
)
def test_timestamps(start: float, srt_time: str, vtt_time: str) -> None:
    assert timing_line("srt", start, start) == f"{srt_time} --> {srt_time}"
    assert timing_line("vtt", start, start) == f"{vtt_time} --> {vtt_time}"


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_negative_and_non_finite_times_clamp_to_zero(fmt: str) -> None:
    assert one_cue(fmt, -1.5, -0.5)[:2] == (0, 0)
    assert one_cue(fmt, float("nan"), 1.0)[:2] == (0, 1000)


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_end_before_start_is_clamped(fmt: str) -> None:
    assert one_cue(fmt, 5.0, 4.0)[:2] == (5000, 5000)
    # Rounding alone must not invert a cue either.
    start, end, _ = one_cue(fmt, 1.0006, 1.0004)
    assert start <= end


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_empty_segments_skipped_and_numbering_consecutive(fmt: str) -> None:
    transcript = make_transcript(
        Segment(0, 1, " one"), Segment(1, 2, "   "), Segment(2, 3, ""), Segment(3, 4, " two")
    )
    content = render(transcript, fmt)
    cues = parse_srt(content) if fmt == "srt" else parse_vtt(content)
    assert [text for _, _, text in cues] == ["one", "two"]


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_blank_lines_inside_text_do_not_break_cues(fmt: str) -> None:
    transcript = make_transcript(Segment(0, 1, " first\n\n\nsecond \n"), Segment(1, 2, "next"))
    content = render(transcript, fmt)
    cues = parse_srt(content) if fmt == "srt" else parse_vtt(content)
    assert [text for _, _, text in cues] == ["first\nsecond", "next"]


def test_vtt_escapes_markup_and_arrows() -> None:
    text = "a < b && c > d --> e &amp;"
    content = render(make_transcript(Segment(0, 1, text)), "vtt")
    assert parse_vtt(content)[0][2] == text


def test_no_cues() -> None:
    empty = make_transcript()
    assert render(empty, "srt") == ""
    assert parse_srt(render(empty, "srt")) == []
    assert render(empty, "vtt") == "WEBVTT\n"
    assert parse_vtt(render(empty, "vtt")) == []


def test_strict_parsers_reject_malformed_input() -> None:
    bad_srt = [
        "2\n00:00:00,000 --> 00:00:01,000\na\n",  # numbering starts at 2
        "1\n00:00:00.000 --> 00:00:01,000\na\n",  # vtt decimal marker
        "1\n0:00:00,000 --> 00:00:01,000\na\n",  # one-digit hours
        "1\n00:00:00,000 -> 00:00:01,000\na\n",  # wrong separator
        "1\n00:00:00,000 --> 00:00:01,000\na\n\n\n2\n00:00:01,000 --> 00:00:02,000\nb\n",
        "1\n00:00:00,000 --> 00:00:01,000\na\n\n",  # trailing blank line
        "1\n00:00:00,000 --> 00:00:01,000\na",  # no final newline
        "1\n00:00:00,000 --> 00:00:01,000\n",  # no text
    ]
    for content in bad_srt:
        with pytest.raises(AssertionError):
            parse_srt(content)
    bad_vtt = [
        "00:00:00.000 --> 00:00:01.000\na\n",  # no header
        "WEBVTT\n00:00:00.000 --> 00:00:01.000\na\n",  # no blank line after header
        "WEBVTT\n\n00:00:00,000 --> 00:00:01.000\na\n",  # srt decimal marker
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\na <b\n",  # raw markup
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\na\n\ntrailing garbage\n",
    ]
    for content in bad_vtt:
        with pytest.raises(AssertionError):
            parse_vtt(content)


# --- json / jsonl --------------------------------------------------------------------------


def _strict_json(text: str) -> dict:
    def reject(constant: str) -> None:
        raise AssertionError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=reject)


def test_json_carries_every_field_rounded() -> None:
    content = render(SAMPLE, "json")
    assert content.startswith('{\n  "path"')  # pretty, indent 2
    assert "Ça va? Ünïcödé ✓" in content  # ensure_ascii=False
    data = _strict_json(content)
    assert data == {
        "path": "talks/keynote.wav",
        "text": SAMPLE.text,
        "language": "en",
        "language_probability": 0.9877,
        "duration": 4000.0,
        "model": "openai/whisper-tiny",
        "dtype": "float16",
        "timings": {"load": 1.235, "decode": 0.5},
        "warnings": [],
        "segments": [
            {
                "id": 0,
                "start": 0.0,
                "end": 2.5,
                "text": " Hello world.",
                "tokens": [50364, 2425, 1002],
                "avg_logprob": -0.1235,
                "no_speech_prob": 0.0123,
                "compression_ratio": 1.2346,
                "language": "en",
            },
            {
                "id": 1,
                "start": 2.5,
                "end": 5.25,
                "text": " Ça va? Ünïcödé ✓",
                "tokens": [123, 456],
                "avg_logprob": -0.5,
                "no_speech_prob": 0.1,
                "compression_ratio": 1.5,
                "language": "fr",
            },
            {
                "id": 2,
                "start": 3723.046,
                "end": 3725.5,
                "text": " Past the hour.",
                "tokens": [],
                "avg_logprob": -0.25,
                "no_speech_prob": 0.0,
                "compression_ratio": 1.0,
                "language": "en",
            },
        ],
    }


def test_jsonl_is_the_json_document_a_line_a_segment() -> None:
    content = render(SAMPLE, "jsonl")
    lines = content.splitlines()
    assert content.endswith("\n") and len(lines) == len(SAMPLE.segments) + 1
    kinds = [_strict_json(line)["type"] for line in lines]
    assert kinds == ["segment"] * len(SAMPLE.segments) + ["transcript"]
    assert all(_strict_json(line)["path"] == SAMPLE.path for line in lines)
    assert jsonl_records(content) == [_strict_json(render(SAMPLE, "json"))]


def test_json_non_finite_numbers_become_null() -> None:
    transcript = make_transcript(
        Segment(0, 1, "x", avg_logprob=float("-inf"), compression_ratio=float("nan")),
        language_probability=None,
        timings={"decode": float("inf")},
    )
    for fmt in ("json", "jsonl"):
        content = render(transcript, fmt)
        for line in content.splitlines() if fmt == "jsonl" else [content]:
            _strict_json(line)
        (data,) = jsonl_records(content) if fmt == "jsonl" else [_strict_json(content)]
        assert data["language_probability"] is None
        assert data["timings"] == {"decode": None}
        assert data["segments"][0]["avg_logprob"] is None
        assert data["segments"][0]["compression_ratio"] is None


def test_json_times_follow_the_subtitle_clamping() -> None:
    data = _strict_json(render(make_transcript(Segment(-0.2, -0.5, "x")), "json"))
    assert (data["segments"][0]["start"], data["segments"][0]["end"]) == (0.0, 0.0)


# --- tsv / txt -----------------------------------------------------------------------------


def test_tsv_header_and_integer_milliseconds() -> None:
    rows = [row.split("\t") for row in render(SAMPLE, "tsv").splitlines()]
    assert rows[0] == ["start", "end", "text"]
    assert rows[1:] == [
        ["0", "2500", "Hello world."],
        ["2500", "5250", "Ça va? Ünïcödé ✓"],
        ["3723046", "3725500", "Past the hour."],
    ]


def test_tsv_text_has_no_tabs_or_newlines() -> None:
    content = render(make_transcript(Segment(0, 1, " a\tb\nc\r\nd ")), "tsv")
    assert content == "start\tend\ttext\n0\t1000\ta b c d\n"


def test_tsv_empty_transcript_is_just_the_header() -> None:
    assert render(make_transcript(), "tsv") == "start\tend\ttext\n"


def test_txt_one_stripped_segment_per_line() -> None:
    assert render(SAMPLE, "txt") == "".join(f"{text}\n" for text in SAMPLE_TEXTS)


def test_txt_empty_transcript_is_empty() -> None:
    assert render(make_transcript(), "txt") == ""
    assert render(make_transcript(Segment(0, 1, "  ")), "txt") == ""


def test_txt_without_segments_falls_back_to_text() -> None:
    assert render(make_transcript(text=" just text "), "txt") == "just text\n"


# --- format names -------------------------------------------------------------------------


UNKNOWN_FORMATS = ["pdf", "SRT", "", ".srt"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_renders(fmt: str) -> None:
    assert isinstance(render(SAMPLE, fmt), str)


@pytest.mark.parametrize("fmt", UNKNOWN_FORMATS)
def test_unknown_format_is_a_usage_error(fmt: str) -> None:
    with pytest.raises(WhisperCliError) as info:
        render(SAMPLE, fmt)
    assert info.value.exit_code == 2
    for name in FORMATS:
        assert name in info.value.message
