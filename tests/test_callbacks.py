"""Lightning callbacks: QuantizedStateCheckpoint, OptimizerStepProfiler, QuantFidelityMonitor.

Tiny Lightning runs on CPU (a 1-layer byte-level DecoderLM, d_model 32, a few steps), so the whole
file stays fast on a busy 2-core machine.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from _helpers import fsdp_scenario_main
from _dist import run_launcher, subprocess_env
from qmuon import QMuon, build_optimizer
from qmuon_lightning.callbacks import (
    OptimizerStepProfiler,
    QuantFidelityMonitor,
    QuantizedStateCheckpoint,
    QuantizedStateMismatchError,
    UpdateFidelityTracker,
    load_quantized_state,
)
from qmuon_lightning.callbacks import checkpoint as ckpt_mod
from qmuon_lightning.callbacks.checkpoint import MANIFEST_KEY, build_manifest, standalone_files, validate_manifest
from qmuon_lightning.data.bytes_corpus import RandomWindowDataset
from qmuon_lightning.models import DecoderLM
from qmuon.quant import state as qstate
from qmuon.optim.fidelity import per_layer_update_cosine
from qmuon.quant.fidelity import synthetic_gradients

SEQ = 16
BATCH = 4
# The bytes of this file are the corpus: deterministic, no download, no stdlib scan.
DATA = torch.frombuffer(bytearray(Path(__file__).read_bytes()), dtype=torch.uint8)


class TinyLM(L.LightningModule):
    """A byte-level DecoderLM trained with ``build_optimizer`` (Muon lr 0.02, AdamW lr 3e-3, weight
    decay 0.01) and a linear warmup, then flat, then a linear decay to 10% over the last 40%."""

    def __init__(self, *, state_format: str = "int8", max_steps: int = 8, warmup_steps: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = DecoderLM(vocab_size=256, d_model=32, n_layers=1, n_heads=2, max_seq_len=SEQ)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x).reshape(-1, 256), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        hp = self.hparams
        opt = build_optimizer(self, state_format=hp.state_format, lr=0.02, weight_decay=0.01, adamw_lr=3e-3,
                              adamw_weight_decay=0.01, state={"seed": 0}, verbose=False)
        warmup, total = hp.warmup_steps, max(1, hp.max_steps)
        cooldown = int(0.6 * total)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 1.0 if step < cooldown else 1.0 - 0.9 * (step - cooldown) / max(1, total - cooldown)

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _module(state_format: str = "int8", steps: int = 8) -> TinyLM:
    L.seed_everything(0, verbose=False)
    return TinyLM(state_format=state_format, max_steps=steps)


def _loader(steps: int) -> DataLoader:
    ds = RandomWindowDataset(DATA, SEQ, steps * BATCH, seed=0)
    return DataLoader(ds, batch_size=BATCH, shuffle=False)


def _fit(module, tmp_path, callbacks, steps, *, ckpt_path=None, logger=False, checkpointing=None, **kw):
    cbs = list(callbacks)
    enable_ckpt = any(isinstance(c, ModelCheckpoint) for c in cbs) if checkpointing is None else checkpointing
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1, logger=logger, callbacks=cbs,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=enable_ckpt,
        default_root_dir=str(tmp_path), num_sanity_val_steps=0, **kw,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*litlogger.*")
        trainer.fit(module, _loader(steps), ckpt_path=ckpt_path)
    return trainer


def _metrics(logger: CSVLogger) -> list[dict[str, str]]:
    logger.save()
    with open(os.path.join(logger.log_dir, "metrics.csv"), newline="") as f:
        return list(csv.DictReader(f))


# ============================================================================ QuantizedStateCheckpoint
def test_manifest_standalone_keep_last_k_and_resume(tmp_path):
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    qc = QuantizedStateCheckpoint(keep_last_k=2)
    _fit(_module(), tmp_path, [mc, qc], steps=4)

    last = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    ck = torch.load(last, weights_only=False)
    man = ck[MANIFEST_KEY]
    assert man["state_layout_version"] >= 1 and man["package_version"] and man["world_size"] == 1
    groups = man["optimizers"][0]["groups"]
    muon = [g for g in groups if g["use_muon"]]
    assert {g["state_format"] for g in muon} == {"int8"} and {g["block_size"] for g in muon} == {256}
    names = {p["name"] for g in muon for p in g["params"]}
    assert "model.blocks.0.attn.qkv.weight" in names
    qkv_group = next(g for g in muon if any(p["name"].endswith("qkv.weight") for p in g["params"]))
    assert qkv_group["parts"] == [32, 32, 32]

    # One standalone file per save, the newest keep_last_k=2 kept, each loadable with weights_only.
    files = standalone_files(tmp_path / "ckpt" / "qmuon_state")
    assert [os.path.basename(f) for f in files] == ["qmuon-state-step=3.pt", "qmuon-state-step=4.pt"]
    blob = torch.load(files[-1], weights_only=True)
    assert blob["manifest"]["global_step"] == 4
    saved = blob["optimizer_states"][0]["state"]
    assert any("momentum_codes" in st for st in saved.values())

    # Resuming with the same optimizer passes validation and trains on.
    tr = _fit(_module(), tmp_path, [QuantizedStateCheckpoint(save_standalone=False)], steps=6, ckpt_path=str(last))
    assert tr.global_step == 6


def test_resume_with_other_format_names_the_mismatch(tmp_path):
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    _fit(_module("int8"), tmp_path, [mc, QuantizedStateCheckpoint()], steps=2)
    last = str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt")

    seen = {}

    class Spy(L.Callback):  # records whether Lightning had loaded optimizer state when the error came
        def on_fit_start(self, trainer, pl_module):
            seen["state_before"] = len(trainer.optimizers[0].state)

    with pytest.raises(QuantizedStateMismatchError) as e:
        _fit(_module("grasp4"), tmp_path, [Spy(), QuantizedStateCheckpoint()], steps=4, ckpt_path=last)
    msg = str(e.value)
    assert "state_format='int8', block_size=256" in msg and "state_format='grasp4', rank=4, grid_block=32" in msg
    assert "allow_format_change=True" in msg and last in msg
    assert seen["state_before"] == 0  # raised before the optimizer state was restored

    # Opting in converts the momentum instead (QMuon.load_state_dict dequantizes and re-encodes).
    tr = _fit(_module("grasp4"), tmp_path, [QuantizedStateCheckpoint(allow_format_change=True)], steps=3,
              ckpt_path=last)
    states = tr.optimizers[0].state.values()
    assert any("grasp_p_codes" in st for st in states)
    assert not any("momentum_codes" in st for st in states)


def _toy_optimizer(state_format="int8", block_size=None, rows=64):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(rows, 64)), torch.nn.Parameter(torch.randn(64, 64))]
    opt = QMuon([{"params": ps, "param_names": ["a.weight", "b.weight"]}], lr=0.02, state_format=state_format, state={"block_size": block_size})
    return ps, opt


def test_validate_manifest_errors_name_the_problem():
    _, saved = _toy_optimizer("int8", 256)
    man = build_manifest([(0, saved)])
    _, cur = _toy_optimizer("int8", 128)
    with pytest.raises(QuantizedStateMismatchError, match=r"saved with block_size=256 but this optimizer uses "
                                                          r"block_size=128; construct the optimizer with block_size=256"):
        validate_manifest(man, [(0, cur)])
    _, other_shape = _toy_optimizer("int8", 256, rows=32)
    with pytest.raises(QuantizedStateMismatchError, match=r"'a.weight' was \(64, 64\) when saved but 'a.weight' is "
                                                          r"\(32, 64\) now"):
        validate_manifest(man, [(0, other_shape)])
    newer = dict(man, state_layout_version=man["state_layout_version"] + 1)
    with pytest.raises(QuantizedStateMismatchError, match="upgrade qmuon_lightning"):
        validate_manifest(newer, [(0, saved)])
    with pytest.raises(QuantizedStateMismatchError, match=r"trainer.optimizers\[1\] is not a QMuon"):
        validate_manifest(dict(man, optimizers=[dict(man["optimizers"][0], index=1)]), [])
    # Format conversion is a note when allowed; rounding or package version never block.
    _, grasp = _toy_optimizer("grasp4")
    notes = validate_manifest(man, [(0, grasp)], allow_format_change=True)
    assert any("converts the momentum" in n for n in notes)


def test_atomic_write_crash_keeps_previous_file(tmp_path, monkeypatch):
    qc = QuantizedStateCheckpoint(dirpath=tmp_path / "q", keep_last_k=2)
    trainer = _fit(_module(), tmp_path, [qc], steps=2, checkpointing=False)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    good = tmp_path / "q" / "qmuon-state-step=2.pt"
    assert good.exists()
    good_bytes = good.read_bytes()

    def crash(obj, f):  # a partial write, then the "crash"
        f.write(b"PARTIAL" * 100)
        raise OSError("simulated crash mid-save")

    monkeypatch.setattr(ckpt_mod, "_serialize", crash)
    with pytest.raises(OSError, match="simulated crash"):
        trainer.save_checkpoint(tmp_path / "b.ckpt")  # same step: would replace the good file
    monkeypatch.undo()
    assert good.read_bytes() == good_bytes
    assert sorted(os.listdir(tmp_path / "q")) == ["qmuon-state-step=2.pt"]  # temporary file removed

    # A temporary file left by a killed process is never taken for a complete file, and the next
    # successful save removes it.
    (tmp_path / "q" / ".qmuon-state-abc.tmp").write_bytes(b"junk")
    assert standalone_files(tmp_path / "q") == [str(good)]
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    assert sorted(os.listdir(tmp_path / "q")) == ["qmuon-state-step=2.pt"]

    # The previous file is whole: it validates and loads into a freshly built optimizer.
    fresh = _module()
    opt = build_optimizer(fresh, state_format="int8", lr=0.02, verbose=False)  # TinyLM's routing
    load_quantized_state(good, [(0, opt)], fresh)
    want = trainer.optimizers[0].state_dict()["state"]
    got = opt.state_dict()["state"]
    assert want.keys() == got.keys()
    for pid in want:
        for k, v in want[pid].items():
            assert torch.equal(v, got[pid][k]), (pid, k)


def test_fp32_export_loads_into_torch_muon(tmp_path):
    qc = QuantizedStateCheckpoint(save_standalone=False)
    trainer = _fit(_module("int8"), tmp_path, [qc], steps=3, checkpointing=False)
    path = tmp_path / "fp32.pt"
    qc.export_fp32_momentum(path)
    blob = torch.load(path, weights_only=True)
    opt = trainer.optimizers[0]
    named = dict(trainer.lightning_module.named_parameters())
    # The exported momentum is exactly the dequantized int8 state.
    for group in opt.param_groups:
        if group["use_muon"]:
            for p, name in zip(group["params"], group["param_names"]):
                m = qstate.dequantize_momentum(opt.state[p], opts=qstate.format_options(group))
                assert torch.equal(blob["momentum"][name], m.reshape(p.shape)), name
    # Build torch.optim.Muon with the same groups, in the exported order, and load.
    groups, order = [], iter(blob["param_names"])
    for g in blob["torch_muon"]["param_groups"]:
        groups.append({"params": [named[next(order)] for _ in g["params"]]})
    muon = torch.optim.Muon(groups, lr=0.02)
    muon.load_state_dict(blob["torch_muon"])
    for gi, g in enumerate(muon.param_groups):
        for p, i in zip(g["params"], blob["torch_muon"]["param_groups"][gi]["params"]):
            assert torch.equal(muon.state[p]["momentum_buffer"], blob["torch_muon"]["state"][i]["momentum_buffer"])
    for p in named.values():
        p.grad = torch.randn_like(p) * 1e-3
    muon.step()  # continues from the migrated momentum


# ============================================================================ OptimizerStepProfiler
def test_profiler_writes_trace_table_memory_and_logs_step_time(tmp_path):
    logger = CSVLogger(tmp_path, name="log")
    prof = OptimizerStepProfiler(steps=(1, 3))
    trainer = _fit(_module(), tmp_path, [prof], steps=5, logger=logger, log_every_n_steps=50)
    out = os.path.join(logger.log_dir, "optimizer_profiles")
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "*.trace.json"))) == [
        "optimizer_step_000001.trace.json", "optimizer_step_000003.trace.json"]
    with open(os.path.join(out, "optimizer_step_000003.trace.json")) as f:
        names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
    assert any(n.startswith("qmuon::") for n in names)
    assert "aten::bmm" in names  # Newton-Schulz
    # Only the update: no forward (embedding lookup) and no backward in the window.
    assert not any("embedding" in n or "autograd::engine" in n or "Backward" in n for n in names)
    table = Path(out, "optimizer_step_000003.txt").read_text()
    assert "qmuon::q8_momentum_update_multi_" in table and "Self CPU" in table and "peak allocated" in table
    assert len(prof.records) == 2 and all(r["optimizer_step_ms"] > 0 for r in prof.records)
    assert all(r["peak_alloc_bytes"].get("cpu", 0) > 0 for r in prof.records)  # NS scratch is allocated
    lines = Path(out, "optimizer_steps.jsonl").read_text().splitlines()
    assert [json.loads(s)["step"] for s in lines] == [1, 3]
    # Logged to the Trainer's logger at the profiled steps, despite log_every_n_steps=50.
    rows = [r for r in _metrics(logger) if r.get("optimizer_step_ms")]
    assert len(rows) == 2 and all(float(r["optimizer_step_ms"]) > 0 for r in rows)
    assert not trainer.optimizers[0]._optimizer_step_post_hooks  # the window's hook was removed


def test_profiler_inactive_steps_build_no_profiler(tmp_path, monkeypatch):
    built = []
    real = torch.profiler.profile

    def counting(*a, **k):
        built.append(1)
        return real(*a, **k)

    monkeypatch.setattr(torch.profiler, "profile", counting)
    hooks_seen = []

    class HookSpy(L.Callback):  # after the profiler's hook: is a post-hook registered on this step?
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            hooks_seen.append(len(optimizer._optimizer_step_post_hooks))

    prof = OptimizerStepProfiler(start=2, active=2, dirpath=tmp_path / "p")
    _fit(_module(), tmp_path, [prof, HookSpy()], steps=6)
    assert len(built) == 2 and [r["step"] for r in prof.records] == [2, 3]
    assert hooks_seen == [0, 0, 1, 1, 0, 0]

    built.clear()
    never = OptimizerStepProfiler(steps=(1000,), dirpath=tmp_path / "never")
    _fit(_module(), tmp_path, [never], steps=3)
    assert built == [] and not (tmp_path / "never").exists()


def test_profiler_schedule():
    p = OptimizerStepProfiler(start=5, active=2, every=10, repeat=3)
    assert [s for s in range(60) if p.is_scheduled(s)] == [5, 6, 15, 16, 25, 26]
    forever = OptimizerStepProfiler(start=0, active=1, every=4, repeat=0)
    assert [s for s in range(13) if forever.is_scheduled(s)] == [0, 4, 8, 12]
    with pytest.raises(ValueError, match="needs every="):
        OptimizerStepProfiler(repeat=2)
    with pytest.raises(ValueError, match="windows would overlap"):
        OptimizerStepProfiler(active=3, every=2)


# ============================================================================ QuantFidelityMonitor
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_tracker_reproduces_per_layer_update_cosine(fmt):
    """With a shadow started at step 0 the monitor's cosine is the fidelity module's metric."""
    shapes, steps = [(48, 64), (64, 40)], 5
    seqs = [synthetic_gradients(r, c, steps, seed=i) for i, (r, c) in enumerate(shapes)]
    grads = [[s[t] for s in seqs] for t in range(steps)]
    want = per_layer_update_cosine(shapes, grads, (fmt,), reduce="last")[fmt]
    ps = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = QMuon(ps, lr=1.0, weight_decay=0.0, state_format=fmt)
    tracker = UpdateFidelityTracker(opt)
    tracker.start()
    for t in range(steps):
        for p, g in zip(ps, grads[t]):
            p.grad = g.clone()
        got = tracker.observe(measure=t == steps - 1)
        opt.step()
    # Same ops on the same inputs; the only difference is batched vs single-matrix bf16
    # Newton-Schulz, measured at 1e-9 here.
    assert list(got.values()) == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("fmt,ns_input", [("int8", "bf16"), ("grasp4", "bf16"), ("int8", "mxfp8")])
def test_tracker_quantized_update_is_the_optimizer_update(fmt, ns_input):
    """The monitor's quantized-path update is what QMuon then applies (lr=1, no weight decay),
    fused parts and the MXFP8 Newton-Schulz carrier included."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(96, 32))
    q = torch.nn.Parameter(torch.zeros(32, 64))
    opt = QMuon([{"params": [p], "parts": (32, 32, 32)}, {"params": [q]}], lr=1.0, weight_decay=0.0, state_format=fmt, newton_schulz={"input": ns_input})
    tracker = UpdateFidelityTracker(opt, keep_updates=True)
    for t in range(3):
        for x in (p, q):
            x.grad = torch.randn_like(x) * 1e-3
        tracker.observe(measure=t == 2)
        before = [p.detach().clone(), q.detach().clone()]
        opt.step()
    for name, x, b in zip(("group0.param0", "group1.param0"), (p, q), before):
        u_q, _ = tracker.last_updates[name]
        # Measured identical (max |diff| 0). The tolerance is a few fp32 ulps of |p| <= 1.4 (1.2e-7
        # each), for the rounding of p - u that the parameter change goes through.
        torch.testing.assert_close(b - x.detach(), u_q, rtol=0, atol=1e-6)


