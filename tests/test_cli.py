"""``qmuon-train`` (``qmuon_lightning.cli``): tiny fits in-process, resume, config handling, errors.

Every run here is a ~30k-parameter model on a few hundred KB of stdlib bytes, single thread.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml

import lightning as L

from qmuon_lightning.cli import QMuonCLI, main
from qmuon_lightning.models.lm_module import DecoderLMModule, MuonWithAdamW, OptimizerSpec

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*LeafSpec",  # Lightning 2.6 calls a pytree API that torch 2.13 deprecates
    "ignore:.*does not have many workers",
    "ignore:.*GPU available but not used",
    "ignore:.*Checkpoint directory .* exists and is not empty",
)

TINY = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 6
  max_epochs: -1
  val_check_interval: 3
  check_val_every_n_epoch: null
  num_sanity_val_steps: 0
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
  logger:
    - class_path: lightning.pytorch.loggers.CSVLogger
      init_args:
        save_dir: ${{trainer.default_root_dir}}
        name: csv
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: ${{trainer.default_root_dir}}/checkpoints
        save_last: true
        every_n_train_steps: 3
        save_top_k: -1
model:
  d_model: 32
  n_layers: 1
  n_heads: 2
  optimizer:
    name: qmuon
    state_format: int8
    adamw_lr: 0.003
    state:
      rounding: stochastic
    warmup_steps: 2
data:
  seq_len: 32
  batch_size: 4
  max_bytes: 600000
  val_windows: 8
"""


@pytest.fixture
def tiny_cfg(tmp_path):
    def make(root: Path, extra: str = "") -> Path:
        path = root.parent / f"{root.name}.yaml"
        path.write_text(TINY.format(root=root) + extra)
        return path
    return make


def _train_losses(root: Path) -> dict[int, float]:
    """step -> train_loss from every CSV version under ``root/csv`` (later versions win)."""
    out: dict[int, float] = {}
    for f in sorted((root / "csv").glob("version_*/metrics.csv")):
        with open(f, newline="") as fh:
            for row in csv.DictReader(fh):
                if row.get("train_loss"):
                    out[int(row["step"])] = float(row["train_loss"])
    return out


