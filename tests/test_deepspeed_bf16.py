"""bf16 weights without an fp32 master copy under DeepSpeed ZeRO (``bf16_update``).

DeepSpeed >= 0.18 keeps its master partitions and gradients in bf16 with
``"bf16": {"enabled": true, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true}``
(ZeRO 1-3). The wrapper then writes every update to those bf16 flat slices through the optimizer's
``bf16_update`` rule, as single-process QMuon writes a ``model.to(torch.bfloat16)`` model:

* ``"stochastic"``: the noise of element ``i`` of a slice is that of its flat index in the whole
  parameter, keyed by the parameter's index and the step (for a Muon matrix: its momentum
  step, shared with every rank holding a slice);
* ``"ecc8"``: each rank keeps the ``weight_ecc`` codes of its slices (Muon: one 1-D tensor per slice;
  AdamW: one per piece), saved in its optimizer file;
* ``"nearest"``: plain rounding.

Both ranks train on the same batch, so DeepSpeed's average of the bf16 gradients is the gradient
itself (``(g + g) / 2 == g`` exactly, in bf16 as in fp32) and the comparison with single-process
QMuon on the bf16 model is bit for bit. The model's partition boundaries cut a Muon matrix and a
small fp32-moment AdamW table inside a row (the slices' element offsets matter), and fall on the
int8 block grid of the int8-moment AdamW tables (a block cut by a boundary is quantized as two
blocks, test_deepspeed_adamw_q.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from _helpers import ds_gathered
from _dist import REPO, run_launcher, subprocess_env, torchrun_cmd

sys.path.insert(0, str(REPO))

if __name__ != "__main__":
    pytest.importorskip("deepspeed")

import qmuon  # noqa: E402
from qmuon.integrations import deepspeed as qds  # noqa: E402

WORLD = 2
STEPS = 4
CKPT_AT = 2
VOCAB = 32
WIDTH = 256
EMB_ROWS = 64
RULES = ("nearest", "stochastic", "ecc8")
# fp32 carriers: the NS input slices travel to the owner and the update back unchanged (bit-exact runs);
# block_size 64: the ZeRO boundary in w1 (column 192) falls on the momentum's block grid, so no block is cut
KW = dict(lr=0.02, weight_decay=0.1, state_format="int8", state={"rounding": "stochastic", "seed": 7, "block_size": 64},
          adamw_lr=3e-3, adamw_weight_decay=0.1, adamw_state_format="int8",
          newton_schulz={"comm_carrier": "fp32", "comm_return": "fp32"})
BF16_MASTER = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
       "gradient_clipping": 0.0, "bf16": BF16_MASTER}
LIGHTNING_STEPS = 3


class Net(torch.nn.Module):
    """Muon matrices 48 x 256, 40 x 48, 256 x 40 (their flat group of 24448 elements is cut at element
    12224: row 47, column 192 of the first, on the 64-column momentum block grid); int8-moment AdamW
    tables 64 x 256 and 32 x 256 (cut at
    row 48 of the first: the 256-column block grid); fp32-moment AdamW (small) table 12 x 20 and a
    LayerNorm (cut at row 8, column 8 of the table)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(EMB_ROWS, WIDTH)
        self.w1 = torch.nn.Linear(WIDTH, 48, bias=False)
        self.ln = torch.nn.LayerNorm(48)
        self.w2 = torch.nn.Linear(48, 40, bias=False)
        self.w3 = torch.nn.Linear(40, WIDTH, bias=False)
        self.gate = torch.nn.Parameter(torch.randn(12, 20))
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.w2(torch.tanh(self.ln(self.w1(self.emb(x))))))
        return self.head(self.w3(h) * (1 + 0.1 * torch.tanh(self.gate.mean())))


