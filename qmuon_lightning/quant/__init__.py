"""State representations built on :mod:`qmuon_lightning.ops`: every momentum format behind one
interface (:class:`StateFormat`, one module per format in :mod:`.formats`, a registry
:data:`FORMATS` in :mod:`.registry`): which tensors it stores, how they are created, updated
(single-process and row-sharded), split over ``Shard(0)`` row shards (:mod:`.layout`), converted,
validated and counted; GRASP's factor tracking (:mod:`.formats.grasp4`, also importable as
:mod:`.grasp`); the update-fidelity metric (:mod:`.fidelity`); and the MXFP8 codec / Newton-Schulz
input carrier (:mod:`.mxfp8`)."""

from .mxfp8 import (
    MXFP8Carrier,
    mxfp8_decode,
    mxfp8_encode,
    mxfp8_encode_normalized,
    mxfp8_nbytes,
    mxfp8_roundtrip_normalized,
)

from .state import (
    COLLECTIVE_FORMATS,
    DEFAULT_BLOCK_SIZE,
    FORMATS,
    PLACEMENTS,
    STATE_FORMATS,
    SUPPORTED_SHARDED_FORMATS,
    FormatOptions,
    FormatSpec,
    StateFormat,
    StateFormatError,
    convert_state,
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
    unregister_format,
    validate_momentum_state,
)

__all__ = [
    "COLLECTIVE_FORMATS",
    "DEFAULT_BLOCK_SIZE",
    "FORMATS",
    "PLACEMENTS",
    "STATE_FORMATS",
    "SUPPORTED_SHARDED_FORMATS",
    "FormatOptions",
    "FormatSpec",
    "MXFP8Carrier",
    "StateFormat",
    "StateFormatError",
    "convert_state",
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
    "unregister_format",
    "validate_momentum_state",
]
