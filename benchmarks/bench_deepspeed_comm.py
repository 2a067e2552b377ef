"""Bytes the Muon exchange moves per step: FSDP2's sharded step vs the DeepSpeed ZeRO-2 / ZeRO-3
path, side by side on one model (issue 38, item 1).

One ``torchrun --nproc_per_node 2`` launch on CPU (gloo). The model is the matrix stack of
``bench_comm.py`` (GPT d=256, 2 layers: 8 Muon matrices, qkv with 3 fused parts); its forward
returns ``sum(p * G_p)`` for fixed random ``G_p``, so every setup gets the same gradient. One
optimizer step each:

- FSDP2 (``fully_shard``, ``Shard(0)``) with plain QMuon and the carriers fp32/fp32, bf16/bf16,
  int8/int8 (the default): ``opt.comm_stats``;
- DeepSpeed ZeRO-2 and ZeRO-3 through ``qmuon.integrations.deepspeed.initialize`` with the same
  carriers: ``WholeMatrixZeroOptimizer.comm_stats`` (each rank updates the momentum of its slices
  and sends their NS input with its fp32 row-block sums of squares to the owner through
  ``comm_carrier``, the update comes back through ``comm_return``: :mod:`qmuon.distributed.flat`).

"wire B/param" is what crossed between the ranks (both trips, all ranks) per Muon element, the
fp32 row-block sums of squares included. Writes ``benchmarks/results/deepspeed_comm.md``.

    python benchmarks/bench_deepspeed_comm.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, gpt_matrices, header_lines, md_table  # noqa: E402

D_MODEL, N_LAYERS = 256, 2
CARRIERS = [("fp32", "fp32"), ("bf16", "bf16"), ("int8", "int8")]


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.specs = gpt_matrices(D_MODEL, N_LAYERS)
        g = torch.Generator().manual_seed(0)
        for i, s in enumerate(self.specs):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(s.shape, generator=g) * 0.02))
        self.targets = [torch.randn(s.shape, generator=g) * 1e-3 for s in self.specs]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ps = [getattr(self, f"p{i}") for i in range(len(self.specs))]
        return sum((p * t).sum() for p, t in zip(ps, self.targets)) + 0 * x.sum()

    def groups(self) -> list[dict]:
        ps = [getattr(self, f"p{i}") for i in range(len(self.specs))]
        fused = [p for s, p in zip(self.specs, ps) if s.parts]
        plain = [p for s, p in zip(self.specs, ps) if not s.parts]
        return [{"params": plain}, {"params": fused, "parts": self.specs[0].parts}]


def _worker(out: Path) -> None:
    import deepspeed
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import qmuon
    from qmuon.integrations import deepspeed as qds

    torch.set_num_threads(1)
    qds.avoid_cpu_op_builds()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for fwd, ret in CARRIERS:
        model = Stack()
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        opt = qmuon.QMuon(model.groups(), lr=0.02, newton_schulz={"comm_carrier": fwd, "comm_return": ret})
        model(torch.zeros(1)).backward()
        opt.step()
        st = opt.comm_stats
        rows.append({"setup": "FSDP2", "carriers": f"{fwd} / {ret}", **{k: float(st[k]) for k in
                     ("ns_bytes_total", "muon_elements", "wire_bytes_per_param", "ns_bytes_sent")}})
    for stage in (2, 3):
        for fwd, ret in [*CARRIERS, ("auto", "int8")]:  # the defaults last
            model = Stack()
            cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": stage}, "communication_data_type": "fp32"}
            qm = qmuon.QMuon(model.groups(), lr=0.02, newton_schulz={"comm_carrier": fwd, "comm_return": ret})
            engine, opt, _, _ = qds.initialize(model, qm, cfg)
            engine.backward(engine(torch.zeros(1)))
            engine.step()
            st = opt.comm_stats
            label = f"{fwd} / {ret}" + (" (default: fp32 NS input)" if fwd == "auto" else "")
            rows.append({"setup": f"DeepSpeed ZeRO-{stage}", "carriers": label, **{k: float(st[k]) for k in
                         ("ns_bytes_total", "muon_elements", "wire_bytes_per_param", "ns_bytes_sent")}})
    sent = [torch.tensor([r["ns_bytes_sent"] for r in rows], dtype=torch.float64) for _ in range(world)]
    dist.all_gather(sent, torch.tensor([r["ns_bytes_sent"] for r in rows], dtype=torch.float64))
    for i, r in enumerate(rows):  # the per-rank counts add up to the all-ranks total
        r["sent_sum_over_ranks"] = float(sum(t[i] for t in sent))
    if rank == 0:
        (out / "rows.json").write_text(json.dumps(rows))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                        "127.0.0.1", "--master_port", "29741", __file__, "--worker", tmp], check=True, env=env)
        rows = json.loads((Path(tmp) / "rows.json").read_text())
    fsdp = {r["carriers"]: r["wire_bytes_per_param"] for r in rows if r["setup"] == "FSDP2"}
    base = fsdp["int8 / int8"]
    table = md_table(
        ["setup", "carriers fwd / return", "wire B/param", "vs FSDP2 same carriers", "vs FSDP2 int8", "bytes, all ranks",
         "Muon elements"],
        [[r["setup"], r["carriers"], f"{r['wire_bytes_per_param']:.3f}",
          f"{r['wire_bytes_per_param'] / fsdp.get(r['carriers'], base):.2f}x", f"{r['wire_bytes_per_param'] / base:.2f}x",
          f"{r['ns_bytes_total']:,.0f}", f"{r['muon_elements']:,.0f}"] for r in rows])
    assert all(abs(r["sent_sum_over_ranks"] - r["ns_bytes_total"]) < 1 for r in rows), rows
    from qmuon.core.newton_schulz import resolve_ns_dtype

    ns_dtype = str(resolve_ns_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    text = "\n".join([
        *header_lines("Muon exchange bytes per step: FSDP2 vs DeepSpeed ZeRO-2 / ZeRO-3 (2 CPU ranks)"), "",
        f"Model: the GPT matrix stack of bench_comm.py (d={D_MODEL}, {N_LAYERS} layers, 8 Muon matrices), one "
        "optimizer step, 2 gloo processes; the same gradient in every setup. FSDP2: `opt.comm_stats` of the "
        "sharded step (NS inputs + fp32 row-block sums of squares forward, NS outputs back). DeepSpeed: "
        "`WholeMatrixZeroOptimizer.comm_stats` (each rank keeps the momentum of its slices of a matrix and sends "
        "their NS input with fp32 row-block sums of squares to the owner through `comm_carrier`, which sends the "
        "update back through `comm_return`, the carriers of the sharded step, `qmuon.distributed.flat`; ZeRO-2 "
        "cuts the flat buffer once, so most matrices sit whole on one rank, ZeRO-3 cuts every matrix in two). "
        "The default `comm_carrier=\"auto\"` is int8 under FSDP2 and the NS input's own dtype under DeepSpeed "
        "(an int8 NS input missed issue 38's update-cosine target of 0.99 on the 4-rank ZeRO-2 Trainer run, "
        "docs/deepspeed.md); its DeepSpeed rows are compared with FSDP2's defaults (int8 / int8). The per-rank "
        "`ns_bytes_sent` add up to the all-ranks total in every row (checked). Newton-Schulz dtype ('auto' on "
        f"this CPU): {ns_dtype}.", "",
        table, ""])
    (RESULTS_DIR / "deepspeed_comm.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker(Path(sys.argv[sys.argv.index("--worker") + 1]))
        from qmuon.distributed import exit_after_distributed_run

        exit_after_distributed_run()
    else:
        main()
