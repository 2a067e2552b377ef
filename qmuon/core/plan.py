"""What one Muon step works on: matrices and fused parts, planned once per set of parameters.

A Muon parameter is updated as one or more *matrices*: the whole parameter (trailing dims
flattened into columns), or, for a fused layout such as q, k and v stacked along one dim, each
part on its own (its own norm, its own Newton-Schulz, its own learning-rate adjustment). Which
matrices a parameter holds does not change between steps, so the plan is computed when a driver
first sees a parameter list (and again only if that list, a shape or a group's layout changes),
not validated again every step.

Orientation. ``torch.nn.Linear`` stores a layer as ``(out, in)``; some layers store it as
``(in, out)`` (Hugging Face ``Conv1D``: GPT-2). Muon's update is defined on the layer's
``(out, in)`` matrix: the learning-rate adjustment reads its shape, and Newton-Schulz runs on it.
Everything else (momentum and its quantized storage, sharding, communication, the update's
application) stays in the *stored* layout: momentum is elementwise, and a ``Shard(0)`` shard of
an ``(in, out)`` weight holds stored rows (input features) of every part. A :class:`MatrixPart`
therefore names a block of the stored matrix (rows ``[r0, r1)``, columns ``[c0, c1)``) plus
``transposed`` (the layer's matrix is the block's transpose); fused parts split either stored dim
(``FusedParts.axis``; GPT-2's ``c_attn`` holds q, k and v along dim 1, its columns).

Banks. A parameter whose leading ``bank_dims`` dims index matrices (a mixture-of-experts layer
stores its experts as one ``(E, out, in)`` tensor) is a *bank*: every member is its own matrix
(its own norm, Newton-Schulz and lr adjustment), and fused parts and orientation apply to each
member (gate and up of one expert are two matrices). The stored 2-D view stays
``(shape[0], prod(shape[1:]))``: one stored row per expert (for ``bank_dims=1``), so momentum
blocks never span two experts and ``Shard(0)`` puts whole experts on a rank. A member's part is a
:class:`BankBlock`: member ``index``, rows and columns of its ``(rows, cols)`` stored matrix, with a
step for interleaved parts (gpt-oss stores gate and up as alternating columns).

The learning-rate adjustment of ``torch.optim.Muon`` is linear in ``lr`` for both of its modes,
so the plan keeps only the factor (:attr:`MatrixPart.lr_scale`); the group's current ``lr`` (which
schedulers change every step) is multiplied in at apply time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

__all__ = [
    "ORIENTATIONS",
    "adjusted_lr",
    "FusedParts",
    "MatrixPart",
    "ParamPlan",
    "plan_param",
    "true_shape",
]

#: ``adjust_lr_fn`` values: ``None`` / ``"original"`` (KellerJordan's ``sqrt(max(1, rows / cols))``)
#: and ``"match_rms_adamw"`` (Moonlight's ``0.2 sqrt(max(rows, cols))``, which lets Muon reuse
#: AdamW's learning rate and weight decay).
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")

#: How a 2-D weight stores its layer: ``"out_in"`` (``nn.Linear``, the default) or ``"in_out"``
#: (Hugging Face ``Conv1D``: ``y = x @ W``).
ORIENTATIONS = ("out_in", "in_out")


def lr_scale(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """The factor ``torch.optim.Muon`` multiplies ``lr`` by for a ``rows x cols`` update
    (``rows x cols``: the layer's ``(out, in)`` shape)."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """``torch.optim.Muon``'s learning-rate adjustment for an ``rows x cols`` (out, in) update."""
    return lr * lr_scale(adjust_lr_fn, rows, cols)


def part_slices(n: int, parts: Sequence[int] | None, interleaved: bool = False) -> list[tuple[int, int, int]]:
    """``(start, stop, step)`` of each part of a dim of length ``n``: consecutive blocks, or, when
    ``interleaved``, part ``k`` of ``m`` equal parts takes indices ``k, k + m, k + 2m, ...``."""
    if not interleaved or not parts:
        return [(a, b, 1) for a, b in part_bounds(n, parts)]
    m = len(parts)
    if len(set(parts)) != 1 or m * int(parts[0]) != n:
        raise ValueError(f"interleaved parts must be equal and cover the dim: {list(parts)} over {n}")
    return [(k, n, m) for k in range(m)]


def part_bounds(rows: int, parts: Sequence[int] | None) -> list[tuple[int, int]]:
    """Index ranges ``[a, b)`` of the parts of a dim of length ``rows`` (one range when ``parts``
    is None)."""
    bounds = [0]
    for n in parts or (rows,):
        bounds.append(bounds[-1] + int(n))
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True)
class FusedParts:
    """Several layers stored in one parameter: sizes ``(n0, n1, ...)`` along stored dim ``axis``
    (0: rows, for example ``nn.MultiheadAttention.in_proj_weight``; 1: columns of a 2-D weight,
    for example GPT-2's ``Conv1D`` ``c_attn``, whose q, k and v are its column blocks).

    ``interleaved``: the parts alternate along the axis (equal sizes; part ``k`` of ``m`` holds
    indices ``k, k + m, ...``), as gpt-oss's expert ``gate_up_proj`` stores gate and up columns.

    Accepted spellings (:meth:`parse`): ``(n0, n1, ...)`` (axis 0), ``{"sizes": [...], "axis": 1}``
    (what a YAML config can say; optionally ``"interleaved": true``) or a ``FusedParts``.
    """

    sizes: tuple[int, ...]
    axis: int = 0
    interleaved: bool = False

    def __post_init__(self) -> None:
        try:
            sizes = tuple(int(n) for n in self.sizes)
        except (TypeError, ValueError):
            raise ValueError(f"fused parts: sizes must be a sequence of positive ints, got {self.sizes!r}") from None
        if not sizes or min(sizes) <= 0:
            raise ValueError(f"fused parts: sizes must be positive ints, got {self.sizes!r}")
        if self.axis not in (0, 1) or isinstance(self.axis, bool):
            raise ValueError(f"fused parts: axis must be 0 (stored rows) or 1 (stored columns of a 2-D weight), "
                             f"got {self.axis!r}")
        object.__setattr__(self, "sizes", sizes)
        if not isinstance(self.interleaved, bool):
            raise ValueError(f"fused parts: interleaved must be a bool, got {self.interleaved!r}")
        if self.interleaved and len(set(sizes)) != 1:
            raise ValueError(f"fused parts: interleaved parts must have equal sizes, got {list(sizes)}")

    @classmethod
    def parse(cls, spec: Any) -> "FusedParts":
        """A :class:`FusedParts` from any accepted spelling; a bad one raises naming the forms."""
        if isinstance(spec, FusedParts):
            return spec
        if isinstance(spec, Mapping):
            unknown = set(spec) - {"sizes", "axis", "interleaved"}
            if unknown or "sizes" not in spec:
                raise ValueError(f"fused parts {dict(spec)!r}: expected {{'sizes': [n0, n1, ...], 'axis': 0 or 1, "
                                 "'interleaved': false}}")
            return cls(tuple(spec["sizes"]), int(spec.get("axis", 0)), bool(spec.get("interleaved", False)))
        if isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence):
            raise ValueError(f"fused parts {spec!r}: expected (n0, n1, ...) (dim 0), "
                             "{'sizes': [n0, n1, ...], 'axis': 0 or 1} or a FusedParts")
        return cls(tuple(spec), 0)


@dataclass(frozen=True)
class BankBlock:
    """A part of one member of a bank: member ``index`` (flat over the bank dims), whose stored
    matrix is ``shape = (rows, cols)``; the part is its rows ``range(r0, r1, row_step)`` and
    columns ``range(c0, c1, col_step)``. ``per_row``: members per stored row of the parameter
    (the product of the bank dims after the first; 1 for an ``(E, out, in)`` bank)."""

    index: int
    shape: tuple[int, int]
    per_row: int
    r0: int
    r1: int
    c0: int
    c1: int
    row_step: int = 1
    col_step: int = 1

    @property
    def rows(self) -> int:
        return len(range(self.r0, self.r1, self.row_step))

    @property
    def cols(self) -> int:
        return len(range(self.c0, self.c1, self.col_step))

    @property
    def whole(self) -> bool:
        """The part is the whole member."""
        return self.rows == self.shape[0] and self.cols == self.shape[1]

    def view(self, t: Tensor, first_row: int = 0) -> Tensor:
        """The part in ``t`` (the parameter, or its gradient / NS input as ``(rows, cols)``; its
        stored rows start at global row ``first_row``): a view (``t`` must be contiguous, so the
        caller's in-place updates reach it)."""
        members = t.view(-1, *self.shape)
        return members[self.index - first_row * self.per_row,
                       self.r0: self.r1: self.row_step, self.c0: self.c1: self.col_step]


@dataclass(frozen=True)
class MatrixPart:
    """One matrix a Muon step orthogonalizes: rows ``[r0, r1)`` and columns ``[c0, c1)`` of the
    parameter's stored 2-D view (``c0 = 0, c1 = cols`` unless parts split the columns).

    ``transposed``: the layer's ``(out, in)`` matrix is this block's transpose (an ``(in, out)``
    weight); Newton-Schulz runs on it and ``lr_scale`` is that of its shape.
    ``whole_rows``: the block holds whole stored rows (its per-row-block sums of squares are
    the momentum kernel's).
    ``bank``: a part of one member of a bank (:class:`BankBlock`); ``[r0, r1)`` and ``[c0, c1)``
    are then the stored row of the member and its columns in that row (what sharding sees), and
    the matrix itself is ``bank``'s block.
    """

    r0: int
    r1: int
    c0: int
    c1: int
    lr_scale: float
    transposed: bool = False
    whole_rows: bool = True
    bank: BankBlock | None = None

    @property
    def rows(self) -> int:
        """Stored rows of the block."""
        return self.bank.rows if self.bank is not None else self.r1 - self.r0

    @property
    def cols(self) -> int:
        """Stored columns of the block."""
        return self.bank.cols if self.bank is not None else self.c1 - self.c0

    @property
    def logical_shape(self) -> tuple[int, int]:
        """The layer's ``(out, in)`` shape."""
        return (self.cols, self.rows) if self.transposed else (self.rows, self.cols)

    def block(self, t: Tensor, first_row: int = 0) -> Tensor:
        """The block of ``t`` (the parameter, its gradient or a buffer of its shape; any ndim when
        the block holds whole rows or is a bank part, else 2-D) whose stored rows start at global
        row ``first_row`` (a shard's rows): a view."""
        if self.bank is not None:
            return self.bank.view(t, first_row)
        r0, r1 = self.r0 - first_row, self.r1 - first_row
        if self.whole_rows:
            return t[r0: r1]
        return t[r0: r1, self.c0: self.c1]


@dataclass(frozen=True)
class ParamPlan:
    """How one Muon parameter is stepped.

    ``key``: the parameter's index over the optimizer's groups (it keys stochastic-rounding
    streams and GRASP's seeded start, so it must not depend on the sharding). ``rows`` / ``cols``:
    the *global* stored matrix (``cols`` = product of the trailing dims). ``orientation``: how it
    stores its layer (:data:`ORIENTATIONS`).
    """

    key: int
    rows: int
    cols: int
    parts: tuple[MatrixPart, ...]
    name: str
    orientation: str = "out_in"
    bank_dims: int = 0


def true_shape(p: Tensor) -> torch.Size:
    """The full shape of parameter ``p``: ``p.shape``, or, for a parameter DeepSpeed ZeRO-3 has
    partitioned (``deepspeed.zero.Init``, or ``deepspeed.initialize`` at stage 3), the shape DeepSpeed
    recorded in ``p.ds_shape``: such a parameter is an empty 1-D tensor on every rank between uses,
    so routing or planning by ``p.shape`` would send every matrix to AdamW, silently (DeepSpeed
    #8438, LlamaFactory #8041). Duck-typed: nothing here imports DeepSpeed."""
    ds = getattr(p, "ds_shape", None)
    return torch.Size(ds) if ds is not None else p.shape


def plan_param(p: Tensor | Sequence[int], group: dict[str, Any], key: int, name: str) -> ParamPlan:
    """The :class:`ParamPlan` of parameter ``p`` (or a shape) of a Muon ``group`` (validated by the
    group: ``parts``, ``parts_axis``, ``parts_interleaved``, ``orientation``, ``bank_dims``)."""
    shape = tuple(int(s) for s in (p.shape if isinstance(p, Tensor) else p))
    rows = shape[0]
    cols = math.prod(shape[1:])
    fn = group["adjust_lr_fn"]
    orientation = group.get("orientation") or "out_in"
    transposed = orientation == "in_out"
    axis = int(group.get("parts_axis") or 0)
    bank_dims = int(group.get("bank_dims") or 0)
    if bank_dims:
        parts = _bank_parts(shape, bank_dims, group["parts"], axis, bool(group.get("parts_interleaved")),
                            transposed, fn, name)
        return ParamPlan(key=key, rows=rows, cols=cols, parts=parts, name=name, orientation=orientation,
                         bank_dims=bank_dims)
    if group.get("parts_interleaved") and group["parts"]:
        raise ValueError(f"{name}: interleaved parts are supported on bank members (bank_dims >= 1); "
                         "declare the parameter as a bank or use consecutive parts")
    parts = []
    if axis == 0:
        bounds = [(r0, r1, 0, cols) for r0, r1 in part_bounds(rows, group["parts"])]
    else:
        bounds = [(0, rows, c0, c1) for c0, c1 in part_bounds(cols, group["parts"])]
    for r0, r1, c0, c1 in bounds:
        logical = (c1 - c0, r1 - r0) if transposed else (r1 - r0, c1 - c0)
        parts.append(MatrixPart(r0, r1, c0, c1, lr_scale(fn, *logical), transposed, c1 - c0 == cols))
    return ParamPlan(key=key, rows=rows, cols=cols, parts=tuple(parts), name=name, orientation=orientation)


def _bank_parts(shape: tuple[int, ...], bank_dims: int, sizes: Sequence[int] | None, axis: int, interleaved: bool,
                transposed: bool, fn: str | None, name: str) -> tuple[MatrixPart, ...]:
    """The parts of every member of a bank of shape ``(*bank, rows, cols)``: member by member,
    each member's fused parts in order (so same-shape parts of one bank sit next to each other
    in the NS queue)."""
    if len(shape) != bank_dims + 2:
        raise ValueError(f"{name}: a bank with bank_dims={bank_dims} has shape (*bank, rows, cols) "
                         f"({bank_dims + 2} dims), got {shape}")
    m_rows, m_cols = shape[bank_dims], shape[bank_dims + 1]
    members = math.prod(shape[:bank_dims])
    per_row = members // shape[0]
    size = m_rows * m_cols
    try:
        slices = part_slices(m_rows if axis == 0 else m_cols, sizes, interleaved)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    out = []
    for e in range(members):
        row, slot = divmod(e, per_row)  # stored row of the member, its place in that row
        for a, b, step in slices:
            if axis == 0:
                blk = BankBlock(e, (m_rows, m_cols), per_row, a, b, 0, m_cols, row_step=step)
            else:
                blk = BankBlock(e, (m_rows, m_cols), per_row, 0, m_rows, a, b, col_step=step)
            logical = (blk.cols, blk.rows) if transposed else (blk.rows, blk.cols)
            out.append(MatrixPart(row, row + 1, slot * size, (slot + 1) * size, lr_scale(fn, *logical), transposed,
                                  False, blk))
    return tuple(out)