def _groups(model: Net) -> list[dict]:
    return [{"params": [model.w1.weight, model.w2.weight, model.w3.weight], "use_muon": True},
            {"params": [model.emb.weight, model.head.weight], "use_muon": False},
            {"params": [model.gate, model.ln.weight, model.ln.bias], "use_muon": False, "state_format": "fp32"}]


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(91 + step)
    return torch.randint(0, VOCAB, (2, 12), generator=g)


def _loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def _reference(init: list[torch.Tensor], rule: str, steps: int = STEPS) -> tuple[list, qmuon.QMuon, Net]:
    """Single-process QMuon on the bf16 model (``model.to(torch.bfloat16)``) from ``init``."""
    model = Net().to(torch.bfloat16)
    with torch.no_grad():
        for p, v in zip(model.parameters(), init):
            p.copy_(v)
    opt = qmuon.QMuon(_groups(model), **KW, bf16_update=rule)
    out = []
    for step in range(steps):
        x = _batch(step)
        _loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()])
    return out, opt, model


# ============================================================================ in-process
@pytest.mark.parametrize("rule", RULES)
def test_unattached_wrapper_on_bf16_model_equals_qmuon(rule):
    """Without DeepSpeed (one process, ZeRO-0 semantics) the wrapper steps a bf16 model as QMuon
    does: the same bits and, under ecc8, the same correction codes (Muon slices and AdamW pieces)."""
    m1, m2 = Net().to(torch.bfloat16), Net().to(torch.bfloat16)
    o1 = qmuon.QMuon(_groups(m1), **KW, bf16_update=rule)
    o2 = qds.WholeMatrixZeroOptimizer(qmuon.QMuon(_groups(m2), **KW, bf16_update=rule))
    p0 = [p.detach().clone() for p in m1.parameters()]
    for step in range(3):
        x = _batch(step)
        for m, o in ((m1, o1), (m2, o2)):
            _loss(m(x), x).backward()
            o.step()
            o.zero_grad()
    for (name, a), b, c in zip(m1.named_parameters(), m2.parameters(), p0):
        assert a.dtype == torch.bfloat16 and not torch.equal(a, c), f"{name} did not move"
        assert torch.equal(a, b), f"{name}: wrapper differs from QMuon under bf16_update={rule!r}"
    if rule == "ecc8":
        for i, p in enumerate((m1.w1.weight, m1.w2.weight, m1.w3.weight)):
            assert torch.equal(o2._weight_state[i]["weight_ecc"], o1.state[p]["weight_ecc"].view(-1))
        for i, p in ((3, m1.emb.weight), (4, m1.head.weight), (5, m1.gate), (6, m1.ln.weight)):
            (st,) = o2._slice_state[i]
            assert torch.equal(st["weight_ecc"].view(-1), o1.state[p]["weight_ecc"].view(-1)), i
        assert o2.state_nbytes(muon_only=False) == o1.state_nbytes(muon_only=False)
    else:
        assert not o2._weight_state or not any(o2._weight_state.values())


def test_skipped_nonfinite_update_keeps_the_rounding_counter_in_step():
    """A NaN gradient skips that matrix on the step (QMuon's own momentum step does not advance), so
    the next stochastic write of its slices uses the same counter as single-process QMuon's."""
    m1, m2 = Net().to(torch.bfloat16), Net().to(torch.bfloat16)
    o1 = qmuon.QMuon(_groups(m1), **KW, bf16_update="stochastic")
    o2 = qds.WholeMatrixZeroOptimizer(qmuon.QMuon(_groups(m2), **KW, bf16_update="stochastic"))
    for step in range(3):
        x = _batch(step)
        for m, o in ((m1, o1), (m2, o2)):
            _loss(m(x), x).backward()
            if step == 1:
                m.w2.weight.grad[0, 0] = float("nan")
                m.gate.grad[0, 0] = float("nan")
            o.step()
            o.zero_grad()
    assert o2.nonfinite_skips == 2
    for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), name
    assert o2._muon_step[1] == int(o1.state[m1.w2.weight]["step"]) == 2  # skipped once in 3 steps


