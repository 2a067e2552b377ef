"""DeepSpeed configurations QMuon runs under, checked before ``deepspeed.initialize``, and the
CPU-accelerator op-build skip."""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Mapping

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
    for sec in ("bf16", "bfloat16"):
        b = cfg.get(sec)
        if isinstance(b, Mapping) and (b.get("bf16_master_weights_and_grads") or b.get("bf16_optimizer_states")):
            raise UnsupportedDeepSpeedConfig(
                f"{sec}.bf16_master_weights_and_grads / bf16_optimizer_states make DeepSpeed keep its master "
                "partitions and gradients in bf16 (DeepSpeed >= 0.18): QMuon's DeepSpeed path writes updates into "
                "fp32 master partitions and does not apply bf16_update ('stochastic' / 'ecc8') to bf16 flat "
                "slices yet, so small updates would be lost to nearest rounding. Remove them (DeepSpeed then "
                "keeps fp32 master partitions), or for bf16 weights without an fp32 copy use QMuon directly, "
                "FSDP2 or the qmuon_fsdp strategy with precision='bf16-true' and bf16_update (docs/deepspeed.md)")
    accum = cfg.get("data_types", {}).get("grad_accum_dtype") if isinstance(cfg.get("data_types"), Mapping) else None
    if bf16 and stage == 1 and accum is not None and str(accum).lower() in ("fp32", "float32", "float"):
        raise UnsupportedDeepSpeedConfig(
            "bf16 with ZeRO stage 1 and data_types.grad_accum_dtype='fp32' makes DeepSpeed use its BF16_Optimizer, "
            "whose partition layout this integration does not read. Use ZeRO stage 2 (fp32 master weights and "
            "gradients partitioned the same way) or drop grad_accum_dtype"
        )
    cfg["zero_allow_untested_optimizer"] = True
    return cfg


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

