"""Tensors of a TorchScript archive, read without TorchScript.

A TorchScript archive is a zip: `<name>/data.pkl` pickles the module tree (objects of the
archive's own `__torch__.*` classes, their attributes in a dict), each tensor's bytes are
a member `<name>/data/<key>`, and `<name>/code/` holds the TorchScript source that
`torch.jit.load` compiles. Only the weights are wanted here (speech.py runs its own
module over them), so the pickle is read with an unpickler that knows the few globals a
module tree pickles and refuses any other, and the code is never compiled or run:
`torch.jit.load` of the Silero wheel's archive took 57-76 ms of every start, this reader
8-16 ms (Intel Xeon with AMX, first calls and medians of 10, alternating), and TorchScript
is deprecated from torch 2.13 on.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch

from whisper_cli.errors import WhisperCliError

# The storage classes a module tree pickles its tensors' storages as ("torch", name).
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


class _ScriptObject:
    """An object of one of the archive's TorchScript classes: its attributes, no code."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _as_list(items: Any) -> list:
    return list(items)


def _rebuild_tensor(
    stored: tuple[torch.UntypedStorage, torch.dtype],
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    *_grad_and_hooks: Any,
) -> torch.Tensor:
    """What the pickle's torch._utils._rebuild_tensor_v2 builds: a view of a storage."""
    storage, dtype = stored
    return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, root: str) -> None:
        super().__init__(io.BytesIO(data))
        self._archive = archive
        self._root = root

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("__torch__."):
            return _ScriptObject
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        # TorchScript's typed lists (build_intlist, build_tensorlist, ...): plain lists.
        if module == "torch.jit._pickle" and name.startswith("build_") and name.endswith("list"):
            return _as_list
        raise pickle.UnpicklingError(f"{module}.{name} is no part of a module's weights")

    def persistent_load(self, pid: Any) -> tuple[torch.UntypedStorage, torch.dtype]:
        kind, dtype, key, _location, _numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        raw = bytearray(self._archive.read(f"{self._root}/data/{key}"))
        # An empty member (a tensor of no elements) has no buffer to wrap.
        storage = (
            torch.frombuffer(raw, dtype=torch.uint8).untyped_storage()
            if raw
            else torch.UntypedStorage(0)
        )
        return storage, dtype


def read_tensors(path: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors at `names` (dotted attribute paths from the archive's top module, as its
    state_dict names them) of the TorchScript archive at `path`, on the CPU."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.count("/") == 1]
            roots = [n.removesuffix("/data.pkl") for n in pickles if n.endswith("/data.pkl")]
            if len(roots) != 1:
                raise WhisperCliError(f"{path} is not a TorchScript archive (no one data.pkl)")
            # The storages' bytes are used as they are: they must be in this machine's
            # order (torch records it; files without the record are little-endian).
            order = f"{roots[0]}/byteorder"
            stored = "little"
            if order in archive.namelist():
                stored = archive.read(order).decode().strip()
            if stored != sys.byteorder:
                raise WhisperCliError(
                    f"{path} holds {stored}-endian tensors; this machine is {sys.byteorder}-endian"
                )
            data = archive.read(f"{roots[0]}/data.pkl")
            top = _Unpickler(data, archive, roots[0]).load()
    except (
        OSError,
        zipfile.BadZipFile,
        KeyError,
        pickle.UnpicklingError,
        EOFError,
        TypeError,
        ValueError,
        RuntimeError,
    ) as exc:
        raise WhisperCliError(f"cannot read the tensors of {path}: {exc}") from exc
    tensors = {}
    for name in names:
        node = top
        for part in name.split("."):
            node = getattr(node, "__dict__", {}).get(part)
        if not isinstance(node, torch.Tensor):
            raise WhisperCliError(f"{path} holds no tensor {name}")
        tensors[name] = node
    return tensors
