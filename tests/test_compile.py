"""The compiled step (torch.compile, inductor on CPU) is the eager step: same texts through
the whole pipeline, fallback rows included, from one graph per step function, batches
stepped to their end or rows refilled as they finish."""

from __future__ import annotations

import pytest
import torch
from util import shared_clip

from whisper_cli import judge
from whisper_cli.audio import SAMPLE_RATE, load_audio
from whisper_cli.decoding import DecodedRow
from whisper_cli.options import Policy
from whisper_cli.pipeline import Transcriber

MARK = "horizon"  # the right speaker's text: "The horizon seems extremely distant."


@pytest.fixture(scope="module")
def five(tmp_path_factory) -> list[str]:
    """Five inputs of different speech, one window each: three batches of two (the last
    padded), the "right" speaker's window forced to fall back."""
    import soundfile as sf

    out = tmp_path_factory.mktemp("five")
    stereo = shared_clip("stereo_diarization.wav")
    clips = [
        load_audio(shared_clip("jfk.flac")),
        load_audio(stereo, "left"),
        load_audio(stereo, "right"),
        load_audio(shared_clip("hotwords.mp3"))[: 20 * SAMPLE_RATE],
        load_audio(shared_clip("jfk.flac"))[: 6 * SAMPLE_RATE] * 0.5,
    ]
    paths = []
    for i, audio in enumerate(clips):
        paths.append(str(out / f"input{i}.wav"))
        sf.write(paths[-1], audio, SAMPLE_RATE, subtype="FLOAT")
    return paths


def run(t: Transcriber, paths: list[str], monkeypatch) -> dict[str, list]:
    real = judge.needs_fallback
    text = lambda row: t.loaded.tokenizer.decode(list(row.tokens)).lower()  # noqa: E731

    def needs_fallback(row: DecodedRow, row_text: str, policy) -> bool:
        return real(row, row_text, policy) or (MARK in text(row) and row.temperature < 0.5)

    monkeypatch.setattr(judge, "needs_fallback", needs_fallback)
    results, errors = [], []
    t.run(paths, results.append, errors.append)
    assert not errors
    return {r.path: r.segments for r in results}


def same(a: dict[str, list], b: dict[str, list]) -> None:
    """Identical tokens, times and texts; log-probs equal up to float rounding (inductor
    fuses the log-sum-exp differently)."""
    assert a.keys() == b.keys()
    for path in a:
        assert [(s.start, s.end, s.text, s.tokens) for s in a[path]] == [
            (s.start, s.end, s.text, s.tokens) for s in b[path]
        ]
        for x, y in zip(a[path], b[path], strict=True):
            assert x.avg_logprob == pytest.approx(y.avg_logprob, abs=1e-4)
            assert x.no_speech_prob == pytest.approx(y.no_speech_prob, abs=1e-4)


@pytest.mark.slow
def test_compiled_pipeline_equals_eager_with_fallback_rows(tiny_en, five, transcriber, monkeypatch):
    eager = transcriber(tiny_en, batch_size=2)
    expected = run(eager, five, monkeypatch)
    compiled = transcriber(tiny_en, batch_size=2, compile=True, refill=False)
    got = run(compiled, five, monkeypatch)
    same(got, expected)
    assert any(MARK in s.text.lower() for s in got[five[2]])
    assert compiled.counters.fallbacks == eager.counters.fallbacks >= 2  # forced: 0.2, 0.4

    counters = compiled.engine.counters
    assert counters.decodes >= 4  # three batches of new windows, then the fallback rows
    assert counters.decoded_rows == 2 * counters.decodes  # every batch padded to two rows
    assert counters.graphs == 2  # one greedy, one sampling step: nothing recompiled
    assert counters.recompiles == 0
    assert counters.graph_breaks == 0
    # The eager engine dropped finished rows; the compiled one kept its fixed batch.
    assert eager.engine.counters.row_steps < 2 * eager.engine.counters.steps
    assert counters.row_steps == 2 * counters.steps

    # Refilled (the default where compiled): rows written in place in the fixed buffers,
    # the same graphs replayed, the same text, every window and fallback decoded.
    refilled = transcriber(tiny_en, batch_size=2, compile=True)
    same(run(refilled, five, monkeypatch), expected)
    ran = refilled.engine.counters
    assert ran.refills > 0
    assert (ran.recompiles, ran.graph_breaks) == (0, 0)
    assert refilled.counters.fallbacks == compiled.counters.fallbacks
    assert ran.row_steps == 2 * ran.steps  # the fixed batch


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_pipeline_equals_eager_on_cuda(five, monkeypatch):
    from util import real_model

    from whisper_cli.dtypes import resolve_policy
    from whisper_cli.loading import load_model
    from whisper_cli.options import TranscribeOptions

    for dtype in ("f32", "bf16"):
        loaded = load_model(str(real_model("tiny.en")), resolve_policy(dtype, "cuda"))
        texts = {}
        for compile in (False, True):
            options = TranscribeOptions(batch_size=2, compile=compile, policy=Policy())
            texts[compile] = run(Transcriber(loaded, options), five, monkeypatch)
        same(texts[True], texts[False])
