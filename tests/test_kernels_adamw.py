"""The quantized AdamW kernel (``torch.ops.qmuon.adamw_q_update_``): compiled CPU / CUDA kernels
against the pure-PyTorch reference (``ops/reference_adamw.py``), bit for bit (both compute every
fp32 operation separately rounded, in the same order: csrc/qmuon/adamw_math.h), and the reference
against a float64 evaluation of the same AdamW step (tolerance: one quantization step of the codes,
since the state is re-encoded; the emitted update uses the unquantized new moments and matches
float64 to fp32 rounding)."""

from __future__ import annotations

import itertools

import pytest
import torch

from qmuon_lightning.ops import _kernels as K
from qmuon_lightning.ops import reference_adamw as refa

KINDS = [(refa.M8, refa.V8), (refa.M4, refa.V4), (refa.M8, refa.V4)]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (3, 7), (5, 300), (17, 257), (2, 1024)]


def _state(rows: int, cols: int, kinds: tuple[int, int], bs: int, *, seed: int, device="cpu"):
    """A realistic state: encoded moments of a few gradient steps (rows of very different scales)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.empty(rows, 1).uniform_(-6.0, 0.0, generator=g))
    m = torch.randn(rows, cols, generator=g) * scale * 0.1
    v = (torch.randn(rows, cols, generator=g) * scale) ** 2 + m * m
    v[:, ::5] = 0.0  # zeros inside blocks (fresh coordinates)
    if rows > 2:
        m[1], v[1] = 0.0, 0.0  # a whole untouched row (an embedding row no token hit)
    mc, ms = refa.encode_moment(m, kinds[0], bs)
    vc, vs = refa.encode_moment(v, kinds[1], bs)
    return [t.to(device) for t in (mc, ms, vc, vs)]


def _grad(rows: int, cols: int, dtype, *, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(rows, cols, generator=g) * torch.exp(torch.empty(rows, 1).uniform_(-5.0, 0.0, generator=g))
    if rows > 2:
        x[1] = 0.0
    return x.to(dtype).to(device)


HYPER = dict(beta1=0.9, beta2=0.95, eps=1e-8, neg_step_size=-1e-3 / (1 - 0.9**3),
             bias_correction2_sqrt=(1 - 0.95**3) ** 0.5)


def _run(op, grad, state, kinds, bs, hyper=HYPER):
    mc, ms, vc, vs = state
    upd = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
    op(grad, mc, ms, vc, vs, upd, hyper["beta1"], hyper["beta2"], hyper["eps"], hyper["neg_step_size"],
       hyper["bias_correction2_sqrt"], kinds[0], kinds[1], bs)
    return [mc, ms, vc, vs, upd]


def _assert_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    assert torch.equal(a, b), f"{what}: {int((a != b).sum())} of {a.numel()} differ"


def _kernel_vs_reference(device: str, rows: int, cols: int, kinds, bs: int, gdt, seed: int) -> None:
    state = _state(rows, cols, kinds, bs, seed=seed, device=device)
    grad = _grad(rows, cols, gdt, seed=seed, device=device)
    ref_state = [t.clone() for t in state]
    before = K.served[("adamw_q_update_", "compiled")]
    out = _run(torch.ops.qmuon.adamw_q_update_, grad, [t.clone() for t in state], kinds, bs)
    assert K.served[("adamw_q_update_", "compiled")] == before + 1, "the compiled kernel did not run"
    want = _run(refa.adamw_q_update_, grad.cpu(), [t.cpu() for t in ref_state], kinds, bs)
    for a, b, what in zip(out, want, ("m codes", "m scale", "v codes", "v scale", "update")):
        _assert_bits(a.cpu(), b, f"{what} {device} {rows}x{cols} kinds={kinds} bs={bs} {gdt}")


@pytest.mark.parametrize("kinds", KINDS)
@pytest.mark.parametrize("gdt", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("bs", [32, 128, 256])
def test_cpu_kernel_matches_reference(ext, kinds, gdt, bs):
    for i, (rows, cols) in enumerate(SHAPES):
        _kernel_vs_reference("cpu", rows, cols, kinds, bs, gdt, seed=i)


def test_cpu_kernel_row_slices_and_repeated_steps(ext):
    """Row slices of a larger state (what the chunked step passes) and several steps in a row."""
    rows, cols, bs, kinds = 40, 333, 128, (refa.M4, refa.V4)
    full_k = _state(rows, cols, kinds, bs, seed=3)
    full_r = [t.clone() for t in full_k]
    for step in range(3):
        grad = _grad(rows, cols, torch.float32, seed=10 + step)
        for r0, r1 in ((0, 13), (13, 40)):
            _run(torch.ops.qmuon.adamw_q_update_, grad[r0:r1], [t[r0:r1] for t in full_k], kinds, bs)
            _run(refa.adamw_q_update_, grad[r0:r1], [t[r0:r1] for t in full_r], kinds, bs)
    for a, b, what in zip(full_k, full_r, ("m codes", "m scale", "v codes", "v scale")):
        _assert_bits(a, b, what)


def test_opcheck_adamw_q_update(ext):
    state = _state(6, 100, (refa.M8, refa.V8), 32, seed=1)
    grad = _grad(6, 100, torch.bfloat16, seed=1)
    upd = torch.empty(6, 100)
    torch.library.opcheck(torch.ops.qmuon.adamw_q_update_.default,
                          (grad, *state, upd, 0.9, 0.95, 1e-8, -1e-3, 0.5, refa.M8, refa.V8, 32))


def test_reference_matches_float64_adamw():
    """The emitted update is AdamW's step from the decoded state (float64 check, fp32 rounding), and
    the re-encoded state decodes to the new moments within one code step of the block's scale."""
    rows, cols, bs = 9, 200, 64
    for kinds in KINDS:
        mc, ms, vc, vs = _state(rows, cols, kinds, bs, seed=7)
        m0 = refa.decode_moment(mc, ms, kinds[0], bs, cols).double()
        v0 = refa.decode_moment(vc, vs, kinds[1], bs, cols).double()
        g = _grad(rows, cols, torch.float32, seed=7).double()
        out = _run(refa.adamw_q_update_, g.float(), [mc, ms, vc, vs], kinds, bs)
        m1 = 0.9 * m0 + 0.1 * g
        v1 = 0.95 * v0 + 0.05 * g * g
        want = HYPER["neg_step_size"] * m1 / (v1.sqrt() / HYPER["bias_correction2_sqrt"] + 1e-8)
        # fp32 rounding of m = lerp(m0, g) can cancel: absolute tolerance 1e-5 of the largest step
        torch.testing.assert_close(out[4].double(), want, rtol=2e-5, atol=1e-5 * float(want.abs().max()))
        m_dec = refa.decode_moment(out[0], out[1], kinds[0], bs, cols).double()
        blockmax = out[1].repeat_interleave(bs, 1)[:, :cols].double()
        # softsign compander: step of u is at most 2 / levels (slope of the inverse is <= 2)
        levels = 127 if kinds[0] == refa.M8 else 7
        assert ((m_dec - m1).abs() <= blockmax * (1.0 / levels) + 1e-12).all()


