"""A window's end written again by the next window (judge.echoed_words), on real speech.

Two inputs of jfk.flac read on, each a stretch of speech longer than a window that the
cutter cuts in its longest pause (about 1.3 s: the window ends inside speech, cut_off):
- the echo: the pause falls after "ask not"; the first window's last segment is given
  "what your country can do for you." once more (what base with int8 weights wrote there,
  a near tie that no CPU reproduces on demand), and the pipeline must write those words
  once, where the next window hears them;
- a repetition: "what your country can do for you" said before the pause and again after
  it; both copies are heard, and both must stay.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import soundfile as sf
import soxr
from util import shared_clip

from whisper_cli import pipeline
from whisper_cli.options import Policy
from whisper_cli.results import Segment, Word
from whisper_cli.segments import without_last_words
from whisper_cli.speech import load_detector
from whisper_cli.windows import cut_windows

RATE = 16000
PHRASE = "what your country can do for you"
OFF = Policy(echo_min_words=10**6)  # no window end is ever taken for an echo


@pytest.fixture(scope="module")
def jfk() -> np.ndarray:
    audio, rate = sf.read(shared_clip("jfk.flac"), dtype="float32", always_2d=True)
    return soxr.resample(audio.mean(axis=1), rate, RATE).astype(np.float32)


def cut(jfk: np.ndarray, at: float) -> tuple[np.ndarray, np.ndarray]:
    return jfk[: int(at * RATE)], jfk[int(at * RATE) :]


def pause(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), np.float32)


def written(tmp_path, name: str, audio: np.ndarray) -> tuple[str, float]:
    """The input's path and where its first window ends (cut inside speech)."""
    path = tmp_path / f"{name}.wav"
    sf.write(path, audio, RATE, subtype="FLOAT")
    windows = list(cut_windows([audio], load_detector()))
    assert len(windows) >= 2 and windows[0].cut_off
    return str(path), windows[0].end


def normalised(text: str) -> list[str]:
    """Lower-case words, punctuation dropped."""
    return "".join(c.lower() if c.isalnum() else " " for c in text).split()


def count(words: list[str], phrase: str) -> int:
    p = phrase.split()
    return sum(words[i : i + len(p)] == p for i in range(len(words)))


@pytest.fixture(scope="module")
def echo_input(jfk, tmp_path_factory) -> tuple[str, float]:
    """jfk twice, "And so my fellow Americans, ask not", 0.3 s of silence, the rest of jfk
    ("what your country ..."), jfk once more: 44 s, the first window cut after "not"."""
    head, rest = cut(jfk, 4.9)  # "ask not" ends at 4.38 s, "what" begins at 5.41 s
    audio = np.concatenate([jfk, jfk, head, pause(0.3), rest, jfk])
    path, end = written(tmp_path_factory.mktemp("echo"), "echo", audio)
    assert 22.0 + 4.38 < end < 22.0 + 4.9 + 0.3 + 0.51
    return path, end


@pytest.fixture(scope="module")
def repeat_input(jfk, tmp_path_factory) -> tuple[str, float]:
    """jfk twice, "what your country can do for you", 0.8 s of silence, the same words
    again, jfk: 39 s, the first window cut between the two copies."""
    phrase = jfk[int(5.2 * RATE) : int(7.9 * RATE)]  # its speech: 5.41-7.65 s
    audio = np.concatenate([jfk, jfk, phrase, pause(0.8), phrase, jfk])
    path, end = written(tmp_path_factory.mktemp("repeat"), "repeat", audio)
    assert 22.0 + 2.45 < end < 22.0 + 2.7 + 0.8 + 0.21
    return path, end


