"""Per-row temperature fallback: re-queued rows, untouched neighbours, seeded sampling."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import soundfile as sf
import torch
from util import shared_clip

from whisper_cli import judge
from whisper_cli.audio import SAMPLE_RATE, load_audio
from whisper_cli.decoding import DecodedRow
from whisper_cli.options import Policy
from whisper_cli.scheduler import Counters, Job, Scheduler

FAILING = 7  # the one input of the "right" speaker, whose window fails below 0.5
MARK = "horizon"  # its text: "The horizon seems extremely distant."


@pytest.fixture(scope="module")
def sixteen(tmp_path_factory) -> list[str]:
    """16 short inputs of real speech (one window each), so they fill one batch of 16."""
    out = tmp_path_factory.mktemp("sixteen")
    stereo = shared_clip("stereo_diarization.wav")
    others = [
        load_audio(shared_clip("jfk.flac")),
        load_audio(stereo, "left"),
        load_audio(shared_clip("hotwords.mp3")),
    ]
    paths = []
    for i in range(16):
        if i == FAILING:
            audio = load_audio(stereo, "right")
        else:
            audio = others[i % 3][: round((3.0 + i % 4) * SAMPLE_RATE)] * (0.4 + 0.1 * (i % 5))
        path = out / f"input{i:02d}.wav"
        sf.write(path, audio.astype(np.float32), SAMPLE_RATE, subtype="FLOAT")
        paths.append(str(path))
    return paths


def run(t, paths: list[str], monkeypatch) -> tuple[dict, list[tuple[bool, float]]]:
    """Transcripts by path, and (is the failing input, temperature) of every row decoded.

    The failing input's window is made to fail at temperatures below 0.5; every other
    check is the pipeline's own."""
    decoded: list[tuple[bool, float]] = []
    text = lambda row: t.loaded.tokenizer.decode(list(row.tokens)).lower()  # noqa: E731
    real_fallback = judge.needs_fallback

    def needs_fallback(row: DecodedRow, row_text: str, policy: Policy) -> bool:
        forced = MARK in text(row) and row.temperature < 0.5
        return real_fallback(row, row_text, policy) or forced

    real_decode = t.engine.decode

    def decode(*args, **kwargs):
        rows = real_decode(*args, **kwargs)
        decoded.extend((MARK in text(row), row.temperature) for row in rows)
        return rows

    monkeypatch.setattr(t.engine, "decode", decode)
    monkeypatch.setattr(judge, "needs_fallback", needs_fallback)
    results, errors = [], []
    t.run(paths, results.append, errors.append)
    assert not errors
    return {r.path: r for r in results}, decoded


# Only the forced failure (and loops) fall back here, so that every other row is known to
# pass at temperature 0 and must come out as it does with no fallback at all.
FORCED_ONLY = {"logprob_threshold": -100.0, "compression_ratio_threshold": 100.0}


def test_one_failing_row_falls_back_alone(sixteen, tiny_en, transcriber, monkeypatch) -> None:
    with_fallback = transcriber(tiny_en, policy=Policy(**FORCED_ONLY))
    fallback, decoded = run(with_fallback, sixteen, monkeypatch)
    no_fallback = transcriber(tiny_en, policy=Policy(temperatures=(0.0,), **FORCED_ONLY))
    plain, _ = run(no_fallback, sixteen, monkeypatch)
    assert len(decoded[:16]) == 16 and sum(failing for failing, _ in decoded[:16]) == 1
    assert all(t == 0.0 for _, t in decoded[:16])  # one full batch first
    # No new window is left: the failing window alone is decoded again, at every later
    # temperature in one batch (the spare rows); it fails at 0.2 and 0.4, passes at 0.6.
    assert decoded[16:] == [(True, t) for t in (0.2, 0.4, 0.6, 0.8, 1.0)]
    assert (with_fallback.counters.fallbacks, with_fallback.counters.ahead) == (3, 4)
    # Its encoder output is kept for its later attempts: every window is encoded once.
    counters = with_fallback.engine.counters
    assert (counters.encoded_rows, counters.decoded_rows, counters.decodes) == (16, 21, 2)
    for i, path in enumerate(sixteen):
        if i != FAILING:
            assert fallback[path].segments == plain[path].segments  # untouched neighbours
    kept = fallback[sixteen[FAILING]]
    assert MARK in kept.text.lower()  # the text decoded at 0.6

    again, _ = run(transcriber(tiny_en, policy=Policy(**FORCED_ONLY)), sixteen, monkeypatch)
    assert again[sixteen[FAILING]].segments == kept.segments  # the same seed, the same text

    # One attempt at a time (nothing decoded ahead) gives the same transcripts (log-probs
    # up to float rounding: the rows' batches differ in size).
    monkeypatch.setattr(Scheduler, "_ahead", lambda self, batch, spare: [])
    one_by_one, decoded = run(
        transcriber(tiny_en, policy=Policy(**FORCED_ONLY)), sixteen, monkeypatch
    )
    assert decoded[16:] == [(True, 0.2), (True, 0.4), (True, 0.6)]  # a batch each
    for path, result in fallback.items():
        got = one_by_one[path].segments
        assert [(s.start, s.end, s.text, s.tokens) for s in got] == [
            (s.start, s.end, s.text, s.tokens) for s in result.segments
        ]
        for x, y in zip(got, result.segments, strict=True):
            assert x.avg_logprob == pytest.approx(y.avg_logprob, abs=1e-5)


