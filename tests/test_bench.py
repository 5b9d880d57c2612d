"""Tests for `whisper-cli bench` as a library (whisper_cli.tools.bench and .reference)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import SUITE_KERNELS
from util import real_model, shared_clip

from whisper_cli.audio import SAMPLE_RATE
from whisper_cli.errors import WhisperCliError
from whisper_cli.tools import bench
from whisper_cli.tools.bench import (
    BenchConfig,
    BenchFailure,
    BenchReport,
    Comparison,
    ConfigResult,
    render_table,
    report_to_json,
    run_bench,
    tiled_blocks,
)
from whisper_cli.tools.reference import compare_texts

# Every per-configuration field the JSON report must carry.
RESULT_FIELDS = {
    "model",
    "dtype",
    "compile",
    "device",
    "device_name",
    "torch_version",
    "threads",
    "batch_size",
    "audio_s",
    "wall_s",
    "walls_s",
    "rtfx",
    "encoder_ms_per_window",
    "decode_ms_per_step",
    "tokens_per_s",
    "load_s",
    "warmup_s",
    "peak_memory_mb",
    "peak_memory_kind",
    "windows",
    "decode_steps",
    "generated_tokens",
    "comparison",
    "kernels",
    "kernels_summary",
}


# --- pure helpers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"batch_size": 0}, "batch-size"),
        ({"repeats": 0}, "repeats"),
        ({"duration": 0.0}, "duration"),
        ({"compile": "maybe"}, "compile"),
        ({"against": "openai"}, "against"),
        ({"threads": 0}, "threads"),
    ],
)
def test_invalid_config_is_refused_before_any_work(change: dict, message: str) -> None:
    with pytest.raises(WhisperCliError, match=message):
        run_bench(BenchConfig(model="no-such-model", **change))


def test_tiled_blocks_repeat_the_clip_exactly() -> None:
    clip = np.arange(7, dtype=np.float32)
    blocks = list(tiled_blocks(clip, 17, block=5))
    assert [len(b) for b in blocks] == [5, 5, 5, 2]
    assert np.array_equal(np.concatenate(blocks), np.resize(clip, 17))
    assert np.array_equal(np.concatenate(list(tiled_blocks(clip, 3, block=5))), clip[:3])


def test_npy_audio_is_read_without_a_decoder(tmp_path: Path) -> None:
    good = tmp_path / "clip.npy"
    np.save(good, np.linspace(-0.5, 0.5, SAMPLE_RATE, dtype=np.float64))
    clip, description = bench.load_bench_audio(str(good))
    assert clip.dtype == np.float32 and clip.shape == (SAMPLE_RATE,)
    assert description == str(good)
    stereo = tmp_path / "stereo.npy"
    np.save(stereo, np.zeros((2, SAMPLE_RATE), np.float32))
    with pytest.raises(WhisperCliError, match="1-D float array"):
        bench.load_bench_audio(str(stereo))


def test_compare_texts_normalises_whitespace_only() -> None:
    same = compare_texts(" ask not  what\nyour country ", "ask not what your country")
    assert same.identical and same.word_differences == 0 and same.words == 5
    differ = compare_texts("ask not what your country", "Ask not what my country can")
    assert not differ.identical
    assert differ.word_differences == 3  # Ask/ask, my/your replaced; "can" inserted


def _fake_result(**change) -> ConfigResult:
    values = dict(
        model="tiny.en",
        model_path="models/tiny.en",
        dtype="f32",
        compile=False,
        device="cpu",
        device_name="Some CPU",
        torch_version="2.x",
        threads=2,
        batch_size=16,
        max_new_tokens=128,
        timestamps=True,
        audio_s=600.0,
        wall_s=20.0,
        walls_s=(20.0,),
        rtfx=30.0,
        load_s=0.5,
        warmup_wall_s=21.0,
        warmup_s=1.0,
        windows=22,
        batches=2,
        decode_steps=200,
        generated_tokens=2000,
        encoder_ms_per_window=100.0,
        decode_ms_per_step=40.0,
        tokens_per_s=250.0,
        detector_s=0.4,
        fallbacks=1,
        peak_memory_mb=700.0,
        peak_memory_kind="process peak RSS",
        language="en",
        words=1500,
        text="a long text",
    )
    return ConfigResult(**{**values, **change})


def test_render_table_and_json_of_a_report() -> None:
    comparison = Comparison("transformers 9", 40.0, 2.0, False, 3, 22)
    report = BenchReport(
        BenchConfig(model="tiny.en", dtypes=("f32", "bf16")),
        "speech",
        600.0,
        (_fake_result(), _fake_result(dtype="bf16", comparison=comparison)),
        (BenchFailure("tiny.en", "f16", "boom"),),
    )
    table = render_table(report)
    rows = [line for line in table.splitlines() if line.startswith("| tiny.en")]
    assert len(rows) == 2
    assert "| 30.0 |" in rows[0] and "2.00x" in rows[1] and "3 words differ" in rows[1]
    assert "| 2.0 |" in rows[0]  # the speech detector: 0.4 s of the 20 s run
    assert "FAILED tiny.en f16: boom" in table
    data = json.loads(json.dumps(report_to_json(report)))  # plain JSON all the way down
    assert "text" not in data["results"][0]
    assert data["results"][1]["comparison"]["speedup"] == 2.0
    assert data["failures"] == [{"model": "tiny.en", "dtype": "f16", "error": "boom"}]
    assert report_to_json(report, include_text=True)["results"][0]["text"] == "a long text"


def test_the_kernel_plan_is_reported() -> None:
    plan = {"mode": "auto", "choices": {"attention/f32/decode/H6xT1xStextxD64/none": "sdpa"}}
    result = _fake_result(kernels=plan, kernels_summary="auto (cpu, f32): attention sdpa x1")
    report = BenchReport(BenchConfig(model="tiny.en", dtypes=("f32",)), "speech", 600.0, (result,))
    assert "kernels of tiny.en f32: auto (cpu, f32): attention sdpa x1" in render_table(report)
    data = json.loads(json.dumps(report_to_json(report)))
    assert data["results"][0]["kernels"] == plan


def test_the_quantization_is_reported() -> None:
    config = BenchConfig(model="tiny.en", dtypes=("f32",), quantize="int8", device="cpu")
    report = BenchReport(config, "speech", 600.0, (_fake_result(quantize="int8"),))
    data = json.loads(json.dumps(report_to_json(report)))
    assert data["config"]["quantize"] == "int8" and data["results"][0]["quantize"] == "int8"
    assert "| tiny.en | f32 int8 |" in render_table(report)
    assert bench._child_spec(config, "f32", Path("c.npy"), 1, Path("r.json"))["quantize"] == "int8"
    assert _fake_result().quantize == "none"
    with pytest.raises(WhisperCliError, match="invalid quantize 'int4'"):
        bench.validate(BenchConfig(quantize="int4", device="cpu"))


def test_a_failing_configuration_is_reported_not_raised(tmp_path: Path) -> None:
    audio = tmp_path / "noise.npy"
    np.save(audio, np.zeros(SAMPLE_RATE, np.float32))
    report = run_bench(BenchConfig(model=str(tmp_path / "missing-model"), audio=str(audio)))
    assert report.results == ()
    assert len(report.failures) == 1
    assert "missing-model" in report.failures[0].error


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's")
def test_the_child_imports_this_package_whatever_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from a directory that holds another whisper_cli (another checkout), the child
    still runs this one: the configuration fails on its missing model, as here."""
    decoy = tmp_path / "whisper_cli"
    (decoy / "tools").mkdir(parents=True)
    (decoy / "__init__.py").write_text('raise SystemExit("the other checkout ran")\n')
    (decoy / "tools" / "__init__.py").write_text("")
    audio = tmp_path / "noise.npy"
    np.save(audio, np.zeros(SAMPLE_RATE, np.float32))
    monkeypatch.chdir(tmp_path)
    report = run_bench(BenchConfig(model=str(tmp_path / "missing-model"), audio=str(audio)))
    assert len(report.failures) == 1
    assert "missing-model" in report.failures[0].error, report.failures[0].error


