"""The ``skip`` flags of the state-mutating ops (issue 37: no host reads in the step).

Every op that writes optimizer state or weights takes a trailing ``Tensor? skip=None``: one flag per matrix
of a multi-tensor update, one for a single-matrix op, on the tensors' device. A flagged matrix is not
written at all (state, grad, ``block_sumsq``, ``update``, param, ecc keep their bits, NaN payloads
included); the others are written exactly as by a call without ``skip``. The flags are never read on the
host: the compiled kernels read them on the device, the references select old or new bits on the device.

Each op runs through three callers: ``torch.ops.qmuon`` (the compiled CPU kernel when it is built, which
``qmuon.ops._kernels.served`` must show), the op's pure-PyTorch reference called directly, and the C-ABI
twin (``qmuon.ops._cabi``, the prebuilt GPU library's Python binding) over the JIT-built CPU library.
"""

from __future__ import annotations

import ctypes
import zlib
from typing import Any, Callable

import pytest
import torch
from torch.library import opcheck

from qmuon import ops
from qmuon.ops import _cabi
from qmuon.ops import _kernels as K
from qmuon.ops import reference as ref
from qmuon.ops import reference_4bit as ref4
from qmuon.ops import reference_adamw as refa
from qmuon.ops import reference_weight as refw
from qmuon.ops._library import OPS

BS = 16
#: The matrices of a multi-tensor call: partial blocks, an odd column count and an empty matrix.
SHAPES = [(5, 40), (3, 64), (4, 33), (2, 48), (0, 32)]
#: Which of them a call flags: NaN and Inf gradients (matrices 1 and 3) and the empty one are flagged.
FLAGS = [0, 1, 0, 1, 1]
MULTI = ("q8_momentum_update_multi_", "dense_momentum_update_multi_", "int4_momentum_update_multi_",
         "e0m3_momentum_update_multi_", "e0m3_momentum_update_with_scale_multi_")
SINGLE = ("adamw_q_update_", "bf16_weight_update_", "bf16_ecc8_weight_update_", "fp32_weight_update_")
NAN_PAYLOAD = 0x7FC01234  # a quiet NaN with a payload: restored bits must keep it


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8, 8: torch.int64}[t.element_size()])


def _assert_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    ba, bb = _bits(a), _bits(b)
    assert torch.equal(ba, bb), f"{what}: {int((ba != bb).sum())} of {a.numel()} elements differ"


def _nan_payload(*shape: int) -> torch.Tensor:
    return torch.full(shape, NAN_PAYLOAD, dtype=torch.int32).view(torch.float32)


# --------------------------------------------------------------------------- the calls
def _grad(i: int, rows: int, cols: int, variant: str, gen: torch.Generator) -> torch.Tensor:
    """Matrix i's gradient: matrix 1 holds NaNs (one with a payload), matrix 3 infinities; in the "mixed"
    variant the dtypes alternate (the kernels group matrices by dtype, the flags must follow the matrix)
    and matrices 1 and 2 are transposed (copied for the kernel and written back)."""
    g = torch.randn(rows, cols, generator=gen) * 0.1
    if rows and i == 1:
        g[0, 3] = float("nan")
        g.view(torch.int32)[rows - 1, 5] = NAN_PAYLOAD
    if rows and i == 3:
        g[0, 0], g[1, 7] = float("inf"), float("-inf")
    mixed = variant.startswith("mixed")
    dtype = torch.bfloat16 if mixed and i % 2 == 0 else torch.float32
    if mixed and i in (1, 2):
        return g.T.contiguous().to(dtype).T
    return g.to(dtype)


def _streams(n: int, variant: str) -> list[int]:
    return [ref.noise_stream(5, 2, k) if variant.endswith("stochastic") else -1 for k in range(n)]


