"""QMuon under the DeepSpeed engine (ZeRO stages 0 to 3): every Muon matrix orthogonalized whole,
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
never runs. After the engine is built, :meth:`WholeMatrixZeroOptimizer.attach` (given the engine,
the ``accelerate.Accelerator`` or the ``transformers.Trainer``; or, without a call, at the first step
through the links DeepSpeed puts on the model's parameters) reads the partition layout: for each
parameter, which element range of which rank's flat fp32 partition holds which of its elements. Then, per
``step()`` call (DeepSpeed's ZeRO optimizer makes one per parameter group and optimizer step, after
the group's averaged gradients landed in its fp32 partition, after unscaling and clipping):

1. one small all-reduce of a "non-finite" flag per parameter, so every rank skips (or raises for)
   the same parameters before the call changes anything;
2. each Muon matrix has an *owner* rank, dealt by the sharded step's planner (Newton-Schulz cost,
   :func:`qmuon.distributed.plan.plan_owners`). One ``all_to_all`` sends every rank's slices of the
   averaged gradient of each matrix to its owner, through ``newton_schulz.comm_carrier``
   (:class:`qmuon.distributed.flat.FlatExchange`, the carriers of :mod:`qmuon.distributed.carrier`);
3. the owner runs QMuon's own momentum update (quantized state: int8 / 4-bit / ...) and whole-matrix
   NS, once: the momentum of a matrix exists only on its owner (ZeRO-1-like state partitioning);
4. a second ``all_to_all`` sends the NS output back through ``newton_schulz.comm_return``, each rank
   receiving the slices that fall in its own partition, and applies ``p *= 1 - lr wd; p -= lr_adj O``
   (per fused part) to them;
5. AdamW parameters are updated on the partition slices with QMuon's own AdamW step: fp32 moments
   elementwise on the flat slice; quantized (int8 / int4) or bf16 moments on pieces of the slice cut
   on the whole parameter's block grid (:func:`qmuon.quant.adamw.flat_slice_pieces`), so
   every block wholly in one rank's slice equals single-process QMuon's.

ZeRO stage 3 partitions the parameters themselves: every parameter is cut into ``N`` pieces of
``ceil(numel / N)`` elements, rank ``r`` keeps piece ``r`` between uses, and the client optimizer
gets one flat fp32 partition per *sub-group* (rank ``r``'s pieces of the sub-group's parameters, in
order), one ``step()`` call per sub-group. The wrapper reads the pieces' offsets
(:func:`.layout.read_zero3_layout`) and runs steps 1-5 per sub-group: the owner receives the other
pieces of its matrix's gradient, runs the quantized momentum and NS once on the whole matrix, and
every rank applies the update to its own piece. Routing and planning read each parameter's full
shape (``ds_shape``, :func:`qmuon.core.plan.true_shape`): under ``zero.Init`` a parameter
is an empty 1-D tensor between uses, and routing by ``p.shape`` would silently send every matrix to
AdamW (DeepSpeed #8438). DeepSpeed's own Muon at stage 3 all-gathers every full gradient *and* its
fp32 momentum to all ranks and back; here only the owner gets each gradient, the momentum never
moves, and it is quantized.

ZeRO stage 0 gives the client optimizer the real 2-D parameters (fp32, or DeepSpeed's unfused
fp16/bf16 wrapper's fp32 copies); the same owner split applies: only step 4 is needed after the
owner's update (every rank holds the whole matrix), and momentum still lives only on the owner.

bf16 master partitions (``"bf16": {"enabled": true, "bf16_master_weights_and_grads": true,
"bf16_optimizer_states": true}``, ZeRO 1-3, DeepSpeed >= 0.18): the flat partitions and gradients
are bf16 and there is no fp32 copy of the weights. The wrapper then writes every update (Muon's
return trip and the AdamW pieces) through the optimizer's ``bf16_update`` rule, as single-process
QMuon writes a ``model.to(torch.bfloat16)`` model: ``"stochastic"`` draws the noise of each element's
flat index in the whole parameter, keyed by the parameter's index and step (for a Muon matrix, its
owner's momentum step, shared with every rank holding a slice through the per-call flag
all-reduce); ``"ecc8"`` keeps the ``weight_ecc`` codes of each rank's slices (Muon: one per slice;
AdamW: one per piece) in that rank's optimizer file; the Muon gradients travel and are stepped in
bf16, as the single-process bf16 model's. A slice therefore writes the bits the whole bf16
parameter gets (tests/test_deepspeed_bf16.py). ``bf16_optimizer_states`` only lets DeepSpeed accept
the bf16 master without optimizer offload; QMuon's state keeps its own formats.

Checkpoints go through ``engine.save_checkpoint`` / ``engine.load_checkpoint``. Stages 1 to 3 write
one optimizer file per rank: each holds that rank's quantized momentum (its owned matrices) and the
AdamW state of its partition. Stage 0 writes only rank 0's optimizer state, so ``state_dict()``
gathers the owners' momentum to rank 0 (``engine.save_checkpoint`` calls it on every rank); on load
each rank keeps its own matrices. Resuming needs the same number of processes and ZeRO stage;
:func:`load_checkpoint` checks the process count first and names the fix
(:mod:`.checkpoint`).

Not supported (each raises :class:`UnsupportedDeepSpeedConfig` naming the fix): an ``optimizer``
section in the DeepSpeed config together with QMuon, ``offload_optimizer`` (DeepSpeed would replace
the client optimizer with DeepSpeedCPUAdam), ``offload_param`` and the stage-3 options that change
where partitions live or how they are stored (MiCS, hpZ, quantized weights), ``elastic_checkpoint``,
and bf16 at stage 1 with fp32 gradient accumulation (DeepSpeed's ``BF16_Optimizer``, a different
partition layout).

Modules: :mod:`.config` (configuration checks), :mod:`.layout` (where each parameter's elements
live per stage, which DeepSpeed optimizer wraps the client), :mod:`.attach` (attaching to it),
:mod:`.optimizer` (the client optimizer), :mod:`.optimizer_state`
(its per-rank checkpoint state), :mod:`.checkpoint` (resume checks)."""

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
