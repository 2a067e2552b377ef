"""The first-use canary: each compiled op is checked once per device type and process against its reference.

The first time the guarded kernel of an op (:mod:`._kernels`) is about to run the compiled kernel on a
device type, :func:`passes` runs that kernel and the op's pure-PyTorch reference on each of the op's
canary cases (:func:`cases`, 2-4 calls) on the same device, and compares every output and every argument
the op writes (:func:`compare`): bit for bit, except the per-block sums of squares, which the contract
allows to differ by fp32 summation order. On a difference, or an error, in any case, that op stays on the
reference for that device type for the rest of the process, with an error-level log line naming the case;
:func:`failures` lists such ops (``qmuon-doctor`` shows them). So a kernel that computes wrong on a new
GPU, driver or compiler costs speed, never a silent corruption of training, even before anyone runs the
doctor. ``QMUON_CANARY=0`` turns it off.

The cases
---------
They are built from the kernels' code (csrc/cpu/*.cpp, csrc/cuda/*.cu, csrc/qmuon/*.h), so that together
they reach every code path of the op's CPU and CUDA kernels, not one sample (what this canary checked
before: :func:`samples`, a 9 x 100 call that the doctor and the ctypes tests still use). The same cases
run on every device type; only the grid cases' sizes depend on it (:class:`Plan`). Labels:

* ``shapes``: several blocks a row with a short last one, odd widths (a half 4-bit byte), rows shorter
  than a block, rows that are views of wider rows (row stride > cols), stochastic rounding whose noise
  index crosses 2**32 inside a block (:func:`straddle_offset`), NaN and infinities. The multi-tensor
  updates take several matrices in one call (:func:`shape_mats`): A 3 x 603 (strided, fp32 grads,
  stochastic, noise across 2**32), B 5 x 40 (bf16 grads, nearest), D 3 x 5 (fp32 grads with NaN, inf and
  -inf), E 0 x 16 (e0m3 updates: an empty one); two dtype groups, A and D in one; on CUDA 24 more small
  matrices in A's group, which then needs two launches (at most 24 matrices a launch).
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

Tolerances: bits, except sums of squares: ``rtol = 2 * block_size * 2**-24`` (both sides add at most
``block_size`` fp32 squares in different orders; tests/_helpers.py ``sumsq_rtol``, the kernel tests'
bound).

Cost: the checks of all 23 ops (53 calls) in a cold process took 23.9 ms (median of 11, max 30.1 ms) on
this repository's 2-core Intel Xeon (AMX, AVX-512), against 12.5 ms for the single sample per op before
(``benchmarks/results/canary_cost.md``, ``benchmarks/bench_canary.py``; docs/kernels.md). A process pays
it only for the ops it uses, once each.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import threading
import time
import zlib
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

__all__ = ["passes", "failures", "samples", "cases", "compare", "reset", "timings"]

_log = logging.getLogger("qmuon.ops")
_lock = threading.Lock()
#: (op name, device type) -> None (passed) or what differed.
_results: dict[tuple[str, str], str | None] = {}
#: (op name, device type) -> seconds the check took.
_seconds: dict[tuple[str, str], float] = {}
#: Bumped by reset(): the guarded kernels re-resolve their compiled kernel and check it again.
generation = 0


def enabled() -> bool:
    return os.environ.get("QMUON_CANARY", "1").strip() != "0"


def reset() -> None:
    """Forget every result (tests; the next compiled call of each op checks again)."""
    global generation
    with _lock:
        generation += 1
        _results.clear()
        _seconds.clear()


def failures() -> dict[tuple[str, str], str]:
    """``{(op name, device type): what differed}`` of the ops that failed their canary in this process."""
    return {k: v for k, v in _results.items() if v is not None}


def timings() -> dict[tuple[str, str], float]:
    """Seconds each canary took, by (op name, device type)."""
    return dict(_seconds)


def samples(device: torch.device, rows: int = 9, cols: int = 100, bs: int = 32, grid: int = 16
            ) -> dict[str, Callable[[], tuple]]:
    """Arguments of one call of each op with a compiled twin (built fresh per call: the updates mutate
    them). The defaults are the canary's small input; ``qmuon-doctor`` uses a larger one."""
    from . import reference as ref
    from . import reference_4bit as ref4
    from . import reference_adamw as refa
    from . import reference_weight as refw

    gen = torch.Generator().manual_seed(20260)

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    m = randn(rows, cols, scale=0.02)
    g = randn(rows, cols, scale=0.1)
    master = randn(rows, cols).cpu()
    codes4 = torch.randint(-7, 8, (rows, cols), generator=gen, dtype=torch.int8)
    d = lambda t: t.to(device).clone()  # noqa: E731
    stream = ref.noise_stream(7, 3, 1)
    wstream = refw.weight_noise_stream(7, 3, 1)
    # State, built on the CPU by the reference (the same bits on every device) when a sample first needs
    # it: the canary checks one op, and encoding every format for it would cost more than the check.
    memo: dict[str, Any] = {}

    def state(key: str) -> Any:
        if key not in memo:
            memo[key] = {
                "q8": lambda: ref.quantize_rows(m.cpu(), bs, signed=True),
                "i4": lambda: ref4.int4_quantize(m.cpu(), bs),
                "e3": lambda: ref4.e0m3_quantize(m.cpu()),
                "gq": lambda: ref4.grid_quantize4(m.cpu(), grid),
                "m8": lambda: refa.encode_moment(m.cpu(), refa.M8, bs),
                "v8": lambda: refa.encode_moment((g * g).cpu(), refa.V8, bs),
                "wb": lambda: refw.nearest_bf16(master),
                "ecc": lambda: refw.ecc8_encode(master, state("wb")),
            }[key]()
        return memo[key]

    q8 = lambda k: state("q8")[k]  # noqa: E731
    i4 = lambda k: state("i4")[k]  # noqa: E731
    e3 = lambda k: state("e3")[k]  # noqa: E731
    gq = lambda k: state("gq")[k]  # noqa: E731
    m8 = lambda k: state("m8")[k]  # noqa: E731
    v8 = lambda k: state("v8")[k]  # noqa: E731

    def sums(block: int) -> list[Tensor]:
        return [torch.full((rows, ref.num_blocks(cols, block)), float("nan"), device=device)]

    return {
        "q8_momentum_update_multi_": lambda: ([d(q8(0))], [d(q8(1))], [g.to(torch.bfloat16)], sums(bs), 0.95, True,
                                              bs, [stream], [5]),
        "dense_momentum_update_multi_": lambda: ([d(m)], [g.clone()], sums(bs), 0.95, True, bs, [-1], [0]),
        "quantize_rows": lambda: (m.clone(), bs, True, stream, 3),
        "dequantize_rows": lambda: (d(q8(0)), d(q8(1)), bs),
        "pack_int4": lambda: (d(codes4),),
        "unpack_int4": lambda: (d(i4(0)), cols),
        "ue4m3_encode": lambda: (m.abs() * 1000, True),
        "ue4m3_decode": lambda: (torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device),),
        "int4_quantize": lambda: (m.clone(), bs, stream, 2),
        "int4_dequantize": lambda: (d(i4(0)), d(i4(1)), bs, cols),
        "e0m3_quantize": lambda: (m.clone(), True, stream, 1),
        "e0m3_dequantize": lambda: (d(e3(0)), d(e3(1)), d(e3(2)), cols),
        "grid_quantize4": lambda: (m.clone(), grid, stream, 0),
        "grid_quantize4_with_scale": lambda: (m.clone(), grid, d(gq(3)).reshape(1), -1, 0),
        "grid_dequantize4": lambda: (d(gq(0)), d(gq(1)), d(gq(2)), d(gq(3)), grid, cols),
        "int4_momentum_update_multi_": lambda: ([d(i4(0))], [d(i4(1))], [g.clone()], sums(bs), 0.95, True, bs,
                                                [stream], [0]),
        "e0m3_momentum_update_multi_": lambda: ([d(e3(0))], [d(e3(1))], [d(e3(2)).reshape(1)],
                                                [g.to(torch.float16)], sums(bs), 0.95, False, bs, [-1], [0]),
        "e0m3_momentum_amax_multi": lambda: ([d(e3(0))], [d(e3(1))], [d(e3(2)).reshape(1)], [g.clone()], 0.9),
        "e0m3_momentum_update_with_scale_multi_": lambda: (
            [d(e3(0))], [d(e3(1))], [d(e3(2)).reshape(1)], [torch.full((1,), 3e-4, device=device)], [g.clone()],
            sums(16), 0.9, True, 16, [stream], [11]),
        "adamw_q_update_": lambda: (g.to(torch.bfloat16), d(m8(0)), d(m8(1)), d(v8(0)), d(v8(1)),
                                    torch.empty(rows, cols, device=device), 0.9, 0.95, 1e-8, -1e-3, 0.5,
                                    refa.M8, refa.V8, bs, refa.adamw_noise_stream(7, 1, 3), 3 * cols),
        "bf16_weight_update_": lambda: (d(state("wb")), g.clone(), -0.3, 0.999, wstream, 5, cols),
        "bf16_ecc8_weight_update_": lambda: (d(state("wb")), d(state("ecc")), g.clone(), -0.3, 0.999),
        # fp32 weights, a transposed bf16 update (a tall Newton-Schulz output, read in place)
        "fp32_weight_update_": lambda: (d(master), g.to(torch.bfloat16).T.contiguous().mT, -0.3, 0.999),
    }


