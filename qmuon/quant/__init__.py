"""State representations built on :mod:`qmuon.ops`: every momentum format behind one
interface (:class:`StateFormat`, one module per format in :mod:`.formats`, a registry
:data:`FORMATS` in :mod:`.registry`): which tensors it stores, how they are created, updated
(single-process and row-sharded), split over ``Shard(0)`` row shards (:mod:`.layout`), converted,
validated and counted; GRASP's factor tracking (:mod:`.formats.grasp4`); the update-fidelity
metric (:mod:`.fidelity`); and the MXFP8 codec / Newton-Schulz input carrier (:mod:`.mxfp8`)."""

from . import state as _state
from .mxfp8 import MXFP8Carrier, mxfp8_decode, mxfp8_encode, mxfp8_roundtrip_normalized
from .state import *  # noqa: F401,F403  (formats, registry, helpers: see quant.state)

__all__ = [*_state.__all__, "MXFP8Carrier", "mxfp8_decode", "mxfp8_encode", "mxfp8_roundtrip_normalized"]
