"""Whisper as plain PyTorch modules, with a preallocated (static) KV cache.

Parameter names follow the Hugging Face checkpoint keys (minus the leading
"model."), so that loading is a strict, checked `load_state_dict`. The model holds
one floating dtype throughout; caches take theirs from the weights.

Shapes: B batch, T text positions, S encoder frames (1500 for 30 s), C d_model,
H heads, D head dim, L cache length (prompt + max new tokens), V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from whisper_cli import kernels
from whisper_cli.config import ModelConfig

KV = tuple[torch.Tensor, torch.Tensor]  # keys and values, (B, H, S, D) each


def window_parts(windows: int, device: torch.device) -> list[slice]:
    """A batch's windows (dim 0 of the encoder's input, and of the audio the cross-attention
    projects) in the groups that run through the model together: on CPU one at a time,
    elsewhere all at once.

    A row's text must not depend on the windows beside it, so a window's encoder output
    and cross K/V must be the same bytes in any batch. Within one call a GEMM's rounding
    can depend on its count of rows: held to AVX2 (MKL_ENABLE_INSTRUCTIONS=AVX2, Intel
    Xeon with AMX), torch's f32 linear at base's 512x512 gives a window other bytes at 1,
    3, 5, 7 and 11 windows than inside a call of 16. A window alone meets every op over
    audio frames in the same calls, of the same rows, in any batch, whatever a kernel does
    with a call's rows. On CPU it costs no time (a window's 1500 rows are past the rows
    where a GEMM's per-row cost flattens) and only one window's activations are live:
    10 min of speech took as long as with one call a batch, at a peak 200-500 MiB lower
    (docs/speed.md). On CUDA one call over the batch keeps the GPU busy (whether its
    kernels round a window by its batch: scripts/gpu_check.py's parity stage reports it)."""
    if device.type == "cpu":
        return [slice(w, w + 1) for w in range(windows)]
    return [slice(0, windows)]


def cross_keys_transposed(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the cross-attention keys are stored (B, H, D, S) and seen as (B, H, S, D)
    (a view: every reader takes them as any strided tensor).

    A decode step reads every row's cross keys once, so it costs about their bytes over
    the memory's bandwidth. On CPU in float32, q k^T over keys stored by column is a GEMV
    that streams them at that rate; over (S, D) rows SDPA and a GEMM both take 1.2-1.4x
    as long (tiny.en, 16 rows, 4 layers: 14.8 against 17.5-21 ms, Intel Xeon with AMX,
    kernels.attention's timing chooses among them for each layout). In f16/bf16 the CPU's
    SDPA over rows is fastest by far (10.7 against 33 ms or more), and CUDA's fused
    kernels want rows.
    """
    return device.type == "cpu" and dtype == torch.float32


# Frames a block of copy_by_column reads: 64 frames of a row are 96-320 KiB (C 384 to 1280
# in float32), which stay in a core's L2 while their columns are written out. (Whether a
# tensor is stored so is kernels.by_column.)
BY_COLUMN_FRAMES = 64


def copy_by_column(k: torch.Tensor, out: torch.Tensor) -> None:
    """k (B, H, S, D) copied into `out`: the same shape, stored (B, H, D, S) (a view of
    such storage).

    Copied a block of frames at a time: a transposing copy of the whole (S, C) of a row
    reads each frame's values C apart, and the lines it reads for one output row are
    gone before the next wants them. Measured (one layer's keys of 16 rows of base, 49 MB
    in float32, Intel Xeon with AMX, 2 threads): into memory already faulted in, 29 ms at
    once against 8.8 ms by 64 frames (13 by 16, 10.7 by 256; a plain copy 2.9 ms); into
    fresh memory, as a batch's caches are made, 39.5 against 21-24 ms. tiny.en's keys
    (C 384: a row's 2.3 MB stay in L2 either way) take 16 ms both ways."""
    stored = out.mT  # (B, H, D, S)
    for at in range(0, k.shape[2], BY_COLUMN_FRAMES):
        stored[..., at : at + BY_COLUMN_FRAMES].copy_(k[:, :, at : at + BY_COLUMN_FRAMES].mT)


def _stored(t: torch.Tensor) -> torch.Tensor:
    """t seen in its memory order (cross keys stored by column, model.cross_keys_transposed,
    as stored): a row of dim 0 is then one block, and torch copies it as one (index_select
    and index_copy_ over the transposed view go element by element: 1.95 against 0.37 ms
    for 4 of tiny.en's rows of one layer's keys in f32, AMD EPYC Zen 4)."""
    return t.mT if kernels.by_column(t) else t


def _rows_of(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t's rows `rows` (dim 0), in t's own memory layout (transposed cross keys stay so)."""
    stored = _stored(t)
    picked = torch.index_select(stored, 0, rows)
    return picked if stored is t else picked.mT


class KVCache:
    """Keys and values of one attention layer, (B, H, L, D) each, written in place.

    Run state of one decode, never module state: the engine creates the caches of a
    batch and passes them in (see DecodeCaches).
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # positions: (T,) int64, the same for every row, or (B, T) each row its own (rows
        # out of step, see Extent); k, v: (B, H, T, D)
        if positions.dim() == 1:
            self.k.index_copy_(2, positions, k)
            self.v.index_copy_(2, positions, v)
            return
        at = positions[:, None, :, None].expand(k.shape)  # (B, H, T, D)
        self.k.scatter_(2, at, k)
        self.v.scatter_(2, at, v)

    def select(self, rows: torch.Tensor) -> KVCache:
        return KVCache(_rows_of(self.k, rows), _rows_of(self.v, rows))


@dataclass
class DecodeCaches:
    """The KV caches of one decode: per decoder layer, self-attention (B, H, L, D) and
    cross-attention (B, H, S, D) (its keys maybe stored transposed, see
    cross_keys_transposed), in the weights' dtype.

    sources: None, or for each row the first row whose cross K/V are the same values
    (rows of one window: a retry and the attempts decoded ahead of it); the cross-attention
    may read those (kernels.attention). Whoever changes which window a row holds sets it
    anew; a select or compact returns caches without it."""

    self_attn: list[KVCache]
    cross: list[KVCache]
    sources: tuple[int, ...] | None = None

    @property
    def rows(self) -> int:
        return self.cross[0].k.shape[0]

    def select(self, rows: torch.Tensor) -> DecodeCaches:
        """The caches of `rows` only, new tensors (the eager path drops finished rows)."""
        return DecodeCaches(
            [c.select(rows) for c in self.self_attn], [c.select(rows) for c in self.cross]
        )

    def compact(self, into: torch.Tensor, rows: torch.Tensor, n: int) -> DecodeCaches:
        """The caches of their first n rows once rows `rows` are copied into rows `into`, in
        place: views of these tensors, which are overwritten. The eager path drops finished
        rows this way when nothing else reads the caches: it copies only the rows it moves
        (a select copies every row it keeps: 35 MiB a row for base in f32)."""
        for t in self.tensors():
            stored = _stored(t)  # rows moved as blocks, in the layout they are kept in
            stored.index_copy_(0, into, torch.index_select(stored, 0, rows))
        return DecodeCaches(
            [KVCache(c.k[:n], c.v[:n]) for c in self.self_attn],
            [KVCache(c.k[:n], c.v[:n]) for c in self.cross],
        )

    def cross_kv(self) -> list[KV]:
        return [(c.k, c.v) for c in self.cross]

    def tensors(self) -> list[torch.Tensor]:
        return [t for c in (*self.self_attn, *self.cross) for t in (c.k, c.v)]


@dataclass(frozen=True)
class Extent:
    """The self-attention cache slots a decoder call reads.

    written: the slots written once this call's tokens are (eager calls): attention reads
    only those. With positions shared by every row (T,), consecutive and ending at
    written - 1, it is causal among the call's own tokens with no mask to build; with
    positions per row (B, T) (rows out of step once a batch is refilled, see engine.py),
    each row sees the slots up to its own position. None: the whole cache under a mask
    built from the positions, so that shapes are fixed for a given (B, T) and the
    one-token step compiles once and replays.
    """

    written: int | None = None


FIXED = Extent()  # the compiled step's


@dataclass(frozen=True)
class Reach:
    """The shapes a run's forward passes reach, which its kernel plan covers: prompts of
    up to `prompt` positions, sequences of up to `text`; with `aligned`, whole sequences
    through the word-alignment pass. No shape class depends on a batch's rows (kernels.py,
    the invariants), so neither does the reach."""

    prompt: int
    text: int
    aligned: bool = False


class FromCheckpoint:
    """A layer whose values always come from the checkpoint (the strict load fills them):
    torch's random draw at construction is skipped. nn.Embedding's normal draw on the meta
    device imports PyTorch's Python decompositions, about a second of every start;
    nn.Linear's and nn.Conv1d's uniform draws there cost 7-10 ms a build (tiny.en, base)."""

    def reset_parameters(self) -> None:
        pass


class Table(FromCheckpoint, nn.Embedding):
    """An embedding table (see FromCheckpoint)."""


class Linear(FromCheckpoint, nn.Linear):
    """nn.Linear (the same parameters) run by kernels.linear: the GEMM its kernel plan
    names (see Whisper.use_plan) for a layer over `rows`: "tokens" (the decoder's text) or
    "frames" (the encoder's audio, and the cross-attention keys and values of it)."""

    plan: kernels.KernelPlan | None = None  # None: torch's reference kernel
    kernel_op = "linear"  # its op in a kernel plan

    def __init__(self, *args, rows: str = "tokens", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rows = rows
        self.binding = kernels.Binding()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = self._product(x.dtype)
        out = None if product is None else product(x)
        if out is not None:
            return out
        return kernels.linear(x, self.weight, self.bias, self.plan, self.rows)

    def _product(self, dtype: torch.dtype) -> kernels.BoundProduct | None:
        """The plan's C product for rows of `dtype`, bound (kernels.Binding); None without a
        plan, while torch.compile traces (one graph, no Python-side choice), or where the
        plan chose another implementation."""
        plan, w, b = self.plan, self.weight, self.bias
        if plan is None or torch.compiler.is_compiling():
            return None
        make = lambda: kernels.bound_linear(plan, dtype, w, b, self.rows)  # noqa: E731
        return self.binding.get(plan, dtype, None, w, b, make)


class Conv1d(FromCheckpoint, nn.Conv1d):
    """nn.Conv1d (the same parameters) run by kernels.conv1d as its kernel plan names:
    stride and padding only (Whisper's convolutions have no dilation or groups)."""

    plan: kernels.KernelPlan | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        assert self.dilation == (1,) and self.groups == 1 and self.padding_mode == "zeros"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stride, padding = self.stride[0], self.padding[0]
        return kernels.conv1d(x, self.weight, self.bias, stride, padding, self.plan)


class Attention(nn.Module):
    plan: kernels.KernelPlan | None = None  # the attention kernels (see Whisper.use_plan)

    def __init__(
        self, d_model: int, heads: int, rows: str = "tokens", kv_rows: str | None = None
    ) -> None:
        """rows: what the queries' rows are (see Linear); kv_rows: the keys' and values'
        (default: the same; the cross-attention's are the encoder's frames)."""
        super().__init__()
        self.heads = heads
        kv_rows = kv_rows or rows
        self.q_proj = Linear(d_model, d_model, rows=rows)
        # Whisper's keys have no bias.
        self.k_proj = Linear(d_model, d_model, bias=False, rows=kv_rows)
        self.v_proj = Linear(d_model, d_model, rows=kv_rows)
        self.out_proj = Linear(d_model, d_model, rows=rows)

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
        sources: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        y = kernels.attention(q, k, v, mask, causal, self.plan, sources)  # (B, H, T, D)
        b, h, t, d = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(b, t, h * d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Uncached full self-attention (the encoder)."""
        q, k, v = (self.split_heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.attend(q, k, v)

    def forward_self(
        self, x: torch.Tensor, cache: KVCache, positions: torch.Tensor, extent: Extent
    ) -> torch.Tensor:
        """Causal self-attention: write these tokens' K/V at `positions`, attend over the
        cache as far as `extent` says."""
        q, k, v = (self.split_heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        cache.write(positions, k, v)
        k, v = cache.k, cache.v
        if extent.written is not None:
            k, v = k[:, :, : extent.written], v[:, :, : extent.written]
            if positions.dim() == 1:
                return self.attend(q, k, v, causal=q.shape[2] > 1)  # several: from position 0
        # Position p sees cache slots 0..p: (T, L) bool, or (B, 1, T, L) with rows' own.
        mask = torch.arange(k.shape[2], device=x.device) <= positions[..., None]
        return self.attend(q, k, v, mask if positions.dim() == 1 else mask[:, None])

    def forward_cross(
        self,
        x: torch.Tensor,
        kv: KV,
        heads: torch.Tensor | None = None,
        sources: tuple[int, ...] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cross-attention over the encoder's K/V (projected once per batch), and the
        scores of the given heads (word timing) or None; sources: the rows whose K/V each
        row's equal (DecodeCaches.sources).

        scaled_dot_product_attention returns no weights, so they are computed explicitly,
        for these heads only, as openai-whisper does: (q * D^-1/4) @ (k * D^-1/4)^T, in
        the model dtype, (B, len(heads), T, S), before the softmax.
        """
        q = self.split_heads(self.q_proj(x))
        k, v = kv
        scores = None
        if heads is not None:
            scale = q.shape[-1] ** -0.25
            scores = (q[:, heads] * scale) @ (k[:, heads] * scale).transpose(-1, -2)
        return self.attend(q, k, v, sources=sources), scores

    def cross_kv(self, audio: torch.Tensor) -> KV:
        """(B, S, C) encoder output -> its cross-attention K and V, (B, H, S, D) each.

        Projected in window_parts' groups of windows (on CPU one at a time: a window's
        K/V are then the same bytes in any batch), and laid out once per batch (every step
        reads them whole, and CPU attention over the strided view of (B, S, C), one head's
        rows C values apart, is slower): V by rows, K by rows or by columns as
        cross_keys_transposed says.

        Why cached at all: a step could attend over the encoder output itself, the query
        taken through k_proj's weight (q W_k) and the weighted sum through v_proj's after
        it (k_proj has no bias, the softmax sums to 1), and hold no K/V: one output serves
        every layer, read once a layer with an online softmax (half the bytes of K and V),
        for H times the multiply-adds. The best C prototype of it so far (AVX-512, blocks
        of 32 frames, the next one prefetched; 16 rows, one step's layers, both
        projections included, alternating, median of 21, Intel Xeon with AMX, 2 cores):
        tiny.en's shape 7.8-10.8 ms against 11.0-14.7 over these caches, base's 21.4-29.2
        against 22.5-28.1. Base is bound by the arithmetic (80-120 GFLOP/s with the output
        in cache, SGEMM 230-280 here), and an AVX2 CPU has half the lanes. Not used: a gain
        for the smallest model alone does not pay for a second kind of cross cache through
        the engine's row drops, refills and alignment pass. (docs/speed.md: an earlier
        attempt, with other shapes.)
        """
        b, s, c = audio.shape
        shape = (b, self.heads, s, c // self.heads)
        by_column = cross_keys_transposed(audio.dtype, audio.device)
        k = audio.new_empty((*shape[:2], shape[3], s)).mT if by_column else audio.new_empty(shape)
        v = audio.new_empty(shape)
        for part in window_parts(b, audio.device):
            frames = audio[part]
            keys = self.split_heads(self.k_proj(frames))
            if by_column:
                copy_by_column(keys, k[part])
            else:
                k[part].copy_(keys)
            v[part].copy_(self.split_heads(self.v_proj(frames)))
        return k, v


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.self_attn = Attention(d_model, heads, rows="frames")
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        self.fc1 = Linear(d_model, ffn, rows="frames")
        self.fc2 = Linear(ffn, d_model, rows="frames")
        self.final_layer_norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))  # (B, S, C)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class DecoderLayer(nn.Module):
    def __init__(self, d_model: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.self_attn = Attention(d_model, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        self.encoder_attn = Attention(d_model, heads, kv_rows="frames")
        self.encoder_attn_layer_norm = nn.LayerNorm(d_model)
        self.fc1 = Linear(d_model, ffn)
        self.fc2 = Linear(ffn, d_model)
        self.final_layer_norm = nn.LayerNorm(d_model)

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache,
        cross: KV,
        positions: torch.Tensor,
        extent: Extent,
        heads: torch.Tensor | None = None,
        sources: tuple[int, ...] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T, C) -> (B, T, C), and the cross-attention scores of `heads` (see
        Attention.forward_cross; sources: DecodeCaches.sources)."""
        x = x + self.self_attn.forward_self(self.self_attn_layer_norm(x), cache, positions, extent)
        normed = self.encoder_attn_layer_norm(x)
        y, scores = self.encoder_attn.forward_cross(normed, cross, heads, sources)
        x = x + y
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x)))), scores


def _class_ends(n: int) -> list[int]:
    """1..n at the upper end of every shape class a length or a count falls in: the
    powers of two and the multiples of 64 up to n, and n."""
    powers = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return sorted({*powers, *range(64, n + 1, 64), n})


def _linear_calls(module: nn.Module) -> Iterator[kernels.KernelCall]:
    """The calls of every linear layer under `module` (float or int8 weights), each with
    its own weight: an int8 layer holds the form of its call's choice
    (quantize.prepare_forms); kernels.build_plan takes layers alike as one."""
    for layer in module.modules():
        op = getattr(type(layer), "kernel_op", None)
        if op is not None:
            yield kernels.KernelCall(op, (*layer.weight.shape, layer.rows), layer.weight)


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        c = cfg.d_model
        self.conv1 = Conv1d(cfg.num_mel_bins, c, kernel_size=3, padding=1)
        self.conv2 = Conv1d(c, c, kernel_size=3, stride=2, padding=1)
        self.embed_positions = Table(cfg.max_source_positions, c)
        self.layers = nn.ModuleList(
            EncoderLayer(c, cfg.encoder_attention_heads, cfg.encoder_ffn_dim)
            for _ in range(cfg.encoder_layers)
        )
        self.layer_norm = nn.LayerNorm(c)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        # mel: (B, n_mels, 2S) in the model dtype -> (B, S, C), its windows in the groups
        # window_parts makes (on CPU one at a time).
        parts = window_parts(mel.shape[0], mel.device)
        if len(parts) == 1:
            return self.encode(mel)
        out = None
        for part in parts:
            x = self.encode(mel[part])
            if out is None:
                out = x.new_empty((mel.shape[0], *x.shape[1:]))
            out[part] = x
        return out

    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        # mel: (B, n_mels, 2S) in the model dtype -> (B, S, C)
        x = F.gelu(self.conv1(mel))
        # (B, C, S) -> (B, S, C), made contiguous once: the residual stream would
        # otherwise keep the transposed layout through every add, and each layer norm
        # would copy it.
        x = F.gelu(self.conv2(x)).transpose(1, 2).contiguous()
        x = x + self.embed_positions.weight[: x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class Decoder(nn.Module):
    plan: kernels.KernelPlan | None = None  # the tied projection's kernel

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
        # The output projection is tied to the embedding; `--quantize int8` gives it an int8
        # copy of its own (quantize.Int8Linear), the embedding staying for the lookup.
        self.proj_out: nn.Module | None = None

    def new_caches(
        self,
        audio: torch.Tensor,
        length: int,
        cross: list[KV] | None = None,
        same: Sequence[int] | None = None,
    ) -> DecodeCaches:
        """Caches for decoding `audio` (B, S, C): self-attention slots for `length`
        positions (zeros; a slot is read only once written) and every layer's cross K/V,
        projected once (or `cross`, projected before from the same audio), in the
        weights' dtype and device.

        same: for each row, the first row whose audio is the same values (a window's
        attempts); the cross K/V are then projected for those first rows only and
        copied to the others: rows of one window hold the same bytes (what
        DecodeCaches.sources counts on)."""
        b = audio.shape[0]
        w = self.embed_tokens.weight
        shape = (b, self.heads, length, w.shape[1] // self.heads)
        self_attn = [
            KVCache(w.new_zeros(shape), w.new_zeros(shape)) for _ in range(len(self.layers))
        ]
        if same is not None and (len(same) != b or not all(0 <= r < b for r in same)):
            raise ValueError(f"same: a row of the {b} for each row, not {same}")
        if cross is None:
            firsts = sorted(set(same)) if same is not None else []
            if len(firsts) in (0, b):
                cross = [layer.encoder_attn.cross_kv(audio) for layer in self.layers]
            else:  # a layer at a time: one layer's projection alive beside the copies
                at = torch.tensor([firsts.index(r) for r in same], device=audio.device)
                distinct = audio[firsts]
                cross = []
                for layer in self.layers:
                    k, v = layer.encoder_attn.cross_kv(distinct)
                    cross.append((_rows_of(k, at), _rows_of(v, at)))
        return DecodeCaches(self_attn, [KVCache(k, v) for k, v in cross])

    def fill_caches(self, caches: DecodeCaches, audio: torch.Tensor) -> None:
        """Refill `caches` in place for a new batch `audio` of the same shape (a compiled
        step replays over fixed buffers): the cross K/V are projected again; the self
        slots are overwritten as the decode goes (a slot is read only once written)."""
        for layer, cache in zip(self.layers, caches.cross, strict=True):
            k, v = layer.encoder_attn.cross_kv(audio)
            cache.k.copy_(k)
            cache.v.copy_(v)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, caches: DecodeCaches, extent: Extent
    ) -> torch.Tensor:
        """Tokens (B, T) at positions (T,), or (B, T) each row its own -> logits (B, T, V):
        a decode step (T 1), a prompt, or the language pass."""
        return self.logits(self.hidden(tokens, positions, caches, extent)[0])

    def hidden(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        caches: DecodeCaches,
        extent: Extent,
        heads: dict[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens (B, T) at positions (T,) or (B, T) -> the final hidden states (B, T, C), and the
        cross-attention scores of the heads `heads` names ({layer: head indices}; word
        timing), (B, n_heads, T, S) in the model dtype, ordered by layer then head (None
        without heads)."""
        if extent.written is not None and 1 < tokens.shape[1] != extent.written:
            raise ValueError("an eager call of several tokens must start at position 0")
        heads = heads or {}
        x = self.embed_tokens(tokens) + self.embed_positions(positions)
        scores = []
        for index, (layer, cache, cross) in enumerate(
            zip(self.layers, caches.self_attn, caches.cross, strict=True)
        ):
            x, layer_scores = layer(
                x, cache, (cross.k, cross.v), positions, extent, heads.get(index), caches.sources
            )
            if layer_scores is not None:
                scores.append(layer_scores)
        return self.layer_norm(x), torch.cat(scores, dim=1) if scores else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., C) final hidden states -> (..., V) logits."""
        if self.proj_out is not None:
            return self.proj_out(hidden)
        # The output projection is tied to the embedding; the kernel is the plan's.
        return kernels.logits(hidden, self.embed_tokens.weight, self.plan)


class Whisper(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.plan: kernels.KernelPlan | None = None  # None: torch's reference kernels

    def use_plan(self, plan: kernels.KernelPlan | None) -> None:
        """Run every kernel call by `plan` (made for this model's dtype and device, see
        kernel_calls): each module that calls a kernel holds it from now on."""
        self.plan = plan
        for module in self.modules():
            if module is not self and hasattr(type(module), "plan"):
                module.plan = plan
            if isinstance(getattr(module, "binding", None), kernels.Binding):
                module.binding = kernels.Binding()  # the last plan's forms not kept alive

    def kernel_calls(self, reach: Reach) -> Iterator[kernels.KernelCall]:
        """The kernel calls of a run's forward passes (see Reach): at least one per shape
        class they can reach (kernels.build_plan keeps one of each), with the weights as
        this model holds them. Lengths are taken at the upper end of every class (see
        _class_ends), so each one of a run falls in the class of one of them."""
        cfg, enc, dec = self.config, self.encoder, self.decoder
        frames = cfg.max_source_positions  # encoder positions; the mel has twice as many
        for conv in (enc.conv1, enc.conv2):
            c_out, c_in, width = conv.weight.shape
            shape = (c_in, c_out, width, 2 * frames, conv.stride[0], conv.padding[0])
            yield kernels.KernelCall("conv1d", shape, conv.weight)
        prompts = [t for t in _class_ends(reach.prompt) if t > 1]
        texts = _class_ends(reach.text)
        whole = [t for t in texts if t > 1] if reach.aligned else []
        h, d = dec.heads, cfg.d_model // dec.heads
        keys = "transposed" if cross_keys_transposed(self.dtype, self.device) else "rows"
        h_enc = cfg.encoder_attention_heads
        yield kernels.KernelCall("attention", (h_enc, frames, frames, cfg.d_model // h_enc, "none"))
        # Every linear layer, the encoder's and the decoder's, the vocabulary projection:
        # one class each, whatever the rows of a call.
        yield from _linear_calls(self)
        if dec.proj_out is None:  # the tied projection
            weight = dec.embed_tokens.weight
            yield kernels.KernelCall("logits", tuple(weight.shape), weight)
        # The decoder's attention: one token (the language pass, a step) over the positions
        # written so far, a prompt, whole sequences (the alignment pass).
        for s in texts:
            yield kernels.KernelCall("attention", (h, 1, s, d, "none"))
        for t in [1, *prompts, *whole]:
            if t > 1:
                yield kernels.KernelCall("attention", (h, t, t, d, "causal"))
            yield kernels.KernelCall("attention", (h, t, frames, d, "none", keys))

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device
