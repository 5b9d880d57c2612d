"""Python's cyclic garbage collector while a process imports torch.

Importing torch and the pipeline makes some 150 thousand objects (modules, functions,
classes) and no garbage. The collector, run after every 700 new containers, scans them
again and again as they pile up: in a `transcribe` of a 2 s clip (tiny.en), 491
collections took 170 ms, three of them full scans of 55 to 170 thousand objects (14, 37
and 59 ms). With the imports made while it is paused, and what they made then frozen
(gc.freeze: left out of every later collection, still freed by reference counting), 167
collections took 17-22 ms, and the median of the whole run went from 2.36 to 2.16 s
(eight alternating runs each; 2-core Intel Xeon with AMX).

gc.freeze takes every object there is, garbage in cycles included, which no collection
then frees. So it runs only where the modules are new to the process: at a process's
start-up, not in one that imported them already (a test session, a library user calling
the CLI's app in-process), where it would keep whatever garbage had not been collected
yet for good.

A process-wide setting, so only an entry point (the CLI) calls it.
"""

from __future__ import annotations

import gc
import importlib
import sys


def import_long_lived(*modules: str) -> None:
    """Import those of `modules` the process has not imported yet with the collector
    paused, then freeze every object (see above); a no-op where all are imported."""
    missing = [name for name in modules if name not in sys.modules]
    if not missing:
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        for name in missing:
            importlib.import_module(name)
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
