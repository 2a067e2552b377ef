"""Distributed Newton-Schulz for dim-0 sharded (FSDP2) Muon parameters.

Newton-Schulz must see each whole matrix (running it per shard is a different, blockwise
algorithm). With ``N`` ranks each holding some rows of every matrix, one optimizer step does:

1. **Agree** (one all-reduce MAX of two flags per sharded parameter): which parameters have a
   gradient on some rank and whether any rank's gradient is non-finite, so every rank skips or
   updates the same parameters and no rank waits for a peer that skipped. A rank without a
   gradient for a parameter that others have uses zeros (its rows got no gradient).
2. **Momentum** (local): each rank updates the quantized momentum of its own rows; the op writes
   the NS input and per-row-block sums of squares for those rows.
3. **Plan** (no communication; every rank computes the same plan): each matrix (a parameter, or a
   fused part such as q / k / v, whose row range may cut through a shard) gets one *owner* rank,
   greedy by Newton-Schulz cost (``rows * cols * min(rows, cols)``), ties to the rank that holds
   most of its rows.
4. **Forward all-to-all** (one ``all_to_all_single`` of bytes): every rank sends its rows of each
   matrix to the owner, encoded with the forward carrier (:mod:`.carrier`), plus the fp32
   per-row-block sums of squares of those rows (``4 / block_size`` bytes per element).
5. **Orthogonalize** (owner): the owner assembles each matrix, sums the block sums of the whole
   matrix in the same order as single-process QMuon (so ``1 / ||G||`` is bit-identical), and
   runs the batched, norm-folded Newton-Schulz on its share of same-shape matrices.
6. **Return all-to-all**: the owner sends each rank its rows of the result (return carrier);
   each rank applies ``p -= adjusted_lr * O`` to its rows.

Every carrier is row-local and is applied to every piece, including the rows an owner holds
itself, so the update does not depend on the world size or on which rank owns a matrix. With the
``bf16`` carrier both ways the update is exactly single-process QMuon's (same NS input bits, same
inverse norm, same NS, same bf16 result added to the parameter).

Bytes: :attr:`QMuon.comm_stats` after each step (see :meth:`ShardedStep.finish`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..optim.newton_schulz import NS_BATCH_MAX_ELEMENTS, newton_schulz_folded
from ..optim.qmuon import adjusted_lr
from .carrier import CARRIERS, RETURN_CARRIERS, Carrier, get_carrier
from ..quant import state as qstate
from .e0m3_sharded import e0m3_update_sharded
from .grasp_sharded import check_grasp_layout, grasp_update_sharded
from .sharding import SUPPORTED_SHARDED_FORMATS, RowLayout, check_sharded_param, row_layout, shard_state

__all__ = ["ShardedStep", "plan_owners"]


@dataclass
class _ShardItem:
    """One matrix (or fused part) of a sharded parameter, seen from this rank."""

    layout: RowLayout
    r0: int  # global rows [r0, r1) of the part
    r1: int
    param_rows: Tensor  # this rank's rows of the part in the local parameter shard (a view, any ndim)
    ns_input: Tensor  # this rank's rows of the NS input (2-D view of the local grad)
    sums: Tensor  # this rank's per-row-block sums of squares (n, nb) fp32
    nb: int
    lr: float
    eps: float
    coefficients: tuple[float, float, float]
    steps: int
    forward: str  # forward carrier name

    @property
    def rows(self) -> int:
        return self.r1 - self.r0

    @property
    def cols(self) -> int:
        return self.layout.cols

    def rows_of(self, r: int) -> tuple[int, int]:
        """Global rows of this part held by rank ``r``."""
        return self.layout.overlap(r, self.r0, self.r1)

    def n_of(self, r: int) -> int:
        a, b = self.rows_of(r)
        return b - a


def plan_owners(items: list[_ShardItem], world: int) -> list[int]:
    """Owner rank of every item: greedy least-loaded by NS cost, largest first; ties go to the
    rank holding most of the item's rows, then to the lowest rank. Deterministic, so every rank
    computes the same plan without communicating."""
    owners = [0] * len(items)
    load = [0] * world
    order = sorted(range(len(items)), key=lambda j: (-items[j].rows * items[j].cols * min(items[j].rows, items[j].cols), j))
    for j in order:
        it = items[j]
        cost = it.rows * it.cols * min(it.rows, it.cols)
        best = min(range(world), key=lambda r: (load[r], -it.n_of(r), r))
        owners[j] = best
        load[best] += cost
    return owners


class ShardedStep:
    """The per-step driver QMuon creates when it sees DTensor parameters (every rank must call
    :meth:`agree_on_updates` and :meth:`finish` in the same step: both are collective)."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self.items: list[_ShardItem] = []
        self._group_of: dict[int, dict[str, Any]] = {}
        mesh = None
        for gi, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                if not isinstance(p, DTensor):
                    continue
                names = group.get("param_names")
                where = f"parameter {names[i]!r}" if names else f"param group {gi} parameter #{i}"
                check_sharded_param(p, where)
                if mesh is None:
                    mesh = p.device_mesh
                    self.device = p.to_local().device  # collectives run on it (NCCL needs CUDA tensors)
                elif p.device_mesh != mesh:
                    raise NotImplementedError(
                        f"QMuon: {where} is sharded on a different device mesh than the other parameters; sharded "
                        "QMuon needs every DTensor parameter on one 1-D mesh (fully_shard with one mesh)")
                if group["use_muon"] and group["state_format"] not in SUPPORTED_SHARDED_FORMATS:
                    raise NotImplementedError(
                        f"QMuon: state_format={group['state_format']!r} is not supported for sharded (FSDP2) parameters "
                        f"({where}). Use one of {', '.join(SUPPORTED_SHARDED_FORMATS)}")
                if group["use_muon"] and group["state_format"] == "grasp4":
                    check_grasp_layout(p, qstate.format_options(group), where)  # before any state changes
                self._group_of[id(p)] = group
        assert mesh is not None
        self.mesh = mesh
        self.pg = mesh.get_group()
        self.world = mesh.size()
        self.rank = mesh.get_local_rank()
        self.flag_bytes = 0
        self.sent = 0  # bytes of NS payload this rank sent to other ranks in this step
        ret = getattr(opt, "comm_return", "int8")
        fwd = getattr(opt, "comm_carrier", "int8")
        if fwd not in CARRIERS or ret not in RETURN_CARRIERS:
            raise ValueError(f"QMuon: comm_carrier must be one of {CARRIERS} and comm_return one of {RETURN_CARRIERS}")
        self.forward_default = fwd
        self.ret: Carrier = get_carrier(ret)

    # ------------------------------------------------------------------ 1. agreement
    def agree_on_updates(self, where: list[tuple[int, int]], finite: list[bool]) -> tuple[list[tuple[int, int]], list[bool]]:
        """Make the has-gradient and finite decisions of DTensor parameters global (all-reduce
        MAX of ``[has_grad, bad]`` per sharded parameter). Plain parameters keep local decisions."""
        local = dict(zip(where, finite))
        sharded: list[tuple[int, int]] = []
        for gi, group in enumerate(self.opt.param_groups):
            for i, p in enumerate(group["params"]):
                if isinstance(p, DTensor):
                    sharded.append((gi, i))
        host = [0] * (2 * len(sharded))
        for j, key in enumerate(sharded):
            if key in local:
                host[2 * j] = 1
                host[2 * j + 1] = 0 if local[key] else 1
        flags = torch.tensor(host, dtype=torch.int32)
        if self.world > 1 and sharded:
            flags = flags.to(self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.pg)
            self.flag_bytes = flags.numel() * flags.element_size()
            host = flags.tolist()
        agreed = {}
        for j, (gi, i) in enumerate(sharded):
            if host[2 * j]:
                agreed[(gi, i)] = not host[2 * j + 1]
                p = self.opt.param_groups[gi]["params"][i]
                if p.grad is None:  # others have a gradient: this rank's rows got none
                    p.grad = torch.zeros_like(p)
        out_where, out_finite = [], []
        for gi, group in enumerate(self.opt.param_groups):
            for i, p in enumerate(group["params"]):
                key = (gi, i)
                if isinstance(p, DTensor):
                    if key in agreed:
                        out_where.append(key)
                        out_finite.append(agreed[key])
                elif key in local:
                    out_where.append(key)
                    out_finite.append(local[key])
        return out_where, out_finite

    # ------------------------------------------------------------------ 2. momentum (called per parameter)
    def init_state(self, p: DTensor, st: dict[str, Tensor]) -> None:
        group = self._group_of.get(id(p), {})
        shard_state(p, st, grid_block=qstate.format_options(group).grid_block)

    #: formats whose sharded momentum update needs collectives (QMuon hands them to :meth:`format_update`)
    COLLECTIVE_FORMATS = ("grasp4", "e0m3")

    def format_update(self, name: str, params: list[Tensor], states: list[dict[str, Tensor]], grads2d: list[Tensor],
                      block_sums: list[Tensor], **kw: Any) -> None:
        """The momentum update of one group in a :attr:`COLLECTIVE_FORMATS` format: sharded parameters
        through :func:`.grasp_sharded.grasp_update_sharded` / :func:`.e0m3_sharded.e0m3_update_sharded`
        (collective), plain ones through the single-process format."""
        fmt = qstate.get_format(name)
        split: dict[bool, list[int]] = {True: [], False: []}
        for j, p in enumerate(params):
            split[isinstance(p, DTensor)].append(j)
        per = ("streams", "offsets", "keys")
        for is_dt, idx in split.items():
            if not idx:
                continue
            sub = {k: ([v[j] for j in idx] if k in per else v) for k, v in kw.items()}
            args = ([states[j] for j in idx], [grads2d[j] for j in idx], [block_sums[j] for j in idx])
            if is_dt and name == "grasp4":
                grasp_update_sharded([params[j] for j in idx], *args, **sub, group=self.pg)
            elif is_dt:
                e0m3_update_sharded(*args, **sub, group=self.pg)
            else:
                fmt.update(*args, **sub)

    def add(self, p: DTensor, param_local: Tensor, g2: Tensor, sums: Tensor, group: dict[str, Any]) -> None:
        """Queue the parts of one sharded parameter (``g2``: local NS input rows, ``sums``: their
        block sums)."""
        lay = row_layout(p)
        bounds = [0]
        for n in group["parts"] or (lay.rows,):
            bounds.append(bounds[-1] + n)
        fwd = "mxfp8" if group.get("ns_input", "bf16") == "mxfp8" else self.forward_default
        for r0, r1 in zip(bounds[:-1], bounds[1:]):
            lo, hi = lay.overlap(lay.rank, r0, r1)
            a, b = lo - lay.start, hi - lay.start
            self.items.append(_ShardItem(
                layout=lay, r0=r0, r1=r1, param_rows=param_local[a:b], ns_input=g2[a:b], sums=sums[a:b],
                nb=sums.shape[1], lr=adjusted_lr(float(group["lr"]), group["adjust_lr_fn"], r1 - r0, lay.cols),
                eps=float(group["eps"]), coefficients=tuple(group["ns_coefficients"]), steps=int(group["ns_steps"]),
                forward=fwd,
            ))

    # ------------------------------------------------------------------ 3-6. exchange and NS
    def _fwd_bytes(self, it: _ShardItem, n: int) -> int:
        return get_carrier(it.forward).nbytes(n, it.cols) + 4 * n * it.nb

    def _ret_bytes(self, it: _ShardItem, n: int) -> int:
        return self.ret.nbytes(n, it.cols)

    def _exchange(self, send: Tensor, send_sizes: list[int], recv_sizes: list[int]) -> Tensor:
        assert send.numel() == sum(send_sizes)
        self.sent += send.numel() - send_sizes[self.rank]  # counted from the buffer handed to the collective
        if self.world == 1:
            return send
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=send.device)
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.pg)
        return recv

    def finish(self) -> None:
        """Run the distributed Newton-Schulz for every queued item and apply the updates; record
        the bytes in ``opt.comm_stats`` / ``opt.comm_bytes_last_step``."""
        items, world, me = self.items, self.world, self.rank
        stats = {"flags_bytes": float(self.flag_bytes)}
        if not items:
            self._record(stats, 0, 0, 0, 0.0, 0.0, 0.0)
            return
        owners = plan_owners(items, world)
        owned = [j for j, o in enumerate(owners) if o == me]
        device = items[0].ns_input.device

        # Byte matrices W[s][d] (every rank can compute them) for both trips.
        fwd_w = [[0] * world for _ in range(world)]
        ret_w = [[0] * world for _ in range(world)]
        for j, it in enumerate(items):
            d = owners[j]
            for s in range(world):
                n = it.n_of(s)
                fwd_w[s][d] += self._fwd_bytes(it, n)
                ret_w[d][s] += self._ret_bytes(it, n)

        # Forward: encode my rows of each item for its owner.
        send = torch.empty(sum(fwd_w[me]), dtype=torch.uint8, device=device)
        off = 0
        for d in range(world):
            for j, it in enumerate(items):
                if owners[j] != d:
                    continue
                n = it.ns_input.shape[0]
                carrier = get_carrier(it.forward)
                nb_c = carrier.nbytes(n, it.cols)
                carrier.encode_into(it.ns_input, send[off: off + nb_c])
                off += nb_c
                send[off: off + 4 * n * it.nb].view(torch.float32).view(n, it.nb).copy_(it.sums)
                off += 4 * n * it.nb
        recv = self._exchange(send, fwd_w[me], [fwd_w[s][me] for s in range(world)])

        # Owner: assemble whole matrices straight into bf16 NS batches.
        groups: dict[tuple, list[int]] = defaultdict(list)
        for j in owned:
            it = items[j]
            groups[(it.rows, it.cols, it.coefficients, it.steps)].append(j)
        slot: dict[int, tuple[Tensor, int]] = {}
        batches: list[tuple[Tensor, list[int], tuple, int]] = []
        for (rows, cols, coefficients, steps), js in groups.items():
            per_batch = max(1, NS_BATCH_MAX_ELEMENTS // (rows * cols))
            for start in range(0, len(js), per_batch):
                chunk = js[start: start + per_batch]
                batch = torch.empty((len(chunk), rows, cols), dtype=torch.bfloat16, device=device)
                for k, j in enumerate(chunk):
                    slot[j] = (batch, k)
                batches.append((batch, chunk, coefficients, steps))
        full_sums = {j: torch.empty((items[j].rows, items[j].nb), dtype=torch.float32, device=device) for j in owned}
        off = 0
        for s in range(world):
            for j in owned:
                it = items[j]
                lo, hi = it.rows_of(s)
                n = hi - lo
                carrier = get_carrier(it.forward)
                nb_c = carrier.nbytes(n, it.cols)
                batch, k = slot[j]
                batch[k, lo - it.r0: hi - it.r0].copy_(carrier.decode(recv[off: off + nb_c], n, it.cols))
                off += nb_c
                full_sums[j][lo - it.r0: hi - it.r0].copy_(recv[off: off + 4 * n * it.nb].view(torch.float32).view(n, it.nb))
                off += 4 * n * it.nb

        outs: dict[int, Tensor] = {}
        for batch, chunk, coefficients, steps in batches:
            sumsq = torch.stack([full_sums[j].sum() for j in chunk])
            eps = torch.tensor([items[j].eps for j in chunk], dtype=torch.float32, device=device)
            inv_norm = torch.maximum(sumsq.sqrt(), eps).reciprocal()
            out = newton_schulz_folded(batch, inv_norm, coefficients, steps)
            for k, j in enumerate(chunk):
                outs[j] = out[k]

        # Return: each rank's rows of every owned result.
        send = torch.empty(sum(ret_w[me]), dtype=torch.uint8, device=device)
        off = 0
        for s in range(world):
            for j in owned:
                it = items[j]
                lo, hi = it.rows_of(s)
                nb_c = self.ret.nbytes(hi - lo, it.cols)
                self.ret.encode_into(outs[j][lo - it.r0: hi - it.r0], send[off: off + nb_c])
                off += nb_c
        recv = self._exchange(send, ret_w[me], [ret_w[d][me] for d in range(world)])
        off = 0
        for d in range(world):
            for j, it in enumerate(items):
                if owners[j] != d:
                    continue
                n = it.ns_input.shape[0]
                nb_c = self.ret.nbytes(n, it.cols)
                if n:
                    o = self.ret.decode(recv[off: off + nb_c], n, it.cols)
                    it.param_rows.add_(o.reshape(it.param_rows.shape), alpha=-it.lr)
                off += nb_c

        elements = sum(it.rows * it.cols for it in items)
        wire = sum(fwd_w[s][d] + ret_w[s][d] for s in range(world) for d in range(world) if s != d)
        bf16_wire = sum(2 * 2 * it.n_of(s) * it.cols for j, it in enumerate(items) for s in range(world) if s != owners[j])
        exchange = sum(self._fwd_bytes(it, it.rows) + self._ret_bytes(it, it.rows) for it in items)
        self._record(stats, self.sent, wire, elements, bf16_wire, exchange, float(len(owned)))

    def _record(self, stats: dict[str, float], mine: int, wire: int, elements: int, bf16_wire: float,
                exchange: float, owned: float) -> None:
        el = max(elements, 1)
        stats.update({
            "ns_bytes_sent": float(mine),  # this rank, both trips, to other ranks
            "ns_bytes_total": float(wire),  # all ranks
            "muon_elements": float(elements),
            "wire_bytes_per_param": wire / el,
            "bf16_wire_bytes_per_param": bf16_wire / el,  # bf16 both ways, same plan
            "exchange_bytes_per_param": exchange / el,  # if every element crossed the wire both ways (bf16: 4)
            "matrices_owned": owned,
        })
        self.opt.comm_stats = stats
        self.opt.comm_bytes_last_step = int(mine + stats["flags_bytes"])
