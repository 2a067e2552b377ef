"""Non-finite gradients: skipped and counted, never poisoning the quantized state, and stopping the
run past ``max_nonfinite_skips`` consecutive skips of one parameter (single process, Lightning,
and 2 processes under ``qmuon_fsdp`` where only one rank sees the NaN).

The 2-process variant runs this file as a script (``python tests/test_nonfinite.py fsdp <out>``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L

from _helpers import fsdp_scenario_main
from _dist import run_launcher, subprocess_env
from qmuon import NonFiniteGradientError, QMuon, QMuonConfig, build_optimizer
from qmuon_lightning.callbacks.summary import TrainSummary
from qmuon.quant import state as qstate

D = 64


def _opt(fmt="int8", **kw):
    torch.manual_seed(0)
    p, q = torch.nn.Parameter(torch.randn(D, D)), torch.nn.Parameter(torch.randn(D, D))
    return p, q, QMuon([{"params": [p, q], "param_names": ["p", "q"]}], state_format=fmt, **kw)


def _grads(p, q, bad_p=False, bad_q=False):
    p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
    if bad_p:
        p.grad[3, 5] = float("nan")
    if bad_q:
        q.grad[0, 0] = float("inf")


# ============================================================================ single process
@pytest.mark.parametrize("fmt", ["int8", "grasp4", "e0m3"])
def test_nan_gradients_leave_parameter_and_quantized_state_untouched(fmt):
    p, q, opt = _opt(fmt)
    _grads(p, q)
    opt.step()
    before_p = p.detach().clone()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    for _ in range(3):
        _grads(p, q, bad_p=True)
        opt.step()
    assert torch.equal(p, before_p)
    # the step counter advanced in the step (it decides the rounding stream without reading the flag)
    # and is rolled back when the flags are read: by the next step, state_dict() or a counter
    assert opt.state[p]["step"] == before["step"] + 1
    assert opt.nonfinite_skips == 3
    assert all(torch.equal(opt.state[p][k], before[k]) for k in before)  # step counter included
    _grads(p, q)
    opt.step()
    m = qstate.dequantize_momentum(opt.state[p], opts=qstate.format_options(opt.param_groups[0]), cols=D)
    assert torch.isfinite(m).all() and torch.isfinite(p).all() and not torch.equal(p, before_p)
    assert opt.nonfinite_skips == 3 and opt.nonfinite_skipped_steps == 3 and opt.nonfinite_max_consecutive == 3


def test_max_nonfinite_skips_raises_naming_the_parameter_and_changes_nothing():
    """The flags of a step are read by the next one (docs: one step of delay): the step that passes the
    limit still skips ``p`` (untouched) and trains ``q``; the step after it raises before any change."""
    p, q, opt = _opt(safety={"max_nonfinite_skips": 2})
    _grads(p, q)
    opt.step()
    p0 = p.detach().clone()
    for _ in range(3):
        _grads(p, q, bad_p=True)
        opt.step()  # q keeps training; p is skipped three times, the third past the limit (read next step)
    assert torch.equal(p, p0)
    snap_p, snap_q = p.detach().clone(), q.detach().clone()
    state_q = {k: v.clone() for k, v in opt.state[q].items()}
    _grads(p, q)  # even a finite gradient now: the run already stopped on the last step's flags
    with pytest.raises(NonFiniteGradientError, match=r"'p' was non-finite .* for 3 optimizer steps in a row, more "
                                                      r"than max_nonfinite_skips=2") as info:
        opt.step()
    assert info.value.params == ["'p'"] and info.value.streak == 3
    assert "gradient clipping" in str(info.value)  # the fix is named
    assert torch.equal(p, snap_p) and torch.equal(q, snap_q)  # this step changed nothing
    assert all(torch.equal(opt.state[q][k], state_q[k]) for k in state_q)


def test_a_finite_step_resets_the_count_per_parameter():
    p, q, opt = _opt(safety={"max_nonfinite_skips": 2})
    pattern = [(True, False), (True, True), (False, True), (True, False), (True, False), (False, False)]
    for bad_p, bad_q in pattern:  # p: 2 bad, 1 good, 2 bad; q: 2 bad around p's good step
        _grads(p, q, bad_p=bad_p, bad_q=bad_q)
        opt.step()
    assert opt.nonfinite_max_consecutive == 2
    assert opt.nonfinite_skips == 6 and opt.nonfinite_skipped_steps == 5


def test_max_nonfinite_skips_validation():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_nonfinite_skips must be None"):
            QMuonConfig(safety={"max_nonfinite_skips": bad}).validate()
    assert QMuonConfig().safety.max_nonfinite_skips is None  # unlimited by default (docs/fidelity.md says why)
    from qmuon_lightning.strategies import QMuonFSDPStrategy

    with pytest.raises(ValueError, match="optimizer_kwargs: .*max_nonfinite_skips"):
        QMuonFSDPStrategy(optimizer_kwargs={"safety": {"max_nonfinite_skips": 0}})
    assert QMuonFSDPStrategy(optimizer_kwargs={"safety": {"max_nonfinite_skips": 5}}).optimizer_kwargs["safety"]["max_nonfinite_skips"] == 5


# ============================================================================ Lightning
class NaNMLP(L.LightningModule):
    """Two hidden matrices; ``net.2.weight``'s gradient is NaN from step ``bad_from`` on (on global
    rank ``bad_rank`` only, when given: its local rows)."""

    def __init__(self, bad_from: int, bad_until: int | None = None, max_skips: int | None = None,
                 bad_rank: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh())
        self.head = nn.Linear(D, 2)
        self.bad_from, self.bad_until, self.max_skips, self.bad_rank = bad_from, bad_until, max_skips, bad_rank

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.net(x)), y)

    def on_after_backward(self) -> None:
        step = self.global_step
        if step < self.bad_from or (self.bad_until is not None and step >= self.bad_until):
            return
        if self.bad_rank is not None and self.global_rank != self.bad_rank:
            return
        g = self.net[2].weight.grad
        (g.to_local() if hasattr(g, "to_local") else g)[0, 0] = float("nan")

    def configure_optimizers(self):
        if type(self.trainer.strategy).__name__ == "QMuonFSDPStrategy":
            return torch.optim.AdamW(self.parameters(), lr=1e-3)  # replaced by the strategy
        return build_optimizer(self, lr=0.02, verbose=False, safety={"max_nonfinite_skips": self.max_skips})


def _loader(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * n, 16, generator=g)
    return DataLoader(TensorDataset(x, torch.sin(x[:, :2])), batch_size=8)


def _fit(module, tmp_path, steps, callbacks=(), **kw):
    L.seed_everything(0, verbose=False)
    tr = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, callbacks=list(callbacks),
                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                   default_root_dir=str(tmp_path), **kw)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        tr.fit(module, _loader())
    return tr


def test_trainer_stops_past_the_limit(tmp_path):
    module = NaNMLP(bad_from=4, max_skips=3)
    with pytest.raises(NonFiniteGradientError, match=r"'net\.2\.weight' was non-finite .* for 4 optimizer steps"):
        _fit(module, tmp_path, 20)
    # steps 4-7 skipped (and counted as steps); step 7's flags (the 4th skip in a row) are read by step 8,
    # which raises before it changes anything: the documented delay of one step
    assert module.global_step == 8


def test_summary_counts_skips(tmp_path):
    summary = TrainSummary(filename=None)
    _fit(NaNMLP(bad_from=2, bad_until=5), tmp_path, 8, [summary])
    s = summary.summary
    assert (s["nonfinite_skips"], s["nonfinite_skipped_steps"], s["nonfinite_max_consecutive"]) == (3, 3, 3)
    assert "3 parameter updates in 3 steps (longest run of one parameter: 3)" in TrainSummary.table(s)


# ============================================================================ 2 processes (qmuon_fsdp)
def _fsdp_scenario(out: Path) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    from qmuon_lightning.strategies import QMuonFSDPStrategy

    L.seed_everything(0, verbose=False)
    strategy = QMuonFSDPStrategy(optimizer_kwargs={"safety": {"max_nonfinite_skips": 2}}, timeout=timedelta(seconds=120))
    module = NaNMLP(bad_from=3, bad_rank=0)  # only rank 0's rows are NaN
    tr = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=20, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                   num_sanity_val_steps=0, default_root_dir=str(out))
    res: dict = {}
    try:
        tr.fit(module, _loader())
    except NonFiniteGradientError as e:
        res["error"] = str(e)
        res["params"] = e.params
    res["rank"] = dist.get_rank() if dist.is_initialized() else int(tr.global_rank)
    res["global_step"] = tr.global_step
    opt = tr.optimizers[0]
    res["counts"] = [opt.nonfinite_skips, opt.nonfinite_skipped_steps, opt.nonfinite_max_consecutive]
    return res


@pytest.mark.slow
def test_limit_is_consistent_across_ranks_under_qmuon_fsdp(tmp_path):
    import sys

    log = run_launcher([sys.executable, str(Path(__file__).resolve()), "fsdp", str(tmp_path)], timeout=300,
                       env=subprocess_env(PYTHONWARNINGS="ignore"), cwd=tmp_path, what="nonfinite fsdp scenario")
    results = sorted(tmp_path.glob("nonfinite_rank*.json"))
    if len(results) != 2:
        pytest.fail(f"scenario wrote {len(results)} rank results, expected 2; log tail:\n{log[-8000:]}")
    r0, r1 = (json.loads(p.read_text()) for p in results)
    for r in (r0, r1):  # rank 1's rows were finite, yet it skipped and stopped with rank 0
        assert r["params"] == ["'net.2.weight'"], r
        assert "more than max_nonfinite_skips=2" in r["error"]
        # sharded steps read their agreed flags in the step: the third skip in a row (step 5) is counted
        # and raises at once, before the step changes anything (no one-step delay here)
        assert r["global_step"] == 5 and r["counts"] == [3, 3, 3]


if __name__ == "__main__":
    fsdp_scenario_main(_fsdp_scenario, "nonfinite")
