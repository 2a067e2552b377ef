"""Dense AdamW moments: ``exp_avg`` / ``exp_avg_sq`` in fp32 (``torch.optim.AdamW``'s keys, dtype and
shape, so its checkpoints load unchanged) or bf16.

Formats ``adamw_m_fp32``, ``adamw_v_fp32``, ``adamw_m_bf16``, ``adamw_v_bf16`` (roles ``"adamw_m"`` /
``"adamw_v"``; families ``"fp32"`` / ``"bf16"`` of :mod:`qmuon.quant.adamw`). The tensors keep
the parameter's own shape; the codec works on its ``(rows, cols)`` view (1-D: ``(n, 1)``). 4 / 2 bytes
per element; every tensor splits by rows under ``Shard(0)``.
"""

from __future__ import annotations

import torch

from .base import FormatSpec, StateFormat, StateFormatError

__all__: list[str] = []

EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"


class AdamWDenseFormat(StateFormat):
    layout_options = ()
    order = 200

    def __init__(self, role: str, family: str, dtype: torch.dtype) -> None:
        key = EXP_AVG if role == "adamw_m" else EXP_AVG_SQ
        self.role = role
        #: the ``adamw_state_format`` this moment format belongs to
        self.family = family
        self.key = key
        self.spec = FormatSpec(f"{role}_{family}", f"adamw_dense_{role}", dtype, (key,))

    def init(self, rows, cols, opts, device, shape=None):
        return {self.key: torch.zeros(shape if shape is not None else (rows, cols), dtype=self.spec.dtype,
                                      device=device)}

    def dequantize(self, state, opts, cols=None):
        t = state[self.key]
        return t.float().reshape(t.shape[0] if t.ndim else 1, -1)

    def encode(self, m, opts):
        return {self.key: m.to(self.spec.dtype).contiguous()}

    def owns(self, state):
        return self.key in state and state[self.key].dtype == self.spec.dtype

    def explain_unowned(self, state):
        if self.key in state and state[self.key].dtype not in (torch.float32, torch.bfloat16):
            return f"{self.key} has dtype {state[self.key].dtype}; expected float32 or bfloat16"
        return None

    def validate(self, state, rows, cols, opts, where):
        t = state[self.key]
        if t.numel() != rows * cols or (t.ndim and t.shape[0] != rows and rows != 1):
            raise StateFormatError(
                f"{where}: {self.key} has shape {tuple(t.shape)} but the parameter is {rows}x{cols}; "
                "the checkpoint belongs to a different model or parameter order")


FORMATS = tuple(AdamWDenseFormat(role, fam, dt) for fam, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))
                for role in ("adamw_m", "adamw_v"))
