"""State representations built on :mod:`qmuon_lightning.ops`: which tensors each momentum format
stores (a registry of format classes, :data:`FORMATS`), how they are created, updated, converted,
validated and counted; GRASP's factor tracking (:mod:`.grasp`); and the update-fidelity metric
(:mod:`.fidelity`)."""

from .state import (
    DEFAULT_BLOCK_SIZE,
    FORMATS,
    STATE_FORMATS,
    FormatOptions,
    FormatSpec,
    StateFormat,
    StateFormatError,
    dequantize_momentum,
    detect_state_format,
    encode_momentum,
    format_options,
    format_spec,
    get_format,
    init_momentum_state,
    momentum_nbytes,
    register_format,
    state_nbytes,
    validate_momentum_state,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "FORMATS",
    "STATE_FORMATS",
    "FormatOptions",
    "FormatSpec",
    "StateFormat",
    "StateFormatError",
    "dequantize_momentum",
    "detect_state_format",
    "encode_momentum",
    "format_options",
    "format_spec",
    "get_format",
    "init_momentum_state",
    "momentum_nbytes",
    "register_format",
    "state_nbytes",
    "validate_momentum_state",
]
