"""Row bookkeeping for dim-0 sharded (FSDP2 ``Shard(0)``) parameters: moved to
:mod:`qmuon_lightning.quant.layout` (driven by each format's per-key placement). This module
re-exports it for existing callers and keeps the old call forms of :func:`shard_state`
(``grid_block=``), :func:`localize_loaded_state` (``(st, p, where)``) and :func:`state_kind`."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..quant.layout import (
    RowLayout,
    check_sharded_param,
    chunk_ranges,
    global_row_offset,
    is_sharded,
    local,
    local_state,
    placement_of,
    process_group_of,
    row_layout,
)
from ..quant.layout import localize_loaded_state as _localize
from ..quant.layout import shard_state as _shard_state
from ..quant.registry import FORMATS, SUPPORTED_SHARDED_FORMATS, format_options
from ..quant.formats.base import FormatOptions, StateFormat

__all__ = [
    "SUPPORTED_SHARDED_FORMATS",
    "RowLayout",
    "check_sharded_param",
    "chunk_ranges",
    "global_row_offset",
    "is_sharded",
    "local",
    "local_state",
    "localize_loaded_state",
    "process_group_of",
    "row_layout",
    "shard_state",
    "state_kind",
]


def state_kind(st: dict[str, Any], key: str) -> str:
    """How state tensor ``key`` of ``st`` splits over row shards (its format's placement)."""
    from ..quant.layout import _resolve

    return placement_of(_resolve(None, st), key, st[key])


def shard_state(p: Any, st: dict[str, Tensor], fmt: StateFormat | str | None = None,
                opts: FormatOptions | None = None, *, grid_block: int | None = None) -> None:
    """:func:`qmuon_lightning.quant.layout.shard_state`; ``grid_block=`` (the old form) gives the
    options of the tile tensors."""
    if opts is None and grid_block is not None:
        opts = format_options({"grid_block": grid_block})
    _shard_state(p, st, fmt, opts)


def localize_loaded_state(st: dict[str, Any], p: Any, *args: Any, where: str | None = None) -> dict[str, Any]:
    """:func:`qmuon_lightning.quant.layout.localize_loaded_state`; also takes the old form
    ``(st, p, where)``."""
    if len(args) == 1 and isinstance(args[0], str) and args[0] not in FORMATS and where is None:
        return _localize(st, p, None, None, args[0])
    return _localize(st, p, *args, **({} if where is None else {"where": where}))
