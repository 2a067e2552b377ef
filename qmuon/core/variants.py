"""Muon variants that act on the orthogonalized update: NorMuon and cautious weight decay.

Both are pure functions here; :mod:`.pipeline` calls them for every driver (one process, the
sharded owner, DeepSpeed, the fidelity monitor), so the maths exists once.

**NorMuon** (Li et al., "NorMuon: Making Muon more efficient and scalable", arXiv:2510.05491).
After Newton-Schulz, the update ``O`` (the layer's ``(out, in)`` matrix) gets a per-neuron (per
output row) second moment ``v_r <- beta2 v_r + (1 - beta2) mean_c O_rc^2``; each row is divided by
``sqrt(v_r) + eps`` and the whole matrix is then rescaled so its Frobenius norm is that of ``O``
(the step length Muon's learning-rate adjustment sets is unchanged; only its distribution over
rows changes). This follows microsoft/dion ``dion/normuon.py`` (``_normuon_normalization_core``:
``muon_beta2=0.95``, ``v`` starts at 0 without bias correction, ``denom = sqrt(v) + 1e-8``,
``normalized * ||O|| / max(||normalized||, 1e-8)``, always per row of the ``(out, in)`` matrix).
modded-nanogpt's ``train_gpt.py`` (``beta2=0.95``) computes the same rescale analytically,
``||O / d||^2 = cols * sum_r mean_c(O_rc^2) / d_r^2``, which is what :func:`normuon_scale` does (no
second full-size temporary); it reduces along the longer side of a wide matrix instead (columns),
which this library does not follow (the issue defines neurons as output rows, as dion does). The
result is rounded once to the NS dtype, as modded-nanogpt returns ``g * scale.to(g.dtype)``: with
bf16 Newton-Schulz a bf16 carrier of the result is exact, so sharded NorMuon equals
single-process NorMuon bit for bit.

**Cautious weight decay** (Chen et al., arXiv:2510.12402; dion ``dion/muon.py``
``muon_update_post_orthogonalize(cautious_wd=True)``; modded-nanogpt ``mask = (g * p) >= 0``):
decay only the coordinates where the weight and the update that is subtracted from it agree in sign
(``p * u >= 0``: the step already moves the weight toward zero), so decay never fights the update.
"""

from __future__ import annotations

from dataclasses import dataclass


import torch
from torch import Tensor

from .plan import MatrixPart, ParamPlan

__all__ = [
    "NORMUON_STATE",
    "RowMoment",
    "row_moment_shape",
    "row_moment_nbytes",
    "part_row_moment",
    "check_row_moment",
]

#: ``variant`` values: plain Muon, or NorMuon (per-neuron second moment after Newton-Schulz).
VARIANTS = ("muon", "normuon")
#: dion's ``muon_beta2`` default and modded-nanogpt's ``beta2``.
NORMUON_BETA2 = 0.95
#: dion's ``denom = sqrt(v) + 1e-8`` and its ``clamp(min=1e-8)`` of the rescaled norm.
NORMUON_EPS = 1e-8
#: Optimizer-state key of NorMuon's second moment (fp32, beside the quantized momentum).
NORMUON_STATE = "normuon_v"


@dataclass(frozen=True)
class RowMoment:
    """NorMuon's second moment of one matrix: ``v`` holds one fp32 value per row of the layer's
    ``(out, in)`` matrix (a view into the parameter's state, updated in place)."""

    v: Tensor
    beta2: float = NORMUON_BETA2
    eps: float = NORMUON_EPS
    #: The parameter's 0-d device skip flag (True: ``v`` is left as it is), or None.
    skip: Tensor | None = None


def normuon_scale(out: Tensor, moment: RowMoment) -> Tensor:
    """NorMuon's rescaling of one orthogonalized update; updates ``moment.v`` in place.

    Args:
        out: the NS output ``O`` as the layer's ``(out, in)`` matrix (any float dtype, any strides).
        moment: the rows' second moment (``v``: ``(out,)`` fp32).

    Returns ``O_r / (sqrt(v_r) + eps) * ||O||_F / max(||O / (sqrt(v) + eps)||_F, eps)`` in
    ``out``'s dtype (computed in ``v``'s dtype, fp32 in the optimizer, and rounded once).
    """
    u = out.to(moment.v.dtype)
    cols = u.shape[1]
    mean_sq = u.square().mean(dim=1)
    norm = (mean_sq.sum() * cols).sqrt()
    if moment.skip is None:
        moment.v.lerp_(mean_sq, 1.0 - moment.beta2)
    else:  # a skipped step leaves v bit-identical (selected on the device)
        moment.v.copy_(torch.where(moment.skip, moment.v, moment.v.lerp(mean_sq, 1.0 - moment.beta2)))
    inv = (moment.v.sqrt() + moment.eps).reciprocal()
    norm_new = (mean_sq.mul(inv.square()).sum() * cols).sqrt().clamp_min(moment.eps)
    scale = inv * (norm / norm_new)
    return (u * scale[:, None]).to(out.dtype)


