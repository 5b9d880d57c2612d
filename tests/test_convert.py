"""Tests for importing CTranslate2 Whisper directories (whisper_cli.tools.convert)."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from whisper_cli.errors import WhisperCliError
from whisper_cli.tools.convert import convert_ct2, is_ct2_dir, read_ct2_model

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO / "models"
JFK = REPO.parent / "shared" / "audio" / "jfk.flac"
IN_CI = os.environ.get("CI", "").lower() == "true"

# --- a minimal CTranslate2 writer (test helper) --------------------------------------------
# Written from the format description (CTranslate2's ModelSpec._serialize), independently of
# the reader under test, so that a shared misunderstanding cannot make both agree.

_CT2_DTYPE_IDS = {torch.float32: 0, torch.int8: 1, torch.int16: 2, torch.float16: 4}


def _ct2_string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def write_ct2_model_bin(
    path: Path,
    variables: dict[str, torch.Tensor],
    aliases: dict[str, str],
    *,
    version: int = 6,
    spec: str = "WhisperSpec",
) -> None:
    out = [struct.pack("<I", version), _ct2_string(spec), struct.pack("<I", 3)]
    out.append(struct.pack("<I", len(variables)))
    for name, value in sorted(variables.items()):
        data = value.contiguous().numpy().tobytes()
        out += [_ct2_string(name), struct.pack("<B", value.dim())]
        out += [struct.pack("<I", dim) for dim in value.shape]
        out += [struct.pack("<BI", _CT2_DTYPE_IDS[value.dtype], len(data)), data]
    out.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases.items():
        out += [_ct2_string(alias), _ct2_string(target)]
    path.write_bytes(b"".join(out))


def hf_to_ct2(state: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """Lay a Hugging Face Whisper state dict out as CTranslate2's WhisperSpec does."""
    dtype = state["model.decoder.embed_tokens.weight"].dtype
    ct2: dict[str, torch.Tensor] = {}

    def linear(ct2_scope: str, hf_scope: str) -> None:
        ct2[f"{ct2_scope}/weight"] = state[f"{hf_scope}.weight"]
        ct2[f"{ct2_scope}/bias"] = state[f"{hf_scope}.bias"]

    def norm(ct2_scope: str, hf_scope: str) -> None:
        ct2[f"{ct2_scope}/gamma"] = state[f"{hf_scope}.weight"]
        ct2[f"{ct2_scope}/beta"] = state[f"{hf_scope}.bias"]

    def fused(ct2_scope: str, hf_scopes: list[str]) -> None:
        # CTranslate2 fills the missing k_proj bias with zeros when it fuses.
        ct2[f"{ct2_scope}/weight"] = torch.cat([state[f"{s}.weight"] for s in hf_scopes])
        ct2[f"{ct2_scope}/bias"] = torch.cat(
            [
                state.get(f"{s}.bias", torch.zeros_like(state[f"{hf_scopes[-1]}.bias"]))
                for s in hf_scopes
            ]
        )

    def layer(ct2_scope: str, hf_scope: str, cross: bool) -> None:
        norm(f"{ct2_scope}/self_attention/layer_norm", f"{hf_scope}.self_attn_layer_norm")
        fused(
            f"{ct2_scope}/self_attention/linear_0",
            [f"{hf_scope}.self_attn.{p}_proj" for p in "qkv"],
        )
        linear(f"{ct2_scope}/self_attention/linear_1", f"{hf_scope}.self_attn.out_proj")
        if cross:
            norm(f"{ct2_scope}/attention/layer_norm", f"{hf_scope}.encoder_attn_layer_norm")
            linear(f"{ct2_scope}/attention/linear_0", f"{hf_scope}.encoder_attn.q_proj")
            fused(
                f"{ct2_scope}/attention/linear_1",
                [f"{hf_scope}.encoder_attn.{p}_proj" for p in "kv"],
            )
            linear(f"{ct2_scope}/attention/linear_2", f"{hf_scope}.encoder_attn.out_proj")
        norm(f"{ct2_scope}/ffn/layer_norm", f"{hf_scope}.final_layer_norm")
        linear(f"{ct2_scope}/ffn/linear_0", f"{hf_scope}.fc1")
        linear(f"{ct2_scope}/ffn/linear_1", f"{hf_scope}.fc2")

    linear("encoder/conv1", "model.encoder.conv1")
    linear("encoder/conv2", "model.encoder.conv2")
    ct2["encoder/position_encodings/encodings"] = state["model.encoder.embed_positions.weight"]
    norm("encoder/layer_norm", "model.encoder.layer_norm")
    ct2["decoder/embeddings/weight"] = state["model.decoder.embed_tokens.weight"]
    ct2["decoder/position_encodings/encodings"] = state["model.decoder.embed_positions.weight"]
    norm("decoder/layer_norm", "model.decoder.layer_norm")
    for side in ("encoder", "decoder"):
        pattern = re.compile(rf"model\.{side}\.layers\.(\d+)\.")
        count = 1 + max(int(m.group(1)) for k in state if (m := pattern.match(k)))
        for i in range(count):
            layer(f"{side}/layer_{i}", f"model.{side}.layers.{i}", cross=side == "decoder")
    ct2 = {name: value.to(dtype) for name, value in ct2.items()}

    # The scalar flags a real WhisperSpec file carries.
    int8, int16 = torch.int8, torch.int16
    ct2.update(
        {
            "encoder/num_heads": torch.tensor(heads, dtype=int16),
            "decoder/num_heads": torch.tensor(heads, dtype=int16),
            "decoder/activation": torch.tensor(3, dtype=int8),
            "decoder/alibi": torch.tensor(0, dtype=int8),
            "decoder/alignment_heads": torch.tensor(1, dtype=int16),
            "decoder/alignment_layer": torch.tensor(-1, dtype=int16),
            "decoder/pre_norm": torch.tensor(1, dtype=int8),
            "decoder/scale_embeddings": torch.tensor(0, dtype=int8),
            "decoder/start_from_zero_embedding": torch.tensor(0, dtype=int8),
        }
    )
    return ct2


