"""Per-row temperature fallback: real failures, untouched neighbours, seeded sampling."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import soundfile as sf
import torch
from util import shared_clip

from whisper_cli.audio import SAMPLE_RATE, load_audio
from whisper_cli.decoding import DecodedRow
from whisper_cli.judge import row_text
from whisper_cli.options import Policy
from whisper_cli.scheduler import Counters, Job, Scheduler
from whisper_cli.segments import compression_ratio

FAILING = 7  # the one input that needs fallback: German speech, to an English-only model


def german() -> np.ndarray:
    """The last 20 s of multilingual.mp3's German half: one window that tiny.en (English
    only) cannot transcribe; its greedy decode loops or is unsure, and so falls back."""
    return load_audio(shared_clip("multilingual.mp3"))[round(40.0 * SAMPLE_RATE) :]


@pytest.fixture(scope="module")
def sixteen(tmp_path_factory) -> list[str]:
    """16 inputs of real speech (one window each), so they fill one batch of 16: short
    English clips around the German one."""
    out = tmp_path_factory.mktemp("sixteen")
    stereo = shared_clip("stereo_diarization.wav")
    others = [
        load_audio(shared_clip("jfk.flac")),
        load_audio(stereo, "left"),
        load_audio(stereo, "right"),
    ]
    paths = []
    for i in range(16):
        if i == FAILING:
            audio = german()
        else:
            audio = others[i % 3][: round((3.0 + i % 4) * SAMPLE_RATE)] * (0.4 + 0.1 * (i % 5))
        path = out / f"input{i:02d}.wav"
        sf.write(path, audio.astype(np.float32), SAMPLE_RATE, subtype="FLOAT")
        paths.append(str(path))
    return paths


def fails(row: DecodedRow, text: str, policy: Policy) -> bool:
    """The fallback thresholds, read off the row (openai-whisper's; the window is not
    judged silent here: tiny.en hears speech in it)."""
    return (
        row.looped
        or compression_ratio(text) > policy.compression_ratio_threshold
        or row.avg_logprob < policy.logprob_threshold
    )


def run(t, paths: list[str]) -> tuple[dict, list[DecodedRow]]:
    """Transcripts by path, and every row the engine decoded (in order)."""
    decoded: list[DecodedRow] = []
    real_run = t.engine.run

    def run_batch(*args, **kwargs):
        batch = real_run(*args, **kwargs)
        decoded.extend(batch.rows)
        return batch

    t.engine.run = run_batch  # watched, not changed
    results, errors = [], []
    t.run(paths, results.append, errors.append)
    assert not errors
    return {r.path: r for r in results}, decoded


def same_segments(a, b) -> None:
    """Equal text, tokens and times; log-probs up to float rounding (batches differ)."""
    assert [(s.start, s.end, s.text, s.tokens) for s in a] == [
        (s.start, s.end, s.text, s.tokens) for s in b
    ]
    for x, y in zip(a, b, strict=True):
        assert x.avg_logprob == pytest.approx(y.avg_logprob, abs=1e-5)


@pytest.fixture(scope="module")
def alone(sixteen, tiny_en):
    """The German input on its own (batches of 16: its later attempts decoded ahead in the
    spare rows), with the default policy: its transcript, rows and the transcriber."""
    from whisper_cli.pipeline import TranscribeOptions, Transcriber

    t = Transcriber(tiny_en, TranscribeOptions())
    results, rows = run(t, [sixteen[FAILING]])
    return results[sixteen[FAILING]], rows, t


def test_a_window_that_fails_the_thresholds_falls_back(alone, tiny_en) -> None:
    """The real decision, end to end: a window whose greedy decode fails the policy's
    thresholds is decoded again at the next temperatures (its encoder output kept), until
    an attempt passes; the text kept is that attempt's, or, when none passes, the likeliest
    that repeats what was heard, or else the likeliest attempt that is not repetitive."""
    result, rows, t = alone
    policy = t.policy
    assert policy == Policy()  # the real thresholds
    assert t.counters.windows == 1
    texts = [row_text(row, tiny_en.tokenizer) for row in rows]
    assert rows[0].temperature == 0.0 and fails(rows[0], texts[0], policy)
    assert rows[0].no_speech_prob <= policy.no_speech_threshold  # speech: not judged silent
    assert t.counters.fallbacks >= 1
    # One attempt per temperature, in order (later ones decoded ahead in the spare rows).
    assert [row.temperature for row in rows] == list(policy.temperatures[: len(rows)])
    judged = next(
        (i for i, (r, x) in enumerate(zip(rows, texts, strict=True)) if not fails(r, x, policy)),
        None,
    )
    if judged is None:  # none passed: every temperature tried, the best one kept
        assert len(rows) == len(policy.temperatures)
        assert t.counters.fallbacks == len(policy.temperatures) - 1
        fine = [
            r
            for r, x in zip(rows, texts, strict=True)
            if not r.looped and compression_ratio(x) <= policy.compression_ratio_threshold
        ]
        # The German is read straight through: speech lies under all of the window, so a
        # confident try that ended by itself counts as repeating what was heard.
        heard = [
            r
            for r in rows
            if not (r.looped or r.hit_max_tokens) and r.avg_logprob >= policy.logprob_threshold
        ]
        kept = max(heard or fine or rows, key=lambda r: r.avg_logprob)
    else:
        assert t.counters.fallbacks == judged
        kept = rows[judged]
    segments = result.segments
    assert segments
    assert all(s.avg_logprob == kept.avg_logprob for s in segments)
    assert all(set(s.tokens) <= set(kept.tokens) for s in segments)
    assert all(s.compression_ratio <= policy.compression_ratio_threshold for s in segments)
    # Its encoder output is kept for its later attempts: the window is encoded once.
    assert t.engine.counters.encoded_rows == 1


def test_fallback_leaves_its_neighbours_alone_and_draws_whatever_the_batch(
    sixteen, alone, tiny_en, transcriber
) -> None:
    """Among 15 inputs of English speech, the German window falls back to the same text as
    alone; an input whose window passes at temperature 0 comes out as with no fallback at
    all; and one window at a time (a batch of one, nothing decoded ahead) gives the same
    transcripts: a draw depends on its window, attempt and step, never on its batch."""
    t = transcriber(tiny_en)
    batched, rows = run(t, sixteen)
    assert t.counters.windows == 16 and t.counters.fallbacks >= 1
    assert all(row.temperature == 0.0 for row in rows[:16])  # one full batch first
    assert t.engine.counters.encoded_rows == 16  # every window encoded once
    same_segments(batched[sixteen[FAILING]].segments, alone[0].segments)

    plain, _ = run(transcriber(tiny_en, policy=Policy(temperatures=(0.0,))), sixteen)
    policy = Policy()
    passed = [
        path
        for path, result in plain.items()
        if not any(w.code in ("looped", "repetitive") for w in result.warnings)
        and all(s.avg_logprob >= policy.logprob_threshold for s in result.segments)
        and compression_ratio("".join(s.text for s in result.segments))
        <= policy.compression_ratio_threshold
    ]
    assert sixteen[FAILING] not in passed and len(passed) >= 12  # the check below is not empty
    for path in passed:
        assert batched[path].segments == plain[path].segments  # untouched neighbours

    one_by_one, rows = run(transcriber(tiny_en, batch_size=1), sixteen)
    assert len(rows) == 16 + t.counters.fallbacks  # no attempt decoded ahead
    for path, result in batched.items():
        same_segments(one_by_one[path].segments, result.segments)


def test_with_refill_a_window_falls_back_in_the_run_where_it_failed(
    sixteen, alone, tiny_en, transcriber
) -> None:
    """Continuous batching: the German window's later attempts are decoded in the run
    where it failed (no second batch), in rows that finished; each attempt once, in
    order, and every input's transcript the one batches give."""
    t = transcriber(tiny_en, refill=True)
    refilled, rows = run(t, sixteen)
    fallbacks, retries = t.counters.fallbacks, len(rows) - 16
    assert fallbacks >= 1 and retries >= fallbacks
    assert t.counters.batches == 1 and t.engine.counters.decodes == 1
    assert t.engine.counters.encoded_rows == 16  # every window encoded once
    assert t.engine.counters.refills == retries
    temperatures = Policy().temperatures
    assert [r.temperature for r in rows[16:]] == list(temperatures[1 : 1 + retries])
    same_segments(refilled[sixteen[FAILING]].segments, alone[0].segments)
    batched, _ = run(transcriber(tiny_en), sixteen)
    for path, result in batched.items():
        same_segments(refilled[path].segments, result.segments)


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


