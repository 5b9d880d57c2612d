"""The transcription pipeline on real speech: long inputs, language switches, batching.

Texts are compared after Whisper's normalisers (EnglishTextNormalizer, or
BasicTextNormalizer for German) by word error rate, or by counting distinctive
phrases, so that a dropped or repeated utterance fails a test while punctuation and
casing do not. The helpers here are imported by test_cli.py too.
"""

from __future__ import annotations

import json
import re

import jiwer
import numpy as np
import pytest
import soundfile as sf
import torch
from typer.testing import CliRunner
from util import manifest, real_model, shared_clip
from whisper_normalizer.basic import BasicTextNormalizer
from whisper_normalizer.english import EnglishTextNormalizer

from whisper_cli import rules
from whisper_cli.audio import SAMPLE_RATE, load_audio, open_audio
from whisper_cli.cli import app
from whisper_cli.results import Segment
from whisper_cli.speech import FRAME_SECONDS
from whisper_cli.windows import cut_windows

ENGLISH = EnglishTextNormalizer()
BASIC = BasicTextNormalizer()

# Phrases that occur once in their clip's reference and in no other clip. They count
# utterances (dropped or repeated), so none starts with a word the models often vary
# ("ask" / "asked" in jfk).
PHRASES = {
    "jfk": ("not what your country can do for you", "my fellow americans"),
    "left": ("confused complaint against the wizard", "behind the curtain on the left"),
    "right": ("horizon seems extremely distant",),
    "licence": ("permission is hereby granted", "substantial portions of the software"),
}


# --- text helpers ----------------------------------------------------------------------------


def english(text: str) -> str:
    return " ".join(ENGLISH(text).split())


def wer(reference: str, hypothesis: str, normalise=ENGLISH) -> float:
    return jiwer.wer(
        " ".join(normalise(reference).split()), " ".join(normalise(hypothesis).split())
    )


def count_phrase(text: str, phrase: str) -> int:
    """Occurrences of `phrase` as whole words of the normalised `text`."""
    return f" {english(text)} ".count(f" {english(phrase)} ")


def clip(name: str) -> dict:
    return next(c for c in manifest()["clips"] if c["file"] == name)


def split_licence(reference: str) -> tuple[str, str]:
    """The English and the German part of multilingual.mp3's reference."""
    english_part, german_part = reference.split(" Jedem", 1)
    return english_part, "Jedem" + german_part


def assert_segments_sane(segments: tuple[Segment, ...] | list, duration: float) -> None:
    """Times inside the audio, each segment after the previous one (no overlap)."""
    assert segments
    previous_end = 0.0
    for s in segments:
        start, end = (s.start, s.end) if isinstance(s, Segment) else (s["start"], s["end"])
        assert 0.0 <= start <= end <= duration + 1e-3, (start, end, duration)
        assert start >= previous_end - 1e-3, f"segment at {start} overlaps one ending at {end}"
        previous_end = end


# --- 1. a language switch inside one input -------------------------------------------------