@pytest.mark.parametrize(("cuda", "expected"), [(True, "turbo"), (False, "base")])
def test_no_model_means_the_default_of_the_device_it_runs_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: bool, expected: str
) -> None:
    import torch

    audio = tmp_path / "noise.npy"
    np.save(audio, np.zeros(SAMPLE_RATE, np.float32))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    specs = []

    def child(spec, timeout_s):
        specs.append(spec)
        raise WhisperCliError("not run")

    monkeypatch.setattr(bench, "_run_child", child)
    report = run_bench(BenchConfig(audio=str(audio), device="auto"))
    assert [spec["model"] for spec in specs] == [expected]
    assert report.config.model == expected
    assert [f.model for f in report.failures] == [expected]


def test_a_configuration_past_its_timeout_is_killed_and_reported(tmp_path: Path) -> None:
    audio = tmp_path / "noise.npy"
    np.save(audio, np.zeros(SAMPLE_RATE, np.float32))
    # The child cannot even import torch in 0.2 s; the model is never reached.
    config = BenchConfig(model=str(tmp_path / "never-loaded"), audio=str(audio), timeout_s=0.2)
    report = run_bench(config)
    assert report.results == ()
    assert [f.error for f in report.failures] == ["timed out after 0.2 s"]


# --- real runs ------------------------------------------------------------------------------


