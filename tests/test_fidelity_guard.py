"""The fidelity guard: ``QuantFidelityMonitor(action="promote" | "stop")``.

One layer of a small MLP gets *adversarial* gradients, written over its real gradient after every
backward pass: a slowly drifting rank-8 signal (twice grasp4's factor rank of 4) under a 1 %
Gaussian noise floor. The fp32 momentum of such gradients is nearly rank 8 with a thin floor, so
Newton-Schulz leaves the floor small; grasp4 keeps only the top 4 directions in its factors and
puts the rest in a 4-bit residual whose rounding error sits far above that floor, and Newton-Schulz
lifts it to full size. The drop is measured, not forced: the monitor's own cosine of that layer is
compared with the same layer in a run without the adversary, and the same gradient sequence gives
the same verdict through an independent path (:func:`per_layer_update_cosine`, two QMuon
optimizers side by side).

The 2-process variant runs this file as a script under ``qmuon_fsdp`` (``python
tests/test_fidelity_guard.py fsdp <out>``), like tests/test_callbacks.py.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from _helpers import fsdp_scenario_main
from _dist import run_launcher, subprocess_env
from qmuon import QMuon, build_optimizer
from qmuon_lightning.callbacks import QuantFidelityError, QuantFidelityMonitor, QuantizedStateCheckpoint
from qmuon_lightning.callbacks.summary import TrainSummary
from qmuon.optim.fidelity import per_layer_update_cosine
from qmuon.quant import state as qstate

D = 64
ADV = "net.2.weight"
HEALTHY = ("net.0.weight", "net.4.weight")
EVERY = 8  # measurements at steps 7, 15, 23, ...
STEPS = 24
BATCH = 16


def adversarial_gradients(rows: int, cols: int, steps: int, *, rank: int = 8, noise: float = 0.01,
                          seed: int = 7) -> list[torch.Tensor]:
    """A drifting rank-``rank`` signal plus Gaussian noise of relative size ``noise`` (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    u, v = torch.randn(rows, rank, generator=g), torch.randn(cols, rank, generator=g)
    out = []
    for _ in range(steps):
        u = u + 0.02 * torch.randn(rows, rank, generator=g)
        v = v + 0.02 * torch.randn(cols, rank, generator=g)
        out.append(1e-3 * ((u @ v.T) / math.sqrt(cols * rank) + noise * torch.randn(rows, cols, generator=g)))
    return out


class GuardedMLP(L.LightningModule):
    """Three hidden Linear layers routed to Muon (``net.0/2/4``) and an AdamW head; ``adversarial``
    overwrites ``net.2.weight``'s gradient after every backward (its local rows when sharded)."""

    def __init__(self, state_format: str = "grasp4", adversarial: bool = True, steps: int = 64) -> None:
        super().__init__()
        self.state_format = state_format
        self.net = nn.Sequential(nn.Linear(32, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh())
        self.head = nn.Linear(D, 4)
        self.adv = adversarial_gradients(D, D, steps) if adversarial else None

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.net(x)), y)

    def on_after_backward(self) -> None:
        if self.adv is None:
            return
        p = self.net[2].weight
        g = self.adv[self.global_step].to(p.dtype)
        if hasattr(p.grad, "to_local"):  # FSDP2: this rank's rows
            from qmuon.quant.layout import global_row_offset

            local = p.grad.to_local()
            a = global_row_offset(p)
            local.copy_(g[a: a + local.shape[0]])
        else:
            p.grad.copy_(g)

    def configure_optimizers(self):
        if self.trainer is not None and type(self.trainer.strategy).__name__ == "QMuonFSDPStrategy":
            return torch.optim.AdamW(self.parameters(), lr=3e-3)  # replaced by the strategy
        return build_optimizer(self, state_format=self.state_format, lr=0.02, verbose=False)


def _loader(steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * steps, 32, generator=g)
    y = torch.tanh(2 * x[:, :4]) + 0.1 * torch.randn(BATCH * steps, 4, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def _fit(module, tmp_path, callbacks, steps, *, ckpt_path=None, **kw) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, callbacks=callbacks,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                        default_root_dir=str(tmp_path), num_sanity_val_steps=0, **kw)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*litlogger.*")
        trainer.fit(module, _loader(max(steps, 64)), ckpt_path=ckpt_path)
    return trainer


def _cos(mon: QuantFidelityMonitor, name: str) -> list[float]:
    return [h["cos"][name] for h in mon.history]


