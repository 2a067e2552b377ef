"""Quantized AdamW moments under DeepSpeed ZeRO (``adamw_state_format="int8"``).

ZeRO 1/2/3 hand the optimizer flat 1-D slices of the AdamW parameters. The wrapper cuts each slice
on the whole parameter's block grid (:func:`qmuon.quant.adamw.flat_slice_pieces`) and
steps every piece with QMuon's own AdamW step, so each block that lies wholly in one rank's slice
holds the moments single-process QMuon gives it, bit for bit.

* in-process: a parameter cut into two slices at a point inside a block, stepped piecewise, against
  the whole parameter (every uncut block bit-exact; the cut block within a stated tolerance);
* 2 processes (gloo, DeepSpeed's CPU accelerator), ZeRO-1, 2 and 3, on a model whose partition
  boundaries fall on the block grid: the parameters equal single-process QMuon with int8 AdamW on
  the same gradients bit for bit (both ranks train on the same batch, so DeepSpeed's average is the
  gradient itself: ``(g + g) / 2 == g`` exactly), save / load / continue is bit-exact, and the AdamW
  state is int8 codes of the quantized size.
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
from qmuon.core import adamw as core_adamw  # noqa: E402
from qmuon.integrations import deepspeed as qds  # noqa: E402
from qmuon.integrations.deepspeed.optimizer_state import STATE_VERSION  # noqa: E402
from qmuon.quant import adamw as qadamw  # noqa: E402

WORLD = 2
STEPS = 4
CKPT_AT = 2
VOCAB = 32
WIDTH = 256  # one int8 block (256 columns) per row
#: Embedding rows: with the 32 x 256 head the AdamW group has 24576 elements, so the ZeRO-2 boundary
#: (12288) is row 48 of the embedding and the ZeRO-3 ones rows 32 / 16: cuts on the block grid.
EMB_ROWS = 64
# fp32 carriers: the gradient slices travel to the owner and the update back unchanged (bit-exact runs)
KW = dict(lr=0.02, weight_decay=0.1, state_format="int8", state={"rounding": "stochastic"}, adamw_lr=3e-3, adamw_weight_decay=0.1, adamw_state_format="int8",
          newton_schulz={"comm_carrier": "fp32", "comm_return": "fp32"})
CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
       "gradient_clipping": 0.0, "zero_optimization": {"stage": 2}}
#: Cut block vs whole block, in-process test: ``max |p_cut - p_whole| / max |p_whole - p0|`` over the
#: cut block's elements after STEPS steps. Origin: each part of a cut block is quantized with its
#: own absmax (<= the whole block's), so the rounding of each moment differs by up to one code of the
#: map per step: about 1/127 of the block's absmax for int8, 1/7 for int4 (15 levels); AdamW's
#: update ``m / (sqrt(v) + eps)`` moves by a fraction of that. Measured 7.2e-3 (int8) and 7.6e-2
#: (int4). Bounds 0.05 / 0.3. The test also requires the cut block to differ from the whole-tensor
#: result (the cut is real) and every uncut block to be bit-exact (which fp32 moments, another
#: block's moments or a wrong gradient would break).
CUT_BLOCK_RTOL = {"int8": 0.05, "int4": 0.3}


class Net(torch.nn.Module):
    """Embedding and head (AdamW, int8 moments: 2-D, >= 4096 elements) around one Muon matrix."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(EMB_ROWS, WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(self.emb(x))))


def _groups(model: Net) -> list[dict]:
    return [{"params": [model.proj.weight], "use_muon": True},
            {"params": [model.emb.weight, model.head.weight], "use_muon": False}]


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(77 + step)
    return torch.randint(0, VOCAB, (2, 12), generator=g)


def _loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))


# ============================================================================ in-process
def test_cut_slice_pieces_follow_the_block_grid():
    pieces = qadamw.flat_slice_pieces("int8", (37, 300), 5550, 5550)  # starts at row 18, column 150
    assert pieces == [(0, 1, 106), (106, 1, 44), (150, 18, 300)]
    assert qadamw.flat_slice_pieces("int8", (37, 300), 0, 5550) == [(0, 18, 300), (5400, 1, 150)]
    assert qadamw.flat_slice_pieces("int4", (37, 300), 5550 + 10, 200) == [(0, 1, 96), (96, 1, 44), (140, 1, 60)]
    assert qadamw.flat_slice_pieces("fp32", (37, 300), 0, 10) is None  # fp32: the 1-D slice as it is
    assert qadamw.flat_slice_pieces("int8", (300,), 0, 10) is None  # 1-D: fp32 moments everywhere
    assert qadamw.flat_slice_pieces("int8", (40, 40), 0, 10) is None  # < 4096 elements: fp32
    with pytest.raises(ValueError, match="outside"):
        qadamw.flat_slice_pieces("int8", (37, 300), 11000, 200)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("family", ["int8", "int4"])
