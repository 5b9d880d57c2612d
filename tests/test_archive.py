"""Reading a TorchScript archive's tensors without TorchScript (archive.py): the same
tensors as torch.jit.load, no code compiled or run, and every malformed archive an error
that names it."""

from __future__ import annotations

import os
import pickle
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from whisper_cli.archive import read_tensors
from whisper_cli.errors import WhisperCliError
from whisper_cli.speech import _NAMES, load_detector, silero_archive_path


def _jit_state() -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():  # torch 2.13 calls TorchScript deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.load(str(silero_archive_path()), map_location="cpu").state_dict()


def test_silero_tensors_equal_torchscripts() -> None:
    """Every weight the detector takes, bit for bit, in the dtype and shape TorchScript
    gives it."""
    ours = read_tensors(silero_archive_path(), tuple(_NAMES))
    theirs = _jit_state()
    assert set(ours) == set(_NAMES)
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype, name
        assert tensor.shape == theirs[name].shape, name
        assert torch.equal(tensor, theirs[name]), name


def test_detector_loads_without_torchscript(monkeypatch: pytest.MonkeyPatch) -> None:
    """load_detector compiles no TorchScript, and its weights are the archive's."""
    expected = _jit_state()

    def refuse(*_args, **_kwargs):
        raise AssertionError("torch.jit.load called")

    monkeypatch.setattr(torch.jit, "load", refuse)
    state = load_detector().state_dict()
    for theirs, ours in _NAMES.items():
        assert torch.equal(state[ours], expected[theirs]), ours


class _Command:
    def __reduce__(self):
        return (os.system, ("touch should-not-exist",))


def _archive(path: Path, data_pkl: bytes, members: dict[str, bytes] | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("m/data.pkl", data_pkl)
        for name, data in (members or {}).items():
            z.writestr(name, data)
    return path


def test_a_global_outside_a_module_tree_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = _archive(tmp_path / "evil.jit", pickle.dumps(_Command(), protocol=2))
    with pytest.raises(WhisperCliError, match=r"\.system is no part of a module's weights"):
        read_tensors(path, ("x",))
    assert not (tmp_path / "should-not-exist").exists()


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    with pytest.raises(WhisperCliError, match=r"holds no tensor _model\.nothing\.weight"):
        read_tensors(silero_archive_path(), ("_model.nothing.weight",))
    # A name that reaches an attribute that is not a tensor is no tensor either.
    with pytest.raises(WhisperCliError, match=r"holds no tensor _model\.sample_rate"):
        read_tensors(silero_archive_path(), ("_model.sample_rate",))


def test_a_file_that_is_no_archive_is_named(tmp_path: Path) -> None:
    plain = tmp_path / "plain.jit"
    plain.write_bytes(b"not a zip")
    with pytest.raises(WhisperCliError, match=r"cannot read the tensors of .*plain\.jit"):
        read_tensors(plain, ("x",))
    no_pickle = tmp_path / "empty.jit"
    with zipfile.ZipFile(no_pickle, "w") as z:
        z.writestr("m/other", b"")
    with pytest.raises(WhisperCliError, match=r"empty\.jit is not a TorchScript archive"):
        read_tensors(no_pickle, ("x",))
    whole = pickle.dumps({"a": [1, 2, 3]}, protocol=2)
    for cut in (whole[:9], b""):  # pickle's error, and EOFError
        truncated = _archive(tmp_path / "truncated.jit", cut)
        with pytest.raises(WhisperCliError, match=r"cannot read the tensors of .*truncated\.jit"):
            read_tensors(truncated, ("a",))
    missing = tmp_path / "missing.jit"
    with pytest.raises(WhisperCliError, match=r"cannot read the tensors of .*missing\.jit"):
        read_tensors(missing, ("x",))


def test_tensors_of_another_byte_order_are_refused(tmp_path: Path) -> None:
    other = "big" if sys.byteorder == "little" else "little"
    path = _archive(
        tmp_path / "other.jit", pickle.dumps({}, protocol=2), {"m/byteorder": other.encode()}
    )
    with pytest.raises(WhisperCliError, match=rf"other\.jit holds {other}-endian tensors"):
        read_tensors(path, ("x",))