def _monitor_run(tmp_path, fmt, **kw):
    mon = QuantFidelityMonitor(6, window=5, **kw)
    logger = CSVLogger(tmp_path, name=f"fid_{fmt}")
    _fit(_module(fmt), tmp_path, [mon], steps=12, logger=logger, log_every_n_steps=50)
    return mon, logger


def test_fidelity_monitor_int8_near_one_int4_lower(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m8, logger = _monitor_run(tmp_path, "int8", threshold=0.0)
        m4, _ = _monitor_run(tmp_path, "int4", threshold=0.0)
    assert [h["step"] for h in m8.history] == [5, 11]
    c8 = [v for h in m8.history for v in h["cos"].values()]
    c4 = [v for h in m4.history for v in h["cos"].values()]
    assert len(c8) == 2 * 4  # 4 Muon matrices (qkv, proj, gate_up, down), 2 measurements
    # Bounds from this run's measured values (int8 layers 0.979-1.000, mean 0.992; int4 layers
    # 0.545-0.944, mean 0.76) with margin: this tiny model's 32-wide rows favour int4 compared with
    # the wider models of docs/callbacks.md.
    assert min(c8) > 0.9 and sum(c8) / len(c8) > 0.97
    assert min(c4) < 0.8 and sum(c4) / len(c4) < sum(c8) / len(c8) - 0.1
    assert all(a > b for a, b in zip(c8, c4))  # every layer, every measurement
    rows = [r for r in _metrics(logger) if r.get("fidelity/cos_min")]
    assert len(rows) == 2 and rows[0]["fidelity/cos/model.blocks.0.attn.qkv.weight"]


def test_fidelity_monitor_warns_below_threshold_once_per_layer(tmp_path):
    with pytest.warns(UserWarning, match="below the threshold 0.99999") as rec:
        mon, _ = _monitor_run(tmp_path, "int8", threshold=0.99999)
    ours = [w for w in rec if "QuantFidelityMonitor" in str(w.message)]
    assert len(ours) == 4  # once per layer, although every layer is below it at both measurements
    assert "'model.blocks.0.mlp.down.weight' (int8 momentum)" in " ".join(str(w.message) for w in ours)


def test_fidelity_monitor_does_not_disturb_training(tmp_path):
    """Same seed with and without the monitor (shadow kept every step): identical weights,
    optimizer state and RNG state afterwards."""
    def run(callbacks):
        module = _module("int8", steps=5)
        tr = _fit(module, tmp_path, callbacks, steps=5)
        return module, tr.optimizers[0], torch.get_rng_state()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, oa, rng_a = run([])
        mon = QuantFidelityMonitor(3, window=None, threshold=0.0)
        b, ob, rng_b = run([mon])
    assert len(mon.history) == 1
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    for pid in sa:
        for k in sa[pid]:
            assert torch.equal(sa[pid][k], sb[pid][k]), (pid, k)
    assert torch.equal(rng_a, rng_b)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_fidelity_monitor_sees_clipped_gradients(algorithm):
    """Lightning clips right after on_before_optimizer_step; the monitor applies the same clipping
    to its copies (compared with torch.nn.utils.clip_grad_*_ on clones)."""
    from types import SimpleNamespace

    from qmuon_lightning.callbacks.fidelity import _clip_transform

    ps, opt = _toy_optimizer()
    for p in ps:
        p.grad = torch.randn_like(p)
    ref = [p.grad.clone() for p in ps]
    clip = 0.5 if algorithm == "norm" else 0.1
    holders = [torch.nn.Parameter(torch.zeros_like(g)) for g in ref]
    for h, g in zip(holders, ref):
        h.grad = g.clone()
    if algorithm == "norm":
        torch.nn.utils.clip_grad_norm_(holders, clip)
    else:
        torch.nn.utils.clip_grad_value_(holders, clip)
    fn = _clip_transform(SimpleNamespace(gradient_clip_val=clip, gradient_clip_algorithm=algorithm), opt)
    for p, h in zip(ps, holders):
        torch.testing.assert_close(fn(p.grad), h.grad, rtol=1e-6, atol=0)  # fp32 rounding of the product
    assert all(torch.equal(p.grad, g) for p, g in zip(ps, ref))  # the real gradients are untouched


def test_fidelity_monitor_arguments():
    with pytest.raises(ValueError, match="window=0 would compare a state with itself"):
        QuantFidelityMonitor(10, window=0)
    with pytest.raises(ValueError, match=r"\[1, 10\)"):
        QuantFidelityMonitor(10, window=10)
    mon = QuantFidelityMonitor(10, window=3)
    assert [s for s in range(25) if mon._in_window(s)] == [6, 7, 8, 9, 16, 17, 18, 19]
    assert [s for s in range(25) if mon.steps_to_measurement(s) == 0] == [9, 19]


# ============================================================================ under qmuon_fsdp (2 processes)
# The test runs this file as a script (``python tests/test_callbacks.py fsdp <out>``); Lightning's
# Trainer(devices=2) starts rank 1 by re-running the same command. Each rank writes a JSON file of
# what it saw. A hung collective fails through the process-group and subprocess timeouts.
FSDP_TIMEOUT_S = 300


class _FsdpLM(L.LightningModule):
    """A 1-block DecoderLM returning plain AdamW: the qmuon_fsdp strategy shards it and swaps in QMuon."""

    def __init__(self) -> None:
        super().__init__()
        from qmuon_lightning.models import DecoderLM

        self.model = DecoderLM(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=SEQ, mlp_hidden=64)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.model.loss(x, y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def _fsdp_fit(out: Path, steps: int, callbacks: list, resume: str | None = None) -> L.Trainer:
    from datetime import timedelta

    from qmuon_lightning.strategies import QMuonFSDPStrategy

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, 64, (4 * steps, SEQ + 1), generator=g)
    data = DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=QMuonFSDPStrategy(timeout=timedelta(seconds=120)), max_steps=steps,
        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=True, num_sanity_val_steps=0, default_root_dir=str(out),
    )
    trainer.fit(_FsdpLM(), data, ckpt_path=resume)
    return trainer


