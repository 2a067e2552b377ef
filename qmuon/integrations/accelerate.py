"""QMuon under Hugging Face Accelerate: configuration checks and ``prepare_qmuon``.

The plain recipe already works::

    model, opt = accelerator.prepare(model, qmuon.build_optimizer(model, ...))

because :class:`~qmuon.QMuon` creates its state lazily, in the first ``step()``, keyed by
the parameter objects that the param groups hold *at that moment*. That matters because
``Accelerator.prepare`` may replace the parameters inside the optimizer:

- single process / DDP (``MULTI_CPU``, ``MULTI_GPU``, ...): the model's ``nn.Parameter`` objects are
  kept (``Module.to`` swaps ``.data``; ``DistributedDataParallel`` wraps the module), so the
  optimizer's parameters stay the live ones. Every rank holds the full matrices and, after DDP's
  all-reduce, identical averaged gradients, so every rank runs the same QMuon step redundantly and
  the replicas stay bit-identical.
- FSDP2 (``fsdp_version=2``): ``prepare`` shards the model with ``fully_shard`` and rewrites
  ``optimizer.param_groups[i]["params"]`` in place with the new ``DTensor`` parameters. Any state
  created before that would be keyed by the dead, unsharded tensors; lazily created state is keyed
  by the ``DTensor`` s. QMuon's sharded step lives in :mod:`qmuon.distributed`.

:func:`prepare_qmuon` is the opt-in helper around that recipe: it refuses configurations that
cannot work (with the reason and the fix), builds the optimizer with
:func:`~qmuon.build_optimizer`, prepares it together with the model, and checks that the
optimizer now points at the prepared model's parameters and holds no state yet.
:func:`check_state_keys` makes the same check at any later time (after steps, after
``load_state``).

Checkpoints: ``accelerator.save_state()`` writes ``optimizer.bin`` from ``QMuon.state_dict()``:
plain tensors (int8 codes, fp32 scales, 0-d steps) and primitives, which Accelerate reads back
with ``torch.load(weights_only=True)``; ``load_state()`` goes through ``QMuon.load_state_dict``,
which keeps the codes' dtypes (torch's default would cast them to the parameter dtype).
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..optim.qmuon import QMuon
from ..optim.release import CLIPPING_ERROR, check_trainer_compatible, release_of, releasing
from ..optim.routing import build_optimizer
from . import require_extra

require_extra("accelerate", "accelerate", "qmuon.integrations.accelerate", "Hugging Face Accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

__all__ = [
    "UnsupportedAccelerateConfig",
    "check_configuration",
    "check_accelerator",
    "accelerate_tp_blocker",
    "check_tp_mesh",
    "prepare_qmuon",
    "check_state_keys",
    "unwrap_qmuon",
    "refuse_clipping_under_release",
]

#: Accelerate's DDP-style distributed types: full parameters on every rank, gradients all-reduced
#: by ``DistributedDataParallel`` before ``optimizer.step()``.
DDP_TYPES: frozenset[str] = frozenset({
    "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
    "MULTI_HPU", "MULTI_NEURON",
})


class UnsupportedAccelerateConfig(ValueError):
    """An Accelerate configuration QMuon cannot train under; the message names the fix."""


def _name(distributed_type: Any) -> str:
    return distributed_type.name if isinstance(distributed_type, DistributedType) else str(distributed_type).upper()


def check_configuration(
    distributed_type: DistributedType | str,
    *,
    fsdp_version: int | None = None,
    mixed_precision: str = "no",
    tensor_parallel: bool = False,
    fsdp_cpu_offload: bool = False,
    optimizer_has_state: bool = False,
    deepspeed_config: Any = None,
) -> None:
    """Raise :class:`UnsupportedAccelerateConfig` for a configuration QMuon cannot run under.

    Supported: ``NO`` (one process), the DDP family (``MULTI_CPU`` on gloo, ``MULTI_GPU``, ...) and
    ``FSDP`` with ``fsdp_version=2``; mixed precision ``"no"``, ``"bf16"`` or ``"fp16"`` (autocast
    changes activations and gradients, not the fp32 parameters the state is built from).

    ``DEEPSPEED`` (Accelerate's DeepSpeed plugin, ZeRO 0-3) is supported with QMuon inside the
    whole-matrix ZeRO client optimizer (:func:`prepare_qmuon` builds it; see docs/deepspeed.md); its
    config (``deepspeed_config``) is checked by :func:`qmuon.integrations.deepspeed.check_config`.

    Refused, with the reason:

    - ``DEEPSPEED`` configurations the ZeRO client optimizer cannot host (an ``optimizer`` section,
      ``offload_optimizer``, ...: the message of ``check_config``).
    - ``FSDP`` with ``fsdp_version=1``: FSDP1 flattens parameters into 1-D ``FlatParameter`` s.
    - ``MEGATRON_LM``: Megatron's own parallel layers and optimizer wrapper, never run with QMuon.
    - tensor parallelism (``ParallelismConfig(tp_size > 1)``) without FSDP2, or with an Accelerate /
      transformers pair whose FSDP2 + TP ``prepare`` cannot run (:func:`accelerate_tp_blocker`).
      Under FSDP2 on a ``(dp_shard, tp)`` mesh QMuon steps colwise and rowwise layers like
      Lightning's ``qmuon_fsdp`` with ``tensor_parallel_size`` does.
    - ``XLA``: the ``torch.ops.qmuon`` kernels have no XLA implementation.
    - ``mixed_precision="fp8"``: Accelerate swaps ``nn.Linear`` modules for fp8 ones during
      ``prepare``; that path has not been run with QMuon (no fp8 hardware was available).
    - FSDP2 with an optimizer that already holds state: ``prepare`` replaces the parameters, so the
      old state would be orphaned; build the optimizer, prepare, then step.
    """
    kind = _name(distributed_type)
    if kind == "DEEPSPEED":
        from .deepspeed import UnsupportedDeepSpeedConfig, check_config

        if optimizer_has_state:
            raise UnsupportedAccelerateConfig(
                "the optimizer already holds state; under DeepSpeed it must be fresh (DeepSpeed hands it flat "
                "partitions). Build it, prepare, then step; load a checkpoint with accelerator.load_state")
        try:
            check_config(deepspeed_config if deepspeed_config is not None else {})
        except UnsupportedDeepSpeedConfig as e:
            raise UnsupportedAccelerateConfig(f"Accelerate's DeepSpeed plugin: {e}") from e
        return
    if kind == "MEGATRON_LM":
        raise UnsupportedAccelerateConfig(
            "Megatron-LM through Accelerate is not supported with QMuon: Megatron splits weights across ranks "
            "as plain local tensors (no DTensor placements), so QMuon cannot assemble the whole matrices it "
            "orthogonalizes; use "
            "DDP or FSDP2 (fsdp_version=2), or for tensor parallelism Lightning's qmuon_fsdp strategy with "
            "tensor_parallel_size / Fabric with parallelize_fn"
        )
    if kind == "XLA":
        raise UnsupportedAccelerateConfig(
            "XLA devices are not supported: the torch.ops.qmuon kernels have CPU and CUDA implementations only"
        )
    if tensor_parallel:
        if kind != "FSDP" or fsdp_version != 2:
            raise UnsupportedAccelerateConfig(
                "tensor parallelism (parallelism_config with tp_size > 1) is supported with FSDP2 only: without it "
                "rowwise layers are 1-D (Shard(1),) DTensors, which QMuon's sharded step does not take. Use "
                "FullyShardedDataParallelPlugin(fsdp_version=2) with ParallelismConfig(dp_shard_size=S, tp_size=T), "
                "or set tp_size=1"
            )
        blocker = accelerate_tp_blocker()
        if blocker:
            raise UnsupportedAccelerateConfig(blocker)
    if mixed_precision == "fp8":
        raise UnsupportedAccelerateConfig(
            "mixed_precision='fp8' is not supported by prepare_qmuon: Accelerate converts nn.Linear modules "
            "during prepare and that path has not been run with QMuon; use mixed_precision='bf16'"
        )
    if kind == "FSDP":
        if fsdp_version != 2:
            raise UnsupportedAccelerateConfig(
                f"FSDP version {fsdp_version} is not supported: FSDP1 flattens parameters into 1-D "
                "FlatParameters, so Muon never sees a matrix. Use FSDP2: FullyShardedDataParallelPlugin("
                "fsdp_version=2), `fsdp_version: 2` in the accelerate config, or `accelerate launch --use_fsdp "
                "--fsdp_version 2`"
            )
        if importlib.util.find_spec("qmuon.distributed") is None:
            raise UnsupportedAccelerateConfig(
                "FSDP2 needs QMuon's sharded step (qmuon.distributed), which this installation "
                "lacks; upgrade qmuon or train with DDP"
            )
        if optimizer_has_state:
            raise UnsupportedAccelerateConfig(
                "the optimizer already holds state, but under FSDP2 Accelerator.prepare replaces its parameters "
                "with sharded DTensors, which would orphan that state. Build the optimizer, prepare it with the "
                "model, and step only after prepare (load a checkpoint with accelerator.load_state afterwards)"
            )
        if fsdp_cpu_offload:
            warnings.warn(
                "FSDP2 with CPU offload has not been tested with QMuon; the optimizer step then runs on CPU",
                stacklevel=3,
            )
        return
    if kind == "NO" or kind in DDP_TYPES:
        return
    raise UnsupportedAccelerateConfig(
        f"Accelerate distributed type {kind} has not been tested with QMuon; supported: NO (one process), "
        f"{', '.join(sorted(DDP_TYPES))} (DDP) and FSDP with fsdp_version=2"
    )


def accelerate_tp_blocker() -> str:
    """Why ``accelerator.prepare`` cannot run FSDP2 + tensor parallelism with the installed
    Accelerate and transformers, or ``""`` when nothing is known to block it.

    Accelerate 1.15's ``Accelerator._prepare_tp`` (FSDP2 branch) imports
    ``transformers.integrations.tensor_parallel.ReplicateParallel`` to replicate the parameters
    outside the TP plan over the ``tp`` dim; transformers 5 removed that class, so ``prepare``
    raises ``ImportError`` whatever the optimizer (measured: Accelerate 1.15.0, transformers 5.24).
    """
    try:
        import transformers
        from transformers.integrations import tensor_parallel as hf_tp
    except ImportError:
        return ("Accelerate's FSDP2 + tensor-parallel prepare needs Hugging Face transformers (its TP plans and "
                "ReplicateParallel); pip install transformers")
    if hasattr(hf_tp, "ReplicateParallel"):
        return ""
    import accelerate

    return (
        f"Accelerate {accelerate.__version__} cannot prepare a tensor-parallel model under FSDP2 with transformers "
        f"{transformers.__version__}: Accelerator._prepare_tp imports ReplicateParallel from "
        "transformers.integrations.tensor_parallel, which transformers 5 removed, so accelerator.prepare raises "
        "ImportError for any optimizer. Train on a (dp, tp) mesh with Lightning instead: "
        "Trainer(strategy=QMuonFSDPStrategy(data_parallel_size=D, tensor_parallel_size=T)) with a configure_model "
        "that applies the TP plan on self.device_mesh['tensor_parallel'], or L.Fabric(strategy=QMuonFabricStrategy("
        "parallelize_fn=..., data_parallel_size=D, tensor_parallel_size=T)) (docs/distributed.md, Tensor parallel); "
        "or keep Accelerate with tp_size=1 (FSDP2 / HSDP)"
    )


def check_tp_mesh(accelerator: Accelerator, model: nn.Module) -> None:
    """Under ``ParallelismConfig(tp_size > 1)``: every ``DTensor`` parameter of the unprepared
    model must live on the accelerator's ``tp`` sub-mesh, or FSDP2 cannot stack its
    ``dp_shard`` dim on top. transformers 5's ``from_pretrained(..., tp_plan="auto",
    device_mesh=...)`` ignores ``device_mesh`` and builds its own ``tp`` mesh over every rank."""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return
    tp = mesh["tp"]
    for name, p in model.named_parameters():
        pm = getattr(p, "device_mesh", None)
        if pm is not None and (pm.mesh_dim_names != tp.mesh_dim_names or pm.mesh.tolist() != tp.mesh.tolist()):
            raise UnsupportedAccelerateConfig(
                f"parameter {name!r} is tensor-parallel on {pm}, not on the accelerator's tp mesh {tp}: "
                "transformers' from_pretrained(..., tp_plan=...) builds its own mesh (it ignores device_mesh). Load "
                "the model without tp_plan and apply the plan on the accelerator's mesh: transformers.distributed."
                "tensor_parallel.apply_tensor_parallelism(model, accelerator.torch_device_mesh['tp'], "
                "model._expand_parallel_plan(model._tp_plan))"
            )


def check_accelerator(accelerator: Accelerator, optimizer: torch.optim.Optimizer | None = None) -> None:
    """:func:`check_configuration` for a constructed ``Accelerator`` (and, before ``prepare``,
    the optimizer that will be prepared with it)."""
    state = accelerator.state
    kind = accelerator.distributed_type
    if _name(kind) in ("MEGATRON_LM", "XLA"):
        check_configuration(kind)  # refused whatever the rest says (and their plugins own mixed precision)
    if _name(kind) == "DEEPSPEED":  # the plugin's config owns mixed precision, offload, ...
        inner = unwrap_qmuon(optimizer, strict=False) if optimizer is not None else None
        plugin = getattr(state, "deepspeed_plugin", None)
        check_configuration(kind, deepspeed_config=getattr(plugin, "deepspeed_config", None),
                            optimizer_has_state=inner is not None and any(len(s) for s in inner.state.values()))
        return
    fsdp_plugin = getattr(state, "fsdp_plugin", None)
    pc = getattr(accelerator, "parallelism_config", None)
    # FSDP2: OffloadPolicy() (none, the default) or CPUOffloadPolicy; FSDP1: CPUOffload(offload_params=...).
    co = getattr(fsdp_plugin, "cpu_offload", None)
    offload = type(co).__name__ == "CPUOffloadPolicy" or getattr(co, "offload_params", False) is True
    inner = unwrap_qmuon(optimizer, strict=False) if optimizer is not None else None
    check_configuration(
        kind,
        fsdp_version=getattr(fsdp_plugin, "fsdp_version", None),
        mixed_precision=str(accelerator.mixed_precision),
        tensor_parallel=bool(pc is not None and getattr(pc, "tp_enabled", False)),
        fsdp_cpu_offload=offload,
        optimizer_has_state=inner is not None and any(len(s) for s in inner.state.values()),
    )


def unwrap_qmuon(optimizer: Any, strict: bool = True) -> QMuon | None:
    """The :class:`QMuon` inside ``optimizer`` (Accelerate's ``AcceleratedOptimizer`` keeps it as
    ``.optimizer``). ``strict``: raise ``TypeError`` when there is none, else return None."""
    seen = optimizer
    for _ in range(4):  # AcceleratedOptimizer -> QMuon; a few levels cover other thin wrappers
        if isinstance(seen, QMuon):
            return seen
        seen = getattr(seen, "optimizer", None)
        if seen is None:
            break
    if strict:
        raise TypeError(f"expected a QMuon (possibly wrapped by Accelerate), got {type(optimizer).__name__}")
    return None


def check_state_keys(model: nn.Module, optimizer: Any) -> None:
    """Check that ``optimizer`` (a QMuon, possibly wrapped by Accelerate) refers to ``model``'s live
    parameters: every parameter in its groups and every key of its state is a parameter object of
    ``model`` (the prepared one: DDP wrapper, FSDP2 module). Raises ``RuntimeError`` naming the
    first offender: a stale key means state was created before ``prepare`` swapped the parameters,
    or the optimizer was built for another model.
    """
    qm = unwrap_qmuon(optimizer)
    live = {id(p) for p in model.parameters()}
    in_groups: set[int] = set()
    for gi, group in enumerate(qm.param_groups):
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            in_groups.add(id(p))
            if id(p) not in live:
                label = repr(names[i]) if names else f"#{i}"
                raise RuntimeError(
                    f"optimizer param group {gi} parameter {label} ({type(p).__name__}, shape {tuple(p.shape)}) is "
                    "not a parameter of the prepared model: pass the model and the optimizer to the same "
                    "accelerator.prepare call (or use prepare_qmuon), and build the optimizer from that model"
                )
    for p in qm.state:
        if id(p) not in in_groups:
            raise RuntimeError(
                f"optimizer state is keyed by a tensor (shape {tuple(p.shape)}) that is no longer in its param "
                "groups: the state was created before Accelerator.prepare replaced the parameters; step only "
                "after prepare"
            )


def refuse_clipping_under_release(accelerator: Accelerator) -> None:
    """Make ``accelerator.clip_grad_norm_`` / ``clip_grad_value_`` raise when the parameters
    passed to them are released (stepped inside backward by ``gradient_release=True``).

    Under release the gradients are stepped and freed inside ``accelerator.backward``; Accelerate's
    clip would then see ``grad is None`` everywhere, return a total norm of 0 and clip nothing,
    silently. Accelerate has no hook around its clipping, so this wraps the two methods on this
    ``Accelerator`` instance (once; :func:`prepare_qmuon` calls it when release is on). Parameters
    that no release hooks (another model, a detached release) are clipped as before.
    """
    if getattr(accelerator, "_qmuon_refuses_release_clipping", False):
        return
    clip_norm, clip_value = accelerator.clip_grad_norm_, accelerator.clip_grad_value_

    def materialize(parameters: Any) -> list[torch.Tensor]:
        return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        params = materialize(parameters)
        if releasing(params) is not None:
            raise RuntimeError(f"accelerator.clip_grad_norm_(max_norm={max_norm}): "
                               + CLIPPING_ERROR.format(what="accelerator.clip_grad_norm_"))
        return clip_norm(params, max_norm, norm_type=norm_type)

    def clip_grad_value_(parameters: Any, clip_value_: float) -> Any:
        params = materialize(parameters)
        if releasing(params) is not None:
            raise RuntimeError(f"accelerator.clip_grad_value_(clip_value={clip_value_}): "
                               + CLIPPING_ERROR.format(what="accelerator.clip_grad_value_"))
        return clip_value(params, clip_value_)

    clip_grad_norm_.__doc__ = clip_norm.__doc__
    clip_grad_value_.__doc__ = clip_value.__doc__
    accelerator.clip_grad_norm_ = clip_grad_norm_  # type: ignore[method-assign]
    accelerator.clip_grad_value_ = clip_grad_value_  # type: ignore[method-assign]
    accelerator._qmuon_refuses_release_clipping = True


def prepare_qmuon(
    accelerator: Accelerator,
    model: nn.Module,
    *objects: Any,
    lr_scheduler: Callable[[QMuon], LRScheduler] | None = None,
    **build_optimizer_kwargs: Any,
) -> tuple[Any, ...]:
    """Build QMuon for ``model`` and prepare both with ``accelerator``, checking the configuration.

    Args:
        accelerator: the ``Accelerator``; its configuration is checked first
            (:func:`check_accelerator`): FSDP1, XLA, fp8 and tensor parallelism
            without FSDP2 (or with an Accelerate / transformers pair that cannot prepare it,
            :func:`accelerate_tp_blocker`) are refused with the reason and the fix; under
            ``tp_size > 1`` the model's TP parameters must be on the accelerator's ``tp`` mesh
            (:func:`check_tp_mesh`).
        model: the unprepared model; the optimizer is routed from its parameter names.
        objects: anything else to prepare in the same call (data loaders, ...).
        lr_scheduler: optional ``optimizer -> scheduler`` factory, called with the QMuon before
            ``prepare`` so the scheduler is prepared (and checkpointed by ``save_state``) with it.
        build_optimizer_kwargs: passed to :func:`qmuon.build_optimizer` (``lr``,
            ``state_format``, ``rounding``, ...; ``verbose=True`` prints the routing table).
            With ``gradient_release=True``, ``accelerator.clip_grad_norm_`` /
            ``clip_grad_value_`` raise for the released parameters
            (:func:`refuse_clipping_under_release`); use ``release_clip_norm`` instead.

    Returns:
        ``(model, optimizer, *objects, [scheduler])`` as ``accelerator.prepare`` returns them:
        the optimizer is Accelerate's ``AcceleratedOptimizer`` around the QMuon
        (:func:`unwrap_qmuon` gets the QMuon back). Under Accelerate's DeepSpeed plugin the model is
        the ``DeepSpeedEngine`` and the optimizer Accelerate's ``DeepSpeedOptimizerWrapper`` around
        DeepSpeed's ZeRO optimizer, around the attached
        :class:`~qmuon.integrations.deepspeed.WholeMatrixZeroOptimizer` around the QMuon.
    """
    check_accelerator(accelerator)
    check_tp_mesh(accelerator, model)
    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer):
            raise TypeError(
                "prepare_qmuon builds the optimizer itself; do not pass one in objects (prepare another optimizer "
                "with its own accelerator.prepare call)"
            )
    if build_optimizer_kwargs.get("gradient_release"):
        # release steps inside backward: Accelerate's gradient accumulation and fp16 GradScaler cannot combine
        check_trainer_compatible(accumulate_grad_batches=accelerator.gradient_accumulation_steps,
                                 scaler=getattr(accelerator, "scaler", None), where="prepare_qmuon",
                                 accumulate_setting="Accelerator(gradient_accumulation_steps={n})")
    optimizer = build_optimizer(model, **build_optimizer_kwargs)
    extra: list[Any] = list(objects)
    if lr_scheduler is not None:
        extra.append(lr_scheduler(optimizer))
    if _name(accelerator.distributed_type) == "DEEPSPEED":
        return _prepare_deepspeed(accelerator, model, optimizer, extra)
    prepared = accelerator.prepare(model, optimizer, *extra)
    # A tuple, or a list under FSDP2 (Accelerate's _prepare_fsdp2 returns one).
    prepared = tuple(prepared) if isinstance(prepared, (tuple, list)) else (prepared,)
    p_model, p_opt = prepared[0], prepared[1]
    qm = unwrap_qmuon(p_opt)
    if qm is not optimizer:
        raise RuntimeError("Accelerator.prepare returned an optimizer that does not wrap the QMuon it was given")
    if any(len(s) for s in qm.state.values()):
        raise RuntimeError("QMuon holds state right after prepare; it must be created lazily by the first step()")
    check_state_keys(p_model, p_opt)
    release = release_of(qm)
    if release is not None:
        release.sync_hooks()  # FSDP2's prepare replaced the parameters: hook the sharded ones
        refuse_clipping_under_release(accelerator)  # its clip would see freed gradients and return 0
    return prepared


def _prepare_deepspeed(accelerator: Accelerator, model: nn.Module, optimizer: QMuon,
                       extra: list[Any]) -> tuple[Any, ...]:
    """:func:`prepare_qmuon` under Accelerate's DeepSpeed plugin: ZeRO hands a client optimizer flat
    partitions, so QMuon goes in the whole-matrix ZeRO client optimizer
    (:class:`~qmuon.integrations.deepspeed.WholeMatrixZeroOptimizer`, sharing its group dicts: a
    scheduler built on the QMuon drives it), Accelerate calls ``deepspeed.initialize`` with it, and it
    attaches to the engine Accelerate keeps (``accelerator.deepspeed_engine_wrapped``)."""
    from .deepspeed import WholeMatrixZeroOptimizer, avoid_cpu_op_builds

    avoid_cpu_op_builds()  # DeepSpeed's CPU accelerator: no JIT kernel builds QMuon does not use
    wrapper = WholeMatrixZeroOptimizer(optimizer)
    prepared = accelerator.prepare(model, wrapper, *extra)
    prepared = tuple(prepared) if isinstance(prepared, (tuple, list)) else (prepared,)
    wrapper.attach(accelerator)
    return prepared
