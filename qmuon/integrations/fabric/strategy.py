"""``QMuonFabricStrategy``: ``L.Fabric(strategy="qmuon_fsdp")``, the Fabric twin of the Trainer strategy.

A subclass of :class:`lightning.fabric.strategies.ModelParallelStrategy` (FSDP2) that adds what
:class:`~qmuon_lightning.strategies.QMuonFSDPStrategy` adds for the Trainer, from the same code:

1. **Sharding without a ``parallelize_fn``.** ``fabric.setup_module(model)`` applies ``fully_shard``
   to the blocks the Trainer strategy's policy selects (:mod:`.sharding`; default: each repeated
   block), then to the model itself (Fabric calls it through its ``forward``), unless the model is
   already sharded. A ``parallelize_fn`` is used as Lightning uses it.
2. **QMuon in ``setup_optimizers``.** A QMuon (``ql.build_optimizer(model, ...)`` after
   ``setup_module``) is kept; an AdamW / Adam is replaced by ``build_optimizer`` on the sharded
   model with ``optimizer_kwargs`` (the presets' formats) and the AdamW's settings for the
   auxiliary AdamW, as the Trainer strategy does with ``configure_optimizers``. ``optimizer="keep"``
   keeps any optimizer. An optimizer built before ``setup_module`` (its parameters were replaced by
   the sharded ones) is refused: it would silently train nothing.
3. **Checkpoints.** ``fabric.save`` writes Lightning's sharded directory
   (``torch.distributed.checkpoint``; default) or, with ``save_distributed_checkpoint=False``, one
   consolidated file, plus a ``"qmuon_fsdp"`` metadata entry per optimizer (type, Muon state
   layouts, world size). ``fabric.load`` checks that entry before loading anything, reshards to the
   current number of processes, and restores optimizer state for exactly the parameters that had
   state when saved. Loading is the Trainer strategy's code (:func:`.checkpoint_state.load_sharded_state`,
   :func:`.checkpoint_state.load_full_state`). Saves are atomic (written under ``<path>.partial``, renamed
   when every rank is done).

Registered in Fabric's ``STRATEGY_REGISTRY`` on ``import qmuon_lightning`` under the Trainer
registry's names (:data:`.mixin.PRESETS`). See docs/fabric.md.
"""

from __future__ import annotations

import os
import shutil
import weakref
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.fsdp import _is_full_checkpoint, _is_sharded_checkpoint
from lightning.fabric.strategies.model_parallel import _has_dtensor_modules
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.utilities.load import _METADATA_FILENAME, _move_state_into
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from qmuon.distributed.resume import require_complete
from qmuon.core.config import QMuonConfig
from qmuon.optim.qmuon import QMuon
from qmuon.optim.release import CLIPPING_ERROR, check_trainer_compatible, release_of
from qmuon.optim.routing import format_routing_table
from . import optimizer_swap as swap
from .checkpoint_state import (CKPT_KEY, apply_format_overrides, check_compatible, checkpoint_info, load_file,
                               load_full_state, load_sharded_state, saved_dcp_keys)
from .mixin import OptimizerMode, QMuonStrategyMixin
from .options import build_replacement, check_sharded_formats, ensure_release, no_muon_warning
from .sharding import ShardPolicy, check_replicate_size, describe_sharding, hsdp_mesh, is_sharded, shard_unless_sharded

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["QMuonFabricStrategy"]

_NO_OPTIMIZER_STATE = (
    "{path} holds no state for the optimizer saved under {key!r}, so training cannot resume from it with "
    "fabric.load(..., strict=True). Pass strict=False to load what it holds, or leave the optimizer out of the state"
)


_PARTIAL_SUFFIX = ".partial"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _replace(src: Path, dst: Path) -> None:
    """Give ``src`` the name ``dst``. A file replaces a file atomically (``os.replace``); otherwise the
    old ``dst`` is first renamed aside and removed after ``src`` took its name, so at every moment
    either a complete checkpoint has the name or none has (the old one then waits under ``.old``)."""
    if src.is_file() and (dst.is_file() or not dst.exists()):
        os.replace(src, dst)
        return
    old = dst.with_name(dst.name + ".old")
    _remove(old)
    if dst.exists() or dst.is_symlink():
        os.replace(dst, old)
    os.replace(src, dst)
    _remove(old)


