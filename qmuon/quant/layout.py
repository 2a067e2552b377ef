"""Row bookkeeping for dim-0 sharded (FSDP2 ``Shard(0)``) parameters and their momentum state.

FSDP2 (``fully_shard``) turns every parameter into a :class:`~torch.distributed.tensor.DTensor`
with placement ``Shard(0)`` on a 1-D device mesh. Rows are split like :func:`torch.chunk`:
``chunk = ceil(rows / N)``, rank ``r`` owns rows ``[min(r chunk, rows), min((r + 1) chunk, rows))``,
so trailing ranks may own fewer rows or none (3 rows on 2 ranks: 2 + 1; 1 row: 1 + 0).

The state of a shard is created from the *local* rows and each tensor is stored as the format's
:meth:`~qmuon.quant.StateFormat.placement` says:

* ``"rows"``: a ``Shard(0)`` DTensor with the parameter's mesh and the *global* row count;
* ``"tiles"``: a ``Shard(0)`` DTensor over the ``ceil(rows / tile_rows)`` row tiles;
* ``"replicate"``: a ``Replicate()`` DTensor (the whole tensor on every rank, saved once);
* ``"scalar"``: a plain 0-d tensor, identical on every rank.

``torch.distributed.checkpoint`` then saves each rank's rows under one key and reshards them on load
(2 -> 1 or 1 -> 2 ranks) without requantizing. (Per-rank plain tensors saved under one key are
deduplicated by DCP and all but one rank's copy is silently lost; that is why only 0-d tensors that
are identical on every rank stay plain.)

HSDP: on a 2-D ``(replicate, shard)`` mesh a parameter is ``(Replicate(), Shard(0))``: the rows
are split over the shard dim as above and every replica holds the same rows. Row ranges, ranks and
process groups here are those of the shard dim (:func:`shard_mesh_dim`); the state is stored with
the parameter's placements (replicated over the replicate dim), so DCP saves one copy of each row.

Tensor parallelism (a ``(dp, tp)`` mesh, FSDP2 over ``parallelize_module``): a colwise parameter is
``(_StridedShard(0), Shard(0))`` (each rank holds one contiguous row range), a rowwise one
``(Shard(0), Shard(1))`` (a row range times a column range). Its state keeps the parameter's own
placements (:func:`state_placements`); a column-split state tensor's trailing dim is split like the
columns (its blocks never straddle two column shards: ``qmuon.distributed.tensor_parallel``
checks that before any state exists). The piece geometry of the exchange lives there.

``torch.distributed`` is imported lazily: builds without it can import this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .formats.base import STEP, FormatOptions, Placement, StateFormat

__all__ = [
    "RowLayout",
    "chunk_ranges",
    "check_sharded_param",
    "global_row_offset",
    "localize_loaded_state",
    "row_placements",
    "shard_mesh_dim",
    "row_layout",
    "shard_state",
    "column_split",
    "is_tensor_parallel",
]


def _dtensor_cls() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (a parameter or gradient managed by FSDP2 / DTensor)."""
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (a view sharing its storage), or ``t`` itself."""
    return t.to_local() if is_sharded(t) else t


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
    ``ranges[r]``: rank ``r``'s global rows ``[start, stop)``; ``rank``: this process's mesh rank;
    ``shape``: the parameter's global shape (``(rows, cols)`` when not given).
    """

    rows: int
    cols: int
    ranges: tuple[tuple[int, int], ...]
    rank: int
    shape: tuple[int, ...] | None = None

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

    @property
    def global_shape(self) -> tuple[int, ...]:
        return tuple(self.shape) if self.shape is not None else (self.rows, self.cols)

    def overlap(self, r: int, r0: int, r1: int) -> tuple[int, int]:
        """Global rows of ``[r0, r1)`` that rank ``r`` holds (empty range -> ``(x, x)``)."""
        a, b = self.ranges[r]
        lo, hi = max(a, r0), min(b, r1)
        return (lo, max(lo, hi))

    # Column API shared with the tensor-parallel piece layout: a row shard holds every column.
    col_start = 0

    @property
    def local_cols(self) -> int:
        return self.cols

    def col_overlap(self, r: int, c0: int, c1: int) -> tuple[int, int]:
        """Global columns of ``[c0, c1)`` that rank ``r`` holds: all of them."""
        return (c0, c1)

    def sends(self, r: int) -> bool:
        """Whether rank ``r`` sends its rows to an owner (every row shard holds its rows alone)."""
        return True


