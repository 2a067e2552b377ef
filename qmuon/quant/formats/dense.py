"""Dense momentum: ``momentum_buffer`` in fp32 (``torch.optim.Muon``'s key and layout) or bf16.

4 / 2 bytes per element; every tensor row-local."""

from __future__ import annotations

import torch

from .base import BUFFER, FormatSpec, StateFormat, StateFormatError

__all__ = ["DenseFormat"]


class DenseFormat(StateFormat):
    order = 0

    def __init__(self, name: str, dtype: torch.dtype, *, guard_threshold: float | None = None) -> None:
        self.spec = FormatSpec(name, "dense", dtype, (BUFFER,))
        self.guard_threshold = guard_threshold  # end of the promotion chain: promotes_to stays None

    def init(self, rows, cols, opts, device):
        return {BUFFER: torch.zeros((rows, cols), dtype=self.spec.dtype, device=device)}

    def update(self, states, grads2d, block_sums, *, beta, nesterov, opts, streams, offsets, keys, seed, skip=None):
        torch.ops.qmuon.dense_momentum_update_multi_(
            [s[BUFFER] for s in states], grads2d, block_sums, beta, nesterov, opts.block_size, streams, offsets,
            skip)

    def dequantize(self, state, opts, cols=None):
        return state[BUFFER].float()

    def encode(self, m, opts):
        return {BUFFER: m.to(self.spec.dtype).contiguous()}

    def owns(self, state):
        return BUFFER in state and state[BUFFER].dtype == self.spec.dtype

    def explain_unowned(self, state):
        if BUFFER in state:
            return f"momentum_buffer has dtype {state[BUFFER].dtype}; expected float32 or bfloat16"
        return None

    def validate(self, state, rows, cols, opts, where):
        shape = tuple(state[BUFFER].shape)
        if shape != (rows, cols):
            raise StateFormatError(
                f"{where}: momentum_buffer has shape {shape} but the parameter is {rows}x{cols}; "
                "the checkpoint belongs to a different model or parameter order"
            )


# fp32 is the guard's reference (cosine 1 by construction); bf16 healthy layers read >= 0.994.
FORMATS = (DenseFormat("fp32", torch.float32), DenseFormat("bf16", torch.bfloat16, guard_threshold=0.85))
