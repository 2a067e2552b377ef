"""Data parallel x tensor parallel meshes: where the pieces of every matrix live.

Lightning's ``ModelParallelStrategy`` (and torchtitan) build a 2-D ``(dp, tp)`` mesh, apply the
user's ``parallelize_module`` plan on the ``tp`` dim, then FSDP2 ``fully_shard`` on the ``dp`` dim.
Measured on torch 2.13 (4 gloo ranks, 2 x 2):

* colwise (``ColwiseParallel``: ``Shard(0)`` on tp) becomes ``(_StridedShard(0, sf=tp), Shard(0))``:
  FSDP splits the rows of each TP shard, so rank ``(d, t)`` holds one contiguous row range (tp
  chunk ``t``, then its dp chunk ``d``), every column;
* rowwise (``RowwiseParallel``: ``Shard(1)`` on tp) becomes ``(Shard(0), Shard(1))``: rank ``(d, t)``
  holds a rectangle, dp row chunk ``d`` times tp column chunk ``t``;
* parameters outside the plan (embeddings, norms, often the head) are ``(Shard(0),)`` on the dp
  sub-mesh, the same rows on every tp rank (their gradients are equal: TP makes the activations
  replicated there).

:func:`piece_layout` turns each into a :class:`PieceLayout` over the *flattened* mesh (rank
``v = d * tp + t``): the rows and columns every rank holds (from DTensor's own
``_compute_local_shape_and_global_offset``, checked to tile the matrix exactly) and which rank
sends each distinct piece (the lowest of the ranks holding the same piece; all of them get the
result back). The exchange of :mod:`.orthogonalize` then runs over the flattened group as on a
1-D mesh of ``dp * tp`` ranks: every matrix is assembled whole on one owner (owners dealt over all
ranks by NS cost), orthogonalized once, and each rank gets its rectangle of the result back.

Column-split pieces keep bit-exactness with single-process QMuon when the momentum's row blocks
never straddle two column shards (each rank's first column a multiple of ``block_size``): the
local momentum update then makes the same blocks, and the owner lays the per-block sums of squares
out as single-process QMuon has them (:func:`check_tensor_parallel_param`).

Narrower rowwise shards (``hidden / tp < block_size``, or not a multiple of it):

* formats without blocks (``fp32``, ``bf16``) take any width. Only the sums of squares behind
  ``1 / ||G||`` are blocked; the owner gives each column piece its own columns of them
  (``ShardItem.sums_layout``), so the norm equals single-process QMuon's up to the order of
  the fp32 additions;
* blocked formats (``int8``, ``uint8``, ``int4``) keep that parameter's momentum in blocks of the
  largest multiple of 32 that divides the shard width and is at most ``block_size``
  (:func:`fit_blocks_to_shards`, logged once). It is recorded as the parameter's layout override
  (the group's ``format_overrides``, as :meth:`QMuon.promote_param` records one), so the saved
  state is an ordinary ``block_size=b`` state of the whole matrix: a checkpoint reshards onto a 1-D
  mesh, another ``(dp, tp)`` shape with the same width, or one process, bit for bit, and the
  override goes with it. Cutting each 256-block at the shard edge instead would give a global
  block grid that no other layout has, so such a checkpoint could only resume on the same ``tp``.
  Cost: ``4 / b`` instead of ``4 / block_size`` bytes of absmax per element (int8, 128 for 256:
  1.031 instead of 1.016 bytes per element), the same extra share of the fp32 block sums on the
  forward trip, and absmax scales over half as many elements, so the rounding error per element
  is no larger than with ``block_size``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..core.config import FORMAT_OVERRIDES, param_group_view
from ..quant import state as qstate
from ..quant.layout import SUPPORTED_PLACEMENTS, check_sharded_param, chunk_ranges, column_split, \
    is_tensor_parallel

__all__: list[str] = []

log = logging.getLogger(__name__)

Rect = tuple[int, int, int, int]  # rows [r0, r1), columns [c0, c1)


@dataclass(frozen=True)
class PieceLayout:
    """Where the pieces of one sharded matrix live on a flattened mesh of ``world`` ranks.

    ``rects[v]``: rank ``v``'s global rows and columns ``(r0, r1, c0, c1)`` of the stored 2-D matrix
    (``rows x cols``); ``senders[v]``: whether rank ``v`` sends its piece (the lowest rank holding
    that piece; ranks holding a copy only receive); ``rank``: this process's flat rank."""

    rows: int
    cols: int
    rects: tuple[Rect, ...]
    senders: tuple[bool, ...]
    rank: int
    shape: tuple[int, ...]

    @property
    def world(self) -> int:
        return len(self.rects)

    @property
    def start(self) -> int:
        return self.rects[self.rank][0]

    @property
    def local_rows(self) -> int:
        r0, r1, _, _ = self.rects[self.rank]
        return r1 - r0

    @property
    def col_start(self) -> int:
        return self.rects[self.rank][2]

    @property
    def local_cols(self) -> int:
        _, _, c0, c1 = self.rects[self.rank]
        return c1 - c0

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.shape

    def overlap(self, r: int, r0: int, r1: int) -> tuple[int, int]:
        """Global rows of ``[r0, r1)`` that rank ``r`` holds (empty range -> ``(x, x)``)."""
        a, b, _, _ = self.rects[r]
        lo, hi = max(a, r0), min(b, r1)
        return (lo, max(lo, hi))

    def col_overlap(self, r: int, c0: int, c1: int) -> tuple[int, int]:
        """Global columns of ``[c0, c1)`` that rank ``r`` holds."""
        _, _, a, b = self.rects[r]
        lo, hi = max(a, c0), min(b, c1)
        return (lo, max(lo, hi))

    def sends(self, r: int) -> bool:
        return self.senders[r]


