"""The compiled decode step gives the same tokens as the eager one."""

from __future__ import annotations

import pytest
import torch
from util import real_model, shared_clip

from whisper_cli.audio import load_audio
from whisper_cli.compiled import compiled_step
from whisper_cli.decoding import DecodeOptions, GreedyDecoder
from whisper_cli.dtypes import resolve_policy
from whisper_cli.features import batch_log_mel
from whisper_cli.loading import load_model


def decode_both(device: str, dtype: str, batch: int = 2, max_new_tokens: int = 48):
    loaded = load_model(str(real_model("tiny.en")), resolve_policy(dtype, device))
    audio = load_audio(shared_clip("jfk.flac"))
    mel = batch_log_mel([audio] * batch, batch, loaded.config.num_mel_bins, loaded.model.device)
    results = {}
    for name, step in (("eager", None), ("compiled", compiled_step(loaded.model))):
        options = DecodeOptions(max_new_tokens=max_new_tokens, shrink_batch=False)
        decoder = GreedyDecoder(loaded, options, step=step)
        with torch.inference_mode():
            results[name] = decoder.decode(decoder.encode(mel), [None] * batch)
    return loaded, results


@pytest.mark.slow
def test_compiled_step_matches_eager_on_cpu():
    """The same step function under torch.compile (inductor, CPU) gives identical tokens."""
    loaded, results = decode_both("cpu", "f32")
    eager = [r.tokens for r in results["eager"]]
    assert [r.tokens for r in results["compiled"]] == eager
    assert "country" in loaded.tokenizer.decode(eager[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_step_matches_eager_on_cuda():
    for dtype in ("f32", "bf16"):
        _, results = decode_both("cuda", dtype, batch=4)
        assert [r.tokens for r in results["compiled"]] == [r.tokens for r in results["eager"]]
