"""Schemas of the ``torch.ops.qmuon`` operators, in one place.

Each op is declared with ``torch.library.custom_op`` (mutation annotations via ``mutates_args``),
its default implementation is the pure-PyTorch reference in :mod:`.reference`, and a fake
implementation describes output shapes for ``torch.compile`` / meta tensors. Compiled CPU and CUDA
kernels register themselves for their device types on top of these defaults.

Multi-tensor ops take lists; ``streams`` and ``row_offsets`` are per tensor. A stream of -1 means
nearest rounding, anything else is the 32-bit stochastic-rounding stream of that tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference as ref

_NS = "qmuon"


def _stream(s: int) -> int | None:
    return None if s < 0 else s


@torch.library.custom_op(f"{_NS}::q8_momentum_update_multi_", mutates_args=("codes", "absmax", "grads"))
def q8_momentum_update_multi_(
    codes: list[Tensor],
    absmax: list[Tensor],
    grads: list[Tensor],
    beta: float,
    nesterov: bool,
    block_size: int,
    streams: list[int],
    row_offsets: list[int],
) -> list[Tensor]:
    """8-bit (int8 or uint8 codes) momentum update over many matrices.

    Overwrites every grad with its Newton-Schulz input and returns, per tensor, the fp32 sum of
    squares of that input for each row block, shaped like the tensor's absmax.
    """
    return [
        ref.q8_momentum_update_(
            c, a, g, beta=beta, nesterov=nesterov, block_size=block_size,
            stream=_stream(s), row_offset=o,
        )
        for c, a, g, s, o in zip(codes, absmax, grads, streams, row_offsets, strict=True)
    ]


@q8_momentum_update_multi_.register_fake
def _(codes, absmax, grads, beta, nesterov, block_size, streams, row_offsets):
    return [torch.empty_like(a, dtype=torch.float32) for a in absmax]


@torch.library.custom_op(f"{_NS}::dense_momentum_update_multi_", mutates_args=("bufs", "grads"))
def dense_momentum_update_multi_(
    bufs: list[Tensor],
    grads: list[Tensor],
    beta: float,
    nesterov: bool,
    block_size: int,
    streams: list[int],
    row_offsets: list[int],
) -> list[Tensor]:
    """fp32 / bf16 momentum update with the same contract as ``q8_momentum_update_multi_``."""
    return [
        ref.dense_momentum_update_(
            b, g, beta=beta, nesterov=nesterov, block_size=block_size,
            stream=_stream(s), row_offset=o,
        )
        for b, g, s, o in zip(bufs, grads, streams, row_offsets, strict=True)
    ]


@dense_momentum_update_multi_.register_fake
def _(bufs, grads, beta, nesterov, block_size, streams, row_offsets):
    return [
        torch.empty((b.shape[0], ref.num_blocks(b.shape[1], block_size)), dtype=torch.float32, device=b.device)
        for b in bufs
    ]


@torch.library.custom_op(f"{_NS}::quantize_rows", mutates_args=())
def quantize_rows(x: Tensor, block_size: int, signed: bool, stream: int, row_offset: int) -> tuple[Tensor, Tensor]:
    """fp32 matrix -> (codes, absmax) in the row-block layout."""
    noise = None if stream < 0 else ref.uniform_noise(*x.shape, stream, row_offset, x.device)
    return ref.quantize_rows(x, block_size, signed=signed, noise=noise)


@quantize_rows.register_fake
def _(x, block_size, signed, stream, row_offset):
    rows, cols = x.shape
    codes = torch.empty((rows, cols), dtype=torch.int8 if signed else torch.uint8, device=x.device)
    absmax = torch.empty((rows, ref.num_blocks(cols, block_size)), dtype=torch.float32, device=x.device)
    return codes, absmax


@torch.library.custom_op(f"{_NS}::dequantize_rows", mutates_args=())
def dequantize_rows(codes: Tensor, absmax: Tensor, block_size: int) -> Tensor:
    """(codes, absmax) -> fp32 matrix."""
    return ref.dequantize_rows(codes, absmax, block_size)


@dequantize_rows.register_fake
def _(codes, absmax, block_size):
    return torch.empty(codes.shape, dtype=torch.float32, device=codes.device)


# Compiled CPU / CUDA kernels (csrc/, built on first use) take over on the devices they support and
# fall back to the reference above when they are unavailable; see _extension.py.
from . import _extension  # noqa: E402

_extension.register_compiled_kernels({
    "q8_momentum_update_multi_": q8_momentum_update_multi_,
    "quantize_rows": quantize_rows,
    "dequantize_rows": dequantize_rows,
})
