"""Whisper as plain PyTorch modules, with a preallocated (static) KV cache.

Parameter names follow the Hugging Face checkpoint keys (minus the leading
"model."), so that loading is a strict, checked `load_state_dict`. The model holds
one floating dtype throughout; caches take theirs from the weights.

Shapes: B batch, T text positions, S encoder frames (1500 for 30 s), C d_model,
H heads, D head dim, L cache length (prompt + max new tokens), V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from whisper_cli.config import ModelConfig

KV = tuple[torch.Tensor, torch.Tensor]  # keys and values, (B, H, S, D) each


class KVCache(nn.Module):
    """Keys and values of one attention layer, preallocated and written in place.

    Buffers are non-persistent: they are run state, not checkpoint weights.
    """

    def __init__(
        self, batch: int, heads: int, length: int, head_dim: int, dtype: torch.dtype, device
    ) -> None:
        super().__init__()
        shape = (batch, heads, length, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # positions: (T,) int64; k, v: (B, H, T, D)
        self.k.index_copy_(2, positions, k)
        self.v.index_copy_(2, positions, v)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Shrink the batch to `rows` (eager path only: drops finished rows' work)."""
        self.k = self.k.index_select(0, rows)
        self.v = self.v.index_select(0, rows)


class Table(nn.Embedding):
    """An embedding table whose values always come from the checkpoint.

    nn.Embedding draws random normal values at construction; on the meta device that
    one op imports PyTorch's Python decompositions, about a second of every start.
    """

    def reset_parameters(self) -> None:
        pass  # filled by the strict load


