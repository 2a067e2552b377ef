"""QK-clip's arithmetic (MuonClip, Kimi K2 arXiv 2507.20534): the per-head maximum attention logit,
and the per-head factors that bring it back to a threshold. Pure functions on tensors; where they
are measured and applied is :mod:`qmuon.optim.qk_clip`.

The logit of query ``i`` and key ``j`` in head ``h`` is ``S_h[i, j] = scale * q_i . k_j`` (``scale``
is usually ``1 / sqrt(head_dim)``). MuonClip measures ``S_max,h = max_ij S_h[i, j]`` in the forward
pass; after the optimizer step a head with ``S_max,h > tau`` has its query and key projections
rescaled by ``eta_h = tau / S_max,h`` in total, so that the same inputs would give ``tau``.
The forward cap (:func:`cap_queries`) applies the same ``eta_h`` to the queries of the forward that
measured it, so the softmax of that forward sees at most ``tau``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["max_logits", "clip_factors", "cap_queries", "qk_clip_factors", "DEFAULT_CHUNK_ELEMENTS"]

#: The most score elements :func:`max_logits` computes at once (fp32: 1 MiB): queries are taken in
#: chunks of rows, so a long sequence never materializes its whole score matrix and each chunk's
#: scores stay in cache between the matmul and the maximum (measured fastest on the CPU models of
#: benchmarks/bench_qk_clip.py).
DEFAULT_CHUNK_ELEMENTS = 1 << 18


@torch.no_grad()
def max_logits(q: Tensor, k: Tensor, scale: float, *, causal: bool = True, mask: Tensor | None = None,
               chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, per_sample: bool = False) -> Tensor:
    """Exact per-head maximum logit ``max over (batch, i, j allowed) of scale * q_i . k_j``, fp32, shape
    ``(H,)`` (``per_sample``: the maximum of each sequence of the batch, ``(B, H)``).

    Args:
        q: queries ``(B, H, T, D)`` as attention sees them (after RoPE and any QK-norm).
        k: keys ``(B, KV, S, D)``, ``H`` a multiple of ``KV`` (grouped-query attention: query head
            ``h`` reads key head ``h // (H / KV)``; the keys are not repeated).
        scale: the factor (> 0) the attention applies to ``q . k``.
        causal: with ``mask=None``, only pairs ``j <= i + S - T`` count (bottom-right aligned, as a
            KV cache places the queries; ``T == S`` in training).
        mask: instead of ``causal``, the attention's own mask broadcastable to ``(B, H, T, S)``:
            boolean (True: the pair is attended, SDPA's convention) or additive float (0 where
            attended, a large negative number where not, as eager attention adds it to the scaled
            scores).
        chunk_elements: the most score elements computed at once (queries are chunked by rows).

    The scores are recomputed in fp32 from ``q`` and ``k`` beside the attention kernel (SDPA and
    FlashAttention never return them). With the causal mask a chunk of query rows multiplies only
    the keys it may see (about half of ``Q K^T``), and the mask enters the matmul as an additive
    ``-inf`` bias (``baddbmm``: no separate masking pass). ``scale`` multiplies the maxima, not the scores:
    rounding is monotonic, so ``max(fl(scale * x)) == fl(scale * max(x))``. Nothing is read to the host.
    """
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    if h % kv:
        raise ValueError(f"max_logits: {h} query heads are not a multiple of {kv} key heads")
    g = h // kv
    # One copy each, laid out so that a chunk of query rows is a view: queries (B, KV, T, G, D)
    # (the G heads of a key head next to each other), keys (B, KV, S, D) read transposed by the matmul.
    qf = q.detach().float().reshape(b, kv, g, t, d).transpose(2, 3).reshape(b * kv, t * g, d)
    kc = k.detach().float().reshape(b * kv, s, d)
    rows = max(1, min(t, chunk_elements // max(1, b * h * s)))
    off = s - t  # query i sees keys j <= i + off
    neg = float("-inf")
    out = torch.full((b, kv, g), neg, device=q.device)
    if causal and mask is None:
        # Additive causal bias of every chunk as a view of one tensor: row r of the chunk at i0 (query
        # i0 + r) may not see key c, i.e. c > i0 + off + r, which is band[r, x0 + c] = -inf for
        # band[r, x] = -inf iff x > r + s and x0 = s - i0 - off (x0 >= 1, x0 + end <= s + rows).
        x_idx = torch.arange(s + rows, device=q.device)
        band = torch.zeros(rows, g, s + rows, device=q.device).masked_fill_(
            (x_idx[None, :] > torch.arange(rows, device=q.device)[:, None] + s)[:, None, :], neg)
    for i0 in range(0, t, rows):
        i1 = min(t, i0 + rows)
        n = i1 - i0
        qc = qf[:, i0 * g:i1 * g]
        if mask is not None:
            m = mask[..., i0:i1, :]
            sc = torch.bmm(qc, kc.transpose(1, 2)).view(b, kv, n, g, s).transpose(2, 3).reshape(b, h, n, s)
            sc = sc.mul_(scale)
            sc = sc.masked_fill(~m, neg) if m.dtype == torch.bool else sc + m.float()
            out = torch.maximum(out, sc.amax(dim=-1).amax(dim=2).view(b, kv, g))
            continue
        end = min(s, i1 + off) if causal else s
        if end <= 0:
            continue
        keys = kc[:, :end].transpose(1, 2)
        if causal and end > max(0, i0 + off):  # some keys hidden from some rows: -inf added in the matmul
            x0 = s - i0 - off
            sc = torch.baddbmm(band[:n, :, x0:x0 + end].reshape(1, n * g, end), qc, keys)
        else:
            sc = torch.bmm(qc, keys)
        # the key axis first (contiguous), then batch and rows
        out = torch.maximum(out, sc.view(b, kv, n, g, end).amax(dim=-1).amax(dim=2))
    out = out.reshape(b, h) if per_sample else out.amax(dim=0).reshape(h)
    return out if mask is not None else out * scale


def clip_factors(max_logit: Tensor, tau: float) -> Tensor:
    """``eta_h = tau / max_logit_h`` where ``max_logit_h > tau`` (finite), else exactly 1, fp32 ``(H,)``,
    chosen on the device with ``torch.where`` (no host read, no branch)."""
    # tau / max(m, tau): exactly 1 at or under tau. A non-finite m gives 0 (+inf) or NaN, and only
    # those fail "> 0" (a finite m over tau gives a positive factor): they get 1. Four ops, as every
    # forward's cap runs them.
    eta = tau / max_logit.float().clamp(min=tau)
    return torch.where(eta > 0, eta, 1.0)


def cap_queries(q: Tensor, max_logit: Tensor, tau: float) -> Tensor:
    """The queries ``q`` ``(B, H, T, D)`` with each head ``h`` over ``tau`` multiplied by
    ``eta_h = tau / max_logit_h`` (:func:`clip_factors`; ``max_logit``: this forward's maxima,
    :func:`max_logits`, per head ``(H,)`` or per sequence and head ``(B, H)``), so that every logit
    of head ``h`` is scaled by ``eta_h`` and its largest becomes ``tau``; key heads shared by
    several query heads (GQA) are untouched. With per-sequence maxima each sequence is capped by
    its own factor, so a sequence's output does not depend on the rest of the batch.

    The factor is a constant of the graph (the gradient reaching ``q`` is scaled by it, like the
    logits). The product is computed in fp32 and rounded to ``q``'s dtype once; a head at or under
    ``tau`` is multiplied by exactly 1.0, so its queries (and their gradients) keep their bits.
    """
    eta = clip_factors(max_logit.detach(), tau).to(q.device)
    return (q * eta.view(-1 if eta.ndim == 2 else 1, q.shape[1], 1, 1)).to(q.dtype)


def qk_clip_factors(max_logit: Tensor, tau: float, n_kv_heads: int) -> tuple[Tensor, Tensor]:
    """The factors ``(q_factor (H,), k_factor (KV,))`` that multiply each head's W_q rows and each key
    head's W_k rows, from the measured per-head maxima ``max_logit (H,)``.

    ``eta_h`` as :func:`clip_factors` gives it. Without grouped-query attention (``H == KV``)
    both projections take ``sqrt(eta_h)``, MuonClip's split. With GQA a key head is shared by the
    ``G = H / KV`` query heads of its group: it takes ``sqrt(min_g eta_g)`` and each query head
    ``eta_h / sqrt(min_g eta_g)``, so every head's logit is scaled by exactly its own ``eta_h``
    (a head of the group that was not over ``tau`` keeps its logits: its query rows grow by what
    the shared key rows shrank). A head not over ``tau`` in a group where none is gets factor 1.0
    on both sides: multiplying by 1.0 leaves a weight bit-identical (fp32 and bf16).
    """
    h = max_logit.numel()
    if h % n_kv_heads:
        raise ValueError(f"qk_clip_factors: {h} heads are not a multiple of {n_kv_heads} key heads")
    eta = clip_factors(max_logit, tau)
    k_factor = eta.view(n_kv_heads, -1).amin(dim=1).sqrt()
    q_factor = eta / k_factor.repeat_interleave(h // n_kv_heads)
    return q_factor, k_factor
