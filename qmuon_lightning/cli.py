"""``qmuon-train``: train :class:`~qmuon_lightning.models.lm_module.DecoderLMModule` from YAML recipes.

Built on :class:`lightning.pytorch.cli.LightningCLI`::

    qmuon-train fit --config recipes/cpu/smoke.yaml                       # train
    qmuon-train fit --config recipes/cpu/smoke.yaml --ckpt_path last      # resume from last.ckpt
    qmuon-train fit --config recipes/cpu/smoke.yaml --ckpt_path auto      # resume if there is a checkpoint
    qmuon-train fit --config base.yaml --config run.yaml --model.optimizer.state_format=grasp4
    qmuon-train fit --config recipes/cpu/smoke.yaml --print_config        # the merged config
    qmuon-train validate --config recipes/cpu/smoke.yaml --ckpt_path last

(``python -m qmuon_lightning.cli`` is the same program.)

* Several ``--config`` files are merged left to right, then dotted overrides; YAML values may use
  omegaconf interpolation (``${data.seq_len}``, ``${trainer.default_root_dir}/checkpoints``),
  resolved after the merge (jsonargparse's ``omegaconf+`` mode), so an override of
  ``trainer.default_root_dir`` moves every path that refers to it.
* The optimizer is part of the model's config (``model.optimizer``: an
  :class:`~qmuon_lightning.models.lm_module.OptimizerSpec`) and is built in
  ``configure_optimizers``, after ``configure_model`` has sharded the model; LightningCLI's automatic
  ``optimizer:`` / ``lr_scheduler:`` sections are switched off because they would build the optimizer
  from unsharded parameters.
* ``data.seq_len`` sets ``model.max_seq_len``; the datamodule's resolved vocabulary (256 for bytes,
  ``meta.json``'s for ``data.source=tokens``, ``data.vocab_size`` for a ``.bin``) sets
  ``model.vocab_size`` when the classes are instantiated.
* A :class:`~qmuon_lightning.callbacks.summary.TrainSummary` is always added (``summary.filename``),
  and for ``fit`` :class:`~qmuon_lightning.callbacks.resume.EpochBoundaryResume`.
* A ``TensorBoardLogger`` in the config is skipped with a warning when tensorboard is not installed.
* ``strategy: qmuon_fsdp`` is available because this module imports ``qmuon_lightning.strategies``.
* ``fit --ckpt_path auto`` (the recipes set it): resume from the newest *complete* checkpoint in the
  ``ModelCheckpoint`` folder (single file or sharded directory), or start a new run when there is
  none; the same command restarts a killed run (by hand, ``torchrun --max-restarts``, a scheduler).
  ``last`` also skips incomplete files, and an explicit path that is incomplete fails naming what
  is missing (:mod:`qmuon_lightning.distributed.resume`, docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from jsonargparse import set_parsing_settings

try:  # not part of jsonargparse's public names; only used to restore the setting after parsing
    from jsonargparse._common import get_parsing_setting
except ImportError:  # pragma: no cover - depends on the jsonargparse version
    get_parsing_setting = None
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

from . import strategies as _strategies  # noqa: F401  (registers strategy names such as "qmuon_fsdp")
from .callbacks.resume import EpochBoundaryResume
from .callbacks.summary import TrainSummary
from .data.datamodule import ByteLMDataModule
from .distributed.process_group import exit_after_distributed_run
from .distributed.resume import (
    IncompleteCheckpointError, checkpoint_problem, checkpoint_step, scan_checkpoints,
    checkpoint_metadata, recover_interrupted_saves, require_complete, untracked_checkpoints,
)
from .models.lm_module import DecoderLMModule

__all__ = ["QMuonCLI", "main", "estimate_main", "merged_config", "resolve_ckpt_path"]


def _tensorboard_available() -> bool:
    from lightning.fabric.loggers.tensorboard import _TENSORBOARD_AVAILABLE, _TENSORBOARDX_AVAILABLE

    return bool(_TENSORBOARD_AVAILABLE or _TENSORBOARDX_AVAILABLE)


#: ``ckpt_path`` values Lightning resolves itself (``last`` is resolved here, skipping incomplete files).
_LIGHTNING_CKPT_WORDS = ("best", "hpc", "registry")


def _checkpoint_dir(trainer: Any, what: str) -> Path:
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    if not callbacks or callbacks[0].dirpath is None:
        raise ValueError(
            f"ckpt_path={what!r} looks for checkpoints in the ModelCheckpoint's folder, but this run has "
            f"{'no ModelCheckpoint' if not callbacks else 'a ModelCheckpoint without dirpath (its folder would depend on the logger version)'}"
            "; add trainer.callbacks: ModelCheckpoint with init_args.dirpath (the recipes use "
            "${trainer.default_root_dir}/checkpoints)")
    return Path(callbacks[0].dirpath)


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


def _named_by(callback: ModelCheckpoint, path: Path) -> bool:
    """Whether ``path`` carries a name this ModelCheckpoint gives its checkpoints (``last``, or its
    ``filename`` for the epoch and step in the name), so it was written by the interrupted run."""
    if path.name == f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}":
        return True
    m = re.search(r"epoch=(\d+)-step=(\d+)", path.name)
    if m is None:
        return False
    try:
        names = {os.path.realpath(callback.format_checkpoint_name({"epoch": int(m[1]), "step": int(m[2])}, ver=v))
                 for v in (None, 1, 2, 3)}
    except Exception:  # noqa: BLE001 - a filename needing other metrics: not provably ours
        return False
    return os.path.realpath(path) in names


def _remove_or_report_incomplete(trainer: Any, incomplete: list[tuple[Path, str]]) -> None:
    """Incomplete checkpoints (a save, or ModelCheckpoint's deletion of a replaced one, cut short by
    the kill) can never be resumed from: those named like this run's ModelCheckpoint names its own are
    removed, any other is reported; each with what is missing."""
    callback = next(cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint))
    for path, problem in incomplete:
        if rank_zero_only.rank == 0 and _named_by(callback, path):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            rank_zero_warn(f"ckpt_path=auto: removed an incomplete checkpoint left by the interrupted run: {problem}")
        else:
            rank_zero_warn(f"ckpt_path=auto: skipping incomplete checkpoint: {problem}")


def _adopt_or_report_untracked(trainer: Any, folder: Path, chosen: Path) -> None:
    """Checkpoints of the interrupted run that the restored ModelCheckpoint does not track: with
    ``monitor=None, save_top_k=1`` (keep the newest) one it wrote is deleted, as the interrupted
    run was about to; anything else is reported with its path."""
    callback = next(cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint))
    if callback.save_top_k == -1:
        return  # keeps every checkpoint: none is stale
    untracked = [p for p in untracked_checkpoints(folder, chosen) if checkpoint_problem(p) is None]
    adopt = [p for p in untracked if callback.monitor is None and callback.save_top_k == 1
             and _is_own_replaced_top1(callback, p)]
    if rank_zero_only.rank == 0:
        for p in adopt:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            rank_zero_warn(f"ckpt_path=auto: removed {p}: ModelCheckpoint(save_top_k=1) of the interrupted run had "
                           f"replaced it by a newer checkpoint and was killed before deleting it")
    rest = [p for p in untracked if p not in adopt]
    if rest:
        rank_zero_warn(
            f"ckpt_path=auto: {len(rest)} checkpoint(s) in {folder} are not tracked by the resumed ModelCheckpoint, "
            f"so it will not delete them: {', '.join(str(p) for p in rest)}. Delete them when you no longer need them.")


def resolve_ckpt_path(trainer: Any, ckpt_path: Optional[str]) -> Optional[str]:
    """``ckpt_path`` of ``qmuon-train fit`` as a path Lightning loads (or ``None``: a new run).

    ``"auto"``: the newest complete checkpoint in the ModelCheckpoint folder, else ``None``; sharded
    saves interrupted by a kill are finished or removed first (on global rank 0), incomplete and
    untracked checkpoints are adopted (deleted where ModelCheckpoint(save_top_k=1) had replaced them)
    or reported. ``"last"``: the newest complete ``last*.ckpt``. A path: it
    must be complete (:class:`IncompleteCheckpointError` names what is missing).
    """
    if ckpt_path is None or ckpt_path in _LIGHTNING_CKPT_WORDS:
        return ckpt_path
    if ckpt_path not in ("auto", "last"):
        return str(require_complete(ckpt_path))
    folder = _checkpoint_dir(trainer, ckpt_path)
    if rank_zero_only.rank == 0:
        recover_interrupted_saves(folder, report=rank_zero_warn)
    if ckpt_path == "last":
        lasts = sorted((p for p in folder.glob("last*.ckpt") if re.fullmatch(r"last(-v\d+)?\.ckpt", p.name)),
                       key=lambda p: p.stat().st_mtime, reverse=True) if folder.is_dir() else []
        complete = [p for p in lasts if checkpoint_problem(p) is None]
        for p in lasts:
            if p not in complete:
                rank_zero_warn(f"ckpt_path=last: skipping incomplete checkpoint: {checkpoint_problem(p)}")
        if lasts and not complete:
            raise IncompleteCheckpointError(
                f"ckpt_path=last: every last checkpoint in {folder} is incomplete (see the warnings); use "
                "--ckpt_path auto to resume from the newest complete checkpoint of any name")
        return str(complete[0]) if complete else "last"  # Lightning warns and starts a new run
    scan = scan_checkpoints(folder)
    _remove_or_report_incomplete(trainer, scan.incomplete)
    chosen = scan.newest
    if chosen is None:
        rank_zero_info(f"ckpt_path=auto: no complete checkpoint in {folder}; starting a new run")
        return None
    rank_zero_info(f"ckpt_path=auto: resuming from {chosen} (global step {checkpoint_step(chosen)})")
    _adopt_or_report_untracked(trainer, folder, chosen)
    return str(chosen)


class _AdoptResumedCheckpoint(Callback):
    """Lets ModelCheckpoint delete the checkpoint ``ckpt_path=auto`` resumed from once it is superseded.

    ModelCheckpoint never deletes the checkpoint a run resumed from (a user's own file, in general).
    One picked by ``auto`` is one of this run's own checkpoints, tracked by the restored callback
    state, so it is handed back to the top-k bookkeeping; otherwise every restart would leave one.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.ckpt_path is not None and str(trainer.ckpt_path) == self.path:
            trainer.ckpt_path = None  # read by ModelCheckpoint._should_remove_checkpoint only, after the restore


class QMuonCLI(LightningCLI):
    """LightningCLI for :class:`DecoderLMModule` + :class:`ByteLMDataModule` (see the module docstring)."""

    def __init__(self, args: ArgsType = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("parser_kwargs", {"parser_mode": "omegaconf+", "prog": "qmuon-train"})
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})  # a resumed run rewrites config.yaml
        super().__init__(
            DecoderLMModule, ByteLMDataModule, args=args, run=run, auto_configure_optimizers=False, **kwargs,
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        # omegaconf+ resolves interpolation once, on the merged config of every --config file and
        # override. That config is nested under the subcommand ("fit.trainer..."), so absolute paths
        # written in a recipe ("${trainer.default_root_dir}") are rewritten relative to where they
        # appear when each file loads (a global jsonargparse setting: restored afterwards).
        before = get_parsing_setting("omegaconf_absolute_to_relative_paths") if get_parsing_setting else False
        try:
            set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
        except TypeError as err:
            raise ImportError(
                "qmuon-train needs jsonargparse's omegaconf+ mode with absolute interpolation paths "
                f"(tested with jsonargparse 4.53): pip install -U 'jsonargparse[signatures]' ({err})") from err
        try:
            super().parse_arguments(parser, args)
        finally:
            set_parsing_settings(omegaconf_absolute_to_relative_paths=before)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(TrainSummary, "summary")
        parser.link_arguments("data.seq_len", "model.max_seq_len")
        # One mechanism for every source: the datamodule resolves its vocabulary when it is built
        # (256 for bytes, meta.json's for a qmuon-prepare corpus, data.vocab_size for a .bin) and
        # the model is built after it with that value.
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        # Recipes list a TensorBoardLogger beside the CSV one; it is optional: without tensorboard
        # (or tensorboardX) installed it is dropped with a warning instead of failing the run.
        if _tensorboard_available():
            return
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        loggers = cfg.get("trainer.logger")
        if not isinstance(loggers, list):
            return
        kept = [lg for lg in loggers if not str(getattr(lg, "class_path", "")).endswith("TensorBoardLogger")]
        if len(kept) != len(loggers):
            rank_zero_warn("tensorboard is not installed: the TensorBoardLogger of this config is skipped "
                           "(pip install tensorboard to get it); the other loggers run as configured")
            cfg["trainer.logger"] = kept or False

    def before_fit(self) -> None:
        # Resolve ckpt_path "auto" / "last" / an explicit path here, where the ModelCheckpoint's
        # folder is known and before Lightning opens anything.
        if not any(isinstance(cb, EpochBoundaryResume) for cb in self.trainer.callbacks):
            self.trainer.callbacks.append(EpochBoundaryResume())
        cfg = self.config_init[self.subcommand]
        requested = cfg.get("ckpt_path")
        cfg["ckpt_path"] = resolve_ckpt_path(self.trainer, requested)
        if requested == "auto" and cfg["ckpt_path"] is not None:
            self.trainer.callbacks.append(_AdoptResumedCheckpoint(cfg["ckpt_path"]))

    def instantiate_classes(self) -> None:
        # A value that parses but is inconsistent (d_model not divisible by n_heads, a missing
        # data file, ...) raises in a constructor; report it like a parse error, with the usage.
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, FileNotFoundError) as err:
            parser = self._parser(self.subcommand)
            parser.error(f"invalid configuration: {err}")