def shard_mesh_dim(p: Any) -> int:
    """The mesh dim over which ``p`` (a DTensor) is ``Shard(0)``: its one ``Shard(0)`` placement, the
    others ``Replicate()`` (FSDP2: ``(Shard(0),)``; HSDP: ``(Replicate(), Shard(0))``)."""
    check_sharded_param(p)
    return next(i for i, pl in enumerate(p.placements) if not pl.is_replicate())


#: What sharded QMuon accepts, for error messages.
SUPPORTED_PLACEMENTS = (
    "FSDP2 fully_shard on a 1-D mesh (Shard(0),); HSDP on a (replicate, shard) mesh (Replicate(), Shard(0)); "
    "data parallel x tensor parallel on a 2-D (dp, tp) mesh (parallelize_module with ColwiseParallel / "
    "RowwiseParallel, then fully_shard on the dp dim): colwise (_StridedShard(0) or Shard(0), Shard(0)), rowwise "
    "(Shard(0), Shard(1)), and parameters outside the TP plan on the dp sub-mesh (Shard(0),)")


def is_row_sharded(p: Any) -> bool:
    """Whether DTensor ``p`` is ``Shard(0)`` over exactly one mesh dim, ``Replicate()`` elsewhere
    (FSDP2 / HSDP)."""
    from torch.distributed.tensor import Replicate, Shard

    shards = [pl for pl in p.placements if not isinstance(pl, Replicate)]
    return len(shards) == 1 and type(shards[0]) is Shard and shards[0].dim == 0


def is_tensor_parallel(p: Any) -> bool:
    """Whether DTensor ``p`` is a tensor-parallel parameter on a 2-D mesh: a placement splits dim 0
    over both mesh dims (colwise under FSDP: ``(_StridedShard(0), Shard(0))``), or one mesh dim
    splits dim 1 (rowwise: ``(Shard(0), Shard(1))``). Other dims are ``Replicate()``."""
    from torch.distributed.tensor import Replicate, Shard

    if p.device_mesh.ndim != 2 or p.ndim != 2 or is_row_sharded(p):
        return False
    from torch.distributed.tensor.placement_types import _StridedShard

    dims = []
    for pl in p.placements:
        if isinstance(pl, Replicate):
            continue
        if not isinstance(pl, (Shard, _StridedShard)):  # (not a Shard subclass in torch 2.13)
            return False
        dims.append(pl.dim)
    return dims in ([0, 0], [0, 1], [1], [1, 0])


def column_split(p: Any) -> int:
    """How many column shards a tensor-parallel DTensor ``p`` has (1: rows only)."""
    from torch.distributed.tensor import Shard

    n = 1
    for i, pl in enumerate(p.placements):
        if isinstance(pl, Shard) and pl.dim == 1:
            n *= p.device_mesh.size(i)
    return n


