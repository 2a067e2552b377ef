"""A restarted run is the same run: the data stream, checkpoint discovery, crash-safe saves.

* The training loader's state (epoch, batch) continues the window stream exactly, on every
  replica, across epoch boundaries; the epoch length never depends on ``max_steps``.
* Lightning restores that state itself: in-process fits stopped at steps before, on and after an
  epoch boundary and resumed end bit-identical to an uninterrupted fit, with the same checkpoint
  names (so the same epoch count).
* :mod:`qmuon.distributed.resume`: incomplete files and sharded directories are named
  as such, never chosen by ``auto`` / ``last``, and refused with the reason when given explicitly;
  a killed sharded save is finished or removed.
* End to end (slow): ``qmuon-train`` killed with SIGKILL at random moments while checkpointing
  every step, restarted with the same command (``ckpt_path: auto``), on 1 process and on 2
  processes under ``qmuon_fsdp``, ends with weights and optimizer state bit-identical to an
  uninterrupted run and the same checkpoint names; the same with a second, user-added
  ``ModelCheckpoint`` in another folder (periodic at another frequency, or the best by
  ``val_loss``): ``auto`` resumes from the newest checkpoint of either folder and both callbacks
  continue their own names (no ``last-v1.ckpt``).
"""

from __future__ import annotations

import logging
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

import lightning as L

import _crash
from qmuon_lightning.cli import QMuonCLI, resolve_ckpt_path
from qmuon_lightning.data import ByteLMDataModule
from qmuon_lightning.data.datamodule import ResumableWindowLoader, TokenWindowDataset, WindowSampler
from qmuon.distributed.resume import (
    IncompleteCheckpointError, checkpoint_problem, find_resumable_checkpoint, publish_directory,
    recover_interrupted_saves, require_complete, scan_checkpoints, staging_path, untracked_checkpoints,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*LeafSpec", "ignore:.*does not have many workers", "ignore:.*GPU available but not used",
    "ignore:.*Checkpoint directory .* exists and is not empty", "ignore:.*smaller than the logging interval",
)


# ------------------------------------------------------------------------------------ data stream
def _windows(n: int = 64) -> TokenWindowDataset:
    data = torch.arange(5000) % 251
    return TokenWindowDataset(data.numpy(), [(0, 5000)], seq_len=8, length=n, seed=3)


def _stream(loader: ResumableWindowLoader, epochs: range) -> list[torch.Tensor]:
    out = []
    for e in epochs:
        loader.sampler.set_epoch(e)
        out += [x for x, _ in loader]
    return out


@pytest.mark.parametrize("replicas", [1, 3])
def test_loader_state_continues_the_stream(replicas):
    """Stop after k batches (also k = a whole epoch), save state, build a fresh loader, load: the
    rest of the stream is the uninterrupted one, on every replica; replicas read disjoint windows."""
    ds = _windows()
    per_epoch = WindowSampler(ds, 4, num_replicas=replicas).num_batches
    for rank in range(replicas):
        straight = _stream(ResumableWindowLoader(ds, WindowSampler(ds, 4, replicas, rank)), range(3))
        for k in (1, per_epoch - 1, per_epoch, per_epoch + 2):
            first = ResumableWindowLoader(ds, WindowSampler(ds, 4, replicas, rank))
            seen, epoch = [], 0
            while len(seen) < k:
                first.sampler.set_epoch(epoch)
                for x, _ in first:
                    seen.append(x)
                    if len(seen) == k:
                        break
                epoch += 1
            state = first.state_dict()
            assert (state["epoch"], state["batch"]) == divmod(k, per_epoch)
            second = ResumableWindowLoader(ds, WindowSampler(ds, 4, replicas, rank))
            second.load_state_dict(state)
            second.sampler.set_epoch(state["epoch"])  # as Lightning does before the restored epoch
            rest = [x for x, _ in second]  # the restored epoch's remaining batches
            rest += _stream(second, range(state["epoch"] + 1, 3))
            assert len(seen) + len(rest) == len(straight)
            for a, b in zip(seen + rest, straight):
                assert torch.equal(a, b)
    starts = [set(WindowSampler(ds, 4, replicas, r)) for r in range(replicas)]
    assert sum(map(len, starts)) == len(set().union(*starts))


