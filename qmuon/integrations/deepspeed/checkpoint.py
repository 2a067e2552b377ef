"""Resuming a DeepSpeed checkpoint: the process count it was saved with, checked before loading.

QMuon's momentum lives per rank (the rows of its slices) and ZeRO's partitions are cut for
one process count, so a checkpoint resumes only on the world size that wrote it. DeepSpeed's own
check (``ZeRORuntimeException``) names both sizes but no way out; :func:`load_checkpoint` raises
:class:`CheckpointWorldSizeError` before anything is loaded, naming both sizes and the fixes.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ...distributed import safe_load

__all__ = ["CheckpointWorldSizeError", "saved_world_size", "check_resume", "load_checkpoint"]

_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


class CheckpointWorldSizeError(ValueError):
    """A DeepSpeed checkpoint written by another number of data-parallel processes than this run's."""


def _tag_dir(load_dir: str | os.PathLike, tag: str | None) -> str | None:
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            return None
        with open(latest) as f:
            tag = f.read().strip()
    return os.path.join(load_dir, str(tag))


def saved_world_size(load_dir: str | os.PathLike, tag: str | None = None) -> int | None:
    """The data-parallel world size that wrote checkpoint ``tag`` of ``load_dir`` (``None``: the
    ``latest`` tag), or None when there is no such checkpoint. ZeRO stages 1-3 write one optimizer
    file per data-parallel rank (``zero_pp_rank_{r}_mp_rank_00_optim_states.pt``); stage 0 records
    ``dp_world_size`` in ``mp_rank_00_model_states.pt``."""
    d = _tag_dir(load_dir, tag)
    if d is None or not os.path.isdir(d):
        return None
    ranks = [int(m.group(1)) for m in map(_OPTIM_FILE.match, os.listdir(d)) if m]
    if ranks:
        return max(ranks) + 1
    states = os.path.join(d, "mp_rank_00_model_states.pt")
    if os.path.isfile(states):
        sd = safe_load.load(states, map_location="cpu", mmap=True)  # refuses a file that would run code
        n = sd.get("dp_world_size")
        return int(n) if n is not None else None
    return None


def check_resume(load_dir: str | os.PathLike, tag: str | None, world_size: int) -> None:
    """Raise :class:`CheckpointWorldSizeError` when the checkpoint was saved by another number of
    data-parallel processes than ``world_size``; the message names both and the fixes."""
    saved = saved_world_size(load_dir, tag)
    if saved is None or saved == world_size:
        return
    where = _tag_dir(load_dir, tag)
    raise CheckpointWorldSizeError(
        f"the DeepSpeed checkpoint {where} was saved by {saved} data-parallel process(es); this run has {world_size}. "
        "QMuon keeps the quantized momentum of each rank's slices of a Muon matrix on that rank, and ZeRO cuts its "
        f"partitions for one process count, so the optimizer state resumes only on {saved} process(es). Fix: relaunch with "
        f"{saved} processes (deepspeed --num_gpus {saved} / torchrun --nproc_per_node {saved}); or keep the weights "
        "only: convert them with DeepSpeed's zero_to_fp32.py (deepspeed.utils.zero_to_fp32."
        "get_fp32_state_dict_from_zero_checkpoint), load them into the model before deepspeed.initialize and start "
        "the optimizer fresh"
    )


def load_checkpoint(engine: Any, load_dir: str | os.PathLike, tag: str | None = None, **kwargs: Any) -> tuple[Any, Any]:
    """``engine.load_checkpoint(load_dir, tag, **kwargs)`` after :func:`check_resume` with the
    engine's data-parallel world size (a mismatch raises before anything is loaded)."""
    world = int(getattr(engine, "seq_dp_world_size", None) or getattr(engine, "dp_world_size", 1))
    check_resume(load_dir, tag, world)
    return engine.load_checkpoint(str(load_dir), tag=tag, **kwargs)
