"""e0m3 momentum of dim-0 sharded (FSDP2 ``Shard(0)``) parameters.

e0m3 (:mod:`qmuon_lightning.ops.reference_4bit`) stores E0M3 codes and UE4M3 scales per 16
elements of a row (row-local, ``Shard(0)``) and one fp32 tensor scale
``t = amax(M) / (7 * 448)`` per matrix (a plain 0-d tensor, identical on every rank). The fused
single-process op computes ``t`` from the matrix it sees, so under row sharding the update is split:

1. local: decode the own rows with the stored ``t``, ``M_new = beta M + (1 - beta) G`` and the NS
   input (the reference :func:`~qmuon_lightning.ops.reference._q8_momentum_and_ns_input`);
2. **all-reduce MAX** of the local ``amax(|M_new|)`` of every sharded e0m3 parameter (one flat
   buffer): the global ``amax``. A max does not depend on the order it is taken in, so ``t`` is the
   single-process value bit for bit;
3. local: encode the own rows with that ``t`` (:func:`e0m3_quantize_with_scale`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops import reference as ref
from ..ops import reference_4bit as ref4
from ..quant.state import PACKED, TSCALE, UE4M3, FormatOptions

__all__ = ["e0m3_quantize_with_scale", "e0m3_update_sharded"]


def e0m3_quantize_with_scale(x: Tensor, t: Tensor, stream: int = -1, row_offset: int = 0) -> tuple[Tensor, Tensor]:
    """:func:`~qmuon_lightning.ops.reference_4bit.e0m3_quantize` of some rows of a matrix with the
    *matrix's* tensor scale ``t``: (packed codes, UE4M3 block scales). Row-local apart from ``t``."""
    rows, cols = x.shape
    xb = ref4._blocked(x.float(), ref4.E0M3_BLOCK)
    amax = xb.abs().amax(dim=-1)
    s_bits = ref4.ue4m3_encode(amax / (ref4.QMAX4 * t), round_up=True)
    step = ref4.ue4m3_decode(s_bits) * t
    safe = torch.where(step > 0, step, torch.ones_like(step))
    noise = None if stream < 0 else ref.uniform_noise(rows, cols, stream, row_offset, x.device)
    nz = None if noise is None else ref4._blocked(noise, ref4.E0M3_BLOCK)
    q = ref4._round_codes(xb / safe[..., None], nz)
    q = torch.where(step[..., None] > 0, q, torch.zeros_like(q))
    q = q.reshape(rows, q.shape[1] * ref4.E0M3_BLOCK)[:, :cols]
    return ref4.pack_int4(q.to(torch.int8)), s_bits


def e0m3_update_sharded(
    states: list[dict[str, Tensor]], grads2d: list[Tensor], block_sums: list[Tensor], *, beta: float,
    nesterov: bool, opts: FormatOptions, streams: list[int], offsets: list[int], group: dist.ProcessGroup,
    **_: object,
) -> None:
    """The e0m3 momentum update of the local rows of sharded parameters (collective: every rank of
    ``group`` calls it with the same parameters in the same order); ``grads2d`` are overwritten with
    the NS input like :meth:`~qmuon_lightning.quant.state.E0M3Format.update`."""
    if not states:
        return
    m_new, amax = [], []
    for st, g2, out in zip(states, grads2d, block_sums):
        cols = g2.shape[1]
        m_old = ref4.e0m3_dequantize(st[PACKED], st[UE4M3], st[TSCALE], cols)
        mn, ns = ref._q8_momentum_and_ns_input(m_old, g2.float(), beta, nesterov)
        m_new.append(mn)
        amax.append(mn.abs().amax() if mn.numel() else torch.zeros((), device=mn.device))
        g2.copy_(ns)
        out.copy_(ref.block_sumsq(ns, opts.block_size))
    a = torch.stack([x.float() for x in amax])
    dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    for st, mn, ai, stream, row0 in zip(states, m_new, a, streams, offsets):
        t = ai / torch.full_like(ai, ref4.QMAX4 * ref4.UE4M3_MAX)
        t = torch.where((t > 0) & torch.isfinite(t), t, torch.ones_like(t)).reshape(())
        packed, scales = e0m3_quantize_with_scale(mn, t, stream, row0)
        st[PACKED].copy_(packed)
        st[UE4M3].copy_(scales)
        st[TSCALE].copy_(t)
