"""QMuon under Accelerate's DeepSpeed plugin (``Accelerator(deepspeed_plugin=...)``), ZeRO-1, ZeRO-2
and ZeRO-3, on 2 gloo CPU processes (DeepSpeed's CPU accelerator), against one process.

Two recipes, each trained 3 steps from the same initial model on the same global batches:

- ``prepare_qmuon(accelerator, model, loader)``: builds QMuon, wraps it in the whole-matrix ZeRO
  client optimizer, prepares, and attaches to the engine (``attach(accelerator)``);
- ``accelerator.prepare(model, WholeMatrixZeroOptimizer(qmuon.build_optimizer(model)), loader)``:
  Accelerate's own call; the wrapper attaches at its first step through the links DeepSpeed puts
  on the model's parameters.

The reference is plain QMuon in one process on the concatenation of both ranks' micro-batches (the
gradient DeepSpeed averages over the 2 ranks). Checked for every hidden matrix (every parameter
routed to Muon): the cosine between its 3-step update and the reference's >= 0.99 and the norms
within 5% (the issue's target). Measured on the 2-core Xeon: lowest cosine 0.99996 (ZeRO-1 and
ZeRO-2) and 0.99990 (ZeRO-3), norm ratios 0.9992-1.0008, the same for both recipes (the owners gather fp32
gradients; the summation order of DeepSpeed's averaging differs from one backward over both
micro-batches, and the int8 momentum rounds those last bits), so the bounds catch a wrong layout or
a per-slice Newton-Schulz (cosines far below) without being tight.
A plain QMuon handed to Accelerate's prepare under the plugin stops at its first step with the
shape guard's error, before anything changes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")

import qmuon  # noqa: E402
from _dist import free_port, run_launcher, subprocess_env  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 64, 16, 4, 3
OPT_KW: dict[str, Any] = dict(lr=0.02, weight_decay=0.01, state_format="int8", adamw_lr=3e-3, verbose=False)
SUBPROCESS_TIMEOUT_S = 600
RECIPES = ("prepare_qmuon", "accelerate_prepare")
STAGES = (1, 2, 3)


def tiny_model() -> torch.nn.Module:
    from qmuon_lightning.models import DecoderLM

    torch.manual_seed(0)
    return DecoderLM(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_seq_len=SEQ)


def tokens(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def loss_of(model: torch.nn.Module, w: torch.Tensor) -> torch.Tensor:
    logits = model(w[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), w[:, 1:].reshape(-1))


def reference_updates() -> dict[str, torch.Tensor]:
    """One process, plain QMuon, each step on both ranks' micro-batches at once."""
    model = tiny_model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = qmuon.build_optimizer(model, **OPT_KW)
    for s in range(STEPS):
        loss_of(model, torch.cat([tokens(s, 0), tokens(s, 1)])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach() - start[n] for n, p in model.named_parameters()}


