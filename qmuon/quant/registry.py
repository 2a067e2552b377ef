"""The registry of momentum formats and the format-agnostic helpers built on it.

:data:`FORMATS` maps a name to its :class:`~.formats.base.StateFormat`; the built-in formats
(:mod:`.formats`) are registered on import, others with :func:`register_format`. Everything else
here (state creation, detection of a loaded state's format, conversion between formats with the
compatibility rules of a resume, byte counts) asks the format objects, so it holds no format names.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Iterator

import torch
from torch import Tensor

from .formats import builtin_formats
from .formats.base import MOMENTUM, STEP, WEIGHT_CORRECTION, FormatOptions, StateFormat, StateFormatError

__all__ = [
    "COLLECTIVE_FORMATS",
    "DEFAULT_BLOCK_SIZE",
    "FORMATS",
    "STATE_FORMATS",
    "SUPPORTED_SHARDED_FORMATS",
    "convert_state",
    "layout_conflicts",
    "describe_conflicts",
    "dequantize_momentum",
    "detect_state_format",
    "encode_momentum",
    "family_format",
    "format_options",
    "get_format",
    "guard_threshold",
    "promotion_chain",
    "safer_format",
    "promoted_layout",
    "init_momentum_state",
    "momentum_nbytes",
    "register_format",
    "state_nbytes",
    "unregister_format",
    "weight_format",
    "weight_state_keys",
]

log = logging.getLogger(__name__)

FORMATS: dict[str, StateFormat] = {}
#: Lookups a step makes per parameter, derived from FORMATS each time it changes (register_format,
#: unregister_format) instead of scanning it per lookup: the scans were a sixth of the bytecode that
#: torch.compile traced of an int8 step (tests/test_compiled_step.py), and eager steps pay them per parameter.
_BY_FAMILY: dict[tuple[Any, str], StateFormat] = {}  # (family, role) -> the format; the last in order wins
_WEIGHT_STATE_KEYS: list[frozenset[str]] = [frozenset()]


def _reindex() -> None:
    _BY_FAMILY.clear()
    for f in FORMATS.values():
        _BY_FAMILY[(getattr(f, "family", None), f.role)] = f
    _WEIGHT_STATE_KEYS[0] = frozenset(k for f in FORMATS.values() if f.role == WEIGHT_CORRECTION for k in f.spec.keys)


def register_format(fmt: StateFormat) -> StateFormat:
    """Add ``fmt`` to :data:`FORMATS` (kept sorted by ``fmt.order``); returns it. A name that is
    already registered is replaced."""
    if not isinstance(fmt, StateFormat):
        raise TypeError(f"register_format expects a StateFormat instance, got {type(fmt).__name__}")
    items = [f for f in FORMATS.values() if f.name != fmt.name] + [fmt]
    FORMATS.clear()
    FORMATS.update((f.name, f) for f in sorted(items, key=lambda f: f.order))
    _reindex()
    return fmt


def unregister_format(name: str) -> StateFormat:
    """Remove a format from :data:`FORMATS` (tests that register a format of their own)."""
    fmt = FORMATS.pop(name)
    _reindex()
    return fmt


def family_format(family: Any, role: str) -> StateFormat | None:
    """The registered format of ``role`` in ``family`` (e.g. ``("int8", "adamw_m")``), or ``None``."""
    try:
        return _BY_FAMILY.get((family, role))
    except TypeError:  # an unhashable family names none
        return None


for _f in builtin_formats():
    register_format(_f)
del _f


class _Names(Sequence):
    """A live tuple-like view of the registered names that satisfy ``pred`` (so formats registered
    later are included)."""

    def __init__(self, pred: Any, doc: str) -> None:
        self._pred = pred
        self.__doc__ = doc

    def _names(self) -> tuple[str, ...]:
        return tuple(n for n, f in FORMATS.items() if self._pred(f))

    def __getitem__(self, i):  # type: ignore[override]
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        f = FORMATS.get(name) if isinstance(name, str) else None
        return f is not None and bool(self._pred(f))

    def __eq__(self, other: object) -> bool:
        return tuple(self) == tuple(other) if isinstance(other, (tuple, list, _Names)) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


class _DefaultBlockSizes(Mapping):
    """Live ``{name: format.default_block_size}`` of the momentum formats."""

    def __getitem__(self, name: str) -> int:
        f = FORMATS[name]
        if f.role != "momentum":
            raise KeyError(name)
        return f.default_block_size

    def __iter__(self) -> Iterator[str]:
        return iter(STATE_FORMATS)

    def __len__(self) -> int:
        return len(STATE_FORMATS)

    def __repr__(self) -> str:
        return repr(dict(self))


def _momentum(f: StateFormat) -> bool:
    return f.role == MOMENTUM


#: Every registered Muon momentum format name, in registry order (the AdamW moment formats, which
#: share the registry, are listed by :mod:`qmuon.quant.adamw`).
STATE_FORMATS: Sequence[str] = _Names(_momentum, "every registered momentum format")
#: Formats QMuon can keep for ``Shard(0)`` (FSDP2) parameters.
SUPPORTED_SHARDED_FORMATS: Sequence[str] = _Names(lambda f: _momentum(f) and f.shardable,
                                                  "formats that support Shard(0) parameters")
#: Shardable formats whose sharded update is collective (``row_local`` False).
COLLECTIVE_FORMATS: Sequence[str] = _Names(lambda f: _momentum(f) and f.shardable and not f.row_local,
                                           "formats whose sharded update needs collectives")
#: ``block_size`` per format when the group does not set one (``StateFormat.default_block_size``).
DEFAULT_BLOCK_SIZE: Mapping[str, int] = _DefaultBlockSizes()


def get_format(name: str, role: str = MOMENTUM) -> StateFormat:
    """The registered format ``name`` for stored tensors of ``role`` (Muon momentum by default)."""
    f = FORMATS.get(name) if isinstance(name, str) else None
    if f is None or f.role != role:
        names = ", ".join(n for n, g in FORMATS.items() if g.role == role)
        raise StateFormatError(f"unknown state_format {name!r}; choose one of {names}")
    return f


def weight_format(rule: str) -> StateFormat | None:
    """The weight-correction format a ``bf16_update`` rule keeps (``"ecc8"``), or ``None`` for rules
    that keep no state (``"nearest"``, ``"stochastic"``)."""
    f = FORMATS.get(rule)
    return f if f is not None and f.role == WEIGHT_CORRECTION else None


def weight_state_keys() -> frozenset[str]:
    """Keys of every weight-correction state tensor (kept beside momentum / AdamW state)."""
    return _WEIGHT_STATE_KEYS[0]


def safer_format(name: str) -> str | None:
    """The fidelity guard's next safer format after ``name`` (``None`` at the end of the chain):
    ``grasp4`` / ``int4`` / ``e0m3`` -> ``int8`` -> ``bf16``. Each format declares its successor
    (:attr:`StateFormat.promotes_to`), so a registered format joins the chain by setting it."""
    nxt = get_format(name).promotes_to
    if nxt is not None:
        get_format(nxt)  # a chain must name registered formats
    return nxt


def promotion_chain(name: str) -> tuple[str, ...]:
    """``name`` and every safer format after it, in promotion order (e.g. ``grasp4, int8, bf16``)."""
    chain = [get_format(name).name]
    while (nxt := safer_format(chain[-1])) is not None:
        if nxt in chain:
            raise StateFormatError(f"the promotion chain of {name!r} loops: {' -> '.join(chain + [nxt])}")
        chain.append(nxt)
    return tuple(chain)


def guard_threshold(name: str) -> float | None:
    """The update cosine below which the fidelity guard counts a layer in format ``name`` as
    drifting (:attr:`StateFormat.guard_threshold`; ``None``: the format is not guarded)."""
    return get_format(name).guard_threshold


def promoted_layout(group: Mapping[str, Any], target: str | None = None) -> dict[str, Any] | None:
    """The layout keys (``state_format`` and its layout options, the target format's defaults)
    that move a parameter of ``group`` to ``target`` (default: the next safer format); ``None``
    when the group's format ends the chain."""
    target = target if target is not None else safer_format(group["state_format"])
    if target is None:
        return None
    fmt = get_format(target)
    opts = FormatOptions(block_size=fmt.default_block_size,
                         rank=group["rank"] if group.get("rank") is not None else FormatOptions.rank,
                         grid_block=group["grid_block"] if group.get("grid_block") is not None else FormatOptions.grid_block)
    return {"block_size": fmt.default_block_size, **fmt.layout_kwargs(opts)}


def _default_block_size(name: str | None) -> int:
    f = FORMATS.get(name) if isinstance(name, str) else None
    return f.default_block_size if f is not None else StateFormat.default_block_size


def format_options(group: Mapping[str, Any]) -> FormatOptions:
    """The layout-relevant options of a parameter group (or a saved group / manifest entry, with defaults)."""
    bs = group.get("block_size")
    return FormatOptions(
        block_size=int(bs) if bs is not None else _default_block_size(group.get("state_format", "int8")),
        rank=group["rank"] if group.get("rank") is not None else FormatOptions.rank,
        grid_block=group["grid_block"] if group.get("grid_block") is not None else FormatOptions.grid_block,
    )


def _opts(block_size: int | None, opts: FormatOptions | None, fmt: str | None = None, **kw: Any) -> FormatOptions:
    if opts is not None:
        return opts
    bs = block_size if block_size is not None else _default_block_size(fmt)
    return FormatOptions(block_size=bs, **{k: v for k, v in kw.items() if v is not None})


def init_momentum_state(
    state_format: str, rows: int, cols: int, *, block_size: int | None = None, device: torch.device,
    opts: FormatOptions | None = None,
) -> dict[str, Tensor]:
    """Zero momentum for a ``rows x cols`` matrix (plus ``step``)."""
    st: dict[str, Tensor] = {STEP: torch.zeros((), dtype=torch.float32)}
    st.update(get_format(state_format).init(rows, cols, _opts(block_size, opts, state_format), device))
    return st


def detect_state_format(state: Mapping[str, Any]) -> str:
    """Which format a loaded state dict entry is in, from its keys and dtypes (the first format in
    registry order that :meth:`~StateFormat.owns` it). A state no format owns raises the first
    format's :meth:`~StateFormat.explain_unowned` message (an incomplete state, a wrong dtype)."""
    momentum = [f for f in FORMATS.values() if _momentum(f)]
    for fmt in momentum:
        if fmt.owns(state):
            return fmt.name
    for fmt in momentum:
        msg = fmt.explain_unowned(state)
        if msg:
            raise StateFormatError(msg)
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


def layout_conflicts(saved_group: Mapping[str, Any], group: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The layout options that must match to resume state saved with ``saved_group`` under
    ``group`` but differ: ``{option: (saved, current)}``.

    Resuming the same kind of state (the same format, or ``int8`` <-> ``uint8``) keeps the codes
    as they are, so the source format's ``layout_options`` (block size; GRASP rank and grid block)
    must be equal; between kinds the momentum is dequantized and re-encoded, so nothing must match.
    The one rule behind every resume check (``core.config.check_resume``, :func:`convert_state`).
    """
    source, target = get_format(saved_group["state_format"]), get_format(group["state_format"])
    if source.spec.kind != target.spec.kind:
        return {}
    a, b = format_options(dict(saved_group)), format_options(dict(group))
    return {k: (getattr(a, k), getattr(b, k)) for k in source.layout_options if getattr(a, k) != getattr(b, k)}


def describe_conflicts(conflicts: Mapping[str, tuple[Any, Any]], where: str) -> str:
    saved = ", ".join(f"{k}={a}" for k, (a, _) in conflicts.items())
    now = ", ".join(f"{k}={b}" for k, (_, b) in conflicts.items())
    # the layout options (block size, GRASP rank and grid block) are the `state` section of QMuonConfig
    option = {k: a for k, (a, _) in conflicts.items()}
    return (f"{where}: momentum was saved with {saved} but this optimizer uses {now}; "
            f"construct the optimizer with state={option} to resume")


def convert_state(
    state: Mapping[str, Any], saved_group: Mapping[str, Any], group: Mapping[str, Any], shape: Sequence[int],
    where: str, *, sharded: bool = False,
) -> dict[str, Any]:
    """A loaded Muon state entry in the format of ``group``: validated, and converted when it was
    saved in another format. The compatibility rules of ``QMuon.load_state_dict``:

    * the saved group's ``state_format`` must match the tensors (else the checkpoint is inconsistent);
    * the tensors are validated against ``shape`` with the *saved* options;
    * resuming the same kind of state (the same format, or ``int8`` <-> ``uint8``) needs the same
      values of the source format's ``layout_options`` (block size; GRASP rank and grid block);
      between kinds the momentum is dequantized and re-encoded anyway;
    * ``sharded=True`` (``state`` holds this rank's rows of a ``Shard(0)`` parameter): conversion
      into a format that needs the whole matrix to encode (``convertible_when_sharded``) is refused
      with ``NotImplementedError``.

    ``shape``: the parameter's shape (its local rows when sharded); ``cols`` is the product of the
    trailing dims. Keys that are not momentum tensors of any format (``step``, ...) are kept; a
    missing ``step`` is added as 0. Returns a new dict (tensors of an unchanged format are shared).
    """
    rows = int(shape[0])
    cols = math.prod(int(s) for s in shape[1:])
    found = detect_state_format(state)
    saved_fmt = saved_group.get("state_format", found)
    if saved_fmt != found:
        raise StateFormatError(
            f"{where}: the group says state_format={saved_fmt!r} but the tensors are {found}; the checkpoint is inconsistent"
        )
    target = get_format(group["state_format"])
    source = get_format(found)
    if sharded and found != target.name and not target.convertible_when_sharded(found):
        raise NotImplementedError(
            f"{where}: converting {found} momentum to {target.name} needs the whole matrix; load it into a "
            f"single-process QMuon, save {target.name}, then shard")
    saved_opts = format_options({**group, **saved_group, "state_format": found})
    validate_momentum_state(state, found, rows, cols, None, where, opts=saved_opts)
    opts = format_options(group)
    conflicts = layout_conflicts({**group, **saved_group, "state_format": found}, group)
    if conflicts:
        raise StateFormatError(describe_conflicts(conflicts, where))
    keys = set().union(*(f.spec.keys for f in FORMATS.values() if _momentum(f)))
    out = {k: v for k, v in state.items() if k not in keys}
    out.setdefault(STEP, torch.zeros((), dtype=torch.float32))
    if found == target.name:
        out.update({k: state[k] for k in source.spec.keys})
    else:
        m = source.dequantize(dict(state), saved_opts, cols)
        out.update(target.encode(m, opts))
        log.info("%s: converted %s momentum to %s", where, found, target.name)
    return out


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
    fmt = get_format(state_format)
    return fmt.nbytes(rows, cols, opts or FormatOptions(fmt.default_block_size))
