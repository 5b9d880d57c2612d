"""C kernels built on the user's machine, once, by its own C compiler.

A kernel torch lacks is a C file in `csrc/`, compiled for this CPU (`-march=native`)
into a shared library in a cache folder the first time one of its kernels is called
(a kernel plan's timing, on a CPU plan only), and called through ctypes on the tensors'
memory. The library's name holds a digest of the sources, the flags, the compiler and
this CPU, so a changed source, compiler or CPU (a home folder shared between machines)
gets a library of its own.

Where no C compiler works (none installed, not Linux, a failed build) the kernels are
simply absent: `kernels.py` offers them only where `buildable()`, runs another
implementation where `library()` returns None, and the others run as before. Nothing
here is needed for a correct result, and loading it changes no other computation (see
the build's flags).
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

CSRC = Path(__file__).with_name("csrc")
# Each source with its own flags, compiled apart, then linked into one library in a step
# of its own: linking a shared library with -ffast-math (gcc before 13) adds
# crtfastmath.o, which turns on flush-to-zero for the whole process when the library
# loads, changing every other kernel's results on subnormals. -fopenmp: the loops over
# rows or (batch, head) pairs run on torch's threads (the library resolves to the libgomp
# torch has loaded; clang would bring its own libomp).
_COMMON_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-c")
SOURCES = {
    # -ffast-math lets gcc vectorize the float32 sums and call glibc's vector exp
    # (libmvec); attention.c says why that is exact enough.
    CSRC / "attention.c": (*_COMMON_FLAGS, "-ffast-math"),
    # Every operation rounded as written (no reciprocal, no fused multiply-add but those
    # written): the row passes give the bytes of torch's elementwise chain they replace
    # (int8.c), the products the same bytes on each of their vector paths (matmul.c).
    CSRC / "int8.c": (*_COMMON_FLAGS, "-ffp-contract=off"),
    CSRC / "matmul.c": (*_COMMON_FLAGS, "-ffp-contract=off"),
    CSRC / "dot.c": (*_COMMON_FLAGS, "-ffp-contract=off"),
}
HEADERS = (CSRC / "floats.h",)  # included by the sources: part of the library's digest
LINK_FLAGS = ("-shared", "-fopenmp")
LIBS = ("-lmvec", "-lm")
BUILD_TIMEOUT_S = 120
# csrc/attention.c: (dtype, keys stored by column) -> the function for it. Each keeps
# a query's scores and its float32 query on the stack, hence the bounds.
DECODE_ATTENTION = {
    "decode_attention_bf16": ("bf16", False),
    "decode_attention_f32": ("f32", False),
    "decode_attention_f32_kcols": ("f32", True),
}
# csrc/int8.c: its passes, each as <pass>_<dtype> for each of ROW_DTYPES (x's dtype for
# the row passes, out's and the bias's for the rescale).
INT8_ROW_PASSES = ("unit_rows", "quantize_rows")  # x, M, K, x's row stride, y, amax, threads
INT8_GRID_PASS = "quantize_rows"  # takes its grid's steps and zero (floats) before threads
INT8_RESCALE = "rescale_rows"  # acc, M, N, amax, bias or NULL, out, out's row stride, threads
ROW_DTYPES = ("f32", "bf16")  # the run dtypes int8.c's passes and matmul.c's products take
# csrc/matmul.c's products of rows and a weight packed by MATMUL_COLUMNS() output columns,
# int8 (INT8_MATMUL) or float32 (FLOAT_MATMUL), as <it>_<dtype> for each of ROW_DTYPES
# (the bias's and out's; x is float32): x, M, K, x's row stride, packed, N, scale (float32;
# NULL for the float one), bias or NULL, out, out's row stride, threads.
INT8_MATMUL = "int8_matmul"
FLOAT_MATMUL = "float_matmul"
MATMUL_COLUMNS = "matmul_columns"
# csrc/dot.c's product of uint8 rows on a grid and an int8 weight packed by DOT_COLUMNS()
# output columns in quads of k, summed in int32, as int8_dot_<dtype> for each of
# ROW_DTYPES (the bias's and out's): q, M, K, q's row stride (a multiple of 4, zeros past
# K), packed, column sums, N, scales, the rows' maxima, the grid's steps (float) and zero
# (int32), bias or NULL, out, out's row stride, threads.
INT8_DOT = "int8_dot"
DOT_COLUMNS = "dot_columns"
MAX_KEYS = 4096
# csrc/attention.c's encoder attention: dtype -> the function (q, k, v, out, B, H, T, S,
# D, their (batch, head, row) strides, scale, threads -> 0, or -1 where its buffers could
# not be allocated); and the vector width whose multiple D must be.
ENCODER_ATTENTION = {"f32": "encoder_attention_f32", "bf16": "encoder_attention_bf16"}
ENCODER_LANES = "encoder_attention_lanes"
MAX_HEAD_DIM = 256


class BuildError(OSError):
    """The compiler refused the source (not a timeout, not a full disk)."""


_I64P = ctypes.POINTER(ctypes.c_int64)


def compiler() -> str | None:
    """The C compiler to build with: $CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cpu_digest() -> str:
    """This CPU's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    own = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))][:2]
    return "\n".join(own) or platform.processor() or platform.machine()


def _build(cc: str, out: Path) -> None:
    """Compile SOURCES and link them into `out`, atomically (another process may build the same)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.stem}-") as tmp:
        objs = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        lib = Path(tmp) / "native.so"
        compiles = [
            [cc, *flags, "-o", str(obj), str(source)]
            for obj, (source, flags) in zip(objs, SOURCES.items(), strict=True)
        ]
        for cmd in [*compiles, [cc, *LINK_FLAGS, "-o", str(lib), *map(str, objs), *LIBS]]:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                raise BuildError(f"{' '.join(cmd)}: {done.stderr.strip()[-2000:]}")
        os.replace(lib, out)