def test_loader_state_from_another_epoch_length_or_epoch_is_refused():
    ds = _windows()
    state = ResumableWindowLoader(ds, WindowSampler(ds, 4)).state_dict()
    other = ResumableWindowLoader(ds, WindowSampler(ds, 8))
    with pytest.raises(ValueError, match="batches per epoch"):
        other.load_state_dict(state)
    same = ResumableWindowLoader(ds, WindowSampler(ds, 4))
    same.load_state_dict({"epoch": 2, "batch": 1})
    with pytest.raises(RuntimeError, match="restored at epoch 2 .* continues with epoch 1"):
        same.sampler.set_epoch(1)  # the trainer's loop state disagrees with the data position


def test_epoch_length_does_not_depend_on_max_steps():
    lengths = []
    for max_steps in (10, 20):
        dm = ByteLMDataModule(seq_len=16, batch_size=4, max_bytes=600_000, val_windows=4)
        trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        dm.trainer = trainer
        dm.setup("fit")
        lengths.append(len(dm.train_dataloader()))
    assert lengths[0] == lengths[1] > 20


# ------------------------------------------------------------------- in-process Lightning restore
TINY = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: {max_steps}
  max_epochs: -1
  val_check_interval: 4
  check_val_every_n_epoch: null
  num_sanity_val_steps: 0
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
  logger: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {root}/checkpoints
        save_last: true
        every_n_train_steps: 1
model:
  d_model: 16
  n_layers: 1
  n_heads: 2
  optimizer:
    name: qmuon
    state_format: int8
    state:
      rounding: stochastic
    warmup_steps: 2
    schedule: constant  # a cosine schedule's length is max_steps, which one resume here changes
data:
  seq_len: 16
  batch_size: 2
  max_bytes: 600000
  val_windows: 4
  train_samples: 10
