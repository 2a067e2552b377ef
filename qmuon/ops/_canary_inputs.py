"""The sizes and the inputs of the first-use canary's coverage cases (:mod:`._canary_cases`).

:class:`Plan` sizes the cases on one device type (on CUDA, more CTAs than the device keeps resident, from
:func:`geometry_of`); :func:`shape_mats` lists the matrices of a multi-tensor "shapes" case, with the noise
offset of :func:`straddle_offset` (a block whose stochastic-rounding indices cross 2**32); :class:`CaseData`
makes one case's random tensors, seeded by the case's name, as strided views where a case asks for them. The
short dtype and stream names (``F32``, ``S1``, ...) keep the case tables readable.
"""

from __future__ import annotations

import math
import zlib
from typing import NamedTuple

import torch
from torch import Tensor

#: Elements of a CPU case's tensors at most (blocks padded): ATen threads its rounding and conversion ops
#: (the references') above this, which on a loaded machine costs milliseconds an op.
CPU_CASE_ELEMENTS = 2048

#: SMs and resident threads per SM of an H200 (sm_90), used when no CUDA device can be asked.
H200_GEOMETRY = (132, 2048)

#: The CUDA kernels' limit of matrices per launch (``kMaxTensorsPerLaunch``, q8_cuda.cu / q4_cuda.cu):
#: a multi-tensor call on CUDA carries this many more, so that one dtype group needs two launches.
CUDA_MATRICES_PER_LAUNCH = 24

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
I8, U8 = torch.int8, torch.uint8
S1, S2 = 0x9E3779B9, 0x2545F491  # stochastic-rounding streams (any 32-bit values)
TWO32 = 1 << 32


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
    r = TWO32 // cols - 1
    c = TWO32 - (r + 1) * cols
    if not (0 < c < cols and c % 16):
        raise ValueError(f"no straddle at cols={cols}")
    return r


class Mat(NamedTuple):
    """One matrix of a multi-tensor case."""
    rows: int
    cols: int
    grad: torch.dtype
    stream: int
    row_offset: int
    pad: int = 0  # > 0: every tensor of it is a view whose rows are longer (row stride > cols)
    state: torch.dtype = I8  # q8 code dtype / dense buffer dtype


def shape_mats(plan: Plan, state: tuple[torch.dtype, torch.dtype, torch.dtype], empty: bool = False) -> list[Mat]:
    """The matrices A, B, (E,) D of a multi-tensor "shapes" case (:mod:`._canary_cases`' docstring), ``state``
    their q8 code / dense buffer dtypes. Each stays within 2048 elements, blocks padded (the references'
    rounding ops thread above that)."""
    mats = [
        Mat(3, 603, F32, S1, straddle_offset(603), 9, state[0]),  # blocks, odd cols, strided, noise past 2**32
        Mat(5, 40, BF16, -1, 0, 0, state[1]),  # a row shorter than most blocks, 4-aligned, nearest
        Mat(3, 5, F32, S2, 5, 0, state[2]),  # rows shorter than any block, NaN / inf grads (A's dtype group)
    ]
    if empty:
        mats.insert(2, Mat(0, 16, F32, -1, 0, 0, state[0]))  # skipped; its e0m3 tensor scale becomes 1
    # CUDA: 24 more in the first dtype group, so that it takes two launches
    mats += [Mat(1 + i % 3, 1 + (7 * i) % 41, F32, S1 if i % 2 else -1, i, 0, state[0]) for i in range(plan.extra)]
    return mats


class CaseData:
    """Random inputs of one case, made on its device with a generator seeded by the case's name."""

    def __init__(self, device: torch.device, key: str) -> None:
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(zlib.crc32(key.encode()))

    def randn(self, rows: int, cols: int, scale: float = 1.0, dtype: torch.dtype = F32) -> Tensor:
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
        n = self.ints(lo, 16, rows, cols + cols % 2, U8)
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


def n_blocks(cols: int, block: int) -> int:
    return (cols + block - 1) // block


def nan_sums(d: CaseData, mats: list[Mat], block: int) -> list[Tensor]:
    return [torch.full((m.rows, n_blocks(m.cols, block)), float("nan"), device=d.device) for m in mats]


def with_nonfinite(t: Tensor) -> Tensor:
    """``t`` with a NaN, +inf and -inf in its first three rows (columns 1-3)."""
    for i, v in enumerate((float("nan"), float("inf"), float("-inf"))):
        if i < t.shape[0] and i + 1 < t.shape[1]:
            t[i, i + 1] = v
    return t


def case_grads(d: CaseData, mats: list[Mat]) -> list[Tensor]:
    # strided grads start one element in: misaligned for the CUDA q8 kernel's 4-wide loads (its scalar path);
    # the fp32 grads of a shapes case's matrix D carry a NaN and infinities (16-bit NaN payloads are the
    # conversion's, not the contract's: the bits compared are fp32's)
    return [d.view(with_nonfinite(g) if m.cols == 5 else g, m.pad, 1)
            for m, g in ((m, d.randn(m.rows, m.cols, 0.1, m.grad)) for m in mats)]
