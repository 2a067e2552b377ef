"""8-bit AdamW moments, blockwise along rows (as the Muon momentum's int8).

* ``adamw_m_int8``: first moment, ``exp_avg_q8`` int8 codes of the softsign-companded ``m / absmax``
  (FlashOptim's map: finer steps near 0, where most of a block's values are) + ``exp_avg_absmax`` fp32;
* ``adamw_v_int8``: second moment, ``exp_avg_sq_q8`` uint8 codes of ``sqrt(v) / max sqrt(v)`` on a
  256-level grid *without a zero code* + ``exp_avg_sq_absmax`` fp32 (the block's ``max sqrt(v)``).

The maths (and its bit-exact compiled twins): :mod:`qmuon.ops.reference_adamw`. Block 256
(bitsandbytes' and torchao's 8-bit block): ``1 + 4 / 256`` bytes per element per moment.
"""

from __future__ import annotations

import torch

from ...ops import reference as ref
from ...ops import reference_adamw as refa
from .base import FormatSpec, StateFormat

__all__: list[str] = []


class AdamWQuantFormat(StateFormat):
    """A blockwise-quantized AdamW moment (``kind``: :data:`~qmuon.ops.reference_adamw.MOMENT_KINDS`)."""

    layout_options = ("block_size",)
    order = 210

    def __init__(self, role: str, family: str, kind: int, block_size: int, order: int = 210) -> None:
        prefix = "exp_avg" if role == "adamw_m" else "exp_avg_sq"
        bits = refa.moment_bits(kind)
        self.role = role
        self.family = family
        #: the moment map of the fused kernels (``torch.ops.qmuon.adamw_q_update_``)
        self.kind = kind
        self.default_block_size = block_size
        self.order = order
        self.codes_key = f"{prefix}_q{bits}"
        self.scale_key = f"{prefix}_absmax"
        dtype = torch.int8 if kind == refa.M8 else torch.uint8
        self.spec = FormatSpec(f"{role}_{family}", f"adamw_q{bits}_{role}", dtype, (self.codes_key, self.scale_key))

    def validate_options(self, opts):
        bs = opts.block_size
        if refa.moment_bits(self.kind) == 4 and bs % 2:
            raise ValueError(f"{self.name}: block_size must be even (two 4-bit codes per byte), got {bs}")

    def init(self, rows, cols, opts, device, shape=None):
        return {
            self.codes_key: torch.zeros((rows, refa.moment_code_cols(self.kind, cols)), dtype=self.spec.dtype,
                                        device=device),
            self.scale_key: torch.zeros((rows, ref.num_blocks(cols, opts.block_size)), dtype=torch.float32,
                                        device=device),
        }

    def dequantize(self, state, opts, cols=None):
        codes = state[self.codes_key]
        if cols is None:
            if refa.moment_bits(self.kind) == 4:
                raise TypeError(f"{self.name}: dequantize needs cols (4-bit codes pack two columns a byte)")
            cols = codes.shape[1]
        return refa.decode_moment(codes, state[self.scale_key], self.kind, opts.block_size, cols)

    def encode(self, m, opts):
        codes, scale = refa.encode_moment(m.float().reshape(m.shape[0] if m.ndim else 1, -1), self.kind,
                                          opts.block_size)
        return {self.codes_key: codes, self.scale_key: scale}

    def owns(self, state):
        return (self.codes_key in state and self.scale_key in state
                and state[self.codes_key].dtype == self.spec.dtype)

    def explain_unowned(self, state):
        if self.codes_key in state and self.scale_key not in state:
            return f"{self.codes_key} present without {self.scale_key}; the checkpoint is incomplete"
        return None

    def validate(self, state, rows, cols, opts, where):
        self._check(state, self.codes_key, (rows, refa.moment_code_cols(self.kind, cols)), self.spec.dtype, where,
                    f"; the parameter is {rows}x{cols}")
        self._check(state, self.scale_key, (rows, ref.num_blocks(cols, opts.block_size)), torch.float32, where,
                    f" for block_size={opts.block_size}")


FORMATS = (AdamWQuantFormat("adamw_m", "int8", refa.M8, 256), AdamWQuantFormat("adamw_v", "int8", refa.V8, 256))
