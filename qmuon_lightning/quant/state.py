"""Momentum state formats: a small registry of format classes, one per storage kind.

A Muon parameter's optimizer state is a plain ``dict[str, Tensor]`` (so ``state_dict()`` is
loadable with ``torch.load(weights_only=True)`` and sharding code can treat every entry as a tensor
with rows along dim 0, except where noted):

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
grasp4    8-bit factors P (rows x k), R (cols x k) with fp32 per-row absmax, 4-bit     see :mod:`.grasp`
          grid-quantized residual with bf16 tile row / column maxima
========  ==========================================================================  ======================

Every format also keeps ``step`` (a 0-d fp32 tensor, as ``torch.optim.Adam`` does), which seeds
stochastic rounding so that a resumed run draws the same noise as an uninterrupted one.

Registry
--------
Each format is a :class:`StateFormat` instance in :data:`FORMATS` with

* ``init(rows, cols, opts, device)`` -> zero state tensors,
* ``update(states, grads2d, block_sums, *, beta, nesterov, opts, streams, offsets, keys, seed)``:
  the fused multi-tensor momentum update (writes the Newton-Schulz input into ``grads2d`` and the
  per-row-block sums of squares into ``block_sums``),
* ``dequantize(state, opts)`` -> fp32 momentum, ``encode(m, opts)`` -> state tensors,
* ``validate(state, rows, cols, opts, where)``, ``nbytes(rows, cols, opts)``, ``owns(state)``
  (whether a loaded state dict is in this format).

``opts`` is a :class:`FormatOptions` (``block_size``, ``rank``, ``grid_block``) taken from the
parameter group (:func:`format_options`). :class:`~qmuon_lightning.QMuon` only talks to the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from ..ops import QuantizedMuonState
from ..ops import reference as ref
from ..ops import reference_4bit as ref4

__all__ = [
    "STATE_FORMATS",
    "FORMATS",
    "FormatSpec",
    "FormatOptions",
    "StateFormat",
    "format_spec",
    "get_format",
    "format_options",
    "register_format",
    "init_momentum_state",
    "detect_state_format",
    "dequantize_momentum",
    "encode_momentum",
    "validate_momentum_state",
    "state_nbytes",
    "momentum_nbytes",
    "StateFormatError",
    "DEFAULT_BLOCK_SIZE",
]

BUFFER = "momentum_buffer"
CODES = "momentum_codes"
ABSMAX = "momentum_absmax"
PACKED = "momentum_packed"
UE4M3 = "momentum_ue4m3"
TSCALE = "momentum_tensor_scale"
STEP = "step"

#: Default ``block_size`` per format when the group does not set one. 8-bit: 256 (bitsandbytes,
#: torchao). int4: 128 (torchao's 4-bit Adam block; 4 B absmax per 128 elements = 0.03125 B/elem on
#: top of 0.5). e0m3 and grasp4 store no absmax blocks (per-16 UE4M3 scales / grid tiles), so their
#: ``block_size`` only sets the granularity of the norm sums and stays 256.
DEFAULT_BLOCK_SIZE = {"fp32": 256, "bf16": 256, "int8": 256, "uint8": 256, "int4": 128, "e0m3": 256, "grasp4": 256}


class StateFormatError(ValueError):
    """A momentum state that does not match what the optimizer expects."""


@dataclass(frozen=True)
class FormatSpec:
    name: str
    kind: str  # "dense", "q8", "q4", "e0m3", "grasp4"
    dtype: torch.dtype  # storage dtype of the buffer / codes
    keys: tuple[str, ...]


@dataclass(frozen=True)
class FormatOptions:
    block_size: int = 256
    rank: int = 4
    grid_block: int = 32


def format_options(group: dict[str, Any]) -> FormatOptions:
    """The layout-relevant options of a parameter group (or a saved group, with defaults)."""
    fmt = group.get("state_format", "int8")
    bs = group.get("block_size")
    return FormatOptions(
        block_size=int(bs) if bs is not None else DEFAULT_BLOCK_SIZE.get(fmt, 256),
        rank=group["rank"] if group.get("rank") is not None else 4,
        grid_block=group["grid_block"] if group.get("grid_block") is not None else 32,
    )


def _shape_error(where: str, key: str, got: tuple, want: tuple, hint: str) -> StateFormatError:
    return StateFormatError(f"{where}: {key} has shape {got}, expected {want}{hint}")


class StateFormat:
    """Base class of a momentum storage format (see the module docstring for the protocol)."""

    spec: FormatSpec
    #: whether ``block_size`` is part of the stored layout (checkpoints must match it)
    uses_block_size: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    def init(self, rows: int, cols: int, opts: FormatOptions, device: torch.device) -> dict[str, Tensor]:
        raise NotImplementedError

    def update(self, states: Sequence[dict[str, Tensor]], grads2d: list[Tensor], block_sums: list[Tensor], *,
               beta: float, nesterov: bool, opts: FormatOptions, streams: list[int], offsets: list[int],
               keys: list[int], seed: int) -> None:
        raise NotImplementedError

    def dequantize(self, state: dict[str, Tensor], opts: FormatOptions, cols: int | None = None) -> Tensor:
        """fp32 momentum; ``cols`` is needed only by packed formats with an odd column count."""
        raise NotImplementedError

    def encode(self, m: Tensor, opts: FormatOptions) -> dict[str, Tensor]:
        raise NotImplementedError

    def owns(self, state: dict[str, Tensor]) -> bool:
        raise NotImplementedError

    def validate(self, state: dict[str, Tensor], rows: int, cols: int, opts: FormatOptions, where: str) -> None:
        raise NotImplementedError

    def validate_options(self, opts: FormatOptions) -> None:
        """Raise ``ValueError`` for options this format cannot use."""

    def nbytes(self, rows: int, cols: int, opts: FormatOptions) -> int:
        """Bytes of the momentum tensors (``step`` excluded) for a ``rows x cols`` matrix."""
        st = self.init(rows, cols, opts, torch.device("meta"))
        return sum(t.numel() * t.element_size() for k, t in st.items() if k != STEP)

    # helpers
    @staticmethod
    def _check(state: dict[str, Tensor], key: str, shape: tuple, dtype: torch.dtype, where: str, hint: str = "") -> None:
        t = state[key]
        if tuple(t.shape) != tuple(shape):
            if key in (BUFFER, CODES):
                raise StateFormatError(
                    f"{where}: {key} has shape {tuple(t.shape)} but the parameter is {shape[0]}x{shape[1]}; "
                    "the checkpoint belongs to a different model or parameter order")
            raise _shape_error(where, key, tuple(t.shape), tuple(shape), hint)
        if t.dtype != dtype:
            raise StateFormatError(f"{where}: {key} must be {str(dtype).replace('torch.', '')}, got {t.dtype}")


class DenseFormat(StateFormat):
    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.spec = FormatSpec(name, "dense", dtype, (BUFFER,))

    def init(self, rows, cols, opts, device):
        return {BUFFER: torch.zeros((rows, cols), dtype=self.spec.dtype, device=device)}

    def update(self, states, grads2d, block_sums, *, beta, nesterov, opts, streams, offsets, keys, seed):
        torch.ops.qmuon.dense_momentum_update_multi_(
            [s[BUFFER] for s in states], grads2d, block_sums, beta, nesterov, opts.block_size, streams, offsets)

    def dequantize(self, state, opts, cols=None):
        return state[BUFFER].float()

    def encode(self, m, opts):
        return {BUFFER: m.to(self.spec.dtype).contiguous()}

    def owns(self, state):
        return BUFFER in state and state[BUFFER].dtype == self.spec.dtype

    def validate(self, state, rows, cols, opts, where):
        shape = tuple(state[BUFFER].shape)
        if shape != (rows, cols):
            raise StateFormatError(
                f"{where}: momentum_buffer has shape {shape} but the parameter is {rows}x{cols}; "
                "the checkpoint belongs to a different model or parameter order"
            )


class Q8Format(StateFormat):
    uses_block_size = True

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.spec = FormatSpec(name, "q8", dtype, (CODES, ABSMAX))

    def init(self, rows, cols, opts, device):
        zero = QuantizedMuonState.zeros(rows, cols, dtype=self.spec.dtype, block_size=opts.block_size, device=device)
        return {CODES: zero.data, ABSMAX: zero.absmax}

    def update(self, states, grads2d, block_sums, *, beta, nesterov, opts, streams, offsets, keys, seed):
        torch.ops.qmuon.q8_momentum_update_multi_(
            [s[CODES] for s in states], [s[ABSMAX] for s in states], grads2d, block_sums,
            beta, nesterov, opts.block_size, streams, offsets)

    def dequantize(self, state, opts, cols=None):
        return torch.ops.qmuon.dequantize_rows(state[CODES], state[ABSMAX], opts.block_size)

    def encode(self, m, opts):
        codes, absmax = torch.ops.qmuon.quantize_rows(
            m.float().contiguous(), opts.block_size, self.spec.dtype == torch.int8, -1, 0)
        return {CODES: codes, ABSMAX: absmax}

    def owns(self, state):
        return CODES in state and state[CODES].dtype == self.spec.dtype

    def validate(self, state, rows, cols, opts, where):
        self._check(state, CODES, (rows, cols), self.spec.dtype, where)
        self._check(state, ABSMAX, (rows, ref.num_blocks(cols, opts.block_size)), torch.float32, where,
                    f" for block_size={opts.block_size}")


class Int4Format(StateFormat):
    """Naive blockwise absmax 4-bit: the baseline GRASP has to beat."""

    uses_block_size = True
    spec = FormatSpec("int4", "q4", torch.uint8, (PACKED, ABSMAX))

    def init(self, rows, cols, opts, device):
        return {PACKED: torch.zeros((rows, ref4.packed_cols(cols)), dtype=torch.uint8, device=device),
                ABSMAX: torch.zeros((rows, ref.num_blocks(cols, opts.block_size)), dtype=torch.float32, device=device)}

    def update(self, states, grads2d, block_sums, *, beta, nesterov, opts, streams, offsets, keys, seed):
        torch.ops.qmuon.int4_momentum_update_multi_(
            [s[PACKED] for s in states], [s[ABSMAX] for s in states], grads2d, block_sums,
            beta, nesterov, opts.block_size, streams, offsets)

    def dequantize(self, state, opts, cols=None):
        cols = 2 * state[PACKED].shape[1] if cols is None else cols
        return torch.ops.qmuon.int4_dequantize(state[PACKED], state[ABSMAX], opts.block_size, cols)

    def encode(self, m, opts):
        packed, absmax = torch.ops.qmuon.int4_quantize(m.float().contiguous(), opts.block_size, -1, 0)
        return {PACKED: packed, ABSMAX: absmax}

    def owns(self, state):
        return PACKED in state and ABSMAX in state and UE4M3 not in state

    def validate(self, state, rows, cols, opts, where):
        self._check(state, PACKED, (rows, ref4.packed_cols(cols)), torch.uint8, where,
                    f" for a {rows}x{cols} parameter (two 4-bit codes per byte)")
        self._check(state, ABSMAX, (rows, ref.num_blocks(cols, opts.block_size)), torch.float32, where,
                    f" for block_size={opts.block_size}")


class E0M3Format(StateFormat):
    """E0M3 elements, UE4M3 scales per 16 elements, fp32 per-tensor scale (two-level scaling).

    The tensor scale is the one piece that is not row-local: under row sharding its max needs an
    all-reduce (MAX) before quantization.
    """

    spec = FormatSpec("e0m3", "e0m3", torch.uint8, (PACKED, UE4M3, TSCALE))

    def init(self, rows, cols, opts, device):
        return {PACKED: torch.zeros((rows, ref4.packed_cols(cols)), dtype=torch.uint8, device=device),
                UE4M3: torch.zeros((rows, ref4.e0m3_num_blocks(cols)), dtype=torch.uint8, device=device),
                TSCALE: torch.ones((), dtype=torch.float32, device=device)}

    def update(self, states, grads2d, block_sums, *, beta, nesterov, opts, streams, offsets, keys, seed):
        torch.ops.qmuon.e0m3_momentum_update_multi_(
            [s[PACKED] for s in states], [s[UE4M3] for s in states], [s[TSCALE] for s in states],
            grads2d, block_sums, beta, nesterov, opts.block_size, streams, offsets)

    def dequantize(self, state, opts, cols=None):
        cols = 2 * state[PACKED].shape[1] if cols is None else cols
        return torch.ops.qmuon.e0m3_dequantize(state[PACKED], state[UE4M3], state[TSCALE], cols)

    def encode(self, m, opts):
        packed, scales, t = torch.ops.qmuon.e0m3_quantize(m.float().contiguous(), True, -1, 0)
        return {PACKED: packed, UE4M3: scales, TSCALE: t}

    def owns(self, state):
        return UE4M3 in state

    def validate(self, state, rows, cols, opts, where):
        for k in self.spec.keys:
            if k not in state:
                raise StateFormatError(f"{where}: e0m3 state lacks {k}; the checkpoint is incomplete")
        self._check(state, PACKED, (rows, ref4.packed_cols(cols)), torch.uint8, where,
                    f" for a {rows}x{cols} parameter (two 4-bit codes per byte)")
        self._check(state, UE4M3, (rows, ref4.e0m3_num_blocks(cols)), torch.uint8, where,
                    " (one UE4M3 scale per 16 elements of a row)")
        self._check(state, TSCALE, (), torch.float32, where)


FORMATS: dict[str, StateFormat] = {}


def register_format(fmt: StateFormat) -> StateFormat:
    FORMATS[fmt.name] = fmt
    return fmt


for _f in (DenseFormat("fp32", torch.float32), DenseFormat("bf16", torch.bfloat16),
           Q8Format("int8", torch.int8), Q8Format("uint8", torch.uint8), Int4Format(), E0M3Format()):
    register_format(_f)

from .grasp import Grasp4Format  # noqa: E402  (needs the base class above)

register_format(Grasp4Format())

STATE_FORMATS: tuple[str, ...] = tuple(FORMATS)


def get_format(name: str) -> StateFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise StateFormatError(
            f"unknown state_format {name!r}; choose one of {', '.join(STATE_FORMATS)}"
        ) from None


def format_spec(name: str) -> FormatSpec:
    return get_format(name).spec


def _opts(block_size: int | None, opts: FormatOptions | None, fmt: str | None = None, **kw) -> FormatOptions:
    if opts is not None:
        return opts
    bs = block_size if block_size is not None else DEFAULT_BLOCK_SIZE.get(fmt or "", 256)
    return FormatOptions(block_size=bs, **{k: v for k, v in kw.items() if v is not None})


def init_momentum_state(
    state_format: str, rows: int, cols: int, *, block_size: int | None = None, device: torch.device,
    opts: FormatOptions | None = None,
) -> dict[str, Tensor]:
    """Zero momentum for a ``rows x cols`` matrix (plus ``step``)."""
    st: dict[str, Tensor] = {STEP: torch.zeros((), dtype=torch.float32)}
    st.update(get_format(state_format).init(rows, cols, _opts(block_size, opts, state_format), device))
    return st


def detect_state_format(state: dict[str, Tensor]) -> str:
    """Which format a loaded state dict entry is in, from its keys and dtypes."""
    if BUFFER in state:
        dt = state[BUFFER].dtype
        for name in ("fp32", "bf16"):
            if FORMATS[name].owns(state):
                return name
        raise StateFormatError(f"momentum_buffer has dtype {dt}; expected float32 or bfloat16")
    if CODES in state:
        if ABSMAX not in state:
            raise StateFormatError("momentum_codes present without momentum_absmax; the checkpoint is incomplete")
        dt = state[CODES].dtype
        for name in ("int8", "uint8"):
            if FORMATS[name].owns(state):
                return name
        raise StateFormatError(f"momentum_codes has dtype {dt}; expected int8 or uint8")
    for name in ("grasp4", "e0m3", "int4"):
        if FORMATS[name].owns(state):
            return name
    if PACKED in state:
        raise StateFormatError("momentum_packed present without its scales; the checkpoint is incomplete")
    raise StateFormatError(f"no momentum tensors in state (keys: {sorted(state)})")


def dequantize_momentum(state: dict[str, Tensor], block_size: int | None = None, *,
                        opts: FormatOptions | None = None, grid_block: int | None = None,
                        cols: int | None = None) -> Tensor:
    """fp32 momentum of any format (``cols``: the matrix's column count, needed by packed 4-bit
    formats when it is odd)."""
    fmt = detect_state_format(state)
    return get_format(fmt).dequantize(state, _opts(block_size, opts, fmt, grid_block=grid_block), cols)


def encode_momentum(m: Tensor, state_format: str, *, block_size: int | None = None,
                    opts: FormatOptions | None = None) -> dict[str, Tensor]:
    """fp32 momentum -> the tensors of ``state_format`` (nearest rounding)."""
    return get_format(state_format).encode(m, _opts(block_size, opts, state_format))


def validate_momentum_state(
    state: dict[str, Tensor], state_format: str, rows: int, cols: int, block_size: int | None, where: str,
    opts: FormatOptions | None = None,
) -> None:
    """Raise :class:`StateFormatError` naming the problem and the fix."""
    fmt = get_format(state_format)
    found = detect_state_format(state)
    if found != state_format:
        raise StateFormatError(f"{where}: state is {found} but the parameter group uses {state_format}")
    fmt.validate(state, rows, cols, _opts(block_size, opts, state_format), where)


def state_nbytes(state: dict[str, Tensor]) -> int:
    """Bytes held *on this rank* by every tensor in one parameter's state.

    Sharded state (a ``DTensor``, as kept for FSDP2 parameters) counts its local shard, not the
    global tensor: the point of sharding is that no rank holds the whole momentum.
    """
    total = 0
    for t in state.values():
        if isinstance(t, Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def momentum_nbytes(state_format: str, rows: int, cols: int, opts: FormatOptions | None = None) -> int:
    """Bytes of the momentum tensors of a ``rows x cols`` matrix in ``state_format`` (``step`` excluded)."""
    return get_format(state_format).nbytes(rows, cols, opts or FormatOptions(DEFAULT_BLOCK_SIZE.get(state_format, 256)))
