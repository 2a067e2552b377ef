"""The row-shard ops of e0m3 and grasp4 (FSDP2 ``Shard(0)``): ``e0m3_momentum_amax_multi``,
``e0m3_momentum_update_with_scale_multi_`` and ``grid_quantize4_with_scale``.

A row shard must encode with its *matrix's* scale (a MAX all-reduce of the shards' amax), so these
ops split the unsharded ones at that point. Contracts, checked for the compiled kernels (CPU here,
CUDA in the ``cuda`` tests) and the references alike:

* kernel == reference bit for bit (codes, UE4M3 scales, tensor scales, NS input, amax; the amax's
  NaN is the single pattern 0x7FC00000), block sums of squares within ``sumsq_rtol`` (summation
  order, see _helpers.sumsq_rtol), as for every other 4-bit op;
* amax -> MAX over shards -> scale -> ``..._with_scale`` on every row shard gives the bytes of the
  unsharded op on the whole matrix, bit for bit (row offsets and stochastic streams included: the
  noise is indexed by the row of the unsharded matrix).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.library import opcheck

from _helpers import assert_bits_equal, assert_sumsq_close, make_grad, momentum, nan_sums, noise_or_none
from qmuon.ops import _kernels, _library
from qmuon.ops import reference as ref
from qmuon.ops import reference_4bit as ref4

SHAPES = [(1, 1), (3, 5), (2, 17), (37, 300), (65, 513)]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STREAM = ref.noise_stream(99, 4, 2)

AMAX = torch.ops.qmuon.e0m3_momentum_amax_multi
WITH_SCALE = torch.ops.qmuon.e0m3_momentum_update_with_scale_multi_
UPDATE = torch.ops.qmuon.e0m3_momentum_update_multi_
GRID = torch.ops.qmuon.grid_quantize4_with_scale


def e0m3_state(rows, cols, seed=0, device="cpu"):
    return [t.to(device) for t in ref4.e0m3_quantize(momentum(rows, cols, seed))]


def _reference(name):
    """The op's pure-PyTorch implementation (what the guarded kernel falls back on)."""
    return _library.OPS[name].reference


# ---------------------------------------------------------------------------------------------
# references: the Python versions in qmuon.distributed, the composition
# ---------------------------------------------------------------------------------------------
# The pure-PyTorch versions these ops replace, as they stood in distributed/grasp_sharded.py and
# distributed/e0m3_sharded.py (commit d92a0c4): the references must keep their bytes.
def _grasp_sharded_grid_quantize4_with_scale(x, s, t, stream=-1, row_offset=0):
    rows, cols = x.shape
    x = x.float()
    row_max, col_max = ref4._grid_maxima(x, s)
    row_bits = ref4.ue4m3_encode(row_max / t, round_up=True)
    col_bits = ref4.ue4m3_encode(col_max / t, round_up=True)
    den = ref4._grid_denominator(ref4.ue4m3_decode(row_bits) * t, ref4.ue4m3_decode(col_bits) * t, s, rows, cols)
    safe = torch.where(den > 0, den, torch.ones_like(den))
    noise = None if stream < 0 else ref.uniform_noise(rows, cols, stream, row_offset, x.device)
    q = ref4._round_codes(x / safe * ref4.QMAX4, noise)
    q = torch.where(den > 0, q, torch.zeros_like(q))
    return ref4.pack_int4(q.to(torch.int8)), row_bits, col_bits


def _e0m3_sharded_quantize_with_scale(x, t, stream=-1, row_offset=0):
    rows, cols = x.shape
    xb = ref4._blocked(x.float(), ref4.E0M3_BLOCK)
    amax = xb.abs().amax(dim=-1)
    s_bits = ref4.ue4m3_encode(amax / (ref4.QMAX4 * t), round_up=True)
    step = ref4.ue4m3_decode(s_bits) * t
    safe = torch.where(step > 0, step, torch.ones_like(step))
    noise = None if stream < 0 else ref.uniform_noise(rows, cols, stream, row_offset, x.device)
    nz = None if noise is None else ref4._blocked(noise, ref4.E0M3_BLOCK)
    q = ref4._round_codes(xb / safe[..., None], nz)
    q = torch.where(step[..., None] > 0, q, torch.zeros_like(q))
    q = q.reshape(rows, q.shape[1] * ref4.E0M3_BLOCK)[:, :cols]
    return ref4.pack_int4(q.to(torch.int8)), s_bits


