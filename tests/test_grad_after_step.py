"""What ``.grad`` holds after ``QMuon.step()`` (issue 37, item 4; docs/limits.md).

QMuon does not keep ``torch.optim``'s untouched ``.grad``: the Muon momentum kernels write the
Newton-Schulz input (the Nesterov-blended momentum) into the gradient buffer instead of a scratch
buffer (the memory this saves: benchmarks/results/grad_buffer_reuse.md). These tests pin the
behaviour the docs state, so that a change to it (e.g. giving ``.grad`` back) has to update them:

- an AdamW-group parameter's ``.grad`` is bit-identical to the gradient backward produced;
- a Muon parameter's ``.grad`` is its NS input, recomputed here from the fp32 reference formula
  (``m = lerp(m_prev, g, 1 - beta)`` from ``m = 0``, ``ns = lerp(g, m, beta)`` with Nesterov);
- with ``gradient_release=True`` every parameter's ``.grad`` is ``None`` after backward.

Tolerance of the Muon check: none (bit-exact). The fp32 format's momentum op promises
``torch.optim.Muon``'s ``buf.lerp_(grad, 1 - beta)`` bit for bit and writes
``torch.lerp(grad, m, beta)`` as the NS input (qmuon/ops/reference.py ``dense_momentum_update_``; the
compiled kernel uses one fused multiply-add, as torch's lerp does, and the binding falls back to the
reference if a probe shows they differ: docs/kernels.md, "Bit-exactness contract"). So the same
``torch.lerp`` calls in fp32 give the same bits here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qmuon

STEPS = 3  # step 1 starts from zero momentum; steps 2-3 check the carried momentum too


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(64, 32),
        nn.Linear(32, 48),
        nn.GELU(),
        nn.Linear(48, 32),
        nn.Linear(32, 64),  # head: out_features != in_features, routed to AdamW
    )


def _backward(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 64, (4, 8), generator=g)
    targets = torch.randint(0, 64, (4, 8), generator=g)
    logits = model(tokens)
    nn.functional.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1)).backward()


def _families(opt) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    muon = [p for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    adamw = [p for g in opt.param_groups if not g["use_muon"] for p in g["params"]]
    return muon, adamw


def test_routing_has_both_families():
    model = _model()
    opt = qmuon.build_optimizer(model, state_format="fp32", verbose=False)
    muon, adamw = _families(opt)
    assert {id(p) for p in muon} == {id(model[1].weight), id(model[3].weight)}
    assert len(adamw) == len(list(model.parameters())) - 2


def test_fp32_muon_grad_is_ns_input_adamw_grad_untouched():
    model = _model()
    opt = qmuon.build_optimizer(model, state_format="fp32", verbose=False)
    muon, adamw = _families(opt)
    (group,) = [g for g in opt.param_groups if g["use_muon"]]
    beta = float(group["momentum"])
    assert group["nesterov"] is True  # the default this test's formula is for
    momentum = {id(p): torch.zeros_like(p, dtype=torch.float32) for p in muon}

    for step in range(STEPS):
        opt.zero_grad()
        _backward(model, step)
        before = {id(p): (p.grad, p.grad.clone()) for p in model.parameters()}

        opt.step()

        for p in adamw:
            buf, copy = before[id(p)]
            assert p.grad is buf
            assert torch.equal(p.grad, copy), "an AdamW parameter's .grad changed in step()"
        for p in muon:
            buf, g = before[id(p)]
            m = torch.lerp(momentum[id(p)], g.float(), 1.0 - beta)
            momentum[id(p)] = m
            ns_input = torch.lerp(g.float(), m, beta)
            assert p.grad is buf  # written in place: no new tensor
            assert not torch.equal(p.grad, g), "a Muon parameter's .grad is the gradient again: update the docs"
            torch.testing.assert_close(p.grad, ns_input, rtol=0, atol=0)
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], m, rtol=0, atol=0)


@pytest.mark.parametrize("state_format", ["int8", "int4"])
def test_quantized_formats_overwrite_muon_grad_only(state_format):
    """The quantized formats (default int8 AdamW state too) write the NS input into a Muon
    parameter's ``.grad`` and leave every AdamW parameter's ``.grad`` bit for bit."""
    model = _model()
    opt = qmuon.build_optimizer(model, state_format=state_format, verbose=False)
    muon, adamw = _families(opt)
    for step in range(2):
        opt.zero_grad()
        _backward(model, step)
        before = {id(p): p.grad.clone() for p in model.parameters()}
        opt.step()
        for p in adamw:
            assert torch.equal(p.grad, before[id(p)])
        for p in muon:
            assert not torch.equal(p.grad, before[id(p)])
            assert torch.isfinite(p.grad).all()


def test_gradient_release_leaves_no_grad():
    model = _model()
    opt = qmuon.build_optimizer(model, state_format="fp32", gradient_release=True, verbose=False)
    for step in range(2):
        weights = [p.detach().clone() for p in model.parameters()]
        _backward(model, step)
        for p, w in zip(model.parameters(), weights):
            assert p.grad is None, "a released parameter kept its .grad"
            assert not torch.equal(p.detach(), w), "a parameter was not stepped in backward"
        opt.step()  # nothing left to step; .grad stays None
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
