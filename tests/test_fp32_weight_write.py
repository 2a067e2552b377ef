"""The fused fp32 weight write ``torch.ops.qmuon.fp32_weight_update_``: decoupled weight decay and the
update in one pass over fp32 weights, the update read in any layout and dtype.

It must write exactly what ``param.mul_(decay); param.add_(update, alpha=alpha)`` (``torch.optim.Muon``'s
arithmetic, and the optimizer's before the op existed) writes, bit for bit: against torch's two ops
on odd shapes (vector tails), transposed / strided / bf16 / fp16 updates and padded weight rows;
against its definition (one fused multiply-add after a rounded multiply, checked with exact rational
arithmetic); and through the whole QMuon step (the compiled write against the reference write).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

import qmuon
from qmuon.core import apply as wa
from qmuon.ops import _kernels as K
from qmuon.ops import reference_weight as refw

SHAPES = [(1, 1), (1, 37), (37, 1), (7, 13), (33, 17), (65, 130), (129, 257), (256, 1024), (1024, 256)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _update(rows: int, cols: int, layout: str, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """An update of shape (rows, cols) with the given memory layout."""
    if layout == "contiguous":
        u = torch.randn(rows, cols, generator=gen)
    elif layout == "transposed":  # a tall Newton-Schulz output: x.mT of a contiguous (cols, rows)
        u = torch.randn(cols, rows, generator=gen).mT
    elif layout == "strided":  # every other column of a wider matrix
        u = torch.randn(rows, 2 * cols, generator=gen)[:, ::2]
    else:  # "batched-transposed": one slot of a transposed batch
        u = torch.randn(3, cols, rows, generator=gen).mT[1]
    return u.to(dtype) if dtype != torch.float32 else u


def _torch_write(w: torch.Tensor, u: torch.Tensor, alpha: float, decay: float) -> None:
    w.mul_(decay)
    w.add_(u, alpha=alpha)


def _fused(ext) -> bool:
    return K.fp32_write_matches_torch(torch.device("cpu"))


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided", "batched-transposed"])
@pytest.mark.parametrize("udt", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_equals_torch_mul_then_add_bit_for_bit(ext, layout, udt):
    if not _fused(ext):
        pytest.skip("this torch build's CPU add rounds twice (no FMA): the op runs torch's own ops")
    gen = torch.Generator().manual_seed(11)
    before = K.served[("fp32_weight_update_", "compiled")]
    calls = 0
    for rows, cols in SHAPES:
        for alpha, decay in ((-0.0213, 0.9998), (-1.7, 1.0), (0.5, 0.37)):
            w = torch.randn(rows, cols, generator=gen) * 3
            u = _update(rows, cols, layout, udt, gen)
            a, b = w.clone(), w.clone()
            torch.ops.qmuon.fp32_weight_update_(a, u, alpha, decay)
            calls += 1
            _torch_write(b, u, alpha, decay)
            assert torch.equal(_bits(a), _bits(b)), (rows, cols, layout, udt, alpha, decay)
    assert K.served[("fp32_weight_update_", "compiled")] - before == calls


def test_kernel_writes_padded_weight_rows_only(ext):
    """A column block of a wider weight (a fused part): the columns outside it stay untouched."""
    if not _fused(ext):
        pytest.skip("no FMA add in this torch build")
    gen = torch.Generator().manual_seed(3)
    whole = torch.randn(70, 300, generator=gen)
    u = torch.randn(100, 70, generator=gen).to(torch.bfloat16).mT
    a, b = whole.clone(), whole.clone()
    torch.ops.qmuon.fp32_weight_update_(a[:, 100:200], u, -0.01, 0.999)
    _torch_write(b[:, 100:200], u, -0.01, 0.999)
    assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(_bits(a[:, :100]), _bits(whole[:, :100])) and torch.equal(_bits(a[:, 200:]), _bits(whole[:, 200:]))


def test_kernel_is_a_rounded_multiply_then_one_fused_multiply_add(ext):
    """By definition, with exact rational arithmetic: ``w' = fp32(w * decay)``, then
    ``fp32(w' + u * alpha)`` rounded once (nearest even). On these inputs two roundings differ from
    one in some elements, so the check tells the two apart."""
    if not _fused(ext):
        pytest.skip("no FMA add in this torch build")
    gen = torch.Generator().manual_seed(5)
    n = 1500
    w = torch.randn(1, n, generator=gen)
    u = torch.randn(1, n, generator=gen)
    alpha, decay = -0.0213, 0.9998
    out = w.clone()
    torch.ops.qmuon.fp32_weight_update_(out, u, alpha, decay)
    a32, d32 = np.float32(alpha), np.float32(decay)
    w1 = (w.numpy().astype(np.float32) * d32).astype(np.float32)  # numpy float32 multiply: one rounding
    twice = (w1 + (u.numpy() * a32).astype(np.float32)).astype(np.float32)
    differs = 0
    for j in range(n):
        exact = Fraction(float(w1[0, j])) + Fraction(float(u[0, j])) * Fraction(float(a32))
        r = np.float32(out[0, j].item())
        err = abs(Fraction(float(r)) - exact)
        half_ulp = Fraction(float(np.spacing(np.abs(r)))) / 2
        assert err < half_ulp or (err == half_ulp and int(np.float32(r).view(np.int32)) % 2 == 0), j
        differs += int(twice[0, j] != r)
    assert differs > 0  # the inputs separate one rounding from two


def test_op_runs_the_reference_where_torch_rounds_twice(ext, monkeypatch):
    """If the probe finds that torch's add is not fused (ATEN_CPU_CAPABILITY=default on x86), the op
    runs torch's own two ops: the same bits as the optimizer always wrote."""
    monkeypatch.setitem(K._add_fused, "cpu", False)
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(33, 17, generator=gen)
    u = torch.randn(17, 33, generator=gen).to(torch.bfloat16).mT
    a, b = w.clone(), w.clone()
    before = K.served[("fp32_weight_update_", "reference")]
    torch.ops.qmuon.fp32_weight_update_(a, u, -0.3, 0.99)
    _torch_write(b, u, -0.3, 0.99)
    assert torch.equal(_bits(a), _bits(b))
    assert K.served[("fp32_weight_update_", "reference")] == before + 1


def test_reference_is_torch_mul_then_add():
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(13, 29, generator=gen)
    u = torch.randn(13, 29, generator=gen).to(torch.bfloat16)
    a, b = w.clone(), w.clone()
    refw.fp32_weight_update_(a, u, -0.05, 0.98)
    _torch_write(b, u, -0.05, 0.98)
    assert torch.equal(_bits(a), _bits(b))


def test_bad_arguments_are_named():
    with pytest.raises((ValueError, RuntimeError), match="fp32"):
        torch.ops.qmuon.fp32_weight_update_(torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, 4), 1.0, 1.0)
    with pytest.raises((ValueError, RuntimeError), match="shape"):
        torch.ops.qmuon.fp32_weight_update_(torch.zeros(3, 4), torch.zeros(4, 3), 1.0, 1.0)


