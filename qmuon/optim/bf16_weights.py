"""What QMuon does for parameters stored in bf16 without an fp32 master copy (both groups): their
weight-correction state (created, dropped, sharded, validated on load), how each step's update is
written (:class:`~qmuon.core.apply.WeightWrite`: the group's ``bf16_update``, the state's
local views, the stochastic-rounding counter); the AdamW step (:mod:`qmuon.core.adamw`)
writes through the same rules. The rules themselves:
:mod:`qmuon.core.apply`; the page: docs/bf16_weights.md."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..core import apply as weight_apply
from ..core.pipeline import is_dtensor, local
from ..quant.layout import shard_state

__all__: list[str] = []


def sync_param_weight_state(p: Tensor, st: dict[str, Any], group: dict[str, Any]) -> None:
    """Create (or drop) ``p``'s weight-correction state for the group's ``bf16_update``
    (``Shard(0)`` DTensors for a sharded parameter, so DCP saves and reshards them)."""
    new = weight_apply.sync_weight_state(local(p), st, group["bf16_update"])
    if new and is_dtensor(p):
        shard_state(p, st, None)  # every new tensor is one code per element: rows


def weight_write(p_local: Tensor, st: dict[str, Any], group: dict[str, Any], key: int,
                 first: int, device_step: bool = False) -> weight_apply.WeightWrite:
    """How this step's update reaches ``p_local``: the group's rule, the local views of the
    correction state and, for stochastic rounding of bf16 weights, the noise counter
    ``(seed, key, step, first)`` (``key``: the parameter's running index over all groups, as the
    momentum's noise; ``first``: global index of ``p_local``'s first element). ``device_step``: a
    capturable step, whose counter stays a device tensor in the counter (nothing read)."""
    rule = group["bf16_update"]
    keys = weight_apply.weight_state_keys(p_local, rule)
    state = {k: local(st[k]) for k in keys} if keys else None
    rng = None
    if rule == "stochastic" and weight_apply.writes_rounded(p_local):
        step = local(st["step"])
        rng = (int(group["seed"]), int(key), step if device_step else int(step.item()), int(first))
    return weight_apply.WeightWrite(rule, state, rng)


def check_loaded_weight_state(p: Tensor, st: dict[str, Any], saved: dict[str, Any], cur: dict[str, Any],
                              where: str) -> None:
    """Validate the weight-correction tensors of a loaded state entry (``st``: this rank's tensors;
    :func:`qmuon.core.apply.check_loaded_weight_state`)."""
    weight_apply.check_loaded_weight_state(local(p), {k: local(v) for k, v in st.items()}, cur["bf16_update"],
                                           saved.get("bf16_update"), where)