class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)  # Whisper's keys have no bias
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.kv_cache: KVCache | None = None

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C) -> (B, H, T, D)
        return x.view(b, t, self.heads, c // self.heads).transpose(1, 2)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)  # (B,H,T,D)
        b, h, t, d = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(b, t, h * d))

    def forward(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """Uncached full self-attention (the encoder; causal: a whole decoder sequence)."""
        q, k, v = (self.split_heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.attend(q, k, v, causal=causal)

    def forward_cached_self(
        self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, visible: int
    ) -> torch.Tensor:
        """Causal self-attention: write this step's K/V at `positions`, attend over the cache.

        With a mask (the fixed-shape step): over the whole static cache. Without: over its
        first `visible` slots, the positions written so far (see Decoder.forward).
        """
        q, k, v = (self.split_heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        self.kv_cache.write(positions, k, v)
        if mask is not None:
            return self.attend(q, self.kv_cache.k, self.kv_cache.v, mask)
        k, v = self.kv_cache.k[:, :, :visible], self.kv_cache.v[:, :, :visible]
        return self.attend(q, k, v, causal=q.shape[2] > 1)  # a prompt from position 0

    def forward_cross(self, x: torch.Tensor) -> torch.Tensor:
        """Cross-attention over the encoder K/V filled once per batch."""
        return self.attend(self.split_heads(self.q_proj(x)), self.kv_cache.k, self.kv_cache.v)

    def cross_kv(self, audio: torch.Tensor) -> KV:
        """(B, S, C) encoder output -> its cross-attention K and V, (B, H, S, D) each."""
        return self.split_heads(self.k_proj(audio)), self.split_heads(self.v_proj(audio))

    def forward_cross_scores(
        self,
        x: torch.Tensor,
        kv: KV | None,
        heads: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cross-attention over `kv` (None: the cache), and the scores of the given heads.

        scaled_dot_product_attention returns no weights, so they are computed explicitly,
        for these heads only, as openai-whisper does: (q * D^-1/4) @ (k * D^-1/4)^T, in
        the model dtype, (B, len(heads), T, S), before the softmax.
        """
        q = self.split_heads(self.q_proj(x))
        k, v = (self.kv_cache.k, self.kv_cache.v) if kv is None else kv
        scores = None
        if heads is not None:
            scale = q.shape[-1] ** -0.25
            scores = (q[:, heads] * scale) @ (k[:, heads] * scale).transpose(-1, -2)
        return self.attend(q, k, v), scores

    def fill_cross(self, audio: torch.Tensor) -> None:
        # audio: (B, S, C) encoder output; all S positions written at once.
        self.kv_cache.k.copy_(self.split_heads(self.k_proj(audio)))
        self.kv_cache.v.copy_(self.split_heads(self.v_proj(audio)))


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.self_attn = Attention(d_model, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, ffn)
        self.fc2 = nn.Linear(ffn, d_model)
        self.final_layer_norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class DecoderLayer(nn.Module):
    def __init__(self, d_model: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.self_attn = Attention(d_model, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        self.encoder_attn = Attention(d_model, heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, ffn)
        self.fc2 = nn.Linear(ffn, d_model)
        self.final_layer_norm = nn.LayerNorm(d_model)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, visible: int
    ) -> torch.Tensor:
        x = x + self.self_attn.forward_cached_self(
            self.self_attn_layer_norm(x), positions, mask, visible
        )
        x = x + self.encoder_attn.forward_cross(self.encoder_attn_layer_norm(x))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))

    def forward_aligned(
        self,
        x: torch.Tensor,
        kv: KV | None,
        heads: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A whole sequence from position 0, uncached (see Decoder.forward_aligned)."""
        x = x + self.self_attn(self.self_attn_layer_norm(x), causal=True)
        y, scores = self.encoder_attn.forward_cross_scores(
            self.encoder_attn_layer_norm(x), kv, heads
        )
        x = x + y
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x)))), scores


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        c = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, c, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(c, c, kernel_size=3, stride=2, padding=1)
        self.embed_positions = Table(cfg.max_source_positions, c)
        self.layers = nn.ModuleList(
            EncoderLayer(c, cfg.encoder_attention_heads, cfg.encoder_ffn_dim)
            for _ in range(cfg.encoder_layers)
        )
        self.layer_norm = nn.LayerNorm(c)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        # mel: (B, n_mels, 2S) in the model dtype -> (B, S, C)
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.embed_positions.weight[: x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        c = cfg.d_model
        self.heads = cfg.decoder_attention_heads
        self.embed_tokens = Table(cfg.vocab_size, c)
        self.embed_positions = Table(cfg.max_target_positions, c)
        self.layers = nn.ModuleList(
            DecoderLayer(c, self.heads, cfg.decoder_ffn_dim) for _ in range(cfg.decoder_layers)
        )
        self.layer_norm = nn.LayerNorm(c)
        self.cross_source: torch.Tensor | None = None  # encoder output the cross caches hold
        # Word timing sets this: keep_rows then keeps the whole batch's cross K/V (one
        # (k, v) per layer, with the encoder output they came from) for the alignment
        # pass, instead of projecting the encoder output again (~15% of the encoder's work
        # for tiny). Dropped when the caches are filled for the next batch.
        self.retain_cross = False
        self.retained_cross: tuple[torch.Tensor, list[KV]] | None = None

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, visible: int | None = None
    ) -> torch.Tensor:
        """One decode step (or the prompt): tokens (B, T) at positions (T,) -> logits (B, T, V).

        Without `visible`, self-attention runs over the whole static cache under a causal
        mask, so shapes are fixed for a given (B, T) and the single-token step can be
        compiled once and replayed. Eager callers pass `visible`, the number of cache
        slots written once these tokens are (positions are consecutive, ending at
        visible - 1): attention then reads only those, with no mask to build.
        """
        if visible is not None and 1 < tokens.shape[1] != visible:
            raise ValueError("an eager call of several tokens must start at position 0")
        x = self.embed_tokens(tokens) + self.embed_positions(positions)
        mask = None
        if visible is None:
            cache_len = self.layers[0].self_attn.kv_cache.k.shape[2]
            # Position p sees cache slots 0..p.  (T, L) bool
            mask = torch.arange(cache_len, device=tokens.device) <= positions[:, None]
        for layer in self.layers:
            x = layer(x, positions, mask, visible or 0)
        return self.logits(self.layer_norm(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., C) final hidden states -> (..., V) logits."""
        return hidden @ self.embed_tokens.weight.T  # output projection tied to the embedding

    def forward_aligned(
        self, tokens: torch.Tensor, audio: torch.Tensor, heads: dict[int, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced pass for word timing: whole sequences (B, T) from position 0.

        Returns the final hidden states (B, T, C) (logits via `logits`, in slices: all T
        at once would be B * T * V) and the cross-attention scores of the alignment heads
        `heads` ({layer: head indices}), (B, n_heads, T, S), in the model dtype, ordered
        by layer then head. Self-attention runs over the sequence itself, leaving the
        self caches alone; cross-attention reads the cross caches when they still hold
        this batch's `audio` (B, S, C), and otherwise projects it again.
        """
        retained = self.retained_cross
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed_tokens(tokens) + self.embed_positions(positions)
        scores = []
        for index, layer in enumerate(self.layers):
            if self.cross_source is audio:
                kv = None  # the caches hold this batch
            elif retained is not None and retained[0] is audio:
                kv = retained[1][index]
            else:
                kv = layer.encoder_attn.cross_kv(audio)
            x, layer_scores = layer.forward_aligned(x, kv, heads.get(index))
            if layer_scores is not None:
                scores.append(layer_scores)
        return self.layer_norm(x), torch.cat(scores, dim=1)

    def setup_caches(self, batch: int, length: int, audio_frames: int) -> None:
        """Preallocate self- and cross-attention caches in the weights' dtype and device."""
        w = self.embed_tokens.weight
        head_dim = w.shape[1] // self.heads
        for layer in self.layers:
            layer.self_attn.kv_cache = KVCache(
                batch, self.heads, length, head_dim, w.dtype, w.device
            )
            layer.encoder_attn.kv_cache = KVCache(
                batch, self.heads, audio_frames, head_dim, w.dtype, w.device
            )
        self.cross_source = None
        self.retained_cross = None

    def fill_cross_caches(self, audio: torch.Tensor) -> None:
        for layer in self.layers:
            layer.encoder_attn.fill_cross(audio)
        self.cross_source = audio
        self.retained_cross = None

    def keep_rows(self, rows: torch.Tensor) -> None:
        if self.retain_cross and self.cross_source is not None:
            cross = [(a.kv_cache.k, a.kv_cache.v) for a in (la.encoder_attn for la in self.layers)]
            self.retained_cross = (self.cross_source, cross)
        for layer in self.layers:
            layer.self_attn.kv_cache.keep_rows(rows)
            layer.encoder_attn.kv_cache.keep_rows(rows)
        self.cross_source = None  # they no longer hold the whole batch

    def caches(self) -> list[KVCache]:
        return [
            cache
            for layer in self.layers
            for cache in (layer.self_attn.kv_cache, layer.encoder_attn.kv_cache)
            if cache is not None
        ]


class Whisper(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device
