"""``QuantizedStateCheckpoint``: what a Lightning checkpoint of a QMuon run needs beyond Lightning.

Lightning already saves ``QMuon.state_dict()`` (the quantized momentum as plain tensors) in every
checkpoint and restores it on resume. What it cannot do, and this callback adds:

1. **A manifest** (``checkpoint["qmuon"]``): package and state-layout versions, world size, and per
   QMuon optimizer and parameter group the state format, block size, GRASP rank / grid block,
   rounding, fused parts and parameter names and shapes. On resume it is checked against the
   optimizer the run just built *before* Lightning loads the optimizer state, and a mismatch is
   an error that names it (``QMuon.load_state_dict`` would otherwise silently convert int8
   momentum into, say, grasp4; pass ``allow_format_change=True`` to accept that conversion).
2. **A standalone quantized-state file per save** (``<dirpath>/qmuon-state-step=<N>.pt``): the
   manifest and the optimizer state dicts only, loadable with ``torch.load(weights_only=True)`` and
   with :func:`load_quantized_state` outside Lightning (to inspect the quantized state or move it
   into another training loop without the model weights). Written atomically (temporary file in the same folder, ``fsync``, ``os.replace``,
   ``fsync`` of the folder), so a crash mid-save leaves the previous file whole; the newest
   ``keep_last_k`` are kept.
3. **fp32 export** (:meth:`QuantizedStateCheckpoint.export_fp32_momentum`,
   :func:`export_fp32_momentum`): the Muon momentum dequantized to fp32, by parameter name and as a
   ``torch.optim.Muon`` state dict, for migrating to another optimizer.

Sharded runs (parameters are DTensors, e.g. FSDP2 via ``ModelParallelStrategy``): the strategy's
distributed checkpoint already stores each rank's rows of the quantized state; the manifest is
added as usual (rank 0 writes the checkpoint metadata). The standalone file is skipped unless
``gather_sharded=True``, which gathers the full state on every rank (collective; the full
quantized state must fit in each rank's memory) and writes one consolidated file from rank 0.

Weights-only saves (``ModelCheckpoint(save_weights_only=True)``, ``save_checkpoint(weights_only=True)``)
hold no optimizer state, and Lightning does not call callbacks' ``on_save_checkpoint`` for them:
neither the manifest nor a standalone file is written then.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from typing import IO, Any, Mapping, Sequence

import torch
from torch import Tensor, nn

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from qmuon.core.config import FORMAT_OVERRIDES, ResumeMismatch, check_resume, param_group_view, plain_coefficients
from qmuon.core.newton_schulz import MUON_COEFFICIENTS, resolve_schedule
from qmuon.distributed import safe_load
from qmuon.optim.qmuon import FORMAT_VERSION, QMuon
from qmuon.quant import state as qstate
from ._common import is_dtensor, param_names, qmuon_optimizers

__all__ = [
    "QuantizedStateCheckpoint",
    "QuantizedStateMismatchError",
    "load_quantized_state",
    "export_fp32_momentum",
]

#: Key of the manifest in a Lightning checkpoint dict.
MANIFEST_KEY = "qmuon"
#: Version of the manifest layout itself.
MANIFEST_VERSION = 1
_FILE_RE = re.compile(r"^qmuon-state-step=(\d+)\.pt$")
_TMP_PREFIX = ".qmuon-state-"


class QuantizedStateMismatchError(ValueError):
    """A checkpoint's quantized optimizer state does not match the optimizer of this run."""


def _package_version() -> str:
    from qmuon import __version__

    return __version__


