"""The 8-bit error correction of a bf16 weight (``bf16_update="ecc8"``): ``weight_ecc`` int8, one
code per weight element, shaped like the parameter (1 byte per element).

Not a momentum format (:attr:`~.base.StateFormat.role` is ``"weight_correction"``): it lives in the
same per-parameter state dict as the Muon momentum or the AdamW moments, for Muon and AdamW
parameters alike. A code is the rounding error of the last bf16 write in units of 1/127 of half
the bf16 gap at the stored weight (FlashOptim, arXiv 2602.23349; the maths and its kernels:
:mod:`qmuon.ops.reference_weight`), so bf16 + ecc8 acts as a weight of about 16
significant bits (24 stored bits). Every tensor is ``"rows"``: a ``Shard(0)`` parameter's codes are
its rows, and DCP reshards them like the weight itself."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ...ops import reference_weight as refw
from .base import WEIGHT_CORRECTION, WEIGHT_ECC, FormatSpec, StateFormat, StateFormatError

__all__: list[str] = []


class Ecc8WeightFormat(StateFormat):
    role = WEIGHT_CORRECTION
    order = 1000
    spec = FormatSpec("ecc8", "ecc", torch.int8, (WEIGHT_ECC,))

    # ------------------------------------------------------------------ codec
    def init(self, rows, cols, opts, device):
        return {WEIGHT_ECC: torch.zeros((rows, cols), dtype=torch.int8, device=device)}

    def init_like(self, param: Tensor) -> dict[str, Tensor]:
        """Zero codes for ``param`` (its local shape): the stored bf16 weight is the master weight."""
        return {WEIGHT_ECC: torch.zeros(param.shape, dtype=torch.int8, device=param.device)}

    def owns(self, state):
        return WEIGHT_ECC in state and state[WEIGHT_ECC].dtype == torch.int8

    def explain_unowned(self, state):
        if WEIGHT_ECC in state:
            return f"weight_ecc has dtype {state[WEIGHT_ECC].dtype}; expected int8"
        return None

    def validate(self, state, rows, cols, opts, where):
        self.validate_like(state, (rows, cols), where)

    def validate_like(self, state: dict[str, Tensor], shape: Sequence[int], where: str) -> None:
        """Raise :class:`StateFormatError` unless ``state`` holds int8 codes shaped ``shape``."""
        t = state.get(WEIGHT_ECC)
        if t is None:
            raise StateFormatError(
                f"{where}: bf16_update='ecc8' but the state has no weight_ecc; the checkpoint is incomplete or was "
                "saved with another bf16_update (construct the optimizer with that rule to resume it exactly)")
        if t.dtype != torch.int8:
            raise StateFormatError(f"{where}: weight_ecc must be int8, got {t.dtype}")
        if tuple(t.shape) != tuple(shape):
            raise StateFormatError(
                f"{where}: weight_ecc has shape {tuple(t.shape)} but the parameter is {tuple(shape)}; the checkpoint "
                "belongs to a different model or parameter order")

    def dequantize(self, state, opts, cols=None):
        raise StateFormatError("ecc8 codes are relative to their bf16 weight: use master_weight(param, state)")

    def encode(self, m, opts):
        raise StateFormatError("ecc8 codes are written with the weight: use apply_(...)")

    def master_weight(self, param: Tensor, state: dict[str, Tensor]) -> Tensor:
        """The fp32 weight that the bf16 ``param`` and its codes stand for."""
        return refw.ecc8_decode(param, state[WEIGHT_ECC].view(param.shape))

    # ------------------------------------------------------------------ the write
    def apply_(self, param2d: Tensor, update2d: Tensor, state2d: dict[str, Tensor], *, alpha: float | Tensor,
               decay: float | Tensor, skip: Tensor | None = None) -> None:
        """``param, codes <- decay * master + alpha * update`` (2-D views of matching shape); nothing is
        written when the one-element device flag ``skip`` is True. ``alpha`` / ``decay`` may be 0-d fp32
        tensors on the device (a capturable step): the op's reference then runs, bit for bit the kernel."""
        if isinstance(alpha, torch.Tensor) or isinstance(decay, torch.Tensor):
            ecc = state2d[WEIGHT_ECC]
            x = refw.new_weight_fp32(refw.ecc8_decode(param2d, ecc), update2d, alpha, decay)
            wb = refw.nearest_bf16(x)
            codes = refw.ecc8_encode(x, wb)
            if skip is not None:
                keep = skip.reshape(())
                wb, codes = torch.where(keep, param2d, wb), torch.where(keep, ecc, codes)
            ecc.copy_(codes)
            param2d.copy_(wb)
            return
        torch.ops.qmuon.bf16_ecc8_weight_update_(param2d, state2d[WEIGHT_ECC], update2d, alpha, decay, skip)

    def nbytes(self, rows, cols, opts):
        return rows * cols


FORMATS = (Ecc8WeightFormat(),)
