"""scripts/gpu_check.py's parity stage, on the CPU with tiny shapes: teacher forcing through
the engine's own step (eager and compiled) reproduces the free-running reference."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from util import REPO, real_tokenizer, shared_clip


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_check"]


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
