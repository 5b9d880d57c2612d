"""The dtype policy: the one module that chooses, checks and applies floating dtypes.

`--dtype auto|f32|f16|bf16` resolves here to one torch dtype, and every floating
tensor from the encoder input onward has it: weights, positional tables, the log-mel
at the encoder's door, activations, both KV caches, logits and everything returned.

Every cast in the library goes through a function of this module, so the places
where a tensor changes dtype can be read in one screen:

* `cast_weight`   - checkpoint tensors (f16/f32/bf16 on disk) to the run dtype, once at load.
* `int8_weight`   - `--quantize int8`: a linear layer's weight (already in the run dtype) to
                    int8 with per-output-channel scales, once at load (see INT8_EXCEPTIONS).
* `ieee_float32`  - f32 on CUDA computes in float32, not TensorFloat-32 (set at load).
* `encoder_input` - the log-mel, computed in float32 (see F32_EXCEPTIONS), enters the
                    encoder in the run dtype.
* `f32_log_softmax`, `f32_logsumexp`, `f32_logprobs` - the listed float32
                    exception for probabilities over logits and their running sums.
* `f32_softmax`   - the sampling draw's distribution (listed exception).
* `f32_alignment_weights` - word timing: alignment-head attention weights (computed in
                    the run dtype) normalised, median-filtered and warped in float32.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from whisper_cli.errors import WhisperCliError, WhisperCliWarning

DTYPE_NAMES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
}
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
# `--quantize`: none, or the linear layers' weights held as int8 (CPU kernels only).
QUANTIZE_CHOICES = ("none", "int8")
INT8_BLOCK_ROWS = 4096  # rows of a weight quantized at a time (see int8_weight)

# The only places a float32 tensor may exist in a non-f32 run. Each is a small
# side computation whose result never flows back into weights, caches or activations.
F32_EXCEPTIONS: dict[str, str] = {
    "audio front end": (
        "STFT, mel filter bank and log compression run in float32 (torch has no "
        "half-precision STFT on CPU); the log-mel is cast once by encoder_input()."
    ),
    "speech detector": (
        "Silero VAD (speech.py) scores the float32 audio in float32 on the CPU; only its "
        "per-frame speech probabilities (NumPy) leave it, to place windows and rules."
    ),
    "log-softmax over logits": (
        "token log-probabilities (timestamp rule, average log-prob, no-speech and "
        "language probabilities) are computed from the logits in float32 by "
        "f32_log_softmax() and f32_logsumexp(); the logits themselves stay in the run dtype."
    ),
    "CPU kernels": (
        "kernels.py's matmul/blocked attention computes q k^T, the softmax and the product "
        "with v in float32 tiles for f16/bf16 inputs (as SDPA's CPU kernel accumulates in "
        "float32: half-precision scores have 7x its error); its f32-blocks vocabulary "
        "projection upcasts weight blocks into one float32 buffer, its f32-packed projection "
        "and linear layers keep a float32 copy of the f16/bf16 embedding or weight (exactly "
        "its values) packed by oneDNN, and its columns projection and linear layers one "
        "packed by columns for csrc/matmul.c (bf16), whose products (columns, and the int8 "
        "widened one) take a float32 copy of bf16 rows for one call; its "
        "f32-upcast linear layers and convolutions keep float32 copies of their f16/bf16 "
        "weights and biases (exactly their values, made once where chosen) and take float32 "
        "copies of their inputs for one call (a half GEMM accumulating in float32, on CPUs "
        "with no native one). None of these copies is a parameter of the model. All round "
        "their result once to the run dtype. The timing that chooses them runs on synthetic "
        "tensors."
    ),
    "sampling draw": (
        "a fallback draw (decoding.draw) takes softmax(logits / T) by f32_softmax(), its "
        "cumulative sum and the row's uniform (decoding.uniform, from integer hashes) in "
        "float32: a half-precision uniform rounds to 1 and a half cumulative sum over the "
        "vocabulary stalls. Only token ids leave it."
    ),
    "word-timing cost": (
        "the alignment heads' attention weights are computed in the run dtype; their "
        "normalisation, median filter and the DTW cost over them run in float32 "
        "(f32_alignment_weights()): half-precision sums over 1500 frames would move word "
        "boundaries. Only word times come out of it."
    ),
}


# `--quantize int8`: the only non-floating weights, in any run dtype. Everything else (the
# embeddings, norms, biases, activations, caches, logits, outputs) keeps the run dtype.
INT8_EXCEPTIONS: dict[str, str] = {
    "int8 weights": (
        "the weight of every linear layer of the encoder and decoder, and the tied output "
        "projection (a copy of the token embedding, which itself stays in the run dtype for "
        "the lookup), held as int8 (quantize.Int8Linear.weight), symmetric, per output channel; "
        "the form its kernel takes (Int8Linear.forms: fbgemm's or oneDNN's packing, "
        "csrc/matmul.c's columns, csrc/dot.c's quads with the columns' int32 sums) holds the "
        "same int8 values."
    ),
    "int8 scales": (
        "their per-output-channel scales (quantize.Int8Linear.weight_scale) in float32, each a "
        "bfloat16 value, so that every int8 kernel (kernels.INT8_LINEAR) in every run dtype "
        "sees the same weights; kernels multiply by them inside, and round their result once "
        "to the run dtype."
    ),
}


@dataclass(frozen=True)
class DtypePolicy:
    """The resolved dtype of a run, the device it runs on, and whether the linear layers'
    weights are int8 (`quantize`: one of QUANTIZE_CHOICES)."""

    dtype: torch.dtype
    device: torch.device
    quantize: str = "none"

    @property
    def name(self) -> str:
        return dtype_name(self.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPE_NAMES.items():
        if value == dtype:
            return name
    raise WhisperCliError(f"unsupported dtype {dtype}")


def expand_dtypes(value: str | Iterable[str]) -> tuple[str, ...]:
    """`all` (every dtype: f32, f16 and bf16, f16 on CPU too), one choice or a comma-separated
    list -> the choices to run, in order, each once (bench and eval run one per dtype)."""
    names = value.split(",") if isinstance(value, str) else list(value)
    out: list[str] = []
    for name in (n.strip() for n in names):
        for choice in DTYPE_NAMES if name == "all" else (name,):
            if choice not in DTYPE_CHOICES:
                raise WhisperCliError(
                    f"invalid dtype {choice!r}; choose all or one of {', '.join(DTYPE_CHOICES)}"
                )
            if choice not in out:
                out.append(choice)
    if not out:
        raise WhisperCliError("no dtype given")
    return tuple(out)


def resolve_policy(
    name: str, device: str | torch.device | None = None, quantize: str = "none"
) -> DtypePolicy:
    """Resolve a `--dtype` (and `--quantize`) choice for a device, refusing what the device
    cannot run.

    auto: bf16 on a CUDA device that supports it, f16 on an older CUDA device,
    f32 on CPU. An explicit choice is never silently switched.
    """
    dev = resolve_device(device)
    if name not in DTYPE_CHOICES:
        raise WhisperCliError(f"invalid dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    check_quantize(quantize, dev)
    if name == "auto":
        if dev.type == "cuda":
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        else:
            dtype = torch.float32
        return DtypePolicy(dtype, dev, quantize)
    dtype = DTYPE_NAMES[name]
    if dev.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        gpu = torch.cuda.get_device_name(dev)
        raise WhisperCliError(
            f"--dtype bf16 is not supported on {gpu} (needs compute capability 8.0 or newer); "
            "use --dtype f16 or f32"
        )
    if dev.type == "cpu" and dtype == torch.float16:
        warn_f16_on_cpu()
    return DtypePolicy(dtype, dev, quantize)


def check_quantize(quantize: str, device: torch.device) -> None:
    """A `--quantize` choice the device can run: int8 has CPU kernels only."""
    if quantize not in QUANTIZE_CHOICES:
        raise WhisperCliError(
            f"invalid quantize {quantize!r}; choose one of {', '.join(QUANTIZE_CHOICES)}"
        )
    if quantize == "int8" and device.type != "cpu":
        raise WhisperCliError(
            f"--quantize int8 runs on the CPU only (its kernels are CPU kernels), not on "
            f"{device}; use --device cpu with it, or --quantize none on {device.type}"
        )


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise WhisperCliError(f"invalid device {device!r}; use auto, cpu, cuda or cuda:N") from exc
    if dev.type not in ("cpu", "cuda"):
        raise WhisperCliError(f"unsupported device {device!r}; use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise WhisperCliError("--device cuda was asked for but no CUDA device is available")
    return dev


_warned_f16 = False


def warn_f16_on_cpu() -> None:
    """f16 matmuls on most CPUs run without native kernels: 10-100x slower than f32."""
    global _warned_f16
    if not _warned_f16:
        _warned_f16 = True
        warnings.warn(
            "f16 on CPU is slow: most CPUs have no native float16 matmul kernels "
            "(10-100x slower than f32); prefer --dtype f32 or bf16 on CPU",
            WhisperCliWarning,
            stacklevel=3,
        )


def cast_weight(tensor: torch.Tensor, policy: DtypePolicy) -> torch.Tensor:
    """A checkpoint tensor as the model holds it: floating tensors take the run dtype."""
    if tensor.is_floating_point():
        return tensor.to(device=policy.device, dtype=policy.dtype)
    return tensor.to(device=policy.device)


def int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (N, K) weight as int8 values q and float32 scales s (N,), per output channel,
    symmetric: weight[n] ~ q[n] * s[n], |q| <= 127 (INT8_EXCEPTIONS).

    Each scale is a bfloat16 value (the row's max |w| / 127, rounded to bfloat16; the row's
    extreme clamps to 127 where rounding went down), so that q * s is exact in float32 and
    the same scales serve kernels that take them in bfloat16. An all-zero row has scale 1.
    Rows are quantized INT8_BLOCK_ROWS at a time: the float32 temporaries of a vocabulary-
    sized weight would otherwise outweigh the int8 result several times over, at load.
    """
    n = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    for r0 in range(0, n, INT8_BLOCK_ROWS):
        # A copy even of float32 rows (the one temporary, divided in place): a float32
        # checkpoint's token embedding is also the model's, assigned at load.
        w = weight[r0 : r0 + INT8_BLOCK_ROWS].detach().to(torch.float32, copy=True)
        amax = w.abs().amax(dim=1)
        s = torch.where(amax > 0, amax / 127, 1.0).to(torch.bfloat16).float()
        q[r0 : r0 + len(w)] = torch.round(w.div_(s[:, None])).clamp_(-127, 127)
        scale[r0 : r0 + len(w)] = s
    return q, scale


