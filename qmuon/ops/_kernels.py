"""The compiled kernels behind the ``torch.ops.qmuon`` ops: what they accept, and their registration.

Every op of :mod:`._library` that has a compiled twin (``torch.ops.qmuon_C.<same name>``, built by
:mod:`._extension`) declares, next to its schema, a predicate saying whether the compiled kernel
supports a call's arguments (``@op.compiled_when``; the building blocks are below).
:func:`register_compiled_kernels` then gives every such op one guarded kernel for the ``CPU`` key (and
``CUDA`` when torch has CUDA), made by one factory: the compiled op when the extension is loaded for
that device and the predicate holds, the reference otherwise. So an unsupported argument (float64
grads, ``block_size`` > 4096, an odd int4 block, ...) or a failed build costs speed, never a result.

:data:`served` counts, per ``(op name, "compiled" | "reference")``, which implementation the guarded
kernels ran, so that tests can tell a compiled run from a silent fallback (the results are the same
by design, so comparing them cannot).
"""

from __future__ import annotations

import collections
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

from . import _canary, _extension

if TYPE_CHECKING:
    from ._library import QmuonOp

__all__ = ["served"]

MAX_BLOCK_SIZE = 4096  # csrc/qmuon/block_math.h: kMaxBlockSize
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CODE_DTYPES = (torch.int8, torch.uint8)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # codec inputs (cast to fp32)
DENSE_BUF_DTYPES = (torch.float32, torch.bfloat16)

#: Calls served by the guarded kernels: ``served[(op_name, "compiled")]``, ``served[(op_name, "reference")]``.
served: collections.Counter[tuple[str, str]] = collections.Counter()


# ---------------------------------------------------------------------------------------------
# Building blocks of the "compiled kernel supports these arguments" predicates
# ---------------------------------------------------------------------------------------------
def block_ok(block_size: int) -> bool:
    return 1 <= block_size <= MAX_BLOCK_SIZE


def int4_block_ok(block_size: int) -> bool:
    # Two codes per byte: an odd block would split a byte between two blocks (two writers).
    return 2 <= block_size <= MAX_BLOCK_SIZE and block_size % 2 == 0


def e0m3_block_ok(block_size: int) -> bool:
    # block_size only sets the sums-of-squares granularity; the kernels walk units of max(block_size, 16)
    # that hold whole 16-element scale blocks and whole sum blocks.
    return block_ok(block_size) and (block_size % 16 == 0 or 16 % block_size == 0)


def mats_ok(ts: Iterable[Tensor], dtypes: Sequence[torch.dtype]) -> bool:
    return all(t.dim() == 2 and t.dtype in dtypes for t in ts)


def lists_ok(n: int, *lists: Sequence[Any]) -> bool:
    return all(len(x) == n for x in lists)


def grads_and_sums_ok(grads: Sequence[Tensor], block_sumsq: Sequence[Tensor]) -> bool:
    """The grads and ``block_sumsq`` outputs of a multi-tensor update (one fp32 output per grad)."""
    return len(block_sumsq) == len(grads) and mats_ok(grads, GRAD_DTYPES) and mats_ok(block_sumsq, (torch.float32,))


def scalar_ok(t: Tensor, device: torch.device) -> bool:
    """A one-element fp32 tensor on ``device`` (the e0m3 tensor scales, a given grid scale)."""
    return t.dtype == torch.float32 and t.numel() == 1 and t.device == device


def scalars_ok(ts: Sequence[Tensor], like: Sequence[Tensor]) -> bool:
    return all(scalar_ok(t, g.device) for t, g in zip(ts, like))


#: dtypes of the ``skip`` flags the compiled kernels read (one byte per flag; nonzero skips).
SKIP_DTYPES = (torch.bool, torch.uint8)


def skip_ok(skip: Tensor | None, like: Tensor | Sequence[Tensor]) -> bool:
    """The ``skip`` flags of a state-mutating op: none, or what the compiled kernels read: bool / uint8, one
    flag per matrix of ``like`` (a list: a multi-tensor update) or one (``like`` a tensor: a single-matrix
    op), on their device. Other flags (another dtype, count or device) run the reference, which checks them."""
    if skip is None:
        return True
    if isinstance(like, Tensor):
        n, device = 1, like.device
    else:
        n, device = len(like), (like[0].device if len(like) else skip.device)
    return skip.dtype in SKIP_DTYPES and skip.numel() == n and skip.device == device


