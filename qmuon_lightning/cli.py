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
* ``fit --ckpt_path auto`` (the recipes set it): resume from the newest *complete* checkpoint in
  every ``ModelCheckpoint`` callback's folder (single file or sharded directory), or start a new run
  when there is none; the same command restarts a killed run (by hand, ``torchrun --max-restarts``,
  a scheduler), and the callbacks continue their checkpoint names (no ``last-v1.ckpt``). ``last``
  also skips incomplete files, and an explicit path that is incomplete fails naming what is missing
  (:mod:`qmuon_lightning.callbacks.resume`, :mod:`qmuon.distributed.resume`,
  docs/reliability.md).
* The ``qmuon`` and ``qmuon_lightning`` loggers print their INFO records (the routing table, what
  ``auto`` options chose) on rank 0 while the program runs; the library itself prints nothing.
* The progress bar (unless one is configured or ``enable_progress_bar: false``) is
  from :func:`~qmuon_lightning.callbacks.progress.default_progress_bar`: it shows the epochs the run will
  reach (``max_steps`` over the epoch length), not ``max_epochs - 1``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from typing import Any, Sequence

try:  # a core dependency; missing only where qmuon-lightning was installed with --no-deps (LitGPT's environment)
    from jsonargparse import set_parsing_settings
except ImportError as _err:  # pragma: no cover - depends on the environment
    raise ImportError("qmuon-train needs jsonargparse >= 4.53: pip install -U 'jsonargparse[signatures]>=4.53' "
                      f"({_err})") from _err

try:  # not part of jsonargparse's public names; only used to restore the setting after parsing
    from jsonargparse._common import get_parsing_setting
except ImportError:  # pragma: no cover - depends on the jsonargparse version
    get_parsing_setting = None
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn

from . import strategies as _strategies  # noqa: F401  (registers strategy names such as "qmuon_fsdp")
from .callbacks.progress import default_progress_bar
from .callbacks.resume import ContinueCheckpointNames, EpochBoundaryResume, resolve_ckpt_path
from .callbacks.summary import TrainSummary
from .data.datamodule import ByteLMDataModule
from qmuon.distributed.process_group import exit_after_distributed_run
from .models.lm_module import DecoderLMModule

__all__ = ["QMuonCLI", "main", "estimate_main"]


def _tensorboard_available() -> bool:
    from lightning.fabric.loggers.tensorboard import _TENSORBOARD_AVAILABLE, _TENSORBOARDX_AVAILABLE

    return bool(_TENSORBOARD_AVAILABLE or _TENSORBOARDX_AVAILABLE)


def cli_dependency_problem() -> str | None:
    """Why ``qmuon-train`` cannot parse its configs in this environment (``None`` when it can): it
    needs jsonargparse's ``omegaconf_absolute_to_relative_paths`` setting (jsonargparse >= 4.53, a core
    dependency). LitGPT 0.5.x pins jsonargparse <= 4.41, so its environment (docs/litgpt.md) lacks it."""
    import inspect

    if "omegaconf_absolute_to_relative_paths" in inspect.signature(set_parsing_settings).parameters:
        return None
    import importlib.metadata

    try:
        version = importlib.metadata.version("jsonargparse")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        version = "unknown"
    return (f"qmuon-train needs jsonargparse >= 4.53 (omegaconf+ mode with absolute interpolation paths); this "
            f"environment has jsonargparse {version}: pip install -U 'jsonargparse[signatures]>=4.53'. LitGPT "
            "0.5.x caps jsonargparse at 4.41, so qmuon-train and LitGPT need separate environments "
            "(docs/litgpt.md)")


#: The packages whose INFO records the program shows (the library and the kit each log under their name).
SHOWN_LOGGERS = ("qmuon", "qmuon_lightning")


class _StdoutOnRankZero(logging.StreamHandler):
    """Prints ``%(message)s`` to the current ``sys.stdout`` (looked up per record, so a replaced
    stream, such as pytest's capture, is followed) on global rank 0 only."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)
        self.setFormatter(logging.Formatter("%(message)s"))
        self.addFilter(lambda record: rank_zero_only.rank == 0)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


@contextlib.contextmanager
def show_qmuon_logs(level: int = logging.INFO) -> Any:
    """Inside the block, the :data:`SHOWN_LOGGERS` print their records at ``level`` and above on
    rank 0 (the routing table ``build_optimizer`` logs at INFO, ...); afterwards they are as before,
    so a program that embeds the CLI keeps its own logging set-up."""
    handler = _StdoutOnRankZero()
    saved = []
    for name in SHOWN_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        if logger.getEffectiveLevel() > level:
            logger.setLevel(level)
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger, before in saved:
            logger.removeHandler(handler)
            logger.setLevel(before)


class QMuonCLI(LightningCLI):
    """LightningCLI for :class:`DecoderLMModule` + :class:`ByteLMDataModule` (see the module docstring)."""

    def __init__(self, args: ArgsType = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("parser_kwargs", {"parser_mode": "omegaconf+", "prog": "qmuon-train"})
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})  # a resumed run rewrites config.yaml
        with show_qmuon_logs():
            super().__init__(
                DecoderLMModule, ByteLMDataModule, args=args, run=run, auto_configure_optimizers=False, **kwargs,
            )

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        # omegaconf+ resolves interpolation once, on the merged config of every --config file and
        # override. That config is nested under the subcommand ("fit.trainer..."), so absolute paths
        # written in a recipe ("${trainer.default_root_dir}") are rewritten relative to where they
        # appear when each file loads (a global jsonargparse setting: restored afterwards).
        problem = cli_dependency_problem()
        if problem:
            raise ImportError(problem)
        before = get_parsing_setting("omegaconf_absolute_to_relative_paths") if get_parsing_setting else False
        set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
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
        if requested in ("auto", "last"):
            # the run continues its own folders: the callbacks keep their checkpoint names
            self.trainer.callbacks.append(ContinueCheckpointNames(cfg["ckpt_path"] if requested == "auto" else None))

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        # The default progress bar, with the epoch count the run will reach (Lightning's shows
        # "Epoch 0/-2" under max_epochs=-1 and a step-bounded run); a configured one is kept.
        trainer_cfg = self._get(self.config_init, "trainer", default={}) or {}
        callbacks = kwargs.get("callbacks", trainer_cfg.get("callbacks"))
        callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, list) else [callbacks]
        if trainer_cfg.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            kwargs["callbacks"] = callbacks + [default_progress_bar()]
        return super().instantiate_trainer(**kwargs)

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
