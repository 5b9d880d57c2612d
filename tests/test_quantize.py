"""`--quantize int8`: the model's linear layers with int8 weights, on the real models.

Tolerances, stated once: teacher-forced over the shared clips' reference words, each int8
kernel's logits are within REL_ERR_ACTIVATIONS (kernels that quantize the activations per
row on 7 bits), REL_ERR_WIDE (on 8 bits, where kernels.activation_grid probed it exact) or
REL_ERR_WEIGHT_ONLY (kernels that keep them) of the f32 model's, relative (Frobenius
norm), and pick the f32 model's token at AGREEMENT of the positions or more; the kernels the
plan chooses transcribe the English clips at a pooled WER of at most MAX_WER.
"""

from __future__ import annotations

import json

import pytest
import torch
from util import manifest, real_model, shared_clip

from whisper_cli import dtypes, kernels
from whisper_cli.errors import WhisperCliError
from whisper_cli.loading import load_model, plan_kernels, run_reach
from whisper_cli.model import Extent, Linear
from whisper_cli.options import TranscribeOptions

REL_ERR_ACTIVATIONS = 0.10  # "fbgemm", "onednn", "dot" on kernels.NARROW_GRID
REL_ERR_WIDE = 0.05  # on kernels.WIDE_GRID (measured 0.019-0.027 base, 0.035-0.042 tiny.en)
REL_ERR_WEIGHT_ONLY = 0.04  # "dequant", "weight-only"
AGREEMENT = 0.9
MAX_WER = 0.05


@pytest.fixture
def kernels_mode(monkeypatch, tmp_path):
    """`kernels_mode(mode)`: WHISPER_CLI_KERNELS for the models loaded after it (with a
    cache file of the test's own)."""
    monkeypatch.setenv("WHISPER_CLI_KERNELS_CACHE", str(tmp_path / "kernels.json"))

    def use(mode: str) -> None:
        monkeypatch.setenv("WHISPER_CLI_KERNELS", mode)

    return use


def int8_model(name: str, dtype: str = "f32"):
    return load_model(str(real_model(name)), dtypes.resolve_policy(dtype, "cpu", "int8"))


def english_cases() -> list[tuple[str, str | None, str]]:
    clips = {c["file"]: c for c in manifest()["clips"]}
    diar = clips["stereo_diarization.wav"]
    return [
        ("jfk.flac", None, clips["jfk.flac"]["reference"]),
        ("stereo_diarization.wav", "left", diar["reference_left"]),
        ("stereo_diarization.wav", "right", diar["reference_right"]),
    ]


def teacher_forced(loaded, cases) -> list[torch.Tensor]:
    """Logits (T, V) of each clip's prompt and reference words, in float64."""
    from whisper_cli.audio import load_audio
    from whisper_cli.dtypes import encoder_input
    from whisper_cli.features import batch_log_mel

    model, tok = loaded.model, loaded.tokenizer
    language = "en" if tok.is_multilingual else None
    out = []
    for name, channel, text in cases:
        audio = load_audio(shared_clip(name), channel=channel)
        tokens = torch.tensor([tok.prompt(language, "transcribe", False) + tok.encode_text(text)])
        t = tokens.shape[1]
        with torch.inference_mode():
            mel = batch_log_mel([audio], 1, loaded.config.num_mel_bins, torch.device("cpu"))
            features = model.encoder(encoder_input(mel, model.dtype))
            caches = model.decoder.new_caches(features, t)
            out.append(model.decoder(tokens, torch.arange(t), caches, Extent(t))[0].double())
    return out


