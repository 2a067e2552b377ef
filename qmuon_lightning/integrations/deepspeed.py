"""QMuon under the DeepSpeed engine (ZeRO stages 0, 1 and 2): every Muon matrix orthogonalized whole,
exactly once per step, with quantized momentum that lives on one rank.

The problem
-----------
ZeRO stages 1 and 2 flatten each parameter group into one buffer, cut it into ``N`` equal
partitions, and hand the client optimizer only ``[fp32 partition]``, a 1-D tensor per group whose
boundaries ignore parameter boundaries. A Muon optimizer stepping that tensor never sees a matrix;
Newton-Schulz (NS) needs the whole matrix. DeepSpeed's own Muon works around it inside its
partitioning code, keyed on the optimizer's class *name* containing "muon" and on ``p.use_muon``
tags, with known silent failures (plain SGD at stage 0, params that look 1-D under ``zero.Init``,
corrupted parameters that cross partitions under reduce-scatter).

The design
----------
:class:`WholeMatrixZeroOptimizer` is the client optimizer handed to ``deepspeed.initialize``. Its
class name does not contain "muon" and it sets no ``use_muon`` attribute, so DeepSpeed's Muon code
never runs. After the engine is built, :meth:`WholeMatrixZeroOptimizer.attach` reads the engine's
partition layout (``bit16_groups``, the flat buffers, ``partition_size``): for each parameter,
which element range of which rank's flat fp32 partition holds which of its elements. Then, per
``step()`` call (DeepSpeed's ZeRO optimizer makes one per parameter group and optimizer step, after
the group's averaged gradients landed in its fp32 partition, after unscaling and clipping):

1. one small all-reduce of a "non-finite" flag per parameter, so every rank skips (or raises for)
   the same parameters before the call changes anything;
2. each Muon matrix has an *owner* rank (matrices dealt by size, largest first, to the least loaded
   rank, so NS work and momentum are split about ``1/N``). One ``all_to_all`` sends every rank's
   slices of the averaged gradient of each matrix to its owner (fp32);
3. the owner runs QMuon's own momentum update (quantized state: int8 / 4-bit / ...) and whole-matrix
   NS, once: the momentum of a matrix exists only on its owner (ZeRO-1-like state partitioning);
4. a second ``all_to_all`` sends the NS output (bf16, what QMuon applies) back, each rank receiving
   the slices that fall in its own partition, and applies ``p *= 1 - lr wd; p -= lr_adj O`` (per
   fused part) to them;
5. AdamW parameters are updated elementwise on the partition (AdamW is elementwise, so a flat slice
   is fine), with per-parameter state as in :class:`~qmuon_lightning.QMuon`.

ZeRO stage 0 gives the client optimizer the real 2-D parameters (fp32, or DeepSpeed's unfused
fp16/bf16 wrapper's fp32 copies); the same owner split applies: only step 4 is needed after the
owner's update (every rank holds the whole matrix), and momentum still lives only on the owner.

Checkpoints go through ``engine.save_checkpoint`` / ``engine.load_checkpoint``. Stages 1 and 2 write
one optimizer file per rank: each holds that rank's quantized momentum (its owned matrices) and the
AdamW state of its partition. Stage 0 writes only rank 0's optimizer state, so ``state_dict()``
gathers the owners' momentum to rank 0 (``engine.save_checkpoint`` calls it on every rank); on load
each rank keeps its own matrices. Resuming needs the same number of processes and ZeRO stage.

Not supported (each raises :class:`UnsupportedDeepSpeedConfig` naming the fix): an ``optimizer``
section in the DeepSpeed config together with QMuon, ``offload_optimizer`` (DeepSpeed would replace
the client optimizer with DeepSpeedCPUAdam), ZeRO stage 3 (parameters are partitioned themselves,
and ``zero.Init`` makes them look 1-D), ``elastic_checkpoint``, and bf16 at stage 1 with fp32
gradient accumulation (DeepSpeed's ``BF16_Optimizer``, a different partition layout).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from ..core import pipeline
from ..core.apply import apply_update_
from ..core.plan import MatrixPart, plan_param
from ..optim.qmuon import QMuon
from ..quant import adamw as qadamw

__all__ = [
    "UnsupportedDeepSpeedConfig",
    "check_config",
    "avoid_cpu_op_builds",
    "WholeMatrixZeroOptimizer",
    "initialize",
    "STATE_VERSION",
]

log = logging.getLogger(__name__)

#: Version of the layout written by :meth:`WholeMatrixZeroOptimizer.state_dict`.
STATE_VERSION = 1
_KEY = "qmuon_deepspeed"
# Group keys the wrapper keeps in sync into its inner QMuon before each step (schedulers change them).
_SKIP_SYNC = ("params", "param_names")


class UnsupportedDeepSpeedConfig(ValueError):
    """A DeepSpeed configuration QMuon cannot run under; the message says what to change."""


# --------------------------------------------------------------------------------------- config
def _load(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    if not isinstance(config, Mapping):
        raise TypeError(f"DeepSpeed config must be a dict or a path to a JSON file, got {type(config).__name__}")
    return copy.deepcopy(dict(config))


def _enabled(section: Any) -> bool:
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


def check_config(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """Validate a DeepSpeed config for QMuon and return a copy ready for ``deepspeed.initialize``.

    The copy sets ``zero_allow_untested_optimizer: true`` (DeepSpeed refuses client optimizers it
    does not know at ZeRO stages >= 1 otherwise; this integration is what is tested). Raises
    :class:`UnsupportedDeepSpeedConfig` for configurations that cannot work.
    """
    cfg = _load(config)
    if "optimizer" in cfg:
        raise UnsupportedDeepSpeedConfig(
            "the DeepSpeed config has an 'optimizer' section "
            f"({cfg['optimizer'].get('type', '?') if isinstance(cfg['optimizer'], Mapping) else cfg['optimizer']!r}) "
            "and QMuon is passed as the optimizer: DeepSpeed would build its own optimizer from the config. "
            "Remove the 'optimizer' section and set learning rates when building QMuon"
        )
    zero = cfg.get("zero_optimization", {}) or {}
    if not isinstance(zero, Mapping):
        raise UnsupportedDeepSpeedConfig(f"'zero_optimization' must be a JSON object, got {zero!r}")
    stage = int(zero.get("stage", 0))
    if stage == 3:
        raise UnsupportedDeepSpeedConfig(
            "ZeRO stage 3 partitions the parameters themselves (zero.Init makes them look 1-D and a matrix "
            "is never whole on any rank between steps), so QMuon does not support it. Use stage 2 (gradients "
            "and optimizer state partitioned; QMuon's momentum is split across ranks by matrix) or FSDP2 "
            "with Trainer(strategy='qmuon_fsdp')"
        )
    if stage not in (0, 1, 2):
        raise UnsupportedDeepSpeedConfig(f"zero_optimization.stage must be 0, 1 or 2 for QMuon, got {stage}")
    for key in ("offload_optimizer", "offload_param"):
        off = zero.get(key)
        if isinstance(off, Mapping) and str(off.get("device", "none")).lower() not in ("none", "null"):
            raise UnsupportedDeepSpeedConfig(
                f"zero_optimization.{key} (device={off.get('device')!r}) is not supported: "
                + ("with optimizer offload DeepSpeed replaces a client optimizer by DeepSpeedCPUAdam (or runs it "
                   "on CPU copies QMuon cannot see whole). " if key == "offload_optimizer" else
                   "parameter offload is a ZeRO stage 3 feature. ")
                + f"Remove '{key}'; QMuon's int8 momentum already takes ~1/4 of fp32 momentum memory"
            )
    if zero.get("elastic_checkpoint", False):
        raise UnsupportedDeepSpeedConfig(
            "zero_optimization.elastic_checkpoint=true re-cuts optimizer state as flat partitions on load; "
            "QMuon's state is per matrix (quantized). Set elastic_checkpoint to false (the default)"
        )
    if cfg.get("zenflow") or zero.get("zenflow"):
        raise UnsupportedDeepSpeedConfig("ZenFlow replaces the optimizer step with its own CPU optimizer; remove 'zenflow'")
    bf16 = _enabled(cfg.get("bf16")) or _enabled(cfg.get("bfloat16"))
    accum = cfg.get("data_types", {}).get("grad_accum_dtype") if isinstance(cfg.get("data_types"), Mapping) else None
    if bf16 and stage == 1 and accum is not None and str(accum).lower() in ("fp32", "float32", "float"):
        raise UnsupportedDeepSpeedConfig(
            "bf16 with ZeRO stage 1 and data_types.grad_accum_dtype='fp32' makes DeepSpeed use its BF16_Optimizer, "
            "whose partition layout this integration does not read. Use ZeRO stage 2 (fp32 master weights and "
            "gradients partitioned the same way) or drop grad_accum_dtype"
        )
    cfg["zero_allow_untested_optimizer"] = True
    return cfg


def avoid_cpu_op_builds() -> bool:
    """On DeepSpeed's CPU accelerator, keep ``deepspeed.comm`` from JIT-compiling its C++ ops.

    When ``deepspeed.comm`` starts on the CPU accelerator it probes which ops can be built (compiler
    subprocesses) and JIT-builds a shared-memory all-reduce kernel (measured: about 50 s on a 2-core
    machine, and it needs a compiler). That kernel serves only DeepSpeed's *inference* all-reduce;
    training communication goes through ``torch.distributed`` (gloo) either way, and QMuon needs no
    DeepSpeed op. This marks every DeepSpeed op as unavailable for this process, before DeepSpeed
    asks. Returns True when it did so (CPU accelerator), False otherwise (GPU: nothing changes).
    Call it before ``deepspeed.init_distributed`` / ``deepspeed.initialize``.
    """
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    import deepspeed.ops as ds_ops

    known = vars(ds_ops).get("__compatible_ops__")
    if isinstance(known, dict):  # already probed: edits to this dict persist (DeepSpeed caches it)
        for name in list(known):
            known[name] = False
    else:
        from deepspeed.ops.op_builder.all_ops import ALL_OPS

        vars(ds_ops)["__compatible_ops__"] = {name: False for name in ALL_OPS}
    return True


# ------------------------------------------------------------------------------ bookkeeping
@dataclass(frozen=True)
class _Segment:
    """The elements ``[start, start + length)`` of a parameter (flattened row-major) held by one rank,
    at offset ``local`` of that rank's flat partition (or of the parameter itself at stage 0)."""

    start: int
    length: int
    local: int


