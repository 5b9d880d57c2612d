"""Word timestamps on real speech: parity with openai-whisper, batching, dtypes, outputs.

The reference is openai-whisper's own `add_word_timestamps` (tests/reference_whisper.py)
run on the very same weights, log-mel, text tokens and segment times as ours, so that
what is compared is the alignment and the word rules alone.
"""

from __future__ import annotations

import difflib
import itertools
import json

import numpy as np
import pytest
import soundfile as sf
import torch
from reference_whisper import boundary_errors, reference_model, reference_words
from test_formats import assert_monotonic, parse_srt, parse_vtt
from typer.testing import CliRunner
from util import decode_mel, jsonl_records, real_model, shared_clip

from whisper_cli.audio import open_audio
from whisper_cli.decoding import DecodeOptions
from whisper_cli.dtypes import resolve_policy
from whisper_cli.engine import Engine
from whisper_cli.features import SAMPLE_RATE, batch_log_mel
from whisper_cli.loading import load_model
from whisper_cli.results import Segment
from whisper_cli.segments import attach_words, window_segments
from whisper_cli.timing import Aligner, AlignRow, WindowWords, WordTiming

# The shared English clips, each one window (multilingual.mp3: its English first 30 s).
ENGLISH = [
    ("jfk.flac", None),
    ("hotwords.mp3", None),
    ("stereo_diarization.wav", "left"),
    ("stereo_diarization.wav", "right"),
    ("multilingual.mp3", None),
]


def english_windows() -> list[np.ndarray]:
    windows = []
    for name, channel in ENGLISH:
        source = open_audio(str(shared_clip(name)), channel=channel)
        windows.append(np.concatenate(list(source.blocks()))[: 30 * SAMPLE_RATE])
    return windows


def all_words(transcript) -> list:
    return [w for s in transcript.segments for w in s.words]


# --- parity with openai-whisper ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["tiny_en", "base_model"])
def test_word_times_match_openai_whisper_on_the_same_tokens(model_name, request):
    """One batch of the English clips, aligned in one pass; the reference window by window."""
    loaded = request.getfixturevalue(model_name)
    windows = english_windows()
    mel = batch_log_mel(windows, len(windows), loaded.config.num_mel_bins, torch.device("cpu"))
    engine = Engine(loaded, DecodeOptions())
    language = "en" if loaded.tokenizer.is_multilingual else None
    decoded = decode_mel(engine, mel, [language] * len(windows))
    features, rows = decoded.features, decoded.rows
    segments = [
        window_segments(
            row.tokens,
            loaded.tokenizer,
            offset=0.0,
            duration=len(audio) / SAMPLE_RATE,
            avg_logprob=row.avg_logprob,
            no_speech_prob=row.no_speech_prob,
            language=language,
        )
        for row, audio in zip(rows, windows, strict=True)
    ]
    aligned = Aligner(loaded).align(
        features,
        [
            AlignRow(sum((s.tokens for s in segs), ()), len(audio), language)
            for segs, audio in zip(segments, windows, strict=True)
        ],
    )
    reference = reference_model(loaded)
    errors = []
    for segs, words, audio, window_mel in zip(segments, aligned, windows, mel, strict=True):
        ours = attach_words(segs, words, offset=0.0, last_speech=0.0)
        with torch.no_grad():
            theirs, their_segments = reference_words(
                reference, loaded, segs, window_mel, len(audio), 0.0, 0.0, "en"
            )
        errors.append(
            boundary_errors([(w.word, w.start, w.end) for s in ours for w in s.words], theirs)
        )
        # Segment times refined from the words, as the reference refines them.
        np.testing.assert_allclose([(s.start, s.end) for s in ours], their_segments, atol=0.1)
    errors = np.concatenate(errors)
    assert len(errors) > 2 * 100  # about 130 words
    within = {ms: float((errors <= ms / 1000 + 1e-9).mean()) for ms in (20, 50, 100)}
    summary = f"{model_name}: {len(errors)} boundaries, within {within}, worst {errors.max():.3f} s"
    print(summary)
    assert within[20] >= 0.95, summary
    assert errors.max() <= 0.1, summary


