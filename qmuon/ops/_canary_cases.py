"""The first-use canary's coverage cases: the calls :mod:`._canary` checks each compiled op on.

The cases are built from the kernels' code (csrc/cpu/*.cpp, csrc/cuda/*.cu, csrc/qmuon/*.h), so that
together they reach every code path of the op's CPU and CUDA kernels, not one sample (what this canary
checked before: :func:`._canary_samples.samples`, a 9 x 100 call that the doctor and the ctypes tests still
use). The same cases run on every device type; only the grid cases' sizes depend on it
(:class:`._canary_inputs.Plan`). Labels:

* ``shapes``: several blocks a row with a short last one, odd widths (a half 4-bit byte), rows shorter
  than a block, rows that are views of wider rows (row stride > cols), stochastic rounding whose noise
  index crosses 2**32 inside a block (:func:`._canary_inputs.straddle_offset`), NaN and infinities. The
  multi-tensor updates take several matrices in one call (:func:`._canary_inputs.shape_mats`): A 3 x 603
  (strided, fp32 grads, stochastic, noise across 2**32), B 5 x 40 (bf16 grads, nearest), D 3 x 5 (fp32
  grads with NaN, inf and -inf), E 0 x 16 (e0m3 updates: an empty one); two dtype groups, A and D in one;
  on CUDA 24 more small matrices in A's group, which then needs two launches (at most 24 matrices a
  launch).
* ``grid``: on CUDA, more CTAs than the device keeps resident (1.5 x SMs x resident CTAs per SM, from the
  device's properties; an H200's 132 SMs x 2048 threads when it cannot be asked), so a second wave of
  CTAs runs; tall and thin (few columns), so that the waves cost few elements. On the CPU 31-64 rows.
* op-specific: ``bigblock`` (one block of 4096 on CUDA, the largest: 2 warps a CTA; 2048 on the CPU),
  ``specials`` (UE4M3 boundaries, NaN, inf, -0), ``kinds84`` / ``kinds88`` (AdamW moment kinds),
  ``fp32`` (bf16 weights, fp32 update), ``grid-rows`` (the fp32 write's row-major update).

Code paths and the cases that reach them:

==========================================================  ==================================================
path (CPU kernel / CUDA kernel)                             cases
==========================================================  ==================================================
**q8_momentum_update_multi_** (q8_update_matrix / q8_momentum_update_kernel)
int8 / uint8 codes                                          shapes A D, bigblock / shapes B, grid
fp32 / bf16 / fp16 grads                                    shapes A D, grid / shapes B / bigblock
Nesterov on / off; stochastic / nearest (per matrix)        grid, bigblock / shapes; shapes A D, grid / B
CPU lerp, beta in [0.5, 1) at compile time / any beta       grid (0.9), bigblock (0.95) / shapes (0.3)
CPU AVX-512 16-wide code store and its scalar tail          shapes (blocks of 64, the last 27), grid (20)
CPU noise: 32-bit counter / a block across 2**32            every stochastic case / shapes A
several blocks a row, a short last one, rows < a block      shapes A / A / B D, grid
row strides (codes, absmax, grad views); dtype groups       shapes A; shapes (A + D, B)
CUDA 4-wide path / scalar path (odd, misaligned)            shapes B, grid, bigblock / shapes A D
CUDA scalar loop / 4-wide loop of several steps             shapes A (64) / bigblock (32 steps)
CUDA 8 / 2 warps a CTA (shared-memory budget)               shapes, grid / bigblock
CUDA > 24 matrices: two launches; more than one wave        shapes; grid
**quantize_rows / dequantize_rows** (quantize_matrix, dequantize_matrix / *_rows_kernel)
signed / unsigned; stochastic / nearest; int8 / uint8       shapes / grid; shapes / grid; grid / shapes
fp32 / bf16 input (the binding widens to fp32)              shapes / grid
blocks, short last one (AVX tail), row < block, strides     shapes (64: the last 27), grid (21 < 32), shapes
noise across 2**32; more than one wave                      shapes; grid
**dense_momentum_update_multi_** (dense_update_matrix / dense_update_kernel)
fp32 / bf16 buffer                                          shapes B D, grid / shapes A, grid
fp32 / bf16 / fp16 grads; Nesterov on / off                 shapes A D / B, grid / grid; grid / shapes
bf16 buffer stochastic / nearest; fp32 one with a stream    shapes A / grid; shapes D, grid
fused lerp of any beta; blocks, strides, groups             shapes (0.3; blocks of 64)
**int4_momentum_update_multi_** (int4_update_matrix / int4_update_kernel)
fp32 / bf16 / fp16 grads; Nesterov; rounding                shapes A D / B, grid / bigblock; as q8
odd last block (half byte); blocks; strides                 shapes A D (blocks of 128); shapes A
CPU noise: fill_noise 32-bit run / run across 2**32         every stochastic case / shapes A
CUDA lane loop of several 64-element steps; 2 warps a CTA   shapes, bigblock; bigblock
**e0m3_momentum_update_multi_ / _with_scale_multi_ / e0m3_momentum_amax_multi** (e0m3_* pass 1 / 2 /
e0m3_pass1_kernel, e0m3_pass2_kernel)
fp32 / bf16 / fp16 grads; Nesterov on / off; rounding       shapes A D / B / grid; per op; shapes A D, grid / B
sum blocks of 8 (two a 16-scale block) / 32 / 48            update shapes / grids / with-scale shapes
CPU units of 16 / 32 / 48; a short 16-block at a row end    as above; shapes A D
CUDA 8-lane shuffle sums / warp sum / a 48-element chunk    update shapes / grids / with-scale shapes
tensor scale from pass 1 / given; an empty matrix           update, amax / with-scale; shapes E (updates)
CUDA scratch per matrix, atomicMax over CTAs; > 1 wave      shapes; grid (pass 1: 32 chunks a CTA)
**codecs** (codec_cpu / the codec kernels)
pack / unpack: odd cols (half byte) / even; strided input   shapes / grid; shapes (the binding copies)
ue4m3_encode nearest / round-up; NaN, inf, -0, 448, 2**-10  specials (fp64 input) / grid (bf16); specials
ue4m3_decode: all 256 patterns                              shapes (a strided view), grid
int4_quantize stochastic / nearest; odd last block          shapes / grid; shapes (64: the last 27), grid (2)
int4_dequantize: an odd block (blocks start mid-byte)       shapes (15)
e0m3_quantize two-level / one-level (scale 1); rounding     grid / shapes; grid / shapes
grid_quantize4(_with_scale): partial tiles; CUDA tile rows  shapes (tiles of 4); grid
a tile larger than the matrix                               grid (64)
grid / e0m3 / int4 dequantize; more than one wave           shapes, grid; grid
**adamw_q_update_** (adamw_run<G, MK, VK> / adamw_q_kernel)
moment kinds m8 v8 / m4 v4 / m8 v4 / m4 v8                  kinds88 / shapes / kinds84 / grid
bf16 / fp32 / fp16 grads; stochastic / nearest              kinds88 / shapes, grid / kinds84; the others / shapes
odd last block (4-bit half byte); blocks; strides           shapes (202: the last 199)
CUDA 256 threads over > 256 / > 512 elements (4-bit)        kinds84 (blocks of 520)
noise across 2**32; more than one wave                      kinds84; grid
**bf16_weight_update_ / bf16_ecc8_weight_update_** (weight_rows / weight_update_kernel)
fp32 / bf16 / fp16 update                                   fp32 / grid (ecc8: shapes) / shapes (ecc8: grid)
nearest / stochastic; a row's run split at 2**32            grid / shapes, fp32; shapes (row 1)
index row stride != cols; strides; NaN / inf updates        shapes
**fp32_weight_update_** (fp32_rows, *_transposed, *_strided / fp32_weight_*kernel)
row-major / column-major (tiles) / other strides            grid-rows (fp16) / grid (bf16) / shapes (fp32)
8 x 8 transposes with tails both ways (62 x 33)             grid
CUDA element-wise kernel / 32 x 32 tiles; > 1 wave          grid-rows, shapes / grid; grid, grid-rows
==========================================================  ==================================================

Not reached, and why:

* the CPU kernels' threading, and their full ``kMaxBlockSize`` (4096) block buffers: every CPU case stays
  within 2048 elements a tensor, blocks padded, so that no kernel crosses an ``at::parallel_for`` chunk
  (32768 elements) and no reference op runs threaded (ATen threads its rounding and conversion ops above
  2048 elements): on this repository's loaded 2-core machine each threaded op cost milliseconds, a case
  cut into chunks 0.1-0.9 s. For the same reason the CPU grid codecs get one tile row (their column
  maxima loop threads over tile rows from two). tests/test_canary.py runs every case at its CUDA size
  through the CPU kernels instead, which crosses their chunks and has thousands of tile rows;
* the codec and weight kernels' grid-stride loops taking a second lap (above 65535 x 16 x 256 or
  65535 x 8 x 256 elements), and the fp32 write's element-wise fallback above 65535 tile rows (2 million
  rows): too large for a canary;
* CUDA q8 / int4 updates with 4 warps a CTA (blocks of 2048), e0m3 sum blocks of 1, 2, 4 and 16 (CUDA
  shuffles over that many lanes): the same code as the 2- / 8-warp and the 8-lane cases, with another count;
* compile-time alternatives (``__CUDA_ARCH__ >= 800`` warp reductions, AVX-512 or portable CPU loops,
  F16C): the build has one of each, and that one runs here.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ._canary_inputs import (
    BF16, F16, F32, F64, I8, S1, S2, TWO32, U8, CaseData, Mat, Plan, case_grads, geometry_of, n_blocks, nan_sums,
    shape_mats, straddle_offset, with_nonfinite,
)

__all__ = ["Case", "cases"]

#: A canary call: (label, function that builds fresh arguments of one call of the op).
Case = tuple[str, Callable[[], tuple]]


def _cases_q8(device: torch.device, plan: Plan) -> dict[str, list[Case]]:
    def update(key: str, mats: list[Mat], bs: int, beta: float, nesterov: bool) -> Case:
        def make() -> tuple:
            d = CaseData(device, "q8u/" + key)
            codes = [d.view(d.ints(-127, 128, m.rows, m.cols, I8) if m.state == I8
                            else d.ints(1, 256, m.rows, m.cols, U8), m.pad) for m in mats]
            absmax = [d.view(d.scales(m.rows, n_blocks(m.cols, bs), 0.05), m.pad and 2) for m in mats]
            return (codes, absmax, case_grads(d, mats), nan_sums(d, mats, bs), beta, nesterov, bs,
                    [m.stream for m in mats], [m.row_offset for m in mats])
        return key, make

    def quantize(key: str, rows: int, cols: int, dtype: torch.dtype, pad: int, bs: int, signed: bool,
                 stream: int, row_offset: int) -> Case:
        def make() -> tuple:
            d = CaseData(device, "q8q/" + key)
            return (d.view(d.randn(rows, cols, 0.02, dtype), pad), bs, signed, stream, row_offset)
        return key, make

    def dequantize(key: str, rows: int, cols: int, code: torch.dtype, pad: int, bs: int) -> Case:
        def make() -> tuple:
            d = CaseData(device, "q8d/" + key)
            c = d.ints(-127, 128, rows, cols, I8) if code == I8 else d.ints(1, 256, rows, cols, U8)
            return (d.view(c, pad), d.view(d.scales(rows, n_blocks(cols, bs), 0.05), pad and 3), bs)
        return key, make

    # blocks of 32, one a row: CUDA a warp per row block, 8 a CTA; CPU 64 rows (one chunk, 2048 elements)
    rows = plan.rows(cpu=64, threads=256, per_cta=8, per_row=1)
    big = plan.big_block
    return {
        "q8_momentum_update_multi_": [
            update("shapes", shape_mats(plan, (I8, U8, I8)), 64, 0.3, False),
            update("grid", [Mat(rows, 20, F32, S1, 7, 0, U8)], 32, 0.9, True),
            # CUDA: the largest block, 2 warps a CTA (shared-memory budget), 32 steps of the 4-wide loop
            update("bigblock", [Mat(1, big, F16, S2, 3, 0, I8)], big, 0.95, True),
        ],
        "quantize_rows": [
            quantize("shapes", 3, 603, F32, 9, 64, True, S1, straddle_offset(603)),
            quantize("grid", rows, 21, BF16, 0, 32, False, -1, 0),
        ],
        "dequantize_rows": [
            dequantize("shapes", 3, 603, U8, 9, 64),
            dequantize("grid", rows, 21, I8, 0, 32),
        ],
    }


def _cases_dense(device: torch.device, plan: Plan) -> dict[str, list[Case]]:
    def update(key: str, mats: list[Mat], bs: int, beta: float, nesterov: bool) -> Case:
        def make() -> tuple:
            d = CaseData(device, "dense/" + key)
            bufs = [d.view(d.randn(m.rows, m.cols, 0.02, m.state), m.pad) for m in mats]
            return (bufs, case_grads(d, mats), nan_sums(d, mats, bs), beta, nesterov, bs,
                    [m.stream for m in mats], [m.row_offset for m in mats])
        return key, make

    rows = plan.rows(cpu=64, threads=256, per_cta=8, per_row=1)  # as the q8 grid case
    return {"dense_momentum_update_multi_": [
        update("shapes", shape_mats(plan, (BF16, F32, F32)), 64, 0.3, False),
        # an fp32 buffer with a stream (which fp32 ignores), a bf16 one rounded to nearest, Nesterov on
        update("grid", [Mat(rows, 20, BF16, S1, 7, 0, F32), Mat(3, 70, F16, -1, 1, 0, BF16)], 32, 0.9, True),
    ]}


def _cases_codecs(device: torch.device, plan: Plan) -> dict[str, list[Case]]:
    def case(key: str, build: Callable[[CaseData], tuple]) -> Case:
        return key.split("/")[1], lambda: build(CaseData(device, "codec/" + key))

    # CUDA: 256-thread CTAs of a thread per byte / element / block / maximum, as each codec kernel launches, more
    # than one wave of them. CPU: 62-64 rows, at most 2048 elements (:mod:`._canary`'s docstring, "Cost").
    cuda = plan.cuda
    pack_rows = plan.rows(cpu=64, threads=256, per_cta=256, per_row=16)
    elem_rows = plan.rows(cpu=64, threads=256, per_cta=256, per_row=32)
    # int4_quantize: a thread per block (blocks of 2, 3 columns: 2 a row); int4_dequantize: per element
    i4q_rows = plan.rows(cpu=64, threads=256, per_cta=256, per_row=2)
    i4d_rows = plan.rows(cpu=64, threads=256, per_cta=256, per_row=21)
    # e0m3_quantize: a thread per 16-block (3 columns: one a row); e0m3 / grid dequantize: per element
    e3q = (plan.rows(cpu=0, threads=256, per_cta=256, per_row=1), 3) if cuda else (42, 33)
    e3d_rows = plan.rows(cpu=42, threads=256, per_cta=256, per_row=33)
    # grid_quantize4: a thread per tile maximum (64-tiles, 3 columns: 1 + 3 / 64 a row), its codes kernel a
    # thread per byte (2 a row). (CPU: 31 rows, one tile: its column maxima loop threads over row tiles from 2.)
    gq = (plan.rows(cpu=0, threads=256, per_cta=256, per_row=1 + 3 / 64), 3) if cuda else (31, 33)

    def specials(d: CaseData, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
        x = d.randn(rows, cols).abs() * torch.logspace(-4, 3, cols, device=d.device)
        v = torch.tensor([0.0, -0.0, 2.0 ** -11, 2.0 ** -10, 2.0 ** -9, 3 * 2.0 ** -10, 2.0 ** -6, 0.0626, 447.9,
                          448.0, 449.0, 464.0, 1e30, float("inf"), float("-inf"), -1.0, float("nan")], device=d.device)
        x.view(-1)[:v.numel()] = v
        return x.to(dtype)

    def e3_state(d: CaseData, rows: int, cols: int, pad: int) -> tuple:
        return (d.view(d.nibbles(rows, cols), pad), d.ints(0, 0x7F, rows, n_blocks(cols, 16), U8),
                torch.tensor(2.5e-5, device=d.device), cols)

    def grid_state(d: CaseData, rows: int, cols: int, s: int) -> tuple:
        return (d.nibbles(rows, cols), d.ints(0, 0x7F, rows, n_blocks(cols, s), U8),
                d.ints(0, 0x7F, n_blocks(rows, s), cols, U8), torch.tensor([3.1e-4], device=d.device), s, cols)

    def x(d: CaseData, rows: int, cols: int, dtype: torch.dtype = F32, pad: int = 0) -> Tensor:
        return d.view(d.randn(rows, cols, 0.02, dtype), pad)

    def scale(d: CaseData, v: float) -> Tensor:
        return torch.tensor([v], device=d.device)

    so = straddle_offset(603)
    return {
        "pack_int4": [
            case("pack/shapes", lambda d: (d.view(d.ints(-7, 8, 3, 603, I8), 9),)),  # odd: a half byte a row
            case("pack/grid", lambda d: (d.ints(-7, 8, pack_rows, 32, I8),)),  # even: whole bytes
        ],
        "unpack_int4": [
            case("unpack/shapes", lambda d: (d.view(d.nibbles(3, 603), 5), 603)),
            case("unpack/grid", lambda d: (d.nibbles(elem_rows, 32), 32)),
        ],
        "ue4m3_encode": [
            case("ue-enc/specials", lambda d: (specials(d, 7, 37, F64), False)),  # nearest even; fp64 input
            case("ue-enc/grid", lambda d: (specials(d, elem_rows, 32, BF16), True)),
        ],
        "ue4m3_decode": [
            # every one of the 256 patterns (and 3 more), a strided view
            case("ue-dec/shapes", lambda d: (d.view((torch.arange(259, device=d.device) % 256).to(U8).reshape(7, 37),
                                                    3),)),
            case("ue-dec/grid", lambda d: (d.ints(0, 256, elem_rows, 32, U8),)),
        ],
        "int4_quantize": [
            case("i4q/shapes", lambda d: (x(d, 3, 603, F32, 9), 64, S1, so)),
            case("i4q/grid", lambda d: (x(d, i4q_rows, 3, BF16), 2, -1, 0)),
        ],
        "int4_dequantize": [
            # an odd block: blocks that start in the middle of a byte
            case("i4d/shapes", lambda d: (d.view(d.nibbles(3, 603), 5), d.scales(3, n_blocks(603, 15), 0.05), 15, 603)),
            case("i4d/grid", lambda d: (d.nibbles(i4d_rows, 21), d.scales(i4d_rows, 1, 0.05), 32, 21)),
        ],
        "e0m3_quantize": [
            case("e3q/shapes", lambda d: (x(d, 3, 603, BF16, 9), False, -1, 0)),  # one level (tensor scale 1)
            case("e3q/grid", lambda d: (x(d, e3q[0], e3q[1], F16), True, S2, 3)),
        ],
        "e0m3_dequantize": [
            case("e3d/shapes", lambda d: e3_state(d, 3, 603, 5)),
            case("e3d/grid", lambda d: e3_state(d, e3d_rows, 33, 0)),
        ],
        "grid_quantize4": [
            case("gq/shapes", lambda d: (x(d, 3, 603, F32, 9), 4, S1, so)),  # partial tiles both ways
            case("gq/grid", lambda d: (x(d, gq[0], gq[1], BF16), 64, -1, 0)),  # a tile larger than the matrix
        ],
        "grid_quantize4_with_scale": [
            case("gqs/shapes", lambda d: (x(d, 3, 603, F32, 9), 4, scale(d, 1.7e-4), S1, so)),
            case("gqs/grid", lambda d: (x(d, gq[0], gq[1], BF16), 64, scale(d, 1.1e-4), -1, 64)),
        ],
        "grid_dequantize4": [
            case("gd/shapes", lambda d: grid_state(d, 3, 603, 2)),
            case("gd/grid", lambda d: grid_state(d, e3d_rows, 33, 64)),
        ],
    }


def _cases_q4_updates(device: torch.device, plan: Plan) -> dict[str, list[Case]]:
    def call(key: str, state: Callable[[CaseData, list[Mat], int], tuple], mats: list[Mat], tail: tuple,
             bs: int) -> Case:
        def make() -> tuple:
            d = CaseData(device, key)
            return (*state(d, mats, bs), case_grads(d, mats), *tail(d, mats, bs))
        return key.split("/")[1], make

    def int4_state(d: CaseData, mats: list[Mat], bs: int) -> tuple:
        return ([d.view(d.nibbles(m.rows, m.cols), m.pad) for m in mats],
                [d.view(d.scales(m.rows, n_blocks(m.cols, bs), 0.05), m.pad and 2) for m in mats])

    def e3_state(d: CaseData, mats: list[Mat], bs: int) -> tuple:
        return ([d.view(d.nibbles(m.rows, m.cols), m.pad) for m in mats],
                [d.view(d.ints(0, 0x7F, m.rows, n_blocks(m.cols, 16), U8), m.pad and 2) for m in mats],
                [torch.full((1,), 2.5e-5 * (1 + i % 3), device=d.device) for i in range(len(mats))])

    def e3_with_scale(d: CaseData, mats: list[Mat], bs: int) -> tuple:
        return (*e3_state(d, mats, bs), [torch.full((1,), 3.0e-5 * (1 + i % 4), device=d.device)
                                         for i in range(len(mats))])

    def update_tail(beta: float, nesterov: bool) -> Callable[[CaseData, list[Mat], int], tuple]:
        return lambda d, mats, bs: (nan_sums(d, mats, bs), beta, nesterov, bs, [m.stream for m in mats],
                                    [m.row_offset for m in mats])

    def amax_tail(beta: float) -> Callable[[CaseData, list[Mat], int], tuple]:
        return lambda d, mats, bs: (beta,)

    s = shape_mats(plan, (U8, U8, U8))
    se = shape_mats(plan, (U8, U8, U8), empty=True)
    # CUDA: a warp per row block of 32, 8 a CTA (int4, e0m3 pass 2), or 4 chunks of 256 a warp (e0m3 pass 1, the
    # amax op: 20 columns, one chunk a row), more than one wave. CPU: 64 rows of 20.
    warp_rows = plan.rows(cpu=64, threads=256, per_cta=8, per_row=1)
    pass1_rows = plan.rows(cpu=64, threads=256, per_cta=32, per_row=1)
    big = plan.big_block
    return {
        "int4_momentum_update_multi_": [
            call("int4/shapes", int4_state, s, update_tail(0.3, False), 128),
            call("int4/grid", int4_state, [Mat(warp_rows, 20, BF16, S1, 7)], update_tail(0.9, True), 32),
            call("int4/bigblock", int4_state, [Mat(1, big, F16, S2, 3)], update_tail(0.95, True), big),
        ],
        "e0m3_momentum_update_multi_": [
            # sums of 8: two per 16-element scale block (CUDA: 8-lane shuffles)
            call("e0m3/shapes", e3_state, se, update_tail(0.3, True), 8),
            call("e0m3/grid", e3_state, [Mat(pass1_rows, 20, F16, S1, 7)], update_tail(0.9, False), 32),
        ],
        "e0m3_momentum_amax_multi": [
            call("e0m3a/shapes", e3_state, s, amax_tail(0.3), 16),
            call("e0m3a/grid", e3_state, [Mat(pass1_rows, 20, F16, -1, 0)], amax_tail(0.9), 16),
        ],
        "e0m3_momentum_update_with_scale_multi_": [
            # a block of 3 scale blocks (CUDA: a 48-element chunk, two 32-lane steps)
            call("e0m3s/shapes", e3_with_scale, se, update_tail(0.3, False), 48),
            call("e0m3s/grid", e3_with_scale, [Mat(warp_rows, 20, F16, S1, 7)], update_tail(0.9, True), 32),
        ],
    }


def _cases_adamw(device: torch.device, plan: Plan) -> dict[str, list[Case]]:
    from . import reference_adamw as refa

    def case(key: str, rows: int, cols: int, grad: torch.dtype, m_kind: int, v_kind: int, bs: int, stream: int,
             index0: int, pad: int) -> Case:
        def make() -> tuple:
            d = CaseData(device, "adamw/" + key)
            nb = n_blocks(cols, bs)

            def codes(kind: int) -> Tensor:
                if kind == refa.M8:
                    return d.ints(-127, 128, rows, cols, I8)
                if kind == refa.V8:
                    return d.ints(0, 256, rows, cols, U8)
                return d.nibbles(rows, cols, lo=1 if kind == refa.M4 else 0)  # m: nibble = code + 8, code >= -7

            v = d.view
            return (v(d.randn(rows, cols, 0.1, grad), pad, 1), v(codes(m_kind), pad), v(d.scales(rows, nb, 0.01), pad),
                    v(codes(v_kind), pad), v(d.scales(rows, nb, 0.1), pad),
                    v(torch.full((rows, cols), float("nan"), device=d.device), pad),
                    0.9, 0.95, 1e-8, -1e-3, 0.5, m_kind, v_kind, bs, stream, index0)
        return key, make

    # CUDA: a 256-thread CTA per row block (blocks of 32, one a row), more than one wave; CPU: 64 rows (one chunk)
    rows = plan.rows(cpu=64, threads=256, per_cta=1, per_row=1)
    return {"adamw_q_update_": [
        case("shapes", 3, 603, F32, refa.M4, refa.V4, 202, -1, 0, 9),  # 3 blocks, the last odd: a half byte
        # a block of 520: more elements than a CUDA CTA has threads (256) and 4-bit pairs (512); noise past 2**32
        case("kinds84", 1, 1100, F16, refa.M8, refa.V4, 520, S1, TWO32 - 301, 0),
        case("kinds88", 5, 40, BF16, refa.M8, refa.V8, 16, S2, 40, 0),
        case("grid", rows, 21, F32, refa.M4, refa.V8, 32, S2, 5, 0),
    ]}


def _cases_weights(device: torch.device, plan: Plan) -> dict[str, list[Case]]:
    def case(key: str, build: Callable[[CaseData], tuple]) -> Case:
        return key.split("/")[1], lambda: build(CaseData(device, "weight/" + key))

    def bf16(d: CaseData, rows: int, cols: int, pad: int = 0) -> Tensor:
        return d.view(d.randn(rows, cols, 0.05, BF16), pad)

    def update(d: CaseData, rows: int, cols: int, dtype: torch.dtype, pad: int = 0) -> Tensor:
        return d.view(d.randn(rows, cols, 0.01, dtype), pad)

    # CUDA: a thread per element, 256 a CTA, more than one wave; CPU: 64 rows (one chunk)
    rows = plan.rows(cpu=64, threads=256, per_cta=256, per_row=31)
    # fp32 weights, a transposed update: CUDA a 32 x 32 tile a CTA of 256 threads (33 columns: 2 tiles a
    # tile-row); CPU 62 x 33, one 64-row tile with 8 x 8 blocks and tails both ways
    t_rows = plan.rows(cpu=62, threads=256, per_cta=1, per_row=2 / 32)
    return {
        "bf16_weight_update_": [
            # stochastic, crossing 2**32 in row 1 (index row stride 1000: a column shard); fp16 update; strided
            case("bf16w/shapes", lambda d: (bf16(d, 3, 603, 9), with_nonfinite(update(d, 3, 603, F16, 5)), -0.3, 0.999,
                                            S1, TWO32 - 1000 - 301, 1000)),
            case("bf16w/grid", lambda d: (bf16(d, rows, 31), update(d, rows, 31, BF16), -0.3, 0.999, -1, 0, 31)),
            case("bf16w/fp32", lambda d: (bf16(d, 5, 37), update(d, 5, 37, F32), -0.3, 0.999, S2, 3, 37)),
        ],
        "bf16_ecc8_weight_update_": [
            case("ecc/shapes", lambda d: (bf16(d, 3, 603, 9), d.view(d.ints(-127, 128, 3, 603, I8), 3),
                                          with_nonfinite(update(d, 3, 603, BF16, 5)), -0.3, 0.999)),
            case("ecc/grid", lambda d: (bf16(d, rows, 31), d.ints(-127, 128, rows, 31, I8),
                                        update(d, rows, 31, F16), -0.3, 0.999)),
            case("ecc/fp32", lambda d: (bf16(d, 5, 37), d.ints(-127, 128, 5, 37, I8), update(d, 5, 37, F32),
                                        -0.3, 0.999)),
        ],
        "fp32_weight_update_": [
            # neither layout (column stride 2): the element-wise loop
            case("fp32w/shapes", lambda d: (d.randn(5, 37), d.randn(5, 74, 0.01)[:, ::2], -0.3, 0.999)),
            # row-major update (fp16), strided rows
            case("fp32w/grid-rows", lambda d: (d.view(d.randn(rows, 31), 9), update(d, rows, 31, F16, 5), -0.3,
                                               0.999)),
            # column-major update (bf16): a tall Newton-Schulz output read in place
            case("fp32w/grid", lambda d: (d.randn(t_rows, 33), d.randn(33, t_rows, 0.01, BF16).T, -0.3, 0.999)),
        ],
    }


#: The case builders, each for a family of ops that share input makers (the op names are their keys).
_FAMILIES = {
    _cases_q8: ("q8_momentum_update_multi_", "quantize_rows", "dequantize_rows"),
    _cases_dense: ("dense_momentum_update_multi_",),
    _cases_codecs: ("pack_int4", "unpack_int4", "ue4m3_encode", "ue4m3_decode", "int4_quantize", "int4_dequantize",
                    "e0m3_quantize", "e0m3_dequantize", "grid_quantize4", "grid_quantize4_with_scale",
                    "grid_dequantize4"),
    _cases_q4_updates: ("int4_momentum_update_multi_", "e0m3_momentum_update_multi_", "e0m3_momentum_amax_multi",
                        "e0m3_momentum_update_with_scale_multi_"),
    _cases_adamw: ("adamw_q_update_",),
    _cases_weights: ("bf16_weight_update_", "bf16_ecc8_weight_update_", "fp32_weight_update_"),
}


def cases(device: torch.device, only: str | None = None, *, sizing: str | None = None,
          geometry: tuple[int, int] | None = None) -> dict[str, list[Case]]:
    """Every op's canary calls on ``device`` (module docstring); ``only``: that op's alone. ``sizing``
    (default ``device.type``) and ``geometry`` (default the device's, an H200's off CUDA) size the grid
    cases, so that tests can build the CUDA cases on the CPU."""
    plan = Plan(sizing or device.type, geometry if geometry is not None else geometry_of(device))
    out: dict[str, list[Case]] = {}
    for family, names in _FAMILIES.items():
        if only is None or only in names:
            built = family(device, plan)
            out.update(built if only is None else {only: built[only]})
    return out
