"""scripts/compare_cpu.py's arithmetic: the start clip's command, the time past start-up
against the baseline's, and the issue-20 lines that print it beside the whole-process
targets (the timed runs themselves need the peers' environment: run by hand)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from util import script_module

from whisper_cli import native


@pytest.fixture(scope="module")
def compare_cpu():
    with script_module("compare_cpu") as module:
        yield module


def test_the_start_clip_replaces_only_the_audio_argument(compare_cpu):
    wav, clip = Path("/tmp/x/speech.wav"), Path("/tmp/x/start.wav")
    cmd = ["python", "-m", "whisper_cli", "transcribe", str(wav), "--model", "m", "-q"]
    assert compare_cpu.clip_command(cmd, wav, clip) == [
        "python", "-m", "whisper_cli", "transcribe", str(clip), "--model", "m", "-q",
    ]  # fmt: skip
    peer = ["peer", "-c", "code", "ct2/tiny.en", "int8", str(wav), "2"]
    assert compare_cpu.clip_command(peer, wav, clip)[5] == str(clip)
    with pytest.raises(ValueError, match="not an argument"):
        compare_cpu.clip_command(["python", "-c", "code", "other.wav"], wav, clip)


def test_time_past_start_up_is_against_the_baselines_own(compare_cpu):
    # 12.3 s whole, 2.4 s of it start-up; the baseline 10.9 s, 1.05 s of it start-up.
    assert compare_cpu.beyond_start(12.3, 2.4, 10.9, 1.05) == round(9.9 / 9.85, 2)
    assert compare_cpu.beyond_start(9.1, 2.2, 10.9, 1.05) == 0.7
    # A baseline whose clip took as long as its whole run has nothing to compare with.
    assert compare_cpu.beyond_start(5.0, 1.0, 1.0, 1.0) is None
    assert compare_cpu.beyond_start(5.0, 1.0, 1.0, 1.2) is None


def _row(impl, dtype, wall, ratio, start=None, beyond=None, peak=1000, wer=1.0):
    return {
        "impl": impl,
        "model": "tiny.en",
        "dtype": dtype,
        "wall_s": wall,
        "ratio": ratio,
        "start_s": start,
        "beyond_ratio": beyond,
        "peak_mb": peak,
        "wer": wer,
    }


def test_issue_20_lines_print_the_time_past_start_up_beside_the_target(compare_cpu):
    rows = [
        _row("whisper-cli", "f32", 12.3, 1.13, 2.4, 1.01, peak=1345, wer=1.46),
        _row("whisper-cli", "f32+int8", 9.1, 0.84, 2.2, 0.7, peak=1209, wer=1.32),
        _row("fw-batched", "int8", 10.9, 1.0, 1.05, 1.0, peak=1447, wer=15.5),
    ]
    lines = compare_cpu.issue20_verdicts(rows, native_bf16=True)
    f32 = next(line for line in lines if "tiny.en f32:" in line)
    int8 = next(line for line in lines if "tiny.en f32+int8:" in line)
    # The whole-process verdicts are unchanged; the time past start-up is not judged.
    assert "1.13x fw-batched int8 (<= 1.0x: NOT met)" in f32
    assert "1.01x past start-up (a 2.4 s start against 1.05 s)" in f32
    assert "0.84x fw-batched int8 (<= 0.75x: NOT met)" in int8
    assert "0.7x past start-up (a 2.2 s start against 1.05 s)" in int8
    assert "met)" not in f32.split("past start-up")[1]
    # Without a start clip (--start-clip 0) the lines are as before.
    bare = [
        _row("whisper-cli", "f32", 12.3, 1.13, peak=1345, wer=1.46),
        _row("fw-batched", "int8", 10.9, 1.0, peak=1447, wer=15.5),
    ]
    assert not any("start-up" in line for line in compare_cpu.issue20_verdicts(bare, True))


def _macros(cc: str, *flags: str) -> str:
    """What the compiler defines for these flags (its -dM listing of an empty C file)."""
    cmd = [cc, *flags, "-dM", "-E", "-x", "c", "/dev/null"]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler ($CC, cc or gcc)")
def test_isa_avx2_holds_each_library_and_builds_the_c_kernels_for_avx2(compare_cpu, tmp_path):
    cc = native.compiler()
    env = compare_cpu.isa_environment("avx2", tmp_path / "isa")
    assert {k: env[k] for k in compare_cpu.ISA_LIMITS["avx2"]} == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "CT2_FORCE_CPU_ISA": "AVX2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    }
    # The wrapper compiles for x86-64-v3 where native.py asks for -march=native (-march=native
    # itself names this CPU's model among its macros), and passes the rest as given.
    wrapped = _macros(env["CC"], "-O3", "-march=native", "-fPIC")
    assert wrapped == _macros(cc, "-O3", "-march=x86-64-v3", "-fPIC")
    assert wrapped != _macros(cc, "-O3", "-march=native", "-fPIC")
    assert "#define __AVX2__ 1" in wrapped and "__AVX512F__" not in wrapped
    # Under it a child's torch runs its AVX2 kernels; a child held lower is refused.
    compare_cpu.check_isa("avx2", {**os.environ, **env})
    with pytest.raises(SystemExit, match="torch runs DEFAULT"):
        compare_cpu.check_isa("avx2", {**os.environ, **env, "ATEN_CPU_CAPABILITY": "default"})
    # fbgemm heeds only its own variable: without it, a CPU with VNNI keeps its int8 GEMM
    # exact on the wide grid, which no AVX2 CPU has, and the run is refused.
    unheld = {k: v for k, v in {**os.environ, **env}.items() if k != "FBGEMM_ENABLE_INSTRUCTIONS"}
    if "avx512_vnni" in Path("/proc/cpuinfo").read_text().split():
        with pytest.raises(SystemExit, match="fbgemm's int8 GEMM is not held to avx2"):
            compare_cpu.check_isa("avx2", unheld)
    else:
        compare_cpu.check_isa("avx2", unheld)
