"""bf16 weights without an fp32 master copy: ``bf16_update="nearest" | "stochastic" | "ecc8"``.

The write rules against their definitions (float64 / fp32 arithmetic, FlashOptim's ECC invariants),
the fused kernels against the pure-PyTorch reference (bit for bit), QMuon with bf16 models (both
groups), resume bit for bit, checkpoint validation, NaN gradients, the numerics check. The sharded
runs (FSDP2 + DCP + reshard) and the Lightning / Accelerate runs are at the end (slow).
"""

from __future__ import annotations

import copy
import io
import math
import os

import pytest
import torch
from torch import nn

import qmuon
from qmuon.core import apply as wa
from qmuon.ops import _kernels as K
from qmuon.ops import reference_weight as refw
from qmuon.quant import state as qstate

RULES = ("nearest", "stochastic", "ecc8")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a.contiguous()), _bits(b.contiguous()))


def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16 weights over many binades (1e-30 .. 1e3), with zeros, a subnormal, inf and the largest values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-30, 3, cols)[None, :]
    w = w.to(torch.bfloat16)
    w.view(-1)[:6] = torch.tensor([0.0, -0.0, float("inf"), 1e-40, 3.3e38, -3.3e38]).to(torch.bfloat16)
    return w


def _compiled() -> bool:
    from qmuon.ops import _extension

    return _extension.status().cpu


# --------------------------------------------------------------------------- the rules, by definition
def test_new_weight_is_three_separately_rounded_fp32_operations():
    g = torch.Generator().manual_seed(1)
    w, u = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    alpha, decay = -0.01234, 0.99876
    want = (w.double() * torch.tensor(decay, dtype=torch.float32).double()).float().double()
    want = (want + (u.double() * torch.tensor(alpha, dtype=torch.float32).double()).float().double()).float()
    assert _same(refw.new_weight_fp32(w, u, alpha, decay), want)


