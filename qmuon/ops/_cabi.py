"""The kernels' C ABI from Python: ctypes mirrors of its structs and a Python twin of the torch binding.

``csrc/qmuon/kernels.h``, ``adamw_kernels.h`` and ``weight_kernels.h`` declare ``qmuon_cpu_*`` and
``qmuon_cuda_*`` entry points that take raw pointers, row strides and (CUDA) a ``cudaStream_t``. The
JIT-built ``qmuon_C`` library calls them from C++ (``csrc/binding*.h``: argument checks, the unit
column stride the kernels need, grouping by dtype, output allocation). The prebuilt GPU library
(``qmuon/_lib/libqmuon_cuda<major>.so``, :mod:`.build_gpu`) has no torch in it, so this module does
that binding's work in Python and calls the entry points with ctypes:

* :class:`CAbiOps` binds one loaded library for one device kind (``"cpu"``: ``qmuon_cpu_<fn>(args)``;
  ``"cuda"``: ``qmuon_cuda_<fn>(args, stream)`` on torch's current stream, under a device guard);
* its methods have the arguments of the ``torch.ops.qmuon`` ops of the same name, check what the
  kernels cannot check themselves (shapes and devices: a mis-shaped pointer on a GPU is a memory fault,
  not an error), and return / mutate exactly as the C++ binding does.

The argument checks and layout helpers are in :mod:`._cabi_checks`, the standalone codec methods in
:mod:`._cabi_codecs` (a mixin), the struct mirrors in :mod:`._cabi_structs`.

The same class runs against the CPU build of the same ABI (the ``qmuon_cpu_*`` functions exported by
the JIT-built CPU library), so CI exercises every line of the GPU path's Python side on a CPU
(``tests/test_cabi.py``). :func:`layout` lists the structs' sizes and field offsets; the libraries
export the C compiler's list (``qmuon_*_abi_layout``, ``csrc/qmuon/abi_layout.h``) and a library
whose list differs is not used.
"""

from __future__ import annotations

import ctypes as C
from typing import Any, Callable

import torch
from torch import Tensor

from ._cabi_checks import (_check, _check_2d, _check_block, _check_grad, _check_lists, _check_scalar, _check_sums,
                           _grouped, _layout_ok, _nb, _rs, _s32, _skip_at, _skip_flags, _work, _Writables)
from ._cabi_codecs import CodecTwins
from ._cabi_structs import (  # noqa: F401 (library_layout: the loader and tests read it here)
    I8, U8, _DTYPE, MAX_BLOCK, _CODE_DTYPES, _GRAD_DTYPES, E0M3_BLOCK, ADAM_M8, ADAM_V8, ADAM_M4, ADAM_V4, Q8Tensor,
    Q8Params, Q4Tensor, Q4Params, DenseTensor, DenseParams, CodecArgs, AdamwQArgs, WeightArgs, Fp32WeightArgs, layout,
    library_layout,
)

__all__ = ["CAbiOps", "layout", "OP_NAMES"]

_DENSE_BUF_DTYPES = (torch.float32, torch.bfloat16)


OP_NAMES = (
    "q8_momentum_update_multi_", "quantize_rows", "dequantize_rows", "dense_momentum_update_multi_",
    "int4_momentum_update_multi_", "e0m3_momentum_update_multi_", "e0m3_momentum_update_with_scale_multi_",
    "e0m3_momentum_amax_multi", "pack_int4", "unpack_int4", "ue4m3_encode", "ue4m3_decode", "int4_quantize",
    "int4_dequantize", "e0m3_quantize", "e0m3_dequantize", "grid_quantize4", "grid_quantize4_with_scale",
    "grid_dequantize4", "adamw_q_update_", "bf16_weight_update_", "bf16_ecc8_weight_update_", "fp32_weight_update_",
)


