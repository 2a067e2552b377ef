"""Sharded QMuon per mesh layout: bytes each rank sends per Muon parameter and the share of the
step's Newton-Schulz cost each rank runs.

Layouts (gloo CPU processes, one torch thread each): FSDP2 on a 1-D mesh of 2 and of 4, HSDP on a
``(replicate, shard)`` mesh 2 x 2, expert parallelism (``Shard(0)`` of expert banks over 2
and 4 ranks), and data parallel x tensor parallel 2 x 2 (``--only tp``: q / k / v and the MLP up
projection colwise, o and the MLP down projection rowwise, then FSDP2 on the dp dim; the dense
stack without expert banks, next to FSDP2 1-D on 4 ranks of the same stack), and DeepSpeed ZeRO-3
and ZeRO-2 on 2 processes (``--only zero``: the dense stack under ``WholeMatrixZeroOptimizer``,
trained through the engine on a toy loss). Model: a decoder-shaped stack (per layer q, k, v, o ``d x d``, MLP ``4d x d`` /
``d x 4d``) plus, per layer, an expert bank of ``E`` experts (``gate_up_proj (E, 2 i, d)``,
``down_proj (E, d, i)``). Figures from ``opt.comm_stats`` after the second step:
``ns_bytes_sent`` (this rank, both all-to-all trips and the HSDP replicate share, excluding its
own segment) over the model's Muon parameters, and ``ns_share`` (this rank's NS cost, ``rows x
cols x min(rows, cols)`` per matrix, over the step's total). A replica-blind HSDP plan (every
replica redoing its shard group's work, as dion does) would run ``1 / S`` per rank.

DeepSpeed rows: the wrapper keeps no byte counter, so the worker wraps
``torch.distributed.all_to_all_single`` / ``all_to_all`` and counts what this rank sends to the
other ranks (split sizes x element size, its own split excluded) while the wrapper's ``step()``
runs (DeepSpeed calls it once per sub-group); all-to-alls outside it are counted separately and
must be 0. The carrier is fixed there: fp32 gradient slices to the owner, NS output back in the NS
dtype (bf16 on CPU). NS share: this rank's owned matrices (``opt.owners``, dealt by size) under
the same cost model, checked against the NS calls the wrapper made (``opt.ns_items``).

Writes ``benchmarks/results/comm_layouts.md`` (``--only tp`` / ``--only zero`` replace or append
their section in it).
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
ZERO_LAYOUTS = [("DeepSpeed ZeRO-3, 2 processes (dense stack)", 3), ("DeepSpeed ZeRO-2, 2 processes (dense stack)", 2)]
TP_SECTION = "## Data parallel x tensor parallel"
ZERO_SECTION = "## DeepSpeed ZeRO-3 and ZeRO-2"
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

    import qmuon

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
    block = {"state": {"block_size": 64}} if kind in ("tp", "dense") else {}
    opt = qmuon.build_optimizer(model, lr=0.02, state_format="int8", newton_schulz={"comm_carrier": carrier, "comm_return": carrier}, verbose=False, **block)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = _local_piece(torch.randn(p.shape, generator=g) * 1e-3, p)
        opt.step()
    muon = sum(p.numel() for g in opt.param_groups if g["use_muon"] for p in g["params"])
    return {"sent": opt.comm_stats["ns_bytes_sent"], "share": opt.comm_stats["ns_share"], "muon": muon}


class DenseStack(torch.nn.Module):
    """The dense stack with a forward (DeepSpeed's engine needs a loss to produce gradients):
    ``h += o(q h + k h + v h); h += down(relu(up h))`` per layer."""

    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.layers = make_model(d, layers, 0, "dense").layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            q, k, v, o = b.attn
            x = x + o(q(x) + k(x) + v(x))
            x = x + b.mlp[1](torch.relu(b.mlp[0](x)))
        return x


def _count_all_to_all(rank: int, counter: dict[str, int]) -> None:
    """Wrap ``torch.distributed.all_to_all_single`` / ``all_to_all``: add the bytes this rank sends
    to other ranks to ``counter["step"]`` while ``counter["in_step"]``, else to ``counter["other"]``."""
    import torch.distributed as dist

    single, listed = dist.all_to_all_single, dist.all_to_all

    def add(nbytes: int) -> None:
        counter["step" if counter["in_step"] else "other"] += nbytes

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        world = dist.get_world_size(group)
        me = dist.get_rank(group)
        sizes = list(input_split_sizes) if input_split_sizes else [input.shape[0] // world] * world
        row = input[0].numel() if input.ndim > 1 else 1  # splits count rows of dim 0
        add((sum(sizes) - sizes[me]) * row * input.element_size())
        return single(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

    def all_to_all(output_tensor_list, input_tensor_list, group=None, **kw):
        me = dist.get_rank(group)
        add(sum(t.numel() * t.element_size() for r, t in enumerate(input_tensor_list) if r != me))
        return listed(output_tensor_list, input_tensor_list, group=group, **kw)

    dist.all_to_all_single, dist.all_to_all = all_to_all_single, all_to_all


def _zero_worker(rank: int, world: int, stage: int, d: int, layers: int) -> dict[str, Any]:
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import qmuon
    from qmuon.distributed.plan import ns_cost
    from qmuon.integrations import deepspeed as qds

    counter = {"in_step": 0, "step": 0, "other": 0}
    _count_all_to_all(rank, counter)
    torch.manual_seed(0)
    model = DenseStack(d, layers)
    opt = qmuon.build_optimizer(model, lr=0.02, state_format="int8", state={"block_size": 64}, verbose=False)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}}
    engine, opt, _, _ = qds.initialize(model, opt, cfg)
    inner_step = opt.step

    def step(closure=None):  # DeepSpeed calls it once per (sub-)group and optimizer step
        counter["in_step"] = 1
        try:
            return inner_step(closure)
        finally:
            counter["in_step"] = 0

    opt.step = step
    sent = []
    for s in range(2):
        counter["step"] = 0
        x = torch.randn(2, 8, d, generator=torch.Generator().manual_seed(100 * s + rank))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        sent.append(counter["step"])
    muon = [p for p in opt._params if p.muon]
    owners = opt.owners
    cost = [sum(ns_cost(part.rows, part.cols) for part in p.parts) for p in muon]
    mine = sum(c for c, o in zip(cost, owners) if o == rank)
    # what ran: one NS call per part of each owned matrix, none of the others'
    ran = {p.index: opt.ns_items.get(p.index, 0) for p in muon}
    expected = {p.index: len(p.parts) if o == rank else 0 for p, o in zip(muon, owners)}
    if ran != expected:
        raise RuntimeError(f"rank {rank}: NS calls {ran} differ from the owner table {expected}")
    return {"sent": sent[-1], "share": mine / sum(cost), "muon": sum(p.numel for p in muon),
            "other": counter["other"], "mode": opt._mode, "zero": type(engine.optimizer).__name__}


def _write_section(out: str, heading: str, lines: list[str]) -> None:
    """Replace ``heading``'s section of ``out`` (up to the next ``## `` heading) by ``lines``, or
    append it."""
    prev = Path(out).read_text() if Path(out).exists() else ""
    at = prev.find("\n" + heading)
    if at >= 0:
        nxt = prev.find("\n## ", at + 1)
        prev = prev[:at] + ("" if nxt < 0 else prev[nxt:])
    Path(out).write_text(prev.rstrip("\n") + "\n\n" + "\n".join(lines))


def main() -> None:
    from _dist import run_workers

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--out", default=str(RESULTS_DIR / "comm_layouts.md"))
    ap.add_argument("--only", choices=("all", "tp", "zero"), default="all",
                    help="tp / zero: run the tensor-parallel / DeepSpeed rows only and put their section in --out")
    args = ap.parse_args()
    rows = []
    header = ["layout", "carrier", "Muon params", "bytes sent / param, per rank", "sum over ranks",
              "NS cost share, per rank", "ideal share"]
    if args.only == "zero":
        import os

        os.environ["DS_ACCELERATOR"] = "cpu"  # inherited by the spawned workers, read on deepspeed's import
        for name, stage in ZERO_LAYOUTS:
            res = run_workers(_zero_worker, 2, timeout=600, stage=stage, d=args.d, layers=args.layers)
            if any(r["other"] for r in res):
                raise RuntimeError(f"{name}: all-to-alls outside the optimizer step: {[r['other'] for r in res]}")
            muon = res[0]["muon"]
            sent = [r["sent"] / muon for r in res]
            shares = [r["share"] for r in res]
            rows.append([name, "auto / int8 (defaults)", f"{muon:,}", " / ".join(f"{x:.2f}" for x in sent), f"{sum(sent):.2f}",
                         " / ".join(f"{x:.3f}" for x in shares), f"{1 / 2:.3f}"])
            print(rows[-1], res[0]["mode"], res[0]["zero"], flush=True)
        for carrier in ("int8", "bf16"):  # the anchor: FSDP2 on the same stack and world size
            res = run_workers(_worker, 2, timeout=600, shape=(2,), kind="dense", d=args.d, layers=args.layers,
                              experts=args.experts, carrier=carrier)
            muon = res[0]["muon"]
            sent = [r["sent"] / muon for r in res]
            rows.append(["FSDP2 1-D, 2 ranks (dense stack)", carrier, f"{muon:,}", " / ".join(f"{x:.2f}" for x in sent),
                         f"{sum(sent):.2f}", " / ".join(f"{r['share']:.3f}" for r in res), f"{1 / 2:.3f}"])
            print(rows[-1], flush=True)
        lines = [ZERO_SECTION, ""] + header_lines("")[2:]
        lines += ["", f"Model: the dense stack (d={args.d}, {args.layers} layers, as above) with a toy forward, trained "
                  "through the DeepSpeed engine (gloo, CPU accelerator, micro-batch 2, default buckets and "
                  "sub-groups); int8 momentum with block_size 64; figures of the second step. Carriers: the "
                  "defaults (each rank updates the momentum of its slices and sends their fp32 NS input, "
                  "comm_carrier='auto' under DeepSpeed, with fp32 row-block sums of squares to each matrix's owner; "
                  "the NS output comes back in int8). Bytes counted by wrapping torch.distributed's all-to-alls during "
                  "the optimizer's step (ZeRO's own parameter / gradient collectives are not counted, as in the rows "
                  "above); owners are dealt by NS cost (largest first, to the least loaded rank, ties to the rank "
                  "holding most of the matrix); the share is of the NS cost model above. FSDP2 1-D on 2 ranks of the "
                  "same stack "
                  "(configurable carriers) for comparison.", "",
                  md_table(header, rows), ""]
        _write_section(args.out, ZERO_SECTION, lines)
        print(f"wrote {args.out}")
        return
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
    table = md_table(header, rows)
    if args.only == "tp":
        lines = [TP_SECTION, ""]
        lines += header_lines("")[2:]  # command, date, versions, source, machine (no second title)
        lines += ["", f"Model: the dense stack (d={args.d}, {args.layers} layers: q, k, v, o d x d, MLP 4d x d / d x 4d; "
                  "no expert banks), int8 momentum with block_size 64; figures of the second step.", "", table, ""]
        _write_section(args.out, TP_SECTION, lines)
    else:
        lines = header_lines("Sharded QMuon per mesh layout: bytes sent and Newton-Schulz share per rank")
        lines += ["", f"Model: d={args.d}, {args.layers} layers, {args.experts} experts per layer (inter d/2); int8 "
                  "momentum, both carriers as listed; figures of the second step; the dense-stack rows have no "
                  "expert banks and use block_size 64.", "", table, ""]
        Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
