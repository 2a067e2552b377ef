"""The client optimizer: :class:`WholeMatrixZeroOptimizer` (see the package docstring)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ...core import pipeline
from ...distributed.flat import FlatParam, Segment
from ...distributed.flat_step import FlatOwnerStep
from ...optim.qmuon import QMuon
from .config import UnsupportedDeepSpeedConfig, check_accelerate_plugin
from .layout import read_zero3_layout, read_zero12_links, resolve_zero
from .optimizer_state import ZeroStateMixin

__all__ = ["WholeMatrixZeroOptimizer"]


class WholeMatrixZeroOptimizer(ZeroStateMixin, FlatOwnerStep):
    """Client optimizer for ``deepspeed.initialize`` that runs a :class:`~qmuon.QMuon`'s
    algorithm with whole-matrix Newton-Schulz under ZeRO stages 0 to 3 (see the package docstring):
    the step over a flat layout (:class:`qmuon.distributed.flat_step.FlatOwnerStep`), on the layout
    read from DeepSpeed's ZeRO optimizer (:meth:`attach`, :mod:`.layout`).

    Build it from a fresh QMuon (for example ``qmuon.build_optimizer(model)``), pass it as
    ``optimizer=`` to ``deepspeed.initialize``, then call :meth:`attach` with the engine;
    :func:`initialize` does all three. The QMuon's parameter-group dicts are shared, not copied, so
    an LR scheduler built on the QMuon drives this optimizer.

    Attributes:
        nonfinite_skips: parameter updates skipped because their averaged gradient held NaN/Inf
            (groups with ``nonfinite="skip"``); the same count on every rank.
        ns_items: after a step, NS calls this rank made per Muon parameter index (one per matrix, or
            one per fused part); summed over ranks it is ``len(parts)`` (or 1) for every matrix.
        comm_stats: after a step, the bytes its Muon exchange moved
            (:class:`qmuon.distributed.flat.FlatExchange`), in the terms of ``QMuon.comm_stats``.
    """

    def __init__(self, qmuon: QMuon) -> None:
        if not isinstance(qmuon, QMuon):
            raise TypeError(
                f"WholeMatrixZeroOptimizer wraps a qmuon.QMuon, got {type(qmuon).__name__}; build one "
                "with qmuon.build_optimizer(model)"
            )
        if qmuon.gradient_release is not None:
            raise ValueError(
                "gradient_release=True cannot combine with DeepSpeed ZeRO: ZeRO reduces and partitions the gradients "
                "into flat buckets after backward, so a parameter's hook would step it with its unreduced local "
                "gradient. Build the QMuon without gradient_release for DeepSpeed, or train with the qmuon_fsdp "
                "strategy (FSDP2), where release steps the reduced shards"
            )
        if qmuon.qk_clip is not None:  # its step post-hook would never run: the engine steps the flat layout
            raise ValueError(
                "qk_clip cannot combine with DeepSpeed ZeRO: the engine steps the flat partitions without "
                "QMuon.step(), whose post-hook rescales W_q / W_k, so the clip would never run. Build the QMuon "
                "without qk_clip for DeepSpeed, or train with the qmuon_fsdp strategy or Accelerate's FSDP2, where "
                "it runs"
            )
        check_accelerate_plugin()  # offload_optimizer would have Accelerate drop this optimizer silently
        if any(len(st) for st in qmuon.state.values()):
            raise ValueError(
                "the QMuon already has optimizer state (it has stepped or loaded a checkpoint): wrap a fresh QMuon "
                "and restore state through engine.load_checkpoint"
            )
        if qmuon.max_nonfinite_skips is not None:
            raise NotImplementedError(
                f"max_nonfinite_skips={qmuon.max_nonfinite_skips} is not enforced under DeepSpeed (this wrapper skips "
                "non-finite updates itself and counts them in nonfinite_skips); build the QMuon without it")
        super().__init__(qmuon)
        self._mode: str | None = None  # "direct" (stage 0), "partitioned" (ZeRO 1/2) or "zero3"
        self._flats: list[Tensor] = []  # ZeRO-3: the flat fp32 partition of every sub-group
        self._flat_index: dict[int, int] = {}  # ZeRO-3: id(flat partition) -> sub-group

    # ------------------------------------------------------------------ attaching: reading the layout
    def attach(self, handle: Any) -> WholeMatrixZeroOptimizer:
        """Read the partition layout of the DeepSpeed optimizer wrapping this one and deal Muon matrices
        to owner ranks. Call it on every rank, after ``deepspeed.initialize(optimizer=this, ...)``.

        ``handle``: what DeepSpeed or its caller hands back (:func:`.layout.resolve_zero`): the
        ``DeepSpeedEngine`` from ``deepspeed.initialize``, the ``accelerate.Accelerator`` that prepared
        it (or the optimizer ``accelerator.prepare`` returned), or the ``transformers.Trainer`` training
        with it. Without a call, the first ``step()`` / ``state_dict()`` / ``load_state_dict()`` attaches
        through the links DeepSpeed puts on the model's parameters (ZeRO 1-3), or raises naming this call.
        """
        zero, engine = resolve_zero(handle, self)
        return self._attach_to(zero, getattr(engine, "seq_data_parallel_group", None))

    def _attach_to(self, wrapper: Any, seq_group: Any) -> WholeMatrixZeroOptimizer:
        """:meth:`attach` given the optimizer DeepSpeed steps (``engine.optimizer``) and the engine's
        data-parallel group (stage 0). Kinds by class, so DeepSpeed's subclasses are read as theirs."""
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        if wrapper is not self and getattr(wrapper, "optimizer", None) is not self:
            raise ValueError(f"the engine's optimizer ({type(wrapper).__name__}) does not wrap this optimizer; pass "
                             "optimizer=this WholeMatrixZeroOptimizer to deepspeed.initialize")
        if wrapper is self or isinstance(wrapper, FP16_UnfusedOptimizer):
            self._attach_direct(seq_group)
        elif isinstance(wrapper, DeepSpeedZeroOptimizer_Stage3):
            self._attach_zero3(wrapper)
        elif isinstance(wrapper, DeepSpeedZeroOptimizer):
            self._attach_partitioned(wrapper)
        else:
            raise UnsupportedDeepSpeedConfig(
                f"DeepSpeed wrapped the optimizer in {type(wrapper).__name__}, whose layout QMuon does not read "
                "(supported: ZeRO stage 0 with fp32 or unfused fp16/bf16, DeepSpeedZeroOptimizer at stages 1 and 2, "
                "DeepSpeedZeroOptimizer_Stage3). Check the config with qmuon.integrations.deepspeed.check_config"
            )
        self._plan_slices()
        return self

    def _set_world(self, group: Any) -> None:
        if dist.is_available() and dist.is_initialized():
            self._group = group
            self._world = dist.get_world_size(group)
            self._rank = dist.get_rank(group)
        else:
            self._group, self._world, self._rank = None, 1, 0

    def _attach_direct(self, group: Any) -> None:
        for info in self._params:
            cur = self._all_groups[info.group]["params"]
            if len(cur) <= info.pos or cur[info.pos].shape != info.shape:
                raise RuntimeError(
                    f"parameter group {info.group} no longer holds the model's parameters as built, and no DeepSpeed "
                    f"optimizer was found through them to read where they went: call {self.ATTACH_CALL}"
                )
            if not cur[info.pos].is_contiguous():
                raise ValueError(f"parameter {info.index} (shape {tuple(info.shape)}) is not contiguous")
        self._mode = "direct"
        self._gather = False  # every rank holds every parameter whole: no gradient travels
        self._set_world(group)
        for info in self._params:
            info.holders = [Segment(0, info.numel, 0)] * self._world

    def _attach_partitioned(self, zero: Any = None) -> None:
        """ZeRO stages 1/2, read from the links on the model's parameters (:func:`.layout.read_zero12_links`);
        ``zero``, when given, is cross-checked."""
        groups = {id(getattr(p, "_dp_group", None)): getattr(p, "_dp_group", None) for p in self._model_params}
        if zero is not None:
            groups.update((id(g), g) for g in zero.real_dp_process_group)
            if len(zero.bit16_groups) != len(self._all_groups):
                raise RuntimeError(f"DeepSpeed built {len(zero.bit16_groups)} flat groups for {len(self._all_groups)} "
                                   "parameter groups")
        if len(groups) != 1:
            raise UnsupportedDeepSpeedConfig("parameter groups with different data-parallel groups (MoE) are not "
                                             "supported")
        flats = [g["params"][0] if len(g["params"]) == 1 else None for g in self._all_groups]
        if any(f is None or f.ndim != 1 for f in flats):
            raise RuntimeError("ZeRO stage 1/2: every parameter group must hold one flat partition, as DeepSpeed's "
                               "ZeRO optimizer leaves it")
        self._mode = "partitioned"
        self._set_world(next(iter(groups.values())))
        read_zero12_links(self._params, self._model_params, flats, self._world, self._group)

    def _attach_zero3(self, zero: Any) -> None:
        """ZeRO stage 3: every parameter is cut into ``N`` pieces (:func:`.layout.zero3_segments`); the
        exchange per step is that of stages 1/2, per sub-group (DeepSpeed steps one sub-group per call)."""
        groups = list(zero.sub_group_process_groups)
        dp = zero.dp_process_group
        if any(g is not groups[0] for g in groups) or (dp is not None and groups and dist.get_world_size(groups[0])
                                                       != dist.get_world_size(dp)):
            raise UnsupportedDeepSpeedConfig(
                "ZeRO-3 sub-groups partitioned over different process groups (MiCS, AutoEP expert groups) are not "
                "supported: QMuon deals matrices to the ranks of one data-parallel group. Remove mics_shard_size / "
                "expert parallelism from the config")
        if getattr(zero, "offload_optimizer", False):
            raise UnsupportedDeepSpeedConfig("ZeRO-3 with offload_optimizer: remove 'offload_optimizer' (see check_config)")
        self._mode = "zero3"
        self._set_world(groups[0] if groups else dp)
        self._flats = read_zero3_layout(zero, self._params, self._world)
        self._flat_index = {id(t): sg for sg, t in enumerate(self._flats)}

    #: Set by whoever hands this optimizer to a ``deepspeed.initialize`` it does not call itself
    #: (``QMuonFactory`` under ``transformers.Trainer``, ``prepare_qmuon`` under Accelerate): without
    #: links on the parameters (ZeRO stage 0), the first step then attaches to the whole matrices it holds.
    auto_attach: bool = False

    #: The call that attaches, for error messages.
    ATTACH_CALL = ("optimizer.attach(engine) on every rank after deepspeed.initialize (or pass the accelerate."
                   "Accelerator / transformers.Trainer: optimizer.attach(accelerator)), or build the engine with "
                   "qmuon.integrations.deepspeed.initialize(...) / prepare_qmuon(accelerator, model, ...)")

    def _require_attached(self) -> None:
        """Attach at the first step / checkpoint call, when no one called :meth:`attach`: through the
        links DeepSpeed puts on the model's parameters (those ``deepspeed.utils.safe_get_full_fp32_param``
        reads): ZeRO-3's ``_z3_optimizer``, ZeRO-1/2's ``_hp_mapping`` fragments; at stage 0 (no link,
        the groups still hold the matrices) to the matrices themselves. Anything else raises, naming
        :meth:`attach`, before the step changes anything."""
        if self._mode is not None:
            return
        z3 = {id(z): z for z in (getattr(p, "_z3_optimizer", None) for p in self._model_params) if z is not None}
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if z3:
            zero = next(iter(z3.values()))
            if len(z3) > 1 or getattr(zero, "optimizer", None) is not self:
                raise RuntimeError("the model's parameters are linked to a ZeRO-3 optimizer that does not wrap this "
                                   f"WholeMatrixZeroOptimizer: call {self.ATTACH_CALL}")
            self._attach_to(zero, None)
        elif any(hasattr(p, "_hp_mapping") for p in self._model_params):
            self._attach_partitioned(None)
            self._plan_slices()
        elif distributed and not self.auto_attach:
            raise RuntimeError(f"WholeMatrixZeroOptimizer.step() before attach: call {self.ATTACH_CALL}")
        else:
            self._attach_direct(None)
            self._plan_slices()

    # ------------------------------------------------------------------ step
    def _views(self, info: FlatParam) -> tuple[Tensor, Tensor | None] | None:
        """This rank's (data, grad) 1-D views of a parameter's slice, or None when it holds none."""
        seg = info.holders[self._rank]
        if seg is None:
            return None
        if self._mode == "zero3":
            flat = self._flats[info.subgroup]
            data = flat.data.narrow(0, seg.local, seg.length)
            grad = None if flat.grad is None else flat.grad.narrow(0, seg.local, seg.length)
        elif self._mode == "partitioned":
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

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = pipeline.call_closure(closure)
        self._require_attached()
        self._flat_step(*self._active_params())
        return loss

    def _active_params(self) -> tuple[list[FlatParam], bool]:
        """The parameters the current ``step()`` call updates, and whether the call is the first of an
        optimizer step. All of them, except under DeepSpeed's ZeRO optimizers: at stages 1/2
        ``param_groups`` is narrowed to one group per call; at stage 3 one group holds one sub-group's
        flat partition (the others are empty) per call. DeepSpeed steps them in order."""
        if self._mode == "zero3":
            live = [g["params"] for g in self._all_groups if g["params"]]
            if len(live) != 1 or len(live[0]) != 1 or id(live[0][0]) not in self._flat_index:
                raise RuntimeError("ZeRO-3 called step() with parameter groups that are not one of its sub-groups' flat "
                                   "partitions; WholeMatrixZeroOptimizer.step() is called by the engine (engine.step())")
            sg = self._flat_index[id(live[0][0])]
            return [p for p in self._params if p.subgroup == sg], sg == 0
        ids = {id(g) for g in self.param_groups}
        active = {i for i, g in enumerate(self._all_groups) if id(g) in ids}
        if len(active) != len(self.param_groups):
            raise RuntimeError("param_groups holds groups this optimizer was not built with; build a new "
                               "WholeMatrixZeroOptimizer instead of calling add_param_group")
        return [p for p in self._params if p.group in active], 0 in active

    def __repr__(self) -> str:
        muon = sum(p.muon for p in self._params)
        return (f"WholeMatrixZeroOptimizer(mode={self._mode}, world={self._world}, rank={self._rank}, "
                f"muon_matrices={muon}, owned={len(self._owned)}, adamw_params={len(self._params) - muon})")