def test_ecc8_codes_validated_on_load():
    """Saved and resumed under "ecc8", a checkpoint without a slice's codes is incomplete
    (StateFormatError naming the slice); codes of the wrong size too. A checkpoint saved under
    "stochastic" loads into an "ecc8" run (codes start at zero at the next step)."""
    from qmuon.quant import StateFormatError

    def stepped(rule):
        m = Net().to(torch.bfloat16)
        o = qds.WholeMatrixZeroOptimizer(qmuon.QMuon(_groups(m), **KW, bf16_update=rule))
        x = _batch(0)
        _loss(m(x), x).backward()
        o.step()
        return m, o

    _, o = stepped("ecc8")
    sd = o.state_dict()
    assert sorted(sd["qmuon_deepspeed"]["weight_slices"]) == [0, 1, 2]
    _, fresh = stepped("ecc8")
    missing = {**sd, "qmuon_deepspeed": {**sd["qmuon_deepspeed"], "weight_slices": {
        k: v for k, v in sd["qmuon_deepspeed"]["weight_slices"].items() if k != 1}}}
    with pytest.raises(StateFormatError, match="Muon parameter 1"):
        fresh.load_state_dict(missing)
    short = {**sd, "qmuon_deepspeed": {**sd["qmuon_deepspeed"], "weight_slices": {
        **sd["qmuon_deepspeed"]["weight_slices"], 0: {"weight_ecc": torch.zeros(5, dtype=torch.int8)}}}}
    with pytest.raises(StateFormatError, match="weight_ecc"):
        fresh.load_state_dict(short)
    fresh.load_state_dict(sd)
    assert all(torch.equal(fresh._weight_state[i]["weight_ecc"], o._weight_state[i]["weight_ecc"]) for i in (0, 1, 2))
    _, o_st = stepped("stochastic")
    m3, o3 = stepped("ecc8")
    o3.load_state_dict(o_st.state_dict())
    assert not o3._weight_state  # nothing saved; created at the next step
    x = _batch(1)
    _loss(m3(x), x).backward()
    o3.step()
    assert o3._weight_state[0]["weight_ecc"].dtype == torch.int8


# ============================================================================ worker
def _engine(stage: int, rule: str, seed: int = 0):
    model = Net(seed)
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in CFG.items()}
    cfg["zero_optimization"] = {"stage": stage}
    engine, opt, _, _ = qds.initialize(model, qmuon.QMuon(_groups(model), **KW, bf16_update=rule), cfg)
    return engine, opt


def _train(engine, steps) -> list[list[torch.Tensor]]:
    out = []
    for step in steps:
        x = _batch(step)  # the same batch on both ranks
        engine.backward(_loss(engine(x), x))
        engine.step()
        out.append(ds_gathered(engine.module))
    return out


def _codes(opt) -> dict:
    """This rank's weight-correction codes: Muon slices ``{index: (start, codes)}``, AdamW pieces
    ``{index: [(start of piece, codes)]}``."""
    muon = {i: (opt._params[i].holders[opt._rank].start, st["weight_ecc"].clone())
            for i, st in opt._weight_state.items() if "weight_ecc" in st}
    adamw = {i: [(opt._params[i].holders[opt._rank].start + off, st["weight_ecc"].clone().view(-1))
                 for (off, _, _), st in zip(opt._pieces[i], sts)]
             for i, sts in opt._slice_state.items() if sts and "weight_ecc" in sts[0]}
    return {"muon": muon, "adamw": adamw}