class QMuonFabricStrategy(QMuonStrategyMixin, ModelParallelStrategy):
    """FSDP2 strategy for Lightning Fabric that shards the model by a policy when no
    ``parallelize_fn`` is given and trains it with :class:`~qmuon.QMuon`.

    Registered on ``import qmuon_lightning`` as ``"qmuon_fsdp"`` and the presets
    ``"qmuon_fsdp_int8_stochastic"``, ``"qmuon_fsdp_grasp4"``,
    ``"qmuon_fsdp_keep"`` (the Trainer registry's names): ``L.Fabric(strategy="qmuon_fsdp")`` or
    an instance.

    Args:
        parallelize_fn: ``(module, device_mesh) -> module`` as in Lightning's
            ``ModelParallelStrategy``; ``None`` (default): the sharding policy.
        optimizer: what ``fabric.setup_optimizers`` does with a non-QMuon optimizer: ``"qmuon"``
            replaces it by ``build_optimizer(model, **optimizer_kwargs)`` (its AdamW / Adam settings
            become the auxiliary AdamW's); ``"keep"``: keep it. A QMuon is always kept.
        optimizer_kwargs: the replacement's QMuon options (a :class:`~qmuon.QMuonConfig` or a dict of them).
        shard_policy: which modules become FSDP units (see :mod:`qmuon.integrations.fabric.sharding`).
        reshard_after_forward: passed to ``fully_shard``.
        data_parallel_size, tensor_parallel_size: device-mesh shape; defaults: all processes on the
            data-parallel dimension, tensor parallel size 1.
        save_distributed_checkpoint: ``True``: ``fabric.save`` writes a sharded directory; ``False``:
            one consolidated file written by rank 0.
        process_group_backend, timeout: as in ``ModelParallelStrategy`` (gloo on CPU, NCCL on CUDA).
        replicate_size: HSDP replicas for the sharding policy (``1``: FSDP2 over all data-parallel
            ranks). With ``R > 1`` ``setup_module`` shards on a ``(replicate, shard)`` mesh of
            ``R x (data_parallel_size / R)``; sharded QMuon then orthogonalizes each matrix once over
            all ranks (docs/distributed.md, HSDP). A ``parallelize_fn`` that wants HSDP calls
            ``fully_shard`` with its own 2-D mesh instead.
    """

    strategy_name = "qmuon_fsdp"

    def __init__(
        self,
        parallelize_fn: Optional[Callable[[nn.Module, DeviceMesh], nn.Module]] = None,
        optimizer: OptimizerMode = "qmuon",
        optimizer_kwargs: Union[dict[str, Any], QMuonConfig, None] = None,
        shard_policy: ShardPolicy = "auto",
        reshard_after_forward: bool = True,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        tensor_parallel_size: Union[Literal["auto"], int] = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        replicate_size: int = 1,
    ) -> None:
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise TypeError(f"parallelize_fn must be a callable (module, device_mesh) -> module, got {parallelize_fn!r}")
        self._check_init_args(optimizer, data_parallel_size, tensor_parallel_size)
        check_replicate_size(replicate_size, tensor_parallel_size)
        if replicate_size > 1 and parallelize_fn is not None:
            raise ValueError(
                f"replicate_size={replicate_size} sets the mesh of the automatic sharding policy, which a parallelize_fn "
                "replaces: for HSDP in your own parallelize_fn call fully_shard(module, mesh=...) with a 2-D "
                "(replicate, shard) mesh (torch.distributed.device_mesh.init_device_mesh) and leave replicate_size at 1")
        self._replicate_size = replicate_size
        super().__init__(
            parallelize_fn=self._then_policy(parallelize_fn) if parallelize_fn else self._parallelize_by_policy,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_qmuon_settings(optimizer, optimizer_kwargs, shard_policy, reshard_after_forward)
        #: Qualified names of the FSDP units the policy created in the last ``setup_module``
        #: (blocks, roots); empty when the model was sharded by other code.
        self.sharded_blocks: list[str] = []
        self.sharded_roots: list[str] = []
        #: Routing decisions of the last QMuon built by ``setup_optimizers`` (name, shape, target, rule).
        self.routing: list[Any] = []
        self._modules: list[weakref.ref[nn.Module]] = []

    # ------------------------------------------------------------------ setup
    def _then_policy(self, parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module]
                     ) -> Callable[[nn.Module, DeviceMesh], nn.Module]:
        """The user's ``parallelize_fn``, followed by the sharding policy on the data-parallel dim
        when it applied tensor parallelism only (DTensor parameters, no ``fully_shard``)."""

        def parallelize(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
            from torch.distributed.fsdp import FSDPModule

            module = parallelize_fn(module, mesh)
            if is_sharded(module) and not any(isinstance(m, FSDPModule) for m in module.modules()):
                return self._parallelize_by_policy(module, mesh)
            return module

        return parallelize

    def _parallelize_by_policy(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        done = shard_unless_sharded(
            module, hsdp_mesh(mesh, self._replicate_size, self.root_device.type), self._shard_policy,
            tensor_parallel_size=int(self._tensor_parallel_size),
            root_unit=True, reshard_after_forward=self._reshard_after_forward,
        )
        if done is None:
            self.sharded_blocks, self.sharded_roots = [], []
            rank_zero_info(f"{type(self).__name__}: the model is already sharded; policy not applied")
        else:
            self.sharded_blocks, self.sharded_roots = done
            rank_zero_info(describe_sharding(type(self).__name__, *done, self._shard_policy))
        return module

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        self._modules = [ref for ref in self._modules if ref() is not None] + [weakref.ref(module)]
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        module = self._module_of(optimizer)
        if isinstance(optimizer, QMuon):
            check_sharded_formats(optimizer)
            self._note_preset_mismatch(optimizer)
            ensure_release(optimizer, self._optimizer_kwargs)
            self._check_release(optimizer)
            return optimizer
        if self._optimizer_mode == "keep":
            return optimizer
        if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
            raise swap.SwapError(
                f"an LR scheduler is attached to the {type(optimizer).__name__} passed to setup_optimizers, which "
                f"optimizer={self._optimizer_mode!r} replaces by QMuon, so the scheduler would drive nothing. Build the "
                "scheduler on the optimizer setup_optimizers returns, or pass ql.build_optimizer(model, ...) yourself"
            )
        new = build_replacement(module, optimizer, self._optimizer_kwargs,
                                lambda note: rank_zero_warn(f"{type(self).__name__}: {note}"))
        self.routing = list(getattr(new, "routing", []))
        warning = no_muon_warning(type(self).__name__, self.routing)
        if warning:
            rank_zero_warn(warning)
        rank_zero_info(f"{type(self).__name__}: {type(optimizer).__name__} replaced by QMuon; parameter routing\n"
                       f"{format_routing_table(self.routing)}")
        self._check_release(new)
        return new

    def _check_release(self, optimizer: Optimizer) -> None:
        """Gradient release cannot combine with fp16 loss scaling: refuse it at setup."""
        if release_of(optimizer) is not None:
            check_trainer_compatible(scaler=getattr(self.precision, "scaler", None), where=type(self).__name__)

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        if release_of(optimizer) is not None:
            raise RuntimeError(f"{type(self).__name__}: fabric.clip_gradients(max_norm={max_norm}): "
                               + CLIPPING_ERROR.format(what="fabric.clip_gradients"))
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        if release_of(optimizer) is not None:
            raise RuntimeError(f"{type(self).__name__}: fabric.clip_gradients(clip_val={clip_val}): the gradients are "
                               "freed inside backward under gradient_release=True, so there is nothing left to clip. "
                               "Use per-parameter norm clipping (optimizer_kwargs={'safety': {'release_clip_norm': ...}}) instead")
        return super().clip_gradients_value(module, optimizer, clip_val)

    def _module_of(self, optimizer: Optimizer) -> nn.Module:
        """The set-up model that owns every parameter of ``optimizer``; a clear error otherwise."""
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        modules = [m for m in (ref() for ref in self._modules) if m is not None]
        for module in reversed(modules):
            if ids <= {id(p) for p in module.parameters()}:
                return module
        if not modules:
            raise RuntimeError(
                f"{type(self).__name__}: set up the model before the optimizer: model = fabric.setup_module(model), "
                "then optimizer = fabric.setup_optimizers(ql.build_optimizer(model, ...)). (fabric.setup(model, "
                "optimizer) builds the optimizer before sharding, on parameters that sharding replaces)"
            )
        raise ValueError(
            f"{type(self).__name__}: the {type(optimizer).__name__} holds parameters that are not those of the model "
            "set up by fabric.setup_module: sharding replaces every parameter, so an optimizer built before "
            "setup_module (or by fabric.setup(model, optimizer)) would update tensors the model no longer uses. "
            "Build it after model = fabric.setup_module(model), from that model"
        )

    def _note_preset_mismatch(self, optimizer: QMuon) -> None:
        """Warn when a passed QMuon's Muon state format differs from the one this strategy's
        ``optimizer_kwargs`` (a preset such as ``"qmuon_fsdp_grasp4"``) names: the QMuon is kept."""
        wanted = self._optimizer_kwargs.get("state_format")
        got = sorted({str(g["state_format"]) for g in optimizer.param_groups if g.get("use_muon", False)})
        if wanted is not None and got and got != [str(wanted)]:
            rank_zero_warn(
                f"{type(self).__name__}: this strategy was configured with state_format={wanted!r}, but the QMuon passed "
                f"to setup_optimizers uses {got}; the QMuon is kept as it is. Build it with "
                f"ql.build_optimizer(model, state_format={wanted!r}) or pass an AdamW to have it replaced"
            )

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Lightning's sharded directory or consolidated file, plus a ``"qmuon_fsdp"`` metadata entry
        (per optimizer key: type, Muon state layouts, world size) that :meth:`load_checkpoint` checks.

        Written under ``<path>.partial`` and renamed to ``path`` by rank 0 once every rank has
        finished, so a save that dies half-way never leaves a broken checkpoint under ``path``, nor
        replaces the one already there (which is removed only after the new one took its name)."""
        if CKPT_KEY in state:
            raise ValueError(f"the state key {CKPT_KEY!r} is reserved for the strategy's checkpoint metadata; rename it")
        models = [m for m in state.values() if _has_dtensor_modules(m)]
        info = {key: checkpoint_info(self._optimizer_mode, [opt], self.world_size,
                                     module=models[0] if len(models) == 1 else None)
                for key, opt in state.items() if isinstance(opt, Optimizer)}
        path = Path(self.broadcast(path))
        partial = path.with_name(path.name + _PARTIAL_SUFFIX)
        if path.is_dir() and not _is_sharded_checkpoint(path):  # every rank raises, none waits in a barrier
            raise IsADirectoryError(
                f"{path} is a directory but not a checkpoint; fabric.save replaces what is at the path it is given. "
                "Give the checkpoint its own path, e.g. fabric.save(directory / 'step-100', state)"
            )
        if self.global_rank == 0:
            _remove(partial)  # left by a save that died
            path.parent.mkdir(parents=True, exist_ok=True)  # Lightning creates a directory's parents, not a file's
        self.barrier()
        super().save_checkpoint(partial, {**state, CKPT_KEY: info}, storage_options=storage_options, filter=filter)
        self.barrier()  # every rank's shards are written
        if self.global_rank == 0:
            _replace(partial, path)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Union[nn.Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Restore ``state`` (``{"model": model, "optimizer": opt, ...}``) from a sharded directory or a
        consolidated file saved on any number of processes. Checks the optimizers' saved layouts
        first; loads what ``ModelParallelStrategy.load_checkpoint`` loads, with optimizer state for
        exactly the parameters that had state when saved. Returns the metadata not requested."""
        if not isinstance(state, dict) or not state:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        path = require_complete(self.broadcast(path))
        modules = {key: m for key, m in state.items() if _has_dtensor_modules(m)}
        if len(modules) != 1:
            raise ValueError(
                f"fabric.load with {type(self).__name__} needs exactly one model set up by fabric.setup_module in the "
                f"state (found {len(modules)}): fabric.load(path, {{'model': model, 'optimizer': optimizer, ...}})"
            )
        (model_key, module), = modules.items()
        optimizers = {key: opt for key, opt in state.items() if isinstance(opt, Optimizer)}
        requested = state.keys() - modules.keys() - optimizers.keys()
        if _is_sharded_checkpoint(path):
            metadata = load_file(path / _METADATA_FILENAME, weights_only)
            saved_info = metadata.pop(CKPT_KEY, None)
            optimizers = self._check_and_select(saved_info, optimizers, path, strict)
            self._apply_format_overrides(module, optimizers, saved_info)
            if not strict:  # leave the optimizers the checkpoint holds no state for as they are
                saved_keys = saved_dcp_keys(path)
                optimizers = {k: o for k, o in optimizers.items() if any(s.startswith(f"{k}.") for s in saved_keys)}
            load_sharded_state(module, path, model_key, optimizers, strict=strict, missing_optimizer=_NO_OPTIMIZER_STATE)
            _validate_keys_for_strict_loading(requested, metadata.keys(), strict=strict)
            _move_state_into(source=metadata, destination=state, keys=requested)
            return metadata
        if _is_full_checkpoint(path):
            checkpoint = load_file(path, weights_only, mmap=True, map_location="cpu")
            saved_info = checkpoint.pop(CKPT_KEY, None)
            optimizers = self._check_and_select(saved_info, optimizers, path, strict)
            self._apply_format_overrides(module, optimizers, saved_info)
            present = {k: opt for k, opt in optimizers.items() if k in checkpoint}
            if strict and len(present) < len(optimizers):
                missing = sorted(optimizers.keys() - present.keys())
                raise KeyError(_NO_OPTIMIZER_STATE.format(path=path, key=missing[0]))
            if model_key not in checkpoint:
                raise KeyError(f"{path} holds no model state under {model_key!r} (keys: {sorted(checkpoint)})")
            load_full_state(module, checkpoint.pop(model_key), [(opt, checkpoint.pop(k)) for k, opt in present.items()],
                            strict=strict)
            _validate_keys_for_strict_loading(requested, checkpoint.keys(), strict=strict)
            _move_state_into(source=checkpoint, destination=state, keys=requested)
            return checkpoint
        raise ValueError(
            f"{str(path)!r} is neither a sharded checkpoint directory (with a .metadata file) nor a consolidated "
            "checkpoint file"
        )

    def _apply_format_overrides(self, module: nn.Module, optimizers: dict[str, Optimizer],
                                saved: Optional[dict[str, Any]]) -> None:
        """Fidelity-guard promotions recorded at save time, applied before the state is loaded."""
        for key, opt in optimizers.items():
            apply_format_overrides(module, [opt], (saved or {}).get(key), type(self).__name__)

    def _check_and_select(
        self, saved: Optional[dict[str, Any]], optimizers: dict[str, Optimizer], path: Path, strict: bool,
    ) -> dict[str, Optimizer]:
        """Check each optimizer against its saved layout; return the optimizers to load (without
        ``strict``, those the checkpoint holds no entry for are left as they are)."""
        saved = saved or {}
        selected = {}
        for key, opt in optimizers.items():
            if key not in saved and saved:
                if strict:
                    raise KeyError(_NO_OPTIMIZER_STATE.format(path=path, key=key))
                continue
            check_compatible(saved.get(key), checkpoint_info(self._optimizer_mode, [opt], self.world_size),
                             f"{path} ({key!r})")
            selected[key] = opt
        return selected
