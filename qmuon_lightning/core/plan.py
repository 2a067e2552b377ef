"""What one Muon step works on: matrices and fused parts, planned once per set of parameters.

A Muon parameter is updated as one or more *matrices*: the whole parameter (trailing dims
flattened into columns), or, for a fused layout such as q, k and v stacked along dim 0, each part
on its own (its own norm, its own Newton-Schulz, its own learning-rate adjustment). Which
matrices a parameter holds does not change between steps, so the plan is computed when a driver
first sees a parameter list (and again only if that list, a shape or a group's layout changes),
not validated again every step.

The learning-rate adjustment of ``torch.optim.Muon`` is linear in ``lr`` for both of its modes,
so the plan keeps only the factor (:attr:`MatrixPart.lr_scale`); the group's current ``lr`` (which
schedulers change every step) is multiplied in at apply time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from torch import Tensor

__all__ = ["ADJUST_LR_FNS", "adjusted_lr", "lr_scale", "MatrixPart", "ParamPlan", "plan_param", "part_bounds"]

#: ``adjust_lr_fn`` values: ``None`` / ``"original"`` (KellerJordan's ``sqrt(max(1, rows / cols))``)
#: and ``"match_rms_adamw"`` (Moonlight's ``0.2 sqrt(max(rows, cols))``, which lets Muon reuse
#: AdamW's learning rate and weight decay).
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def lr_scale(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """The factor ``torch.optim.Muon`` multiplies ``lr`` by for a ``rows x cols`` update."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """``torch.optim.Muon``'s learning-rate adjustment for an ``rows x cols`` update."""
    return lr * lr_scale(adjust_lr_fn, rows, cols)


def part_bounds(rows: int, parts: Sequence[int] | None) -> list[tuple[int, int]]:
    """Row ranges ``[r0, r1)`` of the matrices of a parameter with ``rows`` rows."""
    bounds = [0]
    for n in parts or (rows,):
        bounds.append(bounds[-1] + int(n))
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True)
class MatrixPart:
    """One matrix a Muon step orthogonalizes: global rows ``[r0, r1)`` of a parameter."""

    r0: int
    r1: int
    cols: int
    lr_scale: float

    @property
    def rows(self) -> int:
        return self.r1 - self.r0


@dataclass(frozen=True)
class ParamPlan:
    """How one Muon parameter is stepped.

    ``key``: the parameter's index over the optimizer's groups (it keys stochastic-rounding
    streams and GRASP's seeded start, so it must not depend on the sharding). ``rows`` / ``cols``:
    the *global* matrix (``cols`` = product of the trailing dims).
    """

    key: int
    rows: int
    cols: int
    parts: tuple[MatrixPart, ...]
    name: str


def plan_param(p: Tensor, group: dict[str, Any], key: int, name: str) -> ParamPlan:
    """The :class:`ParamPlan` of parameter ``p`` of a Muon ``group`` (validated by the group)."""
    rows = int(p.shape[0])
    cols = math.prod(int(s) for s in p.shape[1:])
    fn = group["adjust_lr_fn"]
    parts = tuple(MatrixPart(r0, r1, cols, lr_scale(fn, r1 - r0, cols)) for r0, r1 in part_bounds(rows, group["parts"]))
    return ParamPlan(key=key, rows=rows, cols=cols, parts=parts, name=name)