def _run(stage: int, rule: str, out_dir: str, resume: bool) -> dict:
    d = os.path.join(out_dir, f"ckpt{stage}_{rule}")
    engine, opt = _engine(stage, rule)
    # the flat partitions DeepSpeed hands the optimizer (ZeRO-3: one per sub-group, also between steps)
    master = opt._flats if opt._mode == "zero3" else [g["params"][0] for g in opt._all_groups if g["params"]]
    res = {"init": ds_gathered(engine.module), "zero_class": type(engine.optimizer).__name__,
           "master_dtypes": [str(t.dtype) for t in master], "grad_dtype": str(opt._grad_dtype),
           "holders": {p.index: [None if h is None else (h.start, h.length) for h in p.holders] for p in opt._params}}
    if resume:
        res["params"] = _train(engine, range(CKPT_AT))
        engine.save_checkpoint(d, tag="t")
        res["params"] += _train(engine, range(CKPT_AT, STEPS))
    else:
        res["params"] = _train(engine, range(STEPS))
    res["codes"] = _codes(opt)
    res["nbytes"] = opt.state_nbytes(muon_only=False)
    if resume:
        del engine, opt
        engine, opt = _engine(stage, rule, seed=123)
        qds.load_checkpoint(engine, d, tag="t")
        res["resumed"] = _train(engine, range(CKPT_AT, STEPS))
        res["resumed_codes"] = _codes(opt)
        res["ckpt"] = d
    return res


def _lightning_run(rank: int) -> dict:
    """Trainer(strategy=QMuonDeepSpeedStrategy(bf16 master config), precision="bf16-true")."""
    import lightning.pytorch as pl

    import qmuon_lightning.strategies.deepspeed as qsd

    class Batches(torch.utils.data.Dataset):
        def __len__(self):
            return LIGHTNING_STEPS

        def __getitem__(self, i):
            return _batch(i)

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Net()

        def training_step(self, batch, _):
            x = batch[0]
            return _loss(self.model(x), x)

        def configure_optimizers(self):
            return qmuon.QMuon(_groups(self.model), **KW, bf16_update="stochastic")

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Batches(), batch_size=1, shuffle=False)

    lit = Lit()
    init = [p.detach().to(torch.bfloat16) for p in lit.model.parameters()]
    strategy = qsd.QMuonDeepSpeedStrategy(config={
        "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 1,
        "bf16": dict(BF16_MASTER)})
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, precision="bf16-true",
                         max_steps=LIGHTNING_STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(lit)
    wrapper = trainer.strategy.qmuon_optimizer
    master = [g["params"][0] for g in wrapper._all_groups if g["params"]]
    return {"init": init, "params": [p.detach().clone() for p in lit.model.parameters()],
            "master_dtypes": [str(t.dtype) for t in master], "steps": trainer.global_step,
            "config_bf16": dict(trainer.strategy.config["bf16"])}


def worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    import deepspeed  # noqa: F401  (the CPU accelerator is chosen on import)

    rank = int(os.environ["RANK"])
    res: dict = {"rank": rank}
    for rule in RULES:
        res[(2, rule)] = _run(2, rule, out_dir, resume=True)
    for stage in (1, 3):
        res[(stage, "ecc8")] = _run(stage, "ecc8", out_dir, resume=False)
    res["lightning"] = _lightning_run(rank)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()