class CAbiOps(CodecTwins):
    """The ``torch.ops.qmuon`` ops with a compiled twin, run through one library's C ABI.

    ``kind="cpu"``: ``lib`` exports ``qmuon_cpu_*`` (the JIT-built CPU library); ``kind="cuda"``:
    ``qmuon_cuda_*`` (the prebuilt GPU library), launched on torch's current stream of the tensors'
    device. Methods are named and called like the ops; :meth:`get` returns one by name."""

    def __init__(self, lib: C.CDLL, kind: str) -> None:
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"kind must be 'cpu' or 'cuda', got {kind!r}")
        self.lib, self.kind = lib, kind
        self.cuda = kind == "cuda"
        self._needs_scratch = self.cuda  # e0m3 / grid keep a device-side max on CUDA (binding_4bit.h)
        if not self.cuda:
            self._run = self._run_cpu  # type: ignore[method-assign]
        P, I64, I32 = C.c_void_p, C.c_int64, C.c_int32
        s = [P] if self.cuda else []

        def fn(name: str, argtypes: list[Any], restype: Any = C.c_int) -> Any:
            f = getattr(lib, f"qmuon_{kind}_{name}")
            f.argtypes, f.restype = argtypes + s, restype
            return f

        self._q8 = fn("q8_momentum_update", [C.POINTER(Q8Tensor), I64, Q8Params])
        self._quant = fn("quantize_rows", [P, I64, P, I32, P, I64, I64, I64, I64, I64])
        self._dequant = fn("dequantize_rows", [P, I64, I32, P, I64, P, I64, I64, I64])
        self._int4 = fn("int4_momentum_update", [C.POINTER(Q4Tensor), I64, Q4Params])
        self._e0m3 = fn("e0m3_momentum_update", [C.POINTER(Q4Tensor), I64, Q4Params])
        self._e0m3_amax = fn("e0m3_momentum_amax", [C.POINTER(Q4Tensor), I64, Q4Params])
        self._dense = fn("dense_momentum_update", [C.POINTER(DenseTensor), I64, DenseParams])
        self._codec = fn("codec", [C.POINTER(CodecArgs)])
        self._adamw = fn("adamw_q_update", [C.POINTER(AdamwQArgs)])
        self._bf16w = fn("bf16_weight_update", [C.POINTER(WeightArgs)])
        self._fp32w = fn("fp32_weight_update", [C.POINTER(Fp32WeightArgs)])
        if self.cuda:
            err = lib.qmuon_cuda_error_string
            err.argtypes, err.restype = [C.c_int], C.c_char_p
            self._error_text = lambda code: err(code).decode(errors="replace")
            self._raw_stream: Callable[[int], int] = getattr(
                torch._C, "_cuda_getCurrentRawStream", lambda i: torch.cuda.current_stream(i).cuda_stream)
        else:
            texts = {10001: "unsupported dtype", 10002: "unsupported block_size",
                     10003: "malformed call (unknown op, or a required pointer is NULL)"}  # qmuon/validate.h
            self._error_text = lambda code: texts.get(code, "unknown error")

    def get(self, name: str) -> Callable[..., Any]:
        if name not in OP_NAMES:
            raise KeyError(f"qmuon: no C-ABI twin of op {name!r}")
        return getattr(self, name)

    # -- launching ----------------------------------------------------------------------------
    def _run(self, f: Any, op: str, device: torch.device, *args: Any) -> None:
        """Call ``f(*args)`` (plus the current stream on CUDA, under a guard for ``device``); raise on an
        error code. The CPU kind rebinds this to :meth:`_run_cpu` in ``__init__`` (no device branch per call)."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        prev = torch.cuda.current_device()
        if prev != idx:
            torch.cuda.set_device(idx)
        try:
            code = f(*args, self._raw_stream(idx))
        finally:
            if prev != idx:
                torch.cuda.set_device(prev)
        if code != 0:
            self._raise(op, code)

    def _run_cpu(self, f: Any, op: str, device: torch.device, *args: Any) -> None:
        code = f(*args)
        if code != 0:
            self._raise(op, code)

    def _raise(self, op: str, code: int) -> None:
        raise RuntimeError(f"qmuon: {self.kind.upper()} kernel {op} failed: {self._error_text(code)} (code {code})")

    def _scratch(self, n: int, like: Tensor) -> Tensor | None:
        return torch.zeros(n, dtype=torch.float32, device=like.device) if self._needs_scratch and n > 0 else None

    # -- 8-bit (csrc/binding_common.h) ----------------------------------------------------------
    def q8_momentum_update_multi_(self, codes: list[Tensor], absmax: list[Tensor], grads: list[Tensor],
                                  block_sumsq: list[Tensor], beta: float, nesterov: bool, block_size: int,
                                  streams: list[int], row_offsets: list[int], skip: Tensor | None = None,
                                  compute_sumsq: bool = True) -> None:
        op = "q8_momentum_update_multi_"
        n = len(codes)
        # The list and block checks in one expression, the per-matrix checks in another: the ctypes path must
        # cost no more than the C++ binding it stands in for (benchmarks/results/call_overhead_cpu.md).
        if not (len(absmax) == n and len(grads) == n and len(streams) == n and len(row_offsets) == n
                and (len(block_sumsq) == n or (not compute_sumsq and not block_sumsq)) and 1 <= block_size <= MAX_BLOCK):
            _check(len(absmax) == n and len(grads) == n and len(streams) == n and len(row_offsets) == n, op,
                   lambda: f"needs lists of equal length, got {n} codes, {len(absmax)} absmax, {len(grads)} grads, "
                   f"{len(streams)} streams, {len(row_offsets)} row_offsets")
            _check(len(block_sumsq) == n or (not compute_sumsq and not block_sumsq), op,
                   lambda: f"needs one block_sumsq output per tensor, got {len(block_sumsq)} for {n} tensors")
            _check_block(block_size, op)
        flags = None if skip is None else _skip_flags(skip, n, codes[0].device if n else None, op)
        w: _Writables | None = None  # made on the first tensor that needs a contiguous copy
        tensors: list[Q8Tensor] = []
        keys: list[tuple[torch.dtype, torch.dtype]] = []
        dev = codes[0].get_device() if n else -1
        for i in range(n):
            c, a, g = codes[i], absmax[i], grads[i]
            s = block_sumsq[i] if compute_sumsq else None
            # Fast path: one expression (about a microsecond less than the itemized checks, and this
            # op runs once per parameter group per step); any failure is explained by _q8_explain.
            cs, as_ = c.shape, a.shape  # each tensor attribute read costs ~60 ns: read once
            if not (len(cs) == 2 and len(as_) == 2 and g.shape == cs and as_[0] == cs[0]
                    and as_[1] == (cs[1] + block_size - 1) // block_size
                    and c.dtype in _CODE_DTYPES and a.dtype is torch.float32 and g.dtype in _GRAD_DTYPES
                    and a.get_device() == dev and g.get_device() == dev and c.get_device() == dev
                    and (s is None or (s.dtype is torch.float32 and s.shape == as_ and s.get_device() == dev))):
                self._q8_explain(i, c, a, g, block_sumsq, compute_sumsq, block_size, codes[0], op)
            rows, cols = cs
            if rows == 0 or cols == 0:
                continue
            if c.is_contiguous() and a.is_contiguous() and g.is_contiguous() and (s is None or s.is_contiguous()):
                cw, c_rs, aw, a_rs, gw, g_rs, sw = c, cols, a, as_[1], g, cols, s
            else:
                w = w or _Writables()
                (cw, c_rs), (aw, a_rs), (gw, g_rs) = _work(w, c, cols), _work(w, a, a.shape[1]), _work(w, g, cols)
                sw = None if s is None else (s if s.is_contiguous() else w.add(s, dense=True))
            t = Q8Tensor(cw.data_ptr(), aw.data_ptr(), gw.data_ptr(), None if sw is None else sw.data_ptr(), rows,
                         cols, c_rs, a_rs, g_rs, row_offsets[i], -1 if streams[i] < 0 else streams[i] & 0xFFFFFFFF,
                         None if flags is None else flags.data_ptr() + i)
            tensors.append(t)
            keys.append((c.dtype, g.dtype))
        for (cdt, gdt), ts in _grouped(keys, tensors):
            cd, gd = _DTYPE[cdt], _DTYPE[gdt]
            arr = C.byref(ts[0]) if len(ts) == 1 else (Q8Tensor * len(ts))(*ts)  # one matrix: no array copy
            self._run(self._q8, op, codes[0].device, arr, len(ts), Q8Params(beta, int(nesterov), cd, gd, block_size))
        if w is not None and w.pairs:
            w.write_back()

    @staticmethod
    def _q8_explain(i: int, c: Tensor, a: Tensor, g: Tensor, block_sumsq: list[Tensor], compute_sumsq: bool,
                    block_size: int, first: Tensor, op: str) -> None:
        """Raise the error that names what is wrong with matrix ``i`` of a q8 update."""
        _check(c.dim() == 2 and c.dtype in _CODE_DTYPES, op, lambda: f"codes {i} must be 2-D int8 / uint8")
        rows, cols = c.shape
        _check_2d(a, torch.float32, rows, _nb(cols, block_size), "absmax", i, op, " (rows, ceil(cols / block_size))")
        _check(g.shape == c.shape, op, lambda: f"grad {i} has shape {tuple(g.shape)} but its codes have {(rows, cols)}")
        _check(a.device == first.device and g.device == first.device and c.device == first.device, op,
               "all tensors must be on one device")
        _check(g.dtype in _GRAD_DTYPES, op, lambda: f"grads must be float32, bfloat16 or float16, got {g.dtype}")
        if compute_sumsq:
            _check_sums(block_sumsq, i, g, block_size, op)
        raise AssertionError(f"qmuon: {op}: matrix {i} failed a check that names nothing")  # pragma: no cover

    def quantize_rows(self, x: Tensor, block_size: int, signed: bool, stream: int, row_offset: int
                      ) -> tuple[Tensor, Tensor]:
        op = "quantize_rows"
        _check(x.dim() == 2, op, lambda: f"needs a 2-D tensor, got {x.dim()}-D")
        _check_block(block_size, op)
        x = x if x.dtype == torch.float32 else x.to(torch.float32)
        x = x if _layout_ok(x) else x.contiguous()
        rows, cols = x.shape
        codes = torch.empty(rows, cols, dtype=torch.int8 if signed else torch.uint8, device=x.device)
        absmax = torch.empty(rows, _nb(cols, block_size), dtype=torch.float32, device=x.device)
        if rows > 0 and cols > 0:
            self._run(self._quant, op, x.device, x.data_ptr(), _rs(x), codes.data_ptr(), I8 if signed else U8,
                      absmax.data_ptr(), rows, cols, block_size, _s32(stream), row_offset)
        return codes, absmax

    def dequantize_rows(self, codes: Tensor, absmax: Tensor, block_size: int) -> Tensor:
        op = "dequantize_rows"
        _check_block(block_size, op)
        _check(codes.dim() == 2 and codes.dtype in (torch.int8, torch.uint8), op, "codes must be 2-D int8 / uint8")
        rows, cols = codes.shape
        _check_2d(absmax, torch.float32, rows, _nb(cols, block_size), "absmax", 0, op, " (rows, ceil(cols / block_size))")
        _check(absmax.device == codes.device, op, "codes and absmax are on different devices")
        codes = codes if _layout_ok(codes) else codes.contiguous()
        absmax = absmax if _layout_ok(absmax) else absmax.contiguous()
        out = torch.empty(rows, cols, dtype=torch.float32, device=codes.device)
        if rows > 0 and cols > 0:
            a_rs = absmax.shape[1] if rows <= 1 else absmax.stride(0)
            self._run(self._dequant, op, codes.device, codes.data_ptr(), _rs(codes), _DTYPE[codes.dtype],
                      absmax.data_ptr(), a_rs, out.data_ptr(), rows, cols, block_size)
        return out

    # -- dense, int4, e0m3 updates (csrc/binding_4bit.h) --------------------------------------
    def dense_momentum_update_multi_(self, bufs: list[Tensor], grads: list[Tensor], block_sumsq: list[Tensor],
                                     beta: float, nesterov: bool, block_size: int, streams: list[int],
                                     row_offsets: list[int], skip: Tensor | None = None) -> None:
        op = "dense_momentum_update_multi_"
        n = len(bufs)
        if not (len(grads) == n and len(block_sumsq) == n and len(streams) == n and len(row_offsets) == n
                and 1 <= block_size <= MAX_BLOCK):
            _check_lists(op, n, grads=grads, block_sumsq=block_sumsq, streams=streams, row_offsets=row_offsets)
            _check_block(block_size, op)
        flags = None if skip is None else _skip_flags(skip, n, grads[0].device if n else None, op)
        w: _Writables | None = None
        tensors: list[DenseTensor] = []
        keys: list[tuple[torch.dtype, torch.dtype]] = []
        dev = grads[0].get_device() if n else -1
        for i in range(n):
            b, g, q = bufs[i], grads[i], block_sumsq[i]
            gs, qs = g.shape, q.shape  # one expression, each attribute read once (as the q8 twin)
            if not (len(gs) == 2 and b.shape == gs and len(qs) == 2 and qs[0] == gs[0]
                    and qs[1] == (gs[1] + block_size - 1) // block_size
                    and b.dtype in _DENSE_BUF_DTYPES and g.dtype in _GRAD_DTYPES and q.dtype is torch.float32
                    and g.get_device() == dev and b.get_device() == dev and q.get_device() == dev):
                self._dense_explain(i, b, g, grads, block_sumsq, block_size, op)
            rows, cols = gs
            if rows == 0 or cols == 0:
                continue
            if b.is_contiguous() and g.is_contiguous() and q.is_contiguous():
                bw, gw, sw, b_rs, g_rs = b, g, q, cols, cols
            else:
                w = w or _Writables()
                bw, gw, sw = w.add(b), w.add(g), w.add(q, dense=True)
                b_rs, g_rs = _rs(bw), _rs(gw)
            tensors.append(DenseTensor(bw.data_ptr(), gw.data_ptr(), sw.data_ptr(), rows, cols, b_rs, g_rs,
                                       row_offsets[i], _s32(streams[i]), _skip_at(flags, i)))
            keys.append((b.dtype, g.dtype))
        for (bdt, gdt), ts in _grouped(keys, tensors):
            arr = C.byref(ts[0]) if len(ts) == 1 else (DenseTensor * len(ts))(*ts)
            self._run(self._dense, op, grads[0].device, arr, len(ts),
                      DenseParams(beta, int(nesterov), _DTYPE[bdt], _DTYPE[gdt], block_size))
        if w is not None:
            w.write_back()

    @staticmethod
    def _dense_explain(i: int, b: Tensor, g: Tensor, grads: list[Tensor], block_sumsq: list[Tensor], block_size: int,
                       op: str) -> None:
        """Raise the error that names what is wrong with matrix ``i`` of a dense update."""
        _check_grad(g, i, b, op)
        _check(b.dtype in (torch.float32, torch.bfloat16), op, lambda: f"buffers must be float32 or bfloat16, got {b.dtype}")
        _check(b.shape == g.shape, op, lambda: f"buffer {i} has shape {tuple(b.shape)} but its grad has {tuple(g.shape)}")
        _check(g.device == grads[0].device, op, "all tensors must be on one device")
        _check_sums(block_sumsq, i, g, block_size, op)
        raise AssertionError(f"qmuon: {op}: matrix {i} failed a check that names nothing")  # pragma: no cover

    def _q4_update(self, kind: str, packed: list[Tensor], scales: list[Tensor], tensor_scales: list[Tensor],
                   new_tensor_scales: list[Tensor], grads: list[Tensor], block_sumsq: list[Tensor], beta: float,
                   nesterov: bool, block_size: int, streams: list[int], row_offsets: list[int],
                   skip: Tensor | None = None) -> None:
        e0m3, with_scale = kind != "int4", kind == "e0m3_with_scale"
        op = {"int4": "int4_momentum_update_multi_", "e0m3": "e0m3_momentum_update_multi_"}.get(
            kind, "e0m3_momentum_update_with_scale_multi_")
        n = len(packed)
        _check_lists(op, n, scales=scales, grads=grads, block_sumsq=block_sumsq, streams=streams,
                     row_offsets=row_offsets)
        if e0m3:
            _check_lists(op, n, tensor_scales=tensor_scales)
            _check(1 <= block_size <= MAX_BLOCK and (block_size % E0M3_BLOCK == 0 or E0M3_BLOCK % block_size == 0), op,
                   lambda: f"needs a block_size that is a multiple or a divisor of 16 and <= {MAX_BLOCK}, got {block_size}")
        else:
            _check(2 <= block_size <= MAX_BLOCK and block_size % 2 == 0, op,
                   lambda: f"needs an even block_size in [2, {MAX_BLOCK}] (two codes per byte), got {block_size}")
        if with_scale:
            _check_lists(op, n, new_tensor_scales=new_tensor_scales)
        flags = None if skip is None else _skip_flags(skip, n, grads[0].device if n else None, op)
        scratch = self._scratch(2 * n, packed[0]) if kind == "e0m3" and n > 0 else None
        w: _Writables | None = None
        tensors: list[Q4Tensor] = []
        keys: list[torch.dtype] = []
        dev = grads[0].get_device() if n else -1
        nb_scales = E0M3_BLOCK if e0m3 else block_size
        scale_dtype = torch.uint8 if e0m3 else torch.float32
        for i in range(n):
            g, pk, sc, q = grads[i], packed[i], scales[i], block_sumsq[i]
            ts = tensor_scales[i] if e0m3 else None
            nts = new_tensor_scales[i] if with_scale else None
            # One expression, each attribute read once (as the q8 twin); _q4_explain names a failure.
            gs, ps, scs, qs = g.shape, pk.shape, sc.shape, q.shape
            if not (len(gs) == 2 and len(ps) == 2 and len(scs) == 2 and len(qs) == 2
                    and ps[0] == gs[0] and ps[1] == (gs[1] + 1) // 2
                    and scs[0] == gs[0] and scs[1] == (gs[1] + nb_scales - 1) // nb_scales
                    and qs[0] == gs[0] and qs[1] == (gs[1] + block_size - 1) // block_size
                    and g.dtype in _GRAD_DTYPES and pk.dtype is torch.uint8 and sc.dtype is scale_dtype
                    and q.dtype is torch.float32
                    and g.get_device() == dev and pk.get_device() == dev and sc.get_device() == dev
                    and q.get_device() == dev
                    and (ts is None or (ts.dtype is torch.float32 and ts.numel() == 1 and ts.get_device() == dev))
                    and (nts is None or (nts.dtype is torch.float32 and nts.numel() == 1 and nts.get_device() == dev))):
                self._q4_explain(i, e0m3, with_scale, packed, scales, tensor_scales, new_tensor_scales, grads,
                                 block_sumsq, block_size, op)
            rows, cols = gs
            if rows == 0 or cols == 0:
                if e0m3 and flags is not None:  # a flagged matrix keeps its scale: selected on the device
                    unflagged = flags[i] == 0
                    if with_scale:
                        ts.copy_(torch.where(unflagged, new_tensor_scales[i].reshape(ts.shape), ts))
                    else:
                        ts.masked_fill_(unflagged, 1.0)
                elif with_scale:
                    tensor_scales[i].fill_(new_tensor_scales[i].reshape(()))
                elif e0m3:
                    tensor_scales[i].fill_(1.0)
                continue
            if pk.is_contiguous() and sc.is_contiguous() and g.is_contiguous() and q.is_contiguous():
                pw, sw, gw, qw = pk, sc, g, q
                p_rs, s_rs, g_rs = ps[1], scs[1], cols
            else:
                w = w or _Writables()
                pw, sw, gw, qw = w.add(pk), w.add(sc), w.add(g), w.add(q, dense=True)
                p_rs, s_rs, g_rs = _rs(pw), _rs(sw), _rs(gw)
            tensors.append(Q4Tensor(
                pw.data_ptr(), sw.data_ptr(), None if ts is None else ts.data_ptr(), gw.data_ptr(), qw.data_ptr(),
                None if scratch is None else scratch.data_ptr() + 8 * i, None if nts is None else nts.data_ptr(), None,
                rows, cols, p_rs, s_rs, g_rs, row_offsets[i], _s32(streams[i]), _skip_at(flags, i)))
            keys.append(g.dtype)
        for gdt, group in _grouped(keys, tensors):
            arr = C.byref(group[0]) if len(group) == 1 else (Q4Tensor * len(group))(*group)
            self._run(self._e0m3 if e0m3 else self._int4, op, grads[0].device, arr, len(group),
                      Q4Params(beta, int(nesterov), _DTYPE[gdt], block_size))
        if w is not None:
            w.write_back()

    def _q4_explain(self, i: int, e0m3: bool, with_scale: bool, packed: list[Tensor], scales: list[Tensor],
                    tensor_scales: list[Tensor], new_tensor_scales: list[Tensor], grads: list[Tensor],
                    block_sumsq: list[Tensor], block_size: int, op: str) -> None:
        """Raise the error that names what is wrong with matrix ``i`` of a 4-bit update."""
        g = grads[i]
        rows, cols = (g.shape[0], g.shape[1]) if g.dim() == 2 else (0, 0)
        if e0m3:
            self._check_e0m3_state(packed[i], scales[i], tensor_scales[i], g, i, op)
            if with_scale:
                _check_scalar(new_tensor_scales[i], "new_tensor_scales", i, g.device, op)
        else:
            _check_grad(g, i, packed[i], op)
            _check_2d(packed[i], torch.uint8, rows, (cols + 1) // 2, "packed", i, op, " (two 4-bit codes per byte)")
            _check_2d(scales[i], torch.float32, rows, _nb(cols, block_size), "absmax", i, op,
                      " (rows, ceil(cols / block_size))")
            _check(packed[i].device == scales[i].device, op, lambda: f"state {i} is on two devices")
        _check(g.device == grads[0].device, op, "all tensors must be on one device")
        _check_sums(block_sumsq, i, g, block_size, op)
        raise AssertionError(f"qmuon: {op}: matrix {i} failed a check that names nothing")  # pragma: no cover

    @staticmethod
    def _check_e0m3_state(packed: Tensor, scales: Tensor, tensor_scale: Tensor, g: Tensor, i: int, op: str) -> None:
        _check_grad(g, i, packed, op)
        rows, cols = g.shape
        _check_2d(packed, torch.uint8, rows, (cols + 1) // 2, "packed", i, op, " (two 4-bit codes per byte)")
        _check_2d(scales, torch.uint8, rows, _nb(cols, E0M3_BLOCK), "scales", i, op, " (one UE4M3 scale per 16 elements)")
        _check_scalar(tensor_scale, "tensor_scales", i, g.device, op)
        _check(packed.device == scales.device, op, lambda: f"state {i} is on two devices")

    def int4_momentum_update_multi_(self, packed, absmax, grads, block_sumsq, beta, nesterov, block_size, streams,
                                    row_offsets, skip=None) -> None:
        self._q4_update("int4", packed, absmax, [], [], grads, block_sumsq, beta, nesterov, block_size, streams,
                        row_offsets, skip)

    def e0m3_momentum_update_multi_(self, packed, scales, tensor_scales, grads, block_sumsq, beta, nesterov,
                                    block_size, streams, row_offsets, skip=None) -> None:
        self._q4_update("e0m3", packed, scales, tensor_scales, [], grads, block_sumsq, beta, nesterov, block_size,
                        streams, row_offsets, skip)

    def e0m3_momentum_update_with_scale_multi_(self, packed, scales, tensor_scales, new_tensor_scales, grads,
                                               block_sumsq, beta, nesterov, block_size, streams, row_offsets,
                                               skip=None) -> None:
        self._q4_update("e0m3_with_scale", packed, scales, tensor_scales, new_tensor_scales, grads, block_sumsq, beta,
                        nesterov, block_size, streams, row_offsets, skip)

    def e0m3_momentum_amax_multi(self, packed: list[Tensor], scales: list[Tensor], tensor_scales: list[Tensor],
                                 grads: list[Tensor], beta: float) -> Tensor:
        op = "e0m3_momentum_amax_multi"
        n = len(packed)
        _check_lists(op, n, scales=scales, tensor_scales=tensor_scales, grads=grads)
        device = grads[0].device if n else torch.device("cpu")
        out = torch.zeros(n, dtype=torch.float32, device=device)
        scratch = self._scratch(2 * n, out)
        keep: list[Tensor] = []  # unit-column-stride copies the kernel reads (nothing is written back)

        def readable(t: Tensor) -> Tensor:
            keep.append(t if _layout_ok(t) else t.contiguous())
            return keep[-1]

        groups: dict[int, list[Q4Tensor]] = {}
        for i in range(n):
            g = grads[i]
            self._check_e0m3_state(packed[i], scales[i], tensor_scales[i], g, i, op)
            _check(g.device == device, op, "all tensors must be on one device")
            rows, cols = g.shape
            if rows == 0 or cols == 0:
                continue
            p, s, gg = readable(packed[i]), readable(scales[i]), readable(g)
            t = Q4Tensor(p.data_ptr(), s.data_ptr(), tensor_scales[i].data_ptr(), gg.data_ptr(), None,
                         None if scratch is None else scratch.data_ptr() + 8 * i, None, out.data_ptr() + 4 * i,
                         rows, cols, _rs(p), _rs(s), _rs(gg), 0, -1)
            groups.setdefault(_DTYPE[g.dtype], []).append(t)
        for gd, ts in groups.items():
            arr = (Q4Tensor * len(ts))(*ts)
            self._run(self._e0m3_amax, op, device, arr, len(ts), Q4Params(beta, 0, gd, E0M3_BLOCK))
        return out

    # -- quantized AdamW moments (csrc/binding_adamw.h) ---------------------------------------
    def adamw_q_update_(self, grad: Tensor, m_codes: Tensor, m_scale: Tensor, v_codes: Tensor, v_scale: Tensor,
                        update: Tensor, beta1: float, beta2: float, eps: float, neg_step_size: float,
                        bias_correction2_sqrt: float, m_kind: int, v_kind: int, block_size: int, stream: int,
                        index0: int, skip: Tensor | None = None) -> None:
        op = "adamw_q_update_:"
        _check(2 <= block_size <= MAX_BLOCK and block_size % 2 == 0, op,
               lambda: f"block_size must be even in [2, {MAX_BLOCK}], got {block_size}")
        _check(m_kind in (ADAM_M8, ADAM_M4) and v_kind in (ADAM_V8, ADAM_V4), op, lambda: f"bad moment kinds {m_kind}, {v_kind}")
        _check(grad.dim() == 2, op, "grad must be 2-D")
        _check(stream < (1 << 32), op, lambda: f"stream must be < 2^32 (or < 0: nearest), got {stream}")
        _check(index0 >= 0, op, lambda: f"index0 must be >= 0, got {index0}")
        rows, cols = grad.shape
        nb = _nb(cols, block_size)
        _check(grad.dtype in (torch.float32, torch.bfloat16, torch.float16), op,
               lambda: f"grad must be fp32 / bf16 / fp16, got {grad.dtype}")
        _check(m_codes.dtype == (torch.int8 if m_kind == ADAM_M8 else torch.uint8) and v_codes.dtype == torch.uint8, op,
               "code dtypes do not match the kinds")

        def code_cols(kind: int) -> int:
            return (cols + 1) // 2 if kind in (ADAM_M4, ADAM_V4) else cols

        _check(m_codes.dim() == 2 and tuple(m_codes.shape) == (rows, code_cols(m_kind)), op, "m_codes has the wrong shape")
        _check(v_codes.dim() == 2 and tuple(v_codes.shape) == (rows, code_cols(v_kind)), op, "v_codes has the wrong shape")
        for s in (m_scale, v_scale):
            _check(s.dtype == torch.float32 and s.dim() == 2 and tuple(s.shape) == (rows, nb), op,
                   "scales must be fp32 (rows, ceil(cols / block_size))")
        _check(update.dtype == torch.float32 and update.dim() == 2 and tuple(update.shape) == (rows, cols), op,
               "update must be fp32 (rows, cols)")
        ts = (grad, m_codes, m_scale, v_codes, v_scale, update)
        _check(all(_layout_ok(t) and t.device == grad.device for t in ts), op,
               "every tensor must be row-major with unit column stride, on one device")
        flags = None if skip is None else _skip_flags(skip, 1, grad.device, "adamw_q_update_")
        a = AdamwQArgs(grad.data_ptr(), _rs(grad), _DTYPE[grad.dtype], m_kind, v_kind, 0, m_codes.data_ptr(),
                       _rs(m_codes), m_scale.data_ptr(), _rs(m_scale), v_codes.data_ptr(), _rs(v_codes),
                       v_scale.data_ptr(), _rs(v_scale), update.data_ptr(), _rs(update), rows, cols, block_size, beta1,
                       beta2, eps, neg_step_size, bias_correction2_sqrt, stream, index0, _skip_at(flags, 0))
        self._run(self._adamw, "adamw_q_update_", grad.device, C.byref(a))

    # -- weight writes (csrc/binding_weight.h) ------------------------------------------------
    @staticmethod
    def _check_weight_matrix(t: Tensor, param: Tensor, name: str, op: str) -> None:
        _check(t.dim() == 2 and t.shape == param.shape, op,
               lambda: f"{name} must have the param's shape {tuple(param.shape)}, got {tuple(t.shape)}")
        _check(t.device == param.device, op, lambda: f"{name} is on {t.device}, param on {param.device}")
        _check(_layout_ok(t), op, lambda: f"{name} must have unit column stride")

    def _weight_args(self, param: Tensor, ecc: Tensor | None, update: Tensor, alpha: float, decay: float, stream: int,
                     index0: int, index_rs: int, op: str, flags: Tensor | None) -> WeightArgs:
        _check(param.dtype == torch.bfloat16, op, lambda: f"param must be bf16, got {param.dtype}")
        self._check_weight_matrix(param, param, "param", op)
        self._check_weight_matrix(update, param, "update", op)
        _check(update.dtype in (torch.float32, torch.bfloat16, torch.float16), op,
               lambda: f"update must be fp32, bf16 or fp16, got {update.dtype}")
        a = WeightArgs(param=param.data_ptr(), update=update.data_ptr(), update_dtype=_DTYPE[update.dtype],
                       rows=param.shape[0], cols=param.shape[1], param_rs=_rs(param), update_rs=_rs(update),
                       alpha=alpha, decay=decay, stream=_s32(stream), index0=index0, index_rs=index_rs,
                       skip=_skip_at(flags, 0))
        if ecc is not None:
            _check(ecc.dtype == torch.int8, op, lambda: f"ecc must be int8, got {ecc.dtype}")
            self._check_weight_matrix(ecc, param, "ecc", op)
            a.ecc, a.ecc_rs = ecc.data_ptr(), _rs(ecc)
        return a

    def bf16_weight_update_(self, param: Tensor, update: Tensor, alpha: float, decay: float, stream: int, index0: int,
                            index_row_stride: int, skip: Tensor | None = None) -> None:
        op = "bf16_weight_update_"
        flags = None if skip is None else _skip_flags(skip, 1, param.device, op)
        a = self._weight_args(param, None, update, alpha, decay, stream, index0, index_row_stride, op, flags)
        self._run(self._bf16w, op, param.device, C.byref(a))

    def bf16_ecc8_weight_update_(self, param: Tensor, ecc: Tensor, update: Tensor, alpha: float, decay: float,
                                 skip: Tensor | None = None) -> None:
        op = "bf16_ecc8_weight_update_"
        flags = None if skip is None else _skip_flags(skip, 1, param.device, op)
        a = self._weight_args(param, ecc, update, alpha, decay, -1, 0, 0, op, flags)
        self._run(self._bf16w, op, param.device, C.byref(a))

    def fp32_weight_update_(self, param: Tensor, update: Tensor, alpha: float, decay: float,
                            skip: Tensor | None = None) -> None:
        op = "fp32_weight_update_"
        # Fast path (this op runs once per parameter per step): one expression, explained on failure.
        ps, us = param.shape, update.shape
        if not (param.dtype is torch.float32 and param.dim() == 2 and update.dim() == 2 and us == ps
                and update.dtype in _GRAD_DTYPES and update.get_device() == param.get_device()
                and update.stride(0) >= 0 and update.stride(1) >= 0 and (param.is_contiguous() or _layout_ok(param))):
            _check(param.dtype == torch.float32, op, lambda: f"param must be fp32, got {param.dtype}")
            self._check_weight_matrix(param, param, "param", op)
            _check(update.dim() == 2 and update.shape == param.shape, op,
                   lambda: f"update must have the param's shape {tuple(param.shape)}, got {tuple(update.shape)}")
            _check(update.device == param.device, op, lambda: f"update is on {update.device}, param on {param.device}")
            _check(update.stride(0) >= 0 and update.stride(1) >= 0, op, "update has a negative stride")
            _check(update.dtype in _GRAD_DTYPES, op, lambda: f"update must be fp32, bf16 or fp16, got {update.dtype}")
        flags = None if skip is None else _skip_flags(skip, 1, param.device, op)
        a = Fp32WeightArgs(param.data_ptr(), update.data_ptr(), _DTYPE[update.dtype], ps[0], ps[1],
                           ps[1] if ps[0] <= 1 else param.stride(0), update.stride(0), update.stride(1), alpha, decay,
                           _skip_at(flags, 0))
        self._run(self._fp32w, op, param.device, C.byref(a))
