"""Which checkpoints survived a crash, and which one to resume from.

A checkpoint is either one file written by ``torch.save`` (a zip archive: Lightning's ``.ckpt``,
``fabric.save`` on one device) or a directory written by ``torch.distributed.checkpoint`` (DCP;
Lightning's and Fabric's sharded layout, where rank 0 adds the non-tensor state as ``meta.pt``).
It is *complete* when

* a file: the zip's central directory (written last) is readable and names the pickled object;
* a directory: DCP's ``.metadata`` exists (DCP writes it last, through a temporary file and a
  rename, after every rank's data), every shard file it refers to exists and is long enough, and,
  for a directory named like a Lightning checkpoint (``*.ckpt``), ``meta.pt`` is a complete file.

:func:`checkpoint_problem` says what is missing; :func:`find_resumable_checkpoint` picks the newest
complete checkpoint of one folder or of several (largest ``global_step``, then modification time). Sharded saves of
:class:`~qmuon_lightning.strategies.QMuonFSDPStrategy` go to a hidden staging directory
(:func:`staging_path`) that :func:`publish_directory` renames into place, so a reader never sees a
half-written directory under a checkpoint's name; :func:`recover_interrupted_saves` finishes or
removes what a killed save left behind.

Plain functions of paths, so Fabric and Accelerate loops use them as well (docs/reliability.md).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from . import safe_load
from .safe_load import UnsafeCheckpointError, read_dcp_metadata

__all__ = [
    "CheckpointScan",
    "IncompleteCheckpointError",
    "checkpoint_metadata",
    "checkpoint_problem",
    "checkpoint_step",
    "lacks_training_state",
    "find_resumable_checkpoint",
    "newest_complete",
    "publish_directory",
    "recover_interrupted_saves",
    "require_complete",
    "scan_checkpoints",
    "staging_path",
    "untracked_checkpoints",
]

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

#: DCP's metadata file: written last, by the coordinator rank, through a rename.
DCP_METADATA = ".metadata"
#: Lightning's / Fabric's non-tensor state inside a sharded checkpoint directory (rank 0).
LIGHTNING_META = "meta.pt"
#: File names that count as single-file checkpoints.
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth")
# ".<name>.partial" / ".<name>.old": QMuonFSDPStrategy (Trainer); "<name>.partial" / "<name>.old": its Fabric twin.
_STAGING_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)$|^(?P<fname>[^.].*)\.(?P<fkind>partial|old)$")


class IncompleteCheckpointError(FileNotFoundError):
    """A checkpoint given explicitly is missing a part (a crash during its save, or a partial copy)."""


# ----------------------------------------------------------------------------------------- checks
def _zip_problem(path: Path) -> Optional[str]:
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except (zipfile.BadZipFile, OSError) as err:
        return (f"{path} is not a complete torch.save file: its zip directory, which is written last, cannot be read "
                f"({err}); the save was cut short (a crash or a full disk) or the file was truncated when copied")
    if not any(n.endswith("data.pkl") for n in names):
        return f"{path} is a zip file without a pickled object (no data.pkl): not a torch.save checkpoint"
    return None


def _dcp_problem(path: Path) -> Optional[str]:
    meta = path / DCP_METADATA
    if not meta.is_file():
        partial = [p.name for p in path.iterdir()] if path.is_dir() else []
        return (f"{path} is a sharded checkpoint directory without {DCP_METADATA}: torch.distributed.checkpoint "
                f"writes that file last, so the save did not finish (present: {sorted(partial)[:8] or 'nothing'})")
    try:
        metadata = read_dcp_metadata(path)  # DCP's own format: a pickled Metadata object, rebuilt from an allow-list
    except UnsafeCheckpointError:
        raise  # names a global DCP never writes: refused loudly, not skipped as damaged
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the file is damaged
        return f"{path / DCP_METADATA} cannot be read ({type(err).__name__}: {err}); the checkpoint is damaged"
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(needed.items()):
        f = path / rel
        if not f.is_file():
            return f"{path} is missing the shard file {rel} that its {DCP_METADATA} refers to"
        if f.stat().st_size < size:
            return f"{path}: shard file {rel} has {f.stat().st_size} bytes, its {DCP_METADATA} needs {size} (truncated)"
    lightning_meta = path / LIGHTNING_META
    if lightning_meta.exists():
        return _zip_problem(lightning_meta)
    if path.suffix == ".ckpt":
        return (f"{path} has the sharded tensors but no {LIGHTNING_META} (Lightning's loop, callback and "
                "optimizer-hyperparameter state, written by rank 0 after the tensors): the save did not finish")
    return None


def checkpoint_problem(path: PathLike) -> Optional[str]:
    """``None`` if ``path`` is a complete checkpoint (see the module docstring), else what is
    missing, as a sentence naming the file."""
    p = Path(path)
    if p.is_file():
        return _zip_problem(p)
    if p.is_dir():
        return _dcp_problem(p)
    return f"{p} does not exist"


def require_complete(path: PathLike) -> Path:
    """``Path(path)``, or :class:`IncompleteCheckpointError` saying what is missing."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise IncompleteCheckpointError(
            f"cannot resume from {path}: {problem}. Pick an older checkpoint, or let qmuon-train choose the newest "
            "complete one with --ckpt_path auto (qmuon.distributed.resume.find_resumable_checkpoint)")
    return Path(path)