@dataclass
class _Param:
    index: int  # global index over all groups (QMuon's stochastic-rounding key)
    group: int
    pos: int  # position in its group
    shape: torch.Size
    numel: int
    muon: bool
    parts: tuple[MatrixPart, ...] = ()  # the matrices of a Muon parameter (QMuon's plan)
    owner: int = 0
    holders: list[_Segment | None] = dataclasses.field(default_factory=list)  # per rank

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.numel // self.shape[0]


def assign_owners(sizes: list[int], world_size: int) -> list[int]:
    """Deal matrices to ranks: largest first, each to the currently least loaded rank (ties: lowest
    rank, then lowest index). Deterministic, so every rank computes the same table. The greedy
    longest-processing-time rule keeps the heaviest rank within 4/3 of the optimum."""
    load = [0] * world_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += sizes[i]
    return owners


def partition_segments(offset: int, numel: int, partition_size: int, world_size: int) -> list[_Segment | None]:
    """Which slice of a parameter at flat offset ``offset`` each rank's ZeRO partition holds.

    Rank ``r``'s partition is ``[r * partition_size, (r + 1) * partition_size)`` of the group's flat
    buffer (``DeepSpeedZeroOptimizer.get_data_parallel_partitions``); a parameter is one contiguous
    range of that buffer, so each rank holds at most one contiguous slice of it.
    """
    out: list[_Segment | None] = []
    for r in range(world_size):
        lo, hi = r * partition_size, (r + 1) * partition_size
        a, b = max(offset, lo), min(offset + numel, hi)
        out.append(_Segment(a - offset, b - a, a - lo) if b > a else None)
    return out


