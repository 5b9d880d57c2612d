"""Where outputs go: their names below --output-dir, the --format choices, and the atomic
writer every output file goes through."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from test_formats import UNKNOWN_FORMATS

from whisper_cli import outputs
from whisper_cli.errors import WhisperCliError
from whisper_cli.formats import FORMATS
from whisper_cli.outputs import OutputPlan, write_atomic

# --- names and formats ---------------------------------------------------------------------


def test_output_names(tmp_path: Path) -> None:
    out = tmp_path / "out"

    def path(input_path: str, fmt: str) -> Path:
        (found,) = OutputPlan.make(fmt, out, [], 1).paths(input_path)
        return found

    assert path("talks/keynote.wav", "srt") == out / "keynote.srt"
    assert path("/abs/x.tar.gz", "json") == out / "x.tar.json"
    assert path("noext", "txt") == out / "noext.txt"
    assert path("-", "vtt") == out / "stdin.vtt"


def test_format_all_is_every_format_in_order(tmp_path: Path) -> None:
    paths = OutputPlan.make("all", tmp_path, [], 1).paths("a.wav")
    assert paths == [tmp_path / f"a.{fmt}" for fmt in FORMATS]


@pytest.mark.parametrize("fmt", UNKNOWN_FORMATS)
def test_unknown_format_is_a_usage_error(tmp_path: Path, fmt: str) -> None:
    with pytest.raises(WhisperCliError) as info:
        OutputPlan.make(fmt, tmp_path, [], 1)
    assert info.value.exit_code == 2
    for name in [*FORMATS, "all"]:
        assert name in info.value.message


# --- write_atomic --------------------------------------------------------------------------


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_write_atomic_writes_utf8_and_creates_parents(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "out.txt"
    write_atomic(target, "héllo ✓\nline\n")
    assert target.read_bytes() == "héllo ✓\nline\n".encode()
    assert _names(target.parent) == ["out.txt"]


def test_write_atomic_replaces_and_keeps_mode(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old")
    target.chmod(0o640)
    write_atomic(target, "new")
    assert target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert _names(tmp_path) == ["out.txt"]


def test_write_atomic_new_file_gets_umask_mode(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "out.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out.txt").stat().st_mode) == 0o644


def test_write_atomic_target_appears_only_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "out.srt"
    target.write_text("old")
    content = "x" * 1_000_000
    real_replace = os.replace
    seen: list[str] = []

    def checking_replace(src: str, dst: Path) -> None:
        # Just before the swap: the temp file is whole and the target still the old one.
        name = Path(src).name
        assert name.startswith(".") and name.endswith(".tmp")
        assert Path(src).parent == tmp_path
        assert Path(src).read_text() == content
        assert target.read_text() == "old"
        seen.append(name)
        real_replace(src, dst)

    monkeypatch.setattr(outputs.os, "replace", checking_replace)
    write_atomic(target, content)
    assert seen
    assert target.read_text() == content
    assert _names(tmp_path) == ["out.srt"]


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
@pytest.mark.parametrize("step", ["replace", "fsync"])
def test_write_atomic_failure_leaves_no_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str, error: BaseException
) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old")

    def fail(*args: object) -> None:
        raise error

    monkeypatch.setattr(outputs.os, step, fail)
    with pytest.raises(type(error)):
        write_atomic(target, "new content")
    assert target.read_text() == "old"
    assert _names(tmp_path) == ["out.txt"]


def test_write_atomic_failure_mid_write_leaves_no_partial_file(tmp_path: Path) -> None:
    # A lone surrogate cannot be encoded as UTF-8, so the write fails after the
    # first megabyte has gone to the temp file.
    target = tmp_path / "out.txt"
    with pytest.raises(UnicodeEncodeError):
        write_atomic(target, "a" * 1_000_000 + "\ud800")
    assert _names(tmp_path) == []

    target.write_text("old")
    with pytest.raises(UnicodeEncodeError):
        write_atomic(target, "a" * 1_000_000 + "\ud800")
    assert target.read_text() == "old"
    assert _names(tmp_path) == ["out.txt"]
