"""The allocator setting the CLI and bench's child apply (see whisper_cli.allocator)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from whisper_cli.allocator import keep_freed_memory

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_glibc_keeps_freed_memory() -> None:
    """After the call, a freed 256 MiB block stays in the process: RSS does not drop."""
    code = """
import sys
from whisper_cli.allocator import keep_freed_memory
keep = sys.argv[1] == "keep"
if keep:
    assert keep_freed_memory()
import numpy as np
def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
blocks = [np.ones(1 << 20, dtype=np.uint8) for _ in range(256)]  # 1 MiB each: heap blocks
before = rss_mib()
del blocks
print(before - rss_mib())
"""
    released = {
        mode: int(subprocess.check_output([sys.executable, "-c", code, mode], text=True))
        for mode in ("keep", "default")
    }
    assert released["default"] > 200  # glibc hands most of it back by default
    assert released["keep"] < 16  # kept for the next batch


def test_keep_freed_memory_is_a_no_op_elsewhere(monkeypatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert keep_freed_memory() is False


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_glibc_reuses_blocks_past_the_adaptive_mmap_threshold() -> None:
    """Blocks of 40-64 MiB (an encoder activation's size), made and freed batch after
    batch, come from the kept heap once it has grown to hold them (a few batches: a freed
    block is not always reused at once): no page faults in the later batches, where fresh
    mmaps fault in every page (14 thousand a block) each time."""
    code = """
import resource
import torch
from whisper_cli.allocator import keep_freed_memory
assert keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
per_batch = []
for _ in range(12):
    before = faults()
    blocks = [torch.ones(n << 20, dtype=torch.uint8) for n in (64, 48, 64, 40)]
    del blocks
    per_batch.append(faults() - before)
print(sum(per_batch[8:]))
"""
    faults = int(subprocess.check_output([sys.executable, "-c", code], text=True))
    assert faults < 1024  # the last four batches: 221184 pages with fresh mmaps


def test_an_older_glibc_gets_the_highest_threshold_it_takes(monkeypatch) -> None:
    """A glibc that refuses a threshold past 32 MiB gets 32 MiB (every block under it
    from the heap), and the trim and top-pad settings stand."""
    import whisper_cli.allocator as allocator

    calls = []

    def mallopt(param: int, value: int) -> int:
        calls.append((param, value))
        return 0 if param == allocator.M_MMAP_THRESHOLD and value > 32 << 20 else 1

    class Libc:
        pass

    libc = Libc()
    libc.mallopt = mallopt
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: libc)
    assert keep_freed_memory() is True
    assert calls[-1] == (allocator.M_MMAP_THRESHOLD, 32 << 20)
    assert (allocator.M_TRIM_THRESHOLD, allocator.KEEP_BYTES) in calls
