"""Write whisper.cpp's ggml model file from a Hugging Face Whisper directory (no hub needed).

whisper.cpp (and so the `pywhispercpp` wheel) reads its own legacy format, the one its
models/convert-h5-to-ggml.py writes; there are no ggml downloads here, so compare_cpu.py
makes the file from the same HF weights whisper-cli runs. The layout, all little-endian:

    int32 magic 'ggml'; int32 hparams: n_vocab, n_audio_ctx, n_audio_state, n_audio_head,
      n_audio_layer, n_text_ctx, n_text_state, n_text_head, n_text_layer, n_mels, ftype
    int32 n_mels, n_fft; float32 mel filters (n_mels, n_fft)       -- whisper.cpp's own front end
    int32 n_tokens; per token: int32 length, its bytes            -- the BPE vocabulary, no specials
    per tensor: int32 n_dims, name length, ftype (0 f32, 1 f16); int32 dims innermost first;
      name; data in C order

Matrices and conv kernels are stored f16 (ftype 1), everything else f32, as the converter does.
Checked against whisper.cpp's models/for-tests-ggml-{tiny.en,base}.bin (header, filters and
vocabulary, no tensors): hparams equal, filters within 2e-9, tokens equal except where those
old files hold U+FFFD for a token that is not valid UTF-8 alone (we write its raw bytes, as
the current converter does) and, for multilingual models, our one more entry: the
end-of-text token under its own name (whisper.cpp names it "[_EOT_]" when absent).

    python scripts/ggml_weights.py models/tiny.en .cache/ggml/tiny.en.bin
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from whisper_cli.features import mel_filters  # noqa: E402  (the repo, not an installed copy)
from whisper_cli.tools.names import openai_name  # noqa: E402

GGML_MAGIC = 0x67676D6C

# Kept f32 although 2-D: whisper.cpp creates these tensors as GGML_TYPE_F32.
_F32_ALWAYS = {
    "encoder.conv1.bias",
    "encoder.conv2.bias",
    "encoder.positional_embedding",
    "decoder.positional_embedding",
}


def ggml_name(hf_name: str) -> str | None:
    """whisper.cpp's tensor name for an HF state-dict key; None for the tied output projection."""
    if hf_name == "proj_out.weight":
        return None  # tied to the token embedding; whisper.cpp has no such tensor
    return openai_name(hf_name)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes, reversed: the vocabulary's text -> raw bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def vocabulary(model_dir: Path) -> list[bytes]:
    """The BPE tokens (ids 0..n-1, specials excluded) as raw bytes, in id order."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tokenizer["model"]["vocab"]
    by_id = sorted(vocab.items(), key=lambda item: item[1])
    if [i for _, i in by_id] != list(range(len(by_id))):
        raise ValueError(f"{model_dir}: tokenizer vocabulary ids are not 0..{len(by_id) - 1}")
    decode = _byte_decoder()
    return [bytes(decode[c] for c in text) for text, _ in by_id]


def write_ggml(model_dir: Path, out: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    filters = mel_filters(config["num_mel_bins"])  # (n_mels, 201)
    tokens = vocabulary(model_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(out.suffix + ".partial")
    with partial.open("wb") as f:
        hparams = (
            config["vocab_size"],
            config["max_source_positions"],
            config["d_model"],
            config["encoder_attention_heads"],
            config["encoder_layers"],
            config["max_target_positions"],
            config["d_model"],
            config["decoder_attention_heads"],
            config["decoder_layers"],
            config["num_mel_bins"],
            1,  # ftype: mostly f16
        )
        f.write(struct.pack("<12i", GGML_MAGIC, *hparams))
        f.write(struct.pack("<2i", *filters.shape))
        f.write(filters.astype("<f4").tobytes())
        f.write(struct.pack("<i", len(tokens)))
        for token in tokens:
            f.write(struct.pack("<i", len(token)) + token)
        for hf_name, tensor in weights.items():
            name = ggml_name(hf_name)
            if name is None:
                continue
            data = tensor.float().numpy()
            if name in ("encoder.conv1.bias", "encoder.conv2.bias"):
                data = data.reshape(-1, 1)  # (C,) -> (C, 1): broadcast over time in ggml
            f16 = data.ndim >= 2 and name not in _F32_ALWAYS
            data = data.astype("<f2" if f16 else "<f4")
            encoded = name.encode()
            f.write(struct.pack("<3i", data.ndim, len(encoded), int(f16)))
            f.write(struct.pack(f"<{data.ndim}i", *reversed(data.shape)))
            f.write(encoded)
            f.write(np.ascontiguousarray(data).tobytes())
    partial.replace(out)


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: ggml_weights.py HF_MODEL_DIR OUT.bin")
    write_ggml(Path(sys.argv[1]), Path(sys.argv[2]))


if __name__ == "__main__":
    main()