@functools.cache
def _path(cache_dir: Path) -> Path | None:
    """Where this machine's library lives (built or not); None: no C compiler here."""
    cc = compiler()
    if not sys.platform.startswith("linux") or cc is None:
        return None
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("no working C compiler: %s", exc)
        return None
    parts = [part for source, flags in SOURCES.items() for part in (source.read_text(), *flags)]
    parts += [header.read_text() for header in HEADERS]
    key = "\n".join([*parts, *LINK_FLAGS, *LIBS, cc, *version, cpu_digest()])
    return cache_dir / f"native-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def build_name(cache_dir: Path) -> str:
    """The name of this machine's library (its digest of sources, flags, compiler and CPU),
    built or not; "none" where no C compiler works here."""
    path = _path(cache_dir)
    return "none" if path is None else path.stem


def buildable(cache_dir: Path) -> bool:
    """Whether the library is there or may be built (a C compiler, and no build of this
    source by this compiler for this CPU refused before), without building it."""
    path = _path(cache_dir)
    return path is not None and not path.with_suffix(".failed").exists()


@functools.cache
def library(cache_dir: Path) -> ctypes.CDLL | None:
    """The kernels' library, built into `cache_dir` if it is not there yet; None where it
    cannot be built or loaded (the reason is logged at debug level). A build the
    compiler refuses is remembered (a `.failed` file beside it) and not tried again."""
    if not buildable(cache_dir):
        return None
    path = _path(cache_dir)
    try:
        if not path.exists():
            log.debug("building %s", path)
            try:
                _build(compiler(), path)
            except BuildError as exc:
                path.with_suffix(".failed").write_text(str(exc))
                raise
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("native kernels unavailable: %s", exc)
        return None
    return declare(lib)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The library with its functions' C signatures set (ctypes checks the calls)."""
    for name in DECODE_ATTENTION:
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [_I64P] * 4
        # The rows' key counts (int64 data, or None for all S), the rows whose keys and
        # values each reads (int64 data, or None for its own), the scale, the threads.
        fn.argtypes += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int]
        fn.restype = None
    pointers, sizes = ctypes.c_void_p, ctypes.c_int64
    for name in ENCODER_ATTENTION.values():
        fn = getattr(lib, name)
        fn.argtypes = [pointers] * 4 + [sizes] * 5 + [_I64P] * 4 + [ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
    fn = getattr(lib, ENCODER_LANES)
    fn.argtypes, fn.restype = [], sizes
    for dtype in ROW_DTYPES:
        for name in INT8_ROW_PASSES:
            fn = getattr(lib, f"{name}_{dtype}")
            grid = [ctypes.c_float] * 2 if name == INT8_GRID_PASS else []
            fn.argtypes = [pointers, sizes, sizes, sizes, pointers, pointers, *grid, ctypes.c_int]
            fn.restype = None
        fn = getattr(lib, f"{INT8_RESCALE}_{dtype}")
        fn.argtypes = [pointers, sizes, sizes, pointers, pointers, pointers, sizes, ctypes.c_int]
        fn.restype = None
        for product in (INT8_MATMUL, FLOAT_MATMUL):
            fn = getattr(lib, f"{product}_{dtype}")
            fn.argtypes = [pointers, sizes, sizes, sizes, pointers, sizes, pointers, pointers]
            fn.argtypes += [pointers, sizes, ctypes.c_int]
            fn.restype = None
        fn = getattr(lib, f"{INT8_DOT}_{dtype}")
        fn.argtypes = [pointers, sizes, sizes, sizes, pointers, pointers, sizes, pointers]
        fn.argtypes += [pointers, ctypes.c_float, ctypes.c_int32, pointers, pointers, sizes]
        fn.argtypes += [ctypes.c_int]
        fn.restype = None
    for name in (MATMUL_COLUMNS, DOT_COLUMNS):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [], sizes
    return lib


def strides(t, n: int) -> ctypes.Array:
    """The first n strides of tensor t, as the C kernels take them."""
    return (ctypes.c_int64 * n)(*t.stride()[:n])
