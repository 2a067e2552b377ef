"""``QMuonFSDPStrategy``: Lightning's FSDP2 strategy (``ModelParallelStrategy``) with QMuon.

What it adds to :class:`lightning.pytorch.strategies.ModelParallelStrategy`:

1. **Sharding without ``configure_model``.** Lightning's strategy requires the LightningModule to
   call ``fully_shard`` in ``configure_model``. This one applies ``fully_shard`` itself when
   nothing was sharded, by a policy (:mod:`.sharding`; default: each repeated block, then the
   roots). A ``configure_model`` that shards is respected as it is.
2. **Optimizer swap.** With ``optimizer="qmuon"`` the optimizer returned by
   ``configure_optimizers`` is replaced, after sharding, by
   :func:`qmuon_lightning.build_optimizer` on the sharded module: hidden matrices go to Muon with
   quantized momentum, the rest to an auxiliary AdamW that keeps the user's AdamW settings; LR
   schedulers are rebound (:mod:`.optimizer_swap`). The routing table is logged once on rank 0.
   ``optimizer="keep"`` trains with whatever ``configure_optimizers`` returned.
3. **Data parallel by default.** ``tensor_parallel_size`` defaults to 1 and the data-parallel
   mesh dimension spans every process (Lightning's default puts all devices of a node on the
   tensor-parallel dimension, which only makes sense with a tensor-parallel ``configure_model``).
4. **Activation checkpointing.** ``activation_checkpointing_policy`` as Lightning's
   ``FSDPStrategy`` takes it (a set of module classes, an auto-wrap policy callable, or class
   names from YAML): the selected modules are wrapped in ``torch.distributed``'s non-reentrant
   ``checkpoint_wrapper`` after sharding (Lightning's own helper), so their activations are
   recomputed in backward instead of kept.
5. **Communication metric.** After each optimizer step, if the optimizer reports how many bytes
   its step sent (attribute ``comm_bytes_last_step``: QMuon's distributed Newton-Schulz exchange),
   the value is logged as ``qmuon/comm_bytes`` through ``LightningModule.log``.

Checkpoints: with ``save_distributed_checkpoint=True`` (default) a directory written by
``torch.distributed.checkpoint`` (each rank writes its shards; loading reshards, so a run saved on
2 processes resumes on 1 and vice versa) in the layout of Lightning's ``FSDPStrategy`` (weights
under ``"model"``), which ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` turns into
one file for ``LightningModule.load_from_checkpoint``; with ``False`` one consolidated file on rank 0. A sharded save is written into a hidden staging
directory and renamed into place when every rank has finished
(:mod:`qmuon.distributed.resume`), so a crash never leaves a half-written directory
under a checkpoint's name, and loading an incomplete checkpoint fails naming what is missing. The
metadata gains a ``"qmuon_fsdp"`` entry (optimizer types, state formats, world size).
:meth:`QMuonFSDPStrategy.load_checkpoint` checks that entry and restores optimizer state for
exactly the parameters that had state when saved (see there).
"""

from __future__ import annotations

import logging
import shutil
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer, _MockOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from qmuon.distributed.resume import publish_directory, require_complete, staging_path
from qmuon.core.config import QMuonConfig
from qmuon.optim.qmuon import QMuon
from qmuon.optim.release import check_trainer_compatible, release_of
from qmuon.optim.routing import format_routing_table
from qmuon.integrations.fabric import optimizer_swap as swap
from qmuon.integrations.fabric.checkpoint_state import (CKPT_KEY, apply_format_overrides, check_compatible, checkpoint_info, load_file,
                               load_full_state, load_sharded_state, saved_dcp_keys)
from qmuon.integrations.fabric.mixin import OptimizerMode, QMuonStrategyMixin
from qmuon.integrations.fabric.options import (ActivationCheckpointingPolicy, activation_checkpointing_kwargs, build_replacement,
                      check_sharded_formats, ensure_release, no_muon_warning, setup_activation_checkpointing)
from qmuon.integrations.fabric.sharding import (ShardPolicy, check_replicate_size, describe_sharding, hsdp_mesh, shard_unless_sharded)

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["QMuonFSDPStrategy"]

log = logging.getLogger(__name__)

#: The key of the weights in a sharded checkpoint directory written by this strategy (Lightning's
#: ``FSDPStrategy`` layout; ``ModelParallelStrategy`` writes ``"state_dict"``, which is still read).
SHARDED_MODEL_KEY = "model"


def sharded_model_key(path: Path) -> str:
    """``"model"`` or ``"state_dict"``: under which key the sharded checkpoint ``path`` holds the weights."""
    keys = saved_dcp_keys(path)
    return SHARDED_MODEL_KEY if any(k.startswith(SHARDED_MODEL_KEY + ".") for k in keys) else "state_dict"


