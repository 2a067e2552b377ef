"""QMuon under DeepSpeed (qmuon_lightning.integrations.deepspeed, strategies.deepspeed).

In-process tests cover configuration errors, ownership dealing, partition arithmetic and the
single-process path. One 2-process launch (``torch.distributed.run``, gloo, DeepSpeed's CPU
accelerator) runs every multi-process scenario, because each process start imports DeepSpeed:
ZeRO stages 0, 1 and 2 against a single-process QMuon fed the same averaged gradients, the
"exactly once per step" count, and checkpoint save / continue / load / continue. This file is also
that worker (``python tests/test_deepspeed.py --worker OUT``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

deepspeed = pytest.importorskip("deepspeed") if __name__ != "__main__" else None

import qmuon_lightning as ql  # noqa: E402
from qmuon_lightning.integrations import deepspeed as qds  # noqa: E402
from qmuon_lightning.models.decoder_lm import DecoderLM, DecoderLMConfig  # noqa: E402

VOCAB = 64
SEQ = 16
STEPS = 4
OPT_KW = dict(lr=0.02, weight_decay=0.1, state_format="int8", rounding="stochastic", adamw_lr=3e-3,
              adamw_weight_decay=0.1, verbose=False)


def _model(seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    # 3 layers: each Muon group holds 3 matrices, so the 2-rank ZeRO partition boundary falls inside
    # a matrix of every Muon group (the worker checks that matrices are split across ranks).
    return DecoderLM(DecoderLMConfig(vocab_size=VOCAB, d_model=40, n_layers=3, n_heads=2, mlp_hidden=72, max_seq_len=SEQ))


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def _loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))


# ============================================================================ in-process tests
def test_class_name_keeps_deepspeed_muon_code_away():
    # DeepSpeed's ZeRO 1/2 run their own Muon update when the optimizer's class name contains "muon"
    # and parameters carry use_muon: neither may be true, or matrices would be orthogonalized twice.
    assert "muon" not in qds.WholeMatrixZeroOptimizer.__name__.lower()
    model = _model()
    qm = ql.build_optimizer(model, **OPT_KW)
    qm_first = qm.param_groups[0]["params"][0]
    opt = qds.WholeMatrixZeroOptimizer(qm)
    assert opt.param_groups[0] is qm.param_groups[0]
    assert not any(hasattr(p, "use_muon") for p in model.parameters())
    # The QMuon's group dicts are shared (a scheduler built on the QMuon drives the wrapper).
    assert opt.param_groups[0]["params"][0] is qm_first


@pytest.mark.parametrize(
    "cfg, words",
    [
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "'optimizer' section"),
        ({"zero_optimization": {"stage": 3}}, "stage 3"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "DeepSpeedCPUAdam"),
        ({"zero_optimization": {"stage": 2, "elastic_checkpoint": True}}, "elastic_checkpoint"),
        ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}},
         "BF16_Optimizer"),
        ({"zero_optimization": {"stage": 4}}, "must be 0, 1 or 2"),
    ],
)
def test_config_errors_name_the_fix(cfg, words):
    with pytest.raises(qds.UnsupportedDeepSpeedConfig, match=words):
        qds.check_config(cfg)


def test_config_accepted_and_path(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}
    out = qds.check_config(cfg)
    assert out["zero_allow_untested_optimizer"] is True and "zero_allow_untested_optimizer" not in cfg
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert qds.check_config(path)["zero_optimization"]["stage"] == 2
    shipped = ROOT / "examples" / "ds_config_zero2.json"
    if shipped.exists():
        assert qds.check_config(shipped)["zero_optimization"]["stage"] == 2


def test_owner_dealing_balances_and_is_deterministic():
    sizes = [4096, 4096, 1024, 1024, 1024, 512, 512, 96]
    owners = qds.assign_owners(sizes, 2)
    assert owners == qds.assign_owners(sizes, 2)
    load = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(2)]
    assert abs(load[0] - load[1]) <= max(sizes[-1], 1)  # this set splits almost evenly: 6208 / 6272
    assert qds.assign_owners(sizes, 1) == [0] * len(sizes)
    assert set(qds.assign_owners(sizes, 3)) == {0, 1, 2}


def test_partition_segments_cover_each_parameter_once():
    # A flat group of 3 params (7, 10, 5 elements) + padding to 24, cut into 2 partitions of 12.
    offsets, sizes, psize = [0, 7, 17], [7, 10, 5], 12
    for off, n in zip(offsets, sizes):
        segs = qds.partition_segments(off, n, psize, 2)
        covered = sorted((s.start, s.start + s.length) for s in segs if s is not None)
        assert covered[0][0] == 0 and covered[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        for r, s in enumerate(segs):
            if s is not None:
                assert 0 <= s.local and s.local + s.length <= psize
                assert r * psize + s.local == off + s.start  # the same flat element
    assert qds.partition_segments(7, 10, 12, 2)[1] == qds._Segment(5, 5, 0)


def test_single_process_matches_qmuon_bit_exact():
    """Without DeepSpeed (one process) the wrapper is QMuon: same updates, bit for bit, including
    stochastic rounding (the inner optimizer keeps QMuon's parameter indices as noise keys)."""
    torch.manual_seed(0)
    m1, m2 = _model(), _model()
    o1 = ql.build_optimizer(m1, **OPT_KW)
    o2 = qds.WholeMatrixZeroOptimizer(ql.build_optimizer(m2, **OPT_KW))
    for step in range(3):
        x = _batch(step, 0)
        for m, o in ((m1, o1), (m2, o2)):
            _loss(m(x), x).backward()
            o.step()
            o.zero_grad()
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    parts = [len(g["parts"] or (1,)) for g in o1.param_groups if g["use_muon"] for _ in g["params"]]
    assert sorted(o2.ns_items.values()) == sorted(parts)  # one NS call per matrix / fused part
    assert o2.state_nbytes() == o1.state_nbytes()
    sd = o2.state_dict()
    assert sd["qmuon_deepspeed"]["owners"] == [0] * len(parts)


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_nonfinite_gradient_policies(policy):
    model = _model()
    opt = qds.WholeMatrixZeroOptimizer(ql.build_optimizer(model, **{**OPT_KW, "nonfinite": policy}))
    x = _batch(0, 0)
    _loss(model(x), x).backward()
    bad = model.blocks[0].attn.proj.weight
    bad.grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    if policy == "raise":
        with pytest.raises(FloatingPointError, match="blocks.0.attn.proj.weight"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert not any(len(v) for v in opt.inner.state.values())
        return
    opt.step()
    assert opt.nonfinite_skips == 1
    for a, (name, b) in zip(before, model.named_parameters()):
        assert torch.equal(a, b) == (name == "blocks.0.attn.proj.weight"), name


def test_state_dict_refuses_another_layout():
    model = _model()
    opt = qds.WholeMatrixZeroOptimizer(ql.build_optimizer(model, **OPT_KW))
    x = _batch(0, 0)
    _loss(model(x), x).backward()
    opt.step()
    sd = opt.state_dict()
    assert sd["qmuon_deepspeed"]["inner"]["state"][0]["momentum_codes"].dtype == torch.int8
    other = qds.WholeMatrixZeroOptimizer(ql.build_optimizer(_model(), **OPT_KW))
    other.load_state_dict(sd)  # same layout: fine, and the momentum is restored bit for bit
    assert torch.equal(other.inner.state[other._proxies[0]]["momentum_codes"], opt.inner.state[opt._proxies[0]]["momentum_codes"])
    bad = {**sd, "qmuon_deepspeed": {**sd["qmuon_deepspeed"], "world_size": 2}}
    with pytest.raises(ValueError, match="same number of processes and ZeRO stage"):
        other.load_state_dict(bad)
    with pytest.raises(ValueError, match="not written by qmuon_lightning's DeepSpeed integration"):
        other.load_state_dict(ql.build_optimizer(_model(), **OPT_KW).state_dict())


def test_wrapping_a_used_qmuon_is_refused():
    model = _model()
    opt = ql.build_optimizer(model, **OPT_KW)
    x = _batch(0, 0)
    _loss(model(x), x).backward()
    opt.step()
    with pytest.raises(ValueError, match="fresh QMuon"):
        qds.WholeMatrixZeroOptimizer(opt)
    with pytest.raises(TypeError, match="build_optimizer"):
        qds.WholeMatrixZeroOptimizer(torch.optim.AdamW(model.parameters()))


# ============================================================================ 2-process worker
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(stage_steps: int, world: int) -> tuple[DecoderLM, ql.QMuon]:
    """Single-process QMuon fed what DeepSpeed feeds: the mean of each rank's micro-batch gradient
    ((g0 + g1) / 2; DeepSpeed divides by the world size and sums, both exact for 2 ranks)."""
    model = _model()
    opt = ql.build_optimizer(model, **OPT_KW)
    for step in range(stage_steps):
        grads = []
        for r in range(world):
            model.zero_grad()
            x = _batch(step, r)
            _loss(model(x), x).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = torch.stack(gs).sum(0) / world
        opt.step()
        opt.zero_grad()
    return model, opt


def _engine(stage: int, seed: int = 0, bf16: bool = False):
    model = _model(seed)
    # gradient_clipping: DeepSpeed clips to norm 1.0 unless told otherwise; the reference does not clip.
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "gradient_clipping": 0.0, "bf16": {"enabled": bf16},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "allgather_bucket_size": 500}}
    engine, opt, _, _ = qds.initialize(model, ql.build_optimizer(model, **OPT_KW), cfg)
    return engine, opt


