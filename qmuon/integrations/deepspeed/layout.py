"""Where each parameter's elements live under each ZeRO stage, which rank owns each Muon matrix, and
which DeepSpeed optimizer wraps the client (:func:`resolve_zero`).

The readers return, per parameter and rank, the slice that rank's flat fp32 partition holds
(:class:`Segment`):

- stages 1/2 (:func:`read_zero12_links`): each parameter group is one flat buffer cut into ``N``
  equal partitions whose boundaries ignore parameter boundaries; DeepSpeed links every model
  parameter to its fragment in this rank's partition, and one all-gather shares the fragments;
- stage 3 (:func:`read_zero3_layout`, :func:`zero3_segments`): every parameter is cut on its own into
  ``N`` pieces of ``ceil(numel / N)`` elements (the last ones padded), and rank ``r``'s flat partition
  of a sub-group is its pieces of the sub-group's parameters, one after another.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...distributed.flat import FlatParam, Segment


def zero3_segments(numel: int, partition_numel: int, local: int, world_size: int) -> list[Segment | None]:
    """Which slice of a parameter each rank holds under ZeRO stage 3.

    DeepSpeed cuts every parameter on its own (``partition_parameters._partition_param``): rank ``r``
    holds its flattened elements ``[r * partition_numel, (r + 1) * partition_numel)`` with
    ``partition_numel = ceil(numel / N)``, the last ranks' pieces padded (a rank may hold only
    padding). Its piece sits at offset ``local`` of the rank's flat fp32 partition of the sub-group,
    the same offset on every rank (every piece is ``partition_numel`` long, padding included).
    """
    out: list[Segment | None] = []
    for r in range(world_size):
        start = r * partition_numel
        n = min(partition_numel, numel - start)
        out.append(Segment(start, n, local) if n > 0 else None)
    return out


# ------------------------------------------------------------------------------ engine readers
def resolve_zero(handle: Any, client: Any) -> tuple[Any, Any]:
    """The DeepSpeed optimizer that wraps ``client`` (``client`` itself when the engine steps it directly:
    ZeRO stage 0 with fp32 weights) and the ``DeepSpeedEngine`` it was reached through (or None), from
    what DeepSpeed, Accelerate or the Hugging Face Trainer hand over: the engine
    ``deepspeed.initialize`` returns, an ``accelerate.Accelerator`` (``deepspeed_engine_wrapped``) or
    its ``DeepSpeedEngineWrapper`` (``engine``), the optimizer ``accelerator.prepare`` returned
    (``DeepSpeedOptimizerWrapper``: ``optimizer``), a ``transformers.Trainer`` (``model_wrapped``), or
    the ZeRO optimizer itself. Follows those documented attributes only; raises ``TypeError`` when
    none leads to an optimizer whose ``.optimizer`` is ``client``."""
    from deepspeed import DeepSpeedEngine

    engine, x = None, handle
    for _ in range(6):
        if x is client:
            return client, engine
        if isinstance(x, DeepSpeedEngine):  # its optimizer: the ZeRO optimizer, or the client at stage 0
            engine, x = x, x.optimizer
            continue
        if getattr(x, "optimizer", None) is client:
            return x, engine
        nxt = None
        for attr in ("model_wrapped", "deepspeed_engine_wrapped", "engine", "optimizer"):
            nxt = getattr(x, attr, None)
            if nxt is not None:
                break
        if nxt is None:
            break
        x = nxt
    raise TypeError(
        f"attach() got {type(handle).__name__}, from which no DeepSpeed optimizer wrapping this "
        "WholeMatrixZeroOptimizer is reached. Pass the engine deepspeed.initialize returned (built with "
        "optimizer=this wrapper), the accelerate.Accelerator that prepared it, or the transformers.Trainer")


def read_zero12_links(params: list[FlatParam], model_params: list[Tensor], flats: list[Tensor], world_size: int,
                      group: Any) -> None:
    """Fill ``holders`` of every parameter under ZeRO stages 1/2 from the link DeepSpeed puts on each
    model parameter (``_hp_mapping``, what ``deepspeed.utils.safe_get_full_fp32_param`` reads): this
    rank's fragment of the parameter, its elements ``[start, start + numel)`` at offset ``local`` of the
    group's flat fp32 partition (``flats``: the tensors DeepSpeed put in the client's groups). The other
    ranks' fragments come from one all-gather. Checked: each fragment is a view of its group's flat
    partition, and the fragments of all ranks tile each parameter exactly once. Matched by parameter
    identity, not by position in DeepSpeed's lists."""
    device = flats[0].device if flats else torch.device("cpu")
    mine = torch.full((len(params), 3), -1, dtype=torch.int64)
    for info, p in zip(params, model_params):
        if not hasattr(p, "_hp_mapping"):
            raise RuntimeError(f"parameter {info.index} (shape {tuple(info.shape)}) carries no ZeRO stage 1/2 link "
                               "(_hp_mapping): DeepSpeed did not partition it")
        m = p._hp_mapping
        if m is None:
            continue
        flat = flats[info.group]
        lp, hp = m.lp_fragment_address, m.hp_fragment_address
        if m.hp_fragment.data_ptr() != flat.data_ptr() + hp.start * flat.element_size() or \
                hp.start + hp.numel > flat.numel():
            raise RuntimeError(f"parameter {info.index}: its ZeRO fragment is not a view of group {info.group}'s flat "
                               "partition held by this optimizer")
        mine[info.index] = torch.tensor([lp.start, lp.numel, hp.start])
    every = [torch.empty_like(mine) for _ in range(world_size)]
    if world_size > 1:
        gathered = [t.to(device) for t in every]
        dist.all_gather(gathered, mine.to(device), group=group)
        every = [t.cpu() for t in gathered]
    else:
        every = [mine]
    table = torch.stack(every).tolist()  # attach time, once: (rank, parameter) -> (start, numel, local)
    for info in params:
        segs = [None if table[r][info.index][0] < 0 else Segment(*table[r][info.index]) for r in range(world_size)]
        covered = sorted((s.start, s.length) for s in segs if s is not None)
        at = 0
        for start, n in covered:
            if start != at:
                break
            at += n
        if at != info.numel:
            raise RuntimeError(f"parameter {info.index} (shape {tuple(info.shape)}): the ZeRO fragments of the "
                               f"{world_size} ranks do not tile its {info.numel} elements ({covered})")
        info.holders = segs


