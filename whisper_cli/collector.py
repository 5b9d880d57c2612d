"""Python's cyclic garbage collector while a process imports torch.

Importing torch and the pipeline makes some 150 thousand objects (modules, functions,
classes) and no garbage. The collector, run after every 700 new containers, scans them
again and again as they pile up: in a `transcribe` of a 2 s clip (tiny.en), 491
collections took 170 ms, three of them full scans of 55 to 170 thousand objects (14, 37
and 59 ms). With the imports made while it is paused, and what they made then frozen
(gc.freeze: left out of every later collection, still freed by reference counting), 167
collections took 17-22 ms, and the median of the whole run went from 2.36 to 2.16 s
(eight alternating runs each; 2-core Intel Xeon with AMX).

A process-wide setting, so only an entry point (the CLI) calls it; a library user's
process is left as it is.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def long_lived() -> Iterator[None]:
    """Run a block whose objects live as long as the process (imports) with the collector
    paused; freeze them on the way out and restore the collector as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
