"""One module per momentum storage format; each defines ``FORMATS = (instance, ...)``.

=========  ==================================================================  ======================
module     formats                                                             bytes per element
=========  ==================================================================  ======================
dense      ``fp32``, ``bf16``: ``momentum_buffer``                              4 / 2
int8       ``int8``, ``uint8``: codes + fp32 absmax per ``block_size``           1 + 4 / block_size
int4       ``int4``: packed 4-bit codes + fp32 absmax per ``block_size``          0.5 + 4 / block_size
e0m3       ``e0m3``: packed E0M3 + UE4M3 per 16 + fp32 tensor scale              0.5 + 1 / 16 (+ 4 B)
grasp4     ``grasp4``: 8-bit rank-k factors + grid-quantized 4-bit residual       see :mod:`.grasp4`
=========  ==================================================================  ======================

:func:`builtin_formats` imports every module of this package (except :mod:`.base`) and returns
their formats sorted by :attr:`~.base.StateFormat.order`; the registry
(:mod:`qmuon.quant.registry`) registers them. Adding a format is adding a module here.
Importing this package imports no format module.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import StateFormat

__all__: list[str] = []


def builtin_formats() -> list[StateFormat]:
    found: list[StateFormat] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.name == "base":
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        found.extend(getattr(mod, "FORMATS", ()))
    return sorted(found, key=lambda f: f.order)  # stable: a module's formats keep their order