"""


class StopAtStep(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True  # after ModelCheckpoint saved this step, as a kill after the save


def _fit(root: Path, max_steps: int, *extra: str) -> QMuonCLI:
    cfg = root.parent / f"{root.name}.yaml"
    cfg.write_text(TINY.format(root=root, max_steps=max_steps))
    return QMuonCLI(args=["fit", "--config", str(cfg), *extra])


@pytest.mark.qmuon_train
def test_interrupted_fits_resume_bit_identical(tmp_path):
    """Epochs of 5 batches; stops after steps 3, 5 and 10 (the last batches of two consecutive epochs:
    Lightning alone then loses an epoch, EpochBoundaryResume keeps it) and 11, each resumed
    with ``--ckpt_path auto``, one of the resumed runs with ``max_steps`` 9 instead of 14 (the data
    stream must not depend on it; the LR schedule is constant, as a cosine one's length is
    ``max_steps``): the final checkpoint equals an uninterrupted 14-step run bit for bit, and its
    name (epoch number) too."""
    import json

    straight = tmp_path / "straight"
    _fit(straight, 14)
    resumed = tmp_path / "resumed"
    stops = [3, 5, 10, 11]
    for i, step in enumerate(stops):
        stop = json.dumps({"class_path": f"{__name__}.StopAtStep", "init_args": {"step": step}})
        cli = _fit(resumed, 9 if i == 1 else 14, "--ckpt_path", "auto", f"--trainer.callbacks+={stop}")
        assert cli.trainer.global_step == step
    cli = _fit(resumed, 14, "--ckpt_path", "auto")
    assert cli.trainer.global_step == 14
    assert _crash.checkpoint_names(resumed) == _crash.checkpoint_names(straight) == ["epoch=2-step=14.ckpt", "last.ckpt"]
    a = _crash.load_checkpoint(straight / "checkpoints" / "last.ckpt")
    b = _crash.load_checkpoint(resumed / "checkpoints" / "last.ckpt")
    assert _crash.state_differences(a, b) == []
    assert a["loops"]["fit_loop"]["state_dict"] == b["loops"]["fit_loop"]["state_dict"]


# -------------------------------------------------------------------------- checkpoint discovery
def _file_ckpt(path: Path, step: int) -> Path:
    torch.save({"global_step": step, "state_dict": {"w": torch.full((64, 64), float(step))}}, path)
    return path


def _dcp_ckpt(path: Path, step: int) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save({"state_dict": {"w": torch.full((64, 64), float(step))}}, checkpoint_id=str(path), no_dist=True)
    torch.save({"global_step": step}, path / "meta.pt")
    return path


def test_incomplete_checkpoints_are_named_and_skipped(tmp_path):
    d = tmp_path / "checkpoints"
    d.mkdir()
    _file_ckpt(d / "epoch=0-step=3.ckpt", 3)
    _dcp_ckpt(d / "epoch=0-step=4.ckpt", 4)
    assert find_resumable_checkpoint(d) == d / "epoch=0-step=4.ckpt"

    truncated = _file_ckpt(d / "epoch=0-step=9.ckpt", 9)
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    no_metadata = _dcp_ckpt(d / "epoch=0-step=8.ckpt", 8)
    (no_metadata / ".metadata").unlink()
    lost_shard = _dcp_ckpt(d / "epoch=0-step=7.ckpt", 7)
    next(lost_shard.glob("*.distcp")).unlink()
    no_meta_pt = _dcp_ckpt(d / "epoch=0-step=6.ckpt", 6)
    (no_meta_pt / "meta.pt").unlink()
    cut_meta_pt = _dcp_ckpt(d / "epoch=0-step=5.ckpt", 5)
    (cut_meta_pt / "meta.pt").write_bytes((cut_meta_pt / "meta.pt").read_bytes()[:40])

    reports: list[str] = []
    assert find_resumable_checkpoint(d, report=reports.append) == d / "epoch=0-step=4.ckpt"
    assert len(reports) == 5
    expected = {truncated: "zip directory", no_metadata: "without .metadata", lost_shard: "missing the shard file",
                no_meta_pt: "no meta.pt", cut_meta_pt: "zip directory"}
    for path, words in expected.items():
        problem = checkpoint_problem(path)
        assert problem is not None and words in problem and str(path) in problem
        with pytest.raises(IncompleteCheckpointError, match=words):
            require_complete(path)
    assert scan_checkpoints(d).complete[1][0] == d / "epoch=0-step=3.ckpt"
    assert find_resumable_checkpoint(tmp_path / "nothing-here") is None


def test_publish_and_recover_interrupted_sharded_saves(tmp_path):
    d = tmp_path / "checkpoints"
    d.mkdir()
    last = d / "last.ckpt"
    # a replace: the new directory becomes last.ckpt, the old one is gone, nothing hidden is left
    _dcp_ckpt(last, 1)
    _dcp_ckpt(staging_path(last), 2)
    publish_directory(staging_path(last), last)
    assert find_resumable_checkpoint(d) == last and torch.load(last / "meta.pt")["global_step"] == 2
    assert sorted(p.name for p in d.iterdir()) == ["last.ckpt"]

    # killed between the two renames of a replace: last.ckpt missing, both complete copies hidden
    shutil.move(str(last), str(d / ".last.ckpt.old"))
    _dcp_ckpt(staging_path(last), 3)
    assert find_resumable_checkpoint(d) is None
    actions = recover_interrupted_saves(d, report=lambda s: None)
    assert len(actions) == 2 and "adopted" in actions[0] and "removed" in actions[1]
    assert torch.load(last / "meta.pt")["global_step"] == 3
    assert sorted(p.name for p in d.iterdir()) == ["last.ckpt"]

    # the Fabric strategy's staging name "<name>.partial": never a candidate, adopted when complete
    _dcp_ckpt(d / "step=5.ckpt.partial", 5)
    assert find_resumable_checkpoint(d) == last
    assert "adopted" in recover_interrupted_saves(d, report=lambda s: None)[0]
    assert find_resumable_checkpoint(d) == d / "step=5.ckpt"
    shutil.rmtree(d / "step=5.ckpt")

    # killed after the write, before the rename: the complete staging copy is newer, it replaces last.ckpt
    _dcp_ckpt(staging_path(last), 4)
    assert "replacing the older one" in recover_interrupted_saves(d, report=lambda s: None)[0]
    assert torch.load(last / "meta.pt")["global_step"] == 4 and sorted(p.name for p in d.iterdir()) == ["last.ckpt"]

    # killed mid-write: an incomplete staging directory is removed, the published one kept
    staging = staging_path(d / "epoch=0-step=4.ckpt")
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(b"x" * 10)
    assert "removed" in recover_interrupted_saves(d, report=lambda s: None)[0]
    assert sorted(p.name for p in d.iterdir()) == ["last.ckpt"]


@pytest.mark.qmuon_train
def test_cli_resolution_of_auto_last_and_explicit_paths(tmp_path):
    root = tmp_path / "run"
    cli = _fit(root, 3)
    trainer, d = cli.trainer, root / "checkpoints"
    assert resolve_ckpt_path(trainer, "auto") in (str(d / "last.ckpt"), str(d / "epoch=0-step=3.ckpt"))
    assert untracked_checkpoints(d, d / "last.ckpt") == []
    # a kill between ModelCheckpoint(save_top_k=1) writing step 3 and deleting step 2 leaves step 2:
    # auto deletes it (the callback's own name for its epoch and step); a file of another name is reported
    blob = torch.load(d / "epoch=0-step=3.ckpt", weights_only=False)
    blob["global_step"] = 2
    torch.save(blob, d / "epoch=0-step=2.ckpt")
    _file_ckpt(d / "mine.ckpt", 1)
    with pytest.warns(UserWarning, match=r"not tracked .*mine\.ckpt"):
        resolve_ckpt_path(trainer, "auto")
    assert not (d / "epoch=0-step=2.ckpt").exists() and (d / "mine.ckpt").exists()
    (d / "mine.ckpt").unlink()
    whole = (d / "last.ckpt").read_bytes()
    (d / "last.ckpt").write_bytes(whole[:100])
    # an incomplete checkpoint under one of this run's names is removed (and reported), another reported
    (d / "other.ckpt").write_bytes(whole[:100])
    with pytest.warns(UserWarning) as record:
        assert resolve_ckpt_path(trainer, "auto") == str(d / "epoch=0-step=3.ckpt")
    messages = " ".join(str(w.message) for w in record)
    assert "removed an incomplete checkpoint" in messages and "skipping incomplete checkpoint" in messages
    assert not (d / "last.ckpt").exists() and (d / "other.ckpt").exists()
    (d / "other.ckpt").unlink()
    (d / "last.ckpt").write_bytes(whole[:100])
    with pytest.raises(IncompleteCheckpointError, match="no last checkpoint .* is complete"):
        resolve_ckpt_path(trainer, "last")
    with pytest.raises(IncompleteCheckpointError, match="zip directory"):
        resolve_ckpt_path(trainer, str(d / "last.ckpt"))
    stray = _file_ckpt(d / "epoch=0-step=1.ckpt", 1)
    assert untracked_checkpoints(d, d / "epoch=0-step=3.ckpt") == [stray]
    shutil.rmtree(d)
    assert resolve_ckpt_path(trainer, "auto") is None


def _lightning_ckpt(path: Path, step: int, *, weights_only: bool = False, callbacks: dict | None = None) -> Path:
    """A file with what a Lightning checkpoint holds that discovery reads (step, callback states)."""
    blob = {"epoch": 0, "global_step": step, "pytorch-lightning_version": L.__version__,
            "state_dict": {"w": torch.full((8, 8), float(step))}}
    if not weights_only:
        blob.update(callbacks=callbacks or {}, optimizer_states=[{}])
    torch.save(blob, path)
    return path


def test_find_resumable_checkpoint_over_several_folders(tmp_path):
    """Newest by step over every folder, then by modification time; a one-folder call is unchanged."""
    import os

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    _file_ckpt(a / "epoch=0-step=4.ckpt", 4)
    _file_ckpt(b / "epoch=0-step=6.ckpt", 6)
    _file_ckpt(a / "last.ckpt", 6)
    os.utime(b / "epoch=0-step=6.ckpt", ns=(1, 2_000_000_000))
    os.utime(a / "last.ckpt", ns=(1, 1_000_000_000))
    truncated = _file_ckpt(b / "epoch=0-step=9.ckpt", 9)
    truncated.write_bytes(truncated.read_bytes()[:100])
    reports: list[str] = []
    # step 6 twice: the one modified last (b's) wins; the truncated step 9 never does
    assert find_resumable_checkpoint([a, b], report=reports.append) == b / "epoch=0-step=6.ckpt"
    assert len(reports) == 1 and "epoch=0-step=9.ckpt" in reports[0]
    os.utime(a / "last.ckpt", ns=(1, 3_000_000_000))
    assert find_resumable_checkpoint((str(a), b), report=reports.append) == a / "last.ckpt"
    assert find_resumable_checkpoint(a) == a / "last.ckpt"
    assert find_resumable_checkpoint(str(b), report=reports.append) == b / "epoch=0-step=6.ckpt"
    assert find_resumable_checkpoint([tmp_path / "x", tmp_path / "y"]) is None


def _two_callback_trainer(root: Path) -> "L.Trainer":
    from lightning.pytorch.callbacks import ModelCheckpoint

    return L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=root / "checkpoints", save_last=True, every_n_train_steps=4),
                   ModelCheckpoint(dirpath=root / "best", monitor="val_loss", save_top_k=2,
                                   filename="best-{step}-{val_loss:.4f}", save_weights_only=True)])


def test_auto_scans_every_checkpoint_folder(tmp_path, caplog):
    """``auto`` over a periodic folder and a best-by-val_loss one: the newest resumable checkpoint of
    either (a weights-only one is not resumable), a message naming both folders and the choice; an
    incomplete file is removed in the folder whose callback names it and reported elsewhere; an
    untracked weights-only best checkpoint ahead of the resume point is removed (the resumed run
    writes it again: it would otherwise become ``...-v1.ckpt``); ``last`` picks over both folders."""

    root = tmp_path / "run"
    trainer = _two_callback_trainer(root)
    d, best = root / "checkpoints", root / "best"
    d.mkdir(parents=True), best.mkdir()
    kept = best / "best-step=5-val_loss=2.9000.ckpt"
    state = {"ModelCheckpoint{'monitor': None}": {"best_model_path": str(d / "epoch=0-step=8.ckpt"),
                                                  "last_model_path": str(d / "last.ckpt")},
             "ModelCheckpoint{'monitor': 'val_loss'}": {"best_k_models": {str(kept): 2.9}}}
    _lightning_ckpt(d / "epoch=0-step=8.ckpt", 8, callbacks=state)
    _lightning_ckpt(d / "last.ckpt", 8, callbacks=state)
    _lightning_ckpt(kept, 5, weights_only=True)
    dropped = _lightning_ckpt(best / "best-step=4-val_loss=3.1000.ckpt", 4, weights_only=True)
    ahead = _lightning_ckpt(best / "best-step=10-val_loss=2.5000.ckpt", 10, weights_only=True)
    cut = _lightning_ckpt(best / "best-step=12-val_loss=2.4000.ckpt", 12)
    cut.write_bytes(cut.read_bytes()[:100])
    foreign = best / "notes.ckpt"
    foreign.write_bytes(cut.read_bytes())
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning) as record:
        chosen = resolve_ckpt_path(trainer, "auto")
    assert chosen in (str(d / "epoch=0-step=8.ckpt"), str(d / "last.ckpt"))
    warned = " ".join(str(w.message) for w in record)
    assert f"removed an incomplete checkpoint left by the interrupted run: {cut}" in warned
    assert f"skipping incomplete checkpoint: {foreign}" in warned
    assert f"removed {ahead}: saved at step 10, after the resume point (step 8)" in warned
    assert f"removed {dropped}: ModelCheckpoint(monitor='val_loss', save_top_k=2) of the interrupted run had dropped it" in warned
    assert not cut.exists() and not ahead.exists() and not dropped.exists() and foreign.exists() and kept.exists()
    assert (d / "epoch=0-step=8.ckpt").exists() and (d / "last.ckpt").exists()  # tracked: kept
    logged = caplog.text
    assert f"resuming from {chosen} (global step 8)" in logged
    assert f"{d} (2 resumable)" in logged and f"{best} (0 resumable, 3 weights-only)" in logged

    # a newer, resumable checkpoint in the second folder wins, for auto and for last
    foreign.unlink()
    newer = _lightning_ckpt(best / "best-step=10-val_loss=2.5000.ckpt", 10)
    assert resolve_ckpt_path(trainer, "auto") == str(newer)
    assert resolve_ckpt_path(trainer, "last") == str(d / "last.ckpt")  # the only last*.ckpt
    _lightning_ckpt(best / "last.ckpt", 10)
    assert resolve_ckpt_path(trainer, "last") == str(best / "last.ckpt")
    shutil.rmtree(best), shutil.rmtree(d)
    with caplog.at_level(logging.INFO):
        assert resolve_ckpt_path(trainer, "auto") is None
    assert f"no complete checkpoint to resume from in {d} (0 resumable), {best} (0 resumable)" in caplog.text


def test_restart_continues_the_last_checkpoint_name(tmp_path):
    """A ModelCheckpoint whose restored state does not name the ``last.ckpt`` in its folder (here: no
    state at all) writes ``last-v1.ckpt`` beside it under plain Lightning; with
    ContinueCheckpointNames it writes over ``last.ckpt``, as the uninterrupted run does."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from qmuon_lightning.callbacks import ContinueCheckpointNames

    def fit(folder: Path, *extra) -> None:
        cb = ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0, every_n_train_steps=1)
        L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  callbacks=[cb, *extra]).fit(BoringModel())

    for folder, extra in ((tmp_path / "plain", ()), (tmp_path / "continued", (ContinueCheckpointNames(),))):
        fit(folder)
        fit(folder, *extra)
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["last-v1.ckpt", "last.ckpt"]
    assert sorted(p.name for p in (tmp_path / "continued").iterdir()) == ["last.ckpt"]