# Special tokens of an English-only vocabulary, deliberately at unusual ids so that any
# hard-coded id in the converter would show up.
_SPECIALS = {
    "<|endoftext|>": 40,
    "<|startoftranscript|>": 41,
    "<|en|>": 42,
    "<|de|>": 43,
    "<|translate|>": 44,
    "<|transcribe|>": 45,
    "<|startofprev|>": 46,
    "<|notimestamps|>": 47,
}
_VOCAB_SIZE = 56
_HEADS = 2


def write_tokenizer(path: Path) -> None:
    vocab = {f"t{i}": i for i in range(40)}
    added = [{"id": i, "content": t, "special": True} for t, i in _SPECIALS.items()]
    path.write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}, "added_tokens": added}))


@pytest.fixture(scope="module")
def tiny_hf_model():
    config = transformers.WhisperConfig(
        vocab_size=_VOCAB_SIZE,
        num_mel_bins=8,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=_HEADS,
        decoder_attention_heads=_HEADS,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        max_source_positions=1500,
        max_target_positions=448,
        bos_token_id=40,
        eos_token_id=40,
        pad_token_id=40,
        decoder_start_token_id=41,
    )
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # init leaves biases at zero, which would hide swaps
            p.normal_(0, 0.2)
    return model.half()


def make_ct2_dir(root: Path, model, **overrides) -> Path:
    src = root / "ct2"
    src.mkdir()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    variables = hf_to_ct2(state, _HEADS)
    variables.update(overrides.pop("extra", {}))
    aliases = {"decoder/projection/weight": "decoder/embeddings/weight"}
    write_ct2_model_bin(src / "model.bin", variables, aliases, **overrides)
    write_tokenizer(src / "tokenizer.json")
    (src / "config.json").write_text(
        json.dumps(
            {
                "alignment_heads": [[1, 0], [1, 1]],
                "lang_ids": [42, 43],
                "suppress_ids": [1, 2, 44],
                "suppress_ids_begin": [7, 40],
            }
        )
    )
    return src


# --- (a) synthetic round trip ----------------------------------------------------------------


def test_round_trip_reproduces_every_tensor(tmp_path: Path, tiny_hf_model) -> None:
    src = make_ct2_dir(tmp_path, tiny_hf_model)
    dst = tmp_path / "hf"
    assert is_ct2_dir(src)
    convert_ct2(src, dst)

    expected = {k: v for k, v in tiny_hf_model.state_dict().items() if k != "proj_out.weight"}
    written = load_file(dst / "model.safetensors")
    assert set(written) == set(expected)
    for name, value in expected.items():
        assert written[name].dtype == torch.float16, name
        assert torch.equal(written[name], value), name
    assert sorted(p.name for p in dst.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "preprocessor_config.json",
        "tokenizer.json",
    ]
    assert not list(tmp_path.glob(".hf*")), "temporary directory left behind"


