"""CPU kernels for attention, the tied vocabulary projection, linear layers (also with
int8 weights, under `--quantize int8`) and convolutions, and the plan that says which
implementation runs each call.

Every op has a reference implementation, torch's own (SDPA, `hidden @ weight.T`,
F.linear, F.conv1d; for int8 weights, the dequantizing linear), and on the CPU a few
others. Which one is fastest depends on the CPU, the dtype and the shape, by factors up to
tens (docs/speed.md), so it is measured on the machine, never assumed.

Invariants:
* Every implementation is as exact as the reference or closer, against a float64
  reference: f16/bf16 inputs are computed in float32 and the result rounded once to the
  input dtype. Attention never rounds its scores to a half dtype (with peaked scores that
  has several times SDPA's error); it computes them in float32, as SDPA's CPU kernel does.
* A model's choices are a KernelPlan, made once where the model is loaded (build_plan, for
  every shape class the run can reach) and held by the modules that call a kernel. A call
  only looks its shape class up in memory: nothing in a forward pass times, reads or
  writes anything, and a model runs the same kernels for its whole life. A class outside
  the plan runs the reference.
* No class depends on how many rows a call has: a batch's size, or which rows share it.
  Implementations round differently, so a choice that changed with the rows would make a
  row's text depend on its batch (measured: base on 10 min of speech, 42-46 words of its
  sampled fallbacks differed between --batch-size 16, 5 and 1). A linear layer's class is
  its weight's shape and what its rows are: text tokens (timed at TOKEN_ROWS) or audio
  frames (the encoder and the cross-attention keys and values, timed at ENCODER_ROWS).
  Where rows share a call of varying size or mask (GEMMs over text tokens, a step's
  attention over the text's keys), the timing also checks that a candidate gives each
  row what it gives the row alone (_rows_alike, _step_alike), and chooses among those.
  Audio frames share no call: on the CPU the model runs a batch's windows through the
  encoder and the cross-attention projections one at a time (model.window_parts), so a
  window meets the same calls in any batch, whatever a kernel does with a call's rows.
* A choice in mode auto comes from the cache file (kernels_cache_path()), per CPU model,
  torch version, thread count, dtype and shape class; where it has none, from a timing of
  every candidate on synthetic inputs of that class (time_candidates), merged into the
  file. Another implementation replaces the reference only when TIMING_MARGIN faster, so
  near-equals keep the reference.
* Off the CPU, and while torch.compile traces (one graph, no choice on the Python side),
  the reference runs.
* Some implementations are C compiled on the machine (native.py: "fused" and "tiled"
  attention, "columns" linear layers and projection, "widened" int8 ones): offered only
  where it builds, so a machine without a C compiler runs the others. The int8 kernels'
  row passes (quantize, rescale) are C from the same library where it builds, torch's
  elementwise calls where not: the same bytes either way.

`WHISPER_CLI_KERNELS`: `auto` (default), `reference`, or a comma list of implementation
names forced where they apply (the reference elsewhere); neither of the last two times or
writes anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from whisper_cli import native
from whisper_cli.dtypes import DTYPE_NAMES, dtype_name

log = logging.getLogger(__name__)

Tensor = torch.Tensor
Attention = Callable[[Tensor, Tensor, Tensor, "Tensor | None", bool], Tensor]
Logits = Callable[[Tensor, Tensor], Tensor]

# Query rows per block of "blocked" attention, and the most bytes one tile of (batch,
# head) pairs may hold in f32 scores, and in f32 copies of f16/bf16 keys and values: the
# scores of a tile stay in cache, and an upcast tile stays under glibc's mmap threshold
# (a whole f32 copy of a decode cache is past it, so page-faulted in on every call).
# The sizes are the fastest measured (docs/speed.md).
BLOCK_ROWS = 256
SCORE_TILE_BYTES = 2 << 20
UPCAST_TILE_BYTES = 16 << 20
# Weight rows upcast per block by the "f32-blocks" vocabulary projection (a 2-5 MB buffer).
LOGIT_BLOCK_ROWS = 1024
# Queries at least this long are the encoder's shape class (the decoder has at most 448),
# and the rows a GEMM over audio frames is timed at (per-row costs are flat there).
ENCODER_ROWS = 512
# The rows a GEMM over text tokens is timed at, and the batch attention is timed at: a
# decode step of the default batch (options.py), where a run spends its decoder's time.
TOKEN_ROWS = 16
# The keys a step's self-attention is timed at (one class for 1-448 keys, see
# _attention_shape): a window's text is some 30-150 tokens, and at any length this
# attention is a small part of a step (its cache is a few hundred KB).
TEXT_KEYS = 128
CONV_TIMING_LENGTH = 512  # frames a convolution is timed on (see _conv1d_shape)
# The most rows an int8 linear kernel takes at once (int8_linear): a call of more runs in
# equal tiles of 257-512 rows (256 and 257 for a call of 513; a window's 1500 frames: three
# of 500), near the ENCODER_ROWS a plan times audio frames at. Each kernel's float32
# temporaries are then a few MB, where a batch of 16 windows in one call made hundreds of
# MB of them.
INT8_TILE_ROWS = ENCODER_ROWS
# Timing: most elements of one synthetic K tensor (the batch is cut to fit). Each
# candidate is warmed up once, and a second time where it is TIMING_CUTOFF times slower
# than the best (the best as it stands after such second calls too): oneDNN makes a
# kernel for each new shape in its first call (measured on Zen 4: a packed 384x384
# linear's first call at one row took 0.47 ms, its later ones 0.02-0.05). One still that
# slow is dropped there. Then the rest are called in turn, round after round (a load
# burst on a shared machine then hits all of them alike), for at least TIMING_REPS rounds
# and TIMING_MIN_S, at most TIMING_MAX_REPS; each keeps its fastest call. Another
# implementation replaces the reference only when TIMING_MARGIN faster (a tie keeps the
# reference, and a repeated timing does not flip between near-equals).
TIMING_ELEMENTS = 1 << 24
TIMING_REPS = 3
TIMING_MAX_REPS = 20
TIMING_MIN_S = 0.05
TIMING_CUTOFF = 4.0
TIMING_MARGIN = 0.95
# Outputs a half-dtype check of rows (_rows_alike, _step_alike) compares, at least, over
# fresh random draws. A half kernel computes in float32 and rounds once, so two sums that
# differ in float32's last bits mostly round to the same bf16 value: measured on Zen 3,
# torch's f32 GEMM under a bf16 N384xK384 linear differs at 1-3 rows of 16 in float32,
# yet one draw of 16 rows showed it in 9 of 40 draws, and chosen, it changed a row's text
# with its batch. 2^19 outputs is 86 draws there (missed with odds ~0.78^86, 3e-10), one
# for the vocabulary projection; a float32 check shows every difference in one draw.
CHECK_OUTPUTS = 1 << 19
# The tied vocabulary projection is timed with its weight out of the cache, as a step
# finds it: between two steps the cross-attention streams every row's keys and values
# through the cache (tiny.en f32, batch 16: 295 MB against an 80 MB weight). Timed with
# the weight cached, the plan took "weight-first" for tiny.en f32 on a 2-core Xeon with
# AMX (family 6 model 207, 300 MiB L3: 3.49 against packed's 4.19 ms), where packed made
# the run faster (10 min, whole process, alternating, the same text: 8.40 / 8.00 -> 7.52 /
# 7.41 s; docs/speed.md).
# Before each of its calls the timing reads COLD_CACHE_FACTOR times the CPU's largest
# cache: at least COLD_MIN_BYTES (also where sysfs gives no size), at most COLD_MAX_BYTES.
COLD_CACHE_FACTOR = 1.25
COLD_MIN_BYTES = 64 << 20
COLD_MAX_BYTES = 1 << 30
CACHE_VERSION = 11  # a file of another version is read as empty (its choices timed again)


# --- attention implementations ------------------------------------------------------
# All take q (B, H, T, D), k and v (B, H, S, D), a bool mask broadcastable to
# (B, H, T, S) (True = attend) or None, and causal (key j visible to query i when j <= i,
# top-left aligned as in SDPA), and return (B, H, T, D) in q's dtype.


def _sdpa(q, k, v, mask, causal):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def _visible(mask, causal, rows: slice, t: int, s: int, device) -> torch.Tensor | None:
    """The mask of query rows `rows` (..., rows, S), causal folded in; None: all visible."""
    if mask is not None and mask.dim() >= 2 and mask.shape[-2] == t:
        mask = mask[..., rows, :]
    if causal:
        r = torch.arange(rows.start, rows.stop, device=device)
        tri = torch.arange(s, device=device) <= r[:, None]  # (rows, S)
        mask = tri if mask is None else mask & tri
    return mask


def _attend_f32(q, k, v, mask) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v computed in float32 (a no-op cast for f32 inputs), the
    result rounded once to q's dtype.

    f16/bf16: scores rounded to the half dtype have 7x SDPA's error against float64 with
    peaked scores; weights rounded to it before a half GEMM over v (SDPA keeps its row
    maximum exact) still have 1.05-1.4x. In float32 throughout: 0.75-1.0x SDPA's error.
    """
    scores = (q.float() * q.shape[-1] ** -0.5) @ k.float().mT  # (B, H, T, S) f32
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


def _matmul(q, k, v, mask, causal):
    t, s = q.shape[-2], k.shape[-2]
    return _attend_f32(q, k, v, _visible(mask, causal, slice(0, t), t, s, q.device))


