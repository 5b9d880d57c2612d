"""Strict, checked loading: every problem with a model directory is a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from util import make_random_model, real_tokenizer

from whisper_cli import loading
from whisper_cli.dtypes import DtypePolicy, resolve_policy
from whisper_cli.errors import WhisperCliError
from whisper_cli.loading import load_model, resolve_model

F32 = resolve_policy("f32", "cpu")
BF16 = resolve_policy("bf16", "cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("random")
    return make_random_model(root / "m", real_tokenizer("tiny.en"), vocab_size=51864, d_model=32)


@pytest.fixture
def broken(model_dir, tmp_path) -> Path:
    out = tmp_path / "broken"
    shutil.copytree(model_dir, out)
    return out


def edit_weights(path: Path, change) -> None:
    state = load_file(path / "model.safetensors")
    change(state)
    save_file(state, path / "model.safetensors")


def test_loads_and_casts_once(model_dir):
    loaded = load_model(str(model_dir), BF16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model.device.type == "cpu"


def test_a_load_draws_no_random_values(model_dir, monkeypatch):
    """Every layer with a random init at construction (nn.Embedding, nn.Linear,
    nn.Conv1d) is a model.FromCheckpoint: the load draws nothing that the strict load
    then overwrites."""
    drawn = []
    for name in ("normal_", "uniform_", "kaiming_uniform_"):
        real = getattr(torch.nn.init, name)
        monkeypatch.setattr(
            torch.nn.init, name, lambda *a, _n=name, _f=real, **k: drawn.append(_n) or _f(*a, **k)
        )
    loaded = load_model(str(model_dir), F32)
    assert drawn == [] and loaded.model.encoder.conv1.weight.device.type == "cpu"


def test_f16_checkpoint_loads_into_f32(tmp_path):
    d = make_random_model(
        tmp_path / "h", real_tokenizer("tiny.en"), vocab_size=51864, d_model=32, dtype="float16"
    )
    assert load_file(d / "model.safetensors")["model.decoder.layer_norm.weight"].dtype == (
        torch.float16
    )
    loaded = load_model(str(d), F32)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}


def test_int8_from_a_float32_checkpoint_keeps_the_token_embedding(model_dir):
    """The embedding is both the decoder's input table (cast: the checkpoint's own tensor
    in f32) and the int8 output projection's source; quantizing must not touch it."""
    loaded = load_model(str(model_dir), resolve_policy("f32", "cpu", "int8"))
    embedding = load_file(model_dir / "model.safetensors")["model.decoder.embed_tokens.weight"]
    assert embedding.dtype == torch.float32
    assert torch.equal(loaded.model.decoder.embed_tokens.weight, embedding)


def test_missing_key_is_named(broken):
    edit_weights(broken, lambda s: s.pop("model.decoder.layers.1.fc2.bias"))
    with pytest.raises(WhisperCliError, match=r"missing key\(s\): decoder.layers.1.fc2.bias"):
        load_model(str(broken), F32)


def test_unexpected_key_is_named(broken):
    edit_weights(broken, lambda s: s.update({"model.encoder.extra.weight": torch.zeros(2)}))
    with pytest.raises(WhisperCliError, match=r"unexpected key\(s\): encoder.extra.weight"):
        load_model(str(broken), F32)


def test_shape_mismatch_is_named(broken):
    def change(state):
        state["model.encoder.conv1.bias"] = torch.zeros(7)

    edit_weights(broken, change)
    with pytest.raises(WhisperCliError, match=r"shape mismatch for encoder.conv1.bias"):
        load_model(str(broken), F32)


