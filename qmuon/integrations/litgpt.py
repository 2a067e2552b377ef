"""``qmuon-litgpt``: LitGPT's own training commands, trained by QMuon under ``qmuon_fsdp``::

    qmuon-litgpt pretrain --config tiny.yaml --qmuon.state_format int8 --qmuon.lr 0.02
    qmuon-litgpt pretrain --config tiny.yaml --resume true                 # LitGPT's resume
    qmuon-litgpt finetune_full checkpoints/my-model --data JSON --data.json_path train.json
    litgpt generate out/pretrain/final                                     # LitGPT reads the result

Everything but ``--qmuon.*`` goes to LitGPT's CLI (``litgpt.__main__.main``), so a LitGPT config,
``--optimizer AdamW --optimizer.lr ...`` and every other option mean what they mean there. What
changes:

* **Strategy.** The ``lightning.Fabric`` LitGPT builds gets a
  :class:`~qmuon.integrations.fabric.QMuonFabricStrategy` instead of ``"auto"`` / LitGPT's FSDP
  (on any number of processes, CPU or GPU). Its ``setup_optimizers`` replaces LitGPT's AdamW by
  :func:`~qmuon.build_optimizer` on the sharded model: hidden matrices (LitGPT's fused
  ``attn.qkv`` read as q, k, v: :mod:`qmuon.optim.litgpt_layouts`) go to Muon, the
  embedding, head, norms and biases to AdamW with LitGPT's AdamW settings (``--optimizer.lr`` is the
  AdamW lr; ``--qmuon.lr`` the Muon lr).
* **Learning rates.** LitGPT's pretrain loop writes one lr (its schedule of
  ``optimizer.defaults["lr"]``, the Muon lr) into every group; ``lr_ratios="hold"`` (the default
  here, ``update.lr_ratios``) gives the AdamW groups that lr times their configured ratio, ``adamw_lr / lr``. Each
  group's lr is logged after every optimizer step to LitGPT's logger as ``qmuon/lr_g<i>_<muon|adamw>``.
* **Checkpoints.** Consolidated files by default (``lit_model.pth`` is one file), so ``litgpt
  generate / evaluate / convert_from_litgpt`` read them; ``--qmuon.sharded_checkpoint true`` writes
  sharded directories instead (resumable by this launcher only, on any number of processes).

``--qmuon.<key> <value>`` (or ``=value``): any :class:`~qmuon.QMuonConfig` option (``state_format``,
``lr``, ``weight_decay``, a section's field as ``--qmuon.state.block_size 128``, ...; ``update.lr_ratios``
is ``hold`` here unless given), ``shard_policy``, ``sharded_checkpoint``. Values are read as YAML
scalars (``0.02``, ``true``, ``null``).

How LitGPT is reached (patches, here only, for the duration of the command): the command module's
``L`` (``import lightning as L``) is replaced by a proxy of ``lightning`` whose ``Fabric`` builds
the Fabric with the QMuon strategy; ``finetune_full``'s ``load_checkpoint`` becomes
``fabric.load_raw`` (LitGPT's own loader assumes LoRA names under a ModelParallelStrategy). Tested with LitGPT
:data:`TESTED_LITGPT_VERSIONS`; another version runs with a warning.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import types
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import yaml
from torch.utils.data import DataLoader
from typing_extensions import override

from qmuon.core.config import ConfigError, QMuonConfig, unknown_key_message
from qmuon.optim.qmuon import QMuon
from .fabric.sharding import resolve_policy
from .fabric.strategy import QMuonFabricStrategy

__all__ = ["main", "QMuonLitGPTStrategy"]

#: LitGPT versions this launcher (and its patch of ``<command module>.L``) was tested with.
TESTED_LITGPT_VERSIONS = ("0.5.13",)

#: Commands (LitGPT's names) -> the LitGPT module whose ``L.Fabric`` builds the run's Fabric.
#: ``finetune`` is LitGPT's alias of ``finetune_lora``.
COMMANDS = {
    "pretrain": "litgpt.pretrain",
    "finetune_full": "litgpt.finetune.full",
    "finetune_lora": "litgpt.finetune.lora",
    "finetune": "litgpt.finetune.lora",
}

#: Command modules whose ``load_checkpoint`` loads a full model (replaced while the command runs;
#: see :func:`patched_fabric`). LoRA's keeps LitGPT's, written for ModelParallelStrategy.
FULL_MODEL_LOADERS = ("litgpt.finetune.full",)

#: ``--qmuon.*`` keys that are the launcher's own (the rest are QMuonConfig options).
LAUNCHER_KEYS = ("shard_policy", "sharded_checkpoint")
#: Environment variable that carries the ``--qmuon.*`` options (JSON) to the processes Fabric starts.
OPTIONS_ENV = "QMUON_LITGPT_OPTIONS"

USAGE = f"""usage: qmuon-litgpt {{{','.join(COMMANDS)}}} [LitGPT arguments] [--qmuon.KEY VALUE ...]

