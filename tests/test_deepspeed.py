"""QMuon under DeepSpeed (qmuon.integrations.deepspeed, strategies.deepspeed).

In-process tests cover configuration errors, ownership dealing, partition arithmetic and the
single-process path.

One 2-process launch (``torch.distributed.run``, gloo, DeepSpeed's CPU accelerator) runs every
multi-process scenario, because each process start imports DeepSpeed: ZeRO stages 0, 1 and 2,
the Newton-Schulz options (``ns_dtype="fp32"`` at ZeRO 1, ``ns_coefficients="polar_express"`` with
``ns_steps=6`` at ZeRO 2), bf16 at ZeRO 2, checkpoint save / continue / load / continue at stages
0 and 2, and ``Trainer(strategy=QMuonDeepSpeedStrategy)``. This file is also that worker
(``python tests/test_deepspeed.py --worker OUT``). The worker only trains and saves what it holds
with ``torch.save`` (``OUT/rank{r}.pt``): per rank and scenario, the parameters (after the first
step and at the end), the optimizer state it keeps (the quantized momentum of the matrices it owns,
with that momentum dequantized, and the AdamW state of the parameter slices it holds, with their
offsets), the Newton-Schulz (NS) calls it made per matrix in every step, and the owner / partition
layout. The tests compare those tensors, here in the pytest process, with a single-process
:class:`~qmuon_lightning.QMuon` run here (:func:`_reference`) on the same initial weights and the
gradient DeepSpeed applies (the mean of the two ranks' micro-batch gradients); the worker never
computes a verdict.

Tolerances. Exact (``torch.equal``) wherever the design makes the result exact (docs/deepspeed.md,
"Tests"): DeepSpeed's 2-rank gradient average is the reference's, whichever order it uses
(``(g0 + g1) / 2`` and ``g0 / 2 + g1 / 2`` round to the same number: halving is exact), the owner
runs QMuon's own update on the whole matrix with QMuon's stochastic-rounding keys, and the NS output
is applied with the same elementwise operations (in the NS dtype: fp32 NS outputs travel back as
fp32). The one tolerance is the yardstick check that the applied update *is* Newton-Schulz of the
gradient with the configured options (so an optimizer that silently ran SGD, skipped NS or ignored
an NS option in both paths cannot pass): :func:`_assert_is_newton_schulz`.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

# tests/ is on sys.path: pytest's prepend mode, or this script's own directory
from _dist import REPO, free_port, run_launcher, subprocess_env, torchrun_cmd
from _helpers import assert_same, momentum_fp32, ns_float64, torch_adjusted_lr

sys.path.insert(0, str(REPO))

deepspeed = pytest.importorskip("deepspeed") if __name__ != "__main__" else None

import qmuon  # noqa: E402
from qmuon.core.config import GROUP_KEYS  # noqa: E402
from qmuon.core.newton_schulz import resolve_ns_dtype, resolve_schedule  # noqa: E402
from qmuon.integrations import deepspeed as qds  # noqa: E402
from qmuon.distributed.flat import FlatParam, Segment  # noqa: E402
from qmuon.integrations.deepspeed import layout as ds_layout  # noqa: E402
from qmuon_lightning.models.decoder_lm import DecoderLM, DecoderLMConfig  # noqa: E402

# ns_bf16: the scenarios' Newton-Schulz options (ns_dtype='fp32', ...) are told apart from the default options'
# first step, so the default must be bf16.
pytestmark = pytest.mark.ns_bf16


VOCAB = 64
SEQ = 16
WORLD = 2
STEPS = 4  # engine runs at every stage
CKPT_AT = 2  # checkpoint runs: save after CKPT_AT steps, continue to STEPS
BF16_STEPS = 3
LIGHTNING_STEPS = 3
# fp32 AdamW moments: DeepSpeed steps flat ZeRO slices, whose AdamW moments QMuon keeps in fp32
# fp32 carriers: the Muon gradient travels to its owner and the update back as they are, so the 2-process
# runs equal the single-process reference bit for bit (int8, the default, is covered by test_deepspeed_attach.py)
# block_size 32: the ZeRO 1/2 boundary in the plain Muon group falls at column 64 of a 72-column row of
# blocks.0.mlp.down, so every quantization block lies whole on one rank and each rank's momentum of its
# slice's rows is single-process QMuon's bit for bit (a block cut by a slice end is quantized per rank:
# test_cut_block_momentum_bound).
OPT_KW = dict(lr=0.02, weight_decay=0.1, state_format="int8", state={"rounding": "stochastic", "block_size": 32},
              adamw_lr=3e-3,
              adamw_weight_decay=0.1, adamw_state_format="fp32", newton_schulz={"comm_carrier": "fp32", "comm_return": "fp32"},
              verbose=False)

#: First-step update of every Muon matrix (per fused part), recovered from the weights as
#: ``(p0 (1 - lr wd) - p1) / lr_adj``, against Newton-Schulz in float64 of the averaged gradient:
#: relative Frobenius error bound. Origin: QMuon runs NS in bf16 on a bf16 input. On full-rank
#: gradients that is 1.2-1.6% off float64 NS (measured in test_torch_parity.py); these gradients
#: come from 60 predicted tokens, so the 40x40 matrices are nearly rank-deficient (condition numbers up to
#: 1e5) and bf16 rounding of the small singular directions weighs more: measured 1.6-5.7% over the
#: 21 parts (rounding only the NS *input* to bf16 already gives 0.8-4.4%). Bound 0.1. What it
#: rules out, measured on the same gradients: an SGD step (the gradient itself) is off by >= 99%,
#: the normalized momentum (NS skipped) by >= 87%, 3 NS iterations instead of 5 by >= 24%.
NS_YARDSTICK_RTOL = 0.1
#: The same yardstick for ns_dtype="fp32": measured 1.1e-6 - 4.8e-6 (muon and polar_express; the int8
#: momentum rounding does not reach the first update), where bf16 NS is >= 1.1e-2 off on every part.
#: Bound 1e-4: it also proves the NS ran in fp32.
NS_YARDSTICK_RTOL_FP32 = 1e-4
#: Another schedule in bf16 (polar_express, 6 steps): the float64 yardstick of the same schedule is
#: 1.1-10.0% off (Polar Express lifts the smallest singular directions of these near-rank-deficient
#: matrices to ~1, so their bf16 rounding weighs more than with Muon's quintic), too close to 0.1 for
#: a bound; float64 Muon NS (5 steps) is 19.6-32.1% off. Required: every part at least this many times
#: closer to its own schedule than to Muon's (measured >= 2.9). SGD (>= 99% off both) or a skipped
#: NS (>= 87%) gives a ratio near 1.
NS_YARDSTICK_SCHEDULE_RATIO = 2.0
#: The Newton-Schulz option runs: worker scenario -> (ZeRO stage, QMuon options).
NS_OPTION_RUNS = {
    "ns_fp32": (1, {"newton_schulz": {"dtype": "fp32"}}),
    "ns_polar": (2, {"newton_schulz": {"coefficients": "polar_express", "steps": 6}}),
    # NorMuon's second moment lives with the owner's whole-matrix state; cautious decay reads the
    # returned update on each slice holder (Muon) and the AdamW slices.
    "normuon_cautious": (2, {"update": {"variant": "normuon", "cautious_weight_decay": True}}),
    # grasp4 is not row-local (its factors span the whole matrix): at ZeRO 1-3 the gradient travels and
    # the owner keeps the whole momentum, as at stage 0.
    "grasp4": (2, {"state_format": "grasp4"}),
}


def _model(seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    # 3 layers: each Muon group holds 3 matrices, so the 2-rank ZeRO partition boundary falls inside
    # a matrix of every Muon group (test_zero_stage_matches_single_process checks that).
    return DecoderLM(DecoderLMConfig(vocab_size=VOCAB, d_model=40, n_layers=3, n_heads=2, mlp_hidden=72, max_seq_len=SEQ))


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def _loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def _qmuon_params(opt) -> list[tuple[dict, torch.Tensor]]:
    """(group, parameter) in QMuon's parameter order: position i is the wrapper's ``FlatParam.index`` i."""
    return [(g, p) for g in opt.param_groups for p in g["params"]]


# ============================================================================ in-process tests
def test_class_name_keeps_deepspeed_muon_code_away():
    # DeepSpeed's ZeRO 1/2 run their own Muon update when the optimizer's class name contains "muon"
    # and parameters carry use_muon: neither may be true, or matrices would be orthogonalized twice.
    assert "muon" not in qds.WholeMatrixZeroOptimizer.__name__.lower()
    model = _model()
    qm = qmuon.build_optimizer(model, **OPT_KW)
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
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "offload_param"),
        ({"zero_optimization": {"stage": 3, "mics_shard_size": 2}}, "MiCS"),
        ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}}, "hpZ"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "DeepSpeedCPUAdam"),
        ({"zero_optimization": {"stage": 2, "elastic_checkpoint": True}}, "elastic_checkpoint"),
        ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}},
         "BF16_Optimizer"),
        ({"zero_optimization": {"stage": 4}}, "must be 0, 1, 2 or 3"),
        # bf16 master partitions: supported with bf16_optimizer_states at stages 1-3 (test_deepspeed_bf16.py)
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 2}},
         "bf16_optimizer_states=true as well"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}, "zero_optimization": {"stage": 2}},
         "needs bf16.bf16_master_weights_and_grads"),
        ({"bf16": {"enabled": False, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
          "zero_optimization": {"stage": 2}}, "without bf16 training"),
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
          "zero_optimization": {"stage": 0}}, "stage 1, 2 or 3"),
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
    shipped = REPO / "examples" / "ds_config_zero2.json"
    if shipped.exists():
        assert qds.check_config(shipped)["zero_optimization"]["stage"] == 2


def test_owners_come_from_the_sharded_steps_planner():
    """DeepSpeed deals matrices with qmuon.distributed.plan.plan_owners (Newton-Schulz cost, ties to the
    rank holding most), as FSDP2 / HSDP / TP do: deterministic, balanced by NS cost."""
    from qmuon.distributed.plan import ns_cost, plan_owners

    def item(r: int, c: int, held: tuple[int, ...]) -> FlatParam:
        return FlatParam(0, 0, 0, torch.Size((r, c)), r * c, True, holders=[Segment(0, n, 0) if n else None for n in held])

    shapes = [(256, 64), (64, 256), (128, 128), (64, 64), (64, 64), (32, 96)]
    items = [item(r, c, (r * c, 0)) for r, c in shapes]
    owners = plan_owners(items, 2)
    assert owners == plan_owners(items, 2)
    load = [sum(ns_cost(*s) for s, o in zip(shapes, owners) if o == r) for r in range(2)]
    assert max(load) <= sum(load) / 2 + max(ns_cost(*s) for s in shapes)  # greedy LPT bound
    tie = [item(64, 64, (10, 4086)), item(64, 64, (4000, 96))]
    assert plan_owners(tie, 2) == [1, 0]  # equal cost: each to the rank holding most of it
    assert set(plan_owners([item(r, c, (r * c, 0, 0)) for r, c in shapes], 3)) == {0, 1, 2}
    model = _model()
    wrapper = qds.WholeMatrixZeroOptimizer(qmuon.build_optimizer(model, **OPT_KW))
    wrapper._require_attached()  # one process: every matrix is rank 0's
    assert wrapper.owners == [0] * sum(p.muon for p in wrapper._params)


def test_zero3_segments_follow_deepspeed_pieces():
    # ZeRO-3 cuts a 10-element parameter over 3 ranks into pieces of ceil(10 / 3) = 4: [0, 4), [4, 8),
    # [8, 10) + 2 padding; each piece at the same local offset of its rank's flat partition.
    segs = ds_layout.zero3_segments(10, 4, 7, 3)
    assert segs == [Segment(0, 4, 7), Segment(4, 4, 7), Segment(8, 2, 7)]
    # 2 elements over 4 ranks: pieces of 1; ranks 2 and 3 hold only padding.
    assert ds_layout.zero3_segments(2, 1, 0, 4) == [Segment(0, 1, 0), Segment(1, 1, 0), None, None]


def test_check_resume_names_both_world_sizes_and_the_fix(tmp_path):
    # A ZeRO 1-3 checkpoint directory as DeepSpeed (and Lightning, tag "checkpoint") writes it: one
    # optimizer file per data-parallel rank.
    d = tmp_path / "ck"
    (d / "checkpoint").mkdir(parents=True)
    for r in range(4):
        (d / "checkpoint" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    (d / "latest").write_text("checkpoint")
    assert qds.saved_world_size(d) == qds.saved_world_size(d, "checkpoint") == 4
    qds.check_resume(d, None, 4)  # same size: nothing to say
    with pytest.raises(qds.CheckpointWorldSizeError, match=r"saved by 4 data-parallel process\(es\); this run has 2") as e:
        qds.check_resume(d, "checkpoint", 2)
    assert "relaunch with 4 processes" in str(e.value) and "zero_to_fp32" in str(e.value)
    assert qds.saved_world_size(tmp_path / "missing") is None


def test_routing_reads_zero3_true_shapes():
    """A parameter DeepSpeed ZeRO-3 partitioned is an empty 1-D tensor whose shape is in ds_shape
    (zero.Init): routing, QMuon's checks and the wrapper's plans read ds_shape, so the Muon
    parameters are the plain model's (routing by p.shape would give Muon nothing: #8438)."""
    plain = qmuon.build_optimizer(_model(), **OPT_KW)
    model = _model()
    for p in model.parameters():
        p.ds_shape = p.shape
        p.data = torch.empty(0)
    assert not any(p.ndim >= 2 for p in model.parameters())
    opt = qmuon.build_optimizer(model, **OPT_KW)
    assert [(d.name, d.target, d.shape, d.parts) for d in opt.routing] == \
        [(d.name, d.target, d.shape, d.parts) for d in plain.routing]
    wrapper = qds.WholeMatrixZeroOptimizer(opt)
    want = [(tuple(p.shape), g["use_muon"]) for g in plain.param_groups for p in g["params"]]
    assert [(tuple(i.shape), i.muon) for i in wrapper._params] == want
    assert sum(i.numel for i in wrapper._params if i.muon) == sum(
        p.numel() for g in plain.param_groups if g["use_muon"] for p in g["params"]) > 0


