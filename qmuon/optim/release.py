"""Gradient release: each parameter is stepped inside backward, and its gradient freed, as soon as
the gradient is complete. A way of driving :class:`~qmuon.QMuon`, not new maths.

Without release a training step holds every gradient of the model at once (``.grad`` of every
parameter, between the end of backward and ``optimizer.step()``): for an fp32 model that is 4
bytes per parameter, as much as the weights. With release a parameter's
``Tensor.register_post_accumulate_grad_hook`` runs :meth:`QMuon.step_params` on it (the one
pipeline ``step()`` uses: non-finite policy, momentum, its own Newton-Schulz, the AdamW step) and
sets ``p.grad = None``; the gradients in flight are those autograd has not consumed yet plus the
one being stepped. The floor of a step becomes weights + optimizer state + the largest gradient.

Sharded parameters (FSDP2). FSDP2 calls the post-accumulate-grad hooks of its sharded DTensor
parameters right after the reduce-scatter of their unit (``foreach_reduce``), one parameter after
the other. The distributed Newton-Schulz of a Muon matrix is collective, so every rank must step
the same parameters in the same order. Release therefore steps a *unit* at a time: the sharded
gradients of one unit are views of one reduce-scatter output, so hooks whose gradients share
that storage are collected, and the collection is stepped (one collective
:meth:`QMuon.step_params` call, its matrices spread over the ranks) when a hook of the next unit
arrives, at the end of backward (an autograd final callback queued after FSDP2's own), or at the
latest in ``optimizer.step()``. Every rank sees the same units in the same order, so the calls
match. While a unit waits, its sharded gradient (``1 / world`` of the unit) stays alive.

``optimizer.step()`` and ``zero_grad()`` keep working: ``step(closure)`` runs the closure (the
hooks fire in its backward), then steps what bypassed the hooks (gradients set by hand, the
zero-gradient dry run of ``torch.distributed.checkpoint``'s ``set_optimizer_state_dict``, or the
first step after an integration replaced the parameters; hooks are re-registered then) and closes
the step (``nonfinite_skipped_steps``, ``comm_stats``). LR schedulers, Lightning's loop,
Accelerate and checkpoints see a normal optimizer. The learning rate a hook uses is the group's
at that moment: the one ``step()`` would use, since schedulers step after ``optimizer.step()``.

What cannot combine (each raises with the reason and the alternative):

- gradient accumulation over several backward passes: a second backward before ``step()`` would
  step a parameter twice (:data:`ACCUMULATION_ERROR`, raised in the hook);
- global-norm gradient clipping: no moment holds every gradient. Muon's update is normalized
  anyway; for the AdamW group, ``clip_norm`` clips each parameter's gradient to that L2 norm
  before its step (per-parameter clipping, see :class:`GradientRelease`);
- a ``GradScaler`` (fp16 loss scaling): the hooks would step with scaled gradients before the
  scaler could unscale them or skip the step. Use bf16.

The Lightning and Fabric strategies check these at setup (:func:`check_trainer_compatible`).
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from ..core.pipeline import is_dtensor, local
from .qmuon import QMuon

__all__ = [
    "GradientRelease",
    "attach_gradient_release",
    "release_of",
    "releasing",
    "check_trainer_compatible",
    "CLIPPING_ERROR",
]

log = logging.getLogger(__name__)

#: id(parameter) -> (the parameter, the release that hooks it), both weakly: the newest release of a
#: parameter takes it over, so an old optimizer still alive (an earlier ``trainer.fit``, a rebuilt
#: optimizer) does not step it a second time. (Not an attribute of the tensor: it would travel with
#: ``deepcopy`` and break ``torch.save(model)``.)
_OWNERS: dict[int, tuple["weakref.ref[Tensor]", "weakref.ref[GradientRelease]"]] = {}


def _owner_of(p: Tensor) -> "GradientRelease | None":
    entry = _OWNERS.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()

ACCUMULATION_ERROR = (
    "gradient_release=True steps each parameter inside backward, so gradients cannot be accumulated over several "
    "backward passes: a second backward before optimizer.step() would step {what} again. Accumulate inside one "
    "backward (sum the micro-batch losses, or use a larger batch), call optimizer.step() after every backward, or "
    "build the optimizer without gradient_release"
)
CLIPPING_ERROR = (
    "gradient_release=True frees each gradient inside backward, so no moment holds every gradient and a global-norm "
    "gradient clip has nothing to clip. Muon's update is normalized anyway; for the AdamW group use per-parameter "
    "clipping: build_optimizer(..., gradient_release=True, release_clip_norm=1.0) (or optimizer_kwargs="
    "{{'gradient_release': True, 'release_clip_norm': 1.0}}), and drop {what}"
)
SCALER_ERROR = (
    "gradient_release=True steps each parameter inside backward, before a GradScaler could unscale the gradients or "
    "skip a step with inf/NaN, so fp16 loss scaling cannot combine with it ({what}). Train in bf16 "
    "(precision='bf16-mixed' or 'bf16-true'), which needs no scaler, or build the optimizer without gradient_release"
)


class GradientRelease:
    """Steps a :class:`QMuon`'s parameters inside backward (see the module docstring).

    Build it with :func:`attach_gradient_release` (or ``build_optimizer(..., gradient_release=True)``).

    Args:
        optimizer: the QMuon to drive; ``optimizer.gradient_release`` is set to this object.
        clip_norm: ``None``, or the L2 norm each AdamW-group parameter's gradient is clipped to
            before its step (per-parameter clipping, the alternative to global-norm clipping;
            Muon parameters are not clipped: their update is normalized).
    """

    def __init__(self, optimizer: QMuon, clip_norm: float | None = None) -> None:
        if not isinstance(optimizer, QMuon):
            raise TypeError(f"gradient release drives a QMuon, got {type(optimizer).__name__}")
        if optimizer.gradient_release is not None:
            raise ValueError("this QMuon already has gradient release attached")
        if clip_norm is not None and not (isinstance(clip_norm, (int, float)) and math.isfinite(clip_norm)
                                          and clip_norm > 0):
            raise ValueError(f"release_clip_norm must be a positive finite number or None, got {clip_norm!r}")
        self.optimizer = optimizer
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        #: Parameters stepped inside backward in the current step (cleared by ``optimizer.step()``).
        self.released_in_step = 0
        #: Parameters ``optimizer.step()`` had to step itself in the last step (their gradient
        #: bypassed the hooks; see the module docstring).
        self.stepped_by_step = 0
        self._handles: list[RemovableHandle] = []
        self._hooked: tuple[int, ...] = ()
        self._hooked_set: frozenset[int] = frozenset()
        self._stepped: set[int] = set()
        self._pending: list[Tensor] = []
        self._pending_storage: int | None = None
        self._callback_queued = False
        self._adamw_ids: set[int] = set()
        self.sync_hooks()
        optimizer.gradient_release = self

    # ------------------------------------------------------------------ hooks
    def sync_hooks(self) -> None:
        """(Re-)register the hooks when the optimizer's parameters are not those hooked (an
        integration such as Accelerate replaced them)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        ids = tuple(id(p) for p in params)
        self._adamw_ids = {id(p) for g in self.optimizer.param_groups if not g["use_muon"] for p in g["params"]}
        if ids == self._hooked:
            return
        self.remove_hooks()
        for key in [k for k, (pr, rr) in _OWNERS.items() if pr() is None or rr() is None]:
            del _OWNERS[key]  # dead entries
        me = weakref.ref(self)

        def hook(p: Tensor) -> None:  # a weak reference: a dropped optimizer does not live on in its hooks
            release = me()
            if release is not None:
                release._hook(p)

        for p in params:
            if not p.requires_grad:
                continue
            other = _owner_of(p)
            if other is not None and other is not self and id(p) in other._hooked_set:
                log.warning("gradient release: a parameter was released by another optimizer, which stops "
                            "releasing now (its step() steps as without release)")
                other.detach()
            _OWNERS[id(p)] = (weakref.ref(p), me)
            self._handles.append(p.register_post_accumulate_grad_hook(hook))
        self._hooked, self._hooked_set = ids, frozenset(ids)

    def remove_hooks(self) -> None:
        """Remove the hooks (the optimizer then steps in ``step()`` as usual, once detached:
        :meth:`detach`)."""
        for h in self._handles:
            h.remove()
        self._handles, self._hooked, self._hooked_set = [], (), frozenset()

    def detach(self) -> None:
        """Stop releasing: remove the hooks and give ``step()`` back its usual behaviour."""
        self._flush()
        self.remove_hooks()
        if self.optimizer.gradient_release is self:
            self.optimizer.gradient_release = None

    def _hook(self, p: Tensor) -> None:
        if p.grad is None:
            return
        if id(p) in self._stepped:
            raise RuntimeError(ACCUMULATION_ERROR.format(what=self._label(p)))
        self._stepped.add(id(p))
        if is_dtensor(p):
            # One FSDP2 unit's sharded gradients are views of one reduce-scatter output.
            storage = local(p.grad).untyped_storage().data_ptr()
            if self._pending and storage != self._pending_storage:
                self._flush()
            self._pending.append(p)
            self._pending_storage = storage
            self._queue_end_of_backward()
            return
        self._step([p])

    def _queue_end_of_backward(self) -> None:
        if self._callback_queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        except RuntimeError:  # not inside backward (a hook called by hand): step() flushes
            pass

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._flush()

    def _flush(self) -> None:
        params, self._pending, self._pending_storage = self._pending, [], None
        if params:
            self._step(params)

    def _step(self, params: list[Tensor]) -> None:
        try:
            if self.clip_norm is not None:
                self._clip([p for p in params if id(p) in self._adamw_ids])
            self.optimizer.step_params(params)
            self.released_in_step += len(params)
        finally:
            for p in params:
                p.grad = None

    @torch.no_grad()
    def _clip(self, params: list[Tensor]) -> None:
        """Per-parameter L2 clipping of AdamW-group gradients (a DTensor's norm is its whole
        gradient's: one all-reduce per parameter, in the same order on every rank). A non-finite
        gradient is left as it is for the optimizer's non-finite policy."""
        assert self.clip_norm is not None
        for p in params:
            g = p.grad
            if g is None:
                continue
            norm = torch.linalg.vector_norm(g, 2)
            if is_dtensor(norm):
                norm = norm.full_tensor()
            scale = (self.clip_norm / (norm.float() + 1e-6)).clamp(max=1.0)
            scale = torch.where(torch.isfinite(scale), scale, torch.ones_like(scale))
            local(g).mul_(scale.to(local(g).dtype))

    def _label(self, p: Tensor) -> str:
        for gi, g in enumerate(self.optimizer.param_groups):
            for i, q in enumerate(g["params"]):
                if q is p:
                    return self.optimizer._param_label(gi, i)
        return "a parameter"

    # ------------------------------------------------------------------ step
    def finish_step(self) -> None:
        """What ``optimizer.step()`` does with release on: step the waiting unit, then every
        parameter still holding a gradient (it bypassed the hooks), then start a new step."""
        self._flush()
        leftovers = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.stepped_by_step = len(leftovers)
        if leftovers:
            log.debug("gradient release: optimizer.step() steps %d parameters whose gradients bypassed the hooks",
                      len(leftovers))
            if self.clip_norm is not None:
                self._clip([p for p in leftovers if id(p) in self._adamw_ids])
            # A parameter released in this step that holds a gradient again was accumulated into
            # outside autograd's hooks: stepping it a second time would be the accumulation error.
            twice = [p for p in leftovers if id(p) in self._stepped]
            if twice:
                raise RuntimeError(ACCUMULATION_ERROR.format(what=self._label(twice[0])))
            self.optimizer.step_params(leftovers)  # collective for DTensors: every rank has the same leftovers
            # .grad keeps the NS input afterwards, as after a step without release
        self._stepped.clear()
        self.released_in_step = 0
        self.sync_hooks()


