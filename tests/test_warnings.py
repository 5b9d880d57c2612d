"""Warnings reach every machine-readable output: json, jsonl and batch's summary.jsonl.

A flac cut short and a wav with a NaN sample are transcribed with a warning each; its code
is in their json and jsonl, in summary.jsonl beside status "ok", and counted in the last
line; `-q` empties stderr but leaves the files as they are.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from typer.testing import CliRunner
from util import jsonl_records, real_model, shared_clip

from whisper_cli.cli import app


def cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> dict[str, Path]:
    """jfk.flac cut to a quarter of its bytes, jfk as a float wav with one NaN, and jfk."""
    folder = tmp_path_factory.mktemp("damaged")
    jfk = shared_clip("jfk.flac")
    data = jfk.read_bytes()
    (folder / "truncated.flac").write_bytes(data[: len(data) // 4])
    samples, rate = sf.read(jfk, dtype="float32")
    samples[5 * rate] = np.nan
    sf.write(folder / "nan.wav", samples, rate, subtype="FLOAT")
    (folder / "clean.flac").write_bytes(data)
    return {name: folder / f"{name}{ext}" for name, ext in WHICH}


WHICH = (("truncated", ".flac"), ("nan", ".wav"), ("clean", ".flac"))
CODES = {"truncated": ["truncated"], "nan": ["non_finite"], "clean": []}


def codes(path: Path) -> list[str]:
    text = path.read_text()
    (record,) = jsonl_records(text) if path.suffix == ".jsonl" else [json.loads(text)]
    return [w["code"] for w in record["warnings"]]


def assert_warnings_in_files(out: Path) -> None:
    for name, expected in CODES.items():
        assert codes(out / f"{name}.json") == expected, name
        assert codes(out / f"{name}.jsonl") == expected, name
        for w in json.loads((out / f"{name}.json").read_text())["warnings"]:
            assert w["message"] and str(out) not in w["message"]  # the path is its own field


@pytest.mark.usefixtures("cached_cli_models")
def test_transcribe_writes_the_warnings_into_json_and_jsonl(damaged, tmp_path: Path) -> None:
    tiny = real_model("tiny.en")
    inputs = list(damaged.values())
    loud = cli("transcribe", *inputs, "-m", tiny, "-f", "all", "-o", tmp_path / "loud")
    assert loud.exit_code == 0, loud.stderr
    assert_warnings_in_files(tmp_path / "loud")
    lines = loud.stderr.splitlines()
    assert f"whisper-cli: warning: {damaged['truncated']}: truncated: the audio ends at " in (
        loud.stderr
    )
    assert any(
        line.startswith(f"whisper-cli: warning: {damaged['nan']}: 1 non-finite sample")
        for line in lines
    ), loud.stderr
    assert re.fullmatch(
        r"whisper-cli: 3 written, 2 with warnings, 0 failed, .* of audio in .*", lines[-1]
    )
    quiet = cli("transcribe", *inputs, "-m", tiny, "-f", "all", "-o", tmp_path / "quiet", "-q")
    assert quiet.exit_code == 0 and quiet.stderr == ""
    assert_warnings_in_files(tmp_path / "quiet")


@pytest.mark.usefixtures("cached_cli_models")
def test_batch_writes_the_warnings_into_the_summary(damaged, tmp_path: Path) -> None:
    tiny = real_model("tiny.en")
    manifest = tmp_path / "inputs.txt"
    manifest.write_text("".join(f"{p}\n" for p in damaged.values()))
    loud = cli("batch", manifest, "-o", tmp_path / "loud", "-m", tiny, "-f", "all")
    assert loud.exit_code == 0, loud.stderr
    assert re.search(r"3 written, 2 with warnings, 0 failed, 0 already done", loud.stderr)
    assert f"whisper-cli: warning: {damaged['nan']}: 1 non-finite sample" in loud.stderr
    quiet = cli("batch", manifest, "-o", tmp_path / "quiet", "-m", tiny, "-f", "all", "-q")
    assert quiet.exit_code == 0 and quiet.stderr == ""
    for out in (tmp_path / "loud", tmp_path / "quiet"):
        assert_warnings_in_files(out)
        records = [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()]
        by_name = {Path(r["path"]).stem: r for r in records}
        for name, expected in CODES.items():
            assert by_name[name]["status"] == "ok" and by_name[name]["error"] is None
            assert [w["code"] for w in by_name[name]["warnings"]] == expected
        # what `jq 'select(.warnings|length>0)'` finds
        warned = sorted(Path(r["path"]).stem for r in records if r["warnings"])
        assert warned == ["nan", "truncated"]