def test_single_process_matches_qmuon_bit_exact():
    """Without DeepSpeed (one process) the wrapper is QMuon: same updates, bit for bit, including
    stochastic rounding (the wrapper keys the noise by QMuon's parameter indices), and the
    same optimizer state (quantized momentum and AdamW moments)."""
    torch.manual_seed(0)
    m1, m2 = _model(), _model()
    o1 = qmuon.build_optimizer(m1, **OPT_KW)
    o2 = qds.WholeMatrixZeroOptimizer(qmuon.build_optimizer(m2, **OPT_KW))
    for step in range(3):
        x = _batch(step, 0)
        for m, o in ((m1, o1), (m2, o2)):
            _loss(m(x), x).backward()
            o.step()
            o.zero_grad()
    assert_same([p.detach() for p in m2.parameters()], [p.detach() for p in m1.parameters()], "params")
    assert not any(torch.equal(a, b) for a, b in zip(m1.parameters(), _model().parameters()))  # all moved
    for i, (g, p) in enumerate(_qmuon_params(o1)):
        want = o1.state[p]
        if g["use_muon"]:
            got = o2.muon_state(i)
        else:  # the wrapper steps an fp32 AdamW slice as one (numel, 1) piece
            (got,) = o2._slice_state[i]
            got = {k: v.reshape(-1) if v.dim() else v for k, v in got.items()}
            want = {k: v.reshape(-1) if v.dim() else v for k, v in want.items()}
        assert_same(dict(got), dict(want), f"state of {p.shape}")
    parts = {i: len(g["parts"] or (1,)) for i, (g, _) in enumerate(_qmuon_params(o1)) if g["use_muon"]}
    assert o2.ns_items == parts  # one NS call per matrix / fused part, in the last step
    assert o2.state_nbytes() == o1.state_nbytes()
    sd = o2.state_dict()
    assert sd["qmuon_deepspeed"]["owners"] == [0] * len(parts)


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_nonfinite_gradient_policies(policy):
    model = _model()
    opt = qds.WholeMatrixZeroOptimizer(qmuon.build_optimizer(model, **OPT_KW, safety={"nonfinite": policy}))
    x = _batch(0, 0)
    _loss(model(x), x).backward()
    bad = model.blocks[0].attn.proj.weight
    bad.grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    if policy == "raise":
        with pytest.raises(FloatingPointError, match="blocks.0.attn.proj.weight"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert not opt._muon_state and not opt._slice_state
        return
    # The same gradients to a plain QMuon, the bad one removed: the wrapper's step must be that step.
    ref = _model()
    ref_opt = qmuon.build_optimizer(ref, **OPT_KW)
    for name, p in ref.named_parameters():
        g = dict(model.named_parameters())[name].grad
        p.grad = None if name == "blocks.0.attn.proj.weight" else g.clone()
    ref_opt.step()
    opt.step()
    assert opt.nonfinite_skips == 1
    assert torch.equal(bad, before[[n for n, _ in model.named_parameters()].index("blocks.0.attn.proj.weight")])
    assert_same([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()], "params")


def test_cut_block_momentum_bound():
    """ZeRO 1-3 cut a matrix anywhere; each rank keeps the momentum of the rows its slice touches
    (full width, zero outside the slice). Driven through the wrapper's own slice update on one process
    (int8, stochastic rounding, 256-column blocks: each 72-column row of blocks.0.mlp.down is one
    block), the matrix once whole and once cut in two at row 8, column 40:

    - every row the cut does not touch, over 3 steps: codes, scales, NS input and block sums equal
      the whole matrix's bit for bit (same elements, the same noise keys: the kernels' row offsets
      are global); the columns outside a slice keep zero codes (zeros change no absmax);
    - the cut row after the first step: the NS input and each element's fp32 momentum before
      rounding are the same (the first update does not depend on the cut); each rank quantizes its
      part with its own absmax, so the dequantized momentum differs from the whole block's by at most
      two quantization steps of the whole block (each is within one step of the same value:
      2 absmax / 127); its sum of squares arrives as two partial sums whose total is the whole
      block's up to fp32 rounding. Later steps start from the differing momentum."""
    from qmuon.distributed.flat import Segment
    from qmuon.quant import dequantize_momentum, format_options

    kw = {**OPT_KW, "state": {"rounding": "stochastic"}}
    opt = qds.WholeMatrixZeroOptimizer(qmuon.build_optimizer(_model(), **kw))
    names = [n for g in opt._all_groups for n in g["param_names"]]
    info = opt._params[names.index("blocks.0.mlp.down.weight")]
    rows, cols = info.rows, info.cols
    opts = format_options(opt._all_groups[info.group])
    assert cols == 72 and opts.block_size == 256
    cut = 8 * cols + 40
    opt._sharded_momentum = True
    torch.manual_seed(1)
    grads = [torch.randn(rows * cols) for _ in range(3)]

    def run(segments: list[Segment], steps: int) -> list[tuple[dict, torch.Tensor, torch.Tensor]]:
        """Per rank: momentum state, flat NS input and block sums after ``steps`` steps."""
        slices: list[dict] = [{} for _ in segments]
        out = []
        for g in grads[:steps]:
            out = []
            for r, seg in enumerate(segments):
                info.holders = [None] * len(segments)
                info.holders[r] = seg
                opt._rank, opt._muon_slices = r, slices[r]
                flat = g[seg.start: seg.start + seg.length].clone()
                sums: dict = {}
                ns = opt._slice_momentum([info], [None] * info.index + [(flat, flat)] + [None] * 100, sums)
                out.append((opt._muon_slices[info.index], ns[info.index].clone(), sums[info.index]))
        return out

    halves = [Segment(0, cut, 0), Segment(cut, rows * cols - cut, 0)]
    (whole, ns_whole, sums_whole), = run([Segment(0, rows * cols, 0)], 3)
    (a, ns_a, sums_a), (b, ns_b, sums_b) = run(halves, 3)
    # rank 0 keeps rows 0..8, rank 1 rows 8..39: row 8 on both, at full width
    assert a["momentum_codes"].shape == (9, cols) and b["momentum_codes"].shape == (rows - 8, cols)
    for key in ("momentum_codes", "momentum_absmax"):
        assert torch.equal(a[key][:8], whole[key][:8]) and torch.equal(b[key][1:], whole[key][9:]), key
    assert torch.equal(sums_a[:8], sums_whole[:8]) and torch.equal(sums_b[1:], sums_whole[9:])
    assert torch.equal(ns_a[: 8 * cols], ns_whole[: 8 * cols]) and torch.equal(ns_b[32:], ns_whole[9 * cols:])
    assert not a["momentum_codes"][8, 40:].any() and not b["momentum_codes"][0, :40].any()  # zero padding
    (whole, ns_whole, sums_whole), = run([Segment(0, rows * cols, 0)], 1)
    (a, ns_a, sums_a), (b, ns_b, sums_b) = run(halves, 1)
    assert torch.equal(torch.cat([ns_a, ns_b]), ns_whole)  # the first NS input does not depend on the cut
    assert torch.allclose(sums_a[8] + sums_b[0], sums_whole[8], rtol=1e-6, atol=0)
    m_whole = dequantize_momentum(whole, opts=opts, cols=cols)[8]
    m_cut = torch.cat([dequantize_momentum(a, opts=opts, cols=cols)[8, :40],
                       dequantize_momentum(b, opts=opts, cols=cols)[0, 40:]])
    step = float(whole["momentum_absmax"][8, 0]) / 127
    err = float((m_cut - m_whole).abs().max())
    assert 0 < err <= 2 * step, (err, step)  # differs (per-rank absmax), within two whole-block steps


def test_state_dict_refuses_another_layout():
    model = _model()
    opt = qds.WholeMatrixZeroOptimizer(qmuon.build_optimizer(model, **OPT_KW))
    x = _batch(0, 0)
    _loss(model(x), x).backward()
    opt.step()
    sd = opt.state_dict()
    assert sd["qmuon_deepspeed"]["muon"][0]["momentum_codes"].dtype == torch.int8
    other = qds.WholeMatrixZeroOptimizer(qmuon.build_optimizer(_model(), **OPT_KW))
    other.load_state_dict(sd)  # same layout: fine, and the state is restored bit for bit
    assert sorted(other._muon_state) == sorted(opt._muon_state) and other._muon_state
    for i, st in opt._muon_state.items():
        assert_same(dict(other.muon_state(i)), dict(st), "restored momentum")
    assert_same({i: [dict(x) for x in v] for i, v in other._slice_state.items()},
                {i: [dict(x) for x in v] for i, v in opt._slice_state.items()}, "restored AdamW state")
    moved = {**sd, "qmuon_deepspeed": {**sd["qmuon_deepspeed"], "muon": {999: sd["qmuon_deepspeed"]["muon"][0]}}}
    with pytest.raises(ValueError, match="parameter 999, which is not a Muon matrix"):
        other.load_state_dict(moved)
    bad = {**sd, "qmuon_deepspeed": {**sd["qmuon_deepspeed"], "world_size": 2}}
    with pytest.raises(ValueError, match="same number of processes and ZeRO stage"):
        other.load_state_dict(bad)
    with pytest.raises(ValueError, match="not written by qmuon's DeepSpeed integration"):
        other.load_state_dict(qmuon.build_optimizer(_model(), **OPT_KW).state_dict())


def test_wrapping_a_used_qmuon_is_refused():
    model = _model()
    opt = qmuon.build_optimizer(model, **OPT_KW)
    x = _batch(0, 0)
    _loss(model(x), x).backward()
    opt.step()
    with pytest.raises(ValueError, match="fresh QMuon"):
        qds.WholeMatrixZeroOptimizer(opt)
    with pytest.raises(TypeError, match="build_optimizer"):
        qds.WholeMatrixZeroOptimizer(torch.optim.AdamW(model.parameters()))


# ============================================================================ single-process reference
def _ref_state(opt) -> dict:
    """A QMuon's state in the worker's layout: ``muon`` (index -> state tensors and the dequantized
    fp32 momentum) and ``adamw`` (index -> state tensors)."""
    muon, adamw = {}, {}
    for i, (g, p) in enumerate(_qmuon_params(opt)):
        st = opt.state.get(p)
        if not st:
            continue
        t = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in st.items()}
        if g["use_muon"]:
            t["momentum_fp32"] = momentum_fp32(opt, p)
            muon[i] = t
        else:
            adamw[i] = t
    return {"muon": muon, "adamw": adamw}