# ---------------------------------------------------------------------------------------- manifest
def _group_entry(gi: int, group: dict[str, Any], names: Mapping[int, str]) -> dict[str, Any]:
    params = [{"name": names.get(id(p), f"group{gi}.param{i}"), "shape": [int(s) for s in p.shape]}
              for i, p in enumerate(group["params"])]
    entry: dict[str, Any] = {"index": gi, "use_muon": bool(group["use_muon"]), "params": params}
    if not group["use_muon"] and group.get("state_format") is not None:
        entry["adamw_state_format"] = group["state_format"]  # informational: QMuon.load_state_dict converts
    if group["use_muon"]:
        opts = qstate.format_options(group)
        entry.update({
            "state_format": group["state_format"], "block_size": opts.block_size, "rank": opts.rank,
            "grid_block": opts.grid_block, "rounding": group["rounding"], "seed": int(group["seed"]),
            "momentum": float(group["momentum"]), "parts": list(group["parts"]) if group["parts"] else None,
            "parts_axis": int(group.get("parts_axis", 0)), "orientation": group.get("orientation", "out_in"),
            "ns_input": group.get("ns_input", "bf16"), "ns_dtype": group.get("ns_dtype", "auto"),
            "ns_coefficients": plain_coefficients(group.get("ns_coefficients")), "ns_steps": int(group["ns_steps"]),
            # Parameters promoted to a safer format (the fidelity guard): informational; the
            # optimizer state carries them and QMuon.load_state_dict restores them.
            "format_overrides": {params[i]["name"]: dict(layout)
                                 for i, layout in sorted((group.get(FORMAT_OVERRIDES) or {}).items())},
        })
    return entry


def build_manifest(optimizers: Sequence[tuple[int, QMuon]], module: nn.Module | None = None, *,
                   world_size: int = 1, global_step: int | None = None) -> dict[str, Any]:
    """The manifest of ``optimizers`` (``(index in trainer.optimizers, QMuon)`` pairs): plain
    Python values only."""
    sharded = any(is_dtensor(p) for _, opt in optimizers for g in opt.param_groups for p in g["params"])
    return {
        "manifest_version": MANIFEST_VERSION,
        "package_version": _package_version(),
        "state_layout_version": FORMAT_VERSION,
        "torch_version": str(torch.__version__),
        "world_size": int(world_size),
        "sharded": bool(sharded),
        "global_step": global_step,
        "optimizers": [
            {"index": idx, "class": type(opt).__name__,
             "config": opt.config.to_dict() if hasattr(opt, "config") else None,
             "groups": [_group_entry(gi, g, param_names(module, opt)) for gi, g in enumerate(opt.param_groups)]}
            for idx, opt in optimizers
        ],
    }


