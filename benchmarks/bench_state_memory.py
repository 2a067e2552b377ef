"""Optimizer state bytes per Muon-managed parameter element, for every QMuon state format and for
``torch.optim.Muon``.

The bytes are counted from *every* tensor reachable from ``optimizer.state_dict()["state"]``
(8-bit codes, absmax scales, momentum buffers, step counters, anything else) after one
``step()`` with random gradients, then divided by the number of Muon-managed parameter elements.
Nothing is derived from the formula; the formula (``reference.bytes_per_element``) is printed
beside the measurement only as a cross-check.

Matrices: GPT-small (d=768, 12 layers): qkv 2304x768 (a Muon group with ``parts=(768, 768, 768)``),
attn out 768x768, mlp fc 3072x768, mlp proj 768x3072.

    python benchmarks/bench_state_memory.py            # writes benchmarks/results/state_memory.md
    python benchmarks/bench_state_memory.py --d-model 256 --layers 2 --no-write   # quick check
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, default_threads, ensure_backend, gpt_matrices, header_lines, make_params, md_table, qmuon_param_groups  # noqa: E402

from qmuon_lightning import QMuon  # noqa: E402
from qmuon.ops import reference as ref  # noqa: E402

TARGET_INT8 = 1.02  # bytes per parameter
DEFAULT_BLOCK = 256
SWEEP = (64, 128, 256, 512)


def _tensors(obj):
    """Every tensor reachable from a (nested) state entry."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _nbytes(t: torch.Tensor) -> int:
    # Bytes of the tensor's own elements (a view would not own more; none are expected here).
    return t.numel() * t.element_size()


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else (f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B")


def measure(kind: str, fmt: str | None, block_size: int | None, specs, seed: int) -> dict:
    params = make_params(specs, seed)
    n_elems = sum(p.numel() for p in params)
    if kind == "torch":
        opt = torch.optim.Muon(params)
    else:
        opt = QMuon(qmuon_param_groups(specs, params), state_format=fmt, state={"block_size": block_size})
    g = torch.Generator().manual_seed(seed + 1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    t0 = time.perf_counter()
    opt.step()
    step_s = time.perf_counter() - t0

    state = opt.state_dict()["state"]
    if len(state) != len(params):
        raise RuntimeError(f"{kind}/{fmt}: state has {len(state)} entries for {len(params)} parameters")
    by_key: dict[str, int] = {}
    n_tensors = 0
    non_tensor: set[str] = set()
    for entry in state.values():
        for k, v in entry.items():
            ts = list(_tensors(v))
            if not ts:
                non_tensor.add(k)
            for t in ts:
                n_tensors += 1
                by_key[k] = by_key.get(k, 0) + _nbytes(t)
    total = sum(by_key.values())
    cross = opt.state_nbytes() if isinstance(opt, QMuon) else None
    if fmt is None:
        analytic = 4.0
    else:
        analytic = sum(ref.bytes_per_element(fmt, p.shape[1], block_size) * p.numel() for p in params) / n_elems
    out = {
        "kind": kind, "fmt": fmt, "block_size": block_size, "elements": n_elems, "bytes": total,
        "by_key": by_key, "tensors": n_tensors, "non_tensor": sorted(non_tensor),
        "bpp": total / n_elems, "analytic_momentum_bpp": analytic, "state_nbytes": cross, "step_s": step_s,
    }
    del opt, params, state
    gc.collect()
    return out


def _partial_note(specs) -> str:
    notes = []
    for bs in SWEEP:
        cols = sorted({s.shape[1] for s in specs if s.shape[1] % bs})
        if cols:
            notes.append(f"block_size={bs} leaves a partial last block in rows of {', '.join(map(str, cols))} columns")
    return ("; " + "; ".join(notes) + ", so it saves less than 4 / block_size suggests") if notes else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "state_memory.md")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    specs = gpt_matrices(args.d_model, args.layers)
    print(f"torch.ops.qmuon backend: {ensure_backend()}", flush=True)
    configs = [("torch", None, None), ("qmuon", "fp32", DEFAULT_BLOCK), ("qmuon", "bf16", DEFAULT_BLOCK)]
    configs += [("qmuon", "int8", bs) for bs in SWEEP]
    configs += [("qmuon", "uint8", DEFAULT_BLOCK)]
    results = []
    for kind, fmt, bs in configs:
        r = measure(kind, fmt, bs, specs, args.seed)
        label = "torch.optim.Muon" if kind == "torch" else f"QMuon {fmt}"
        print(f"  {label:18s} block={bs}: {r['bpp']:.4f} B/param ({r['tensors']} tensors, step {r['step_s']:.1f}s)",
              flush=True)
        results.append(r)

    torch_bpp = results[0]["bpp"]
    rows = []
    for r in results:
        label = "torch.optim.Muon" if r["kind"] == "torch" else f"QMuon `{r['fmt']}`"
        dense = r["fmt"] in (None, "fp32", "bf16")
        bs = "-" if dense else str(r["block_size"]) + (" (default)" if r["block_size"] == DEFAULT_BLOCK else "")
        keys = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in sorted(r["by_key"].items()))
        is_int8 = r["fmt"] == "int8"
        target = ("PASS" if r["bpp"] <= TARGET_INT8 else "FAIL") if is_int8 else ""
        xcheck = "-" if r["state_nbytes"] is None else ("equal" if r["state_nbytes"] == r["bytes"] else f"{r['state_nbytes']}")
        rows.append([
            label, bs, f"{r['bytes'] / 2**20:.2f}", keys, f"{r['bpp']:.4f}", f"{r['analytic_momentum_bpp']:.4f}",
            f"{r['bpp'] / torch_bpp:.3f}x", xcheck, target,
        ])
    table = md_table(
        ["optimizer", "block_size", "state MiB", "bytes by key", "bytes / param", "formula (momentum only)",
         "vs torch.optim.Muon", "`state_nbytes()`", f"int8 <= {TARGET_INT8}"],
        rows, ["l", "l", "r", "l", "r", "r", "r", "l", "l"],
    )
    default = next(r for r in results if r["fmt"] == "int8" and r["block_size"] == DEFAULT_BLOCK)
    verdict = "PASS" if default["bpp"] <= TARGET_INT8 else "FAIL"
    n = results[0]["elements"]
    n_mats = len(specs)
    lines = header_lines("Optimizer state memory per Muon-managed parameter")
    lines += [
        f"Matrices: GPT d={args.d_model}, {args.layers} layers, {n_mats} Muon matrices, {n:,} elements "
        f"(qkv {3 * args.d_model}x{args.d_model} with `parts=({args.d_model}, {args.d_model}, {args.d_model})`, "
        f"attn out {args.d_model}x{args.d_model}, mlp fc {4 * args.d_model}x{args.d_model}, "
        f"mlp proj {args.d_model}x{4 * args.d_model}).",
        "",
        "Bytes are summed over every tensor in `optimizer.state_dict()[\"state\"]` after one `step()` with "
        "random gradients (codes, absmax scales, momentum buffers, 0-d `step` counters) and divided by the "
        "number of Muon-managed elements. \"formula\" is `reference.bytes_per_element` (momentum tensors only, "
        "no `step`), shown as a cross-check; `state_nbytes()` is `QMuon.state_nbytes()` compared with the count.",
        "",
        table,
        "",
        f"**Target int8 <= {TARGET_INT8} bytes/param at the default block_size={DEFAULT_BLOCK}: {verdict}** "
        f"(measured {default['bpp']:.4f}; torch.optim.Muon {torch_bpp:.4f}).",
        "",
        "Block-size sweep (int8): " + ", ".join(
            f"{r['block_size']}: {r['bpp']:.4f} ({'PASS' if r['bpp'] <= TARGET_INT8 else 'FAIL'})"
            for r in results if r["fmt"] == "int8"
        ) + ". Each row block costs 4 bytes of fp32 absmax, so the overhead is about 4 / block_size bytes "
        "per element" + _partial_note(specs) + ".",
        "",
    ]
    text = "\n".join(lines)
    print()
    print(text)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