def test_cut_parameter_equals_whole_except_the_cut_block(family, rounding):
    """Two 'ranks' step halves of a 37 x 300 parameter (the cut falls at column 150 of row 18, inside
    the block [0, 256) of that row) piecewise, against single-process QMuon's AdamW step on the whole
    parameter with the same gradients. Stochastic rounding of the moments: each piece passes its
    first element's index in the whole parameter (as the wrapper does), so it draws the same noise."""
    shape, rows, cols = (37, 300), 37, 300
    group = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "rounding": rounding, "seed": 5, "weight_decay": 0.1, "state_format": family}
    torch.manual_seed(0)
    p0 = torch.randn(shape)
    whole = p0.clone()
    cut = p0.clone().view(-1)
    st_whole = core_adamw.init_state(family, shape, whole, "nearest")
    half = rows * cols // 2
    slices = [(0, half), (half, rows * cols - half)]
    pieces = [qadamw.flat_slice_pieces(family, shape, s, n) for s, n in slices]
    st_cut = [[core_adamw.init_state(family, shape, torch.empty(r, w), "nearest") for _, r, w in ps] for ps in pieces]
    for step in range(STEPS):
        g = torch.randn(shape) * (1 + step)
        core_adamw.adamw_param_step(whole, g, st_whole, group, global_shape=shape, key=2)
        for (s, n), ps, sts in zip(slices, pieces, st_cut):
            data, grad = cut.narrow(0, s, n), g.view(-1).narrow(0, s, n)
            for (off, r, w), st in zip(ps, sts):
                core_adamw.adamw_param_step(data.narrow(0, off, r * w).view(r, w),
                                            grad.narrow(0, off, r * w).view(r, w), st, group, global_shape=shape,
                                            key=2, first_index=s + off)
    cut = cut.view(shape)
    bs = 256 if family == "int8" else 128
    block = torch.zeros(shape, dtype=torch.bool)
    b0 = (150 // bs) * bs
    block[18, b0:b0 + bs] = True  # the one block the cut falls in
    assert torch.equal(cut[~block], whole[~block]), "an uncut block differs from single-process QMuon"
    diff = (cut[block] - whole[block]).abs().max().item()
    scale = (whole[block] - p0[block]).abs().max().item()
    assert diff > 0, "the cut block equals the whole one: the cut was not exercised"
    assert diff / scale < CUT_BLOCK_RTOL[family], f"cut block off by {diff / scale:.3g} of its update"
    assert st_cut[0][0][next(k for k in st_cut[0][0] if k.endswith("_q8") or k.endswith("_q4"))].dtype in (
        torch.int8, torch.uint8)


def test_single_process_wrapper_int8_adamw_bit_exact():
    """Without DeepSpeed (stage 0 semantics, one process) the wrapper's AdamW with int8 moments is
    QMuon's: the same parameters and the same quantized state."""
    m1, m2 = Net(), Net()
    o1 = qmuon.QMuon(_groups(m1), **KW)
    o2 = qds.WholeMatrixZeroOptimizer(qmuon.QMuon(_groups(m2), **KW))
    for step in range(3):
        x = _batch(step)
        for m, o in ((m1, o1), (m2, o2)):
            _loss(m(x), x).backward()
            o.step()
            o.zero_grad()
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for idx, p in ((1, m1.emb.weight), (2, m1.head.weight)):
        (got,) = o2._slice_state[idx]
        want = o1.state[p]
        assert sorted(got) == sorted(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k
    assert o2.state_nbytes(muon_only=False) == o1.state_nbytes(muon_only=False)


def test_another_layout_version_is_refused():
    """Only the layout version this qmuon writes loads; another one is refused before anything changes."""
    m1, m2 = Net(), Net()
    o1 = qds.WholeMatrixZeroOptimizer(qmuon.QMuon(_groups(m1), **KW))
    x = _batch(0)
    _loss(m1(x), x).backward()
    o1.step()
    sd = o1.state_dict()
    sd["qmuon_deepspeed"]["version"] = STATE_VERSION - 1
    o2 = qds.WholeMatrixZeroOptimizer(qmuon.QMuon(_groups(m2), **KW))
    with pytest.raises(ValueError, match=rf"layout version {STATE_VERSION - 1} is not this qmuon's"):
        o2.load_state_dict(sd)
    assert not o2._slice_state


# ============================================================================ worker
def _engine(stage: int, seed: int = 0):
    model = Net(seed)
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in CFG.items()}
    cfg["zero_optimization"] = {"stage": stage}
    engine, opt, _, _ = qds.initialize(model, qmuon.QMuon(_groups(model), **KW), cfg)
    return engine, opt


def _train(engine, steps) -> list[list[torch.Tensor]]:
    out = []
    for step in steps:
        x = _batch(step)  # the same batch on both ranks
        engine.backward(_loss(engine(x), x))
        engine.step()
        out.append(ds_gathered(engine.module))
    return out


def _slice_state(opt) -> dict:
    return {i: [{k: v.clone() for k, v in st.items()} for st in sts] for i, sts in opt._slice_state.items()}


def _stage_run(stage: int, out_dir: str, rank: int) -> dict:
    d = os.path.join(out_dir, f"ckpt{stage}")
    engine, opt = _engine(stage)
    res = {"init": ds_gathered(engine.module), "zero_class": type(engine.optimizer).__name__,
           "holders": {p.index: [None if h is None else (h.start, h.length) for h in p.holders] for p in opt._params},
           "pieces": {i: list(v) for i, v in opt._pieces.items()}}
    res["params"] = _train(engine, range(CKPT_AT))
    engine.save_checkpoint(d, tag="t")
    res["params"] += _train(engine, range(CKPT_AT, STEPS))
    res["state"] = _slice_state(opt)
    res["nbytes"] = opt.state_nbytes(muon_only=False) - opt.state_nbytes(muon_only=True)
    del engine, opt
    engine, opt = _engine(stage, seed=123)
    qds.load_checkpoint(engine, d, tag="t")
    res["resumed"] = _train(engine, range(CKPT_AT, STEPS))
    res["resumed_state"] = _slice_state(opt)
    return res


def worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    import deepspeed  # noqa: F401  (the CPU accelerator is chosen on import)

    rank = int(os.environ["RANK"])
    res = {"rank": rank, **{stage: _stage_run(stage, out_dir, rank) for stage in (1, 2, 3)}}
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("adamw_q")
    cmd = torchrun_cmd(str(WORLD), Path(__file__).resolve(), "--worker", str(out))
    run_launcher(cmd, timeout=600, env=subprocess_env(DS_ACCELERATOR="cpu"), what="2-process int8-AdamW worker")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _reference(init: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    model = Net()
    with torch.no_grad():
        for p, v in zip(model.parameters(), init):
            p.copy_(v)
    opt = qmuon.QMuon(_groups(model), **KW)
    out = []
    for step in range(STEPS):
        x = _batch(step)
        _loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_int8_adamw_equals_single_process_and_resumes(run, stage):
    ranks = [r[stage] for r in run]
    assert ranks[0]["zero_class"] == ("DeepSpeedZeroOptimizer" if stage < 3 else "DeepSpeedZeroOptimizer_Stage3")
    # The 2-rank boundaries fall on the 256-column block grid (so every block is wholly one rank's),
    # and the embedding is cut between the ranks (at ZeRO-3 the head too): slices really are cut.
    for idx in (1, 2):
        segs = [s for s in ranks[0]["holders"][idx] if s is not None and s[1] > 0]
        assert all(s[0] % WIDTH == 0 and s[1] % WIDTH == 0 for s in segs), f"parameter {idx}: {segs}"
        assert sum(s[1] for s in segs) == (EMB_ROWS if idx == 1 else VOCAB) * WIDTH
        assert len(segs) == (2 if idx == 1 or stage == 3 else 1), f"parameter {idx}: {segs}"
        for r, seg in zip(ranks, ranks[0]["holders"][idx]):
            if seg is not None and seg[1] > 0:
                assert idx in r["pieces"], "an int8 AdamW table was not stepped with quantized moments"
    ref = _reference(ranks[0]["init"])
    for step, (got, want) in enumerate(zip(ranks[0]["params"], ref)):
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"ZeRO-{stage} step {step}: parameter {i} differs from single-process QMuon"
    for r in ranks:
        for i, (a, b) in enumerate(zip(r["resumed"][-1], r["params"][-1])):
            assert torch.equal(a, b), f"ZeRO-{stage}: parameter {i} after resume differs from the straight run"
        for idx, sts in r["state"].items():
            for st, st2 in zip(sts, r["resumed_state"][idx]):
                assert sorted(st) == sorted(st2) and all(torch.equal(st[k], st2[k]) for k in st)
                assert st["exp_avg_q8"].dtype == torch.int8 and st["exp_avg_sq_q8"].dtype == torch.uint8
    # The AdamW state is int8: 2 moments x (1 B codes + 4 B per 256-element block) per element + the
    # 4-byte step per piece, summed over the ranks' slices of the two tables.
    elements = (EMB_ROWS + VOCAB) * WIDTH
    n_pieces = sum(len(v) for r in ranks for v in r["pieces"].values())
    want = 2 * (elements + 4 * elements // 256) + 4 * n_pieces
    assert sum(r["nbytes"] for r in ranks) == want
    assert want < elements * 8 / 3.8  # vs fp32 moments


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    worker(sys.argv[2])
