"""Two nodes on one machine (issue 38, item 5): ``torchrun --nnodes 2 --nproc_per_node 2`` started
twice, node ranks 0 and 1, static rendezvous on 127.0.0.1 (``--rdzv-backend static --master-addr
127.0.0.1 --master-port P --node-rank R``): 4 gloo processes in two launcher groups, so every
cross-node collective goes through the rendezvous and process groups a real two-node job uses
(node 0 holds global ranks 0 and 1, node 1 ranks 2 and 3).

Launch 1 (``--mesh``), each check the single-node one with its tolerance:

- FSDP2 on a 1-D mesh of 4 and HSDP on a ``(replicate, shard)`` 2 x 2 mesh whose replicate dim
  spans the nodes (the groups are checked: replicas on different nodes, shards on one node): with
  bf16 carriers and bf16 Newton-Schulz, fp32 and int8 momentum, parameters and state equal
  single-process QMuon's bit for bit (tests/test_hsdp.py's check), each rank runs <= 1/4 + 10% of
  the Newton-Schulz cost;
- docs/fabric.md's HSDP block (``QMuonFabricStrategy(replicate_size=2)``, ``num_nodes=2``) on CPU:
  placements ``(Replicate(), Shard(0))``, the update equals single-process QMuon's on the same
  gradients bit for bit (fp32 NS and carriers, as tests/test_hsdp.py's driver checks);
- docs/accelerate.md's HSDP block (``ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)``,
  the FSDP2 plugin, ``prepare_qmuon``): tests/test_hsdp.py's Accelerate driver as it is (update bit
  for bit, ``save_state`` / ``load_state`` resume bit-exact).

Launch 2 (``--zero2``): the Hugging Face Trainer with ``deepspeed={"zero_optimization": {"stage":
2}}`` and ``QMuonFactory`` (tests/test_transformers_dist.py's ZeRO setup), 4 steps of 8 samples
(2 per rank), against one process (no DeepSpeed, 8 samples per step, the same samples in the same
order): every hidden matrix moves like 1 process (cosine >= 0.99, norm within 5%, issue 38's
target for DeepSpeed against 1 process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import qmuon  # noqa: E402
from _dist import free_port, kill, start, subprocess_env  # noqa: E402

pytestmark = pytest.mark.slow

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE


def launch_two_nodes(args: list[str], out: Path, timeout: float, env: dict[str, str] | None = None) -> None:
    """``torchrun --nnodes 2 --nproc_per_node 2`` twice (node ranks 0 and 1, static rendezvous on
    127.0.0.1) running this file with ``args``; fails the test with both logs when either launcher
    exits non-zero or the pair runs past ``timeout`` seconds (both sessions are then killed)."""
    port = free_port()
    procs, logs = [], []
    for node in range(NODES):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc_per_node",
               str(PER_NODE), "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--node-rank", str(node), str(Path(__file__).resolve()), *args]
        log = open(out / f"node{node}.log", "w")  # noqa: SIM115 (closed below)
        logs.append(log)
        procs.append(start(cmd, stdout=log, env=env or subprocess_env(PYTHONWARNINGS="ignore"),
                           what=f"torchrun node {node} of 2"))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        if any(p.poll() not in (None, 0) for p in procs):  # the other node waits in a collective: give it a moment
            time.sleep(3)
    finally:
        for p in procs:
            kill(p)
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    if codes != [0, 0]:
        tails = "\n".join(f"--- node {n} (exit {c}) ---\n{(out / f'node{n}.log').read_text()[-5000:]}"
                          for n, c in enumerate(codes))
        pytest.fail(f"two-node launch {args[0]} {'timed out' if None in codes else 'failed'}: exit codes {codes}\n{tails}")


# ------------------------------------------------------------------------- launch 1: FSDP2, HSDP, drivers
def _equivalence(mesh: Any) -> dict[str, Any]:
    """tests/test_hsdp.py's bit-for-bit check on ``mesh``: its model sharded and whole, 2 steps of the
    same random gradients, bf16 carriers and NS, fp32 and int8 momentum."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from test_hsdp import LR, make_model

    out: dict[str, Any] = {}
    for fmt in ("fp32", "int8"):
        kw = dict(lr=LR, weight_decay=0.01, state_format=fmt, verbose=False,
                  newton_schulz={"dtype": "bf16", "comm_carrier": "bf16", "comm_return": "bf16"})
        whole, sharded = make_model(), make_model()
        fully_shard(sharded, mesh=mesh)
        o_whole, o_sharded = qmuon.build_optimizer(whole, **kw), qmuon.build_optimizer(sharded, **kw)
        sp = dict(sharded.named_parameters())
        out["placements"] = sorted({str(tuple(p.placements)) for p in sp.values()})
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            for n, p in whole.named_parameters():
                p.grad = torch.randn(p.shape, generator=g) * 0.01
                sp[n].grad = distribute_tensor(p.grad.clone(), sp[n].device_mesh, sp[n].placements)
            o_whole.step()
            o_sharded.step()
        full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
        out[f"{fmt}_mismatches"] = [n for n, p in whole.named_parameters() if not torch.equal(full(sp[n]), p.detach())]
        out[f"{fmt}_mismatches"] += [f"{n}.{k}" for n, p in whole.named_parameters() if p in o_whole.state
                                     for k, v in o_whole.state[p].items()
                                     if not torch.equal(full(o_sharded.state[sp[n]][k]), v)]
        out[f"{fmt}_stats"] = dict(o_sharded.comm_stats)
    return out


