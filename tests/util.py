"""Shared test helpers: paths to real data, random-weight Hugging Face model dirs, and
scripts/ imported as modules."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_AUDIO = REPO.parent / "shared" / "audio"
MODELS = REPO / "models"
IN_CI = os.environ.get("CI", "").lower() == "true"


@contextmanager
def script_module(name: str) -> Iterator[ModuleType]:
    """scripts/<name>.py imported as module `name` while the block runs (registered in
    sys.modules: a script's dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


def jsonl_records(text: str) -> list[dict]:
    """The json documents of a jsonl output, rebuilt from its lines: each input's
    "segment" lines (in order) go into the "segments" of its "transcript" line."""
    records, segments = [], {}
    for line in text.splitlines():
        item = json.loads(line)
        kind, path = item.pop("type"), item["path"]
        if kind == "segment":
            del item["path"]
            segments.setdefault(path, []).append(item)
        else:
            assert kind == "transcript", kind
            records.append(item | {"segments": segments.pop(path, [])})
    assert not segments, f"segments of no transcript: {list(segments)}"
    return records


def require(path: Path, why: str) -> Path:
    """`path` if it exists; else skip (locally) or fail (under CI=true, where it must exist)."""
    if path.exists():
        return path
    message = f"{path} is missing ({why})"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def shared_clip(name: str) -> Path:
    return require(SHARED_AUDIO / name, "real speech from ../shared/audio")


def manifest() -> dict:
    return json.loads(shared_clip("manifest.json").read_text())


def real_model(name: str) -> Path:
    return require(MODELS / name / "model.safetensors", "run `make models`").parent


# Tokenizers of the real imported models: 51864 (tiny.en) and 51865 (base) vocabularies.
def real_tokenizer(name: str) -> Path:
    return require(MODELS / name / "tokenizer.json", "run `make models`")


def shifted_tokenizer(src: Path, dst: Path) -> Path:
    """A large-v3 style tokenizer (vocab 51866): one more language, specials shifted by one."""
    data = json.loads(src.read_text())
    added = data["added_tokens"]
    translate = next(t["id"] for t in added if t["content"] == "<|translate|>")
    for token in added:
        if token["id"] >= translate:
            token["id"] += 1
    added.append({**added[0], "id": translate, "content": "<|yue|>"})
    added.sort(key=lambda t: t["id"])
    dst.write_text(json.dumps(data))
    return dst


def make_random_model(
    out: Path,
    tokenizer: Path,
    *,
    vocab_size: int,
    num_mel_bins: int = 80,
    d_model: int = 64,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """A random-weight HF Whisper directory that transformers and whisper-cli both load."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from whisper_cli.tokenizer import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer.read_text())
    special = Tokenizer(out / "tokenizer.json", multilingual=vocab_size >= 51865).special
    config = WhisperConfig(
        vocab_size=vocab_size,
        num_mel_bins=num_mel_bins,
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=4 * d_model,
        decoder_ffn_dim=4 * d_model,
        max_source_positions=1500,
        max_target_positions=448,
        bos_token_id=special.eot,
        eos_token_id=special.eot,
        pad_token_id=special.eot,
        decoder_start_token_id=special.sot,
        suppress_tokens=[1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60],
        begin_suppress_tokens=[220, special.eot],
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    # Random init gives near-uniform logits; sharpen them so greedy choices are stable.
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight.mul_(8.0)
        model.model.decoder.embed_positions.weight.normal_(0.0, 1.0)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    generation = {
        "decoder_start_token_id": special.sot,
        "eos_token_id": special.eot,
        "pad_token_id": special.eot,
        "bos_token_id": special.eot,
        "suppress_tokens": config.suppress_tokens,
        "begin_suppress_tokens": config.begin_suppress_tokens,
        "no_timestamps_token_id": special.no_timestamps,
        "max_initial_timestamp_index": 50,
        "max_length": 448,
        "is_multilingual": vocab_size >= 51865,
        "task_to_id": {"transcribe": special.transcribe, "translate": special.translate},
    }
    if vocab_size >= 51865:
        tok = Tokenizer(out / "tokenizer.json", multilingual=True)
        generation["lang_to_id"] = {f"<|{c}|>": i for c, i in tok.language_ids.items()}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out


def decode_mel(engine, mel, languages, **row):
    """The engine's Decoded of a log-mel batch (B, n_mels, 3000), one language per row:
    the mel is encoded first and each row handed its encoder output (`row`: further
    WindowInput fields, the same for every row)."""
    import numpy as np

    from whisper_cli.engine import WindowInput

    features = engine.encode(mel)
    silent = np.zeros(0, np.float32)
    inputs = [
        WindowInput(silent, features=f, language=lang, **row)
        for f, lang in zip(features, languages, strict=True)
    ]
    return engine.run(inputs)
