"""The dtype recorder: every floating tensor of a run, and the listed float32 exceptions.

Shared by tests/test_dtype.py (CPU) and scripts/gpu_check.py (the same check on CUDA).
A TorchDispatchMode sees the output of every op. Only the exceptions listed in
whisper_cli.dtypes.F32_EXCEPTIONS may produce float32 in a bf16/f16 run: the audio front
end (log_mel), the speech detector (whose output is NumPy) and probabilities computed
from the logits (f32_log_softmax, f32_logsumexp, f32_logprobs, the sampling draw,
the word-timing weights) and whatever is computed from those. Under `--quantize int8` the
int8 weights and their float32 scales (whisper_cli.dtypes.INT8_EXCEPTIONS) are the only
tensors of the model not in the run dtype; the int8 kernels compute inside.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class DtypeRecorder(TorchDispatchMode):
    """Records (op, dtype) of every floating output; tracks tensors derived from exceptions."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[tuple[str, torch.dtype]] = Counter()
        self.violations: Counter[tuple[str, torch.dtype]] = Counter()
        self.expected: torch.dtype | None = None
        self.paused = 0
        self._exception_ids: set[int] = set()
        self._keep: list[torch.Tensor] = []  # keeps ids of tagged tensors from being reused

    def untag(self, tensor: torch.Tensor) -> torch.Tensor:
        self._exception_ids.discard(id(tensor))
        return tensor

    def tag(self, tensor: torch.Tensor) -> torch.Tensor:
        self._exception_ids.add(id(tensor))
        self._keep.append(tensor)
        return tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        derived = any(id(t) in self._exception_ids for t in inputs)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                continue
            if derived and t.dtype == torch.float32:
                self.tag(t)  # computed from an exception's float32 result: same exception
                continue
            self.seen[(str(func), t.dtype)] += 1
            if t.dtype != self.expected:
                self.violations[(str(func), t.dtype)] += 1
        return out


@contextlib.contextmanager
def exceptions_marked(rec: DtypeRecorder) -> Iterator[DtypeRecorder]:
    """While open, the listed exceptions' results are tagged (float32 allowed from them),
    where they are used: the sites of whisper_cli that call them."""
    import whisper_cli.decoding as decoding
    import whisper_cli.engine as engine
    import whisper_cli.pipeline as pipeline
    import whisper_cli.rules as rules
    import whisper_cli.timing as timing
    from whisper_cli import kernels, speech

    def exception(fn):
        def wrapped(*args, **kwargs):
            rec.paused += 1
            try:
                result = fn(*args, **kwargs)
            finally:
                rec.paused -= 1
            assert result.dtype == torch.float32
            return rec.tag(result)

        return wrapped

    def encoder_door(fn):
        def wrapped(mel, dtype):
            assert mel.dtype == torch.float32
            result = fn(mel, dtype)
            assert result.dtype == dtype
            return rec.untag(result)  # from here on, the model's own tensors

        return wrapped

    def inside(fn):  # a listed exception whose float32 never leaves it (NumPy or cast out)
        def wrapped(*args, **kwargs):
            rec.paused += 1
            try:
                result = fn(*args, **kwargs)
            finally:
                rec.paused -= 1
            if isinstance(result, torch.Tensor) and result.is_floating_point():
                # What leaves it is the run's dtype, recorded under the kernel's name.
                name = f"kernels.{fn.__name__}"
                rec.seen[(name, result.dtype)] += 1
                if rec.expected is not None and result.dtype != rec.expected:
                    rec.violations[(name, result.dtype)] += 1
            return result

        return wrapped

    patches = [
        (speech.SpeechStream, "_score", inside),
        # The CPU kernels' float32 tiles and the timing that chooses them.
        (kernels, "_attend_f32", inside),
        (kernels, "time_candidates", inside),
        # The synthetic inputs and the own copies (f32, packed) of a weight timing makes.
        *((kernels, runs, inside) for runs in ("_linear_runs", "_conv1d_runs", "_logits_runs")),
        (kernels, "_int8_runs", inside),
        (kernels, "packable", inside),  # its probe: oneDNN packs a small f32 matrix or not
        (engine, "encoder_input", encoder_door),
        # The listed exceptions, wrapped where they are used.
        (pipeline, "batch_log_mel", exception),
        (engine, "f32_log_softmax", exception),
        (rules, "f32_logsumexp", exception),
        (decoding, "uniform", exception),
        (decoding, "f32_softmax", exception),
        (decoding, "f32_logprobs", exception),
        (decoding, "f32_logsumexp", exception),
        (timing, "f32_log_softmax", exception),
        (timing, "f32_alignment_weights", exception),
    ]
    with contextlib.ExitStack() as stack:
        for owner, name, wrap in patches:
            stack.enter_context(mock.patch.object(owner, name, wrap(getattr(owner, name))))
        for table, name in (
            (kernels.LOGITS, "f32-blocks"),
            (kernels.LOGITS, "f32-packed"),
            (kernels.LINEAR, "f32-upcast"),
            (kernels.CONV1D, "f32-upcast"),
            # --quantize int8: every kernel computes in float32 or int8 inside.
            *((kernels.INT8_LINEAR, name) for name in kernels.INT8_LINEAR),
        ):
            stack.enter_context(mock.patch.dict(table, {name: inside(table[name])}))
        yield rec
