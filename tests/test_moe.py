"""Mixture-of-experts expert banks (issue 22, item 1) on tiny Hugging Face configs built here (no
download): Qwen3-MoE, Mixtral, OLMoE (``(E, out, in)`` banks, ``[gate; up]`` rows) and gpt-oss
(``(E, in, out)``, gate / up interleaved columns, bias banks, attention sinks).

Yardstick: each expert's gate, up and down matrix, read from the models' own forward code
(tests/_moe.py), against ``torch.optim.Muon`` stepping that ``(out, in)`` matrix with the same
gradient; targets cosine >= 0.99 and norm ratio within 10% (both run bf16 Newton-Schulz; measured
>= 0.9995 and within 1.1%). The same check on the bank as stored, one flattened ``(E, out*in)``
matrix (what QMuon did before), misses them (``test_flattened_bank_misses_the_targets``).

Sharded runs (2 processes, gloo, ``fully_shard`` per decoder layer): ``Shard(0)`` of a bank puts
whole experts on a rank; each rank orthogonalizes its own experts, so with bf16 carriers the update
and int8 state equal single-process QMuon's bit for bit, and a bank-only model runs no
Newton-Schulz exchange at all (also with an uneven split: 3 experts on 2 ranks).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers") if __name__ != "__main__" else None

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qmuon  # noqa: E402
from _dist import run_workers  # noqa: E402
from _helpers import assert_same, fabric_resume_scenario, roundtrip_state_dict  # noqa: E402
from _dist import run_launcher, subprocess_env  # noqa: E402
from _moe import (EXPERTS, INTER, LAYERS, LR, MOE_FAMILIES, compare, expert_report,  # noqa: E402
                  lm_loss, make_moe, tokens, torch_muon_update)
from qmuon.optim import RoutingRule, format_routing_table, route_parameters  # noqa: E402

MIN_COSINE, NORM_TOL = 0.99, 0.10
EXACT_KW = dict(lr=LR, weight_decay=0.0, state_format="fp32", newton_schulz={"dtype": "bf16"}, verbose=False)
#: bf16 carriers both ways: the sharded step is then bit for bit the single-process one.
BF16_WIRE = {"comm_carrier": "bf16", "comm_return": "bf16"}


def assert_targets(report: dict[str, tuple[float, float]], what: str) -> None:
    bad = {k: v for k, v in report.items() if not (v[0] >= MIN_COSINE and abs(v[1] - 1.0) <= NORM_TOL)}
    assert not bad, f"{what}: expert blocks off torch.optim.Muon (cosine, norm ratio): {bad}"


def first_step(family: str, batch: int = 8, **build: Any) -> dict[str, tuple[float, float]]:
    model = make_moe(family)
    opt = qmuon.build_optimizer(model, **{**EXACT_KW, **build})
    lm_loss(model, tokens(batch=batch)).backward()
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    grads = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
    opt.step()
    return expert_report(family, before, {n: p.detach() for n, p in params.items()}, grads)


# ------------------------------------------------------------------------------------ routing
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routing_table_of_moe_families(family: str) -> None:
    """Expert banks are banks (with gate / up parts per expert), bias banks, routers and sinks go to
    AdamW; no bias bank reaches Muon."""
    model = make_moe(family)
    decisions = {d.name: d for d in route_parameters(model)}
    gpt_oss = family == "gpt_oss"
    for i in range(LAYERS):
        pre = f"model.layers.{i}.mlp"
        gu, dn = decisions[f"{pre}.experts.gate_up_proj"], decisions[f"{pre}.experts.down_proj"]
        want_gu = ("muon", 1, (INTER, INTER), 1 if gpt_oss else 0, gpt_oss, "in_out" if gpt_oss else "out_in")
        assert (gu.target, gu.bank_dims, gu.parts, gu.parts_axis, gu.parts_interleaved, gu.orientation) == want_gu
        assert (dn.target, dn.bank_dims, dn.parts, dn.orientation) == ("muon", 1, None, gu.orientation)
        router = decisions[f"{pre}.router.weight" if gpt_oss else f"{pre}.gate.weight"]
        assert (router.target, router.reason) == ("adamw", "MoE router: logits over experts")
        if gpt_oss:
            assert decisions[f"{pre}.router.bias"].target == "adamw_no_decay"
            for b in ("gate_up_proj_bias", "down_proj_bias"):
                assert decisions[f"{pre}.experts.{b}"].target == "adamw_no_decay"
            assert decisions[f"model.layers.{i}.self_attn.sinks"].target == "adamw_no_decay"
    muon_bias = [d.name for d in decisions.values() if d.target == "muon" and "bias" in d.name]
    assert muon_bias == []
    table = format_routing_table(list(decisions.values()))
    row = next(line for line in table.splitlines() if line.startswith("model.layers.0.mlp.experts.gate_up_proj "))
    assert f"bank={EXPERTS} parts=[{INTER}, {INTER}]" in row
    assert ("dim=1 interleaved" in row and "in_out" in row) if gpt_oss else "out_in" in row
    opt = qmuon.build_optimizer(model, verbose=False)
    banks = [g for g in opt.param_groups if g["use_muon"] and g["bank_dims"]]
    assert sorted(n for g in banks for n in g["param_names"]) == sorted(
        f"model.layers.{i}.mlp.experts.{a}" for i in range(LAYERS) for a in ("gate_up_proj", "down_proj"))


def test_declared_banks_and_router_override() -> None:
    """A user's own expert module declares its bank with ``qmuon_bank_dims``; ``banks`` with None
    turns detection off (the bank is one flattened matrix again); a rule before the router rule
    sends routers to Muon."""

    class MyExperts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_in = torch.nn.Parameter(torch.randn(3, 2, 8, 4))  # (E1, E2, out, in)
            self.qmuon_bank_dims = {"w_in": 2}

    m = torch.nn.Module()
    m.experts = MyExperts()
    (d,) = route_parameters(m)
    assert (d.target, d.bank_dims, d.orientation) == ("muon", 2, "out_in")
    (d,) = route_parameters(m, banks={r"w_in$": None})
    assert d.bank_dims == 0
    with pytest.raises(ValueError, match=r"bank dims must be an int .* has shape \(3, 2, 8, 4\), got 1"):
        route_parameters(m, banks={r"w_in$": 1})
    opt = qmuon.build_optimizer(m, verbose=False, **{k: v for k, v in EXACT_KW.items() if k != "verbose"})
    w = m.experts.w_in
    w.grad = torch.randn_like(w)
    w0, g = w.detach().clone(), w.grad.clone()
    opt.step()
    for i in range(3):
        for j in range(2):
            cos, ratio = compare((w.detach() - w0)[i, j], torch_muon_update(w0[i, j], g[i, j]))
            # bf16 Newton-Schulz on both sides; 8 x 4 matrices: measured norm ratios within 1.1%
            assert cos >= 0.999 and abs(ratio - 1) < 0.02, (i, j, cos, ratio)
    model = make_moe("qwen3_moe")
    rules = (RoutingRule("muon", module_class_regex="Router$", reason="router on Muon"),
             *qmuon.optim.routing.DEFAULT_RULES)
    decisions = {d.name: d for d in route_parameters(model, rules)}
    assert decisions["model.layers.0.mlp.gate.weight"].target == "muon"


def test_formats_that_mix_rows_are_refused_for_banks() -> None:
    """grasp4 (a low-rank factor of the stored matrix) and e0m3 (a tensor scale) would mix
    experts; the error names the fix, which works."""
    model = make_moe("mixtral")
    for fmt in ("grasp4", "e0m3"):
        with pytest.raises(ValueError, match=f"state_format '{fmt}' keeps statistics over the whole stored matrix"):
            qmuon.build_optimizer(model, state_format=fmt, verbose=False)
    opt = qmuon.build_optimizer(model, state_format="grasp4", routing={"bank_state_format": "int8"}, verbose=False)
    formats = {g["state_format"] for g in opt.param_groups if g["use_muon"] and g["bank_dims"]}
    plain = {g["state_format"] for g in opt.param_groups if g["use_muon"] and not g["bank_dims"]}
    assert (formats, plain) == ({"int8"}, {"grasp4"})
    lm_loss(model, tokens()).backward()
    opt.step()
    with pytest.raises(ValueError, match="keeps statistics"):
        p = model.model.layers[0].mlp.experts.down_proj
        opt.promote_param(p, {"state_format": "grasp4"})


# ------------------------------------------------------------------------------ update parity
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_expert_block_moves_like_torch_muon(family: str) -> None:
    report = first_step(family)
    assert len(report) == 3 * EXPERTS * LAYERS
    assert_targets(report, family)


def test_flattened_bank_misses_the_targets() -> None:
    """The yardstick has teeth: the banks as one flattened (E, out*in) matrix each (detection
    turned off through the router's own override) fail it."""
    report = first_step("qwen3_moe", routing={"banks": {r"experts\.": None}})
    worst_cos = min(c for c, _ in report.values())
    worst_norm = max(abs(r - 1) for _, r in report.values())
    assert worst_cos < MIN_COSINE and worst_norm > NORM_TOL, (worst_cos, worst_norm)


def test_expert_without_tokens_decays_and_stays_finite() -> None:
    """An expert that got no tokens (zero gradient block): no NaN from normalizing zero, no update
    on a zero momentum, momentum decays by beta otherwise; its state is there from the first step."""
    torch.manual_seed(0)
    for fmt in ("fp32", "int8"):
        w = torch.nn.Parameter(torch.randn(4, 2 * 8, 12))
        opt = qmuon.QMuon([{"params": [w], "bank_dims": 1, "parts": (8, 8)}], lr=LR, weight_decay=0.0,
                       state_format=fmt)
        g = torch.randn_like(w)
        g[1] = 0.0  # expert 1: no tokens at step 1
        w.grad = g.clone()
        w0 = w.detach().clone()
        opt.step()
        assert torch.isfinite(w).all()
        assert torch.equal(w.detach()[1], w0[1])  # zero momentum: no update, no NaN
        assert not torch.equal(w.detach()[0], w0[0])
        m1 = qmuon.quant.dequantize_momentum(opt.state[w]).view(4, -1).clone()
        g2 = torch.randn_like(w)
        g2[2] = 0.0  # expert 2: no tokens at step 2 (momentum from step 1)
        w.grad = g2
        w1 = w.detach().clone()
        opt.step()
        m2 = qmuon.quant.dequantize_momentum(opt.state[w]).view(4, -1)
        tol = 0 if fmt == "fp32" else 2 * m1[2].abs().max().item() / 127  # one int8 step of each encoding
        assert (m2[2] - 0.95 * m1[2]).abs().max().item() <= tol + 1e-7
        assert torch.isfinite(w).all() and not torch.equal(w.detach()[2], w1[2])


@pytest.mark.parametrize("layout", ["out_in", "gpt_oss"])
def test_normuon_on_a_bank_is_normuon_per_expert_matrix(layout: str) -> None:
    """variant='normuon' on a bank: every expert's gate, up and down matrix gets its own per-neuron
    second moment, exactly as NorMuon on that matrix as its own (out, in) parameter (3 steps, fp32
    momentum, bf16 NS; the same matrices batch together on both sides, so the bits agree). gpt-oss:
    (E, in, out) with interleaved gate / up columns, neurons are stored columns."""
    E, I, H = 3, 8, 12
    torch.manual_seed(0)
    kw = dict(lr=LR, weight_decay=0.01, state_format="fp32", newton_schulz={"dtype": "bf16"}, update={"variant": "normuon"})
    if layout == "out_in":
        bank = torch.nn.Parameter(torch.randn(E, 2 * I, H) * 0.1)
        group = {"params": [bank], "bank_dims": 1, "parts": (I, I)}
        views = [lambda t, e=e: t[e][:I] for e in range(E)] + [lambda t, e=e: t[e][I:] for e in range(E)]
    else:
        bank = torch.nn.Parameter(torch.randn(E, H, 2 * I) * 0.1)
        group = {"params": [bank], "bank_dims": 1, "parts": (I, I), "parts_axis": 1, "parts_interleaved": True,
                 "orientation": "in_out"}
        views = [lambda t, e=e: t[e][:, 0::2].T for e in range(E)] + [lambda t, e=e: t[e][:, 1::2].T for e in range(E)]
    singles = [torch.nn.Parameter(v(bank.detach()).clone().contiguous()) for v in views]
    o_bank = qmuon.QMuon([group], **kw)
    o_single = qmuon.QMuon([{"params": singles}], **kw)
    for step in range(3):
        g = torch.randn(bank.shape, generator=torch.Generator().manual_seed(step))
        if step == 1:
            g[1] = 0.0  # expert 1 got no tokens: its second moment decays, nothing is NaN
        bank.grad = g
        for p, v in zip(singles, views):
            p.grad = v(g).clone().contiguous()
        o_bank.step()
        o_single.step()
    for j, (p, v) in enumerate(zip(singles, views)):
        assert torch.equal(v(bank.detach()), p.detach()), (layout, j)
    vb = o_bank.state[bank]["normuon_v"]
    assert vb.shape == (E, 2 * I) and torch.isfinite(vb).all()
    for e in range(E):  # gate's neurons, then up's, of each expert
        assert torch.equal(vb[e, :I], o_single.state[singles[e]]["normuon_v"].flatten()), e
        assert torch.equal(vb[e, I:], o_single.state[singles[E + e]]["normuon_v"].flatten()), e
    # the bank's second moment survives a checkpoint (torch.save / weights_only load) and the resumed
    # bank keeps stepping like the uninterrupted one
    resumed = torch.nn.Parameter(bank.detach().clone())
    o_resumed = qmuon.QMuon([{**group, "params": [resumed]}], **kw)
    o_resumed.load_state_dict(roundtrip_state_dict(o_bank.state_dict()))
    g = torch.randn(bank.shape, generator=torch.Generator().manual_seed(9))
    bank.grad, resumed.grad = g, g.clone()
    o_bank.step()
    o_resumed.step()
    assert torch.equal(resumed.detach(), bank.detach())
    assert torch.equal(o_resumed.state[resumed]["normuon_v"], o_bank.state[bank]["normuon_v"])


def test_fidelity_tracker_measures_banks_per_expert() -> None:
    """UpdateFidelityTracker on a MoE model (int8 momentum): the banks are measured with their plan
    (per-expert NS), so the int8 update follows the fp32 one (cosine > 0.99: one 8-bit rounding of
    the momentum)."""
    from qmuon_lightning.callbacks.fidelity import UpdateFidelityTracker

    model = make_moe("gpt_oss")
    opt = qmuon.build_optimizer(model, lr=LR, state_format="int8", verbose=False)
    tracker = UpdateFidelityTracker(opt, params=r"experts\.")
    cos: dict[str, float] = {}
    for step in range(2):
        lm_loss(model, tokens(step, batch=8)).backward()
        cos = tracker.observe(measure=step == 1)
        opt.step()
        opt.zero_grad()
    assert sorted(cos) == sorted(f"model.layers.{i}.mlp.experts.{a}" for i in range(LAYERS)
                                 for a in ("gate_up_proj", "down_proj"))
    assert min(cos.values()) > 0.99, cos


def test_deepspeed_wrapper_steps_banks_like_qmuon() -> None:
    """The DeepSpeed wrapper (one process, no engine) applies a bank member's fused parts once:
    gpt-oss (interleaved gate / up, bias banks on AdamW) steps bit for bit like QMuon."""
    qds = pytest.importorskip("qmuon.integrations.deepspeed")
    # fp32 AdamW moments: the DeepSpeed wrapper keeps them (flat ZeRO slices cannot hold row blocks)
    kw = dict(lr=LR, state_format="int8", state={"rounding": "stochastic"}, adamw_state_format="fp32", verbose=False)
    m1, m2 = make_moe("gpt_oss"), make_moe("gpt_oss")
    o1, o2 = qmuon.build_optimizer(m1, **kw), qds.WholeMatrixZeroOptimizer(qmuon.build_optimizer(m2, **kw))
    for step in range(2):
        for m, o in ((m1, o1), (m2, o2)):
            lm_loss(m, tokens(step)).backward()
            o.step()
            o.zero_grad()
    assert_same(dict(m2.named_parameters()), dict(m1.named_parameters()), "params")


# ------------------------------------------------------------------------- sharded (fully_shard)
def _sharded_worker(rank: int, world: int, families: tuple[str, ...]) -> dict[str, Any]:
    """Each rank: the same model twice, one sharded with fully_shard per decoder layer, one whole;
    both get the same gradients and step twice. Returns rank 0's comparison, plus each rank's
    communication figures."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    out: dict[str, Any] = {}
    for family in families:
        for label, fmt in (("fp32", "fp32"), ("int8", "int8")):
            kw = dict(EXACT_KW, state_format=fmt, newton_schulz={**EXACT_KW["newton_schulz"], **BF16_WIRE})
            whole, sharded = make_moe(family), make_moe(family)
            for block in sharded.model.layers:
                fully_shard(block)
            fully_shard(sharded)
            o_whole, o_sharded = qmuon.build_optimizer(whole, **kw), qmuon.build_optimizer(sharded, **kw)
            sp = dict(sharded.named_parameters())
            for step in range(2):
                lm_loss(whole, tokens(step, batch=8)).backward()
                for n, p in whole.named_parameters():
                    if p.grad is not None:
                        sp[n].grad = distribute_tensor(p.grad.detach().clone(), sp[n].device_mesh, sp[n].placements)
                before = {n: p.detach().clone() for n, p in whole.named_parameters()}
                grads = {n: p.grad.detach().clone() for n, p in whole.named_parameters() if p.grad is not None}
                o_whole.step()
                o_sharded.step()
                o_whole.zero_grad()
                o_sharded.zero_grad()
                full = {n: p.full_tensor() for n, p in sp.items()}
                if step == 0 and label == "fp32":
                    out[f"{family}_report"] = expert_report(family, before, full, grads)
            out[f"{family}_{label}_params_equal"] = {n: torch.equal(full[n], p.detach())
                                                     for n, p in whole.named_parameters()}
            out[f"{family}_{label}_state_equal"] = {
                n: all(torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, o_whole.state[p][k])
                       for k, v in o_sharded.state[sp[n]].items())
                for n, p in whole.named_parameters() if p in o_whole.state}
            out[f"{family}_{label}_local"] = o_sharded.comm_stats.get("local_matrices")
    return out


def _bank_only_worker(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """A model of expert banks only, 3 experts on 2 ranks (2 + 1, whole experts), one expert without
    tokens: no Newton-Schulz bytes, no all-to-all, single-process updates bit for bit; DCP saves
    every expert's state and loads it back on every rank."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    class Bank(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.gate_up_proj = torch.nn.Parameter(torch.randn(3, 16, 12) * 0.1)
            self.down_proj = torch.nn.Parameter(torch.randn(3, 12, 8) * 0.1)

    Bank.__name__ = "ToyExperts"  # detected by class name, as transformers' *Experts

    calls = {"all_to_all": 0}
    real = dist.all_to_all_single

    def counting(*a: Any, **k: Any) -> Any:
        calls["all_to_all"] += 1
        return real(*a, **k)

    dist.all_to_all_single = counting
    kw = dict(EXACT_KW, state_format="int8", newton_schulz={**EXACT_KW["newton_schulz"], **BF16_WIRE})
    whole, sharded = Bank(), Bank()
    fully_shard(sharded)
    o_whole, o_sharded = qmuon.build_optimizer(whole, **kw), qmuon.build_optimizer(sharded, **kw)
    sp = dict(sharded.named_parameters())
    sent = []
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        for n, p in whole.named_parameters():
            p.grad = torch.randn(p.shape, generator=g)
            p.grad[2] = 0.0  # expert 2 (rank 1's only expert): no tokens
            sp[n].grad = distribute_tensor(p.grad.clone(), sp[n].device_mesh, sp[n].placements)
        o_whole.step()
        o_sharded.step()
        sent.append(o_sharded.comm_stats["ns_bytes_sent"])
    res = {"sent": sent, "all_to_all": calls["all_to_all"], "local": o_sharded.comm_stats["local_matrices"],
           "local_rows": {n: p.to_local().shape[0] for n, p in sp.items()},
           "params_equal": all(torch.equal(sp[n].full_tensor(), p.detach()) for n, p in whole.named_parameters()),
           "state_equal": all(torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, o_whole.state[p][k])
                              for n, p in whole.named_parameters() for k, v in o_sharded.state[sp[n]].items())}
    dcp.save({"optim": get_optimizer_state_dict(sharded, o_sharded)}, checkpoint_id=tmp)
    fresh = Bank()
    fully_shard(fresh)
    o_fresh = qmuon.build_optimizer(fresh, **kw)
    sd = {"optim": get_optimizer_state_dict(fresh, o_fresh)}
    dcp.load(sd, checkpoint_id=tmp)
    set_optimizer_state_dict(fresh, o_fresh, sd["optim"])
    fp = dict(fresh.named_parameters())
    res["loaded_equal"] = all(
        torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v,
                    o_whole.state[p][k]) for n, p in whole.named_parameters() for k, v in o_fresh.state[fp[n]].items())
    res["loaded_keys"] = sorted(k for n in fp for k in o_fresh.state[fp[n]])
    return res


