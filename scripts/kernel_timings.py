"""Per-kernel CPU timings at Whisper's real shapes, and what whisper_cli.kernels picks.

    OMP_WAIT_POLICY=PASSIVE python scripts/kernel_timings.py [--models tiny.en,base,large-v3]
        [--dtypes f32,bf16] [--cache]
        [--only decode-cross,decode-shared,decode-self,encoder,logits,linear-encoder,
                linear-decode,conv]

For each model, dtype and kernel, every implementation is timed by the kernel plan's own
protocol (kernels.time_candidates: one warm-up each, then calls in turn for at least
--reps rounds, min per implementation; one whose warm-up is 4x the best warm-up is shown
with that time and a `*`), then a plan made for that call picks as a load would (its own
timing of the shape class, on a fresh cache file unless --cache, which uses and fills the
real one).
Shapes: decode cross-attention B 16 x 1 query x 1500 keys; the same with SHARED of the 16
rows one window's attempts (the fused kernel reading their keys and values once, as the
engine has it do, against each row its own; keys stored as the model stores them), from
the C library; decode self-attention over 240 cache slots, the encoder's self-attention
1500 x 1500 per window (B 1; a batch of 16 windows costs 16x), the tied vocabulary
projection at M 16 (one token of 16 rows), V 51865 (each call after a flush of the CPU's
caches, as a plan times it), the MLP's first layer (C -> 4C) at one window's 1536 rows
and at one token of 16 rows, and the encoder's second convolution (C -> C, stride 2) on
one window. The best
rate is GFLOP/s for the encoder's kernels, GB/s of K and V (or of the weight) read for
the rest.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from whisper_cli import kernels
from whisper_cli.model import cross_keys_transposed

# name: (d_model, heads); head dim 64 in all Whisper sizes.
MODELS = {"tiny.en": (384, 6), "base": (512, 8), "small": (768, 12), "large-v3": (1280, 20)}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
KERNELS = (
    "decode-cross",
    "decode-shared",
    "decode-self",
    "encoder",
    "logits",
    "linear-encoder",
    "linear-decode",
    "conv",
)
VOCAB, BATCH, FRAMES, SELF_LEN, HEAD_DIM = 51865, 16, 1500, 240, 64
SHARED = 6  # rows of one window in decode-shared: a window's first attempt and five retries


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "?"
    flags = next(
        (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []
    )
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
    return " ".join(f for f in wanted if f in flags) or "none of avx2/avx512/amx"


def attention_case(kernel: str, heads: int, dtype: torch.dtype):
    b, t, s = {
        "decode-cross": (BATCH, 1, FRAMES),
        "decode-self": (BATCH, 1, SELF_LEN),
        "encoder": (1, FRAMES, FRAMES),
    }[kernel]
    q = torch.randn(b, t, heads, HEAD_DIM).transpose(1, 2).to(dtype)  # split heads' view
    k = torch.randn(b, heads, s, HEAD_DIM).to(dtype)
    v = torch.randn(b, heads, s, HEAD_DIM).to(dtype)
    names = kernels.attention_candidates(kernels.attention_class(t), dtype)  # keys by rows
    impls = {n: (lambda f=kernels.ATTENTION[n]: f(q, k, v, None, False)) for n in names}
    if kernel == "encoder":  # compute-bound: GFLOP/s
        rate = (4 * b * heads * t * s * HEAD_DIM, "GFLOP/s")
    else:  # one query: memory-bound, GB/s of keys and values read
        rate = (2 * k.numel() * k.element_size(), "GB/s")
    shape = f"B{b} H{heads} T{t} S{s}"
    call = (heads, t, s, HEAD_DIM, "none")
    return impls, (lambda: planned("attention", dtype, call)), rate, shape, "sdpa"


def shared_case(heads: int, dtype: torch.dtype):
    """decode-shared: rows 0..SHARED-1 hold one window's keys and values (copies, as the
    caches hold them), the rest their own; "fused" reads each row's, "fused, shared" the
    first row's for the window's (DecodeCaches.sources)."""
    b, s = BATCH, FRAMES
    q = torch.randn(b, 1, heads, HEAD_DIM).transpose(1, 2).to(dtype)
    k = torch.randn(b, heads, s, HEAD_DIM).to(dtype)
    v = torch.randn(b, heads, s, HEAD_DIM).to(dtype)
    k[1:SHARED], v[1:SHARED] = k[0], v[0]
    if cross_keys_transposed(dtype, torch.device("cpu")):
        k = k.mT.contiguous().mT
    sources = (0,) * SHARED + tuple(range(SHARED, b))
    fused = kernels._fused
    impls = {
        "fused": lambda: fused(q, k, v, None, False),
        "fused, shared": lambda: fused(q, k, v, None, False, sources),
    }
    rate = (2 * k.numel() * k.element_size(), "GB/s")  # as if every row's were read
    shape = f"B{b} ({SHARED} one window's) H{heads} S{s}"
    return impls, (lambda: "fused, shared"), rate, shape, "fused"


def logits_case(d_model: int, dtype: torch.dtype):
    hidden = torch.randn(BATCH, 1, d_model).to(dtype)
    weight = (torch.randn(VOCAB, d_model) * 0.05).to(dtype)
    weight_t = weight.T.contiguous()  # costs a second copy of the table: informational
    names = kernels.logits_candidates(dtype)
    impls = {n: (lambda f=kernels.LOGITS[n]: f(hidden, weight)) for n in names}
    impls["transposed-copy(info)"] = lambda: hidden @ weight_t
    rate = (weight.numel() * weight.element_size(), "GB/s")  # the table, read once
    shape = f"M{BATCH} C{d_model} V{VOCAB}"
    call = (VOCAB, d_model)
    return impls, (lambda: planned("logits", dtype, call, weight)), rate, shape, "matmul"


def linear_case(d_model: int, dtype: torch.dtype, rows: int):
    x = torch.randn(rows, d_model).to(dtype)
    weight = (torch.randn(4 * d_model, d_model) * 0.05).to(dtype)
    names = kernels.upcast_candidates("linear", dtype)
    impls = {n: (lambda f=kernels.LINEAR[n]: f(x, weight, None)) for n in names}
    if rows >= kernels.ENCODER_ROWS:
        rate = (2 * rows * weight.numel(), "GFLOP/s")
    else:
        rate = (weight.numel() * weight.element_size(), "GB/s")
    shape = f"M{rows} K{d_model} N{4 * d_model}"
    call = (4 * d_model, d_model, "frames" if rows >= kernels.ENCODER_ROWS else "tokens")
    return impls, (lambda: planned("linear", dtype, call, weight)), rate, shape, "linear"


def conv_case(d_model: int, dtype: torch.dtype):
    x = torch.randn(1, d_model, 2 * FRAMES).to(dtype)
    weight = (torch.randn(d_model, d_model, 3) * 0.05).to(dtype)
    names = kernels.upcast_candidates("conv1d", dtype)
    impls = {n: (lambda f=kernels.CONV1D[n]: f(x, weight, None, 2, 1)) for n in names}
    rate = (2 * FRAMES * weight.numel(), "GFLOP/s")
    shape = f"C{d_model} L{2 * FRAMES} W3 stride 2"
    call = (d_model, d_model, 3, 2 * FRAMES, 2, 1)
    return impls, (lambda: planned("conv1d", dtype, call, weight)), rate, shape, "conv"


def planned(op: str, dtype: torch.dtype, shape: tuple, weight=None) -> str:
    """What a kernel plan made for this one call runs (from the cache, or timed for it)."""
    plan = kernels.build_plan([kernels.KernelCall(op, shape, weight)], dtype)
    return plan.choice(op, dtype, *shape)


def row(case, reps: int, cold: bool = False) -> str:
    """Time every implementation, ask a plan, and format the rest of a table row. cold:
    each call after a flush of the CPU's caches, as the plan times the vocabulary
    projection (kernels.COLD_CACHE_FACTOR)."""
    impls, choose, (work, unit), shape, ref = case
    kernels.TIMING_REPS = reps
    times = kernels.time_candidates(impls, kernels.cache_flush() if cold else None)
    pick = choose()
    cells = ", ".join(f"{n} {ms:.2f}{'' if full else '*'}" for n, (ms, full) in times.items())
    best_ms = min(ms for ms, _ in times.values())
    speedup = times[ref][0] / times[pick][0]
    return f"{shape} | {cells} | {pick} | {speedup:.2f} | {work / best_ms / 1e6:.1f} {unit} |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="tiny.en,base,large-v3")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--only", default=",".join(KERNELS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache", action="store_true", help="use and fill the real kernels cache")
    args = ap.parse_args(argv)
    if not args.cache:
        tmp = tempfile.mkdtemp(prefix="kernel-timings-")
        os.environ["WHISPER_CLI_KERNELS_CACHE"] = str(Path(tmp) / "kernels.json")
    os.environ.pop("WHISPER_CLI_KERNELS", None)

    print(f"CPU: {kernels.cpu_model()} ({platform.machine()}; flags: {cpu_flags()})")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"capability {torch.backends.cpu.get_cpu_capability()}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '-')}, "
        f"load average {os.getloadavg()[0]:.2f} at start"
    )
    print(f"kernel cache: {kernels.kernels_cache_path()}\n")
    print("| kernel | model | dtype | shape | ms per call | pick | ref/pick | best rate |")
    print("|---|---|---|---|---|---|---|---|")
    started = time.perf_counter()
    with torch.inference_mode():
        for model in args.models.split(","):
            d_model, heads = MODELS[model]
            for dname in args.dtypes.split(","):
                for kernel in args.only.split(","):
                    if kernel == "logits":
                        case = logits_case(d_model, DTYPES[dname])
                    elif kernel.startswith("linear"):
                        rows = 1536 if kernel == "linear-encoder" else BATCH
                        case = linear_case(d_model, DTYPES[dname], rows)
                    elif kernel == "conv":
                        case = conv_case(d_model, DTYPES[dname])
                    elif kernel == "decode-shared":
                        case = shared_case(heads, DTYPES[dname])
                    else:
                        case = attention_case(kernel, heads, DTYPES[dname])
                    cells = row(case, args.reps, cold=kernel == "logits")
                    print(f"| {kernel} | {model} | {dname} | {cells}", flush=True)
    print(
        f"\n{time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.2f} at end. "
        "`*`: one warm-up call only (4x slower than the best warm-up). ref/pick: the "
        "reference's time (sdpa, `@`, F.linear, F.conv1d; for decode-shared, fused over "
        "every row's own) over the pick's (decode-shared: what the engine runs), in this "
        "table's own timing."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
