"""The measured side: the compared optimizers built on a real model, and the peak of a few training
steps by PyTorch's ``MemTracker`` (what the accounting model is held to)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..optim.routing import route_parameters
from .model import Setup


BASELINE_ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8)


BASELINE_ADAMW_WD = 0.1


BASELINE_MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)


def build_optimizers(model: nn.Module, setup: Setup, **build_kwargs: Any) -> list[torch.optim.Optimizer]:
    """The optimizer(s) of ``setup`` on ``model`` (whose weights are already in ``setup.weights``):
    ``torch.optim.AdamW`` on every parameter; ``torch.optim.Muon`` on what ``route_parameters``
    sends to Muon plus ``torch.optim.AdamW`` on the rest; or :func:`~qmuon_lightning.build_optimizer`
    with the setup's options."""
    missing = setup.missing()
    if missing:
        raise ValueError(f"setup {setup.label!r} needs {', '.join(missing)}, which this qmuon_lightning does not have")
    if setup.optimizer == "adamw":
        decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
        return [torch.optim.AdamW([{"params": decay, "weight_decay": BASELINE_ADAMW_WD},
                                   {"params": no_decay, "weight_decay": 0.0}], **BASELINE_ADAMW)]
    if setup.optimizer == "torch_muon":
        decisions = route_parameters(model)
        muon = [d.param for d in decisions if d.target == "muon"]
        adamw = [{"params": [d.param for d in decisions if d.target == t], "weight_decay": wd}
                 for t, wd in (("adamw", BASELINE_ADAMW_WD), ("adamw_no_decay", 0.0))]
        return [torch.optim.Muon(muon, **BASELINE_MUON), torch.optim.AdamW([g for g in adamw if g["params"]],
                                                                           **BASELINE_ADAMW)]
    from ..optim.routing import build_optimizer

    kw = dict(setup.options)
    kw.setdefault("verbose", False)
    return [build_optimizer(model, **kw, **build_kwargs)]


@dataclass
class Measurement:
    """What ``MemTracker`` saw over a few training steps: the peak of live tensor bytes and its split."""

    peak: int
    split: dict[str, int]
    state_bytes: int
    losses: list[float]


def measure_step(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], loss_fn: Callable[[], torch.Tensor],
                 steps: int = 2) -> Measurement:
    """Peak live tensor bytes of ``steps`` training steps (``loss_fn().backward()``, every
    optimizer's ``step()``, ``zero_grad(set_to_none=True)``), by PyTorch's
    ``torch.distributed._tools.mem_tracker.MemTracker`` (its *peak* snapshot: live bytes by
    category at the moment they were highest). The first step allocates the optimizer state; the
    peak of a later step includes it. ``state_bytes``: the optimizers' state after the run."""
    from torch.distributed._tools.mem_tracker import MemTracker

    device = next(model.parameters()).device
    tracker = MemTracker()
    tracker.track_external(model, *optimizers)
    losses: list[float] = []
    with tracker:
        for _ in range(steps):
            tracker.reset_mod_stats()
            loss = loss_fn()
            loss.backward()
            losses.append(float(loss.detach()))
            del loss
            for o in optimizers:
                o.step()
            for o in optimizers:
                o.zero_grad(set_to_none=True)
    # A tensor-subclass state (torchao's quantized AdamW state, a DTensor shard) has no storage of its
    # own: count the storages of its inner tensors (``__tensor_flatten__``, recursively), as MemTracker does.
    from torch.distributed._tools.common_utils import get_untyped_storages

    seen: set[int] = set()
    state = 0
    for o in optimizers:
        for st in o.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    for storage in get_untyped_storages(v):
                        if storage.data_ptr() not in seen:
                            seen.add(storage.data_ptr())
                            state += storage.nbytes()
    snap = tracker.get_tracker_snapshot("peak")[device]
    split = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
    peak = split.pop("Total")
    return Measurement(peak, split, state, losses)
