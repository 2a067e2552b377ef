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

The learning-rate adjustment of ``torch.optim.Muon`` is linear in ``lr`` for both of its modes,
so the plan keeps only the factor (:attr:`MatrixPart.lr_scale`); the group's current ``lr`` (which
schedulers change every step) is multiplied in at apply time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from torch import Tensor

__all__ = [
    "ADJUST_LR_FNS",
    "ORIENTATIONS",
    "adjusted_lr",
    "lr_scale",
    "FusedParts",
    "MatrixPart",
    "ParamPlan",
    "plan_param",
    "part_bounds",
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

    Accepted spellings (:meth:`parse`): ``(n0, n1, ...)`` (axis 0), ``{"sizes": [...], "axis": 1}``
    (what a YAML config can say) or a ``FusedParts``.
    """

    sizes: tuple[int, ...]
    axis: int = 0

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

    @classmethod
    def parse(cls, spec: Any) -> "FusedParts":
        """A :class:`FusedParts` from any accepted spelling; a bad one raises naming the forms."""
        if isinstance(spec, FusedParts):
            return spec
        if isinstance(spec, Mapping):
            unknown = set(spec) - {"sizes", "axis"}
            if unknown or "sizes" not in spec:
                raise ValueError(f"fused parts {dict(spec)!r}: expected {{'sizes': [n0, n1, ...], 'axis': 0 or 1}}")
            return cls(tuple(spec["sizes"]), int(spec.get("axis", 0)))
        if isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence):
            raise ValueError(f"fused parts {spec!r}: expected (n0, n1, ...) (dim 0), "
                             "{'sizes': [n0, n1, ...], 'axis': 0 or 1} or a FusedParts")
        return cls(tuple(spec), 0)


@dataclass(frozen=True)
class MatrixPart:
    """One matrix a Muon step orthogonalizes: rows ``[r0, r1)`` and columns ``[c0, c1)`` of the
    parameter's stored 2-D view (``c0 = 0, c1 = cols`` unless parts split the columns).

    ``transposed``: the layer's ``(out, in)`` matrix is this block's transpose (an ``(in, out)``
    weight); Newton-Schulz runs on it and ``lr_scale`` is that of its shape.
    ``whole_rows``: the block holds whole stored rows (its per-row-block sums of squares are
    the momentum kernel's).
    """

    r0: int
    r1: int
    c0: int
    c1: int
    lr_scale: float
    transposed: bool = False
    whole_rows: bool = True

    @property
    def rows(self) -> int:
        """Stored rows of the block."""
        return self.r1 - self.r0

    @property
    def cols(self) -> int:
        """Stored columns of the block."""
        return self.c1 - self.c0

    @property
    def logical_shape(self) -> tuple[int, int]:
        """The layer's ``(out, in)`` shape."""
        return (self.cols, self.rows) if self.transposed else (self.rows, self.cols)

    def block(self, t: Tensor) -> Tensor:
        """The block of ``t`` (the parameter, its gradient or a buffer of its shape; any ndim when
        the block holds whole rows, else 2-D): a view."""
        if self.whole_rows:
            return t[self.r0: self.r1]
        return t[self.r0: self.r1, self.c0: self.c1]


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


def plan_param(p: Tensor, group: dict[str, Any], key: int, name: str) -> ParamPlan:
    """The :class:`ParamPlan` of parameter ``p`` of a Muon ``group`` (validated by the group:
    ``parts``, ``parts_axis``, ``orientation``)."""
    rows = int(p.shape[0])
    cols = math.prod(int(s) for s in p.shape[1:])
    fn = group["adjust_lr_fn"]
    orientation = group.get("orientation") or "out_in"
    transposed = orientation == "in_out"
    axis = int(group.get("parts_axis") or 0)
    parts = []
    if axis == 0:
        bounds = [(r0, r1, 0, cols) for r0, r1 in part_bounds(rows, group["parts"])]
    else:
        bounds = [(0, rows, c0, c1) for c0, c1 in part_bounds(cols, group["parts"])]
    for r0, r1, c0, c1 in bounds:
        logical = (c1 - c0, r1 - r0) if transposed else (r1 - r0, c1 - c0)
        parts.append(MatrixPart(r0, r1, c0, c1, lr_scale(fn, *logical), transposed, c1 - c0 == cols))
    return ParamPlan(key=key, rows=rows, cols=cols, parts=tuple(parts), name=name, orientation=orientation)
