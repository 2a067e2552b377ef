"""Newton-Schulz orthogonalization with the input's 1/norm folded into the first iteration.

Muon feeds ``X = G / ||G||_F`` to a quintic Newton-Schulz iteration. Dividing ``G`` costs a pass
over the whole matrix. Instead, with ``s = 1 / ||G||`` and ``A0 = G G^T`` (an ``r x r`` Gram matrix,
``r = min(rows, cols)``), the first iteration is::

    X1 = a X + (b A + c A^2) X,  A = s^2 A0
       = [s (a I + b A + c A^2)] G

so only the small matrix is scaled and the big one is read as it is. The remaining iterations are
the usual ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``. Matrices are processed in bf16, like
``torch.optim.Muon``, transposed when ``rows > cols`` so the Gram matrix is the small side, and a
batch of same-shape matrices goes through ``bmm`` together.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["newton_schulz_folded", "newton_schulz_reference", "NS_BATCH_MAX_ELEMENTS"]

#: Largest number of elements stacked into one batched NS call (bounds the bf16 scratch to 256 MiB).
NS_BATCH_MAX_ELEMENTS = 1 << 27


def newton_schulz_folded(
    g: Tensor, inv_norm: Tensor, coefficients: tuple[float, float, float], steps: int
) -> Tensor:
    """Orthogonalize a batch ``g`` of shape ``(B, rows, cols)`` (any float dtype).

    ``inv_norm``: fp32 ``(B,)``, ``1 / max(||g_i||_F, eps)``. Returns bf16 ``(B, rows, cols)``.
    """
    if g.ndim != 3:
        raise ValueError(f"expected a (batch, rows, cols) tensor, got shape {tuple(g.shape)}")
    a, b, c = coefficients
    x = g if g.dtype == torch.bfloat16 else g.to(torch.bfloat16)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    s = inv_norm.to(torch.float32).reshape(-1, 1, 1)
    if steps == 0:
        out = (x.float() * s).to(torch.bfloat16)
        return out.mT if transposed else out
    # First iteration: scale only the r x r matrices.
    gram = (torch.bmm(x, x.mT).float() * (s * s)).to(torch.bfloat16)
    poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
    eye = torch.eye(x.size(-2), dtype=torch.float32, device=x.device)
    left = ((poly.float() + a * eye) * s).to(torch.bfloat16)
    x = torch.bmm(left, x)
    for _ in range(steps - 1):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if transposed else x


def newton_schulz_reference(
    g: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> Tensor:
    """The textbook form (explicit division by the norm, one 2-D matrix), in bf16 as
    ``torch.optim.Muon`` computes it. Kept beside the folded form for tests."""
    a, b, c = coefficients
    x = g.to(torch.bfloat16)
    transposed = g.size(0) > g.size(1)
    if transposed:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if transposed else x