def checkpoint_metadata(path: PathLike) -> Optional[dict[str, Any]]:
    """The checkpoint dict of a file (tensors memory-mapped, not read) or a directory's ``meta.pt``,
    loaded with ``weights_only=True`` (:mod:`.safe_load`: a file that needs more raises
    :class:`~.safe_load.UnsafeCheckpointError`)."""
    p = Path(path)
    target = p / LIGHTNING_META if p.is_dir() else p
    if not target.is_file():
        return None
    try:
        blob = safe_load.load(target, map_location="cpu", mmap=True)
    except UnsafeCheckpointError:
        raise  # holds objects safe loading refuses: said, not skipped
    except Exception:  # noqa: BLE001 - an unreadable checkpoint has no state; checkpoint_problem reports why
        return None
    return blob if isinstance(blob, dict) else None


def checkpoint_step(path: PathLike) -> Optional[int]:
    """``global_step`` stored in a complete Lightning / Fabric checkpoint (``None`` if it has none).

    Reads the small non-tensor part only: ``meta.pt`` of a directory; a file is opened with
    ``mmap=True``, so its tensors are not read.
    """
    blob = checkpoint_metadata(path)
    step = blob.get("global_step") if blob else None
    return int(step) if isinstance(step, int) else None


def lacks_training_state(path: PathLike) -> bool:
    """Whether ``path`` is a complete Lightning checkpoint saved with ``weights_only`` (no
    ``callbacks`` / ``optimizer_states``: ``ModelCheckpoint(save_weights_only=True)``), which
    Lightning refuses to resume a fit from. Other files (Fabric, Accelerate) are never refused."""
    blob = checkpoint_metadata(path)
    return bool(blob) and "pytorch-lightning_version" in blob and "callbacks" not in blob


# ------------------------------------------------------------------------------- staging / publish
def staging_path(final: PathLike) -> Path:
    """Hidden sibling directory a sharded save writes into before :func:`publish_directory`."""
    f = Path(final)
    return f.parent / f".{f.name}.partial"


