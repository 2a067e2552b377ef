"""Fidelity of quantized momentum: how close is a quantized-state Muon update to the fp32-state one?

:func:`per_layer_update_cosine` runs one :class:`~qmuon_lightning.QMuon` per state format on clones of
the same parameters, feeds every optimizer the same gradient sequence and compares each step's
update (the parameter change, with ``lr=1`` and no weight decay, i.e. the orthogonalized update)
with the fp32-state update, per layer. :func:`synthetic_gradients` makes gradient sequences like a
training run's (a slowly drifting low-rank signal plus noise, with outlier rows and columns), on
which naive 4-bit momentum loses the top singular directions that Muon cares about.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

__all__ = ["cosine", "synthetic_gradients", "per_layer_update_cosine", "update_cosine", "momentum_relative_error"]


def cosine(a: Tensor, b: Tensor) -> float:
    """Cosine similarity of two tensors (float64; 0 when either is zero)."""
    a, b = a.double().flatten(), b.double().flatten()
    den = a.norm() * b.norm()
    return float((a @ b) / den) if den > 0 else 0.0


def synthetic_gradients(
    rows: int, cols: int, steps: int, *, seed: int = 0, rank: int = 4, scale: float = 1e-3,
    noise: float = 0.5, drift: float = 0.1, outlier_rows: int | None = None, outlier_cols: int | None = None,
    outlier_gain: float = 10.0,
) -> list[Tensor]:
    """``steps`` fp32 gradients ``(rows, cols)``: low-rank signal ``U diag(c_t) V^T`` (``U``, ``V``
    drifting by ``drift`` per step, decaying spectrum), Gaussian noise of relative size ``noise``,
    and ``outlier_rows`` / ``outlier_cols`` (default rows/16, cols/16) scaled by ``outlier_gain``."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(rows, rank, generator=g)
    v = torch.randn(cols, rank, generator=g)
    spectrum = torch.tensor([1.0 / (1 + i) for i in range(rank)])
    row_gain = torch.ones(rows, 1)
    col_gain = torch.ones(1, cols)
    nr = max(1, rows // 16) if outlier_rows is None else outlier_rows
    nc = max(1, cols // 16) if outlier_cols is None else outlier_cols
    row_gain[torch.randperm(rows, generator=g)[:nr]] = outlier_gain
    col_gain[0, torch.randperm(cols, generator=g)[:nc]] = outlier_gain
    out = []
    for _ in range(steps):
        u = u + drift * torch.randn(rows, rank, generator=g)
        v = v + drift * torch.randn(cols, rank, generator=g)
        coef = spectrum * (1.0 + 0.3 * torch.randn(rank, generator=g))
        signal = (u * coef) @ v.T / math.sqrt(cols)
        n = noise * torch.randn(rows, cols, generator=g) / math.sqrt(rank)
        out.append((scale * row_gain * col_gain * (signal + n)).float())
    return out


def per_layer_update_cosine(
    params: Sequence[Tensor | tuple[int, int]],
    grads: Sequence[Sequence[Tensor]],
    formats: Sequence[str] = ("int8", "int4", "e0m3", "grasp4"),
    *,
    reference: str = "fp32",
    reduce: str = "mean",
    skip: int = 0,
    **qmuon_kwargs: Any,
) -> dict[str, list[float]]:
    """Per-layer cosine between each format's Muon update and the ``reference``-state update.

    Args:
        params: the matrices (their values are cloned; the originals are untouched) or shapes.
        grads: ``grads[t][i]`` is parameter ``i``'s gradient at step ``t`` (same for every format).
        formats: state formats to compare.
        reduce: ``"mean"`` over steps ``skip..`` or ``"last"``.
        qmuon_kwargs: passed to every :class:`~qmuon_lightning.QMuon` (``momentum``, ``nesterov``,
            ``rounding``, ``rank``, ``grid_block``, ``block_size``...).

    Returns ``{format: [cosine per layer]}``.
    """
    from ..optim import QMuon

    if reduce not in ("mean", "last"):
        raise ValueError(f"reduce must be 'mean' or 'last', got {reduce!r}")
    init = [torch.zeros(p) if isinstance(p, tuple) else p.detach().float() for p in params]
    kw = {"lr": 1.0, "weight_decay": 0.0, **qmuon_kwargs}

    def updates(fmt: str) -> list[list[Tensor]]:
        ps = [torch.nn.Parameter(p.clone()) for p in init]
        opt = QMuon(ps, state_format=fmt, **kw)
        out = []
        for step_grads in grads:
            before = [p.detach().clone() for p in ps]
            for p, g in zip(ps, step_grads, strict=True):
                p.grad = g.detach().clone().to(p.dtype)
            opt.step()
            out.append([b - p.detach() for b, p in zip(before, ps)])
        return out

    ref_updates = updates(reference)
    result: dict[str, list[float]] = {}
    for fmt in formats:
        upd = updates(fmt)
        steps = range(len(grads) - 1, len(grads)) if reduce == "last" else range(skip, len(grads))
        result[fmt] = [
            sum(cosine(upd[t][i], ref_updates[t][i]) for t in steps) / len(steps) for i in range(len(init))
        ]
    return result


#: Alias (the name used in the issue).
update_cosine = per_layer_update_cosine


def momentum_relative_error(m_hat: Tensor, m: Tensor) -> float:
    """``||m_hat - m||_F / ||m||_F`` in float64."""
    d = (m_hat.double() - m.double()).norm()
    n = m.double().norm()
    return float(d / n) if n > 0 else float(d)
