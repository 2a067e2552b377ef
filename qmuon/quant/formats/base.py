"""The interface every momentum storage format implements (:class:`StateFormat`), its options
(:class:`FormatOptions`), the state-key constants shared by several formats, and
:class:`StateFormatError`.

A Muon parameter's optimizer state is a plain ``dict[str, Tensor]`` (so ``state_dict()`` loads with
``torch.load(weights_only=True)``): the format's tensors (``spec.keys``) plus ``step``, a 0-d fp32
tensor that seeds stochastic rounding. Nothing outside :mod:`qmuon.quant` (and the kernel
layer :mod:`qmuon.ops`) looks at a format's name or keys: the optimizer, the sharded step
and the checkpoint code ask the format object.

What a format declares
----------------------
* ``spec``: name, kind (formats of one kind are the same layout at another dtype: ``int8`` /
  ``uint8``; resuming across them needs the same :attr:`~StateFormat.layout_options`), storage
  dtype and state keys;
* ``default_block_size`` and ``layout_options``: the :class:`FormatOptions` fields that are part of
  the stored layout (a checkpoint resumes in the same format only with the same values);
* ``role``: which stored tensor the format is for: ``"momentum"`` (Muon's, the default),
  ``"adamw_m"`` / ``"adamw_v"`` (the first / second moment of the auxiliary AdamW, see
  :mod:`qmuon.quant.adamw`); every registry helper that picks a Muon format looks only at
  ``"momentum"`` formats, so one registry holds them all;
* ``order``: position in the registry (listing order, detection order);
* ``promotes_to`` and ``guard_threshold``: the fidelity guard's next safer format and the update
  cosine below which a layer in this format counts as drifting;
* the codec: ``init``, ``encode``, ``dequantize``, ``owns``, ``validate``, ``validate_options``,
  ``nbytes``, ``update_workspace_nbytes``, ``describe``;
* the update: ``update`` (single process, or row-local shards) and ``update_sharded`` (the local
  rows of ``Shard(0)`` DTensor parameters; collective for formats that are not ``row_local``);
* sharding: ``shardable``, ``row_local``, ``placement(key)`` (how each state tensor splits over row
  shards, see :data:`PLACEMENTS`), ``tile_rows(opts)`` (for ``"tiles"`` tensors),
  ``check_sharded_layout`` and ``convertible_when_sharded``.

A new format is one module in :mod:`qmuon.quant.formats` that defines a
``FORMATS = (instance, ...)`` tuple (picked up by the registry), or, from other code, an instance
passed to :func:`qmuon.quant.register_format`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
from torch import Tensor

__all__ = [
    "ABSMAX",
    "BUFFER",
    "CODES",
    "PACKED",
    "STEP",
    "TSCALE",
    "UE4M3",
    "MOMENTUM",
    "WEIGHT_CORRECTION",
    "WEIGHT_ECC",
    "FormatOptions",
    "FormatSpec",
    "StateFormat",
    "StateFormatError",
]

BUFFER = "momentum_buffer"
CODES = "momentum_codes"
ABSMAX = "momentum_absmax"
PACKED = "momentum_packed"
UE4M3 = "momentum_ue4m3"
TSCALE = "momentum_tensor_scale"
STEP = "step"
#: The int8 error-correction code of a bf16 weight (``bf16_update="ecc8"``; :mod:`.ecc8`).
WEIGHT_ECC = "weight_ecc"

#: :attr:`StateFormat.role` of Muon momentum formats (the ``state_format`` choices).
MOMENTUM = "momentum"
#: :attr:`StateFormat.role` of a bf16 weight's correction state (a ``bf16_update`` rule, e.g. ``ecc8``);
#: kept in the same state dict as the parameter's other state and never taken for momentum.
WEIGHT_CORRECTION = "weight_correction"

#: How one state tensor splits over the row shards of a ``Shard(0)`` parameter:
#: ``"rows"``: dim 0 is the parameter's rows (stored as a ``Shard(0)`` DTensor with the global row count);
#: ``"tiles"``: dim 0 is row tiles of :meth:`StateFormat.tile_rows` rows (``Shard(0)`` over the tiles);
#: ``"replicate"``: one per matrix, the whole tensor on every rank (a ``Replicate()`` DTensor);
#: ``"scalar"``: a 0-d tensor kept plain, identical on every rank.
PLACEMENTS = ("rows", "tiles", "replicate", "scalar")
Placement = Literal["rows", "tiles", "replicate", "scalar"]

#: The stored tensors a format can be for: Muon's momentum, AdamW's first and second moment, a bf16
#: weight's correction.
ROLES = (MOMENTUM, "adamw_m", "adamw_v", WEIGHT_CORRECTION)

#: Short labels of the layout options in :meth:`StateFormat.describe`.
_OPTION_LABELS = {"block_size": "block", "rank": "rank", "grid_block": "grid"}


class StateFormatError(ValueError):
    """An optimizer state (Muon momentum or AdamW moments) that does not match what the optimizer expects."""


@dataclass(frozen=True)
class FormatSpec:
    name: str
    kind: str  # formats of one kind share a layout at another dtype ("dense", "q8", ...)
    dtype: torch.dtype  # storage dtype of the buffer / codes
    keys: tuple[str, ...]


@dataclass(frozen=True)
class FormatOptions:
    """The layout-relevant options of a parameter group (:func:`~qmuon.quant.format_options`)."""

    block_size: int = 256
    rank: int = 4
    grid_block: int = 32


class StateFormat:
    """Base class of a momentum storage format (see the module docstring)."""

    spec: FormatSpec
    #: what the stored tensor is (:data:`ROLES`: Muon momentum, an AdamW moment, a weight correction):
    #: the momentum helpers of the registry (``STATE_FORMATS``, detection, conversion) see momentum formats only
    role: str = MOMENTUM
    #: ``block_size`` when the group does not set one (for formats without absmax blocks it only
    #: sets the granularity of the norm sums)
    default_block_size: int = 256
    #: :class:`FormatOptions` fields that are part of the stored layout: resuming a checkpoint in
    #: this format (or one of the same ``spec.kind``) needs the same values
    layout_options: tuple[str, ...] = ()
    #: whether the state of a ``Shard(0)`` parameter can be kept (see ``placement`` / ``update_sharded``)
    shardable: bool = True
    #: True when the update of a row shard needs no collectives (every state tensor is ``"rows"``)
    row_local: bool = True
    #: registry position (listing and detection order); ties keep registration order
    order: int = 100
    #: the next safer format of the fidelity guard's promotion chain (``None``: end of the chain)
    promotes_to: str | None = None
    #: per-layer update cosine (against the fp32-state update) below which the fidelity guard
    #: counts a check as unhealthy; ``None``: not guarded. Set clearly below the lowest healthy
    #: reading measured for the format (figures and source: docs/fidelity.md, "Fidelity guard").
    guard_threshold: float | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    # ------------------------------------------------------------------ codec
    def init(self, rows: int, cols: int, opts: FormatOptions, device: torch.device) -> dict[str, Tensor]:
        """Zero momentum tensors of a ``rows x cols`` matrix (``step`` excluded)."""
        raise NotImplementedError

    def dequantize(self, state: dict[str, Tensor], opts: FormatOptions, cols: int | None = None) -> Tensor:
        """fp32 momentum; ``cols`` is needed only by packed formats with an odd column count."""
        raise NotImplementedError

    def encode(self, m: Tensor, opts: FormatOptions) -> dict[str, Tensor]:
        """fp32 momentum -> this format's tensors (nearest rounding)."""
        raise NotImplementedError

    def owns(self, state: dict[str, Tensor]) -> bool:
        """Whether a loaded state dict entry is in this format (keys and dtypes, not shapes)."""
        raise NotImplementedError

    def explain_unowned(self, state: dict[str, Tensor]) -> str | None:
        """When no format owns ``state``: a message if it looks like a broken state of this format
        (a key of it present but incomplete or of the wrong dtype), else ``None``."""
        return None

    def validate(self, state: dict[str, Tensor], rows: int, cols: int, opts: FormatOptions, where: str) -> None:
        """Raise :class:`StateFormatError` naming the problem when ``state`` does not fit a
        ``rows x cols`` matrix with ``opts``."""
        raise NotImplementedError

    def validate_options(self, opts: FormatOptions) -> None:
        """Raise ``ValueError`` for options this format cannot use."""

    def nbytes(self, rows: int, cols: int, opts: FormatOptions) -> int:
        """Bytes of the momentum tensors (``step`` excluded) for a ``rows x cols`` matrix (built on
        the meta device once per shape and options: memory estimates ask for the same shapes often)."""
        cache = self.__dict__.setdefault("_nbytes_cache", {})
        key = (rows, cols, opts)
        if key not in cache:
            st = self.init(rows, cols, opts, torch.device("meta"))
            cache[key] = sum(t.numel() * t.element_size() for k, t in st.items() if k != STEP)
        return cache[key]

    def update_workspace_nbytes(self, rows: int, cols: int, opts: FormatOptions, grad_bytes: int = 4) -> int:
        """Transient bytes :meth:`update` allocates for one ``rows x cols`` matrix beyond its state,
        gradient (``grad_bytes`` per element) and block sums (the accounting model of
        :mod:`qmuon_lightning.memory`). 0 for the
        formats whose compiled kernels update the codes in place."""
        return 0

    def describe(self, opts: FormatOptions) -> str:
        """Human-readable name with the layout options, e.g. ``"int8 (block 256)"``,
        ``"grasp4 (rank 4, grid 32)"``, ``"fp32"`` (manifests, logs)."""
        if not self.layout_options:
            return self.name
        parts = ", ".join(f"{_OPTION_LABELS.get(k, k)} {getattr(opts, k)}" for k in self.layout_options)
        return f"{self.name} ({parts})"

    def layout_kwargs(self, opts: FormatOptions) -> dict[str, Any]:
        """The constructor arguments that reproduce this stored layout:
        ``{"state_format": name, <each layout option>: value}``."""
        return {"state_format": self.name, **{k: getattr(opts, k) for k in self.layout_options}}

    # ------------------------------------------------------------------ update
    def update(self, states: Sequence[dict[str, Tensor]], grads2d: list[Tensor], block_sums: list[Tensor], *,
               beta: float, nesterov: bool, opts: FormatOptions, streams: list[int], offsets: list[int],
               keys: list[int], seed: int, skip: Tensor | None = None) -> None:
        """The fused multi-tensor momentum update: ``m = beta m + (1 - beta) g`` re-encoded in place,
        the Newton-Schulz input (Nesterov blend) written into ``grads2d`` and the per-row-block
        (``opts.block_size``) sums of squares of it into ``block_sums``. ``streams``: stochastic-rounding
        streams (-1: nearest), ``offsets``: global index of each matrix's first row, ``keys``:
        parameter keys (seeding per-matrix randomness with ``seed``). ``skip``: None, or one bool flag
        per matrix on the device; a flagged matrix's state is left bit-identical (its ``grads2d`` and
        ``block_sums`` may then hold anything), without the flags being read on the host."""
        raise NotImplementedError

    def update_sharded(self, params: Sequence[Any], states: Sequence[dict[str, Tensor]], grads2d: list[Tensor],
                       block_sums: list[Tensor], *, beta: float, nesterov: bool, opts: FormatOptions,
                       streams: list[int], offsets: list[int], keys: list[int], seed: int,
                       process_group: Any) -> None:
        """:meth:`update` of the local rows of ``Shard(0)`` DTensor parameters ``params``: ``states``
        hold the local tensors (views of the DTensors' storage), ``grads2d`` the local gradient rows.
        Collective for formats that are not :attr:`row_local`: every rank of ``process_group`` calls
        it with the same parameters in the same order. Row-local formats: :meth:`update`."""
        if not self.row_local:
            raise NotImplementedError(f"{self.name}: a format that is not row_local must implement update_sharded")
        self.update(states, grads2d, block_sums, beta=beta, nesterov=nesterov, opts=opts, streams=streams,
                    offsets=offsets, keys=keys, seed=seed)

    # ------------------------------------------------------------------ sharding
    def placement(self, key: str) -> Placement:
        """How state tensor ``key`` splits over row shards (:data:`PLACEMENTS`)."""
        return "scalar" if key == STEP else "rows"

    def tile_rows(self, opts: FormatOptions) -> int:
        """Rows per tile of the ``"tiles"`` tensors."""
        raise NotImplementedError(f"{self.name} has no 'tiles' state tensors")

    def check_sharded_layout(self, layout: Any, opts: FormatOptions, where: str) -> None:
        """Raise ``ValueError`` with the fix when the row split ``layout`` (a
        :class:`qmuon.quant.layout.RowLayout`) of a sharded parameter does not suit this
        format (called before any state is created)."""

    def convertible_when_sharded(self, source_name: str) -> bool:
        """Whether momentum saved in format ``source_name`` can be converted to this format on each
        rank's rows alone (row-local encoders can; the others need the whole matrix)."""
        return self.row_local or source_name == self.name

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _check(state: dict[str, Tensor], key: str, shape: tuple, dtype: torch.dtype, where: str, hint: str = "") -> None:
        t = state[key]
        if tuple(t.shape) != tuple(shape):
            if key in (BUFFER, CODES):
                raise StateFormatError(
                    f"{where}: {key} has shape {tuple(t.shape)} but the parameter is {shape[0]}x{shape[1]}; "
                    "the checkpoint belongs to a different model or parameter order")
            raise StateFormatError(f"{where}: {key} has shape {tuple(t.shape)}, expected {tuple(shape)}{hint}")
        if t.dtype != dtype:
            raise StateFormatError(f"{where}: {key} must be {str(dtype).replace('torch.', '')}, got {t.dtype}")

    def _require_keys(self, state: dict[str, Tensor], where: str) -> None:
        for k in self.spec.keys:
            if k not in state:
                raise StateFormatError(f"{where}: {self.name} state lacks {k}; the checkpoint is incomplete")
