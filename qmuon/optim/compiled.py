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
DTensors: their step exchanges matrices between ranks), and an update sink (DeepSpeed).

What a captured CUDA graph would additionally need (step counters and the learning rate on the
device, read by the kernels) is not here yet: docs/limits.md.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..core import pipeline
from ..core.config import ConfigError
from .qmuon import QMuon

__all__ = ["compile_step"]


def _refuse(optimizer: QMuon) -> None:
    if optimizer.gradient_release is not None:
        raise ConfigError(
            "qmuon.compile_step: this optimizer has gradient release attached; its parameters are stepped inside "
            "backward by hooks, one at a time, so there is no single step to compile. Compile the model "
            "(torch.compile(model)) and keep release, or build the optimizer without gradient_release to compile "
            "its step")
    if optimizer.update_sink is not None:
        raise ConfigError(
            "qmuon.compile_step: this optimizer hands its updates to an update sink (the DeepSpeed driver), which "
            "runs outside the step; use the DeepSpeed engine's own step")
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
    (gradient release, sharded parameters, an update sink), before anything is compiled.
    """
    if not isinstance(optimizer, QMuon):
        raise TypeError(f"qmuon.compile_step takes a QMuon, got {type(optimizer).__name__}")
    _refuse(optimizer)
    compile_kwargs.setdefault("fullgraph", True)
    compiled = torch.compile(optimizer.step, **compile_kwargs)

    def step(closure: Callable[[], Any] | None = None) -> Any:
        _refuse(optimizer)  # release or sharding attached after compile_step
        loss = pipeline.call_closure(closure)  # forward / backward stay outside the update's graph
        optimizer.settle_nonfinite()  # the previous step's flags (read a step late, as eagerly)
        for group in optimizer.param_groups:  # what "auto" chooses is host logic (a lock, the CPU's ISA)
            if group.get("use_muon", True) and group["params"]:
                pipeline.record_auto_choices(group, pipeline.local(group["params"][0]).device)
        optimizer._follow_lrs()  # learning rates written by a loop into every group (lr_ratios), warnings
        optimizer._check_group_lrs()
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            compiled()
        optimizer._nonfinite.end_step()  # this step's flags: their host copy starts now
        return loss

    step.__doc__ = f"The compiled step of {type(optimizer).__name__} (qmuon.compile_step)."
    return step