def test_grid_reference_matches_former_grasp_sharded_python():
    x = momentum(70, 33, seed=3) - momentum(70, 33, seed=4) * 0.01
    for s, t, stream in itertools.product((32, 5), (0.7, 1e-3), (-1, STREAM)):
        scale = torch.tensor(t)
        mine = _reference("grid_quantize4_with_scale")(x, s, scale, stream, 64)
        theirs = _grasp_sharded_grid_quantize4_with_scale(x, s, scale, stream, 64)
        for a, b, w in zip(mine, theirs, ("packed", "row maxima", "column maxima")):
            assert_bits_equal(a, b, f"{w} s={s} t={t}")


def test_e0m3_reference_matches_former_e0m3_sharded_python():
    x = momentum(37, 300)
    for t, stream in itertools.product((1e-4, 0.02), (-1, STREAM)):
        scale = torch.tensor(t)
        mine = ref4.e0m3_quantize_with_scale(x, scale, noise=noise_or_none(x, stream, 8))
        theirs = _e0m3_sharded_quantize_with_scale(x, scale, stream, 8)
        for a, b in zip(mine, theirs):
            assert_bits_equal(a, b, f"e0m3 t={t}")


def test_amax_is_the_update_scale_and_nan_is_canonical():
    # the reference amax gives the unsharded update's scale; a NaN momentum gives 0x7FC00000
    state = e0m3_state(9, 70)
    g = make_grad(9, 70)
    amax = _reference("e0m3_momentum_amax_multi")(*[[t] for t in state], [g], 0.9)
    r = [t.clone() for t in state]
    ref4.e0m3_momentum_update_(*r, g.clone(), beta=0.9, nesterov=False, block_size=32)
    assert_bits_equal(ref4.e0m3_tensor_scale_from_amax(amax[0]), r[2], "scale from amax vs unsharded update's")
    g[3, 5] = float("nan")
    amax = _reference("e0m3_momentum_amax_multi")(*[[t] for t in state], [g], 0.9)
    assert amax.view(torch.int32).tolist() == [0x7FC00000]


# ---------------------------------------------------------------------------------------------
# kernel == reference
# ---------------------------------------------------------------------------------------------
def _amax_case(shapes, grad_dtypes, device="cpu"):
    states = [e0m3_state(r, c, seed=i, device=device) for i, (r, c) in enumerate(shapes)]
    grads = [make_grad(r, c, gd, seed=10 + i, device=device) for i, ((r, c), gd) in enumerate(zip(shapes, grad_dtypes))]
    return [list(x) for x in zip(*states)] if states else [[], [], []], grads


def check_amax(lists, grads, beta):
    before = _kernels.served.copy()
    out = AMAX(*lists, grads, beta)
    expect = _reference("e0m3_momentum_amax_multi")(*[[t.cpu() for t in x] for x in lists], [g.cpu() for g in grads],
                                                     beta)
    assert out.shape == (len(grads),) and out.dtype == torch.float32
    assert out.device == (grads[0].device if grads else torch.device("cpu"))
    assert_bits_equal(out, expect, "e0m3 amax")
    return _kernels.served - before


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("beta", [0.0, 0.9, 1.0])
def test_amax_matches_reference(ext, grad_dtype, beta):
    lists, grads = _amax_case(SHAPES + [(0, 5), (4, 0)], [grad_dtype] * (len(SHAPES) + 2))
    served = check_amax(lists, grads, beta)
    assert served == {("e0m3_momentum_amax_multi", "compiled"): 1}


def test_amax_nonfinite_noncontiguous_and_mixed_dtypes_match_reference(ext):
    lists, grads = _amax_case([(6, 50), (5, 40), (3, 33)], [torch.float32, torch.bfloat16, torch.float16])
    grads[0][1, 2], grads[0][4, 40] = float("inf"), -float("inf")
    grads[1][2, 7] = float("nan")
    grads[2] = make_grad(33, 3, torch.float16, seed=5).t()  # transposed: read through a contiguous copy
    check_amax(lists, grads, 0.95)
    # a row-padded state view (read in place)
    big = torch.zeros(6, 40, dtype=torch.uint8)
    big[:, 3:28] = lists[0][0]
    lists[0][0] = big[:, 3:28]
    check_amax(lists, grads, 0.95)
    assert AMAX([], [], [], [], 0.9).shape == (0,)


