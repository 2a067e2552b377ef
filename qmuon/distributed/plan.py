"""The plan of one distributed Newton-Schulz step: what each rank holds of each matrix, who owns it.

:class:`ShardItem` is one matrix (or fused part) of a sharded parameter seen from this rank, with
the piece every rank of the exchange holds (:meth:`ShardItem.rows_of` / :meth:`ShardItem.cols_of`:
rows on a ``Shard(0)`` / HSDP mesh; rows times columns on a flattened ``(dp, tp)`` mesh,
:mod:`.tensor_parallel`). The owner functions deal the step's matrices to ranks by Newton-Schulz
cost; every rank computes the same plan without communicating. :func:`merge_comm_stats` adds up
the figures of several exchanges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ..core.apply import WeightWrite
from ..core.pipeline import NSSettings

__all__ = ["ns_cost", "merge_comm_stats"]


@dataclass
class ShardItem:
    """One matrix (or fused part) of a sharded parameter, seen from this rank: the stored block
    rows ``[r0, r1)``, columns ``[c0, c1)`` (rows are what ``Shard(0)`` splits; for an ``(in, out)``
    weight they are the layer's input features, and ``transposed`` runs NS on the block's
    transpose, on the owner, after the rows are assembled)."""

    layout: Any  # quant.layout.RowLayout (Shard(0) / HSDP) or tensor_parallel.PieceLayout
    r0: int  # global stored rows [r0, r1) of the part
    r1: int
    param_rows: Tensor  # this rank's rows of the part in the local parameter shard (a view, any ndim)
    ns_input: Tensor  # this rank's rows of the NS input (2-D view of the local grad)
    sums: Tensor  # this rank's per-row-block sums of squares (n, nb) fp32 (nb = 1: per-row sums of a column block)
    nb: int
    lr: float
    eps: float
    settings: NSSettings
    forward: str  # forward carrier name
    c0: int = 0  # stored columns [c0, c1) of the part (c1 None: every column)
    c1: int | None = None
    transposed: bool = False
    decay: float = 1.0  # decoupled weight decay, folded into the write (core.apply.apply_update_)
    write: WeightWrite = field(default_factory=WeightWrite)  # this rank's rows: rule, state views, rng
    cautious: bool = False
    moment_rows: Tensor | None = None  # NorMuon: this rank's rows of the part's second moment (fp32 view)
    beta2: float = 0.0
    block_sums: bool = True  # ``sums`` are per-row-block (whole stored rows), not per-row sums of a column block
    block: int = 256  # the state's row-block size (columns per sum of a whole-row part)

    @property
    def moment_bytes(self) -> int:
        """Bytes per row of the NorMuon second moment on each trip (0 for plain Muon)."""
        return 4 if self.moment_rows is not None else 0

    @property
    def rows(self) -> int:
        return self.r1 - self.r0

    @property
    def cols(self) -> int:
        return (self.layout.cols if self.c1 is None else self.c1) - self.c0

    def rows_of(self, r: int) -> tuple[int, int]:
        """Global rows of this part held by rank ``r``."""
        return self.layout.overlap(r, self.r0, self.r1)

    def cols_of(self, r: int) -> tuple[int, int]:
        """Stored columns of this part held by rank ``r`` (all of them on a row-sharded mesh)."""
        c1 = self.layout.cols if self.c1 is None else self.c1
        return self.layout.col_overlap(r, self.c0, c1)

    def n_of(self, r: int) -> int:
        a, b = self.rows_of(r)
        return b - a

    def w_of(self, r: int) -> int:
        a, b = self.cols_of(r)
        return b - a

    def holds(self, r: int) -> bool:
        return self.n_of(r) > 0 and self.w_of(r) > 0

    def sends(self, r: int) -> bool:
        """Whether rank ``r`` sends its piece to the owner (one of the ranks holding a copy does)."""
        return self.layout.sends(r) and self.holds(r)

    def nb_of(self, r: int) -> int:
        """Columns of rank ``r``'s sums of squares: its row blocks, or 1 (per-row sums)."""
        return -(-self.w_of(r) // self.block) if self.block_sums else 1

    def sums_layout(self, world: int) -> tuple[int, dict[int, int]]:
        """The owner's ``(rows, NB)`` table of sums of squares: ``NB`` and each sending rank's first
        column in it. Whole-row parts: the row blocks of single-process QMuon (each column shard
        starts on a block boundary), so the table, and its sum, are bit-identical to it. Column
        blocks: one column of per-row sums per distinct column shard."""
        senders = [r for r in range(world) if self.sends(r)]
        if self.block_sums:
            starts = {self.cols_of(r)[0] - self.c0: r for r in senders}
            if all(s % self.block == 0 for s in starts):
                return -(-self.cols // self.block), {r: (self.cols_of(r)[0] - self.c0) // self.block for r in senders}
            # A column shard starts inside a row block (a rowwise shard narrower than block_size, fine
            # for formats without blocks): each column piece gets its own columns of sums, and their
            # total is single-process QMuon's up to the order of the fp32 additions.
            at, n = {}, 0
            for s in sorted(starts):
                at[s] = n
                n += self.nb_of(starts[s])
            return n, {r: at[self.cols_of(r)[0] - self.c0] for r in senders}
        starts = sorted({self.cols_of(r)[0] for r in senders})
        return max(len(starts), 1), {r: starts.index(self.cols_of(r)[0]) for r in senders}


def ns_cost(rows: int, cols: int) -> int:
    """Newton-Schulz cost model of a ``rows x cols`` matrix (flops up to a constant)."""
    return rows * cols * min(rows, cols)


def plan_replica_owners(items: list[Any], banks: list[tuple[int, int, int]], shards: int,
                        replicas: int) -> tuple[list[int], list[int]]:
    """HSDP plan over the ``replicas x shards`` ranks ``v = replica * shards + shard``: the owner
    of every exchange item (any rank; ties to the rank holding most of its rows) and of every bank
    member part ``(rows, cols, shard holding it)`` (a rank of that shard). Greedy least-loaded,
    largest first; deterministic, so every rank computes the same plan."""
    costs = [(ns_cost(it.rows, it.cols), 0, j) for j, it in enumerate(items)]
    costs += [(ns_cost(r, c), 1, j) for j, (r, c, _) in enumerate(banks)]
    load = [0] * (shards * replicas)
    owners, bank_owners = [0] * len(items), [0] * len(banks)
    for cost, kind, j in sorted(costs, key=lambda t: (-t[0], t[1], t[2])):
        if kind == 0:
            it = items[j]
            best = min(range(len(load)), key=lambda v: (load[v], -it.n_of(v % shards), v))
            owners[j] = best
        else:
            s = banks[j][2]
            best = min((r * shards + s for r in range(replicas)), key=lambda v: (load[v], v))
            bank_owners[j] = best
        load[best] += cost
    return owners, bank_owners


def plan_owners(items: list[Any], world: int) -> list[int]:
    """Owner rank of every item on ``world`` ranks without replicas (FSDP2, TP, DeepSpeed ZeRO):
    :func:`plan_replica_owners` with one replica and no bank members."""
    return plan_replica_owners(items, [], world, 1)[0]


def comm_figures(stats: dict[str, float], mine: float, wire: float, elements: float, bf16_wire: float,
                 exchange: float, owned: float) -> dict[str, float]:
    """``stats`` with the byte figures of one Newton-Schulz exchange, the terms of ``QMuon.comm_stats``
    (:meth:`.orthogonalize.ShardedStep.finish`, :class:`.flat.FlatExchange`)."""
    el = max(elements, 1)
    stats.update({
        "ns_bytes_sent": float(mine),  # this rank, both trips, to other ranks
        "ns_bytes_total": float(wire),  # all ranks
        "muon_elements": float(elements),
        "wire_bytes_per_param": wire / el,
        "bf16_wire_bytes_per_param": bf16_wire / el,  # bf16 both ways, same plan
        "exchange_bytes_per_param": exchange / el,  # if every element crossed the wire both ways (bf16: 4)
        "matrices_owned": float(owned),
    })
    return stats


#: Figures of :meth:`ShardedStep.finish` that add up over several exchanges of one optimizer step.
_ADDITIVE = ("flags_bytes", "ns_bytes_sent", "ns_bytes_total", "muon_elements", "matrices_owned")
#: Per-parameter ratios (bytes / Muon element): combined weighted by ``muon_elements``.
_PER_ELEMENT = ("wire_bytes_per_param", "bf16_wire_bytes_per_param", "exchange_bytes_per_param")


def merge_comm_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """The figures of one optimizer step whose distributed Newton-Schulz ran as several exchanges
    (gradient release: one per FSDP unit): byte counts summed, per-element ratios weighted by
    each exchange's Muon elements. One part is returned as it is."""
    if len(parts) == 1:
        return dict(parts[0])
    out = {k: float(sum(p.get(k, 0.0) for p in parts)) for k in _ADDITIVE}
    el = max(out["muon_elements"], 1.0)
    for k in _PER_ELEMENT:
        out[k] = sum(p.get(k, 0.0) * p.get("muon_elements", 0.0) for p in parts) / el
    return out