def test_round_trip_model_loads_and_matches(tmp_path: Path, tiny_hf_model) -> None:
    src = make_ct2_dir(tmp_path, tiny_hf_model)
    dst = tmp_path / "hf"
    convert_ct2(src, dst)

    loaded, info = transformers.WhisperForConditionalGeneration.from_pretrained(
        dst, output_loading_info=True, dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    features = torch.randn(1, 8, 3000)
    decoder_ids = torch.tensor([[41, 1, 2, 3]])
    reference = tiny_hf_model.float()
    try:
        with torch.no_grad():
            want = reference(features, decoder_input_ids=decoder_ids).logits
            got = loaded.eval()(features, decoder_input_ids=decoder_ids).logits
    finally:
        tiny_hf_model.half()
    torch.testing.assert_close(got, want)


def test_configs_use_ids_from_the_tokenizer(tmp_path: Path, tiny_hf_model) -> None:
    convert_ct2(make_ct2_dir(tmp_path, tiny_hf_model), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    features = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())

    assert config["model_type"] == "whisper"
    assert config["architectures"] == ["WhisperForConditionalGeneration"]
    assert (config["d_model"], config["encoder_layers"], config["decoder_layers"]) == (16, 2, 2)
    assert config["encoder_ffn_dim"] == config["decoder_ffn_dim"] == 24
    assert config["num_mel_bins"] == features["feature_size"] == 8
    assert config["vocab_size"] == _VOCAB_SIZE
    assert config["torch_dtype"] == "float16"
    assert config["eos_token_id"] == config["pad_token_id"] == 40
    assert config["decoder_start_token_id"] == 41
    assert config["suppress_tokens"] == [1, 2, 44]
    assert config["begin_suppress_tokens"] == [7, 40]

    assert generation["decoder_start_token_id"] == 41
    assert generation["eos_token_id"] == 40
    assert generation["no_timestamps_token_id"] == 47
    assert generation["prev_sot_token_id"] == 46
    assert generation["alignment_heads"] == [[1, 0], [1, 1]]
    assert generation["is_multilingual"] is False
    assert "lang_to_id" not in generation  # English-only: no language detection
    assert generation["max_length"] == 448

    assert features["sampling_rate"] == 16000
    assert (features["n_fft"], features["hop_length"], features["chunk_length"]) == (400, 160, 30)
    assert (features["n_samples"], features["nb_max_frames"]) == (480000, 3000)
    assert features["return_attention_mask"] is False
    transformers.WhisperFeatureExtractor.from_pretrained(tmp_path / "hf")


# --- (c) errors ------------------------------------------------------------------------------


def _assert_no_output(tmp_path: Path) -> None:
    assert not (tmp_path / "hf").exists()
    assert not list(tmp_path.glob(".hf*")), "temporary directory left behind"


def test_missing_model_bin(tmp_path: Path, tiny_hf_model) -> None:
    src = make_ct2_dir(tmp_path, tiny_hf_model)
    (src / "model.bin").unlink()
    assert not is_ct2_dir(src)
    with pytest.raises(WhisperCliError, match=r"missing model\.bin"):
        convert_ct2(src, tmp_path / "hf")
    _assert_no_output(tmp_path)


def test_missing_tokenizer(tmp_path: Path, tiny_hf_model) -> None:
    src = make_ct2_dir(tmp_path, tiny_hf_model)
    (src / "tokenizer.json").unlink()
    with pytest.raises(WhisperCliError, match=r"missing tokenizer\.json"):
        convert_ct2(src, tmp_path / "hf")


@pytest.mark.parametrize("keep", [3, 20, 5000, -1])
def test_truncated_model_bin(tmp_path: Path, tiny_hf_model, keep: int) -> None:
    src = make_ct2_dir(tmp_path, tiny_hf_model)
    data = (src / "model.bin").read_bytes()
    (src / "model.bin").write_bytes(data[:keep])
    with pytest.raises(WhisperCliError, match=r"model\.bin is truncated"):
        convert_ct2(src, tmp_path / "hf")
    _assert_no_output(tmp_path)


def test_bad_header(tmp_path: Path, tiny_hf_model) -> None:
    src = make_ct2_dir(tmp_path, tiny_hf_model, version=99)
    with pytest.raises(WhisperCliError, match=r"bad header: binary version 99"):
        convert_ct2(src, tmp_path / "hf")


def test_other_spec_is_rejected(tmp_path: Path, tiny_hf_model) -> None:
    src = make_ct2_dir(tmp_path, tiny_hf_model, spec="TransformerSpec")
    assert is_ct2_dir(src)
    with pytest.raises(WhisperCliError, match="'TransformerSpec', not a Whisper model"):
        convert_ct2(src, tmp_path / "hf")


def test_unknown_variable(tmp_path: Path, tiny_hf_model) -> None:
    extra = {"decoder/layer_0/mystery/weight": torch.zeros(2, dtype=torch.float16)}
    src = make_ct2_dir(tmp_path, tiny_hf_model, extra=extra)
    with pytest.raises(WhisperCliError, match=r"unknown variable\(s\): decoder/layer_0/mystery"):
        convert_ct2(src, tmp_path / "hf")
    _assert_no_output(tmp_path)


def test_flag_that_changes_the_math(tmp_path: Path, tiny_hf_model) -> None:
    extra = {"decoder/scale_embeddings": torch.tensor(1, dtype=torch.int8)}
    src = make_ct2_dir(tmp_path, tiny_hf_model, extra=extra)
    with pytest.raises(WhisperCliError, match="decoder/scale_embeddings is 1"):
        convert_ct2(src, tmp_path / "hf")


def test_quantized_weights_are_refused(tmp_path: Path, tiny_hf_model) -> None:
    extra = {"encoder/conv1/weight": torch.zeros(16, 8, 3, dtype=torch.int8)}
    src = make_ct2_dir(tmp_path, tiny_hf_model, extra=extra)
    with pytest.raises(WhisperCliError, match=r"encoder/conv1/weight is torch\.int8"):
        convert_ct2(src, tmp_path / "hf")


def test_existing_destination(tmp_path: Path, tiny_hf_model) -> None:
    src = make_ct2_dir(tmp_path, tiny_hf_model)
    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "old").write_text("x")
    with pytest.raises(WhisperCliError, match="already exists"):
        convert_ct2(src, dst)
    convert_ct2(src, dst, overwrite=True)
    assert (dst / "model.safetensors").is_file() and not (dst / "old").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2", "hf"]


