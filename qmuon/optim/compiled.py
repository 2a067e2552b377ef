"""``compile_step``: the whole optimizer step as one ``torch.compile`` graph.

The step reads nothing back from the tensors it computes (:mod:`.nonfinite`), so dynamo can trace it
end to end (``fullgraph=True``: any graph break is an error). Two things stay outside the graph,
done eagerly around it by the function :func:`compile_step` returns:

- the non-finite bookkeeping of the previous step (:meth:`QMuon.settle_nonfinite`: reading its
  staged flags, rolling back skipped step counters, ``max_nonfinite_skips``), and closing this step's
  flags (their asynchronous copy to the host);
- a ``closure``, when one is given (it runs forward and backward; the graph is the update).

Inside the graph the per-parameter ``step`` counters are read as scalars: they are 0-d CPU tensors
(torch.optim's non-capturable convention) whose values key the stochastic-rounding streams and AdamW's
bias corrections, so the step is traced with ``torch._dynamo.config.capture_scalar_outputs`` on
(reading a CPU scalar does not wait for any device). The compiled kernels stay opaque custom ops in
the graph (their fakes describe them to the compiler); the Newton-Schulz iterations, the apply and
the elementwise glue are compiled by the backend (inductor by default).

Not compiled (each refused by name, with the alternative): gradient release (its steps run inside
backward, one parameter at a time: compile the model instead), sharded parameters (FSDP2 / TP
DTensors: their step exchanges matrices between ranks).

``capture_step``: the step as one CUDA graph, replayed every step. It needs ``update.capturable``
(torch.optim's convention: the step counters live on the device and the step reads the learning
rates from device copies, refreshed before each replay), CUDA parameters and gradients that stay in
place (``zero_grad(set_to_none=False)``). On CPU, :func:`compile_step` with ``capturable`` gives the
same no-recompile behaviour under an lr schedule.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import Tensor

from ..core import pipeline
from ..core.config import ConfigError
from .qmuon import QMuon

__all__ = ["compile_step", "capture_step", "CapturedStep"]


def _refuse(optimizer: QMuon) -> None:
    if optimizer.gradient_release is not None:
        raise ConfigError(
            "qmuon.compile_step: this optimizer has gradient release attached; its parameters are stepped inside "
            "backward by hooks, one at a time, so there is no single step to compile. Compile the model "
            "(torch.compile(model)) and keep release, or build the optimizer without gradient_release to compile "
            "its step")
    sharded = [p for g in optimizer.param_groups for p in g["params"] if pipeline.is_dtensor(p)]
    if sharded:
        raise ConfigError(
            f"qmuon.compile_step: {len(sharded)} parameters are sharded (DTensor: FSDP2, HSDP or tensor parallel); "
            "their step exchanges whole matrices between ranks with collectives decided per step, which one "
            "compiled graph cannot hold. Step sharded models eagerly (optimizer.step()); compile the model instead")


def compile_step(optimizer: QMuon, **compile_kwargs: Any) -> Callable[..., Any]:
    """``optimizer.step`` compiled as one graph: ``step = qmuon.compile_step(opt)``, then ``step()`` in
    place of ``opt.step()`` (same results: within float reordering for fp32 weights, see
    tests/test_compiled_step.py).

    ``compile_kwargs`` go to :func:`torch.compile` (``fullgraph=True`` unless given; ``backend``,
    ``mode``, ``dynamic``, ...). The optimizer keeps working eagerly beside it (``opt.step()``,
    ``state_dict()``, checkpoints). Raises :class:`~qmuon.ConfigError` for what cannot be compiled
    (gradient release, sharded parameters), before anything is compiled.
    """
    if not isinstance(optimizer, QMuon):
        raise TypeError(f"qmuon.compile_step takes a QMuon, got {type(optimizer).__name__}")
    _refuse(optimizer)
    compile_kwargs.setdefault("fullgraph", True)
    # the class's step, not ``optimizer.step``: an lr scheduler replaces that attribute with a wrapper
    # dynamo does not trace (it only marks the step as called, which the function below does)
    compiled = torch.compile(type(optimizer).step.__get__(optimizer), **compile_kwargs)
    seen_lrs: list[Any] = []

    def step(closure: Callable[[], Any] | None = None) -> Any:
        _refuse(optimizer)  # release or sharding attached after compile_step
        loss = pipeline.call_closure(closure)  # forward / backward stay outside the update's graph
        optimizer.settle_nonfinite()  # the previous step's flags (read a step late, as eagerly)
        for group in optimizer.param_groups:  # what "auto" chooses is host logic (a lock, the CPU's ISA)
            if group.get("use_muon", True) and group["params"]:
                pipeline.record_auto_choices(group, pipeline.local(group["params"][0]).device)
        optimizer._follow_lrs()  # learning rates written by a loop into every group (lr_ratios), warnings
        optimizer._check_group_lrs()
        if optimizer.capturable:
            optimizer.refresh_device_lrs()  # the graph reads the lrs from these device copies
        else:
            _warn_lr_recompiles(optimizer, seen_lrs)
        optimizer._opt_called = True  # what an lr scheduler's step wrapper records (its order warning)
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            compiled()
        optimizer._nonfinite.end_step()  # this step's flags: their host copy starts now
        return loss

    step.__doc__ = f"The compiled step of {type(optimizer).__name__} (qmuon.compile_step)."
    return step


def _warn_lr_recompiles(optimizer: QMuon, seen: list[Any]) -> None:
    """Warn once when a non-capturable compiled step meets a new learning rate: its lrs are
    constants of the graph, so each new value recompiles (dynamo stops after its recompile limit)."""
    lrs = [g["lr"] if isinstance(g["lr"], float) else float(g["lr"]) for g in optimizer.param_groups]
    if seen and seen[0] is not None and lrs != seen[0]:
        warnings.warn(
            "qmuon.compile_step: the learning rate changed, which recompiles a step whose lrs are graph constants. "
            "Build the optimizer with update={'capturable': True} (the graph then reads the lrs from the device) "
            "to follow an lr schedule with one graph", stacklevel=3)
        seen[:] = [None]  # once
    elif not seen:
        seen.append(lrs)


class CapturedStep:
    """``optimizer.step`` as one CUDA graph (what :func:`capture_step` returns): the first
    ``warmup_steps`` calls step eagerly on a side stream (the state is created, the kernels are
    loaded), the next one captures the step and replays it, every later one replays it.

    Around each replay, eagerly: the closure (forward and backward), the previous step's non-finite
    flags (:meth:`QMuon.settle_nonfinite`), the lr bookkeeping and the device lr copies
    (:meth:`QMuon.refresh_device_lrs`), and the asynchronous host copy of this step's flags.
    """

    def __init__(self, optimizer: QMuon, warmup_steps: int, pool: Any) -> None:
        self.optimizer = optimizer
        self.warmup_steps = warmup_steps
        self.pool = pool
        self.calls = 0
        self.graph: Any = None
        self._grads: dict[int, int | None] = {}
        self._recorded: Any = None
        self._signature: tuple[int, ...] = ()

    def _params(self) -> list[Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _check_grads(self) -> None:
        """The graph reads each gradient at the address it had when captured."""
        if tuple(id(p) for p in self._params()) != self._signature:
            raise RuntimeError("qmuon.capture_step: the optimizer's parameters changed since the step was captured "
                               "(add_param_group, a new model); call qmuon.capture_step(optimizer) again")
        for p in self._params():
            want, grad = self._grads[id(p)], p.grad
            have = None if grad is None else grad.data_ptr()
            if have != want:
                raise RuntimeError(
                    "qmuon.capture_step: a gradient is not where the captured step reads it "
                    f"(parameter of shape {tuple(p.shape)}: {'no gradient' if have is None else 'a new tensor'}"
                    f"{'' if want is not None else ', and it had none at capture'}). Keep gradients in place: "
                    "optimizer.zero_grad(set_to_none=False) (or model.zero_grad(set_to_none=False)), and give every "
                    "parameter a gradient before the capturing call")

    def __call__(self, closure: Callable[[], Any] | None = None) -> Any:
        opt = self.optimizer
        _refuse(opt)
        loss = pipeline.call_closure(closure)
        opt._opt_called = True  # what an lr scheduler's step wrapper records (its order warning)
        if self.calls < self.warmup_steps:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                opt.step()
            torch.cuda.current_stream().wait_stream(side)
            self.calls += 1
            return loss
        opt.settle_nonfinite()  # the previous step's flags, read a step late (as eagerly)
        for group in opt.param_groups:
            if group.get("use_muon", True) and group["params"]:
                pipeline.record_auto_choices(group, pipeline.local(group["params"][0]).device)
        opt._follow_lrs()
        opt._check_group_lrs()
        opt.refresh_device_lrs()  # host-to-device writes the graph then reads
        if self.graph is None:
            self._signature = tuple(id(p) for p in self._params())
            self._grads = {id(p): None if p.grad is None else p.grad.data_ptr() for p in self._params()}
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                opt.step_params()
            self._recorded = opt._nonfinite.take_current()
            self.graph = graph
        else:
            self._check_grads()
        self.graph.replay()
        opt._nonfinite.replay(self._recorded)
        opt._end_step()  # this step's flags: their host copy starts now
        self.calls += 1
        return loss


def capture_step(optimizer: QMuon, *, warmup_steps: int = 3, pool: Any = None) -> CapturedStep:
    """``optimizer.step`` captured as one CUDA graph: ``step = qmuon.capture_step(opt)``, then
    ``step()`` in place of ``opt.step()``. The optimizer must be built with
    ``update={"capturable": True}`` (step counters on the device, lrs read from device copies: an lr
    schedule keeps working, replay after replay) and its parameters must live on one or more CUDA
    devices. Gradients must stay where they are between steps (``zero_grad(set_to_none=False)``);
    the replay checks their addresses, on the host, and raises if one moved.

    The first ``warmup_steps`` calls (3 by default, as torch recommends before a capture) step eagerly
    on a side stream; the next captures and runs the step; the rest replay it. ``pool``: a graph
    memory pool to share with other graphs (``torch.cuda.graph_pool_handle()``). Raises
    :class:`~qmuon.ConfigError` before anything is captured for what cannot be: a non-capturable
    optimizer, CPU parameters (use :func:`compile_step`), gradient release, sharded parameters,
    stochastic rounding of the quantized state.
    """
    if not isinstance(optimizer, QMuon):
        raise TypeError(f"qmuon.capture_step takes a QMuon, got {type(optimizer).__name__}")
    _refuse(optimizer)
    if not optimizer.capturable:
        raise ConfigError(
            "qmuon.capture_step: the optimizer is not capturable; build it with update={'capturable': True} (its step "
            "counters then live on the device and the graph reads the learning rates from device copies)")
    devices = {pipeline.local(p).device.type for g in optimizer.param_groups for p in g["params"]}
    if devices != {"cuda"}:
        raise ConfigError(
            f"qmuon.capture_step: CUDA graphs capture CUDA work; these parameters live on {sorted(devices)}. On a CPU, "
            "qmuon.compile_step(optimizer) compiles the step as one graph (with capturable=True it follows an lr "
            "schedule without recompiling)")
    if not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ConfigError(f"qmuon.capture_step: warmup_steps must be an int >= 1 (eager steps before the capture, "
                          f"which create the state), got {warmup_steps!r}")
    optimizer._check_capturable()
    return CapturedStep(optimizer, warmup_steps, pool)