def ieee_float32(policy: DtypePolicy) -> None:
    """An f32 run on CUDA: float32 matmuls and convolutions, TensorFloat-32 off.

    cuDNN allows TF32 for float32 convolutions by default, and TF32 keeps 10 mantissa bits:
    the encoder's convolutions would round to ~1e-3 relative, which is not what "f32"
    promises. The flags are process-wide (cuBLAS and cuDNN read them at each call); runs
    in other dtypes have no float32 matmul of weights, and leave them as they are. The
    legacy flags, not `fp32_precision`: torch refuses reads of a mix of the two APIs.
    """
    if policy.device.type == "cuda" and policy.dtype == torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def encoder_input(mel: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 log-mel (front-end exception) as the encoder takes it."""
    return mel.to(dtype)


def f32_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities over the vocabulary in float32 (listed exception). torch makes
    a float32 copy of f16/bf16 logits first (not of f16 logits on CUDA, whose kernel reads
    the halves as they are): 0.04-0.07 ms of a 0.28 ms call at 16 rows of tiny.en's
    vocabulary in bf16 (AMD EPYC Zen 4)."""
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32)


def f32_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(logits))) over the last dim in float32, the log-softmax normaliser
    (same listed exception): a token's log-prob is its logit less this."""
    return torch.logsumexp(logits.float(), dim=-1)


def f32_softmax(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """softmax(logits / temperature) over the last dim in float32, the sampling draw's
    distribution (listed exception "sampling draw")."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def f32_logprobs(rows: int, steps: int, device: torch.device) -> torch.Tensor:
    """(rows, steps) log-probabilities of the chosen tokens (same listed exception)."""
    return torch.zeros(rows, steps, dtype=torch.float32, device=device)


def f32_alignment_weights(weights: torch.Tensor) -> torch.Tensor:
    """Attention weights as the word-timing filter and DTW take them (listed exception)."""
    return weights.float()
