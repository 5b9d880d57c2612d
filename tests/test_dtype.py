"""--dtype means what it says: every floating tensor of a run has the chosen dtype.

A TorchDispatchMode sees the output of every op of a whole transcription. Only the
exceptions listed in whisper_cli.dtypes.F32_EXCEPTIONS may produce float32 in a
bf16/f16 run: the audio front end (log_mel), the speech detector (whose output is NumPy)
and probabilities computed from the logits (f32_log_softmax, f32_logsumexp,
f32_logprob_sums) and whatever is computed from those.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from util import real_model, shared_clip

import whisper_cli.decoding as decoding
import whisper_cli.engine as engine
import whisper_cli.pipeline as pipeline
import whisper_cli.rules as rules
import whisper_cli.timing as timing
from whisper_cli import dtypes, kernels, speech
from whisper_cli.loading import load_model
from whisper_cli.pipeline import TranscribeOptions, Transcriber


class DtypeRecorder(TorchDispatchMode):
    """Records (op, dtype) of every floating output; tracks tensors derived from exceptions."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[tuple[str, torch.dtype]] = Counter()
        self.violations: Counter[tuple[str, torch.dtype]] = Counter()
        self.expected: torch.dtype | None = None
        self.paused = 0
        self._exception_ids: set[int] = set()
        self._keep: list[torch.Tensor] = []  # keeps ids of tagged tensors from being reused

    def untag(self, tensor: torch.Tensor) -> torch.Tensor:
        self._exception_ids.discard(id(tensor))
        return tensor

    def tag(self, tensor: torch.Tensor) -> torch.Tensor:
        self._exception_ids.add(id(tensor))
        self._keep.append(tensor)
        return tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        derived = any(id(t) in self._exception_ids for t in inputs)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                continue
            if derived and t.dtype == torch.float32:
                self.tag(t)  # computed from an exception's float32 result: same exception
                continue
            self.seen[(str(func), t.dtype)] += 1
            if t.dtype != self.expected:
                self.violations[(str(func), t.dtype)] += 1
        return out


@pytest.fixture
def recorder(monkeypatch):
    rec = DtypeRecorder()

    def exception(fn):
        def wrapped(*args, **kwargs):
            rec.paused += 1
            try:
                result = fn(*args, **kwargs)
            finally:
                rec.paused -= 1
            assert result.dtype == torch.float32
            return rec.tag(result)

        return wrapped

    def encoder_door(fn):
        def wrapped(mel, dtype):
            assert mel.dtype == torch.float32
            result = fn(mel, dtype)
            assert result.dtype == dtype
            return rec.untag(result)  # from here on, the model's own tensors

        return wrapped

    def inside(fn):  # a listed exception whose float32 never leaves it (NumPy or cast out)
        def wrapped(*args, **kwargs):
            rec.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                rec.paused -= 1

        return wrapped

    monkeypatch.setattr(speech.SpeechStream, "_score", inside(speech.SpeechStream._score))
    # The CPU kernels' float32 tiles and the timing that chooses them (listed exception).
    monkeypatch.setattr(kernels, "_attend_f32", inside(kernels._attend_f32))
    monkeypatch.setitem(kernels.LOGITS, "f32-blocks", inside(kernels.LOGITS["f32-blocks"]))
    monkeypatch.setattr(kernels, "time_candidates", inside(kernels.time_candidates))
    monkeypatch.setattr(engine, "encoder_input", encoder_door(engine.encoder_input))
    # The listed exceptions, wrapped where they are used.
    monkeypatch.setattr(pipeline, "batch_log_mel", exception(pipeline.batch_log_mel))
    monkeypatch.setattr(engine, "f32_log_softmax", exception(engine.f32_log_softmax))
    monkeypatch.setattr(rules, "f32_logsumexp", exception(rules.f32_logsumexp))
    monkeypatch.setattr(decoding, "gumbel_noise", exception(decoding.gumbel_noise))
    monkeypatch.setattr(decoding, "f32_logprob_sums", exception(decoding.f32_logprob_sums))
    monkeypatch.setattr(decoding, "f32_logsumexp", exception(decoding.f32_logsumexp))
    monkeypatch.setattr(timing, "f32_log_softmax", exception(timing.f32_log_softmax))
    monkeypatch.setattr(timing, "f32_alignment_weights", exception(timing.f32_alignment_weights))
    return rec


def test_exceptions_are_listed():
    assert set(dtypes.F32_EXCEPTIONS) == {
        "audio front end",
        "speech detector",
        "log-softmax over logits",
        "CPU kernels",
        "sampling noise",
        "word-timing cost",
    }


