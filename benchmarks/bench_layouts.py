"""Sharded QMuon per mesh layout: bytes each rank sends per Muon parameter and the share of the
step's Newton-Schulz cost each rank runs.

Layouts (gloo CPU processes, one torch thread each): FSDP2 on a 1-D mesh of 2 and of 4, HSDP on a
``(replicate, shard)`` mesh 2 x 2, expert parallelism (``Shard(0)`` of expert banks over 2
and 4 ranks), and data parallel x tensor parallel 2 x 2 (``--only tp``: q / k / v and the MLP up
projection colwise, o and the MLP down projection rowwise, then FSDP2 on the dp dim; the dense
stack without expert banks, next to FSDP2 1-D on 4 ranks of the same stack). Model: a decoder-shaped stack (per layer q, k, v, o ``d x d``, MLP ``4d x d`` /
``d x 4d``) plus, per layer, an expert bank of ``E`` experts (``gate_up_proj (E, 2 i, d)``,
``down_proj (E, d, i)``). Figures from ``opt.comm_stats`` after the second step:
``ns_bytes_sent`` (this rank, both all-to-all trips and the HSDP replicate share, excluding its
own segment) over the model's Muon parameters, and ``ns_share`` (this rank's NS cost, ``rows x
cols x min(rows, cols)`` per matrix, over the step's total). A replica-blind HSDP plan (every
replica redoing its shard group's work, as dion does) would run ``1 / S`` per rank.

Writes ``benchmarks/results/comm_layouts.md`` (``--only tp`` appends its section to it).
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

LAYOUTS = [  # (name, mesh shape, kind: "stack" (dense + banks), "banks" (banks only), "dense", "tp")
    ("FSDP2 1-D, 2 ranks", (2,), "stack"),
    ("FSDP2 1-D, 4 ranks", (4,), "stack"),
    ("HSDP 2 x 2", (2, 2), "stack"),
    ("expert parallel (banks only), 2 ranks", (2,), "banks"),
    ("expert parallel (banks only), 4 ranks", (4,), "banks"),
]
TP_LAYOUTS = [
    ("FSDP2 1-D, 4 ranks (dense stack)", (4,), "dense"),
    ("FSDP2 x TP 2 x 2 (dense stack)", (2, 2), "tp"),
]


class Experts(torch.nn.Module):  # detected as a bank by class name, like transformers' *Experts
    def __init__(self, e: int, d: int, i: int) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(e, 2 * i, d) * 0.02)
        self.down_proj = torch.nn.Parameter(torch.randn(e, d, i) * 0.02)


def make_model(d: int, layers: int, experts: int, kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Module()
    blocks = []
    for _ in range(layers):
        b = torch.nn.Module()
        if kind != "banks":
            b.attn = torch.nn.ModuleList([torch.nn.Linear(d, d, bias=False) for _ in range(4)])
            b.mlp = torch.nn.ModuleList([torch.nn.Linear(d, 4 * d, bias=False), torch.nn.Linear(4 * d, d, bias=False)])
        if kind in ("stack", "banks"):
            b.experts = Experts(experts, d, d // 2)
        blocks.append(b)
    m.layers = torch.nn.ModuleList(blocks)
    return m


def _local_piece(full: torch.Tensor, like: Any) -> Any:
    """A DTensor with ``like``'s mesh and placements holding this rank's piece of ``full``
    (``distribute_tensor`` does not take FSDP's ``_StridedShard``)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, off = compute_local_shape_and_global_offset(full.shape, like.device_mesh, like.placements)
    piece = full[tuple(slice(o, o + n) for o, n in zip(off, shape))].clone()
    return DTensor.from_local(piece, like.device_mesh, like.placements, run_check=False, shape=full.shape,
                              stride=full.stride())


def _worker(rank: int, world: int, shape: tuple[int, ...], kind: str, d: int, layers: int, experts: int,
            carrier: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import qmuon_lightning as ql

    names = ("dp", "tp") if kind == "tp" else ("replicate", "shard")[-len(shape):]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = make_model(d, layers, experts, kind)
    for b in model.layers:
        if kind == "tp":
            plan = {"attn.0": ColwiseParallel(), "attn.1": ColwiseParallel(), "attn.2": ColwiseParallel(),
                    "attn.3": RowwiseParallel(), "mlp.0": ColwiseParallel(), "mlp.1": RowwiseParallel()}
            parallelize_module(b, mesh["tp"], plan)
        fully_shard(b, mesh=mesh["dp"] if kind == "tp" else mesh)
    # rowwise shards of d=128 hold 64 columns: momentum blocks of 64 (the dense rows, both meshes)
    block = {"block_size": 64} if kind in ("tp", "dense") else {}
    opt = ql.build_optimizer(model, lr=0.02, state_format="int8", comm_carrier=carrier, comm_return=carrier,
                             verbose=False, **block)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = _local_piece(torch.randn(p.shape, generator=g) * 1e-3, p)
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
    ap.add_argument("--only", choices=("all", "tp"), default="all",
                    help="tp: run the tensor-parallel rows only and append them to --out")
    args = ap.parse_args()
    rows = []
    layouts = TP_LAYOUTS if args.only == "tp" else LAYOUTS + TP_LAYOUTS
    for name, shape, kind in layouts:
        world = 1
        for n in shape:
            world *= n
        for carrier in ("int8", "bf16"):
            res = run_workers(_worker, world, timeout=600, shape=shape, kind=kind, d=args.d,
                              layers=args.layers, experts=args.experts, carrier=carrier)
            muon = res[0]["muon"]
            sent = [r["sent"] / muon for r in res]
            shares = [r["share"] for r in res]
            rows.append([name, carrier, f"{muon:,}", " / ".join(f"{x:.2f}" for x in sent), f"{sum(sent):.2f}",
                         " / ".join(f"{x:.3f}" for x in shares), f"{1 / world:.3f}"])
            print(rows[-1], flush=True)
    table = md_table(["layout", "carrier", "Muon params", "bytes sent / param, per rank", "sum over ranks",
                      "NS cost share, per rank", "ideal share"], rows)
    if args.only == "tp":
        lines = ["", "## Data parallel x tensor parallel", ""]
        lines += header_lines("")[2:]  # command, date, versions, source, machine (no second title)
        lines += ["", f"Model: the dense stack (d={args.d}, {args.layers} layers: q, k, v, o d x d, MLP 4d x d / d x 4d; "
                  "no expert banks), int8 momentum with block_size 64; figures of the second step.", "", table, ""]
        prev = Path(args.out).read_text() if Path(args.out).exists() else ""
        cut = prev.find("\n## Data parallel x tensor parallel")
        Path(args.out).write_text((prev if cut < 0 else prev[:cut]).rstrip("\n") + "\n" + "\n".join(lines))
    else:
        lines = header_lines("Sharded QMuon per mesh layout: bytes sent and Newton-Schulz share per rank")
        lines += ["", f"Model: d={args.d}, {args.layers} layers, {args.experts} experts per layer (inter d/2); int8 "
                  "momentum, both carriers as listed; figures of the second step; the dense-stack rows have no "
                  "expert banks and use block_size 64.", "", table, ""]
        Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
