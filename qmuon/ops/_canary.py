"""The first-use canary: each compiled op is checked once per device type and process against its reference.

The first time the guarded kernel of an op (:mod:`._kernels`) is about to run the compiled kernel on a
device type, :func:`passes` runs that kernel and the op's pure-PyTorch reference on each of the op's
canary cases (:func:`._canary_cases.cases`, 2-4 calls) on the same device, and compares every output and
every argument the op writes (:func:`compare`): bit for bit, except the per-block sums of squares, which
the contract allows to differ by fp32 summation order. On a difference, or an error, in any case, that op stays on the
reference for that device type for the rest of the process, with an error-level log line naming the case;
:func:`failures` lists such ops (``qmuon-doctor`` shows them). So a kernel that computes wrong on a new
GPU, driver or compiler costs speed, never a silent corruption of training, even before anyone runs the
doctor. ``QMUON_CANARY=0`` turns it off.

The cases, and which code path of the kernels each one reaches, are :mod:`._canary_cases` (their sizes
and input makers :mod:`._canary_inputs`); the single sample call of each op that this canary ran before,
which ``qmuon-doctor`` and the ctypes tests still use, is :mod:`._canary_samples`.

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
import os
import threading
import time
from typing import Any, Callable

import torch
from torch import Tensor

from ._canary_cases import cases

__all__ = ["passes", "failures", "compare", "reset", "timings"]

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
