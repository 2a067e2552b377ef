"""Attaching :class:`~.optimizer.WholeMatrixZeroOptimizer` to the DeepSpeed optimizer that wraps it
(:class:`ZeroAttachMixin`): from what DeepSpeed, Accelerate or the Trainer hand over, or from the
links DeepSpeed puts on the model's parameters, and reading the layout of each ZeRO stage."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ...distributed.flat import Segment
from .config import UnsupportedDeepSpeedConfig
from .layout import read_zero3_layout, read_zero12_links, resolve_zero

if TYPE_CHECKING:
    from .optimizer import WholeMatrixZeroOptimizer

__all__: list[str] = []


class ZeroAttachMixin:
    """``attach`` and the first-call attach of :class:`~.optimizer.WholeMatrixZeroOptimizer` (its
    attributes: ``_params``, ``_model_params``, ``_all_groups``, ``_mode``, ``_group``, ``_world``,
    ``_rank``, ``_flats``, ``_flat_index``; its ``_plan_slices`` deals owners once the layout is read)."""


    def attach(self, handle: Any) -> "WholeMatrixZeroOptimizer":
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

    def _attach_to(self, wrapper: Any, seq_group: Any) -> "WholeMatrixZeroOptimizer":
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
