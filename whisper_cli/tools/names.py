"""Hugging Face Whisper parameter names -> openai-whisper's (which whisper.cpp's follow).

One map for the tools that hand our weights to the peers: the ggml writer
(scripts/ggml_weights.py) and openai-whisper as the word-timing reference (tests).
"""

from __future__ import annotations

import re

# A layer's modules: HF name -> openai-whisper's.
_LAYER = {
    "self_attn.q_proj": "attn.query",
    "self_attn.k_proj": "attn.key",
    "self_attn.v_proj": "attn.value",
    "self_attn.out_proj": "attn.out",
    "self_attn_layer_norm": "attn_ln",
    "encoder_attn.q_proj": "cross_attn.query",
    "encoder_attn.k_proj": "cross_attn.key",
    "encoder_attn.v_proj": "cross_attn.value",
    "encoder_attn.out_proj": "cross_attn.out",
    "encoder_attn_layer_norm": "cross_attn_ln",
    "fc1": "mlp.0",
    "fc2": "mlp.2",
    "final_layer_norm": "mlp_ln",
}
# Outside the layers: HF prefix -> openai-whisper's (conv1 and conv2 keep their names).
_TOP = {
    "encoder.embed_positions.weight": "encoder.positional_embedding",
    "encoder.layer_norm.": "encoder.ln_post.",
    "decoder.embed_tokens.": "decoder.token_embedding.",
    "decoder.embed_positions.weight": "decoder.positional_embedding",
    "decoder.layer_norm.": "decoder.ln.",
}
_LAYER_KEY = re.compile(r"(encoder|decoder)\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def openai_name(key: str) -> str:
    """openai-whisper's name for an HF state-dict key (with or without "model.")."""
    name = key.removeprefix("model.")
    m = _LAYER_KEY.match(name)
    if m:
        side, index, part, kind = m.groups()
        return f"{side}.blocks.{index}.{_LAYER[part]}.{kind}"
    for ours, theirs in _TOP.items():
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return name
