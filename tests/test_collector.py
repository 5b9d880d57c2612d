"""torch's import with the collector paused, then frozen (see whisper_cli.collector)."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from util import REPO

from whisper_cli.collector import start_up_imports


@pytest.fixture
def fresh_module(tmp_path, monkeypatch):
    """fresh_module(body) -> the name of a module not imported yet, `body` its source."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def make(body: str) -> str:
        name = f"whisper_cli_test_module_{len(names)}"
        (tmp_path / f"{name}.py").write_text(body)
        names.append(name)
        return name

    enabled = gc.isenabled()
    yield make
    for name in names:
        sys.modules.pop(name, None)
    gc.unfreeze()  # what a test froze goes back to the collector
    (gc.enable if enabled else gc.disable)()


RECORDS = "import gc\nPAUSED = not gc.isenabled()\nMADE = [[i] for i in range(10_000)]\n"


@pytest.fixture
def start_up(monkeypatch):
    """The process as at its start-up: torch not imported (hidden, for the test)."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)


def test_at_start_up_modules_import_paused_then_all_is_frozen(start_up, fresh_module) -> None:
    gc.enable()
    name = fresh_module(RECORDS)
    before = gc.get_freeze_count()
    start_up_imports(name)
    module = sys.modules[name]
    assert module.PAUSED
    assert gc.isenabled()
    assert gc.get_freeze_count() >= before + len(module.MADE)


def test_a_process_with_torch_imports_as_usual(fresh_module) -> None:
    """A test session, the CLI's app called in-process: a freeze there would keep its
    uncollected garbage for good."""
    import torch  # noqa: F401

    gc.enable()
    name = fresh_module(RECORDS)
    before = gc.get_freeze_count()
    start_up_imports(name)
    assert not sys.modules[name].PAUSED
    assert gc.get_freeze_count() == before
    assert gc.isenabled()


def test_a_failed_import_freezes_nothing_and_resumes(start_up, fresh_module) -> None:
    gc.enable()
    name = fresh_module("raise ImportError('broken on purpose')\n")
    before = gc.get_freeze_count()
    with pytest.raises(ImportError, match="broken on purpose"):
        start_up_imports(name)
    assert gc.get_freeze_count() == before
    assert gc.isenabled()


def test_a_paused_collector_stays_paused(start_up, fresh_module) -> None:
    gc.disable()
    start_up_imports(fresh_module(RECORDS))
    assert not gc.isenabled()


def test_transcribe_imports_torch_paused_and_loads_with_it_frozen(tmp_path: Path) -> None:
    """In a CLI process torch is imported with the collector paused; by the time the model
    loads, the collector runs and torch's objects are frozen (gc freezes every object
    there is: over 50 thousand with torch's; 0 without the call)."""
    clip = tmp_path / "quiet.wav"
    sf.write(clip, np.zeros(16_000, np.float32), 16_000)
    code = f"""
import gc, sys
paused = []
sys.addaudithook(
    lambda event, args: paused.append(not gc.isenabled())
    if event == "import" and args[0] == "torch" else None
)
from whisper_cli import cli

def load(*args, **kwargs):
    print(paused, gc.isenabled(), gc.get_freeze_count(), file=sys.stderr)
    raise SystemExit(0)

assert "torch" not in sys.modules
cli._load = load
sys.argv = ["whisper-cli", "transcribe", {str(clip)!r}, "-m", "tiny.en"]
cli.main()
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    paused, enabled, frozen = done.stderr.strip().splitlines()[-1].split()
    assert paused == "[True]" and enabled == "True"
    assert int(frozen) > 50_000