@pytest.mark.parametrize(
    ("name", "clip_seconds", "max_new_tokens", "word_timestamps"),
    # f16 is slow on this CPU; the bf16 and f16 runs time their words too.
    [("f32", None, 224, False), ("bf16", None, 224, True), ("f16", 5.0, 16, True)],
)
def test_every_tensor_of_a_run_has_the_chosen_dtype(
    recorder, name, clip_seconds, max_new_tokens, word_timestamps, tmp_path
):
    import soundfile as sf

    from whisper_cli.audio import load_audio

    policy = dtypes.resolve_policy(name, "cpu")
    loaded = load_model(str(real_model("tiny.en")), policy)
    audio = load_audio(shared_clip("jfk.flac"))
    if clip_seconds:
        audio = audio[: int(clip_seconds * 16000)]
    path = tmp_path / "clip.wav"
    sf.write(path, audio, 16000)
    options = TranscribeOptions(max_new_tokens=max_new_tokens, word_timestamps=word_timestamps)
    transcriber = Transcriber(loaded, options)
    caches = []
    new_caches = loaded.model.decoder.new_caches
    loaded.model.decoder.new_caches = lambda *a: caches.append(new_caches(*a)) or caches[-1]
    recorder.expected = policy.dtype
    with recorder:
        result = transcriber.transcribe(str(path))

    # Parameters, buffers and every KV cache (self and cross attention).
    model = loaded.model
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert {t.dtype for t in tensors.values()} == {policy.dtype}
    assert caches  # every decode's caches: self and cross attention, every layer
    kv = [t for c in caches for t in c.tensors()]
    assert len(kv) == len(caches) * 4 * loaded.config.decoder_layers
    assert {t.dtype for t in kv} == {policy.dtype}

    assert not recorder.violations, dict(recorder.violations)
    ops = {op for op, _ in recorder.seen}
    # The run really went through the model: convolutions, attention, matmuls, norms.
    for op in ("conv1d", "layer_norm", "linear", "index_copy_"):
        assert any(op in o for o in ops), (op, sorted(ops))
    if word_timestamps:  # the alignment pass ran, in this dtype
        assert any(s.words for s in result.segments)
    if clip_seconds is None:
        words = re.sub(r"[^\w\s]", "", result.text.lower()).split()
        assert words[:4] == ["and", "so", "my", "fellow"]
        assert "country" in words


def test_bf16_and_f16_transcribe_jfk_with_the_same_words():
    from whisper_cli.audio import load_audio
    from whisper_cli.decoding import DecodeOptions
    from whisper_cli.engine import Engine
    from whisper_cli.features import log_mel

    audio = load_audio(shared_clip("jfk.flac"))
    texts = {}
    for name in ("f32", "bf16", "f16"):
        loaded = load_model(str(real_model("tiny.en")), dtypes.resolve_policy(name, "cpu"))
        engine = Engine(loaded, DecodeOptions(max_new_tokens=40))
        mel = log_mel(torch.from_numpy(audio)[None], loaded.config.num_mel_bins)
        row = engine.decode(engine.encode(mel), [None])[0]
        texts[name] = re.sub(r"[^\w\s]", "", loaded.tokenizer.decode(row.tokens).lower()).split()
    assert texts["bf16"] == texts["f32"]
    assert texts["f16"] == texts["f32"]


def test_auto_is_f32_on_cpu_and_f16_warns():
    assert dtypes.resolve_policy("auto", "cpu").dtype == torch.float32
    dtypes._warned_f16 = False
    with pytest.warns(RuntimeWarning, match="f16 on CPU is slow"):
        dtypes.resolve_policy("f16", "cpu")


def test_bf16_refused_on_a_cuda_device_without_it(monkeypatch):
    from whisper_cli.errors import WhisperCliError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    with pytest.raises(WhisperCliError, match="bf16 is not supported on Tesla T4"):
        dtypes.resolve_policy("bf16", "cuda")
    assert dtypes.resolve_policy("auto", "cuda").dtype == torch.float16


def test_expand_dtypes_of_bench_and_eval():
    from whisper_cli.errors import WhisperCliError

    assert dtypes.expand_dtypes("all") == ("f32", "f16", "bf16")
    assert dtypes.expand_dtypes("bf16") == ("bf16",)
    assert dtypes.expand_dtypes("f32,bf16,f32") == ("f32", "bf16")
    assert dtypes.expand_dtypes(["bf16", "all", "f32"]) == ("bf16", "f32", "f16")
    assert dtypes.expand_dtypes(("auto",)) == ("auto",)
    with pytest.raises(WhisperCliError, match="invalid dtype 'f8'; choose all or one of auto"):
        dtypes.expand_dtypes("f8")
    with pytest.raises(WhisperCliError, match="no dtype given"):
        dtypes.expand_dtypes([])
