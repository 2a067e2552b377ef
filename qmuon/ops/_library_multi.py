"""What the multi-tensor momentum updates of ``torch.ops.qmuon`` share: their reference loop over the
matrices (:func:`each_matrix`), their fake (:func:`update_fake`), and the checks of their caller-allocated
``block_sumsq`` outputs (:func:`empty_block_sumsq` allocates them).

The 8-bit / dense updates (:mod:`._library`) and the 4-bit ones (:mod:`._library_4bit`) are declared with
these; this module declares no op.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from . import reference as ref

__all__ = ["check_grads_2d", "each_matrix", "empty_block_sumsq", "update_fake"]


def _stream(s: int) -> int | None:
    return None if s < 0 else s


def empty_block_sumsq(mats: list[Tensor], block_size: int) -> list[Tensor]:
    """Uninitialized ``block_sumsq`` outputs for a multi-tensor update of the 2-D ``mats`` (codes,
    bufs or grads): fp32 ``(rows, ceil(cols / block_size))`` per matrix, on its device."""
    return [
        torch.empty((m.shape[0], ref.num_blocks(m.shape[1], block_size)), dtype=torch.float32, device=m.device)
        for m in mats
    ]


def _check_block_sumsq(block_sumsq: list[Tensor], mats: list[Tensor], block_size: int, op: str) -> None:
    """The caller-allocated outputs: one fp32 ``(rows, ceil(cols / block_size))`` tensor per matrix,
    on that matrix's device."""
    if len(block_sumsq) != len(mats):
        raise ValueError(f"qmuon::{op}: got {len(block_sumsq)} block_sumsq outputs for {len(mats)} tensors")
    for i, (out, m) in enumerate(zip(block_sumsq, mats)):
        shape = (m.shape[0], ref.num_blocks(m.shape[1], block_size)) if m.dim() == 2 else None
        if out.dtype != torch.float32 or tuple(out.shape) != shape or out.device != m.device:
            raise ValueError(
                f"qmuon::{op}: block_sumsq {i} must be float32 of shape {shape} on {m.device}, got "
                f"{out.dtype} {tuple(out.shape)} on {out.device}")


def check_grads_2d(grads: list[Tensor], n: int, op: str) -> None:
    if len(grads) != n:
        raise ValueError(f"qmuon::{op}: got {len(grads)} grads for {n} states")


def _grads_device(grads: list[Tensor]) -> torch.device | None:
    return grads[0].device if grads else None


def each_matrix(update_one: Callable[..., Tensor], op: str, states: tuple[list[Tensor], ...], grads: list[Tensor],
                block_sumsq: list[Tensor], beta: float, nesterov: bool, block_size: int, streams: list[int],
                row_offsets: list[int], skip: Optional[Tensor] = None, **per_matrix: list[Any]) -> None:
    """The reference of a multi-tensor update: ``update_one`` (the :mod:`.reference` /
    :mod:`.reference_4bit` update of one matrix) on every matrix, its block sums copied into the
    caller's ``block_sumsq``. ``per_matrix`` lists become keyword arguments of ``update_one``.
    ``skip`` (one flag per matrix): a flagged matrix is updated as the others, then every tensor of it
    (state, grad, block sums) gets its old bits back, selected on the device (no host read)."""
    for lst in (*states, streams, row_offsets, *per_matrix.values()):
        check_grads_2d(grads, len(lst), op)
    _check_block_sumsq(block_sumsq, grads, block_size, op)
    ref.check_skip(skip, len(grads), _grads_device(grads), op)
    flags = ref.skip_flags(skip)
    for i, (g, out) in enumerate(zip(grads, block_sumsq)):
        flag = None if flags is None else flags[i]
        written = (*(st[i] for st in states), g, out)
        saved = ref.snapshot(flag, written)
        out.copy_(update_one(*(st[i] for st in states), g, beta=beta, nesterov=nesterov, block_size=block_size,
                             stream=_stream(streams[i]), row_offset=row_offsets[i],
                             **{k: v[i] for k, v in per_matrix.items()}))
        ref.restore(flag, written, saved)


def update_fake(op: Any) -> None:
    """The fake of a multi-tensor update (``op``, a :class:`._library.QmuonOp`): it returns None, after
    the reference's check of the ``block_sumsq`` outputs against the grads."""
    params = list(inspect.signature(op.reference).parameters)
    i_grads, i_sums, i_bs, i_skip = (params.index(p) for p in ("grads", "block_sumsq", "block_size", "skip"))

    def fake(*args: Any) -> None:
        _check_block_sumsq(args[i_sums], args[i_grads], args[i_bs], op.name)
        ref.check_skip(args[i_skip] if len(args) > i_skip else None, len(args[i_grads]),
                       _grads_device(args[i_grads]), op.name)

    op.register_fake(fake)