def test_a_refilled_run_judges_attempts_in_order_and_stops_those_not_needed() -> None:
    """In the last refilled run (Transcriber._retry, told of rows as they finish): a
    window that falls back asks for its next attempt, spare rows take its later ones
    (never past the last temperature), an attempt that finishes before the one ahead of
    it waits to be judged in order, and the attempt kept stops the ones still running."""
    from whisper_cli.engine import Reply
    from whisper_cli.judge import Judgement
    from whisper_cli.pipeline import Transcriber, _InRun
    from whisper_cli.windows import Window

    t = Transcriber.__new__(Transcriber)
    t.policy, t.counters = Policy(), Counters()  # temperatures 0.0 .. 1.0: attempts 0..5
    passes = {2}  # the attempt the judge keeps (the other window passes at once)
    judged = []

    def judge(job, row):
        job.attempts.append(row)
        judged.append(len(job.attempts) - 1)
        return Judgement(final=job is other or len(job.attempts) - 1 in passes, row=row)

    t._judge = judge
    audio = np.zeros(SAMPLE_RATE, dtype=np.float32)
    window = Window(0, 0, 0, audio, np.zeros(32, dtype=bool))
    job, other = Job(window), Job(window)
    run = _InRun.of([job, other])
    row = DecodedRow((), -2.0, (), 0.0, "en")

    first = t._retry(run, 0, row, spare=0)  # fails: its next attempt, no spare row
    assert [(r, x.temperature) for r, x in first.retries] == [(0, 0.2)] and not first.stop
    ahead = t._retry(run, 1, row, spare=3)  # the other window passes; 3 rows spare
    assert [(r, x.temperature) for r, x in ahead.retries] == [(0, 0.4), (0, 0.6), (0, 0.8)]
    assert t.counters.ahead == 3 and run.attempts == [0, 0, 1, 2, 3, 4]
    assert t._retry(run, 3, row, spare=0) == Reply([], [])  # attempt 2 first: waits
    kept = t._retry(run, 2, row, spare=0)  # attempt 1 fails, attempt 2 (waiting) passes
    assert judged == [0, 0, 1, 2] and not kept.retries and sorted(kept.stop) == [4, 5]
    assert run.verdicts[id(job)].row is row and t.counters.fallbacks == 2
    assert t._retry(run, 5, row, spare=4) == Reply([], [])  # stopped: not judged
    assert judged == [0, 0, 1, 2]
    seeds = {x.seed for _, x in first.retries + ahead.retries}
    assert len(seeds) == 4  # each attempt its own draw
