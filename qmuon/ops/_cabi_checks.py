"""Argument checks and layout helpers of the C-ABI twin (:mod:`._cabi`): what ``csrc/binding_common.h``
does in C++ before it calls a kernel, in Python. A check that fails raises ``RuntimeError("qmuon: <op>
...")`` naming the tensor, its shape and the shape it needs; the messages are built only on failure."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ._cabi_structs import MAX_BLOCK

def _layout_ok(t: Tensor) -> bool:
    """The kernels index element (r, c) as base + r * row_stride + c."""
    return t.is_contiguous() or ((t.shape[1] <= 1 or t.stride(1) == 1) and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1]))


def _rs(t: Tensor) -> int:
    return t.shape[1] if t.shape[0] <= 1 else t.stride(0)


def _nb(cols: int, block: int) -> int:
    return (cols + block - 1) // block


def _s32(stream: int) -> int:
    return -1 if stream < 0 else stream & 0xFFFFFFFF


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(ok: bool, op: str, msg: str | Callable[[], str]) -> None:
    """Raise ``RuntimeError("qmuon: <op> <msg>")`` unless ``ok``. ``msg`` may be a callable, so that the
    message (tuple formatting: about a microsecond) is only built when the check fails."""
    if not ok:
        raise RuntimeError(f"qmuon: {op} {msg() if callable(msg) else msg}")


def _check_2d(t: Tensor, dtype: torch.dtype, rows: int, cols: int, what: str, i: int, op: str, hint: str = "") -> None:
    if t.dtype != dtype:
        _check(False, op, f"{what} {i} must be {dtype}, got {t.dtype}")
    if t.dim() != 2 or t.shape[0] != rows or t.shape[1] != cols:
        _check(False, op, f"{what} {i} has shape {tuple(t.shape)} but needs ({rows}, {cols}){hint}")


def _check_grad(g: Tensor, i: int, state: Tensor, op: str) -> None:
    _check(g.dim() == 2, op, lambda: f"grad {i} must be 2-D, got {g.dim()}-D")
    _check(g.dtype in (torch.float32, torch.bfloat16, torch.float16), op,
           lambda: f"grads must be float32, bfloat16 or float16, got {g.dtype}")
    _check(g.device == state.device, op, lambda: f"grad {i} is on {g.device} but its state is on {state.device}")


def _check_scalar(t: Tensor, what: str, i: int, device: torch.device, op: str) -> None:
    _check(t.dtype == torch.float32 and t.numel() == 1 and t.device == device, op,
           lambda: f"{what} {i} must be a one-element float32 tensor on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def _check_lists(op: str, n: int, **others: Sequence[Any]) -> None:
    for name, xs in others.items():
        _check(len(xs) == n, op, lambda: f"needs lists of equal length, got {n} states and {len(xs)} {name}")


def _check_sums(sums: Sequence[Tensor], i: int, g: Tensor, block: int, op: str) -> None:
    _check(len(sums) > i, op, "needs one block_sumsq output per tensor")
    _check_2d(sums[i], torch.float32, g.shape[0], _nb(g.shape[1], block), "block_sumsq", i, op,
              " (rows, ceil(cols / block_size)) of its grad")
    _check(sums[i].get_device() == g.get_device(), op,
           lambda: f"block_sumsq {i} is on {sums[i].device} but its grad is on {g.device}")


def _skip_flags(skip: Tensor | None, n: int, device: torch.device | None, op: str) -> Tensor | None:
    """The ``skip`` flags of a call as the kernels read them (``csrc/binding_common.h``, ``skip_flags``): None,
    or ``n`` bytes (bool or uint8) on ``device`` (None: any), contiguous. Nothing here reads a flag; the caller
    keeps the returned tensor alive until the kernels have run."""
    if skip is None:
        return None
    _check(skip.dtype in (torch.bool, torch.uint8), op, lambda: f"skip must be bool or uint8, got {skip.dtype}")
    _check(skip.numel() == n, op, lambda: f"skip must hold one flag per matrix ({n}), got {skip.numel()}")
    _check(device is None or skip.device == device, op,
           lambda: f"skip is on {skip.device} but the matrices are on {device}")
    return skip.reshape(-1).contiguous()


def _skip_at(flags: Tensor | None, i: int) -> int | None:
    """The address of flag ``i`` (NULL without flags): bool and uint8 are one byte per flag."""
    return None if flags is None else flags.data_ptr() + i


def _check_block(block_size: int, op: str) -> None:
    _check(1 <= block_size <= MAX_BLOCK, op, lambda: f"block_size must be in [1, {MAX_BLOCK}], got {block_size}")


def _check_packed(packed: Tensor, cols: int, op: str) -> int:
    """Check a packed 4-bit tensor (uint8, two codes a byte) holding ``cols`` codes a row; its rows."""
    _check(packed.dim() == 2, op, lambda: f"packed must be 2-D, got {packed.dim()}-D")
    _check(cols >= 0 and (cols + 1) // 2 == packed.shape[1], op,
           lambda: f"{packed.shape[1]} packed columns cannot hold {cols} codes")
    _check_2d(packed, torch.uint8, packed.shape[0], (cols + 1) // 2, "packed", 0, op)
    return packed.shape[0]


def _same_device(t: Tensor, what: str, first: Tensor, op: str) -> None:
    _check(t.device == first.device, op,
           lambda: f"{what} is on {t.device} but packed is on {first.device}; move every argument to one device")


class _Writables:
    """Tensors a kernel writes: each the tensor itself, or a copy in the kernel layout that is written
    back after the call (``dense``: fully contiguous, as the sums of squares must be)."""

    __slots__ = ("pairs",)

    def __init__(self) -> None:
        self.pairs: list[tuple[Tensor, Tensor]] = []

    def add(self, t: Tensor, dense: bool = False) -> Tensor:
        work = t if (t.is_contiguous() if dense else _layout_ok(t)) else t.contiguous()
        if work is not t:
            self.pairs.append((t, work))
        return work

    def write_back(self) -> None:
        for orig, work in self.pairs:
            orig.copy_(work)


def _work(w: _Writables, t: Tensor, cols: int) -> tuple[Tensor, int]:
    """``(tensor the kernel writes, its row stride)``: ``t`` itself when contiguous (the common case,
    with no further checks), else through ``w``."""
    if t.is_contiguous():
        return t, cols
    work = w.add(t)
    return work, _rs(work)


def _grouped(keys: list[Any], tensors: list[Any]) -> list[tuple[Any, list[Any]]]:
    """``tensors`` grouped by ``keys`` (one launch per dtype combination), in first-seen order; nearly
    always one group, found without building a dict."""
    if not keys:
        return []
    if keys.count(keys[0]) == len(keys):
        return [(keys[0], tensors)]
    return [(k, [t for t, kt in zip(tensors, keys) if kt == k]) for k in dict.fromkeys(keys)]


def _f32c(t: Tensor) -> Tensor:
    return (t if t.dtype == torch.float32 else t.to(torch.float32)).contiguous()