def _launch(out: Path) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(Path(__file__).resolve()), "--worker", "--out", str(out)]
    backend = "reference" if qmuon.ops.backend() == "reference" else os.environ.get("QMUON_BACKEND", "auto")
    run_launcher(cmd, timeout=SUBPROCESS_TIMEOUT_S, env=subprocess_env(QMUON_BACKEND=backend),
                 what="torchrun Accelerate DeepSpeed worker")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_accelerate_deepspeed_plugin_zero1_2_3_match_one_process(tmp_path) -> None:
    reports = _launch(tmp_path)
    ref = reference_updates()
    groups = [g for g in qmuon.build_optimizer(tiny_model(), **OPT_KW).param_groups if g["use_muon"]]
    muon = {n for g in groups for n in g["param_names"]}
    ns_items = sum(len(g.get("parts") or (1,)) * len(g["params"]) for g in groups)  # matrices and fused parts
    assert len(muon) == 8 and ns_items > len(muon)  # 2 blocks x (qkv, proj, mlp up, mlp down); qkv fused
    for rep in reports:
        assert rep["naive_error"] and "no longer holds the matrices it was routed with" in rep["naive_error"], rep
        for stage in STAGES:
            for recipe in RECIPES:
                run = rep[f"zero{stage}/{recipe}"]
                assert run["mode"] == ("zero3" if stage == 3 else "partitioned"), run
                assert run["distributed_type"] == "DEEPSPEED" and run["world"] == 2, run
                # every matrix (or fused part) orthogonalized once per step, on one of the 2 ranks
                assert sum(r[f"zero{stage}/{recipe}"]["ns_items"] for r in reports) == ns_items, run
                # The exchange's byte count (WholeMatrixZeroOptimizer.comm_stats): the ranks' own counts add
                # up to the total. At ZeRO-1/2 this small model's matrices each fit in one rank's partition and
                # the planner gives each to the rank holding it (measured: 0 bytes, ZeRO-1 too); at ZeRO-3 every
                # (even-sized) matrix is cut in halves and the non-owner's half crosses both ways with the
                # default carriers: the fp32 NS input (comm_carrier="auto") with the fp32 sum of squares of
                # each row block (one per row: rows are 32 to 128 columns here) and the int8 update (1 byte per
                # element and a 4-byte scale per row), so 5.0625 to 5.25 bytes per crossing element, 1.265625 to
                # 1.3125 times the same plan in bf16 both ways (bf16_wire_bytes_per_param, 4 bytes).
                comm = run["comm"]
                assert sum(r[f"zero{stage}/{recipe}"]["comm"]["ns_bytes_sent"] for r in reports) == \
                    comm["ns_bytes_total"], comm
                if stage == 3:
                    assert 1.265625 <= comm["wire_bytes_per_param"] / comm["bf16_wire_bytes_per_param"] <= 1.3125, comm
                for name in muon:
                    got = torch.tensor(run["updates"][name])
                    want = ref[name].reshape(-1)
                    cos = float(F.cosine_similarity(got, want, dim=0))
                    ratio = float(got.norm() / want.norm())
                    assert cos >= 0.99 and abs(ratio - 1) <= 0.05, (stage, recipe, name, cos, ratio)


# ---------------------------------------------------------------------------------------------- worker
def _worker(out: Path) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    from qmuon.integrations.accelerate import prepare_qmuon
    from qmuon.integrations.deepspeed import WholeMatrixZeroOptimizer, avoid_cpu_op_builds

    torch.set_num_threads(1)
    avoid_cpu_op_builds()  # DeepSpeed's CPU accelerator would JIT-build an inference kernel
    rank = int(os.environ["RANK"])
    rep: dict[str, Any] = {}

    def accelerator(stage: int) -> Any:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        plugin = DeepSpeedPlugin(hf_ds_config={
            "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage}, "communication_data_type": "fp32"})
        return Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])

    def loader() -> Any:
        data = [tokens(s, rank) for s in range(STEPS)]  # each rank's own micro-batches, in order
        return torch.utils.data.DataLoader(data, batch_size=None)

    for stage in STAGES:
        for recipe in RECIPES:
            acc = accelerator(stage)
            model = tiny_model()
            start = {n: p.detach().clone() for n, p in model.named_parameters()}
            if recipe == "prepare_qmuon":
                engine, opt, dl = prepare_qmuon(acc, model, loader(), **OPT_KW)
            else:
                client = WholeMatrixZeroOptimizer(qmuon.build_optimizer(model, **OPT_KW))
                engine, opt, dl = acc.prepare(model, client, loader())
            for w in loader():  # the prepared loader would shard a map-style list across ranks
                acc.backward(loss_of(engine, w))
                opt.step()
                opt.zero_grad()
            wrapper = opt.optimizer.optimizer
            params = list(engine.module.named_parameters())
            import deepspeed

            with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=stage == 3):
                updates = {n: (p.detach() - start[n]).reshape(-1).tolist() for n, p in params}
            rep[f"zero{stage}/{recipe}"] = {
                "mode": wrapper._mode, "world": wrapper._world, "distributed_type": acc.distributed_type.name,
                "ns_items": sum(wrapper.ns_items.values()), "updates": updates, "comm": wrapper.comm_stats}
            acc.free_memory()

    # A plain QMuon handed to the plugin: DeepSpeed gives it flat partitions; its first step refuses them.
    acc = accelerator(2)
    model = tiny_model()
    engine, opt = acc.prepare(model, qmuon.build_optimizer(model, **OPT_KW))
    try:
        acc.backward(loss_of(engine, tokens(0, rank)))
        rep["naive_error"] = None
    except RuntimeError as e:
        rep["naive_error"] = str(e)
    (out / f"rank{rank}.json").write_text(json.dumps(rep))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ns = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _worker(ns.out)
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()
