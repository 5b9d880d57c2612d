"""How the C allocator keeps freed memory in a transcription process (glibc only).

By default glibc serves large blocks with fresh mmaps and gives freed memory back to the
OS, so the encoder's activations (tens to hundreds of MB per batch) are page-faulted and
zeroed anew for every batch: on a 2-core CPU, 15-20% of the encoder's time (base, f32,
batch 16). Growing the heap in 1 GiB steps (M_TOP_PAD) lets the heap's free top serve
those blocks, and never trimming (M_TRIM_THRESHOLD) keeps them for the next batch. Peak
resident memory stays what the largest batch touches; it is only not handed back
before exit.

A process-wide setting, so only entry points (the CLI, bench's child) call it; a library
user's process is left as it is.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's <malloc.h>
M_TOP_PAD = -2
KEEP_BYTES = 2**31 - 1  # the largest int mallopt takes: never trim
TOP_PAD_BYTES = 1 << 30  # address space reserved per heap growth; pages count only once used


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory; False where that is not glibc (no-op)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # musl and others have no mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return mallopt(M_TRIM_THRESHOLD, KEEP_BYTES) == 1 and mallopt(M_TOP_PAD, TOP_PAD_BYTES) == 1
