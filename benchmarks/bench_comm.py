"""Distributed Newton-Schulz of sharded QMuon: bytes moved per Muon parameter, update fidelity of
each carrier, and step time vs unsharded QMuon.

Two CPU processes (gloo) hold a GPT-shaped stack of Muon matrices sharded with FSDP2
(``fully_shard``, ``Shard(0)``). Every step each rank feeds the *same* full gradients to the
sharded optimizer and to an unsharded single-process QMuon, so that

* **bytes**: ``opt.comm_stats`` counts the byte buffers handed to the two ``all_to_all_single``
  calls (forward: NS inputs + fp32 block sums of squares; return: NS outputs), excluding each
  rank's own segment; "exchange bytes / param" is the carrier cost if every element crossed the
  wire both ways (what "bf16 all-to-all both ways = 4 bytes" refers to), "wire bytes / param" is
  what actually crossed between the 2 ranks (the owner's own rows stay local);
* **fidelity**: the cosine between the sharded and the unsharded update ``p_after - p_before``
  (weight decay 0, so the update is the orthogonalized momentum only; momentum is identical by
  construction, so the difference is the carrier's);
* **time**: median wall time of the sharded ``step()`` (max over ranks, barrier-synchronized) vs
  the unsharded ``step()`` of the same process (1 torch thread per process; gloo on CPU, loopback
  TCP: not a GPU / NCCL number).

Writes ``benchmarks/results/comm.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, gpt_matrices, header_lines, md_table  # noqa: E402

CONFIGS = [  # (forward carrier, return carrier)
    ("bf16", "bf16"),
    ("int8", "int8"),
    ("int8", "bf16"),
    ("mxfp8", "int8"),
    ("mxfp8", "bf16"),
]


def _grads(shapes, step: int, rank: int = 4):
    """Low-rank signal + noise with a few heavy rows (a training-like gradient spectrum)."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for rows, cols in shapes:
        u = torch.randn(rows, rank, generator=g)
        v = torch.randn(rank, cols, generator=g) / cols ** 0.5
        scale = torch.ones(rows, 1)
        scale[torch.randperm(rows, generator=g)[: max(1, rows // 8)]] = 10.0
        out.append(1e-3 * scale * (u @ v + 0.5 * torch.randn(rows, cols, generator=g) / rank ** 0.5))
    return out


def _worker(rank: int, world: int, store: str, d_model: int, n_layers: int, warmup: int, steps: int, out: str) -> None:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    import qmuon

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    specs = gpt_matrices(d_model, n_layers)
    shapes = [s.shape for s in specs]

    def module():
        m = nn.Module()
        g = torch.Generator().manual_seed(0)
        for i, s in enumerate(specs):
            m.register_parameter(f"p{i}", nn.Parameter(torch.randn(s.shape, generator=g) * 0.02))
        return m

    def groups(m):
        ps = [getattr(m, f"p{i}") for i in range(len(specs))]
        fused = [p for s, p in zip(specs, ps) if s.parts]
        plain = [p for s, p in zip(specs, ps) if not s.parts]
        return [{"params": plain}, {"params": fused, "parts": specs[0].parts}]

    results = []
    for fwd, ret in CONFIGS:
        sharded, ref = module(), module()
        fully_shard(sharded, mesh=mesh)
        opt = qmuon.QMuon(groups(sharded), lr=0.02, weight_decay=0.0, newton_schulz={"comm_carrier": fwd, "comm_return": ret})
        ref_opt = qmuon.QMuon(groups(ref), lr=0.02, weight_decay=0.0)
        t_sh, t_ref, cos, stats = [], [], [], None
        for s in range(warmup + steps):
            grads = _grads(shapes, s)
            ps = [getattr(sharded, f"p{i}") for i in range(len(specs))]
            rs = [getattr(ref, f"p{i}") for i in range(len(specs))]
            for p, r_, g in zip(ps, rs, grads):
                rows = g.shape[0]
                chunk = -(-rows // world)
                a, b = min(rank * chunk, rows), min(rank * chunk + chunk, rows)
                p.grad = DTensor.from_local(g[a:b].clone(), mesh, [Shard(0)], run_check=False, shape=g.shape,
                                            stride=g.stride())
                r_.grad = g.clone()
            before = [p.to_local().clone() for p in ps]
            before_ref = [r_.detach().clone() for r_ in rs]
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            t0 = time.perf_counter()
            ref_opt.step()
            dr = time.perf_counter() - t0
            if s < warmup:
                continue
            t_sh.append(dt.item())
            t_ref.append(dr)
            stats = dict(opt.comm_stats)
            # cosine of the updates over all Muon matrices (gathered; not timed)
            num = den_a = den_b = 0.0
            per = []
            for p, b0, r_, rb in zip(ps, before, rs, before_ref):
                u = DTensor.from_local(p.to_local() - b0, mesh, [Shard(0)], run_check=False, shape=p.shape,
                                       stride=p.stride()).full_tensor().double()
                v = (r_.detach() - rb).double()
                num += (u * v).sum().item()
                den_a += (u * u).sum().item()
                den_b += (v * v).sum().item()
                per.append(((u * v).sum() / (u.norm() * v.norm())).item())
            cos.append((num / (den_a * den_b) ** 0.5, min(per)))
        results.append({"fwd": fwd, "ret": ret, "t_sh": t_sh, "t_ref": t_ref, "cos": cos, "stats": stats})
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=str(RESULTS_DIR / "comm.md"))
    args = ap.parse_args()
    world = 2
    load0 = os.getloadavg()[0]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        res_path = os.path.join(tmp, "res.pt")
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), args.d_model, args.layers, args.warmup,
                                          args.steps, res_path), nprocs=world, start_method="spawn")
        results = torch.load(res_path, weights_only=False)
    elapsed = time.time() - t0
    load1 = os.getloadavg()[0]
    specs = gpt_matrices(args.d_model, args.layers)
    n_el = sum(s.shape[0] * s.shape[1] for s in specs)
    base = next(r for r in results if r["fwd"] == "bf16" and r["ret"] == "bf16")["stats"]
    rows = []
    for r in results:
        st = r["stats"]
        cos_all = min(c[0] for c in r["cos"])
        cos_min = min(c[1] for c in r["cos"])
        ratio = statistics.median(r["t_sh"]) / statistics.median(r["t_ref"])
        rows.append([
            f"`{r['fwd']}` / `{r['ret']}`",
            f"{st['exchange_bytes_per_param']:.3f}",
            f"{st['exchange_bytes_per_param'] / base['exchange_bytes_per_param']:.3f}x",
            f"{st['wire_bytes_per_param']:.3f}",
            f"{st['ns_bytes_total'] / base['ns_bytes_total']:.3f}x",
            f"{cos_all:.6f}",
            f"{cos_min:.6f}",
            f"{statistics.median(r['t_sh']) * 1e3:.0f}",
            f"{statistics.median(r['t_ref']) * 1e3:.0f}",
            f"{ratio:.2f}x",
        ])
    lines = header_lines("Distributed Newton-Schulz: bytes per Muon parameter and step time (2 CPU ranks)")
    lines += [
        f"Matrices: GPT d={args.d_model}, {args.layers} layers ({len(specs)} Muon matrices, {n_el:,} elements; "
        f"qkv {3 * args.d_model}x{args.d_model} with 3 parts, mlp {4 * args.d_model}x{args.d_model} / "
        f"{args.d_model}x{4 * args.d_model}), sharded with FSDP2 `fully_shard` over 2 gloo processes, 1 torch "
        f"thread each; int8 momentum, block 256. {args.steps} measured steps after {args.warmup} warm-up; every step "
        "both optimizers get the same full gradients (low-rank + noise, a few heavy rows).",
        "",
        "- **exchange bytes / param**: carrier bytes per Muon element if every element crossed the wire both "
        "ways (NS input + fp32 block sums of squares forward, NS output back): the figure behind "
        "\"bf16 all-to-all both ways = 4\". Target <= 3.",
        "- **wire bytes / param**: bytes actually passed to `all_to_all_single` for other ranks (each rank's "
        "own segment excluded), all ranks, per Muon element; with 2 ranks about half of every matrix is "
        "already on its owner.",
        "- **update cosine**: sharded vs unsharded QMuon update `p_after - p_before` (weight decay 0), over all "
        "matrices (worst step) and the worst single matrix (worst step).",
        "- **step time**: median ms of the sharded `step()` (max over the 2 ranks) and of the unsharded `step()` "
        "in the same process; CPU gloo over loopback, so the ratio says little about a GPU with NCCL, where "
        "NS is fast and the exchange matters more.",
        "",
        md_table(["carrier fwd / return", "exchange B/param", "vs bf16", "wire B/param", "wire vs bf16",
                  "update cos (all)", "update cos (worst matrix)", "sharded ms", "unsharded ms",
                  "step time ratio"], rows),
        "",
        f"Run time {elapsed:.0f} s; 1-min load average at start / end: {load0:.1f} / {load1:.1f} on 2 CPUs "
        "(other jobs shared the cores when it exceeds 2; the times are then indicative only).",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