def _fabric_doc_block(rank: int) -> dict[str, Any]:
    """docs/fabric.md, "HSDP (multi-node)", on CPU: 2 nodes x 2 processes instead of 2 x 8 GPUs."""
    import lightning as L

    from test_hsdp import Net, _steps_against_whole

    from qmuon_lightning.strategies import QMuonFabricStrategy

    strategy = QMuonFabricStrategy(replicate_size=2)          # 2 replicas x (processes / 2) shards
    fabric = L.Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(Net(0))
    opt = fabric.setup_optimizers(qmuon.build_optimizer(model, **_driver_kw()))
    named = dict(model.module.named_parameters())
    res = _steps_against_whole(named, opt, lambda x: fabric.backward(model(x)), rank, range(2))
    res["node_rank"] = fabric.node_rank
    res["mesh"] = next(iter(named.values())).device_mesh.mesh.tolist()
    return res


def _driver_kw() -> dict[str, Any]:
    from test_hsdp import DRIVER_KW

    return DRIVER_KW


def _mesh_main(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = int(os.environ["GROUP_RANK"])  # torchrun's node rank
    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, node)
    flat = init_device_mesh("cpu", (WORLD,))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    res: dict[str, Any] = {
        "nodes": nodes,
        "replicate_peers_nodes": [nodes[r] for r in dist.get_process_group_ranks(hsdp.get_group("replicate"))],
        "shard_peers_nodes": [nodes[r] for r in dist.get_process_group_ranks(hsdp.get_group("shard"))],
        "fsdp2": _equivalence(flat), "hsdp": _equivalence(hsdp), "fabric": _fabric_doc_block(rank),
    }
    try:
        import accelerate  # noqa: F401
    except ImportError:
        res["accelerate"] = None
    else:
        from test_hsdp import _accelerate_hsdp

        res["accelerate"] = _accelerate_hsdp(out, rank)
    torch.save(res, out / f"rank{rank}.pt")
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("two_nodes_mesh")
    launch_two_nodes(["--mesh", str(out)], out, timeout=600)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_two_nodes_fsdp2_and_hsdp_equal_single_process(mesh_run: list[dict[str, Any]]) -> None:
    r0 = mesh_run[0]
    assert r0["nodes"] == [0, 0, 1, 1], r0["nodes"]  # two launcher groups, ranks by node
    for r, res in enumerate(mesh_run):
        # HSDP: the replicate dim crosses the nodes, the shard dim stays inside one
        assert sorted(res["replicate_peers_nodes"]) == [0, 1] and len(set(res["shard_peers_nodes"])) == 1, res
        assert res["fsdp2"]["placements"] == ["(Shard(dim=0),)"], res["fsdp2"]["placements"]
        assert res["hsdp"]["placements"] == ["(Replicate(), Shard(dim=0))"], res["hsdp"]["placements"]
        for label in ("fsdp2", "hsdp"):
            for fmt in ("fp32", "int8"):
                assert res[label][f"{fmt}_mismatches"] == [], (r, label, fmt, res[label][f"{fmt}_mismatches"])
    for label in ("fsdp2", "hsdp"):  # every matrix orthogonalized once, the work dealt over all 4 ranks
        shares = [res[label]["fp32_stats"]["ns_share"] for res in mesh_run]
        assert abs(sum(shares) - 1.0) < 1e-9 and max(shares) <= 0.25 * 1.1, (label, shares)


def test_two_nodes_fabric_doc_block_hsdp(mesh_run: list[dict[str, Any]]) -> None:
    for r, res in enumerate(mesh_run):
        f = res["fabric"]
        assert f["node_rank"] == r // PER_NODE, f
        assert f["placements"] == "(Replicate(), Shard(dim=0))" and f["mismatches"] == [], f
        assert f["mesh"] == [[0, 1], [2, 3]], f  # replicas (rows' columns) on different nodes


def test_two_nodes_accelerate_hsdp(mesh_run: list[dict[str, Any]]) -> None:
    if mesh_run[0]["accelerate"] is None:
        pytest.skip("accelerate is not installed")
    for r, res in enumerate(mesh_run):
        a = res["accelerate"]
        assert a["placements"] == "(Replicate(), Shard(dim=0))" and a["mismatches"] == [], (r, a)
        assert a["resume"] == "", (r, a["resume"])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--mesh":
        _mesh_main(Path(sys.argv[2]))
    else:
        sys.exit(f"usage: {sys.argv[0]} --mesh OUT")