def test_short_real_run_reports_every_field() -> None:
    """tiny.en f32 over 30 s of the default real speech, one timed run, in a child process."""
    model = real_model("tiny.en")
    shared_clip("jfk.flac")  # the default audio is built from ../shared/audio
    config = BenchConfig(
        model=str(model),
        dtypes=("f32",),
        batch_size=4,
        duration=30.0,
        repeats=1,
        max_new_tokens=64,
        device="cpu",
        threads=1,  # one thread: steady timings on a loaded 2-core machine
    )
    report = run_bench(config)
    assert report.failures == ()
    data = json.loads(json.dumps(report_to_json(report)))
    assert data["audio"].startswith("real speech: jfk.flac")
    assert data["audio_s"] == pytest.approx(30.0)
    (result,) = data["results"]
    assert RESULT_FIELDS - set(result) == set()
    assert result["model"] == "tiny.en" and result["dtype"] == "f32"
    assert result["device"] == "cpu" and result["device_name"]
    assert result["compile"] is False  # auto is off on CPU
    assert result["threads"] == 1 and result["batch_size"] == 4
    assert result["audio_s"] == pytest.approx(30.0)
    assert len(result["walls_s"]) == 1 and result["wall_s"] == result["walls_s"][0] > 0
    assert result["rtfx"] == pytest.approx(30.0 / result["wall_s"], rel=1e-3)
    for key in ("encoder_ms_per_window", "decode_ms_per_step", "tokens_per_s", "load_s"):
        assert result[key] > 0, key
    assert result["warmup_s"] >= 0
    assert result["peak_memory_mb"] > 100  # torch alone takes more than this
    assert result["peak_memory_kind"] == "process peak RSS"
    assert result["windows"] >= 1 and result["batches"] >= 1
    assert 0 < result["generated_tokens"] <= result["windows"] * 64
    assert result["decode_steps"] >= result["batches"] + 1
    # What the engine ran, per timed run, and the text's hash.
    engine = result["engine"]
    assert engine["decoded_rows"] == result["windows"] >= engine["encoded_rows"] >= 1
    assert engine["prefills"] + engine["steps"] == result["decode_steps"]
    assert engine["tokens"] == result["generated_tokens"]
    assert engine["graphs"] == engine["recompiles"] == 0  # eager
    assert result["engine_warmup"]["decodes"] >= 1
    text = report.results[0].text
    assert result["text_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert result["comparison"] is None
    # The kernel plan the model ran with: the suite's (see conftest.SUITE_KERNELS), made at
    # load for batches of 4, its choices named per shape class.
    kernels = result["kernels"]
    assert kernels["mode"] == SUITE_KERNELS and kernels["dtype"] == "f32"
    assert kernels["threads"] == 1 and kernels["timed_now"] == 0
    assert "attention/f32/decode/H6xT1xStextxD64/none" in kernels["choices"]
    assert "linear/f32/N1536xK384/frames" in kernels["choices"]  # the encoder's fc1
    assert set(kernels["choices"].values()) <= {"sdpa", "matmul", "fused", "linear", "conv"}
    assert result["kernels_summary"].startswith(f"{SUITE_KERNELS} (cpu, f32, 1 threads")
    assert report.results[0].words > 20  # 30 s of speech was transcribed
    assert "ask not what your country can do for you" in report.results[0].text.lower()


def test_against_transformers_gives_identical_text() -> None:
    """The same windows through transformers' generate() decode to the same words (~15 s)."""
    model = real_model("tiny.en")
    jfk = shared_clip("jfk.flac")
    config = BenchConfig(
        model=str(model),
        dtypes=("f32",),
        batch_size=4,
        audio=str(jfk),
        repeats=1,
        max_new_tokens=128,
        device="cpu",
        against="transformers",
        threads=1,
    )
    report = run_bench(config)
    assert report.failures == ()
    (result,) = report.results
    c = result.comparison
    assert c is not None and c.reference.startswith("transformers ")
    assert c.texts_identical, (c.word_differences, result.text)
    assert c.word_differences == 0
    assert c.reference_wall_s > 0 and c.speedup == pytest.approx(c.reference_wall_s / result.wall_s)
    assert "ask not what your country can do for you" in result.text.lower()


def test_word_timestamps_run_reports_the_alignment_cost() -> None:
    """The alignment pass is timed on its own and set against the rest of the run."""
    config = BenchConfig(
        model=str(real_model("tiny.en")),
        dtypes=("f32",),
        batch_size=4,
        audio=str(shared_clip("jfk.flac")),
        repeats=1,
        device="cpu",
        threads=1,
        word_timestamps=True,
    )
    report = run_bench(config)
    assert report.failures == ()
    (result,) = report.results
    assert result.word_timestamps is True
    assert result.align_ms_per_window > 0
    # The pass is a fraction of decoding: well under the whole rest of the run.
    assert 0 < result.word_timing_overhead < 1
    data = report_to_json(report)["results"][0]
    assert data["align_ms_per_window"] > 0 and data["word_timing_overhead"] > 0
    table = render_table(report)
    assert "| words +% |" in table
    assert f"| {100 * result.word_timing_overhead:.1f} |" in table


def test_bench_decodes_what_transcribe_decodes_unless_told() -> None:
    from whisper_cli.cli import run_options
    from whisper_cli.options import TranscribeOptions

    assert BenchConfig().max_new_tokens == TranscribeOptions().max_new_tokens == 224
    assert BenchConfig.of(run_options({})).max_new_tokens == 224
    told = BenchConfig.of(run_options({"max_new_tokens": 64, "no_vad": True}), repeats=1)
    assert (told.max_new_tokens, told.vad, told.repeats, told.timestamps) == (64, False, 1, True)