def _part_runs(part: MatrixPart, cols: int, start: int, length: int) -> list[tuple[int, int, int, int, int]]:
    """The elements of ``part`` in the flat slice ``[start, start + length)`` of its row-major
    ``(rows, cols)`` parameter, as runs ``(offset, n, width, c0, c1)``: the slice's elements
    ``[offset, offset + n * width)`` seen as ``n x width`` hold the part in columns ``[c0, c1)``.
    At most three runs: a partial first row, whole rows, a partial last row (ZeRO partitions cut
    parameters anywhere)."""
    lo, hi = max(part.r0 * cols, start), min(part.r1 * cols, start + length)
    pieces = []  # (first row, rows, first column, last column + 1) of the parameter
    while lo < hi:
        row, col = divmod(lo, cols)
        if col or hi - lo < cols:  # a partial row
            end = min(hi, (row + 1) * cols)
            pieces.append((row, 1, col, end - row * cols))
            lo = end
        else:
            n = (hi - lo) // cols
            pieces.append((row, n, 0, cols))
            lo += n * cols
    out = []
    for row, n, a, b in pieces:
        c0, c1 = max(a, part.c0), min(b, part.c1)
        if c1 > c0:
            out.append((row * cols + a - start, n, b - a, c0 - a, c1 - a))
    return out


def _apply_parts(parts: tuple[MatrixPart, ...], where: str) -> tuple[MatrixPart, ...]:
    """The parts :meth:`WholeMatrixZeroOptimizer._apply_update` applies, as ranges of the stored
    ``(rows, cols)`` matrix. A bank member's parts (gate and up of one expert; gpt-oss interleaves
    them) share the member's range, which then gets one scaled update: their lr factors must agree
    (equal fused parts; always so for transformers' experts)."""
    out: dict[tuple[int, int, int, int], MatrixPart] = {}
    for part in parts:
        key = (part.r0, part.r1, part.c0, part.c1)
        seen = out.setdefault(key, part)
        if seen.lr_scale != part.lr_scale:
            raise NotImplementedError(
                f"parameter {where!r}: the fused parts of one bank member have different lr adjustments "
                f"({seen.lr_scale} and {part.lr_scale}); under DeepSpeed a bank member's parts must have equal "
                "shapes. Use equal parts or FSDP2 (qmuon_fsdp)")
    return tuple(out.values())


def _placeholder(shape: torch.Size, device: torch.device) -> Tensor:
    """A tensor of ``shape`` backed by one element: what an idle proxy looks like (never written)."""
    return torch.zeros(1, dtype=torch.float32, device=device).expand(shape)


