"""Helpers shared by the test modules (imported as ``from _helpers import ...``; pytest's default
``prepend`` import mode puts tests/ on sys.path)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

#: One quantization step is absmax / 127 (symmetric 8-bit absmax quantization, codes in [-127, 127]).
QMAX = 127.0


def ns_float64(x: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = 5, eps: float = 1e-7,
               norm_safety: float = 1.0) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of torch.optim.Muon, evaluated in float64 (the
    "exact" target both bf16 implementations approximate).

    ``coefficients``: one ``(a, b, c)`` used at every iteration, or a per-iteration schedule
    ``((a_0, b_0, c_0), ...)`` (iteration ``i`` uses entry ``min(i, len - 1)``, e.g. Polar
    Express's); the input is divided by ``norm_safety * ||x||_F`` (1.01 for Polar Express)."""
    schedule = [tuple(coefficients)] if not isinstance(coefficients[0], (tuple, list)) else list(coefficients)
    x = x.double()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (norm_safety * x.norm().clamp(min=eps))
    for i in range(steps):
        a, b, c = schedule[min(i, len(schedule) - 1)]
        gram = x @ x.T
        poly = b * gram + c * gram @ gram
        x = a * x + poly @ x
    return x.T if transposed else x


def torch_adjusted_lr(lr: float, adjust_lr_fn, rows: int, cols: int) -> float:
    """torch.optim.Muon's _adjust_lr, restated."""
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def realistic_grads(rows: int, cols: int, steps: int, *, seed: int, scale: float = 1e-3, rank: int = 4):
    """A sequence of gradients like a training run's: a slowly rotating low-rank signal plus noise,
    with a few "heavy" rows (x10) so per-row blocks have very different scales, magnitude ~scale."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(rows, rank, generator=g)
    v = torch.randn(rank, cols, generator=g) / math.sqrt(cols)
    row_scale = torch.ones(rows, 1)
    heavy = torch.randperm(rows, generator=g)[: max(1, rows // 8)]
    row_scale[heavy] = 10.0
    out = []
    for _ in range(steps):
        coef = torch.randn(rank, generator=g)
        signal = (u * coef) @ v
        noise = 0.5 * torch.randn(rows, cols, generator=g) / math.sqrt(rank)
        out.append((scale * row_scale * (signal + noise)).float())
    return out


def blocked_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per row-block max |x| of a 2-D tensor, shape (rows, ceil(cols / block_size))."""
    rows, cols = x.shape
    nb = (cols + block_size - 1) // block_size
    pad = nb * block_size - cols
    xb = torch.nn.functional.pad(x.abs(), (0, pad)).reshape(rows, nb, block_size)
    return xb.amax(dim=-1)


def expand_blocks(per_block: torch.Tensor, block_size: int, cols: int) -> torch.Tensor:
    """(rows, nb) -> (rows, cols): every element gets its block's value."""
    return per_block.repeat_interleave(block_size, dim=1)[:, :cols]


def roundtrip_state_dict(sd: dict) -> dict:
    """torch.save into memory and torch.load(weights_only=True), as a checkpoint would."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def momentum_fp32(opt, p) -> torch.Tensor:
    """Dequantized fp32 momentum of parameter ``p`` in a QMuon optimizer (any format)."""
    from qmuon.quant import dequantize_momentum, format_options

    group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
    return dequantize_momentum(opt.state[p], opts=format_options(group), cols=p.numel() // p.shape[0])


# ----------------------------------------------------------------------------- kernel comparisons
def sumsq_rtol(block_size: int) -> float:
    """Tolerance of a per-block sum of squares, kernel vs reference: both add ``n <= block_size``
    non-negative fp32 squares in different orders; each is within ``(n - 1) * 2**-24`` (relative) of
    the exact sum, so they differ by at most ``2 * block_size * 2**-24``."""
    return 2.0 * block_size * 2.0**-24


def float_bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a float tensor's bits, so equality is bitwise (NaN- and -0-aware)."""
    t = t.contiguous()
    if not t.is_floating_point():
        return t
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Same shape, dtype and bits (on CPU), with the first differing elements in the message."""
    a, b = a.cpu(), b.cpu()
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    eq = float_bits(a) == float_bits(b)
    if not bool(eq.all()):
        idx = (~eq).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int((~eq).sum())} of {eq.numel()} elements differ, first at {idx}: "
                             f"{[a[tuple(i)].item() for i in idx]} vs {[b[tuple(i)].item() for i in idx]}")


def assert_sumsq_close(a: torch.Tensor, b: torch.Tensor, block_size: int) -> None:
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=sumsq_rtol(block_size), atol=1e-30, equal_nan=True)


# ----------------------------------------------------------------------------- state comparison
def assert_same(a, b, where: str = "") -> None:
    """Bit-exact equality of nested state (dicts, lists, tuples, tensors, plain values): tensors
    must have the same dtype, shape and values (``torch.equal``); the message names the first
    differing entry by its path and, for tensors, the largest difference."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if not torch.equal(a, b):
            d = (a.double() - b.double()).abs()
            raise AssertionError(f"{where}: {int((d != 0).sum())} of {d.numel()} elements differ, max |diff| "
                                 f"{d.max().item():.3e}")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), \
            f"{where}: keys differ: {sorted(set(a) ^ set(b if isinstance(b, dict) else {}), key=str)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# ----------------------------------------------------------------------------- DeepSpeed
