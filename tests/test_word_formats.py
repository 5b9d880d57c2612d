"""Word-timed outputs: json/jsonl words, and subtitle cues cut as openai-whisper cuts them.

openai-whisper's own SRT writer is the reference for --max-line-width, --max-line-count,
--max-words-per-line and --highlight-words: the same transcript must give the same cues.
"""

from __future__ import annotations

import io
import json

import pytest
from test_formats import assert_monotonic, make_transcript, parse_srt, parse_vtt
from util import jsonl_records

from whisper_cli.errors import WhisperCliError
from whisper_cli.formats import SubtitleOptions, render
from whisper_cli.results import Segment, Word


def segment(*words: tuple[str, float, float]) -> Segment:
    ws = tuple(Word(w, s, e, 0.876543) for w, s, e in words)
    return Segment(ws[0].start, ws[-1].end, "".join(w.word for w in ws), words=ws)


TRANSCRIPT = make_transcript(
    segment((" And", 0.0, 0.5), (" so,", 0.5, 0.9), (" my", 1.0, 1.2), (" fellow", 1.2, 1.6)),
    segment((" Americans", 1.7, 2.3), (" ask", 2.4, 2.8), (" not", 2.8, 3.1)),
    # after a pause of more than 3 s
    segment(
        (" what", 7.0, 7.3),
        (" your", 7.3, 7.5),
        (" country", 7.5, 8.0),
        (" can", 8.1, 8.3),
        (" do", 8.3, 8.5),
        (" for", 8.5, 8.7),
        (" you.", 8.7, 9.2),
    ),
)
WORDS = [w.word.strip() for s in TRANSCRIPT.segments for w in s.words]

CASES = [
    SubtitleOptions(),
    SubtitleOptions(max_words_per_line=2),
    SubtitleOptions(max_line_width=12),
    SubtitleOptions(max_line_width=12, max_line_count=2),
    SubtitleOptions(max_line_width=20, max_line_count=1),
    SubtitleOptions(max_line_width=12, max_line_count=2, highlight_words=True),
    SubtitleOptions(max_words_per_line=3, highlight_words=True),
]


def reference_srt(options: SubtitleOptions) -> str:
    from whisper.utils import WriteSRT

    result = {
        "segments": [
            {
                "start": s.start,
                "end": s.end,
                "text": s.text,
                "words": [vars(w) for w in s.words],
            }
            for s in TRANSCRIPT.segments
        ]
    }
    out = io.StringIO()
    WriteSRT(".").write_result(result, out, vars(options))
    return out.getvalue().rstrip("\n") + "\n"


@pytest.mark.parametrize("options", CASES, ids=lambda o: repr(o)[16:-1] or "default")
def test_cues_are_cut_as_openai_whisper_cuts_them(options):
    ours = parse_srt(render(TRANSCRIPT, "srt", options))
    assert ours == parse_srt(reference_srt(options))
    assert_monotonic(ours)


@pytest.mark.parametrize("options", CASES[:5], ids=lambda o: repr(o)[16:-1] or "default")
def test_every_word_once_in_srt_vtt_and_tsv(options):
    for fmt, parse in (("srt", parse_srt), ("vtt", parse_vtt)):
        cues = parse(render(TRANSCRIPT, fmt, options))
        assert [w for _, _, text in cues for w in text.split()] == WORDS
        if options.max_line_width:
            assert all(
                len(line) <= options.max_line_width for _, _, t in cues for line in t.split("\n")
            )
        if options.max_line_count:
            assert all(len(t.split("\n")) <= options.max_line_count for _, _, t in cues)
    rows = render(TRANSCRIPT, "tsv", options).splitlines()[1:]
    assert [w for row in rows for w in row.split("\t")[2].split()] == WORDS
    assert len(rows) == len(parse_srt(render(TRANSCRIPT, "srt", options)))


def test_highlighted_vtt_escapes_text_but_not_the_underline():
    transcript = make_transcript(segment((" a<b", 0.0, 0.5), (" &c", 0.6, 1.0)))
    content = render(transcript, "vtt", SubtitleOptions(highlight_words=True))
    assert "<u>a&lt;b</u> &amp;c" in content
    assert "a&lt;b <u>&amp;c</u>" in content
    assert "00:00:00.500 --> 00:00:00.600\na&lt;b &amp;c" in content  # the gap, plain


def test_json_and_jsonl_carry_the_words():
    for fmt in ("json", "jsonl"):
        content = render(TRANSCRIPT, fmt)
        (data,) = jsonl_records(content) if fmt == "jsonl" else [json.loads(content)]
        assert data["segments"][0]["words"][1] == {
            "word": " so,",
            "start": 0.5,
            "end": 0.9,
            "probability": 0.8765,
        }
        assert [w["word"].strip() for s in data["segments"] for w in s["words"]] == WORDS


def test_json_has_no_words_key_without_word_timestamps():
    data = json.loads(render(make_transcript(Segment(0.0, 1.0, " hi")), "json"))
    assert "words" not in data["segments"][0]


def test_segments_without_words_render_as_before():
    plain = make_transcript(Segment(0.0, 1.0, " one two three four"))
    assert render(plain, "srt", SubtitleOptions(max_words_per_line=2)) == render(plain, "srt")


def test_word_options_without_word_timestamps_are_a_usage_error():
    with pytest.raises(WhisperCliError, match="need --word-timestamps") as info:
        SubtitleOptions(max_words_per_line=3).check(word_timestamps=False)
    assert info.value.exit_code == 2
    SubtitleOptions().check(word_timestamps=False)
    with pytest.warns(UserWarning, match="no effect without --max-line-width"):
        SubtitleOptions(max_line_count=2).check(word_timestamps=True)
