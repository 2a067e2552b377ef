"""Distributed Newton-Schulz for sharded (FSDP2, HSDP, FSDP x TP) Muon parameters.

Newton-Schulz must see each whole matrix (running it per shard is a different, blockwise
algorithm). With ``N`` ranks each holding some rows of every matrix, one optimizer step does:

Rows are *stored* rows: for an ``(in, out)`` weight (Hugging Face ``Conv1D``) ``Shard(0)`` splits the
layer's input features, and for fused parts along dim 1 every rank holds rows of every part. The
momentum and its quantized blocks stay in that stored layout (momentum is elementwise); only the
owner transposes, when it runs Newton-Schulz on the layer's ``(out, in)`` matrix.

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
5. **Orthogonalize** (owner): the owner sums the block sums of each whole matrix in the same
   order as single-process QMuon (so ``1 / ||G||`` is bit-identical) and hands its matrices to
   :func:`qmuon.core.pipeline.orthogonalize`, the batching every driver uses; each
   matrix is decoded from the received rows straight into its batch slot, and each result is
   encoded into the return buffer as soon as its batch is done, so no rank holds more than one
   batch of whole matrices at a time.
6. **Return all-to-all**: the owner sends each rank its rows of the result (return carrier);
   each rank applies ``p = decay * p - adjusted_lr * O`` to its rows (cautious weight decay: its
   mask reads the same rows of ``O``).

NorMuon (``variant="normuon"``): the second moment has one fp32 value per output row and, for
``(out, in)`` weights, lives with the rows like the momentum (``Shard(0)``, so DCP reshards it).
Each rank's rows of it ride with its NS input to the owner (4 bytes per row), the owner rescales
the whole matrix's result (:func:`~qmuon.core.variants.normuon_scale`, the rescale needs
the whole matrix's norm) before encoding the return, and the updated rows ride back with it: no
extra collective. ``(in, out)`` weights (neurons = stored columns) are refused for now, except
in expert banks: a member's second moment (its neurons in either orientation) sits in the stored
row that holds the member, so it stays with the expert and is updated where the expert is
orthogonalized; under HSDP the owner shares it with the member's result over the replicate dim.

Banks (mixture-of-experts layers stored ``(E, out, in)``, :mod:`qmuon.core.plan`) keep one
stored row per expert, so ``Shard(0)`` always puts whole experts on a rank (an uneven split, 8
experts on 3 ranks, moves whole experts: 3 + 3 + 2). Each rank orthogonalizes its own experts'
matrices locally, as single-process QMuon does (same NS input, same norm, same batching rule):
bank parts never enter the exchange, and a step whose only sharded matrices are expert banks runs
no all-to-all at all (expert parallelism needs no Newton-Schulz communication).

HSDP (a ``(replicate, shard)`` mesh, :mod:`.mesh`): the ``R`` replicas hold the same rows and the
same gradients, so a matrix needs orthogonalizing once, not once per replica. The plan deals the
step's matrices to all ``R x S`` ranks (greedy by NS cost over ``(replica, shard)``; a bank member
goes to one of the ranks holding it); each replica runs steps 4-6 over its shard group for its
own matrices, and every rank then shares the return-carrier bytes of its rows of its replica's
results (and of the bank members it orthogonalized) with its peers of the other replicas (one
all-gather over the replicate group); every rank decodes and applies all of them, so the replicas
stay identical and each rank runs about ``1 / (R S)`` of the Newton-Schulz work.

Tensor parallel (a ``(dp, tp)`` mesh, :mod:`.tensor_parallel`): the exchange runs over the
flattened mesh as over a 1-D mesh of ``dp * tp`` ranks, with pieces instead of rows: a rowwise
shard sends its rectangle (rows x its columns) and its per-row-block sums, the owner places both
where they sit in the whole matrix (so ``1 / ||G||`` is single-process QMuon's when the column
shards start on block boundaries) and returns each rank its rectangle of the result. A piece
held by several ranks (a parameter outside the TP plan, the same rows on every tp rank) is sent
by one of them and returned to all.

The plan (which rows each rank holds, layout checks) is built once per set of parameters, by
:class:`ShardedStep`'s constructor; a step only fills it.

Every carrier is row-local and is applied to every piece, including the rows an owner holds
itself, so the update does not depend on the world size or on which rank owns a matrix. With the
carrier both ways in the Newton-Schulz dtype (``bf16`` for ``ns_dtype="bf16"``, ``fp32`` for
``"fp32"``) the update is exactly single-process QMuon's (same NS input bits, same inverse norm,
same NS, same result added to the parameter).

Bytes: :attr:`QMuon.comm_stats` after each step (see :meth:`ShardedStep.finish`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..core.apply import WeightWrite, apply_update_, block_rng
from ..core.config import param_group_view
from ..core.pipeline import BatchSizes, NSItem, NSSettings, apply_to, orthogonalize, part_item, row_sumsq
from ..core.plan import ParamPlan
from ..core.variants import RowMoment, part_row_moment
from ..quant import state as qstate
from ..quant.layout import check_sharded_param, row_layout, shard_state
from .carrier import Carrier, forward_carrier, get_carrier
from .mesh import ShardMesh
from .plan import ShardItem, comm_figures, merge_comm_stats, ns_cost, plan_owners, plan_replica_owners
from .tensor_parallel import TensorParallelWorld, check_tensor_parallel_param, fit_blocks_to_shards, \
    log_fitted_blocks, uses_tensor_parallel

__all__ = ["ShardedStep", "merge_comm_stats"]


class ShardedStep:
    """The distributed driver of a QMuon whose parameters include ``Shard(0)`` DTensors.

    Built once per set of parameters (the layout checks run here, before any state exists); each
    step calls :meth:`begin`, :meth:`agree_on_updates`, :meth:`add` per sharded parameter and
    :meth:`finish`. ``agree_on_updates`` and ``finish`` are collective: every rank calls them in
    the same step.
    """

    def __init__(self, param_groups: list[dict[str, Any]], comm_carrier: str, comm_return: str) -> None:
        self.param_groups = param_groups
        self._layouts: dict[int, Any] = {}
        self._group_of: dict[int, dict[str, Any]] = {}
        self._sharded_keys: list[tuple[int, int]] = []
        sharded = [(gi, i, p, self._where(group, gi, i)) for gi, group in enumerate(param_groups)
                   for i, p in enumerate(group["params"]) if isinstance(p, DTensor)]
        assert sharded
        self.device = sharded[0][2].to_local().device  # collectives run on it (NCCL needs CUDA tensors)
        tp = TensorParallelWorld([p for _, _, p, _ in sharded]) if uses_tensor_parallel([p for *_, p, _ in sharded]) \
            else None
        first, first_where = sharded[0][2], sharded[0][3]
        if tp is None:
            ShardMesh.of(first, first_where)  # a mesh of more than 2 dims is refused naming the parameter
        fitted: list[str] = []
        for gi, i, p, where in sharded:
            group = param_groups[gi]
            if tp is not None:
                lay = tp.layout(p)
                fitted.append(fit_blocks_to_shards(p, group, i, lay, where) or "")  # narrow rowwise shards
                check_tensor_parallel_param(p, param_group_view(group, i), lay, where)
            else:
                self._check_one_mesh(p, where, first, first_where)
                lay = row_layout(p, where)
            if (group["use_muon"] and group.get("variant") == "normuon" and group["orientation"] != "out_in"
                    and not group.get("bank_dims")):
                raise NotImplementedError(
                    f"QMuon: {where}: variant='normuon' on a sharded orientation={group['orientation']!r} weight: "
                    "its neurons are stored columns, not the rows FSDP2 shards. Use variant='muon' for this "
                    "group, or a model with nn.Linear (out, in) weights")
            if group["use_muon"] and tp is None:
                view = param_group_view(group, i)  # a promoted parameter's own layout
                fmt = qstate.get_format(view["state_format"])
                fmt.check_sharded_layout(lay, qstate.format_options(view), where)  # before any state changes
            self._layouts[id(p)] = lay
            self._group_of[id(p)] = group
            self._sharded_keys.append((gi, i))
        log_fitted_blocks([line for line in fitted if line])
        self.mesh = tp.mesh if tp is not None else first.device_mesh
        if tp is not None:  # the exchange runs over the flattened (dp, tp) mesh, no replicas
            self.shard_mesh = ShardMesh(mesh=tp.mesh, shard_dim=-1, shard_group=tp.group, shard_size=tp.world,
                                        shard_rank=tp.rank, replicate_group=None, replicas=1, replica=0)
        else:
            self.shard_mesh = ShardMesh.of(first, first_where)
        sm = self.shard_mesh
        self.tensor_parallel = tp is not None
        self.process_group = sm.shard_group  # momentum collectives, flags and the all-to-all: the shard dim
        self.world = sm.shard_size
        self.rank = sm.shard_rank
        self.replicas, self.replica = sm.replicas, sm.replica
        comm_carrier = forward_carrier(comm_carrier)
        get_carrier(comm_carrier), get_carrier(comm_return)  # raise for an unknown carrier
        #: Nothing crosses a process boundary (one rank, no replicas: FSDP2 on one device): the
        #: carriers are then lossless, so the step is plain QMuon's (the forward one follows each
        #: matrix's NS dtype in :meth:`add`; fp32 returns bf16 and fp32 results exactly).
        self.nothing_sent = self.world == 1 and self.replicas == 1
        self.forward_default = comm_carrier
        self.ret: Carrier = get_carrier("fp32" if self.nothing_sent else comm_return)
        self.begin()

    @staticmethod
    def _where(group: dict[str, Any], gi: int, i: int) -> str:
        names = group.get("param_names")
        return f"parameter {names[i]!r}" if names else f"param group {gi} parameter #{i}"

    @staticmethod
    def _check_one_mesh(p: DTensor, where: str, first: DTensor, first_where: str) -> None:
        """Shard(0) / HSDP: every parameter on one mesh, sharded the same way."""
        check_sharded_param(p, where)
        if p.device_mesh != first.device_mesh:
            raise NotImplementedError(
                f"QMuon: {where} (placements {tuple(p.placements)}) is sharded on the mesh {p.device_mesh}, "
                f"but {first_where} on {first.device_mesh}; sharded QMuon needs every DTensor parameter on one mesh "
                "(fully_shard every unit with the same 1-D or (replicate, shard) mesh), or a (dp, tp) mesh and its "
                "dp sub-mesh (tensor parallelism)")
        if tuple(p.placements) != tuple(first.placements):
            raise NotImplementedError(
                f"QMuon: {where} has placements {tuple(p.placements)}, but {first_where} has "
                f"{tuple(first.placements)}; sharded QMuon needs every DTensor parameter sharded the same way, "
                "(Shard(0),) on a 1-D mesh or (Replicate(), Shard(0)) on a (replicate, shard) HSDP mesh "
                "(fully_shard every unit with the same mesh)")

    def begin(self) -> None:
        """Start a step: forget the previous step's items and byte counts."""
        self.items: list[ShardItem] = []
        self.local_items: list[NSItem] = []  # whole bank members this rank holds (no exchange; 1-D mesh)
        # Every bank member part (rows, cols, shard holding it); HSDP: for those on this shard also
        # (index in bank_meta, part, NS input rows, block sums, group, settings, local param, first row, lr)
        self.bank_meta: list[tuple[int, int, int]] = []
        self.bank_local: list[tuple[Any, ...]] = []
        self.flag_bytes = 0
        self.sent = 0  # bytes of NS payload this rank sent to other ranks in this step

    def row_offset(self, p: DTensor) -> int:
        """Global index of this rank's first row of ``p``."""
        return self._layouts[id(p)].start

    # ------------------------------------------------------------------ 1. agreement
    def agree_on_updates(self, where: list[tuple[int, int]], finite: list[bool],
                         keys: list[tuple[int, int]] | None = None) -> tuple[list[tuple[int, int]], list[bool]]:
        """Make the has-gradient and finite decisions of DTensor parameters global (all-reduce
        MAX of ``[has_grad, bad]`` per sharded parameter). Plain parameters keep local decisions.

        ``keys``: the ``(group, index)`` of the parameters this call steps, in group order (None:
        every parameter); only their sharded ones are agreed on, so a per-unit step (gradient
        release) all-reduces the flags of its own parameters. Every rank passes the same keys."""
        local = dict(zip(where, finite))
        if keys is None:
            keys = [(gi, i) for gi, g in enumerate(self.param_groups) for i in range(len(g["params"]))]
        wanted = set(keys)
        sharded = [k for k in self._sharded_keys if k in wanted]
        host = [0] * (2 * len(sharded))
        for j, key in enumerate(sharded):
            if key in local:
                host[2 * j] = 1
                host[2 * j + 1] = 0 if local[key] else 1
        flags = torch.tensor(host, dtype=torch.int32)
        if self.world > 1 and sharded:
            flags = flags.to(self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
            self.flag_bytes = flags.numel() * flags.element_size()
            host = flags.tolist()
        agreed = {}
        for j, (gi, i) in enumerate(sharded):
            if host[2 * j]:
                agreed[(gi, i)] = not host[2 * j + 1]
                p = self.param_groups[gi]["params"][i]
                if p.grad is None:  # others have a gradient: this rank's rows got none
                    p.grad = torch.zeros_like(p)
        out_where, out_finite = [], []
        for key in sorted(keys):
            gi, i = key
            if isinstance(self.param_groups[gi]["params"][i], DTensor):
                if key in agreed:
                    out_where.append(key)
                    out_finite.append(agreed[key])
            elif key in local:
                out_where.append(key)
                out_finite.append(local[key])
        return out_where, out_finite

    # ------------------------------------------------------------------ 2. momentum (called per parameter)
    def init_state(self, p: DTensor, st: dict[str, Tensor], group: dict[str, Any] | None = None) -> None:
        """Wrap a new local state of ``p`` as DTensors with the global shape (so DCP reshards it);
        ``group``: the group as ``p`` is stepped (with its layout override), default its group."""
        group = group if group is not None else self._group_of[id(p)]
        shard_state(p, st, qstate.get_format(group["state_format"]), qstate.format_options(group))

    def add(self, p: DTensor, plan: ParamPlan, param_local: Tensor, g2: Tensor, sums: Tensor,
            group: dict[str, Any], settings: NSSettings, write: WeightWrite | None = None,
            moment: Tensor | None = None) -> None:
        """Queue the parts of one sharded parameter (``g2``: local NS input rows, ``sums``: their
        block sums; ``write``: how the update reaches ``param_local``, its state views and rounding
        counter, for the whole local shard, each part getting its block of them; ``moment``: the
        local rows of its NorMuon second moment)."""
        write = write if write is not None else WeightWrite()
        lay = self._layouts[id(p)]
        # ns_input="mxfp8": the MXFP8 carrier is the forward trip itself, so the owner's NS reads
        # the decoded rows as they arrive.
        if settings.carrier == "mxfp8":
            fwd = "mxfp8"
        elif self.nothing_sent:
            fwd = "fp32" if settings.dtype == torch.float32 else "bf16"  # the NS input as NS reads it
        else:
            fwd = self.forward_default
        owner_settings = dataclasses.replace(settings, carrier="bf16")
        lr = float(group["lr"])
        decay = 1.0 - lr * float(group["weight_decay"])
        cautious = bool(group.get("cautious_weight_decay", False))
        apply_local = apply_to(param_local, lr, first_row=lay.start, decay=decay, cautious=cautious, **write.rounding)
        if self.tensor_parallel and any(part.bank is not None for part in plan.parts):
            raise NotImplementedError("QMuon: expert banks on a (dp, tp) mesh are not supported; shard them with "
                                      "FSDP2 on a 1-D mesh or HSDP")
        beta2 = float(group.get("normuon_beta2", 0.0))
        for part in plan.parts:
            if part.bank is not None:  # a bank member lies in one stored row: wholly here, or not here
                here = lay.start <= part.r0 < lay.start + lay.local_rows
                holder = next(r for r, (a, b) in enumerate(lay.ranges) if a <= part.r0 < b)
                self.bank_meta.append((part.rows, part.cols, holder))  # every rank knows every member's holder
                # NorMuon: the member's second moment lives in its stored row, here (no communication)
                mom = RowMoment(part_row_moment(moment, plan, part, lay.start), beta2) \
                    if moment is not None and here else None
                if self.replicas > 1:
                    if here:
                        self.bank_local.append((len(self.bank_meta) - 1, part, g2, sums, group, settings, apply_local,
                                                lay.start, lr, mom))
                elif here:
                    self.local_items.append(part_item(part, g2, sums, group, settings, apply_local, lay.start,
                                                      moment=mom))
                continue
            lo, hi = lay.overlap(lay.rank, part.r0, part.r1)
            a, b = lo - lay.start, hi - lay.start
            # this rank's stored columns of the part, relative to its local shard (a rowwise
            # tensor-parallel shard holds some columns only; a row shard holds them all)
            clo, chi = lay.col_overlap(lay.rank, part.c0, lay.cols if part.c1 is None else part.c1)
            ca, cb = clo - lay.col_start, chi - lay.col_start
            if part.whole_rows:
                def cut(t: Tensor) -> Tensor:
                    return t[a:b]
                rows, ns_in, part_sums = param_local[a:b], g2[a:b], sums[a:b]
            else:  # a column block (fused parts along dim 1): per-row sums, as single-process QMuon
                def cut(t: Tensor) -> Tensor:
                    return t[a:b, ca:cb]
                rows, ns_in = param_local[a:b, ca:cb], g2[a:b, ca:cb]
                part_sums = row_sumsq(ns_in)
            part_write = WeightWrite(write.bf16_update,
                                     {k: cut(v) for k, v in write.state.items()} if write.state else None,
                                     block_rng(write.rng, param_local, rows))
            self.items.append(ShardItem(
                layout=lay, r0=part.r0, r1=part.r1, c0=part.c0, c1=part.c1, transposed=part.transposed,
                param_rows=rows, ns_input=ns_in, sums=part_sums, nb=part_sums.shape[1], lr=lr * part.lr_scale,
                eps=float(group["eps"]), settings=owner_settings, forward=fwd, decay=decay, write=part_write,
                cautious=cautious,
                moment_rows=None if moment is None else part_row_moment(moment, plan, part, lay.start, (lo, hi)),
                beta2=beta2, block_sums=part.whole_rows, block=int(group["block_size"]),
            ))

    # ------------------------------------------------------------------ 3-6. exchange and NS
    def _fwd_bytes(self, it: ShardItem, s: int) -> int:
        """Bytes rank ``s`` sends to the owner of ``it``: its piece (forward carrier), the piece's
        fp32 sums of squares and NorMuon second moment rows; 0 for a rank holding a copy only."""
        if not it.sends(s):
            return 0
        n = it.n_of(s)
        return get_carrier(it.forward).nbytes(n, it.w_of(s)) + 4 * n * it.nb_of(s) + it.moment_bytes * n

    def _ret_bytes(self, it: ShardItem, s: int) -> int:
        """Bytes the owner of ``it`` returns to rank ``s``: its piece of the result (every holder)."""
        if not it.holds(s):
            return 0
        n = it.n_of(s)
        return self.ret.nbytes(n, it.w_of(s)) + it.moment_bytes * n

    def _whole_bytes(self, it: ShardItem) -> int:
        """Both trips' bytes if the whole matrix crossed the wire."""
        fwd = get_carrier(it.forward).nbytes(it.rows, it.cols) + 4 * it.rows * it.sums_layout(self.world)[0]
        return fwd + self.ret.nbytes(it.rows, it.cols) + 2 * it.moment_bytes * it.rows

    def _exchange(self, send: Tensor, send_sizes: list[int], recv_sizes: list[int]) -> Tensor:
        assert send.numel() == sum(send_sizes)
        self.sent += send.numel() - send_sizes[self.rank]  # counted from the buffer handed to the collective
        if self.world == 1:
            return send
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=send.device)
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.process_group)
        return recv

    def finish(self, batch_budget: float | BatchSizes = 1.0) -> dict[str, float]:
        """Run the distributed Newton-Schulz for every queued item, apply the updates, and return
        this step's communication figures. ``batch_budget``: the step's :class:`BatchSizes` (every
        rank batches exactly as a single process would), or a float budget."""
        items, world, me = self.items, self.world, self.rank
        stats = {"flags_bytes": float(self.flag_bytes), "local_matrices": float(len(self.local_items))}
        R = self.replicas
        if not items and not self.bank_meta:  # the same on every rank: no exchange at all
            stats.update(self._flops([], [], [], []))
            orthogonalize(self.local_items, batch_budget)
            self.local_items = []
            return comm_figures(stats, 0, 0, 0, 0.0, 0.0, 0.0)
        if R == 1:  # bank members stay where they live
            owners_v, bank_owners = plan_owners(items, world), [holder for _, _, holder in self.bank_meta]
        else:
            owners_v, bank_owners = plan_replica_owners(items, self.bank_meta, world, R)
        stats.update(self._flops(items, owners_v, self.bank_meta, bank_owners))
        mine = [j for j, v in enumerate(owners_v) if v // world == self.replica]  # this replica's matrices
        owners = {j: owners_v[j] % world for j in mine}  # their owner in the shard group
        owned = [j for j in mine if owners[j] == me]
        device = self.device

        # Byte matrices W[s][d] (every rank of the replica can compute them) for both trips.
        fwd_w = [[0] * world for _ in range(world)]
        ret_w = [[0] * world for _ in range(world)]
        for j in mine:
            it, d = items[j], owners[j]
            for s in range(world):
                fwd_w[s][d] += self._fwd_bytes(it, s)
                ret_w[d][s] += self._ret_bytes(it, s)
        exchange = any(fwd_w[s][d] for s in range(world) for d in range(world))

        # Forward: encode my rows of each item for its owner.
        send = torch.empty(sum(fwd_w[me]), dtype=torch.uint8, device=device)
        off = 0
        for d in range(world):
            for j in mine:
                it = items[j]
                if owners[j] != d or not it.sends(me):
                    continue
                n = it.ns_input.shape[0]
                carrier = get_carrier(it.forward)
                nb_c = carrier.nbytes(n, it.w_of(me))
                carrier.encode_into(it.ns_input if it.ns_input.is_contiguous() else it.ns_input.contiguous(),
                                    send[off: off + nb_c])
                off += nb_c
                send[off: off + 4 * n * it.nb].view(torch.float32).view(n, it.nb).copy_(it.sums)
                off += 4 * n * it.nb
                if it.moment_rows is not None:
                    send[off: off + 4 * n].view(torch.float32).copy_(it.moment_rows)
                    off += 4 * n
        recv = self._exchange(send, fwd_w[me], [fwd_w[s][me] for s in range(world)]) if exchange else send
        del send

        # Where each rank's rows of each owned item sit in the receive buffer, and where the
        # results go in the return buffer (both laid out rank by rank, item by item).
        recv_at: dict[tuple[int, int], int] = {}
        off = 0
        for s in range(world):
            for j in owned:
                recv_at[(j, s)] = off
                off += self._fwd_bytes(items[j], s)
        ret_send = torch.empty(sum(ret_w[me]), dtype=torch.uint8, device=device)
        ret_at: dict[tuple[int, int], int] = {}
        off = 0
        for s in range(world):
            for j in owned:
                ret_at[(j, s)] = off
                off += self._ret_bytes(items[j], s)

        ns_items = []
        for j in owned:
            it = items[j]
            n_blocks, block_at = it.sums_layout(world)
            full_sums = torch.empty((it.rows, n_blocks), dtype=torch.float32, device=device)
            full_v = torch.empty(it.rows, dtype=torch.float32, device=device) if it.moment_rows is not None else None
            for s in range(world):
                if not it.sends(s):
                    continue
                lo, hi = it.rows_of(s)
                n, nb, k = hi - lo, it.nb_of(s), block_at[s]
                at = recv_at[(j, s)] + get_carrier(it.forward).nbytes(n, it.w_of(s))
                full_sums[lo - it.r0: hi - it.r0, k: k + nb].copy_(recv[at: at + 4 * n * nb].view(torch.float32).view(n, nb))
                if full_v is not None:
                    at += 4 * n * nb
                    full_v[lo - it.r0: hi - it.r0].copy_(recv[at: at + 4 * n].view(torch.float32))
            ns_items.append(NSItem(
                rows=it.rows, cols=it.cols, sumsq=full_sums.sum(), eps=it.eps, settings=it.settings,
                apply=self._returner(j, ret_send, ret_at, full_v), load=self._loader(j, recv, recv_at), device=device,
                transpose=it.transposed, moment=None if full_v is None else RowMoment(full_v, it.beta2)))
        # HSDP: the bank members of this shard that this rank orthogonalizes; their results are
        # encoded (return carrier) for every replica, this one included, so replicas stay identical.
        bank_mine = [b for b in self.bank_local if bank_owners[b[0]] == self.replica * world + me]
        bank_buf = torch.empty(sum(self._bank_bytes(b) for b in bank_mine), dtype=torch.uint8, device=device)
        off = 0
        for b in bank_mine:
            _, part, g2, sums, group, settings, _, first_row, _, mom = b
            nb = self._bank_bytes(b)
            ns_items.append(part_item(part, g2, sums, group, settings, self._bank_encoder(bank_buf[off: off + nb], mom),
                                      first_row, moment=mom))
            off += nb
        orthogonalize(ns_items + self.local_items, batch_budget)
        self.local_items = []
        del recv

        back = self._exchange(ret_send, ret_w[me], [ret_w[d][me] for d in range(world)]) if exchange else ret_send
        if R == 1:
            self._apply_returned(back, [j for j in mine], owners)
        else:
            payload = torch.cat([back, bank_buf])
            for r, buf in enumerate(self._share_replicas(payload)):
                sub = [j for j, v in enumerate(owners_v) if v // world == r]
                at = self._apply_returned(buf, sub, {j: owners_v[j] % world for j in sub})
                for b in self.bank_local:
                    if bank_owners[b[0]] != r * world + me:
                        continue
                    _, part, _, _, _, _, apply_bank, _, _, mom = b
                    nb_c = self.ret.nbytes(part.rows, part.cols)
                    o = self.ret.decode(buf[at: at + nb_c], part.rows, part.cols)
                    apply_bank(part, o.view(part.rows, part.cols))  # decay and bf16 rounding as every write
                    if mom is not None:  # the owner's updated NorMuon second moment of the member's neurons
                        mom.v.copy_(buf[at + nb_c: at + self._bank_bytes(b)].view(torch.float32))
                    at += self._bank_bytes(b)
        self.bank_local, self.bank_meta = [], []

        elements = sum(it.rows * it.cols for it in items)
        wire = sum(fwd_w[s][d] + ret_w[s][d] for s in range(world) for d in range(world) if s != d)
        bf16_wire = sum(2 * items[j].n_of(s) * items[j].w_of(s) * (int(items[j].sends(s)) + 1)
                        for j in mine for s in range(world) if s != owners[j] and items[j].holds(s))
        exchange_b = sum(self._whole_bytes(it) for it in items)
        return comm_figures(stats, self.sent, wire, elements, bf16_wire, exchange_b, float(len(owned) + len(bank_mine)))

    def _apply_returned(self, recv: Tensor, sub: list[int], owners: dict[int, int]) -> int:
        """Decode and apply this rank's rows of the results of items ``sub`` (laid out owner by
        owner, item by item); returns the bytes read."""
        off = 0
        for d in range(self.world):
            for j in sub:
                if owners[j] != d:
                    continue
                it = self.items[j]
                if not it.holds(self.rank):
                    continue
                n, w = it.n_of(self.rank), it.w_of(self.rank)
                nb_c = self.ret.nbytes(n, w)
                o = self.ret.decode(recv[off: off + nb_c], n, w)
                apply_update_(it.param_rows, o.reshape(it.param_rows.shape), alpha=-it.lr, decay=it.decay,
                              cautious=it.cautious, **it.write.rounding)
                off += nb_c
                if it.moment_rows is not None:
                    it.moment_rows.copy_(recv[off: off + 4 * n].view(torch.float32))
                    off += 4 * n
        return off

    def _bank_bytes(self, b: tuple[Any, ...]) -> int:
        """Bytes of one HSDP bank member part shared over the replicate dim: its result (return
        carrier) and, under NorMuon, the updated fp32 second moment of its neurons."""
        part, mom = b[1], b[-1]
        return self.ret.nbytes(part.rows, part.cols) + (4 * mom.v.numel() if mom is not None else 0)

    def _bank_encoder(self, buf: Tensor, mom: RowMoment | None = None) -> Callable[[Any, Tensor], None]:
        """``apply`` of a bank member part orthogonalized for every replica: encode the result (and
        the NorMuon second moment, which the NS pipeline updated before calling this)."""

        def encode(part: Any, out: Tensor) -> None:
            nb_c = self.ret.nbytes(part.rows, part.cols)
            self.ret.encode_into(out.contiguous(), buf[:nb_c])
            if mom is not None:
                buf[nb_c:].view(torch.float32).copy_(mom.v)

        return encode

    def _share_replicas(self, payload: Tensor) -> list[Tensor]:
        """Every replica's payload (this rank's peers along the replicate dim), by one all-gather of
        buffers padded to the longest."""
        R = self.replicas
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
        sizes = [torch.empty_like(size) for _ in range(R)]
        dist.all_gather(sizes, size, group=self.shard_mesh.replicate_group)
        n = [int(x.item()) for x in sizes]
        padded = torch.zeros(max(n), dtype=torch.uint8, device=payload.device)
        padded[: payload.numel()].copy_(payload)
        bufs = [torch.empty_like(padded) for _ in range(R)]
        dist.all_gather(bufs, padded, group=self.shard_mesh.replicate_group)
        self.sent += (R - 1) * padded.numel()
        self.flag_bytes += (R - 1) * size.numel() * size.element_size()
        return [b[:k] for b, k in zip(bufs, n)]

    def _flops(self, items: list[Any], owners_v: list[int], banks: list[tuple[int, int, int]],
               bank_owners: list[int]) -> dict[str, float]:
        """This rank's share of the step's Newton-Schulz cost (:func:`ns_cost`)."""
        me_v = self.replica * self.world + self.rank
        total = sum(ns_cost(it.rows, it.cols) for it in items) + sum(ns_cost(r, c) for r, c, _ in banks)
        mine = sum(ns_cost(it.rows, it.cols) for it, v in zip(items, owners_v) if v == me_v)
        mine += sum(ns_cost(r, c) for (r, c, _), v in zip(banks, bank_owners) if v == me_v)
        return {"ns_cost_owned": float(mine), "ns_cost_total": float(total),
                "ns_share": (mine / total) if total else 0.0}

    def _loader(self, j: int, recv: Tensor, recv_at: dict[tuple[int, int], int]) -> Callable[[Tensor], None]:
        """Decode every rank's rows of owned item ``j`` into a batch slot."""
        it = self.items[j]

        def load(dest: Tensor) -> None:
            carrier = get_carrier(it.forward)
            for s in range(self.world):
                if not it.sends(s):
                    continue
                lo, hi = it.rows_of(s)
                clo, chi = it.cols_of(s)
                n, w = hi - lo, chi - clo
                at = recv_at[(j, s)]
                dest[lo - it.r0: hi - it.r0, clo - it.c0: chi - it.c0].copy_(
                    carrier.decode(recv[at: at + carrier.nbytes(n, w)], n, w).view(n, w))

        return load

    def _returner(self, j: int, buf: Tensor, ret_at: dict[tuple[int, int], int],
                  full_v: Tensor | None = None) -> Callable[[Tensor], None]:
        """Encode each rank's rows of owned item ``j``'s result (and of its updated NorMuon second
        moment ``full_v``, which the NS pipeline updated before calling this) into the return buffer."""
        it = self.items[j]

        def apply(out: Tensor) -> None:
            for s in range(self.world):
                if not it.holds(s):
                    continue
                lo, hi = it.rows_of(s)
                clo, chi = it.cols_of(s)
                at = ret_at[(j, s)]
                rows = out[lo - it.r0: hi - it.r0, clo - it.c0: chi - it.c0]  # strided for transposed parts
                nb_c = self.ret.nbytes(hi - lo, chi - clo)
                self.ret.encode_into(rows if rows.is_contiguous() else rows.contiguous(), buf[at: at + nb_c])
                if full_v is not None:
                    buf[at + nb_c: at + nb_c + 4 * (hi - lo)].view(torch.float32).copy_(full_v[lo - it.r0: hi - it.r0])

        return apply