def _reference(steps: int, bf16: bool = False, **ns) -> dict:
    """Single-process QMuon fed what DeepSpeed feeds: the mean of the two ranks' micro-batch
    gradients, ``(g0 + g1) / 2`` (DeepSpeed divides by the world size, then sums: the same number
    for 2 ranks, since halving is exact). ``bf16``: DeepSpeed's bf16 ZeRO 2, emulated: the model
    runs in bf16 (bf16 gradients, averaged in bf16), QMuon steps fp32 master weights that start as
    the bf16 weights, and the model gets the master weights rounded to bf16 after every step.
    ``ns``: Newton-Schulz options of the QMuon (``ns_dtype``, ``ns_coefficients``, ``ns_steps``).

    Returns the initial weights, per step the averaged gradients, weights and optimizer state (all
    in ``model.parameters()`` order, state by QMuon index), the bf16 model weights (``bf16``), and
    per QMuon index its group and position in ``model.parameters()``.
    """
    model = _model()
    opt = qmuon.build_optimizer(model, _without_verbose(OPT_KW), verbose=False, **ns)
    run = model
    if bf16:
        run = copy.deepcopy(model).bfloat16()
        with torch.no_grad():
            for m, w in zip(model.parameters(), run.parameters()):
                m.copy_(w.float())
    params = list(model.parameters())
    pos = {id(p): i for i, p in enumerate(params)}
    trace = {"init": [p.detach().clone() for p in params], "grads": [], "params": [], "state": [], "bf16": [],
             "index": [(g, pos[id(p)]) for g, p in _qmuon_params(opt)], "muon_bytes": []}
    for step in range(steps):
        per_rank = []
        for r in range(WORLD):
            run.zero_grad()
            x = _batch(step, r)
            _loss(run(x), x).backward()
            per_rank.append([p.grad.clone() for p in run.parameters()])
        avg = [torch.stack(gs).sum(0) / WORLD for gs in zip(*per_rank)]  # in the gradients' dtype
        for p, g in zip(params, avg):
            p.grad = g.float()
        opt.step()
        opt.zero_grad()
        if bf16:
            with torch.no_grad():
                for w, m in zip(run.parameters(), params):
                    w.copy_(m)  # round to nearest bf16, as DeepSpeed's copy back from the fp32 master
            trace["bf16"].append([p.detach().clone() for p in run.parameters()])
        trace["grads"].append([g.float() for g in avg])
        trace["params"].append([p.detach().clone() for p in params])
        trace["state"].append(_ref_state(opt))
        trace["muon_bytes"].append(opt.state_nbytes())
    trace["parts"] = {i: len(g["parts"] or (1,)) for i, (g, _) in enumerate(trace["index"]) if g["use_muon"]}
    # The yardstick itself must be Muon: were QMuon's core broken (SGD, NS skipped) in this process as
    # well, every exact comparison with it would still hold.
    if ns.get("update", {}).get("variant", "muon") == "muon":  # NorMuon rescales rows after NS: not the NS yardstick
        _assert_is_newton_schulz(trace["init"], trace["params"][0], trace["grads"][0], trace["index"],
                                 f"the reference (options {ns}) is not Muon")
    return trace


