"""The word-timing machinery on its own: DTW, the median filter, words from tokens, rules.

DTW and the median filter are checked against planted answers and straightforward
reference code; the word rules against openai-whisper's own functions where it has them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from util import real_tokenizer

from whisper_cli.results import Segment
from whisper_cli.segments import attach_words
from whisper_cli.timing import (
    NO_SPACE_LANGUAGES,
    WindowWords,
    WordTiming,
    _Word,
    dtw,
    median_filter,
    merge_punctuations,
    split_words,
    window_words,
)
from whisper_cli.tokenizer import Tokenizer

# --- DTW -----------------------------------------------------------------------------------

SIZES = [(10, 20), (32, 16), (123, 1500), (234, 189)]


def planted(n: int, m: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A random monotonic path from (0, 0) to (n-1, m-1), and a cost of -1 on it, 1-2 off it.

    Negative on the path: a diagonal short cut past one of its cells costs more, so the
    planted path is the only cheapest one.
    """
    i, j, path = 0, 0, [(0, 0)]
    while (i, j) != (n - 1, m - 1):
        moves = (
            [(1, 0)] * (i < n - 1) + [(0, 1)] * (j < m - 1) + [(1, 1)] * (i < n - 1 and j < m - 1)
        )
        di, dj = moves[rng.integers(len(moves))]
        i, j = i + di, j + dj
        path.append((i, j))
    cost = rng.uniform(1.0, 2.0, size=(n, m)).astype(np.float32)
    path_array = np.array(path).T
    cost[path_array[0], path_array[1]] = -1.0
    return cost, path_array


@pytest.mark.parametrize(("n", "m"), SIZES)
def test_dtw_recovers_a_planted_path(n, m):
    cost, path = planted(n, m, np.random.default_rng(n * 7919 + m))
    (found,) = dtw(torch.from_numpy(cost)[None], [n], [m])
    np.testing.assert_array_equal(found, path)


def test_dtw_recovers_planted_paths_of_every_size_in_one_batch():
    """Rows of different sizes padded into one batch: each path ends at its own corner."""
    rng = np.random.default_rng(1)
    cases = [planted(n, m, rng) for n, m in SIZES]
    n_max, m_max = max(n for n, _ in SIZES), max(m for _, m in SIZES)
    batch = np.full((len(SIZES), n_max, m_max), -5.0, dtype=np.float32)  # cheaper padding
    for b, (cost, _) in enumerate(cases):
        batch[b, : cost.shape[0], : cost.shape[1]] = cost
    found = dtw(torch.from_numpy(batch), [n for n, _ in SIZES], [m for _, m in SIZES])
    for (_, path), got in zip(cases, found, strict=True):
        np.testing.assert_array_equal(got, path)


def reference_dtw(x: np.ndarray) -> np.ndarray:
    """The textbook double loop with openai-whisper's tie rule, float32 costs."""
    n, m = x.shape
    cost = np.full((n + 1, m + 1), np.inf, dtype=np.float32)
    trace = np.zeros((n + 1, m + 1), dtype=np.int8)
    cost[0, 0] = 0
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
            if c0 < c1 and c0 < c2:
                c, t = c0, 0
            elif c1 < c0 and c1 < c2:
                c, t = c1, 1
            else:
                c, t = c2, 2
            cost[i, j] = np.float32(x[i - 1, j - 1] + c)
            trace[i, j] = t
    i, j, path = n, m, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        t = 2 if i == 0 else 1 if j == 0 else trace[i, j]
        i, j = i - (t != 2), j - (t != 1)
    return np.array(path[::-1]).T


@pytest.mark.parametrize("ties", [False, True])
def test_dtw_equals_the_double_loop(ties):
    """Random costs (with many exact ties when they are small integers): the same paths."""
    rng = np.random.default_rng(3)
    shapes = [(1, 1), (1, 7), (7, 1), (5, 9), (12, 30), (30, 12)]
    xs = [
        (rng.integers(0, 3, size=s) if ties else rng.standard_normal(s)).astype(np.float32)
        for s in shapes
    ]
    batch = np.zeros((len(xs), 30, 30), dtype=np.float32)
    for b, x in enumerate(xs):
        batch[b, : x.shape[0], : x.shape[1]] = x
    found = dtw(torch.from_numpy(batch), [s[0] for s in shapes], [s[1] for s in shapes])
    for x, got in zip(xs, found, strict=True):
        np.testing.assert_array_equal(got, reference_dtw(x))