def packed_ok(packed: Tensor, cols: int) -> bool:
    """uint8 ``(rows, ceil(cols / 2))``: the packed 4-bit codes of ``cols`` columns."""
    return packed.dim() == 2 and packed.dtype == torch.uint8 and cols >= 0 and (cols + 1) // 2 == packed.shape[1]


def _probe_once(cache: dict[str, bool], device: torch.device, kernel: str, fn_name: str,
                probe: Callable[[torch.device], bool], mismatch: str) -> bool:
    """``cache[device.type]``, computed on the first call by ``probe(device)`` (a bit-for-bit comparison of
    a compiled kernel with torch's own arithmetic). The probe copies to the device and compares on the
    host, so it refuses to run inside a CUDA graph capture; ``mismatch`` is the warning when it fails."""
    key = device.type
    if key not in cache:
        if key == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"qmuon: the {kernel} kernel is probed on its first CUDA call, which cannot happen "
                "inside a CUDA graph capture. Run one optimizer step eagerly before capturing (the warm-up that "
                f"torch.cuda.graph needs anyway), or call qmuon.ops._kernels.{fn_name}(device) first.")
        cache[key] = probe(device)
        if not cache[key]:
            warnings.warn(f"qmuon: this torch build's {key} {mismatch}", RuntimeWarning, stacklevel=4)
    return cache[key]


_lerp_fused: dict[str, bool] = {}


def _dense_probe(device: torch.device) -> bool:
    from . import reference as ref

    gen = torch.Generator().manual_seed(1234)
    ok = True
    for buf_dtype in DENSE_BUF_DTYPES:
        buf = torch.randn(5, 333, generator=gen).to(buf_dtype).to(device)
        grad = torch.randn(5, 333, generator=gen).to(device)
        r_buf, r_grad = buf.clone(), grad.clone()
        sums = [torch.empty(5, 2, device=device)]
        compiled_op("dense_momentum_update_multi_", device.type)([buf], [grad], sums, 0.95, True, 256, [-1], [0])
        ref.dense_momentum_update_(r_buf, r_grad, beta=0.95, nesterov=True, block_size=256)
        bits = torch.int16 if buf_dtype == torch.bfloat16 else torch.int32
        ok = ok and torch.equal(buf.view(bits), r_buf.view(bits))
        ok = ok and torch.equal(grad.view(torch.int32), r_grad.view(torch.int32))
    return ok


def dense_matches_torch(device: torch.device) -> bool:
    """Whether the compiled dense update reproduces torch's ``lerp`` on this device, bit for bit.

    The fp32 dense format must stay identical to ``torch.optim.Muon`` (``buf.lerp_(grad, 1 - beta)``),
    whose lerp rounds once (a fused multiply-add on CPU, contracted by nvcc on CUDA), as the kernel
    does. A torch build without FMA (an old CPU, ``ATEN_CPU_CAPABILITY=default``) rounds twice; this
    probe, run once per device type, compares the kernel with the reference where the two roundings
    differ, and the dense op stays on the reference if they disagree.
    """
    return _probe_once(_lerp_fused, device, "dense momentum", "dense_matches_torch", _dense_probe,
                       "lerp does not round like the compiled dense update (no FMA); fp32/bf16 momentum uses the "
                       "pure-PyTorch reference.")


_add_fused: dict[str, bool] = {}


def _fp32_write_probe(device: torch.device) -> bool:
    gen = torch.Generator().manual_seed(4321)
    ok = True
    for rows, cols, transposed, udt in ((67, 333, False, torch.float32), (67, 333, True, torch.bfloat16),
                                        (130, 67, True, torch.float32), (5, 1029, False, torch.bfloat16),
                                        (3, 7, False, torch.float16)):
        w = torch.randn(rows, cols, generator=gen).to(device)
        u = torch.randn((cols, rows) if transposed else (rows, cols), generator=gen).to(udt).to(device)
        u = u.mT if transposed else u
        a, b = w.clone(), w.clone()
        compiled_op("fp32_weight_update_", device.type)(a, u, -0.0213, 0.9998)
        b.mul_(0.9998)
        b.add_(u, alpha=-0.0213)
        ok = ok and torch.equal(a.view(torch.int32), b.view(torch.int32))
    return ok