# ------------------------------------------------------------------------------- optimizer
class WholeMatrixZeroOptimizer(Optimizer):
    """Client optimizer for ``deepspeed.initialize`` that runs a :class:`~qmuon_lightning.QMuon`'s
    algorithm with whole-matrix Newton-Schulz under ZeRO stages 0, 1 and 2 (see the module docstring).

    Build it from a fresh QMuon (for example ``qmuon_lightning.build_optimizer(model)``), pass it as
    ``optimizer=`` to ``deepspeed.initialize``, then call :meth:`attach` with the engine;
    :func:`initialize` does all three. The QMuon's parameter-group dicts are shared, not copied, so
    an LR scheduler built on the QMuon drives this optimizer.

    Attributes:
        nonfinite_skips: parameter updates skipped because their averaged gradient held NaN/Inf
            (groups with ``nonfinite="skip"``); the same count on every rank.
        ns_items: after a step, NS calls this rank made per Muon parameter index (one per matrix, or
            one per fused part); summed over ranks it is ``len(parts)`` (or 1) for every matrix.
    """

    def __init__(self, qmuon: QMuon) -> None:
        if not isinstance(qmuon, QMuon):
            raise TypeError(
                f"WholeMatrixZeroOptimizer wraps a qmuon_lightning.QMuon, got {type(qmuon).__name__}; build one "
                "with qmuon_lightning.build_optimizer(model)"
            )
        if qmuon.gradient_release is not None:
            raise ValueError(
                "gradient_release=True cannot combine with DeepSpeed ZeRO: ZeRO reduces and partitions the gradients "
                "into flat buckets after backward, so a parameter's hook would step it with its unreduced local "
                "gradient. Build the QMuon without gradient_release for DeepSpeed, or train with the qmuon_fsdp "
                "strategy (FSDP2), where release steps the reduced shards"
            )
        if any(len(st) for st in qmuon.state.values()):
            raise ValueError(
                "the QMuon already has optimizer state (it has stepped or loaded a checkpoint): wrap a fresh QMuon "
                "and restore state through engine.load_checkpoint"
            )
        if qmuon.max_nonfinite_skips is not None:
            raise NotImplementedError(
                f"max_nonfinite_skips={qmuon.max_nonfinite_skips} is not enforced under DeepSpeed (this wrapper skips "
                "non-finite updates itself and counts them in nonfinite_skips); build the QMuon without it")
        groups = [g for g in qmuon.param_groups if len(g["params"])]  # DeepSpeed drops empty groups
        self._params: list[_Param] = []
        inner_groups = []
        for gi, g in enumerate(groups):
            proxies = []
            for pos, p in enumerate(g["params"]):
                where = (g.get("param_names") or [None] * len(g["params"]))[pos] or f"group {gi} #{pos}"
                if not p.requires_grad:
                    raise ValueError(f"parameter {where!r} does not require grad: remove frozen parameters from the "
                                     "optimizer (build_optimizer leaves them out)")
                if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                    raise ValueError(f"parameter {where!r} has dtype {p.dtype}; DeepSpeed trains float parameters")
                info = _Param(len(self._params), gi, pos, p.shape, p.numel(), bool(g["use_muon"]),
                              _apply_parts(plan_param(p, g, 0, where).parts, where) if g["use_muon"] else ())
                self._params.append(info)
                proxies.append(_placeholder(p.shape, p.device) if info.muon else torch.zeros(0, device=p.device))
            ig = {k: v for k, v in g.items() if k != "params"}
            ig["params"] = proxies
            if not g["use_muon"] and not qadamw.is_full_precision(g.get("state_format", qadamw.FULL_PRECISION)):
                # AdamW steps flat 1-D slices of the ZeRO partitions here, and 1-D tensors keep fp32
                # moments (quant.adamw.moment_formats): say so instead of implying quantized moments.
                log.warning("DeepSpeed: AdamW group %d asks for %s moments, but under DeepSpeed AdamW steps flat "
                            "1-D slices of the ZeRO partitions, whose moments QMuon keeps in fp32; using fp32 "
                            "(quantized AdamW moments need whole tensors: QMuon alone or FSDP2)", gi, g["state_format"])
                ig["state_format"] = qadamw.FULL_PRECISION
            inner_groups.append(ig)
        # The inner optimizer keeps the same group structure (so parameter indices, the stochastic
        # rounding keys, are those of a single-process QMuon) but holds proxies, not the model's tensors.
        self._inner = QMuon(inner_groups)
        self._proxies = [p for g in self._inner.param_groups for p in g["params"]]
        # The owner's momentum update and whole-matrix Newton-Schulz are QMuon's own (core pipeline);
        # its updates are handed to _capture instead of being applied to the proxies.
        self._inner.update_sink = self._capture
        self._proxy_index = {id(proxy): info.index for info, proxy in zip(self._params, self._proxies)}
        self._out: dict[int, Tensor] = {}
        self._ret_dtype = torch.bfloat16
        #: NS items (matrices or fused parts) orthogonalized in the last call, per Muon parameter index.
        self._ns_items_call: dict[int, int] = defaultdict(int)
        # The QMuon's own group dicts (torch's add_param_group keeps the dict objects): DeepSpeed swaps
        # their "params" for its flat partitions, and a scheduler built on the QMuon sets their "lr".
        super().__init__(groups, dict(qmuon.defaults))
        # DeepSpeed's ZeRO optimizer calls step() once per group with param_groups narrowed to that
        # group; every group dict is kept here to know which one a call is for.
        self._all_groups = list(self.param_groups)
        self.nonfinite_skips = 0
        self.ns_items: dict[int, int] = {}
        self._mode: str | None = None  # "partitioned" (ZeRO 1/2) or "direct" (stage 0)
        self._group: Any = None
        self._world = 1
        self._rank = 0
        self._device = groups[0]["params"][0].device if groups else torch.device("cpu")
        self._owned: list[_Param] = []

    # ------------------------------------------------------------------ attach
    def attach(self, engine: Any) -> "WholeMatrixZeroOptimizer":
        """Read the engine's partition layout and deal Muon matrices to owner ranks.

        ``engine``: the ``DeepSpeedEngine`` returned by ``deepspeed.initialize(optimizer=self, ...)``.
        """
        wrapper = engine.optimizer
        kind = type(wrapper).__name__
        if wrapper is self:
            self._attach_direct(getattr(engine, "seq_data_parallel_group", None))
        elif kind in ("DeepSpeedZeroOptimizer",):
            if wrapper.optimizer is not self:
                raise ValueError("the engine's ZeRO optimizer does not wrap this optimizer; pass optimizer=this "
                                 "WholeMatrixZeroOptimizer to deepspeed.initialize")
            self._attach_partitioned(wrapper)
        elif kind == "FP16_UnfusedOptimizer":
            if wrapper.optimizer is not self:
                raise ValueError("the engine's fp16/bf16 optimizer does not wrap this optimizer")
            self._attach_direct(getattr(engine, "seq_data_parallel_group", None))
        else:
            raise UnsupportedDeepSpeedConfig(
                f"DeepSpeed wrapped the optimizer in {kind}, whose layout QMuon does not read (supported: ZeRO "
                "stage 0 with fp32 or unfused fp16/bf16, and DeepSpeedZeroOptimizer at stages 1 and 2). "
                "Check the config with qmuon_lightning.integrations.deepspeed.check_config"
            )
        return self

    def _set_world(self, group: Any) -> None:
        if dist.is_available() and dist.is_initialized():
            self._group = group
            self._world = dist.get_world_size(group)
            self._rank = dist.get_rank(group)
        else:
            self._group, self._world, self._rank = None, 1, 0
        muon = [p for p in self._params if p.muon]
        for p, owner in zip(muon, assign_owners([p.numel for p in muon], self._world)):
            p.owner = owner
        self._owned = [p for p in muon if p.owner == self._rank]

    def _attach_direct(self, group: Any) -> None:
        for info in self._params:
            cur = self._all_groups[info.group]["params"]
            if len(cur) <= info.pos or cur[info.pos].shape != info.shape:
                raise RuntimeError(
                    f"ZeRO stage 0: parameter group {info.group} no longer holds the model's parameters as built; "
                    "QMuon cannot map them"
                )
            if not cur[info.pos].is_contiguous():
                raise ValueError(f"parameter {info.index} (shape {tuple(info.shape)}) is not contiguous")
        self._mode = "direct"
        self._set_world(group)
        for info in self._params:
            info.holders = [_Segment(0, info.numel, 0)] * self._world

    def _attach_partitioned(self, zero: Any) -> None:
        groups = zero.real_dp_process_group
        if any(g is not groups[0] for g in groups):
            raise UnsupportedDeepSpeedConfig("parameter groups with different data-parallel groups (MoE) are not supported")
        if len(zero.bit16_groups) != len(self._all_groups):
            raise RuntimeError(f"DeepSpeed built {len(zero.bit16_groups)} flat groups for {len(self._all_groups)} "
                               "parameter groups")
        self._mode = "partitioned"
        self._set_world(groups[0])
        by_group = defaultdict(list)
        for info in self._params:
            by_group[info.group].append(info)
        for gi, infos in by_group.items():
            flat = zero.bit16_groups_flat[gi]
            psize = int(zero.partition_size[gi])
            if psize * self._world != flat.numel():
                raise RuntimeError(f"group {gi}: partition size {psize} x {self._world} ranks != flat size {flat.numel()}")
            model_params = zero.bit16_groups[gi]
            if len(model_params) != len(infos):
                raise RuntimeError(f"group {gi}: DeepSpeed flattened {len(model_params)} parameters, QMuon has {len(infos)}")
            declared = {}
            for p, off in zip(getattr(zero, "round_robin_bit16_groups", [[]] * (gi + 1))[gi],
                              getattr(zero, "round_robin_bit16_offsets", [[]] * (gi + 1))[gi]):
                declared[id(p)] = int(off)
            for info, p in zip(infos, model_params):
                if p.shape != info.shape:
                    raise RuntimeError(f"group {gi}: parameter order differs from DeepSpeed's ({tuple(p.shape)} vs "
                                       f"{tuple(info.shape)})")
                # Where the parameter lives in the flat buffer: its storage offset (DeepSpeed points each
                # model parameter at a view of the flat buffer), cross-checked against DeepSpeed's record.
                delta = p.data_ptr() - flat.data_ptr()
                if delta % flat.element_size() or not 0 <= delta // flat.element_size() <= flat.numel() - info.numel:
                    raise RuntimeError(f"group {gi}: a parameter is not a view of DeepSpeed's flat buffer")
                off = delta // flat.element_size()
                if id(p) in declared and declared[id(p)] != off:
                    raise RuntimeError(f"group {gi}: flat offset {off} disagrees with DeepSpeed's {declared[id(p)]}")
                info.holders = partition_segments(off, info.numel, psize, self._world)

    # ------------------------------------------------------------------ step
    def _require_attached(self) -> None:
        if self._mode is not None:
            return
        first = self._all_groups[0]["params"][0] if self._all_groups and self._all_groups[0]["params"] else None
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if first is not None and first.ndim == 1 and self._params and self._params[0].muon:
            distributed = True  # flat partitions: only attach() can map them
        if distributed:
            raise RuntimeError(
                "WholeMatrixZeroOptimizer.step() before attach(engine): call optimizer.attach(engine) after "
                "deepspeed.initialize, or use qmuon_lightning.integrations.deepspeed.initialize(...)"
            )
        self._attach_direct(None)

    def _views(self, info: _Param) -> tuple[Tensor, Tensor | None] | None:
        """This rank's (data, grad) 1-D views of a parameter's slice, or None when it holds none."""
        seg = info.holders[self._rank]
        if seg is None:
            return None
        if self._mode == "partitioned":
            part = self._all_groups[info.group]["params"][0]
            data = part.data.view(-1).narrow(0, seg.local, seg.length)
            grad = None if part.grad is None else part.grad.view(-1).narrow(0, seg.local, seg.length)
        else:
            p = self._all_groups[info.group]["params"][info.pos]
            data = p.data.view(-1)
            grad = None if p.grad is None else (p.grad.reshape(-1) if p.grad.is_contiguous() else None)
            if p.grad is not None and grad is None:
                p.grad = p.grad.contiguous()
                grad = p.grad.view(-1)
        return data, grad

    def _all_to_all(self, send: list[Tensor], send_sizes: list[int], recv_sizes: list[int], dtype: torch.dtype) -> Tensor:
        flat_send = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=self._device)
        flat_send = flat_send.to(dtype)
        recv = torch.empty(sum(recv_sizes), dtype=dtype, device=flat_send.device)
        if self._world == 1:
            recv.copy_(flat_send)
        else:
            dist.all_to_all_single(recv, flat_send, recv_sizes, send_sizes, group=self._group)
        return recv

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = pipeline.call_closure(closure)
        self._require_attached()
        active = self._active_groups()
        params = [p for p in self._params if p.group in active]
        views: list[tuple[Tensor, Tensor | None] | None] = [None] * len(self._params)
        for info in params:
            views[info.index] = self._views(info)
        self._device = next((v[0].device for v in views if v is not None), self._device)
        live = self._finite_params(params, views)

        # 1. averaged gradient of each owned Muon matrix, whole, on its owner.
        muon_live = [p for p in params if p.muon and p.index in live]
        by_owner: dict[int, list[_Param]] = defaultdict(list)
        for p in muon_live:
            by_owner[p.owner].append(p)
        full_grad: dict[int, Tensor] = {}
        has_muon = any(p.muon for p in params)  # the same on every rank: no exchange for AdamW-only calls
        if self._mode == "partitioned" and has_muon:
            send, send_sizes = [], []
            for r in range(self._world):
                n = 0
                for p in by_owner[r]:
                    seg = p.holders[self._rank]
                    if seg is not None:
                        send.append(views[p.index][1])
                        n += seg.length
                send_sizes.append(n)
            recv_sizes = [sum(p.holders[s].length for p in by_owner[self._rank] if p.holders[s] is not None)
                          for s in range(self._world)]
            recv = self._all_to_all(send, send_sizes, recv_sizes, torch.float32)
            for p in by_owner[self._rank]:
                full_grad[p.index] = torch.empty(p.numel, dtype=torch.float32, device=recv.device)
            at = 0
            for s in range(self._world):
                for p in by_owner[self._rank]:
                    seg = p.holders[s]
                    if seg is not None:
                        full_grad[p.index].narrow(0, seg.start, seg.length).copy_(recv.narrow(0, at, seg.length))
                        at += seg.length
        else:
            for p in by_owner[self._rank]:
                g = views[p.index][1]
                full_grad[p.index] = g if g.dtype == torch.float32 else g.float()

        # 2. the owner's QMuon update (momentum + whole-matrix NS), AdamW on this rank's slices.
        self._sync_inner_groups()
        ret_dtype = self._ret_dtype = self._return_dtype()  # once per call: every capture and the all-to-all use it
        out = self._out = {}
        self._ns_items_call.clear()
        for info, proxy in zip(self._params, self._proxies):
            if info.muon:
                g = full_grad.get(info.index)
                if g is None:
                    proxy.data = _placeholder(info.shape, self._device)
                    proxy.grad = None
                    continue
                g2 = g.view(info.shape)
                # NS input is written into the grad buffer; the proxy's data aliases it because with
                # weight_decay 0 QMuon only multiplies it by 1.0 (exact) before the captured NS output.
                proxy.data = g2
                proxy.grad = g2
            else:
                v = views[info.index]
                if v is None or info.index not in live or v[1] is None:
                    proxy.data = torch.zeros(0, device=self._device)
                    proxy.grad = None
                else:
                    proxy.data = v[0]
                    proxy.grad = v[1]
        self._inner.step()
        if 0 in active:  # a new optimizer step (DeepSpeed steps groups in order, one call each)
            self.ns_items = {}
        for k, v in self._ns_items_call.items():
            self.ns_items[k] = self.ns_items.get(k, 0) + v
        for proxy in self._proxies:
            proxy.grad = None
        for info, proxy in zip(self._params, self._proxies):
            if info.muon:
                proxy.data = _placeholder(info.shape, self._device)

        # 3. the NS output back to every rank holding a slice; each applies it to its slice.
        if not has_muon:
            return loss
        send, send_sizes = [], []
        for r in range(self._world):
            n = 0
            for p in by_owner[self._rank]:
                seg = p.holders[r]
                if seg is not None:
                    send.append(out[p.index].view(-1).narrow(0, seg.start, seg.length))
                    n += seg.length
            send_sizes.append(n)
        recv_sizes = [sum(p.holders[self._rank].length for p in by_owner[s] if p.holders[self._rank] is not None)
                      for s in range(self._world)]
        recv = self._all_to_all(send, send_sizes, recv_sizes, ret_dtype)
        at = 0
        for s in range(self._world):
            for p in by_owner[s]:
                seg = p.holders[self._rank]
                if seg is None:
                    continue
                self._apply_update(p, views[p.index][0], seg, recv.narrow(0, at, seg.length))
                at += seg.length
        return loss

    def _capture(self, proxy: Tensor, part: Any, o: Tensor) -> None:
        """QMuon's update sink: keep the NS output of one part of an owned matrix for the return trip."""
        index = self._proxy_index[id(proxy)]
        info = self._params[index]
        buf = self._out.get(index)
        if buf is None:
            buf = self._out[index] = torch.empty(info.shape, dtype=self._ret_dtype, device=o.device)
        block = part.block(buf)
        block.copy_(o.reshape(block.shape))
        self._ns_items_call[index] += 1

    def _return_dtype(self) -> torch.dtype:
        """dtype of the NS outputs sent back: that of Newton-Schulz (fp32 when any Muon group runs
        it in fp32), so the applied update is the single-process one. Every rank resolves the same."""
        from ..core.newton_schulz import resolve_ns_dtype

        dtypes = {resolve_ns_dtype(g.get("ns_dtype", "auto"), self._device) for g in self._all_groups if g["use_muon"]}
        return torch.float32 if torch.float32 in dtypes else torch.bfloat16

    def _sync_inner_groups(self) -> None:
        for g, ig in zip(self._all_groups, self._inner.param_groups):
            for k, v in g.items():
                if k not in _SKIP_SYNC and k not in ("state_format", "block_size", "parts", "use_muon"):
                    ig[k] = v
            if ig["use_muon"]:
                ig["weight_decay"] = 0.0  # applied to the slices by _apply_update

    def _apply_update(self, p: _Param, data: Tensor, seg: _Segment, o: Tensor) -> None:
        """``p *= 1 - lr wd`` then ``p -= lr lr_scale(part) * O`` on this rank's slice, as QMuon does on
        the whole matrix (``lr_scale`` is torch.optim.Muon's shape adjustment of each fused part, on
        the layer's ``(out, in)`` shape)."""
        group = self._all_groups[p.group]
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        if data.dtype != torch.float32:
            # DeepSpeed's fp16 / bf16 modes step fp32 master partitions and copy them to the model's
            # low-precision weights itself, so QMuon's bf16_update has nothing to do here (a no-op).
            raise NotImplementedError(
                f"QMuon under DeepSpeed expects fp32 master partitions, got {data.dtype}; DeepSpeed keeps an fp32 "
                "master copy in its fp16/bf16 modes (bf16_update does not apply). For bf16 weights without a master "
                "copy use QMuon directly, FSDP2 or the qmuon_fsdp strategy with precision='bf16-true'")
        cautious = bool(group.get("cautious_weight_decay", False))
        # The parts' runs cover the slice once: each element gets one decay-and-update write (core.apply).
        for part in p.parts:
            for at, n, width, c0, c1 in _part_runs(part, p.cols, seg.start, seg.length):
                d = data.narrow(0, at, n * width).view(n, width)[:, c0:c1]
                apply_update_(d, o.narrow(0, at, n * width).view(n, width)[:, c0:c1], alpha=-lr * part.lr_scale,
                              decay=1.0 - lr * wd, cautious=cautious)

    def _active_groups(self) -> set[int]:
        """Which of this optimizer's groups the current ``step()`` call updates: all of them, except
        under DeepSpeedZeroOptimizer, which narrows ``param_groups`` to one group per call."""
        ids = {id(g) for g in self.param_groups}
        active = {i for i, g in enumerate(self._all_groups) if id(g) in ids}
        if len(active) != len(self.param_groups):
            raise RuntimeError("param_groups holds groups this optimizer was not built with; build a new "
                               "WholeMatrixZeroOptimizer instead of calling add_param_group")
        return active

    def _finite_params(self, params: list[_Param], views: list[tuple[Tensor, Tensor | None] | None]) -> set[int]:
        """Indices of parameters (of ``params``) whose averaged gradient is finite on every rank (one
        all-reduce of a flag per parameter); raises on every rank for a bad gradient in a
        ``nonfinite="raise"`` group before this call changes anything."""
        idx, grads = [], []
        for info in params:
            v = views[info.index]
            if v is not None and v[1] is not None and v[1].numel():
                idx.append(info.index)
                grads.append(v[1])
        bad = torch.zeros(len(self._params) + 1, dtype=torch.float32, device=self._device)
        present = torch.zeros_like(bad)
        if grads:
            flags = torch.tensor([0.0 if ok else 1.0 for ok in pipeline.finite_flags(grads)], device=self._device)
            where = torch.tensor(idx, device=self._device)
            bad[where] = flags
            present[where] = 1.0
        present[-1] = 0.0
        both = torch.stack([bad, present])
        if self._world > 1:
            dist.all_reduce(both, group=self._group)
        bad_list = both[0].tolist()
        has_grad = both[1].tolist()
        live = {p.index for p in params if has_grad[p.index] > 0 and bad_list[p.index] == 0}
        bad_params = [p for p in params if bad_list[p.index] > 0]
        if not bad_params:
            return live
        labels = []
        for p in bad_params:
            names = self._all_groups[p.group].get("param_names")
            labels.append(repr(names[p.pos]) if names else f"group {p.group} parameter #{p.pos} (shape {tuple(p.shape)})")
        if any(self._all_groups[p.group].get("nonfinite", "skip") == "raise" for p in bad_params):
            raise FloatingPointError(
                f"QMuon (DeepSpeed): non-finite gradient in {', '.join(labels)}; no parameter or optimizer state was "
                "changed. Use nonfinite='skip' to skip such updates, or check the loss scale / learning rate"
            )
        self.nonfinite_skips += len(bad_params)
        if self._rank == 0:
            log.warning("QMuon (DeepSpeed): skipped update of %s (non-finite gradient)", ", ".join(labels))
        return live

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self._all_groups:
            for p in g["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()

    # ------------------------------------------------------------------ introspection
    @property
    def owners(self) -> list[int]:
        """Owner rank of every Muon parameter, in parameter order (empty before :meth:`attach`)."""
        return [p.owner for p in self._params if p.muon] if self._mode else []

    @property
    def inner(self) -> QMuon:
        """The QMuon that holds this rank's momentum (owned matrices) and AdamW state (its slices)."""
        return self._inner

    def state_nbytes(self, muon_only: bool = True) -> int:
        """Bytes of optimizer state on this rank (Muon momentum of owned matrices by default)."""
        return self._inner.state_nbytes(muon_only)

    # ------------------------------------------------------------------ checkpoints
    def _layout(self) -> list[Any]:
        return [[p.index, p.owner if p.muon else -1, p.numel,
                 None if p.holders[self._rank] is None else dataclasses.astuple(p.holders[self._rank])]
                for p in self._params]

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the quantized momentum of the Muon matrices it owns and the AdamW state of
        its slices, as plain tensors, plus the layout they belong to.

        At ZeRO stage 0 with several processes DeepSpeed saves only rank 0's optimizer state, so this
        gathers every owner's momentum to rank 0 and is a collective there (``engine.save_checkpoint``
        calls it on every rank).
        """
        if self._mode is None:
            self._require_attached()
        inner = self._inner.state_dict()
        if self._mode == "direct" and self._world > 1:
            muon_idx = {p.index for p in self._params if p.muon}
            mine = {k: {n: t.cpu() if isinstance(t, Tensor) else t for n, t in v.items()}
                    for k, v in inner["state"].items() if k in muon_idx}
            gathered: list[Any] = [None] * self._world if self._rank == 0 else None  # type: ignore[assignment]
            dst = 0 if self._group is None else dist.get_global_rank(self._group, 0)
            dist.gather_object(mine, gathered, dst=dst, group=self._group)
            if self._rank == 0:
                for part in gathered:
                    inner["state"].update(part)
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": []} for g in self._all_groups]
        return {
            "state": {},
            "param_groups": groups,
            _KEY: {
                "version": STATE_VERSION,
                "mode": self._mode,
                "world_size": self._world,
                "rank": self._rank,
                "layout": self._layout() if self._mode == "partitioned" else None,
                "owners": self.owners,
                "inner": inner,
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` wrote for this rank (same process count and ZeRO stage)."""
        if self._mode is None:
            self._require_attached()
        if state_dict is None:
            raise ValueError(
                "the checkpoint holds no optimizer state for this engine: it was saved at another ZeRO stage "
                "(stage 0 keeps it in mp_rank_00_model_states.pt, stages 1/2 in per-rank zero_pp_rank_* files). "
                "Resume with the same number of processes and ZeRO stage, or load with load_optimizer_states=False"
            )
        ours = state_dict.get(_KEY)
        if ours is None:
            raise ValueError(
                "this optimizer state was not written by qmuon_lightning's DeepSpeed integration (no "
                f"'{_KEY}' entry); a plain QMuon state dict loads with QMuon.load_state_dict before wrapping"
            )
        if ours["version"] > STATE_VERSION:
            raise ValueError(f"checkpoint layout version {ours['version']} is newer than this qmuon_lightning "
                             f"({STATE_VERSION}); upgrade qmuon_lightning")
        if ours["mode"] != self._mode or ours["world_size"] != self._world:
            raise ValueError(
                f"the checkpoint was saved with {ours['world_size']} process(es) in "
                f"{'ZeRO stage 1/2' if ours['mode'] == 'partitioned' else 'ZeRO stage 0'} mode; this run has "
                f"{self._world} in {'ZeRO stage 1/2' if self._mode == 'partitioned' else 'ZeRO stage 0'} mode. "
                "Resume with the same number of processes and ZeRO stage (QMuon's momentum is stored per owner rank)"
            )
        if list(ours["owners"]) != self.owners:
            raise ValueError("the checkpoint's matrix-to-rank assignment differs from this run's: the model or the "
                             "optimizer's parameter groups changed since it was saved")
        if self._mode == "partitioned":
            if ours["rank"] != self._rank:
                raise ValueError(f"rank {self._rank} was given rank {ours['rank']}'s optimizer state")
            if [list(x) if not isinstance(x, list) else x for x in ours["layout"]] != \
                    [list(x) for x in self._layout()]:
                raise ValueError("the checkpoint's ZeRO partition layout differs from this run's (different "
                                 "parameters, bucket alignment or process count)")
        inner = copy.copy(ours["inner"])
        state = dict(inner["state"])
        muon_idx = {p.index: p for p in self._params if p.muon}
        for k in list(state):
            if k in muon_idx and muon_idx[k].owner != self._rank:
                del state[k]  # another rank's matrix (stage 0: rank 0's file holds all of them)
        inner["state"] = state
        # AdamW proxies must look like the saved slices while loading (torch casts state to them).
        for info, proxy in zip(self._params, self._proxies):
            if not info.muon:
                v = self._views(info)
                proxy.data = v[0] if v is not None else torch.zeros(0, device=self._device)
        self._inner.load_state_dict(inner)
        for info, proxy in zip(self._params, self._proxies):
            if not info.muon:
                proxy.data = torch.zeros(0, device=self._device)
        for g, saved in zip(self._all_groups, state_dict.get("param_groups", [])):
            for k, v in saved.items():
                if k not in ("params", "param_names"):
                    g[k] = v

    def __repr__(self) -> str:
        muon = sum(p.muon for p in self._params)
        return (f"WholeMatrixZeroOptimizer(mode={self._mode}, world={self._world}, rank={self._rank}, "
                f"muon_matrices={muon}, owned={len(self._owned)}, adamw_params={len(self._params) - muon})")


