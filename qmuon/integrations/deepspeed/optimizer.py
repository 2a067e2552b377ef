"""The client optimizer: :class:`WholeMatrixZeroOptimizer` (see the package docstring)."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from ...core import adamw as core_adamw
from ...core import apply as weight_apply
from ...core import pipeline
from ...core.apply import apply_update_
from ...core.plan import plan_param, true_shape
from ...distributed.flat import FlatExchange, FlatParam, Segment, deal_owners, part_runs, row_pieces
from ...optim.qmuon import QMuon
from ...quant import adamw as qadamw
from ...quant import state as qstate
from .attach import ZeroAttachMixin
from .config import check_accelerate_plugin
from .layout import _apply_parts, _placeholder
from .optimizer_state import ZeroStateMixin

__all__ = ["WholeMatrixZeroOptimizer"]

log = logging.getLogger(__name__)

# Group keys the wrapper keeps in sync into its inner QMuon before each step (schedulers change them).
# bf16_update is not: the wrapper writes every low-precision weight itself (the inner QMuon holds
# gradient buffers and fp32 slices only, and keeps "nearest", which creates no weight state).
_SKIP_SYNC = ("params", "param_names", "bf16_update")


class WholeMatrixZeroOptimizer(ZeroAttachMixin, ZeroStateMixin, Optimizer):
    """Client optimizer for ``deepspeed.initialize`` that runs a :class:`~qmuon.QMuon`'s
    algorithm with whole-matrix Newton-Schulz under ZeRO stages 0 to 3 (see the package docstring).

    Build it from a fresh QMuon (for example ``qmuon.build_optimizer(model)``), pass it as
    ``optimizer=`` to ``deepspeed.initialize``, then call :meth:`attach` with the engine;
    :func:`initialize` does all three. The QMuon's parameter-group dicts are shared, not copied, so
    an LR scheduler built on the QMuon drives this optimizer.

    Attributes:
        nonfinite_skips: parameter updates skipped because their averaged gradient held NaN/Inf
            (groups with ``nonfinite="skip"``); the same count on every rank.
        ns_items: after a step, NS calls this rank made per Muon parameter index (one per matrix, or
            one per fused part); summed over ranks it is ``len(parts)`` (or 1) for every matrix.
        comm_stats: after a step, the bytes its Muon exchange moved (:meth:`_count_comm`), in the
            terms of ``QMuon.comm_stats`` under FSDP2.
    """

    def __init__(self, qmuon: QMuon) -> None:
        if not isinstance(qmuon, QMuon):
            raise TypeError(
                f"WholeMatrixZeroOptimizer wraps a qmuon.QMuon, got {type(qmuon).__name__}; build one "
                "with qmuon.build_optimizer(model)"
            )
        if qmuon.gradient_release is not None:
            raise ValueError(
                "gradient_release=True cannot combine with DeepSpeed ZeRO: ZeRO reduces and partitions the gradients "
                "into flat buckets after backward, so a parameter's hook would step it with its unreduced local "
                "gradient. Build the QMuon without gradient_release for DeepSpeed, or train with the qmuon_fsdp "
                "strategy (FSDP2), where release steps the reduced shards"
            )
        check_accelerate_plugin()  # offload_optimizer would have Accelerate drop this optimizer silently
        if any(len(st) for st in qmuon.state.values()):
            raise ValueError(
                "the QMuon already has optimizer state (it has stepped or loaded a checkpoint): wrap a fresh QMuon "
                "and restore state through engine.load_checkpoint"
            )
        if qmuon.max_nonfinite_skips is not None:
            raise NotImplementedError(
                f"max_nonfinite_skips={qmuon.max_nonfinite_skips} is not enforced under DeepSpeed (this wrapper skips "
                "non-finite updates itself and counts them in nonfinite_skips); build the QMuon without it")
        groups = [g for g in qmuon.param_groups if len(g["params"])]  # DeepSpeed drops empty groups
        self._params: list[FlatParam] = []
        inner_groups = []
        for gi, g in enumerate(groups):
            proxies = []
            for pos, p in enumerate(g["params"]):
                where = (g.get("param_names") or [None] * len(g["params"]))[pos] or f"group {gi} #{pos}"
                if not p.requires_grad:
                    raise ValueError(f"parameter {where!r} does not require grad: remove frozen parameters from the "
                                     "optimizer (build_optimizer leaves them out)")
                if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                    raise ValueError(f"parameter {where!r} has dtype {p.dtype}; DeepSpeed trains float parameters")
                # The full shape, also for parameters zero.Init already partitioned (they look 1-D, empty).
                shape = true_shape(p)
                info = FlatParam(len(self._params), gi, pos, shape, shape.numel(), bool(g["use_muon"]),
                              _apply_parts(plan_param(shape, g, 0, where).parts, where) if g["use_muon"] else ())
                self._params.append(info)
                proxies.append(_placeholder(shape, p.device) if info.muon else torch.zeros(0, device=p.device))
            ig = {k: v for k, v in g.items() if k != "params"}
            ig["params"] = proxies
            ig["bf16_update"] = "nearest"  # see _SKIP_SYNC
            if not g["use_muon"]:
                # The inner QMuon steps only the slices that keep fp32 moments (1-D, small or fp32-family
                # parameters): elementwise, a flat slice is exact. Quantized / bf16 moments are stepped
                # by this wrapper on pieces cut on the whole parameter's block grid (_adamw_slice_step).
                ig["state_format"] = qadamw.FULL_PRECISION
            inner_groups.append(ig)
        # The model's parameters, in _params order: DeepSpeed links each to its ZeRO partition (read at attach).
        self._model_params: list[Tensor] = [p for g in groups for p in g["params"]]
        # The inner optimizer keeps the same group structure (so parameter indices, the stochastic
        # rounding keys, are those of a single-process QMuon) but holds proxies, not the model's tensors.
        self._inner = QMuon(inner_groups)
        self._proxies = [p for g in self._inner.param_groups for p in g["params"]]
        # The owner's momentum update and whole-matrix Newton-Schulz are QMuon's own (core pipeline);
        # its updates are handed to _capture instead of being applied to the proxies.
        self._inner.update_sink = self._capture
        self._proxy_index = {id(proxy): info.index for info, proxy in zip(self._params, self._proxies)}
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
        self._mode: str | None = None  # "direct" (stage 0), "partitioned" (ZeRO 1/2) or "zero3"
        self._flats: list[Tensor] = []  # ZeRO-3: the flat fp32 partition of every sub-group
        self._flat_index: dict[int, int] = {}  # ZeRO-3: id(flat partition) -> sub-group
        self._group: Any = None
        self._world = 1
        self._rank = 0
        self._device = groups[0]["params"][0].device if groups else torch.device("cpu")
        self._owned: list[FlatParam] = []
        #: AdamW parameters with non-fp32 moments: index -> this rank's pieces of its slice
        #: (quant.adamw.flat_slice_pieces) and their state, one AdamW state dict per piece.
        self._pieces: dict[int, list[tuple[int, int, int]]] = {}
        self._slice_state: dict[int, list[dict[str, Tensor]]] = {}
        #: Muon parameters with bf16 slices (DeepSpeed's bf16 master partitions): index -> the
        #: weight-correction state of this rank's slice (``weight_ecc`` under bf16_update="ecc8", 1-D).
        self._weight_state: dict[int, dict[str, Tensor]] = {}
        #: Muon parameter index -> the optimizer step its update of this call is written with (the
        #: owner's momentum step, shared by every rank holding a slice; keys its stochastic rounding).
        self._muon_step: dict[int, int] = {}
        self._grad_dtype = torch.float32  # dtype the Muon gradients travel and are stepped in
        self._carriers = (qmuon.comm_carrier, qmuon.comm_return)  # the sharded step's (newton_schulz section)
        self._exchange: FlatExchange | None = None

    def _plan_slices(self) -> None:
        """Once the layout is read: deal the Muon matrices to owners with the sharded step's planner
        (:func:`qmuon.distributed.flat.deal_owners`: Newton-Schulz cost, ties to the rank holding
        most of the matrix), set up the exchange with the sharded step's carriers
        (:class:`qmuon.distributed.flat.FlatExchange`), and cut this rank's slice of every AdamW
        parameter with quantized (or bf16) moments into pieces on the parameter's block grid
        (:func:`qmuon.quant.adamw.flat_slice_pieces`)."""
        deal_owners(self._params, self._world)
        self._owned = [p for p in self._params if p.muon and p.owner == self._rank]
        self._exchange = FlatExchange(self._group, self._world, self._rank, *self._carriers)
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
                # bf16 slice with elementwise moments: stepped here too, piece by piece, so each write
                # gets its bf16_update rule with the whole parameter's element indices.
                pieces = row_pieces(info.cols, seg.start, seg.length)
            if pieces is not None:
                self._pieces[info.index] = pieces
        # bf16 slices (DeepSpeed's bf16 master, or a bf16 model at stage 0): the Muon gradients travel
        # and are stepped in bf16, as a single-process bf16 model's are (its NS input is the bf16 grad).
        self._grad_dtype = torch.bfloat16 if rounded else torch.float32

    # ------------------------------------------------------------------ step
    def _views(self, info: FlatParam) -> tuple[Tensor, Tensor | None] | None:
        """This rank's (data, grad) 1-D views of a parameter's slice, or None when it holds none."""
        seg = info.holders[self._rank]
        if seg is None:
            return None
        if self._mode == "zero3":
            flat = self._flats[info.subgroup]
            data = flat.data.narrow(0, seg.local, seg.length)
            grad = None if flat.grad is None else flat.grad.narrow(0, seg.local, seg.length)
        elif self._mode == "partitioned":
            part = self._all_groups[info.group]["params"][0]
            data = part.data.view(-1).narrow(0, seg.local, seg.length)
            grad = None if part.grad is None else part.grad.view(-1).narrow(0, seg.local, seg.length)
        else:
            p = self._all_groups[info.group]["params"][info.pos]
            data = p.data.view(-1)
            grad = None if p.grad is None else (p.grad.reshape(-1) if p.grad.is_contiguous() else None)
            if p.grad is not None and grad is None:
                p.grad = p.grad.contiguous()
                grad = p.grad.view(-1)
        return data, grad

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = pipeline.call_closure(closure)
        self._require_attached()
        params, first_call = self._active_params()
        views: list[tuple[Tensor, Tensor | None] | None] = [None] * len(self._params)
        for info in params:
            views[info.index] = self._views(info)
        self._device = next((v[0].device for v in views if v is not None), self._device)
        live = self._finite_params(params, views)

        ex = self._exchange
        ex.start(first_call)
        # 1. averaged gradient of each owned Muon matrix, whole, on its owner (ZeRO 1-3: every rank's
        # slices through the forward carrier; stage 0: every rank holds it).
        muon_live = [p for p in params if p.muon and p.index in live]
        by_owner: dict[int, list[FlatParam]] = defaultdict(list)
        for p in muon_live:
            by_owner[p.owner].append(p)
        has_muon = any(p.muon for p in params)  # the same on every rank: no exchange for AdamW-only calls
        gathered = self._mode in ("partitioned", "zero3")
        if gathered and has_muon:
            full_grad = ex.gather(by_owner, {p.index: views[p.index][1] for p in muon_live if views[p.index]},
                                  self._grad_dtype, self._device)
        else:
            full_grad = {p.index: views[p.index][1] for p in by_owner[self._rank]}
            full_grad = {i: g if g.dtype in (torch.float32, self._grad_dtype) else g.float() for i, g in full_grad.items()}

        # 2. the owner's QMuon update (momentum + whole-matrix NS), AdamW on this rank's slices.
        self._sync_inner_groups()
        out = self._out = {}
        self._ns_items_call.clear()
        for info, proxy in zip(self._params, self._proxies):
            if info.muon:
                g = full_grad.get(info.index)
                if g is None:
                    proxy.data = _placeholder(info.shape, self._device)
                    proxy.grad = None
                    continue
                g2 = g.view(info.shape)
                # NS input is written into the grad buffer; the proxy's data aliases it because with
                # weight_decay 0 QMuon only multiplies it by 1.0 (exact) before the captured NS output.
                proxy.data = g2
                proxy.grad = g2
            else:
                v = views[info.index]
                if v is None or info.index not in live or v[1] is None or info.index in self._pieces:
                    proxy.data = torch.zeros(0, device=self._device)
                    proxy.grad = None
                else:
                    proxy.data = v[0]
                    proxy.grad = v[1]
        self._inner.step()
        for info in params:
            v = views[info.index]
            if info.index in self._pieces and info.index in live and v is not None and v[1] is not None:
                self._adamw_slice_step(info, v[0], v[1])
        if first_call:  # a new optimizer step (DeepSpeed steps groups in order, one call each)
            self.ns_items = {}
        for k, v in self._ns_items_call.items():
            self.ns_items[k] = self.ns_items.get(k, 0) + v
        for proxy in self._proxies:
            proxy.grad = None
        for info, proxy in zip(self._params, self._proxies):
            if info.muon:
                proxy.data = _placeholder(info.shape, self._device)

        # 3. the NS output back to every rank holding a slice (return carrier); each applies it to its slice.
        if has_muon:
            ex.scatter(by_owner, {i: o.view(-1) for i, o in out.items()}, self._device,
                       lambda p, seg, o: self._apply_update(p, views[p.index][0], seg, o))
        ex.count(muon_live, gathered, 3 * 8 * (len(self._params) + 1) if self._world > 1 else 0)
        self.comm_stats = ex.comm_stats
        return loss

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

    def _capture(self, proxy: Tensor, part: Any, o: Tensor) -> None:
        """QMuon's update sink: keep the NS output of one part of an owned matrix for the return trip."""
        index = self._proxy_index[id(proxy)]
        info = self._params[index]
        buf = self._out.get(index)
        if buf is None:
            buf = self._out[index] = torch.empty(info.shape, dtype=o.dtype, device=o.device)
        block = part.block(buf)
        block.copy_(o.reshape(block.shape))
        self._ns_items_call[index] += 1

    def _sync_inner_groups(self) -> None:
        for g, ig in zip(self._all_groups, self._inner.param_groups):
            for k, v in g.items():
                if k not in _SKIP_SYNC and k not in ("state_format", "block_size", "parts", "use_muon"):
                    ig[k] = v
            if ig["use_muon"]:
                ig["weight_decay"] = 0.0  # applied to the slices by _apply_update

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

    def _active_params(self) -> tuple[list[FlatParam], bool]:
        """The parameters the current ``step()`` call updates, and whether the call is the first of an
        optimizer step. All of them, except under DeepSpeed's ZeRO optimizers: at stages 1/2
        ``param_groups`` is narrowed to one group per call; at stage 3 one group holds one sub-group's
        flat partition (the others are empty) per call. DeepSpeed steps them in order."""
        if self._mode == "zero3":
            live = [g["params"] for g in self._all_groups if g["params"]]
            if len(live) != 1 or len(live[0]) != 1 or id(live[0][0]) not in self._flat_index:
                raise RuntimeError("ZeRO-3 called step() with parameter groups that are not one of its sub-groups' flat "
                                   "partitions; WholeMatrixZeroOptimizer.step() is called by the engine (engine.step())")
            sg = self._flat_index[id(live[0][0])]
            return [p for p in self._params if p.subgroup == sg], sg == 0
        ids = {id(g) for g in self.param_groups}
        active = {i for i, g in enumerate(self._all_groups) if id(g) in ids}
        if len(active) != len(self.param_groups):
            raise RuntimeError("param_groups holds groups this optimizer was not built with; build a new "
                               "WholeMatrixZeroOptimizer instead of calling add_param_group")
        return [p for p in self._params if p.group in active], 0 in active

    def _finite_params(self, params: list[FlatParam], views: list[tuple[Tensor, Tensor | None] | None]) -> set[int]:
        """Indices of parameters (of ``params``) whose averaged gradient is finite on every rank (one
        all-reduce of a flag per parameter); raises on every rank for a bad gradient in a
        ``nonfinite="raise"`` group before this call changes anything. The same all-reduce carries each
        Muon matrix's momentum step from its owner, so ``self._muon_step`` (the step every rank holding a
        slice keys its bf16 stochastic rounding by) costs no collective of its own."""
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
            if info.muon and info.owner == self._rank:
                st = self._inner.state.get(self._proxies[info.index])
                if st and "step" in st:
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
        bad_list = both[0].tolist()
        has_grad = both[1].tolist()
        step_list = both[2].tolist()
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
                f"QMuon (DeepSpeed): non-finite gradient in {', '.join(labels)}; no parameter or optimizer state was "
                "changed. Use nonfinite='skip' to skip such updates, or check the loss scale / learning rate"
            )
        self.nonfinite_skips += len(bad_params)
        if self._rank == 0:
            log.warning("QMuon (DeepSpeed): skipped update of %s (non-finite gradient)", ", ".join(labels))
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
        """Owner rank of every Muon parameter, in parameter order (empty before :meth:`attach`)."""
        return [p.owner for p in self._params if p.muon] if self._mode else []

    @property
    def inner(self) -> QMuon:
        """The QMuon that holds this rank's momentum (owned matrices) and AdamW state (its slices)."""
        return self._inner

    def state_nbytes(self, muon_only: bool = True) -> int:
        """Bytes of optimizer state on this rank (Muon momentum of owned matrices by default; with
        ``muon_only=False`` also the AdamW state of its slices, quantized pieces included)."""
        total = self._inner.state_nbytes(muon_only)
        if not muon_only:
            total += sum(qstate.state_nbytes(st) for sts in self._slice_state.values() for st in sts)
            total += sum(qstate.state_nbytes(st) for st in self._weight_state.values())
        return total

    def __repr__(self) -> str:
        muon = sum(p.muon for p in self._params)
        return (f"WholeMatrixZeroOptimizer(mode={self._mode}, world={self._world}, rank={self._rank}, "
                f"muon_matrices={muon}, owned={len(self._owned)}, adamw_params={len(self._params) - muon})")