@pytest.fixture(scope="module")
def reference() -> dict:
    return _reference(STEPS)


def _check_params(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert_same([t.float() for t in got], [t.float() for t in want], what)


#: A block cut by a slice end (ZeRO-3 cuts odd-width matrices mid-block) is quantized by each rank with
#: its own absmax: after the first step its dequantized momentum is within 2 int8 steps (2 / 127) of
#: the whole block's absmax of single-process QMuon's (test_cut_block_momentum_bound); each later
#: step carries that times beta and adds up to 2 steps more: after 2 steps <= (2 + 2 * 0.95) / 127 =
#: 0.031 of the absmax when it did not shrink (measured <= 0.010 on GPT-2 under ZeRO-3). Bound on
#: |difference| / the block's absmax: 0.05.
CUT_BLOCK_ATOL = 0.05


def _check_slice_momentum(states: list[dict | None], first_rows: list[int | None], holders: list, ref: dict,
                          what: str, block_size: int | None = None) -> None:
    """ZeRO 1-3: each rank holding a slice of the matrix keeps the momentum of the rows its slice
    touches (full width); the slices tile the matrix once. Every block lying wholly in a slice (int8
    codes, scale, dequantized fp32) equals the reference's; in the OPT_KW layouts (block_size 32) every
    block does. Other layouts (``block_size``: theirs) may cut a block at a slice end: its elements
    within :data:`CUT_BLOCK_ATOL` of the block's absmax."""
    bs = block_size or OPT_KW["state"]["block_size"]
    rows, cols = ref["momentum_codes"].shape
    nb = ref["momentum_absmax"].shape[1]
    elements = torch.zeros(rows * cols, dtype=torch.int64)
    blocks = torch.zeros((rows, nb), dtype=torch.int64)
    whole = torch.zeros(rows * cols, dtype=torch.bool)  # elements of blocks wholly in one slice
    for r, (st, r0, h) in enumerate(zip(states, first_rows, holders)):
        if h is None or not h[1]:
            assert st is None, f"{what}: rank {r} holds no slice but keeps momentum"
            continue
        start, length = h
        assert_same(st["step"], ref["step"], f"{what}: step on rank {r}")
        for row in range(r0, r0 + st["momentum_codes"].shape[0]):
            for b in range(nb):
                lo, hi = row * cols + b * bs, row * cols + min(cols, (b + 1) * bs)
                if start <= lo and hi <= start + length:
                    assert_same(st["momentum_absmax"][row - r0, b], ref["momentum_absmax"][row, b],
                                f"{what}: scale of block ({row}, {b}) on rank {r}")
                    blocks[row, b] += 1
                    whole[lo:hi] = True
        elements[start: start + length] += 1
    assert bool((elements == 1).all()), f"{what}: the slices do not tile the matrix"
    assert block_size or bool((blocks == 1).all()), f"{what}: a quantization block is cut by a slice end"
    for r, (st, r0, h) in enumerate(zip(states, first_rows, holders)):
        if st is None:
            continue
        start, length = h
        at = start - r0 * cols
        keep = whole[start: start + length]
        for key in ("momentum_codes", "momentum_fp32"):
            got, want = st[key].reshape(-1)[at: at + length], ref[key].reshape(-1)[start: start + length]
            assert_same(got[keep], want[keep], f"{what}: {key} of rank {r}'s slice")
        scale = ref["momentum_absmax"].repeat_interleave(bs, dim=1)[:, :cols].reshape(-1)[start: start + length]
        diff = (st["momentum_fp32"].reshape(-1)[at: at + length] - ref["momentum_fp32"].reshape(-1)[start: start + length])
        assert bool((diff[~keep].abs() <= CUT_BLOCK_ATOL * scale[~keep]).all()), \
            f"{what}: cut block of rank {r}: |diff| / absmax up to {float((diff[~keep].abs() / scale[~keep]).max())}"


def _check_state(ranks: list[dict], owner: dict[int, int], holders: dict[int, list], want: dict, what: str,
                 block_size: int | None = None) -> None:
    """Every Muon matrix's momentum equals the reference's (codes, scales, step count, dequantized fp32
    momentum): at ZeRO 1/2 split over the ranks holding its slices (:func:`_check_slice_momentum`), at
    stage 0 whole on its owner only; NorMuon's second moment on the owner only; the AdamW slices the
    ranks hold are, at their offsets, the reference's AdamW state, and together cover every element."""
    for i, ref in want["muon"].items():
        held = [r for r, st in enumerate(ranks) if i in st["muon"]]
        if "normuon_v" in ref:
            assert [r for r, st in enumerate(ranks) if i in st["normuon"]] == [owner[i]], (what, i)
            assert_same(ranks[owner[i]]["normuon"][i], ref["normuon_v"], f"{what}: NorMuon moment of matrix {i}")
            ref = {k: v for k, v in ref.items() if k != "normuon_v"}
        if any(i in st["muon_rows"] for st in ranks):
            assert held == [r for r, h in enumerate(holders[i]) if h is not None and h[1]], (what, i, held)
            _check_slice_momentum([st["muon"].get(i) for st in ranks], [st["muon_rows"].get(i) for st in ranks],
                                  holders[i], ref, f"{what}: momentum of matrix {i}", block_size)
            continue
        assert held == [owner[i]], f"{what}: momentum of matrix {i} held by ranks {held}, owner is {owner[i]}"
        assert_same(ranks[held[0]]["muon"][i], ref, f"{what}: momentum of matrix {i} (rank {held[0]})")
    for r, st in enumerate(ranks):
        assert set(st["muon"]) <= set(want["muon"]), f"{what}: rank {r} holds momentum the reference has not"
        assert set(st["adamw"]) <= set(want["adamw"]), f"{what}: rank {r} holds AdamW state the reference has not"
    for i, ref in want["adamw"].items():
        pieces = {r: st["adamw"][i] for r, st in enumerate(ranks) if i in st["adamw"]}
        assert sorted(pieces) == [r for r, h in enumerate(holders[i]) if h is not None], (what, i, sorted(pieces))
        for key, w in ref.items():
            flat = w.reshape(-1) if w.dim() else w
            covered = torch.zeros(flat.numel() if w.dim() else 1, dtype=torch.int64)
            for r, (start, t) in pieces.items():
                got = t[key]
                exp = flat[start: start + got.numel()] if w.dim() else flat
                assert_same(got, exp, f"{what}: AdamW {key} of parameter {i} (rank {r}, offset {start})")
                if w.dim():
                    covered[start: start + got.numel()] += 1
            if w.dim():
                assert bool((covered >= 1).all()), f"{what}: AdamW {key} of parameter {i} not covered by the ranks"


def _check_ns_items(ranks: list[list[dict]], owner: dict[int, int], parts: dict[int, int], what: str) -> None:
    """Exactly once: in every step each matrix got one NS call per fused part, all on its owner."""
    assert len({len(r) for r in ranks}) == 1
    for step in range(len(ranks[0])):
        for r, calls in enumerate(ranks):
            assert set(calls[step]) <= set(parts), f"{what} step {step}: rank {r} ran NS for non-Muon indices"
        for i, n in parts.items():
            got = [calls[step].get(i, 0) for calls in ranks]
            want = [n if r == owner[i] else 0 for r in range(WORLD)]
            assert got == want, f"{what} step {step}, matrix {i}: NS calls per rank {got}, expected {want}"


def _ns_yardstick_errors(init: list[torch.Tensor], first: list[torch.Tensor], grads: list[torch.Tensor],
                         index: list) -> dict[str, float]:
    """Relative error of each Muon part's first-step update, recovered from the weights, against
    float64 Newton-Schulz of the averaged gradient (from zero momentum the Nesterov NS input is
    (1 - beta^2) g, up to int8 rounding; NS normalizes the scale away), with the group's
    ``ns_coefficients`` and ``ns_steps``."""
    errs = {}
    for i, (g, pos) in enumerate(index):
        if not g["use_muon"]:
            continue
        p0, p1, grad = init[pos].double(), first[pos].double(), grads[pos].double()
        lr, wd = g["lr"], g["weight_decay"]
        schedule = resolve_schedule(g["ns_coefficients"], g["ns_steps"])  # the group's own NS options
        update = p0 * (1.0 - lr * wd) - p1
        cols = p0[0].numel()
        r0 = 0
        for k, rows in enumerate(g["parts"] or (p0.shape[0],)):
            rs = slice(r0, r0 + rows)
            r0 += rows
            want = ns_float64(grad[rs].reshape(rows, cols), schedule.coefficients, g["ns_steps"],
                              norm_safety=schedule.norm_safety)
            got = update[rs].reshape(rows, cols) / torch_adjusted_lr(lr, g["adjust_lr_fn"], rows, cols)
            errs[f"{i}.{k}"] = ((got - want).norm() / want.norm()).item()
    return errs


def _assert_is_newton_schulz(init: list[torch.Tensor], first: list[torch.Tensor], grads: list[torch.Tensor],
                             index: list, what: str) -> None:
    """The first update of every Muon part is Newton-Schulz of the averaged gradient with the
    groups' options (all Muon groups share them here): within :data:`NS_YARDSTICK_RTOL_FP32` of
    float64 NS for ``ns_dtype="fp32"``; for bf16, within :data:`NS_YARDSTICK_RTOL` with the
    ``"muon"`` 5-step schedule, or :data:`NS_YARDSTICK_SCHEDULE_RATIO` times closer to another
    schedule than to float64 Muon NS."""
    errs = _ns_yardstick_errors(init, first, grads, index)
    assert len(errs) == 21, f"{what}: {len(errs)} Muon parts, expected 21"
    g = next(g for g, _ in index if g["use_muon"])
    if resolve_ns_dtype(g["ns_dtype"]) == torch.float32:
        assert max(errs.values()) < NS_YARDSTICK_RTOL_FP32, f"{what}: fp32 NS vs float64 NS: {errs}"
    elif resolve_schedule(g["ns_coefficients"], g["ns_steps"]) == resolve_schedule("muon", 5):
        assert max(errs.values()) < NS_YARDSTICK_RTOL, f"{what}: bf16 NS vs float64 NS: {errs}"
    else:
        as_muon = [({**grp, "ns_coefficients": "muon", "ns_steps": 5}, pos) for grp, pos in index]
        muon = _ns_yardstick_errors(init, first, grads, as_muon)
        ratio = {k: muon[k] / max(errs[k], 1e-30) for k in errs}
        assert min(ratio.values()) > NS_YARDSTICK_SCHEDULE_RATIO, \
            f"{what}: error vs float64 Muon NS / error vs float64 NS of the configured schedule: {ratio}"


# ============================================================================ 2-process worker
def _without_verbose(kw: dict) -> dict:
    """``kw`` as a config (sections given to build_optimizer as keywords then merge field by field)."""
    return {k: v for k, v in kw.items() if k != "verbose"}


def _engine(stage: int, seed: int = 0, bf16: bool = False, **ns):
    model = _model(seed)
    # gradient_clipping: DeepSpeed clips to norm 1.0 unless told otherwise; the reference does not clip.
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "gradient_clipping": 0.0, "bf16": {"enabled": bf16},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "allgather_bucket_size": 500}}
    engine, opt, _, _ = qds.initialize(model, qmuon.build_optimizer(model, _without_verbose(OPT_KW), verbose=False, **ns), cfg)
    return engine, opt