def test_second_moment_has_no_zero_code():
    """A tiny v next to a large one decodes to a positive value (never 0, so 1 / sqrt(v) stays finite);
    a block that is all zeros decodes to exact zeros."""
    v = torch.tensor([[1.0, 1e-12, 0.0, 1e-6] + [0.0] * 4, [0.0] * 8])
    for kind in (refa.V8, refa.V4):
        c, s = refa.encode_moment(v, kind, 4)
        d = refa.decode_moment(c, s, kind, 4, 8)
        assert (d[0, :4] > 0).all(), kind
        assert torch.equal(d[1], torch.zeros(8))
        assert d[0, 0] == 1.0  # the block max is exact


@pytest.mark.cuda
@pytest.mark.parametrize("kinds", KINDS)
@pytest.mark.parametrize("gdt", GRAD_DTYPES, ids=str)
def test_cuda_kernel_matches_reference(cuda_ext, kinds, gdt):
    for (i, (rows, cols)), bs in itertools.product(enumerate(SHAPES), (32, 256)):
        _kernel_vs_reference("cuda", rows, cols, kinds, bs, gdt, seed=i)


@pytest.mark.cuda
def test_cuda_optimizer_step_matches_cpu(cuda_ext):
    """QMuon's int8 / int4 AdamW step on CUDA equals the CPU step bit for bit (same kernel maths)."""
    from qmuon_lightning import QMuon

    for fam in ("int8", "int4"):
        params = {}
        for dev in ("cpu", "cuda"):
            torch.manual_seed(0)
            p = torch.nn.Parameter(torch.randn(64, 96, device=dev))
            opt = QMuon([{"params": [p], "use_muon": False}], adamw_state_format=fam)
            for s in range(3):
                p.grad = _grad(64, 96, torch.float32, seed=s, device=dev)
                opt.step()
            params[dev] = p.detach().cpu()
        _assert_bits(params["cuda"], params["cpu"], fam)