def test_apply_update_writes_any_parameter_layout_like_torch():
    """core.apply for fp32 weights: 2-D blocks (with a transposed bf16 update), a 4-D conv weight and a
    1-D vector all get torch's mul_ / add_ bits."""
    gen = torch.Generator().manual_seed(4)
    cases = [
        (torch.randn(64, 48, generator=gen), torch.randn(48, 64, generator=gen).to(torch.bfloat16).mT),
        (torch.randn(8, 3, 3, 3, generator=gen), torch.randn(8, 27, generator=gen)),
        (torch.randn(50, generator=gen), torch.randn(50, generator=gen)),
        (torch.randn(20, 30, generator=gen)[:, 5:25], torch.randn(20, 20, generator=gen)),
    ]
    for w, u in cases:
        a, b = w.clone(), w.clone()
        wa.apply_update_(a, u, alpha=-0.02, decay=0.999)
        b.mul_(0.999)
        b.add_(u.reshape(b.shape), alpha=-0.02)
        assert torch.equal(_bits(a), _bits(b)), tuple(w.shape)


class _Net(nn.Module):
    """Square, tall and wide matrices, a fused qkv projection, a conv weight, vectors (AdamW)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96, bias=False)
        self.tall = nn.Linear(24, 80)
        self.wide = nn.Linear(80, 24)
        self.sq = nn.Linear(32, 32, bias=False)
        self.conv = nn.Conv2d(3, 8, 3)


def _run(monkeypatch, fused: bool, steps: int = 3, **kw) -> list[torch.Tensor]:
    monkeypatch.setitem(K._add_fused, "cpu", fused)
    torch.manual_seed(0)
    net = _Net()
    # qkv as three fused parts, "wide" stored (in, out) (NS on its transpose), conv 4-D, biases AdamW
    opt = qmuon.build_optimizer(net, lr=0.02, weight_decay=0.1, adamw_lr=3e-3, verbose=False, routing={"fused_parts": {r"qkv\.weight$": (32, 32, 32)}, "orientations": {r"wide\.weight$": "in_out"}}, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in net.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("kw", [{}, {"state_format": "fp32"}, {"newton_schulz": {"dtype": "fp32"}}, {"update": {"variant": "normuon"}}])
def test_qmuon_step_with_the_compiled_write_equals_torch_ops(ext, monkeypatch, kw):
    if not K.fp32_write_matches_torch(torch.device("cpu")):
        pytest.skip("no FMA add in this torch build: both runs use torch's ops")
    before = K.served[("fp32_weight_update_", "compiled")]
    fast = _run(monkeypatch, True, **kw)
    assert K.served[("fp32_weight_update_", "compiled")] > before
    slow = _run(monkeypatch, False, **kw)
    for a, b in zip(fast, slow):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
@pytest.mark.parametrize("udt", [torch.float32, torch.bfloat16])
def test_cuda_kernel_equals_torch_mul_then_add(cuda_ext, layout, udt):
    dev = torch.device("cuda")
    if not K.fp32_write_matches_torch(dev):
        pytest.skip("this torch build's CUDA add is not one FMA")
    gen = torch.Generator().manual_seed(12)
    for rows, cols in SHAPES + [(1000, 33), (70000, 2)]:
        w = torch.randn(rows, cols, generator=gen).to(dev)
        u = _update(rows, cols, layout, udt, gen).to(dev)
        a, b = w.clone(), w.clone()
        torch.ops.qmuon.fp32_weight_update_(a, u, -0.0213, 0.9998)
        _torch_write(b, u, -0.0213, 0.9998)
        assert torch.equal(_bits(a), _bits(b)), (rows, cols, layout, udt)