def _sums(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return [_nan_payload(g.shape[0], ref.num_blocks(g.shape[1], BS)) for g in grads]


def _multi_args(name: str, variant: str) -> tuple:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name} {variant}".encode()))
    n = len(SHAPES)
    ms = [torch.randn(r, c, generator=gen) * 0.02 for r, c in SHAPES]
    grads = [_grad(i, r, c, variant, gen) for i, (r, c) in enumerate(SHAPES)]
    tail = (0.9, True, BS, _streams(n, variant), [0, 3, 0, 1, 0])
    if name == "q8_momentum_update_multi_":
        q = [ref.quantize_rows(m, BS, signed=i % 2 == 0) for i, m in enumerate(ms)]
        return ([c for c, _ in q], [a for _, a in q], grads, _sums(grads), *tail)
    if name == "dense_momentum_update_multi_":
        bufs = [m.to(torch.bfloat16) if i % 2 else m for i, m in enumerate(ms)]
        return (bufs, grads, _sums(grads), *tail)
    if name == "int4_momentum_update_multi_":
        q = [ref4.int4_quantize(m, BS) for m in ms]
        return ([p for p, _ in q], [a for _, a in q], grads, _sums(grads), *tail)
    q = [ref4.e0m3_quantize(m) for m in ms]
    packed, scales = [p for p, _, _ in q], [s for _, s, _ in q]
    tscales = [t.reshape(1).clone() for _, _, t in q]
    tscales[-1].fill_(0.5)  # the empty matrix's: an unflagged call would write 1 there
    if name == "e0m3_momentum_update_multi_":
        return (packed, scales, tscales, grads, _sums(grads), *tail)
    new = [torch.full((1,), 3e-4 * (k + 1)) for k in range(n)]
    return (packed, scales, tscales, new, grads, _sums(grads), *tail)


def _single_args(name: str, variant: str, finite: bool = False) -> tuple:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name} {variant}".encode()))
    rows, cols = 6, 70
    stochastic = variant.endswith("stochastic")
    g = torch.randn(rows, cols, generator=gen) * 0.1
    if not finite:
        g[2, 3] = float("nan")  # a flagged call with a NaN gradient writes nothing either
    u = g.to(torch.bfloat16) if variant.startswith("mixed") else g
    if name == "adamw_q_update_":
        kinds = (refa.M4, refa.V4) if variant.startswith("mixed") else (refa.M8, refa.V8)
        m = torch.randn(rows, cols, generator=gen) * 0.01
        mc, ms = refa.encode_moment(m, kinds[0], BS)
        vc, vs = refa.encode_moment(m * m, kinds[1], BS)
        stream = refa.adamw_noise_stream(7, 1, 3) if stochastic else -1
        return (u, mc, ms, vc, vs, _nan_payload(rows, cols), 0.9, 0.95, 1e-8, -1e-3, 0.5, kinds[0], kinds[1], BS,
                stream, 2 * cols)
    master = torch.randn(rows, cols, generator=gen)
    if name == "bf16_weight_update_":
        stream = refw.weight_noise_stream(7, 3, 1) if stochastic else -1
        return (refw.nearest_bf16(master), u, -0.3, 0.999, stream, 5, cols)
    if name == "bf16_ecc8_weight_update_":
        wb = refw.nearest_bf16(master)
        return (wb, refw.ecc8_encode(master, wb), u, -0.3, 0.999)
    ut = u.T.contiguous().mT if variant.startswith("mixed") else u  # a transposed update, read in place
    return (master, ut, -0.3, 0.999)


def _args(name: str, variant: str, finite: bool = False) -> tuple:
    """One call's arguments; ``finite``: no NaN in a single-matrix op's input (the kernels and the reference
    agree bit for bit on finite inputs; a multi-tensor call's NaN / Inf gradients are in flagged matrices)."""
    return _multi_args(name, variant) if name in MULTI else _single_args(name, variant, finite)


