"""``Trainer(strategy="qmuon_deepspeed")``: Lightning's DeepSpeed strategy with QMuon whole-matrix updates.

:class:`QMuonDeepSpeedStrategy` is Lightning's :class:`~lightning.pytorch.strategies.DeepSpeedStrategy`
with three changes:

- the QMuon returned by ``configure_optimizers`` is wrapped in
  :class:`~qmuon.integrations.deepspeed.WholeMatrixZeroOptimizer` before
  ``deepspeed.initialize`` and attached to the engine afterwards, so under ZeRO stages 0-3 every
  Muon matrix is orthogonalized whole, once per step, by one owner rank (see that module);
- the DeepSpeed config is checked with
  :func:`~qmuon.integrations.deepspeed.check_config` (no ``optimizer`` section, no
  optimizer offload, ...), each refusal naming the fix;
- it also runs on the CPU accelerator (gloo), which Lightning's own ``setup_environment`` refuses:
  nothing else in the strategy is CUDA-specific, and DeepSpeed itself runs on its CPU accelerator.
  On CPU, DeepSpeed's JIT-compiled communication op is skipped
  (:func:`~qmuon.integrations.deepspeed.avoid_cpu_op_builds`).

Names registered in Lightning's ``StrategyRegistry`` on import: ``"qmuon_deepspeed"`` (ZeRO stage 2),
``"qmuon_deepspeed_stage_1"``, ``"qmuon_deepspeed_stage_2"``, ``"qmuon_deepspeed_stage_3"``. At
stage 3 a model built in ``configure_model`` is created under ``deepspeed.zero.Init`` (partitioned
from the start); ``qmuon_lightning.build_optimizer`` routes it by the full shapes. Stage 0:
``QMuonDeepSpeedStrategy(zero_optimization=False)``. A config dict or JSON path works as for
Lightning's strategy: ``QMuonDeepSpeedStrategy(config="examples/ds_config_zero2.json")``.

bf16 weights without an fp32 master copy: ``precision="bf16-true"`` with a config whose bf16 section
asks for DeepSpeed's bf16 master partitions, ``{"bf16": {"enabled": True, "bf16_master_weights_and_grads":
True, "bf16_optimizer_states": True}, "zero_optimization": {"stage": 2}}`` (stages 1-3); Lightning keeps a
user's bf16 section (it adds ``{"enabled": True}`` only when there is none), and QMuon writes its updates
through its ``bf16_update`` rule (see :mod:`qmuon.integrations.deepspeed`).

Checkpoints are DeepSpeed checkpoint directories (``trainer.save_checkpoint(path)`` /
``Trainer.fit(ckpt_path=path)``): the quantized momentum is in the optimizer state DeepSpeed writes
(one file per rank at stages 1-3). Resume with the same number of processes and ZeRO stage: a
checkpoint from another process count raises
:class:`~qmuon.integrations.deepspeed.CheckpointWorldSizeError` naming both and the fix.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.strategies.ddp import DDPStrategy
from torch.nn import Module
from torch.optim import Optimizer

from qmuon.integrations.deepspeed import WholeMatrixZeroOptimizer, avoid_cpu_op_builds, check_config, check_resume
from qmuon.optim.qmuon import QMuon

__all__ = ["QMuonDeepSpeedStrategy"]

#: Names this module registers, with the ZeRO stage each selects.
STRATEGY_NAMES = {"qmuon_deepspeed": 2, "qmuon_deepspeed_stage_1": 1, "qmuon_deepspeed_stage_2": 2,
                  "qmuon_deepspeed_stage_3": 3}


class QMuonDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO 0-3 with QMuon's whole-matrix Newton-Schulz and quantized momentum.

    Takes the arguments of Lightning's ``DeepSpeedStrategy``. ``configure_optimizers`` must return
    one QMuon (for example ``qmuon_lightning.build_optimizer(self)``), optionally with a scheduler.
    Other optimizers pass through to DeepSpeed unchanged.
    """

    strategy_name = "qmuon_deepspeed"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.config = check_config(self.config)  # refuse impossible configs at construction
        #: The wrapper handed to DeepSpeed (None until fit starts or when the optimizer is not QMuon).
        self.qmuon_optimizer: Optional[WholeMatrixZeroOptimizer] = None

    def setup_environment(self) -> None:
        if isinstance(self.accelerator, CPUAccelerator):
            # Lightning's DeepSpeedStrategy raises for any non-CUDA accelerator; DeepSpeed runs on its CPU
            # accelerator (gloo), so skip only that check.
            DDPStrategy.setup_environment(self)
            return
        super().setup_environment()

    def setup_distributed(self) -> None:
        if isinstance(self.accelerator, CPUAccelerator):
            # Lightning's version first checks that CUDA device indices match local ranks; CPU devices
            # have no index. The rest is the same.
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()
            return
        super().setup_distributed()

    def _init_deepspeed_distributed(self) -> None:
        if isinstance(self.accelerator, CPUAccelerator):
            avoid_cpu_op_builds()
        super()._init_deepspeed_distributed()

    def _setup_model_and_optimizer(
        self, model: Module, optimizer: Optional[Optimizer], lr_scheduler: Any = None
    ) -> tuple[Any, Optimizer]:
        import deepspeed

        wrapper = None
        if isinstance(optimizer, QMuon):
            self.config = check_config(self.config)  # again: Lightning filled in precision, batch size, clipping
            wrapper = WholeMatrixZeroOptimizer(optimizer)
            optimizer = wrapper
        # As Lightning's DeepSpeedStrategy does, except the device rank: a CPU device has no index, and
        # DeepSpeed compares args.device_rank with 0, so the local rank stands in for it there.
        index = self.root_device.index
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank if index is None else index),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        if wrapper is not None:
            wrapper.attach(engine)
            self.qmuon_optimizer = wrapper
        return engine, ds_optimizer

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if self.qmuon_optimizer is not None and not (self.load_full_weights and self.zero_stage_3):
            # A DeepSpeed checkpoint directory (tag "checkpoint", as Lightning saves it) from another process
            # count: say so, with the fix, before DeepSpeed loads anything.
            check_resume(checkpoint_path, "checkpoint", self.world_size)
        return super().load_checkpoint(checkpoint_path, weights_only)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, stage in STRATEGY_NAMES.items():
            strategy_registry.register(
                name, cls, description=f"DeepSpeed ZeRO stage {stage} with QMuon whole-matrix updates",
                override=True, stage=stage,
            )


if "qmuon_deepspeed" not in StrategyRegistry:
    QMuonDeepSpeedStrategy.register_strategies(StrategyRegistry)