_NO_OPTIMIZER_STATE = (
    "{path} holds no optimizer state (saved with save_weights_only=True?), so training cannot resume from it. "
    "To start a new run from its weights, load them into the module before fit, or use a full checkpoint"
)


class QMuonFSDPStrategy(QMuonStrategyMixin, ModelParallelStrategy):
    """FSDP2 (``fully_shard``) strategy that shards the model by a policy when ``configure_model``
    does not, and trains it with :class:`~qmuon_lightning.QMuon`.

    Registered on ``import qmuon_lightning`` as ``"qmuon_fsdp"`` and presets
    (``"qmuon_fsdp_int8_stochastic"``, ``"qmuon_fsdp_grasp4"``,
    ``"qmuon_fsdp_keep"``); use ``Trainer(strategy="qmuon_fsdp")``, an instance, or a YAML
    ``class_path: qmuon_lightning.strategies.QMuonFSDPStrategy``.

    Args:
        optimizer: ``"qmuon"``: replace the optimizer from ``configure_optimizers`` by
            ``build_optimizer(module, **optimizer_kwargs)``; its AdamW / Adam settings (``lr``,
            ``betas``, ``eps``, ``weight_decay``) become the auxiliary AdamW's unless
            ``optimizer_kwargs`` sets ``adamw_*`` itself. ``"keep"``: use the configured optimizer
            unchanged.
        optimizer_kwargs: the QMuon options: a :class:`~qmuon.QMuonConfig` or a dict of its options
            (``{"lr": 0.02, "state_format": "int8", "state": {"rounding": "stochastic"}}``), checked here.
        shard_policy: which modules become FSDP units when ``configure_model`` does not shard:
            ``"auto"``, ``"root"``, a list of classes or class names, or a callable
            ``(name, module) -> bool`` (see :mod:`qmuon.integrations.fabric.sharding`).
        reshard_after_forward: passed to ``fully_shard`` (free gathered parameters after forward).
        log_comm_bytes: log the optimizer's ``comm_bytes_last_step`` as ``qmuon/comm_bytes``.
        data_parallel_size, tensor_parallel_size: device-mesh shape; defaults: all processes on the
            data-parallel dimension, tensor parallel size 1.
        save_distributed_checkpoint: ``True``: sharded checkpoint directory
            (``torch.distributed.checkpoint``); ``False``: one consolidated file written by rank 0.
        process_group_backend, timeout: as in ``ModelParallelStrategy`` (default backend: NCCL on
            CUDA, gloo on CPU).
        replicate_size: HSDP replicas (``1``: FSDP2 over all data-parallel ranks). With ``R > 1`` the
            automatic sharding uses a ``(replicate, shard)`` mesh of ``R x (data_parallel_size / R)``
            (multi-node: shard inside a node, replicate across nodes); sharded QMuon orthogonalizes
            each matrix once over all ranks (docs/distributed.md, HSDP).
        activation_checkpointing_policy: which modules recompute their activations in backward
            (Lightning ``FSDPStrategy``'s argument): a set of ``nn.Module`` classes (``{Block}``),
            an FSDP auto-wrap policy callable ``(module, recurse, nonwrapped_numel) -> bool``, or
            class names (``["Block"]`` matches the class or a base class by name,
            ``["pkg.mod.Block"]`` is imported). ``None``: none. Applied after sharding with
            ``checkpoint_wrapper`` (non-reentrant); the wrapped names are in
            :attr:`checkpointed_modules`.
    """

    strategy_name = "qmuon_fsdp"

    def __init__(
        self,
        optimizer: OptimizerMode = "qmuon",
        optimizer_kwargs: Union[dict[str, Any], QMuonConfig, None] = None,
        shard_policy: ShardPolicy = "auto",
        reshard_after_forward: bool = True,
        log_comm_bytes: bool = True,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        tensor_parallel_size: Union[Literal["auto"], int] = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        replicate_size: int = 1,
        activation_checkpointing_policy: Optional[ActivationCheckpointingPolicy] = None,
    ) -> None:
        self._check_init_args(optimizer, data_parallel_size, tensor_parallel_size)
        self._activation_checkpointing_kwargs = activation_checkpointing_kwargs(activation_checkpointing_policy)
        check_replicate_size(replicate_size, tensor_parallel_size)
        self._replicate_size = replicate_size
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_qmuon_settings(optimizer, optimizer_kwargs, shard_policy, reshard_after_forward)
        self._log_comm_bytes = bool(log_comm_bytes)
        #: Qualified names of the FSDP units this strategy created (blocks, roots); empty if
        #: ``configure_model`` sharded the model itself. Set in ``setup``.
        self.sharded_blocks: list[str] = []
        self.sharded_roots: list[str] = []
        #: Routing decisions of the swapped-in QMuon (name, shape, target, rule); set in ``setup``.
        self.routing: list[Any] = []
        self._routing_logged = False
        #: Qualified names of the modules wrapped for activation checkpointing; set in ``setup``.
        self.checkpointed_modules: list[str] = []

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """``ModelParallelStrategy.setup`` with the ``configure_model`` requirement replaced by the
        sharding policy (same steps otherwise: materialize, precision, device, optimizers)."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if any(isinstance(mod, FullyShardedDataParallel) for mod in self.model.modules()):
            raise TypeError(
                "Found modules wrapped with `torch.distributed.fsdp.FullyShardedDataParallel` (FSDP1). "
                f"`{type(self).__name__}` uses FSDP2 (`fully_shard`); shard with `fully_shard` in "
                "configure_model or let the strategy shard (shard_policy)"
            )
        self._shard_if_needed()
        self._checkpoint_activations()
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard_if_needed(self) -> None:
        assert self.model is not None
        done = shard_unless_sharded(
            self.model, self._sharding_mesh(), self._shard_policy,
            tensor_parallel_size=int(self._tensor_parallel_size), reshard_after_forward=self._reshard_after_forward,
        )
        if done is None:
            if not self.sharded_blocks and not self.sharded_roots:
                rank_zero_info(f"{type(self).__name__}: the model is already sharded (configure_model); policy not applied")
            return
        self.sharded_blocks, self.sharded_roots = done
        rank_zero_info(describe_sharding(type(self).__name__, *done, self._shard_policy))

    def _checkpoint_activations(self) -> None:
        if not self._activation_checkpointing_kwargs or self.checkpointed_modules:
            return
        assert self.model is not None
        self.checkpointed_modules = setup_activation_checkpointing(
            self.model, self._activation_checkpointing_kwargs, type(self).__name__)
        rank_zero_info(f"{type(self).__name__}: activation checkpointing on {len(self.checkpointed_modules)} modules "
                       f"({', '.join(self.checkpointed_modules[:3])}{', ...' if len(self.checkpointed_modules) > 3 else ''})")

    def _sharding_mesh(self) -> Any:
        """The data-parallel mesh, or with ``replicate_size > 1`` an HSDP ``(replicate, shard)`` mesh
        over the same ranks (FSDP2 then reduce-scatters inside a replica and all-reduces across)."""
        return hsdp_mesh(self.device_mesh, self._replicate_size, self.root_device.type)

    # ------------------------------------------------------------------ optimizer swap
    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self._optimizer_mode != "keep":
            self._swap_optimizer()
        if any(release_of(opt) is not None for opt in self.optimizers):
            # Gradient release steps inside backward: what needs every gradient at once fails now.
            check_trainer_compatible(
                accumulate_grad_batches=trainer.accumulate_grad_batches, gradient_clip_val=trainer.gradient_clip_val,
                scaler=getattr(self.precision_plugin, "scaler", None), where=type(self).__name__)

    def _swap_optimizer(self) -> None:
        module = self.lightning_module
        assert module is not None
        optimizers = list(self.optimizers)
        if len(optimizers) > 1:
            raise swap.SwapError(
                f"configure_optimizers returned {len(optimizers)} optimizers; optimizer={self._optimizer_mode!r} "
                "replaces exactly one. Return one optimizer, or use optimizer='keep' and build QMuon yourself "
                "(qmuon_lightning.build_optimizer) in configure_optimizers"
            )
        user = optimizers[0] if optimizers else None
        if isinstance(user, QMuon):
            rank_zero_info(f"{type(self).__name__}: configure_optimizers returned a QMuon; kept as it is")
            check_sharded_formats(user)
            ensure_release(user, self._optimizer_kwargs)
            return
        if isinstance(user, _MockOptimizer):
            user = None
        new = build_replacement(module, user, self._optimizer_kwargs,
                                lambda note: rank_zero_warn(f"{type(self).__name__}: {note}"))
        for config in self.lr_scheduler_configs:
            if user is None:
                raise swap.SwapError("an LR scheduler was configured without an optimizer")
            swap.rebind_scheduler(config.scheduler, user, new)
        self.optimizers = [new]
        self._report_routing(new)

    def _report_routing(self, opt: QMuon) -> None:
        decisions = getattr(opt, "routing", [])
        self.routing = decisions
        warning = no_muon_warning(type(self).__name__, decisions)
        if warning:
            rank_zero_warn(warning)
        if not self._routing_logged:
            self._routing_logged = True
            rank_zero_info(f"{type(self).__name__}: QMuon parameter routing\n{format_routing_table(decisions)}")

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_info(self) -> dict[str, Any]:
        return checkpoint_info(self._optimizer_mode, self.optimizers, self.world_size, module=self.lightning_module)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        """Lightning's sharded (``torch.distributed.checkpoint`` directory) or consolidated save,
        plus a ``"qmuon_fsdp"`` entry in the metadata (optimizer types, state formats, world size)
        that :meth:`load_checkpoint` checks before loading."""
        checkpoint[CKPT_KEY] = self._checkpoint_info()
        if not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        # Sharded: every rank writes into a hidden staging directory, then rank 0 renames it into
        # place, so a directory under a checkpoint's name is always complete (a crash mid-save
        # leaves only the staging directory, which recover_interrupted_saves clears up).
        final = Path(self.broadcast(str(filepath)))
        staging = staging_path(final)
        if self.is_global_zero and staging.exists():
            shutil.rmtree(staging)
        self.barrier("qmuon_fsdp_save_staging")
        self._save_sharded(checkpoint, staging, storage_options)
        self.barrier("qmuon_fsdp_save_written")
        if self.is_global_zero:
            publish_directory(staging, final)
        self.barrier("qmuon_fsdp_save_published")

    def _save_sharded(self, checkpoint: dict[str, Any], path: Path, storage_options: Optional[Any]) -> None:
        """``ModelParallelStrategy``'s sharded save with the weights under ``"model"`` instead of
        ``"state_dict"``: the layout of Lightning's ``FSDPStrategy``, which
        ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` reads (it renames ``"model"``
        to ``"state_dict"`` and gathers ``"optimizer_<i>"`` into ``"optimizer_states"``), so its
        output loads with ``LightningModule.load_from_checkpoint``. Only the key name differs; the
        tensors written are the same. :meth:`load_checkpoint` reads either key."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported "
                            "with sharded checkpoints (torch.distributed.checkpoint writes them, not CheckpointIO)")
        import torch.distributed.checkpoint as dcp

        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        converted = {SHARDED_MODEL_KEY: checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{idx}": osd for idx, osd in enumerate(checkpoint.pop("optimizer_states", []))})
        dcp.save(converted, checkpoint_id=path)
        if self.global_rank == 0:
            torch.save(checkpoint, path / _METADATA_FILENAME)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load model and optimizer state saved by this strategy (either layout, any world size).

        Differs from ``ModelParallelStrategy.load_checkpoint`` in one respect: optimizer state is
        restored for exactly the parameters that had state when saved. Parameters that never
        received a gradient (unused in forward) have no state; torch's loader would otherwise
        require it (strict) or keep the zero state its initializing dry-run ``step()`` created.
        """
        path = require_complete(self.broadcast(str(checkpoint_path)))
        module = self.model
        assert module is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        optimizers = {f"optimizer_{idx}": opt for idx, opt in enumerate(self.optimizers)}
        if path.is_dir() and (path / ".metadata").is_file():
            metadata = load_file(path / _METADATA_FILENAME, weights_only)
            self._check_compatible(metadata.get(CKPT_KEY), path)
            apply_format_overrides(self.lightning_module, self.optimizers, metadata.get(CKPT_KEY), type(self).__name__)
            load_sharded_state(module, path, sharded_model_key(path), optimizers, strict=strict,
                               missing_optimizer=_NO_OPTIMIZER_STATE)
            return metadata
        if path.is_file():
            checkpoint = load_file(path, weights_only, mmap=True, map_location="cpu")
            self._check_compatible(checkpoint.get(CKPT_KEY), path)
            apply_format_overrides(self.lightning_module, self.optimizers, checkpoint.get(CKPT_KEY), type(self).__name__)
            if self.optimizers and "optimizer_states" not in checkpoint:
                raise KeyError(_NO_OPTIMIZER_STATE.format(path=path))
            load_full_state(module, checkpoint.pop("state_dict"),
                            list(zip(self.optimizers, checkpoint.get("optimizer_states", []))), strict=strict)
            return checkpoint
        raise FileNotFoundError(
            f"{path} is neither a sharded checkpoint directory (with a .metadata file) nor a checkpoint file"
        )

    def _check_compatible(self, saved: Optional[Mapping[str, Any]], path: Path) -> None:
        if self.optimizers:
            check_compatible(saved, self._checkpoint_info(), path)

    # ------------------------------------------------------------------ metrics
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[pl.LightningModule, torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._log_comm_bytes:
            self._log_comm(optimizer)
        return out

    def _log_comm(self, optimizer: Optimizer) -> None:
        opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        value = getattr(opt, "comm_bytes_last_step", None)
        module = self.lightning_module
        if value is None or module is None or module._current_fx_name not in ("optimizer_step", "training_step"):
            return
        if not module.trainer.loggers:  # nothing would record it, and Lightning warns about logger=True
            return
        module.log("qmuon/comm_bytes", float(value), on_step=True, on_epoch=False, prog_bar=False, logger=True)