def _print_config(capsys, *args: str) -> dict:
    with pytest.raises(SystemExit) as exc:
        main(["fit", *args, "--print_config"])
    assert exc.value.code in (None, 0)
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.qmuon_train
def test_fit_logs_checkpoints_and_summarizes(tmp_path, tiny_cfg, capsys):
    root = tmp_path / "run"
    cli = QMuonCLI(args=["fit", "--config", str(tiny_cfg(root))])
    trainer = cli.trainer
    # build_optimizer logs the routing table (the library prints nothing); qmuon-train shows it once.
    out = capsys.readouterr().out
    assert out.count("QMuon parameter routing:") == 1 and "blocks.0.attn" in out, out[:2000]
    assert trainer.global_step == 6
    assert (root / "checkpoints" / "last.ckpt").is_file()
    losses = _train_losses(root)
    assert sorted(losses) == list(range(6))
    # ln 256 = 5.545 at initialization; 6 steps of Muon move it down measurably (a stalled or
    # diverged optimizer would not).
    assert abs(losses[0] - math.log(256)) < 0.3
    assert losses[5] < losses[0] - 0.2, losses

    summary = json.loads(next(root.glob("csv/version_*/summary.json")).read_text())
    assert summary["steps"] == 6 and summary["optimizer"] == "qmuon" and summary["state_format"] == "int8"
    assert summary["tokens"] == 6 * 4 * 32
    assert summary["optimizer_steps_timed"] == 5  # the first step is reported apart
    assert summary["val_final"][0] == 6 and math.isfinite(summary["val_final"][1])
    # int8 momentum: 1 B + 4 B / 256 per Muon element (+ a 4 B step per matrix) vs fp32's 4 B.
    assert 0.25 < summary["muon_state_vs_fp32"] < 0.30
    assert summary["state_bytes"] < summary["fp32_muon_reference_bytes"]
    # Telemetry: a grad norm per optimizer step, logged as well; MFU n/a on CPU.
    assert summary["grad_norm_steps"] == 6 and summary["mfu"] is None and summary["tokens_per_s"] > 0
    with open(next(root.glob("csv/version_*/metrics.csv")), newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert sum(1 for r in rows if r.get("grad_norm")) == 6
    assert all(float(r["perf/tokens_per_s"]) > 0 for r in rows if r.get("perf/tokens_per_s"))
    # The model's max_seq_len comes from data.seq_len (link).
    assert cli.model.config.max_seq_len == 32

    # The loss plot reads the same curves back and writes a PNG.
    pytest.importorskip("matplotlib")
    from qmuon_lightning.plotting import main as plot_main
    from qmuon_lightning.plotting import read_run

    curves = read_run(root)
    # Lightning logs the validation that follows batch index k (global_step k + 1) at step k.
    assert curves.train == losses and sorted(curves.val) == [2, 5]
    png = plot_main([str(root), "--out", str(root / "loss.png")])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class StopAtStep(L.Callback):
    """Interrupts a run after ``step`` optimizer steps (as a crash or a time limit would), so the
    schedule, which depends on ``max_steps``, is the same as in the uninterrupted run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


@pytest.mark.qmuon_train
def test_resume_from_last_matches_uninterrupted_run(tmp_path, tiny_cfg):
    """fit 6 steps straight vs the same run interrupted after 3 and resumed with ``--ckpt_path
    last``: same losses at every step (weights, int8 state with stochastic rounding, LR schedule
    and data position all restored)."""
    straight = tmp_path / "straight"
    QMuonCLI(args=["fit", "--config", str(tiny_cfg(straight))])
    resumed = tmp_path / "resumed"
    cfg = str(tiny_cfg(resumed))
    stop = json.dumps({"class_path": f"{__name__}.StopAtStep", "init_args": {"step": 3}})
    first = QMuonCLI(args=["fit", "--config", cfg, f"--trainer.callbacks+={stop}"])
    assert first.trainer.global_step == 3
    cli = QMuonCLI(args=["fit", "--config", cfg, "--ckpt_path", "last"])
    assert cli.trainer.global_step == 6
    summary = json.loads(sorted(resumed.glob("csv/version_*/summary.json"))[-1].read_text())
    assert (summary["steps"], summary["steps_this_run"], summary["tokens"]) == (6, 3, 3 * 4 * 32)
    a, b = _train_losses(straight), _train_losses(resumed)
    assert sorted(b) == list(range(6))
    for step in range(6):
        # Same process, same ops, same data: the only allowed difference is float summation
        # order, which is identical here, so the tolerance is fp32 round-off of a ~5.0 loss.
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-5), (step, a, b)


@pytest.mark.qmuon_train
def test_tensorboard_logger_is_optional(tmp_path, tiny_cfg, monkeypatch):
    """A recipe's TensorBoardLogger is dropped (with a warning) when tensorboard is not installed;
    with it installed, both loggers are built."""
    import qmuon_lightning.cli as cli_mod

    extra = ("    - class_path: lightning.pytorch.loggers.TensorBoardLogger\n"
             "      init_args:\n        save_dir: ${trainer.default_root_dir}\n        name: tb\n")
    text = TINY.format(root=tmp_path / "run").replace("        name: csv\n", "        name: csv\n" + extra)
    cfg = tmp_path / "tb.yaml"
    cfg.write_text(text)
    args = ["--config", str(cfg), "--trainer.max_steps=1"]  # run=False: no subcommand
    if cli_mod._tensorboard_available():
        cli = QMuonCLI(args=args, run=False)
        assert [type(lg).__name__ for lg in cli.trainer.loggers] == ["CSVLogger", "TensorBoardLogger"]
    monkeypatch.setattr(cli_mod, "_tensorboard_available", lambda: False)
    with pytest.warns(UserWarning, match="tensorboard is not installed"):
        cli = QMuonCLI(args=args, run=False)
    assert [type(lg).__name__ for lg in cli.trainer.loggers] == ["CSVLogger"]


@pytest.mark.qmuon_train
def test_validate_subcommand_loads_checkpoint(tmp_path, tiny_cfg):
    root = tmp_path / "run"
    cfg = str(tiny_cfg(root))
    QMuonCLI(args=["fit", "--config", cfg, "--trainer.max_steps", "3"])
    ckpt = root / "checkpoints" / "last.ckpt"
    cli = QMuonCLI(args=["validate", "--config", cfg, "--ckpt_path", str(ckpt)])
    fresh = QMuonCLI(args=["validate", "--config", cfg])
    trained, untrained = float(cli.trainer.callback_metrics["val_loss"]), float(fresh.trainer.callback_metrics["val_loss"])
    assert abs(untrained - math.log(256)) < 0.3
    assert trained < untrained - 0.05


@pytest.mark.qmuon_train
def test_print_config_interpolation_and_links(tmp_path, tiny_cfg, capsys):
    cfg = str(tiny_cfg(tmp_path / "run"))
    out = _print_config(capsys, "--config", cfg)
    assert out["trainer"]["callbacks"][0]["init_args"]["dirpath"] == f"{tmp_path / 'run'}/checkpoints"
    assert out["trainer"]["logger"][0]["init_args"]["save_dir"] == str(tmp_path / "run")
    assert out["model"]["optimizer"]["state_format"] == "int8"
    assert out["summary"]["filename"] == "summary"  # the always-on summary callback
    # An override of the interpolated key moves every path built from it (resolved after merging).
    other = tmp_path / "elsewhere"
    out = _print_config(capsys, "--config", cfg, f"--trainer.default_root_dir={other}")
    assert out["trainer"]["callbacks"][0]["init_args"]["dirpath"] == f"{other}/checkpoints"


@pytest.mark.qmuon_train
def test_several_configs_and_dotted_overrides(tmp_path, tiny_cfg, capsys):
    base = str(tiny_cfg(tmp_path / "run"))
    over = tmp_path / "over.yaml"
    over.write_text("model:\n  n_layers: 3\n  optimizer:\n    state_format: grasp4\n"
                    "data:\n  seq_len: 48\n")
    out = _print_config(capsys, "--config", base, "--config", str(over), "--model.d_model=64",
                        "--model.optimizer.lr", "0.01")
    m = out["model"]
    assert (m["n_layers"], m["d_model"], m["optimizer"]["state_format"], m["optimizer"]["lr"]) == (3, 64, "grasp4", 0.01)
    assert m["n_heads"] == 2  # untouched keys of the first config survive the merge
    assert out["data"]["seq_len"] == 48


@pytest.mark.qmuon_train
@pytest.mark.parametrize(
    "override, expect",
    [
        (["--model.optimizer.state_format=int7"], ["state_format", "int7"]),
        (["--model.d_model=100", "--model.n_heads=3"], ["invalid configuration", "d_model=100", "n_heads=3"]),
        (["--model.optimizer.newton_schulz.dtpye=fp32"], ["newton_schulz.dtpye"]),
        (["--data.source=text"], ["invalid configuration", "data.paths"]),
        (["--model.dmodel=64"], ["dmodel"]),
        (["--data.source=tokens", "--data.paths=[/nonexistent/corpus]"], ["invalid configuration", "qmuon-prepare"]),
        (["--model.optimizer.bf16_update=ecc7"], ["bf16_update", "ecc7"]),
        (["--model.optimizer.name=torch_muon", "--model.optimizer.bf16_update=ecc8"],
         ["invalid configuration", "bf16_update", "torch baseline"]),
    ],
    ids=["unknown-format", "heads-do-not-divide", "section-typo", "text-without-paths", "typo-key",
         "tokens-dir-missing", "unknown-bf16-update", "bf16-update-on-torch-baseline"],
)
def test_bad_config_gives_clear_error(tmp_path, tiny_cfg, capsys, override, expect):
    cfg = str(tiny_cfg(tmp_path / "run"))
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", cfg, *override])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for word in expect:
        assert word in err, err
    assert "Traceback" not in err


@pytest.mark.qmuon_train
@pytest.mark.parametrize("rule", ["nearest", "stochastic", "ecc8"])
def test_config_sets_bf16_update_adamw_state_and_release(tmp_path, tiny_cfg, capsys, rule):
    """``model.optimizer.bf16_update`` / ``adamw_state_format`` / ``gradient_release`` in a YAML reach
    the QMuon that ``configure_optimizers`` builds (every group), and a bf16-true run writes its bf16
    weights with that rule (ecc8: int8 correction codes for each trained matrix)."""
    extra = tmp_path / "bf16.yaml"
    extra.write_text(f"trainer:\n  precision: bf16-true\n  gradient_clip_val: null\n"
                     f"model:\n  optimizer:\n    bf16_update: {rule}\n    adamw_state_format: int4\n"
                     f"    gradient_release: true\n")
    cfg = str(tiny_cfg(tmp_path / "run"))
    out = _print_config(capsys, "--config", cfg, "--config", str(extra))
    o = out["model"]["optimizer"]
    assert (o["bf16_update"], o["adamw_state_format"], o["gradient_release"]) == (rule, "int4", True)

    cli = QMuonCLI(args=["fit", "--config", cfg, "--config", str(extra), "--trainer.max_steps=2",
                         "--trainer.val_check_interval=2"])
    opt = cli.trainer.optimizers[0]
    groups = opt.param_groups
    assert {g["bf16_update"] for g in groups} == {rule}
    assert {g["state_format"] for g in groups if not g["use_muon"]} == {"int4"}
    assert all(p.dtype == torch.bfloat16 for p in cli.model.parameters())
    muon = [p for g in groups if g["use_muon"] for p in g["params"]]
    has_ecc = [any("ecc" in k for k in opt.state[p]) for p in muon]
    assert all(has_ecc) if rule == "ecc8" else not any(has_ecc), (rule, [sorted(opt.state[p]) for p in muon])


def test_text_and_bin_sources(tmp_path):
    """The datamodule's three sources feed the same training step (text files and a uint16 .bin)."""
    import numpy as np

    from qmuon_lightning.data import ByteLMDataModule

    (tmp_path / "a.txt").write_bytes(b"hello world " * 4000)
    (tmp_path / "b.txt").write_bytes(bytes(range(256)) * 200)
    dm = ByteLMDataModule(source="text", paths=[str(tmp_path / "*.txt")], seq_len=16, batch_size=2, split_chunk=4096)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])
    n = dm.corpus.data.size
    assert n == 12 * 4000 + 256 * 200 + 2  # two NUL separators
    train = sum(hi - lo for lo, hi in dm.corpus.train)
    val = sum(hi - lo for lo, hi in dm.corpus.val)
    assert train + val == n and val > 0 and train > 0
    # Deterministic: a second datamodule draws the same split and windows.
    dm2 = ByteLMDataModule(source="text", paths=[str(tmp_path)], seq_len=16, batch_size=2, split_chunk=4096)
    dm2.setup("fit")
    assert dm2.corpus.val == dm.corpus.val and torch.equal(next(iter(dm2.train_dataloader()))[0], x)

    ids = (np.arange(100_000) * 7919 % 50_000).astype(np.uint16)
    ids.tofile(tmp_path / "tok.bin")
    dm = ByteLMDataModule(source="bin", paths=[str(tmp_path / "tok.bin")], dtype="uint16", vocab_size=50_000,
                          seq_len=64, batch_size=2, split_chunk=8192)
    dm.setup("fit")
    x, _ = dm.val_dataloader().dataset[0]
    assert x.dtype == torch.int64 and int(x.max()) < 50_000
    s = dm.train_dataloader().dataset.window_start(0)
    assert any(lo <= s and s + 65 <= hi for lo, hi in dm.corpus.train)
    with pytest.raises(ValueError, match="vocab_size is required"):
        ByteLMDataModule(source="bin", paths=[str(tmp_path / "tok.bin")], dtype="uint16")


