"""8-bit blockwise absmax momentum: ``momentum_codes`` int8 (``int8``) or uint8 with zero point 128
(``uint8``), plus ``momentum_absmax`` fp32 per ``block_size`` elements of a row.

``1 + 4 / block_size`` bytes per element; every tensor row-local."""

from __future__ import annotations

import torch

from ...ops import reference as ref
from .base import ABSMAX, CODES, FormatSpec, StateFormat

__all__ = ["Q8Format"]


class Q8Format(StateFormat):
    #: 256, as bitsandbytes and torchao
    default_block_size = 256
    layout_options = ("block_size",)
    order = 10
    promotes_to = "bf16"
    guard_threshold = 0.7

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.spec = FormatSpec(name, "q8", dtype, (CODES, ABSMAX))

    def init(self, rows, cols, opts, device):
        zero_code = 0 if self.spec.dtype == torch.int8 else 128  # uint8: zero point 128
        return {CODES: torch.full((rows, cols), zero_code, dtype=self.spec.dtype, device=device),
                ABSMAX: torch.zeros((rows, ref.num_blocks(cols, opts.block_size)), dtype=torch.float32, device=device)}

    def update(self, states, grads2d, block_sums, *, beta, nesterov, opts, streams, offsets, keys, seed, skip=None):
        torch.ops.qmuon.q8_momentum_update_multi_(
            [s[CODES] for s in states], [s[ABSMAX] for s in states], grads2d, block_sums,
            beta, nesterov, opts.block_size, streams, offsets, skip)

    def dequantize(self, state, opts, cols=None):
        return torch.ops.qmuon.dequantize_rows(state[CODES], state[ABSMAX], opts.block_size)

    def encode(self, m, opts):
        codes, absmax = torch.ops.qmuon.quantize_rows(
            m.float().contiguous(), opts.block_size, self.spec.dtype == torch.int8, -1, 0)
        return {CODES: codes, ABSMAX: absmax}

    def owns(self, state):
        return CODES in state and ABSMAX in state and state[CODES].dtype == self.spec.dtype

    def explain_unowned(self, state):
        if CODES not in state:
            return None
        if ABSMAX not in state:
            return "momentum_codes present without momentum_absmax; the checkpoint is incomplete"
        return f"momentum_codes has dtype {state[CODES].dtype}; expected int8 or uint8"

    def validate(self, state, rows, cols, opts, where):
        self._check(state, CODES, (rows, cols), self.spec.dtype, where)
        self._check(state, ABSMAX, (rows, ref.num_blocks(cols, opts.block_size)), torch.float32, where,
                    f" for block_size={opts.block_size}")


FORMATS = (Q8Format("int8", torch.int8), Q8Format("uint8", torch.uint8))
