"""DeepSpeed configurations QMuon runs under, checked before ``deepspeed.initialize``, and the
CPU-accelerator op-build skip."""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Mapping

from .. import require_extra

__all__ = ["UnsupportedDeepSpeedConfig", "check_config", "avoid_cpu_op_builds"]


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
    if stage not in (0, 1, 2, 3):
        raise UnsupportedDeepSpeedConfig(f"zero_optimization.stage must be 0, 1, 2 or 3 for QMuon, got {stage}")
    for key in ("offload_optimizer", "offload_param"):
        off = zero.get(key)
        if isinstance(off, Mapping) and str(off.get("device", "none")).lower() not in ("none", "null"):
            raise UnsupportedDeepSpeedConfig(
                f"zero_optimization.{key} (device={off.get('device')!r}) is not supported: "
                + ("with optimizer offload DeepSpeed replaces a client optimizer by DeepSpeedCPUAdam (or runs it "
                   "on CPU copies QMuon cannot see whole). " if key == "offload_optimizer" else
                   "parameter offload moves ZeRO-3's partitions to CPU / NVMe, which QMuon's stage-3 path has not "
                   "been run with. ")
                + f"Remove '{key}'; QMuon's int8 momentum already takes ~1/4 of fp32 momentum memory"
            )
    if stage == 3:
        # Options that change which ranks hold a parameter's pieces, or how the pieces are stored: the
        # wrapper reads one data-parallel group's fp32 pieces.
        for key, why in (("mics_shard_size", "MiCS partitions each parameter over a sub-group of ranks"),
                         ("zero_hpz_partition_size", "hpZ keeps secondary partitions per node"),
                         ("zero_quantized_weights", "quantized weights store the partitions as int8"),
                         ("zero_quantized_nontrainable_weights", "quantized weights store the partitions as int8")):
            value = zero.get(key)
            if value not in (None, False, 0, 1, -1) or (value is True):
                raise UnsupportedDeepSpeedConfig(
                    f"zero_optimization.{key}={value!r} is not supported with QMuon at ZeRO stage 3 ({why}; QMuon "
                    f"deals whole matrices to the ranks of one data-parallel group). Remove '{key}'")
    if zero.get("elastic_checkpoint", False):
        raise UnsupportedDeepSpeedConfig(
            "zero_optimization.elastic_checkpoint=true re-cuts optimizer state as flat partitions on load; "
            "QMuon's state is per matrix (quantized). Set elastic_checkpoint to false (the default)"
        )
    if cfg.get("zenflow") or zero.get("zenflow"):
        raise UnsupportedDeepSpeedConfig("ZenFlow replaces the optimizer step with its own CPU optimizer; remove 'zenflow'")
    bf16 = _enabled(cfg.get("bf16")) or _enabled(cfg.get("bfloat16"))
    _check_bf16_master(cfg, stage, bf16)
    accum = cfg.get("data_types", {}).get("grad_accum_dtype") if isinstance(cfg.get("data_types"), Mapping) else None
    if bf16 and stage == 1 and accum is not None and str(accum).lower() in ("fp32", "float32", "float"):
        raise UnsupportedDeepSpeedConfig(
            "bf16 with ZeRO stage 1 and data_types.grad_accum_dtype='fp32' makes DeepSpeed use its BF16_Optimizer, "
            "whose partition layout this integration does not read. Use ZeRO stage 2 (fp32 master weights and "
            "gradients partitioned the same way) or drop grad_accum_dtype"
        )
    cfg["zero_allow_untested_optimizer"] = True
    return cfg


def check_accelerate_plugin() -> None:
    """Under an ``accelerate.Accelerator`` with a DeepSpeed plugin, :func:`check_config` its config now:
    ``accelerator.prepare`` would otherwise replace a client optimizer by DeepSpeedCPUAdam under
    ``offload_optimizer`` without a word, and the QMuon inside would never step. Nothing to do when
    Accelerate was not imported or runs no DeepSpeed plugin."""
    import sys

    state = sys.modules.get("accelerate.state")
    if state is None or not state.AcceleratorState._shared_state:
        return
    acc = state.AcceleratorState()
    if getattr(acc.distributed_type, "name", None) != "DEEPSPEED":
        return
    plugin = acc.deepspeed_plugin
    if plugin is not None:
        try:
            check_config(plugin.deepspeed_config)
        except UnsupportedDeepSpeedConfig as e:
            raise UnsupportedDeepSpeedConfig(f"Accelerate's DeepSpeed plugin: {e}") from None


def _check_bf16_master(cfg: Mapping[str, Any], stage: int, bf16: bool) -> None:
    """bf16 master partitions (DeepSpeed >= 0.18): supported at ZeRO stages 1-3 together with
    ``bf16_optimizer_states``. DeepSpeed accepts ``bf16_master_weights_and_grads`` without
    ``bf16_optimizer_states`` only with optimizer offload and DeepSpeedCPUAdam (it assumes the
    optimizer's moments are fp32 and would not fit on the device); ``bf16_optimizer_states`` lets the
    client optimizer keep its state on the device. For QMuon that flag changes nothing else: its
    momentum and AdamW moments keep the formats it was built with (``state_format``,
    ``adamw_state_format``; DeepSpeed never converts a client optimizer's state)."""
    for sec in ("bf16", "bfloat16"):
        b = cfg.get(sec)
        if not isinstance(b, Mapping):
            continue
        master, states = bool(b.get("bf16_master_weights_and_grads")), bool(b.get("bf16_optimizer_states"))
        if not (master or states):
            continue
        if states and not master:
            raise UnsupportedDeepSpeedConfig(
                f"{sec}.bf16_optimizer_states=true needs {sec}.bf16_master_weights_and_grads=true (DeepSpeed refuses "
                "it alone). Set both to keep bf16 master partitions, or remove bf16_optimizer_states")
        if not bf16:
            raise UnsupportedDeepSpeedConfig(
                f"{sec}.bf16_master_weights_and_grads=true without bf16 training: set {sec}.enabled=true (bf16 model "
                "weights; QMuon writes its updates to DeepSpeed's bf16 master partitions through bf16_update), or "
                "remove bf16_master_weights_and_grads")
        if stage not in (1, 2, 3):
            raise UnsupportedDeepSpeedConfig(
                f"{sec}.bf16_master_weights_and_grads=true needs ZeRO stage 1, 2 or 3 (DeepSpeed supports it only "
                f"there), got stage {stage}. Set zero_optimization.stage; at stage 0 train a bf16 model "
                "(model.to(torch.bfloat16)) without DeepSpeed's bf16 section instead: QMuon then steps the bf16 "
                "parameters directly through bf16_update")
        if not states:
            raise UnsupportedDeepSpeedConfig(
                f"{sec}.bf16_master_weights_and_grads=true without {sec}.bf16_optimizer_states=true: DeepSpeed accepts "
                "that only with optimizer offload and DeepSpeedCPUAdam. Set bf16_optimizer_states=true as well: it "
                "lets QMuon keep its state on the device, in its own formats (state_format / adamw_state_format)")


def require_deepspeed() -> Any:
    """The ``deepspeed`` module, or an ImportError that names the extra to install."""
    return require_extra("deepspeed", "deepspeed", "qmuon.integrations.deepspeed", "DeepSpeed")


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
    require_deepspeed()
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

