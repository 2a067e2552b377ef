"""Naive blockwise absmax 4-bit momentum (the baseline GRASP has to beat): ``momentum_packed``
uint8 (two codes per byte, low nibble first) + ``momentum_absmax`` fp32 per ``block_size`` elements.

``0.5 + 4 / block_size`` bytes per element; every tensor row-local."""

from __future__ import annotations

import torch

from ...ops import reference as ref
from ...ops import reference_4bit as ref4
from .base import ABSMAX, PACKED, UE4M3, FormatSpec, StateFormat

__all__ = ["Int4Format"]


class Int4Format(StateFormat):
    #: torchao's 4-bit Adam block: 4 B absmax per 128 elements = 0.03125 B/elem on top of 0.5
    default_block_size = 128
    layout_options = ("block_size",)
    order = 20
    promotes_to = "int8"
    guard_threshold = 0.2
    spec = FormatSpec("int4", "q4", torch.uint8, (PACKED, ABSMAX))

    def init(self, rows, cols, opts, device):
        return {PACKED: torch.zeros((rows, ref4.packed_cols(cols)), dtype=torch.uint8, device=device),
                ABSMAX: torch.zeros((rows, ref.num_blocks(cols, opts.block_size)), dtype=torch.float32, device=device)}

    def update(self, states, grads2d, block_sums, *, beta, nesterov, opts, streams, offsets, keys, seed, skip=None):
        torch.ops.qmuon.int4_momentum_update_multi_(
            [s[PACKED] for s in states], [s[ABSMAX] for s in states], grads2d, block_sums,
            beta, nesterov, opts.block_size, streams, offsets, skip)

    def dequantize(self, state, opts, cols=None):
        cols = 2 * state[PACKED].shape[1] if cols is None else cols
        return torch.ops.qmuon.int4_dequantize(state[PACKED], state[ABSMAX], opts.block_size, cols)

    def encode(self, m, opts):
        packed, absmax = torch.ops.qmuon.int4_quantize(m.float().contiguous(), opts.block_size, -1, 0)
        return {PACKED: packed, ABSMAX: absmax}

    def owns(self, state):
        return PACKED in state and ABSMAX in state and UE4M3 not in state

    def explain_unowned(self, state):
        if PACKED in state:
            return "momentum_packed present without its scales; the checkpoint is incomplete"
        return None

    def validate(self, state, rows, cols, opts, where):
        self._check(state, PACKED, (rows, ref4.packed_cols(cols)), torch.uint8, where,
                    f" for a {rows}x{cols} parameter (two 4-bit codes per byte)")
        self._check(state, ABSMAX, (rows, ref.num_blocks(cols, opts.block_size)), torch.float32, where,
                    f" for block_size={opts.block_size}")


FORMATS = (Int4Format(),)