def test_every_linear_layer_is_int8_and_the_rest_keeps_the_dtype():
    from whisper_cli.quantize import Int8Linear

    loaded = int8_model("tiny.en", "bf16")
    model = loaded.model
    assert not any(type(m) is Linear for m in model.modules())
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    cfg = loaded.config
    # Per layer: q, k, v, out and fc1, fc2 (encoder); twice the attention (decoder); + proj_out.
    assert len(layers) == 6 * cfg.encoder_layers + 10 * cfg.decoder_layers + 1
    proj = model.decoder.proj_out
    assert isinstance(proj, Int8Linear) and proj.bias is None
    embedding = model.decoder.embed_tokens.weight
    assert proj.weight.shape == embedding.shape and embedding.dtype == torch.bfloat16
    tensors = [*model.parameters(), *model.buffers()]
    assert not any(t.is_meta for t in tensors)  # every placeholder of a cast was replaced
    for layer in layers:
        assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == torch.float32
        assert layer.bias is None or layer.bias.dtype == torch.bfloat16
    # The int8 values come from the checkpoint, not from the run dtype's copy: f32 and bf16
    # runs hold the same ones.
    f32 = int8_model("tiny.en", "f32").model
    torch.testing.assert_close(f32.decoder.proj_out.weight, proj.weight, rtol=0, atol=0)
    q = f32.encoder.layers[0].fc1
    torch.testing.assert_close(q.weight, model.encoder.layers[0].fc1.weight, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["tiny.en", "base"])
def test_int8_logits_follow_f32_with_every_kernel(model_name, kernels_mode):
    """Each int8 implementation, forced, against the f32 model (reference kernels)."""
    cases = english_cases()
    kernels_mode("reference")
    f32 = teacher_forced(
        load_model(str(real_model(model_name)), dtypes.resolve_policy("f32", "cpu")), cases
    )
    loaded = int8_model(model_name)
    reach = run_reach(TranscribeOptions(batch_size=1), loaded.config, loaded.tokenizer)
    for name in kernels.int8_candidates(torch.float32):
        plan = plan_kernels(loaded.model, loaded.policy, reach, mode=name)
        for cls, choice in plan.choices.items():  # forced where offered, else the reference
            if cls.startswith("int8-"):
                offered = name in kernels.int8_candidates(torch.float32, cls.split("/")[-1])
                assert choice == (name if offered else "dequant"), (name, cls)
        assert name in plan.choices.values()
        bound = REL_ERR_WEIGHT_ONLY
        if name in kernels.QUANTIZING:
            wide = kernels.activation_grid(name) == kernels.WIDE_GRID
            bound = REL_ERR_WIDE if wide else REL_ERR_ACTIVATIONS
        ours = teacher_forced(loaded, cases)
        for (clip, channel, _), out, ref in zip(cases, ours, f32, strict=True):
            err = ((out - ref).norm() / ref.norm()).item()
            agree = (out.argmax(-1) == ref.argmax(-1)).double().mean().item()
            assert err <= bound, (name, clip, channel, err)
            assert agree >= AGREEMENT, (name, clip, channel, agree)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["tiny.en", "base"])
def test_int8_transcribes_the_english_clips(model_name, kernels_mode):
    """The kernels the plan chooses (timed here), through eval: WER within MAX_WER."""
    from util import SHARED_AUDIO

    from whisper_cli.tools.evaluate import evaluate_loaded, read_manifest

    kernels_mode("auto")
    items = read_manifest(SHARED_AUDIO / "manifest.json").items
    items = [i for i in items if i.languages == ("en",)]
    assert len(items) == 3
    loaded = int8_model(model_name)
    result = evaluate_loaded(items, loaded, 16, None, 0.0, True)
    assert result.wer <= MAX_WER, [(s.name, s.hypothesis) for s in result.items]
    plan = loaded.model.plan
    chosen = {choice for name, choice in plan.choices.items() if name.startswith("int8-")}
    assert chosen <= set(kernels.int8_candidates(torch.float32)) and chosen
    assert plan.mode == "auto" and plan.timed


def test_int8_on_cuda_is_refused_naming_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    with pytest.raises(WhisperCliError, match="--quantize int8 runs on the CPU only") as err:
        dtypes.resolve_policy("auto", "cuda", "int8")
    assert "--device cpu" in err.value.message
    with pytest.raises(WhisperCliError, match="--quantize int8 runs on the CPU only"):
        dtypes.resolve_policy("f32", "auto", "int8")  # auto is CUDA where there is one
    assert dtypes.resolve_policy("bf16", "cuda").quantize == "none"
    with pytest.raises(WhisperCliError, match="invalid quantize 'int4'"):
        dtypes.resolve_policy("f32", "cpu", "int4")