# ============================================================================ the gradients themselves
def test_adversarial_gradients_defeat_grasp4_not_int8():
    """Independent of the monitor: two QMuon optimizers on the same gradient sequence
    (per_layer_update_cosine). Measured: grasp4 0.305, int8 0.835, bf16 0.977 (steps 10-39)."""
    grads = adversarial_gradients(D, D, 40)
    res = per_layer_update_cosine([(D, D)], [[g] for g in grads], formats=("grasp4", "int8", "bf16"), skip=10)
    assert res["grasp4"][0] < qstate.guard_threshold("grasp4") - 0.05
    assert res["int8"][0] > qstate.guard_threshold("int8") + 0.05
    assert res["bf16"][0] > 0.95


def test_promotion_chain_is_the_format_layers():
    assert qstate.promotion_chain("grasp4") == ("grasp4", "int8", "bf16")
    assert qstate.promotion_chain("int4") == ("int4", "int8", "bf16")
    assert qstate.promotion_chain("e0m3") == ("e0m3", "int8", "bf16")
    assert qstate.safer_format("bf16") is None and qstate.safer_format("fp32") is None
    # every threshold of a format that can be promoted lies below 1 and the chain ends guarded
    for name in ("grasp4", "int4", "e0m3", "int8", "uint8", "bf16"):
        assert 0.0 < qstate.guard_threshold(name) < 1.0


# ============================================================================ single process
def test_guard_promotes_the_adversarial_layer_only(tmp_path):
    mon = QuantFidelityMonitor(EVERY, window=None, action="promote")
    control = QuantFidelityMonitor(EVERY, window=None, action="log", threshold=-1.0)
    module = GuardedMLP()
    tr = _fit(module, tmp_path, [mon], STEPS)
    _fit(GuardedMLP(adversarial=False), tmp_path, [control], STEPS)
    opt: QMuon = tr.optimizers[0]
    # Measured cosines of the adversarial layer: 0.531, 0.348, 0.274; without the adversary the
    # same layer reads 0.927, 0.829, 0.768 and the healthy layers 0.77-0.99 in both runs.
    adv, ref = _cos(mon, ADV), _cos(control, ADV)
    thr = qstate.guard_threshold("grasp4")
    assert adv[1] < thr and adv[2] < thr  # two consecutive checks below: patience 2
    assert all(a < r - 0.3 for a, r in zip(adv[1:], ref[1:]))  # the adversary, not the model, did it
    for name in HEALTHY:
        assert min(_cos(mon, name)) > thr + 0.2
    assert [(p["param"], p["from"], p["to"], p["step"]) for p in mon.promotions] == [(ADV, "grasp4", "int8", 23)]
    assert opt.param_layout(module.net[2].weight)["state_format"] == "int8"
    for name, mod in (("net.0.weight", module.net[0]), ("net.4.weight", module.net[4])):
        assert opt.param_layout(mod.weight)["state_format"] == "grasp4", name
    st = opt.state[module.net[2].weight]
    assert qstate.detect_state_format(st) == "int8"


def test_promotion_survives_resume(tmp_path):
    """Save after the promotion, then a new module / trainer / optimizer resumes: the layer is
    still int8 (no layout mismatch from the manifest check), training continues, and the summary
    lists the promotion."""
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=STEPS, save_top_k=-1)
    mon = QuantFidelityMonitor(EVERY, window=None, action="promote")
    first = GuardedMLP(steps=STEPS + 16)
    tr = _fit(first, tmp_path, [mon, mc, QuantizedStateCheckpoint(dirpath=tmp_path / "q")], STEPS)
    assert [p["param"] for p in mon.promotions] == [ADV]
    saved_state = {k: v.clone() for k, v in tr.optimizers[0].state[first.net[2].weight].items()}
    (ckpt,) = (tmp_path / "ckpt").glob(f"*step={STEPS}.ckpt")

    # The loaded state is the saved int8 state, bit for bit (loading stops before any new step).
    fresh = GuardedMLP(steps=STEPS + 16)
    opt = build_optimizer(fresh, state_format="grasp4", lr=0.02, verbose=False)
    opt.load_state_dict(torch.load(ckpt, weights_only=True)["optimizer_states"][0])
    st = opt.state[fresh.net[2].weight]
    assert qstate.detect_state_format(st) == "int8"
    assert all(torch.equal(st[k], saved_state[k]) for k in saved_state)

    mon2 = QuantFidelityMonitor(EVERY, window=None, action="promote")
    summary = TrainSummary(filename=None)
    second = GuardedMLP(steps=STEPS + 16)
    tr2 = _fit(second, tmp_path, [mon2, summary, QuantizedStateCheckpoint(dirpath=tmp_path / "q", require_manifest=True)],
               STEPS + 16, ckpt_path=str(ckpt))
    opt2 = tr2.optimizers[0]
    assert tr2.global_step == STEPS + 16
    assert opt2.param_layout(second.net[2].weight)["state_format"] == "int8"
    assert qstate.detect_state_format(opt2.state[second.net[2].weight]) == "int8"
    assert opt2.param_layout(second.net[0].weight)["state_format"] == "grasp4"
    assert [p["param"] for p in mon2.promotions] == [ADV]  # restored callback state, no second move
    # After the move the layer is measured in int8 (shadow re-seeded): healthy again.
    assert min(_cos(mon2, ADV)[-2:]) > qstate.guard_threshold("int8")
    promos = summary.summary["promotions"]
    assert promos == [{"param": ADV, "group_format": "grasp4", "state_format": "int8", "step": 23}]
    assert "net.2.weight: grasp4 -> int8 at step 23" in TrainSummary.table(summary.summary)