def _fsdp_scenario(out: Path) -> dict:
    import torch.distributed as dist

    from qmuon.distributed.checkpoint import full_state_dict

    mc = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=-1)
    qc = QuantizedStateCheckpoint(dirpath=out / "q")
    prof = OptimizerStepProfiler(steps=(1,), dirpath=out / "prof")
    mon = QuantFidelityMonitor(2, window=1)
    tr = _fsdp_fit(out, 2, [mc, qc, prof, mon])
    opt = tr.optimizers[0]
    res: dict = {"rank": dist.get_rank(), "optimizer": type(opt).__name__}
    res["profiled"] = [(r["step"], os.path.basename(r["trace"]), r["qmuon_ops"]) for r in prof.records]
    res["monitor_trackers"] = len(mon._trackers)
    res["monitor_history"] = mon.history  # sharded: measured, cosines all-reduced (the same on every rank)
    blob = qc.export_fp32_momentum(out / "fp32.pt")  # collective: every rank
    full = full_state_dict(opt)  # collective
    exact = True
    for group, saved in zip(opt.param_groups, full["param_groups"]):
        if group["use_muon"]:
            for p, pid, name in zip(group["params"], saved["params"], group["param_names"]):
                m = qstate.dequantize_momentum(full["state"][pid], opts=qstate.format_options(group))
                exact &= torch.equal(blob["momentum"][name], m.reshape(p.shape))
    res["export_matches_gathered_state"] = bool(exact)
    res["exported"] = len(blob["momentum"])
    (ckpt,) = (out / "ckpt").glob("*step=2.ckpt")  # DistributedSampler: 1 batch per epoch per rank
    res["ckpt_is_dir"] = ckpt.is_dir()
    if res["rank"] == 0:
        meta = torch.load(ckpt / "meta.pt", weights_only=False)
        man = meta[MANIFEST_KEY]
        res["manifest_sharded"] = man["sharded"]
        res["manifest_formats"] = sorted({g["state_format"] for g in man["optimizers"][0]["groups"] if g["use_muon"]})
        res["standalone_files"] = os.listdir(out / "q") if (out / "q").exists() else []
        res["fp32_file"] = (out / "fp32.pt").exists()
    dist.barrier()
    # Resume from the sharded checkpoint: the manifest is validated against the swapped-in QMuon.
    tr2 = _fsdp_fit(out, 3, [QuantizedStateCheckpoint(dirpath=out / "q", require_manifest=True)], resume=str(ckpt))
    res["resumed_step"] = tr2.global_step
    return res