# ============================================================================ 2-process tests
@pytest.fixture(scope="module")
def run(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ds_bf16")
    cmd = torchrun_cmd(str(WORLD), Path(__file__).resolve(), "--worker", str(out))
    run_launcher(cmd, timeout=600, env=subprocess_env(DS_ACCELERATOR="cpu"), what="2-process bf16-master worker")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _assert_codes(ranks: list[dict], key: str, opt: qmuon.QMuon, model: Net) -> None:
    """The ranks' weight_ecc slices / pieces, put back at their element offsets, are the reference's."""
    params = list(model.parameters())
    by_index = [p for g in opt.param_groups for p in g["params"]]
    seen = set()
    for r in ranks:
        for kind in ("muon", "adamw"):
            for i, entries in r[key][kind].items():
                want = opt.state[by_index[i]]["weight_ecc"].reshape(-1)
                for start, codes in ([entries] if kind == "muon" else entries):
                    got = codes.reshape(-1)
                    assert torch.equal(got, want[start:start + got.numel()]), f"{kind} parameter {i} at {start}"
                    seen.add((i, start))
    assert {i for i, _ in seen} == set(range(len(params)))  # every parameter has its codes somewhere


@pytest.mark.slow
@pytest.mark.parametrize("rule", RULES)
def test_zero2_bf16_master_equals_single_process_bf16_and_resumes(run, rule):
    ranks = [r[(2, rule)] for r in run]
    assert ranks[0]["zero_class"] == "DeepSpeedZeroOptimizer"
    assert set(ranks[0]["master_dtypes"]) == {"torch.bfloat16"} and ranks[0]["grad_dtype"] == "torch.bfloat16"
    # The cuts this test is about: a Muon matrix and the small fp32-moment table inside a row.
    assert [s for s in ranks[0]["holders"][0] if s] == [(0, 12224), (12224, 64)]
    assert [s for s in ranks[0]["holders"][5] if s] == [(0, 168), (168, 72)]
    ref, opt, model = _reference(ranks[0]["init"], rule)
    for step, (got, want) in enumerate(zip(ranks[0]["params"], ref)):
        for (name, _), a, b in zip(model.named_parameters(), got, want):
            assert a.dtype == torch.bfloat16
            assert torch.equal(a, b), f"ZeRO-2 bf16 master, {rule}, step {step}: {name} differs from single-process"
    for r in ranks:
        for i, (a, b) in enumerate(zip(r["resumed"][-1], r["params"][-1])):
            assert torch.equal(a, b), f"{rule}: parameter {i} after resume differs from the straight run"
    if rule == "ecc8":
        _assert_codes(ranks, "codes", opt, model)
        _assert_codes(ranks, "resumed_codes", opt, model)
        # +1 byte per parameter element, split over the ranks
        per_rank = [sum(c.numel() for _, c in r["codes"]["muon"].values()) +
                    sum(c.numel() for v in r["codes"]["adamw"].values() for _, c in v) for r in ranks]
        assert sum(per_rank) == sum(p.numel() for p in model.parameters())
    else:
        assert not any(r["codes"]["muon"] or r["codes"]["adamw"] for r in ranks)
    # a 2-process checkpoint refuses a 1-process resume before anything loads
    with pytest.raises(qds.CheckpointWorldSizeError, match="saved by 2"):
        qds.check_resume(ranks[0]["ckpt"], "t", 1)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_zero1_zero3_bf16_master_ecc8_equals_single_process(run, stage):
    ranks = [r[(stage, "ecc8")] for r in run]
    assert ranks[0]["zero_class"] == ("DeepSpeedZeroOptimizer" if stage == 1 else "DeepSpeedZeroOptimizer_Stage3")
    assert set(ranks[0]["master_dtypes"]) == {"torch.bfloat16"}
    ref, opt, model = _reference(ranks[0]["init"], "ecc8")
    for step, (got, want) in enumerate(zip(ranks[0]["params"], ref)):
        for (name, _), a, b in zip(model.named_parameters(), got, want):
            assert torch.equal(a, b), f"ZeRO-{stage} bf16 master, ecc8, step {step}: {name} differs"
    _assert_codes(ranks, "codes", opt, model)


@pytest.mark.slow
def test_lightning_bf16_true_with_bf16_master(run):
    got = [r["lightning"] for r in run]
    assert got[0]["steps"] == LIGHTNING_STEPS
    assert got[0]["config_bf16"]["bf16_master_weights_and_grads"] is True  # Lightning kept the user's bf16 section
    assert set(got[0]["master_dtypes"]) == {"torch.bfloat16"}
    ref, _, model = _reference(got[0]["init"], "stochastic", LIGHTNING_STEPS)
    for (name, _), a, b in zip(model.named_parameters(), got[0]["params"], ref[-1]):
        assert torch.equal(a, b), f"Lightning bf16-true + bf16 master: {name} differs from single-process"
    for a, b in zip(got[0]["params"], got[1]["params"]):
        assert torch.equal(a, b)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    worker(sys.argv[2])