def test_stop_names_the_layer(tmp_path):
    mon = QuantFidelityMonitor(EVERY, window=None, action="stop")
    with pytest.raises(QuantFidelityError, match=r"'net\.2\.weight' \(grasp4 momentum") as info:
        _fit(GuardedMLP(), tmp_path, [mon], STEPS)
    assert info.value.layers == [ADV]
    assert "action='promote'" in str(info.value)


def test_guard_arguments():
    with pytest.raises(ValueError, match="action must be one of"):
        QuantFidelityMonitor(10, window=5, action="fix")
    with pytest.raises(ValueError, match="patience must be an int >= 1"):
        QuantFidelityMonitor(10, window=5, patience=0)
    with pytest.raises(qstate.StateFormatError, match="unknown state_format 'int3'"):
        QuantFidelityMonitor(10, window=5, threshold={"int3": 0.5})
    mon = QuantFidelityMonitor(10, window=5, threshold={"grasp4": 0.6})
    assert mon.threshold_for("grasp4") == 0.6 and mon.threshold_for("int8") == qstate.guard_threshold("int8")
    assert QuantFidelityMonitor(10, window=5, threshold=0.9).threshold_for("e0m3") == 0.9


def test_promote_param_round_trips_and_ends_at_bf16():
    torch.manual_seed(0)
    p, q = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64, 64))
    opt = QMuon([{"params": [p, q], "param_names": ["p", "q"]}], state_format="grasp4")
    for _ in range(2):
        p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
        opt.step()
    before = qstate.dequantize_momentum(opt.state[q], opts=qstate.format_options(opt.param_layout(q)), cols=64)
    assert opt.promote_param(q) == ("grasp4", "int8")
    after = qstate.dequantize_momentum(opt.state[q], block_size=256)
    # int8 absmax rounding of the converted momentum: at most half a step (absmax / 127) per element.
    assert (after - before).abs().max() <= before.abs().max() / 127 / 2 * (1 + 1e-6)
    assert opt.promote_param(q) == ("int8", "bf16")
    assert opt.promote_param(q) is None  # the end of the chain
    assert opt.promotions() == [{"param": "q", "group_format": "grasp4", "state_format": "bf16"}]
    sd = opt.state_dict()
    p2, q2 = torch.nn.Parameter(p.detach().clone()), torch.nn.Parameter(q.detach().clone())
    opt2 = QMuon([{"params": [p2, q2], "param_names": ["p", "q"]}], state_format="grasp4")
    opt2.load_state_dict(sd)
    assert opt2.param_layout(q2)["state_format"] == "bf16" and opt2.param_layout(p2)["state_format"] == "grasp4"
    for o, (a, b) in ((opt, (p, q)), (opt2, (p2, q2))):
        g = torch.Generator().manual_seed(3)
        a.grad, b.grad = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
        o.step()
    assert torch.equal(p, p2) and torch.equal(q, q2)


def test_promote_param_rejects_a_bad_layout_before_changing_anything():
    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = QMuon([p], state_format="grasp4")
    p.grad = torch.randn_like(p)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    with pytest.raises(ValueError, match="only layout keys"):
        opt.promote_param(p, {"state_format": "int8", "lr": 1.0})
    assert opt.promotions() == [] and all(torch.equal(opt.state[p][k], before[k]) for k in before)