# ------------------------------------------------------------------------------- entry point
def initialize(
    model: torch.nn.Module,
    optimizer: QMuon,
    config: Mapping[str, Any] | str | os.PathLike,
    *,
    lr_scheduler: Any = None,
    training_data: Any = None,
    collate_fn: Any = None,
    skip_cpu_op_builds: bool = True,
    **kwargs: Any,
) -> tuple[Any, WholeMatrixZeroOptimizer, Any, Any]:
    """``deepspeed.initialize`` with QMuon as the optimizer.

    Checks the config (:func:`check_config`), wraps ``optimizer`` (a fresh QMuon, e.g. from
    ``qmuon_lightning.build_optimizer(model)``) in :class:`WholeMatrixZeroOptimizer`, builds the
    engine and attaches the wrapper to it. ``lr_scheduler``: a scheduler built on ``optimizer``, or a
    callable taking the optimizer (DeepSpeed's convention). Returns ``(engine, wrapper, dataloader,
    lr_scheduler)``; train with ``engine.backward(loss); engine.step()`` and checkpoint with
    ``engine.save_checkpoint`` / ``engine.load_checkpoint``.

    ``skip_cpu_op_builds``: on DeepSpeed's CPU accelerator, call :func:`avoid_cpu_op_builds` first.
    """
    import deepspeed

    cfg = check_config(config)
    if skip_cpu_op_builds:
        avoid_cpu_op_builds()
    wrapper = WholeMatrixZeroOptimizer(optimizer)
    engine, ds_optimizer, loader, scheduler = deepspeed.initialize(
        model=model, optimizer=wrapper, config=cfg, lr_scheduler=lr_scheduler, training_data=training_data,
        collate_fn=collate_fn, **kwargs,
    )
    wrapper.attach(engine)
    return engine, wrapper, loader, scheduler