def _clone(args: tuple) -> tuple:
    def one(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return a.clone(memory_format=torch.preserve_format)
        if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            return [t.clone(memory_format=torch.preserve_format) for t in a]
        return a
    return tuple(one(a) for a in args)


def _written(name: str, args: tuple, i: int) -> list[tuple[str, torch.Tensor]]:
    """The tensors of matrix ``i`` (0 for a single-matrix op) that ``name`` may write."""
    import inspect

    op = OPS[name]
    params = list(inspect.signature(op.reference).parameters)
    out = []
    for j in op.mutated:
        a = args[j]
        out.append((params[j], a[i] if isinstance(a, list) else a))
    return out


def _n(name: str) -> int:
    return len(SHAPES) if name in MULTI else 1


# --------------------------------------------------------------------------- the callers
def _compiled_expected(name: str) -> bool:
    if name == "dense_momentum_update_multi_":
        return K.dense_matches_torch(torch.device("cpu"))
    if name == "fp32_weight_update_":
        return K.fp32_write_matches_torch(torch.device("cpu"))
    return True


@pytest.fixture(scope="module")
def cabi_ops(ext):
    return _cabi.CAbiOps(ctypes.CDLL(ext.library), "cpu")


def _caller(kind: str, name: str, request) -> Callable[..., Any]:
    if kind == "reference":
        return OPS[name].reference
    if kind == "cabi":
        return request.getfixturevalue("cabi_ops").get(name)
    request.getfixturevalue("ext")
    fn = getattr(torch.ops.qmuon, name)

    def dispatched(*args: Any) -> Any:
        key = (name, "compiled" if _compiled_expected(name) else "reference")
        before = K.served[key]
        out = fn(*args)
        assert K.served[key] == before + 1, f"{name}: the {key[1]} kernel did not serve the call"
        return out

    return dispatched


def _call(fn: Callable[..., Any], args: tuple, skip: torch.Tensor | None) -> Any:
    return fn(*args) if skip is None else fn(*args, skip)


CALLERS = ["op", "reference", "cabi"]
VARIANTS = ["fp32-nearest", "fp32-stochastic", "mixed-nearest", "mixed-stochastic"]


def _variants(name: str) -> list[str]:
    if name in ("bf16_ecc8_weight_update_", "fp32_weight_update_"):  # no stochastic rounding
        return ["fp32-nearest", "mixed-nearest"]
    return VARIANTS


CASES = [(name, v) for name in MULTI + SINGLE for v in _variants(name)]


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("name, variant", CASES)
@pytest.mark.parametrize("skip_dtype", [torch.bool, torch.uint8], ids=["bool", "uint8"])
def test_no_flag_set_equals_no_skip(request, caller, name, variant, skip_dtype):
    """All flags zero: every written tensor (and the return value) equals a call without ``skip``, bit for bit."""
    fn = _caller(caller, name, request)
    a = _args(name, variant)
    b = _clone(a)
    out_a = _call(fn, a, torch.zeros(_n(name), dtype=skip_dtype))
    out_b = _call(fn, b, None)
    assert out_a is None and out_b is None
    for i in range(_n(name)):
        for (what, x), (_, y) in zip(_written(name, a, i), _written(name, b, i)):
            _assert_bits(x, y, f"{caller} {name} {variant}: {what}[{i}]")


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("name, variant", CASES)
def test_flagged_matrices_are_untouched(request, caller, name, variant):
    """Flagged matrices keep every bit (NaN / Inf gradients and NaN payloads included); the others equal
    a call without ``skip``."""
    fn = _caller(caller, name, request)
    n = _n(name)
    flags = FLAGS if n > 1 else [1]
    a = _args(name, variant)
    before, no_skip = _clone(a), _clone(a)
    _call(fn, a, torch.tensor(flags, dtype=torch.uint8))
    _call(fn, no_skip, None)
    for i in range(n):
        want = before if flags[i] else no_skip
        for (what, x), (_, y) in zip(_written(name, a, i), _written(name, want, i)):
            _assert_bits(x, y, f"{caller} {name} {variant}: {what}[{i}] ({'flagged' if flags[i] else 'not flagged'})")
        if flags[i] and (n == 1 or SHAPES[i][0] or name.startswith("e0m3")):  # the flag did keep a write out
            assert any(not torch.equal(_bits(x), _bits(y))
                       for (_, x), (_, y) in zip(_written(name, before, i), _written(name, no_skip, i))), (name, i)
    if n == 1:  # and a zero flag writes what a call without skip writes
        c = _clone(before)
        _call(fn, c, torch.zeros(1, dtype=torch.bool))
        for (what, x), (_, y) in zip(_written(name, c, 0), _written(name, no_skip, 0)):
            _assert_bits(x, y, f"{caller} {name} {variant}: {what} (flag 0)")


@pytest.mark.parametrize("name", MULTI + SINGLE)
def test_compiled_with_flags_equals_reference_with_flags(request, name):
    """The compiled kernel and the reference agree on a flagged call (sums of squares up to fp32 order)."""
    import inspect

    variant = "mixed-stochastic" if name not in ("bf16_ecc8_weight_update_", "fp32_weight_update_") else "mixed-nearest"
    a = _args(name, variant, finite=True)
    b = _clone(a)
    flags = torch.tensor(FLAGS if name in MULTI else [0], dtype=torch.bool)
    _caller("op", name, request)(*a, flags)
    OPS[name].reference(*b, flags)
    params = list(inspect.signature(OPS[name].reference).parameters)
    for i in range(_n(name)):
        for (what, x), (_, y) in zip(_written(name, a, i), _written(name, b, i)):
            if what == "block_sumsq":
                rtol = 2 * BS * 2.0**-24
                assert torch.allclose(x, y, rtol=rtol, atol=1e-30, equal_nan=True), f"{name}: {what}[{i}]"
                if FLAGS[i]:
                    _assert_bits(x, y, f"{name}: {what}[{i}]")
            else:
                _assert_bits(x, y, f"{name}: {what}[{i}]")
    assert "skip" == params[-1]


@pytest.mark.parametrize("name", MULTI + SINGLE)
def test_cabi_twin_with_flags_equals_the_cpp_binding(cabi_ops, name):
    """Same kernel, two callers (as tests/test_cabi.py checks without flags): the ctypes twin and
    torch.ops.qmuon_C write the same bits with flags, including through copies of transposed grads."""
    variant = "mixed-stochastic" if name not in ("bf16_ecc8_weight_update_", "fp32_weight_update_") else "mixed-nearest"
    for flags in ([1] * _n(name), FLAGS if name in MULTI else [0]):
        a = _args(name, variant)
        b = _clone(a)
        skip = torch.tensor(flags, dtype=torch.uint8)
        cabi_ops.get(name)(*a, skip)
        getattr(torch.ops.qmuon_C, name)(*b, skip.bool())
        for i in range(_n(name)):
            for (what, x), (_, y) in zip(_written(name, a, i), _written(name, b, i)):
                _assert_bits(x, y, f"{name} {flags}: {what}[{i}]")


# --------------------------------------------------------------------------- routing and checks
def _same_as_bool_flags(name: str, skip: torch.Tensor, key: tuple[str, str]) -> None:
    """A call with ``skip`` is served by ``key``'s kernel and writes what one with the bool flags writes."""
    n = _n(name)
    flags = FLAGS if n > 1 else [1]
    a = _args(name, "fp32-nearest")
    b = _clone(a)
    before = K.served[key]
    getattr(torch.ops.qmuon, name)(*a, skip)
    assert K.served[key] == before + 1, f"{name}: not served by the {key[1]} kernel"
    getattr(torch.ops.qmuon, name)(*b, torch.tensor(flags, dtype=torch.bool))
    for i in range(n):
        for (what, x), (_, y) in zip(_written(name, a, i), _written(name, b, i)):
            if what == "block_sumsq" and not flags[i]:  # the reference's sums against the kernel's
                assert torch.allclose(x, y, rtol=2 * BS * 2.0**-24, atol=1e-30, equal_nan=True)
            else:
                _assert_bits(x, y, f"{name}: {what}[{i}]")


@pytest.mark.parametrize("name", MULTI + SINGLE)
@pytest.mark.parametrize("dtype", [torch.int32, torch.float32], ids=str)
def test_flags_of_another_dtype_run_the_reference(ext, name, dtype):
    """Flags the kernels do not read (int32, float: nonzero skips) are taken by the reference, as the
    ``served`` counts show; the result is that of bool flags."""
    flags = FLAGS if _n(name) > 1 else [1]
    _same_as_bool_flags(name, torch.tensor(flags, dtype=dtype) * 3, (name, "reference"))


@pytest.mark.parametrize("name", MULTI + SINGLE)
@pytest.mark.parametrize("layout", ["column", "strided"])
def test_flags_of_any_layout_run_the_compiled_kernel(ext, name, layout):
    """bool / uint8 flags as an (n, 1) column or a strided view (copied to one byte per flag): compiled."""
    n = _n(name)
    flags = torch.tensor(FLAGS if n > 1 else [1], dtype=torch.uint8)
    skip = flags.reshape(n, 1) if layout == "column" else torch.stack((flags, 1 - flags), dim=1)[:, 0]
    assert layout == "column" or n == 1 or not skip.is_contiguous()
    _same_as_bool_flags(name, skip, (name, "compiled" if _compiled_expected(name) else "reference"))


@pytest.mark.parametrize("name", MULTI + SINGLE)
@pytest.mark.parametrize("bad", ["numel", "device"])
@pytest.mark.parametrize("caller", ["op", "reference"])
def test_bad_flags_raise_before_anything_is_written(name, bad, caller):
    n = _n(name)
    skip = torch.zeros(n + 1, dtype=torch.bool) if bad == "numel" else torch.zeros(n, dtype=torch.bool,
                                                                                   device="meta")
    a = _args(name, "fp32-nearest")
    before = _clone(a)
    fn = OPS[name].reference if caller == "reference" else getattr(torch.ops.qmuon, name)
    what = "one flag per matrix" if n > 1 else "one-element tensor"
    with pytest.raises(ValueError, match=rf"qmuon::{name}: skip must (hold|be) .*{what}.*or skip=None"):
        fn(*a, skip)
    for i in range(n):
        for (w, x), (_, y) in zip(_written(name, a, i), _written(name, before, i)):
            _assert_bits(x, y, f"{name}: {w}[{i}]")


@pytest.mark.parametrize("name", MULTI + SINGLE)
def test_fake_checks_the_flags(name):
    """The fake (torch.compile, meta tensors) accepts the flags and refuses a wrong count as the op does."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    n = _n(name)
    a = _args(name, "fp32-nearest")
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fa = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor)
                   else [mode.from_tensor(t) for t in x] if isinstance(x, list) and x and isinstance(x[0], torch.Tensor)
                   else x for x in a)
        getattr(torch.ops.qmuon, name)(*fa, torch.zeros(n, dtype=torch.bool))
        with pytest.raises(ValueError, match=rf"qmuon::{name}: skip"):
            getattr(torch.ops.qmuon, name)(*fa, torch.zeros(n + 2, dtype=torch.bool))


def test_opcheck_with_flags():
    """The schema, fake and functionalization with the flags (whichever CPU kernel is registered)."""
    for name in ("q8_momentum_update_multi_", "e0m3_momentum_update_multi_", "adamw_q_update_",
                 "bf16_ecc8_weight_update_"):
        a = _args(name, "fp32-nearest")
        skip = torch.tensor(FLAGS if name in MULTI else [1], dtype=torch.bool)
        opcheck(getattr(torch.ops.qmuon, name).default, (*a, skip))


@pytest.mark.parametrize("name", MULTI + SINGLE)
def test_reference_reads_no_flag_on_the_host(name):
    """The reference with flags runs on meta tensors (which have no data: a host read of a flag, or any
    data-dependent branch on one, would raise), and gives the right shapes."""
    a = _args(name, "fp32-nearest")

    def meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to("meta")
        if isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
            return [t.to("meta") for t in x]
        return x

    OPS[name].reference(*(meta(x) for x in a), torch.zeros(_n(name), dtype=torch.bool, device="meta"))


def test_cabi_structs_carry_the_flag_pointer_last(ext):
    """Every per-matrix struct of the C ABI ends with the flag pointer, where the C compiler puts it."""
    from qmuon.ops import _cabi_structs as S

    for s in (S.Q8Tensor, S.Q4Tensor, S.DenseTensor, S.AdamwQArgs, S.WeightArgs, S.Fp32WeightArgs):
        assert s._fields_[-1][0] == "skip", s.__name__
    assert _cabi.library_layout(ctypes.CDLL(ext.library), "cpu") == _cabi.layout()


def test_empty_list_takes_empty_flags(ext):
    for name in MULTI:
        op = getattr(torch.ops.qmuon, name)
        nlists = {"q8_momentum_update_multi_": 4, "dense_momentum_update_multi_": 3, "int4_momentum_update_multi_": 4,
                  "e0m3_momentum_update_multi_": 5, "e0m3_momentum_update_with_scale_multi_": 6}[name]
        op(*([[]] * nlists), 0.9, True, BS, [], [], torch.zeros(0, dtype=torch.bool))
    assert ops.empty_block_sumsq([], BS) == []