Runs LitGPT's command with the qmuon_fsdp Fabric strategy and QMuon (see docs/litgpt.md).
--qmuon keys: QMuonConfig options ({', '.join(QMuonConfig.field_names())}; a section's field as
--qmuon.newton_schulz.dtype fp32; update.lr_ratios defaults to hold), shard_policy, sharded_checkpoint
(default false: consolidated lit_model.pth files).
"""


def split_qmuon_args(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """``argv`` without its ``--qmuon.KEY VALUE`` / ``--qmuon.KEY=VALUE`` pairs, and those pairs as
    a dict (values parsed as YAML scalars; ``--qmuon.SECTION.FIELD`` fills a section's dict). Unknown keys
    raise ``SystemExit`` naming the closest valid one."""
    rest: list[str] = []
    opts: dict[str, Any] = {}
    accepted = (*QMuonConfig.field_names(), *LAUNCHER_KEYS)
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--qmuon."):
            rest.append(a)
            i += 1
            continue
        key, eq, value = a[len("--qmuon."):].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise SystemExit(f"qmuon-litgpt: --qmuon.{key} needs a value")
            value = args[i + 1]
            i += 1
        i += 1
        head, dot, leaf = key.partition(".")
        if head not in accepted or (dot and head in LAUNCHER_KEYS):
            raise SystemExit(f"qmuon-litgpt: --qmuon.{key}: {unknown_key_message(key, list(accepted))}")
        parsed = yaml.safe_load(value) if value != "" else None
        if dot:
            opts[head] = {**(opts.get(head) or {}), leaf: parsed}
        else:
            opts[key] = parsed
    return rest, opts


def _is_plain_loader(value: Any) -> bool:
    """A DataLoader (possibly Fabric-wrapped) without ``state_dict``: it has no state to save."""
    inner = getattr(value, "_dataloader", value)
    return isinstance(inner, DataLoader) and not callable(getattr(inner, "state_dict", None))


class QMuonLitGPTStrategy(QMuonFabricStrategy):
    """The Fabric strategy of a ``qmuon-litgpt`` run: :class:`QMuonFabricStrategy` that

    * logs each parameter group's lr after every optimizer step to the Fabric's loggers
      (``qmuon/lr_g<i>_<kind>`` at the optimizer's step count, which a resumed run continues);
    * leaves plain ``DataLoader`` objects out of checkpoints. LitGPT's pretrain state holds its
      ``train_dataloader``; a loader with ``state_dict`` (LitData's ``StreamingDataLoader``) is saved
      as LitGPT saves it, but a plain one would be pickled whole into ``lit_model.pth``, so that
      ``litgpt generate`` could not open the file without the data code importable (and resuming
      never reads it back: LitGPT iterates its own loader).
    """

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: Any = None) -> None:
        kept = {k: v for k, v in state.items() if not _is_plain_loader(v)}
        super().save_checkpoint(path, kept, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: Any = None) -> Any:
        if not isinstance(state, dict):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        kept = {k: v for k, v in state.items() if not _is_plain_loader(v)}
        self._loading = True  # torch's state-dict loading runs one lr=0 step to create the state: not logged
        try:
            out = super().load_checkpoint(path, kept, strict=strict, weights_only=weights_only)
        finally:
            self._loading = False
        state.update(kept)  # the loaded plain values (iter_num, step_count, ...)
        return out

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fabric_ref: weakref.ref[Any] | None = None
        self._loading = False

    def setup_optimizer(self, optimizer: Any) -> Any:
        new = super().setup_optimizer(optimizer)
        if isinstance(new, QMuon):
            new.register_step_post_hook(self._log_group_lrs)
        return new

    def _log_group_lrs(self, optimizer: QMuon, *_: Any) -> None:
        fabric = self._fabric_ref() if self._fabric_ref is not None else None
        if fabric is None or not fabric.loggers or self._loading:
            return
        step = _optimizer_steps(optimizer)
        metrics = {f"qmuon/lr_g{gi}_{'muon' if g['use_muon'] else 'adamw'}": float(g["lr"])
                   for gi, g in enumerate(optimizer.param_groups)}
        fabric.log_dict(metrics, step=step)


def _optimizer_steps(optimizer: QMuon) -> int:
    """Optimizer steps taken (AdamW's per-parameter ``step``, saved and restored with the state)."""
    for g in optimizer.param_groups:
        if not g["use_muon"]:
            for p in g["params"]:
                st = optimizer.state.get(p)
                if st and "step" in st:
                    return int(float(st["step"]))
    return 0


def _strategy_kwargs(opts: dict[str, Any]) -> dict[str, Any]:
    optimizer_kwargs = {k: v for k, v in opts.items() if k not in LAUNCHER_KEYS}
    # LitGPT's loops write one lr into every group: keep each group's ratio to the Muon lr
    optimizer_kwargs["update"] = {"lr_ratios": "hold", **(optimizer_kwargs.get("update") or {})}
    try:
        QMuonConfig.from_kwargs(optimizer_kwargs)
    except ConfigError as e:
        raise SystemExit(f"qmuon-litgpt: {e}") from None
    policy = opts.get("shard_policy", "auto")
    resolve_policy(policy)
    sharded = opts.get("sharded_checkpoint", False)
    if not isinstance(sharded, bool):
        raise SystemExit(f"qmuon-litgpt: --qmuon.sharded_checkpoint takes true or false, got {sharded!r}")
    return {"optimizer": "qmuon", "optimizer_kwargs": optimizer_kwargs, "shard_policy": policy,
            "save_distributed_checkpoint": sharded}


@contextmanager
def patched_fabric(module: types.ModuleType, strategy_kwargs: dict[str, Any]) -> Iterator[None]:
    """Within the block, ``module.L.Fabric(...)`` (LitGPT's ``import lightning as L``) builds the
    Fabric with :class:`QMuonLitGPTStrategy` (``strategy_kwargs``) instead of the strategy LitGPT
    chose (``"auto"``, or its FSDP on several devices)."""
    import lightning

    real_fabric = lightning.Fabric

    def fabric(*args: Any, strategy: Any = None, **kwargs: Any) -> Any:
        if strategy not in (None, "auto") and type(strategy).__name__ not in ("FSDPStrategy", "ModelParallelStrategy"):
            warnings.warn(f"qmuon-litgpt: LitGPT asked for strategy {strategy!r}; the run uses qmuon_fsdp instead")
        qstrategy = QMuonLitGPTStrategy(**strategy_kwargs)
        out = real_fabric(*args, strategy=qstrategy, **kwargs)
        qstrategy._fabric_ref = weakref.ref(out)
        return out

    proxy = types.ModuleType("lightning", doc="lightning, with Fabric building the qmuon_fsdp strategy (qmuon-litgpt)")
    proxy.__getattr__ = lambda name: getattr(lightning, name)  # type: ignore[method-assign]
    proxy.Fabric = fabric  # type: ignore[attr-defined]
    before = module.__dict__.get("L")
    if before is not lightning:
        raise RuntimeError(
            f"qmuon-litgpt: {module.__name__} does not use `import lightning as L` (found {before!r}); this LitGPT "
            f"version is not one the launcher knows (tested: {', '.join(TESTED_LITGPT_VERSIONS)})")
    module.L = proxy  # type: ignore[attr-defined]
    loader = module.__dict__.get("load_checkpoint")
    if module.__name__ in FULL_MODEL_LOADERS:
        # litgpt.utils.load_checkpoint's ModelParallelStrategy branch renames every weight to
        # `.linear.weight` (LoRA's names), so it cannot load a full model into a ModelParallelStrategy
        # (ours); Fabric's load_raw does what its FSDPStrategy branch does.
        module.load_checkpoint = _load_full_model  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module.L = before  # type: ignore[attr-defined]
        if module.__name__ in FULL_MODEL_LOADERS:
            module.load_checkpoint = loader  # type: ignore[attr-defined]


def _load_full_model(fabric: Any, model: Any, checkpoint_path: Any, strict: bool = True) -> None:
    """``litgpt.utils.load_checkpoint`` for a full (non-LoRA) model under the QMuon strategy:
    ``fabric.load_raw`` (a consolidated ``lit_model.pth`` into the sharded model)."""
    fabric.load_raw(checkpoint_path, model, strict=strict)


def _litgpt_version() -> str:
    try:
        return importlib.metadata.version("litgpt")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit("qmuon-litgpt needs LitGPT: pip install litgpt (tested with "
                         f"{', '.join(TESTED_LITGPT_VERSIONS)}); then pip install qmuon-lightning") from None


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``qmuon-litgpt`` (also ``python -m qmuon.integrations.litgpt``).

    LitGPT's CLI reads ``sys.argv`` (and re-reads it to save ``hyperparameters.yaml``), and
    Fabric's launcher starts the other processes with ``sys.executable`` and ``sys.argv``; so
    ``sys.argv`` becomes ``[this program, command, LitGPT arguments]`` and the ``--qmuon.*``
    options reach the other processes through the environment (:data:`OPTIONS_ENV`)."""
    full = list(sys.argv if argv is None else [sys.argv[0], *argv])
    args = full[1:]
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return
    command = args[0]
    if command not in COMMANDS:
        raise SystemExit(f"qmuon-litgpt: unknown command {command!r}; one of {', '.join(COMMANDS)} (LitGPT's names)\n"
                         + USAGE)
    version = _litgpt_version()
    if version not in TESTED_LITGPT_VERSIONS:
        warnings.warn(f"qmuon-litgpt was tested with litgpt {', '.join(TESTED_LITGPT_VERSIONS)}; found {version}")
    if importlib.util.find_spec("requests") is None:
        # litgpt.__main__.main calls jsonargparse's set_config_read_mode(urls_enabled=True), which
        # imports requests; litgpt 0.5.13 lists it only in its `extra` extra, so `litgpt` fails too.
        raise SystemExit("qmuon-litgpt: LitGPT's CLI needs `requests` (litgpt 0.5.13 lists it only in litgpt[extra]): "
                         "pip install requests")
    litgpt_args, opts = split_qmuon_args(args[1:])
    inherited = json.loads(os.environ.get(OPTIONS_ENV) or "{}")
    opts = {**inherited, **opts}
    strategy_kwargs = _strategy_kwargs(opts)
    os.environ[OPTIONS_ENV] = json.dumps(opts)
    module = importlib.import_module(COMMANDS[command])
    litgpt_main = importlib.import_module("litgpt.__main__").main
    before = sys.argv
    sys.argv = [full[0], command, *litgpt_args]
    try:
        with patched_fabric(module, strategy_kwargs):
            litgpt_main()
    finally:
        sys.argv = before


if __name__ == "__main__":
    main()