def test_restart_after_a_kill_between_the_final_saves_rewrites_last(tmp_path):
    """A kill after the final step's periodic checkpoint and before its ``last.ckpt`` (seen in
    test_sigkill_and_auto_restart_is_bit_identical under load) leaves ``last.ckpt`` one step behind,
    and the restart has no step left to save: resumed by Lightning from the newest file, the run ends
    with the stale ``last.ckpt``; ``ckpt_path="auto"`` writes it again from that file first."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    def trainer(folder: Path) -> L.Trainer:
        cb = ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=-1, every_n_train_steps=1)
        return L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[cb])

    def step_of(path: Path) -> int:
        return torch.load(path, weights_only=False)["global_step"]

    for name in ("plain", "auto"):
        folder = tmp_path / name
        trainer(folder).fit(BoringModel())
        assert step_of(folder / "last.ckpt") == 3
        shutil.copyfile(folder / "epoch=0-step=2.ckpt", folder / "last.ckpt")  # the kill's leftover
        t = trainer(folder)
        newest = str(folder / "epoch=0-step=3.ckpt")
        if name == "auto":
            with pytest.warns(UserWarning, match=r"last.ckpt held step 2, older than epoch=0-step=3.ckpt \(step 3\)"):
                chosen = resolve_ckpt_path(t, "auto")
        else:
            chosen = newest
        assert chosen == newest
        t.fit(BoringModel(), ckpt_path=chosen)
        assert step_of(folder / "last.ckpt") == (3 if name == "auto" else 2), name
    got, want = (torch.load(tmp_path / "auto" / f, weights_only=False) for f in ("last.ckpt", "epoch=0-step=3.ckpt"))
    assert all(torch.equal(got["state_dict"][k], v) for k, v in want["state_dict"].items())
    assert sorted(p.name for p in (tmp_path / "auto").iterdir()) == sorted(p.name for p in (tmp_path / "plain").iterdir())


# ------------------------------------------------------------------------------ SIGKILL, end to end
@pytest.mark.qmuon_train
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_sigkill_and_auto_restart_is_bit_identical(tmp_path, world_size):
    """Kill ``qmuon-train`` (SIGKILL, whole process group) twice at random moments of a run that
    checkpoints every step, restart with the same command each time; the run completes, with the
    uninterrupted run's weights, optimizer state and checkpoint names. With 2 processes a third
    start loses only its second rank (a lost node): the first must exit on its own (gloo reports
    the closed connection), and the restart still ends bit-identical."""
    steps = 14
    straight = tmp_path / "straight"
    with _crash.running(_crash.write_config(straight, world_size, steps)) as straight_run:  # beside the kills
        killed = tmp_path / "killed"
        cfg = _crash.write_config(killed, world_size, steps)
        rng = random.Random(1000 + world_size)
        outcomes = [_crash.run_and_kill(cfg, killed, after, rng)[0] for after in sorted(rng.sample(range(1, steps - 4), 2))]
        assert "killed" in outcomes
        if world_size == 2:
            outcome, log = _crash.run_and_kill(cfg, killed, _crash.saved_steps(killed) + 1, rng, only_rank1=True)
            assert outcome.startswith("rank 1 lost, rank 0 exited") or outcome == "finished", (outcome, log[-3000:])
        _crash.run(cfg)
        straight_run()
    assert _crash.checkpoint_names(killed) == _crash.checkpoint_names(straight)
    a = _crash.load_checkpoint(straight / "checkpoints" / "last.ckpt")
    b = _crash.load_checkpoint(killed / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == steps
    assert _crash.state_differences(a, b) == []


@pytest.mark.qmuon_train
@pytest.mark.slow
@pytest.mark.parametrize("rule", ["stochastic", "ecc8"])
def test_sigkill_restart_bit_identical_with_bf16_weights_and_release(tmp_path, rule):
    """Issue 19's state and weights through SIGKILL + ``ckpt_path: auto``: ``precision: bf16-true``
    (bf16 weights, no fp32 master) written with ``bf16_update`` ``rule``, int8 AdamW moments (the
    default) and gradient release. One kill; the run ends with the uninterrupted run's weights and
    optimizer state bit for bit (ecc8: its ``weight_ecc`` codes too)."""
    steps = 12
    options = {"precision": "bf16-true", "optimizer": {"bf16_update": rule, "gradient_release": True}}
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    with _crash.running(_crash.write_config(straight, 1, steps, **options)) as straight_run:  # beside the kill
        cfg = _crash.write_config(killed, 1, steps, **options)
        outcome, log = _crash.run_and_kill(cfg, killed, 4, random.Random(7))
        assert outcome == "killed", log[-3000:]
        _crash.run(cfg)
        straight_run()
    a = _crash.load_checkpoint(straight / "checkpoints" / "last.ckpt")
    b = _crash.load_checkpoint(killed / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == steps
    assert all(v.dtype == torch.bfloat16 for v in a["state_dict"].values() if v.is_floating_point())
    ecc = [k for k in _crash.tensors({"optimizer_states": a["optimizer_states"]}) if "ecc" in k]
    assert bool(ecc) == (rule == "ecc8"), ecc
    assert _crash.state_differences(a, b) == []


@pytest.mark.slow
@pytest.mark.parametrize("second", ["periodic", "best"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_sigkill_with_two_checkpoint_callbacks_is_bit_identical(tmp_path, world_size, second):
    """Issue 20: the recipe's ModelCheckpoint (top-1 + last) plus a user's own in another folder
    (``periodic``: every 2 steps while the first saves every 3, top-1 + last, in ``ck/``; ``best``:
    the 2 best by ``val_loss`` after each validation, every 5 steps, in ``best/``, while the first
    saves every 4). Three SIGKILLs at random moments, the same command each time: every restart
    resumes from the newest checkpoint of either folder (none starts over), and the run ends with
    the uninterrupted run's weights, optimizer state and checkpoint names in both folders (no
    ``-vN`` duplicate).

    In ``best`` the first callback never saves on a validation step: Lightning 2.6 does not rerun
    the validation of step ``s`` when resuming from a checkpoint saved at the end of training batch
    ``s`` (docs/reliability.md), so a kill during that validation would change which checkpoints
    are the best two (not the weights)."""
    # max_steps a multiple of the first callback's frequency: its last checkpoint is the final step's
    every, steps = (3, 18) if second == "periodic" else (4, 16)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    with _crash.running(_crash.write_config(straight, world_size, steps, every=every, second=second)) as straight_run:
        rng = random.Random(2000 + 10 * world_size + len(second))
        # A run of these steps takes about a second once started, so a kill can come too late and the
        # run finish first. The kill lands within 0.1 s of its checkpoint, and a sequence in which fewer
        # than two kills landed is repeated in a fresh folder (at most three times): the test needs its
        # kills.
        for attempt in range(3):
            if killed.exists():
                shutil.rmtree(killed)
            cfg = _crash.write_config(killed, world_size, steps, every=every, second=second)
            logs = []
            for after in sorted(rng.sample(range(2, steps - 5), 3)):
                outcome, log = _crash.run_and_kill(cfg, killed, max(after, _crash.saved_steps(killed) + 1), rng,
                                                   max_delay=0.1)
                logs.append((outcome, log))
            if sum(o == "killed" for o, _ in logs) >= 2:
                break
        assert sum(o == "killed" for o, _ in logs) >= 2, [o for o, _ in logs]
        final = _crash.run(cfg)
        straight_run()
    starts = [log for _, log in logs[1:]] + [final]
    for log in starts:
        assert "ckpt_path=auto: resuming from" in log and "starting a new run" not in log, log[-3000:]
    names = _crash.checkpoint_names(killed)
    assert names == _crash.checkpoint_names(straight), names
    assert not any(re.search(r"-v\d+\.ckpt$", n) for n in names) and _crash.hidden_leftovers(killed) == []
    for last in ["checkpoints/last.ckpt"] + (["ck/last.ckpt"] if second == "periodic" else []):
        a, b = _crash.load_checkpoint(straight / last), _crash.load_checkpoint(killed / last)
        assert a["global_step"] == b["global_step"] == steps
        assert _crash.state_differences(a, b) == [], last
    if second == "best":  # the same two best checkpoints, holding the same weights
        for name in (n for n in names if n.startswith("best/")):
            a, b = _crash.load_checkpoint(straight / name), _crash.load_checkpoint(killed / name)
            assert _crash.state_differences(a, b) == [], name


# ------------------------------------------------------------------- the documented Fabric / Accelerate loops
def _tiny_model_and_opt():
    from qmuon import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    return model, build_optimizer(model, lr=0.02, state_format="int8")


def _train_steps(model, opt, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 16, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_fabric_loop_resumes_from_what_find_resumable_checkpoint_returns(tmp_path):
    """docs/reliability.md's Fabric pattern: save every step with the step in the state, a later
    save truncated by a "crash"; the loop resumes from the newest complete one and ends like an
    uninterrupted loop."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    ref_model, ref_opt = _tiny_model_and_opt()
    _train_steps(ref_model, ref_opt, range(6))

    model, opt = _tiny_model_and_opt()
    model, opt = fabric.setup(model, opt)
    state = {"model": model, "optimizer": opt, "global_step": 0}
    for step in range(4):
        _train_steps(model, opt, range(step, step + 1))
        state["global_step"] = step + 1
        fabric.save(tmp_path / f"step={step + 1}.ckpt", state)
    last = tmp_path / "step=4.ckpt"
    last.write_bytes(last.read_bytes()[:200])  # the kill landed in the last save

    model, opt = _tiny_model_and_opt()
    model, opt = fabric.setup(model, opt)
    state = {"model": model, "optimizer": opt, "global_step": 0}
    ckpt = find_resumable_checkpoint(tmp_path, report=lambda s: None)
    assert ckpt == tmp_path / "step=3.ckpt"
    fabric.load(ckpt, state)
    _train_steps(model, opt, range(state["global_step"], 6))
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_accelerate_loop_resumes_from_what_find_resumable_checkpoint_returns(tmp_path):
    """docs/reliability.md's Accelerate pattern: save_state, then a DCP marker written last; a
    folder whose marker is missing (killed in between) is not picked."""
    import torch.distributed.checkpoint as dcp
    from accelerate import Accelerator

    ref_model, ref_opt = _tiny_model_and_opt()
    _train_steps(ref_model, ref_opt, range(5))

    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(*_tiny_model_and_opt())
    for step in range(3):
        _train_steps(model, opt, range(step, step + 1))
        out = tmp_path / f"step={step + 1}"
        accelerator.save_state(out)
        if step < 2:  # the third save is "killed" before its marker
            dcp.save({"global_step": torch.tensor(step + 1)}, checkpoint_id=out, no_dist=True)

    accelerator = Accelerator(cpu=True)  # the restarted process
    model, opt = accelerator.prepare(*_tiny_model_and_opt())
    ckpt = find_resumable_checkpoint(tmp_path)
    assert ckpt == tmp_path / "step=2"
    accelerator.load_state(ckpt)
    _train_steps(model, opt, range(2, 5))
    for a, b in zip(ref_model.parameters(), accelerator.unwrap_model(model).parameters()):
        assert torch.equal(a, b)