def _stage_run(engine, opt, rank: int) -> dict:
    """STEPS steps; the weights before, after the first and after the last step, the state, the NS calls."""
    init = _params(engine.module)
    calls = _train(engine, opt, range(1), rank)
    first = _params(engine.module)
    calls += _train(engine, opt, range(1, STEPS), rank)
    return {"init": init, "first": first, "params": _params(engine.module), "state": _state(opt),
            "ns_items": calls, "zero_class": type(engine.optimizer).__name__, **_layout(opt)}


def _train(engine, opt, steps, rank) -> list[dict[int, int]]:
    """Train ``steps``; return the NS calls this rank made per Muon index in each step."""
    calls = []
    for step in steps:
        x = _batch(step, rank)
        engine.backward(_loss(engine(x), x))
        engine.step()
        calls.append(dict(opt.ns_items))
    return calls


def _params(module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _state(opt) -> dict:
    """What this rank's wrapper holds: ``muon`` (index -> the momentum state it keeps of a matrix:
    ZeRO 1-3 the rows its slice touches, stage 0 the whole matrix on its owner; plus the dequantized
    fp32 momentum), ``muon_rows`` (index -> the first of those rows, ZeRO 1-3) and ``adamw`` (index ->
    (offset of the slice in the flattened parameter, state of the slice: its fp32-moment pieces'
    moments end to end))."""
    from qmuon.quant import dequantize_momentum, format_options

    muon, rows, adamw = {}, {}, {}
    for info in opt._params:
        if info.muon:
            st = opt.muon_state(info.index)
            if not st:
                continue
            t = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in st.items()}
            t["momentum_fp32"] = dequantize_momentum(st, opts=format_options(opt._all_groups[info.group]),
                                                     cols=info.cols)
            if opt._sliced(info.index):
                rows[info.index] = info.holders[opt._rank].start // info.cols
            muon[info.index] = t
        elif opt._slice_state.get(info.index):
            sts = opt._slice_state[info.index]
            t = {k: torch.cat([x[k].reshape(-1) for x in sts]) if sts[0][k].dim() else sts[0][k].clone()
                 for k in sts[0]}
            adamw[info.index] = (info.holders[opt._rank].start, t)
    # NorMuon's second moment stays on each matrix's owner
    normuon = {i: st["normuon_v"].clone() for i, st in opt._muon_state.items() if "normuon_v" in st}
    return {"muon": muon, "muon_rows": rows, "normuon": normuon, "adamw": adamw}