def test_untied_output_projection_is_refused(broken):
    edit_weights(
        broken,
        lambda s: s.update(
            {"proj_out.weight": torch.ones_like(s["model.decoder.embed_tokens.weight"])}
        ),
    )
    with pytest.raises(WhisperCliError, match=r"proj_out\.weight is not tied"):
        load_model(str(broken), F32)


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        ("tokenizer.json", "has no tokenizer.json"),
        ("model.safetensors", "is missing model weights"),
        ("config.json", "is missing config.json"),
    ],
)
def test_missing_file_is_named(broken, missing, message):
    (broken / missing).unlink()
    with pytest.raises(WhisperCliError, match=message):
        load_model(str(broken), F32)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "malformed .*config.json"),
        ({"d_model": "wide"}, "'d_model' must be a positive integer, got 'wide'"),
        ({"decoder_attention_heads": 5}, "not divisible by decoder_attention_heads 5"),
        ('{"model_type": "bert"}', "not a Whisper model"),
    ],
)
def test_malformed_config_is_named(broken, text, message):
    if isinstance(text, dict):  # one field of the real config changed
        text = json.dumps(json.loads((broken / "config.json").read_text()) | text)
    (broken / "config.json").write_text(text)
    with pytest.raises(WhisperCliError, match=message):
        load_model(str(broken), F32)


def test_sharded_safetensors_and_pytorch_bin(model_dir, tmp_path):
    state = load_file(model_dir / "model.safetensors")
    keys = sorted(state)
    sharded = tmp_path / "sharded"
    shutil.copytree(model_dir, sharded)
    (sharded / "model.safetensors").unlink()
    halves = {"a.safetensors": keys[::2], "b.safetensors": keys[1::2]}
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, sharded / name)
    index = {"weight_map": {k: name for name, part in halves.items() for k in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    legacy = tmp_path / "legacy"
    shutil.copytree(model_dir, legacy)
    (legacy / "model.safetensors").unlink()
    torch.save(state, legacy / "pytorch_model.bin")
    reference = load_model(str(model_dir), F32).model.state_dict()
    for path in (sharded, legacy):
        got = load_model(str(path), F32).model.state_dict()
        assert all(torch.equal(got[k], reference[k]) for k in reference)


def test_hub_id_downloads_through_huggingface_hub(model_dir, monkeypatch):
    """The network edge is mocked: a cache miss, then a download into the hub cache."""
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns, local_files_only):
        calls.append((repo_id, local_files_only))
        if local_files_only:
            raise FileNotFoundError("not in cache")
        return str(model_dir)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model("openai/whisper-tiny.en") == model_dir
    assert calls[0] == ("openai/whisper-tiny.en", True)
    assert ("openai/whisper-tiny.en", False) in calls


def test_alias_prefers_imported_model_then_names_alternatives(monkeypatch, tmp_path, model_dir):
    import huggingface_hub

    def offline(repo_id, allow_patterns, local_files_only):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WHISPER_CLI_HOME", str(tmp_path / "home"))
    with pytest.raises(WhisperCliError, match=r"--model DIR.*make models"):
        resolve_model("small.en")
    shutil.copytree(model_dir, tmp_path / "models" / "small.en")
    assert resolve_model("small.en") == Path("models") / "small.en"
    with pytest.raises(WhisperCliError, match="unknown model 'nope'"):
        resolve_model("nope")
    assert loading.ALIASES["turbo"] == "openai/whisper-large-v3-turbo"


@pytest.mark.parametrize(("device", "expected"), [("cuda", "turbo"), ("cpu", "base")])
def test_no_model_name_loads_the_default_of_the_policys_device(monkeypatch, device, expected):
    """The one place a run without --model gets its model: where it loads, for that device
    (a Ray worker on a GPU node gets turbo although its driver has no GPU)."""
    asked: list[str] = []

    def resolve(name: str) -> Path:
        asked.append(name)
        raise WhisperCliError("stop here")

    monkeypatch.setattr(loading, "resolve_model", resolve)
    policy = DtypePolicy(torch.float32, torch.device(device))
    with pytest.raises(WhisperCliError, match="stop here"):
        load_model(None, policy)
    assert asked == [expected]
