"""State representations built on :mod:`qmuon_lightning.ops`: which tensors each momentum format
stores (a registry of format classes, :data:`FORMATS`), how they are created, updated, converted,
validated and counted; GRASP's factor tracking (:mod:`.grasp`); the update-fidelity metric
(:mod:`.fidelity`); and the MXFP8 codec / Newton-Schulz input carrier (:mod:`.mxfp8`)."""

from .mxfp8 import (
    MXFP8Carrier,
    mxfp8_decode,
    mxfp8_encode,
    mxfp8_encode_normalized,
    mxfp8_nbytes,
    mxfp8_roundtrip_normalized,
)

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
    "MXFP8Carrier",
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
    "mxfp8_decode",
    "mxfp8_encode",
    "mxfp8_encode_normalized",
    "mxfp8_nbytes",
    "mxfp8_roundtrip_normalized",
    "register_format",
    "state_nbytes",
    "validate_momentum_state",
]