def _blocked(q, k, v, mask, causal):
    """Matmul attention over tiles of (batch, heads, query rows) whose f32 scores and
    f32 copies of f16/bf16 keys and values stay within SCORE_TILE_BYTES and
    UPCAST_TILE_BYTES, instead of the full (B, H, T, S) scores or an f32 copy of the cache."""
    b, h, t, d = q.shape
    s = k.shape[-2]
    rows = min(t, BLOCK_ROWS)
    fit = SCORE_TILE_BYTES // (4 * s * rows)  # (batch, head) pairs per tile
    if q.dtype != torch.float32:
        fit = min(fit, UPCAST_TILE_BYTES // (4 * s * 2 * d))
    fit = max(1, fit)
    if fit >= h:  # whole heads, several batch rows
        nb, nh = min(b, fit // h), h
    else:  # one batch row, heads split evenly
        nb, nh = 1, -(-h // -(-h // fit))
    # (B, T, H, D) storage seen as (B, H, T, D): the caller's merge of heads is a view.
    out = q.new_empty((b, t, h, v.shape[-1])).transpose(1, 2)
    for t0 in range(0, t, rows):
        ts = slice(t0, min(t, t0 + rows))
        m = _visible(mask, causal, ts, t, s, q.device)
        if m is not None:  # right-aligned broadcasting, made explicit: (B|1, H|1, rows, S)
            m = m.reshape((1,) * (4 - m.dim()) + m.shape)
        for b0 in range(0, b, nb):
            bs = slice(b0, b0 + nb)
            for h0 in range(0, h, nh):
                hs = slice(h0, h0 + nh)
                mt = None
                if m is not None:
                    mt = m[
                        bs if m.shape[0] == b else slice(None),
                        hs if m.shape[1] == h else slice(None),
                    ]
                out[bs, hs, ts] = _attend_f32(q[bs, hs, ts], k[bs, hs], v[bs, hs], mt)
    return out


def by_column(t: Tensor) -> bool:
    """Whether (..., S, D) tensor t is stored by column ((..., D, S) seen as rows), as the
    f32 model's cross keys are (model.cross_keys_transposed)."""
    return t.stride(-2) == 1 and t.stride(-1) != 1


def _key_counts(mask: Tensor | None, b: int, s: int) -> Tensor | None:
    """(B,) int64 key counts where a one-query bool mask lets each row see its first keys
    only (a refilled step's, model.Attention.forward_self), else None."""
    if mask is None or mask.numel() not in (s, b * s):
        return None
    rows = mask.reshape(-1, s).expand(b, s)  # one row's mask: every row's
    counts = rows.sum(-1)
    prefix = torch.arange(s, device=mask.device) < counts[:, None]
    return counts if bool(counts.min() >= 1) and torch.equal(rows, prefix) else None


def _fused_function(q, k, v, mask, causal) -> tuple[str, Tensor | None] | None:
    """The C function (native.DECODE_ATTENTION) for this call and the rows' key counts
    (None: all keys), None where none applies: one query per row, unmasked or each row
    seeing its first keys (_key_counts), bf16 or f32, keys by rows (bf16, f32) or by
    column (f32)."""
    if causal or q.shape[-2] != 1 or q.device.type != "cpu":
        return None
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.bfloat16, torch.float32):
        return None
    # The C loop takes B, H and D from q and S from k: no broadcasting, no other value size.
    if not q.shape[:2] == k.shape[:2] == v.shape[:2] or not 1 <= k.shape[-2] == v.shape[-2]:
        return None
    if not q.shape[-1] == k.shape[-1] == v.shape[-1] <= native.MAX_HEAD_DIM:
        return None
    if k.shape[-2] > native.MAX_KEYS:
        return None
    if q.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    columns = by_column(k)
    if not columns and k.stride(-1) != 1:
        return None
    counts = None if mask is None else _key_counts(mask, q.shape[0], k.shape[-2])
    if mask is not None and counts is None:
        return None
    wanted = (dtype_name(q.dtype), columns)
    name = next((f for f, of in native.DECODE_ATTENTION.items() if of == wanted), None)
    return None if name is None else (name, counts)


def _fused(q, k, v, mask, causal, sources: tuple[int, ...] | None = None):
    """One query over the keys and values read once, in float32 (bf16 widened as it is
    read) (csrc/attention.c): a decode step's attention without a float32 copy of its
    cache or a call per tile; a refilled step's mask taken as each row's key count, so a
    row sums what it sums unmasked. Blocked attention for any other call, and where the
    library is absent.

    sources: row b's keys and values are row sources[b]'s (the same values: see
    attention); the C loop reads those, rows of one source back to back, so that their
    keys and values come from memory once."""
    lib = _native()
    function = _fused_function(q, k, v, mask, causal)
    if lib is None or function is None:
        return _blocked(q, k, v, mask, causal)
    name, counts = function
    if sources is not None:  # checked here: the C loop reads where they point
        b = q.shape[0]
        if len(sources) != b or not all(0 <= s < b for s in sources):
            raise ValueError(f"sources: a row of the {b} for each, not {sources}")
        sources = (ctypes.c_int64 * b)(*sources)
    b, h, _, d = q.shape
    out = q.new_empty((b, 1, h, d)).transpose(1, 2)  # as _blocked's: heads merge as a view
    # torch.profiler sees no C call made through ctypes: under it, the call is a named
    # range, its key count in the name (scripts/step_profile.py tells cross-attention by it).
    profiled = torch._C._autograd._profiler_enabled()
    with torch.profiler.record_function(f"{FUSED_RANGE}{k.shape[-2]}") if profiled else _NO_RANGE:
        getattr(lib, name)(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
            b, h, k.shape[-2], d,
            native.strides(q, 2), native.strides(k, 4), native.strides(v, 3),
            native.strides(out, 2), None if counts is None else counts.data_ptr(),
            sources, d**-0.5, torch.get_num_threads(),
        )  # fmt: skip
    return out


def _tiled_applies(q, k, v, mask, causal, lib) -> bool:
    """Whether csrc/attention.c's encoder attention takes this call: float32 or bfloat16 on
    the CPU, unmasked, each tensor's last dimension contiguous, no broadcasting, D a
    multiple of the library's vector width, and something to compute (the C loop divides
    the work by the batch's heads and the queries' tiles)."""
    if lib is None or mask is not None or causal or q.device.type != "cpu" or q.numel() == 0:
        return False
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not q.shape[:2] == k.shape[:2] == v.shape[:2] or k.shape[-2] != v.shape[-2]:
        return False
    d = q.shape[-1]
    if not d == k.shape[-1] == v.shape[-1] or d % getattr(lib, native.ENCODER_LANES)():
        return False
    return q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k.shape[-2] >= 1


def _tiled(q, k, v, mask, causal):
    """The encoder's attention in one C loop per (batch, head) (csrc/attention.c): the keys
    packed into panels and the values made contiguous once per head, then read from the
    core's cache by every tile of queries; computed in float32 (bf16 widened as it is
    packed), rounded once. SDPA for any other call, and where the library is absent."""
    lib = _native()
    if not _tiled_applies(q, k, v, mask, causal, lib):
        return _sdpa(q, k, v, mask, causal)
    b, h, t, d = q.shape
    out = q.new_empty((b, t, h, d)).transpose(1, 2)  # as _blocked's: heads merge as a view
    status = getattr(lib, native.ENCODER_ATTENTION[dtype_name(q.dtype)])(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), b, h, t, k.shape[-2], d,
        native.strides(q, 3), native.strides(k, 3), native.strides(v, 3),
        native.strides(out, 3), d**-0.5, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the encoder attention's buffers (a few MB a thread)")
    return out


FUSED_RANGE = "whisper_cli::fused_attention/S"  # + the call's key count
# + the call's output columns (csrc/matmul.c's products, csrc/dot.c's)
MATMUL_RANGE = "whisper_cli::matmul/N"
_NO_RANGE = contextlib.nullcontext()


def _native():
    """The C kernels' library (native.py), built beside the kernel cache file at its first
    call: a plan in reference mode or off the CPU never builds it. Called per kernel call
    (a decode step makes dozens): looked up once per value of the environment that
    kernels_cache_path reads, not by building that path each time (~20 us)."""
    env = os.environ
    return _native_for(
        env.get("WHISPER_CLI_KERNELS_CACHE"), env.get("XDG_CACHE_HOME"), env.get("HOME")
    )


@functools.cache
def _native_for(*_environment: str | None):
    """_native's library; `_environment`: what kernels_cache_path reads, only the key."""
    return native.library(_native_dir())


def _native_dir() -> Path:
    """Where the C kernels' library is built: beside the kernel cache file."""
    return kernels_cache_path().parent / "native"


def _native_offered() -> bool:
    """Whether the C kernels may be offered: built already, or buildable here."""
    return native.buildable(_native_dir())


ATTENTION: dict[str, Attention] = {
    # torch's fused kernel: the reference, and the fastest for f32 where measured.
    "sdpa": _sdpa,
    # Two GEMMs and a softmax in f32: for CPUs where SDPA's f16/bf16 path is slow (decode
    # self-attention without native bf16, docs/speed.md).
    "matmul": _matmul,
    # The same in cache-sized tiles: the encoder's long queries without the full score
    # tensor, and the bf16 decode caches upcast a tile at a time instead of whole.
    "blocked": _blocked,
    # A decode step's unmasked attention in one C loop over the caches (csrc/): offered
    # only for that class, and only where the library builds.
    "fused": _fused,
    # The encoder's in one C loop per (batch, head) over packed keys (csrc/): offered for
    # that class in float32 and bfloat16, where the library builds.
    "tiled": _tiled,
}


def attention_candidates(
    shape_class: str,
    dtype: torch.dtype | None = None,
    kind: str = "none",
    keys: str = "rows",
) -> tuple[str, ...]:
    """Implementations timed for a shape class ("decode", "prefill", "encoder") of
    `dtype`, mask `kind` and key layout (see _attention_shape).

    Each computes in float32 and rounds once (the reference, SDPA, as its CPU kernel
    does), so each is exact enough in every dtype; which one is fastest does depend on
    the dtype, and the dtype is part of every class's name."""
    if shape_class == "encoder":  # plain matmul would hold all (B, H, T, S) f32 scores
        tiled = dtype in (torch.float32, torch.bfloat16) and kind == "none" and keys == "rows"
        return ("sdpa", "blocked", "tiled") if tiled and _native_offered() else ("sdpa", "blocked")
    common = ("sdpa", "matmul", "blocked")
    fused = shape_class == "decode" and kind == "none"
    fused &= dtype == torch.float32 or (dtype == torch.bfloat16 and keys == "rows")
    return (*common, "fused") if fused and _native_offered() else common


# --- vocabulary projection implementations ------------------------------------------
# (..., C) hidden states and the (V, C) tied embedding -> (..., V) in hidden's dtype.


def _logits_f32_blocks(hidden, weight):
    """The projection LOGIT_BLOCK_ROWS vocabulary rows at a time, in f32. f16/bf16: each
    block of the weight is upcast into one reused f32 buffer: f32 GEMM speed on CPUs
    without native half GEMMs, no f32 copy of the weight kept, and the result rounded
    once, as a half GEMM (f32 accumulation) rounds its output."""
    v = weight.shape[0]
    out = hidden.new_empty((*hidden.shape[:-1], v))
    h32 = hidden.float()
    buf = None
    if weight.dtype != torch.float32:
        buf = torch.empty((min(LOGIT_BLOCK_ROWS, v), weight.shape[1]), device=weight.device)
    for r0 in range(0, v, LOGIT_BLOCK_ROWS):
        block = weight[r0 : r0 + LOGIT_BLOCK_ROWS]
        if buf is not None:
            block = buf[: block.shape[0]].copy_(block)
        out[..., r0 : r0 + block.shape[0]] = h32 @ block.T
    return out


def _logits_weight_first(hidden, weight):
    """(V, C) @ (C, M), then transposed to (M, V) contiguous: some BLAS builds stream the
    tall weight against a few columns much faster than a few rows against its transpose."""
    rows = hidden.reshape(-1, hidden.shape[-1])  # (M, C)
    out = (weight @ rows.T).T.contiguous()  # (M, V)
    return out.view(*hidden.shape[:-1], weight.shape[0])


# oneDNN's copy of a weight in its own blocked layout, made once per weight tensor and
# dropped with it: id(weight) -> (a weak reference to it, its version, the copy).
_PACKED: dict[int, tuple[weakref.ref, int, Tensor]] = {}
_PACKABLE: dict[torch.dtype, bool] = {}


def packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of `dtype` on this CPU (f32 where torch has oneDNN;
    bf16 and f16 only with the instructions it asks for, e.g. avx512bw or avx_ne_convert)."""
    if dtype not in _PACKABLE:
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype))
            _PACKABLE[dtype] = True
        except (RuntimeError, AttributeError):  # unsupported CPU, or no oneDNN in this build
            _PACKABLE[dtype] = False
    return _PACKABLE[dtype]


def _version(weight: Tensor) -> int:
    """Its in-place version; an inference tensor (made under inference_mode) keeps none."""
    return -1 if weight.is_inference() else weight._version


def _packed(weight: Tensor) -> Tensor:
    key = id(weight)
    entry = _PACKED.get(key)
    if entry is None or entry[0]() is not weight or entry[1] != _version(weight):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        ref = weakref.ref(weight, lambda _: _PACKED.pop(key, None))
        entry = _PACKED[key] = (ref, _version(weight), packed)
    return entry[2]


# Forms of a weight made once and dropped with it: (id(weight), kind) -> (a weak reference
# to it, its storage and version, the form).
_DERIVED: dict[tuple[int, str], tuple[weakref.ref, tuple[int, int], object]] = {}


def _derived(weight: Tensor, kind: str, make: Callable[[], object]):
    """`make()`'s form of `weight`, made once per weight, storage (a parameter's `.data`
    swapped, as Module.to does) and version, dropped with it."""
    key, held = (id(weight), kind), (weight.data_ptr(), _version(weight))
    entry = _DERIVED.get(key)
    if entry is None or entry[0]() is not weight or entry[1] != held:
        form = make()
        ref = weakref.ref(weight, lambda _: _DERIVED.pop(key, None))
        entry = _DERIVED[key] = (ref, held, form)
    return entry[2]


def _logits_packed(hidden, weight, packed: Tensor | None = None):
    """oneDNN's linear over a copy of the weight packed once in its blocked layout
    (_linear_packed, no bias): no call repacks the (V, C) matrix, as BLAS does for every
    call. Costs one more copy of the embedding once chosen."""
    return _linear_packed(hidden, weight, None, packed)


def _logits_f32_packed(hidden, weight, packed: Tensor | None = None):
    """ "packed" over a float32 copy of an f16/bf16 weight (_linear_f32_packed, no bias).
    Costs an f32 copy of the embedding once chosen."""
    return _linear_f32_packed(hidden, weight, None, packed)


def _reorder_f32(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.float())


LOGITS: dict[str, Logits] = {
    "matmul": lambda hidden, weight: hidden @ weight.T,  # the reference
    "linear": F.linear,  # the same GEMM through addmm's path; differs by CPU and M
    "weight-first": _logits_weight_first,
    "f32-blocks": _logits_f32_blocks,
    "packed": _logits_packed,
    "f32-packed": _logits_f32_packed,
    "columns": lambda hidden, weight, packed=None: _linear_columns(hidden, weight, None, packed),
}


# --- linear layers and convolutions -----------------------------------------------------
# Every nn.Linear and nn.Conv1d of the model (model.Linear, model.Conv1d) calls these.


def _f32_copies(weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Float32 copies of a half weight and its bias (exactly their values), made once per
    weight where an f32-upcast implementation runs, and kept with the weight."""
    return _derived(weight, "f32", lambda: (weight.float(), None if bias is None else bias.float()))


def _linear_f32(x, weight, bias, f32: tuple[Tensor, Tensor | None] | None = None):
    """x W^T + b in float32 from f16/bf16 inputs, the result rounded once: what a half GEMM
    accumulating in f32 computes (products of bf16 or f16 values are exact in f32), at f32
    GEMM speed on CPUs without native half GEMMs (where torch's bf16 path is several times
    slower, docs/speed.md). The weight and bias in float32 are the kept copies
    (_f32_copies), so no call converts them; `f32`: copies of the caller's (timing makes
    its own, so that the run keeps none it did not choose)."""
    w, b = _f32_copies(weight, bias) if f32 is None else f32
    return F.linear(x.float(), w, b).to(x.dtype)


def _linear_packed(x, weight, bias, packed: Tensor | None = None):
    """x W^T + b by oneDNN over a copy of the weight packed once in its blocked layout
    and kept with the weight (_packed): BLAS repacks the weight on every call, which at
    the decode step's few rows costs as much as the product (measured on Zen 4, f32,
    tiny's and base's shapes: 1.2-2.3x as fast at 16 rows, 1.1-1.3x at the encoder's
    512). Costs one more copy of each weight it runs. `packed`: a copy packed by the
    caller (timing packs its own, so that the run keeps none it did not choose)."""
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    packed = _packed(weight) if packed is None else packed
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def _linear_f32_packed(x, weight, bias, packed: Tensor | None = None):
    """ "packed" over a float32 copy of an f16/bf16 weight (exactly its values), packed
    once and kept with the weight, from float32 copies of the rows and bias, the result
    rounded once (see _linear_f32): oneDNN's f32 GEMM, which on CPUs without native half
    GEMMs (where oneDNN packs no half weights) is the fast one. Costs a float32 copy of
    each weight it runs. `packed`: as in _linear_packed."""
    if packed is None:
        packed = _derived(weight, "f32-packed", lambda: _reorder_f32(weight))
    b = None if bias is None else bias.float()
    return _linear_packed(x.float(), weight, b, packed).to(x.dtype)


def _by_columns(weight: Tensor, lib) -> Tensor:
    """A (N, K) weight as csrc/matmul.c's products read it: packed by the library's
    matmul_columns() C output columns, zero past N, (ceil(N / C), K, C)."""
    n, k = weight.shape
    columns = getattr(lib, native.MATMUL_COLUMNS)()
    padded = weight.new_zeros((-(-n // columns) * columns, k))
    padded[:n] = weight
    return padded.view(-1, columns, k).transpose(1, 2).contiguous()


def _columns_take(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether csrc/matmul.c's loops read x and the bias as they are: CPU tensors in one of
    its dtypes, of the weight's sizes."""
    n, k = weight.shape
    takes = _native_rows(x) and x.device.type == "cpu" and x.shape[-1] == k
    return takes and _columns_bias(bias, x.dtype, n)


def _columns_bias(bias: Tensor | None, dtype: torch.dtype, n: int) -> bool:
    """Whether the C loops read `bias` for rows of `dtype` and N outputs: none, or (n,) in
    that dtype."""
    return bias is None or (bias.dtype == dtype and bias.shape == (n,))


def _columns_product(lib, product: str, x, packed, n, scale, bias, out=None) -> Tensor:
    """csrc/matmul.c's `product` (a native.*_MATMUL) of x's rows and the weight `packed` by
    _by_columns, with its scales (None: 1) and bias, in x's dtype: into `out` ((M, N))
    where given, else a new (..., N) tensor. The C loop reads float32 rows: a bf16 run's
    are widened here, exactly, once a call."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.dtype != torch.float32:
        rows = rows.float()
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    b = None if bias is None else bias.contiguous()

    def run(result: Tensor) -> None:
        getattr(lib, f"{product}_{dtype_name(x.dtype)}")(
            rows.data_ptr(), rows.shape[0], k, rows.stride(0), packed.data_ptr(), n,
            None if scale is None else scale.data_ptr(), None if b is None else b.data_ptr(),
            result.data_ptr(), result.stride(0), torch.get_num_threads(),
        )  # fmt: skip

    return _c_rows_out(x, rows.shape[0], n, out, run)


def _c_rows_out(x: Tensor, m: int, n: int, out: Tensor | None, run) -> Tensor:
    """What a C product writes (`run(result)`: x's dtype into (m, n) rows of a stride of
    their own), in x's dtype: straight into `out` ((M, N)) where it is such rows, else into
    a new tensor, returned as (..., N) or copied into `out`. The call is named for
    torch.profiler, which sees no ctypes call (see _fused)."""
    direct = out is not None and out.shape == (m, n) and out.dtype == x.dtype
    direct = direct and out.stride(-1) == 1
    result = out if direct else x.new_empty((m, n))
    profiled = torch._C._autograd._profiler_enabled()
    with torch.profiler.record_function(f"{MATMUL_RANGE}{n}") if profiled else _NO_RANGE:
        run(result)
    if direct:
        return out
    return _into(result.view(*x.shape[:-1], n), out)


class BoundProduct:
    """One layer's csrc/matmul.c product ("columns", int8 "widened") with everything but
    its rows bound once: the library's function for the run dtype, the packed weight, its
    scales and bias, and their addresses. The C loop does the same per-row arithmetic as
    on the general path (_columns_product), so the same bytes come out.

    Why: a decode step makes some 30 of these calls (tiny.en), most right after a
    cross-attention has streamed tens of MB through the CPU's caches, and there the general
    path's Python (the plan's lookup, the checks, the closures) runs cold: tiny's 384 x 384
    int8 layer at 13 rows, after a 64 MB read, took 89 us a call against 36 for the bare C
    call (41 and 26 warm; AMD EPYC Zen 4 held to AVX2, 2 threads)."""

    __slots__ = ("_args", "_fn", "_k", "_kept", "_most", "_n", "_widen")

    def __init__(
        self,
        fn: Callable[..., None],
        dtype: torch.dtype,
        packed: Tensor,
        n: int,
        scale: Tensor | None,
        bias: Tensor | None,
        most_rows: int | None = None,
    ) -> None:
        """fn: the library's function for `dtype` rows; most_rows: the most rows a call
        runs bound (more: the general path, which tiles them; None: any)."""
        k = packed.shape[1]
        self._fn, self._k, self._n, self._most = fn, k, n, most_rows
        self._widen = dtype != torch.float32  # the C loop reads float32 rows
        self._kept = (packed, scale, bias)  # the addresses below stay theirs
        ptr = [None if t is None else t.data_ptr() for t in (scale, bias)]
        self._args = (packed.data_ptr(), n, *ptr)

    def __call__(self, x: Tensor) -> Tensor | None:
        """x (..., K) -> (..., N) in x's dtype; None where the general path would do
        otherwise (x not contiguous, not on the CPU or of another K, as _columns_take
        checks; more rows than most_rows): the caller then runs it."""
        k, n = self._k, self._n
        if not (x.is_contiguous() and x.is_cpu and x.shape[-1] == k):
            return None
        m = x.numel() // k
        if self._most is not None and m > self._most:
            return None
        rows = x.float() if self._widen else x
        out = x.new_empty((*x.shape[:-1], n))
        profiled = torch._C._autograd._profiler_enabled()
        with torch.profiler.record_function(f"{MATMUL_RANGE}{n}") if profiled else _NO_RANGE:
            self._fn(
                rows.data_ptr(), m, k, k, *self._args, out.data_ptr(), n, torch.get_num_threads()
            )
        return out


def bound_linear(
    plan: KernelPlan, dtype: torch.dtype, weight: Tensor, bias: Tensor | None, rows: str
) -> BoundProduct | None:
    """The bound "columns" product of a float layer (see linear) with `dtype` rows, where
    its plan chooses it and the C loop takes the layer as it is; else None."""
    if plan.choice("linear", dtype, *weight.shape, rows) != "columns":
        return None
    return _bind_columns(
        dtype, weight, bias, lambda: _derived(weight, "columns", lambda: _columns_form(weight))
    )


def _bind_columns(
    dtype: torch.dtype, weight: Tensor, bias: Tensor | None, packed: Callable[[], Tensor]
) -> BoundProduct | None:
    """A float layer's "columns" product bound on its packed form (`packed()`, made only
    where it binds), where the library is built and the C loop takes the layer as it is;
    else None."""
    lib = _native()
    if lib is None or weight.dtype != dtype or not _bindable(weight, bias, dtype):
        return None
    fn = getattr(lib, f"{native.FLOAT_MATMUL}_{dtype_name(dtype)}")
    return BoundProduct(fn, dtype, packed(), weight.shape[0], None, bias)


def bound_int8_linear(
    plan: KernelPlan,
    dtype: torch.dtype,
    weight: Tensor,
    bias: Tensor | None,
    forms: dict[str, object],
    rows: str,
) -> BoundProduct | None:
    """The bound "widened" product of an int8 layer (see int8_linear) with `dtype` rows, on
    the form in `forms`, where its plan chooses it and the C loop takes the layer as it
    is; else None. Calls of more than INT8_TILE_ROWS rows keep the general path's tiles."""
    choice = plan.choice("int8-linear", dtype, *weight.shape, rows)
    if choice != "widened":
        return None
    return _bind_widened(dtype, weight, bias, forms.get(choice))


def _bind_widened(
    dtype: torch.dtype, weight: Tensor, bias: Tensor | None, form: tuple[Tensor, Tensor] | None
) -> BoundProduct | None:
    """An int8 layer's "widened" product bound on its form (_widened_prepare's), where
    the library is built, there is a form and the C loop takes the layer as it is; else
    None."""
    lib = _native()
    if lib is None or form is None or not _bindable(weight, bias, dtype):
        return None
    packed, scales = form
    fn = getattr(lib, f"{native.INT8_MATMUL}_{dtype_name(dtype)}")
    return BoundProduct(fn, dtype, packed, weight.shape[0], scales, bias, INT8_TILE_ROWS)


def _bound_first(
    bound: BoundProduct | None, general: Callable[[Tensor], Tensor]
) -> Callable[[Tensor], Tensor]:
    """A C product as bound (the product model.Linear and quantize.Int8Linear call once
    their plan chooses it), the general path where the bound one does not take the call."""
    if bound is None:
        return general

    def run(x: Tensor) -> Tensor:
        out = bound(x)
        return general(x) if out is None else out

    return run


def _bindable(weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> bool:
    """Whether csrc/matmul.c's loops take a layer of this weight and bias, with rows of
    `dtype`, as it is: the layer's part of _columns_take, and a bias read in place."""
    takes = dtype in _NATIVE_DTYPES and weight.device.type == "cpu"
    takes &= _columns_bias(bias, dtype, weight.shape[0])
    return takes and (bias is None or bias.is_contiguous())


class Binding:
    """A layer's BoundProduct (or None), made at its first call and again whenever its plan,
    its rows' dtype, its forms (quantize.prepare_forms), its weight (another tensor, or
    this one changed in place: as _derived remakes a form) or its bias tensor change:
    checked by identity and a few reads a call."""

    __slots__ = ("_key", "_product")

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._product: BoundProduct | None = None

    def get(
        self,
        plan: KernelPlan,
        dtype: torch.dtype,
        forms: dict[str, object] | None,
        weight: Tensor,
        bias: Tensor | None,
        make: Callable[[], BoundProduct | None],
    ) -> BoundProduct | None:
        key = self._key
        fresh = key is not None and key[0] is plan and key[1] is dtype and key[2] is forms
        fresh = fresh and key[3] is weight and key[4] is bias
        if not fresh or key[5] != (weight.data_ptr(), _version(weight)):
            self._product = make()
            self._key = (plan, dtype, forms, weight, bias, (weight.data_ptr(), _version(weight)))
        return self._product


def _columns_form(weight: Tensor) -> Tensor | None:
    """The float32 weight (a half one's exact values) packed by columns for
    _linear_columns; None where the library is not built."""
    lib = _native()
    return None if lib is None else _by_columns(weight.float(), lib)


def _linear_columns(x, weight, bias, packed: Tensor | None = None):
    """x W^T + b by csrc/matmul.c's float_matmul_*: a few rows against a float32 copy of
    the weight packed by columns once and kept with it (a bf16 weight's exact values),
    each output one float32 sum of fused multiply-adds in order, the bias added and the
    result rounded once to x's dtype; the same bytes for a row whatever rows share the
    call. The weight streams once a call, the next panel prefetched (matmul.c): at a
    decode step's rows it beats oneDNN's packed GEMM, whose later tiles of rows leave the
    memory idle (tiny's vocabulary projection at 16 rows 1.5x as fast on a Xeon held to
    AVX2, 1.3x with AVX-512). Costs a float32 copy of each weight it runs. Where the
    library is not built, or x or the bias is not as the C loop reads it, the reference.
    `packed`: as in _linear_packed."""
    lib = _native()
    if lib is None or not _columns_take(x, weight, bias) or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    if packed is None:
        packed = _derived(weight, "columns", lambda: _columns_form(weight))
    return _columns_product(lib, native.FLOAT_MATMUL, x, packed, weight.shape[0], None, bias)


LINEAR: dict[str, Callable] = {
    "linear": F.linear,  # the reference
    "f32-upcast": _linear_f32,
    "packed": _linear_packed,
    "f32-packed": _linear_f32_packed,
    "columns": _linear_columns,
}


def _conv1d_f32(x, weight, bias, stride, padding, f32=None):
    """The convolution in float32 from f16/bf16 inputs and the kept float32 copies of its
    weight and bias, rounded once (see _linear_f32): torch's bf16 convolution on AVX2 is its
    slow reference loop."""
    w, b = _f32_copies(weight, bias) if f32 is None else f32
    return F.conv1d(x.float(), w, b, stride, padding).to(x.dtype)


CONV1D: dict[str, Callable] = {
    "conv": lambda x, weight, bias, stride, padding: F.conv1d(x, weight, bias, stride, padding),
    "f32-upcast": _conv1d_f32,
}


def upcast_candidates(kind: str, dtype: torch.dtype) -> tuple[str, ...]:
    """Implementations timed for a linear layer or convolution: the reference; the f32
    upcast for f16/bf16; for a linear layer, "packed" where oneDNN packs this dtype on
    this CPU, "f32-packed" for f16/bf16 where it packs float32, and "columns" for f32 and
    bf16 where the C library builds. A convolution in f32 has the reference alone (nothing
    to time)."""
    if kind == "conv1d":
        return tuple(CONV1D)[: 1 if dtype == torch.float32 else None]
    half = dtype != torch.float32
    offered = {
        "f32-upcast": half,
        "packed": packable(dtype),
        "f32-packed": half and packable(torch.float32),
        "columns": _columns_offered(dtype),
    }
    return tuple(n for n in LINEAR if offered.get(n, True))


def _columns_offered(dtype: torch.dtype) -> bool:
    """Whether "columns" (csrc/matmul.c) is timed for `dtype`: one of its dtypes, where
    the library builds."""
    return dtype in _NATIVE_DTYPES and _native_offered()


def logits_candidates(dtype: torch.dtype) -> tuple[str, ...]:
    """Implementations timed for the projection: all of them, "packed" where oneDNN
    packs this dtype on this CPU, "f32-packed" for f16/bf16 where it packs float32,
    "columns" for f32 and bf16 where the C library builds."""
    offered = {"packed": packable(dtype), "columns": _columns_offered(dtype)}
    offered["f32-packed"] = dtype != torch.float32 and packable(torch.float32)
    return tuple(n for n in LOGITS if offered.get(n, True))


# --- int8 linear layers (`--quantize int8`) -------------------------------------------
# x (..., K) in the run dtype, weight (N, K) int8 and scale (N,) float32 per output channel
# (dtypes.int8_weight), bias (N,) in the run dtype or None -> (..., N) in x's dtype.
# `prepared`: the implementation's own form of the weight (int8_form), made by the caller
# once: each layer holds the forms its plan chose (quantize.prepare_forms, at load), and a
# timing makes its own, so that the run keeps none it did not choose. `out`: (M, N) in x's
# dtype to write the result into (a tile of a larger call's output, see int8_linear), or
# None for a new tensor.


def _into(result: Tensor, out: Tensor | None) -> Tensor:
    return result if out is None else out.copy_(result.view(out.shape))


def _int8_dequant(x, weight, scale, bias, prepared=None, out=None):  # `prepared` unused
    """The reference, weight-only: W = weight * scale in float32 (exact: an int8 times a
    bfloat16 value), x W^T + b in float32 and the result rounded once to x's dtype. The
    float32 W lives for one call; the activations are not quantized."""
    w = weight.float() * scale[:, None]
    b = None if bias is None else bias.float()
    return _into(F.linear(x.float(), w, b).to(x.dtype), out)


def _fbgemm_prepare(weight: Tensor, scale: Tensor):
    """fbgemm's packed int8 weight: its per-channel quantized tensor made from the int8
    values and scales as they are. The bias is added outside (see _int8_fbgemm)."""
    zeros = torch.zeros(weight.shape[0], dtype=torch.long, device=weight.device)
    engine = torch.backends.quantized.engine
    with warnings.catch_warnings():  # the quantized-tensor front end warns of its future
        warnings.simplefilter("ignore")
        q = torch._make_per_channel_quantized_tensor(weight, scale.double(), zeros, 0)
        try:
            torch.backends.quantized.engine = "fbgemm"
            return torch.ops.quantized.linear_prepack(q, None)
        finally:
            torch.backends.quantized.engine = engine


def _unit_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x's rows (M, K) in float32, each divided by its max |x|, and those maxima (M, 1)
    (1 for an all-zero row): a kernel that quantizes a whole call with one scale then
    quantizes every row over its own range. Whisper's rows differ in range (a few carry
    outliers): one scale for all of them costs the others most of their bits. In one C
    pass where the library is built (csrc/int8.c: the same values), else by torch."""
    return _int8_rows("unit_rows", torch.float32, x)


def _quantized_rows(x: Tensor, grid: Grid) -> tuple[Tensor, Tensor]:
    """x's rows (M, K) as unit rows (_unit_rows) quantized on `grid`, uint8, and their
    maxima (M, 1), as _unit_rows makes them."""
    return _int8_rows("quantize_rows", torch.uint8, x, grid)


def _int8_rows(
    kind: str, dtype: torch.dtype, x: Tensor, grid: Grid | None = None
) -> tuple[Tensor, Tensor]:
    """x's rows as `kind` of csrc/int8.c makes them (in `dtype`), and their maxima; uint8
    rows are on `grid`, which the C pass takes from here."""
    rows = x.reshape(-1, x.shape[-1])
    lib = _native()
    if lib is not None and _native_rows(x) and rows.stride(-1) == 1:
        m, k = rows.shape
        out = torch.empty((m, k), dtype=dtype, device=x.device)
        amax = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        on = (grid.steps, grid.zero) if kind == native.INT8_GRID_PASS else ()
        getattr(lib, f"{kind}_{dtype_name(x.dtype)}")(
            rows.data_ptr(), m, k, rows.stride(0), out.data_ptr(), amax.data_ptr(), *on,
            torch.get_num_threads(),
        )  # fmt: skip
        return out, amax
    rows = rows.float()
    amax = rows.abs().amax(dim=-1, keepdim=True)
    amax = torch.where(amax > 0, amax, 1.0)
    unit = (rows / amax).contiguous()
    if dtype == torch.float32:
        return unit, amax
    return unit.mul_(grid.steps).round_().add_(grid.zero).to(torch.uint8), amax


def _rescale(
    acc: Tensor, amax: Tensor, bias: Tensor | None, x: Tensor, n: int, out: Tensor | None
) -> Tensor:
    """The rows' maxima multiplied back and the bias added, in float32, rounded once (into
    `out` where given: a tile's result written where it goes, not copied there): in one C
    pass where the library is built (csrc/int8.c; the bias read in x's dtype, as the
    model holds it), else by torch."""
    lib = _native()
    takes = _native_rows(x) and acc.is_contiguous() and amax.is_contiguous()
    takes &= bias is None or (bias.dtype == x.dtype and bias.is_contiguous())
    takes &= out is None or out.stride(-1) == 1
    if lib is not None and takes:
        if out is None:
            out = x.new_empty((*x.shape[:-1], n))
        rows = out.view(-1, n)
        getattr(lib, f"rescale_rows_{dtype_name(x.dtype)}")(
            acc.data_ptr(), rows.shape[0], n, amax.data_ptr(),
            None if bias is None else bias.data_ptr(), rows.data_ptr(), rows.stride(0),
            torch.get_num_threads(),
        )  # fmt: skip
        return out
    if out is not None:  # computed in float32, rounded to out's dtype as it is written
        if bias is None:
            return torch.mul(acc, amax, out=out)
        return torch.addcmul(bias.float(), acc, amax, out=out)
    acc = acc.mul_(amax) if bias is None else torch.addcmul(bias.float(), acc, amax)
    return acc.view(*x.shape[:-1], n).to(x.dtype)


def _native_rows(x: Tensor) -> bool:
    """Whether csrc/int8.c's passes and matmul.c's products take x's dtype."""
    return x.dtype in _NATIVE_DTYPES


_NATIVE_DTYPES = frozenset(DTYPE_NAMES[name] for name in native.ROW_DTYPES)


@dataclass(frozen=True)
class Grid:
    """The activations' quantization of unit rows (_unit_rows): x = (q - zero) / steps, q
    a uint8 in [zero - steps, zero + steps]. A grid that depends on nothing in the call
    quantizes every row on its own, so a row's result is the same alone, in a batch or in
    a tile of a larger call (int8_linear)."""

    steps: int  # grid points per unit
    zero: int

    @property
    def scale(self) -> float:
        return 1 / self.steps


# 8 bits (q in [1, 255]) where the int8 GEMM sums u8 x s8 products in int32 (VNNI's
# vpdpbusd, AMX); 7 bits (q in [1, 127]) where it sums pairs of them in int16 first
# (AVX2's and AVX-512's vpmaddubsw, saturating at 32767: 2 x 255 x 127 overflows it,
# 2 x 127 x 127 does not). Which one a library does is a fact of the CPU and of the
# library's build, so it is probed (activation_grid), not read from CPU flags. The wide
# grid halves the quantization's error: measured on the shared English clips, teacher
# forced, onednn's logits against f32's, relative: base 0.039-0.056 -> 0.019-0.027,
# tiny.en 0.049-0.060 -> 0.035-0.042 (weight-only int8, the floor: base 0.007-0.010).
WIDE_GRID = Grid(127, 128)
NARROW_GRID = Grid(63, 64)


@functools.cache
def activation_grid(name: str) -> Grid:
    """The grid implementation `name` quantizes activations on in this process: WIDE_GRID
    where its GEMM is exact on the wide grid's worst case, NARROW_GRID elsewhere.

    The probe: rows at the grid's ends (every q = 255, or 1) against weight rows of +-127
    and of alternating signs, K = 64, scales 1: every product and sum is an integer under
    2^24 that float32 holds exactly, so an exact GEMM returns it to the bit and one that
    saturates a pair sum misses it by thousands."""
    k = 64
    signs = torch.tensor([1.0, -1.0]).repeat(k // 2)
    x = torch.stack([torch.ones(k), -torch.ones(k), signs])
    weight = torch.stack([torch.full((k,), 127.0), -torch.full((k,), 127.0), 127 * signs])
    weight = weight.to(torch.int8)
    scale = torch.ones(weight.shape[0])
    exact = x @ weight.float().T
    run = INT8_LINEAR[name]
    got = run(x, weight, scale, None, int8_form(name, weight, scale), grid=WIDE_GRID)
    return WIDE_GRID if torch.equal(got, exact) else NARROW_GRID


def _int8_fbgemm(x, weight, scale, bias, prepared, out=None, grid=None):
    """fbgemm's int8 linear with activations quantized per row (_unit_rows) on `grid`
    (default: activation_grid's), an int8 GEMM accumulating in int32 and the weight's
    scales applied in float32. (Its dynamic variant takes the grid from the call's min
    and max: a row's result would depend on the other rows.)"""
    grid = grid or activation_grid("fbgemm")
    rows, amax = _unit_rows(x)
    acc = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        rows, grid.scale, grid.zero, prepared
    )
    return _rescale(acc, amax, bias, x, weight.shape[0], out)


def _onednn_prepare(weight: Tensor, scale: Tensor):
    """oneDNN's packed int8 weight, the scales in float32 and zero points (all 0)."""
    zeros = torch.zeros(weight.shape[0], dtype=torch.long, device=weight.device)
    return torch.ops.onednn.qlinear_prepack(weight, None), scale.float(), zeros


def _int8_onednn(x, weight, scale, bias, prepared, out=None, grid=None):
    """oneDNN's int8 linear (the kernel inductor and torchao call on x86) with activations
    quantized per row (_quantized_rows) on `grid` (default: activation_grid's), an int8
    GEMM, the weight's scales applied by oneDNN in float32."""
    grid = grid or activation_grid("onednn")
    packed, w_scale, w_zero = prepared
    q, amax = _quantized_rows(x, grid)
    acc = torch.ops.onednn.qlinear_pointwise(
        q, grid.scale, grid.zero, packed, w_scale, w_zero,
        None, 1.0, 0, torch.float32, "none", [], "",
    )  # fmt: skip
    return _rescale(acc, amax, bias, x, weight.shape[0], out)


def _int8_weight_only(x, weight, scale, bias, prepared, out=None):
    """torch's weight-only int8 GEMM (`_weight_int8pack_mm`) over bfloat16 rows: the int8
    values and scales (bfloat16 values, see dtypes.int8_weight) taken as they are, float32
    accumulation, the product rounded to bfloat16, the bias added in float32 and the result
    rounded to x's dtype. An f32 run's rows and products are rounded to bfloat16 inside:
    8 bits of mantissa per element, finer than any int8 quantization of a row."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    acc = torch._weight_int8pack_mm(rows, weight, prepared).float()
    if bias is not None:
        acc += bias.float()
    return _into(acc.view(*x.shape[:-1], weight.shape[0]).to(x.dtype), out)


def _widened_prepare(weight: Tensor, scale: Tensor):
    """csrc/matmul.c's form for int8_matmul_*: the weight packed by columns (_by_columns);
    the scales in float32. None where the library is not built (the kernel then runs the
    reference)."""
    lib = _native()
    if lib is None:
        return None
    return _by_columns(weight, lib), scale.float().contiguous()


def _int8_widened(x, weight, scale, bias, prepared, out=None):
    """Rows times the int8 weight widened to float32 as it is read (csrc/matmul.c,
    int8_matmul_*): each output one float32 sum of fused multiply-adds, then its scale
    and bias, rounded once to x's dtype; nothing quantized or rounded to bfloat16 on the
    way, so as close to the reference ("dequant") as float32 sums in another order.
    Bound by its multiply-adds (an int8 GEMM does four times as many an instruction),
    so for a decode step's few rows, where the others' passes around their product cost
    more than it: one call, not torch's five (widen, product, upcast, bias, round).
    Where the library is not built, or x or the bias is not as the C loop reads it (a
    CPU tensor, in x's dtype, of the weight's sizes), the reference."""
    lib = _native()
    n = weight.shape[0]
    if lib is None or prepared is None or not _columns_take(x, weight, bias):
        return _int8_dequant(x, weight, scale, bias, out=out)
    packed, scales = prepared
    return _columns_product(lib, native.INT8_MATMUL, x, packed, n, scales, bias, out)


def _dot_prepare(weight: Tensor, scale: Tensor):
    """csrc/dot.c's form for int8_dot_*: the weight packed by the library's dot_columns()
    C output columns in quads of k, zero past N and K ((ceil(N / C), ceil(K / 4), C, 4)),
    its column sums in int32 (the grid's zero taken out of the integer sums) and its
    scales in float32. None where the library is not built."""
    lib = _native()
    if lib is None:
        return None
    n, k = weight.shape
    columns = getattr(lib, native.DOT_COLUMNS)()
    padded = weight.new_zeros((-(-n // columns) * columns, -(-k // 4) * 4))
    padded[:n, :k] = weight
    packed = padded.view(-1, columns, padded.shape[1] // 4, 4).transpose(1, 2).contiguous()
    return packed, weight.sum(dim=1, dtype=torch.int32), scale.float().contiguous()


def _int8_dot(x, weight, scale, bias, prepared, out=None, grid=None):
    """Rows quantized on `grid` (default: activation_grid's; _quantized_rows) times the
    int8 weight in one C call (csrc/dot.c, int8_dot_*): integer sums of u8 x s8 products
    (four a lane: VNNI's vpdpbusd, AVX2's vpmaddubsw), exact, then the weight's scale,
    the row's maximum and the bias in float32, rounded once to x's dtype. For a decode
    step's few rows, where fbgemm and oneDNN spend on packing the rows and on dispatch
    what the product costs, and the widened loop (_int8_widened) does a quarter of the
    multiply-adds an instruction. Where the library is not built, or x or the bias is not
    as the C loop reads it, the reference."""
    lib = _native()
    n = weight.shape[0]
    if lib is None or prepared is None or not _columns_take(x, weight, bias):
        return _int8_dequant(x, weight, scale, bias, out=out)
    grid = grid or activation_grid("dot")
    packed, colsum, scales = prepared
    q, amax = _quantized_rows(x, grid)
    m, k = q.shape
    if k % 4:  # the C loop reads rows in quads of bytes: zeros past K
        q = F.pad(q, (0, -k % 4))
    b = None if bias is None else bias.contiguous()

    def run(result: Tensor) -> None:
        getattr(lib, f"{native.INT8_DOT}_{dtype_name(x.dtype)}")(
            q.data_ptr(), m, k, q.stride(0), packed.data_ptr(), colsum.data_ptr(), n,
            scales.data_ptr(), amax.data_ptr(), float(grid.steps), grid.zero,
            None if b is None else b.data_ptr(), result.data_ptr(), result.stride(0),
            torch.get_num_threads(),
        )  # fmt: skip

    return _c_rows_out(x, m, n, out, run)


INT8_LINEAR: dict[str, Callable] = {
    "dequant": _int8_dequant,
    "fbgemm": _int8_fbgemm,
    "onednn": _int8_onednn,
    "weight-only": _int8_weight_only,
    "widened": _int8_widened,
    "dot": _int8_dot,
}
# The form of the weight each implementation takes (`prepared`); "dequant" takes none.
_INT8_PREPARE: dict[str, Callable[[Tensor, Tensor], object]] = {
    "fbgemm": _fbgemm_prepare,
    "onednn": _onednn_prepare,
    "weight-only": lambda weight, scale: scale.to(torch.bfloat16),  # the scales, in bf16
    "widened": _widened_prepare,
    "dot": _dot_prepare,
}


def int8_form(name: str, weight: Tensor, scale: Tensor) -> object | None:
    """Implementation `name`'s form of an int8 weight and its scales (None: it takes none)."""
    prepare = _INT8_PREPARE.get(name)
    return None if prepare is None else prepare(weight, scale)


def _has_op(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


# The int8 kernels that quantize a call's activations (each row on a grid, see Grid).
QUANTIZING = frozenset({"fbgemm", "onednn", "dot"})


def int8_candidates(dtype: torch.dtype, rows: str | None = None) -> tuple[str, ...]:
    """Implementations timed for an int8 linear layer with `dtype` activations over `rows`
    (GEMM_ROWS; None: every one offered here): the reference; fbgemm and oneDNN where
    this torch has them; the weight-only kernel for float32 and bfloat16 rows (float16
    ones would need the scales in float16), and the C loops over the widened weight and
    over quantized rows for them where the library builds.

    A decode step's inner layers ("tokens") keep their activations: no kernel that
    quantizes them is offered there (so "widened", where the library builds: each output
    a float32 sum, a row's relative error 4e-7 against float64). Their errors would pass
    through every later layer and into the self-attention cache, where the output
    projection's ("vocab") and the encoder's ("frames", quantized since int8 began)
    perturb one product. Measured with "dot" in the decoder's layers too, against
    "widened" there (the rest alike), 10 min of English, Intel Xeon with AMX, WER points:
    natively +0.21, +0.13, 0, +0.07 (tiny.en f32 and bf16, base f32 and bf16, all + int8),
    held to AVX2 +0.21 and 0 for tiny.en. (Held, base wrote a passage said twice running
    a third time in either arrangement, f32 with "widened" and bf16 with "dot", a word off
    the speech each time: judge.repeats_too_fast drops both copies since it allows
    Policy.repeat_max_changed_share.) Keeping them costs about 0.45 ms of a 20 ms step
    (tiny.en held, the plan's timings)."""
    names = ["dequant"]
    if "fbgemm" in torch.backends.quantized.supported_engines:
        names.append("fbgemm")
    if torch.backends.mkldnn.is_available() and _has_op("onednn", "qlinear_pointwise"):
        names.append("onednn")
    if dtype in (torch.float32, torch.bfloat16):
        names.append("weight-only")
        if _native_offered():
            names += ["widened", "dot"]
    if rows == "tokens":
        names = [n for n in names if n not in QUANTIZING]
    return tuple(names)


# --- the public entry points ----------------------------------------------------------
# Each runs the implementation its plan names for the call's shape class; without a plan,
# and while torch.compile traces (one graph, no Python-side choice), the reference.


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    causal: bool = False,
    plan: KernelPlan | None = None,
    sources: tuple[int, ...] | None = None,
) -> Tensor:
    """softmax(q k^T / sqrt(D), masked) v: (B, H, T, D) x (B, H, S, D) -> (B, H, T, D).

    Same semantics as F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
    is_causal=causal) with a bool mask (True = attend); every query row must see a key.

    sources: None, or for each row b the row whose keys and values equal b's (rows of one
    window: DecodeCaches.sources). An implementation may read those instead of the row's
    own (the fused one does); the result is the same.
    """
    if plan is None or torch.compiler.is_compiling():
        return _sdpa(q, k, v, mask, causal)
    _, h, t, d = q.shape
    # A step's mask (rows at their own positions once a batch is refilled) changes no
    # class: each row runs what it runs unmasked ("fused" takes the mask as key counts).
    kind = "causal" if causal else "none" if mask is None or t == 1 else "mask"
    # Keys stored by column (model.cross_keys_transposed) are a class of their own: which
    # implementation reads them fastest depends on it.
    keys = "transposed" if by_column(k) else "rows"
    choice = plan.choice("attention", q.dtype, h, t, k.shape[-2], d, kind, keys)
    if sources is not None and choice == "fused":
        return _fused(q, k, v, mask, causal, sources)
    return ATTENTION[choice](q, k, v, mask, causal)


def _one_row_as_two(run: Callable[..., Tensor], x: Tensor, *args) -> Tensor:
    """run(x, *args), where x (..., K) is one row: on two copies of it, the first kept.
    oneDNN and BLAS take a matrix-vector path for one row, which sums in another order
    than their GEMM (measured, Zen 4: oneDNN's packed f32 and bf16 GEMMs at K 1536 and
    2048 differ there alone), so a row's last tokens, stepped alone once the rest of its
    batch has finished, would round otherwise than in company. The second row costs
    little: a one-row GEMM reads the whole weight either way."""
    if x.numel() != x.shape[-1]:
        return run(x, *args)
    out = run(x.reshape(1, -1).expand(2, -1).contiguous(), *args)  # (2, N)
    return out[:1].view(*x.shape[:-1], out.shape[-1])


def logits(hidden: Tensor, weight: Tensor, plan: KernelPlan | None = None) -> Tensor:
    """(..., C) hidden states @ weight (V, C)^T -> (..., V), the tied vocabulary projection."""
    if plan is None or torch.compiler.is_compiling():
        return hidden @ weight.T
    run = LOGITS[plan.choice("logits", hidden.dtype, *weight.shape)]
    return _one_row_as_two(run, hidden, weight)


def linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    plan: KernelPlan | None = None,
    rows: str = "tokens",
) -> Tensor:
    """F.linear(x, weight, bias) by the implementation the plan names for a layer of this
    weight over `rows` ("tokens" or "frames", see GEMM_ROWS)."""
    if plan is None or torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    run = LINEAR[plan.choice("linear", x.dtype, *weight.shape, rows)]
    return _one_row_as_two(run, x, weight, bias)


def int8_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    bias: Tensor | None = None,
    plan: KernelPlan | None = None,
    forms: dict[str, object] | None = None,
    rows: str = "tokens",
) -> Tensor:
    """x (weight * scale)^T + bias for an int8 weight, by the implementation the plan names
    for a layer over `rows` (see linear; without a plan, the dequantizing reference), on
    its form of the weight from `forms` (the
    layer's, see quantize.prepare_forms); a form they lack (a class outside the plan in a
    forced mode) is made for this call only.

    A call of more than INT8_TILE_ROWS rows (the encoder's: a window's 1500) runs in
    equal tiles of rows (row_tiles), each written in place into one output in x's dtype:
    each kernel's float32 and uint8 temporaries are a tile's, not the call's. A
    quantizing kernel computes a row on its own (a grid per row, see Grid), so there the
    result is the untiled call's; the reference's BLAS may round a tile's rows otherwise
    (test_kernels checks both). The tiles are a function of the call's rows alone, and a
    window's frames come as a call of their own (model.window_parts)."""
    if torch.compiler.is_compiling():
        return _int8_dequant(x, weight, scale, bias)
    n, k = weight.shape
    m = x.numel() // k
    choice = "dequant" if plan is None else plan.choice("int8-linear", x.dtype, n, k, rows)
    run = INT8_LINEAR[choice]
    form = forms.get(choice) if forms else None
    if form is None:
        form = int8_form(choice, weight, scale)
    if m <= INT8_TILE_ROWS:
        return _one_row_as_two(run, x, weight, scale, bias, form)
    rows = x.reshape(m, k)
    out = x.new_empty((*x.shape[:-1], n))
    flat = out.view(m, n)
    for part in row_tiles(m, INT8_TILE_ROWS):
        run(rows[part], weight, scale, bias, form, flat[part])
    return out


def row_tiles(m: int, most: int) -> list[slice]:
    """m rows cut into the fewest equal tiles of at most `most` rows (sizes differ by one
    at most): for most = ENCODER_ROWS, every tile of a longer call has 257-512 rows (256
    and 257 for 513), near the rows a plan times audio frames at."""
    tiles = -(-m // most)
    return [slice(m * i // tiles, m * (i + 1) // tiles) for i in range(tiles)]


def conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: int,
    padding: int,
    plan: KernelPlan | None = None,
) -> Tensor:
    """F.conv1d(x, weight, bias, stride, padding) by the implementation the plan names."""
    if plan is None or torch.compiler.is_compiling():
        return F.conv1d(x, weight, bias, stride, padding)
    c_out, c_in, width = weight.shape
    choice = plan.choice("conv1d", x.dtype, c_in, c_out, width, x.shape[-1], stride, padding)
    return CONV1D[choice](x, weight, bias, stride, padding)


# --- shape classes -------------------------------------------------------------------------
# Calls whose costs compare alike share one choice: each op maps its arguments' dtype and
# shape to a class, named as in the cache file. The plan's lookups and its construction use
# the same functions, so a call finds the class its model was planned for.


@dataclass(frozen=True)
class ShapeClass:
    """Calls that share a choice: their name in the cache, the implementations that apply
    (the reference first), the shape a timing runs at, and whether the choice must compute
    every row alike at any count of rows (GEMMs over text tokens, see _rows_alike)."""

    name: str
    candidates: tuple[str, ...]
    timing: tuple
    rows_checked: bool = False


def attention_class(t: int) -> str:
    """The shape class of a query length: one decode step, a prompt, or the encoder."""
    return "decode" if t == 1 else "encoder" if t >= ENCODER_ROWS else "prefill"


def _bucket(n: int) -> int:
    """Lengths timed alike: 1 alone, then multiples of 64 (1500 -> 1536)."""
    return 1 if n == 1 else 64 * math.ceil(n / 64)


def _attention_timing(h: int, t: int, s: int, d: int) -> tuple[int, int, int, int, int]:
    """The shape a class of attention is timed at: the queries cut to two blocks, and a
    batch of TOKEN_ROWS cut so that one K tensor, and the scores, hold at most
    TIMING_ELEMENTS (per-row costs, not totals, are compared: timing the encoder's
    attention costs about one window's per candidate)."""
    # The encoder: per-row costs of sdpa and blocked are flat in T; tiled packs each head's
    # keys once, which weighs more over these rows than over 1500 (against it, if at all).
    t = min(t, 2 * BLOCK_ROWS)
    return max(1, min(TOKEN_ROWS, TIMING_ELEMENTS // (h * s * max(d, t)))), h, t, s, d


def _attention_shape(dtype: torch.dtype, h, t, s, d, kind: str, keys: str = "rows") -> ShapeClass:
    """A call's class without its batch (see the invariants); keys: "rows" ((B, H, S, D)
    storage) or "transposed" ((B, H, D, S), seen as rows). A step over the text's keys is
    one class whatever their count ("Stext", timed at TEXT_KEYS): a refilled step's keys
    are its longest row's, and a row must run what it runs alone."""
    cls = attention_class(t)
    text = cls == "decode" and s < ENCODER_ROWS
    shape = (h, _bucket(t), TEXT_KEYS if text else _bucket(s), d)
    keys_name = "text" if text else shape[2]
    name = f"attention/{dtype_name(dtype)}/{cls}/H{h}xT{shape[1]}xS{keys_name}xD{d}/{kind}"
    if keys != "rows":
        name += "/keys-" + keys
    candidates = attention_candidates(cls, dtype, kind, keys)
    timing = (*_attention_timing(*shape), kind, keys)
    return ShapeClass(name, candidates, timing, rows_checked=text)


# What a GEMM's rows are -> the rows it is timed at (see the invariants). "vocab": the
# decoder's text tokens through an int8 model's output projection (int8_candidates).
GEMM_ROWS = {"tokens": TOKEN_ROWS, "frames": ENCODER_ROWS, "vocab": TOKEN_ROWS}


def _logits_shape(dtype: torch.dtype, v: int, c: int) -> ShapeClass:
    name = f"logits/{dtype_name(dtype)}/V{v}xC{c}"
    return ShapeClass(name, logits_candidates(dtype), (TOKEN_ROWS,), rows_checked=True)


def _linear_shape(dtype: torch.dtype, n: int, k: int, rows: str) -> ShapeClass:
    name = f"linear/{dtype_name(dtype)}/N{n}xK{k}/{rows}"
    cands = upcast_candidates("linear", dtype)
    return ShapeClass(name, cands, (GEMM_ROWS[rows],), rows_checked=rows == "tokens")


def _int8_shape(dtype: torch.dtype, n: int, k: int, rows: str) -> ShapeClass:
    name = f"int8-linear/{dtype_name(dtype)}/N{n}xK{k}/{rows}"
    cands = int8_candidates(dtype, rows)
    return ShapeClass(name, cands, (GEMM_ROWS[rows],), rows_checked=rows != "frames")


def _conv1d_shape(dtype: torch.dtype, c_in, c_out, width, length, stride, padding) -> ShapeClass:
    # Timed on one row of at most CONV_TIMING_LENGTH frames (the batch and the length
    # only multiply the cost): a slow reference (torch's own bf16 convolution on AVX2)
    # would otherwise cost a new machine's first load many seconds.
    n = min(_bucket(length), CONV_TIMING_LENGTH)
    name = f"conv1d/{dtype_name(dtype)}/Cin{c_in}xCout{c_out}xW{width}xL{n}/s{stride}p{padding}"
    return ShapeClass(name, upcast_candidates("conv1d", dtype), (n, stride, padding))


Runs = dict[str, Callable[[], object]]
RowFns = dict[str, Callable[[Tensor], Tensor]]  # a GEMM's candidates as functions of its rows


@dataclass(frozen=True)
class _Op:
    shape_class: Callable[..., ShapeClass]  # (dtype, *shape) -> its class
    # Attention and convolutions: the calls to time, (class, dtype, weight, device) -> Runs.
    runs: Callable[[ShapeClass, torch.dtype, Tensor | None, torch.device], Runs] | None = None
    # GEMMs: each candidate on the real weight as a function of its (M, K) rows in the run
    # dtype, (candidates, dtype, weight) -> RowFns; timed on random rows, and checked.
    fns: Callable[[tuple[str, ...], torch.dtype, Tensor], RowFns] | None = None
    # Ops with `runs` whose classes check rows: whether a candidate computes them alike,
    # (name, class, dtype, device) -> bool.
    alike: Callable[[str, ShapeClass, torch.dtype, torch.device], bool] | None = None
    # Whether each timed call finds the caches flushed (see COLD_CACHE_FACTOR).
    cold: bool = False


# Every op the plan decides, by one mechanism: a class per call, a choice per class.
OPS: dict[str, _Op] = {
    "attention": _Op(
        _attention_shape,
        lambda cls, dtype, weight, device: _attention_runs(
            cls.candidates, cls.timing[:5], dtype, device, *cls.timing[5:]
        ),
        alike=lambda name, cls, dtype, device: _step_alike(
            ATTENTION[name], cls.timing[:5], dtype, device
        ),
    ),
    "logits": _Op(
        _logits_shape, fns=lambda cands, dtype, weight: _logits_fns(cands, weight), cold=True
    ),
    "linear": _Op(
        _linear_shape, fns=lambda cands, dtype, weight: _linear_fns(cands, dtype, weight)
    ),
    "int8-linear": _Op(
        _int8_shape, fns=lambda cands, dtype, weight: _int8_fns(cands, dtype, weight)
    ),
    "conv1d": _Op(
        _conv1d_shape,
        lambda cls, dtype, weight, device: _conv1d_runs(
            cls.candidates, *cls.timing[:1], weight, *cls.timing[1:]
        ),
    ),
}


# --- the plan ------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelCall:
    """A call a model's forward makes, as a plan is built for it: the op, its arguments'
    shape as that op's class function takes it (see OPS), and the weight of the ops that
    have one (timed on it, as it is)."""

    op: str
    shape: tuple
    weight: Tensor | None = None


@dataclass
class KernelPlan:
    """Which implementation runs each kernel call: per op and shape class, for one machine
    (CPU model, torch version), thread count, device and dtype.

    Built once, where the model is loaded (build_plan), and handed to the model's modules.
    A call only looks its class up, in memory: nothing is timed, read or written while a
    model runs. A class the plan does not hold runs as the mode says (auto: the reference),
    and the same kernels run for the same shapes for the model's whole life.
    """

    mode: str  # "auto", "reference", or implementation names forced where they apply
    device: str
    dtype: torch.dtype
    threads: int
    choices: dict[str, str] = field(default_factory=dict)  # class name -> implementation
    ms: dict[str, dict[str, float]] = field(default_factory=dict)  # the timings behind them
    timed: set[str] = field(default_factory=set)  # classes timed by this build, not read
    # Exact call shape -> implementation, filled as calls come (a dict lookup per call).
    _memo: dict[tuple, str] = field(default_factory=dict, repr=False, compare=False)

    def choice(self, op: str, dtype: torch.dtype, *shape) -> str:
        """The implementation a call of `op` on `dtype` arguments of `shape` runs."""
        key = (op, dtype, *shape)
        choice = self._memo.get(key)
        if choice is None:
            cls = OPS[op].shape_class(dtype, *shape)
            choice = self.choices.get(cls.name)
            if choice not in cls.candidates:
                choice = _untimed(self.mode, cls.candidates)
            self._memo[key] = choice
        return choice

    def summary(self) -> str:
        """One line: the mode, where it applies, and per op how many shape classes run
        which implementation."""
        per_op: dict[str, Counter[str]] = {}
        for name, choice in self.choices.items():
            per_op.setdefault(name.split("/")[0], Counter())[choice] += 1
        ops = "; ".join(
            f"{op} " + ", ".join(f"{impl} x{n}" for impl, n in counts.most_common())
            for op, counts in per_op.items()
        )
        head = f"{self.mode} ({self.device}, {dtype_name(self.dtype)}, {self.threads} threads"
        head += f", {len(self.timed)} of {len(self.choices)} classes timed now)"
        return f"{head}: {ops}" if ops else head

    def report(self) -> dict[str, object]:
        """The plan as JSON-ready data: what it is for, and every class's choice."""
        return {
            "mode": self.mode,
            "device": self.device,
            "dtype": dtype_name(self.dtype),
            "threads": self.threads,
            "machine": _machine(),
            "timed_now": len(self.timed),
            "choices": dict(sorted(self.choices.items())),
        }


def _untimed(mode: str, candidates: tuple[str, ...]) -> str:
    """The choice made without a timing: the first forced name that applies, else the
    reference."""
    if mode not in ("auto", "reference"):
        forced = [c for c in mode.split(",") if c in candidates]
        if forced:
            return forced[0]
    return candidates[0]


def kernels_mode() -> str:
    """WHISPER_CLI_KERNELS: `auto` (default: the timed choices), `reference` (SDPA, `@`,
    F.linear, F.conv1d, the dequantizing int8 linear) or a comma list of implementation
    names forced where they apply (the reference elsewhere); the last two time nothing."""
    return os.environ.get("WHISPER_CLI_KERNELS", "auto").strip() or "auto"


def build_plan(
    calls: Iterable[KernelCall],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    mode: str | None = None,
    path: Path | None = None,
) -> KernelPlan:
    """The plan for `calls` (a model's: model.Whisper.kernel_calls) in `dtype` on `device`.

    Mode auto: each shape class's choice read from the cache file (`path`, default
    kernels_cache_path()) for this machine and thread count, or timed now where the file
    has none (or one made among other candidates) and merged into it. Every weight is in
    one class (of its shape and rows), so it holds one copy at most (packed, or float32)
    beside it. Other modes, and a class with one candidate (f32 convolutions; f32 linear
    layers where oneDNN packs nothing and the C library does not build), time nothing.
    Off the CPU the reference runs everywhere.
    """
    device = torch.device(device)
    mode = kernels_mode() if mode is None else mode
    if device.type != "cpu":
        mode = "reference"
    plan = KernelPlan(mode, device.type, dtype, torch.get_num_threads())
    path = kernels_cache_path() if path is None else path
    cached = _read(path) if mode == "auto" else {}
    prefix = f"{_machine()}|threads={plan.threads}|" if mode == "auto" else ""
    saved: dict[str, dict] = {}
    shapes: set[tuple] = set()  # calls of layers alike: one class, looked up once
    for call in calls:
        if (call.op, call.shape) in shapes:
            continue
        shapes.add((call.op, call.shape))
        op = OPS[call.op]
        cls = op.shape_class(dtype, *call.shape)
        if cls.name in plan.choices:
            continue
        if mode != "auto" or len(cls.candidates) == 1:
            plan.choices[cls.name] = _untimed(mode, cls.candidates)
            continue
        entry = cached.get(prefix + cls.name)
        if not _current(entry, cls.candidates):
            entry = _measure(op, cls, dtype, call.weight, device)
            saved[prefix + cls.name] = entry
            plan.timed.add(cls.name)
            log.debug("kernel %s: %s (%s)", cls.name, entry["choice"], entry["ms"])
        plan.choices[cls.name] = entry["choice"]
        plan.ms[cls.name] = entry["ms"]
    if saved:
        _write(path, saved)
    return plan


def _current(entry: object, candidates: tuple[str, ...]) -> bool:
    """A cached entry still decides: its choice is a candidate and it was timed among
    exactly these (one that joined or left since makes it a choice among others)."""
    if not isinstance(entry, dict) or entry.get("choice") not in candidates:
        return False
    ms = entry.get("ms")
    return isinstance(ms, dict) and set(ms) == set(candidates)


def kernels_cache_path() -> Path:
    """WHISPER_CLI_KERNELS_CACHE, else $XDG_CACHE_HOME/whisper-cli/kernels.json (~/.cache)."""
    explicit = os.environ.get("WHISPER_CLI_KERNELS_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "whisper-cli" / "kernels.json"


def _read(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _write(path: Path, entries: dict[str, dict]) -> None:
    """Merge into the file (others may have written since), atomically; a cache that
    cannot be written costs a new timing next load, never the run."""
    tmp = None
    try:
        on_disk = _read(path)
        on_disk.update(entries)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kernels-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": CACHE_VERSION, "entries": on_disk}, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("kernel choices not saved to %s: %s", path, exc)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


# --- timing --------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


# The variables by which oneDNN, MKL and fbgemm are held to fewer instructions than the
# CPU has (each library's own; torch's own limit, ATEN_CPU_CAPABILITY, shows in its
# capability). fbgemm reads FBGEMM_ENABLE_INSTRUCTIONS and nothing else: held to AVX2 by
# it alone, its int8 GEMM sums u8 x s8 pairs in int16 (activation_grid's narrow grid).
ISA_LIMITS = (
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "FBGEMM_ENABLE_INSTRUCTIONS",
)


@functools.cache
def _cpu_features() -> str:
    """A digest of this CPU's model and feature flags (read once)."""
    return hashlib.sha256(native.cpu_digest().encode()).hexdigest()[:12]


def _machine() -> str:
    """What a plan's timings hold for, the key of its entries in the cache file: the CPU (a
    VM may name every generation "Intel(R) Xeon(R) Processor", so its flags' digest too),
    the instructions torch's, oneDNN's, MKL's and fbgemm's kernels are held to, the C kernels' build
    (a changed source is checked and timed anew) and torch's version. A plan made under
    other instructions would run choices that were neither timed nor checked (each row
    computed alike at every row count) for the kernels this process runs."""
    limits = [f"{name}={os.environ[name]}" for name in ISA_LIMITS if os.environ.get(name)]
    return "|".join(
        [
            f"cpu={cpu_model()}",
            f"features={_cpu_features()}",
            f"isa={torch.backends.cpu.get_cpu_capability()}",
            *limits,
            f"native={native.build_name(_native_dir())}",
            f"torch={torch.__version__}",
        ]
    )


def _call_s(fn: Callable[[], object], before: Callable[[], object] | None = None) -> float:
    if before is not None:
        before()  # not timed
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_candidates(
    candidates: Runs, before: Callable[[], object] | None = None
) -> dict[str, tuple[float, bool]]:
    """name -> (ms, timed): the fastest of its timed calls, or (its warm-up, False) for a
    candidate dropped after it. The protocol of every choice (see TIMING_REPS). before:
    called ahead of every call, outside its time (see cache_flush)."""
    _warm_allocator()
    call_s = functools.partial(_call_s, before=before)
    with torch.no_grad():
        warm = {name: call_s(fn) for name, fn in candidates.items()}
        again: set[str] = set()  # warmed up twice (a kernel made in its first call)
        while True:  # until every one over the cutoff has had its second warm-up
            cut = TIMING_CUTOFF * min(warm.values())
            over = [n for n in warm if warm[n] > cut and n not in again]
            if not over:
                break
            for name in over:
                warm[name] = min(warm[name], call_s(candidates[name]))
            again.update(over)
        timed = {name: math.inf for name in candidates if warm[name] <= cut}
        rounds, spent = 0, 0.0
        while rounds < TIMING_MAX_REPS and (rounds < TIMING_REPS or spent < TIMING_MIN_S):
            for name in timed:
                elapsed = call_s(candidates[name])
                timed[name] = min(timed[name], elapsed)
                spent += elapsed
            rounds += 1
    return {n: (timed[n] * 1e3, True) if n in timed else (warm[n] * 1e3, False) for n in warm}


def _time(candidates: Runs, cold: bool = False) -> dict[str, float]:
    """Every candidate's ms (the first is the reference); cold: each call with the CPU's
    caches flushed first (see COLD_CACHE_FACTOR)."""
    flush = cache_flush() if cold else None
    return {name: ms for name, (ms, _) in time_candidates(candidates, flush).items()}


CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def largest_cache_bytes(caches: Path = CPU_CACHES) -> int | None:
    """The size of the CPU's largest cache, from Linux's sysfs (cpu0's), or None."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for entry in caches.glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):  # unreadable, or not a size
            text = entry.read_text().strip()  # "48K", "2048K", "307200K"
            if text:
                unit = units.get(text[-1])
                sizes.append(int(text[:-1]) * unit if unit else int(text))
    return max(sizes, default=None)


def cache_flush() -> Callable[[], object]:
    """A call that reads a buffer of COLD_CACHE_FACTOR times the largest cache through the
    CPU's caches, leaving none of what was there before (the buffer is made and touched
    once, here, and dropped with the call)."""
    buffer = torch.zeros(flush_bytes(largest_cache_bytes()) // 4)
    return buffer.sum


def flush_bytes(cached: int | None) -> int:
    """The bytes a flush reads where the largest cache holds `cached` (None: unknown)."""
    size = COLD_MIN_BYTES if cached is None else int(cached * COLD_CACHE_FACTOR)
    return min(max(size, COLD_MIN_BYTES), COLD_MAX_BYTES)


def _fastest_of(times: dict[str, float], among: Iterable[str] | None = None) -> str:
    """The fastest, where TIMING_MARGIN faster than the reference (the first); else the
    reference (ties keep it, and a repeated timing does not flip between near-equals).
    `among`: only those may be chosen, where any is (the fastest of them, if the reference
    is not); none: all."""
    reference = next(iter(times))
    allowed = [n for n in times if among is None or n in among] or list(times)
    best = min(allowed, key=times.__getitem__)
    if reference not in allowed:
        return best
    return best if times[best] < TIMING_MARGIN * times[reference] else reference


def _measure(op: _Op, cls: ShapeClass, dtype: torch.dtype, weight: Tensor | None, device) -> dict:
    """A class's cache entry: every candidate's ms and the choice; where the class checks
    rows (rows_checked), the choice made among the candidates that compute them alike, and
    what the check found of those it had to check ("rows_alike", see _fastest_alike)."""
    check = None  # candidate -> whether it computes each row alike in any company
    if op.fns is None:
        runs = op.runs(cls, dtype, weight, device)
        if cls.rows_checked and op.alike is not None:
            check = lambda name: op.alike(name, cls, dtype, device)  # noqa: E731
    else:
        fns = op.fns(cls.candidates, dtype, weight)
        g = torch.Generator(device=weight.device).manual_seed(0)
        shape = (cls.timing[0], weight.shape[1])
        x = torch.randn(shape, device=weight.device, generator=g).to(dtype)
        runs = {n: (lambda f=f: f(x)) for n, f in fns.items()}
        if cls.rows_checked:
            more = _check_draws(dtype, shape[0] * weight.shape[0]) - 1
            fresh = (torch.randn(shape, device=x.device, generator=g) for _ in range(more))
            draws = [x, *(r.to(dtype) for r in fresh)]
            check = lambda name: _rows_alike(fns[name], draws)  # noqa: E731
    times = _time(runs, cold=op.cold)
    ms = {n: round(t, 3) for n, t in times.items()}
    if check is None:
        return {"choice": _fastest_of(times), "ms": ms}
    choice, checked = _fastest_alike(times, check)
    return {"choice": choice, "ms": ms, "rows_alike": checked}


def _fastest_alike(times: dict[str, float], alike: Callable[[str], bool]) -> tuple[str, dict]:
    """_fastest_of(times) among the candidates `alike` accepts, checking only those that
    decide it: in order of speed up to the first accepted, and then the reference where
    it would win over that one. The check costs seconds on a slow candidate in a half
    dtype (_check_draws), and the slow ones are never chosen. Returns the choice and what
    was found of each candidate checked."""
    checked: dict[str, bool] = {}

    def ok(name: str) -> bool:
        if name not in checked:
            checked[name] = alike(name)
        return checked[name]

    reference = next(iter(times))
    best = next((n for n in sorted(times, key=times.__getitem__) if ok(n)), None)
    if best is not None and _fastest_of(times, [best, reference]) == reference:
        ok(reference)
    return _fastest_of(times, [n for n, passed in checked.items() if passed]), checked


def _check_draws(dtype: torch.dtype, outputs: int) -> int:
    """Random draws a check of rows makes, where one draw compares `outputs` values: one in
    float32, enough for CHECK_OUTPUTS in a half dtype (see there)."""
    return 1 if dtype == torch.float32 else max(1, math.ceil(CHECK_OUTPUTS / outputs))


def _step_alike(f: Attention, shape, dtype: torch.dtype, device) -> bool:
    """Whether a one-query step of `f` gives each row, bit for bit, what its own call over
    just its keys gives, where rows see every count of keys 1..S of S (a refilled step's
    mask, model.Attention.forward_self), in calls of at most TOKEN_ROWS rows each with a
    row that sees all S (a refilled step's keys are its longest row's), on every draw
    (_check_draws): a row's text then depends neither on the rows beside it nor on their
    positions. Every count, as a reduction's order can change with a count's remainder
    by the vector width or a block: torch's f32 matmul held to AVX2 on a Xeon sums rows
    of 2-7 keys otherwise, and agrees at 1, S/3, S-1 and S. "fused" does by construction
    (csrc/attention.c); the others sum the masked keys' zeros in another order."""
    _, h, _, s, d = shape
    g = torch.Generator(device=device).manual_seed(0)
    opts = {"dtype": dtype, "device": device, "generator": g}
    per_call = TOKEN_ROWS - 1
    calls = [[*range(c, min(s, c + per_call)), s] for c in range(1, s, per_call)] or [[s]]

    def alike(counts: list[int]) -> bool:
        b = len(counts)
        q = torch.randn(b, 1, h, d, **opts).transpose(1, 2)  # (B, H, 1, D), as split heads
        k, v = torch.randn(b, h, s, d, **opts), torch.randn(b, h, s, d, **opts)
        mask = torch.arange(s, device=device) < torch.tensor(counts, device=device)[:, None]
        own = [
            f(q[r : r + 1], k[r : r + 1, :, :n], v[r : r + 1, :, :n], None, False)
            for r, n in enumerate(counts)
        ]
        return torch.equal(f(q, k, v, mask[:, None, None], False), torch.cat(own))

    with torch.no_grad():
        draws = range(_check_draws(dtype, s * h * d))
        return all(alike(counts) for _ in draws for counts in calls)


def _rows_alike(fn: Callable[[Tensor], Tensor], draws: list[Tensor]) -> bool:
    """Whether fn's result for each of a draw's first m rows is, bit for bit, the one for
    them among all of its rows, for every m below its rows and on every draw
    (_check_draws), called as the entry points call it (_one_row_as_two).
    Implementations round differently at some row counts (on Zen 3 and Zen 4, torch's f32
    GEMM at 1-3, 5-7 and 9-11 rows of 16): chosen for text tokens, such a one makes a
    row's text depend on how many rows share its step."""

    def alike(x: Tensor) -> bool:
        whole = fn(x)
        rows = range(1, x.shape[0])
        return all(torch.equal(_one_row_as_two(fn, x[:m]), whole[:m]) for m in rows)

    with torch.no_grad():
        return all(alike(x) for x in draws)


def _fastest(candidates: Runs) -> tuple[str, dict[str, float]]:
    """The fastest candidate and every one's ms."""
    times = _time(candidates)
    return _fastest_of(times), times


def _warm_allocator() -> None:
    """Time kernels in the allocator state of a real run, not of a fresh process.

    glibc serves blocks above its mmap threshold (128 KiB at start) with fresh, page-
    faulted mappings, and raises the threshold (to at most 32 MiB) when such a block is
    freed, as happens in any run once weights are loaded. Before that, every tile of
    "blocked" attention is page-faulted in, so a timing in a fresh process would choose,
    and save, the wrong kernel. Allocating and freeing one such block here gives every
    process the warm state.
    """
    torch.empty(30 << 18).fill_(0)  # 30 MiB, touched, freed


def _attention_runs(
    cands, shape, dtype: torch.dtype, device, kind: str, keys: str = "rows"
) -> Runs:
    """Calls of each candidate on random tensors of `shape` (see _attention_timing), the
    keys laid out as `keys` says (see _attention_shape)."""
    b, h, t, s, d = shape
    # A generator of its own: timing never moves the global random state.
    g = torch.Generator(device=device).manual_seed(0)
    opts = {"dtype": dtype, "device": device, "generator": g}
    q = torch.randn(b, t, h, d, **opts).transpose(1, 2)  # as split heads: (B, H, T, D) view
    # As the caches: keys by rows or (B, H, D, S) seen as rows, values by rows.
    transposed = keys == "transposed"
    k = torch.randn(b, h, d, s, **opts).mT if transposed else torch.randn(b, h, s, d, **opts)
    v = torch.randn(b, h, s, d, **opts)
    mask = torch.ones(t, s, dtype=torch.bool, device=device) if kind == "mask" else None
    causal = kind == "causal"
    return {n: (lambda f=ATTENTION[n]: f(q, k, v, mask, causal)) for n in cands}


def _logits_fns(cands, weight: Tensor) -> RowFns:
    """Each candidate on the real weight (no copy of it, but a packed one's own, freed
    with the timing)."""
    fns = {n: (lambda x, f=LOGITS[n]: f(x, weight)) for n in cands}
    if "packed" in fns:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        fns["packed"] = lambda x: _logits_packed(x, weight, packed)
    if "f32-packed" in fns:  # the same
        f32_packed = _reorder_f32(weight)
        fns["f32-packed"] = lambda x: _logits_f32_packed(x, weight, f32_packed)
    if "columns" in fns:
        columns = _columns_form(weight)
        fns["columns"] = lambda x: LOGITS["columns"](x, weight, columns)
    return fns


def _linear_fns(cands, dtype: torch.dtype, weight: Tensor) -> RowFns:
    """Each candidate on the real weight, no bias (its add costs alike); the copies a
    candidate keeps are its own, freed with the timing. "columns" is timed as bound
    (_bound_first), as a layer calls it once chosen: at a decode step's rows the general
    path's Python around the C call costs about what the call does (see BoundProduct)."""
    fns = {n: (lambda x, f=LINEAR[n]: f(x, weight, None)) for n in cands}
    if "f32-upcast" in fns:
        f32 = (weight.float(), None)
        fns["f32-upcast"] = lambda x: LINEAR["f32-upcast"](x, weight, None, f32)
    if "packed" in fns:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        fns["packed"] = lambda x: _linear_packed(x, weight, None, packed)
    if "f32-packed" in fns:
        f32_packed = _reorder_f32(weight)
        fns["f32-packed"] = lambda x: _linear_f32_packed(x, weight, None, f32_packed)
    if "columns" in fns:
        columns = _columns_form(weight)
        general = lambda x: _linear_columns(x, weight, None, columns)  # noqa: E731
        fns["columns"] = _bound_first(_bind_columns(dtype, weight, None, lambda: columns), general)
    return fns


def _int8_fns(cands, dtype: torch.dtype, weight: Tensor) -> RowFns:
    """Each candidate on the real int8 weight, unit scales, no bias; each prepares its own
    form of the weight, freed with the timing. "widened" is timed as bound (see
    _linear_fns)."""
    scale = torch.full((weight.shape[0],), 1 / 127, device=weight.device)

    def fn(name: str) -> Callable[[Tensor], Tensor]:
        prepared = int8_form(name, weight, scale)
        general = lambda x: INT8_LINEAR[name](x, weight, scale, None, prepared)  # noqa: E731
        if name != "widened":
            return general
        return _bound_first(_bind_widened(dtype, weight, None, prepared), general)

    return {n: fn(n) for n in cands}


def _conv1d_runs(cands, length: int, weight: Tensor, stride: int, padding: int) -> Runs:
    g = torch.Generator(device=weight.device).manual_seed(0)
    shape = (1, weight.shape[1], length)
    x = torch.randn(shape, dtype=weight.dtype, device=weight.device, generator=g)
    runs = {n: (lambda f=CONV1D[n]: f(x, weight, None, stride, padding)) for n in cands}
    if "f32-upcast" in runs:  # copies of its own, freed with the timing
        f32 = (weight.float(), None)
        runs["f32-upcast"] = lambda: CONV1D["f32-upcast"](x, weight, None, stride, padding, f32)
    return runs