def validate_manifest(manifest: Mapping[str, Any], optimizers: Sequence[tuple[int, QMuon]],
                      module: nn.Module | None = None, *, allow_format_change: bool = False,
                      source: str = "the checkpoint") -> list[str]:
    """Check a saved manifest against the optimizers of this run.

    Raises :class:`QuantizedStateMismatchError` naming every mismatch (newer layout, missing
    optimizer, group or parameter count, parameter shape, and, unless ``allow_format_change``,
    state format / block size / GRASP rank / grid block) and the fix. Returns notes for changes
    that are allowed (format conversions with ``allow_format_change``, another package version).
    """
    problems: list[str] = []
    notes: list[str] = []
    mv = int(manifest.get("manifest_version", 0))
    if mv > MANIFEST_VERSION:
        problems.append(f"its qmuon manifest has version {mv}, newer than this qmuon_lightning reads ({MANIFEST_VERSION})"
                        "; upgrade qmuon_lightning")
    lv = int(manifest.get("state_layout_version", 0))
    if lv > FORMAT_VERSION:
        problems.append(f"its optimizer state layout version is {lv}, newer than this qmuon_lightning's "
                        f"({FORMAT_VERSION}); upgrade qmuon_lightning to load it")
    if manifest.get("package_version") != _package_version():
        notes.append(f"saved by qmuon_lightning {manifest.get('package_version')}, loading with {_package_version()}")
    current = dict(optimizers)
    saved_indices = [o["index"] for o in manifest.get("optimizers", [])]
    for idx in current:
        if idx not in saved_indices:
            problems.append(f"trainer.optimizers[{idx}] is a QMuon but the checkpoint has no QMuon state at that index")
    for saved_opt in manifest.get("optimizers", []):
        idx = saved_opt["index"]
        opt = current.get(idx)
        where = f"optimizer {idx}"
        if opt is None:
            problems.append(f"{where} was a {saved_opt.get('class', 'QMuon')} when saved but trainer.optimizers[{idx}] "
                            "is not a QMuon in this run; configure_optimizers must return the same optimizers")
            continue
        names = param_names(module, opt)
        cur_groups = [_group_entry(gi, g, names) for gi, g in enumerate(opt.param_groups)]
        if len(cur_groups) != len(saved_opt["groups"]):
            problems.append(f"{where} has {len(saved_opt['groups'])} parameter groups in the checkpoint and "
                            f"{len(cur_groups)} now; build the optimizer the same way (same routing rules)")
            continue
        for saved, cur in zip(saved_opt["groups"], cur_groups):
            gw = f"{where}, param group {saved['index']}"
            if saved["use_muon"] != cur["use_muon"]:
                kind = {True: "Muon", False: "AdamW"}
                problems.append(f"{gw} was a {kind[saved['use_muon']]} group when saved and is a {kind[cur['use_muon']]} "
                                "group now; build the optimizer with the same routing")
                continue
            if len(saved["params"]) != len(cur["params"]):
                problems.append(f"{gw} held {len(saved['params'])} parameters when saved and holds {len(cur['params'])} now")
                continue
            for sp, cp in zip(saved["params"], cur["params"]):
                if list(sp["shape"]) != list(cp["shape"]):
                    problems.append(f"{gw}: parameter {sp['name']!r} was {tuple(sp['shape'])} when saved but "
                                    f"{cp['name']!r} is {tuple(cp['shape'])} now; the checkpoint belongs to a "
                                    "different model or parameter order")
            if not saved["use_muon"]:
                continue
            first = saved["params"][0]["name"] if saved["params"] else "-"
            try:
                note = check_resume(saved, cur, where=f"{gw} ({len(saved['params'])} matrices, first {first!r})",
                                    allow_format_change=allow_format_change)
            except ResumeMismatch as e:
                problems.append(str(e))
                continue
            if note:
                notes.append(note)
    if problems:
        raise QuantizedStateMismatchError(
            f"cannot resume from {source}:\n  - " + "\n  - ".join(problems))
    return notes


# ---------------------------------------------------------------------------------------- files
def _serialize(obj: Any, f: IO[bytes]) -> None:
    """Write ``obj`` to the open file ``f`` (a seam for tests that simulate a crash mid-write)."""
    torch.save(obj, f)


