"""QMuon's parameter groups under Lightning's own callbacks: ``BackboneFinetuning`` unfreezes a
backbone into the optimizer mid-training (``add_param_group``, routed like ``build_optimizer``:
the matrices train with Muon), and ``LearningRateMonitor`` logs each group under its ``name``.

Plain ``Trainer`` runs happen in this process (CPU, a few steps). The ``qmuon_fsdp`` run (FSDP2
with one CPU process) happens in a subprocess: Lightning initializes a process group for it, which
must not outlive the test (this file is that worker: ``python tests/test_lightning_groups.py
fsdp OUT``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lightning as L
from lightning.pytorch.callbacks import BackboneFinetuning, LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qmuon_lightning  # noqa: E402,F401  (registers the strategies)
from _dist import subprocess_env  # noqa: E402
from qmuon import QMuon, build_optimizer  # noqa: E402

LR, ADAMW_LR = 0.02, 3e-3


class Finetune(L.LightningModule):
    """A backbone (hidden matrices, biases, a norm) and a classifier head; ``BackboneFinetuning``
    freezes the backbone before ``configure_optimizers``, so the optimizer starts with the head
    alone (AdamW: an output head)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32))
        self.head = nn.Linear(32, 4)
        self.initial = {n: p.detach().clone() for n, p in self.named_parameters()}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> Any:
        return build_optimizer(self, lr=LR, adamw_lr=ADAMW_LR, verbose=False)


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(12, 8, generator=g), torch.randn(12, 4, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=4)


def fit(tmp: Path, strategy: Any = "auto") -> tuple[L.Trainer, Finetune, LearningRateMonitor]:
    module = Finetune()
    monitor = LearningRateMonitor(logging_interval="step")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=3, logger=CSVLogger(tmp),
        callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1), monitor], log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(module, data())
    return trainer, module, monitor


def report(trainer: L.Trainer, module: Finetune, monitor: LearningRateMonitor) -> dict[str, Any]:
    """What the tests check, as plain values (also what the FSDP worker writes)."""
    opt = trainer.optimizers[0]
    local = (lambda t: t.to_local() if hasattr(t, "to_local") else t)
    return {
        "type": type(opt).__name__,
        "sharded": hasattr(module.backbone[0].weight, "to_local"),  # an FSDP2 DTensor
        "groups": [{"name": g["name"], "use_muon": g["use_muon"], "param_names": g["param_names"],
                    "lr": float(g["lr"]), "lr_follows": g.get("lr_follows")} for g in opt.param_groups],
        "state_keys": {n: sorted(opt.state[p]) for n, p in module.named_parameters() if opt.state.get(p)},
        "moved": sorted(n for n, p in module.named_parameters()
                        if not torch.equal(local(p.detach()).cpu(), local(module.initial[n]).cpu())),
        "monitor": sorted(monitor.lrs),
        "logged_muon": [float(v) for v in monitor.lrs.get("lr-QMuon/muon", [])],
    }


def check(r: dict[str, Any]) -> None:
    assert r["type"] == "QMuon"
    groups = {g["name"]: g for g in r["groups"]}
    assert [g["name"] for g in r["groups"]] == ["adamw", "adamw_no_decay", "muon", "adamw_no_decay_2"]
    muon, lead = groups["muon"], groups["adamw_no_decay_2"]
    assert muon["use_muon"] and muon["param_names"] == ["backbone.0.weight", "backbone.2.weight"]
    assert lead["param_names"] == ["backbone.0.bias", "backbone.2.bias", "backbone.3.weight", "backbone.3.bias"]
    for name in muon["param_names"]:  # trained with Muon: quantized momentum, not AdamW moments
        assert {"momentum_codes", "momentum_absmax", "step"} <= set(r["state_keys"][name]), name
    assert "exp_avg" in r["state_keys"]["backbone.0.bias"]
    assert {"backbone.0.weight", "backbone.2.weight", "head.weight"} <= set(r["moved"])
    # Epoch 1: BackboneFinetuning gives param_groups[0]["lr"] * 0.1 (head lr, AdamW units): the
    # biases take it, the matrices its Muon equivalent (x 0.02 / 3e-3). Epoch 2: it writes 2x (its default multiplicative lambda)
    # into param_groups[-1], the leader; the Muon group follows.
    assert lead["lr"] == pytest.approx(ADAMW_LR * 0.1 * 2) and muon["lr_follows"] == "adamw_no_decay_2"
    assert muon["lr"] == pytest.approx(LR * 0.1 * 2)
    assert {"lr-QMuon/adamw", "lr-QMuon/adamw_no_decay", "lr-QMuon/muon", "lr-QMuon/adamw_no_decay_2"} <= set(
        r["monitor"])
    assert not any("/pg" in k for k in r["monitor"])
    assert r["logged_muon"][0] == pytest.approx(LR * 0.1) and r["logged_muon"][-1] == pytest.approx(LR * 0.1 * 2)


def test_backbone_finetuning_unfreezes_into_muon_and_the_monitor_logs_group_names(tmp_path: Path) -> None:
    trainer, module, monitor = fit(tmp_path)
    assert isinstance(trainer.optimizers[0], QMuon)
    r = report(trainer, module, monitor)
    assert not r["sharded"]
    check(r)


def test_backbone_finetuning_under_qmuon_fsdp(tmp_path: Path) -> None:
    """The same run under ``strategy="qmuon_fsdp"`` (FSDP2, one CPU process, gloo): the unfrozen
    sharded matrices are routed to Muon and train with its sharded step."""
    out = tmp_path / "fsdp.json"
    proc = subprocess.run([sys.executable, __file__, "fsdp", str(out)], env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["sharded"]
    check(r)


def test_qmuon_fsdp_without_a_logger_logs_nothing_and_warns_nothing(tmp_path: Path) -> None:
    """``qmuon_fsdp`` logs ``qmuon/comm_bytes`` only where a logger records it: without one, Lightning
    would warn about ``logger=True`` for a metric the user never asked for."""
    out = tmp_path / "nologger.json"
    proc = subprocess.run([sys.executable, __file__, "nologger", str(out)], env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["steps"] == 2 and not r["logger_warnings"], r


def _worker(scenario: str, out: str) -> None:
    import warnings
    from datetime import timedelta

    from qmuon_lightning.strategies import QMuonFSDPStrategy

    strategy = QMuonFSDPStrategy(timeout=timedelta(seconds=120))
    if scenario == "fsdp":
        trainer, module, monitor = fit(Path(out).parent, strategy)
        Path(out).write_text(json.dumps(report(trainer, module, monitor)))
        return
    assert scenario == "nologger"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        trainer.fit(Finetune(), data())
    texts = [str(w.message) for w in caught]
    Path(out).write_text(json.dumps({"steps": trainer.global_step,
                                     "logger_warnings": [t for t in texts if "logger=True" in t or "comm_bytes" in t]}))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