def test_stochastic_rounding_brackets_and_is_unbiased():
    """Every draw is x truncated toward zero or the next bf16 away from zero, and the mean over many
    independent streams converges to x (tolerance: 5 standard errors of a two-point distribution)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, generator=g) * 3
    lo_bits = x.view(torch.int32) & ~0xFFFF
    lo, hi = lo_bits.view(torch.float32), (lo_bits + 0x10000).view(torch.float32)
    n = 4000
    acc = torch.zeros(64, dtype=torch.float64)
    idx = torch.arange(64, dtype=torch.int64)
    for s in range(n):
        rf = refw.stochastic_round_bf16(x, refw._noise_bits16(idx, refw.weight_noise_stream(7, 3, s))).float()
        assert torch.all((rf == lo) | (rf == hi)), s
        acc += rf.double()
    gap = (hi - lo).double().abs()
    assert torch.all((acc / n - x.double()).abs() <= 5 * gap / (2 * math.sqrt(n)))


def test_stochastic_noise_differs_from_momentum_noise():
    from qmuon.ops import reference as ref

    assert refw.weight_noise_stream(0, 5, 1) != ref.noise_stream(0, 1, 5)
    assert len({refw.weight_noise_stream(0, k, s) for k in range(20) for s in range(20)}) == 400


def test_ecc8_invariants_over_every_bf16_mantissa():
    """FlashOptim's ECC invariants (their test_ecc_invariants.py), for fp32 values spread over every
    bf16 mantissa of 40 binades: (1) exact downcasts stay exact; (2) the corrected error is never larger
    than nearest rounding's, and smaller once that exceeds one code step (h / 127, h = ulp / 2);
    (3) it is at most half a code step (h / 254) plus the fp32 rounding of the decode."""
    g = torch.Generator().manual_seed(3)
    exps = torch.arange(-20, 20).repeat_interleave(128 * 16)
    mant = torch.arange(128).repeat_interleave(16).repeat(40)
    low = torch.randint(0, 1 << 16, (exps.numel(),), generator=g)
    low[::16] = 0  # exactly representable in bf16
    bits = ((exps + 127) << 23) | (mant << 16) | low
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.cat([x, -x])
    wb = x.to(torch.bfloat16)
    code = refw.ecc8_encode(x, wb)
    back = refw.ecc8_decode(wb, code).double()
    e0 = (wb.double() - x.double()).abs()
    e8 = (back - x.double()).abs()
    h = refw.ecc8_half_ulp(wb).double()
    assert torch.all(e8[e0 == 0] == 0)
    assert torch.all(e8 <= e0)
    big = e0 > h / 127
    assert big.float().mean() > 0.9 and torch.all(e8[big] < e0[big])
    assert torch.all(e8 <= h / 254 + x.double().abs() * 2 ** -24)


def test_ecc8_half_ulp_is_half_the_bf16_gap():
    w = torch.tensor([1.0, 1.5, -3.0, 1e-3, 0.0, 1e-40, 2.0 ** -126, 3e38]).to(torch.bfloat16)
    nxt = (w.view(torch.int16) + 1).view(torch.bfloat16)  # one step away from zero (sign-magnitude)
    gap = (nxt.double() - w.double()).abs()
    assert torch.equal(refw.ecc8_half_ulp(w).double(), gap / 2)


def test_nearest_loses_small_updates_stochastic_and_ecc8_keep_them():
    """1000 updates of +1e-4 to weights of 1.0 (ulp 2**-7): nearest never moves; ecc8 rounds its
    ~16-bit master each step (code step h / 127 = 2**-8 / 127 = 3.1e-5 here), so it is off by at most
    n * h / 254 (and by far less than nearest's 0.1); stochastic within 5 standard deviations of its
    random walk."""
    n = 1000
    p = {r: torch.ones(256, 4, dtype=torch.bfloat16) for r in RULES}
    st = {r: wa.weight_state_init(p[r], r) for r in RULES}
    u = torch.full((256, 4), 1e-4)
    for s in range(n):
        for r in RULES:
            wa.apply_update_(p[r], u, alpha=1.0, bf16_update=r, state=st[r], rng=(0, 1, s + 1, 0))
    assert torch.all(p["nearest"] == 1.0)
    master = refw.ecc8_decode(p["ecc8"], st["ecc8"]["weight_ecc"])
    assert (master - 1.1).abs().max() <= n * 2 ** -8 / 254
    assert torch.all(p["ecc8"] > 1.0)
    sd = math.sqrt(n) * 2 ** -7 / 2  # each step moves by 0 or one ulp: sd <= ulp / 2 per step
    assert (p["stochastic"].float().mean() - 1.1).abs() < 5 * sd / math.sqrt(1024)
    assert p["stochastic"].float().std() < 5 * sd


def test_decay_is_folded_into_the_one_rounding():
    """lr * wd = 1e-3 < 2**-9: a separate bf16 multiply by (1 - 1e-3) rounds back to w; folded into the
    update (nearest rounding of decay * w + alpha * u) it is not lost."""
    w = torch.full((8, 8), 1.0, dtype=torch.bfloat16) * torch.linspace(1, 2, 8).to(torch.bfloat16)
    separate = w.clone().mul_(1 - 1e-3)
    assert torch.equal(separate, w)
    folded = w.clone()
    u = torch.full((8, 8), 2e-3)
    wa.apply_update_(folded, u, alpha=-1.0, decay=1 - 1e-3, bf16_update="nearest")
    want = (w.float() * (1 - 1e-3) - 2e-3).to(torch.bfloat16)
    assert torch.equal(folded, want) and not torch.equal(folded, (w - 2e-3).to(torch.bfloat16))


def test_fp32_params_keep_torch_arithmetic():
    g = torch.Generator().manual_seed(4)
    w, u = torch.randn(17, 9, generator=g), torch.randn(17, 9, generator=g).to(torch.bfloat16)
    for r in RULES:
        a = w.clone()
        wa.apply_update_(a, u, alpha=-0.02, decay=0.999, bf16_update=r, state={}, rng=None)
        assert _same(a, w.clone().mul_(0.999).add_(u, alpha=-0.02))
        assert wa.weight_state_init(a, r) == {}


def test_blocks_draw_the_noise_of_the_whole_parameter():
    """Row chunks, a column block of a fused weight and a 3-D parameter: writing block by block with
    block_rng gives the bits of one write of the whole parameter (stochastic), and ecc8 views work."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(12, 40, generator=g).to(torch.bfloat16)
    u = torch.randn(12, 40, generator=g) * 1e-3
    rng = (3, 11, 7, 1000)
    whole = w.clone()
    wa.apply_update_(whole, u, alpha=-1.0, decay=0.99, bf16_update="stochastic", rng=rng)
    rows = w.clone()
    for a, b in ((0, 5), (5, 12)):
        wa.apply_update_(rows[a:b], u[a:b], alpha=-1.0, decay=0.99, bf16_update="stochastic",
                         rng=wa.block_rng(rng, rows, rows[a:b]))
    assert torch.equal(_bits(rows), _bits(whole))
    cols = w.clone()
    for a, b in ((0, 16), (16, 40)):
        blk = cols[:, a:b]
        wa.apply_update_(blk, u[:, a:b].contiguous(), alpha=-1.0, decay=0.99, bf16_update="stochastic",
                         rng=wa.block_rng(rng, cols, blk))
    assert torch.equal(_bits(cols), _bits(whole))
    w3 = w.clone().view(12, 5, 8)
    wa.apply_update_(w3, u.view(12, 5, 8), alpha=-1.0, decay=0.99, bf16_update="stochastic", rng=rng)
    assert torch.equal(_bits(w3.view(12, 40)), _bits(whole))
    e_whole, e_cols = wa.weight_state_init(w, "ecc8"), wa.weight_state_init(w, "ecc8")
    a1, a2 = w.clone(), w.clone()
    wa.apply_update_(a1, u, alpha=-1.0, decay=0.99, bf16_update="ecc8", state=e_whole)
    for a, b in ((0, 16), (16, 40)):
        wa.apply_update_(a2[:, a:b], u[:, a:b], alpha=-1.0, decay=0.99, bf16_update="ecc8",
                         state={k: v[:, a:b] for k, v in e_cols.items()})
    assert torch.equal(_bits(a1), _bits(a2)) and torch.equal(e_whole["weight_ecc"], e_cols["weight_ecc"])


def test_bad_arguments_are_named():
    w = torch.zeros(4, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16_update must be one of"):
        wa.apply_update_(w, torch.zeros(4, 4), alpha=1.0, bf16_update="fp8")
    with pytest.raises(ValueError, match="needs the parameter's weight_ecc"):
        wa.apply_update_(w, torch.zeros(4, 4), alpha=1.0, bf16_update="ecc8", state={})
    with pytest.raises(ValueError, match="needs rng"):
        wa.apply_update_(w, torch.zeros(4, 4), alpha=1.0, bf16_update="stochastic")
    with pytest.raises(ValueError, match="supports 'nearest' only"):
        wa.apply_update_(w.half(), torch.zeros(4, 4), alpha=1.0, bf16_update="ecc8", state={})
    with pytest.raises(ValueError, match="bf16_update must be one of"):
        qmuon.QMuon([nn.Parameter(torch.zeros(4, 4))], bf16_update="round")
    with pytest.raises(ValueError, match="bf16_update must be one of"):
        qmuon.QMuon([{"params": [nn.Parameter(torch.zeros(4))], "use_muon": False, "bf16_update": "x"}])


# --------------------------------------------------------------------------- kernels vs reference
@pytest.mark.parametrize("update_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernels_equal_reference_bit_for_bit(update_dtype):
    if not _compiled():
        pytest.skip("the compiled CPU kernels did not build here")
    g = torch.Generator().manual_seed(6)
    big = _weights(23, 700, seed=6)
    w = big[:, 50:650]  # padded rows (row stride 700): the kernels' strided layout
    u = (torch.randn(23, 600, generator=g) * 1e-2).to(update_dtype)
    before = dict(K.served)
    for stream in (-1, 0, 0xDEADBEEF):
        for index0, index_rs in ((0, 600), (2**33 - 5000, 700)):  # a high word in the index
            a, b = w.clone(), w.clone()
            a2 = big.clone()[:, 50:650]
            a2.copy_(w)
            torch.ops.qmuon.bf16_weight_update_(a2, u, -0.3, 0.999, stream, index0, index_rs)
            refw.bf16_weight_update_(b, u, -0.3, 0.999, stream, index0, index_rs)
            assert _same(a2, b), (stream, index0)
            del a
    e = torch.randint(-127, 128, (23, 700), generator=g, dtype=torch.int8)[:, 50:650]
    a, b, ea, eb = w.clone(), w.clone(), e.clone(), e.clone()
    ea_strided = torch.zeros(23, 700, dtype=torch.int8)[:, 50:650]
    ea_strided.copy_(e)
    torch.ops.qmuon.bf16_ecc8_weight_update_(a, ea_strided, u, -0.3, 0.999)
    refw.bf16_ecc8_weight_update_(b, eb, u, -0.3, 0.999)
    assert _same(a, b) and torch.equal(ea_strided, eb)
    after = K.served
    assert after[("bf16_weight_update_", "compiled")] - before.get(("bf16_weight_update_", "compiled"), 0) == 6
    assert after[("bf16_ecc8_weight_update_", "compiled")] - before.get(("bf16_ecc8_weight_update_", "compiled"), 0) == 1


@pytest.mark.parametrize("update_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernels_equal_reference_on_special_values(update_dtype):
    """The vectorized loops' edge cases, bit for bit: NaN / +-inf weights and updates, a write that
    overflows to inf, zeros and subnormals (the smallest ecc8 gap, 2**-134), every int8 code, and
    row lengths that leave a scalar remainder after the vector body (1, 7, 37 columns)."""
    if not _compiled():
        pytest.skip("the compiled CPU kernels did not build here")
    g = torch.Generator().manual_seed(11)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.38e38, -3.38e38, 0.0, -0.0, 1e-40,
                             -1e-45, 2.0 ** -126, 1.0, -1.5, 65504.0])
    for cols in (1, 7, 37, 300):
        rows = 9
        w = (torch.randn(rows, cols, generator=g) * torch.logspace(-38, 38, cols)[None, :]).to(torch.bfloat16)
        u = torch.randn(rows, cols, generator=g) * torch.logspace(-40, 4, cols)[None, :]
        n = min(specials.numel(), w.numel())
        w.view(-1)[:n] = specials[:n].to(torch.bfloat16)
        u.view(-1)[-n:] = specials[:n]  # specials meet other weights in the update, too
        u = u.to(update_dtype)
        e = torch.randint(-127, 128, (rows, cols), generator=g, dtype=torch.int8)
        for alpha, decay in ((-0.3, 0.999), (1e30, 1.0)):  # the second overflows large weights to inf
            for stream in (-1, 0x1234567):
                a, b = w.clone(), w.clone()
                torch.ops.qmuon.bf16_weight_update_(a, u, alpha, decay, stream, 2**32 - 3, cols)
                refw.bf16_weight_update_(b, u, alpha, decay, stream, 2**32 - 3, cols)
                assert _same(a, b), (cols, alpha, stream)
            a, b, ea, eb = w.clone(), w.clone(), e.clone(), e.clone()
            torch.ops.qmuon.bf16_ecc8_weight_update_(a, ea, u, alpha, decay)
            refw.bf16_ecc8_weight_update_(b, eb, u, alpha, decay)
            assert _same(a, b) and torch.equal(ea, eb), (cols, alpha)


def test_ops_run_the_reference_on_layouts_the_kernels_lack():
    w = torch.randn(8, 6).to(torch.bfloat16).t()  # column stride 8
    u = torch.randn(6, 8)
    before = K.served[("bf16_weight_update_", "reference")]
    a, b = w.clone(), w.clone()
    torch.ops.qmuon.bf16_weight_update_(w, u, -0.1, 1.0, 5, 0, 8)
    refw.bf16_weight_update_(b, u, -0.1, 1.0, 5, 0, 8)
    assert _same(w, b) and K.served[("bf16_weight_update_", "reference")] == before + (1 if _compiled() else 0)
    del a


@pytest.mark.cuda
@pytest.mark.parametrize("update_dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_equal_reference_bit_for_bit(update_dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from qmuon.ops import _extension

    if not _extension.status().cuda:
        pytest.skip(f"no CUDA kernels: {_extension.status().reason}")
    g = torch.Generator().manual_seed(7)
    w = _weights(64, 1000, seed=7)
    u = (torch.randn(64, 1000, generator=g) * 1e-2).to(update_dtype)
    e = torch.randint(-127, 128, (64, 1000), generator=g, dtype=torch.int8)
    for stream in (-1, 12345):
        a = w.cuda()
        torch.ops.qmuon.bf16_weight_update_(a, u.cuda(), -0.3, 0.999, stream, 2**32 - 100, 1000)
        b = w.clone()
        refw.bf16_weight_update_(b, u, -0.3, 0.999, stream, 2**32 - 100, 1000)
        assert _same(a.cpu(), b)
    a, ea = w.cuda(), e.cuda()
    torch.ops.qmuon.bf16_ecc8_weight_update_(a, ea, u.cuda(), -0.3, 0.999)
    b, eb = w.clone(), e.clone()
    refw.bf16_ecc8_weight_update_(b, eb, u, -0.3, 0.999)
    assert _same(a.cpu(), b) and torch.equal(ea.cpu(), eb)
    # and the CUDA reference (torch ops on the device) gives the same bits
    c, ec = w.cuda(), e.cuda()
    refw.bf16_ecc8_weight_update_(c, ec, u.cuda(), -0.3, 0.999)
    assert _same(c.cpu(), b) and torch.equal(ec.cpu(), eb)


# --------------------------------------------------------------------------- QMuon with bf16 models
class _Tiny(nn.Module):
    def __init__(self, dtype=torch.bfloat16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(50, 32)
        self.l1 = nn.Linear(32, 64, bias=True)
        self.qkv = nn.Linear(32, 96, bias=False)  # fused parts (32, 32, 32)
        self.l2 = nn.Linear(64, 32, bias=False)
        self.head = nn.Linear(32, 50, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        self.to(dtype)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.qkv(h)[..., :32]
        return self.head(self.l2(torch.relu(self.l1(h))))


def _opt(model, **kw):
    return qmuon.build_optimizer(model, lr=0.02, adamw_lr=3e-3, verbose=False, routing={"fused_parts": {r"qkv\.weight$": (32, 32, 32)}}, **kw)


def _batch(s: int):
    g = torch.Generator().manual_seed(100 + s)
    x = torch.randint(0, 50, (8, 12), generator=g)
    return x, (7 * x + 3) % 50  # a per-token map this model (no attention) can learn


def _train(model, opt, steps, nan_at=()):
    losses = []
    for s in steps:
        x, y = _batch(s)
        loss = nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        if s in nan_at:
            model.l1.weight.grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _state_copy(opt):
    return {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}


@pytest.mark.parametrize("rule", RULES)
def test_qmuon_trains_bf16_models_with_each_rule(rule):
    model = _Tiny()
    opt = _opt(model, bf16_update=rule)
    losses = _train(model, opt, range(30))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert sum(losses[-5:]) < sum(losses[:5]) * 0.9
    ecc = {n: opt.state[p].get("weight_ecc") for n, p in model.named_parameters()}
    if rule == "ecc8":
        assert all(e is not None and e.dtype == torch.int8 and e.shape == p.shape
                   for (n, p), e in zip(model.named_parameters(), ecc.values()))
        assert all(e.abs().sum() > 0 for e in ecc.values())  # both groups write their codes
        assert {g["bf16_update"] for g in opt.param_groups} == {"ecc8"}
    else:
        assert all(e is None for e in ecc.values())


def test_bf16_rules_track_the_fp32_master_run():
    """Same init (bf16-representable), same batches: after 40 steps the ecc8 weights are closer to
    the fp32-master run's than stochastic's, and those closer than nearest's (relative L2 over all
    parameters); nearest stalls the AdamW parameters at lr 3e-3 on weights ~0.1."""
    ref = _Tiny(torch.float32)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    opt = _opt(ref)
    _train(ref, opt, range(40))
    target = torch.cat([p.detach().flatten() for p in ref.parameters()])
    err = {}
    for rule in RULES:
        m = _Tiny()
        o = _opt(m, bf16_update=rule)
        _train(m, o, range(40))
        w = torch.cat([o.master_weight(p).flatten() for p in m.parameters()])
        err[rule] = ((w - target).norm() / target.norm()).item()
    assert err["ecc8"] < err["stochastic"] < err["nearest"], err


@pytest.mark.parametrize("rule", ["stochastic", "ecc8"])
def test_resume_is_bit_exact(rule):
    model = _Tiny()
    opt = _opt(model, bf16_update=rule)
    _train(model, opt, range(5))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, range(5, 10))
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    again = _Tiny()
    again.load_state_dict(ck["model"])
    opt2 = _opt(again, bf16_update=rule)
    opt2.load_state_dict(ck["opt"])
    if rule == "ecc8":
        assert all(st["weight_ecc"].dtype == torch.int8 for st in opt2.state.values())
    _train(again, opt2, range(5, 10))
    for (n, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(_bits(p.detach()), _bits(q.detach())), n
    for p, q in zip(model.parameters(), again.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[q][k]), k


def test_checkpoint_validation_names_the_problem():
    model = _Tiny()
    opt = _opt(model, bf16_update="ecc8")
    _train(model, opt, range(2))
    sd = opt.state_dict()

    def load(mutate):
        bad = copy.deepcopy(sd)
        mutate(bad["state"])
        o = _opt(_Tiny(), bf16_update="ecc8")
        o.load_state_dict(bad)
        return o

    ids = list(sd["state"])
    for pid in (ids[0], ids[-1]):  # a Muon parameter and an AdamW one
        with pytest.raises(qstate.StateFormatError, match="no weight_ecc; the checkpoint is incomplete"):
            load(lambda st: st[pid].pop("weight_ecc"))
        with pytest.raises(qstate.StateFormatError, match="weight_ecc must be int8"):
            load(lambda st: st[pid].__setitem__("weight_ecc", st[pid]["weight_ecc"].to(torch.int16)))
        with pytest.raises(qstate.StateFormatError, match="weight_ecc has shape"):
            load(lambda st: st[pid].__setitem__("weight_ecc", st[pid]["weight_ecc"][:1]))
    # a changed rule is allowed: codes dropped (ecc8 -> stochastic) or started at zero (stochastic -> ecc8)
    st_opt = _opt(model, bf16_update="stochastic")
    st_opt.load_state_dict(copy.deepcopy(sd))
    _train(model, st_opt, range(2, 3))
    assert all("weight_ecc" not in st for st in st_opt.state.values())
    back = _opt(model, bf16_update="ecc8")
    back.load_state_dict(st_opt.state_dict())
    _train(model, back, range(3, 4))
    assert all(st["weight_ecc"].dtype == torch.int8 for st in back.state.values())


@pytest.mark.parametrize("rule", ["stochastic", "ecc8"])
def test_nan_gradient_leaves_weight_and_codes_untouched(rule):
    model = _Tiny()
    opt = _opt(model, bf16_update=rule)
    _train(model, opt, range(3))
    w0 = model.l1.weight.detach().clone()
    st0 = {k: v.clone() for k, v in opt.state[model.l1.weight].items()}
    _train(model, opt, [3], nan_at={3})
    assert opt.nonfinite_skips == 1
    assert torch.equal(_bits(model.l1.weight.detach()), _bits(w0))
    for k, v in st0.items():
        assert torch.equal(opt.state[model.l1.weight][k], v), k


def test_stall_report_names_the_frozen_parameters():
    """Weights ~0.1 and AdamW steps of ~3e-5 (< ulp/2 = 2**-12 for |w| in [1/16, 1/8)): the AdamW
    parameters are reported as stalled; with Muon's larger steps the Muon matrices much less."""
    model = _Tiny()
    opt = qmuon.build_optimizer(model, lr=0.02, adamw_lr=3e-5, verbose=False, bf16_update="stochastic")
    x, y = _batch(0)
    nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).backward()
    rows = qmuon.optim.bf16_stall_report(opt, model.named_parameters())
    share = {r["param"]: r["share"] for r in rows}
    assert set(share) == {n for n, _ in model.named_parameters()}
    assert share["emb.weight"] > 0.5 and share["head.weight"] > 0.5
    assert share["l2.weight"] < share["head.weight"]
    fp32 = _Tiny(torch.float32)
    o32 = qmuon.build_optimizer(fp32, verbose=False)
    nn.functional.cross_entropy(fp32(x).flatten(0, 1), y.flatten()).backward()
    assert qmuon.optim.bf16_stall_report(o32, fp32.named_parameters()) == []


def test_weight_state_bytes_are_one_per_parameter():
    model = _Tiny()
    for rule, per in (("stochastic", 0), ("ecc8", 1)):
        opt = _opt(model, bf16_update=rule)
        _train(model, opt, range(1))
        n = sum(p.numel() for p in model.parameters())
        ecc = sum(st["weight_ecc"].numel() * st["weight_ecc"].element_size() for st in opt.state.values()
                  if "weight_ecc" in st)
        assert ecc == per * n


def test_strategy_and_config_check_bf16_update():
    from qmuon_lightning.strategies import QMuonFSDPStrategy

    with pytest.raises(ValueError, match="bf16_update must be one of"):
        QMuonFSDPStrategy(optimizer_kwargs={"bf16_update": "stochastic-ish"})
    QMuonFSDPStrategy(optimizer_kwargs={"bf16_update": "ecc8"})
    assert qmuon.QMuonConfig().bf16_update == "stochastic"
    assert qmuon.QMuonConfig.from_kwargs(bf16_update="ecc8").adamw_group_defaults()["bf16_update"] == "ecc8"


def test_stall_monitor_in_a_trainer():
    import lightning as L

    from qmuon_lightning.callbacks import BF16StallMonitor

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _Tiny()

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x).float().flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return qmuon.build_optimizer(self.net, lr=0.02, adamw_lr=3e-5, verbose=False)

    xs = torch.stack([_batch(s)[0] for s in range(4)]).flatten(0, 1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, (7 * xs + 3) % 50), batch_size=8)
    mon = BF16StallMonitor(every_n_steps=2, warn_above=0.5)
    tr = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, callbacks=[mon])
    with pytest.warns(UserWarning, match="BF16StallMonitor: under nearest rounding these bf16 weights"):
        tr.fit(M(), data)
    shares = {r["param"]: r["share"] for r in mon.last_report}
    assert shares["net.emb.weight"] > 0.5 and len(shares) == 6


# --------------------------------------------------------------------------- sharded: FSDP2 + DCP + reshard
class _ShardNet(nn.Module):
    """bf16 parameters with awkward shapes for 2 ranks: uneven rows, a rank without rows, fused
    parts cut by the shard boundary, a 4-D weight, an AdamW embedding and gain."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def w(*shape):
            return nn.Parameter((torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).to(torch.bfloat16))

        self.a = w(3, 40)
        self.b = w(5, 300)
        self.c = w(1, 40)  # rank 1 owns nothing
        self.qkv = w(8, 40)  # parts (3, 3, 2)
        self.conv = w(6, 2, 2, 3)
        self.emb = w(10, 40)  # AdamW
        self.gain = nn.Parameter(torch.ones(40, dtype=torch.bfloat16))  # AdamW, 1-D


def _shard_groups(net: nn.Module) -> list[dict]:
    return [{"params": [net.a, net.b, net.c, net.conv], "param_names": ["a", "b", "c", "conv"]},
            {"params": [net.qkv], "parts": (3, 3, 2), "param_names": ["qkv"]},
            {"params": [net.emb, net.gain], "use_muon": False, "param_names": ["emb", "gain"]}]


def _shard_grads(net: nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {n: (torch.randn(p.shape, generator=g) * 1e-2).to(torch.bfloat16) for n, p in net.named_parameters()}


SHARD_STEPS, SHARD_CONT = 3, 2
SHARD_KW = dict(lr=0.02, weight_decay=0.1, adamw_lr=1e-2, newton_schulz={"comm_carrier": "bf16", "comm_return": "bf16"})


def _shard_opt(net, rule):
    return qmuon.QMuon(_shard_groups(net), bf16_update=rule, **SHARD_KW)


def _worker_bf16(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from _dist import local_copy, step_side_by_side
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for rule in ("stochastic", "ecc8"):
        ref, net = _ShardNet(), _ShardNet()
        fully_shard(net, mesh=mesh)
        opt_ref, opt = _shard_opt(ref, rule), _shard_opt(net, rule)
        step_side_by_side(ref, opt_ref, net, opt, _shard_grads, SHARD_STEPS)
        res = {"params": {n: local_copy(p) for n, p in net.named_parameters()},
               "ref_params": {n: p.detach().clone() for n, p in ref.named_parameters()},
               "state": {n: {k: local_copy(v) for k, v in opt.state[p].items()} for n, p in net.named_parameters()},
               "ref_state": {n: {k: v.clone() for k, v in opt_ref.state[p].items()} for n, p in ref.named_parameters()},
               "ecc_is_dtensor": [type(opt.state[p].get("weight_ecc")).__name__ for p in net.parameters()]}
        msd, osd = get_state_dict(net, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, rule))
        for s in range(SHARD_STEPS, SHARD_STEPS + SHARD_CONT):  # continue
            from _dist import set_grads

            set_grads(net, _shard_grads(ref, s), True)
            opt.step()
        res["cont"] = {n: local_copy(p) for n, p in net.named_parameters()}
        # same-world resume from DCP
        net2 = _ShardNet()
        fully_shard(net2, mesh=mesh)
        opt2 = _shard_opt(net2, rule)
        msd, osd = get_state_dict(net2, opt2)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=os.path.join(root, rule))
        set_state_dict(net2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        for s in range(SHARD_STEPS, SHARD_STEPS + SHARD_CONT):
            from _dist import set_grads

            set_grads(net2, _shard_grads(ref, s), True)
            opt2.step()
        res["resumed"] = {n: local_copy(p) for n, p in net2.named_parameters()}
        # 1 -> 2: the single-process checkpoint (saved by the pytest process) resumed on 2 ranks
        net3 = _ShardNet()
        fully_shard(net3, mesh=mesh)
        opt3 = _shard_opt(net3, rule)
        msd, osd = get_state_dict(net3, opt3)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=os.path.join(root, "single_" + rule))
        set_state_dict(net3, opt3, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        for s in range(SHARD_STEPS, SHARD_STEPS + SHARD_CONT):
            from _dist import set_grads

            set_grads(net3, _shard_grads(ref, s), True)
            opt3.step()
        res["from_single"] = {n: local_copy(p) for n, p in net3.named_parameters()}
        out[rule] = res
    return out


def _merge(per_rank: list):
    first = per_rank[0]
    if isinstance(first, dict):
        return {k: _merge([r[k] for r in per_rank]) for k in first}
    if isinstance(first, torch.Tensor) and first.ndim >= 1:
        return torch.cat(per_rank)
    return first


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    from _dist import run_workers

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = str(tmp_path_factory.mktemp("bf16dcp"))
    single = {}
    for rule in ("stochastic", "ecc8"):  # the single-process side of the 1 -> 2 reshard
        net = _ShardNet()
        opt = _shard_opt(net, rule)
        for s in range(SHARD_STEPS + SHARD_CONT):
            if s == SHARD_STEPS:
                msd, osd = get_state_dict(net, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "single_" + rule), no_dist=True)
            for n, p in net.named_parameters():
                p.grad = _shard_grads(net, s)[n]
            opt.step()
        single[rule] = {n: p.detach().clone() for n, p in net.named_parameters()}
    two = run_workers(_worker_bf16, 2, timeout=300, root=root)
    merged = {}
    for rule in two[0]:
        per = [t[rule] for t in two]
        merged[rule] = {k: (_merge([p[k] for p in per]) if k not in ("ref_params", "ref_state") else per[0][k])
                        for k in per[0]}
    for rule in merged:
        merged[rule]["single_cont"] = single[rule]
    return root, merged


@pytest.mark.slow
@pytest.mark.ns_bf16  # bf16 carriers: lossless only against bf16 Newton-Schulz
@pytest.mark.parametrize("rule", ["stochastic", "ecc8"])
def test_sharded_equals_single_process_bit_exact(sharded_runs, rule):
    """FSDP2 Shard(0) on 2 ranks (bf16 carriers) vs one process on the same gradients: the same bf16
    weights and the same state bit for bit (the stochastic bits are keyed by the global element, the
    ecc8 codes are rows of the weight and live as Shard(0) DTensors)."""
    _, runs = sharded_runs
    r = runs[rule]
    for n, p in r["ref_params"].items():
        assert torch.equal(_bits(r["params"][n]), _bits(p)), n
    for n, st in r["ref_state"].items():
        for k, v in st.items():
            assert torch.equal(r["state"][n][k], v), (n, k)
    if rule == "ecc8":
        assert set(r["ecc_is_dtensor"]) == {"DTensor"}
        assert all("weight_ecc" in st for st in r["state"].values())
    else:
        assert all("weight_ecc" not in st for st in r["state"].values())


@pytest.mark.slow
@pytest.mark.ns_bf16  # bf16 carriers: lossless only against bf16 Newton-Schulz
@pytest.mark.parametrize("rule", ["stochastic", "ecc8"])
def test_dcp_resume_same_world_and_reshard_2_to_1_and_1_to_2(sharded_runs, rule):
    """The 2-rank DCP checkpoint resumes on 2 ranks bit for bit, and on 1 process (DCP reshards the
    weights and the ecc8 codes) with the same continuation bit for bit; a 1-process checkpoint
    resumes on 2 ranks with the 1-process continuation bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    root, runs = sharded_runs
    r = runs[rule]
    for n, p in r["cont"].items():
        assert torch.equal(_bits(r["resumed"][n]), _bits(p)), n
        # 1 -> 2: the single-process checkpoint continued on 2 ranks == continued on 1
        assert torch.equal(_bits(r["from_single"][n]), _bits(r["single_cont"][n])), n
    net = _ShardNet()
    opt = _shard_opt(net, rule)
    msd, osd = get_state_dict(net, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=os.path.join(root, rule), no_dist=True)
    set_state_dict(net, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    if rule == "ecc8":
        for n, p in net.named_parameters():
            assert torch.equal(opt.state[p]["weight_ecc"], r["state"][n]["weight_ecc"]), n
    for s in range(SHARD_STEPS, SHARD_STEPS + SHARD_CONT):
        for n, p in net.named_parameters():
            p.grad = _shard_grads(net, s)[n]
        opt.step()
    for n, p in net.named_parameters():
        assert torch.equal(_bits(p.detach()), _bits(r["cont"][n])), n


# --------------------------------------------------------------------------- Accelerate
@pytest.mark.parametrize("rule", ["stochastic", "ecc8"])
def test_accelerate_bf16_model_resumes_bit_exact(tmp_path, rule):
    """``prepare_qmuon`` on a model cast to bf16 (no mixed precision: the weights are the only copy),
    ``save_state`` / ``load_state`` mid-run: the resumed run equals the uninterrupted one bit for bit,
    and optimizer.bin keeps the ecc8 codes as int8."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from test_accelerate import snapshot, tiny_model, train

    from qmuon.integrations.accelerate import prepare_qmuon

    def run(seed, load=None, save=None):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator(cpu=True)
        model, opt = prepare_qmuon(acc, tiny_model(seed).to(torch.bfloat16), bf16_update=rule, verbose=False)
        if load:
            acc.load_state(load)
        else:
            train(acc, model, opt, range(3))
            acc.save_state(save)
        losses = train(acc, model, opt, range(3, 6))
        return snapshot(model, opt), losses

    ck = str(tmp_path / "ck")
    a, la = run(0, save=ck)
    b, lb = run(1, load=ck)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    assert la == lb
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(_bits(a[k]), _bits(b[k])), k
    assert all(v.dtype == torch.bfloat16 for k, v in a.items() if k.startswith("param/"))
    sd = torch.load(tmp_path / "ck" / "optimizer.bin", weights_only=True)
    ecc = [st["weight_ecc"] for st in sd["state"].values() if "weight_ecc" in st]
    assert (len(ecc) == len(sd["state"]) and all(e.dtype == torch.int8 for e in ecc)) if rule == "ecc8" else not ecc


# --------------------------------------------------------------------------- Trainer(strategy="qmuon_fsdp", precision="bf16-true")
def _lightning_scenario(out):
    """2 CPU processes: one epoch (3 steps per rank) and a sharded checkpoint; an uninterrupted 2-epoch
    run; a third Trainer resumes the checkpoint for the second epoch (Lightning resumes exactly at
    epoch boundaries). Reports dtypes, the ecc8 state and both 2-epoch results."""
    from datetime import timedelta

    import lightning as L
    import torch.distributed as dist

    from qmuon_lightning.models import DecoderLM
    from qmuon_lightning.strategies import QMuonFSDPStrategy

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = DecoderLM(vocab_size=32, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, mlp_hidden=64)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.model.loss(x, y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    g = torch.Generator().manual_seed(5)
    tok = torch.randint(0, 32, (24, 17), generator=g)  # 3 batches of 4 per rank and epoch
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tok[:, :-1], tok[:, 1:]), batch_size=4)

    def trainer(epochs):
        strategy = QMuonFSDPStrategy(optimizer_kwargs={"bf16_update": "ecc8"}, timeout=timedelta(seconds=120))
        return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-true", max_epochs=epochs,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0, default_root_dir=str(out))

    res: dict = {}
    tr = trainer(1)
    m = LM()
    tr.fit(m, data)
    tr.save_checkpoint(str(out / "ck"))
    opt = tr.optimizers[0]
    res["rank"] = dist.get_rank()
    res["optimizer"] = type(opt).__name__
    res["param_dtypes"] = sorted({str(p.dtype) for p in m.parameters()})
    res["all_dtensor"] = all(type(p).__name__ == "DTensor" for p in m.parameters())
    res["ecc"] = sorted({(type(st["weight_ecc"]).__name__, str(st["weight_ecc"].dtype))
                         for st in opt.state.values() if "weight_ecc" in st})
    res["ecc_entries"] = sum("weight_ecc" in st for st in opt.state.values())
    res["state_entries"] = len(opt.state)
    res["rules"] = sorted({g_["bf16_update"] for g_ in opt.param_groups})
    m2 = LM()
    tr2 = trainer(2)
    tr2.fit(m2, data)  # uninterrupted
    res["cont"] = {n: p.to_local().float().tolist() for n, p in m2.named_parameters()}
    m3 = LM()
    tr3 = trainer(2)
    tr3.fit(m3, data, ckpt_path=str(out / "ck"))
    res["resumed"] = {n: p.to_local().float().tolist() for n, p in m3.named_parameters()}
    res["global_steps"] = [tr.global_step, tr2.global_step, tr3.global_step]
    return res


@pytest.mark.slow
def test_qmuon_fsdp_strategy_with_bf16_true(tmp_path):
    import json
    import sys
    from pathlib import Path

    from _dist import run_launcher, subprocess_env

    log = run_launcher([sys.executable, str(Path(__file__).resolve()), "fsdp", str(tmp_path)], timeout=400,
                       env=subprocess_env(PYTHONWARNINGS="ignore"), cwd=tmp_path, what="bf16-true qmuon_fsdp scenario")
    results = sorted(tmp_path.glob("bf16w_rank*.json"))
    if len(results) != 2:
        pytest.fail(f"scenario wrote {len(results)} rank results, expected 2; log tail:\n{log[-8000:]}")
    for r in (json.loads(p.read_text()) for p in results):
        assert r["optimizer"] == "QMuon" and r["rules"] == ["ecc8"]
        assert r["param_dtypes"] == ["torch.bfloat16"] and r["all_dtensor"]
        assert r["ecc"] == [["DTensor", "torch.int8"]] and r["ecc_entries"] == r["state_entries"] > 0
        assert r["global_steps"] == [3, 6, 6]
        assert r["cont"] == r["resumed"]  # resumed from the sharded checkpoint: bit for bit (bf16 -> fp32 is exact)


if __name__ == "__main__":
    from _helpers import fsdp_scenario_main

    fsdp_scenario_main(_lightning_scenario, "bf16w")
