"""C kernels built on the user's machine, once, by its own C compiler.

A kernel torch lacks is a C file in `csrc/`, compiled for this CPU (`-march=native`)
into a shared library in a cache folder the first time a kernel plan asks for it, and
called through ctypes on the tensors' memory. The library's name holds a digest of the
source, the flags, the compiler and this CPU, so a changed source, compiler or CPU (a
home folder shared between machines) gets a library of its own.

Where no C compiler works (none installed, not Linux, a failed build) the kernels are
simply absent: `kernels.py` offers them only where `library()` returns one, and the other
implementations run as before. Nothing here is needed for a correct result.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "attention.c"
# -ffast-math lets gcc vectorize the float32 sums and call glibc's vector exp (libmvec);
# the source says why that is exact enough. -fopenmp: the loop over (batch, head) pairs
# runs on torch's threads (the library resolves to the libgomp torch has loaded).
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lmvec", "-lm")
BUILD_TIMEOUT_S = 120
# csrc/attention.c: (dtype, keys stored by column) -> the function for it. Each keeps
# a query's scores and its float32 query on the stack, hence the bounds.
DECODE_ATTENTION = {
    "decode_attention_bf16": ("bf16", False),
    "decode_attention_f32": ("f32", False),
    "decode_attention_f32_kcols": ("f32", True),
}
MAX_KEYS = 4096
MAX_HEAD_DIM = 256

_I64P = ctypes.POINTER(ctypes.c_int64)


def compiler() -> str | None:
    """The C compiler to build with: $CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_digest() -> str:
    """This CPU's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    own = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))][:2]
    return "\n".join(own) or platform.processor() or platform.machine()


def _build(cc: str, out: Path) -> None:
    """Compile SOURCE into `out`, atomically (another process may build the same)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.stem}-", suffix=".so")
    os.close(fd)
    try:
        cmd = [cc, *FLAGS, "-o", tmp, str(SOURCE), *LIBS]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise OSError(f"{' '.join(cmd)}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)


@functools.cache
def library(cache_dir: Path) -> ctypes.CDLL | None:
    """The kernels' library, built into `cache_dir` if it is not there yet; None where it
    cannot be built or loaded (the reason is logged at debug level)."""
    cc = compiler()
    if not sys.platform.startswith("linux") or cc is None:
        return None
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[:1]
        key = "\n".join([SOURCE.read_text(), *FLAGS, *LIBS, cc, *version, _cpu_digest()])
        path = cache_dir / f"attention-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
        failed = path.with_suffix(".failed")  # a build that failed is not tried again
        if failed.exists():
            return None
        if not path.exists():
            log.debug("building %s", path)
            try:
                _build(cc, path)
            except (OSError, subprocess.SubprocessError) as exc:
                failed.write_text(str(exc))
                raise
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("native kernels unavailable: %s", exc)
        return None
    for name in DECODE_ATTENTION:
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [_I64P] * 4
        fn.argtypes += [ctypes.c_float, ctypes.c_int]
        fn.restype = None
    return lib


def strides(t, n: int) -> ctypes.Array:
    """The first n strides of tensor t, as the C kernels take them."""
    return (ctypes.c_int64 * n)(*t.stride()[:n])
