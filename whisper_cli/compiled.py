"""The compiled decode step: `torch.compile` of the fixed-shape one-token decoder call.

Only the step is compiled (as gpt-fast does): it always sees tokens (B, 1), one
position and the same static caches, so it compiles once per (batch size, dtype) and
is replayed. On CUDA, mode "reduce-overhead" records it into a CUDA graph, which
removes the per-kernel launch cost that dominates small-batch decoding. The prompt
(prefill) and the language-detection step keep their own shapes and run eagerly.
"""

from __future__ import annotations

import torch

from whisper_cli.decoding import StepFn
from whisper_cli.model import Whisper


def compiled_step(model: Whisper) -> StepFn:
    """A compiled `decoder(tokens (B, 1), positions (1,)) -> logits (B, 1, V)`."""
    mode = "reduce-overhead" if model.device.type == "cuda" else "default"
    compiled = torch.compile(model.decoder.forward, fullgraph=True, dynamic=False, mode=mode)

    def step(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = compiled(tokens, positions)
        if mode == "reduce-overhead":
            # The graph's output buffer is overwritten by the next replay: own a copy.
            logits = logits.clone()
        return logits

    return step