# --- median filter ---------------------------------------------------------------------------


def reference_median(x: np.ndarray, width: int) -> np.ndarray:
    """Per element: the median of the `width` values around it, indices reflected at the edges."""
    pad, m = width // 2, x.shape[-1]
    if m <= pad:
        return x
    out = np.empty_like(x)
    for k in range(m):
        idx = [
            abs(p) if p < 0 else 2 * (m - 1) - p if p >= m else p
            for p in range(k - pad, k + pad + 1)
        ]
        out[..., k] = np.sort(x[..., idx], axis=-1)[..., pad]
    return out


@pytest.mark.parametrize("width", [1, 3, 5, 7])
@pytest.mark.parametrize("frames", [2, 3, 4, 8, 50])
def test_median_filter_equals_the_reference(width, frames):
    x = torch.from_numpy(
        np.random.default_rng(frames).standard_normal((3, 4, frames), dtype=np.float32)
    )
    np.testing.assert_array_equal(
        median_filter(x, width).numpy(), reference_median(x.numpy(), width)
    )


def test_median_filter_matches_openai_whisper():
    from whisper.timing import median_filter as reference

    x = torch.from_numpy(np.random.default_rng(5).standard_normal((8, 40, 1500), dtype=np.float32))
    assert torch.equal(median_filter(x, 7), reference(x, 7))


def test_median_filter_rejects_even_widths():
    with pytest.raises(ValueError, match="odd"):
        median_filter(torch.zeros(2, 10), 4)


# --- words from tokens -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(real_tokenizer("base"), multilingual=True)


def words_of(text: str, tokenizer: Tokenizer, language: str | None) -> list[str]:
    return [
        tokenizer.decode(g) for g in split_words(tokenizer.encode_text(text), tokenizer, language)
    ]


def test_words_split_at_spaces_with_punctuation_apart(tokenizer):
    assert words_of(" Hello, world. Don't stop!", tokenizer, "en") == [
        " Hello",
        ",",
        " world",
        ".",
        " Don't",
        " stop",
        "!",
    ]


def test_words_split_like_openai_whisper(tokenizer):
    from whisper.tokenizer import get_tokenizer

    texts = {
        "en": " And so, my fellow Americans: ask not (what) your country can do—for you?",
        "de": " Die Software wird »ohne Gewähr« bereitgestellt, ausdrücklich.",
        "ja": "こんにちは世界、元気ですか？今日は「晴れ」です。",
        "zh": "你好，世界！我们今天去北京。",
        "th": "สวัสดีครับ ยินดีต้อนรับ",
    }
    for language, text in texts.items():
        reference = get_tokenizer(True, language=language, task="transcribe")
        tokens = tokenizer.encode_text(text)
        theirs, _ = reference.split_to_word_tokens([*tokens, reference.eot])
        assert words_of(text, tokenizer, language) == theirs[:-1], language  # less end-of-text


def test_languages_without_spaces_split_into_whole_characters(tokenizer):
    """Japanese "？" is three byte-level tokens: one word, never a broken character."""
    text = "こんにちは世界、元気ですか？"
    tokens = tokenizer.encode_text(text)
    groups = split_words(tokens, tokenizer, "ja")
    words = [tokenizer.decode(g) for g in groups]
    assert "ja" in NO_SPACE_LANGUAGES
    assert "".join(words) == text
    assert all("\ufffd" not in w for w in words)
    assert words[-1] == "？" and len(groups[-1]) == 3
    assert len(words) > 4  # not one word for the sentence, as splitting at spaces would give