def test_the_flag_reaches_the_policy(monkeypatch):
    from typer.testing import CliRunner

    import whisper_cli.cli as cli

    seen = []

    def refuse(name, device=None, quantize="none"):
        seen.append(quantize)
        raise WhisperCliError("stop here")

    monkeypatch.setattr(dtypes, "resolve_policy", refuse)
    jfk = str(shared_clip("jfk.flac"))
    result = CliRunner().invoke(cli.app, ["transcribe", jfk, "--quantize", "int8"])
    assert "stop here" in result.stderr and seen == ["int8"]


def test_each_int8_layer_holds_the_forms_its_plan_chose_and_a_forward_makes_none(
    kernels_mode, tmp_path, monkeypatch
):
    """Through load_model: a kernel cache that names the weight-only kernel for layers over
    text tokens and oneDNN for layers over audio frames; every layer holds the form of
    exactly its own choice (the encoder's and the cross-attention keys' and values' layers
    oneDNN's, the decoder's others and the projection the bfloat16 scales), and a forward
    pass hands the kernels those, making none."""
    from whisper_cli.audio import load_audio
    from whisper_cli.dtypes import encoder_input
    from whisper_cli.features import batch_log_mel
    from whisper_cli.quantize import Int8Linear

    # A cache of this machine's classes, written by a load whose timings are all alike (the
    # reference kept), then rewritten for the int8 classes.
    kernels_mode("auto")
    cache = tmp_path / "kernels.json"
    with monkeypatch.context() as patch:
        patch.setattr(
            kernels, "time_candidates", lambda runs, before=None: {n: (1.0, True) for n in runs}
        )
        int8_model("tiny.en")
    data = json.loads(cache.read_text())
    rows_of = {"tokens": "weight-only", "frames": "onednn", "vocab": "weight-only"}
    for key, entry in data["entries"].items():
        if "|int8-linear/" in key:
            entry["choice"] = rows_of[key.split("/")[-1]]
    cache.write_text(json.dumps(data))

    loaded = int8_model("tiny.en")
    model = loaded.model
    assert not model.plan.timed  # every choice read from the cache above
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Int8Linear)}
    for name, layer in layers.items():
        cross_kv = name.endswith(("encoder_attn.k_proj", "encoder_attn.v_proj"))
        frames = name.startswith("encoder.") or cross_kv
        rows = "vocab" if name == "decoder.proj_out" else "frames" if frames else "tokens"
        assert layer.rows == rows, name
        assert set(layer.forms) == {rows_of[layer.rows]}, name
    assert sum(layer.rows == "tokens" for layer in layers.values()) > 0
    held = {id(form) for layer in layers.values() for form in layer.forms.values()}

    ran = []

    def recording(name, kernel):
        def run(x, weight, scale, bias, prepared=None, out=None):
            ran.append((name, prepared))
            return kernel(x, weight, scale, bias, prepared, out)

        return run

    for name, kernel in list(kernels.INT8_LINEAR.items()):
        monkeypatch.setitem(kernels.INT8_LINEAR, name, recording(name, kernel))
    made = []
    monkeypatch.setattr(kernels, "int8_form", lambda *args: made.append(args))
    tok = loaded.tokenizer
    tokens = torch.tensor([tok.prompt(None, "transcribe", False)])  # weight-only
    t = tokens.shape[1]
    with torch.inference_mode():
        mel = batch_log_mel([load_audio(shared_clip("jfk.flac"))], 1, 80, torch.device("cpu"))
        features = model.encoder(encoder_input(mel, model.dtype))  # 1500 rows: oneDNN, tiled
        caches = model.decoder.new_caches(features, t)
        model.decoder(tokens, torch.arange(t), caches, Extent(t))
    assert not made
    assert {name for name, _ in ran} == {"weight-only", "onednn"}
    assert all(id(prepared) in held for _, prepared in ran)
