"""GRASP 4-bit momentum: kept importable for existing code; the maths, the format and its sharded
update live in :mod:`qmuon.quant.formats.grasp4`."""

from .formats.grasp4 import (  # noqa: F401
    CONVERT_ITERS,
    DEFAULT_GRID_BLOCK,
    DEFAULT_RANK,
    GRID_COL,
    GRID_ROW,
    GRID_SCALE,
    P_ABSMAX,
    P_CODES,
    R_ABSMAX,
    R_CODES,
    Grasp4Format,
    _col_normalize,
    _random_q,
    _rank,
    _substream,
    dq8_rows,
    grasp_decode,
    grasp_encode,
    grasp_factors,
    power_iteration,
    q8_rows,
)

__all__ = ["Grasp4Format", "power_iteration", "grasp_encode", "grasp_decode", "grasp_factors", "DEFAULT_RANK",
           "DEFAULT_GRID_BLOCK"]