def fp32_write_matches_torch(device: torch.device) -> bool:
    """Whether the compiled fp32 weight write reproduces torch's ``param.mul_(decay);
    param.add_(update, alpha=alpha)`` on this device, bit for bit.

    The kernel rounds the add once (``fma(update, alpha, param * decay)``), as torch's CPU add does on
    AVX2 / AVX-512 builds (``vec::fmadd`` in the vector loop, the same FMA in the contracted scalar
    tail) and its CUDA kernel does; on an x86 build without FMA (``ATEN_CPU_CAPABILITY=default``) torch
    rounds the product and the sum separately. This probe, run once per device type, compares the
    kernel with torch's own two ops on shapes with vector tails, a transposed update and bf16 / fp32
    updates (inputs where one and two roundings differ in thousands of elements); on any difference
    the op stays on the reference (torch's ops), with a warning.
    """
    if device.type not in _add_fused and not _compiled_for(device.type):
        return False  # no compiled kernel on this device: nothing to compare
    return _probe_once(_add_fused, device, "fp32 weight-write", "fp32_write_matches_torch", _fp32_write_probe,
                       "add does not round like the compiled fp32 weight write (no FMA); fp32 weights are written "
                       "with torch's mul_ / add_.")


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------
def _compiled_for(device_type: str) -> bool:
    st = _extension.status()  # loads (or builds) the extension on the first call
    return st.cuda if device_type == "cuda" else st.cpu


def compiled_op(name: str, device_type: str) -> Callable[..., Any]:
    """The compiled kernel of op ``name`` for ``device_type`` (the extension must be loaded for it):
    ``torch.ops.qmuon_C.<name>`` of the JIT build, or on CUDA the prebuilt GPU library's twin
    (:class:`._cabi.CAbiOps`) when that is where the CUDA kernels come from."""
    st = _extension.status()
    if device_type == "cuda" and st.cuda_source == "prebuilt":
        return st.gpu_library.ops.get(name)
    return getattr(torch.ops.qmuon_C, name)  # qmuon_C exists once status() has loaded it


def _device_of(args: Sequence[Any]) -> torch.device | None:
    for a in args:
        if isinstance(a, Tensor):
            return a.device
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], Tensor):
            return a[0].device
    return None


def _guarded_kernel(op: QmuonOp, device_type: str) -> Callable[..., Any]:
    """The kernel of ``op`` for one device type: its compiled kernel (:func:`compiled_op`) when the
    extension is loaded for it, ``op.supported(*args)`` holds and the op passed its first-use canary on
    this device type (:mod:`._canary`), else ``op.reference``."""
    name, supported, reference = op.name, op.supported, op.reference
    compiled_key, reference_key = (name, "compiled"), (name, "reference")
    # [canary generation it was resolved in, compiled kernel, canary passed]: after the first call a
    # compiled call costs one int comparison more (_canary.reset() starts over, for tests).
    state: list[Any] = [-1, None, False]

    def kernel(*args: Any) -> Any:
        if _compiled_for(device_type) and supported(*args):
            if state[0] != _canary.generation:
                state[:] = [_canary.generation, compiled_op(name, device_type), False]
            fn = state[1]
            if state[2] or _canary_passes(fn, args):
                state[2] = True
                served[compiled_key] += 1
                return fn(*args)
        served[reference_key] += 1
        return reference(*args)

    def _canary_passes(fn: Callable[..., Any], args: tuple) -> bool:
        device = _device_of(args)
        return device is None or _canary.passes(op, fn, device)

    kernel.__name__ = name
    return kernel


_registered = False


def register_compiled_kernels(ops: Iterable[QmuonOp]) -> None:
    """Register the guarded kernel of every op in ``ops`` that has a ``compiled_when`` predicate for
    ``CPU`` (and ``CUDA`` when torch has CUDA). Nothing is built here, and nothing is registered under
    ``QMUON_BACKEND=reference``."""
    global _registered
    if _registered or os.environ.get("QMUON_BACKEND", "").strip().lower() == "reference":
        return
    device_types = ["cpu"] + (["cuda"] if torch.version.cuda is not None else [])
    for op in ops:
        if op.supported is None:
            continue
        for device_type in device_types:
            op.register_kernel(device_type.upper(), _guarded_kernel(op, device_type))
    _registered = True