def _check_with_scale(states, grads, new_scales, *, block_size, nesterov, streams, offsets):
    """torch.ops.qmuon (the compiled kernel) vs the reference on clones, bit for bit."""
    lists = [list(x) for x in zip(*states)]
    r_lists = [[t.clone() for t in x] for x in lists]
    r_grads = [g.clone() for g in grads]
    sums = nan_sums(grads, block_size)
    r_sums = nan_sums(grads, block_size)
    before = _kernels.served.copy()
    assert WITH_SCALE(*lists, new_scales, grads, sums, 0.95, nesterov, block_size, streams, offsets) is None
    served = _kernels.served - before
    _reference("e0m3_momentum_update_with_scale_multi_")(*r_lists, [t.clone() for t in new_scales], r_grads, r_sums,
                                                          0.95, nesterov, block_size, streams, offsets)
    for i in range(len(grads)):
        for j, w in enumerate(("packed", "scales", "tensor scale")):
            assert_bits_equal(lists[j][i], r_lists[j][i], f"{w} {i}")
        assert_bits_equal(lists[2][i].reshape(()), new_scales[i].reshape(()).to(lists[2][i].dtype),
                          f"tensor scale {i} = the given one")
        assert_bits_equal(grads[i], r_grads[i], f"NS input {i}")
        assert_sumsq_close(sums[i], r_sums[i], block_size)
    return served


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [256, 16, 8])
def test_with_scale_matches_reference(ext, shape, grad_dtype, block_size):
    rows, cols = shape
    for stream, nesterov, factor in itertools.product([-1, STREAM], [False, True], [1.0, 0.25, 3.0]):
        state = e0m3_state(rows, cols)
        t = ref4.e0m3_tensor_scale(momentum(rows, cols, seed=2)) * factor  # 0.25: block scales saturate at 448
        served = _check_with_scale([state], [make_grad(rows, cols, grad_dtype)], [t], block_size=block_size,
                                   nesterov=nesterov, streams=[stream], offsets=[7])
        assert served == {("e0m3_momentum_update_with_scale_multi_", "compiled"): 1}


def test_with_scale_special_scales_multi_tensor_and_empty(ext):
    shapes = [(4, 40), (3, 5), (2, 33), (5, 16), (1, 1), (0, 4), (3, 0)]
    scales = [0.0, float("inf"), float("nan"), 1e-30, 1.0, 0.5, 2.0]
    states = [e0m3_state(r, c, seed=i) for i, (r, c) in enumerate(shapes)]
    grads = [make_grad(r, c, (torch.float32, torch.bfloat16)[i % 2], seed=i) for i, (r, c) in enumerate(shapes)]
    _check_with_scale(states, grads, [torch.tensor(t) for t in scales], block_size=16, nesterov=True,
                      streams=[STREAM + i for i in range(len(shapes))], offsets=list(range(len(shapes))))


def test_with_scale_noncontiguous(ext):
    rows, cols = 37, 300
    state = e0m3_state(rows, cols)
    big = torch.zeros(rows, 170, dtype=torch.uint8)  # row-padded packed codes, updated in place
    big[:, 5:155] = state[0]
    state[0] = big[:, 5:155]
    grad = make_grad(cols, rows, torch.bfloat16).t()
    t = torch.full((1,), 0.01)  # a one-element (not 0-d) scale
    _check_with_scale([state], [grad], [t], block_size=64, nesterov=True, streams=[STREAM], offsets=[0])


def test_with_scale_unsupported_arguments_fall_back_to_reference(ext):
    state = e0m3_state(5, 40)
    served = _check_with_scale([state], [make_grad(5, 40)], [torch.tensor(0.01, dtype=torch.float64)],
                               block_size=16, nesterov=False, streams=[-1], offsets=[0])
    assert served == {("e0m3_momentum_update_with_scale_multi_", "reference"): 1}
    served = _check_with_scale([e0m3_state(5, 40)], [make_grad(5, 40)], [torch.tensor(0.01)], block_size=24,
                               nesterov=False, streams=[-1], offsets=[0])
    assert served == {("e0m3_momentum_update_with_scale_multi_", "reference"): 1}


def test_with_scale_bad_arguments_raise_before_writing(ext):
    state = e0m3_state(5, 70)
    g = make_grad(5, 70)
    keep = [t.clone() for t in state] + [g.clone()]
    for bad in ([torch.zeros(2)], [torch.tensor(1.0), torch.tensor(1.0)]):
        with pytest.raises(RuntimeError, match="new_tensor_scales"):
            torch.ops.qmuon_C.e0m3_momentum_update_with_scale_multi_(
                *[[t] for t in state], bad, [g], nan_sums([g], 16), 0.9, False, 16, [-1], [0])
    for a, b in zip(state + [g], keep):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", SHAPES + [(70, 33), (0, 4)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("stream", [-1, STREAM])
