"""Reading checkpoints without running code from them.

A ``torch.save`` file is a pickle, and unpickling can call any function it names, so a checkpoint
from elsewhere could run code. Everything qmuon and the Lightning kit read goes through here:

* :func:`load`: ``torch.load(weights_only=True)``, which rebuilds tensors, plain containers,
  numbers and strings and the types registered with ``torch.serialization.add_safe_globals``,
  and refuses anything else with :class:`UnsafeCheckpointError` naming what it met;
* :func:`read_dcp_metadata`: ``torch.distributed.checkpoint``'s ``.metadata`` file, a plain pickle
  that torch's own reader unpickles unrestricted; here only DCP's metadata dataclasses, torch's
  sizes, dtypes and layouts and paths are rebuilt;
* :func:`dcp_reader` / :func:`dcp_planner`: a ``FileSystemReader`` reading the metadata that way and
  a ``DefaultLoadPlanner`` that checks each non-tensor entry with ``weights_only=True`` before
  torch's own ``load_bytes`` (which uses ``weights_only=False``) rebuilds it. Pass both to
  ``dcp.load``.

QMuon's own state (``optimizer.state_dict()``) holds tensors, numbers, strings, tuples and dicts
only, so it needs no registration.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import io
import pathlib
import pickle
import re
from typing import IO, Any

import torch

__all__ = ["UnsafeCheckpointError", "dcp_planner", "dcp_reader", "load", "read_dcp_metadata"]

_FIX = ("qmuon reads checkpoints with torch.load(weights_only=True), which never runs code from the file. If you "
        "wrote this file yourself and trust it, register the type before loading: "
        "torch.serialization.add_safe_globals([TheClass]); otherwise do not load it")


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint holds a pickled object that safe loading does not rebuild (it was refused, not run)."""


def load(source: str | pathlib.Path | IO[bytes], *, what: str | None = None, **kwargs: Any) -> Any:
    """``torch.load(source, weights_only=True, **kwargs)``; a file that needs more raises
    :class:`UnsafeCheckpointError` saying which global it names and what to do."""
    if kwargs.pop("weights_only", True) is not True:
        raise ValueError("qmuon.distributed.safe_load.load loads with weights_only=True only")
    try:
        return torch.load(source, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        name = what or (str(source) if isinstance(source, (str, pathlib.Path)) else "the checkpoint")
        text = str(err)
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text) or re.search(r"GLOBAL (\S+)", text)
        lines = text.strip().splitlines()
        detail = f"it names {found.group(1)}" if found else (lines[0] if lines else type(err).__name__)
        raise UnsafeCheckpointError(f"refused to load {name}: it holds a pickled object that safe loading does not "
                                    f"rebuild ({detail}). {_FIX}") from None


# ------------------------------------------------------------------------- DCP's .metadata pickle
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")
_PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}
_BUILTINS = {"set": set, "frozenset": frozenset, "slice": slice, "complex": complex}


def _allowed(module: str, name: str) -> Any:
    """The object ``module.name`` if DCP metadata may name it, else None."""
    if module in _DCP_MODULES:
        obj = getattr(__import__(module, fromlist=[name]), name, None)
        # dataclasses (their __init__ only stores fields) and enums; no function of those modules
        if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return obj
        return None
    if module == "torch":
        obj = getattr(torch, name, None)
        if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
        return None
    if module == "torch.serialization" and name == "_get_layout":
        return torch.serialization._get_layout  # name -> torch.layout, nothing else
    if module == "pathlib" and name in _PATHS:
        return getattr(pathlib, name)
    if module == "collections" and name == "OrderedDict":
        return collections.OrderedDict
    if module == "builtins":
        return _BUILTINS.get(name)
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], what: str) -> None:
        super().__init__(file)
        self.what = what

    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed(module, name)
        if obj is None:
            raise UnsafeCheckpointError(
                f"refused to load {self.what}: it names {module}.{name}, which is not part of "
                f"torch.distributed.checkpoint's metadata (only DCP's metadata classes, torch sizes, dtypes and "
                f"layouts, and paths are rebuilt); the file was not written by torch.distributed.checkpoint.save or "
                f"was altered. Do not load it")
        return obj


def read_dcp_metadata(path: str | pathlib.Path) -> Any:
    """The ``Metadata`` of the DCP checkpoint directory ``path`` (its ``.metadata`` file), rebuilt
    from an allow-list; any other global raises :class:`UnsafeCheckpointError` before it is called."""
    return _read_metadata_file(pathlib.Path(path) / ".metadata")


def _read_metadata_file(meta: str | pathlib.Path) -> Any:
    with open(meta, "rb") as fh:
        return _MetadataUnpickler(fh, str(meta)).load()


_classes: dict[str, type] = {}


def _dcp_classes() -> dict[str, type]:
    # Built on first use: torch.distributed.checkpoint is a heavy import `import qmuon` does not pay.
    if not _classes:
        from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
        from torch.distributed.checkpoint.metadata import StorageMeta

        class SafeFileSystemReader(FileSystemReader):
            """``FileSystemReader`` whose metadata is unpickled by :func:`read_dcp_metadata`."""

            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                # FileSystemReader.read_metadata with the allow-list unpickler instead of pickle.load
                metadata = _read_metadata_file(self._get_metadata_path(kwargs.get("rank")))
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                return metadata

        class SafeLoadPlanner(DefaultLoadPlanner):
            """``DefaultLoadPlanner`` that loads each non-tensor entry with ``weights_only=True`` first."""

            def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
                load(value, what=f"the entry {read_item.dest_index.fqn!r} of a torch.distributed.checkpoint")
                value.seek(0)  # it holds only what weights_only allows: torch's load rebuilds the same objects
                super().load_bytes(read_item, value)

        _classes.update(reader=SafeFileSystemReader, planner=SafeLoadPlanner)
    return _classes


def dcp_reader(path: str | pathlib.Path) -> Any:
    """A ``torch.distributed.checkpoint.FileSystemReader`` of ``path`` that reads its metadata safely."""
    return _dcp_classes()["reader"](path)


def dcp_planner(**kwargs: Any) -> Any:
    """A ``DefaultLoadPlanner(**kwargs)`` that refuses non-tensor entries ``weights_only`` loading refuses."""
    return _dcp_classes()["planner"](**kwargs)