def _fsync_dir(path: str) -> None:
    if os.name != "posix":  # pragma: no cover - directories cannot be opened for fsync on Windows
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` so that ``path`` holds either its old content or all of ``obj``.

    Writes a temporary file in the same folder, flushes and ``fsync``s it, ``os.replace``s it onto
    ``path`` (atomic on POSIX and Windows for one filesystem) and ``fsync``s the folder so the
    rename survives a power loss. On any error the temporary file is removed and the error raised.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            _serialize(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


def standalone_files(dirpath: str | os.PathLike) -> list[str]:
    """Complete standalone files in ``dirpath``, oldest first (by modification time, then step).

    Temporary files of an interrupted save never match, so a crash cannot make them "latest"."""
    dirpath = os.fspath(dirpath)
    if not os.path.isdir(dirpath):
        return []
    found = []
    for name in os.listdir(dirpath):
        m = _FILE_RE.match(name)
        if m:
            full = os.path.join(dirpath, name)
            found.append((os.stat(full).st_mtime_ns, int(m.group(1)), full))
    return [f for _, _, f in sorted(found)]


def load_quantized_state(path: str | os.PathLike, optimizers: QMuon | Sequence[tuple[int, QMuon]],
                         module: nn.Module | None = None, *, allow_format_change: bool = False) -> list[str]:
    """Validate a standalone file's manifest against ``optimizers`` and load their state.

    ``optimizers``: one QMuon (taken as index 0) or ``(index, QMuon)`` pairs. Returns the notes of
    :func:`validate_manifest`; raises :class:`QuantizedStateMismatchError` before loading anything.
    """
    opts = [(0, optimizers)] if isinstance(optimizers, QMuon) else list(optimizers)
    blob = safe_load.load(os.fspath(path), map_location="cpu")  # weights_only=True; refused with why, never run
    notes = validate_manifest(blob["manifest"], opts, module, allow_format_change=allow_format_change,
                              source=os.fspath(path))
    states = {int(i): sd for i, sd in blob["optimizer_states"].items()}
    for idx, opt in opts:
        opt.load_state_dict(states[idx])
    return notes


# ---------------------------------------------------------------------------------------- fp32 export
def _full_state_dict(opt: QMuon) -> dict[str, Any]:
    if any(is_dtensor(v) for st in opt.state.values() for v in st.values()):
        from qmuon.distributed.checkpoint import full_state_dict

        return full_state_dict(opt)  # collective
    return opt.state_dict()


def _torch_coefficients(group: dict[str, Any], gi: int) -> tuple[float, float, float]:
    """The group's NS coefficients as torch.optim.Muon takes them: one ``(a, b, c)`` for every
    iteration. A per-iteration schedule (e.g. ``"polar_express"``) has no such form: torch's
    default is exported instead, with a warning (the momentum itself is exact either way)."""
    sched = resolve_schedule(group["ns_coefficients"], int(group["ns_steps"]))
    if len(set(sched.coefficients)) == 1 and sched.norm_safety == 1.0:
        return sched.coefficients[0]
    rank_zero_warn(f"param group {gi}: ns_coefficients={group['ns_coefficients']!r} is a per-iteration schedule, which "
                   f"torch.optim.Muon cannot run; the exported group uses torch's default {MUON_COEFFICIENTS}")
    return MUON_COEFFICIENTS


def export_fp32_momentum(optimizer: QMuon, path: str | os.PathLike | None, module: nn.Module | None = None, *,
                         write: bool = True) -> dict[str, Any]:
    """Dequantize every Muon momentum of ``optimizer`` to fp32 and save it (atomically) at ``path``.

    The file holds ``{"format": "qmuon_fp32_momentum", "version": 1, "param_names": [...],
    "momentum": {name: fp32 tensor shaped like the parameter}, "torch_muon": state_dict}``, where
    ``torch_muon`` is a :class:`torch.optim.Muon` state dict with one group per QMuon Muon group, in
    the same order, parameters in ``param_names`` order (build ``torch.optim.Muon`` with those
    groups and call ``load_state_dict(blob["torch_muon"])``). Parameters that never stepped have
    no momentum yet and are left out of both, as torch leaves them out. AdamW groups already use
    ``torch.optim.AdamW``'s state layout and are not part of this export.

    Sharded parameters: the state is gathered first (collective; call on every rank) and only
    global rank 0 writes (``write`` is ignored elsewhere). Returns the blob.
    """
    sd = _full_state_dict(optimizer)
    names = param_names(module, optimizer)
    momentum: dict[str, Tensor] = {}
    order: list[str] = []
    t_state: dict[int, dict[str, Tensor]] = {}
    t_groups: list[dict[str, Any]] = []
    index = 0
    for gi, (group, saved) in enumerate(zip(optimizer.param_groups, sd["param_groups"])):
        if not group["use_muon"]:
            continue
        ids: list[int] = []
        for i, (p, pid) in enumerate(zip(group["params"], saved["params"])):
            view = param_group_view(group, i)  # a promoted parameter's own format
            fmt, opts = qstate.get_format(view["state_format"]), qstate.format_options(view)
            name = names.get(id(p), f"group{gi}.param{pid}")
            order.append(name)
            ids.append(index)
            st = sd["state"].get(pid)
            if st:
                rows = int(p.shape[0])
                cols = p.numel() // rows
                m = fmt.dequantize({k: v for k, v in st.items()}, opts, cols).float().reshape(p.shape).cpu().contiguous()
                momentum[name] = m
                t_state[index] = {"momentum_buffer": m}
            index += 1
        t_groups.append({
            "lr": group["lr"], "weight_decay": group["weight_decay"], "momentum": group["momentum"],
            "nesterov": group["nesterov"], "ns_coefficients": _torch_coefficients(group, gi), "eps": group["eps"],
            "ns_steps": group["ns_steps"], "adjust_lr_fn": group["adjust_lr_fn"], "params": ids,
        })
    blob = {"format": "qmuon_fp32_momentum", "version": 1, "param_names": order, "momentum": momentum,
            "torch_muon": {"state": t_state, "param_groups": t_groups}}
    is_rank0 = not torch.distributed.is_available() or not torch.distributed.is_initialized() \
        or torch.distributed.get_rank() == 0
    if write and path is not None and is_rank0:
        atomic_torch_save(blob, path)
    return blob


# ---------------------------------------------------------------------------------------- callback
class QuantizedStateCheckpoint(Callback):
    """Manifest + validation on resume, atomic standalone quantized-state files, fp32 export.

    Use it beside :class:`~lightning.pytorch.callbacks.ModelCheckpoint` (which decides *when*
    checkpoints are saved; this callback acts on every save).

    Args:
        dirpath: folder of the standalone files (default ``<ModelCheckpoint dirpath>/qmuon_state``,
            else ``<default_root_dir>/qmuon_state``).
        keep_last_k: newest standalone files to keep (``None``: all).
        save_standalone: write the standalone file on each checkpoint save.
        allow_format_change: on resume, accept a checkpoint saved with another state format or
            layout (QMuon converts the momentum) instead of raising.
        require_manifest: raise when resuming from a checkpoint without a manifest (default: warn).
        gather_sharded: under sharded parameters, gather the full state to write the standalone
            file (collective) instead of skipping it.
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, *, keep_last_k: int | None = 3,
                 save_standalone: bool = True, allow_format_change: bool = False, require_manifest: bool = False,
                 gather_sharded: bool = False) -> None:
        if keep_last_k is not None and (not isinstance(keep_last_k, int) or keep_last_k < 1):
            raise ValueError(f"keep_last_k must be None (keep all) or an int >= 1, got {keep_last_k!r}")
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.keep_last_k = keep_last_k
        self.save_standalone = save_standalone
        self.allow_format_change = allow_format_change
        self.require_manifest = require_manifest
        self.gather_sharded = gather_sharded
        #: path of the last standalone file written by this callback
        self.last_saved: str | None = None
        self._trainer: pl.Trainer | None = None
        self._pending: tuple[dict[str, Any], str] | None = None
        self._explained_sharded = False

    # ------------------------------------------------------------------ helpers
    def _resolve_dir(self, trainer: pl.Trainer) -> str:
        if self.dirpath is not None:
            return self.dirpath
        ckpt_cb = trainer.checkpoint_callback
        base = getattr(ckpt_cb, "dirpath", None) or trainer.default_root_dir
        return os.path.join(base, "qmuon_state")

    def _validate(self, trainer: pl.Trainer, manifest: dict[str, Any], source: str) -> None:
        notes = validate_manifest(manifest, qmuon_optimizers(trainer), trainer.lightning_module,
                                  allow_format_change=self.allow_format_change, source=source)
        for n in notes:
            rank_zero_info(f"QuantizedStateCheckpoint: {source}: {n}")

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        optimizers = qmuon_optimizers(trainer)
        if not optimizers:
            return
        manifest = build_manifest(optimizers, pl_module, world_size=trainer.world_size,
                                  global_step=trainer.global_step)
        checkpoint[MANIFEST_KEY] = manifest
        if self.save_standalone:
            self._save_standalone(trainer, optimizers, manifest)

    def _save_standalone(self, trainer: pl.Trainer, optimizers: list[tuple[int, QMuon]],
                         manifest: dict[str, Any]) -> None:
        if manifest["sharded"]:
            if not self.gather_sharded:
                if not self._explained_sharded:
                    self._explained_sharded = True
                    rank_zero_info(
                        "QuantizedStateCheckpoint: parameters are sharded (DTensor); the strategy's distributed "
                        "checkpoint holds each rank's rows of the quantized state, so no standalone file is written "
                        "(pass gather_sharded=True to gather and write a consolidated one)")
                return
            states = {idx: _full_state_dict(opt) for idx, opt in optimizers}  # collective: every rank
        else:
            states = {idx: opt.state_dict() for idx, opt in optimizers} if trainer.is_global_zero else {}
        if not trainer.is_global_zero:
            return
        path = os.path.join(self._resolve_dir(trainer), f"qmuon-state-step={trainer.global_step}.pt")
        atomic_torch_save({"manifest": manifest, "optimizer_states": states}, path)
        self.last_saved = path
        self._prune(os.path.dirname(path))

    def _prune(self, folder: str) -> None:
        files = standalone_files(folder)
        stale_tmp = [os.path.join(folder, n) for n in os.listdir(folder)
                     if n.startswith(_TMP_PREFIX) and n.endswith(".tmp")]  # left by a killed save (one writer)
        keep = len(files) if self.keep_last_k is None else self.keep_last_k
        for old in files[: max(0, len(files) - keep)] + stale_tmp:
            with contextlib.suppress(FileNotFoundError):
                os.remove(old)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        source = str(trainer.ckpt_path) if trainer.ckpt_path else "the checkpoint"
        manifest = checkpoint.get(MANIFEST_KEY)
        if manifest is None:
            msg = (f"QuantizedStateCheckpoint: {source} has no qmuon manifest (it was saved without this callback), so "
                   "the quantized optimizer state cannot be checked before loading")
            if self.require_manifest:
                raise QuantizedStateMismatchError(msg + "; pass require_manifest=False to resume anyway")
            rank_zero_warn(msg)
            return
        if trainer.strategy.restore_checkpoint_after_setup:
            # ModelParallelStrategy / qmuon_fsdp: the checkpoint is read after the optimizers are built
            # (qmuon_fsdp has loaded the optimizer state already; the error still comes before training).
            self._validate(trainer, manifest, source)
        else:
            # Single-device / DDP: checkpoints are read before the optimizers are built; validate in
            # on_fit_start, which still runs before Lightning restores the optimizer state.
            self._pending = (manifest, source)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is not None:
            manifest, source = self._pending
            self._pending = None
            self._validate(trainer, manifest, source)

    # ------------------------------------------------------------------ export
    def export_fp32_momentum(self, path: str | os.PathLike, optimizer_index: int | None = None) -> dict[str, Any]:
        """Write the Muon momentum of the trainer's QMuon dequantized to fp32 (see
        :func:`export_fp32_momentum`). ``optimizer_index`` picks one when there are several."""
        if self._trainer is None:
            raise RuntimeError("QuantizedStateCheckpoint.export_fp32_momentum needs the callback attached to a Trainer "
                               "that has been set up (call it after or during trainer.fit)")
        found = qmuon_optimizers(self._trainer)
        if optimizer_index is not None:
            found = [(i, o) for i, o in found if i == optimizer_index]
        if len(found) != 1:
            raise ValueError(f"found {len(found)} QMuon optimizers (indices {[i for i, _ in qmuon_optimizers(self._trainer)]}"
                             "); pass optimizer_index= to pick one")
        return export_fp32_momentum(found[0][1], path, self._trainer.lightning_module)
