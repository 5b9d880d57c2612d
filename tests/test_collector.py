"""The collector paused and then frozen for torch's import (see whisper_cli.collector)."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from util import REPO, real_model

from whisper_cli.collector import long_lived


@pytest.fixture(autouse=True)
def _thawed():
    """What a test froze goes back to the collector; the collector ends as it began."""
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_objects_made_inside_are_frozen_and_the_collector_resumes() -> None:
    gc.enable()
    before = gc.get_freeze_count()
    with long_lived():
        assert not gc.isenabled()
        made = [[i] for i in range(10_000)]  # tracked containers, as modules and classes are
    assert gc.isenabled()
    assert gc.get_freeze_count() >= before + len(made)


def test_the_collector_resumes_after_an_error() -> None:
    gc.enable()
    with pytest.raises(ImportError), long_lived():
        import whisper_cli_no_such_module  # noqa: F401
    assert gc.isenabled()


def test_a_paused_collector_stays_paused() -> None:
    gc.disable()
    with long_lived():
        pass
    assert not gc.isenabled()


def test_transcribe_decodes_with_torch_frozen_and_the_collector_on(tmp_path: Path) -> None:
    """By the time the CLI decodes, what its imports made is frozen (gc.freeze takes every
    object there is: over 50 thousand with torch's; 0 without long_lived) and the
    collector runs."""
    clip = tmp_path / "quiet.wav"
    sf.write(clip, np.zeros(16_000, np.float32), 16_000)
    code = f"""
import gc, sys
import whisper_cli.pipeline as pipeline
from whisper_cli import cli

def run(self, sources, *args, **kwargs):
    print(gc.isenabled(), gc.get_freeze_count(), file=sys.stderr)

pipeline.Transcriber.run = run
sys.argv = ["whisper-cli", "transcribe", {str(clip)!r}, "-m", {str(real_model("tiny.en"))!r}]
cli.main()
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    enabled, frozen = done.stderr.strip().splitlines()[-1].split()
    assert enabled == "True"
    assert int(frozen) > 50_000