def _layout(opt) -> dict:
    return {"mode": opt._mode, "owner": {p.index: p.owner for p in opt._params if p.muon},
            "holders": {p.index: [None if s is None else (s.start, s.length) for s in p.holders] for p in opt._params},
            "state_nbytes": opt.state_nbytes()}


def worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    import deepspeed  # noqa: F401  (the CPU accelerator is chosen on import)
    import deepspeed.comm.comm as ds_comm
    import deepspeed.ops as ds_ops
    from deepspeed.accelerator import get_accelerator

    rank = int(os.environ["RANK"])
    res: dict = {"rank": rank, "accelerator": get_accelerator().device_name()}
    for stage in (0, 1, 2):
        engine, opt = _engine(stage)
        if stage == 0:
            # qds.initialize (nothing before it) must have kept DeepSpeed from building its CPU comm op.
            res["ops_at_init"] = {"backend": type(ds_comm.cdb).__name__,
                                  "shm_comm_op": repr(getattr(ds_comm.cdb, "shm_comm_op", "missing")),
                                  "compatible": sorted(k for k, v in ds_ops.__compatible_ops__.items() if v)}
        res[f"stage{stage}"] = _stage_run(engine, opt, rank)
        del engine, opt
    # The Newton-Schulz options, as the groups the owners' Newton-Schulz reads hold them.
    for key, (stage, ns) in NS_OPTION_RUNS.items():
        engine, opt = _engine(stage, **ns)
        res[key] = {**_stage_run(engine, opt, rank),
                    "ns_options": [{s: {f: g[GROUP_KEYS[f"{s}.{f}"]] for f in fields} if isinstance(fields, dict)
                                    else g[GROUP_KEYS[s]] for s, fields in ns.items()}
                                   for g in opt._all_groups if g["use_muon"]]}
        del engine, opt
    # bf16 parameters at ZeRO 2: fp32 master partitions, bf16 model weights.
    engine, opt = _engine(2, bf16=True)
    calls = _train(engine, opt, range(BF16_STEPS), rank)
    master = {}
    for info in opt._params:
        v = opt._views(info)
        if v is not None:  # this rank's slice of DeepSpeed's fp32 master partition
            master[info.index] = (info.holders[rank].start, v[0].detach().clone())
    res["bf16"] = {"params": _params(engine.module), "master": master, "state": _state(opt), "ns_items": calls,
                   **_layout(opt)}
    del engine, opt
    # Checkpoint: save after CKPT_AT steps, continue; a fresh engine (other init) loads and continues.
    for stage in (0, 2):
        d = os.path.join(out_dir, "ckpt", f"stage{stage}")
        engine, opt = _engine(stage)
        _train(engine, opt, range(CKPT_AT), rank)
        engine.save_checkpoint(d, tag="t")
        at_save = {"params": _params(engine.module), "state": _state(opt)}
        _train(engine, opt, range(CKPT_AT, STEPS), rank)
        straight = {"params": _params(engine.module), "state": _state(opt)}
        del engine, opt
        engine, opt = _engine(stage, seed=123)
        fresh = _params(engine.module)
        engine.load_checkpoint(d, tag="t")
        loaded = {"params": _params(engine.module), "state": _state(opt)}
        _train(engine, opt, range(CKPT_AT, STEPS), rank)
        resumed = {"params": _params(engine.module), "state": _state(opt)}
        res[f"ckpt{stage}"] = {"dir": d, "fresh": fresh, "at_save": at_save, "straight": straight, "loaded": loaded,
                               "resumed": resumed, **_layout(opt)}
        del engine, opt
    # A world-size / mode mismatch is refused with a clear error (stage 2 checkpoint into stage 0).
    engine, opt = _engine(0)
    try:
        engine.load_checkpoint(os.path.join(out_dir, "ckpt", "stage2"), tag="t")
        res["mismatch_error"] = None
    except Exception as e:  # noqa: BLE001
        res["mismatch_error"] = f"{type(e).__name__}: {e}"
    del engine, opt
    res["lightning"] = _lightning_run(rank)
    res["ops_at_end"] = {"shm_comm_op": repr(getattr(ds_comm.cdb, "shm_comm_op", "missing")),
                         "compatible": sorted(k for k, v in ds_ops.__compatible_ops__.items() if v)}
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()  # see its docstring