# --- the pipeline ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jfk_words(tiny_en):
    from whisper_cli.pipeline import TranscribeOptions, Transcriber

    return Transcriber(tiny_en, TranscribeOptions(word_timestamps=True)).transcribe(
        str(shared_clip("jfk.flac"))
    )


def test_jfk_americans_is_where_openai_whisper_puts_it(jfk_words):
    """openai-whisper's own test: "Americans" starts by 1.8 s and ends after it."""
    words = all_words(jfk_words)
    americans = next(w for w in words if "Americans" in w.word)
    assert americans.start <= 1.8 < americans.end


def test_jfk_words_are_monotonic_inside_their_segments(jfk_words):
    words = all_words(jfk_words)
    text = "".join(w.word for w in words)
    assert text.strip() == jfk_words.text
    for segment in jfk_words.segments:
        assert segment.words
        assert "".join(w.word for w in segment.words) == segment.text
        assert segment.words[0].start == segment.start
        for word in segment.words:
            assert segment.start <= word.start <= word.end <= segment.end
            assert 0.0 <= word.probability <= 1.0
    assert all(a.end <= b.start for a, b in itertools.pairwise(words))
    assert words[-1].end < jfk_words.duration  # 11.0 s


@pytest.fixture(scope="module")
def long_input(tmp_path_factory) -> str:
    """The English windows one after another (about 50 s): two windows of different lengths."""
    path = tmp_path_factory.mktemp("words") / "long.wav"
    sf.write(path, np.concatenate(english_windows()[:3] + english_windows()[4:]), SAMPLE_RATE)
    return str(path)


@pytest.fixture(scope="module")
def long_f32(tiny_en, long_input):
    """tiny.en f32 on the long input, batch size 16."""
    from whisper_cli.pipeline import TranscribeOptions, Transcriber

    return Transcriber(tiny_en, TranscribeOptions(word_timestamps=True)).transcribe(long_input)


def matched(a: list, b: list) -> list[tuple]:
    """Pairs of the same word in two transcripts (texts may differ slightly)."""
    words_a, words_b = [w.word for w in a], [w.word for w in b]
    matcher = difflib.SequenceMatcher(None, words_a, words_b, autojunk=False)
    return [
        (a[block.a + k], b[block.b + k])
        for block in matcher.get_matching_blocks()
        for k in range(block.size)
    ]


