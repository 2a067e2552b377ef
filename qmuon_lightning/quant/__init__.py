"""State representations built on :mod:`qmuon_lightning.ops`: which tensors each momentum format
stores, and how they are created, converted, validated and counted."""

from .state import (
    STATE_FORMATS,
    FormatSpec,
    StateFormatError,
    dequantize_momentum,
    detect_state_format,
    encode_momentum,
    format_spec,
    init_momentum_state,
    state_nbytes,
    validate_momentum_state,
)

__all__ = [
    "STATE_FORMATS",
    "FormatSpec",
    "StateFormatError",
    "dequantize_momentum",
    "detect_state_format",
    "encode_momentum",
    "format_spec",
    "init_momentum_state",
    "state_nbytes",
    "validate_momentum_state",
]
