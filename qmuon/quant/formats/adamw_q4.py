"""4-bit AdamW moments, blockwise along rows, two codes a byte (even column in the low nibble).

* ``adamw_m_int4``: ``exp_avg_q4``, the softsign-companded ``m / absmax`` on 15 levels (-7..7) +
  ``exp_avg_absmax`` fp32;
* ``adamw_v_int4``: ``exp_avg_sq_q4``, ``v ** (1/4) / max v ** (1/4)`` on 16 levels *without a zero
  code* (``(code + 1) / 16``) + ``exp_avg_sq_absmax`` fp32. The fourth root spreads 16 levels over
  ~5 decades of ``v`` (the smallest stored ``sqrt(v)`` is ``max sqrt(v) / 256``); with no zero code a
  small ``v`` is over-estimated (a smaller step), never rounded to 0 (``1 / sqrt(v)`` would blow up).

Block 128 (torchao's 4-bit block): ``0.5 + 4 / 128`` bytes per element per moment. The maths:
:mod:`qmuon.ops.reference_adamw`.
"""

from __future__ import annotations

from ...ops import reference_adamw as refa
from .adamw_q8 import AdamWQuantFormat

__all__: list[str] = []

FORMATS = (AdamWQuantFormat("adamw_m", "int4", refa.M4, 128, order=220),
           AdamWQuantFormat("adamw_v", "int4", refa.V4, 128, order=220))