def _train(engine, opt, steps, rank, world):
    import torch.distributed as dist

    counts = []
    for step in steps:
        x = _batch(step, rank)
        loss = _loss(engine(x), x)
        engine.backward(loss)
        engine.step()
        n = len(opt.owners)
        items = torch.zeros(n)
        doers = torch.zeros(n)
        for i, (k, v) in enumerate(sorted({p.index: p for p in opt._params if p.muon}.items())):
            items[i] = opt.ns_items.get(k, 0)
            doers[i] = 1.0 if opt.ns_items.get(k, 0) else 0.0
        dist.all_reduce(items)
        dist.all_reduce(doers)
        counts.append({"items": items.tolist(), "doers": doers.tolist()})
    return counts


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone().float() for p in engine.module.parameters()]


def worker(out_path: str) -> None:
    torch.set_num_threads(1)
    import deepspeed  # noqa: F401  (the CPU accelerator is chosen on import)
    import torch.distributed as dist

    from deepspeed.accelerator import get_accelerator

    assert qds.avoid_cpu_op_builds() == (get_accelerator().device_name() == "cpu")
    results: dict = {"accelerator": get_accelerator().device_name()}
    import deepspeed.ops as ds_ops
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    ref_model, ref_opt = _reference(STEPS, world)
    ref = [p.detach().clone() for p in ref_model.parameters()]
    parts = [len(g["parts"] or (1,)) for g in ref_opt.param_groups if g["use_muon"] for _ in g["params"]]
    ref_bytes = ref_opt.state_nbytes()
    for stage in (0, 1, 2):
        engine, opt = _engine(stage)
        counts = _train(engine, opt, range(STEPS), rank, world)
        got = _params(engine)
        diffs = [(a - b).abs().max().item() for a, b in zip(got, ref)]
        bytes_here = torch.tensor([float(opt.state_nbytes())])
        dist.all_reduce(bytes_here)
        split = sum(1 for p in opt._params if p.muon and sum(s is not None for s in p.holders) > 1)
        results[f"stage{stage}"] = {
            "mode": opt._mode, "max_abs_diff": max(diffs), "equal": all(d == 0 for d in diffs),
            "counts": counts, "parts": parts, "owners": opt.owners,
            "momentum_bytes_total": bytes_here.item(), "momentum_bytes_here": opt.state_nbytes(),
            "reference_bytes": ref_bytes, "split_params": split,
            "zero_class": type(engine.optimizer).__name__,
        }
        del engine, opt
    # bf16 parameters at ZeRO 2: fp32 master partitions, bf16 model weights.
    engine, opt = _engine(2, bf16=True)
    x = _batch(0, rank)
    counts = _train(engine, opt, range(3), rank, world)
    synced = True
    for info in opt._params:
        p = engine.optimizer.bit16_groups[info.group][info.pos]  # the model's bf16 parameter
        v = opt._views(info)
        if v is not None:  # this rank's fp32 master slice, rounded, is what the bf16 model holds
            seg = info.holders[rank]
            synced &= torch.equal(p.detach().reshape(-1)[seg.start: seg.start + seg.length], v[0].to(torch.bfloat16))
    results["bf16"] = {
        "dtype": str(next(engine.module.parameters()).dtype), "mode": opt._mode, "counts": counts, "synced": synced,
        "finite": all(bool(p.isfinite().all()) for p in engine.module.parameters()),
        "moved": min((a.float() - b.float()).abs().max().item() for a, b in zip(engine.module.parameters(), _model().parameters())),
    }
    del engine, opt, x
    # Checkpoint: save after 2 steps, continue 2; a fresh engine (other init) loads and continues 2.
    ckdir = os.path.join(os.path.dirname(out_path), "ckpt")
    for stage in (0, 2):
        d = os.path.join(ckdir, f"stage{stage}")
        engine, opt = _engine(stage)
        _train(engine, opt, range(2), rank, world)
        engine.save_checkpoint(d, tag="t")
        _train(engine, opt, range(2, STEPS), rank, world)
        straight = _params(engine)
        del engine, opt
        engine, opt = _engine(stage, seed=123)
        engine.load_checkpoint(d, tag="t")
        _train(engine, opt, range(2, STEPS), rank, world)
        resumed = _params(engine)
        dist.barrier()
        if stage == 0:
            saved = torch.load(os.path.join(d, "t", "mp_rank_00_model_states.pt"), weights_only=False)["optimizer"]
        else:
            f = os.path.join(d, "t", f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
            saved = torch.load(f, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]
        inner = saved["qmuon_deepspeed"]["inner"]["state"]
        codes = {k: str(v["momentum_codes"].dtype) for k, v in inner.items() if "momentum_codes" in v}
        results[f"ckpt{stage}"] = {
            "equal": all(torch.equal(a, b) for a, b in zip(straight, resumed)),
            "max_abs_diff": max((a - b).abs().max().item() for a, b in zip(straight, resumed)),
            "momentum_codes": codes,
        }
        del engine, opt
    # A world-size / mode mismatch is refused with a clear error (stage 2 checkpoint into stage 0).
    engine, opt = _engine(0)
    try:
        engine.load_checkpoint(os.path.join(ckdir, "stage2"), tag="t")
        results["mismatch_error"] = None
    except Exception as e:  # noqa: BLE001
        results["mismatch_error"] = f"{type(e).__name__}: {e}"
    results["lightning"] = _lightning_run(rank)
    results["compatible_ops_after_init"] = sorted(k for k, v in ds_ops.__compatible_ops__.items() if v)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    from qmuon_lightning.distributed import exit_after_distributed_run

    exit_after_distributed_run()  # see its docstring


def _lightning_run(rank: int, steps: int = 3) -> dict:
    """Trainer(strategy="qmuon_deepspeed") on the CPU accelerator inside the torchrun processes: 3 steps
    of ZeRO 2 on the same per-rank micro-batches as the reference, then compare."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    import qmuon_lightning.strategies.deepspeed as qsd

    class Batches(torch.utils.data.Dataset):
        # item i on rank r is micro-batch _batch(i, r), as in the engine runs (Trainer built with
        # use_distributed_sampler=False, so Lightning does not re-deal the items).
        def __len__(self):
            return steps

        def __getitem__(self, i):
            return _batch(i, rank)

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model()

        def training_step(self, batch, _):
            x = batch[0]
            return _loss(self.model(x), x)

        def configure_optimizers(self):
            return ql.build_optimizer(self.model, **OPT_KW)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Batches(), batch_size=1, shuffle=False)

    lit = Lit()
    strategy = qsd.QMuonDeepSpeedStrategy(config={
        "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 1,
    })
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    trainer.fit(lit)
    ref_model, _ = _reference(steps, 2)
    diffs = [(a.detach().float() - b).abs().max().item() for a, b in zip(lit.model.parameters(), ref_model.parameters())]
    wrapper = trainer.strategy.qmuon_optimizer
    dist.barrier()
    return {
        "registered": "qmuon_deepspeed" in pl.strategies.StrategyRegistry,
        "wrapper": type(wrapper).__name__, "mode": wrapper._mode, "max_abs_diff": max(diffs),
        "ns_items": sorted(wrapper.ns_items.items()), "steps": trainer.global_step,
    }


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds") / "results.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(Path(__file__).resolve()), "--worker", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return json.loads(out.read_text()), log


def _check_stage(res: dict, stage: int) -> None:
    r = res[f"stage{stage}"]
    assert r["mode"] == ("direct" if stage == 0 else "partitioned")
    # Exactly once per step: summed over both ranks every matrix got one NS call per part, from one rank.
    for c in r["counts"]:
        assert c["items"] == [float(n) for n in r["parts"]]
        assert c["doers"] == [1.0] * len(r["parts"])
    assert set(r["owners"]) == {0, 1}
    # The momentum is split, not replicated: together the ranks hold exactly one QMuon's worth.
    assert r["momentum_bytes_total"] == r["reference_bytes"]
    assert r["momentum_bytes_here"] < r["reference_bytes"]
    # Against single-process QMuon on the same averaged gradients. The tolerance is zero: DeepSpeed's
    # gradient average of 2 ranks is exact ((g0 + g1) / 2 either way), the owner runs QMuon's own
    # update on the whole matrix, and the NS output is applied with the same elementwise ops.
    assert r["equal"], f"stage {stage}: max |param - reference| = {r['max_abs_diff']}"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_stage_matches_single_process(two_process_run, stage):
    res, _ = two_process_run
    _check_stage(res, stage)
    if stage:
        # one matrix of each of the 3 Muon groups (plain, fused qkv, fused gate_up) crosses the boundary
        assert res[f"stage{stage}"]["split_params"] == 3
        assert res[f"stage{stage}"]["zero_class"] == "DeepSpeedZeroOptimizer"


@pytest.mark.parametrize("stage", [0, 2])
def test_checkpoint_resume_is_bit_exact(two_process_run, stage):
    res, _ = two_process_run
    r = res[f"ckpt{stage}"]
    assert r["equal"], f"max diff {r['max_abs_diff']}"
    assert r["momentum_codes"] and set(r["momentum_codes"].values()) == {"torch.int8"}
    n_muon = len(res["stage0"]["parts"])
    if stage == 0:  # rank 0's file holds every matrix's momentum (gathered from the owners)
        assert len(r["momentum_codes"]) == n_muon
    else:  # rank 0's own file holds only the matrices rank 0 owns
        assert 0 < len(r["momentum_codes"]) < n_muon


def test_no_op_builds_and_mismatch_error(two_process_run):
    res, log = two_process_run
    assert res["accelerator"] == "cpu"
    # DeepSpeed prints "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" whenever
    # it builds or loads its CPU shared-memory op; the worker also checked that no op is marked buildable.
    assert "built successfully" not in log, "DeepSpeed JIT-built / loaded a C++ op"
    assert res["compatible_ops_after_init"] == [], res["compatible_ops_after_init"]
    assert res["mismatch_error"] and "same number of processes and ZeRO stage" in res["mismatch_error"]


if __name__ == "__main__" and "--worker" in sys.argv:
    worker(sys.argv[sys.argv.index("--worker") + 1])


def test_bf16_zero2_runs_whole_matrix_once(two_process_run):
    res = two_process_run[0]
    r = res["bf16"]
    assert r["dtype"] == "torch.bfloat16" and r["mode"] == "partitioned" and r["finite"]
    parts = [float(n) for n in res["stage0"]["parts"]]
    assert all(c["items"] == parts and c["doers"] == [1.0] * len(parts) for c in r["counts"])
    assert r["synced"]  # updates land in DeepSpeed's fp32 master partition and reach the bf16 weights
    assert r["moved"] > 0  # every parameter changed


def test_lightning_strategy_on_cpu_matches_single_process(two_process_run):
    r = two_process_run[0]["lightning"]
    assert r["registered"] and r["wrapper"] == "WholeMatrixZeroOptimizer" and r["mode"] == "partitioned"
    assert r["steps"] == 3
    assert r["max_abs_diff"] == 0.0  # same averaged gradients as the reference, so bit-exact as the engine path


def test_strategy_registered_and_refuses_bad_config():
    import lightning.pytorch as pl

    import qmuon_lightning.strategies.deepspeed as qsd

    assert pl.strategies.StrategyRegistry["qmuon_deepspeed"]["strategy"] is qsd.QMuonDeepSpeedStrategy
    assert pl.strategies.StrategyRegistry["qmuon_deepspeed_stage_1"]["init_params"] == {"stage": 1}
    with pytest.raises(qds.UnsupportedDeepSpeedConfig, match="stage 3"):
        qsd.QMuonDeepSpeedStrategy(stage=3)
    with pytest.raises(qds.UnsupportedDeepSpeedConfig, match="DeepSpeedCPUAdam"):
        qsd.QMuonDeepSpeedStrategy(stage=2, offload_optimizer=True)
    with pytest.raises(qds.UnsupportedDeepSpeedConfig, match="'optimizer' section"):
        qsd.QMuonDeepSpeedStrategy(config={"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 2}})
    trainer = pl.Trainer(strategy="qmuon_deepspeed", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, qsd.QMuonDeepSpeedStrategy)
    assert trainer.strategy.config["zero_optimization"]["stage"] == 2


@pytest.mark.slow
def test_example_under_deepspeed_launcher(tmp_path):
    """examples/deepspeed_train.py with the `deepspeed` launcher on 2 CPU processes: train, checkpoint,
    resume. Slow (two more launches); the fast tests above cover the same engine path."""
    import shutil

    launcher = shutil.which("deepspeed")
    if launcher is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    common = [launcher, "--num_gpus", "2", "--master_port", str(_free_port()), str(ROOT / "examples" / "deepspeed_train.py"),
              "--d-model", "64", "--seq-len", "64", "--corpus-bytes", str(1 << 20), "--log-every", "2",
              "--save-dir", str(tmp_path / "ck")]
    first = subprocess.run(common + ["--steps", "4", "--save-every", "2"], env=env, capture_output=True, text=True,
                           timeout=600, cwd=str(ROOT))
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    assert "val loss" in first.stdout and "bytes/param" in first.stdout
    common[4] = str(_free_port())
    second = subprocess.run(common + ["--steps", "6", "--resume"], env=env, capture_output=True, text=True,
                            timeout=600, cwd=str(ROOT))
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    assert "resumed from" in second.stdout and "at step 4" in second.stdout