def test_torch_muon_baseline_state_dict_roundtrip():
    """The fp32 baseline optimizer (torch Muon + AdamW as one) saves and reloads its state and
    keeps both inner optimizers bound to the reloaded groups."""
    torch.manual_seed(0)
    m = DecoderLMModule(d_model=32, n_layers=1, n_heads=2, max_seq_len=16,
                        optimizer=OptimizerSpec(name="torch_muon", warmup_steps=0))
    m.configure_model()
    opt = m.configure_optimizers()["optimizer"]
    assert isinstance(opt, MuonWithAdamW)
    x = torch.randint(0, 256, (2, 16))
    for _ in range(2):
        opt.zero_grad()
        m._loss((x, x)).backward()
        opt.step()
    sd = opt.state_dict()
    # Muon keeps one fp32 momentum_buffer per hidden matrix (qkv, proj, gate_up, down of 1 block).
    assert sum("momentum_buffer" in s for s in sd["state"].values()) == 4
    opt2 = m.configure_optimizers()["optimizer"]
    opt2.load_state_dict(sd)
    assert opt2.muon.param_groups[0] is opt2.param_groups[0] and opt2.adamw.state is opt2.state
    for p in m.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[p][k])


@pytest.mark.qmuon_train
def test_module_runs_as_console_program(monkeypatch, capsys):
    """``python -m qmuon_lightning.cli`` (the console script's program, run as ``__main__``)
    parses ``sys.argv``; --help lists the subcommands."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["qmuon-train", "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("qmuon_lightning.cli", run_name="__main__")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "qmuon-train" in out and "fit" in out and "validate" in out


@pytest.mark.qmuon_train
@pytest.mark.slow
def test_fit_and_resume_under_qmuon_fsdp_two_processes(tmp_path, tiny_cfg):
    """``strategy: qmuon_fsdp`` on 2 CPU processes (gloo): DecoderLMModule.configure_model shards
    the blocks with fully_shard, QMuon is built on the DTensor shards in configure_optimizers (the
    strategy keeps it), the DCP checkpoint resumes with ``--ckpt_path last``."""
    import os
    import subprocess

    root = tmp_path / "fsdp"
    cfg = str(tiny_cfg(root))
    # PYTHONFAULTHANDLER: a crash prints every thread's Python stack into the output asserted on.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               PYTHONFAULTHANDLER="1")
    base = [sys.executable, "-m", "qmuon_lightning.cli", "fit", "--config", cfg, "--trainer.strategy=qmuon_fsdp",
            "--trainer.devices=2"]
    for extra in ([], ["--trainer.max_steps=9", "--ckpt_path=last"]):
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "configure_optimizers returned a QMuon; kept as it is" in r.stdout + r.stderr
    assert (root / "checkpoints" / "last.ckpt").is_dir()  # torch.distributed.checkpoint directory
    runs = sorted(root.glob("csv/version_*/summary.json"))
    first, second = (json.loads(p.read_text()) for p in runs)
    assert (first["steps"], second["steps"], second["steps_this_run"]) == (6, 9, 3)
    assert first["tokens"] == 6 * 4 * 32 * 2  # two data-parallel replicas
    # The grad norm over the FSDP2 shards (an all-reduce in on_before_optimizer_step) every step.
    assert first["grad_norm_steps"] == 6 and math.isfinite(first["grad_norm_final"]) and first["grad_norm_final"] > 0
    assert second["val_final"][1] < first["val_first"][1]


@pytest.mark.qmuon_train
def test_optimizer_section_is_the_qmuon_config(tmp_path, tiny_cfg, capsys):
    """``model.optimizer`` is QMuonConfig itself: ``--print_config`` shows its defaults for every
    option the recipe leaves alone, and every option, sections included (a routing rule as a dict),
    is set from YAML and reaches the optimizer."""
    from qmuon.core.config import QMuonConfig

    out = _print_config(capsys, "--config", str(tiny_cfg(tmp_path / "run")))
    opt, defaults = out["model"]["optimizer"], QMuonConfig().to_dict()
    assert set(defaults) <= set(opt)
    for key in ("weight_decay", "momentum", "adamw_state_format", "bf16_update", "gradient_release",
                "newton_schulz", "update", "safety", "routing"):  # the tiny recipe sets none of these
        assert opt[key] == defaults[key], key
    over = tmp_path / "over.yaml"
    over.write_text(
        "model:\n  optimizer:\n"
        "    newton_schulz: {dtype: fp32, method: standard, steps: 4}\n"
        "    update: {variant: normuon, adamw_betas: [0.8, 0.9]}\n"
        "    state: {block_size: 64}\n"
        "    safety: {max_nonfinite_skips: 3}\n"
        "    routing:\n      rules:\n"
        "        - {target: adamw, name_regex: 'blocks\\.0\\.', reason: first block on AdamW}\n"
        "        - {target: muon, min_ndim: 2, max_ndim: 2}\n"
        "        - {target: adamw_no_decay}\n")
    opt = _print_config(capsys, "--config", str(tiny_cfg(tmp_path / "run")), "--config", str(over))["model"]["optimizer"]
    spec = OptimizerSpec(**opt)
    assert (spec.newton_schulz.dtype, spec.newton_schulz.steps, spec.update.variant, spec.state.block_size,
            spec.safety.max_nonfinite_skips) == ("fp32", 4, "normuon", 64, 3)
    module = DecoderLMModule(d_model=32, n_layers=2, n_heads=2, max_seq_len=16, optimizer=spec)
    module.configure_model()
    built = module.configure_optimizers()
    built = built["optimizer"] if isinstance(built, dict) else built
    muon = [g for g in built.param_groups if g["use_muon"]]
    assert muon and all((g["ns_dtype"], g["ns_steps"], g["variant"], g["block_size"]) == ("fp32", 4, "normuon", 64)
                        for g in muon)
    assert not any(n.startswith("blocks.0.") for g in muon for n in g["param_names"])
    assert built.max_nonfinite_skips == 3
