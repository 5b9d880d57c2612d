"""How the C allocator keeps freed memory in a transcription process (glibc only).

By default glibc serves large blocks with fresh mmaps and gives freed memory back to the
OS, so the encoder's activations (tens to hundreds of MB per batch) are page-faulted and
zeroed anew for every batch: on a 2-core CPU, 15-20% of the encoder's time (base, f32,
batch 16). Three settings keep them instead:
- M_TOP_PAD: the heap grows in 1 GiB steps of address space, so its free top serves
  those blocks;
- M_TRIM_THRESHOLD: it is never trimmed, so they are kept for the next batch;
- M_MMAP_THRESHOLD: blocks of any size come from the heap. By default the threshold
  adapts up to 32 MiB only, and setting either of the two above fixes it where it stands:
  an encoder activation of 37-200 MB (tiny to base at batch 16) was still a fresh mmap,
  faulted in on every batch (tiny.en f32: 200-280 thousand faults a batch of 16).
Peak resident memory stays what the largest batch touches; it is only not handed back
before exit.

A process-wide setting, so only entry points (the CLI, bench's child) call it; a library
user's process is left as it is.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's <malloc.h>
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 2**31 - 1  # the largest int mallopt takes: never trim, never mmap a block
OLD_MMAP_CAP = 32 << 20  # the highest threshold older glibc takes (HEAP_MAX_SIZE / 2)
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
    kept = mallopt(M_TRIM_THRESHOLD, KEEP_BYTES) == 1 and mallopt(M_TOP_PAD, TOP_PAD_BYTES) == 1
    if kept and mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) != 1:
        mallopt(M_MMAP_THRESHOLD, OLD_MMAP_CAP)  # blocks past it are still fresh mmaps
    return kept
