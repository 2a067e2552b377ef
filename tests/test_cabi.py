"""The ctypes path of the prebuilt GPU library (qmuon/ops/_cabi.py), run on a CPU.

``CAbiOps`` is the Python twin of the C++ torch binding: it checks arguments, brings tensors into the
kernels' layout, fills the C-ABI structs and calls ``qmuon_<kind>_*``. On a GPU it calls the prebuilt
library's ``qmuon_cuda_*``; here it calls the ``qmuon_cpu_*`` functions of the JIT-built CPU library
(the same ABI, the same structs), so every line of it runs in CI. It must give exactly what the C++
binding gives for the same kernel (bit for bit: one kernel, two callers), on every op, including
inputs the kernels cannot take in place (a transposed grad is copied and written back).
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from qmuon.ops import _cabi, _canary, _canary_samples
from qmuon.ops._library import OPS


@pytest.fixture(scope="module")
def cpu_ops(ext):
    return _cabi.CAbiOps(ctypes.CDLL(ext.library), "cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return _canary._bits(t)


def _same(a, b) -> None:
    ta, tb = _canary._tensors(a), _canary._tensors(b)
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(_bits(x), _bits(y))


def test_struct_layout_matches_the_c_compiler(ext):
    """The ctypes mirror lays the structs out as g++ does (qmuon_cpu_abi_layout, csrc/qmuon/abi_layout.h)."""
    lib = ctypes.CDLL(ext.library)
    assert _cabi.library_layout(lib, "cpu") == _cabi.layout()


def test_every_compiled_op_has_a_c_abi_twin():
    compiled = {n for n, op in OPS.items() if op.supported is not None}
    assert compiled == set(_cabi.OP_NAMES)


@pytest.mark.parametrize("name", _cabi.OP_NAMES)
def test_ctypes_path_equals_the_cpp_binding(cpu_ops, name):
    """Same kernel, two callers: the ctypes twin and torch.ops.qmuon_C give the same outputs and writes."""
    op = OPS[name]
    args_a = _canary_samples.samples(torch.device("cpu"), rows=37, cols=300, bs=64, grid=32)[name]()
    args_b = _canary.clone_args(args_a)
    out_a = cpu_ops.get(name)(*args_a)
    out_b = getattr(torch.ops.qmuon_C, name)(*args_b)
    _same(out_a, out_b)
    for i in op.mutated:
        _same(args_a[i], args_b[i])


def test_non_kernel_layout_is_copied_and_written_back(cpu_ops):
    """A transposed grad and a column-sliced absmax are not in the kernels' layout: the twin copies them,
    runs the kernel and writes the results back, as the C++ binding does."""
    from qmuon.ops import reference as ref

    gen = torch.Generator().manual_seed(3)
    rows, cols, bs = 48, 40, 16
    m = torch.randn(rows, cols, generator=gen) * 0.02
    codes, absmax = ref.quantize_rows(m, bs, signed=True)
    grad_t = (torch.randn(cols, rows, generator=gen) * 0.1).T  # (rows, cols), column-major
    wide = torch.zeros(rows, absmax.shape[1] + 3)
    wide[:, 1:1 + absmax.shape[1]] = absmax
    absmax_view = wide[:, 1:1 + absmax.shape[1]]  # row stride > cols: still the kernels' layout
    a = ([codes.clone()], [absmax_view.clone()], [grad_t.clone()], [torch.empty(rows, 3)])
    b = ([codes.clone()], [absmax.clone()], [grad_t.contiguous()], [torch.empty(rows, 3)])
    cpu_ops.q8_momentum_update_multi_(*a, 0.9, False, bs, [-1], [0])
    torch.ops.qmuon_C.q8_momentum_update_multi_(*b, 0.9, False, bs, [-1], [0])
    for x, y in zip(a, b):
        _same(x, y)


def test_empty_and_mixed_dtype_lists(cpu_ops):
    """Empty matrices are skipped; matrices with different grad dtypes go in separate launches."""
    from qmuon.ops import reference as ref

    ms = [torch.randn(5, 33) * 0.01, torch.zeros(0, 8), torch.randn(7, 20) * 0.01]
    grads = [torch.randn(5, 33), torch.zeros(0, 8), torch.randn(7, 20).to(torch.bfloat16)]
    q = [ref.quantize_rows(m, 16, signed=True) for m in ms]
    a = ([c.clone() for c, _ in q], [s.clone() for _, s in q], [g.clone() for g in grads],
         [torch.empty(c.shape[0], ref.num_blocks(c.shape[1], 16)) for c, _ in q])
    b = _canary.clone_args(a)
    cpu_ops.q8_momentum_update_multi_(*a, 0.95, True, 16, [1, -1, 2], [0, 0, 4])
    torch.ops.qmuon_C.q8_momentum_update_multi_(*b, 0.95, True, 16, [1, -1, 2], [0, 0, 4])
    for x, y in zip(a, b):
        _same(x, y)


def test_bad_arguments_raise_before_any_kernel(cpu_ops):
    """Shapes the kernels cannot check (a wrong absmax shape would be an out-of-bounds access on a GPU)
    are refused with the fix in the message."""
    codes = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match=r"absmax 0 has shape \(4, 3\) but needs \(4, 2\)"):
        cpu_ops.q8_momentum_update_multi_([codes], [torch.zeros(4, 3)], [torch.zeros(4, 64)], [torch.zeros(4, 2)],
                                          0.9, False, 32, [-1], [0])
    with pytest.raises(RuntimeError, match=r"block_sumsq 0 has shape \(4, 3\) but needs \(4, 2\)"):
        cpu_ops.q8_momentum_update_multi_([codes], [torch.zeros(4, 2)], [torch.zeros(4, 64)], [torch.zeros(4, 3)],
                                          0.9, False, 32, [-1], [0])
    with pytest.raises(RuntimeError, match=r"update must have the param's shape \(4, 8\), got \(8, 4\)"):
        cpu_ops.fp32_weight_update_(torch.zeros(4, 8), torch.zeros(8, 4), -0.1, 1.0)
    with pytest.raises(RuntimeError, match="even block_size"):
        cpu_ops.int4_quantize(torch.zeros(2, 8), 3, -1, 0)
    with pytest.raises(RuntimeError, match="cannot hold 9 codes"):
        cpu_ops.unpack_int4(torch.zeros(2, 4, dtype=torch.uint8), 9)


def _dense_args(rows=4, cols=64, bs=32, buf_dtype=torch.float32, sums_cols=2, grad_shape=None):
    return ([torch.zeros(rows, cols, dtype=buf_dtype)], [torch.zeros(grad_shape or (rows, cols))],
            [torch.zeros(rows, sums_cols)], 0.9, True, bs, [-1], [0])


def _q4_args(kind, rows=4, cols=64, bs=32, scales=None, tensor_scale=None, sums_cols=2, packed_cols=32):
    packed = [torch.zeros(rows, packed_cols, dtype=torch.uint8)]
    if kind == "int4":
        sc = [scales if scales is not None else torch.ones(rows, 2)]
        return (packed, sc, [torch.zeros(rows, cols)], [torch.zeros(rows, sums_cols)], 0.9, True, bs, [-1], [0])
    sc = [scales if scales is not None else torch.zeros(rows, 4, dtype=torch.uint8)]
    ts = [tensor_scale if tensor_scale is not None else torch.ones(1)]
    return (packed, sc, ts, [torch.zeros(rows, cols)], [torch.zeros(rows, sums_cols)], 0.9, True, bs, [-1], [0])


@pytest.mark.parametrize("op, args, message", [
    ("dense_momentum_update_multi_", _dense_args(buf_dtype=torch.float16), "buffers must be float32 or bfloat16"),
    ("dense_momentum_update_multi_", _dense_args(grad_shape=(4, 32)), r"buffer 0 has shape \(4, 64\) but its grad"),
    ("dense_momentum_update_multi_", _dense_args(sums_cols=3), r"block_sumsq 0 has shape \(4, 3\) but needs \(4, 2\)"),
    ("int4_momentum_update_multi_", _q4_args("int4", packed_cols=31), r"packed 0 has shape \(4, 31\) but needs \(4, 32\)"),
    ("int4_momentum_update_multi_", _q4_args("int4", scales=torch.ones(4, 3)), r"absmax 0 has shape \(4, 3\)"),
    ("int4_momentum_update_multi_", _q4_args("int4", scales=torch.ones(4, 2, dtype=torch.float64)),
     "absmax 0 must be torch.float32"),
    ("int4_momentum_update_multi_", _q4_args("int4", sums_cols=1), r"block_sumsq 0 has shape \(4, 1\)"),
    ("e0m3_momentum_update_multi_", _q4_args("e0m3", scales=torch.zeros(4, 3, dtype=torch.uint8)),
     r"scales 0 has shape \(4, 3\) but needs \(4, 4\)"),
    ("e0m3_momentum_update_multi_", _q4_args("e0m3", tensor_scale=torch.ones(2)),
     "tensor_scales 0 must be a one-element float32 tensor"),
    ("e0m3_momentum_update_multi_", _q4_args("e0m3", tensor_scale=torch.ones(1, dtype=torch.float64)),
     "tensor_scales 0 must be a one-element float32 tensor"),
])
def test_bad_update_arguments_are_named_and_refused_by_both_callers(cpu_ops, op, args, message):
    """The twin's one-expression checks of the multi-matrix updates fall back to the itemized ones, which
    name the tensor and the shape it needs; the C++ binding refuses the same call."""
    with pytest.raises(RuntimeError, match=message):
        getattr(cpu_ops, op)(*args)
    with pytest.raises(RuntimeError):
        getattr(torch.ops.qmuon_C, op)(*args)


def test_kernel_error_codes_become_errors(cpu_ops):
    """An error code from the C side (here the CPU kernel's own dtype check) is a RuntimeError with its text."""
    t = _cabi.Q8Tensor()
    with pytest.raises(RuntimeError, match=r"CPU kernel q8 failed: unsupported dtype \(code 10001\)"):
        cpu_ops._run(cpu_ops._q8, "q8", torch.device("cpu"), ctypes.byref(t), 0,
                     _cabi.Q8Params(0.9, 0, 99, 0, 32))


def test_twin_signatures_match_the_ops():
    """The guarded kernel calls a twin with the op's own arguments: same positional parameters."""
    import inspect

    for name in _cabi.OP_NAMES:
        want = list(inspect.signature(OPS[name].reference).parameters)
        params = inspect.signature(getattr(_cabi.CAbiOps, name)).parameters
        got = [p for p in params if p not in ("self", "compute_sumsq")]  # compute_sumsq: qmuon_C's, by keyword
        assert got == want, (name, got, want)


@pytest.mark.parametrize("op", ["dense_momentum_update_multi_", "int4_momentum_update_multi_",
                                "e0m3_momentum_update_multi_"])
def test_multi_updates_with_copies_empties_and_mixed_dtypes(cpu_ops, op):
    """The dense and 4-bit twins on one call that takes every path: a transposed grad (copied and written
    back), an empty matrix (skipped), a bf16 grad (a second launch). Bit for bit the C++ binding."""
    gen = torch.Generator().manual_seed(11)
    bs = 16
    shapes = [(5, 33), (0, 8), (7, 20)]
    grads = [(torch.randn(33, 5, generator=gen) * 0.1).T, torch.zeros(0, 8),
             (torch.randn(7, 20, generator=gen) * 0.1).to(torch.bfloat16)]
    sums = [torch.empty(r, (c + bs - 1) // bs) for r, c in shapes]
    states = [torch.randn(r, c, generator=gen) * 0.02 for r, c in shapes]
    if op == "dense_momentum_update_multi_":
        args = ([states[0], states[1], states[2].to(torch.bfloat16)], grads, sums, 0.95, True, bs, [3, -1, 4], [0, 0, 5])
    elif op == "int4_momentum_update_multi_":
        q = [torch.ops.qmuon.int4_quantize(m, bs, -1, 0) for m in states]
        args = ([p for p, _ in q], [a for _, a in q], grads, sums, 0.95, True, bs, [3, -1, 4], [0, 0, 5])
    else:
        q = [torch.ops.qmuon.e0m3_quantize(m, True, -1, 0) for m in states]
        args = ([p for p, _, _ in q], [s for _, s, _ in q], [t for _, _, t in q], grads, sums, 0.95, True, bs,
                [3, -1, 4], [0, 0, 5])
    a, b = _canary.clone_args(args), _canary.clone_args(args)
    getattr(cpu_ops, op)(*a)
    getattr(torch.ops.qmuon_C, op)(*b)
    for x, y in zip(a, b):
        if isinstance(x, list):
            _same(x, y)
    grads_at = {"dense_momentum_update_multi_": 1, "int4_momentum_update_multi_": 2}.get(op, 3)
    assert a[grads_at][0].stride() == (1, 5)  # the twin's input was the transposed grad itself
