"""Replace the optimizer a LightningModule's ``configure_optimizers`` returned by :class:`QMuon`.

Three pieces, used by :class:`~qmuon_lightning.strategies.QMuonFSDPStrategy` after sharding:

* :func:`adamw_settings` reads the user's Adam / AdamW hyper-parameters, which become the
  auxiliary AdamW group's (embeddings, head, norms, biases keep the settings the user tuned);
* :func:`check_coverage` refuses a swap that would start training parameters the user's optimizer
  left out;
* :func:`rebind_scheduler` moves an LR scheduler built on the user's optimizer onto the new one.

Why rebinding is exact for the common schedulers: ``LambdaLR``, ``StepLR``, ``MultiStepLR``,
``ExponentialLR``, ``LinearLR``, ``ConstantLR``, ``PolynomialLR``, ``CosineAnnealingLR`` (with
``eta_min=0``) and ``SequentialLR`` / ``ChainedScheduler`` of them scale each group's
``initial_lr`` by a factor that depends only on the step. The new groups get ``initial_lr`` = their
own lr (Muon lr for Muon groups, the user's AdamW lr for the others) and the factor the scheduler had
already applied, so every group follows the user's schedule shape from its own base.
``OneCycleLR`` and ``CyclicLR`` write absolute per-group learning rates and momenta into the
param groups (their ``max_lr`` is an AdamW value, and cycling ``momentum`` would cycle Muon's
momentum), so they are refused with a message that says what to do instead.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Sequence

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim import lr_scheduler as lrs

__all__ = ["SwapError"]

#: Scheduler attributes that hold one entry per param group.
_PER_GROUP_ATTRS = ("lr_lambdas", "min_lrs")


class SwapError(ValueError):
    """The optimizer returned by ``configure_optimizers`` cannot be replaced as configured."""


def _numel(group: dict[str, Any]) -> int:
    return sum(p.numel() for p in group["params"])


def _as_float(v: Any) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


def adamw_settings(optimizer: Optimizer) -> tuple[dict[str, Any], list[str]]:
    """``build_optimizer`` options (``adamw_lr``, ``adamw_weight_decay``, ``update.adamw_betas``,
    ``update.adamw_eps``) taken from a ``torch.optim.Adam`` / ``AdamW``, and warnings about
    settings that cannot carry over.

    The values come from the group holding the most elements (with the usual "decay" / "no decay"
    split that is the decay group; QMuon's router gives 1-D parameters weight decay 0 by itself).
    """
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam in torch >= 2.6
        raise SwapError(
            f"configure_optimizers returned {type(optimizer).__name__}; the swap reads the auxiliary AdamW "
            "settings from a torch.optim.AdamW or Adam. Return AdamW, pass the AdamW settings explicitly "
            "(optimizer_kwargs={'adamw_lr': ..., 'adamw_weight_decay': ...}) and return None from "
            "configure_optimizers, or use optimizer='keep' to train with your own optimizer"
        )
    warnings: list[str] = []
    groups = optimizer.param_groups
    main = max(groups, key=_numel)
    for key in ("lr", "betas", "eps"):
        values = {repr(g.get("initial_lr", g[key]) if key == "lr" else g[key]) for g in groups}
        if len(values) > 1:
            warnings.append(
                f"your {type(optimizer).__name__} groups use different {key} values ({sorted(values)}); "
                f"the auxiliary AdamW uses {main[key]!r} (from the largest group) for all of them"
            )
    for flag in ("amsgrad", "maximize"):
        if any(g.get(flag, False) for g in groups):
            warnings.append(f"{flag}=True is not supported by QMuon's auxiliary AdamW and is dropped")
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(main.get("decoupled_weight_decay", False))
    if not decoupled and main["weight_decay"] > 0:
        warnings.append(
            f"your Adam uses L2 weight decay (weight_decay={main['weight_decay']} added to the gradient); "
            "QMuon's auxiliary AdamW applies it decoupled (AdamW), so the effective regularization differs"
        )
    b1, b2 = main["betas"]
    settings = {
        # A scheduler built in configure_optimizers has already scaled "lr"; its base is "initial_lr".
        "adamw_lr": _as_float(main.get("initial_lr", main["lr"])),
        "adamw_weight_decay": float(main["weight_decay"]),
        "update": {"adamw_betas": (_as_float(b1), _as_float(b2)), "adamw_eps": float(main["eps"])},
    }
    return settings, warnings


def check_coverage(module: nn.Module, optimizer: Optimizer) -> None:
    """Raise :class:`SwapError` if ``optimizer`` leaves out trainable parameters of ``module``
    (the swap would start training them) or holds parameters that are not ``module``'s."""
    named = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
    in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [n for i, n in named.items() if i not in in_opt]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise SwapError(
            f"configure_optimizers' {type(optimizer).__name__} does not update {len(missing)} trainable "
            f"parameter(s) ({shown}); the swap would start training them. Freeze them with "
            "requires_grad_(False), add them to your optimizer, or use optimizer='keep'"
        )
    all_ids = {id(p) for p in module.parameters()}
    foreign = sum(1 for i in in_opt if i not in all_ids)
    if foreign:
        raise SwapError(
            f"configure_optimizers' {type(optimizer).__name__} holds {foreign} tensor(s) that are not parameters "
            "of the LightningModule; build the optimizer from self.parameters() after configure_model"
        )


def _track_step_called(optimizer: Optimizer) -> None:
    """Mark ``optimizer.step`` the way ``LRScheduler.__init__`` does, so the scheduler's
    "optimizer.step() has been overridden" check keeps working for the new optimizer."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    func = optimizer.step.__func__  # type: ignore[attr-defined]
    opt_ref = weakref.ref(optimizer)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def _current_factor(scheduler: Any, old: Optimizer) -> float:
    """The factor the scheduler has applied so far: ``lr / initial_lr`` of the old groups (they
    must agree; a per-group schedule cannot be mapped onto QMuon's groups)."""
    factors = set()
    for g in old.param_groups:
        base = _as_float(g.get("initial_lr", g["lr"]))
        if base == 0.0:
            continue
        factors.add(round(_as_float(g["lr"]) / base, 12))
    if len(factors) > 1:
        raise SwapError(
            f"{type(scheduler).__name__} has applied different factors to your optimizer's groups "
            f"({sorted(factors)}); the swap cannot map a per-group schedule onto QMuon's groups. "
            "Use one schedule for all groups or optimizer='keep'"
        )
    return factors.pop() if factors else 1.0


def _broadcast_per_group(scheduler: Any, n_old: int, n_new: int) -> None:
    for attr in _PER_GROUP_ATTRS:
        values = getattr(scheduler, attr, None)
        if not isinstance(values, list) or len(values) != n_old:
            continue
        first = values[0]
        if any(v is not first and v != first for v in values[1:]):
            raise SwapError(
                f"{type(scheduler).__name__}.{attr} differs between your optimizer's {n_old} groups; the swap "
                "cannot map per-group values onto QMuon's groups. Give one value for all groups or use optimizer='keep'"
            )
        setattr(scheduler, attr, [first] * n_new)


def rebind_scheduler(scheduler: Any, old: Optimizer, new: Optimizer) -> None:
    """Point ``scheduler`` (built on ``old``) at ``new`` and give ``new``'s groups the same schedule
    position. See the module docstring for which schedulers this is exact for."""
    if isinstance(scheduler, (lrs.OneCycleLR, lrs.CyclicLR)):
        raise SwapError(
            f"{type(scheduler).__name__} writes absolute per-group learning rates (and momenta) into the "
            "optimizer, which cannot be mapped onto QMuon's Muon and AdamW groups. Use a relative schedule "
            "(LambdaLR, CosineAnnealingLR, LinearLR, ...), or use optimizer='keep' and build QMuon and the "
            "scheduler yourself in configure_optimizers"
        )
    if getattr(scheduler, "optimizer", None) is not old:
        raise SwapError(
            f"{type(scheduler).__name__} is not attached to the optimizer returned by configure_optimizers"
        )
    children: Sequence[Any] = getattr(scheduler, "_schedulers", ())
    for child in children:
        rebind_scheduler(child, old, new)
    n_old, n_new = len(old.param_groups), len(new.param_groups)
    factor = _current_factor(scheduler, old)
    _broadcast_per_group(scheduler, n_old, n_new)
    for g in new.param_groups:
        base = _as_float(g.get("initial_lr", g["lr"]))
        g["initial_lr"] = base
        g["lr"] = base * factor
    scheduler.optimizer = new
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [g["initial_lr"] for g in new.param_groups]
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [g["lr"] for g in new.param_groups]
    _track_step_called(new)
