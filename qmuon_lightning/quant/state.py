"""Momentum state formats: what tensors each format stores, and how to create, read, convert and
validate them.

A Muon parameter's optimizer state is a plain ``dict[str, Tensor]`` (so ``state_dict()`` is
loadable with ``torch.load(weights_only=True)`` and sharding code can treat every entry as a tensor
with rows along dim 0):

========  =============================================================  =====================
format    tensors                                                        bytes per element
========  =============================================================  =====================
fp32      ``momentum_buffer`` fp32 (same key as ``torch.optim.Muon``)     4
bf16      ``momentum_buffer`` bf16                                        2
int8      ``momentum_codes`` int8 + ``momentum_absmax`` fp32 row blocks   1 + 4 / block_size
uint8     ``momentum_codes`` uint8 (zero at 128) + ``momentum_absmax``    1 + 4 / block_size
========  =============================================================  =====================

Every format also keeps ``step`` (a 0-d fp32 tensor, as ``torch.optim.Adam`` does), which seeds
stochastic rounding so that a resumed run draws the same noise as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..ops import reference as ref

__all__ = [
    "STATE_FORMATS",
    "FormatSpec",
    "format_spec",
    "init_momentum_state",
    "detect_state_format",
    "dequantize_momentum",
    "encode_momentum",
    "validate_momentum_state",
    "state_nbytes",
    "StateFormatError",
]

BUFFER = "momentum_buffer"
CODES = "momentum_codes"
ABSMAX = "momentum_absmax"
STEP = "step"


class StateFormatError(ValueError):
    """A momentum state that does not match what the optimizer expects."""


@dataclass(frozen=True)
class FormatSpec:
    name: str
    kind: str  # "dense" or "q8"
    dtype: torch.dtype  # storage dtype of the buffer / codes
    keys: tuple[str, ...]


_SPECS = {
    "fp32": FormatSpec("fp32", "dense", torch.float32, (BUFFER,)),
    "bf16": FormatSpec("bf16", "dense", torch.bfloat16, (BUFFER,)),
    "int8": FormatSpec("int8", "q8", torch.int8, (CODES, ABSMAX)),
    "uint8": FormatSpec("uint8", "q8", torch.uint8, (CODES, ABSMAX)),
}
STATE_FORMATS: tuple[str, ...] = tuple(_SPECS)


def format_spec(name: str) -> FormatSpec:
    try:
        return _SPECS[name]
    except KeyError:
        raise StateFormatError(
            f"unknown state_format {name!r}; choose one of {', '.join(STATE_FORMATS)}"
        ) from None


def init_momentum_state(
    state_format: str, rows: int, cols: int, *, block_size: int, device: torch.device
) -> dict[str, Tensor]:
    """Zero momentum for a ``rows x cols`` matrix."""
    spec = format_spec(state_format)
    st: dict[str, Tensor] = {STEP: torch.zeros((), dtype=torch.float32)}
    if spec.kind == "dense":
        st[BUFFER] = torch.zeros((rows, cols), dtype=spec.dtype, device=device)
    else:
        zero = 0 if spec.dtype == torch.int8 else 128
        st[CODES] = torch.full((rows, cols), zero, dtype=spec.dtype, device=device)
        st[ABSMAX] = torch.zeros((rows, ref.num_blocks(cols, block_size)), dtype=torch.float32, device=device)
    return st


def detect_state_format(state: dict[str, Tensor]) -> str:
    """Which format a loaded state dict entry is in, from its keys and dtypes."""
    if BUFFER in state:
        dt = state[BUFFER].dtype
        for name in ("fp32", "bf16"):
            if _SPECS[name].dtype == dt:
                return name
        raise StateFormatError(f"momentum_buffer has dtype {dt}; expected float32 or bfloat16")
    if CODES in state:
        if ABSMAX not in state:
            raise StateFormatError("momentum_codes present without momentum_absmax; the checkpoint is incomplete")
        dt = state[CODES].dtype
        for name in ("int8", "uint8"):
            if _SPECS[name].dtype == dt:
                return name
        raise StateFormatError(f"momentum_codes has dtype {dt}; expected int8 or uint8")
    raise StateFormatError(f"no momentum tensors in state (keys: {sorted(state)})")


def dequantize_momentum(state: dict[str, Tensor], block_size: int) -> Tensor:
    """fp32 momentum of any format."""
    fmt = detect_state_format(state)
    if format_spec(fmt).kind == "dense":
        return state[BUFFER].float()
    return torch.ops.qmuon.dequantize_rows(state[CODES], state[ABSMAX], block_size)


def encode_momentum(m: Tensor, state_format: str, *, block_size: int) -> dict[str, Tensor]:
    """fp32 momentum -> the tensors of ``state_format`` (nearest rounding)."""
    spec = format_spec(state_format)
    if spec.kind == "dense":
        return {BUFFER: m.to(spec.dtype).contiguous()}
    codes, absmax = torch.ops.qmuon.quantize_rows(m.float().contiguous(), block_size, spec.dtype == torch.int8, -1, 0)
    return {CODES: codes, ABSMAX: absmax}


def validate_momentum_state(
    state: dict[str, Tensor], state_format: str, rows: int, cols: int, block_size: int, where: str
) -> None:
    """Raise :class:`StateFormatError` naming the problem and the fix."""
    spec = format_spec(state_format)
    found = detect_state_format(state)
    if found != state_format:
        raise StateFormatError(f"{where}: state is {found} but the parameter group uses {state_format}")
    if spec.kind == "dense":
        shape = tuple(state[BUFFER].shape)
        if shape != (rows, cols):
            raise StateFormatError(
                f"{where}: momentum_buffer has shape {shape} but the parameter is {rows}x{cols}; "
                "the checkpoint belongs to a different model or parameter order"
            )
        return
    cshape, ashape = tuple(state[CODES].shape), tuple(state[ABSMAX].shape)
    if cshape != (rows, cols):
        raise StateFormatError(
            f"{where}: momentum_codes has shape {cshape} but the parameter is {rows}x{cols}; "
            "the checkpoint belongs to a different model or parameter order"
        )
    want = (rows, ref.num_blocks(cols, block_size))
    if ashape != want:
        raise StateFormatError(
            f"{where}: momentum_absmax has shape {ashape}, expected {want} for block_size={block_size}"
        )
    if state[ABSMAX].dtype != torch.float32:
        raise StateFormatError(f"{where}: momentum_absmax must be float32, got {state[ABSMAX].dtype}")


def state_nbytes(state: dict[str, Tensor]) -> int:
    """Bytes held by every tensor in one parameter's state."""
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, Tensor))