def test_later_attempts_fill_spare_rows_round_robin() -> None:
    """Each retry's next temperature first, then the one after; never past the spare
    rows, the last temperature, or onto rows decoded for the first time."""
    from whisper_cli.windows import Window

    counters = Counters()
    scheduler = Scheduler([], lambda i: None, 16, 6, counters)  # attempts 0..5
    audio = np.zeros(SAMPLE_RATE, dtype=np.float32)
    window = Window(0, 0, 0, audio, np.zeros(32, dtype=bool))
    features = torch.zeros(1500, 384)
    a, b = Job(window, 1, features=features), Job(window, 4, features=features)
    fresh = Job(window)  # a new window: nothing ahead
    ahead = scheduler._ahead([a, fresh, b], 3)
    assert [(j.ahead_of, j.attempt) for j in ahead] == [(a, 2), (b, 5), (a, 3)]
    assert all(j.features is features and j.window is window for j in ahead)
    assert [j.attempt for j in scheduler._ahead([a, b], 10)] == [2, 5, 3, 4, 5]
    assert scheduler._ahead([a, b], 0) == [] and scheduler._ahead([fresh], 5) == []
    assert counters.ahead == 8


def test_draws_follow_the_tempered_softmax_and_never_a_suppressed_token() -> None:
    from whisper_cli.decoding import draw, uniform

    n = 40_000
    logits = torch.tensor([2.0, 0.5, float("-inf"), 1.0, -1.0, float("-inf")]).expand(n, -1)
    temperature = torch.full((n,), 0.7)
    greedy = logits.argmax(dim=-1)
    tokens = draw(logits, temperature, uniform(torch.arange(n), torch.tensor(3)), greedy)
    counts = torch.bincount(tokens, minlength=6).double()
    expected = torch.softmax(logits[0].double() / 0.7, dim=0) * n
    assert counts[2] == 0 and counts[5] == 0  # -inf: never, the vocabulary's end included
    sigma = (expected * (1 - expected / n)).sqrt()
    assert ((counts - expected).abs() <= 5 * sigma + 1e-9).all(), (counts, expected)
    # The extreme uniforms land on tokens with mass of their own.
    edges = torch.tensor([1 - 2.0**-24, 2.0**-24, 1.0])
    # u = 1.0 (the target at the total): the likeliest token the caller passes.
    assert draw(logits[:3], temperature[:3], edges, greedy[:3]).tolist() == [4, 0, 0]
    # A cumulative sum that is not flat across a suppressed token (as a parallel scan
    # may round) still never draws it.
    probs = torch.tensor([[0.5, 0.0, 0.5]])
    uneven = torch.tensor([[0.5, 0.5000001, 1.0]])
    with (
        mock.patch.object(torch.Tensor, "cumsum", lambda self, dim: uneven),
        mock.patch("whisper_cli.decoding.f32_softmax", lambda logits, t: probs),
    ):
        assert draw(probs, torch.ones(1), torch.tensor([0.5]), torch.zeros(1)).tolist() == [2]
    # Far from the edges, a very low temperature is the argmax.
    cold = draw(logits[:2], torch.full((2,), 1e-3), torch.tensor([0.3, 0.9]), greedy[:2])
    assert cold.tolist() == [0, 0]


def test_a_rows_uniform_depends_on_its_seed_and_step_alone() -> None:
    from whisper_cli.decoding import uniform

    seeds = torch.tensor([0, 1, 2**32 - 1, 123456789])
    u = uniform(seeds, torch.tensor(7))
    assert u.dtype == torch.float32 and ((u > 0) & (u < 1)).all()
    # The largest and least hash values: still strictly inside (0, 1).
    with mock.patch("whisper_cli.decoding._mix32", lambda x: torch.full_like(x, 2**32 - 1)):
        assert uniform(seeds, torch.tensor(0)).max().item() == 1 - 2.0**-24
    with mock.patch("whisper_cli.decoding._mix32", torch.zeros_like):
        assert uniform(seeds, torch.tensor(0)).min().item() == 2.0**-24
    assert torch.equal(uniform(seeds.flip(0), torch.tensor(7)), u.flip(0))  # no row order
    assert torch.equal(uniform(seeds[1:2], torch.tensor(7)), u[1:2])  # nor batch size
    assert not torch.equal(uniform(seeds, torch.tensor(8)), u)  # a new step, new draws
    many = uniform(torch.arange(100_000), torch.tensor(0))
    assert abs(many.mean().item() - 0.5) < 0.005 and len(many.unique()) > 99_000