def test_grid_with_scale_matches_reference(ext, shape, stream):
    rows, cols = shape
    x = momentum(rows, cols, seed=5) - momentum(rows, cols, seed=6) * 0.01
    for s, t in itertools.product((32, 5, 1), (None, 0.05, 0.0, float("inf"))):
        scale = ref4.grid_scale_from_amax(x.abs().amax() if x.numel() else torch.zeros(())) if t is None \
            else torch.tensor(t)
        before = _kernels.served.copy()
        k = GRID(x, s, scale, stream, 3)
        assert _kernels.served - before == {("grid_quantize4_with_scale", "compiled"): 1}
        r = ref4.grid_quantize4_with_scale(x, s, scale, noise=noise_or_none(x, stream, 3))
        for a, b, w in zip(k, r, ("packed", "row maxima", "column maxima")):
            assert_bits_equal(a, b, f"grid_quantize4_with_scale {w} s={s} t={t}")
        if t is None:  # the matrix's own scale: grid_quantize4's bytes
            for a, b in zip(k, torch.ops.qmuon.grid_quantize4(x, s, stream, 3)):
                assert_bits_equal(a, b, "with the matrix's scale vs grid_quantize4")


def test_grid_with_scale_noncontiguous_and_bf16(ext):
    x = momentum(300, 37).t()
    t = torch.tensor(0.004)
    for a, b in zip(GRID(x, 16, t, 7, 0), ref4.grid_quantize4_with_scale(x, 16, t, noise=noise_or_none(x, 7, 0))):
        assert_bits_equal(a, b, "transposed input")
    xb = momentum(40, 64).bfloat16()
    for a, b in zip(GRID(xb, 8, t, -1, 0), ref4.grid_quantize4_with_scale(xb, 8, t)):
        assert_bits_equal(a, b, "bf16 input")


# ---------------------------------------------------------------------------------------------
# row shards == the whole matrix
# ---------------------------------------------------------------------------------------------
def _e0m3_row_split(impl, rows, cols, cuts, grad_dtype, block_size, stream, base_offset, device="cpu"):
    """Whole-matrix update vs shards [cuts[i], cuts[i+1]) through amax -> MAX -> with_scale."""
    amax_op, with_scale_op, update_op = (
        (AMAX, WITH_SCALE, UPDATE) if impl == "op" else
        (_reference("e0m3_momentum_amax_multi"), _reference("e0m3_momentum_update_with_scale_multi_"),
         _reference("e0m3_momentum_update_multi_")))
    whole = e0m3_state(rows, cols, device=device)
    grad = make_grad(rows, cols, grad_dtype, device=device)
    bounds = list(zip([0] + cuts, cuts + [rows]))
    shards = [[whole[0][a:b].clone(), whole[1][a:b].clone(), whole[2].clone()] for a, b in bounds]
    shard_grads = [grad[a:b].clone() for a, b in bounds]
    shard_sums = [nan_sums([g], block_size)[0] for g in shard_grads]
    sums = nan_sums([grad], block_size)
    update_op(*[[t] for t in whole], [grad], sums, 0.9, True, block_size, [stream], [base_offset])
    # every shard: local amax, then the MAX "all-reduce" and the matrix's scale
    amax = torch.stack([amax_op([p], [s], [t], [g], 0.9)[0] for (p, s, t), g in zip(shards, shard_grads)])
    scale = ref4.e0m3_tensor_scale_from_amax(amax.max())
    for (p, s, t), g, out, (a, _) in zip(shards, shard_grads, shard_sums, bounds):
        with_scale_op([p], [s], [t], [scale], [g], [out], 0.9, True, block_size, [stream], [base_offset + a])
    for (p, s, t), g, out, (a, b) in zip(shards, shard_grads, shard_sums, bounds):
        assert_bits_equal(p, whole[0][a:b], f"packed rows {a}:{b}")
        assert_bits_equal(s, whole[1][a:b], f"scales rows {a}:{b}")
        assert_bits_equal(t, whole[2], "tensor scale")
        assert_bits_equal(g, grad[a:b], f"NS input rows {a}:{b}")
        assert_bits_equal(out, sums[0][a:b], f"block sums rows {a}:{b}")  # same rows, same summation


# "op": torch.ops.qmuon (the compiled kernels where they are loaded), "reference": the ops' Python bodies.
@pytest.mark.parametrize("impl", ["op", "reference"])
@pytest.mark.parametrize("grad_dtype,block_size,stream", [(torch.float32, 256, STREAM), (torch.bfloat16, 16, -1),
                                                          (torch.float16, 8, STREAM)], ids=["fp32", "bf16", "fp16"])
