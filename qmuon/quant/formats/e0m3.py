"""E0M3 momentum with two-level scaling: ``momentum_packed`` uint8 (two E0M3 codes per byte),
``momentum_ue4m3`` uint8 (one UE4M3 scale per 16 elements of a row) and ``momentum_tensor_scale``
fp32 0-d (``t = amax(M) / (7 * 448)``, so the largest block scale sits at the top of UE4M3's range).

``0.5 + 1 / 16`` bytes per element plus 4 bytes per matrix.

Sharding: codes and block scales are row-local (``Shard(0)``); the tensor scale is a plain 0-d
tensor, identical on every rank. The fused single-process op computes ``t`` from the matrix it sees,
so the sharded update (:meth:`E0M3Format.update_sharded`, compiled kernels) is split:

1. ``torch.ops.qmuon.e0m3_momentum_amax_multi``: the local ``amax(|beta M + (1 - beta) G|)`` of
   every parameter (decoded with the stored ``t``);
2. one **all-reduce MAX** over all of them (one flat buffer): the global ``amax``. A max does not
   depend on the order it is taken in, so ``t`` is the single-process value bit for bit;
3. ``torch.ops.qmuon.e0m3_momentum_update_with_scale_multi_``: the fused update of the own rows,
   encoding with that ``t``.
"""

from __future__ import annotations

import torch

from ...ops import reference_4bit as ref4
from .base import PACKED, TSCALE, UE4M3, FormatSpec, StateFormat

__all__ = ["E0M3Format"]


class E0M3Format(StateFormat):
    """E0M3 elements, UE4M3 scales per 16 elements, fp32 per-tensor scale (see the module docstring)."""

    row_local = False  # the tensor scale is a per-matrix max
    order = 30
    promotes_to = "int8"
    guard_threshold = 0.2
    spec = FormatSpec("e0m3", "e0m3", torch.uint8, (PACKED, UE4M3, TSCALE))

    def init(self, rows, cols, opts, device):
        return {PACKED: torch.zeros((rows, ref4.packed_cols(cols)), dtype=torch.uint8, device=device),
                UE4M3: torch.zeros((rows, ref4.e0m3_num_blocks(cols)), dtype=torch.uint8, device=device),
                TSCALE: torch.ones((), dtype=torch.float32, device=device)}

    def update(self, states, grads2d, block_sums, *, beta, nesterov, opts, streams, offsets, keys, seed, skip=None):
        torch.ops.qmuon.e0m3_momentum_update_multi_(
            [s[PACKED] for s in states], [s[UE4M3] for s in states], [s[TSCALE] for s in states],
            grads2d, block_sums, beta, nesterov, opts.block_size, streams, offsets, skip)

    def update_sharded(self, params, states, grads2d, block_sums, *, beta, nesterov, opts, streams, offsets, keys,
                       seed, process_group):
        if not states:
            return
        import torch.distributed as dist

        packed = [s[PACKED] for s in states]
        scales = [s[UE4M3] for s in states]
        tscales = [s[TSCALE] for s in states]
        amax = torch.ops.qmuon.e0m3_momentum_amax_multi(packed, scales, tscales, grads2d, beta)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=process_group)
        new_t = list(ref4.e0m3_tensor_scale_from_amax(amax).unbind(0))  # views of one new tensor: no aliasing
        torch.ops.qmuon.e0m3_momentum_update_with_scale_multi_(
            packed, scales, tscales, new_t, grads2d, block_sums, beta, nesterov, opts.block_size, streams, offsets)

    def placement(self, key):
        return "scalar" if key == TSCALE else super().placement(key)

    def dequantize(self, state, opts, cols=None):
        cols = 2 * state[PACKED].shape[1] if cols is None else cols
        return torch.ops.qmuon.e0m3_dequantize(state[PACKED], state[UE4M3], state[TSCALE], cols)

    def encode(self, m, opts):
        packed, scales, t = torch.ops.qmuon.e0m3_quantize(m.float().contiguous(), True, -1, 0)
        return {PACKED: packed, UE4M3: scales, TSCALE: t}

    def owns(self, state):
        return UE4M3 in state

    def validate(self, state, rows, cols, opts, where):
        self._require_keys(state, where)
        self._check(state, PACKED, (rows, ref4.packed_cols(cols)), torch.uint8, where,
                    f" for a {rows}x{cols} parameter (two 4-bit codes per byte)")
        self._check(state, UE4M3, (rows, ref4.e0m3_num_blocks(cols)), torch.uint8, where,
                    " (one UE4M3 scale per 16 elements of a row)")
        self._check(state, TSCALE, (), torch.float32, where)


FORMATS = (E0M3Format(),)