@pytest.mark.slow
def test_batch_of_one_and_of_sixteen_give_the_same_word_times(
    tiny_en, transcriber, long_input, long_f32
):
    one = transcriber(tiny_en, word_timestamps=True, batch_size=1).transcribe(long_input)
    windows = {round(s.start // 30) for s in long_f32.segments}
    assert len(windows) == 2  # batched together, rows of different lengths
    pairs = matched(all_words(one), all_words(long_f32))
    assert len(pairs) >= 0.95 * len(all_words(one)) > 100
    diffs = np.array([(abs(a.start - b.start), abs(a.end - b.end)) for a, b in pairs])
    assert diffs.max() <= 0.02


@pytest.mark.slow
def test_refilled_rows_get_the_same_words_as_batches(tiny_en, transcriber, long_input):
    """One row at a time, refilled as each finishes: the alignment pass runs over the
    run's rows in the order they entered (their cross K/V projected again, the decode's
    were overwritten), and every word comes out as with batches of one."""
    runs = {}
    for refill in (False, True):
        t = transcriber(tiny_en, word_timestamps=True, batch_size=1, refill=refill)
        runs[refill] = t.transcribe(long_input)
        assert (t.engine.counters.refills > 0) == refill
    batches, refilled = ([(w.word, w.start, w.end) for w in all_words(runs[r])] for r in (0, 1))
    assert len(batches) > 100
    assert refilled == batches


@pytest.mark.slow
def test_bf16_word_times_are_within_40_ms_of_f32(transcriber, long_input, long_f32):
    bf16 = load_model(str(real_model("tiny.en")), resolve_policy("bf16", "cpu"))
    ours = transcriber(bf16, word_timestamps=True).transcribe(long_input)
    pairs = matched(all_words(ours), all_words(long_f32))
    assert len(pairs) >= 0.9 * len(all_words(long_f32)) > 100
    diffs = np.array([(abs(a.start - b.start), abs(a.end - b.end)) for a, b in pairs]).ravel()
    assert (diffs <= 0.04 + 1e-9).mean() >= 0.95, np.percentile(diffs, [50, 95, 100])


def timings(*spec: tuple[str, int, float, float]) -> tuple[WordTiming, ...]:
    return tuple(WordTiming(w, tuple(range(n)), s, e, 0.9) for w, n, s, e in spec)


# --- outputs through the CLI -------------------------------------------------------------------


def transcribe(*args: str) -> str:
    result = CliRunner().invoke(app_module().app, ["transcribe", *args])
    assert result.exit_code == 0, (result.stderr, result.exception)
    return result.stdout


def app_module():
    import whisper_cli.cli

    return whisper_cli.cli


@pytest.mark.slow
@pytest.mark.usefixtures("cached_cli_models")
def test_subtitles_with_three_words_per_line_hold_every_word_once(long_input, tmp_path):
    """Every word once, in order, at most 3 a cue; the strict parsers accept the files."""
    model = str(real_model("tiny.en"))
    transcribe(
        long_input,
        "-m",
        model,
        "-q",
        "--word-timestamps",
        "--max-words-per-line",
        "3",
        "-f",
        "all",
        "-o",
        str(tmp_path),
    )
    data = json.loads((tmp_path / "long.json").read_text())
    words = [w["word"].strip() for s in data["segments"] for w in s["words"]]
    assert len(words) > 100
    for fmt, parse in (("srt", parse_srt), ("vtt", parse_vtt)):
        cues = parse((tmp_path / f"long.{fmt}").read_text())
        assert_monotonic(cues)
        assert all(len(text.split()) <= 3 for _, _, text in cues)
        assert [w for _, _, text in cues for w in text.split()] == words
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(cues))
    rows = (tmp_path / "long.tsv").read_text().splitlines()[1:]
    assert [w for row in rows for w in row.split("\t")[2].split()] == words


def test_a_word_cut_to_its_segment_time_stays_inside_the_segment():
    """The case of a French clip's last word " ?": it starts 0.18 s before the decoded
    segment end and runs far past it, so it is cut, but to the median duration (0.23 s),
    past that end: the segment ends with it. A first word cut likewise before the decoded
    start starts its segment."""
    segments = [Segment(156.0, 158.324, " oui ?", (1, 2))]
    window = WindowWords(timings((" oui", 1, 6.0, 6.3), (" ?", 1, 8.144, 9.2)), 0.23)
    (last,) = attach_words(segments, window, offset=150.0, last_speech=156.0)
    assert (last.words[-1].start, last.words[-1].end) == (158.144, 158.374)
    assert (last.start, last.end) == (156.0, 158.374)

    segments = [Segment(10.0, 11.0, " a b", (1, 2))]
    window = WindowWords(timings((" a", 1, 9.2, 10.1), (" b", 1, 10.1, 10.8)), 0.23)
    (first,) = attach_words(segments, window, offset=0.0, last_speech=9.9)
    assert (first.words[0].start, first.words[0].end) == (9.87, 10.1)
    assert (first.start, first.end) == (9.87, 10.8)


@pytest.mark.slow  # base on 70 s of speech, with words
@pytest.mark.usefixtures("cached_cli_models")
def test_every_word_lies_inside_its_segment_in_every_format(tmp_path):
    """Real speech in English (jfk.flac) and English then German (multilingual.mp3, the
    language detected per window): in json every word lies inside its segment, and every
    srt and vtt cue spans its segment's words exactly."""
    clips = [str(shared_clip(name)) for name in ("jfk.flac", "multilingual.mp3")]
    model = str(real_model("base"))
    transcribe(
        *clips,
        "-m",
        model,
        "-q",
        "--multilingual",
        "--word-timestamps",
        "-f",
        "all",
        "-o",
        str(tmp_path),
    )
    languages = set()
    for stem in ("jfk", "multilingual"):
        data = json.loads((tmp_path / f"{stem}.json").read_text())
        spans = []
        for segment in data["segments"]:
            languages.add(segment["language"])
            words = segment["words"]
            assert words, segment
            for word in words:
                assert segment["start"] <= word["start"] <= word["end"] <= segment["end"], (
                    segment["text"],
                    word,
                )
            assert (segment["start"], segment["end"]) == (words[0]["start"], words[-1]["end"])
            spans.append((round(segment["start"] * 1000), round(segment["end"] * 1000)))
        for fmt, parse in (("srt", parse_srt), ("vtt", parse_vtt)):
            cues = parse((tmp_path / f"{stem}.{fmt}").read_text())
            assert [(start, end) for start, end, _ in cues] == spans, fmt
    assert {"en", "de"} <= languages


@pytest.mark.usefixtures("cached_cli_models")
def test_json_words_carry_word_start_end_probability():
    out = transcribe(
        str(shared_clip("jfk.flac")),
        "-m",
        str(real_model("tiny.en")),
        "-q",
        "--word-timestamps",
        "-f",
        "jsonl",
    )
    (record,) = jsonl_records(out)
    for segment in record["segments"]:
        assert segment["words"]
        for word in segment["words"]:
            assert set(word) == {"word", "start", "end", "probability"}
            assert segment["start"] <= word["start"] <= word["end"] <= segment["end"]


def test_word_options_need_word_timestamps():
    result = CliRunner().invoke(
        app_module().app,
        [
            "transcribe",
            str(shared_clip("jfk.flac")),
            "-m",
            str(real_model("tiny.en")),
            "-f",
            "srt",
            "--max-words-per-line",
            "3",
        ],
    )
    assert result.exit_code == 2
    assert "need --word-timestamps" in result.stderr
    assert result.stdout == ""


def test_retained_and_reprojected_cross_attention_give_the_same_words(tiny_en):
    """The engine's pass reads the cross K/V its decode projected, of the whole batch,
    whether the eager decode kept every row or dropped finished ones; without them the
    aligner projects them again from the encoder output: the same words."""
    windows = english_windows()[:2]
    mel = batch_log_mel(windows, 3, tiny_en.config.num_mel_bins, torch.device("cpu"))
    results = []
    for shrink in (False, True):
        engine = Engine(tiny_en, DecodeOptions(max_new_tokens=48), shrink=shrink, words=True)
        decoded = decode_mel(engine, mel, [None] * 3)
        assert all(k.shape[0] == 3 for k, _ in decoded.cross)  # the whole batch
        eot = tiny_en.tokenizer.special.eot
        text = [
            AlignRow(tuple(t for t in r.tokens if t < eot), len(a))
            for r, a in zip(decoded.rows, windows, strict=False)
        ]
        results.append(engine.align(decoded, text))
    results.append(Aligner(tiny_en).align(decoded.features, text))
    assert results[0] == results[1] == results[2]
    assert all(len(w.words) > 5 for w in results[0])


def test_a_batch_is_aligned_before_the_engines_next_run(tiny_en):
    """A compiled engine refills its buffers at each run: an older batch cannot be aligned."""
    mel = batch_log_mel(english_windows()[:1], 1, tiny_en.config.num_mel_bins, torch.device("cpu"))
    engine = Engine(tiny_en, DecodeOptions(max_new_tokens=8), words=True)
    first = decode_mel(engine, mel, [None])
    decode_mel(engine, mel, [None])
    with pytest.raises(ValueError, match="before the engine's next run"):
        engine.align(first, [AlignRow((), 16000)])
