"""Sharded QMuon: FSDP2 (DTensor ``Shard(0)``) parameters, distributed Newton-Schulz, checkpoints.

Nothing here needs to be called by hand: after ``fully_shard(model)``, ``QMuon(...)`` /
``qmuon.build_optimizer(model, ...)`` see DTensor parameters and

* keep each rank's momentum (codes and scales) for its own rows, stored as ``Shard(0)`` DTensors
  as each state format places its tensors (:mod:`qmuon.quant.layout`, re-exported by
  :mod:`.sharding`), so ``torch.distributed.checkpoint`` saves and reshards it;
* orthogonalize every whole matrix on one rank, about ``1/N`` of the matrices per rank, moving
  rows with compact carriers (:mod:`.orthogonalize`, :mod:`.carrier`);
* report bytes moved per step in ``opt.comm_stats`` / ``opt.comm_bytes_last_step``.

Meshes: FSDP2 ``Shard(0)`` on a 1-D mesh, HSDP ``(replicate, shard)`` (:mod:`.mesh`), and data
parallel x tensor parallel ``(dp, tp)`` with colwise / rowwise plans (:mod:`.tensor_parallel`).

:mod:`.checkpoint` gathers / scatters a consolidated (full) optimizer state dict. Formats with
per-matrix pieces (grasp4, e0m3) update their shards with a few small collectives in their own
``StateFormat.update_sharded`` (:mod:`qmuon.quant.formats`).
:func:`.exit_after_distributed_run` ends a rank of a multi-process script that succeeded.
"""

from .checkpoint import full_state_dict, load_full_state_dict
from .orthogonalize import ShardedStep
from .process_group import exit_after_distributed_run, shut_down_process_group

__all__ = [
    "ShardedStep",
    "exit_after_distributed_run",
    "full_state_dict",
    "load_full_state_dict",
    "shut_down_process_group",
]
