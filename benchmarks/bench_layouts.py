"""Sharded QMuon per mesh layout: bytes each rank sends per Muon parameter and the share of the
step's Newton-Schulz cost each rank runs.

Layouts (gloo CPU processes, one torch thread each): FSDP2 on a 1-D mesh of 2 and of 4, HSDP on a
``(replicate, shard)`` mesh 2 x 2, and expert parallelism (``Shard(0)`` of expert banks over 2
and 4 ranks). Model: a decoder-shaped stack (per layer q, k, v, o ``d x d``, MLP ``4d x d`` /
``d x 4d``) plus, per layer, an expert bank of ``E`` experts (``gate_up_proj (E, 2 i, d)``,
``down_proj (E, d, i)``). Figures from ``opt.comm_stats`` after the second step:
``ns_bytes_sent`` (this rank, both all-to-all trips and the HSDP replicate share, excluding its
own segment) over the model's Muon parameters, and ``ns_share`` (this rank's NS cost, ``rows x
cols x min(rows, cols)`` per matrix, over the step's total). A replica-blind HSDP plan (every
replica redoing its shard group's work, as dion does) would run ``1 / S`` per rank.

Writes ``benchmarks/results/comm_layouts.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import RESULTS_DIR, header_lines, md_table  # noqa: E402

LAYOUTS = [  # (name, mesh shape, experts only)
    ("FSDP2 1-D, 2 ranks", (2,), False),
    ("FSDP2 1-D, 4 ranks", (4,), False),
    ("HSDP 2 x 2", (2, 2), False),
    ("expert parallel (banks only), 2 ranks", (2,), True),
    ("expert parallel (banks only), 4 ranks", (4,), True),
]


class Experts(torch.nn.Module):  # detected as a bank by class name, like transformers' *Experts
    def __init__(self, e: int, d: int, i: int) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(e, 2 * i, d) * 0.02)
        self.down_proj = torch.nn.Parameter(torch.randn(e, d, i) * 0.02)


def make_model(d: int, layers: int, experts: int, banks_only: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Module()
    blocks = []
    for _ in range(layers):
        b = torch.nn.Module()
        if not banks_only:
            b.attn = torch.nn.ModuleList([torch.nn.Linear(d, d, bias=False) for _ in range(4)])
            b.mlp = torch.nn.ModuleList([torch.nn.Linear(d, 4 * d, bias=False), torch.nn.Linear(4 * d, d, bias=False)])
        b.experts = Experts(experts, d, d // 2)
        blocks.append(b)
    m.layers = torch.nn.ModuleList(blocks)
    return m


def _worker(rank: int, world: int, shape: tuple[int, ...], banks_only: bool, d: int, layers: int, experts: int,
            carrier: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    import qmuon_lightning as ql

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    model = make_model(d, layers, experts, banks_only)
    for b in model.layers:
        fully_shard(b, mesh=mesh)
    opt = ql.build_optimizer(model, lr=0.02, state_format="int8", comm_carrier=carrier, comm_return=carrier,
                             verbose=False)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = distribute_tensor(torch.randn(p.shape, generator=g) * 1e-3, p.device_mesh, p.placements)
        opt.step()
    muon = sum(p.numel() for g in opt.param_groups if g["use_muon"] for p in g["params"])
    return {"sent": opt.comm_stats["ns_bytes_sent"], "share": opt.comm_stats["ns_share"], "muon": muon}


def main() -> None:
    from _dist import run_workers

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--out", default=str(RESULTS_DIR / "comm_layouts.md"))
    args = ap.parse_args()
    rows = []
    for name, shape, banks_only in LAYOUTS:
        world = 1
        for n in shape:
            world *= n
        for carrier in ("int8", "bf16"):
            res = run_workers(_worker, world, timeout=600, shape=shape, banks_only=banks_only, d=args.d,
                              layers=args.layers, experts=args.experts, carrier=carrier)
            muon = res[0]["muon"]
            sent = [r["sent"] / muon for r in res]
            shares = [r["share"] for r in res]
            rows.append([name, carrier, f"{muon:,}", " / ".join(f"{x:.2f}" for x in sent), f"{sum(sent):.2f}",
                         " / ".join(f"{x:.3f}" for x in shares), f"{1 / world:.3f}"])
            print(rows[-1], flush=True)
    lines = header_lines("Sharded QMuon per mesh layout: bytes sent and Newton-Schulz share per rank")
    lines += ["", f"Model: d={args.d}, {args.layers} layers, {args.experts} experts per layer (inter d/2); int8 "
              "momentum, both carriers as listed; figures of the second step.", "",
              md_table(["layout", "carrier", "Muon params", "bytes sent / param, per rank", "sum over ranks",
                        "NS cost share, per rank", "ideal share"], rows), ""]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