def _lightning_run(rank: int) -> dict:
    """Trainer(strategy=QMuonDeepSpeedStrategy) on the CPU accelerator inside the torchrun processes:
    LIGHTNING_STEPS steps of ZeRO 2 on the same per-rank micro-batches as the reference."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    import qmuon_lightning.strategies.deepspeed as qsd

    class Batches(torch.utils.data.Dataset):
        # item i on rank r is micro-batch _batch(i, r), as in the engine runs (Trainer built with
        # use_distributed_sampler=False, so Lightning does not re-deal the items).
        def __len__(self):
            return LIGHTNING_STEPS

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
            return qmuon.build_optimizer(self.model, **OPT_KW)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Batches(), batch_size=1, shuffle=False)

    class NSCalls(pl.Callback):
        def __init__(self):
            self.calls = []

        def on_train_batch_end(self, trainer, *args):
            self.calls.append(dict(trainer.strategy.qmuon_optimizer.ns_items))

    lit, ns_calls = Lit(), NSCalls()
    strategy = qsd.QMuonDeepSpeedStrategy(config={
        "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 1,
    })
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=LIGHTNING_STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[ns_calls])
    trainer.fit(lit)
    wrapper = trainer.strategy.qmuon_optimizer
    dist.barrier()
    return {"registered": "qmuon_deepspeed" in pl.strategies.StrategyRegistry, "wrapper": type(wrapper).__name__,
            "steps": trainer.global_step, "params": _params(lit.model), "state": _state(wrapper),
            "ns_items": ns_calls.calls, **_layout(wrapper)}


# ============================================================================ 2-process tests
@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ds")
    cmd = torchrun_cmd(str(WORLD), Path(__file__).resolve(), "--worker", str(out))
    log = run_launcher(cmd, timeout=600, env=subprocess_env(DS_ACCELERATOR="cpu"), what="2-process DeepSpeed worker")
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    assert [r["rank"] for r in ranks] == list(range(WORLD))
    return {"ranks": ranks, "log": log}


def _scenario(run: dict, key: str) -> list[dict]:
    per_rank = [r[key] for r in run["ranks"]]
    for k in ("mode", "owner", "holders"):  # every rank computed the same layout
        assert all(r[k] == per_rank[0][k] for r in per_rank), f"{key}: ranks disagree on {k}"
    return per_rank


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_stage_matches_single_process(two_process_run, reference, stage):
    """ZeRO stage 0/1/2 on 2 processes, STEPS steps, against the single-process reference: weights on
    both ranks, every matrix's quantized momentum (stage 0: on its owner only; 1/2: each rank its
    slice's rows) and the AdamW slices, exact;
    NS exactly once per matrix part per step; the first update is Newton-Schulz of the gradient."""
    runs = _scenario(two_process_run, f"stage{stage}")
    r0 = runs[0]
    assert r0["mode"] == ("direct" if stage == 0 else "partitioned")
    assert r0["zero_class"] == ("WholeMatrixZeroOptimizer" if stage == 0 else "DeepSpeedZeroOptimizer")
    for rank, r in enumerate(runs):
        _check_params(r["init"], reference["init"], f"stage {stage} rank {rank}: initial weights")
        _check_params(r["first"], reference["params"][0], f"stage {stage} rank {rank}: weights after step 1")
        _check_params(r["params"], reference["params"][-1], f"stage {stage} rank {rank}: weights after {STEPS} steps")
    _check_state([r["state"] for r in runs], r0["owner"], r0["holders"], reference["state"][-1], f"stage {stage}")
    _check_ns_items([r["ns_items"] for r in runs], r0["owner"], reference["parts"], f"stage {stage}")
    _assert_is_newton_schulz(r0["init"], r0["first"], reference["grads"][0], reference["index"], f"stage {stage}")
    # The work and the momentum are split, not replicated: both ranks own matrices, and their momentum
    # bytes add up to one QMuon's; at ZeRO 1/2 plus, per matrix cut by the boundary, its step counter
    # on the second rank and the row both slices touch (kept full width on each: 1 B per element + 4 B
    # per block of int8).
    assert set(r0["owner"].values()) == set(range(WORLD)), f"owners {r0['owner']}"
    nbytes = [r["state_nbytes"] for r in runs]
    extra = 0
    for i, h in r0["holders"].items():
        held = [x for x in h if x is not None and x[1]] if stage and i in r0["owner"] else []
        if len(held) > 1:
            rows, cols = reference["state"][-1]["muon"][i]["momentum_codes"].shape
            touched = sum((s + n - 1) // cols + 1 - s // cols for s, n in held)
            extra += 4 * (len(held) - 1) + (touched - rows) * (cols + 4 * -(-cols // OPT_KW["state"]["block_size"]))
    assert sum(nbytes) == reference["muon_bytes"][-1] + extra and all(0 < n < sum(nbytes) for n in nbytes), \
        f"momentum bytes per rank {nbytes}, one QMuon holds {reference['muon_bytes'][-1]} (+ {extra} shared)"
    if stage:
        # one matrix of each of the 3 Muon groups (plain, fused qkv, fused gate_up) crosses the boundary
        split = [i for i in r0["owner"] if sum(h is not None for h in r0["holders"][i]) > 1]
        assert len(split) == 3, split


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(NS_OPTION_RUNS))
def test_ns_options_match_single_process(two_process_run, reference, scenario):
    """The Newton-Schulz options give the single-process update under DeepSpeed: ``ns_dtype="fp32"``
    at ZeRO 1 (fp32 NS outputs go back to the slice holders as fp32) and ``ns_coefficients=
    "polar_express"`` with ``ns_steps=6`` at ZeRO 2, each against a single-process QMuon with the same
    options: weights after the first and the last of STEPS steps on both ranks and every matrix's
    momentum and AdamW slice, exact; NS once per matrix part per step. The option is in effect: the
    first update is NS with these options (:func:`_assert_is_newton_schulz`), not the default one."""
    stage, ns = NS_OPTION_RUNS[scenario]
    ref = _reference(STEPS, **ns)
    runs = _scenario(two_process_run, scenario)
    r0 = runs[0]
    assert r0["mode"] == "partitioned" and r0["zero_class"] == "DeepSpeedZeroOptimizer"
    assert all(opts == ns for r in runs for opts in r["ns_options"]), [r["ns_options"] for r in runs]
    for rank, r in enumerate(runs):
        where = f"{scenario} (ZeRO {stage}) rank {rank}"
        _check_params(r["init"], ref["init"], f"{where}: initial weights")
        _check_params(r["first"], ref["params"][0], f"{where}: weights after step 1")
        _check_params(r["params"], ref["params"][-1], f"{where}: weights after {STEPS} steps")
    _check_state([r["state"] for r in runs], r0["owner"], r0["holders"], ref["state"][-1], scenario)
    _check_ns_items([r["ns_items"] for r in runs], r0["owner"], ref["parts"], scenario)
    if "state_format" in ns:  # a momentum format, not a Newton-Schulz option: where the momentum lives
        for rank, r in enumerate(runs):
            assert not r["state"]["muon_rows"], f"{scenario}: rank {rank} keeps slice momentum of a grasp4 matrix"
        return
    if ns.get("update", {}).get("variant", "muon") == "muon":
        _assert_is_newton_schulz(r0["init"], r0["first"], ref["grads"][0], ref["index"], f"{scenario}: 2-process update")
    else:  # the second moment is on each matrix's owner (the momentum on the ranks holding its slices)
        for rank, r in enumerate(runs):
            assert set(r["state"]["normuon"]) == {i for i, o in r0["owner"].items() if o == rank}, rank
    # ... and changes the arithmetic: every Muon matrix's first update differs from the default options'.
    muon = [pos for g, pos in ref["index"] if g["use_muon"]]
    same = [pos for pos in muon if torch.equal(ref["params"][0][pos], reference["params"][0][pos])]
    assert not same, f"{scenario}: parameters {same} took the default options' first step"


def _optimizer_files(d: str, stage: int) -> list[dict]:
    """The qmuon_deepspeed entry of the optimizer state DeepSpeed wrote: stage 0, rank 0's (the only
    one); stages 1/2, one per rank."""
    if stage == 0:
        sd = torch.load(os.path.join(d, "t", "mp_rank_00_model_states.pt"), weights_only=False)["optimizer"]
        return [sd["qmuon_deepspeed"]]
    out = []
    for r in range(WORLD):
        f = os.path.join(d, "t", f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        out.append(torch.load(f, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["qmuon_deepspeed"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_checkpoint_resume_is_bit_exact(two_process_run, reference, stage):
    """engine.save_checkpoint after CKPT_AT steps, continue to STEPS; a fresh engine (other initial
    weights) loads the checkpoint and continues. Compared as tensors: the loaded weights and state
    are the saved ones, the resumed run ends where the straight one does, and the straight one
    where the single-process reference does (so the test cannot pass by nothing moving)."""
    runs = _scenario(two_process_run, f"ckpt{stage}")
    r0 = runs[0]
    owner, holders = r0["owner"], r0["holders"]
    _check_state([r["at_save"]["state"] for r in runs], owner, holders, reference["state"][CKPT_AT - 1],
                 f"stage {stage} at save")
    for rank, r in enumerate(runs):
        where = f"stage {stage} rank {rank}"
        _check_params(r["at_save"]["params"], reference["params"][CKPT_AT - 1], f"{where}: weights at save")
        assert not any(torch.equal(a, b) for a, b in zip(r["fresh"], r["at_save"]["params"])), \
            f"{where}: the fresh engine already had the saved weights; the load would not be tested"
        assert_same(r["loaded"]["params"], r["at_save"]["params"], f"{where}: weights after load_checkpoint")
        assert_same(r["loaded"]["state"], r["at_save"]["state"], f"{where}: optimizer state after load_checkpoint")
        assert_same(r["resumed"]["params"], r["straight"]["params"], f"{where}: weights, resumed vs straight")
        assert_same(r["resumed"]["state"], r["straight"]["state"], f"{where}: optimizer state, resumed vs straight")
        _check_params(r["straight"]["params"], reference["params"][-1], f"{where}: weights after {STEPS} steps")
    _check_state([r["straight"]["state"] for r in runs], owner, holders, reference["state"][-1], f"stage {stage} end")
    # What DeepSpeed wrote: int8 momentum codes, each matrix's being its owner's state at the save.
    files = _optimizer_files(r0["dir"], stage)
    for r, f in enumerate(files):
        inner = f["muon"] if stage == 0 else f["muon_slices"]
        held = {k for k in inner if "momentum_codes" in inner[k]}
        expected = set(owner) if stage == 0 else {i for i in owner if holders[i][r] is not None and holders[i][r][1]}
        assert held == expected, f"file of rank {r}: momentum of matrices {sorted(held)}, expected {sorted(expected)}"
        for i in held:
            assert inner[i]["momentum_codes"].dtype == torch.int8
            saved = runs[owner[i] if stage == 0 else r]["at_save"]["state"]["muon"][i]
            assert_same({k: v for k, v in inner[i].items()}, {k: v for k, v in saved.items() if k != "momentum_fp32"},
                        f"checkpoint file of rank {r}, matrix {i}")


@pytest.mark.slow
def test_no_op_builds_and_mismatch_error(two_process_run):
    for res in two_process_run["ranks"]:
        assert res["accelerator"] == "cpu"
        # qds.initialize ran first: deepspeed.comm's backend came up without its shared-memory op (built
        # or loaded, it would be a module object here), and every op is marked unavailable.
        assert res["ops_at_init"] == {"backend": "TorchBackend", "shm_comm_op": "None", "compatible": []}
        assert res["ops_at_end"] == {"shm_comm_op": "None", "compatible": []}
        assert res["mismatch_error"] and "same number of processes and ZeRO stage" in res["mismatch_error"]
    # DeepSpeed prints this whenever it builds or loads an op (secondary evidence; the state above decides).
    assert "built successfully" not in two_process_run["log"]


@pytest.mark.slow
def test_bf16_zero2_matches_emulated_reference(two_process_run):
    """bf16 parameters at ZeRO 2 against the single-process emulation of DeepSpeed's bf16 path
    (:func:`_reference` with ``bf16=True``): the fp32 master slices, the bf16 model weights on both
    ranks and the optimizer state, exact; every matrix once per step."""
    ref = _reference(BF16_STEPS, bf16=True)
    runs = _scenario(two_process_run, "bf16")
    r0 = runs[0]
    assert r0["mode"] == "partitioned"
    for rank, r in enumerate(runs):
        assert all(p.dtype == torch.bfloat16 for p in r["params"])
        assert_same(r["params"], ref["bf16"][-1], f"rank {rank}: bf16 weights")
        for i, (start, master) in r["master"].items():
            want = ref["params"][-1][ref["index"][i][1]].reshape(-1)
            assert_same(master, want[start: start + master.numel()], f"rank {rank}: fp32 master of parameter {i}")
    covered = {i for r in runs for i in r["master"]}
    assert covered == set(range(len(ref["index"])))
    _check_state([r["state"] for r in runs], r0["owner"], r0["holders"], ref["state"][-1], "bf16")
    _check_ns_items([r["ns_items"] for r in runs], r0["owner"], ref["parts"], "bf16")
    assert not any(torch.equal(a, b) for a, b in zip(r0["params"], [p.bfloat16() for p in ref["init"]]))


@pytest.mark.slow
def test_lightning_strategy_on_cpu_matches_single_process(two_process_run, reference):
    runs = _scenario(two_process_run, "lightning")
    r0 = runs[0]
    assert r0["registered"] and r0["wrapper"] == "WholeMatrixZeroOptimizer" and r0["mode"] == "partitioned"
    assert r0["steps"] == LIGHTNING_STEPS
    # Same averaged gradients as the reference, so bit-exact as the engine path.
    for rank, r in enumerate(runs):
        _check_params(r["params"], reference["params"][LIGHTNING_STEPS - 1], f"Lightning rank {rank}: weights")
    _check_state([r["state"] for r in runs], r0["owner"], r0["holders"], reference["state"][LIGHTNING_STEPS - 1],
                 "Lightning")
    _check_ns_items([r["ns_items"] for r in runs], r0["owner"], reference["parts"], "Lightning")


def test_strategy_registered_and_refuses_bad_config():
    import lightning.pytorch as pl

    import qmuon_lightning.strategies.deepspeed as qsd

    assert pl.strategies.StrategyRegistry["qmuon_deepspeed"]["strategy"] is qsd.QMuonDeepSpeedStrategy
    assert pl.strategies.StrategyRegistry["qmuon_deepspeed_stage_1"]["init_params"] == {"stage": 1}
    assert pl.strategies.StrategyRegistry["qmuon_deepspeed_stage_3"]["init_params"] == {"stage": 3}
    assert qsd.QMuonDeepSpeedStrategy(stage=3).config["zero_optimization"]["stage"] == 3
    with pytest.raises(qds.UnsupportedDeepSpeedConfig, match="offload_param"):
        qsd.QMuonDeepSpeedStrategy(stage=3, offload_parameters=True)
    with pytest.raises(qds.UnsupportedDeepSpeedConfig, match="DeepSpeedCPUAdam"):
        qsd.QMuonDeepSpeedStrategy(stage=2, offload_optimizer=True)
    with pytest.raises(qds.UnsupportedDeepSpeedConfig, match="'optimizer' section"):
        qsd.QMuonDeepSpeedStrategy(config={"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 2}})
    trainer = pl.Trainer(strategy="qmuon_deepspeed", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, qsd.QMuonDeepSpeedStrategy)
    assert trainer.strategy.config["zero_optimization"]["stage"] == 2


# ============================================================================ the example, under the launcher
def _tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested checkpoint object, by path (other leaves are ignored)."""
    out = {}
    if torch.is_tensor(obj):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_tensors(v, f"{prefix}/{i}"))
    return out


