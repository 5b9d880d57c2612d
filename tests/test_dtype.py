"""--dtype means what it says: every floating tensor of a run has the chosen dtype.

The recorder (tests/dtype_recorder.py, also run on CUDA by scripts/gpu_check.py) sees the
output of every op of a whole transcription; only the listed float32 exceptions of
whisper_cli.dtypes.F32_EXCEPTIONS may produce float32 in a bf16/f16 run.
"""

from __future__ import annotations

import re

import pytest
import torch
from dtype_recorder import DtypeRecorder, exceptions_marked
from util import decode_mel, real_model, shared_clip

from whisper_cli import dtypes
from whisper_cli.loading import load_model
from whisper_cli.options import Policy
from whisper_cli.pipeline import TranscribeOptions, Transcriber


@pytest.fixture
def recorder():
    with exceptions_marked(DtypeRecorder()) as rec:
        yield rec


def short_bf16_run(path, unmarked: str | None = None) -> DtypeRecorder:
    """tiny.en in bf16 on `path`, drawing its tokens (temperature 0.5) and timing its
    words, under the recorder with the listed exceptions marked but `unmarked`."""
    policy = dtypes.resolve_policy("bf16", "cpu")
    loaded = load_model(str(real_model("tiny.en")), policy)
    options = TranscribeOptions(
        max_new_tokens=16, word_timestamps=True, policy=Policy(temperatures=(0.5,))
    )
    transcriber = Transcriber(loaded, options)
    with exceptions_marked(DtypeRecorder(), unmarked) as rec:
        rec.expected = policy.dtype
        with rec:
            result = transcriber.transcribe(str(path))
    assert any(s.words for s in result.segments)
    return rec


def test_every_listed_exception_is_needed(tmp_path):
    """Each float32 exception of dtypes.F32_EXCEPTIONS is one a bf16 run needs: left
    unmarked, a run that reaches it has float32 results where bf16 was expected. A short
    sampled run with word times reaches every one but the CPU kernels' float32 tiles
    (reached where the kernel plan chose them, and then needed too)."""
    import soundfile as sf

    from whisper_cli.audio import load_audio

    path = tmp_path / "clip.wav"
    sf.write(path, load_audio(shared_clip("jfk.flac"))[: 5 * 16000], 16000)
    marked = short_bf16_run(path)
    assert not marked.violations, dict(marked.violations)
    reached = set(marked.reached)
    assert reached <= set(dtypes.F32_EXCEPTIONS)
    assert set(dtypes.F32_EXCEPTIONS) - {"CPU kernels"} <= reached, reached
    for listed in sorted(reached):
        assert short_bf16_run(path, unmarked=listed).violations, f"{listed!r} is not needed"


def test_int8_exceptions_are_the_tensors_outside_the_run_dtype():
    """With int8 weights, the model's tensors that are not in the run dtype are exactly
    those dtypes.INT8_EXCEPTIONS lists: each quantized layer's int8 weight and its
    float32 scales, and nothing else."""
    from whisper_cli.quantize import Int8Linear

    kinds = {"int8 weights": ("weight", torch.int8), "int8 scales": ("weight_scale", torch.float32)}
    assert set(kinds) == set(dtypes.INT8_EXCEPTIONS)
    policy = dtypes.resolve_policy("bf16", "cpu", "int8")
    model = load_model(str(real_model("tiny.en")), policy).model
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    outside = {name: t.dtype for name, t in tensors.items() if t.dtype != policy.dtype}
    layers = [path for path, module in model.named_modules() if isinstance(module, Int8Linear)]
    assert layers
    listed = {f"{layer}.{attr}": dtype for layer in layers for attr, dtype in kinds.values()}
    assert outside == listed


