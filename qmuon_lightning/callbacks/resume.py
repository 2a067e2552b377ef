"""Resuming a Lightning run from its own checkpoint folders, the same run, under the same names.

* :func:`resolve_ckpt_path`: ``ckpt_path="auto"`` / ``"last"`` over **every** ``ModelCheckpoint``
  callback's folder (a recipe's periodic checkpoint plus a user's own periodic or
  best-by-validation one). Per folder, on global rank 0: interrupted sharded saves are finished or
  removed, incomplete checkpoints carrying a name of a callback writing there are removed (others
  reported), weights-only checkpoints are not candidates (Lightning cannot resume a fit from them).
  The newest complete checkpoint of all folders is chosen (largest ``global_step``, then the latest
  modification: of two saves on one step, the one written last holds both callbacks' states), and
  each folder's untracked leftovers are handled by the callbacks writing there.
* :class:`ContinueCheckpointNames`: after the restore, each ``ModelCheckpoint`` writes its ``last``
  checkpoint under the name the interrupted run used instead of a versioned ``last-v1.ckpt``
  (Lightning versions a name that exists and is not the callback's ``last_model_path``), and the
  checkpoint ``auto`` resumed from is handed back to the callbacks' bookkeeping.
* :class:`EpochBoundaryResume`: count the epoch that follows a restart at an epoch's last batch.

``qmuon-train`` uses all three; a plain ``Trainer`` can too (docs/reliability.md).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

from qmuon.distributed.resume import (
    CheckpointScan, IncompleteCheckpointError, checkpoint_metadata, checkpoint_problem, checkpoint_step,
    lacks_training_state, newest_complete, publish_directory, recover_interrupted_saves, require_complete,
    scan_checkpoints, staging_path, untracked_checkpoints,
)

__all__ = ["ContinueCheckpointNames", "EpochBoundaryResume", "resolve_ckpt_path"]

#: ``ckpt_path`` values Lightning resolves itself (``last`` is resolved here, skipping incomplete files).
_LIGHTNING_CKPT_WORDS = ("best", "hpc", "registry")


# ------------------------------------------------------------------------------------ folders
@dataclass
class CheckpointFolder:
    """A folder and the ``ModelCheckpoint`` callbacks that write into it (usually one)."""

    path: Path
    callbacks: list[ModelCheckpoint] = field(default_factory=list)


def checkpoint_folders(trainer: Any, what: str = "auto") -> list[CheckpointFolder]:
    """Every ``ModelCheckpoint`` callback's folder, in callback order, callbacks sharing a folder
    grouped. A callback without ``dirpath`` writes under the logger's version folder, a new one each
    run, so it is left out with a warning; none with a ``dirpath`` is an error naming the fix."""
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    with_dir = [cb for cb in callbacks if cb.dirpath is not None]
    if not with_dir:
        raise ValueError(
            f"ckpt_path={what!r} looks for checkpoints in the ModelCheckpoint folders, but this run has "
            f"{'no ModelCheckpoint' if not callbacks else 'only ModelCheckpoints without dirpath (their folder would depend on the logger version)'}"
            "; add trainer.callbacks: ModelCheckpoint with init_args.dirpath (the recipes use "
            "${trainer.default_root_dir}/checkpoints)")
    if len(with_dir) < len(callbacks):
        rank_zero_warn(
            f"ckpt_path={what!r}: {len(callbacks) - len(with_dir)} ModelCheckpoint callback(s) without dirpath are not "
            "searched (their folder depends on the logger version, a new one each run); give them "
            "init_args.dirpath to resume from their checkpoints")
    folders: dict[str, CheckpointFolder] = {}
    for cb in with_dir:
        folders.setdefault(os.path.realpath(cb.dirpath), CheckpointFolder(Path(cb.dirpath))).callbacks.append(cb)
    return list(folders.values())


def _name_pattern(callback: ModelCheckpoint, template: Optional[str]) -> re.Pattern[str]:
    """The file names ``callback.format_checkpoint_name`` gives for ``template`` (its ``filename``,
    or ``CHECKPOINT_NAME_LAST``), any metric values, with or without a version suffix ``-vN``."""
    template = template or "{epoch}" + callback.CHECKPOINT_JOIN_CHAR + "{step}"
    parts, pos = [], 0
    for m in re.finditer(r"\{([^{}:]+)(?::[^{}]*)?\}", template):
        parts.append(re.escape(template[pos:m.start()]))
        if callback.auto_insert_metric_name:
            parts.append(re.escape(m.group(1) + callback.CHECKPOINT_EQUALS_CHAR))
        parts.append(r".+?")
        pos = m.end()
    parts.append(re.escape(template[pos:]))
    version = re.escape(callback.CHECKPOINT_JOIN_CHAR) + r"v\d+"
    return re.compile("".join(parts) + f"(?:{version})?" + re.escape(callback.FILE_EXTENSION))


def _is_last_name(callback: ModelCheckpoint, path: Path) -> bool:
    return _name_pattern(callback, callback.CHECKPOINT_NAME_LAST).fullmatch(path.name) is not None


def _named_by(callback: ModelCheckpoint, path: Path) -> bool:
    """Whether ``path`` carries a name this ModelCheckpoint gives its checkpoints (its ``last``
    name, or its ``filename`` template with any values), so it was written by the interrupted run."""
    return _is_last_name(callback, path) or _name_pattern(callback, callback.filename).fullmatch(path.name) is not None


def _is_own_replaced_top1(callback: ModelCheckpoint, path: Path) -> bool:
    """Whether ``path`` is a checkpoint this ``ModelCheckpoint(monitor=None, save_top_k=1)`` wrote
    (its name is the callback's name for the epoch and step stored in it): one the interrupted run
    had already replaced, killed before deleting it."""
    state = checkpoint_metadata(path) or {}
    epoch, step = state.get("epoch"), state.get("global_step")
    if not isinstance(epoch, int) or not isinstance(step, int):
        return False
    try:
        names = {os.path.realpath(callback.format_checkpoint_name({"epoch": epoch, "step": step}, ver=v))
                 for v in (None, 1, 2, 3)}
    except Exception:  # noqa: BLE001 - a filename needing other metrics: not provably ours
        return False
    return os.path.realpath(path) in names


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()


def _remove_or_report_incomplete(folder: CheckpointFolder, incomplete: list[tuple[Path, str]], what: str) -> None:
    """Incomplete checkpoints (a save, or ModelCheckpoint's deletion of a replaced one, cut short by
    the kill) can never be resumed from: those carrying a name of a callback writing into this
    folder are removed, any other is reported; each with what is missing."""
    for path, problem in incomplete:
        if rank_zero_only.rank == 0 and any(_named_by(cb, path) for cb in folder.callbacks):
            _remove(path)
            rank_zero_warn(f"ckpt_path={what}: removed an incomplete checkpoint left by the interrupted run: {problem}")
        else:
            rank_zero_warn(f"ckpt_path={what}: skipping incomplete checkpoint: {problem}")


def _stale_reason(callbacks: list[ModelCheckpoint], path: Path, step: Optional[int],
                  resumed_step: Optional[int]) -> Optional[str]:
    """Why an untracked checkpoint of the interrupted run in these callbacks' folder is removed,
    or ``None`` to keep (and report) it. Without a step in both, nothing is provably stale."""
    owners = [cb for cb in callbacks if _named_by(cb, path)]
    if not owners or step is None or resumed_step is None:
        return None
    if step > resumed_step:
        return (f"saved at step {step}, after the resume point (step {resumed_step}): the resumed run writes it again "
                "(it was left out of the resume as a weights-only checkpoint)")
    if any(cb.monitor is None and cb.save_top_k == 1 and _is_own_replaced_top1(cb, path) for cb in owners):
        return ("ModelCheckpoint(save_top_k=1) of the interrupted run had replaced it by a newer checkpoint and was "
                "killed before deleting it")
    if step < resumed_step and all(cb.monitor is not None and cb.save_top_k > 0 for cb in owners):
        return (f"ModelCheckpoint(monitor={owners[0].monitor!r}, save_top_k={owners[0].save_top_k}) of the interrupted "
                "run had dropped it from its top k and was killed before deleting it")
    return None


def _adopt_or_report_untracked(folder: CheckpointFolder, chosen: Path, resumed_step: Optional[int], what: str) -> None:
    """Complete checkpoints of the interrupted run in ``folder`` that the restored callback states
    do not track: removed where the callback owning the name would have deleted or rewritten them
    (:func:`_stale_reason`), otherwise listed in a warning. A ``last`` name is kept: the restored
    callback writes over it (:class:`ContinueCheckpointNames`)."""
    untracked = [p for p in untracked_checkpoints(folder.path, chosen) if checkpoint_problem(p) is None
                 and not any(_is_last_name(cb, p) for cb in folder.callbacks)]
    rest = []
    for p in untracked:
        reason = _stale_reason(folder.callbacks, p, checkpoint_step(p), resumed_step)
        if reason is None:
            if not any(cb.save_top_k == -1 and _named_by(cb, p) for cb in folder.callbacks):
                rest.append(p)  # a keep-everything callback's own file is not stale
        elif rank_zero_only.rank == 0:
            _remove(p)
            rank_zero_warn(f"ckpt_path={what}: removed {p}: {reason}")
    if rest:
        rank_zero_warn(
            f"ckpt_path={what}: {len(rest)} checkpoint(s) in {folder.path} are not tracked by the resumed ModelCheckpoint "
            f"callbacks, so they will not delete them: {', '.join(str(p) for p in rest)}. Delete them when you no longer "
            "need them.")


def _refresh_stale_last(folder: CheckpointFolder, chosen: Path, step: Optional[int]) -> None:
    """Write ``chosen`` over the ``last`` checkpoint of the callback that saved it when that ``last``
    holds an earlier step: the run was killed between the callback's periodic save and its ``last``
    save of one step (Lightning writes both, in that order, whenever the callback saves). The next
    save would rewrite ``last``, but a run killed so at its final step has none: the restart ends at
    once and ``last`` would stay one save behind the uninterrupted run's. Copied to a hidden staging
    name, then published (a kill meanwhile leaves the old ``last`` or the new one, never neither)."""
    if step is None or chosen.parent != folder.path:
        return
    for cb in folder.callbacks:
        if (not cb.save_last or "{" in cb.CHECKPOINT_NAME_LAST or _is_last_name(cb, chosen)
                or _name_pattern(cb, cb.filename).fullmatch(chosen.name) is None):
            continue
        last = folder.path / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
        if last.is_symlink() or not last.exists() or checkpoint_problem(last) is not None:
            continue
        saved = checkpoint_step(last)
        if saved is None or saved >= step:
            continue
        # the staging names recover_interrupted_saves finishes or removes after a kill
        if chosen.is_dir():
            staging = staging_path(last)
            copy = shutil.copytree
        else:
            staging, copy = last.with_name(f"{last.name}.partial"), shutil.copyfile
        if staging.exists() or staging.is_symlink():
            _remove(staging)
        copy(chosen, staging)
        publish_directory(staging, last)  # flushed, then renamed over (a file: the same two renames)
        rank_zero_warn(f"ckpt_path=auto: {last} held step {saved}, older than {chosen.name} (step {step}) saved by "
                       "the same callback: the run was killed between the two saves of that step; "
                       f"{last.name} was written again from {chosen.name}")


def _resumable(scan: CheckpointScan) -> tuple[CheckpointScan, int]:
    """``scan`` without weights-only checkpoints (Lightning cannot resume a fit from them), and
    how many there were."""
    keep = [c for c in scan.complete if not lacks_training_state(c[0])]
    return CheckpointScan(scan.directory, keep, scan.incomplete), len(scan.complete) - len(keep)


def _resolve_last(folders: list[CheckpointFolder]) -> str:
    lasts = sorted({p for f in folders if f.path.is_dir() for p in f.path.iterdir()
                    if any(_is_last_name(cb, p) for cb in f.callbacks)})
    complete = []
    for p in lasts:
        problem = checkpoint_problem(p)
        if problem is not None:
            rank_zero_warn(f"ckpt_path=last: skipping incomplete checkpoint: {problem}")
        elif lacks_training_state(p):
            rank_zero_warn(f"ckpt_path=last: skipping {p}: saved with weights only, a fit cannot resume from it")
        else:
            complete.append(p)
    if lasts and not complete:
        raise IncompleteCheckpointError(
            f"ckpt_path=last: no last checkpoint in {', '.join(str(f.path) for f in folders)} is complete and resumable "
            "(see the warnings); use --ckpt_path auto to resume from the newest complete checkpoint of any name")
    if not complete:
        return "last"  # Lightning warns and starts a new run
    scan = CheckpointScan(folders[0].path, [(p, checkpoint_step(p), p.stat().st_mtime) for p in complete])
    newest = newest_complete([scan])
    assert newest is not None
    return str(newest[0])


def resolve_ckpt_path(trainer: Any, ckpt_path: Optional[str]) -> Optional[str]:
    """``ckpt_path`` of a fit as a path Lightning loads (or ``None``: a new run).

    ``"auto"``: the newest complete, resumable checkpoint of every ``ModelCheckpoint`` folder
    (largest ``global_step``, then the latest modification), else ``None``; per folder, sharded saves
    interrupted by a kill are finished or removed first (on global rank 0), and incomplete and
    untracked checkpoints are removed where a callback writing there names them, reported otherwise.
    Logs the folders scanned and the checkpoint chosen. ``"last"``: the newest complete
    ``last*.ckpt`` of those folders. A path: it must be complete (:class:`IncompleteCheckpointError`
    names what is missing).
    """
    if ckpt_path is None or ckpt_path in _LIGHTNING_CKPT_WORDS:
        return ckpt_path
    if ckpt_path not in ("auto", "last"):
        return str(require_complete(ckpt_path))
    folders = checkpoint_folders(trainer, ckpt_path)
    if rank_zero_only.rank == 0:
        for folder in folders:
            recover_interrupted_saves(folder.path, report=rank_zero_warn)
    if ckpt_path == "last":
        return _resolve_last(folders)
    scans = []
    for folder in folders:
        scan = scan_checkpoints(folder.path)
        _remove_or_report_incomplete(folder, scan.incomplete, ckpt_path)
        scans.append(_resumable(scan))
    scanned = ", ".join(f"{f.path} ({len(s.complete)} resumable" + (f", {n} weights-only" if n else "") + ")"
                        for f, (s, n) in zip(folders, scans))
    newest = newest_complete(s for s, _ in scans)
    if newest is None:
        rank_zero_info(f"ckpt_path=auto: no complete checkpoint to resume from in {scanned}; starting a new run")
        return None
    chosen, step = newest[0], newest[1]
    rank_zero_info(f"ckpt_path=auto: resuming from {chosen} (global step {step}), the newest of {scanned}")
    for folder in folders:
        _adopt_or_report_untracked(folder, chosen, step, ckpt_path)
        if rank_zero_only.rank == 0:
            _refresh_stale_last(folder, chosen, step)
    return str(chosen)


# ---------------------------------------------------------------------------------- callbacks
class ContinueCheckpointNames(Callback):
    """Keep writing the interrupted run's checkpoint names after ``ckpt_path="auto"`` / ``"last"``.

    * ``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` over the existing one only when that
      file is its restored ``last_model_path``; otherwise (its state was restored from a checkpoint
      saved before its own first ``last``, from a weights-only save, or not at all) Lightning
      versions the name and each restart adds a ``last-vN.ckpt``. Here such an existing ``last``
      file in the callback's folder becomes its ``last_model_path`` (decided on global rank 0), so
      the next save replaces it as in an uninterrupted run.
    * ModelCheckpoint never deletes the checkpoint a run resumed from (a user's own file, in
      general). One picked by ``auto`` (``resumed_from``) is one of this run's own checkpoints,
      tracked by the restored callback state, so it is handed back to the top-k bookkeeping;
      otherwise every restart would leave one behind.
    """

    def __init__(self, resumed_from: Optional[str] = None) -> None:
        self.resumed_from = resumed_from

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.resumed_from is not None and trainer.ckpt_path is not None and str(trainer.ckpt_path) == self.resumed_from:
            trainer.ckpt_path = None  # read by ModelCheckpoint._should_remove_checkpoint only, after the restore
        callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
        adopt = [self._existing_last(cb) if trainer.is_global_zero else None for cb in callbacks]
        adopt = trainer.strategy.broadcast(adopt)  # one decision for every rank: the names must agree
        for cb, path in zip(callbacks, adopt):
            if path is not None:
                cb.last_model_path = path

    @staticmethod
    def _existing_last(cb: ModelCheckpoint) -> Optional[str]:
        """The callback's fixed ``last`` file when it exists and is not what the callback tracks."""
        if not cb.save_last or cb.dirpath is None or "{" in cb.CHECKPOINT_NAME_LAST:
            return None
        last = cb.format_checkpoint_name({}, cb.CHECKPOINT_NAME_LAST)
        tracked = cb.last_model_path
        if not os.path.lexists(last) or tracked == last or (tracked and os.path.lexists(tracked)):
            return None
        return last


class EpochBoundaryResume(Callback):
    """Start the epoch after a restart at an epoch's last batch as Lightning starts any epoch.

    Lightning 2.6 restores a checkpoint saved after the last batch of epoch ``e`` by closing epoch
    ``e`` in ``FitLoop.reset`` (it marks it processed and completed) but keeps its restart stage
    "restarted mid-epoch", so ``FitLoop.on_advance_start`` then skips, for epoch ``e + 1``, what it
    does at the start of every other epoch: ``epoch_progress.increment_ready()`` /
    ``increment_started()`` and the ``on_train_epoch_start`` hooks. The run goes on correctly, but
    the next checkpoint saved at the end of epoch ``e + 1`` records that epoch as never started;
    restoring *that* checkpoint, Lightning does not close the epoch and trains it a second time under
    the same number, one epoch behind the data loader's own position (seen as a lost epoch in
    checkpoint names and a different data stream after two restarts on consecutive epoch ends).

    The callback clears the restart stage in ``on_train_start`` (after ``FitLoop.reset``, before the
    first ``on_advance_start``) exactly in that case, so the new epoch starts as in an uninterrupted
    run. ``qmuon-train`` always adds it; add it to your own ``Trainer`` when resuming mid-run with
    :class:`~qmuon_lightning.data.ByteLMDataModule` (whose loader refuses a restore where the two
    epoch counts disagree).
    """

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        fit_loop = trainer.fit_loop
        epoch_loop = fit_loop.epoch_loop
        if (fit_loop.restarted_mid_epoch and epoch_loop.restarted_on_train_batch_end
                and epoch_loop.batch_progress.is_last_batch):
            # FitLoop.reset has just closed the restored epoch (the same condition); what follows
            # is a new epoch, which on_advance_start counts and announces only without the stage.
            fit_loop.reset_restart_stage()