def _cli_json(args: list[str]) -> dict:
    result = CliRunner().invoke(app, ["transcribe", *args, "--format", "json", "--quiet"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    return json.loads(result.stdout)


@pytest.mark.slow
@pytest.mark.usefixtures("cached_cli_models")
def test_multilingual_switches_language_per_window() -> None:
    path = shared_clip("multilingual.mp3")
    model = str(real_model("base"))
    english_ref, german_ref = split_licence(clip("multilingual.mp3")["reference"])

    out = _cli_json([str(path), "--model", model, "--multilingual"])
    segments = out["segments"]
    assert_segments_sane(segments, 60.0)
    assert 59.0 <= out["duration"] <= 60.0
    languages = [s["language"] for s in segments]
    # English, then German: one switch, where the speaker switches (about 29.5 s in).
    switch = next(i for i, lang in enumerate(languages) if lang != "en")
    assert languages[switch:] == ["de"] * (len(languages) - switch), languages
    assert switch > 0
    assert 25.0 <= segments[switch]["start"] <= 35.0

    english_hyp = "".join(s["text"] for s in segments[:switch])
    german_hyp = "".join(s["text"] for s in segments[switch:])
    assert wer(english_ref, english_hyp) <= 0.05
    assert wer(german_ref, german_hyp, BASIC) <= 0.35
    # Every English sentence once, in order.
    positions = []
    for phrase in (
        "permission is hereby granted",
        "free of charge",
        "furnished to do so",
        "the above copyright notice",
        "substantial portions of the software",
    ):
        assert count_phrase(english_hyp, phrase) == 1, phrase
        positions.append(english(english_hyp).index(english(phrase)))
    assert positions == sorted(positions)

    # Without --multilingual the language is detected once per input: the German half
    # is then decoded as English (translated, roughly), which is what the flag prevents.
    once = _cli_json([str(path), "--model", model])
    assert {s["language"] for s in once["segments"]} == {"en"}
    assert once["language"] == "en"
    german_start = segments[switch]["start"] - 0.5
    german_once = "".join(s["text"] for s in once["segments"] if s["start"] >= german_start)
    assert wer(german_ref, german_once, BASIC) > 0.8


# --- 2. long-form: clips joined into minutes of audio ----------------------------------------

# (clip, seconds of silence after it): each clip three times, in varied orders, some joined
# with about a second of silence and some with none.
LONG_ORDER = [
    ("jfk", 1.0), ("left", 0.0), ("right", 1.0), ("licence", 0.0),
    ("right", 0.0), ("licence", 1.2), ("jfk", 0.0), ("left", 0.8),
    ("licence", 0.0), ("left", 0.0), ("jfk", 1.0), ("right", 0.0),
]  # fmt: skip


def _english_licence(audio: np.ndarray) -> np.ndarray:
    """The English first half of multilingual.mp3, cut in the silence that ends it."""
    hop = SAMPLE_RATE // 50
    first = 27 * SAMPLE_RATE
    frames = audio[first : 32 * SAMPLE_RATE]
    rms = np.sqrt(np.mean(frames[: len(frames) // hop * hop].reshape(-1, hop) ** 2, axis=1))
    quiet = np.flatnonzero(rms < 1e-3)
    assert len(quiet), "no pause between the English and the German part"
    cut = first + int(quiet[0]) * hop
    assert 28.0 <= cut / SAMPLE_RATE <= 30.0
    return audio[:cut]


@pytest.fixture(scope="module")
def long_form(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A 2.5-minute wav of the shared clips, the clips as wavs, and the reference text."""
    stereo = shared_clip("stereo_diarization.wav")
    clips = {
        "jfk": (load_audio(shared_clip("jfk.flac")), clip("jfk.flac")["reference"]),
        "left": (load_audio(stereo, "left"), clip("stereo_diarization.wav")["reference_left"]),
        "right": (load_audio(stereo, "right"), clip("stereo_diarization.wav")["reference_right"]),
        "licence": (
            _english_licence(load_audio(shared_clip("multilingual.mp3"))),
            split_licence(clip("multilingual.mp3")["reference"])[0],
        ),
    }
    out = tmp_path_factory.mktemp("longform")
    pieces = []
    for name, pause in LONG_ORDER:
        pieces += [clips[name][0], np.zeros(round(pause * SAMPLE_RATE), np.float32)]
    audio = np.concatenate(pieces)
    sf.write(out / "long.wav", audio, SAMPLE_RATE, subtype="FLOAT")
    for name, (samples, _) in clips.items():
        sf.write(out / f"{name}.wav", samples, SAMPLE_RATE, subtype="FLOAT")
    return {
        "path": out / "long.wav",
        "duration": len(audio) / SAMPLE_RATE,
        "clips": {name: out / f"{name}.wav" for name in clips},
        "reference": " ".join(clips[name][1] for name, _ in LONG_ORDER),
    }


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_en", "base_model"])
def test_long_form_matches_clips_on_their_own(
    model: str, long_form: dict, transcriber, request: pytest.FixtureRequest
) -> None:
    assert long_form["duration"] >= 120.0
    t = transcriber(request.getfixturevalue(model))
    result = t.transcribe(str(long_form["path"]))
    alone = {name: t.transcribe(str(path)).text for name, path in long_form["clips"].items()}
    per_clip = " ".join(alone[name] for name, _ in LONG_ORDER)

    reference = long_form["reference"]
    long_wer, clip_wer = wer(reference, result.text), wer(reference, per_clip)
    print(f"{model}: long-form WER {long_wer:.2%}, clips on their own {clip_wer:.2%}")
    assert long_wer <= clip_wer + 0.01
    # Nothing dropped, nothing repeated.
    for name, phrases in PHRASES.items():
        inserted = sum(1 for n, _ in LONG_ORDER if n == name)
        for phrase in phrases:
            assert count_phrase(reference, phrase) == inserted  # the phrase is distinctive
            assert count_phrase(result.text, phrase) == inserted, phrase
    ref_words, hyp_words = len(english(reference).split()), len(english(result.text).split())
    assert abs(hyp_words - ref_words) <= 0.02 * ref_words, (hyp_words, ref_words)
    assert_segments_sane(result.segments, long_form["duration"])
    assert result.duration == pytest.approx(long_form["duration"], abs=1e-3)


def test_speech_after_a_pause_is_not_lost(tiny_en, transcriber, tmp_path) -> None:
    """After a pause the model often ends a window early and what follows would be lost.

    The decoder may not end while the speech map holds speech after its latest timestamp:
    here the utterance after a 5 s pause (one window with it) is transcribed, and the
    window's text runs on to where the map's speech ends.
    """
    jfk = load_audio(shared_clip("jfk.flac"))
    left = load_audio(shared_clip("stereo_diarization.wav"), "left")
    path = tmp_path / "pause.wav"
    pause = np.zeros(5 * SAMPLE_RATE, np.float32)
    audio = np.concatenate([jfk, pause, left])
    sf.write(path, audio, SAMPLE_RATE, subtype="FLOAT")
    after_pause = "wizard who had vanished behind the curtain"

    t = transcriber(tiny_en)
    segments = t.transcribe(str(path)).segments
    assert t.counters.windows == 1
    assert "ask not what your country" in english(" ".join(s.text for s in segments))
    (late,) = [s for s in segments if after_pause in english(s.text)]
    assert late.start >= 16.0 - 0.5  # it starts after the pause, where it is

    # What the rule guarantees, whatever the model writes: the decode ended (at its latest
    # timestamp, the last segment's end) with less than min_speech_seconds of speech after
    # it, the first end_slack_seconds (cut_end_slack_seconds where the window's end cut its
    # speech off) of a stretch running on through it not counted (and a frame for the
    # rounding of 20 ms timestamps to 32 ms frames).
    (window,) = cut_windows([audio], t.detector, t.policy)
    speech_end = window.start + (np.flatnonzero(window.speech)[-1] + 1) * FRAME_SECONDS
    p = t.policy
    slack = p.cut_end_slack_seconds if window.cut_off else p.end_slack_seconds
    allowed = p.min_speech_seconds + slack + FRAME_SECONDS
    assert segments[-1].end >= speech_end - allowed, (segments[-1].end, speech_end)


def test_speech_after_timestamps_reads_the_map() -> None:
    speech = np.zeros(937, dtype=bool)  # 30 s of 32 ms frames
    speech[100:300] = True  # speech from 3.2 s to 9.6 s
    after = rules.speech_after_timestamps(speech, 1501, 0.25)
    per_second = 50  # timestamps are 20 ms apart
    assert after[0] and after[5 * per_second]
    assert after[round(9.3 * per_second)]  # 0.3 s of speech left
    assert not after[round(9.4 * per_second)]  # 0.2 s left: less than a word
    assert not after[10 * per_second :].any()
    assert not rules.speech_after_timestamps(np.zeros(937, bool), 1501, 0.25).any()
    assert not rules.speech_after_timestamps(np.zeros(0, bool), 1501, 0.25).any()
    # A slack forgives the start of a stretch running on through the timestamp, not the
    # speech after a pause: 9.1 s has 0.5 s left, 0.2 s past a 0.3 s slack.
    slack = rules.speech_after_timestamps(speech, 1501, 0.25, 0.3)
    assert after[round(9.1 * per_second)] and not slack[round(9.1 * per_second)]
    assert slack[round(8.9 * per_second)] and slack[round(2 * per_second)]

    # Each row of a batch's grid has its own slacks, for open text and for text that ends
    # a sentence (a window cut off has one, less), each in its bit.
    slacks = [(0.0, 0.3), (0.0, 0.0), (0.3, 0.3)]
    grid = rules.SpeechGrid.from_maps([speech] * 3, 1501, 0.25, slacks, "cpu")
    assert grid.after.dtype == torch.uint8
    bits = grid.after.numpy()
    for row, (open_slack, ended_slack) in enumerate(slacks):
        held_open = bits[row] & rules.HELD_OPEN != 0
        held_ended = bits[row] & rules.HELD_ENDED != 0
        np.testing.assert_array_equal(held_open, slack if open_slack else after)
        np.testing.assert_array_equal(held_ended, slack if ended_slack else after)


# --- 3. batching changes nothing -------------------------------------------------------------


def test_batch_size_does_not_change_results(tiny_en, transcriber) -> None:
    # Five 30 s windows of four inputs: several share a batch of 16.
    paths = [
        str(shared_clip(name))
        for name in ("jfk.flac", "multilingual.mp3", "hotwords.mp3", "stereo_diarization.wav")
    ]

    def run(batch_size: int, refill: bool = False) -> list[tuple]:
        results, errors = [], []
        t = transcriber(tiny_en, batch_size=batch_size, refill=refill)
        t.run(paths, results.append, errors.append)
        assert not errors
        assert (t.engine.counters.refills > 0) == (refill and batch_size == 1)
        return [(r.path, r.text, [(s.start, s.end, s.text) for s in r.segments]) for r in results]

    # One row at a time, in batches or refilled as each finishes (continuous batching,
    # fallbacks decoded ahead among them), and sixteen.
    one, refilled, sixteen = run(1), run(1, refill=True), run(16)
    assert sorted(one) == sorted(sixteen) == sorted(refilled)
    assert {path for path, _, _ in one} == set(paths)


# --- 5. containers libsndfile cannot read -----------------------------------------------------


def _encode(audio: np.ndarray, path, container: str, codec: str, rate: int) -> None:
    import av

    with av.open(str(path), "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        for start in range(0, len(audio), SAMPLE_RATE):
            frame = av.AudioFrame.from_ndarray(
                audio[None, start : start + SAMPLE_RATE], format="flt", layout="mono"
            )
            frame.sample_rate = SAMPLE_RATE
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)


@pytest.mark.parametrize(
    ("name", "container", "codec", "rate"),
    [("jfk.m4a", "ipod", "aac", 16000), ("jfk.webm", "webm", "libopus", 48000)],
)
def test_ffmpeg_only_formats_transcribe_like_flac(
    name: str, container: str, codec: str, rate: int, tmp_path, tiny_en, transcriber
) -> None:
    flac = shared_clip("jfk.flac")
    path = tmp_path / name
    _encode(load_audio(flac), path, container, codec, rate)
    assert open_audio(path).backend == "av"  # not something libsndfile reads

    t = transcriber(tiny_en)
    expected = t.transcribe(str(flac)).text
    result = t.transcribe(str(path))
    assert english(result.text) == english(expected)
    assert re.search(r"ask not what your country", english(result.text))
    assert result.duration == pytest.approx(11.0, abs=0.1)


@pytest.mark.slow
def test_refilled_rows_give_the_same_text(tiny_en, long_form, transcriber) -> None:
    """Continuous batching: with 2 rows at a time and 4 batches' windows a run, rows that
    finish take the next windows mid-decode. The text, segments, windows and fallbacks
    are those of batches decoded one after another, and the decode takes fewer steps."""
    on = transcriber(tiny_en, batch_size=2, refill=True)
    off = transcriber(tiny_en, batch_size=2, refill=False)
    refilled, plain = on.transcribe(str(long_form["path"])), off.transcribe(str(long_form["path"]))
    assert on.engine.counters.refills > 0 and off.engine.counters.refills == 0
    assert [(s.start, s.end, s.text) for s in refilled.segments] == [
        (s.start, s.end, s.text) for s in plain.segments
    ]
    assert (on.counters.windows, on.counters.fallbacks) == (
        off.counters.windows,
        off.counters.fallbacks,
    )
    assert on.engine.counters.steps < off.engine.counters.steps
