"""How an fp32 update reaches a parameter: the one place where both groups (Muon and AdamW) write weights.

``param <- decay * param + alpha * update``, computed in fp32 and written once in the parameter's
own dtype. For fp32 parameters this is exact. For bf16 (or fp16) parameters the rounding of that
write decides whether small updates survive; ``bf16_update`` names the rule (``"nearest"`` here;
the stochastic and error-corrected rules are added beside it).

Callers pass views: a block of a parameter's (local) rows and the update for exactly that block,
so a step's transient memory is one block's fp32 update, never a copy of the whole model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["BF16_UPDATES", "apply_update_", "weight_state_init"]

#: How an fp32 update reaches a low-precision weight.
BF16_UPDATES = ("nearest",)


def weight_state_init(param: Tensor, bf16_update: str) -> dict[str, Tensor]:
    """Optimizer-state tensors a parameter needs for writing its updates (none for ``"nearest"``)."""
    return {}


def apply_update_(param: Tensor, update: Tensor, *, alpha: float, decay: float = 1.0,
                  bf16_update: str = "nearest", state: dict[str, Any] | None = None,
                  rng: tuple[int, int, int, int] | None = None) -> None:
    """``param <- decay * param + alpha * update`` in place.

    Args:
        param: the weights to change (a view of the parameter's local storage, any shape).
        update: the update for exactly those weights (same shape; fp32, or any float dtype).
        alpha: scale of the update (``-lr * lr_scale`` for Muon, ``-lr`` for AdamW).
        decay: decoupled weight decay factor ``1 - lr * weight_decay`` (1.0: none).
        bf16_update: the rounding rule when ``param`` is not fp32 (see :data:`BF16_UPDATES`).
        state: views of the parameter's weight-correction state matching ``param``
            (from :func:`weight_state_init`), when the rule keeps any.
        rng: ``(seed, key, step, first_element_index)``: the counter of rounding noise, when the
            rule draws any (reproducible on resume).
    """
    if bf16_update not in BF16_UPDATES:
        raise ValueError(f"bf16_update must be one of {BF16_UPDATES}, got {bf16_update!r}")
    if param.dtype == torch.float32:
        if decay != 1.0:
            param.mul_(decay)
        param.add_(update.view(param.shape), alpha=alpha)
        return
    # nearest: one rounding of the fp32 result
    new = param.float()
    if decay != 1.0:
        new.mul_(decay)
    new.add_(update.view(param.shape).float(), alpha=alpha)
    param.copy_(new)