@pytest.mark.slow
def test_sharded_expert_banks_are_single_process_bit_for_bit() -> None:
    """FSDP2 Shard(0) over the expert dim, 2 processes: parameters and fp32 / int8 state equal
    single-process QMuon's after 2 steps (attention matrices go through the exchange, experts are
    orthogonalized where they live), and every expert block meets the targets."""
    families = ("qwen3_moe", "gpt_oss", "mixtral")
    res = run_workers(_sharded_worker, 2, timeout=400, families=families)
    for family in families:
        for label in ("fp32", "int8"):
            eq = res[0][f"{family}_{label}_params_equal"]
            assert eq and all(eq.values()), (family, label, [n for n, ok in eq.items() if not ok])
            st = res[0][f"{family}_{label}_state_equal"]
            assert st and all(st.values()), (family, label, [n for n, ok in st.items() if not ok])
            # each rank orthogonalizes its own experts: half of the 3 parts x E experts x layers
            assert [r[f"{family}_{label}_local"] for r in res] == [3 * EXPERTS * LAYERS // 2] * 2
        assert_targets(res[0][f"{family}_report"], f"{family} sharded")


@pytest.mark.slow
def test_expert_parallel_needs_no_newton_schulz_communication(tmp_path: Path) -> None:
    res = run_workers(_bank_only_worker, 2, timeout=200, tmp=str(tmp_path / "ckpt"))
    assert [r["local_rows"]["gate_up_proj"] for r in res] == [2, 1]  # uneven: whole experts, 2 + 1
    for r in res:
        assert r["sent"] == [0.0, 0.0] and r["all_to_all"] == 0, r
        assert r["params_equal"] and r["state_equal"] and r["loaded_equal"], r
        assert "momentum_codes" in r["loaded_keys"]
    assert [r["local"] for r in res] == [2.0 * 3, 1.0 * 3]  # its experts' gate, up and down matrices


# ------------------------------------------------- Trainer and Fabric (qmuon_fsdp): one 2-process launch
TRAINER_MOE = ("qwen3_moe", "gpt_oss")
FABRIC_MOE = ("mixtral",)
#: QMuon's defaults (int8 momentum, int8 carriers for the attention matrices); experts never cross the wire.
STRATEGY_KW = dict(lr=LR, weight_decay=0.0)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worker_trainer(out: Path, family: str) -> dict[str, Any]:
    """Trainer(strategy="qmuon_fsdp"): the first step's per-expert update against torch.optim.Muon
    on the gradient FSDP averaged, the bank groups, and resume from the sharded checkpoint of
    epoch 0 == the uninterrupted run (bit for bit, parameters and optimizer state)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from qmuon_lightning.strategies import QMuonFSDPStrategy

    class Lit(L.LightningModule):
        def __init__(self, seed: int = 0) -> None:
            super().__init__()
            self.model = make_moe(family, seed)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return lm_loss(self.model, batch[0])

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    class FirstStep(L.Callback):
        def __init__(self) -> None:
            self.before: dict = {}
            self.grads: dict = {}
            self.after: dict = {}

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            if trainer.global_step == 0:
                self.before = {n: _full(p.detach()).clone() for n, p in module.model.named_parameters()}
                self.grads = {n: _full(p.grad).clone() for n, p in module.model.named_parameters() if p.grad is not None}

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            if trainer.global_step == 1:
                self.after = {n: _full(p.detach()).clone() for n, p in module.model.named_parameters()}

    def data() -> Any:
        x = torch.cat([tokens(s) for s in range(4)])  # 16 sequences: 2 steps of 4 per rank per epoch
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4, shuffle=False)

    def local(trainer: Any) -> dict[str, Any]:
        m, o = trainer.lightning_module, trainer.optimizers[0]
        names = {id(p): n for n, p in m.named_parameters()}
        loc = lambda t: (t.to_local() if hasattr(t, "to_local") else t).detach().clone()  # noqa: E731
        return {"params": {n: loc(p) for n, p in m.named_parameters()},
                "state": {names[id(p)]: {k: loc(v) for k, v in st.items()} for p, st in o.state.items()}}

    def fit(seed: int, resume: Path | None, callbacks: list) -> Any:
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=QMuonFSDPStrategy(optimizer_kwargs=STRATEGY_KW),
                            max_epochs=2, callbacks=callbacks, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=bool(callbacks), num_sanity_val_steps=0)
        trainer.fit(Lit(seed), data(), ckpt_path=str(resume) if resume else None)
        return trainer

    first = FirstStep()
    ckpt = ModelCheckpoint(dirpath=out / f"trainer_{family}", filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    t1 = fit(0, None, [first, ckpt])
    straight = local(t1)
    banks = sorted(n for g in t1.optimizers[0].param_groups if g.get("use_muon") and g["bank_dims"]
                   for n in g["param_names"])
    t2 = fit(3, out / f"trainer_{family}" / "epoch=0.ckpt", [])
    try:
        assert_same(local(t2), straight, f"{family} resume")
        mismatch: list[str] = []
    except AssertionError as e:
        mismatch = [str(e)]
    return {"report": expert_report(family, first.before, first.after, first.grads), "mismatches": mismatch,
            "banks": banks, "steps": t1.global_step, "n_state": len(straight["state"])}


#: (layer, expert) that gets no tokens in the Fabric gpt-oss run (its router bias is -1e4): on rank 1
SILENT = (0, 3)


def _worker_fabric(out: Path, family: str, silent: bool = False) -> dict[str, Any]:
    """L.Fabric(strategy="qmuon_fsdp"), plain loop, build_optimizer after setup_module: per-expert
    targets on the first step, and fabric.save / fabric.load (sharded) at step 2 == the
    uninterrupted run. ``silent`` (gpt-oss): expert :data:`SILENT` never gets a token; its weights,
    its (zero) state and its rows in the checkpoint are reported."""
    import lightning as L

    from qmuon_lightning.strategies import QMuonFabricStrategy

    def make(seed: int) -> tuple[Any, Any, Any]:
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=QMuonFabricStrategy())
        fabric.launch()
        module = make_moe(family, seed)
        if silent:
            with torch.no_grad():
                module.model.layers[SILENT[0]].mlp.router.bias[SILENT[1]] = -1e4
        model = fabric.setup_module(module)
        opt = fabric.setup_optimizers(qmuon.build_optimizer(model, **STRATEGY_KW, verbose=False))
        return fabric, model, opt

    ckpt = out / f"fabric_{family}"
    run = fabric_resume_scenario(make, lambda m, s, r: lm_loss(m, tokens(s, r)), ckpt)
    first, model2, opt2 = run["first"], run["model"], run["optimizer"]
    res = {"report": expert_report(family, first["before"], first["after"], first["grads"]),
           "mismatches": run["mismatches"], "n_snap": run["n_snap"], "resumed_at": run["resumed_at"]}
    if silent:
        res["silent"] = _silent_expert_facts(ckpt, first["before"], model2, opt2)
    return res


def _silent_expert_facts(ckpt: Path, before: dict[str, torch.Tensor], model: Any, opt: Any) -> dict[str, Any]:
    """The expert without tokens after the resumed run: its weights (unchanged: zero gradient, zero
    momentum, no weight decay), its state on this rank after fabric.load (local rows of the bank:
    present, zero codes on the rank holding it), and which rows of each of its bank's state tensors
    the DCP checkpoint holds (chunks written by every rank)."""
    import torch.distributed.checkpoint as dcp

    layer, e = SILENT
    out: dict[str, Any] = {"unchanged": {}, "local_state": {}, "saved_rows": {}}
    params = dict(model.module.named_parameters())
    for attr in ("gate_up_proj", "down_proj"):
        name = f"model.layers.{layer}.mlp.experts.{attr}"
        p = params[name]
        out["unchanged"][attr] = bool(torch.equal(_full(p.detach())[e], before[name][e]))
        st = opt.state[p]
        local_rows = {k: tuple(v.to_local().shape) for k, v in st.items() if hasattr(v, "to_local")}
        codes = st["momentum_codes"]
        first_row = codes.to_local().shape[0] * torch.distributed.get_rank()  # 2 + 2 experts: even split
        holds = first_row <= e < first_row + codes.to_local().shape[0]
        out["local_state"][attr] = {
            "keys": sorted(st), "local_shapes": local_rows, "holds_silent": holds,
            "silent_codes_zero": bool((codes.to_local()[e - first_row] == 0).all()) if holds else None,
        }
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    for key, md in meta.items():
        if (f"layers.{layer}.mlp.experts." in key and key.startswith("optimizer.") and hasattr(md, "chunks")
                and len(md.size) >= 1):
            rows = sorted({r for c in md.chunks for r in range(c.offsets[0], c.offsets[0] + c.sizes[0])})
            out["saved_rows"][key] = (tuple(md.size), rows)
    return out


def _worker_main(out: Path) -> None:
    import os

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    res: dict[str, Any] = {"rank": rank}
    for family in TRAINER_MOE:
        res[f"trainer_{family}"] = _worker_trainer(out, family)
    for family in FABRIC_MOE:
        res[f"fabric_{family}"] = _worker_fabric(out, family)
    torch.save(res, out / f"rank{rank}.pt")
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()


def _worker2_main(out: Path) -> None:
    """The families the first launch leaves out: Trainer on Mixtral, Fabric on Qwen3-MoE and on gpt-oss
    with an expert that never gets a token."""
    import os

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    res: dict[str, Any] = {"rank": rank, "trainer_mixtral": _worker_trainer(out, "mixtral"),
                           "fabric_qwen3_moe": _worker_fabric(out, "qwen3_moe"),
                           "fabric_gpt_oss": _worker_fabric(out, "gpt_oss", silent=True)}
    torch.save(res, out / f"rank{rank}.pt")
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()


def _launch(out: Path, flag: str, what: str) -> list[dict[str, Any]]:
    """Run this file's ``flag`` worker on 2 processes; each rank's results."""
    from _dist import torchrun_cmd

    run_launcher(torchrun_cmd(2, Path(__file__).resolve(), flag, str(out)), timeout=900,
                 env=subprocess_env(PYTHONWARNINGS="ignore"), what=what)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _assert_trainer_run(run: dict[str, Any], rank: int) -> None:
    assert run["steps"] == 4 and run["mismatches"] == [], f"rank {rank}: {run['mismatches']}"
    assert run["banks"] == sorted(f"model.model.layers.{i}.mlp.experts.{a}" for i in range(LAYERS)
                                  for a in ("gate_up_proj", "down_proj"))


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch(tmp_path_factory.mktemp("moe"), "--worker", "2-process MoE worker (Trainer, Fabric)")


@pytest.mark.slow
@pytest.mark.parametrize("family", TRAINER_MOE)
def test_trainer_qmuon_fsdp_moe_trains_and_resumes(two_process_run: list[dict], family: str) -> None:
    for r, res in enumerate(two_process_run):
        run = res[f"trainer_{family}"]
        _assert_trainer_run(run, r)
        assert_targets(run["report"], f"{family} Trainer rank {r}")


@pytest.mark.slow
@pytest.mark.parametrize("family", FABRIC_MOE)
def test_fabric_qmuon_fsdp_moe_trains_and_resumes(two_process_run: list[dict], family: str) -> None:
    for r, res in enumerate(two_process_run):
        run = res[f"fabric_{family}"]
        assert run["resumed_at"] == 2 and run["n_snap"] > 0
        assert run["mismatches"] == [], f"rank {r}: {run['mismatches']}"
        assert_targets(run["report"], f"{family} Fabric rank {r}")


@pytest.fixture(scope="module")
def second_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch(tmp_path_factory.mktemp("moe2"), "--worker2",
                   "2-process MoE worker (Trainer Mixtral, Fabric Qwen3-MoE / gpt-oss)")


@pytest.mark.slow
def test_trainer_and_fabric_cover_every_moe_family(second_run: list[dict]) -> None:
    """With the first launch: Qwen3-MoE, Mixtral and gpt-oss each train and resume bit-exactly under
    both the Trainer strategy and Fabric (2 processes), every expert block on target."""
    for r, res in enumerate(second_run):
        run = res["trainer_mixtral"]
        _assert_trainer_run(run, r)
        assert_targets(run["report"], f"mixtral Trainer rank {r}")
        for family in ("qwen3_moe", "gpt_oss"):
            run = res[f"fabric_{family}"]
            assert run["resumed_at"] == 2 and run["mismatches"] == [], f"rank {r} {family}: {run['mismatches']}"
            silent = {k for k in run["report"] if family == "gpt_oss" and f"layers.{SILENT[0]}.mlp.experts.{SILENT[1]}." in k}
            assert len(silent) == (3 if family == "gpt_oss" else 0)
            assert_targets({k: v for k, v in run["report"].items() if k not in silent}, f"{family} Fabric rank {r}")


@pytest.mark.slow
def test_expert_without_tokens_under_fabric_keeps_its_state_in_the_checkpoint(second_run: list[dict]) -> None:
    """gpt-oss under Fabric, expert 3 of layer 0 routed no token in any step (rank 1 holds it): its
    weights do not move, every rank resumes with its bank state (rank 1 with the expert's zero
    momentum codes), and the sharded checkpoint holds every expert's rows of every state tensor of
    the bank, written by both ranks."""
    holders = []
    for r, res in enumerate(second_run):
        facts = res["fabric_gpt_oss"]["silent"]
        assert all(facts["unchanged"].values()), (r, facts["unchanged"])
        for attr, st in facts["local_state"].items():
            assert {"momentum_codes", "momentum_absmax", "step"} <= set(st["keys"]), (r, attr, st)
            assert all(shape[0] == EXPERTS // 2 for shape in st["local_shapes"].values()), (r, attr, st)
            if st["holds_silent"]:
                holders.append(r)
                assert st["silent_codes_zero"], (r, attr)
        saved = facts["saved_rows"]
        assert any(k.endswith("gate_up_proj.momentum_codes") for k in saved), sorted(saved)
        for key, (size, rows) in saved.items():
            assert size[0] == EXPERTS and rows == list(range(EXPERTS)), (key, size, rows)
    assert holders == [1, 1], holders  # gate_up_proj and down_proj, both on rank 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker_main(Path(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--worker2":
        _worker2_main(Path(sys.argv[2]))
    else:
        sys.exit(f"usage: {sys.argv[0]} --worker OUT | --worker2 OUT")