def _fsync(path: PathLike) -> None:
    """Flush one file or directory entry to disk; best effort (some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)


def publish_directory(staging: PathLike, final: PathLike) -> None:
    """Make the complete directory ``staging`` visible as ``final``, replacing an existing one.

    Its files are flushed to disk first. A new name is one ``rename``. An existing ``final`` (a
    ``last.ckpt`` saved again) moves aside to ``.<name>.old`` first, so at every moment either the
    old or the new complete checkpoint is under a name :func:`recover_interrupted_saves` restores.
    """
    staging, final = Path(staging), Path(final)
    _fsync_tree(staging)
    if final.exists() or final.is_symlink():
        old = final.parent / f".{final.name}.old"
        if old.exists():
            _remove(old)
        os.rename(final, old)
        os.rename(staging, final)
        _fsync(final.parent)
        _remove(old)
    else:
        os.rename(staging, final)
        _fsync(final.parent)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def recover_interrupted_saves(dirpath: PathLike, *, report: Optional[Callable[[str], None]] = None) -> list[str]:
    """Finish or undo sharded saves a killed run left in ``dirpath`` (call on one process only,
    before any new save). Returns one sentence per action, also passed to ``report``.

    ``.<name>.partial`` (a staging directory): published as ``<name>`` when it is complete (killed
    after the write, before or between the renames: it is newer than what holds the name), removed
    otherwise. ``.<name>.old`` (the replaced checkpoint): removed when ``<name>`` exists, renamed
    back when it does not and it is complete.
    """
    d = Path(dirpath)
    actions: list[str] = []
    if not d.is_dir():
        return actions
    found = [(m.group("name") or m.group("fname"), m.group("kind") or m.group("fkind"), e)
             for e in d.iterdir() if (m := _STAGING_RE.match(e.name))]
    # staging directories first: a complete one is newer than the ".old" it was replacing
    for name, kind, entry in sorted(found, key=lambda f: (f[1] != "partial", f[2].name)):
        final = d / name
        problem = checkpoint_problem(entry)
        if kind == "partial" and problem is None:
            # written completely, killed before its rename: newer than whatever holds the name
            replaced = final.exists()
            publish_directory(entry, final)
            actions.append(f"adopted {entry} (a complete save interrupted before its rename) as {final}"
                           + (", replacing the older one" if replaced else ""))
        elif kind == "old" and not final.exists() and problem is None:
            os.rename(entry, final)
            actions.append(f"restored {entry} (replaced by a save that did not finish) as {final}")
        else:
            _remove(entry)
            why = "superseded" if problem is None else problem
            actions.append(f"removed {entry} left by an interrupted save ({why})")
    for a in actions:
        (report or log.warning)(a)
    return actions


# ------------------------------------------------------------------------------------ discovery
@dataclass
class CheckpointScan:
    """What :func:`scan_checkpoints` found in a folder."""

    directory: Path
    #: complete checkpoints as ``(path, global_step or None, mtime)``, newest first
    complete: list[tuple[Path, Optional[int], float]] = field(default_factory=list)
    #: checkpoint-like entries that are not complete, with what is missing
    incomplete: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def newest(self) -> Optional[Path]:
        return self.complete[0][0] if self.complete else None


def _looks_like_checkpoint(p: Path) -> bool:
    if p.name.startswith(".") or _STAGING_RE.match(p.name):
        return False  # staging / replaced directories: recover_interrupted_saves handles them
    if p.is_file():
        return p.suffix in CHECKPOINT_SUFFIXES
    if p.is_dir():
        return p.suffix in CHECKPOINT_SUFFIXES or (p / DCP_METADATA).exists() or (p / LIGHTNING_META).exists()
    return False


def scan_checkpoints(dirpath: PathLike) -> CheckpointScan:
    """Every checkpoint directly under ``dirpath``: complete ones ordered newest first (largest
    ``global_step``; then the most recent modification), incomplete ones with the reason."""
    d = Path(dirpath)
    scan = CheckpointScan(d)
    if not d.is_dir():
        return scan
    for entry in sorted(d.iterdir(), key=lambda p: p.name):
        if not _looks_like_checkpoint(entry):
            continue
        problem = checkpoint_problem(entry)
        if problem is not None:
            scan.incomplete.append((entry, problem))
            continue
        target = entry / DCP_METADATA if entry.is_dir() else entry
        scan.complete.append((entry, checkpoint_step(entry), target.stat().st_mtime))
    scan.complete.sort(key=_ordering, reverse=True)
    return scan


def _ordering(entry: tuple[Path, Optional[int], float]) -> tuple[int, float]:
    """Newest first: the largest ``global_step`` (none counts as below every step), then the latest
    modification."""
    return (-1 if entry[1] is None else entry[1], entry[2])


def newest_complete(scans: Iterable[CheckpointScan]) -> Optional[tuple[Path, Optional[int], float]]:
    """The newest complete checkpoint of several scans: largest ``global_step``, then the latest
    modification, so of two checkpoints saved at the same step (two ``ModelCheckpoint`` callbacks
    firing on one step) the one written last wins; it holds every callback's state after both
    saves. ``None`` when no scan has a complete one."""
    entries = [c for scan in scans for c in scan.complete]
    return max(entries, key=_ordering) if entries else None


def find_resumable_checkpoint(dirpath: Union[PathLike, Sequence[PathLike]], *,
                              report: Optional[Callable[[str], None]] = None) -> Optional[Path]:
    """The newest complete checkpoint directly under ``dirpath``, or ``None`` (start fresh).

    ``dirpath`` is one folder or several (a run saving into more than one, e.g. a periodic and a
    best-by-validation checkpoint folder): the newest of all of them by ``global_step``, then by
    modification time (:func:`newest_complete`). Single files and sharded directories alike;
    incomplete ones (cut short by a crash) are never returned and are named through ``report``
    (default: a logging warning). Reads only; call :func:`recover_interrupted_saves` on each folder
    first to adopt a sharded save that was killed between its final renames.
    """
    folders = [dirpath] if isinstance(dirpath, (str, os.PathLike)) else list(dirpath)
    start = time.perf_counter()
    scans = [scan_checkpoints(d) for d in folders]
    for scan in scans:
        for _, problem in scan.incomplete:
            (report or log.warning)(f"skipping incomplete checkpoint: {problem}")
    log.debug("scanned %s in %.2f s", ", ".join(map(str, folders)), time.perf_counter() - start)
    newest = newest_complete(scans)
    return None if newest is None else newest[0]


def untracked_checkpoints(dirpath: PathLike, resumed_from: PathLike) -> list[Path]:
    """Checkpoints in ``dirpath`` that the ``ModelCheckpoint`` state saved in ``resumed_from``
    does not know (not a top-k, best or last path), other than ``resumed_from`` itself.

    A run killed between writing a new top-k checkpoint and deleting the one it replaces leaves
    such a file; the resumed callback will never delete it. Returned so the caller reports it.
    """
    state = checkpoint_metadata(resumed_from) or {}
    known: set[str] = set()
    for key, cb in (state.get("callbacks") or {}).items():
        if not str(key).startswith("ModelCheckpoint") or not isinstance(cb, dict):
            continue
        known.update(os.path.realpath(str(k)) for k in (cb.get("best_k_models") or {}))
        for name in ("best_model_path", "last_model_path", "kth_best_model_path"):
            if cb.get(name):
                known.add(os.path.realpath(str(cb[name])))
    here = os.path.realpath(resumed_from)
    out = []
    for entry in sorted(Path(dirpath).iterdir(), key=lambda p: p.name) if Path(dirpath).is_dir() else []:
        if _looks_like_checkpoint(entry) and os.path.realpath(entry) not in known | {here}:
            out.append(entry)
    return out