# --- (b) the real models -------------------------------------------------------------------

# (directory, multilingual, the ids HF ships for openai/whisper-<name>)
REAL_MODELS = {
    "tiny.en": (False, {"eot": 50256, "sot": 50257, "no_timestamps": 50362, "prev_sot": 50360}),
    "base": (True, {"eot": 50257, "sot": 50258, "no_timestamps": 50363, "prev_sot": 50361}),
}


def real_model_dir(name: str) -> Path:
    path = MODELS_DIR / name
    if not (path / "model.safetensors").is_file():
        reason = f"{path} missing; run `make models` (scripts/fetch_models.py)"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    return path


@pytest.fixture(scope="module")
def jfk_features():
    if not JFK.is_file():
        reason = f"{JFK} missing (../shared/audio beside the checkout)"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    import soundfile
    import soxr

    audio, rate = soundfile.read(JFK, dtype="float32", always_2d=True)
    mono = audio.mean(axis=1)
    return soxr.resample(mono, rate, 16000).astype(np.float32)


@pytest.mark.parametrize("name", REAL_MODELS)
def test_real_model_ids(name: str) -> None:
    from tokenizers import Tokenizer

    path = real_model_dir(name)
    multilingual, ids = REAL_MODELS[name]
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    generation = transformers.GenerationConfig.from_pretrained(path)

    assert tokenizer.token_to_id("<|endoftext|>") == ids["eot"]
    assert tokenizer.token_to_id("<|startoftranscript|>") == ids["sot"]
    assert generation.eos_token_id == generation.pad_token_id == ids["eot"]
    assert generation.decoder_start_token_id == ids["sot"]
    assert generation.no_timestamps_token_id == ids["no_timestamps"]
    assert generation.prev_sot_token_id == ids["prev_sot"]
    assert generation.is_multilingual is multilingual
    assert generation.begin_suppress_tokens == [220, ids["eot"]]
    assert generation.max_length == 448
    if multilingual:
        assert generation.lang_to_id["<|en|>"] == tokenizer.token_to_id("<|en|>") == 50259
        assert len(generation.lang_to_id) == 99
        assert generation.task_to_id == {"transcribe": 50359, "translate": 50358}
    else:
        assert not hasattr(generation, "lang_to_id")


@pytest.mark.parametrize("name", REAL_MODELS)
def test_real_model_transcribes_jfk(name: str, jfk_features) -> None:
    from tokenizers import Tokenizer

    path = real_model_dir(name)
    model, info = transformers.WhisperForConditionalGeneration.from_pretrained(
        path, output_loading_info=True, dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    # proj_out comes from the tie, not from the file.
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()

    extractor = transformers.WhisperFeatureExtractor.from_pretrained(path)
    features = extractor(jfk_features, sampling_rate=16000, return_tensors="pt").input_features
    with torch.no_grad():
        tokens = model.eval().generate(features)
    text = Tokenizer.from_file(str(path / "tokenizer.json")).decode(
        tokens[0].tolist(), skip_special_tokens=True
    )
    assert "ask not what your country can do for you" in text.lower(), text


def test_real_model_bin_is_fp16() -> None:
    """The CTranslate2 source of tiny.en, when the fetch cache is there."""
    source = REPO / ".cache" / "ct2" / "tiny.en" / "model.bin"
    if not source.is_file():
        pytest.skip(f"{source} missing")
    model = read_ct2_model(source)
    assert (model.spec_name, model.spec_revision, model.binary_version) == ("WhisperSpec", 3, 6)
    assert model.variables["decoder/embeddings/weight"].dtype == torch.float16
    assert model.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    key_bias = model.variables["encoder/layer_0/self_attention/linear_0/bias"][384:768]
    assert not key_bias.any()  # CTranslate2 zero-fills the bias HF's k_proj lacks
