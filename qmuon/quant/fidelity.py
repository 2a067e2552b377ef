"""Fidelity metrics of quantized momentum: :func:`cosine`, :func:`momentum_relative_error`, and
:func:`synthetic_gradients`, gradient sequences like a training run's (a slowly drifting low-rank
signal plus noise, with outlier rows and columns), on which naive 4-bit momentum loses the top
singular directions that Muon cares about.

The update-cosine measurement that runs :class:`~qmuon.QMuon` per format
(``per_layer_update_cosine``) sits above the optimizer, in :mod:`qmuon.optim.fidelity`
(this layer does not import the optimizer).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["cosine"]


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


def momentum_relative_error(m_hat: Tensor, m: Tensor) -> float:
    """``||m_hat - m||_F / ||m||_F`` in float64."""
    d = (m_hat.double() - m.double()).norm()
    n = m.double().norm()
    return float(d / n) if n > 0 else float(d)