def test_punctuation_merges_like_openai_whisper():
    from whisper.timing import WordTiming as Reference
    from whisper.timing import merge_punctuations as reference

    texts = [' "', "Hello", ",", " world", ".", " (", "quote", ")", '"', " ¿", " Qué", "?"]
    ours = [_Word(t, [k], float(k), k + 1.0, 0.5) for k, t in enumerate(texts)]
    theirs = [Reference(t, [k], float(k), k + 1.0, 0.5) for k, t in enumerate(texts)]
    merge_punctuations(ours, "\"'“¿([{-", "\"'.。,，!！?？:：”)]}、")
    reference(theirs, "\"'“¿([{-", "\"'.。,，!！?？:：”)]}、")
    assert [(w.word, w.tokens) for w in ours] == [(w.word, w.tokens) for w in theirs]
    assert [w.word for w in ours if w.word] == [' "Hello,', " world.", ' (quote)"', " ¿ Qué?"]


def test_long_words_at_sentence_ends_are_cut_to_twice_the_median(tokenizer):
    texts = [" one", " two", " three", ".", " four", " five"]
    groups = [tokenizer.encode_text(t) for t in texts]
    tokens = [t for g in groups for t in g]
    assert [tokenizer.decode(g) for g in split_words(tokens, tokenizer, "en")] == texts
    # Word starts (and the end): "." lasts 3 s and " four", right after it, 2.5 s.
    word_starts = [0.0, 0.3, 0.6, 0.9, 3.9, 6.4, 6.7]
    starts = np.array([word_starts[k] for k, g in enumerate(groups) for _ in g] + [6.7])
    result = window_words(starts, [0.9] * len(tokens), tokens, tokenizer, "en")
    assert result.median_duration == pytest.approx(0.3)
    by_word = {w.word: (w.start, w.end) for w in result.words}
    # "." is cut to 0.6 s (then merged into "three"), " four" starts 0.6 s before its end.
    assert by_word[" three."] == pytest.approx((0.6, 0.9))
    assert by_word[" four"] == pytest.approx((5.8, 6.4))
    assert [w.word for w in result.words] == [" one", " two", " three.", "", " four", " five"]


# --- words into segments ---------------------------------------------------------------------


def timings(*spec: tuple[str, int, float, float]) -> tuple[WordTiming, ...]:
    return tuple(WordTiming(w, tuple(range(n)), s, e, 0.9) for w, n, s, e in spec)


def test_words_go_to_their_segments_and_refine_their_times():
    segments = [Segment(10.0, 12.0, " a b", (1, 2)), Segment(12.0, 14.0, " c", (3,))]
    window = WindowWords(
        timings((" a", 1, 0.3, 0.6), (" b", 1, 0.6, 1.1), (" c", 1, 2.2, 2.5)), 0.3
    )
    out = attach_words(segments, window, offset=10.0, last_speech=9.8)
    assert [[w.word for w in s.words] for s in out] == [[" a", " b"], [" c"]]
    assert [(s.start, s.end) for s in out] == [(10.3, 11.1), (12.2, 12.5)]
    assert out[0].text == " a b" and out[0].tokens == (1, 2)


def test_an_overlong_first_word_after_a_pause_is_cut():
    """openai-whisper's rule: the first word after a pause is at most twice the median long."""
    segments = [Segment(0.0, 5.0, " a b c", (1, 2, 3))]
    window = WindowWords(
        timings((" a", 1, 0.0, 3.0), (" b", 1, 3.0, 3.3), (" c", 1, 3.3, 3.6)), 0.3
    )
    (out,) = attach_words(segments, window, offset=0.0, last_speech=0.0)
    assert (out.words[0].start, out.words[0].end) == (2.4, 3.0)
    assert out.start == 2.4 and out.end == 3.6


def test_a_last_word_running_far_past_its_segment_is_cut_to_it():
    segments = [Segment(0.0, 2.0, " a b", (1, 2))]
    window = WindowWords(timings((" a", 1, 0.0, 0.4), (" b", 1, 0.4, 4.0)), 0.4)
    (out,) = attach_words(segments, window, offset=0.0, last_speech=0.0)
    assert out.words[-1].end == 2.0 and out.end == 2.0
