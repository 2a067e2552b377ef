"""Newton-Schulz engine: coefficient schedules, the NS compute dtype, and the folded iteration.

Pure functions (no optimizer state); the optimizer decides what to batch and how much memory a
batch may use.

The iteration
-------------
Muon replaces an update ``G`` (``m x n``, ``m <= n`` after an optional transpose) by an
approximation of its polar factor ``polar(G) = U V^T``, where ``G = U S V^T`` is the thin SVD.
Newton-Schulz gets there with matrix products only (KellerJordan/Muon, torch.optim.Muon):
normalize ``X_0 = G / ||G||_F`` (so every singular value lies in ``(0, 1]``), then apply odd
quintic polynomials::

    A_k     = X_k X_k^T                                   (m x m Gram matrix)
    X_{k+1} = a_k X_k + (b_k A_k + c_k A_k^2) X_k
            = U p_k(S_k) V^T,   p_k(s) = a_k s + b_k s^3 + c_k s^5

Because ``p_k`` is odd, the iteration acts on each singular value independently and never
touches ``U`` and ``V``: after ``T`` steps a singular value ``sigma`` of ``G`` has become
``f_T(sigma / ||G||_F)`` with ``f_T = p_{T-1} o ... o p_0`` (:func:`ns_scalar_map`). The
coefficients decide how close ``f_T`` is to 1 on ``[l, 1]`` (``l`` the smallest relative singular
value that matters):

* ``"muon"``: one quintic, ``(3.4445, -4.7750, 2.0315)``, repeated (KellerJordan/Muon,
  ``torch.optim.Muon``'s defaults). Its slope at 0 is large (3.4445) so small singular values grow
  fast, at the price of not converging: after 5 steps the output singular values oscillate in
  roughly ``[0.7, 1.2]`` (on ``[1e-3, 1]``: ``[0.47, 1.20]``, worst deviation 0.53).
* ``"polar_express"``: a different, minimax-optimal quintic per iteration (Polar Express, below):
  on ``[1e-3, 1]`` the worst deviation after 5 steps is 0.16 and after 6 it is 6.5e-3.

The coefficient schedule (:class:`NSSchedule`) is the list ``((a_0, b_0, c_0), (a_1, b_1, c_1), ...)``;
iteration ``i`` uses entry ``min(i, len - 1)``, so a single tuple is the classic constant
iteration. A schedule may also carry ``norm_safety`` ``s`` (1.01 for Polar Express): the input
is normalized by ``s ||G||_F`` instead of ``||G||_F``.

Polar Express
-------------
Amsel, Persson, Musco, Gower (2025), "The Polar Express: Optimal Matrix Sign Methods and Their
Application to the Muon Algorithm", arXiv:2505.16932 (code: github.com/NoahAmsel/PolarExpress,
linked from the abstract). Each ``p_k`` is the degree-5 odd polynomial that minimizes
``max |1 - p(x)|`` over the interval ``[l_k, u_k]`` holding the singular values at that step
(Remez algorithm, Appendix D); Section 4 (Theorem 4.1, proved in Appendix A) shows this greedy
choice is optimal for the whole composition. Starting from ``[l_0, u_0] = [1e-3, 1]``:
``l_{k+1} = p_k(l_k)``, ``u_{k+1} = 2 - l_{k+1}``, and after ``T`` steps every point of
``[l_0, 1]`` lies in ``[l_T, 2 - l_T]``. For bf16 the paper adds two finite-precision fixes:
*cushioning* (each ``p_k`` is designed on ``[max(l_k, 0.024 u_k), u_k]`` and rescaled, so no
polynomial is too steep), and a *safety factor* 1.01: the input is divided by ``1.01 ||X||_F``
and every polynomial but the last is replaced by ``p(x / 1.01)``, i.e.
``(a, b, c) -> (a / 1.01, b / 1.01^3, c / 1.01^5)``, so singular values pushed slightly above 1
by rounding are still mapped back below ~1.

The coefficients here are the hard-coded listing of the authors' repository, file
``polar_express/basic.py`` (``_COEFFS``: 8 raw quintics, the last being the fixed point
``(15/8, -10/8, 3/8)`` of the classic quintic Newton-Schulz; then the 1.01 safety factor on all
but the last, and the input divided by ``1.01 ||X||_F``), the list commonly reproduced as the
paper's. They are the construction above for ``l = 1e-3`` with cushion ``0.02407327424182761``
and the safety factor applied afterwards (regenerated in tests/test_newton_schulz.py to 1e-13).
The same repository's ``polar_express/_core.py`` instead computes a slightly different set at
import (cushion 0.02, safety applied inside the recursion, 10 iterations; first entry 8.237).
``NVIDIA-NeMo/Emerging-Optimizers`` (``emerging_optimizers/orthogonalized_optimizers/muon_utils.py``)
ships the 8 safety-divided coefficients used here, with 4 decimals, but normalizes by ``||X||_F``
alone; modded-nanogpt / nanochat use a different 5-step set (safety 1.02), which can be passed as
a list of tuples (it then runs with ``norm_safety=1``). With more steps than entries, the last
(fixed-point) quintic repeats, as in the authors' code.

The folded first iteration
--------------------------
Dividing ``G`` by its norm would cost a full pass over the big matrix. With ``s = 1 / (norm_safety
* max(||G||_F, eps))`` and ``A_0 = G G^T``, the first step is::

    X_1 = a X_0 + (b A + c A^2) X_0,   X_0 = s G,  A = s^2 A_0
        = [s (a I + b A + c A^2)] G

so only the small ``m x m`` matrices are scaled and ``G`` is read as it is (the optimizer gets
``||G||^2`` for free from its momentum kernel). :func:`newton_schulz_folded` does that on a batch
of same-shape matrices with ``bmm``, transposing when ``rows > cols`` so the Gram matrix is the
small side. In bf16 with the ``"muon"`` schedule it is bit-identical to
the implementation it replaced (``optim/newton_schulz.py`` at commit d92a0c4; a frozen copy is in tests/test_newton_schulz.py).

Compute dtype
-------------
``ns_dtype``: ``"bf16"`` (``torch.optim.Muon``'s arithmetic), ``"fp32"``, or ``"auto"``
(:func:`resolve_ns_dtype`): bf16 on CUDA and other accelerators; on CPU bf16 only where a bf16
matmul is measured to be at least as fast as an fp32 one (native AVX512-BF16 / AMX), else fp32
(without native bf16, GEMMs are emulated: 17-52x slower than fp32 for 256 x 256 and ~30x for a
5-step NS of a 768 x 3072 matrix on an AVX2-capped CPU, docs/newton_schulz.md). Decided once per process and device,
logged once; ``QMUON_NS_DTYPE=bf16|fp32`` overrides ``"auto"`` for reproducibility.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass
from numbers import Real
from typing import Any, Sequence, Union

import torch
from torch import Tensor

__all__ = [
    "MUON_COEFFICIENTS",
    "resolve_schedule",
    "resolve_ns_dtype",
    "newton_schulz_folded",
]

log = logging.getLogger(__name__)

Coefficients = tuple[float, float, float]
#: What a user may pass as ``ns_coefficients``: a preset name, one ``(a, b, c)`` tuple (every
#: iteration), or a sequence of per-iteration ``(a, b, c)`` tuples. All three serialize as plain
#: Python values (param groups, checkpoints, YAML).
NSCoefficientSpec = Union[str, Sequence[float], Sequence[Sequence[float]]]

#: Values of ``ns_dtype``.
NS_DTYPES = ("auto", "bf16", "fp32")
#: Environment variable that overrides ``ns_dtype="auto"`` (values ``bf16`` or ``fp32``).
NS_DTYPE_ENV = "QMUON_NS_DTYPE"
_DTYPE_OF = {"bf16": torch.bfloat16, "fp32": torch.float32}
_NAME_OF = {torch.bfloat16: "bf16", torch.float32: "fp32"}

#: KellerJordan/Muon's quintic, ``torch.optim.Muon``'s ``DEFAULT_A, DEFAULT_B, DEFAULT_C``.
MUON_COEFFICIENTS: Coefficients = (3.4445, -4.7750, 2.0315)

#: Polar Express (arXiv:2505.16932), degree 5, l = 1e-3, before the safety factor:
#: NoahAmsel/PolarExpress, polar_express/basic.py (``_COEFFS``).
POLAR_EXPRESS_RAW_COEFFICIENTS: tuple[Coefficients, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),  # the fixed point; repeats for any further iteration
)
#: The paper's safety factor: input divided by ``1.01 ||X||_F``; every polynomial but the last
#: evaluated at ``x / 1.01``.
POLAR_EXPRESS_SAFETY = 1.01
#: The coefficients Polar Express actually runs (same float operations as the authors' code).
POLAR_EXPRESS_COEFFICIENTS: tuple[Coefficients, ...] = tuple(
    (a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)
    for a, b, c in POLAR_EXPRESS_RAW_COEFFICIENTS[:-1]
) + (POLAR_EXPRESS_RAW_COEFFICIENTS[-1],)


# ------------------------------------------------------------------------------------ schedules
def _fix(what: str) -> str:
    presets = ", ".join(repr(p) for p in NS_PRESETS)
    return (f"{what}; pass a preset name ({presets}), one (a, b, c) tuple used at every iteration, "
            "or a list of per-iteration (a, b, c) tuples")


def _triple(entry: Any, where: str) -> Coefficients:
    if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence):
        raise ValueError(_fix(f"ns_coefficients{where} must be a sequence of 3 numbers (a, b, c), got {entry!r}"))
    if len(entry) != 3:
        raise ValueError(_fix(
            f"ns_coefficients{where} has {len(entry)} numbers {tuple(entry)!r}, but each entry must be exactly "
            "3 numbers (a, b, c) of the quintic X <- a X + b (X X^T) X + c (X X^T)^2 X"))
    out = []
    for v in entry:
        if isinstance(v, bool) or not isinstance(v, Real):
            raise ValueError(_fix(f"ns_coefficients{where} holds {v!r}, which is not a real number"))
        f = float(v)
        if not math.isfinite(f):
            raise ValueError(_fix(f"ns_coefficients{where} holds the non-finite value {f!r} in {tuple(entry)!r}; "
                                  "every coefficient must be a finite number"))
        out.append(f)
    return out[0], out[1], out[2]


@dataclass(frozen=True)
class NSSchedule:
    """A Newton-Schulz coefficient schedule: iteration ``i`` uses
    ``coefficients[min(i, len(coefficients) - 1)]``; the input is normalized by
    ``norm_safety * ||G||_F``.

    Frozen, hashable and compared by value, so it can key a batch of same-shape matrices
    (``(shape, schedule, steps, dtype)``). Build it with :func:`resolve_schedule` from a user spec;
    keep the spec (not this object) in param groups and checkpoints.
    """

    coefficients: tuple[Coefficients, ...]
    norm_safety: float = 1.0

    def __post_init__(self) -> None:
        coeffs = self.coefficients
        if isinstance(coeffs, (str, bytes)) or not isinstance(coeffs, Sequence) or len(coeffs) == 0:
            raise ValueError(_fix(f"NSSchedule.coefficients must be a non-empty sequence of (a, b, c), got {coeffs!r}"))
        frozen = tuple(_triple(c, f" entry {i}") for i, c in enumerate(coeffs))
        s = self.norm_safety
        if isinstance(s, bool) or not isinstance(s, Real) or not math.isfinite(float(s)) or float(s) <= 0.0:
            raise ValueError(f"NSSchedule.norm_safety must be a finite number > 0 (1.0: plain ||G||_F), got {s!r}")
        object.__setattr__(self, "coefficients", frozen)
        object.__setattr__(self, "norm_safety", float(s))

    def coefficient(self, i: int) -> Coefficients:
        """The ``(a, b, c)`` of iteration ``i`` (0-based)."""
        return self.coefficients[min(i, len(self.coefficients) - 1)]


#: Named schedules (full length; :func:`resolve_schedule` cuts or extends them to ``steps``).
NS_PRESETS: dict[str, NSSchedule] = {
    "muon": NSSchedule((MUON_COEFFICIENTS,)),
    "polar_express": NSSchedule(POLAR_EXPRESS_COEFFICIENTS, norm_safety=POLAR_EXPRESS_SAFETY),
}


def _check_steps(steps: Any) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"ns_steps must be an int >= 0 (number of Newton-Schulz iterations), got {steps!r}")
    return steps


def resolve_schedule(spec: NSCoefficientSpec | NSSchedule, steps: int) -> NSSchedule:
    """The :class:`NSSchedule` that ``steps`` iterations of ``spec`` run.

    ``spec``: a preset name (``"muon"``, ``"polar_express"``), one ``(a, b, c)`` tuple (repeated
    every iteration), a sequence of per-iteration ``(a, b, c)`` tuples (iteration ``i`` uses entry
    ``min(i, len - 1)``), or an :class:`NSSchedule`. The result holds exactly ``max(steps, 1)``
    entries, so two specs that run the same arithmetic give equal (same-hash) schedules: ``"muon"``
    equals ``(3.4445, -4.7750, 2.0315)``, and a long list cut at ``steps`` equals its prefix.

    Raises ``ValueError`` naming the problem and the fix: unknown preset (lists the presets),
    an entry without exactly 3 numbers, a non-number or non-finite value, an empty list, a
    negative or non-int ``steps``.
    """
    if _cacheable(spec) and type(steps) is int:
        return _resolve_schedule_cached(spec, steps)
    return _resolve_schedule(spec, steps)


def _cacheable(spec: Any) -> bool:
    """Specs whose hash and equality mean "same schedule" (exact float / str leaves: ``True == 1``
    and ``1 == 1.0`` hash alike but must not share a cached result or its validation)."""
    if isinstance(spec, (str, NSSchedule)):
        return True
    if type(spec) is not tuple:
        return False
    return all(type(v) is float for v in spec) or all(
        type(e) is tuple and all(type(v) is float for v in e) for e in spec)


@functools.lru_cache(maxsize=512)
def _resolve_schedule_cached(spec: Any, steps: int) -> NSSchedule:
    return _resolve_schedule(spec, steps)


def _resolve_schedule(spec: Any, steps: Any) -> NSSchedule:
    steps = _check_steps(steps)
    if isinstance(spec, NSSchedule):
        base = spec
    elif isinstance(spec, str):
        if spec not in NS_PRESETS:
            raise ValueError(_fix(f"unknown ns_coefficients preset {spec!r}"))
        base = NS_PRESETS[spec]
    elif isinstance(spec, bytes) or not isinstance(spec, Sequence):
        raise ValueError(_fix(
            f"ns_coefficients must be a preset name or a sequence, got {type(spec).__name__} {spec!r}"))
    elif len(spec) == 0:
        raise ValueError(_fix("ns_coefficients is empty"))
    else:
        nested = [isinstance(e, Sequence) and not isinstance(e, (str, bytes)) for e in spec]
        if all(nested):
            base = NSSchedule(tuple(_triple(e, f" entry {i}") for i, e in enumerate(spec)))
        elif any(nested):
            i = nested.index(False)
            raise ValueError(_fix(f"ns_coefficients mixes (a, b, c) tuples and bare numbers: entry {i} is {spec[i]!r}"))
        else:
            base = NSSchedule((_triple(spec, ""),))
    n = max(steps, 1)
    coeffs = tuple(base.coefficient(i) for i in range(n))
    if coeffs == base.coefficients:
        return base
    return NSSchedule(coeffs, base.norm_safety)


def ns_scalar_map(schedule: NSSchedule, steps: int, sigma: Tensor) -> Tensor:
    """What ``steps`` iterations do to a singular value: ``sigma -> f(sigma / norm_safety)``,
    ``f = p_{steps-1} o ... o p_0``, ``p_i(x) = a_i x + b_i x^3 + c_i x^5``, in float64.

    ``sigma`` is relative to ``||G||_F`` (so in ``(0, 1]``). Exact-arithmetic counterpart of the
    matrix iterations, for analysing a schedule (worst deviation from 1 on ``[l, u]``).
    """
    steps = _check_steps(steps)
    x = sigma.to(torch.float64) / schedule.norm_safety
    for i in range(steps):
        a, b, c = schedule.coefficient(i)
        x2 = x * x
        x = x * (a + x2 * (b + c * x2))
    return x


# ------------------------------------------------------------------------------------ dtype
_AUTO_LOCK = threading.Lock()
_AUTO_CACHE: dict[str, torch.dtype] = {}
_OVERRIDE_LOGGED: set[tuple[str, str]] = set()
#: ``"auto"`` picks bf16 on CPU when a bf16 matmul takes at most this fraction of an fp32 one.
_PROBE_N = 256
_PROBE_REPS = 5


def _cpuinfo_field(*keys: str) -> str | None:
    """The value of the first /proc/cpuinfo line starting with one of ``keys`` (None if absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(keys):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``flags`` on x86, ``Features`` on Arm) from /proc/cpuinfo."""
    return set((_cpuinfo_field("flags", "Features") or "").split())


def _cpu_model() -> str:
    return _cpuinfo_field("model name") or "unknown CPU"


def _cpu_vendor() -> str:
    """``vendor_id`` from /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``, ...; "" if unknown)."""
    return _cpuinfo_field("vendor_id") or ""


def _cpu_description() -> str:
    model, flags = _cpu_model(), cpu_flags()
    bf16 = sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16", "amx_tile"))
    cap = torch.backends.cpu.get_cpu_capability()
    return f"CPU {model!r}, ATen CPU capability {cap}, bf16 CPU flags: {', '.join(bf16) or 'none'}"


def _probe_cpu_bf16() -> tuple[bool, str]:
    """Whether bf16 matmul is native on this CPU, and why (one line for the log).

    A rule on the CPU's instruction set, not a timing: every rank of a job and a resumed run must
    make the same choice (a sharded step exchanges NS results in the NS dtype, and a resume is only
    bit-exact with the same arithmetic), and a timing near the threshold could flip between
    processes. Native (ATen capability AVX512 and ``ONEDNN_MAX_CPU_ISA`` unset or admitting it):
    x86 with AMX-BF16; an AMD x86 with AVX512-BF16; Arm with the BF16 extension. An Intel CPU whose
    only bf16 instructions are AVX512-BF16 (Cooper Lake, or a virtual machine that hides AMX) is not:
    its two 512-bit FMA ports make fp32 GEMMs faster than oneDNN's AVX512-BF16 ones.
    Measured bf16 / fp32 time of a 256 x 256 matmul (:func:`measure_cpu_bf16_ratio`): 0.49-0.61 on
    an AVX512-BF16 EPYC, 1.65-2.0 on an AVX512-BF16 Xeon with AMX hidden (5-step NS 1.67x slower),
    17-52 with ATen / oneDNN capped at AVX2 (docs/newton_schulz.md).
    """
    flags = cpu_flags()
    cap = torch.backends.cpu.get_cpu_capability()
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        has = sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16"))
        vendor = _cpu_vendor()
        amx = "amx_bf16" in flags and (not isa or isa == "ALL" or "AMX" in isa)
        # AVX512-BF16 alone beats fp32 only where fp32 FMAs are narrow (AMD's double-pumped 256-bit units).
        avx512_bf16 = ("avx512_bf16" in flags and vendor == "AuthenticAMD"
                       and (not isa or isa == "ALL" or "BF16" in isa or "AMX" in isa))
        native = (amx or avx512_bf16) and cap.upper().startswith("AVX512")
        why = (f"x86 bf16 instructions: {', '.join(has) or 'none'} ({vendor}"
               f"{'; AVX512-BF16 without AMX is slower than fp32 on Intel' if vendor == 'GenuineIntel' and has and not amx else ''}); "
               f"ATen CPU capability {cap}; ONEDNN_MAX_CPU_ISA={isa or 'unset'}")
    elif machine in ("aarch64", "arm64"):
        native = "bf16" in flags
        why = f"Arm BF16 extension: {'yes' if native else 'no'}; ATen CPU capability {cap}"
    else:
        native, why = False, f"{machine}: no known native bf16 matmul"
    verdict = ("native bf16 matmul, faster than fp32" if native
               else "no bf16 matmul faster than fp32 (emulated, or slower than the fp32 FMAs)")
    return native, f"{verdict} ({why}); {_cpu_description()}"


def measure_cpu_bf16_ratio(n: int = _PROBE_N, reps: int = _PROBE_REPS) -> tuple[float, float]:
    """Median single-thread time (s) of an ``n x n`` matmul in bf16 and in fp32 (benchmarks and
    docs; the automatic choice uses :func:`_probe_cpu_bf16`'s rule, which is deterministic)."""
    threads = torch.get_num_threads()
    with torch.no_grad():
        a32 = torch.linspace(-1.0, 1.0, n * n, dtype=torch.float32).reshape(n, n)
        b32 = a32.flip(0).contiguous()
        a16, b16 = a32.bfloat16(), b32.bfloat16()

        def timed(x: Tensor, y: Tensor) -> float:
            t0 = time.perf_counter()
            torch.mm(x, y)
            return time.perf_counter() - t0

        t32: list[float] = []
        t16: list[float] = []
        try:
            torch.set_num_threads(1)
            for _ in range(2):  # warm-up: kernel selection, oneDNN primitive creation
                timed(a32, b32)
                timed(a16, b16)
            for _ in range(reps):
                t32.append(timed(a32, b32))
                t16.append(timed(a16, b16))
        finally:
            torch.set_num_threads(threads)
    return statistics.median(t16), statistics.median(t32)


def _device_key(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    return f"{device.type}:{device.index if device.index is not None else 0}"


def resolve_ns_dtype(ns_dtype: str, device: torch.device | str | None = None) -> torch.dtype:
    """The torch dtype Newton-Schulz runs in for ``ns_dtype`` on ``device``.

    ``"bf16"`` -> ``torch.bfloat16`` and ``"fp32"`` -> ``torch.float32``, always. ``"auto"``: the
    environment variable ``QMUON_NS_DTYPE`` (``bf16`` or ``fp32``) wins if set; otherwise bf16 on
    CUDA and other accelerators; on CPU bf16 only where bf16 matmul is native
    (:func:`_probe_cpu_bf16`: a deterministic rule on the instruction set), else fp32. The automatic choice is made once per process
    and device (cached) and logged once at INFO with its reason.
    """
    if isinstance(ns_dtype, str) and ns_dtype in _DTYPE_OF:
        return _DTYPE_OF[ns_dtype]
    if not isinstance(ns_dtype, str) or ns_dtype != "auto":
        raise ValueError(f"ns_dtype must be one of {NS_DTYPES} ('auto' picks per device), got {ns_dtype!r}")
    dev = device if isinstance(device, torch.device) else torch.device(device or "cpu")
    key = _device_key(dev)
    env = os.environ.get(NS_DTYPE_ENV, "").strip().lower()
    if env:
        if env not in _DTYPE_OF:
            raise ValueError(f"environment variable {NS_DTYPE_ENV}={os.environ[NS_DTYPE_ENV]!r} is not one of "
                             f"{tuple(_DTYPE_OF)}; set it to bf16 or fp32, or unset it to let ns_dtype='auto' decide")
        if (key, env) not in _OVERRIDE_LOGGED:
            _OVERRIDE_LOGGED.add((key, env))
            log.info("Newton-Schulz dtype on %s: %s (ns_dtype='auto' overridden by %s)", key, env, NS_DTYPE_ENV)
        return _DTYPE_OF[env]
    cached = _AUTO_CACHE.get(key)
    if cached is not None:
        return cached
    with _AUTO_LOCK:
        cached = _AUTO_CACHE.get(key)
        if cached is not None:
            return cached
        if dev.type == "cpu":
            fast, reason = _probe_cpu_bf16()
            dtype = torch.bfloat16 if fast else torch.float32
        else:
            dtype, reason = torch.bfloat16, f"{dev.type} device: bf16 matmul runs on tensor cores / native units"
        _AUTO_CACHE[key] = dtype
        log.info("Newton-Schulz dtype on %s: %s (ns_dtype='auto'; %s; set %s=bf16|fp32 to override)",
                 key, _NAME_OF[dtype], reason, NS_DTYPE_ENV)
        return dtype


def _clear_ns_dtype_cache() -> None:
    """Forget the automatic choices (tests)."""
    with _AUTO_LOCK:
        _AUTO_CACHE.clear()
        _OVERRIDE_LOGGED.clear()


# ------------------------------------------------------------------------------------ iteration
def _check_dtype(dtype: torch.dtype, allowed: tuple[torch.dtype, ...]) -> None:
    if dtype not in allowed:
        raise ValueError(f"Newton-Schulz dtype must be one of {allowed}, got {dtype}; "
                         "map ns_dtype strings with resolve_ns_dtype()")


def newton_schulz_folded(
    g: Tensor,
    inv_norm: Tensor,
    schedule: NSSchedule | NSCoefficientSpec,
    steps: int,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Orthogonalize a batch ``g`` of shape ``(B, rows, cols)`` (any float dtype, never written).

    ``inv_norm``: ``(B,)``, ``1 / max(||g_i||_F, eps)`` (fp32); the schedule's ``norm_safety`` is
    folded into it. ``schedule``: an :class:`NSSchedule` (or a spec, resolved with
    :func:`resolve_schedule`). ``dtype``: ``torch.bfloat16`` or ``torch.float32``, the dtype of
    every matmul and of the result ``(B, rows, cols)``.

    Iteration 0 scales only the ``r x r`` matrices (``r = min(rows, cols)``; see the module
    docstring): ``X_1 = [s (a I + b A + c A^2)] X_0`` with ``A = s^2 X_0 X_0^T``, the scaling
    and the ``+ a I`` done in fp32. Later iterations are ``X <- a X + (b A + c A^2) X`` as
    ``baddbmm``. In bf16 with the ``"muon"`` schedule the result is bit-identical to
    the implementation it replaced (``optim/newton_schulz.py`` at commit d92a0c4; a frozen copy is in tests/test_newton_schulz.py).

    Memory: two full-size buffers in ``dtype`` (the iterate and the next one, reused in turn;
    when ``g`` had to be converted to ``dtype``, the converted copy is one of them) plus a few
    ``B x r x r`` matrices; no other full-size temporary.
    """
    if g.ndim != 3:
        raise ValueError(f"expected a (batch, rows, cols) tensor, got shape {tuple(g.shape)}")
    _check_dtype(dtype, (torch.bfloat16, torch.float32))
    steps = _check_steps(steps)
    if not isinstance(schedule, NSSchedule):
        schedule = resolve_schedule(schedule, steps)
    x_in = g if g.dtype == dtype else g.to(dtype)
    owned = x_in is not g  # our own copy: its storage may be reused as scratch
    transposed = x_in.size(-2) > x_in.size(-1)
    x = x_in.mT if transposed else x_in
    s = inv_norm.to(torch.float32).reshape(-1, 1, 1)
    if schedule.norm_safety != 1.0:
        s = s / schedule.norm_safety
    if steps == 0:
        out = (x.float() * s).to(dtype)
        return out.mT if transposed else out
    # Iteration 0, folded: only the r x r matrices are scaled (in fp32, then rounded to dtype).
    a, b, c = schedule.coefficient(0)
    # The fp32 steps are rounded back into the dtype-sized matrices they came from (copy_ rounds as
    # .to(dtype) does): at most one fp32 r x r temporary beside gram and poly, so iteration 0 never
    # holds more than the later iterations' two full-size buffers and two r x r matrices.
    gram = torch.bmm(x, x.mT)
    gram.copy_(gram.float().mul_(s * s))  # fp32 scaling, rounded once
    poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
    left = poly.float()  # fp32 copy of poly, whose storage then takes the rounded result
    left.diagonal(dim1=-2, dim2=-1).add_(a)
    poly.copy_(left.mul_(s))
    del left
    x = torch.bmm(poly, x)  # (B, r, c), contiguous
    if steps == 1:
        return x.mT if transposed else x
    # Later iterations ping-pong between two full-size buffers (no allocation per iteration).
    if owned and x_in.is_contiguous():
        scratch = x_in.view(x.shape)  # the converted input is no longer needed
    else:
        scratch = torch.empty_like(x)
    del x_in
    for i in range(1, steps):
        a, b, c = schedule.coefficient(i)
        torch.bmm(x, x.mT, out=gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
        torch.baddbmm(x, poly, x, beta=a, out=scratch)
        x, scratch = scratch, x
    del scratch
    return x.mT if transposed else x


def newton_schulz_reference(
    g: Tensor,
    schedule: NSSchedule | NSCoefficientSpec,
    steps: int,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """The textbook form, one 2-D matrix: ``X = G / (norm_safety * max(||G||_F, eps))``, then
    ``X <- a_i X + (b_i A + c_i A^2) X`` with ``A = X X^T`` (transposed when ``rows > cols``),
    every operation in ``dtype`` (bf16, fp32 or fp64). In bf16 with the ``"muon"`` schedule this
    is ``torch.optim.Muon``'s ``_zeropower_via_newtonschulz`` operation for operation. Kept beside
    the folded form for tests."""
    if g.ndim != 2:
        raise ValueError(f"expected a 2-D matrix, got shape {tuple(g.shape)}")
    _check_dtype(dtype, (torch.bfloat16, torch.float32, torch.float64))
    steps = _check_steps(steps)
    if not isinstance(schedule, NSSchedule):
        schedule = resolve_schedule(schedule, steps)
    x = g.to(dtype)
    transposed = g.size(0) > g.size(1)
    if transposed:
        x = x.T
    norm = x.norm().clamp(min=eps)
    if schedule.norm_safety != 1.0:
        norm = norm * schedule.norm_safety
    x = x / norm
    for i in range(steps):
        a, b, c = schedule.coefficient(i)
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if transposed else x
