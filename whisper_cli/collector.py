"""Python's cyclic garbage collector while a process imports torch.

Importing torch and the pipeline makes some 160 thousand objects (modules, functions,
classes) that live as long as the process, and little garbage (7 thousand unreachable
objects, 640 KiB). The collector, run after every 700 new containers, scans the
long-lived ones again and again as they pile up: in a `transcribe` of a 2 s clip
(tiny.en), 491 collections took 170 ms, three of them full scans of 55 to 170 thousand
objects (14, 37 and 59 ms). With the imports made while it is paused, and what
they made then frozen (gc.freeze: left out of every later collection, still freed by
reference counting), 167 collections took 17-22 ms, and the median of the whole run
went from 2.36 to 2.16 s (eight alternating runs each; 2-core Intel Xeon with AMX).

gc.freeze takes every object there is, garbage in cycles included, which no collection
then frees: that little garbage stays. So it runs only at a process's start-up, which
is where torch is not imported yet; a process that has it (a test session, a library
user calling the CLI's app in-process) imports as usual and keeps its collector as it
was.

A process-wide setting, so only an entry point (the CLI) calls it.
"""

from __future__ import annotations

import gc
import importlib
import sys


def start_up_imports(*modules: str) -> None:
    """Import `modules`. Where torch is not imported yet (a process's start-up) that is
    done with the collector paused, and every object is then frozen (see above)."""
    if "torch" in sys.modules:
        for name in modules:
            importlib.import_module(name)
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        for name in modules:
            importlib.import_module(name)
        gc.freeze()  # not after a failed import: its traceback's cycles must stay collectable
    finally:
        if enabled:
            gc.enable()
