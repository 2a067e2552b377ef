"""QMuon under the DeepSpeed engine (ZeRO stages 0 to 3): every Muon matrix orthogonalized whole,
exactly once per step, with quantized momentum that lives on one rank. The page: docs/deepspeed.md.

ZeRO hands a client optimizer flat partitions whose boundaries ignore parameter boundaries (stages
1/2: one flat buffer per group cut into ``N`` pieces; stage 3: every parameter cut into ``N``
pieces, one flat partition per sub-group); Newton-Schulz needs whole matrices. This package is the
adapter between DeepSpeed and the step over a flat layout (:mod:`qmuon.distributed.flat_step`):

- :class:`WholeMatrixZeroOptimizer`, the client optimizer handed to ``deepspeed.initialize`` (its
  class name contains no "muon" and it tags no parameter, so DeepSpeed's own Muon code never runs);
  it reads the layout (:mod:`.layout`: which element range of which rank's
  partition holds which elements of each parameter) and steps each call DeepSpeed makes (one per
  group, or ZeRO-3 sub-group) with the shared step: owners dealt by the sharded step's planner,
  gradients to the owner and updates back through ``newton_schulz.comm_carrier`` /
  ``comm_return`` (:mod:`qmuon.distributed.flat`), momentum and Newton-Schulz on the owner, AdamW
  on the slices, bf16 master partitions written through ``bf16_update``;
- checkpoints (:mod:`.optimizer_state`: each rank's file holds its owned matrices' momentum and its
  slices' AdamW state; :mod:`.checkpoint`: resume on the process count that saved);
- configuration checks (:mod:`.config`): what the step cannot host (an ``optimizer`` section,
  ``offload_optimizer``, ``offload_param``, MiCS / hpZ / quantized weights at stage 3,
  ``elastic_checkpoint``, bf16 at stage 1 with fp32 gradient accumulation) raises
  :class:`UnsupportedDeepSpeedConfig` naming the option, before the first step.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from ...optim.qmuon import QMuon
from .checkpoint import CheckpointWorldSizeError, check_resume, load_checkpoint, saved_world_size
from .config import UnsupportedDeepSpeedConfig, avoid_cpu_op_builds, check_config, require_deepspeed
from .optimizer import WholeMatrixZeroOptimizer

__all__ = [
    "UnsupportedDeepSpeedConfig",
    "CheckpointWorldSizeError",
    "check_config",
    "avoid_cpu_op_builds",
    "WholeMatrixZeroOptimizer",
    "initialize",
    "load_checkpoint",
    "check_resume",
    "saved_world_size",
]


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
    ``qmuon.build_optimizer(model)``) in :class:`WholeMatrixZeroOptimizer`, builds the
    engine and attaches the wrapper to it. ``lr_scheduler``: a scheduler built on ``optimizer``, or a
    callable taking the optimizer (DeepSpeed's convention). Returns ``(engine, wrapper, dataloader,
    lr_scheduler)``; train with ``engine.backward(loss); engine.step()`` and checkpoint with
    ``engine.save_checkpoint`` / :func:`load_checkpoint` (or ``engine.load_checkpoint``).

    ``skip_cpu_op_builds``: on DeepSpeed's CPU accelerator, call :func:`avoid_cpu_op_builds` first.
    """
    deepspeed = require_deepspeed()
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
