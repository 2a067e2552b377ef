"""The first-use canary: each compiled op is checked once per device type and process against its reference.

The first time the guarded kernel of an op (:mod:`._kernels`) is about to run the compiled kernel on a
device type, :func:`passes` runs that kernel and the op's pure-PyTorch reference on one small sample
call (:func:`samples`: a partial last block, an odd row count, stochastic rounding where the op has
it) on the same device, and compares them (:func:`compare`): bit for bit, except the per-block sums of
squares, which the contract allows to differ by fp32 summation order (``2 * block_size * 2**-24``
relative, as in the kernel tests). On a difference, or an error, that op stays on the reference for
that device type for the rest of the process, with an error-level log line; :func:`failures` lists
such ops (``qmuon-doctor`` shows them). So a kernel that computes wrong on a new GPU, driver or
compiler costs speed, never a silent corruption of training, even before anyone runs the doctor.

Cost: one small call of the kernel and of the reference per op and device type, on the first call only
(``benchmarks/results/canary_cost.md``). ``QMUON_CANARY=0`` turns it off.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["passes", "failures", "samples", "compare", "reset", "timings"]

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


def compare(op: Any, out_a: Any, out_b: Any, args_a: tuple, args_b: tuple) -> str | None:
    """None when the outputs and the mutated arguments of two calls of ``op`` (a compiled one on
    ``args_a``, the reference on ``args_b``) agree under the op's contract, else what differs."""
    params = list(inspect.signature(op.reference).parameters)
    sums_at = params.index("block_sumsq") if "block_sumsq" in params else None
    bs_at = params.index("block_size") if "block_size" in params else None
    pairs: list[tuple[str, Tensor, Tensor, bool]] = []
    for k, (a, b) in enumerate(zip(_tensors(out_a), _tensors(out_b))):
        pairs.append((f"output {k}", a, b, False))
    for i in op.mutated:
        for k, (a, b) in enumerate(zip(_tensors(args_a[i]), _tensors(args_b[i]))):
            pairs.append((f"{params[i]}[{k}]", a, b, i == sums_at))
    for what, a, b, is_sum in pairs:
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{what}: {a.dtype}{tuple(a.shape)} vs reference {b.dtype}{tuple(b.shape)}"
        if is_sum:  # fp32 sums of <= block_size squares, different summation order
            rtol = 2 * (args_a[bs_at] if bs_at is not None else 1) * 2.0 ** -24
            if not torch.allclose(a.cpu(), b.cpu(), rtol=rtol, atol=1e-30, equal_nan=True):
                return f"{what}: sums of squares differ beyond fp32 order tolerance {rtol:.1e}"
        elif not torch.equal(_bits(a), _bits(b)):
            n = int((_bits(a) != _bits(b)).sum())
            return f"{what}: {n} of {a.numel()} elements differ from the reference"
    return None


def run_check(op: Any, compiled: Callable[..., Any], device: torch.device) -> str | None:
    """Run ``compiled`` and ``op.reference`` on the sample call of ``op`` on ``device``; what differs, or None."""
    make = samples(device).get(op.name)
    if make is None:
        return None  # an op without a sample is not checked (tests/test_canary.py requires one for each)
    args_a = make()
    args_b = clone_args(args_a)
    try:
        out_a = compiled(*args_a)
        out_b = op.reference(*args_b)
        return compare(op, out_a, out_b, args_a, args_b)
    except Exception as err:  # noqa: BLE001 - an error is a failed check, reported with its text
        return f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"


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