def read_zero3_layout(zero: Any, params: list[FlatParam], world_size: int) -> list[Tensor]:
    """Fill ``holders`` and ``subgroup`` of every parameter from a ``DeepSpeedZeroOptimizer_Stage3``
    and return its flat fp32 partitions (one per sub-group; the tensors DeepSpeed hands to ``step``).

    DeepSpeed splits each parameter group into sub-groups (``sub_group_size`` elements of partitions
    each, in the group's order); a parameter's piece sits in its sub-group's flat partition after the
    pieces (``partition_numel()`` each, padding included) of the parameters before it. The offsets are
    cross-checked against where DeepSpeed put each piece (``ds_tensor`` is a view of the sub-group's
    flat low-precision buffer) and the true shapes (``ds_shape``) against QMuon's."""
    by_group: dict[int, list[FlatParam]] = defaultdict(list)
    for info in params:
        by_group[info.group].append(info)
    seen: dict[int, list[Any]] = defaultdict(list)  # group -> DeepSpeed's parameters, sub-group by sub-group
    where: dict[int, list[tuple[int, int]]] = defaultdict(list)  # group -> (sub-group, local offset)
    flats = list(zero.fp32_partitioned_groups_flat)
    for sg, sub in enumerate(zero.fp16_groups):
        gi = int(zero.sub_group_to_group_id[sg])
        low = zero.fp16_partitioned_groups_flat[sg] if sg < len(zero.fp16_partitioned_groups_flat) else None
        local = 0
        for p in sub:
            if int(p.partition_numel()) * world_size < int(p.ds_numel):
                raise RuntimeError(f"sub-group {sg}: a parameter's pieces ({p.partition_numel()} x {world_size}) do "
                                   f"not cover its {p.ds_numel} elements")
            if low is not None and p.ds_tensor.numel():
                delta = p.ds_tensor.data_ptr() - low.data_ptr()
                if delta != local * low.element_size():
                    raise RuntimeError(f"sub-group {sg}: a partition sits at byte {delta} of the flat buffer, expected "
                                       f"{local * low.element_size()}")
            seen[gi].append(p)
            where[gi].append((sg, local))
            local += int(p.partition_numel())
        if flats[sg].numel() != local:
            raise RuntimeError(f"sub-group {sg}: flat fp32 partition has {flats[sg].numel()} elements, its pieces {local}")
    for gi, infos in by_group.items():
        if len(seen[gi]) != len(infos):
            raise RuntimeError(f"group {gi}: DeepSpeed partitioned {len(seen[gi])} parameters, QMuon has {len(infos)}")
        for info, p, (sg, local) in zip(infos, seen[gi], where[gi]):
            if tuple(p.ds_shape) != tuple(info.shape):
                raise RuntimeError(f"group {gi}: parameter order differs from DeepSpeed's ({tuple(p.ds_shape)} vs "
                                   f"{tuple(info.shape)})")
            info.subgroup = sg
            info.holders = zero3_segments(info.numel, int(p.partition_numel()), local, world_size)
    return flats