def _example_checkpoint(d: Path, stage: int = 2) -> dict:
    """Model weights and each rank's optimizer state of one tag of examples/deepspeed_train.py. At
    stage 3 the model file holds empty placeholders; the weights are the ranks' fp32 pieces."""
    model = torch.load(d / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"),
                       weights_only=False)
    optim = [torch.load(d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", weights_only=False)["optimizer_state_dict"]
             for r in range(WORLD)]
    if stage == 3:
        module = {f"rank{r}/{i}": t for r, o in enumerate(optim) for i, t in enumerate(o["fp32_flat_groups"])}
        qmuon = [o["optimizer_state_dict"]["qmuon_deepspeed"] for o in optim]
    else:
        module = _tensors(model["module"])
        qmuon = [o["base_optimizer_state"]["qmuon_deepspeed"] for o in optim]
    return {"module": module, "step": model["step"], "optim": [_tensors(o) for o in optim], "qmuon": qmuon}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_example_under_deepspeed_launcher(tmp_path, stage):
    """examples/deepspeed_train.py on 2 CPU processes with the shipped config: ZeRO 2 under the
    `deepspeed` launcher, and ``--stage 3`` (the model built under ``zero.Init``) under
    ``torch.distributed.run`` (the same processes, without the launcher's own DeepSpeed start-up:
    the `deepspeed` launcher ran it too, docs/deepspeed.md). Run A: 6 steps, checkpoints at steps
    2, 4 and 6. Run B: a copy of A's step-4
    checkpoint, ``--resume`` to step 6, saving every step. Compared as tensors: B's step-6
    checkpoint (weights, fp32 master partitions, quantized momentum, AdamW state) equals A's
    exactly. B must have written only step5 and step6: a run that ignored the checkpoint and
    started over (same data, same initial weights) would have written step1..step6 and could end
    at the same weights. Slow (two more launches); the fast tests above compare the same engine
    path with a single-process reference."""
    launcher = shutil.which("deepspeed")
    if launcher is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    a, b = tmp_path / "a", tmp_path / "b"
    example = str(REPO / "examples" / "deepspeed_train.py")

    def launch(save_dir: Path, *extra: str) -> None:
        start = [launcher, "--num_gpus", "2"] if stage != 3 else \
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
        cmd = [*start, "--master_port", str(free_port()), example, "--d-model", "64",
               "--seq-len", "64", "--corpus-bytes", str(1 << 20), "--log-every", "2", "--steps", "6",
               "--save-dir", str(save_dir), "--stage", str(stage), *extra]
        run_launcher(cmd, timeout=600, env=subprocess_env(DS_ACCELERATOR="cpu"),
                     what=f"examples/deepspeed_train.py {' '.join(extra)}")

    launch(a, "--save-every", "2")
    assert sorted(p.name for p in a.iterdir() if p.is_dir()) == ["step2", "step4", "step6"]
    b.mkdir()
    shutil.copytree(a / "step4", b / "step4")
    (b / "latest").write_text("step4")
    launch(b, "--save-every", "1", "--resume")
    assert sorted(p.name for p in b.iterdir() if p.is_dir()) == ["step4", "step5", "step6"], \
        "run B did not resume from step 4"
    straight, resumed = _example_checkpoint(a / "step6", stage), _example_checkpoint(b / "step6", stage)
    at4 = _example_checkpoint(a / "step4", stage)
    assert straight["step"] == resumed["step"] == 6
    assert_same(resumed["module"], straight["module"], "step-6 weights, resumed vs straight")
    for r in range(WORLD):
        assert_same(resumed["optim"][r], straight["optim"][r], f"step-6 optimizer state of rank {r}, resumed/straight")
    # The run trained: every weight changed from step 4 to step 6, and the momentum is int8, each
    # matrix's rows on the ranks holding its slices.
    assert not any(torch.equal(straight["module"][k], at4["module"][k]) for k in straight["module"])
    owners = straight["qmuon"][0]["owners"]
    held = [{k for k, v in q["muon_slices"].items() if "momentum_codes" in v} for q in straight["qmuon"]]
    assert len(held[0] | held[1]) == len(owners)  # each matrix's rows on the ranks holding its slices
    assert all(q["muon_slices"][k]["momentum_codes"].dtype == torch.int8 for q, h in zip(straight["qmuon"], held)
               for k in h)


if __name__ == "__main__" and "--worker" in sys.argv:
    worker(sys.argv[sys.argv.index("--worker") + 1])
