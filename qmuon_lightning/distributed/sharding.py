"""Row bookkeeping for dim-0 sharded (FSDP2 ``Shard(0)``) parameters and their quantized state.

FSDP2 (``fully_shard``) turns every parameter into a :class:`~torch.distributed.tensor.DTensor`
with placement ``Shard(0)`` on a 1-D device mesh. Rows are split like :func:`torch.chunk`:
``chunk = ceil(rows / N)``, rank ``r`` owns rows ``[min(r chunk, rows), min((r + 1) chunk, rows))``,
so trailing ranks may own fewer rows or none (3 rows on 2 ranks: 2 + 1; 1 row: 1 + 0).

Every momentum tensor of the row-local state formats (``fp32``, ``bf16``, ``int8``, ``uint8``,
``int4``: :mod:`qmuon_lightning.quant.state`) has the parameter's rows along dim 0 and each row's
codes and scales depend on that row only. So the state of a shard is created from the *local*
rows, and stored as a DTensor with the parameter's mesh, ``Shard(0)`` and the *global* shape:
``torch.distributed.checkpoint`` then saves each rank's rows under one key and reshards them on
load (2 -> 1 or 1 -> 2 ranks) without requantizing. (Per-rank plain tensors saved under one key
are deduplicated by DCP and all but one rank's copy is silently lost.)

``grasp4`` is not row-local (a power iteration over the whole matrix, a replicated ``R`` factor,
column maxima per row *tile*); :mod:`.grasp_sharded` updates it with three small collectives, and its
tensors are stored as ``Shard(0)`` over rows, ``Shard(0)`` over row tiles (``grid_col_max``) or
``Replicate()`` (``R``): :func:`state_kind`. ``e0m3`` is row-local apart from its 0-d tensor scale
(a plain tensor, identical on every rank after a MAX all-reduce: :mod:`.e0m3_sharded`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..quant import grasp as _grasp

__all__ = [
    "SUPPORTED_SHARDED_FORMATS",
    "RowLayout",
    "is_sharded",
    "local",
    "row_layout",
    "global_row_offset",
    "check_sharded_param",
    "shard_state",
    "local_state",
    "localize_loaded_state",
    "process_group_of",
]

#: State formats QMuon can keep for ``Shard(0)`` parameters (the row-local ones, grasp4 and e0m3).
SUPPORTED_SHARDED_FORMATS = ("fp32", "bf16", "int8", "uint8", "int4", "grasp4", "e0m3")


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (a parameter or gradient managed by FSDP2 / DTensor)."""
    return isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (a view sharing its storage), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def chunk_ranges(rows: int, world: int) -> tuple[tuple[int, int], ...]:
    """Row range ``[start, stop)`` of every rank under ``Shard(0)`` (``torch.chunk`` semantics)."""
    chunk = -(-rows // world) if rows else 0
    out = []
    for r in range(world):
        start = min(r * chunk, rows)
        out.append((start, min(start + chunk, rows)))
    return tuple(out)


@dataclass(frozen=True)
class RowLayout:
    """Where the rows of one ``Shard(0)`` parameter live.

    ``rows`` / ``cols``: the global matrix (``cols`` = product of the trailing dims);
    ``ranges[r]``: rank ``r``'s global rows ``[start, stop)``; ``rank``: this process's mesh rank.
    """

    rows: int
    cols: int
    ranges: tuple[tuple[int, int], ...]
    rank: int

    @property
    def world(self) -> int:
        return len(self.ranges)

    @property
    def start(self) -> int:
        return self.ranges[self.rank][0]

    @property
    def local_rows(self) -> int:
        a, b = self.ranges[self.rank]
        return b - a

    def overlap(self, r: int, r0: int, r1: int) -> tuple[int, int]:
        """Global rows of ``[r0, r1)`` that rank ``r`` holds (empty range -> ``(x, x)``)."""
        a, b = self.ranges[r]
        lo, hi = max(a, r0), min(b, r1)
        return (lo, max(lo, hi))


def check_sharded_param(p: DTensor, where: str = "parameter") -> None:
    """Raise a clear error for DTensor layouts the sharded optimizer does not handle."""
    mesh = p.device_mesh
    if mesh.ndim != 1 or len(p.placements) != 1 or not isinstance(p.placements[0], Shard) or p.placements[0].dim != 0:
        raise NotImplementedError(
            f"QMuon: {where} is a DTensor with placements {tuple(p.placements)} on a {mesh.ndim}-D mesh; sharded QMuon "
            "supports a 1-D device mesh with Shard(0) (what FSDP2 fully_shard produces). For HSDP or tensor "
            "parallelism shard Muon parameters with fully_shard on a 1-D mesh, or use plain (replicated) parameters"
        )


def row_layout(p: DTensor) -> RowLayout:
    """The :class:`RowLayout` of a ``Shard(0)`` DTensor (checked against its local shard)."""
    check_sharded_param(p)
    rows = int(p.shape[0])
    cols = math.prod(int(s) for s in p.shape[1:])
    mesh = p.device_mesh
    world = mesh.size()
    rank = mesh.get_local_rank()
    ranges = chunk_ranges(rows, world)
    n_local = int(p.to_local().shape[0])
    if ranges[rank][1] - ranges[rank][0] != n_local:
        raise RuntimeError(
            f"QMuon: a Shard(0) parameter of shape {tuple(p.shape)} has {n_local} local rows on mesh rank {rank}, "
            f"but torch.chunk-style sharding gives {ranges[rank]}; only even (torch.chunk) Shard(0) layouts are supported"
        )
    return RowLayout(rows, cols, ranges, rank)


def global_row_offset(p: Tensor) -> int:
    """Global index of the first local row: 0 for plain tensors, the shard's start for DTensors
    (stochastic-rounding noise is keyed by the global element index, so a shard draws the same
    noise as the unsharded matrix)."""
    if not isinstance(p, DTensor):
        return 0
    return row_layout(p).start


def process_group_of(p: DTensor) -> dist.ProcessGroup:
    return p.device_mesh.get_group()


def state_kind(st: dict[str, Any], key: str) -> str:
    """How state tensor ``key`` (``ndim >= 1``) splits over row shards: ``"rows"`` (dim 0 = the
    parameter's rows), ``"tiles"`` (dim 0 = row tiles of ``grid_block`` rows: grasp4's
    ``grid_col_max``) or ``"replicate"`` (one per matrix: grasp4's ``R`` factor)."""
    if _grasp.P_CODES in st:
        if key in (_grasp.R_CODES, _grasp.R_ABSMAX):
            return "replicate"
        if key == _grasp.GRID_COL:
            return "tiles"
    return "rows"


def _wrap(t: Tensor, like: DTensor, global_rows: int) -> DTensor:
    shape = (global_rows, *t.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(t, like.device_mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)


def shard_state(p: DTensor, st: dict[str, Tensor], grid_block: int | None = None) -> None:
    """Wrap the local state tensors of ``p`` (dim 0 = local rows) as ``Shard(0)`` DTensors with
    the global row count, in place. 0-d tensors (``step``, grasp4's ``grid_scale``) stay plain: they
    are identical on every rank, which is what DCP's deduplication of plain tensors assumes.
    grasp4 state (``grid_block`` required): ``grid_col_max`` is ``Shard(0)`` over the
    ``ceil(rows / grid_block)`` row tiles, ``R`` a ``Replicate()`` DTensor (saved once)."""
    rows = int(p.shape[0])
    for k, v in list(st.items()):
        if isinstance(v, Tensor) and not isinstance(v, DTensor) and v.ndim >= 1:
            kind = state_kind(st, k)
            if kind == "replicate":
                st[k] = DTensor.from_local(v, p.device_mesh, [Replicate()], run_check=False)
            elif kind == "tiles":
                if grid_block is None:
                    raise TypeError("shard_state: grasp4 state needs grid_block (the group's grid_block option)")
                st[k] = _wrap(v, p, -(-rows // int(grid_block)))
            else:
                st[k] = _wrap(v, p, rows)


def local_state(st: dict[str, Tensor]) -> dict[str, Tensor]:
    """A dict of local views of a sharded state (in-place updates reach the DTensors' storage)."""
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in st.items()}


def localize_loaded_state(st: dict[str, Any], p: DTensor, where: str) -> dict[str, Any]:
    """Local rows of a loaded state entry for the sharded parameter ``p``.

    DTensor entries (what ``torch.distributed.checkpoint`` / ``set_optimizer_state_dict`` hand
    over) are redistributed to ``p``'s ``Shard(0)`` layout if needed and their local shard taken;
    plain tensors with ``ndim >= 1`` are taken to be full (consolidated) tensors and sliced to this
    rank's rows. 0-d tensors and non-tensors pass through.
    """
    lay = row_layout(p)
    out: dict[str, Any] = {}
    for k, v in st.items():
        kind = state_kind(st, k) if isinstance(v, Tensor) and v.ndim >= 1 else "plain"
        if kind == "replicate":  # grasp4's R: the whole tensor on every rank
            out[k] = v.full_tensor() if isinstance(v, DTensor) else v
            continue
        if kind == "plain":
            out[k] = v.full_tensor() if isinstance(v, DTensor) else v
            continue
        n = int(v.shape[0])
        if kind == "rows" and n != lay.rows:
            raise ValueError(
                f"{where}: {k} has {n} rows but the parameter has {lay.rows}; the checkpoint belongs "
                "to a different model or parameter order")
        # rows: this rank's rows; tiles: this rank's row tiles (torch.chunk of the n tiles, which equals
        # the tiles of its rows when shards start on tile boundaries, see grasp_sharded.check_grasp_layout)
        a, b = chunk_ranges(n, lay.world)[lay.rank]
        if isinstance(v, DTensor):
            if v.device_mesh == p.device_mesh and tuple(v.placements) == (Shard(0),):
                out[k] = v.to_local()
                continue
            if v.device_mesh == p.device_mesh:
                out[k] = v.redistribute(p.device_mesh, [Shard(0)]).to_local()
                continue
            v = v.full_tensor()
        out[k] = v[a:b]
    return out