def attach_gradient_release(optimizer: QMuon, clip_norm: float | None = None) -> GradientRelease:
    """Step ``optimizer``'s parameters inside backward from now on (see the module docstring)."""
    return GradientRelease(optimizer, clip_norm=clip_norm)


def release_of(optimizer: Any) -> GradientRelease | None:
    """The gradient release driving ``optimizer`` (unwrapping Lightning / Accelerate wrappers), or None."""
    seen = 0
    while optimizer is not None and seen < 8:
        rel = getattr(optimizer, "gradient_release", None) if isinstance(optimizer, QMuon) else None
        if rel is not None:
            return rel
        optimizer = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
        seen += 1
    return None


def releasing(parameters: Any) -> GradientRelease | None:
    """The gradient release that hooks one of ``parameters`` (a tensor or an iterable of them;
    the iterable is consumed), or None: the check an integration's global clip makes before it
    looks at gradients that release has already stepped and freed."""
    for p in [parameters] if isinstance(parameters, Tensor) else parameters:
        owner = _owner_of(p)
        if owner is not None and id(p) in owner._hooked_set and owner.optimizer.gradient_release is owner:
            return owner
    return None


def check_trainer_compatible(*, accumulate_grad_batches: int = 1, gradient_clip_val: float | None = None,
                             scaler: Any = None, where: str = "gradient_release",
                             accumulate_setting: str = "Trainer(accumulate_grad_batches={n})") -> None:
    """Raise at setup when a training loop's settings cannot combine with gradient release (the
    Lightning strategies call it with the Trainer's settings, ``prepare_qmuon`` with the
    Accelerator's; ``accumulate_setting`` names the setting in the message)."""
    if accumulate_grad_batches and int(accumulate_grad_batches) > 1:
        raise ValueError(f"{where}: " + ACCUMULATION_ERROR.format(what="each parameter")
                         + f" ({accumulate_setting.format(n=accumulate_grad_batches)})")
    if gradient_clip_val:
        raise ValueError(f"{where}: " + CLIPPING_ERROR.format(what=f"Trainer(gradient_clip_val={gradient_clip_val})"))
    if scaler is not None:
        raise ValueError(f"{where}: " + SCALER_ERROR.format(what=f"the precision plugin holds a {type(scaler).__name__}"))