def test_e0m3_row_split_matches_whole_matrix(impl, grad_dtype, block_size, stream):
    _e0m3_row_split(impl, 37, 300, [10, 11, 30], grad_dtype, block_size, stream, base_offset=5)


@pytest.mark.cuda
def test_cuda_row_split_matches_whole_matrix(cuda_ext):  # larger shards than the CPU cases above
    _e0m3_row_split("op", 130, 1000, [32, 64, 65], torch.bfloat16, 256, STREAM, base_offset=7, device="cuda")


@pytest.mark.parametrize("impl", ["op", "reference"])
@pytest.mark.parametrize("stream", [-1, STREAM])
def test_grid_row_split_matches_whole_matrix(impl, stream):
    s, rows, cols = 8, 70, 33
    x = momentum(rows, cols, seed=5) - momentum(rows, cols, seed=6) * 0.01
    whole = torch.ops.qmuon.grid_quantize4(x, s, stream, 0) if impl == "op" else \
        ref4.grid_quantize4(x, s, noise=noise_or_none(x, stream, 0))
    bounds = [(0, 24), (24, 32), (32, 64), (64, 70)]  # shards start on tile boundaries
    amax = torch.stack([x[a:b].abs().amax() for a, b in bounds]).max()
    t = ref4.grid_scale_from_amax(amax)
    assert_bits_equal(t, whole[3], "scale from the shards' amax")
    for a, b in bounds:
        part = GRID(x[a:b], s, t, stream, a) if impl == "op" else \
            _reference("grid_quantize4_with_scale")(x[a:b], s, t, stream, a)
        assert_bits_equal(part[0], whole[0][a:b], f"packed rows {a}:{b}")
        assert_bits_equal(part[1], whole[1][a:b], f"row maxima rows {a}:{b}")
        assert_bits_equal(part[2], whole[2][a // s: -(-b // s)], f"column maxima tiles of rows {a}:{b}")


# ---------------------------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------------------------
def _opcheck_args(device="cpu"):
    states = [e0m3_state(9, 70, device=device), e0m3_state(4, 33, seed=3, device=device)]
    grads = [make_grad(9, 70, torch.float32, device=device), make_grad(4, 33, torch.bfloat16, seed=4, device=device)]
    lists = [list(x) for x in zip(*states)]
    scales = [torch.tensor(0.01, device=device), torch.tensor(0.2, device=device)]
    update = (*lists[:3], scales, grads, [torch.empty(9, 5, device=device), torch.empty(4, 3, device=device)],
              0.95, True, 16, [11, -1], [0, 5])
    amax = (*lists[:3], grads, 0.9)
    x = momentum(37, 65, device=device)
    grid = (x, 16, torch.tensor(0.003, device=device), 5, 1)
    return update, amax, grid


def test_opcheck_sharded_ops(kernel_device):
    update, amax, grid = _opcheck_args(kernel_device.type)
    opcheck(WITH_SCALE.default, update)
    opcheck(AMAX.default, amax)
    opcheck(GRID.default, grid)


# ---------------------------------------------------------------------------------------------
# On each device (cuda: marked): kernel == CPU reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_sharded_ops_match_reference_on_each_device(kernel_device, grad_dtype):
    lists, grads = _amax_case(SHAPES + [(300, 1000), (0, 3)], [grad_dtype] * (len(SHAPES) + 2), device=kernel_device)
    for beta in (0.0, 0.9):
        check_amax(lists, grads, beta)
    for (rows, cols), bs, stream in itertools.product(SHAPES + [(300, 1000)], [256, 8], [-1, STREAM]):
        state = e0m3_state(rows, cols, device=kernel_device)
        t = torch.tensor(0.003, device=kernel_device)
        _check_with_scale([state], [make_grad(rows, cols, grad_dtype, device=kernel_device)], [t], block_size=bs,
                          nesterov=True, streams=[stream], offsets=[3])
    for (rows, cols), s, stream in itertools.product(SHAPES + [(300, 1000)], [32, 5], [-1, STREAM]):
        x = momentum(rows, cols, seed=7)
        t = torch.tensor(0.01)
        for a, b in zip(GRID(x.to(kernel_device), s, t.to(kernel_device), stream, 2),
                        ref4.grid_quantize4_with_scale(x, s, t, noise=noise_or_none(x, stream, 2))):
            assert_bits_equal(a, b, f"{kernel_device} grid_quantize4_with_scale {rows}x{cols} s={s}")