# ============================================================================ 2 processes (qmuon_fsdp)
FSDP_TIMEOUT_S = 420


def _fsdp_fit(out: Path, steps: int, callbacks: list, resume: str | None = None) -> L.Trainer:
    from datetime import timedelta

    from qmuon_lightning.strategies import QMuonFSDPStrategy

    L.seed_everything(0, verbose=False)
    strategy = QMuonFSDPStrategy(optimizer_kwargs={"state_format": "grasp4", "lr": 0.02},
                                 timeout=timedelta(seconds=180))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, callbacks=callbacks,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=True, num_sanity_val_steps=0, default_root_dir=str(out))
    trainer.fit(GuardedMLP(steps=64), _loader(64), ckpt_path=resume)
    return trainer


def _fsdp_scenario(out: Path) -> dict:
    import torch.distributed as dist

    mc = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=STEPS, save_top_k=-1)
    mon = QuantFidelityMonitor(EVERY, window=None, action="promote")
    tr = _fsdp_fit(out, STEPS, [mon, mc])
    opt = tr.optimizers[0]
    module = tr.lightning_module
    res: dict = {"rank": dist.get_rank()}
    res["history"] = mon.history
    res["promotions"] = [(p["param"], p["from"], p["to"], p["step"]) for p in mon.promotions]
    res["formats"] = {n: opt.param_layout(p)["state_format"] for n, p in module.named_parameters() if n.startswith("net.")
                      and n.endswith("weight")}
    res["state_format_of_adv"] = qstate.detect_state_format({k: v.to_local() if hasattr(v, "to_local") else v
                                                             for k, v in opt.state[module.net[2].weight].items()})
    (ckpt,) = (out / "ckpt").glob(f"*step={STEPS}.ckpt")
    res["ckpt_is_dir"] = ckpt.is_dir()
    dist.barrier()
    tr2 = _fsdp_fit(out, STEPS + 8, [QuantizedStateCheckpoint(dirpath=out / "q", require_manifest=False)],
                    resume=str(ckpt))
    opt2, module2 = tr2.optimizers[0], tr2.lightning_module
    res["resumed_step"] = tr2.global_step
    res["resumed_format"] = opt2.param_layout(module2.net[2].weight)["state_format"]
    res["resumed_state_format"] = qstate.detect_state_format(
        {k: v.to_local() if hasattr(v, "to_local") else v for k, v in opt2.state[module2.net[2].weight].items()})
    res["resumed_other"] = opt2.param_layout(module2.net[0].weight)["state_format"]
    return res


@pytest.mark.slow
def test_guard_under_qmuon_fsdp_two_processes(tmp_path):
    """Sharded grasp4 state on 2 ranks: both ranks see the same cosines (all-reduced), promote the
    adversarial layer at the same step, and the promotion survives a DCP checkpoint and resume."""
    import sys

    log = run_launcher([sys.executable, str(Path(__file__).resolve()), "fsdp", str(tmp_path)], timeout=FSDP_TIMEOUT_S,
                       env=subprocess_env(PYTHONWARNINGS="ignore"), cwd=tmp_path, what="guard fsdp scenario")
    results = sorted(tmp_path.glob("guard_rank*.json"))
    if len(results) != 2:
        pytest.fail(f"guard fsdp scenario wrote {len(results)} rank results, expected 2; log tail:\n{log[-8000:]}")
    r0, r1 = (json.loads(p.read_text()) for p in results)
    assert r0["history"] == r1["history"] and len(r0["history"]) == STEPS // EVERY
    for r in (r0, r1):
        assert r["ckpt_is_dir"]
        assert [tuple(p) for p in r["promotions"]] == [(ADV, "grasp4", "int8", 23)], r["promotions"]
        assert r["formats"] == {"net.0.weight": "grasp4", ADV: "int8", "net.4.weight": "grasp4"}
        assert r["state_format_of_adv"] == "int8"
        assert r["resumed_step"] == STEPS + 8
        assert r["resumed_format"] == "int8" and r["resumed_state_format"] == "int8" and r["resumed_other"] == "grasp4"
    adv = [h["cos"][ADV] for h in r0["history"]]
    assert adv[1] < qstate.guard_threshold("grasp4") and adv[2] < qstate.guard_threshold("grasp4")


if __name__ == "__main__":
    fsdp_scenario_main(_fsdp_scenario, "guard")
