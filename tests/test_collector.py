"""torch's import with the collector paused, then frozen (see whisper_cli.collector)."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from util import REPO, real_model

from whisper_cli.collector import import_long_lived


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


def test_a_new_module_is_imported_paused_and_frozen(fresh_module) -> None:
    gc.enable()
    name = fresh_module(RECORDS)
    before = gc.get_freeze_count()
    import_long_lived(name)
    module = sys.modules[name]
    assert module.PAUSED
    assert gc.isenabled()
    assert gc.get_freeze_count() >= before + len(module.MADE)


def test_modules_already_imported_freeze_nothing(fresh_module) -> None:
    """A process that has them (a test session, the CLI's app called in-process) keeps
    its collector as it was: a freeze there would keep its uncollected garbage for good."""
    gc.enable()
    name = fresh_module(RECORDS)
    __import__(name)
    before = gc.get_freeze_count()
    import_long_lived(name, "gc")
    assert gc.get_freeze_count() == before
    assert gc.isenabled()


def test_the_collector_resumes_after_a_failed_import(fresh_module) -> None:
    gc.enable()
    name = fresh_module("raise ImportError('broken on purpose')\n")
    with pytest.raises(ImportError, match="broken on purpose"):
        import_long_lived(name)
    assert gc.isenabled()


def test_a_paused_collector_stays_paused(fresh_module) -> None:
    gc.disable()
    import_long_lived(fresh_module(RECORDS))
    assert not gc.isenabled()


def test_transcribe_imports_torch_paused_and_loads_with_it_frozen(tmp_path: Path) -> None:
    """In a CLI process, by the time the model loads torch is imported and frozen (gc
    freezes every object there is: over 50 thousand with torch's; 0 without the call)
    and the collector runs."""
    clip = tmp_path / "quiet.wav"
    sf.write(clip, np.zeros(16_000, np.float32), 16_000)
    code = f"""
import gc, sys
from whisper_cli import cli

def load(*args, **kwargs):
    print("torch" in sys.modules, gc.isenabled(), gc.get_freeze_count(), file=sys.stderr)
    raise SystemExit(0)

assert "torch" not in sys.modules
cli._load = load
sys.argv = ["whisper-cli", "transcribe", {str(clip)!r}, "-m", {str(real_model("tiny.en"))!r}]
cli.main()
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    imported, enabled, frozen = done.stderr.strip().splitlines()[-1].split()
    assert imported == "True" and enabled == "True"
    assert int(frozen) > 50_000
