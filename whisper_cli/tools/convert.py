"""Import CTranslate2 (faster-whisper) Whisper model directories into the Hugging Face layout.

A CTranslate2 Whisper directory holds ``model.bin`` (every weight in one binary file),
``config.json`` (suppress lists, alignment heads) and ``tokenizer.json``. The output is the
directory ``transformers.WhisperForConditionalGeneration.save_pretrained`` would write:
``config.json``, ``generation_config.json``, ``preprocessor_config.json``, ``tokenizer.json``
and ``model.safetensors``, with the weights in the dtype they were stored in.

The ``model.bin`` layout (little-endian, as written by CTranslate2's ``ModelSpec._serialize``
and read by ``Model::load`` in ``src/models/model.cc``)::

    uint32 binary_version                  (this reader accepts 4..6)
    string spec_name, uint32 spec_revision
    uint32 num_variables, then per variable:
        string name, uint8 rank, uint32 dims[rank], uint8 dtype_id, uint32 num_bytes, bytes
    uint32 num_aliases, then per alias: string alias, string target

where ``string`` is a uint16 length that counts a trailing NUL, then that many bytes.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from whisper_cli.audio import SAMPLE_RATE
from whisper_cli.config import MAX_INITIAL_TIMESTAMP_INDEX, MULTILINGUAL_VOCAB_SIZE
from whisper_cli.errors import WhisperCliError
from whisper_cli.features import CHUNK_SECONDS, HOP_LENGTH, N_FFT, N_FRAMES, N_SAMPLES

MODEL_BIN = "model.bin"
CT2_CONFIG = "config.json"
TOKENIZER = "tokenizer.json"

_MIN_BINARY_VERSION = 4  # version 4 introduced explicit dtype ids; older files are ambiguous
_MAX_BINARY_VERSION = 6
_SPEC_NAME = "WhisperSpec"
_MAX_SPEC_REVISION = 3

# Order of CTranslate2's DataType enum (include/ctranslate2/types.h).
_DTYPES: dict[int, torch.dtype] = {
    0: torch.float32,
    1: torch.int8,
    2: torch.int16,
    3: torch.int32,
    4: torch.float16,
    5: torch.bfloat16,
}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

_GELU = 3  # CTranslate2 Activation enum: RELU, GELUTanh, SWISH, GELU, ...

# Scalar flags CTranslate2 stores next to the weights. Those that change the computation
# must have the value that matches Hugging Face's Whisper; the rest only steer
# CTranslate2's own runtime and carry no weights.
_REQUIRED_FLAGS = {
    "decoder/activation": _GELU,
    "decoder/pre_norm": 1,
    "decoder/scale_embeddings": 0,
    "decoder/alibi": 0,
    "decoder/alibi_use_positive_positions": 0,
    "decoder/scale_alibi": 0,
    "decoder/start_from_zero_embedding": 0,
    "decoder/multi_query_attention": 0,
}
_IGNORED_FLAGS = ("decoder/alignment_layer", "decoder/alignment_heads")
_IGNORED_FLAG_SUFFIXES = ("/keep_in_float32",)  # a CTranslate2 quantization hint per linear

_LANGUAGE_TOKEN = re.compile(r"<\|([a-z]{2,3})\|>")


@dataclass(frozen=True)
class Ct2Model:
    """The parsed content of a CTranslate2 ``model.bin``."""

    spec_name: str
    spec_revision: int
    binary_version: int
    variables: dict[str, torch.Tensor]
    aliases: dict[str, str]


def is_ct2_dir(path: Path) -> bool:
    """Whether ``path`` looks like a CTranslate2 model directory (any spec).

    Only reads the first bytes of ``model.bin``: cheap enough to call on every ``--model``.
    """
    model_bin = Path(path) / MODEL_BIN
    if not model_bin.is_file():
        return False
    try:
        with model_bin.open("rb") as f:
            head = f.read(4 + 2 + 256)
        reader = _Reader(head, model_bin)
        version = reader.uint32()
        # Version 1 files have no spec name; later versions start with one. Versions newer
        # than this reader still count, so that conversion can say why it cannot proceed.
        return version == 1 or (1 < version < 100 and reader.string().isidentifier())
    except (OSError, WhisperCliError):
        return False


def convert_ct2(src: Path, dst: Path, *, overwrite: bool = False) -> None:
    """Convert the CTranslate2 Whisper directory ``src`` into a Hugging Face directory ``dst``.

    The output is written into a temporary directory next to ``dst`` and renamed into place,
    so an interrupted conversion never leaves a half-written ``dst``. An existing ``dst`` is
    an error unless ``overwrite`` is set.

    Raises:
        WhisperCliError: a file is missing or malformed, or a variable cannot be mapped.
    """
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise WhisperCliError(f"CTranslate2 model directory not found: {src}")
    for name in (MODEL_BIN, CT2_CONFIG, TOKENIZER):
        if not (src / name).is_file():
            raise WhisperCliError(f"{src}: missing {name}; not a complete CTranslate2 model")
    if dst.exists() and not overwrite:
        raise WhisperCliError(f"{dst} already exists; remove it or convert elsewhere")

    ct2_config = _read_json(src / CT2_CONFIG)
    tokenizer = _read_json(src / TOKENIZER)
    model = read_ct2_model(src / MODEL_BIN)
    if model.spec_name != _SPEC_NAME:
        raise WhisperCliError(
            f"{src / MODEL_BIN}: model spec is {model.spec_name!r}, not a Whisper model"
        )
    if model.spec_revision > _MAX_SPEC_REVISION:
        raise WhisperCliError(
            f"{src / MODEL_BIN}: WhisperSpec revision {model.spec_revision} is newer than "
            f"the supported revision {_MAX_SPEC_REVISION}"
        )

    dims = _model_dims(model, src / MODEL_BIN)
    state = _hf_state_dict(model, dims, src / MODEL_BIN)
    token_ids = _special_token_ids(tokenizer, src / TOKENIZER)
    dtype_name = _DTYPE_NAMES[state["model.decoder.embed_tokens.weight"].dtype]

    hf_config = _hf_config(dims, token_ids, ct2_config, dtype_name)
    generation_config = _generation_config(dims, token_ids, ct2_config)
    preprocessor_config = _preprocessor_config(dims, src)

    def write_all(tmp: Path) -> None:
        _write_json(tmp / "config.json", hf_config)
        _write_json(tmp / "generation_config.json", generation_config)
        _write_json(tmp / "preprocessor_config.json", preprocessor_config)
        shutil.copyfile(src / TOKENIZER, tmp / TOKENIZER)
        # The metadata save_pretrained writes; transformers checks the format entry.
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # safetensors writes through a private (0600) temporary file; give the weights the
        # same umask-derived mode as the JSON files so other users can read the model.
        os.chmod(tmp / "model.safetensors", (tmp / "config.json").stat().st_mode)

    try:
        _write_dir_atomically(dst, write_all, overwrite=overwrite)
    except OSError as e:
        raise WhisperCliError(f"cannot write {dst}: {e}") from e


# --- model.bin parsing -----------------------------------------------------------------


class _Reader:
    """Bounds-checked little-endian reads over an in-memory ``model.bin``."""

    def __init__(self, data: bytes | bytearray, path: Path) -> None:
        self.data = data
        self.path = path
        self.pos = 0

    def _take(self, size: int, what: str) -> int:
        start = self.pos
        if start + size > len(self.data):
            raise WhisperCliError(
                f"{self.path} is truncated: needs {size} bytes for {what} at byte {start}, "
                f"but the file has {len(self.data)} bytes"
            )
        self.pos += size
        return start

    def _unpack(self, fmt: str, what: str) -> int:
        start = self._take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.data, start)[0]

    def uint8(self, what: str = "a uint8") -> int:
        return self._unpack("<B", what)

    def uint16(self, what: str = "a uint16") -> int:
        return self._unpack("<H", what)

    def uint32(self, what: str = "a uint32") -> int:
        return self._unpack("<I", what)

    def string(self, what: str = "a string") -> str:
        length = self.uint16(f"the length of {what}")
        start = self._take(length, what)
        raw = bytes(self.data[start : start + length])
        if length == 0 or raw[-1] != 0:
            raise WhisperCliError(
                f"{self.path}: bad header: {what} at byte {start} is not a string"
            )
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError as e:
            raise WhisperCliError(f"{self.path}: bad header: {what} is not UTF-8") from e

    def tensor(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, size: int
    ) -> torch.Tensor:
        start = self._take(size, f"the data of {name}")
        count = 1
        for dim in shape:
            count *= dim
        itemsize = torch.empty((), dtype=dtype).element_size()
        if count * itemsize != size:
            raise WhisperCliError(
                f"{self.path}: variable {name} has shape {list(shape)} of {dtype} "
                f"but {size} bytes of data"
            )
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self.data, dtype=dtype, count=count, offset=start)
        # Own the memory: the file buffer is released after parsing, and safetensors
        # refuses tensors that share storage.
        return flat.reshape(shape).clone()


def read_ct2_model(path: Path) -> Ct2Model:
    """Parse a CTranslate2 ``model.bin`` into named tensors and aliases.

    Raises:
        WhisperCliError: the file is missing, truncated or has an unknown layout.
    """
    path = Path(path)
    try:
        # bytearray, not bytes: torch.frombuffer wants a writable buffer.
        data = bytearray(path.read_bytes())
    except FileNotFoundError as e:
        raise WhisperCliError(f"missing {path}") from e
    except OSError as e:
        raise WhisperCliError(f"cannot read {path}: {e.strerror}") from e

    reader = _Reader(data, path)
    version = reader.uint32("the binary version")
    if not _MIN_BINARY_VERSION <= version <= _MAX_BINARY_VERSION:
        raise WhisperCliError(
            f"{path}: bad header: binary version {version} is not supported "
            f"(expected {_MIN_BINARY_VERSION} to {_MAX_BINARY_VERSION}); "
            "is this a CTranslate2 model.bin?"
        )
    spec_name = reader.string("the spec name")
    spec_revision = reader.uint32("the spec revision")

    variables: dict[str, torch.Tensor] = {}
    for index in range(reader.uint32("the variable count")):
        name = reader.string(f"the name of variable #{index}")
        rank = reader.uint8(f"the rank of {name}")
        shape = tuple(reader.uint32(f"the shape of {name}") for _ in range(rank))
        type_id = reader.uint8(f"the dtype of {name}")
        if type_id not in _DTYPES:
            raise WhisperCliError(f"{path}: variable {name} has unknown dtype id {type_id}")
        size = reader.uint32(f"the byte count of {name}")
        if name in variables:
            raise WhisperCliError(f"{path}: variable {name} appears twice")
        variables[name] = reader.tensor(name, shape, _DTYPES[type_id], size)

    aliases: dict[str, str] = {}
    for index in range(reader.uint32("the alias count")):
        alias = reader.string(f"the name of alias #{index}")
        aliases[alias] = reader.string(f"the target of alias {alias}")

    if reader.pos != len(data):
        raise WhisperCliError(
            f"{path}: {len(data) - reader.pos} unexpected bytes after the last alias"
        )
    return Ct2Model(spec_name, spec_revision, version, variables, aliases)


# --- weight mapping ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Dims:
    vocab_size: int
    d_model: int
    num_mel_bins: int
    encoder_layers: int
    decoder_layers: int
    encoder_heads: int
    decoder_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    max_source_positions: int
    max_target_positions: int
    alignment_default: list[list[int]]


def _layer_count(variables: dict[str, torch.Tensor], prefix: str) -> int:
    pattern = re.compile(rf"{prefix}/layer_(\d+)/")
    indices = {int(m.group(1)) for name in variables if (m := pattern.match(name))}
    return max(indices) + 1 if indices else 0


def _scalar(model: Ct2Model, name: str, path: Path) -> int:
    value = model.variables.get(name)
    if value is None:
        raise WhisperCliError(f"{path}: missing variable {name}")
    if value.numel() != 1:
        raise WhisperCliError(f"{path}: variable {name} should be a scalar")
    return int(value.item())


def _shape(model: Ct2Model, name: str, rank: int, path: Path) -> tuple[int, ...]:
    value = model.variables.get(name)
    if value is None:
        raise WhisperCliError(f"{path}: missing variable {name}")
    if value.dim() != rank:
        raise WhisperCliError(f"{path}: variable {name} should have rank {rank}")
    return tuple(value.shape)


def _model_dims(model: Ct2Model, path: Path) -> _Dims:
    vocab_size, d_model = _shape(model, "decoder/embeddings/weight", 2, path)
    _, num_mel_bins, _ = _shape(model, "encoder/conv1/weight", 3, path)
    decoder_layers = _layer_count(model.variables, "decoder")
    decoder_heads = _scalar(model, "decoder/num_heads", path)
    return _Dims(
        vocab_size=vocab_size,
        d_model=d_model,
        num_mel_bins=num_mel_bins,
        encoder_layers=_layer_count(model.variables, "encoder"),
        decoder_layers=decoder_layers,
        encoder_heads=_scalar(model, "encoder/num_heads", path),
        decoder_heads=decoder_heads,
        encoder_ffn_dim=_shape(model, "encoder/layer_0/ffn/linear_0/weight", 2, path)[0],
        decoder_ffn_dim=_shape(model, "decoder/layer_0/ffn/linear_0/weight", 2, path)[0],
        max_source_positions=_shape(model, "encoder/position_encodings/encodings", 2, path)[0],
        max_target_positions=_shape(model, "decoder/position_encodings/encodings", 2, path)[0],
        # What CTranslate2 itself uses when a config has no alignment heads.
        alignment_default=[
            [layer, head]
            for layer in range(decoder_layers // 2, decoder_layers)
            for head in range(decoder_heads)
        ],
    )


class _Mapper:
    """Moves CTranslate2 variables into a Hugging Face state dict, one name at a time.

    Every variable must be consumed exactly once, so a variable this converter does not
    know about is reported instead of silently dropped.
    """

    def __init__(self, model: Ct2Model, path: Path) -> None:
        self.remaining = dict(model.variables)
        self.path = path
        self.state: dict[str, torch.Tensor] = {}

    def take(self, name: str) -> torch.Tensor:
        value = self.remaining.pop(name, None)
        if value is None:
            raise WhisperCliError(f"{self.path}: missing variable {name}")
        if value.dtype not in _FLOAT_DTYPES:
            raise WhisperCliError(
                f"{self.path}: variable {name} is {value.dtype}; quantized CTranslate2 models "
                "are not supported, convert one saved as float16 or float32"
            )
        return value

    def put(self, hf_name: str, value: torch.Tensor, like: tuple[int, ...] | None = None) -> None:
        if like is not None and tuple(value.shape) != like:
            raise WhisperCliError(
                f"{self.path}: {hf_name} has shape {list(value.shape)}, expected {list(like)}"
            )
        self.state[hf_name] = value.contiguous()

    def copy(self, ct2_name: str, hf_name: str) -> None:
        self.put(hf_name, self.take(ct2_name))

    def layer_norm(self, ct2_scope: str, hf_scope: str) -> None:
        self.copy(f"{ct2_scope}/gamma", f"{hf_scope}.weight")
        self.copy(f"{ct2_scope}/beta", f"{hf_scope}.bias")

    def linear(self, ct2_scope: str, hf_scope: str) -> None:
        self.copy(f"{ct2_scope}/weight", f"{hf_scope}.weight")
        self.copy(f"{ct2_scope}/bias", f"{hf_scope}.bias")

    def fused_linear(self, ct2_scope: str, hf_scopes: list[str], d_model: int) -> None:
        """Split a fused projection (QKV or KV) along its output rows.

        CTranslate2 fuses q/k/v into one matrix and, since Hugging Face's k_proj has no
        bias, fills the key slice of the fused bias with zeros. The key bias is dropped
        here; that is exact even if it were not zero, because q·(k + b) shifts every score
        of one query by the same amount, which the softmax cancels.
        """
        weight = self.take(f"{ct2_scope}/weight")
        bias = self.take(f"{ct2_scope}/bias")
        parts = len(hf_scopes)
        if tuple(weight.shape) != (parts * d_model, d_model) or tuple(bias.shape) != (
            parts * d_model,
        ):
            raise WhisperCliError(
                f"{self.path}: {ct2_scope} has shape {list(weight.shape)}, "
                f"expected {[parts * d_model, d_model]}"
            )
        for hf_scope, w, b in zip(
            hf_scopes, weight.split(d_model), bias.split(d_model), strict=True
        ):
            self.put(f"{hf_scope}.weight", w.clone())
            if not hf_scope.endswith(".k_proj"):
                self.put(f"{hf_scope}.bias", b.clone())


def _map_attention_block(m: _Mapper, ct2: str, hf: str, d_model: int, cross: bool) -> None:
    if cross:
        m.layer_norm(f"{ct2}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm")
        m.linear(f"{ct2}/attention/linear_0", f"{hf}.encoder_attn.q_proj")
        m.fused_linear(
            f"{ct2}/attention/linear_1",
            [f"{hf}.encoder_attn.k_proj", f"{hf}.encoder_attn.v_proj"],
            d_model,
        )
        m.linear(f"{ct2}/attention/linear_2", f"{hf}.encoder_attn.out_proj")
    else:
        m.layer_norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
        m.fused_linear(
            f"{ct2}/self_attention/linear_0",
            [f"{hf}.self_attn.q_proj", f"{hf}.self_attn.k_proj", f"{hf}.self_attn.v_proj"],
            d_model,
        )
        m.linear(f"{ct2}/self_attention/linear_1", f"{hf}.self_attn.out_proj")


def _map_layer(m: _Mapper, ct2: str, hf: str, d_model: int, decoder: bool) -> None:
    _map_attention_block(m, ct2, hf, d_model, cross=False)
    if decoder:
        _map_attention_block(m, ct2, hf, d_model, cross=True)
    m.layer_norm(f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm")
    m.linear(f"{ct2}/ffn/linear_0", f"{hf}.fc1")
    m.linear(f"{ct2}/ffn/linear_1", f"{hf}.fc2")


def _consume_flags(m: _Mapper) -> None:
    for name, expected in _REQUIRED_FLAGS.items():
        value = m.remaining.pop(name, None)
        if value is None:
            continue  # older CTranslate2 versions do not write every flag
        if value.numel() != 1:
            raise WhisperCliError(f"{m.path}: variable {name} should be a scalar")
        if int(value.item()) != expected:
            raise WhisperCliError(
                f"{m.path}: variable {name} is {int(value.item())}, but Whisper needs {expected}"
            )
    for name in ("encoder/num_heads", "decoder/num_heads", *_IGNORED_FLAGS):
        m.remaining.pop(name, None)
    for name in [n for n in m.remaining if n.endswith(_IGNORED_FLAG_SUFFIXES)]:
        if m.remaining[name].numel() == 1:
            del m.remaining[name]


def _consume_projection(m: _Mapper, model: Ct2Model, embed_tokens: torch.Tensor) -> None:
    """Check that the output projection is the (tied) token embedding, as in HF Whisper.

    Hugging Face ties ``proj_out`` to ``embed_tokens`` and does not save it, so the
    projection may only be an alias of the embeddings or an identical copy.
    """
    name = "decoder/projection/weight"
    target = model.aliases.get(name)
    if target is not None:
        if target != "decoder/embeddings/weight":
            raise WhisperCliError(f"{m.path}: {name} is an alias of {target}, not the embeddings")
    elif name in m.remaining and not torch.equal(m.take(name), embed_tokens):
        raise WhisperCliError(
            f"{m.path}: {name} differs from the token embeddings; "
            "untied output projections are not supported"
        )
    bias = m.remaining.pop("decoder/projection/bias", None)
    if bias is not None and bool(bias.any()):
        raise WhisperCliError(f"{m.path}: decoder/projection/bias is not zero; not supported")


def _hf_state_dict(model: Ct2Model, dims: _Dims, path: Path) -> dict[str, torch.Tensor]:
    unknown_aliases = set(model.aliases) - {"decoder/projection/weight"}
    if unknown_aliases:
        raise WhisperCliError(f"{path}: unknown variable alias(es): {sorted(unknown_aliases)}")

    m = _Mapper(model, path)
    d = dims.d_model
    # conv1d weights are (out_channels, in_channels, kernel) in both formats.
    m.linear("encoder/conv1", "model.encoder.conv1")
    m.linear("encoder/conv2", "model.encoder.conv2")
    m.copy("encoder/position_encodings/encodings", "model.encoder.embed_positions.weight")
    for i in range(dims.encoder_layers):
        _map_layer(m, f"encoder/layer_{i}", f"model.encoder.layers.{i}", d, decoder=False)
    m.layer_norm("encoder/layer_norm", "model.encoder.layer_norm")

    m.copy("decoder/embeddings/weight", "model.decoder.embed_tokens.weight")
    m.copy("decoder/position_encodings/encodings", "model.decoder.embed_positions.weight")
    for i in range(dims.decoder_layers):
        _map_layer(m, f"decoder/layer_{i}", f"model.decoder.layers.{i}", d, decoder=True)
    m.layer_norm("decoder/layer_norm", "model.decoder.layer_norm")

    _consume_projection(m, model, m.state["model.decoder.embed_tokens.weight"])
    _consume_flags(m)
    if m.remaining:
        raise WhisperCliError(f"{path}: unknown variable(s): {', '.join(sorted(m.remaining))}")

    _check_shapes(m.state, dims, path)
    return m.state


def _check_shapes(state: dict[str, torch.Tensor], dims: _Dims, path: Path) -> None:
    """Catch inconsistent files here rather than as a size mismatch inside transformers."""
    d = dims.d_model
    expected = {
        "model.encoder.conv1.weight": (d, dims.num_mel_bins, 3),
        "model.encoder.conv2.weight": (d, d, 3),
        "model.encoder.embed_positions.weight": (dims.max_source_positions, d),
        "model.decoder.embed_positions.weight": (dims.max_target_positions, d),
    }
    for i in range(dims.encoder_layers):
        expected[f"model.encoder.layers.{i}.fc1.weight"] = (dims.encoder_ffn_dim, d)
        expected[f"model.encoder.layers.{i}.fc2.weight"] = (d, dims.encoder_ffn_dim)
    for i in range(dims.decoder_layers):
        expected[f"model.decoder.layers.{i}.fc1.weight"] = (dims.decoder_ffn_dim, d)
        expected[f"model.decoder.layers.{i}.fc2.weight"] = (d, dims.decoder_ffn_dim)
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise WhisperCliError(
                f"{path}: {name} has shape {list(state[name].shape)}, expected {list(shape)}"
            )
    if d % dims.encoder_heads or d % dims.decoder_heads:
        raise WhisperCliError(f"{path}: d_model {d} is not divisible by the number of heads")


# --- configs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _TokenIds:
    eot: int
    sot: int
    no_timestamps: int
    transcribe: int | None
    translate: int | None
    prev_sot: int | None
    languages: dict[str, int]  # "<|en|>" -> id, in id order


def _special_token_ids(tokenizer: dict[str, Any], path: Path) -> _TokenIds:
    """Look the special tokens up by name: their ids move between model generations."""
    vocab: dict[str, int] = {}
    model = tokenizer.get("model")
    if isinstance(model, dict) and isinstance(model.get("vocab"), dict):
        vocab.update(model["vocab"])
    for token in tokenizer.get("added_tokens") or []:
        if isinstance(token, dict) and "content" in token and "id" in token:
            vocab[token["content"]] = token["id"]

    def need(token: str) -> int:
        if token not in vocab:
            raise WhisperCliError(f"{path}: special token {token} not found")
        return int(vocab[token])

    languages = {
        token: int(token_id)
        for token, token_id in sorted(vocab.items(), key=lambda item: item[1])
        if _LANGUAGE_TOKEN.fullmatch(token)
    }
    return _TokenIds(
        eot=need("<|endoftext|>"),
        sot=need("<|startoftranscript|>"),
        no_timestamps=need("<|notimestamps|>"),
        transcribe=vocab.get("<|transcribe|>"),
        translate=vocab.get("<|translate|>"),
        prev_sot=vocab.get("<|startofprev|>"),
        languages=languages,
    )


def _int_list(ct2_config: dict[str, Any], key: str, default: list[int] | None) -> list[int]:
    value = ct2_config.get(key, default)
    if value is None:
        raise WhisperCliError(f"CTranslate2 {CT2_CONFIG} lacks {key!r}")
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise WhisperCliError(f"CTranslate2 {CT2_CONFIG}: {key!r} should be a list of ids")
    return value


def _alignment_heads(ct2_config: dict[str, Any], dims: _Dims) -> list[list[int]]:
    heads = ct2_config.get("alignment_heads") or dims.alignment_default
    for pair in heads:
        if (
            not isinstance(pair, list)
            or len(pair) != 2
            or not 0 <= pair[0] < dims.decoder_layers
            or not 0 <= pair[1] < dims.decoder_heads
        ):
            raise WhisperCliError(f"CTranslate2 {CT2_CONFIG}: bad alignment head {pair!r}")
    return [list(pair) for pair in heads]


def _hf_config(
    dims: _Dims, ids: _TokenIds, ct2_config: dict[str, Any], dtype_name: str
) -> dict[str, Any]:
    """The model config.json, field for field as in the openai/whisper-* checkpoints."""
    return {
        "activation_dropout": 0.0,
        "activation_function": "gelu",
        "apply_spec_augment": False,
        "architectures": ["WhisperForConditionalGeneration"],
        "attention_dropout": 0.0,
        "begin_suppress_tokens": _int_list(ct2_config, "suppress_ids_begin", [220, ids.eot]),
        "bos_token_id": ids.eot,
        "classifier_proj_size": 256,
        "d_model": dims.d_model,
        "decoder_attention_heads": dims.decoder_heads,
        "decoder_ffn_dim": dims.decoder_ffn_dim,
        "decoder_layerdrop": 0.0,
        "decoder_layers": dims.decoder_layers,
        "decoder_start_token_id": ids.sot,
        "dropout": 0.0,
        "encoder_attention_heads": dims.encoder_heads,
        "encoder_ffn_dim": dims.encoder_ffn_dim,
        "encoder_layerdrop": 0.0,
        "encoder_layers": dims.encoder_layers,
        "eos_token_id": ids.eot,
        "init_std": 0.02,
        "is_encoder_decoder": True,
        "mask_feature_length": 10,
        "mask_feature_min_masks": 0,
        "mask_feature_prob": 0.0,
        "mask_time_length": 10,
        "mask_time_min_masks": 2,
        "mask_time_prob": 0.05,
        "max_source_positions": dims.max_source_positions,
        "max_target_positions": dims.max_target_positions,
        "median_filter_width": 7,
        "model_type": "whisper",
        "num_hidden_layers": dims.encoder_layers,
        "num_mel_bins": dims.num_mel_bins,
        "pad_token_id": ids.eot,
        "scale_embedding": False,
        "suppress_tokens": _int_list(ct2_config, "suppress_ids", None),
        "tie_word_embeddings": True,
        "torch_dtype": dtype_name,
        "use_cache": True,
        "use_weighted_layer_sum": False,
        "vocab_size": dims.vocab_size,
    }


def _generation_config(dims: _Dims, ids: _TokenIds, ct2_config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json as Hugging Face ships it for openai/whisper-*."""
    multilingual = dims.vocab_size >= MULTILINGUAL_VOCAB_SIZE
    config: dict[str, Any] = {
        "alignment_heads": _alignment_heads(ct2_config, dims),
        "begin_suppress_tokens": _int_list(ct2_config, "suppress_ids_begin", [220, ids.eot]),
        "bos_token_id": ids.eot,
        "decoder_start_token_id": ids.sot,
        "eos_token_id": ids.eot,
        "is_multilingual": multilingual,
        "max_initial_timestamp_index": MAX_INITIAL_TIMESTAMP_INDEX,
        "max_length": dims.max_target_positions,
        "no_timestamps_token_id": ids.no_timestamps,
        "pad_token_id": ids.eot,
        "return_timestamps": False,
        "suppress_tokens": _int_list(ct2_config, "suppress_ids", None),
    }
    if ids.prev_sot is not None:
        config["prev_sot_token_id"] = ids.prev_sot
    if multilingual:
        if ids.transcribe is None or ids.translate is None or not ids.languages:
            raise WhisperCliError(
                f"{TOKENIZER}: a multilingual model needs <|transcribe|>, <|translate|> "
                "and language tokens"
            )
        # English-only checkpoints carry language tokens in their vocabulary too, but HF
        # leaves lang_to_id out for them: with it, transformers would run language
        # detection and put a language token into an English-only prompt.
        config["lang_to_id"] = ids.languages
        config["task_to_id"] = {"transcribe": ids.transcribe, "translate": ids.translate}
        # The default prompt: detect the language (None), then transcribe.
        config["forced_decoder_ids"] = [[1, None], [2, ids.transcribe]]
    else:
        config["forced_decoder_ids"] = [[1, ids.no_timestamps]]
    return dict(sorted(config.items()))


