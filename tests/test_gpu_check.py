"""scripts/gpu_check.{sh,py} on the CPU with tiny shapes: the parity stage (teacher forcing
through the engine's own step, eager and compiled, reproduces the free-running reference),
the plan, and the driver killing a stage at its limit with its partial result kept."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from util import REPO, real_tokenizer, script_module, shared_clip


@pytest.fixture(scope="module")
def gpu_check():
    with script_module("gpu_check") as module:
        yield module


def test_parity_stage_on_cpu(gpu_check, tmp_path, monkeypatch):
    from whisper_cli.audio import load_audio

    model = gpu_check.make_model(
        tmp_path / "model", (64, 2, 1, 4), "cpu", tokenizer=real_tokenizer("base")
    )
    clip = load_audio(shared_clip("jfk.flac"))
    # One compiled path (inductor's compile is most of this test's time).
    paths = (("f32", False), ("f32", True), ("bf16", False))
    out = gpu_check.parity(model, "cpu", clip, rows=2, steps=6, paths=paths)
    eager, compiled = out["cpu_f32_eager"], out["cpu_f32_compiled"]
    # The same CPU, the same eager kernels: forcing the reference's own tokens changes nothing.
    assert eager["vs_cpu_f32"]["max_abs_logit_diff"] == 0.0
    assert eager["vs_cpu_f32"]["tokens_identical"]
    # Inductor fuses differently: equal within the f32 tolerance, the same choices, one graph.
    assert compiled["vs_cpu_f32"]["max_abs_logit_diff"] <= 1e-3
    assert compiled["vs_eager"]["tokens_identical"]
    assert (compiled["graphs"], compiled["recompiles"], compiled["graph_breaks"]) == (1, 0, 0)
    assert out["f32_pass"]
    # bf16 forced to the f32 tokens: mostly the same choices (the weights are confident).
    assert min(out["bf16_token_agreement"].values()) >= 0.5
    assert out["reference_max_abs_logit"] > 10  # the scaled embedding: confident logits
    # The sampled step (fallback draws) compiled whole, drawing what the eager step draws.
    drawn = out["cpu_sampled_f32"]
    assert drawn["drawn_identical"] and drawn["drawn_agreement"] == 1.0
    assert drawn["drawn_not_greedy"] > 0  # real draws, not the argmax under another name
    c = drawn["compiled"]
    assert (c["graphs"], c["recompiles"], c["graph_breaks"]) == (1, 0, 0)
    # The summary reports it, the sampled draws included.
    work, out_dir = tmp_path / "work", tmp_path / "out"
    work.mkdir(), out_dir.mkdir()
    monkeypatch.setenv("GPU_CHECK_WORK", str(work))
    gpu_check.write_json(work / "parity-turbo.json", {"status": "ok", "result": out})
    gpu_check.summarise(out_dir)
    summary = (out_dir / "summary.md").read_text()
    assert "| cpu_f32_compiled | " in summary
    assert "- cpu_sampled_f32 (T 1.0): compiled draws agree with eager **1.0**" in summary
    # A window's encoder output alone and inside the batch: the same bytes on the CPU
    # (a window at a time); the device's answer is reported, not judged.
    for dtype in ("f32", "bf16"):
        alone = out[f"cpu_window_alone_{dtype}"]
        assert alone == {"windows": 2, "identical": True, "max_abs_diff": 0.0}
        assert (
            f"- cpu_window_alone_{dtype}: window 0's encoder output alone against inside the "
            "batch of 2: identical **True** (max abs diff 0.00e+00)"
        ) in summary


def test_the_plan_answers_by_value_within_the_budget(gpu_check):
    plan = gpu_check.PLAN
    planned = [
        "setup",
        "parity-turbo",
        "bench-large-v3-bf16-compiled",
        "bench-turbo-bf16-compiled",
        "bench-turbo-bf16-eager",
        "dtype",
        "bench-large-v3-bf16-eager",
        "bench-large-v3-f32-compiled",
    ]
    assert [s.name for s in plan[: len(planned)]] == planned
    assert sum(s.expect_s for s in plan[: len(planned)]) <= gpu_check.BUDGET_S - gpu_check.RESERVE_S
    for s in plan:
        assert s.first_s is None or s.first_s <= s.expect_s <= s.limit_s, s
    # Setup saves nothing of use on its own: it starts only with its whole limit left.
    assert plan[0].needs_s == plan[0].limit_s


def test_token_agreement_is_per_window(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_CHECK_WORK", str(tmp_path))
    gpu_check.write_json(tmp_path / "a.tokens.json", [[1, 2, 3, 4], [5, 6]])
    gpu_check.write_json(tmp_path / "b.tokens.json", [[1, 2, 3, 4], [5, 7]])
    assert gpu_check.token_agreement("a", "b").endswith(
        "1/2 windows identical, mean agreement 0.750, mean common prefix 2.5 tokens"
    )
    assert gpu_check.token_agreement("a", "c") == "tokens of a vs c: not recorded"


def repacked_wheel(name: str, into: Path) -> Path:
    """The installed distribution `name` zipped back into a wheel (its files, metadata
    included): the carried wheel, with no network."""
    dist = importlib.metadata.distribution(name)
    wheel = into / f"{name.replace('-', '_')}-{dist.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for file in dist.files or ():
            if ".." not in file.parts and file.suffix != ".pyc":
                zf.write(file.locate(), str(file))
    return wheel


def test_a_stage_killed_at_its_limit_keeps_its_partial_result(tmp_path):
    """The driver on the CPU with setup and one bench stage, which hangs after its warm-up
    (GPU_CHECK_STALL, as a compile running long would) and is killed at its limit:
    summary.md shows its warm-up result and names the stages not run, with why: dtype
    (60 s needed, x5 on the CPU) finds less than that of the 95 s budget left after them.
    The driver's python has no silero-vad and a pip that fails, as a bare image may: the
    carried wheel is unpacked instead, and the stages import the detector from there."""
    from whisper_cli.audio import load_audio

    carry, work, out = tmp_path / "carry", tmp_path / "work", tmp_path / "out"
    carry.mkdir()
    shutil.copyfile(real_tokenizer("base"), carry / "tokenizer.json")
    clip = load_audio(shared_clip("jfk.flac"))
    np.save(carry / "speech-int16.npy", np.round(clip * 32767).astype(np.int16))
    plan = {"duration_s": {"small": 60.0, "full": 860.0}, "real_steps_per_batch": {"base": 9}}
    (carry / "plan.json").write_text(json.dumps(plan))
    repacked_wheel("silero-vad", carry)
    python = tmp_path / "python"  # the driver's probe finds no silero-vad, its pip fails
    python.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1 $2" == "-m pip" ]]; then echo "pip: failing here" >&2; exit 1; fi\n'
        'if [[ "$1" == -c && "$2" == *silero-vad* ]]; then exit 1; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    stage, limit = "bench-turbo-bf16-eager", 25  # its warm-up takes a few seconds
    env = {
        **os.environ,
        "PYTHON": str(python),
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_SMALL": "1",
        "GPU_CHECK_CARRY": str(carry),
        "GPU_CHECK_WORK": str(work),
        "GPU_CHECK_MODELS": str(tmp_path / "models"),
        "OUT": str(out),
        "GPU_CHECK_STAGES": f"setup {stage} dtype",
        "GPU_CHECK_BUDGET_S": "95",  # 85 s after the summary's reserve
        "GPU_CHECK_LIMITS": f"setup=60 {stage}={limit}",
        "GPU_CHECK_STALL": stage,
    }
    run = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "pip: failing here" in run.stdout
    assert "silero-vad unpacked from" in run.stdout
    site = work / "site"
    setup = json.loads((work / "setup.json").read_text())
    assert setup["status"] == "ok"
    assert setup["result"]["env"]["silero_vad"] == str(site / "silero_vad" / "__init__.py")
    summary = (out / "summary.md").read_text()
    assert f"| {stage} | timed out after {limit} s, partial result kept |" in summary
    assert "| turbo-bf16-eager | warm-up only: RTFx " in summary
    assert "not run: parity-turbo (not selected (GPU_CHECK_STAGES)); " in summary
    skipped = re.search(r"\| dtype \| skipped: (\d+)s of the budget left, needs 60s \|", summary)
    assert skipped and int(skipped[1]) < 60, summary
    assert "; dtype (skipped: " in summary
    assert "- turbo bf16 compiled RTFx >= 3000: not measured" in summary


def test_the_summary_reports_steps_saved_by_refills(gpu_check, tmp_path, monkeypatch):
    """Continuous batching on the device: the refilled compiled bench stage against the
    same configuration stepped in batches (bench-turbo-bf16-batches), steps and tokens."""
    monkeypatch.setenv("GPU_CHECK_WORK", str(tmp_path))
    assert gpu_check.BENCH["bench-turbo-bf16-batches"].refill is False
    assert gpu_check.BENCH["bench-turbo-bf16-compiled"].refill is None  # the default: on
    engine = {"steps": 300.0, "row_steps": 4200.0, "refills": 16.0}
    stages = {
        "bench-turbo-bf16-compiled": {"result": {"engine": engine}},
        "bench-turbo-bf16-batches": {"result": {"engine": {**engine, "steps": 448.0}}},
    }
    gpu_check.write_json(tmp_path / "bench-turbo-bf16-compiled.tokens.json", [[1, 2], [3]])
    gpu_check.write_json(tmp_path / "bench-turbo-bf16-batches.tokens.json", [[1, 2], [3]])
    lines = gpu_check.refill_lines(stages, "turbo-bf16-compiled", "turbo-bf16-batches")
    assert lines[0] == (
        "- refilled / batches (turbo bf16 compiled): steps 300 vs 448, row-steps 4200 vs "
        "4200, rows refilled 16"
    )
    assert "2/2 windows identical" in lines[1]
    del stages["bench-turbo-bf16-batches"]
    assert gpu_check.refill_lines(stages, "turbo-bf16-compiled", "turbo-bf16-batches")[0].endswith(
        "not measured"
    )