@pytest.mark.parametrize(
    ("name", "clip_seconds", "max_new_tokens", "word_timestamps", "quantize"),
    # f16 is slow on this CPU; the bf16 and f16 runs time their words too.
    [
        ("f32", None, 224, False, "none"),
        ("bf16", None, 224, True, "none"),
        ("f16", 5.0, 16, True, "none"),
        ("f32", None, 224, False, "int8"),
        ("bf16", None, 224, True, "int8"),
    ],
)
def test_every_tensor_of_a_run_has_the_chosen_dtype(
    recorder, name, clip_seconds, max_new_tokens, word_timestamps, quantize, tmp_path
):
    import soundfile as sf

    from whisper_cli.audio import load_audio
    from whisper_cli.quantize import Int8Linear

    policy = dtypes.resolve_policy(name, "cpu", quantize)
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
    loaded.model.decoder.new_caches = lambda *a, **k: (
        caches.append(new_caches(*a, **k)) or caches[-1]
    )
    recorder.expected = policy.dtype
    with recorder:
        result = transcriber.transcribe(str(path))

    # Parameters, buffers and every KV cache (self and cross attention); with int8 weights,
    # each Int8Linear's weight (int8) and weight_scale (float32) are the listed exceptions.
    model = loaded.model
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    int8 = {
        f"{path}.{attr}": dtype
        for path, module in model.named_modules()
        if isinstance(module, Int8Linear)
        for attr, dtype in (("weight", torch.int8), ("weight_scale", torch.float32))
    }
    assert bool(int8) == (quantize == "int8")
    for key, dtype in int8.items():
        assert tensors.pop(key).dtype == dtype, key
    assert {t.dtype for t in tensors.values()} == {policy.dtype}
    assert caches  # every decode's caches: self and cross attention, every layer
    kv = [t for c in caches for t in c.tensors()]
    assert len(kv) == len(caches) * 4 * loaded.config.decoder_layers
    assert {t.dtype for t in kv} == {policy.dtype}

    assert not recorder.violations, dict(recorder.violations)
    ops = {op for op, _ in recorder.seen}
    # The run really went through the model: convolutions, attention, matmuls, norms.
    # With int8 weights, the linear layers are the int8 kernels, whose results are recorded.
    linear = "linear" if quantize == "none" else "kernels._int8_"
    for op in ("conv1d", "layer_norm", linear, "index_copy_"):
        assert any(op in o for o in ops), (op, sorted(ops))
    # Attention by whichever kernel was chosen: SDPA, or the f32 tiles of matmul/blocked.
    assert any("scaled_dot_product" in o or "_attend_f32" in o for o in ops), sorted(ops)
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
        row = decode_mel(engine, mel, [None]).rows[0]
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


def tf32_flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def set_tf32(matmul: bool, cudnn: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = matmul
    torch.backends.cudnn.allow_tf32 = cudnn


@pytest.fixture
def tf32_on():
    """TF32 allowed for both cuBLAS and cuDNN, restored after the test (the flags are plain
    process state, settable without a GPU; monkeypatch cannot undo their descriptors)."""
    before = tf32_flags()
    set_tf32(True, True)
    yield
    set_tf32(*before)


@pytest.mark.usefixtures("tf32_on")
def test_f32_on_cuda_turns_tf32_off_and_other_runs_leave_it():
    others = ((torch.bfloat16, "cuda"), (torch.float16, "cuda"), (torch.float32, "cpu"))
    for dtype, device in others:
        dtypes.ieee_float32(dtypes.DtypePolicy(dtype, torch.device(device)))
        assert tf32_flags() == (True, True), (dtype, device)
    dtypes.ieee_float32(dtypes.DtypePolicy(torch.float32, torch.device("cuda")))
    assert tf32_flags() == (False, False)


@pytest.mark.usefixtures("tf32_on")
def test_load_model_applies_the_float32_precision(monkeypatch):
    """load_model is where it is set: a CUDA f32 policy cannot load here, so the CPU load
    is seen to hand its policy over (and, CPU, to leave the flags alone)."""
    import whisper_cli.loading as loading

    seen = []
    monkeypatch.setattr(loading, "ieee_float32", seen.append)
    policy = dtypes.resolve_policy("f32", "cpu")
    load_model(str(real_model("tiny.en")), policy)
    assert seen == [policy]
    assert tf32_flags() == (True, True)