def _ranges(plan: ParamPlan) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    rows = sorted({(p.r0, p.r1) for p in plan.parts})
    cols = sorted({(p.c0, p.c1) for p in plan.parts})
    return rows, cols


def _bank_neuron_offsets(plan: ParamPlan) -> tuple[dict[tuple[int, ...], int], int]:
    """A bank's NorMuon slots: for each part of a member (keyed by its place in the member:
    ``BankBlock`` rows / columns and steps), the offset of its neurons in the member's slice, and
    the member's neuron count ``K`` (its parts' logical output rows, part after part)."""
    per_member: dict[tuple[int, ...], int] = {}
    k = 0
    first = plan.parts[0].bank
    assert first is not None
    for part in plan.parts:
        b = part.bank
        assert b is not None
        if b.index != first.index:
            break
        per_member[(b.r0, b.r1, b.row_step, b.c0, b.c1, b.col_step)] = k
        k += part.logical_shape[0]
    return per_member, k


def row_moment_shape(plan: ParamPlan) -> tuple[int, int]:
    """Shape of a parameter's NorMuon state: ``(rows, n column parts)`` when the stored rows are
    the layer's output rows (``out_in``), ``(n row parts, cols)`` when the stored columns are
    (``in_out``). Either way every part's neurons are one slice of it, and an ``out_in`` state
    splits by stored rows like the momentum (``Shard(0)``).

    A bank (``plan.bank_dims``): ``(rows, members per stored row * K)``, ``K`` the neurons of one
    member (the logical output rows of its parts, gate's then up's, in either orientation). A
    member's second moment sits in the stored row that holds the member, so it always splits with
    the experts (``Shard(0)``): each rank keeps its own experts' NorMuon state."""
    if plan.bank_dims:
        first = plan.parts[0].bank
        assert first is not None
        return (plan.rows, first.per_row * _bank_neuron_offsets(plan)[1])
    rows, cols = _ranges(plan)
    if plan.parts[0].transposed:
        return (len(rows), plan.cols)
    return (plan.rows, len(cols))


def row_moment_nbytes(shape: tuple[int, ...], parts: tuple[int, ...] | None = None, parts_axis: int = 0,
                      orientation: str = "out_in") -> int:
    """Bytes of a parameter's NorMuon state (fp32, :func:`row_moment_shape`) from its routing: its
    shape, fused ``parts`` along stored dim ``parts_axis``, and ``orientation`` (the accounting of
    ``qmuon-estimate`` and the recipes' memory budget; a parameter built on the meta device is enough)."""
    from .plan import plan_param

    group = {"adjust_lr_fn": None, "parts": list(parts) if parts else None, "parts_axis": parts_axis,
             "orientation": orientation}
    rows, k = row_moment_shape(plan_param(tuple(int(x) for x in shape), group, 0, "nbytes"))
    return rows * k * 4


def part_row_moment(v: Tensor, plan: ParamPlan, part: MatrixPart, row_offset: int = 0,
                    local_rows: tuple[int, int] | None = None) -> Tensor:
    """The slice of a parameter's NorMuon state ``v`` (:func:`row_moment_shape`) holding ``part``'s
    neurons: a 1-D view. ``row_offset``: global index of ``v``'s first row (a ``Shard(0)`` shard);
    ``local_rows``: the global stored rows ``[a, b)`` of the part this shard holds (default: all;
    a bank member is never split)."""
    if part.bank is not None:
        b = part.bank
        offsets, k = _bank_neuron_offsets(plan)
        at = (b.index % b.per_row) * k + offsets[(b.r0, b.r1, b.row_step, b.c0, b.c1, b.col_step)]
        return v[part.r0 - row_offset, at: at + part.logical_shape[0]]
    rows, cols = _ranges(plan)
    if part.transposed:
        return v[rows.index((part.r0, part.r1)), part.c0: part.c1]
    a, b = local_rows if local_rows is not None else (part.r0, part.r1)
    return v[a - row_offset: b - row_offset, cols.index((part.c0, part.c1))]


def check_row_moment(v: Tensor, plan: ParamPlan, local_rows: int, where: str) -> None:
    """Raise naming the problem when a loaded NorMuon state does not fit the parameter."""
    shape = row_moment_shape(plan)
    want = (local_rows, shape[1]) if plan.bank_dims or not plan.parts[0].transposed else shape
    if tuple(v.shape) != want or v.dtype != torch.float32:
        raise ValueError(f"{where}: {NORMUON_STATE} has shape {tuple(v.shape)} {v.dtype}, expected {want} float32 "
                         "(one value per output row of each matrix); the checkpoint belongs to another model or layout")