def local_offset(p: Any) -> tuple[int, ...]:
    """Global index of the first element of ``p``'s local shard, per dim (DTensor's own geometry)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(int(o) for o in compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1])


def check_sharded_param(p: Any, where: str = "parameter", tensor_parallel: bool = False) -> None:
    """Raise a clear error for DTensor layouts the sharded optimizer does not handle
    (``tensor_parallel``: also accept the tensor-parallel layouts of :func:`is_tensor_parallel`)."""
    mesh = p.device_mesh
    if is_row_sharded(p) or (tensor_parallel and is_tensor_parallel(p)):
        return
    raise NotImplementedError(
        f"QMuon: {where} is a DTensor of shape {tuple(p.shape)} with placements {tuple(p.placements)} on a "
        f"{mesh.ndim}-D mesh {tuple(mesh.mesh_dim_names or ())}; sharded QMuon supports {SUPPORTED_PLACEMENTS}. "
        "Other layouts (sequence-parallel norms, Shard(1) without FSDP, 3-D meshes, expert banks under TP) are not "
        "supported: keep such parameters out of the TP plan, or give them to an AdamW group only if their "
        "placements are one of the above"
    )


def row_layout(p: Any, where: str = "a Shard(0) parameter") -> RowLayout:
    """The :class:`RowLayout` of a ``Shard(0)`` DTensor (checked against its local shard;
    ``where`` names it in errors; tensor-parallel layouts:
    ``qmuon.distributed.tensor_parallel.piece_layout``)."""
    check_sharded_param(p, where)
    rows = int(p.shape[0])
    cols = math.prod(int(s) for s in p.shape[1:])
    mesh = p.device_mesh
    dim = shard_mesh_dim(p)
    world = mesh.size(dim)
    rank = mesh.get_local_rank(dim)
    ranges = chunk_ranges(rows, world)
    n_local = int(p.to_local().shape[0])
    if ranges[rank][1] - ranges[rank][0] != n_local:
        raise RuntimeError(
            f"QMuon: {where} of shape {tuple(p.shape)} (placements {tuple(p.placements)}) has {n_local} local rows "
            f"on mesh rank {rank}, "
            f"but torch.chunk-style sharding gives {ranges[rank]}; only even (torch.chunk) Shard(0) layouts are supported"
        )
    return RowLayout(rows, cols, ranges, rank, tuple(int(s) for s in p.shape))


def global_row_offset(p: Tensor) -> int:
    """Global index of the first local row: 0 for plain tensors, the shard's start for DTensors
    (stochastic-rounding noise is keyed by the global element index, so a shard draws the same
    noise as the unsharded matrix)."""
    if not is_sharded(p):
        return 0
    if is_tensor_parallel(p):
        return local_offset(p)[0]
    return row_layout(p).start


def state_placements(p: Any) -> list[Any]:
    """Placements of a ``"rows"`` state tensor of ``p``: :func:`row_placements`, or a
    tensor-parallel parameter's own placements (state tensors split rows, and columns, like it)."""
    return list(p.placements) if is_tensor_parallel(p) else row_placements(p)


def row_placements(p: Any) -> list[Any]:
    """Placements of a state tensor split like ``p``'s rows: ``Shard(0)`` on its shard dim,
    ``Replicate()`` elsewhere."""
    from torch.distributed.tensor import Replicate, Shard

    dim = shard_mesh_dim(p)
    return [Shard(0) if i == dim else Replicate() for i in range(p.device_mesh.ndim)]


def _resolve(fmt: StateFormat | str | None, st: dict[str, Any] | None = None) -> StateFormat | None:
    """A format object from an object, a registered name, or (``None``) detected from ``st``;
    ``None`` when ``st`` holds no momentum (e.g. AdamW state: every tensor then splits by rows)."""
    if isinstance(fmt, StateFormat):
        return fmt
    from .registry import detect_state_format, get_format
    from .formats.base import StateFormatError

    if fmt is not None:
        return get_format(fmt)
    if st is None:
        return None
    try:
        return get_format(detect_state_format(st))
    except StateFormatError:
        return None


def placement_of(fmt: StateFormat | None, key: str, value: Any) -> Placement:
    """How state tensor ``key`` of ``fmt`` splits over row shards; 0-d tensors and tensors of
    states without a format (``fmt=None``: AdamW's) follow their shape (``"scalar"`` / ``"rows"``)."""
    if isinstance(value, Tensor) and value.ndim == 0:
        return "scalar"
    if fmt is None:
        return "scalar" if key == STEP else "rows"
    return fmt.placement(key)


