"""``qmuon.compile_step``: the optimizer step as one ``torch.compile`` graph (``fullgraph=True``), for
every single-device configuration of tests/test_host_reads.py, against the eager step in the same run.

Tolerances. ``aot_eager`` runs the traced graph's ops as eager torch would, so it must match the eager
step bit for bit (any difference is a tracing bug). ``inductor`` generates its own loops: fused
elementwise code may contract multiply-adds (FMA) and reorder reductions, so fp32 weights agree within
float reordering: measured max |compiled - eager| 1.6e-4 after 4 steps at lr 0.02 on the tiny model
(AMX Xeon), bounded here by 1e-3 absolute (a Muon step moves a weight by ~lr = 2e-2, so a wrong step
or a skipped parameter shows as ~1e-2).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qmuon
from qmuon import ConfigError, NonFiniteGradientError
from test_host_reads import CONFIGS, Net


def _pair(config: str):
    kw, dtype = CONFIGS[config]
    torch.manual_seed(0)
    model = Net().to(dtype)
    twin = copy.deepcopy(model)
    build = dict(lr=0.02, adamw_lr=1e-3, verbose=False, **kw)
    return model, qmuon.build_optimizer(model, **build), twin, qmuon.build_optimizer(twin, **build)


def _loss(model, x, bad=False):
    loss = nn.functional.cross_entropy(model(x).float().flatten(0, 1), x.flatten())
    return loss * float("nan") if bad else loss


def _train(config: str, backend: str, steps: int = 4, bad_steps=(2,), schedule: bool = True):
    """Both optimizers get the same gradients each step (drawn, not backpropagated, so a difference in
    one step cannot change the next step's gradients), under a learning-rate schedule (``schedule``)."""
    model, opt, twin, eager = _pair(config)
    step = qmuon.compile_step(opt, backend=backend)
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        for g in (*opt.param_groups, *eager.param_groups) if schedule else ():
            g["lr"] *= 0.9  # a schedule: the compiled step must follow it
        for p, q in zip(model.parameters(), twin.parameters()):
            g = torch.randn(p.shape, generator=gen).to(p.dtype) * (float("nan") if i in bad_steps else 1.0)
            p.grad, q.grad = g, g.clone()
        step()
        eager.step()
    return model, opt, twin, eager


def _max_diff(a: nn.Module, b: nn.Module, muon: bool | None = None, opt=None) -> float:
    """Largest |a - b| over the parameters (only the Muon or only the AdamW ones, when ``muon`` is set)."""
    keep = None
    if muon is not None:
        keep = {id(p) for g in opt.param_groups if g["use_muon"] == muon for p in g["params"]}
    return max(((p.float() - q.float()).abs().max().item() for p, q in zip(a.parameters(), b.parameters())
                if keep is None or id(p) in keep), default=0.0)


#: AdamW's bias corrections depend on the step count, which the compiled graph reads as a symbolic
#: float: ``1 - beta ** t`` is evaluated by the symbolic-float machinery instead of Python's ``**``
#: and can differ in its last bit (measured: 3e-8 after one step, 1.2e-7 after four on weights ~1);
#: 1e-5 leaves room for that and still catches a wrong update (~adamw_lr = 1e-3 per step).
ADAMW_TOL = 1e-5


#: Traced through AOT autograd too (the functionalized graph inductor would get); the other
#: configurations run dynamo's own graph (``backend="eager"``): one graph all the same (fullgraph), at a
#: fraction of the tracing time (the whole matrix under aot_eager took 8 minutes on 2 cores).
AOT = ("int8", "int4", "grasp4", "normuon", "bf16 stochastic + int8 adamw", "bf16 ecc8")


@pytest.mark.parametrize("config", list(CONFIGS))
def test_compiled_step_is_the_eager_step(config):
    """The Muon parameters and every state tensor bit for bit, the AdamW parameters within ADAMW_TOL,
    a NaN step skipped alike."""
    torch._dynamo.reset()
    model, opt, twin, eager = _train(config, "aot_eager" if config in AOT else "eager")
    assert _max_diff(model, twin, muon=True, opt=opt) == 0.0
    assert _max_diff(model, twin, muon=False, opt=opt) < ADAMW_TOL
    assert (opt.nonfinite_skips, opt.nonfinite_skipped_steps) == (eager.nonfinite_skips, eager.nonfinite_skipped_steps)
    assert opt.nonfinite_skips == len(list(model.parameters()))
    full = opt.state_dict()
    sd, sd_eager = full["state"], eager.state_dict()["state"]
    muon_idx = {i for g in full["param_groups"] if g["use_muon"] for i in g["params"]}
    for i in sd:
        for k, v in sd[i].items():
            if i in muon_idx or k == "step":
                assert torch.equal(v, sd_eager[i][k]), (config, i, k)
            else:
                assert torch.allclose(v.float(), sd_eager[i][k].float(), rtol=1e-5, atol=1e-7), (config, i, k)


@pytest.mark.parametrize("config", ["int8", "bf16 stochastic"])
def test_inductor_step_agrees_with_eager(config):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, opt, twin, eager = _train(config, "inductor", schedule=False)
    assert _max_diff(model, twin) < 1e-3
    # the first step creates the state (a graph of its own); the 3 later steps, one with NaN gradients,
    # reuse one graph while the step counters change
    assert counters["stats"]["unique_graphs"] == 2


def test_a_learning_rate_change_recompiles():
    """Without ``update.capturable`` (docs/limits.md): the kernels take the learning rate (and what
    derives from it) as host floats, which dynamo specializes, so each new value compiles the step again
    (a schedule that changes lr every step reaches dynamo's recompile limit and falls back to eager;
    compile_step warns once). tests/test_capturable.py: with capturable=True one graph follows it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _train("int8", "eager", steps=4, bad_steps=())
    assert counters["stats"]["unique_graphs"] == 4  # the first (state-creating) step's, then one per new lr


def test_compiled_step_enforces_max_nonfinite_skips():
    torch.manual_seed(0)
    model = Net()
    opt = qmuon.build_optimizer(model, verbose=False, safety={"max_nonfinite_skips": 1})
    step = qmuon.compile_step(opt, backend="aot_eager")
    x = torch.randint(0, 64, (4, 12))
    _loss(model, x).backward()
    step()
    snapshot = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):  # the second skip in a row passes the limit; read by the next step
        opt.zero_grad()
        _loss(model, x, bad=True).backward()
        step()
    opt.zero_grad()
    _loss(model, x).backward()
    with pytest.raises(NonFiniteGradientError, match="max_nonfinite_skips=1"):
        step()
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), snapshot))  # nothing changed since


def test_what_cannot_be_compiled_is_refused_by_name():
    model = Net()
    with pytest.raises(ConfigError, match="gradient release .* Compile the model"):
        qmuon.compile_step(qmuon.build_optimizer(model, verbose=False, gradient_release=True))
    with pytest.raises(TypeError, match="takes a QMuon"):
        qmuon.compile_step(torch.optim.AdamW(model.parameters()))


def test_plain_torch_compile_without_settling_is_refused():
    """``torch.compile(opt.step, fullgraph=True)`` traces too (with capture_scalar_outputs); its second
    step, with the first step's flags never read, stops with the fix instead of dropping them."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    opt = qmuon.build_optimizer(model, verbose=False)
    x = torch.randint(0, 64, (4, 12))
    compiled = torch.compile(opt.step, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        _loss(model, x).backward()
        compiled()
        opt.zero_grad()
        _loss(model, x).backward()
        with pytest.raises(Exception, match="settle_nonfinite"):
            compiled()