def _flat_coords(mesh: Any) -> list[tuple[int, ...]]:
    """Mesh coordinates of the flat ranks ``0 .. mesh.size() - 1`` (row-major)."""
    shape = tuple(mesh.shape)
    out = []
    for v in range(mesh.size()):
        c, rest = [], v
        for n in reversed(shape):
            c.append(rest % n)
            rest //= n
        out.append(tuple(reversed(c)))
    return out


def _sub_dim(root: Any, sub: Any) -> int:
    """The dim of the 2-D ``root`` mesh that the 1-D mesh ``sub`` (this rank's slice) runs along."""
    names, sub_names = root.mesh_dim_names, sub.mesh_dim_names
    if names and sub_names and sub_names[0] in names:
        return names.index(sub_names[0])
    ranks = sub.mesh.flatten().tolist()
    coord = root.get_coordinate()
    for d in range(root.ndim):
        idx = [slice(None) if i == d else coord[i] for i in range(root.ndim)]
        if root.mesh[tuple(idx)].flatten().tolist() == ranks:
            return d
    raise NotImplementedError(f"QMuon: a parameter's 1-D mesh {sub} is not a sub-mesh of the tensor-parallel mesh {root}")


def piece_layout(p: Any, root: Any) -> PieceLayout:
    """The :class:`PieceLayout` of DTensor ``p`` on the flattened 2-D mesh ``root``: ``p`` is on
    ``root`` (tensor-parallel or ``(Shard(0), Replicate())`` placements) or on a 1-D sub-mesh of it
    (``(Shard(0),)``)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    rows = int(p.shape[0])
    cols = 1
    for s in p.shape[1:]:
        cols *= int(s)
    coords = _flat_coords(root)
    rects: list[Rect] = []
    if p.device_mesh == root:
        for c in coords:
            shape, off = _compute_local_shape_and_global_offset(p.shape, root.shape, list(c), p.placements)
            if p.ndim == 2:
                rects.append((off[0], off[0] + shape[0], off[1], off[1] + shape[1]))
            else:  # only dim 0 split (checked): every trailing element
                rects.append((off[0], off[0] + shape[0], 0, cols))
    else:
        d = _sub_dim(root, p.device_mesh)
        ranges = chunk_ranges(rows, root.size(d))
        rects = [(*ranges[c[d]], 0, cols) for c in coords]
    _check_tiling(p, rects, rows, cols)
    seen: set[Rect] = set()
    senders = []
    for r in rects:
        senders.append(r not in seen)
        seen.add(r)
    me = root.get_rank()
    rank = root.mesh.flatten().tolist().index(me)
    return PieceLayout(rows, cols, tuple(rects), tuple(senders), rank, tuple(int(s) for s in p.shape))


def _check_tiling(p: Any, rects: list[Rect], rows: int, cols: int) -> None:
    """The distinct pieces cover the matrix exactly once (a strided layout whose local shard is not
    one rectangle would not)."""
    distinct = {r for r in rects if r[1] > r[0] and r[3] > r[2]}
    area = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in distinct)
    inside = all(0 <= r0 <= r1 <= rows and 0 <= c0 <= c1 <= cols for r0, r1, c0, c1 in distinct)
    overlap = any(a != b and a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]
                  for a in distinct for b in distinct)
    if area != rows * cols or not inside or overlap:
        raise NotImplementedError(
            f"QMuon: a parameter of shape {tuple(p.shape)} with placements {tuple(p.placements)}: its local shards are "
            f"not rectangles that tile the matrix ({sorted(distinct)}); sharded QMuon supports {SUPPORTED_PLACEMENTS}")


def uses_tensor_parallel(params: list[Any]) -> bool:
    """Whether the DTensor ``params`` need the flattened-mesh exchange: some parameter is
    tensor-parallel, or they sit on different meshes (a TP mesh and its dp sub-mesh)."""
    if any(is_tensor_parallel(p) for p in params):
        return True
    first = params[0].device_mesh
    return any(p.device_mesh.ndim == 2 for p in params) and any(p.device_mesh != first for p in params)


def check_tensor_parallel_param(p: Any, group: dict[str, Any], lay: PieceLayout, where: str) -> None:
    """Refuse, before any state exists, what a tensor-parallel piece layout cannot keep exact.

    ``group``: the group as ``p`` is stepped (``param_group_view``: with its layout override).
    Column-split pieces: the split must be even; a blocked momentum format needs row blocks that
    fit the shard (a ``block_size`` dividing its width; :func:`fit_blocks_to_shards` picks one
    before this check), AdamW's blocked moments likewise; the things keyed by a global element
    index over whole rows (stochastic rounding of the momentum or of bf16 weights, NorMuon's
    per-row second moment) are refused."""
    check_sharded_param(p, where, tensor_parallel=True)
    fix = "; or keep this layer out of the TP plan"
    if group["use_muon"]:
        fmt = qstate.get_format(group["state_format"])
        if not fmt.row_local or any(fmt.placement(k) == "tiles" for k in fmt.spec.keys):
            raise NotImplementedError(
                f"QMuon: {where}: state_format={fmt.name!r} keeps statistics over whole matrices or row tiles, which "
                f"a (dp, tp) mesh does not support yet (placements {tuple(p.placements)}); use a row-local format "
                f"(int8, int4, fp32, bf16) for this group")
        if p.ndim != 2:
            raise NotImplementedError(
                f"QMuon: {where}: expert banks and other >2-D Muon parameters on a (dp, tp) mesh are not supported "
                f"(shape {tuple(p.shape)}, placements {tuple(p.placements)}); use FSDP2 on a 1-D mesh or HSDP for them")
    split = column_split(p) if is_tensor_parallel(p) else 1
    if split == 1:
        return
    if lay.cols % split:
        raise NotImplementedError(f"QMuon: {where}: {lay.cols} columns do not split evenly over {split} rowwise tensor-"
                                  f"parallel shards (placements {tuple(p.placements)}){fix}")
    local_cols = lay.cols // split
    if group["use_muon"]:
        fmt = qstate.get_format(group["state_format"])
        bs = int(group["block_size"])
        if "block_size" in fmt.layout_options and local_cols % bs:
            raise NotImplementedError(
                f"QMuon: {where}: each rowwise tensor-parallel shard holds {local_cols} of {lay.cols} columns, not a "
                f"multiple of block_size={bs}, and no block size that is a multiple of 32 divides {local_cols}, so "
                f"{fmt.name} momentum blocks would straddle two shards. Use state_format='fp32' or 'bf16' (no blocks) "
                f"for this layer, or a tensor-parallel size that leaves a multiple of 32 columns per shard{fix}")
        if group.get("rounding") == "stochastic":
            raise NotImplementedError(f"QMuon: {where}: rounding='stochastic' keys its noise by the element's index "
                                      f"in whole rows; use rounding='nearest' for rowwise tensor-parallel layers{fix}")
        if group.get("variant", "muon") == "normuon":
            raise NotImplementedError(f"QMuon: {where}: variant='normuon' keeps one value per whole row; rowwise "
                                      f"tensor-parallel layers split rows, use variant='muon'{fix}")
    else:
        from ..quant import adamw as qadamw

        for f in qadamw.moment_formats(group["state_format"], p.shape):
            bs = f.default_block_size
            if "block_size" in f.layout_options and local_cols % bs:
                raise NotImplementedError(
                    f"QMuon: {where}: the AdamW moments ({f.name}, blocks of {bs}) of a rowwise tensor-parallel "
                    f"parameter holding {local_cols} columns per shard would straddle shards; use "
                    f"adamw_state_format='fp32' for it{fix}")
    if p.to_local().dtype.itemsize < 4 and group.get("bf16_update", "stochastic") == "stochastic":
        raise NotImplementedError(
            f"QMuon: {where}: bf16 weights with bf16_update='stochastic' key their rounding noise by the element's "
            f"index in whole rows; for rowwise tensor-parallel layers use bf16_update='ecc8' or 'nearest', or fp32 "
            f"master weights{fix}")


def shard_block_size(local_cols: int, block_size: int) -> int | None:
    """The largest multiple of 32 (the kernels' granularity) that divides ``local_cols`` and is at
    most ``block_size``; ``None`` when there is none (``local_cols`` not a multiple of 32)."""
    for b in range(min(block_size, local_cols) // 32 * 32, 0, -32):
        if local_cols % b == 0:
            return b
    return None


def fit_blocks_to_shards(p: Any, group: dict[str, Any], index: int, lay: PieceLayout, where: str) -> str | None:
    """Give Muon parameter ``index`` of ``group`` (``p``, rowwise tensor-parallel) momentum blocks
    that fit its column shards, when its blocked format's ``block_size`` does not divide the shard
    width: records ``block_size=b`` (:func:`shard_block_size`) as its layout override in the
    group, before any state exists (module docstring: why an override rather than cut blocks).
    Returns a line for the log, or None when nothing changed (no column split, no blocks, blocks
    that fit already, or no such ``b``: :func:`check_tensor_parallel_param` then refuses)."""
    if not group["use_muon"] or not is_tensor_parallel(p):
        return None
    split = column_split(p)
    if split == 1 or lay.cols % split:
        return None
    view = param_group_view(group, index)
    fmt = qstate.get_format(view["state_format"])
    bs, local_cols = int(view["block_size"]), lay.cols // split
    if "block_size" not in fmt.layout_options or local_cols % bs == 0:
        return None
    b = shard_block_size(local_cols, bs)
    if b is None:
        return None
    overrides = dict(group.get(FORMAT_OVERRIDES) or {})
    overrides[index] = {**overrides.get(index, {"state_format": fmt.name}), "block_size": b}
    group[FORMAT_OVERRIDES] = overrides
    return f"{where}: {fmt.name} momentum in blocks of {b} (rowwise shards of {local_cols} columns; block_size={bs})"


def log_fitted_blocks(lines: list[str]) -> None:
    """One log record for every parameter :func:`fit_blocks_to_shards` changed in a layout build."""
    if lines:
        log.warning("QMuon: tensor parallel: momentum blocks narrowed to fit the rowwise shards (saved with the "
                    "checkpoint as each parameter's layout override, so it reshards bit for bit):\n  %s",
                    "\n  ".join(lines))


class TensorParallelWorld:
    """The flattened ``(dp, tp)`` mesh the exchange runs over: its process group (all ranks of the
    mesh), size and this rank's flat index, and the :class:`PieceLayout` of each parameter."""

    def __init__(self, params: list[Any]) -> None:
        roots: list[Any] = []
        for p in params:  # equal meshes may be distinct objects (one per fully_shard call)
            if p.device_mesh.ndim == 2 and not any(p.device_mesh == m for m in roots):
                roots.append(p.device_mesh)
        if len(roots) != 1:
            raise NotImplementedError(
                f"QMuon: the sharded parameters are on {len(roots)} different 2-D meshes; tensor-parallel QMuon needs "
                "one (dp, tp) mesh (its sub-meshes allowed)")
        self.mesh = roots[0]
        self.world = self.mesh.size()
        ranks = self.mesh.mesh.flatten().tolist()
        self.rank = ranks.index(self.mesh.get_rank())
        self.group = _flat_group(self.mesh, ranks)

    def layout(self, p: Any) -> PieceLayout:
        return piece_layout(p, self.mesh)


_GROUPS: dict[tuple[int, ...], Any] = {}


def _flat_group(mesh: Any, ranks: list[int]) -> Any:
    """A process group over every rank of ``mesh`` (the default group when it is the world; one
    ``new_group`` per set of ranks otherwise, made once: collective on first use)."""
    if ranks != sorted(ranks):  # the flat index must be the rank in the group (new_group sorts)
        raise NotImplementedError(f"QMuon: the (dp, tp) mesh lists its ranks out of order ({ranks}); build it with "
                                  "init_device_mesh, whose ranks are in order")
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(ranks)
    return _GROUPS[key]
