"""Model and generation settings read from a Hugging Face Whisper directory."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from whisper_cli.errors import WhisperCliError
from whisper_cli.tokenizer import TIME_PRECISION

# English-only vocabularies have 51864 tokens, multilingual ones 51865 (51866 from large-v3).
MULTILINGUAL_VOCAB_SIZE = 51865
# A window's first timestamp is at most this far in (openai-whisper's
# max_initial_timestamp, in seconds), and as a timestamp token's index (50).
MAX_INITIAL_TIMESTAMP = 1.0
MAX_INITIAL_TIMESTAMP_INDEX = round(MAX_INITIAL_TIMESTAMP / TIME_PRECISION)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a model directory, with errors that name the file."""
    if not path.is_file():
        raise WhisperCliError(f"model directory {path.parent} has no {path.name}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WhisperCliError(f"malformed {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise WhisperCliError(f"malformed {path}: expected a JSON object")
    return data


@dataclass(frozen=True)
class ModelConfig:
    """Every shape of the network; all of it comes from config.json."""

    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_layers: int
    decoder_attention_heads: int
    decoder_ffn_dim: int
    vocab_size: int
    max_source_positions: int  # encoder frames after the stride-2 conv (1500 for 30 s)
    max_target_positions: int  # decoder text context (448)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config.json") -> ModelConfig:
        if data.get("model_type") not in (None, "whisper"):
            raise WhisperCliError(
                f"{source}: model_type is {data.get('model_type')!r}, not a Whisper model"
            )
        values = {}
        for f in fields(cls):
            value = data.get(f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise WhisperCliError(
                    f"malformed {source}: {f.name!r} must be a positive integer, got {value!r}"
                )
            values[f.name] = value
        cfg = cls(**values)
        for side in ("encoder", "decoder"):
            heads = getattr(cfg, f"{side}_attention_heads")
            if cfg.d_model % heads:
                raise WhisperCliError(
                    f"malformed {source}: d_model {cfg.d_model} is not divisible by "
                    f"{side}_attention_heads {heads}"
                )
        return cfg

    @classmethod
    def load(cls, model_dir: Path) -> ModelConfig:
        path = model_dir / "config.json"
        return cls.from_dict(read_json(path), str(path))

    @property
    def n_audio_samples(self) -> int:
        # The encoder sees 2 * max_source_positions mel frames, 160 samples each.
        return self.max_source_positions * 2 * 160


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings from generation_config.json (falling back to config.json)."""

    suppress_tokens: tuple[int, ...]
    begin_suppress_tokens: tuple[int, ...]
    max_initial_timestamp_index: int
    alignment_heads: tuple[tuple[int, int], ...]
    is_multilingual: bool | None

    @classmethod
    def load(cls, model_dir: Path) -> GenerationConfig:
        gen_path = model_dir / "generation_config.json"
        data = read_json(model_dir / "config.json")
        if gen_path.is_file():
            data = {**data, **read_json(gen_path)}
        try:
            return cls(
                suppress_tokens=tuple(int(t) for t in data.get("suppress_tokens") or ()),
                begin_suppress_tokens=tuple(
                    int(t) for t in data.get("begin_suppress_tokens") or ()
                ),
                max_initial_timestamp_index=int(
                    data.get("max_initial_timestamp_index", MAX_INITIAL_TIMESTAMP_INDEX)
                ),
                alignment_heads=tuple(
                    (int(a), int(b)) for a, b in data.get("alignment_heads") or ()
                ),
                is_multilingual=data.get("is_multilingual"),
            )
        except (TypeError, ValueError) as exc:
            raise WhisperCliError(f"malformed {gen_path}: {exc}") from exc
