"""Gram Newton-Schulz: the Newton-Schulz polynomial iterated on the small Gram matrix.

For a wide ``r x c`` iterate ``X`` (``r <= c``; a tall one is transposed), every Newton-Schulz step
``X <- (a I + b R + c R^2) X`` with ``R = X X^T`` is a polynomial in ``R`` applied on the left. So
the ``r x r`` matrices can be iterated alone: ``Z = b R + c R^2``, ``Q <- Q (a I + Z)`` (the
accumulated left factor) and ``R <- (a I + Z) R (a I + Z)``, and ``X`` is touched only once at the
end (``Q X``). A ``c / r``-aspect matrix then costs ``2 r^2 c`` (the first Gram matrix and the
final product) plus ``O(r^3)`` per iteration instead of ``~4 r^2 c + r^3`` per iteration.

Stability: ``R`` drifts from ``X X^T`` as rounding accumulates (its small eigenvalues can turn
negative), so the published versions *restart*: at the restart iterations ``X`` is formed
(``X <- Q X``) and ``R = X X^T`` recomputed. This follows Dao-AILab's ``gram-newton-schulz``
(``GramNewtonSchulz(gram_newton_schulz_reset_iterations=[2])``, the setting microsoft/dion's
``use_gram_newton_schulz`` uses, which iterates in fp16) and DeepSpeed PR #7953
(``ns_method="gram"``, ``_zeropower_via_gram_newtonschulz``: one restart). Here every matmul runs
in the NS dtype (bf16 or fp32) as standard NS does; the ``1 / ||G||`` scaling and the ``+ a I``
of the first factor are applied in fp32 (as :func:`~.newton_schulz.newton_schulz_folded` does).
The same coefficient schedules (``"muon"``, Polar Express, custom) apply.

Restarts by dtype (:func:`default_restarts`, measured on 4:1 / 1:4 / 4:1-small matrices, random,
rank-8, rank-1 + 1e-3 noise and singular values log-spaced down to 1e-6; relative Frobenius error
against fp32 standard NS): in **bf16** the restart is needed: without it ``R`` drifts until the
iteration diverges on low-rank inputs (largest singular value of the result 8-13 on rank-8
matrices, 1e5-8e6 on rank-1 + noise, non-finite with Polar Express), with it the largest stays
at 1.15-1.28 as standard NS's 1.13-1.20. In **fp32** no restart is needed (relative error
<= 6e-4 with none, <= 1e-4 with one; largest singular values equal to standard's), so fp32 runs
without it (25 instead of 30 ``r^3`` at 4:1: the restart's ``Q X`` and ``X X^T`` are the two
products with the long side).

The result is written in the input's orientation: for a tall input (``rows > cols``, iterated as
its transpose) the last product is ``G Q^T`` (``(B, rows, cols)``, contiguous), so the caller does
not have to copy a transposed view before adding it to the weights.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .newton_schulz import NSSchedule, resolve_schedule

__all__ = ["pick_ns_method", "newton_schulz_gram"]

#: ``ns_method`` values: ``"standard"`` (iterate on X), ``"gram"`` (iterate on X X^T, restart at
#: :data:`GRAM_RESTARTS`) and ``"auto"`` (gram where it measured faster: :data:`GRAM_AUTO_ASPECT`,
#: :data:`GRAM_AUTO_MIN_SIDE`).
NS_METHODS = ("standard", "gram", "auto")
#: Iterations at which ``X`` and ``R`` are recomputed in bf16 (Dao-AILab / dion default ``[2]``);
#: fp32 runs without restarts (see the module docstring, :func:`default_restarts`).
GRAM_RESTARTS: tuple[int, ...] = (2,)


def default_restarts(dtype: torch.dtype) -> tuple[int, ...]:
    """The restart iterations used in ``dtype``: :data:`GRAM_RESTARTS` in bf16 (and any dtype
    below fp32), none in fp32 or wider (measured stable without; module docstring)."""
    return () if dtype in (torch.float32, torch.float64) else GRAM_RESTARTS


#: ``ns_method="auto"`` picks gram on CPU for bf16 matrices at least this elongated (long side /
#: short side) whose short side is at least :data:`GRAM_AUTO_MIN_SIDE`. Measured on the 2-core AMX
#: Xeon, 1 thread, batches of 1 and 4, interleaved, thread CPU time, six runs
#: (benchmarks/results/gram_ns.md): at 4:1 / 1:4 bf16 gram is 1.14-1.40x faster with a short side
#: of 256 and 1.17-1.62x with 768; at 3:1 only 1.02-1.21x (not picked); square 0.67-0.80x. Not
#: measured on CUDA, so "auto" keeps the standard iteration there (gram stays opt-in on GPUs).
GRAM_AUTO_ASPECT = 4.0
#: The shortest short side "auto" picks gram for in bf16: at 4:1, 192 measured 1.06-1.10x (batch 1),
#: 1.21-1.34x (batch 4); 128 0.90-0.91x at batch 1; 64 and 32 0.78-0.95x (each of gram's ~20 small
#: products pays a fixed ~25 us per oneDNN call).
GRAM_AUTO_MIN_SIDE = 192
#: The same in fp32 (no restart there): gram measured 1.42-1.50x faster at 3:1 and 1.69-1.88x at
#: 4:1, 0.75-0.77x on square matrices.
GRAM_AUTO_ASPECT_FP32 = 3.0
#: The shortest short side "auto" picks gram for in fp32: 64 x 256 measured 1.34-1.61x, 32 x 128
#: 0.95x (batch 1), 16 x 64 0.81-0.90x.
GRAM_AUTO_MIN_SIDE_FP32 = 64


def pick_ns_method(method: str, rows: int, cols: int, device: str, dtype: torch.dtype = torch.bfloat16,
                   schedule: NSSchedule | None = None) -> str:
    """The iteration ``method`` (:data:`NS_METHODS`) resolves to for a ``rows x cols`` matrix on
    ``device`` (``"cpu"``, ``"cuda:0"``...) in the NS ``dtype`` with the coefficient ``schedule``.

    ``"auto"`` (the default ``ns_method``) picks gram only where it measured faster and as
    accurate: on CPU, elongated enough (:data:`GRAM_AUTO_ASPECT` ...), and in bf16 only with the
    ``"muon"`` coefficients (with Polar Express, bf16 gram's mean ``|sigma - 1|`` measured 3-6x
    standard's; ``schedule=None`` is treated as ``"muon"``)."""
    long, short = max(rows, cols), max(1, min(rows, cols))
    if method == "gram":
        # Square matrices gain nothing from the Gram form and lose accuracy (bf16, Polar Express:
        # 0.49 relative error at 128 x 128 vs 0.009 for standard); Dao-AILab's GramNewtonSchulz
        # also runs the standard iteration on them.
        return "gram" if long > short else "standard"
    if method == "auto":
        fp32 = dtype == torch.float32
        aspect = GRAM_AUTO_ASPECT_FP32 if fp32 else GRAM_AUTO_ASPECT
        min_side = GRAM_AUTO_MIN_SIDE_FP32 if fp32 else GRAM_AUTO_MIN_SIDE
        accurate = fp32 or schedule is None or _is_muon_schedule(schedule)
        cpu = device == "cpu" or device.startswith("cpu:")
        return "gram" if cpu and accurate and long >= aspect * short and short >= min_side else "standard"
    return method


def _is_muon_schedule(schedule: NSSchedule) -> bool:
    """Whether ``schedule`` repeats the ``"muon"`` preset's one (a, b, c) (any length)."""
    return set(schedule.coefficients) == set(resolve_schedule("muon", 1).coefficients) and schedule.norm_safety == 1.0


def _round_scaled(dst: Tensor, src: Tensor, factor: Tensor, buf: Tensor | None, a: float | None = None) -> None:
    """``dst = (src + a I) * factor`` per matrix (``factor``: ``(B, 1)`` fp32), computed in fp32 and
    rounded once into ``dst`` (``buf``: an fp32 scratch shaped like ``src``, or None when ``dst``
    is fp32 itself). The multiply runs on the fp32 scratch: an in-place bf16 x fp32 ``mul_``
    computes the same values but measured 5x slower (batch of 4, 256 x 256)."""
    work = dst if buf is None else buf
    if work is not src:
        work.copy_(src)
    if a is not None:
        work.diagonal(dim1=-2, dim2=-1).add_(a)
    work.flatten(1).mul_(factor)
    if work is not dst:
        dst.copy_(work)


def _plus_a_identity_into(dst: Tensor, src: Tensor, a: float) -> None:
    """``dst = src + a I``, the diagonal computed in fp32 and rounded once. (An in-place bf16
    ``add_`` of the scalar on the strided diagonal view rounds differently: measured on 370 of
    1024 diagonal entries, up to 0.03.)"""
    dst.copy_(src)
    d = dst.diagonal(dim1=-2, dim2=-1)
    d.copy_(src.diagonal(dim1=-2, dim2=-1).float() + a)


def newton_schulz_gram(
    g: Tensor,
    inv_norm: Tensor,
    schedule: NSSchedule | object,
    steps: int,
    dtype: torch.dtype = torch.bfloat16,
    restarts: Sequence[int] | None = None,
) -> Tensor:
    """Gram Newton-Schulz of a batch ``g`` ``(B, rows, cols)`` (never written); same contract as
    :func:`~.newton_schulz.newton_schulz_folded` (``inv_norm``: ``(B,)`` ``1 / max(||g||, eps)``,
    the schedule's ``norm_safety`` folded in; result ``(B, rows, cols)`` in ``dtype``, contiguous).
    ``restarts``: iterations at which ``X`` and ``R`` are recomputed (default
    :func:`default_restarts` of ``dtype``).

    Implementation (measured on CPU, docs/newton_schulz.md): every ``r x r`` product writes into
    one of five preallocated buffers (``out=``); ``b R + c R^2``, ``Q (a I + Z)`` and
    ``(a I + Z) R (a I + Z)`` are ``baddbmm`` with ``beta``/``alpha`` (no separate elementwise
    pass); the fp32 steps (``s^2`` on ``R``, ``(a I + Z) s`` for the first factor) reuse one fp32
    scratch. A tall input stays in its own layout (``X^T``, ``(B, cols, rows)``):
    the restart and the final product are ``X^T Q^T`` with a contiguous long operand, which
    measured 1.1-1.9x faster than ``Q X`` on the transposed view; only the Gram products read
    ``X^T`` transposed, as standard NS's first one does.
    """
    if restarts is None:
        restarts = default_restarts(dtype)
    if g.ndim != 3:
        raise ValueError(f"expected a (batch, rows, cols) tensor, got shape {tuple(g.shape)}")
    if not isinstance(schedule, NSSchedule):
        schedule = resolve_schedule(schedule, steps)
    x = g if g.dtype == dtype else g.to(dtype)
    # tall: x holds X^T (B, c, r), r <= c; X X^T = x^T x and Q X = (x Q^T)^T.
    tall = x.size(-2) > x.size(-1)
    s = inv_norm.to(torch.float32).reshape(-1, 1)
    if schedule.norm_safety != 1.0:
        s = s / schedule.norm_safety
    if steps == 0:
        return (x.float() * s.unsqueeze(-1)).to(dtype)

    def gram_of(x: Tensor, out: Tensor | None = None) -> Tensor:
        return torch.bmm(x.mT, x, out=out) if tall else torch.bmm(x, x.mT, out=out)

    def left(q: Tensor, x: Tensor) -> Tensor:  # Q X, in x's layout
        return torch.bmm(x, q.mT) if tall else torch.bmm(q, x)

    # R of the normalized X_0 = s x: s^2 x x^T, scaled in fp32 and rounded once.
    r = gram_of(x)
    buf = None if dtype == torch.float32 else torch.empty(r.shape, dtype=torch.float32, device=r.device)
    _round_scaled(r, r, s * s, buf)
    z, rz, q_next = torch.empty_like(r), torch.empty_like(r), torch.empty_like(r)
    q: Tensor | None = None
    scale: Tensor | None = s  # the left factor still owes X_0's 1/||G|| (folded into it, in fp32)
    restart = set(int(i) for i in restarts)
    for i in range(steps):
        a, b, c = schedule.coefficient(i)
        if i in restart and i != 0:
            assert q is not None
            x = left(q, x)  # X_i = Q X (scale already folded into q)
            gram_of(x, out=r)
            scale = None
            q_first = True
        else:
            q_first = q is None
        torch.baddbmm(r, r, r, beta=b, alpha=c, out=z)  # Z = b R + c R^2
        if q_first:  # (a I + Z) [* s on the first segment]
            if q is None:
                q = torch.empty_like(r)
            if scale is not None:
                _round_scaled(q, z, scale, buf, a)
            else:
                _plus_a_identity_into(q, z, a)
        else:
            assert q is not None
            torch.baddbmm(q, q, z, beta=a, out=q_next)  # Q (a I + Z)
            q, q_next = q_next, q
        if i < steps - 1 and (i + 1) not in restart:
            torch.baddbmm(r, r, z, beta=a, out=rz)  # R (a I + Z)
            torch.baddbmm(rz, z, rz, beta=a, out=r)  # (a I + Z) R (a I + Z)
    assert q is not None
    return left(q, x)  # the input's orientation, contiguous