def ds_gathered(module: torch.nn.Module) -> list[torch.Tensor]:
    """Copies of ``module``'s full parameters; under DeepSpeed ZeRO-3 (parameters with ``ds_shape``)
    gathered from their partitions first."""
    import deepspeed

    params = list(module.parameters())
    if not hasattr(params[0], "ds_shape"):
        return [p.detach().clone() for p in params]
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


# ----------------------------------------------------------------------------- kernel test inputs
def make_grad(rows: int, cols: int, dtype: torch.dtype = torch.float32, *, seed: int = 1,
              device: str | torch.device = "cpu") -> torch.Tensor:
    """A standard-normal x 2 gradient of ``dtype`` (drawn in fp32 from ``seed``, then cast)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=gen) * 2).to(dtype).to(device)


def momentum(rows: int, cols: int, seed: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    """An fp32 momentum with row-varying scale (1e-4 .. 3): block scales of very different sizes."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=gen) * (torch.rand(rows, 1, generator=gen) * 3 + 1e-4)).to(device)


def nan_sums(grads: list[torch.Tensor], block_size: int) -> list[torch.Tensor]:
    """NaN-filled per-block sum-of-squares outputs for an update op (the op must overwrite every one)."""
    from qmuon.ops import reference as ref

    return [torch.full((g.shape[0], ref.num_blocks(g.shape[1], block_size)), float("nan"), device=g.device)
            for g in grads]


def noise_or_none(x: torch.Tensor, stream: int, offset: int) -> torch.Tensor | None:
    """The reference uniform rounding noise for ``x`` (stream ``stream``, element offset ``offset``),
    or None for round-to-nearest (``stream < 0``)."""
    from qmuon.ops import reference as ref

    return None if stream < 0 else ref.uniform_noise(*x.shape, stream, offset, x.device)


def fsdp_scenario_main(scenario_fn, prefix: str) -> None:
    """Entry point of a test file run as a torchrun worker: ``python test_x.py fsdp OUT_DIR`` runs
    ``scenario_fn(OUT_DIR)`` and writes its result to ``OUT_DIR/<prefix>_rank<R>.json``."""
    import json
    import sys
    import warnings

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    if scenario != "fsdp":
        raise SystemExit(f"unknown scenario {scenario!r}; the only one is 'fsdp'")
    result = scenario_fn(out_dir)
    (out_dir / f"{prefix}_rank{result['rank']}.json").write_text(json.dumps(result, indent=1, default=str))
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()  # see its docstring


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (all-gathered), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def fabric_resume_scenario(make, loss, ckpt) -> dict:
    """The plain Fabric loop both the dense HF and the MoE tests run on 2 processes: ``make(seed)``
    returns ``(fabric, model, optimizer)`` set up by Fabric; ``loss(model, step, rank)`` one
    training loss. Trains steps 0-1 (recording the first step's weights before and after and its
    gradients, whole), saves with ``fabric.save`` at step 2, trains to step 4; then a fresh run
    (another seed) loads the checkpoint and trains to step 4 too. Returns ``first`` (``before``,
    ``after``, ``grads`` by parameter name), ``mismatches`` (empty when both runs end with the same
    parameters and optimizer state, bit for bit), ``n_snap``, ``resumed_at`` and the resumed
    ``model`` / ``optimizer`` for further checks."""

    def run(fabric, model, opt, steps: range, first: dict | None = None) -> None:
        for s in steps:
            fabric.backward(loss(model, s, fabric.global_rank))
            if first is not None and s == 0:
                first["before"] = {n: full_tensor(p.detach()).clone() for n, p in model.module.named_parameters()}
                first["grads"] = {n: full_tensor(p.grad).clone() for n, p in model.module.named_parameters()
                                  if p.grad is not None}
            opt.step()
            opt.zero_grad(set_to_none=True)
            if first is not None and s == 0:
                first["after"] = {n: full_tensor(p.detach()).clone() for n, p in model.module.named_parameters()}

    def snap(model, opt) -> dict:
        out = {f"param/{n}": full_tensor(p.detach()).clone() for n, p in model.module.named_parameters()}
        for gi, g in enumerate(opt.param_groups):
            for i, p in enumerate(g["params"]):
                for k, v in opt.state.get(p, {}).items():
                    out[f"state/{gi}/{i}/{k}"] = full_tensor(v).clone()
        return out

    fabric, model, opt = make(0)
    first: dict = {}
    run(fabric, model, opt, range(2), first)
    fabric.save(ckpt, {"model": model, "optimizer": opt, "step": 2})
    run(fabric, model, opt, range(2, 4))
    a = snap(model, opt)
    fabric2, model2, opt2 = make(5)
    state = {"model": model2, "optimizer": opt2, "step": 0}
    fabric2.load(ckpt, state)
    run(fabric2, model2, opt2, range(state["step"], 4))
    try:
        assert_same(a, snap(model2, opt2), "fabric resume")
        mismatches: list[str] = []
    except AssertionError as e:
        mismatches = [str(e)]
    return {"first": first, "mismatches": mismatches, "n_snap": len(a), "resumed_at": state["step"],
            "model": model2, "optimizer": opt2}