def _preprocessor_config(dims: _Dims, src: Path) -> dict[str, Any]:
    """WhisperFeatureExtractor settings; only the number of mel bins varies by model.

    The rest is Whisper's audio front end, fixed by the model family (not stored in
    CTranslate2 directories): our own front end's constants (features.py).
    """
    config = {
        "chunk_length": CHUNK_SECONDS,
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": dims.num_mel_bins,
        "hop_length": HOP_LENGTH,
        "n_fft": N_FFT,
        "n_samples": N_SAMPLES,
        "nb_max_frames": N_FRAMES,
        "padding_side": "right",
        "padding_value": 0.0,
        "processor_class": "WhisperProcessor",
        "return_attention_mask": False,
        "sampling_rate": SAMPLE_RATE,
    }
    # faster-whisper ships one for large-v3 (128 mel bins); it must agree with the weights.
    shipped = src / "preprocessor_config.json"
    if shipped.is_file():
        feature_size = _read_json(shipped).get("feature_size", dims.num_mel_bins)
        if feature_size != dims.num_mel_bins:
            raise WhisperCliError(
                f"{shipped}: feature_size {feature_size} does not match the "
                f"{dims.num_mel_bins} mel bins the model's conv1 expects"
            )
    return config


# --- files -------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise WhisperCliError(f"missing {path}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WhisperCliError(f"cannot read {path}: {e}") from e
    if not isinstance(value, dict):
        raise WhisperCliError(f"{path}: expected a JSON object")
    return value


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def _write_dir_atomically(dst: Path, write: Callable[[Path], None], *, overwrite: bool) -> None:
    """Fill a temporary sibling of ``dst`` with ``write``, then rename it to ``dst``.

    A rename within one directory is atomic, so readers see either no ``dst`` or a
    complete one; a crash leaves only a hidden ``.<name>.tmp-*`` directory behind.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    # Not mkdtemp: its 0700 mode would survive the rename; mkdir honours the umask.
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    old: Path | None = None
    try:
        write(tmp)
        if dst.exists() and overwrite:
            # Directories cannot be renamed over non-empty ones: move the old one aside.
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.replace(dst, old / dst.name)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not dst.exists():
            os.replace(old / dst.name, dst)  # put the previous model back
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
