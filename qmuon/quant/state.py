"""Momentum state formats: the public face of :mod:`.registry` and :mod:`.formats`.

A Muon parameter's optimizer state is a plain ``dict[str, Tensor]`` (so ``state_dict()`` is
loadable with ``torch.load(weights_only=True)``): the tensors of its format plus ``step`` (a 0-d
fp32 tensor, as ``torch.optim.Adam`` keeps, which seeds stochastic rounding so that a resumed run
draws the same noise as an uninterrupted one).

========  ==========================================================================  ======================
format    tensors                                                                     bytes per element
========  ==========================================================================  ======================
fp32      ``momentum_buffer`` fp32 (same key as ``torch.optim.Muon``)                  4
bf16      ``momentum_buffer`` bf16                                                     2
int8      ``momentum_codes`` int8 + ``momentum_absmax`` fp32 row blocks                1 + 4 / block_size
uint8     ``momentum_codes`` uint8 (zero at 128) + ``momentum_absmax``                 1 + 4 / block_size
int4      ``momentum_packed`` uint8 (2 codes / byte) + ``momentum_absmax`` fp32        0.5 + 4 / block_size
e0m3      ``momentum_packed`` + ``momentum_ue4m3`` uint8 per 16 + ``momentum_tensor_   0.5 + 1 / 16 (+ 4 B)
          scale`` fp32 0-d
grasp4    8-bit factors P (rows x k), R (cols x k) with bf16 per-row absmax, 4-bit     see :mod:`.formats.grasp4`
          grid-quantized residual with UE4M3 tile row / column maxima
========  ==========================================================================  ======================

Each format is a :class:`StateFormat` (:mod:`.formats.base` documents the interface: codec,
single-process and sharded update, per-key placement over row shards, layout checks, byte counts)
in :data:`FORMATS`. ``opts`` is a :class:`FormatOptions` (``block_size``, ``rank``, ``grid_block``)
taken from the parameter group (:func:`format_options`). :class:`~qmuon.QMuon` only talks
to the registry; :func:`convert_state` holds the conversion and resume-compatibility rules.
"""

from __future__ import annotations

from . import registry as _registry
from .formats import base as _base
from .formats.base import *  # noqa: F401,F403  (the interface and the state-key constants)
from .formats.dense import DenseFormat
from .formats.e0m3 import E0M3Format
from .formats.grasp4 import Grasp4Format
from .formats.int4 import Int4Format
from .formats.int8 import Q8Format
from .registry import *  # noqa: F401,F403  (the registry and the format-agnostic helpers)

__all__ = [*_base.__all__, *_registry.__all__, "DenseFormat", "E0M3Format", "Grasp4Format", "Int4Format", "Q8Format"]