# ---------------------------------------------------------------------------------------------
# The coverage cases (module docstring: which case reaches which code path)
# ---------------------------------------------------------------------------------------------
#: A canary call: (label, function that builds fresh arguments of one call of the op).
Case = tuple[str, Callable[[], tuple]]

#: Elements of a CPU case's tensors at most (blocks padded): ATen threads its rounding and conversion ops
#: (the references') above this, which on a loaded machine costs milliseconds an op.
CPU_CASE_ELEMENTS = 2048

#: SMs and resident threads per SM of an H200 (sm_90), used when no CUDA device can be asked.
H200_GEOMETRY = (132, 2048)

#: The CUDA kernels' limit of matrices per launch (``kMaxTensorsPerLaunch``, q8_cuda.cu / q4_cuda.cu):
#: a multi-tensor call on CUDA carries this many more, so that one dtype group needs two launches.
CUDA_MATRICES_PER_LAUNCH = 24

_F32, _BF16, _F16, _F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
_I8, _U8 = torch.int8, torch.uint8
_S1, _S2 = 0x9E3779B9, 0x2545F491  # stochastic-rounding streams (any 32-bit values)
_TWO32 = 1 << 32


class Plan:
    """Sizes of the cases on one device type: on CUDA the grid cases launch more CTAs than the device
    keeps resident (so a second wave runs), sized from its SM count and resident threads per SM
    (``geometry``; an H200's when not given); other device types get the CPU's small sizes."""

    def __init__(self, kind: str, geometry: tuple[int, int] = H200_GEOMETRY) -> None:
        self.kind = kind
        self.cuda = kind == "cuda"
        self.sms, self.threads_per_sm = geometry
        #: extra matrices of the multi-tensor calls (CUDA: a second launch of the first dtype group)
        self.extra = CUDA_MATRICES_PER_LAUNCH if self.cuda else 0
        #: the bigblock cases' block: CUDA's largest (4096: 2 warps a CTA), within CPU_CASE_ELEMENTS on the CPU
        self.big_block = 4096 if self.cuda else CPU_CASE_ELEMENTS

    def resident_ctas(self, threads: int) -> int:
        """An upper bound on the CTAs of ``threads`` threads an SM set keeps resident at once (threads
        per SM, at most 32 CTAs per SM; shared memory and registers can only lower it)."""
        return self.sms * min(32, self.threads_per_sm // threads)

    def wave_ctas(self, threads: int) -> int:
        """CTAs of a launch that needs a second wave, the last one partial: 1.5 x the resident bound."""
        return self.resident_ctas(threads) * 3 // 2 + 1

    def rows(self, cpu: int, threads: int, per_cta: float, per_row: float) -> int:
        """Rows of a grid case: ``cpu`` on the CPU; on CUDA enough rows of ``per_row`` work items for
        :meth:`wave_ctas` CTAs of ``threads`` threads that take ``per_cta`` items each."""
        return math.ceil(self.wave_ctas(threads) * per_cta / per_row) if self.cuda else cpu


def geometry_of(device: torch.device) -> tuple[int, int]:
    """(SMs, resident threads per SM) of a CUDA device; an H200's otherwise."""
    if device.type != "cuda":
        return H200_GEOMETRY
    p = torch.cuda.get_device_properties(device)
    return int(p.multi_processor_count), int(getattr(p, "max_threads_per_multi_processor", 2048))


def straddle_offset(cols: int) -> int:
    """A ``row_offset`` at which row 1 of a ``cols``-wide matrix holds global element index 2**32 (the
    stochastic-rounding noise index ``(row_offset + r) * cols + c``) at a column that is not a multiple
    of 16: its block's indices cross 2**32, where the CPU kernels leave their 32-bit counter loop."""
    r = _TWO32 // cols - 1
    c = _TWO32 - (r + 1) * cols
    if not (0 < c < cols and c % 16):
        raise ValueError(f"no straddle at cols={cols}")
    return r


class _M(NamedTuple):
    """One matrix of a multi-tensor case."""
    rows: int
    cols: int
    grad: torch.dtype
    stream: int
    row_offset: int
    pad: int = 0  # > 0: every tensor of it is a view whose rows are longer (row stride > cols)
    state: torch.dtype = _I8  # q8 code dtype / dense buffer dtype


def shape_mats(plan: Plan, state: tuple[torch.dtype, torch.dtype, torch.dtype], empty: bool = False) -> list[_M]:
    """The matrices A, B, (E,) D of a multi-tensor "shapes" case (module docstring), ``state`` their q8 code /
    dense buffer dtypes. Each stays within 2048 elements, blocks padded (the references' rounding ops thread
    above that)."""
    mats = [
        _M(3, 603, _F32, _S1, straddle_offset(603), 9, state[0]),  # blocks, odd cols, strided, noise past 2**32
        _M(5, 40, _BF16, -1, 0, 0, state[1]),  # a row shorter than most blocks, 4-aligned, nearest
        _M(3, 5, _F32, _S2, 5, 0, state[2]),  # rows shorter than any block, NaN / inf grads (A's dtype group)
    ]
    if empty:
        mats.insert(2, _M(0, 16, _F32, -1, 0, 0, state[0]))  # skipped; its e0m3 tensor scale becomes 1
    # CUDA: 24 more in the first dtype group, so that it takes two launches
    mats += [_M(1 + i % 3, 1 + (7 * i) % 41, _F32, _S1 if i % 2 else -1, i, 0, state[0]) for i in range(plan.extra)]
    return mats


class _Data:
    """Random inputs of one case, made on its device with a generator seeded by the case's name."""

    def __init__(self, device: torch.device, key: str) -> None:
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(zlib.crc32(key.encode()))

    def randn(self, rows: int, cols: int, scale: float = 1.0, dtype: torch.dtype = _F32) -> Tensor:
        return (torch.randn(rows, cols, generator=self.gen, device=self.device) * scale).to(dtype)

    def ints(self, lo: int, hi: int, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
        return torch.randint(lo, hi, (rows, cols), generator=self.gen, device=self.device, dtype=dtype)

    def scales(self, rows: int, cols: int, scale: float) -> Tensor:
        """Positive fp32 block scales, and one 0 (a block that decodes to zeros)."""
        t = torch.rand(rows, cols, generator=self.gen, device=self.device) * scale + scale / 8
        if t.numel():
            t.view(-1)[0] = 0.0
        return t

    def nibbles(self, rows: int, cols: int, lo: int = 0) -> Tensor:
        """Packed 4-bit codes ``(rows, ceil(cols / 2))`` of random nibbles in [lo, 15]."""
        n = self.ints(lo, 16, rows, cols + cols % 2, _U8)
        return n[:, 0::2] | (n[:, 1::2] << 4)

    @staticmethod
    def view(t: Tensor, pad: int, offset: int = 0) -> Tensor:
        """``t``'s values in a view with rows ``pad + offset`` elements longer (padding filled with NaN /
        0x5A, which a kernel that reads it would carry into its results)."""
        if pad <= 0 or t.shape[0] == 0:
            return t
        junk = float("nan") if t.is_floating_point() else 0x5A
        wide = torch.full((t.shape[0], t.shape[1] + pad + offset), junk, dtype=t.dtype, device=t.device)
        out = wide[:, offset:offset + t.shape[1]]
        out.copy_(t)
        return out


def _nb(cols: int, block: int) -> int:
    return (cols + block - 1) // block


def _sums(d: _Data, mats: list[_M], block: int) -> list[Tensor]:
    return [torch.full((m.rows, _nb(m.cols, block)), float("nan"), device=d.device) for m in mats]


def _nonfinite(t: Tensor) -> Tensor:
    """``t`` with a NaN, +inf and -inf in its first three rows (columns 1-3)."""
    for i, v in enumerate((float("nan"), float("inf"), float("-inf"))):
        if i < t.shape[0] and i + 1 < t.shape[1]:
            t[i, i + 1] = v
    return t


def _grads(d: _Data, mats: list[_M]) -> list[Tensor]:
    # strided grads start one element in: misaligned for the CUDA q8 kernel's 4-wide loads (its scalar path);
    # the fp32 grads of a shapes case's matrix D carry a NaN and infinities (16-bit NaN payloads are the
    # conversion's, not the contract's: the bits compared are fp32's)
    return [d.view(_nonfinite(g) if m.cols == 5 else g, m.pad, 1)
            for m, g in ((m, d.randn(m.rows, m.cols, 0.1, m.grad)) for m in mats)]


def _cases_q8(device: torch.device, plan: Plan) -> dict[str, list[Case]]:
    def update(key: str, mats: list[_M], bs: int, beta: float, nesterov: bool) -> Case:
        def make() -> tuple:
            d = _Data(device, "q8u/" + key)
            codes = [d.view(d.ints(-127, 128, m.rows, m.cols, _I8) if m.state == _I8
                            else d.ints(1, 256, m.rows, m.cols, _U8), m.pad) for m in mats]
            absmax = [d.view(d.scales(m.rows, _nb(m.cols, bs), 0.05), m.pad and 2) for m in mats]
            return (codes, absmax, _grads(d, mats), _sums(d, mats, bs), beta, nesterov, bs,
                    [m.stream for m in mats], [m.row_offset for m in mats])
        return key, make

    def quantize(key: str, rows: int, cols: int, dtype: torch.dtype, pad: int, bs: int, signed: bool,
                 stream: int, row_offset: int) -> Case:
        def make() -> tuple:
            d = _Data(device, "q8q/" + key)
            return (d.view(d.randn(rows, cols, 0.02, dtype), pad), bs, signed, stream, row_offset)
        return key, make

    def dequantize(key: str, rows: int, cols: int, code: torch.dtype, pad: int, bs: int) -> Case:
        def make() -> tuple:
            d = _Data(device, "q8d/" + key)
            c = d.ints(-127, 128, rows, cols, _I8) if code == _I8 else d.ints(1, 256, rows, cols, _U8)
            return (d.view(c, pad), d.view(d.scales(rows, _nb(cols, bs), 0.05), pad and 3), bs)
        return key, make

    # blocks of 32, one a row: CUDA a warp per row block, 8 a CTA; CPU 64 rows (one chunk, 2048 elements)
    rows = plan.rows(cpu=64, threads=256, per_cta=8, per_row=1)
    big = plan.big_block
    return {
        "q8_momentum_update_multi_": [
            update("shapes", shape_mats(plan, (_I8, _U8, _I8)), 64, 0.3, False),
            update("grid", [_M(rows, 20, _F32, _S1, 7, 0, _U8)], 32, 0.9, True),
            # CUDA: the largest block, 2 warps a CTA (shared-memory budget), 32 steps of the 4-wide loop
            update("bigblock", [_M(1, big, _F16, _S2, 3, 0, _I8)], big, 0.95, True),
        ],
        "quantize_rows": [
            quantize("shapes", 3, 603, _F32, 9, 64, True, _S1, straddle_offset(603)),
            quantize("grid", rows, 21, _BF16, 0, 32, False, -1, 0),
        ],
        "dequantize_rows": [
            dequantize("shapes", 3, 603, _U8, 9, 64),
            dequantize("grid", rows, 21, _I8, 0, 32),
        ],
    }


def _cases_dense(device: torch.device, plan: Plan) -> dict[str, list[Case]]:
    def update(key: str, mats: list[_M], bs: int, beta: float, nesterov: bool) -> Case:
        def make() -> tuple:
            d = _Data(device, "dense/" + key)
            bufs = [d.view(d.randn(m.rows, m.cols, 0.02, m.state), m.pad) for m in mats]
            return (bufs, _grads(d, mats), _sums(d, mats, bs), beta, nesterov, bs,
                    [m.stream for m in mats], [m.row_offset for m in mats])
        return key, make

    rows = plan.rows(cpu=64, threads=256, per_cta=8, per_row=1)  # as the q8 grid case
    return {"dense_momentum_update_multi_": [
        update("shapes", shape_mats(plan, (_BF16, _F32, _F32)), 64, 0.3, False),
        # an fp32 buffer with a stream (which fp32 ignores), a bf16 one rounded to nearest, Nesterov on
        update("grid", [_M(rows, 20, _BF16, _S1, 7, 0, _F32), _M(3, 70, _F16, -1, 1, 0, _BF16)], 32, 0.9, True),
    ]}


def _cases_codecs(device: torch.device, plan: Plan) -> dict[str, list[Case]]:
    def case(key: str, build: Callable[[_Data], tuple]) -> Case:
        return key.split("/")[1], lambda: build(_Data(device, "codec/" + key))

    # CUDA: 256-thread CTAs of a thread per byte / element / block / maximum, as each codec kernel launches, more
    # than one wave of them. CPU: 62-64 rows, at most 2048 elements (module docstring, "Cost").
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

    def specials(d: _Data, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
        x = d.randn(rows, cols).abs() * torch.logspace(-4, 3, cols, device=d.device)
        v = torch.tensor([0.0, -0.0, 2.0 ** -11, 2.0 ** -10, 2.0 ** -9, 3 * 2.0 ** -10, 2.0 ** -6, 0.0626, 447.9,
                          448.0, 449.0, 464.0, 1e30, float("inf"), float("-inf"), -1.0, float("nan")], device=d.device)
        x.view(-1)[:v.numel()] = v
        return x.to(dtype)

    def e3_state(d: _Data, rows: int, cols: int, pad: int) -> tuple:
        return (d.view(d.nibbles(rows, cols), pad), d.ints(0, 0x7F, rows, _nb(cols, 16), _U8),
                torch.tensor(2.5e-5, device=d.device), cols)

    def grid_state(d: _Data, rows: int, cols: int, s: int) -> tuple:
        return (d.nibbles(rows, cols), d.ints(0, 0x7F, rows, _nb(cols, s), _U8),
                d.ints(0, 0x7F, _nb(rows, s), cols, _U8), torch.tensor([3.1e-4], device=d.device), s, cols)

    def x(d: _Data, rows: int, cols: int, dtype: torch.dtype = _F32, pad: int = 0) -> Tensor:
        return d.view(d.randn(rows, cols, 0.02, dtype), pad)

    def scale(d: _Data, v: float) -> Tensor:
        return torch.tensor([v], device=d.device)

    so = straddle_offset(603)
    return {
        "pack_int4": [
            case("pack/shapes", lambda d: (d.view(d.ints(-7, 8, 3, 603, _I8), 9),)),  # odd: a half byte a row
            case("pack/grid", lambda d: (d.ints(-7, 8, pack_rows, 32, _I8),)),  # even: whole bytes
        ],
        "unpack_int4": [
            case("unpack/shapes", lambda d: (d.view(d.nibbles(3, 603), 5), 603)),
            case("unpack/grid", lambda d: (d.nibbles(elem_rows, 32), 32)),
        ],
        "ue4m3_encode": [
            case("ue-enc/specials", lambda d: (specials(d, 7, 37, _F64), False)),  # nearest even; fp64 input
            case("ue-enc/grid", lambda d: (specials(d, elem_rows, 32, _BF16), True)),
        ],
        "ue4m3_decode": [
            # every one of the 256 patterns (and 3 more), a strided view
            case("ue-dec/shapes", lambda d: (d.view((torch.arange(259, device=d.device) % 256).to(_U8).reshape(7, 37),
                                                    3),)),
            case("ue-dec/grid", lambda d: (d.ints(0, 256, elem_rows, 32, _U8),)),
        ],
        "int4_quantize": [
            case("i4q/shapes", lambda d: (x(d, 3, 603, _F32, 9), 64, _S1, so)),
            case("i4q/grid", lambda d: (x(d, i4q_rows, 3, _BF16), 2, -1, 0)),
        ],
        "int4_dequantize": [
            # an odd block: blocks that start in the middle of a byte
            case("i4d/shapes", lambda d: (d.view(d.nibbles(3, 603), 5), d.scales(3, _nb(603, 15), 0.05), 15, 603)),
            case("i4d/grid", lambda d: (d.nibbles(i4d_rows, 21), d.scales(i4d_rows, 1, 0.05), 32, 21)),
        ],
        "e0m3_quantize": [
            case("e3q/shapes", lambda d: (x(d, 3, 603, _BF16, 9), False, -1, 0)),  # one level (tensor scale 1)
            case("e3q/grid", lambda d: (x(d, e3q[0], e3q[1], _F16), True, _S2, 3)),
        ],
        "e0m3_dequantize": [
            case("e3d/shapes", lambda d: e3_state(d, 3, 603, 5)),
            case("e3d/grid", lambda d: e3_state(d, e3d_rows, 33, 0)),
        ],
        "grid_quantize4": [
            case("gq/shapes", lambda d: (x(d, 3, 603, _F32, 9), 4, _S1, so)),  # partial tiles both ways
            case("gq/grid", lambda d: (x(d, gq[0], gq[1], _BF16), 64, -1, 0)),  # a tile larger than the matrix
        ],
        "grid_quantize4_with_scale": [
            case("gqs/shapes", lambda d: (x(d, 3, 603, _F32, 9), 4, scale(d, 1.7e-4), _S1, so)),
            case("gqs/grid", lambda d: (x(d, gq[0], gq[1], _BF16), 64, scale(d, 1.1e-4), -1, 64)),
        ],
        "grid_dequantize4": [
            case("gd/shapes", lambda d: grid_state(d, 3, 603, 2)),
            case("gd/grid", lambda d: grid_state(d, e3d_rows, 33, 64)),
        ],
    }


def _cases_q4_updates(device: torch.device, plan: Plan) -> dict[str, list[Case]]:
    def call(key: str, state: Callable[[_Data, list[_M], int], tuple], mats: list[_M], tail: tuple,
             bs: int) -> Case:
        def make() -> tuple:
            d = _Data(device, key)
            return (*state(d, mats, bs), _grads(d, mats), *tail(d, mats, bs))
        return key.split("/")[1], make

    def int4_state(d: _Data, mats: list[_M], bs: int) -> tuple:
        return ([d.view(d.nibbles(m.rows, m.cols), m.pad) for m in mats],
                [d.view(d.scales(m.rows, _nb(m.cols, bs), 0.05), m.pad and 2) for m in mats])

    def e3_state(d: _Data, mats: list[_M], bs: int) -> tuple:
        return ([d.view(d.nibbles(m.rows, m.cols), m.pad) for m in mats],
                [d.view(d.ints(0, 0x7F, m.rows, _nb(m.cols, 16), _U8), m.pad and 2) for m in mats],
                [torch.full((1,), 2.5e-5 * (1 + i % 3), device=d.device) for i in range(len(mats))])

    def e3_with_scale(d: _Data, mats: list[_M], bs: int) -> tuple:
        return (*e3_state(d, mats, bs), [torch.full((1,), 3.0e-5 * (1 + i % 4), device=d.device)
                                         for i in range(len(mats))])

    def update_tail(beta: float, nesterov: bool) -> Callable[[_Data, list[_M], int], tuple]:
        return lambda d, mats, bs: (_sums(d, mats, bs), beta, nesterov, bs, [m.stream for m in mats],
                                    [m.row_offset for m in mats])

    def amax_tail(beta: float) -> Callable[[_Data, list[_M], int], tuple]:
        return lambda d, mats, bs: (beta,)

    s = shape_mats(plan, (_U8, _U8, _U8))
    se = shape_mats(plan, (_U8, _U8, _U8), empty=True)
    # CUDA: a warp per row block of 32, 8 a CTA (int4, e0m3 pass 2), or 4 chunks of 256 a warp (e0m3 pass 1, the
    # amax op: 20 columns, one chunk a row), more than one wave. CPU: 64 rows of 20.
    warp_rows = plan.rows(cpu=64, threads=256, per_cta=8, per_row=1)
    pass1_rows = plan.rows(cpu=64, threads=256, per_cta=32, per_row=1)
    big = plan.big_block
    return {
        "int4_momentum_update_multi_": [
            call("int4/shapes", int4_state, s, update_tail(0.3, False), 128),
            call("int4/grid", int4_state, [_M(warp_rows, 20, _BF16, _S1, 7)], update_tail(0.9, True), 32),
            call("int4/bigblock", int4_state, [_M(1, big, _F16, _S2, 3)], update_tail(0.95, True), big),
        ],
        "e0m3_momentum_update_multi_": [
            # sums of 8: two per 16-element scale block (CUDA: 8-lane shuffles)
            call("e0m3/shapes", e3_state, se, update_tail(0.3, True), 8),
            call("e0m3/grid", e3_state, [_M(pass1_rows, 20, _F16, _S1, 7)], update_tail(0.9, False), 32),
        ],
        "e0m3_momentum_amax_multi": [
            call("e0m3a/shapes", e3_state, s, amax_tail(0.3), 16),
            call("e0m3a/grid", e3_state, [_M(pass1_rows, 20, _F16, -1, 0)], amax_tail(0.9), 16),
        ],
        "e0m3_momentum_update_with_scale_multi_": [
            # a block of 3 scale blocks (CUDA: a 48-element chunk, two 32-lane steps)
            call("e0m3s/shapes", e3_with_scale, se, update_tail(0.3, False), 48),
            call("e0m3s/grid", e3_with_scale, [_M(warp_rows, 20, _F16, _S1, 7)], update_tail(0.9, True), 32),
        ],
    }


def _cases_adamw(device: torch.device, plan: Plan) -> dict[str, list[Case]]:
    from . import reference_adamw as refa

    def case(key: str, rows: int, cols: int, grad: torch.dtype, m_kind: int, v_kind: int, bs: int, stream: int,
             index0: int, pad: int) -> Case:
        def make() -> tuple:
            d = _Data(device, "adamw/" + key)
            nb = _nb(cols, bs)

            def codes(kind: int) -> Tensor:
                if kind == refa.M8:
                    return d.ints(-127, 128, rows, cols, _I8)
                if kind == refa.V8:
                    return d.ints(0, 256, rows, cols, _U8)
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
        case("shapes", 3, 603, _F32, refa.M4, refa.V4, 202, -1, 0, 9),  # 3 blocks, the last odd: a half byte
        # a block of 520: more elements than a CUDA CTA has threads (256) and 4-bit pairs (512); noise past 2**32
        case("kinds84", 1, 1100, _F16, refa.M8, refa.V4, 520, _S1, _TWO32 - 301, 0),
        case("kinds88", 5, 40, _BF16, refa.M8, refa.V8, 16, _S2, 40, 0),
        case("grid", rows, 21, _F32, refa.M4, refa.V8, 32, _S2, 5, 0),
    ]}


def _cases_weights(device: torch.device, plan: Plan) -> dict[str, list[Case]]:
    def case(key: str, build: Callable[[_Data], tuple]) -> Case:
        return key.split("/")[1], lambda: build(_Data(device, "weight/" + key))

    def bf16(d: _Data, rows: int, cols: int, pad: int = 0) -> Tensor:
        return d.view(d.randn(rows, cols, 0.05, _BF16), pad)

    def update(d: _Data, rows: int, cols: int, dtype: torch.dtype, pad: int = 0) -> Tensor:
        return d.view(d.randn(rows, cols, 0.01, dtype), pad)

    # CUDA: a thread per element, 256 a CTA, more than one wave; CPU: 64 rows (one chunk)
    rows = plan.rows(cpu=64, threads=256, per_cta=256, per_row=31)
    # fp32 weights, a transposed update: CUDA a 32 x 32 tile a CTA of 256 threads (33 columns: 2 tiles a
    # tile-row); CPU 62 x 33, one 64-row tile with 8 x 8 blocks and tails both ways
    t_rows = plan.rows(cpu=62, threads=256, per_cta=1, per_row=2 / 32)
    return {
        "bf16_weight_update_": [
            # stochastic, crossing 2**32 in row 1 (index row stride 1000: a column shard); fp16 update; strided
            case("bf16w/shapes", lambda d: (bf16(d, 3, 603, 9), _nonfinite(update(d, 3, 603, _F16, 5)), -0.3, 0.999,
                                            _S1, _TWO32 - 1000 - 301, 1000)),
            case("bf16w/grid", lambda d: (bf16(d, rows, 31), update(d, rows, 31, _BF16), -0.3, 0.999, -1, 0, 31)),
            case("bf16w/fp32", lambda d: (bf16(d, 5, 37), update(d, 5, 37, _F32), -0.3, 0.999, _S2, 3, 37)),
        ],
        "bf16_ecc8_weight_update_": [
            case("ecc/shapes", lambda d: (bf16(d, 3, 603, 9), d.view(d.ints(-127, 128, 3, 603, _I8), 3),
                                          _nonfinite(update(d, 3, 603, _BF16, 5)), -0.3, 0.999)),
            case("ecc/grid", lambda d: (bf16(d, rows, 31), d.ints(-127, 128, rows, 31, _I8),
                                        update(d, rows, 31, _F16), -0.3, 0.999)),
            case("ecc/fp32", lambda d: (bf16(d, 5, 37), d.ints(-127, 128, 5, 37, _I8), update(d, 5, 37, _F32),
                                        -0.3, 0.999)),
        ],
        "fp32_weight_update_": [
            # neither layout (column stride 2): the element-wise loop
            case("fp32w/shapes", lambda d: (d.randn(5, 37), d.randn(5, 74, 0.01)[:, ::2], -0.3, 0.999)),
            # row-major update (fp16), strided rows
            case("fp32w/grid-rows", lambda d: (d.view(d.randn(rows, 31), 9), update(d, rows, 31, _F16, 5), -0.3,
                                               0.999)),
            # column-major update (bf16): a tall Newton-Schulz output read in place
            case("fp32w/grid", lambda d: (d.randn(t_rows, 33), d.randn(33, t_rows, 0.01, _BF16).T, -0.3, 0.999)),
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


def clone_args(args: tuple) -> tuple:
    return tuple([t.clone() for t in a] if isinstance(a, list) and a and isinstance(a[0], Tensor)
                 else a.clone() if isinstance(a, Tensor) else a for a in args)


def _tensors(x: Any) -> list[Tensor]:
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _bits(t: Tensor) -> Tensor:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    return t


#: Integer views of the float dtypes, for bit-for-bit comparisons (same element size: any strides).
_BIT_VIEWS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
              torch.float64: torch.int64}


def _same_bits(a: Tensor, b: Tensor) -> bool:
    v = _BIT_VIEWS.get(a.dtype)
    return torch.equal(a.view(v), b.view(v)) if v is not None else torch.equal(a, b)


@functools.cache
def _params(reference: Callable[..., Any]) -> tuple[list[str], int | None, int | None]:
    """The parameter names of an op's reference, and where ``block_sumsq`` and ``block_size`` are."""
    code = getattr(reference, "__code__", None)  # a plain function (every reference); inspect is slower
    params = (list(code.co_varnames[:code.co_argcount]) if code is not None
              else list(inspect.signature(reference).parameters))
    return (params, params.index("block_sumsq") if "block_sumsq" in params else None,
            params.index("block_size") if "block_size" in params else None)


def compare(op: Any, out_a: Any, out_b: Any, args_a: tuple, args_b: tuple) -> str | None:
    """None when the outputs and the mutated arguments of two calls of ``op`` (a compiled one on
    ``args_a``, the reference on ``args_b``) agree under the op's contract, else what differs."""
    params, sums_at, bs_at = _params(op.reference)
    pairs: list[tuple[str, Tensor, Tensor, bool]] = []
    for k, (a, b) in enumerate(zip(_tensors(out_a), _tensors(out_b))):
        pairs.append((f"output {k}", a, b, False))
    for i in op.mutated:
        for k, (a, b) in enumerate(zip(_tensors(args_a[i]), _tensors(args_b[i]))):
            pairs.append((f"{params[i]}[{k}]", a, b, i == sums_at))
    for what, a, b, is_sum in pairs:
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{what}: {a.dtype}{tuple(a.shape)} vs reference {b.dtype}{tuple(b.shape)}"
        if is_sum:
            # fp32 sums of <= block_size squares in different orders: each within (n - 1) * 2**-24 of the exact
            # sum, so 2 * block_size * 2**-24 apart at most (tests/_helpers.py sumsq_rtol, the kernel tests')
            rtol = 2 * (args_a[bs_at] if bs_at is not None else 1) * 2.0 ** -24
            if not torch.allclose(a, b, rtol=rtol, atol=1e-30, equal_nan=True):
                return f"{what}: sums of squares differ beyond fp32 order tolerance {rtol:.1e}"
        elif not _same_bits(a, b):  # everything else: bit for bit (the kernels' contract, csrc/qmuon/*.h)
            n = int((_bits(a) != _bits(b)).sum())
            return f"{what}: {n} of {a.numel()} elements differ from the reference"
    return None


def _check_one(op: Any, compiled: Callable[..., Any], make: Callable[[], tuple]) -> str | None:
    args_a = make()
    args_b = clone_args(args_a)
    try:
        out_a = compiled(*args_a)
        out_b = op.reference(*args_b)
        return compare(op, out_a, out_b, args_a, args_b)
    except Exception as err:  # noqa: BLE001 - an error is a failed check, reported with its text
        return f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"


def run_check(op: Any, compiled: Callable[..., Any], device: torch.device,
              labels: tuple[str, ...] | None = None) -> str | None:
    """Run ``compiled`` and ``op.reference`` on every canary case of ``op`` on ``device`` (``labels``: only
    those), in order; what differs in the first case that differs (``"case <label>: ..."``), or None."""
    calls = cases(device, only=op.name).get(op.name)
    if not calls:
        return None  # an op without a sample is not checked (tests/test_canary.py requires one for each)
    for label, make in calls:
        if labels is not None and label not in labels:
            continue
        problem = _check_one(op, compiled, make)
        if problem is not None:
            return f"case {label}: {problem}"
    return None


def passes(op: Any, compiled: Callable[..., Any], device: torch.device) -> bool:
    """Whether ``op``'s compiled kernel may serve ``device.type`` (checking it on the first call)."""
    key = (op.name, device.type)
    result = _results.get(key, 0)
    if result != 0:
        return result is None
    if not enabled():
        return True
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"qmuon: the {op.name} kernel is checked against its reference on its first CUDA call (the first-use "
            "canary), which cannot run inside a CUDA graph capture. Run one optimizer step eagerly before "
            "capturing (the warm-up that torch.cuda.graph needs anyway), or set QMUON_CANARY=0.")
    with _lock:
        if key in _results:
            return _results[key] is None
        t0 = time.perf_counter()
        problem = run_check(op, compiled, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _seconds[key] = time.perf_counter() - t0
        _results[key] = problem
    if problem is not None:
        _log.error("qmuon: the compiled %s kernel on %s does not match its reference (%s); this op runs the "
                   "pure-PyTorch reference on %s from now on. Please report it with the output of qmuon-doctor.",
                   op.name, device.type, problem, device.type)
    return problem is None