def main(args: ArgsType = None) -> None:
    """Console entry point of ``qmuon-train`` (``args``: a list of strings instead of ``sys.argv``).

    ``--estimate_memory`` anywhere in the arguments prints ``qmuon-estimate``'s table for the same
    ``--config`` files and overrides (``--budget 128GiB`` etc. pass through) and trains nothing."""
    argv = list(args) if isinstance(args, (list, tuple)) else (sys.argv[1:] if args is None else None)
    if argv is not None and "--estimate_memory" in argv:
        rest = [a for a in argv if a != "--estimate_memory"]
        if rest and rest[0] in ("fit", "validate", "test", "predict"):
            rest = rest[1:]
        estimate_main(rest)
        return
    with warnings.catch_warnings():
        # Byte windows come from memory: worker processes would only add start-up time on small runs.
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        QMuonCLI(args=args)
    # A rank of a multi-process run that succeeded leaves here without Python's finalization (see the
    # docstring for why); a single-process run returns normally.
    exit_after_distributed_run()



def merged_config(configs: Sequence[str], overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The merged ``qmuon-train fit`` config of ``--config`` files and dotted overrides: the same
    parser, interpolation and defaults as training (its ``--print_config`` output), nothing built."""
    import yaml

    args = ["fit"] + [a for c in configs for a in ("--config", c)] + list(overrides) + ["--print_config"]
    out = io.StringIO()
    argv0 = sys.argv
    sys.argv = [argv0[0] if argv0 else "qmuon-train"]  # LightningCLI warns when args and sys.argv both carry options
    try:
        with contextlib.redirect_stdout(out):
            QMuonCLI(args=args)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise SystemExit(f"the recipe does not parse (exit {e.code}); run qmuon-train {' '.join(args[:-1])} "
                             "--print_config to see why") from None
    finally:
        sys.argv = argv0
    return yaml.safe_load(out.getvalue())


def estimate_main(args: Sequence[str] | None = None) -> None:
    """Console entry point of ``qmuon-estimate`` (:mod:`qmuon_lightning.estimate`)."""
    from .estimate import run

    run(list(sys.argv[1:] if args is None else args), merged_config)


if __name__ == "__main__":
    main()