def echoing(tokenizer, cut_at: float):
    """A judge that, like base with int8 weights, writes the next window's first words
    at the end of the window that ends at `cut_at` (its last segment, after "ask not")."""
    real = pipeline.judge

    def judge(window, attempts, *args, **kwargs):
        verdict = real(window, attempts, *args, **kwargs)
        if not verdict.final or abs(window.end - cut_at) > 1e-6 or not verdict.segments:
            return verdict
        last = verdict.segments[-1]
        assert normalised(last.text)[-2:] == ["ask", "not"]
        text = last.text.rstrip(".") + " " + PHRASE + "."
        echoed = replace(last, text=text, tokens=tuple(tokenizer.encode_text(text)))
        return replace(verdict, segments=(*verdict.segments[:-1], echoed))

    return judge


@pytest.mark.parametrize("words", [False, True], ids=["text", "word-timestamps"])
def test_words_written_past_a_cut_are_kept_once_where_they_are_heard(
    tiny_en, transcriber, echo_input, monkeypatch, words
) -> None:
    path, cut_at = echo_input
    plain = transcriber(tiny_en, word_timestamps=words).transcribe(path)
    monkeypatch.setattr(pipeline, "judge", echoing(tiny_en.tokenizer, cut_at))
    results, streamed = [], []
    transcriber(tiny_en, word_timestamps=words).run(
        [path], results.append, pytest.fail, on_segments=lambda _, s: streamed.extend(s)
    )
    kept = results[0]
    assert tuple(streamed) == kept.segments  # the held segment streams, trimmed, in order
    doubled = transcriber(tiny_en, word_timestamps=words, policy=OFF).transcribe(path)

    # The echo was written (without the rule it is in the text), and the rule took it out.
    assert count(normalised(plain.text), PHRASE) == 4
    assert count(normalised(doubled.text), PHRASE) == 5
    assert normalised(kept.text) == normalised(plain.text)
    assert [w.code for w in kept.warnings] == ["echo"]
    assert [w.code for w in plain.warnings] == []
    # The trimmed segment keeps its own time and, with words asked for, its own words.
    last = [s for s in kept.segments if s.start < cut_at][-1]
    assert normalised(last.text)[-2:] == ["ask", "not"] and last.end <= cut_at + 1e-3
    if words:
        assert "".join(w.word for w in last.words) == last.text
        assert last.end == last.words[-1].end
    else:
        assert last.words == ()


def test_words_said_on_both_sides_of_a_cut_stay(tiny_en, transcriber, repeat_input) -> None:
    """No word lost: both copies of a phrase said before and after the cut lie over
    speech, and both are written, with or without word timestamps."""
    path, _ = repeat_input
    for words in (False, True):
        on = transcriber(tiny_en, word_timestamps=words).transcribe(path)
        off = transcriber(tiny_en, word_timestamps=words, policy=OFF).transcribe(path)
        assert count(normalised(on.text), PHRASE) == 5  # jfk three times, the phrase twice
        assert on.text == off.text
        assert "echo" not in [w.code for w in on.warnings]


def test_dropping_the_last_words_drops_the_tokens_that_spell_them(tiny_en) -> None:
    tok = tiny_en.tokenizer
    text = " And so my fellow Americans, ask not what your country can do for you."
    words = tuple(Word(" " + w, float(i), float(i) + 0.5, 0.9) for i, w in enumerate(text.split()))
    segment = Segment(0.0, 14.0, text, tokens=tuple(tok.encode_text(text)), words=words)
    trimmed = without_last_words(segment, 7, tok)
    assert trimmed.text == " And so my fellow Americans, ask not"
    assert tok.decode(list(trimmed.tokens)) == trimmed.text
    assert trimmed.words == words[:7] and trimmed.end == words[6].end
    assert trimmed.start == 0.0
    assert without_last_words(segment, 0, tok) is segment
    assert without_last_words(segment, len(words), tok) is None
    # Words that no token boundary spells (a word planted over other tokens): unchanged.
    odd = replace(segment, words=(*words[:-1], Word(" them.", 13.0, 13.5, 0.9)))
    assert without_last_words(odd, 1, tok) is odd