def _global_trailing(t: Tensor, like: Any) -> tuple[int, ...]:
    """The global trailing dims of a ``"rows"`` state tensor ``t`` of ``like``: its own, or, for a
    column-split (rowwise TP) parameter, dim 1 times the column shards (even splits: checked by
    the tensor-parallel layout before state exists)."""
    n = column_split(like) if is_tensor_parallel(like) else 1
    if n == 1 or t.ndim < 2:
        return tuple(t.shape[1:])
    if int(like.shape[1]) % n:
        raise ValueError(f"QMuon: a rowwise tensor-parallel parameter of shape {tuple(like.shape)} has {like.shape[1]} "
                         f"columns, not divisible by its {n} column shards; its state could not be saved as one tensor")
    return (int(t.shape[1]) * n, *t.shape[2:])


def _wrap_rows(t: Tensor, like: Any, global_rows: int) -> Any:
    from torch.distributed.tensor import DTensor

    shape = (global_rows, *_global_trailing(t, like))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(t, like.device_mesh, state_placements(like), run_check=False, shape=torch.Size(shape),
                              stride=stride)


def shard_state(p: Any, st: dict[str, Tensor], fmt: StateFormat | str | None = None,
                opts: FormatOptions | None = None) -> None:
    """Wrap the local state tensors of the ``Shard(0)`` parameter ``p`` as DTensors, in place, as
    ``fmt``'s :meth:`~qmuon.quant.StateFormat.placement` says (module docstring).

    ``fmt``: the state's format (object or name; ``None``: detected from ``st``, and states without
    momentum tensors, AdamW's, split every ``ndim >= 1`` tensor by rows). ``opts``: the group's
    :class:`FormatOptions`, needed for ``"tiles"`` tensors."""
    from torch.distributed.tensor import DTensor, Replicate

    f = _resolve(fmt, st)
    rows = int(p.shape[0])
    for k, v in list(st.items()):
        if not isinstance(v, Tensor) or isinstance(v, DTensor):
            continue
        kind = placement_of(f, k, v)
        if kind == "scalar":
            continue
        if kind == "replicate":
            st[k] = DTensor.from_local(v, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
        elif kind == "tiles":
            if is_tensor_parallel(p):
                raise NotImplementedError(f"QMuon: {f.name} keeps row-tile state tensors ({k}), which tensor-parallel "
                                          "parameters do not support; use a row-local state format (int8, int4, fp32)")
            if opts is None:
                raise TypeError(f"shard_state: {f.name} state has row-tile tensors ({k}); pass the group's "
                                "FormatOptions (qmuon.quant.format_options(group))")
            st[k] = _wrap_rows(v, p, -(-rows // f.tile_rows(opts)))
        else:
            st[k] = _wrap_rows(v, p, rows)


def localize_loaded_state(st: dict[str, Any], p: Any, fmt: StateFormat | str | None = None,
                          opts: FormatOptions | None = None, where: str = "state") -> dict[str, Any]:
    """This rank's part of a loaded state entry for the sharded parameter ``p``.

    ``fmt``: the format *of the loaded state* (``None``: detected from ``st``; states without
    momentum tensors split by rows). DTensor entries (what ``torch.distributed.checkpoint`` /
    ``set_optimizer_state_dict`` hand over) are redistributed to ``p``'s ``Shard(0)`` layout if
    needed and their local shard taken; plain tensors are taken to be full (consolidated) tensors
    and sliced: ``"rows"`` to this rank's rows, ``"tiles"`` to its row tiles (``torch.chunk`` of the
    tiles, which equals the tiles of its rows when shards start on tile boundaries: the format's
    ``check_sharded_layout``), ``"replicate"`` and ``"scalar"`` kept whole. Non-tensors pass through.
    ``opts`` is accepted for symmetry with :func:`shard_state` (slicing needs no options).
    """
    from torch.distributed.tensor import DTensor

    f = _resolve(fmt, st)
    if is_tensor_parallel(p):
        return _localize_tensor_parallel(st, p, f, where)
    lay = row_layout(p)
    out: dict[str, Any] = {}
    for k, v in st.items():
        if not isinstance(v, Tensor):
            out[k] = v
            continue
        kind = placement_of(f, k, v)
        if kind in ("replicate", "scalar"):
            out[k] = v.full_tensor() if isinstance(v, DTensor) else v
            continue
        n = int(v.shape[0])
        if kind == "rows" and n != lay.rows:
            raise ValueError(
                f"{where}: {k} has {n} rows but the parameter has {lay.rows}; the checkpoint belongs "
                "to a different model or parameter order")
        if isinstance(v, DTensor):
            want = row_placements(p)
            if v.device_mesh == p.device_mesh and list(v.placements) == want:
                out[k] = v.to_local()
                continue
            if v.device_mesh == p.device_mesh:
                out[k] = v.redistribute(p.device_mesh, want).to_local()
                continue
            v = v.full_tensor()
        a, b = chunk_ranges(n, lay.world)[lay.rank]
        out[k] = v[a:b]
    return out


def _localize_tensor_parallel(st: dict[str, Any], p: Any, f: StateFormat | None, where: str) -> dict[str, Any]:
    """:func:`localize_loaded_state` of a tensor-parallel parameter: DTensor entries in ``p``'s
    placements are taken as they are; others are gathered whole and this rank's rows (and, for a
    column-split parameter, its ``torch.chunk`` share of dim 1) sliced out."""
    from torch.distributed.tensor import DTensor, Shard

    r0 = local_offset(p)[0]
    n_local = int(p.to_local().shape[0])
    col_dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard) and pl.dim == 1]
    coord = p.device_mesh.get_coordinate()
    out: dict[str, Any] = {}
    for k, v in st.items():
        if not isinstance(v, Tensor):
            out[k] = v
            continue
        kind = placement_of(f, k, v)
        if kind in ("replicate", "scalar"):
            out[k] = v.full_tensor() if isinstance(v, DTensor) else v
            continue
        if kind != "rows":
            raise NotImplementedError(f"{where}: {k} is a row-tile tensor; tensor-parallel parameters need a "
                                      "row-local state format")
        if int(v.shape[0]) != int(p.shape[0]):
            raise ValueError(f"{where}: {k} has {int(v.shape[0])} rows but the parameter has {int(p.shape[0])}; the "
                             "checkpoint belongs to a different model or parameter order")
        if isinstance(v, DTensor):
            if v.device_mesh == p.device_mesh and list(v.placements) == list(p.placements):
                out[k] = v.to_local()
                continue
            v = v.full_tensor()
        piece = v[r0: r0 + n_local]
        if col_dims and piece.ndim >= 2:
            (d,) = col_dims  # is_tensor_parallel: at most one mesh dim splits columns
            split = p.device_mesh.size(d)
            if int(piece.shape[1]) % split:  # blocks wider than a shard: they cannot be cut by columns
                raise ValueError(
                    f"{where}: {k} has {int(piece.shape[1])} columns of blocks, which do not split over the {split} "
                    f"rowwise tensor-parallel shards of this parameter ({int(p.shape[1]) // split} of {int(p.shape[1])}"
                    " columns each): the checkpoint's momentum blocks straddle them. Load it where it was saved, "
                    "move the parameter to blocks that fit a shard there (QMuon.promote_param(p, {'state_format': "
                    "..., 'block_size': b}), b dividing the shard width) and save again")
            a, b = chunk_ranges(int(piece.shape[1]), split)[coord[d]]
            piece = piece[:, a:b]
        out[k] = piece
    return out
