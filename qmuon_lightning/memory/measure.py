"""The measured side: the compared optimizers built on a real model, and the peak of a few training
steps by PyTorch's ``MemTracker`` (what the accounting model is held to)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qmuon.optim.routing import route_parameters
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
    from qmuon.optim.routing import build_optimizer

    kw = dict(setup.options)
    kw.setdefault("verbose", False)
    return [build_optimizer(model, **kw, **build_kwargs)]


#: MemTracker's categories of activation memory: tensors made in forward (``Activation``: the saved
#: tensors, the logits) and in backward outside an optimizer step (``Temp``: activation gradients,
#: autograd's scratch). Issue 19's whole-step metric leaves them aside ("activations aside"); every
#: other category (parameters, buffers, gradients, optimizer state and the step's temporaries,
#: ``Other``) counts.
ACTIVATION_CATEGORIES = ("Activation", "Temp")


@dataclass
class Measurement:
    """What ``MemTracker`` saw over a few training steps.

    * ``peak`` / ``split``: the most live tensor bytes at once (every category) and their split by
      category at that moment (MemTracker's own peak snapshot);
    * ``peak_no_act`` / ``split_no_act``: the most bytes at once of everything but activations
      (:data:`ACTIVATION_CATEGORIES`): weights, buffers, gradients, optimizer state and the step's
      temporaries (issue 19's metric), and the full split at that moment; with gradient release the
      temporaries of a backward hook's step are counted as optimizer bytes (``Optstate``), not as
      autograd ``Temp`` (see :func:`measure_step`);
    * ``peak_where`` / ``peak_no_act_where``: what was running at either peak (``forward``,
      ``backward``, ``release hook: <parameter names>``, ``optimizer.step``);
    * ``state_bytes``: the optimizers' state after the run;
    * ``peak_act`` / ``peak_act_where``: the most bytes of activations (:data:`ACTIVATION_CATEGORIES`)
      at once, wherever the whole step peaks, and what was running then (what
      :func:`~qmuon_lightning.memory.decoder_activations` estimates).
    """

    peak: int
    split: dict[str, int]
    state_bytes: int
    losses: list[float]
    peak_no_act: int = 0
    split_no_act: dict[str, int] = field(default_factory=dict)
    peak_where: str = ""
    peak_no_act_where: str = ""
    peak_act: int = 0
    peak_act_where: str = ""


def _step_tracker_class() -> type:
    """``MemTracker`` that also keeps the peak of the non-activation bytes and what ran at each peak.

    MemTracker updates its peak after every op that allocates (``_update_peak_stats``, called from
    its ``__torch_dispatch__`` with the current per-category snapshot); the subclass reads the same
    snapshot there, so both peaks come from one accounting."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepMemTracker(MemTracker):
        def __init__(self) -> None:
            super().__init__()
            self.stage = ""
            self.peak_no_act: dict[torch.device, int] = {}
            self.peak_no_act_snap: dict[torch.device, dict[str, int]] = {}
            self.peak_where: dict[torch.device, str] = {}
            self.peak_no_act_where: dict[torch.device, str] = {}
            self.peak_act: dict[torch.device, int] = {}
            self.peak_act_where: dict[torch.device, str] = {}

        def _update_peak_stats(self, peak_state: Any) -> None:
            before = dict(self._peak_mem)
            super()._update_peak_stats(peak_state)
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) != before.get(dev, 0):
                    self.peak_where[dev] = self.stage
                no_act = sum(v for k, v in snap.items()
                             if str(getattr(k, "value", k)) not in ACTIVATION_CATEGORIES + ("Total",))
                act = sum(v for k, v in snap.items() if str(getattr(k, "value", k)) in ACTIVATION_CATEGORIES)
                if act > self.peak_act.get(dev, -1):
                    self.peak_act[dev] = act
                    self.peak_act_where[dev] = self.stage
                if no_act > self.peak_no_act.get(dev, -1):
                    self.peak_no_act[dev] = no_act
                    self.peak_no_act_snap[dev] = dict(snap)
                    self.peak_no_act_where[dev] = self.stage

        def optimizer_region(self, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> None:
            """Count what ``optimizer.step_params`` allocates (a gradient-release hook inside
            backward) as optimizer bytes, as MemTracker does for ``optimizer.step()`` through its
            global step hooks (which ``step_params`` does not run: they are ``step()``'s)."""
            from torch.distributed._tools.mem_tracker import _MemRefType

            if not hasattr(self, "_in_opt"):
                raise RuntimeError("this torch's MemTracker has no _in_opt flag; update measure_step")
            inner = optimizer.step_params
            tracker = self

            def step_params(params: Any, *args: Any, **kwargs: Any) -> Any:
                prev_in, prev_stage = tracker._in_opt, tracker.stage
                tracker._in_opt = True
                if not prev_in:
                    tracker.stage = "release hook: " + ", ".join(names.get(id(p), "?") for p in params)
                try:
                    return inner(params, *args, **kwargs)
                finally:
                    tracker._track_optimizer_states(_MemRefType.OPT, optimizer)
                    tracker._in_opt, tracker.stage = prev_in, prev_stage

            optimizer.step_params = step_params  # type: ignore[method-assign]

    return StepMemTracker


def _categories(snap: dict[Any, int]) -> dict[str, int]:
    return {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}


def measure_step(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], loss_fn: Callable[[], torch.Tensor],
                 steps: int = 2) -> Measurement:
    """Peak live tensor bytes of ``steps`` training steps (``loss_fn().backward()``, every
    optimizer's ``step()``, ``zero_grad(set_to_none=True)``), by PyTorch's
    ``torch.distributed._tools.mem_tracker.MemTracker`` (its *peak* snapshot: live bytes by
    category at the moment they were highest), and the peak of the non-activation bytes
    (:class:`Measurement`). The first step allocates the optimizer state; the peak of a later step
    includes it. An optimizer driven by gradient release (``optimizer.gradient_release``) steps
    inside backward through ``step_params``; what it allocates there is counted as optimizer bytes
    (MemTracker would file it under backward ``Temp``, beside the activations' gradients)."""
    device = next(model.parameters()).device
    tracker = _step_tracker_class()()
    tracker.track_external(model, *optimizers)
    names = {id(p): n for n, p in model.named_parameters()}
    restore = []
    for o in optimizers:
        if getattr(o, "gradient_release", None) is not None and hasattr(o, "step_params"):
            restore.append(o)
            tracker.optimizer_region(o, names)
    losses: list[float] = []
    try:
        with tracker:
            for _ in range(steps):
                tracker.reset_mod_stats()
                tracker.stage = "forward"
                loss = loss_fn()
                tracker.stage = "backward"
                loss.backward()
                losses.append(float(loss.detach()))
                del loss
                tracker.stage = "optimizer.step"
                for o in optimizers:
                    o.step()
                tracker.stage = "zero_grad"
                for o in optimizers:
                    o.zero_grad(set_to_none=True)
    finally:
        for o in restore:
            del o.step_params  # the class's method again
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
    split = _categories(tracker.get_tracker_snapshot("peak")[device])
    peak = split.pop("Total")
    split_no_act = _categories(tracker.peak_no_act_snap.get(device, {}))
    split_no_act.pop("Total", None)
    return Measurement(peak, split, state, losses, tracker.peak_no_act.get(device, 0), split_no_act,
                       tracker.peak_where.get(device, ""), tracker.peak_no_act_where.get(device, ""),
                       tracker.peak_act.get(device, 0), tracker.peak_act_where.get(device, ""))
