"""QMuon's step over a flat layout (:mod:`.flat`): :class:`FlatOwnerStep`, the base of the DeepSpeed
ZeRO client optimizer (:mod:`qmuon.integrations.deepspeed` reads the layout and hooks ``step()``;
the steps of a call: docs/deepspeed.md, "How it works").

The Muon step is the core pipeline's (:mod:`qmuon.core.pipeline`), called as every other driver
calls it. Momentum is sharded as under FSDP2 (ZeRO 1-3): every rank keeps the momentum of the rows
its slice of a matrix touches and updates it with :func:`~qmuon.core.pipeline.momentum_inputs` /
:func:`~qmuon.core.pipeline.update_momentum` (the group's state format, QMuon's parameter indices
and the rows' global offsets as stochastic-rounding keys), which write the NS input and its
per-row-block sums of squares; a slice that starts or ends inside a row keeps that row at full
width (its other columns zero), so the kernels key each element's noise by its index in the whole
matrix and every quantization block wholly inside the slice is single-process QMuon's; a block cut
by the slice's end holds only this rank's elements (its own absmax). The NS input and the sums go
to the owner (:class:`.flat.FlatExchange`), which assembles the whole matrix and runs
:func:`~qmuon.core.pipeline.local_items` (NorMuon's second moment, kept on the owner, per part)
and :func:`~qmuon.core.pipeline.orthogonalize` with the step's :class:`~qmuon.core.pipeline.BatchSizes`
of every Muon matrix, as single-process QMuon batches; each NS output is kept for the return trip
and applied to the slices by :meth:`FlatOwnerStep._apply_update`. At ZeRO stage 0 every rank holds
the averaged gradient, so the owner keeps the whole matrix's momentum and nothing travels forward.
AdamW slices are stepped piece by piece by :func:`qmuon.core.adamw.adamw_param_step`.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from ..core import adamw as core_adamw
from ..core import apply as weight_apply
from ..core import pipeline
from ..core.apply import apply_update_
from ..core.config import FORMAT_OVERRIDES, param_group_view
from ..core.plan import MatrixPart, ParamPlan, plan_param, true_shape
from ..core.variants import NORMUON_STATE, RowMoment, part_row_moment, row_moment_shape
from ..quant import adamw as qadamw
from ..quant import state as qstate
from .carrier import forward_carrier
from .flat import FlatExchange, FlatParam, Segment, deal_owners, part_runs, row_pieces
from .flat_state import FlatStateMixin

__all__: list[str] = []

log = logging.getLogger(__name__)

def _apply_parts(parts: tuple[MatrixPart, ...], where: str) -> tuple[MatrixPart, ...]:
    """The parts :meth:`FlatOwnerStep._apply_update` applies, as ranges of the stored
    ``(rows, cols)`` matrix. A bank member's parts (gate and up of one expert; gpt-oss interleaves
    them) share the member's range, which then gets one scaled update: their lr factors must agree
    (equal fused parts; always so for transformers' experts)."""
    out: dict[tuple[int, int, int, int], MatrixPart] = {}
    for part in parts:
        key = (part.r0, part.r1, part.c0, part.c1)
        seen = out.setdefault(key, part)
        if seen.lr_scale != part.lr_scale:
            raise NotImplementedError(
                f"parameter {where!r}: the fused parts of one bank member have different lr adjustments "
                f"({seen.lr_scale} and {part.lr_scale}); over flat partitions a bank member's parts must have equal "
                "shapes. Use equal parts or FSDP2 (qmuon_fsdp)")
    return tuple(out.values())


class FlatOwnerStep(FlatStateMixin, Optimizer):
    """A QMuon's step over a flat layout (see the module docstring). Subclasses read the layout
    (each :class:`.flat.FlatParam`'s ``holders``; ``_group``, ``_world``, ``_rank``), then call
    :meth:`_plan_slices`; they give :meth:`_views` (this rank's data and gradient of a slice) and
    call :meth:`_flat_step` from ``step()``."""

    def __init__(self, qmuon: Any) -> None:
        groups = [g for g in qmuon.param_groups if len(g["params"])]  # DeepSpeed drops empty groups
        self._params: list[FlatParam] = []
        #: Muon parameter index -> its plan (QMuon's: the parameter index is its stochastic-rounding key).
        self._plans: dict[int, ParamPlan] = {}
        for gi, g in enumerate(groups):
            for pos, p in enumerate(g["params"]):
                where = (g.get("param_names") or [None] * len(g["params"]))[pos] or f"group {gi} #{pos}"
                if not p.requires_grad:
                    raise ValueError(f"parameter {where!r} does not require grad: remove frozen parameters from the "
                                     "optimizer (build_optimizer leaves them out)")
                if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                    raise ValueError(f"parameter {where!r} has dtype {p.dtype}; flat partitions hold float parameters")
                # The full shape, also for parameters zero.Init already partitioned (they look 1-D, empty).
                shape = true_shape(p)
                index = len(self._params)
                plan = plan_param(shape, g, index, where) if g["use_muon"] else None
                self._params.append(FlatParam(index, gi, pos, shape, shape.numel(), bool(g["use_muon"]),
                                              _apply_parts(plan.parts, where) if plan is not None else ()))
                if plan is not None:
                    self._plans[index] = plan
        # The model's parameters, in _params order: DeepSpeed links each to its ZeRO partition (read at attach).
        self._model_params: list[Tensor] = [p for g in groups for p in g["params"]]
        # Batch sizes from every Muon matrix (global shapes), so each owner batches as single-process QMuon does.
        self._batch_sizes = pipeline.BatchSizes.of(
            [(pt.cols, pt.rows) if pt.transposed else (pt.rows, pt.cols) for plan in self._plans.values()
             for pt in plan.parts], qmuon.batch_budget)
        #: The wrapped QMuon: its lr bookkeeping (lr_follows links, lr_ratios) runs once per optimizer step.
        self._qmuon = qmuon
        #: State kept by a matrix's owner, by index: its momentum (QMuon's entry) where the owner keeps
        #: it whole (:meth:`_sliced` False), and NorMuon's second moment.
        self._muon_state: dict[int, dict[str, Tensor]] = {}
        #: ZeRO 1-3: the momentum of the rows this rank's slice of each Muon matrix touches (QMuon's
        #: entry over those rows, full width), by index.
        self._muon_slices: dict[int, dict[str, Tensor]] = {}
        #: Whether the ranks keep their slices' momentum (ZeRO 1-3); False at stage 0 (on the owner).
        self._sharded_momentum = False
        #: ZeRO 1-3: Muon matrices whose format is not row-local (grasp4, e0m3), whose momentum the
        #: owner keeps whole, updated from the gathered gradient as at stage 0.
        self._whole_momentum: set[int] = set()
        self._out: dict[int, Tensor] = {}
        #: NS items (matrices or fused parts) orthogonalized in the last call, per Muon parameter index.
        self._ns_items_call: dict[int, int] = defaultdict(int)
        # The QMuon's own group dicts (torch's add_param_group keeps the dict objects): DeepSpeed swaps
        # their "params" for its flat partitions, and a scheduler built on the QMuon sets their "lr".
        super().__init__(groups, dict(qmuon.defaults))
        # DeepSpeed's ZeRO optimizer calls step() once per group with param_groups narrowed to that
        # group; every group dict is kept here to know which one a call is for.
        self._all_groups = list(self.param_groups)
        self.nonfinite_skips = 0
        self.ns_items: dict[int, int] = {}
        self.comm_stats: dict[str, float] = {}
        #: Whether the slices are partitions, so the NS inputs travel to the owners (ZeRO 1-3); False
        #: when every rank holds every parameter whole (ZeRO stage 0).
        self._gather = True
        self._group: Any = None
        self._world = 1
        self._rank = 0
        self._device = groups[0]["params"][0].device if groups else torch.device("cpu")
        self._owned: list[FlatParam] = []
        #: AdamW parameters: index -> this rank's pieces of its slice ((offset, rows, width):
        #: quant.adamw.flat_slice_pieces for quantized moments, row pieces for bf16 slices, one
        #: (length, 1) piece for elementwise moments) and their state, one AdamW state dict per piece.
        self._pieces: dict[int, list[tuple[int, int, int]]] = {}
        self._slice_state: dict[int, list[dict[str, Tensor]]] = {}
        #: Muon parameters with bf16 slices (DeepSpeed's bf16 master partitions): index -> the
        #: weight-correction state of this rank's slice (``weight_ecc`` under bf16_update="ecc8", 1-D).
        self._weight_state: dict[int, dict[str, Tensor]] = {}
        #: Muon parameter index -> the optimizer step its update of this call is written with (the
        #: matrix's momentum step, shared by every rank holding a slice; keys its stochastic rounding).
        self._muon_step: dict[int, int] = {}
        self._grad_dtype = torch.float32  # dtype the Muon momentum is stepped in and the NS input formed in
        self._carriers = (qmuon.comm_carrier, qmuon.comm_return)  # the sharded step's (newton_schulz section)
        self._exchange: FlatExchange | None = None

    def _plan_slices(self) -> None:
        """Once the layout is read: deal the Muon matrices to owners with the sharded step's planner
        (:func:`qmuon.distributed.flat.deal_owners`: Newton-Schulz cost, ties to the rank holding
        most of the matrix), set up the exchange with the sharded step's carriers
        (:class:`qmuon.distributed.flat.FlatExchange`; at ZeRO 1-3 the slices' sums of squares ride
        with their NS input; a matrix in a format that is not row-local sends its gradient), and cut this rank's slice of every AdamW
        parameter into pieces: on the parameter's block grid for quantized moments
        (:func:`qmuon.quant.adamw.flat_slice_pieces`), on rows for bf16 slices, whole otherwise."""
        deal_owners(self._params, self._world)
        self._owned = [p for p in self._params if p.muon and p.owner == self._rank]
        self._pieces = {}
        rounded = False
        for info in self._params:
            v = self._views(info)
            rounded = rounded or (v is not None and weight_apply.writes_rounded(v[0]))
            seg = info.holders[self._rank] if not info.muon else None
            if seg is None or seg.length == 0:
                continue
            family = self._all_groups[info.group].get("state_format", qadamw.FULL_PRECISION)
            pieces = qadamw.flat_slice_pieces(family, info.shape, seg.start, seg.length)
            if pieces is None and weight_apply.writes_rounded(v[0]):
                # bf16 slice with elementwise moments: piece by piece, so each write gets its
                # bf16_update rule with the whole parameter's element indices.
                pieces = row_pieces(info.cols, seg.start, seg.length)
            # elementwise moments on an fp32 slice: the 1-D slice as one (length, 1) piece (a 1-D
            # parameter's own view: core.adamw steps it in the same row blocks)
            self._pieces[info.index] = pieces if pieces is not None else [(0, seg.length, 1)]
        # bf16 slices (DeepSpeed's bf16 master, or a bf16 model at stage 0): the Muon momentum is stepped
        # on the bf16 gradients, as a single-process bf16 model's is (its NS input is the bf16 grad).
        self._grad_dtype = torch.bfloat16 if rounded else torch.float32
        fwd, ret = self._carriers
        # comm_carrier="auto": the NS input in its own dtype (int8 missed the 0.99 cosine target: forward_carrier)
        self._exchange = FlatExchange(self._group, self._world, self._rank,
                                      forward_carrier(fwd, "bf16" if rounded else "fp32"), ret)
        self._sharded_momentum = self._gather
        self._whole_momentum = set()
        if self._sharded_momentum:  # the sums of squares of each slice's NS input rows ride with it
            for info in self._params:
                if info.muon:
                    view = param_group_view(self._all_groups[info.group], info.pos)
                    if not qstate.get_format(view["state_format"]).row_local:
                        # grasp4 / e0m3 scale (and factor) a whole matrix, so a slice's rows cannot be updated
                        # alone: the gradient travels and the owner keeps the whole momentum
                        self._whole_momentum.add(info.index)
                        continue
                    self._exchange.sum_blocks[info.index] = qstate.format_options(view).block_size

    def _views(self, info: FlatParam) -> tuple[Tensor, Tensor | None] | None:
        """This rank's (data, grad) 1-D views of a parameter's slice, or None when it holds none."""
        raise NotImplementedError

    def _flat_step(self, params: list[FlatParam], first_call: bool) -> None:
        """Step ``params`` (every rank passes the same); ``first_call``: the call starts an optimizer step."""
        views: list[tuple[Tensor, Tensor | None] | None] = [None] * len(self._params)
        for info in params:
            views[info.index] = self._views(info)
        self._device = next((v[0].device for v in views if v is not None), self._device)
        live = self._finite_params(params, views)

        ex = self._exchange
        ex.start(first_call)
        muon_live = [p for p in params if p.muon and p.index in live]
        by_owner: dict[int, list[FlatParam]] = defaultdict(list)
        for p in muon_live:
            by_owner[p.owner].append(p)
        has_muon = any(p.muon for p in params)  # the same on every rank: no exchange for AdamW-only calls
        if first_call:  # a new optimizer step: the QMuon's lr links and lr_ratios, as QMuon.step runs them
            self._qmuon._follow_lrs()
            self._qmuon._check_group_lrs()
        for gi in sorted({p.group for p in params if p.muon}):
            pipeline.record_auto_choices(self._all_groups[gi], self._device)  # what "auto" chose, saved with the groups
        # 1. the NS input of each owned Muon matrix, whole, on its owner: ZeRO 1-3, every rank updates
        # its slices' momentum and sends their NS input and sums of squares (forward carrier); stage 0,
        # every rank holds the averaged gradient and the owner updates the whole momentum (below).
        grids: dict[int, Tensor] = {}
        if self._gather and has_muon:
            sums: dict[int, Tensor] = {}
            flats = self._slice_momentum([p for p in muon_live if self._sliced(p.index)], views, sums)
            for p in muon_live:  # formats that are not row-local: the averaged gradient goes to the owner
                if not self._sliced(p.index) and views[p.index] is not None and p.holders[self._rank].length:
                    flats[p.index] = views[p.index][1].to(self._grad_dtype)
            full, grids = ex.gather(by_owner, flats, self._grad_dtype, self._device, sums)
            del flats, sums
        else:
            full = {p.index: g if (g := views[p.index][1]).dtype in (torch.float32, self._grad_dtype) else g.float()
                    for p in by_owner[self._rank]}

        # 2. the owner's whole-matrix NS (the core pipeline), AdamW on this rank's slices.
        self._out = {}
        self._ns_items_call.clear()
        items: list[pipeline.NSItem] = []
        owned = {p.index for p in by_owner[self._rank]}
        for group, mine in self._by_group_view([p for p in params if p.index in owned]):
            self._owner_items(group, mine, full, grids, items)
        pipeline.orthogonalize(items, self._batch_sizes)
        for info in params:
            v = views[info.index]
            if info.index in self._pieces and info.index in live and v is not None and v[1] is not None:
                self._adamw_slice_step(info, v[0], v[1])
        if first_call:  # a new optimizer step (DeepSpeed steps groups in order, one call each)
            self.ns_items = {}
        for k, v in self._ns_items_call.items():
            self.ns_items[k] = self.ns_items.get(k, 0) + v

        # 3. the NS output back to every rank holding a slice (return carrier); each applies it to its slice.
        if has_muon:
            ex.scatter(by_owner, {i: o.view(-1) for i, o in self._out.items()}, self._device,
                       lambda p, seg, o: self._apply_update(p, views[p.index][0], seg, o))
        ex.count(muon_live, self._gather, 3 * 8 * (len(self._params) + 1) if self._world > 1 else 0)
        self.comm_stats = ex.comm_stats

    def _adamw_slice_step(self, info: FlatParam, data: Tensor, grad: Tensor) -> None:
        """AdamW on this rank's flat slice of a parameter with quantized moments: each piece is a
        ``(rows, width)`` matrix stepped by QMuon's own AdamW step (core.adamw.adamw_param_step, the
        fused kernels), with the moment formats the whole parameter's shape gives."""
        group = self._all_groups[info.group]
        family = group["state_format"]
        rule = group.get("bf16_update", "nearest")
        states = self._slice_state.get(info.index)
        pieces = self._pieces[info.index]
        start = info.holders[self._rank].start
        if grad.dtype != data.dtype:
            grad = grad.to(data.dtype)
        if states is None:
            states = self._slice_state[info.index] = [
                core_adamw.init_state(family, info.shape, data.narrow(0, off, r * w).view(r, w), rule)
                for off, r, w in pieces]
        for (off, r, w), st in zip(pieces, states):
            piece = data.narrow(0, off, r * w).view(r, w)
            weight_apply.sync_weight_state(piece, st, rule)  # a rule changed on resume: codes created / dropped
            # first_index: the piece's first element in the whole parameter (bf16 stochastic rounding
            # draws the noise of the unsharded parameter, as single-process QMuon does).
            core_adamw.adamw_param_step(piece, grad.narrow(0, off, r * w).view(r, w), st, group,
                                        global_shape=info.shape, key=info.index, first_index=start + off)

    def _by_group_view(self, params: list[FlatParam]) -> list[tuple[dict[str, Any], list[FlatParam]]]:
        """``params`` (Muon) as QMuon._muon_group_step steps them: per group in order, the group's
        parameters together, then each promoted one (a layout override) alone with its group view."""
        out = []
        for gi in sorted({p.group for p in params}):
            group = self._all_groups[gi]
            overrides = group.get(FORMAT_OVERRIDES) or {}
            mine = [p for p in params if p.group == gi]
            out.append((group, [p for p in mine if p.pos not in overrides]))
            out += [(param_group_view(group, p.pos), [p]) for p in mine if p.pos in overrides]
        return [(g, ps) for g, ps in out if ps]

    def _slice_momentum(self, live: list[FlatParam], views: list[tuple[Tensor, Tensor | None] | None],
                        sums: dict[int, Tensor]) -> dict[int, Tensor]:
        """ZeRO 1-3: update the momentum of this rank's slice of every matrix of ``live`` (the rows the
        slice touches, :attr:`_muon_slices`); returns each slice's NS input (flat, the slice's elements)
        and puts the rows' per-row-block sums of squares in ``sums``."""
        flats: dict[int, Tensor] = {}
        mine = [p for p in live if views[p.index] is not None and p.holders[self._rank].length]
        for group, ps in self._by_group_view(mine):
            fmt = qstate.get_format(group["state_format"])
            opts = qstate.format_options(group)
            grads, states, first_rows = [], [], []
            for p in ps:
                seg, cols = p.holders[self._rank], p.cols
                r0, r1 = seg.start // cols, (seg.start + seg.length - 1) // cols + 1
                at = seg.start - r0 * cols
                g = views[p.index][1]
                if at == 0 and seg.length == (r1 - r0) * cols and g.dtype == self._grad_dtype:
                    rows = g.view(r1 - r0, cols)  # whole rows: the NS input replaces the gradient, as in QMuon
                else:
                    # A partial first / last row is kept at full width, zero outside the slice: the kernels
                    # then key stochastic rounding by the element's index in the whole matrix and cut
                    # quantization blocks on its grid (zeros change no absmax; their codes stay 0).
                    rows = torch.zeros((r1 - r0, cols), dtype=self._grad_dtype, device=g.device)
                    rows.view(-1).narrow(0, at, seg.length).copy_(g)
                st = self._muon_slices.get(p.index)
                if st is None:
                    st = self._muon_slices[p.index] = qstate.init_momentum_state(fmt.name, r1 - r0, cols, opts=opts,
                                                                                 device=g.device)
                grads.append(rows)
                states.append(st)
                first_rows.append(r0)
                flats[p.index] = rows.view(-1).narrow(0, at, seg.length)
            inputs = pipeline.momentum_inputs(group, grads, states, [self._plans[p.index] for p in ps], first_rows)
            for p, s in zip(ps, pipeline.update_momentum(group, inputs)):
                sums[p.index] = s
        return flats

    def _owner_items(self, group: dict[str, Any], params: list[FlatParam], full: dict[int, Tensor],
                     grids: dict[int, Tensor], items: list[pipeline.NSItem]) -> None:
        """The NS items of owned matrices ``params`` of ``group``: their whole NS inputs ``full`` with
        the sums of squares ``grids`` (ZeRO 1-3), or, at stage 0, their averaged gradients ``full``,
        whose momentum the owner updates here (the NS input replaces the gradient)."""
        whole = [p for p in params if p.index not in grids]
        sums = dict(grids)
        if whole:
            fmt = qstate.get_format(group["state_format"])
            opts = qstate.format_options(group)
            grads = [full[p.index].view(p.rows, p.cols) for p in whole]
            states = []
            for p, g in zip(whole, grads):
                st = self._muon_state.get(p.index)
                if st is None or qstate.STEP not in st:
                    st = self._muon_state[p.index] = {**(st or {}), **qstate.init_momentum_state(
                        fmt.name, g.shape[0], g.shape[1], opts=opts, device=g.device)}
                states.append(st)
            inputs = pipeline.momentum_inputs(group, grads, states, [self._plans[p.index] for p in whole],
                                              [0] * len(whole))
            sums.update(zip((p.index for p in whole), pipeline.update_momentum(group, inputs)))
        normuon = group.get("variant", "muon") == "normuon"
        settings = pipeline.ns_settings(group, self._device)
        for p in params:
            plan = self._plans[p.index]
            moments = None
            if normuon:  # NorMuon's second moment of the layer's rows, on the owner
                st = self._muon_state.setdefault(p.index, {})
                v = st.get(NORMUON_STATE)
                if v is None:
                    v = st[NORMUON_STATE] = torch.zeros(row_moment_shape(plan), dtype=torch.float32, device=self._device)
                b2 = float(group["normuon_beta2"])
                moments = [RowMoment(part_row_moment(v, plan, part), b2) for part in plan.parts]
            items.extend(pipeline.local_items(plan, full[p.index].view(p.rows, p.cols), sums[p.index], group, settings,
                                              self._capture(p), moments))

    def _capture(self, info: FlatParam) -> Any:
        """The NS items' ``apply`` for an owned matrix: keep each part's NS output for the return trip."""

        def capture(part: MatrixPart, o: Tensor) -> None:
            buf = self._out.get(info.index)
            if buf is None:
                buf = self._out[info.index] = torch.empty(info.shape, dtype=o.dtype, device=o.device)
            block = part.block(buf)
            block.copy_(o.reshape(block.shape))
            self._ns_items_call[info.index] += 1

        return capture

    def _apply_update(self, p: FlatParam, data: Tensor, seg: Segment, o: Tensor) -> None:
        """``p *= 1 - lr wd`` then ``p -= lr lr_scale(part) * O`` on this rank's slice, as QMuon does on
        the whole matrix (``lr_scale`` is torch.optim.Muon's shape adjustment of each fused part, on
        the layer's ``(out, in)`` shape)."""
        group = self._all_groups[p.group]
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        cautious = bool(group.get("cautious_weight_decay", False))
        rule = group.get("bf16_update", "nearest")
        # bf16 slices (DeepSpeed's bf16 master partitions): the group's bf16_update rule, with this
        # slice's correction codes and the rounding counter (seed, parameter index, the owner's
        # momentum step, global element index) of single-process QMuon, so a slice writes the bits
        # the whole bf16 parameter would get. fp32 master slices: exact fp32 arithmetic.
        wstate: dict[str, Tensor] = {}
        if weight_apply.writes_rounded(data):
            wstate = self._weight_state.setdefault(p.index, {})
            weight_apply.sync_weight_state(data, wstate, rule)
        stochastic = rule == "stochastic" and weight_apply.writes_rounded(data)
        seed, step = int(group.get("seed", 0)), self._muon_step.get(p.index, 0)
        # The parts' runs cover the slice once: each element gets one decay-and-update write (core.apply).
        for part in p.parts:
            for at, n, width, c0, c1 in part_runs(part, p.cols, seg.start, seg.length):
                d = data.narrow(0, at, n * width).view(n, width)[:, c0:c1]
                st = {k: v.narrow(0, at, n * width).view(n, width)[:, c0:c1] for k, v in wstate.items()}
                apply_update_(d, o.narrow(0, at, n * width).view(n, width)[:, c0:c1], alpha=-lr * part.lr_scale,
                              decay=1.0 - lr * wd, cautious=cautious, bf16_update=rule, state=st or None,
                              rng=(seed, p.index, step, seg.start + at + c0) if stochastic else None)

    def _step_state(self, info: FlatParam) -> dict[str, Tensor] | None:
        """The momentum state whose step this rank contributes to the flag all-reduce for Muon matrix
        ``info`` (the owner's at stage 0; at ZeRO 1-3 the first rank holding a slice's), or None."""
        if not self._sliced(info.index):
            st = self._muon_state.get(info.index) if info.owner == self._rank else None
        else:
            first = next((r for r, seg in enumerate(info.holders) if seg is not None and seg.length), None)
            st = self._muon_slices.get(info.index) if first == self._rank else None
        return st if st is not None and qstate.STEP in st else None

    def _finite_params(self, params: list[FlatParam], views: list[tuple[Tensor, Tensor | None] | None]) -> set[int]:
        """Indices of parameters (of ``params``) whose averaged gradient is finite on every rank (one
        all-reduce of a flag per parameter); raises on every rank for a bad gradient in a
        ``nonfinite="raise"`` group before this call changes anything. The same all-reduce carries each
        Muon matrix's momentum step (:meth:`_step_state`), so ``self._muon_step`` (the step every rank
        holding a slice keys its bf16 stochastic rounding by) costs no collective of its own."""
        idx, grads = [], []
        for info in params:
            v = views[info.index]
            if v is not None and v[1] is not None and v[1].numel():
                idx.append(info.index)
                grads.append(v[1])
        # float64: exact for step counts up to 2**53
        bad = torch.zeros(len(self._params) + 1, dtype=torch.float64, device=self._device)
        present = torch.zeros_like(bad)
        # The owner's momentum step of each Muon matrix (every rank holding a slice writes its update
        # with it: single-process QMuon keys a bf16 weight's stochastic rounding by that step).
        steps = torch.zeros_like(bad)
        for info in params:
            st = self._step_state(info) if info.muon else None
            if st is not None:
                steps[info.index] = st["step"]  # a tensor copy: no host sync per matrix
        if grads:
            flags = torch.tensor([0.0 if ok else 1.0 for ok in pipeline.finite_flags(grads)], dtype=bad.dtype,
                                 device=self._device)
            where = torch.tensor(idx, device=self._device)
            bad[where] = flags
            present[where] = 1.0
        both = torch.stack([bad, present, steps])
        if self._world > 1:
            dist.all_reduce(both, group=self._group)
        bad_list, has_grad, step_list = both.tolist()  # one read of the agreed flags and steps
        self._muon_step = {p.index: int(step_list[p.index]) + 1 for p in params if p.muon}
        live = {p.index for p in params if has_grad[p.index] > 0 and bad_list[p.index] == 0}
        bad_params = [p for p in params if bad_list[p.index] > 0]
        if not bad_params:
            return live
        labels = []
        for p in bad_params:
            names = self._all_groups[p.group].get("param_names")
            labels.append(repr(names[p.pos]) if names else f"group {p.group} parameter #{p.pos} (shape {tuple(p.shape)})")
        if any(self._all_groups[p.group].get("nonfinite", "skip") == "raise" for p in bad_params):
            raise FloatingPointError(
                f"QMuon (flat partitions): non-finite gradient in {', '.join(labels)}; no parameter or optimizer state was "
                "changed. Use nonfinite='skip' to skip such updates, or check the loss scale / learning rate"
            )
        self.nonfinite_skips += len(bad_params)
        if self._rank == 0:
            log.warning("QMuon (flat partitions): skipped update of %s (non-finite gradient)", ", ".join(labels))
        return live

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self._all_groups:
            for p in g["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()

    # ------------------------------------------------------------------ introspection
    @property
    def owners(self) -> list[int]:
        """Owner rank of every Muon parameter, in parameter order (empty before the layout is read)."""
        return [p.owner for p in self._params if p.muon] if self._exchange is not None else []

    def muon_state(self, index: int) -> dict[str, Tensor] | None:
        """The momentum state (QMuon's entry: codes, scales, ``step``) of this rank's part of Muon
        parameter ``index``: at ZeRO 1-3 the rows its slice touches (full width; rows
        ``holders[rank].start // cols`` on), at stage 0 the whole matrix on its owner; None when it
        keeps none or the matrix has not stepped. NorMuon's second moment is in the owner's entry."""
        st = self._muon_slices.get(index) if self._sliced(index) else self._muon_state.get(index)
        return st if st and qstate.STEP in st else None

    def _sliced(self, index: int) -> bool:
        """Whether the ranks keep the momentum of their slices of Muon matrix ``index`` (ZeRO 1-3,
        row-local formats); else its owner keeps it whole."""
        return self._sharded_momentum and index not in self._whole_momentum

    def state_nbytes(self, muon_only: bool = True) -> int:
        """Bytes of optimizer state on this rank (Muon momentum of its slices, or at stage 0 of its owned
        matrices, and NorMuon's moments of its owned matrices by default; with
        ``muon_only=False`` also the AdamW state of its slices, quantized pieces included)."""
        total = sum(qstate.state_nbytes(st) for d in (self._muon_state, self._muon_slices) for st in d.values())
        if not muon_only:
            total += sum(qstate.state_nbytes(st) for sts in self._slice_state.values() for st in sts)
            total += sum(qstate.state_nbytes(st) for st in self._weight_state.values())
        return total