@pytest.mark.slow
def test_under_qmuon_fsdp_two_processes(tmp_path):
    """Sharded (DCP) saving works with the callback: manifest in the checkpoint metadata, no per-rank
    standalone file, fp32 export gathered on every rank and written by rank 0, resume validated.
    The profiler writes one trace per rank; the fidelity monitor measures the sharded layers and
    every rank sees the same cosines."""
    import sys

    log = run_launcher([sys.executable, str(Path(__file__).resolve()), "fsdp", str(tmp_path)], timeout=FSDP_TIMEOUT_S,
                       env=subprocess_env(PYTHONWARNINGS="ignore"), cwd=tmp_path, what="fsdp scenario")
    results = sorted(tmp_path.glob("fsdp_rank*.json"))
    if len(results) != 2:
        pytest.fail(f"fsdp scenario wrote {len(results)} rank results, expected 2; log tail:\n{log[-8000:]}")
    r0, r1 = (json.loads(p.read_text()) for p in results)
    for r in (r0, r1):
        assert r["optimizer"] == "QMuon" and r["ckpt_is_dir"] and r["resumed_step"] == 3
        assert r["export_matches_gathered_state"] and r["exported"] > 0
        assert r["monitor_trackers"] == 1 and [h["step"] for h in r["monitor_history"]] == [1]
        # 2 blocks x (qkv, proj, gate_up, down); int8 with a 1-step window: measured 0.999-1.000
        assert len(r["monitor_history"][0]["cos"]) == 8 and min(r["monitor_history"][0]["cos"].values()) > 0.95
        (step, trace, ops), = r["profiled"]
        assert step == 1 and trace == f"optimizer_step_000001-rank{r['rank']}.trace.json"
        assert "qmuon::q8_momentum_update_multi_" in ops
    assert r0["manifest_sharded"] is True and r0["manifest_formats"] == ["int8"]
    assert r0["standalone_files"] == [] and r0["fp32_file"]
    assert r0["monitor_history"] == r1["monitor_history"]


if __name__ == "__main__":
    fsdp_scenario_main(_fsdp_scenario, "fsdp")
