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
        self.reached: Counter[str] = Counter()  # calls of each listed exception's sites
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


# The listed exception (whisper_cli.dtypes.F32_EXCEPTIONS) of each site marked below that
# is not in kernels.py; every site in kernels.py is the "CPU kernels" exception.
EXCEPTION_OF = {
    ("SpeechStream", "_score"): "speech detector",
    ("whisper_cli.engine", "batch_log_mel"): "audio front end",
    ("whisper_cli.engine", "f32_log_softmax"): "log-softmax over logits",
    ("whisper_cli.rules", "f32_logsumexp"): "log-softmax over logits",
    ("whisper_cli.decoding", "f32_logprobs"): "log-softmax over logits",
    ("whisper_cli.decoding", "f32_log_softmax"): "log-softmax over logits",
    ("whisper_cli.decoding", "uniform"): "sampling draw",
    ("whisper_cli.decoding", "f32_softmax"): "sampling draw",
    ("whisper_cli.timing", "f32_log_softmax"): "word-timing cost",
    ("whisper_cli.timing", "f32_alignment_weights"): "word-timing cost",
}


@contextlib.contextmanager
def exceptions_marked(rec: DtypeRecorder, unmarked: str | None = None) -> Iterator[DtypeRecorder]:
    """While open, the listed exceptions' results are tagged (float32 allowed from them),
    where they are used: the sites of whisper_cli that call them. `unmarked`: one listed
    exception whose sites are left as they are (their float32 is then recorded as any
    other op's); `rec.reached` counts the calls of each exception's sites."""
    import whisper_cli.decoding as decoding
    import whisper_cli.engine as engine
    import whisper_cli.rules as rules
    import whisper_cli.timing as timing
    from whisper_cli import kernels, speech

    def exception(fn, listed):
        def wrapped(*args, **kwargs):
            rec.reached[listed] += 1
            rec.paused += 1
            try:
                result = fn(*args, **kwargs)
            finally:
                rec.paused -= 1
            assert result.dtype == torch.float32
            return rec.tag(result)

        return wrapped

    def encoder_door(fn, listed):
        def wrapped(mel, dtype):
            assert mel.dtype == torch.float32
            result = fn(mel, dtype)
            assert result.dtype == dtype
            return rec.untag(result)  # from here on, the model's own tensors

        return wrapped

    def inside(fn, listed):  # a listed exception whose float32 never leaves it (NumPy or cast out)
        def wrapped(*args, **kwargs):
            rec.reached[listed] += 1
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
        # The synthetic inputs and the own copies (f32, packed) of a weight that timing and
        # the rows check make.
        (kernels, "_measure", inside),
        (kernels, "packable", inside),  # its probe: oneDNN packs a small f32 matrix or not
        (engine, "encoder_input", encoder_door),
        # The listed exceptions, wrapped where they are used.
        (engine, "batch_log_mel", exception),
        (engine, "f32_log_softmax", exception),
        (rules, "f32_logsumexp", exception),
        (decoding, "uniform", exception),
        (decoding, "f32_softmax", exception),
        (decoding, "f32_logprobs", exception),
        (decoding, "f32_log_softmax", exception),
        (timing, "f32_log_softmax", exception),
        (timing, "f32_alignment_weights", exception),
    ]

    def listed(owner, name: str) -> str | None:
        if owner is engine and name == "encoder_input":
            return None  # not an exception: where the front end's float32 ends
        if owner is kernels or any(owner is table for table, _ in tables):
            return "CPU kernels"
        return EXCEPTION_OF[(getattr(owner, "__name__", None), name)]

    tables = (
        (kernels.LOGITS, "f32-blocks"),
        (kernels.LOGITS, "f32-packed"),
        (kernels.LINEAR, "f32-upcast"),
        (kernels.CONV1D, "f32-upcast"),
        # --quantize int8: every kernel computes in float32 or int8 inside.
        *((kernels.INT8_LINEAR, name) for name in kernels.INT8_LINEAR),
    )
    with contextlib.ExitStack() as stack:
        for owner, name, wrap in patches:
            site = listed(owner, name)
            if site is None or site != unmarked:
                patch = wrap(getattr(owner, name), site)
                stack.enter_context(mock.patch.object(owner, name, patch))
        for table, name in tables if unmarked != "CPU kernels" else ():
            stack.enter_context(mock.patch.dict(table, {name: inside(table[name], "CPU kernels")}))
        yield rec
