"""``QMuon``: Muon with fp32 / bf16 / 8-bit / 4-bit momentum and an auxiliary AdamW, in one optimizer.

Per step, for every Muon parameter group:

1. the group's state format (:data:`qmuon_lightning.quant.state.FORMATS`; for the elementwise
   formats one multi-tensor op ``torch.ops.qmuon.*_momentum_update_multi_``) dequantizes the momentum,
   applies ``m = beta m + (1 - beta) g``, requantizes it, and writes the Newton-Schulz input
   (the Nesterov blend) into the gradient buffer, and writes the sums of squares per row block
   into caller-allocated outputs;
2. the sums are reduced per norm group (a whole matrix, or each part of a fused QKV matrix);
3. same-shape matrices are stacked and orthogonalized together, with ``1 / norm`` folded into the
   first Newton-Schulz iteration (:mod:`.newton_schulz`);
4. decoupled weight decay and the shape-adjusted learning rate are applied.

No persistent full-precision momentum exists for 8-bit formats and no extra scratch buffer is
allocated for the NS input: after ``step()`` a Muon parameter's ``.grad`` holds its NS input.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.adam import adam as _functional_adam

from .. import ops  # noqa: F401  (registers torch.ops.qmuon)
from ..ops import reference as ref
from ..quant import state as qstate
from ..quant.mxfp8 import mxfp8_roundtrip_normalized
from .newton_schulz import NS_BATCH_MAX_ELEMENTS, newton_schulz_folded

__all__ = ["QMuon", "GraspMuon", "FORMAT_VERSION", "DEFAULT_NS_COEFFICIENTS"]

log = logging.getLogger(__name__)

#: Version of the optimizer state layout written by ``state_dict()``.
FORMAT_VERSION = 1
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_ROUNDING = ("nearest", "stochastic")
_NONFINITE = ("skip", "raise")
_NS_INPUT = ("bf16", "mxfp8")
# Carriers of the distributed Newton-Schulz exchange (sharded parameters only); must equal
# qmuon_lightning.distributed.carrier.CARRIERS / RETURN_CARRIERS (a test checks).
_COMM_CARRIERS = ("bf16", "int8", "mxfp8")
_COMM_RETURN = ("bf16", "int8")
_ADJUST_LR = (None, "original", "match_rms_adamw")
# Keys that describe how a group is built, not how it is tuned: on load_state_dict the
# constructed optimizer's values win over the checkpoint's (torch would silently take the saved ones).
_STRUCTURAL_KEYS = ("use_muon", "state_format", "block_size", "rank", "grid_block", "rounding", "seed", "parts",
                    "nonfinite", "ns_input")


def _is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (FSDP2 parameter or gradient), without importing torch.distributed
    on builds that lack it."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (a view of its storage), or ``t`` itself."""
    return t.to_local() if _is_dtensor(t) else t


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """``torch.optim.Muon``'s learning-rate adjustment for an ``rows x cols`` update."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


@dataclass
class _NSItem:
    """One matrix (or fused part) waiting for Newton-Schulz."""

    param_rows: Tensor  # the parameter rows this update applies to (a dim-0 view, any ndim)
    ns_input: Tensor  # 2-D view of the grad buffer holding the NS input
    sumsq: Tensor  # fp32 0-d
    lr: float
    eps: float
    coefficients: tuple[float, float, float]
    steps: int
    carrier: str = "bf16"  # ns_input of the group: "mxfp8" feeds NS the decoded MXFP8 carrier


def _apply_ns_carrier(chunk: list[_NSItem], batch: Tensor, inv_norm: Tensor) -> tuple[Tensor, Tensor]:
    """``ns_input="mxfp8"``: replace those items' rows of the NS batch by their decoded MXFP8 carrier.

    The carrier encodes the normalized input ``x * inv_norm`` (from the full-precision buffer), so
    its inverse norm for the folded Newton-Schulz becomes 1. Never writes into the gradient buffers.
    """
    if batch.data_ptr() == chunk[0].ns_input.data_ptr():
        batch = batch.clone()  # the single-item batch was a view of .grad
    inv_norm = inv_norm.clone()
    for i, it in enumerate(chunk):
        if it.carrier == "mxfp8":
            batch[i].copy_(mxfp8_roundtrip_normalized(it.ns_input, inv_norm[i]))
            inv_norm[i] = 1.0
    return batch, inv_norm


class QMuon(Optimizer):
    """Muon with quantized momentum; AdamW for parameter groups with ``use_muon=False``.

    The Muon arguments and their defaults are those of :class:`torch.optim.Muon`; with
    ``state_format="fp32"`` the algorithm is the same (momentum, Nesterov blend, Newton-Schulz in
    bf16, learning-rate adjustment, decoupled weight decay).

    Args:
        params: parameters or parameter groups. A group with ``use_muon=False`` is updated by
            AdamW (keys ``lr``, ``betas``, ``eps``, ``weight_decay``; unset keys take the
            ``adamw_*`` defaults). A Muon group may set ``parts=(n0, n1, ...)``: each of its
            parameters is a stack of matrices along dim 0 (for example fused q, k, v) whose parts
            are normalized and orthogonalized separately.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: as in
            :class:`torch.optim.Muon`.
        state_format: momentum storage: ``"fp32"``, ``"bf16"``, ``"int8"``, ``"uint8"`` (8-bit
            blockwise absmax), ``"int4"`` (naive 4-bit blockwise absmax), ``"e0m3"`` (4-bit E0M3
            elements, UE4M3 per-16 scales, fp32 tensor scale) or ``"grasp4"`` (GRASP: 8-bit
            rank-``rank`` factors + 4-bit grid-quantized residual); see :mod:`qmuon_lightning.quant.state`.
        block_size: elements per absmax block along a row (8-bit and int4 formats; for the others
            only the granularity of the norm sums); a multiple of 32. ``None`` (default) takes the
            format's default: 256 for 8-bit, 128 for int4, 256 otherwise.
        rank, grid_block: grasp4 only: rank of the 8-bit factor (default 4) and side of the square
            grid-quantization tiles of the residual (default 32).
        rounding: ``"nearest"`` or ``"stochastic"`` (counter-based noise; reproducible on resume).
        seed: seed of the stochastic-rounding noise.
        nonfinite: ``"skip"`` leaves a parameter and its state untouched for a step whose gradient
            holds NaN/Inf (counted in :attr:`nonfinite_skips`); ``"raise"`` raises instead.
        ns_input: what Newton-Schulz reads: ``"bf16"`` (default) the NS input rounded to bf16 with
            ``1/norm`` folded into the first iteration; ``"mxfp8"`` the normalized input
            ``G / ||G||`` encoded as an MXFP8 carrier (E4M3 payload + E8M0 scale per 32 elements +
            the fp32 inverse norm, 1.03 bytes / element instead of 2) and decoded, so NS sees exactly
            what a receiver of the carrier would (:mod:`qmuon_lightning.quant.mxfp8`). Like
            ``rounding``, the constructed value wins over a checkpoint's on ``load_state_dict``.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: defaults for AdamW groups.
        comm_carrier, comm_return: sharded (FSDP2 / DTensor ``Shard(0)``) parameters only: how the
            distributed Newton-Schulz moves NS inputs to the rank that orthogonalizes a matrix
            (``"int8"`` row-block absmax codes, ``"bf16"``, ``"mxfp8"``) and results back
            (``"int8"``, ``"bf16"``); see :mod:`qmuon_lightning.distributed`. ``"bf16"`` both ways
            reproduces single-process QMuon exactly; the int8 default moves 2.03 bytes per element
            both ways instead of 4. Bytes per step: :attr:`comm_bytes_last_step`, :attr:`comm_stats`.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        state_format: str = "int8",
        block_size: int | None = None,
        rank: int = 4,
        grid_block: int = 32,
        rounding: str = "nearest",
        seed: int = 0,
        nonfinite: str = "skip",
        ns_input: str = "bf16",
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 1e-2,
        comm_carrier: str = "int8",
        comm_return: str = "int8",
    ) -> None:
        if comm_carrier not in _COMM_CARRIERS or comm_return not in _COMM_RETURN:
            raise ValueError(
                f"QMuon: comm_carrier must be one of {_COMM_CARRIERS} and comm_return one of {_COMM_RETURN}, "
                f"got comm_carrier={comm_carrier!r}, comm_return={comm_return!r}"
            )
        #: Carriers of the distributed Newton-Schulz exchange (sharded parameters only).
        self.comm_carrier, self.comm_return = comm_carrier, comm_return
        #: Bytes this rank sent to other ranks in the last step (sharded parameters; 0 otherwise).
        self.comm_bytes_last_step = 0
        #: Per-step communication figures for logging (empty until a sharded step ran).
        self.comm_stats: dict[str, float] = {}
        self._adamw_defaults = {
            "lr": adamw_lr,
            "betas": tuple(adamw_betas),
            "eps": adamw_eps,
            "weight_decay": adamw_weight_decay,
        }
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "state_format": state_format,
            "block_size": block_size,
            "rank": rank,
            "grid_block": grid_block,
            "rounding": rounding,
            "seed": seed,
            "nonfinite": nonfinite,
            "ns_input": ns_input,
            "use_muon": True,
            "parts": None,
        }
        #: Parameter updates skipped because their gradient was not finite (``nonfinite="skip"``).
        self.nonfinite_skips = 0
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups and validation
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not param_group.get("use_muon", True):
            for k, v in self._adamw_defaults.items():
                param_group.setdefault(k, v)
            param_group.setdefault("use_muon", False)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f"param group {len(self.param_groups) - 1}"
        if group["use_muon"]:
            self._validate_muon_group(group, where)
        else:
            self._validate_adamw_group(group, where)

    @staticmethod
    def _validate_muon_group(group: dict[str, Any], where: str) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"QMuon {where}: {msg}")

        if not group["lr"] >= 0.0:
            raise bad(f"lr must be >= 0, got {group['lr']}")
        if not 0.0 <= group["momentum"] < 1.0:
            raise bad(f"momentum must be in [0, 1), got {group['momentum']}")
        if not group["weight_decay"] >= 0.0:
            raise bad(f"weight_decay must be >= 0, got {group['weight_decay']}")
        if group["adjust_lr_fn"] not in _ADJUST_LR:
            raise bad(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {group['adjust_lr_fn']!r}")
        if len(group["ns_coefficients"]) != 3:
            raise bad(f"ns_coefficients must be 3 numbers (a, b, c), got {group['ns_coefficients']!r}")
        if not 0 <= int(group["ns_steps"]) < 100:
            raise bad(f"ns_steps must be in [0, 100), got {group['ns_steps']}")
        fmt = qstate.get_format(group["state_format"])  # raises with the list of formats
        if group.get("block_size") is None:
            group["block_size"] = qstate.DEFAULT_BLOCK_SIZE.get(fmt.name, 256)
        group.setdefault("rank", 4)
        group.setdefault("grid_block", 32)
        bs = group["block_size"]
        if not isinstance(bs, int) or bs <= 0 or bs % 32 or bs > 4096:
            raise bad(f"block_size must be a multiple of 32 in [32, 4096] (kernel warp granularity), got {bs!r}")
        try:
            fmt.validate_options(qstate.format_options(group))
        except ValueError as e:
            raise bad(str(e)) from None
        if group["rounding"] not in _ROUNDING:
            raise bad(f"rounding must be 'nearest' or 'stochastic', got {group['rounding']!r}")
        if group["nonfinite"] not in _NONFINITE:
            raise bad(f"nonfinite must be 'skip' or 'raise', got {group['nonfinite']!r}")
        if group.setdefault("ns_input", "bf16") not in _NS_INPUT:
            raise bad(
                f"ns_input must be 'bf16' (bf16 Newton-Schulz input) or 'mxfp8' (MXFP8 carrier), got {group['ns_input']!r}"
            )
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            label = f"parameter {names[i]!r}" if names else f"parameter #{i}"
            if p.ndim < 2:
                raise bad(
                    f"{label} has shape {tuple(p.shape)}: Muon orthogonalizes matrices. Put 1-D tensors "
                    "(biases, norm gains) in an AdamW group ({'params': [...], 'use_muon': False}) or build "
                    "the optimizer with qmuon_lightning.build_optimizer(model), which routes them for you"
                )
            if torch.is_complex(p):
                raise bad(f"{label} is complex; QMuon supports real parameters only")
        parts = group["parts"]
        if parts is not None:
            parts = tuple(int(n) for n in parts)
            if not parts or min(parts) <= 0:
                raise bad(f"parts must be positive row counts, got {group['parts']!r}")
            for i, p in enumerate(group["params"]):
                if sum(parts) != p.shape[0]:
                    label = f"parameter {names[i]!r}" if names else f"parameter #{i}"
                    raise bad(f"parts {parts} sum to {sum(parts)} rows but {label} has {p.shape[0]} rows")
            group["parts"] = parts

    @staticmethod
    def _validate_adamw_group(group: dict[str, Any], where: str) -> None:
        b1, b2 = group["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"QMuon {where} (AdamW): betas must be in [0, 1), got {group['betas']}")
        if not group["eps"] >= 0.0 or not group["lr"] >= 0.0 or not group["weight_decay"] >= 0.0:
            raise ValueError(f"QMuon {where} (AdamW): lr, eps and weight_decay must be >= 0")

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sharded = self._sharded_step()  # None unless a parameter is a DTensor (FSDP2)
        updatable = self._updatable_params(sharded)  # raises before anything changes (nonfinite="raise")
        ns_queue: dict[tuple, list[_NSItem]] = defaultdict(list)
        key = 0
        for group, idx in zip(self.param_groups, updatable):
            if group["use_muon"]:
                self._muon_momentum_step(group, idx, key, ns_queue, sharded)
            else:
                self._adamw_step(group, idx)
            key += len(group["params"])
        self._orthogonalize_and_apply(ns_queue)
        if sharded is not None:
            sharded.finish()  # distributed Newton-Schulz (collective: every rank, same items)
        return loss

    def _sharded_step(self) -> Any:
        """The distributed driver for this step when some parameter is a DTensor, else ``None``.

        The import is lazy: ``optim`` only reaches into ``qmuon_lightning.distributed`` once
        sharded parameters are seen (FSDP2 / Accelerate may replace parameters after construction).
        """
        if not any(_is_dtensor(p) for g in self.param_groups for p in g["params"]):
            return None
        from ..distributed.orthogonalize import ShardedStep

        return ShardedStep(self)

    def _updatable_params(self, sharded: Any = None) -> list[list[int]]:
        """Per group, indices of parameters with a finite gradient.

        One fused L2-norm reduction over every gradient of every group (NaN/Inf propagate; the
        rare overflowing norm is re-checked exactly) and one host sync. With ``nonfinite="raise"`` in any group
        that holds a bad gradient, raises before any parameter or state of any group changes.
        """
        where: list[tuple[int, int]] = []
        grads: list[Tensor] = []
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("QMuon does not support sparse gradients")
                where.append((gi, i))
                grads.append(_local(p.grad))
        out: list[list[int]] = [[] for _ in self.param_groups]
        if not grads and sharded is None:
            return out
        # The L2 norm is the fast fused reduction (the inf-norm is several times slower on CPU); it
        # propagates NaN/Inf but can overflow for huge finite gradients, so only tensors whose L2 norm
        # is not finite are re-checked with the exact max-abs.
        l2 = torch._foreach_norm(grads, 2.0) if grads else []
        finite = torch.stack([n.float() for n in l2]).isfinite().tolist() if grads else []
        suspects = [j for j, ok in enumerate(finite) if not ok]
        if suspects:
            amax = torch._foreach_norm([grads[j] for j in suspects], float("inf"))
            for j, a in zip(suspects, amax):
                finite[j] = bool(a.float().isfinite())
        if sharded is not None:  # one all-reduce: every rank skips / updates the same sharded parameters
            where, finite = sharded.agree_on_updates(where, finite)
        bad_by_policy: dict[str, list[str]] = defaultdict(list)
        for (gi, i), ok in zip(where, finite):
            if ok:
                out[gi].append(i)
                continue
            group = self.param_groups[gi]
            names = group.get("param_names")
            shape = tuple(group["params"][i].shape)
            label = repr(names[i]) if names else f"param group {gi} parameter #{i} (shape {shape})"
            bad_by_policy[group.get("nonfinite", "skip")].append(label)
        if bad_by_policy.get("raise"):
            raise FloatingPointError(
                f"QMuon: non-finite gradient in {', '.join(bad_by_policy['raise'] + bad_by_policy['skip'])}; "
                "no parameter or optimizer state was changed. Use nonfinite='skip' to skip such updates, "
                "or check the loss scale / learning rate"
            )
        if bad_by_policy.get("skip"):
            self.nonfinite_skips += len(bad_by_policy["skip"])
            log.warning("QMuon: skipped update of %s (non-finite gradient)", ", ".join(bad_by_policy["skip"]))
        return out

    @staticmethod
    def _row_offset(p: Tensor) -> int:
        """Global index of the first local row (used by stochastic-rounding noise, so a shard
        draws the noise of the unsharded matrix). Plain tensors hold all rows."""
        if not _is_dtensor(p):
            return 0
        from ..distributed.sharding import global_row_offset

        return global_row_offset(p)

    def _muon_momentum_step(
        self, group: dict[str, Any], idx: list[int], key0: int, ns_queue: dict[tuple, list[_NSItem]],
        sharded: Any = None,
    ) -> None:
        if not idx:
            return
        params = [group["params"][i] for i in idx]
        keys = [key0 + i for i in idx]
        fmt = qstate.get_format(group["state_format"])
        opts = qstate.format_options(group)
        bs = opts.block_size
        stochastic = group["rounding"] == "stochastic"
        grads2d, states, streams, offsets = [], [], [], []
        for p, k in zip(params, keys):
            grad = _local(p.grad)  # DTensor (FSDP2): this rank's rows; state is built from them
            rows = grad.shape[0]
            cols = math.prod(p.shape[1:])
            st = self.state[p]
            if not st:
                st.update(qstate.init_momentum_state(fmt.name, rows, cols, opts=opts, device=grad.device))
                if sharded is not None and _is_dtensor(p):
                    sharded.init_state(p, st)  # Shard(0) DTensors with the global shape (for DCP)
            st["step"] += 1
            # A 2-D view when the layout allows; otherwise a copy that is written back below.
            g2 = grad.view(rows, cols) if grad.is_contiguous() else grad.reshape(rows, cols)
            grads2d.append(g2)
            states.append({k_: _local(v) for k_, v in st.items()} if sharded is not None else st)
            streams.append(ref.noise_stream(group["seed"], int(st["step"].item()), k) if stochastic else -1)
            offsets.append(self._row_offset(p))
        beta, nesterov = float(group["momentum"]), bool(group["nesterov"])
        # Per-row-block sums of squares of the NS input, written by the op (fp32, shaped like absmax).
        block_sums = [
            torch.empty((g2.shape[0], ref.num_blocks(g2.shape[1], bs)), dtype=torch.float32, device=g2.device)
            for g2 in grads2d
        ]
        kw = dict(beta=beta, nesterov=nesterov, opts=opts, streams=streams, offsets=offsets, keys=keys,
                  seed=int(group["seed"]))
        if sharded is not None and fmt.name in sharded.COLLECTIVE_FORMATS:  # grasp4 / e0m3: whole-matrix pieces
            sharded.format_update(fmt.name, params, states, grads2d, block_sums, **kw)
        else:
            fmt.update(states, grads2d, block_sums, **kw)
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        parts = group["parts"]
        for p, g2, sums in zip(params, grads2d, block_sums):
            grad = _local(p.grad)
            if g2.data_ptr() != grad.data_ptr():
                grad.copy_(g2.view(grad.shape))  # keep the contract: .grad holds the NS input
            p_local = _local(p)
            p_local.mul_(1.0 - lr * wd)
            if sharded is not None and _is_dtensor(p):
                sharded.add(p, p_local, g2, sums, group)  # whole-matrix NS across ranks, after all groups
                continue
            bounds = [0]
            for n in parts or (p.shape[0],):
                bounds.append(bounds[-1] + n)
            for r0, r1 in zip(bounds[:-1], bounds[1:]):
                rows, cols = r1 - r0, g2.shape[1]
                item = _NSItem(
                    param_rows=p[r0:r1],  # dim-0 slices are views for any layout
                    ns_input=g2[r0:r1],
                    sumsq=sums[r0:r1].sum(),
                    lr=adjusted_lr(lr, group["adjust_lr_fn"], rows, cols),
                    eps=float(group["eps"]),
                    coefficients=tuple(group["ns_coefficients"]),
                    steps=int(group["ns_steps"]),
                    carrier=group.get("ns_input", "bf16"),
                )
                ns_queue[(rows, cols, item.coefficients, item.steps, str(g2.device))].append(item)

    @staticmethod
    def _orthogonalize_and_apply(ns_queue: dict[tuple, list[_NSItem]]) -> None:
        for (rows, cols, coefficients, steps, _), items in ns_queue.items():
            per_batch = max(1, NS_BATCH_MAX_ELEMENTS // (rows * cols))
            for start in range(0, len(items), per_batch):
                chunk = items[start: start + per_batch]
                if len(chunk) == 1 and chunk[0].ns_input.dtype == torch.bfloat16:
                    batch = chunk[0].ns_input.unsqueeze(0)  # no copy needed
                else:
                    batch = torch.empty((len(chunk), rows, cols), dtype=torch.bfloat16, device=chunk[0].ns_input.device)
                    for i, it in enumerate(chunk):
                        batch[i].copy_(it.ns_input)
                sumsq = torch.stack([it.sumsq for it in chunk])
                eps = torch.tensor([it.eps for it in chunk], dtype=torch.float32, device=sumsq.device)
                inv_norm = torch.maximum(sumsq.sqrt(), eps).reciprocal()
                if any(it.carrier == "mxfp8" for it in chunk):
                    batch, inv_norm = _apply_ns_carrier(chunk, batch, inv_norm)
                out = newton_schulz_folded(batch, inv_norm, coefficients, steps)
                for i, it in enumerate(chunk):
                    it.param_rows.add_(out[i].reshape(it.param_rows.shape), alpha=-it.lr)

    def _adamw_step(self, group: dict[str, Any], idx: list[int]) -> None:
        params = [group["params"][i] for i in idx]
        grads = [p.grad for p in params]
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            st = self.state[p]
            if not st:
                # Same state layout as torch.optim.AdamW, so checkpoints interoperate.
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(st["exp_avg"])
            exp_avg_sqs.append(st["exp_avg_sq"])
            steps.append(st["step"])
        if not params:
            return
        b1, b2 = group["betas"]
        _functional_adam(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            foreach=None, capturable=False, differentiable=False, fused=None,
            grad_scale=None, found_inf=None, has_complex=False, decoupled_weight_decay=True,
            amsgrad=False, beta1=b1, beta2=b2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=False,
        )

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        for g in sd["param_groups"]:
            g["qmuon_version"] = FORMAT_VERSION
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a QMuon (any format) or ``torch.optim.Muon`` / ``torch.optim.AdamW`` state dict.

        Momentum saved in another format is converted to this optimizer's format (dense <->
        8-bit, int8 <-> uint8); shapes, block sizes and dtypes are validated first, so a bad
        checkpoint raises before anything is changed.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"checkpoint has {len(saved_groups)} parameter groups but this optimizer has "
                f"{len(self.param_groups)}; build the optimizer the same way it was built when saved"
            )
        saved_state = state_dict["state"]
        # Muon state is converted and placed here, not by torch: torch casts every state tensor of a
        # floating-point parameter to the parameter's dtype, which would turn int8 codes, fp32 scales
        # and bf16 momentum into the parameter's dtype.
        new_groups, new_state = [], dict(saved_state)
        muon_state: list[tuple[Tensor, dict[str, Any], dict[str, Any]]] = []
        for gi, (saved, cur) in enumerate(zip(saved_groups, self.param_groups)):
            version = saved.get("qmuon_version", 0)
            if version > FORMAT_VERSION:
                raise ValueError(
                    f"param group {gi} was saved with state format version {version}, newer than this "
                    f"qmuon_lightning ({FORMAT_VERSION}); upgrade qmuon_lightning to load it"
                )
            if len(saved["params"]) != len(cur["params"]):
                raise ValueError(
                    f"param group {gi}: checkpoint has {len(saved['params'])} parameters, optimizer has "
                    f"{len(cur['params'])}; build the optimizer the same way it was built when saved"
                )
            merged = {k: v for k, v in saved.items() if k != "qmuon_version"}
            for k in _STRUCTURAL_KEYS:
                merged[k] = cur[k]
            if cur["use_muon"]:
                for pid, p in zip(saved["params"], cur["params"]):
                    if pid in saved_state:
                        where = f"param group {gi}, param id {pid}"
                        src, like = saved_state[pid], p
                        if _is_dtensor(p):  # sharded: validate and convert this rank's rows only
                            from ..distributed.sharding import localize_loaded_state

                            found = qstate.detect_state_format(src)
                            if cur["state_format"] in ("grasp4", "e0m3") and found != cur["state_format"]:
                                raise NotImplementedError(
                                    f"{where}: converting {found} momentum to {cur['state_format']} needs the whole "
                                    f"matrix; load it into a single-process QMuon, save {cur['state_format']}, then shard")
                            src = localize_loaded_state(src, p, where)
                            like = torch.empty((_local(p).shape[0], *p.shape[1:]), device="meta")
                        muon_state.append((p, self._convert_muon_state(src, saved, cur, like, where), cur))
                        del new_state[pid]
            new_groups.append(merged)
        super().load_state_dict({"state": new_state, "param_groups": new_groups})
        for p, st, cur in muon_state:
            new = {k: v.to(device=p.device, copy=True) if k != "step" else v.clone() for k, v in st.items()}
            if _is_dtensor(p):
                from ..distributed.sharding import shard_state

                shard_state(p, new, grid_block=qstate.format_options(cur).grid_block)
            self.state[p] = new

    @staticmethod
    def _convert_muon_state(
        st: dict[str, Any], saved_group: dict[str, Any], cur: dict[str, Any], p: Tensor, where: str
    ) -> dict[str, Any]:
        rows = p.shape[0]
        cols = math.prod(p.shape[1:])
        found = qstate.detect_state_format(st)
        saved_fmt = saved_group.get("state_format", found)
        if saved_fmt != found:
            raise qstate.StateFormatError(
                f"{where}: the group says state_format={saved_fmt!r} but the tensors are {found}; the checkpoint is inconsistent"
            )
        saved_opts = qstate.format_options({**cur, **saved_group, "state_format": found})
        qstate.validate_momentum_state(st, found, rows, cols, None, where, opts=saved_opts)
        target = qstate.get_format(cur["state_format"])
        opts = qstate.format_options(cur)
        source = qstate.get_format(found)
        # Resuming the same kind of blockwise state (int8 / uint8, or int4) needs the same block size;
        # between different kinds the momentum is dequantized and re-encoded anyway.
        same_kind = source.spec.kind == target.spec.kind
        if same_kind and source.uses_block_size and saved_opts.block_size != opts.block_size:
            raise qstate.StateFormatError(
                f"{where}: momentum was saved with block_size={saved_opts.block_size} but this optimizer uses "
                f"block_size={opts.block_size}; construct the optimizer with block_size={saved_opts.block_size} to resume"
            )
        if found == target.name:
            for key in ("rank", "grid_block"):
                a, b = getattr(saved_opts, key), getattr(opts, key)
                if found == "grasp4" and a != b:
                    raise qstate.StateFormatError(
                        f"{where}: momentum was saved with {key}={a} but this optimizer uses {key}={b}; "
                        f"construct the optimizer with {key}={a} to resume"
                    )
        keys = set().union(*(f.spec.keys for f in qstate.FORMATS.values()))
        out = {k: v for k, v in st.items() if k not in keys}
        out.setdefault("step", torch.zeros((), dtype=torch.float32))
        if found == target.name:
            momentum = {k: st[k] for k in source.spec.keys}
        else:
            m = source.dequantize(st, saved_opts, cols)
            momentum = target.encode(m, opts)
            log.info("%s: converted %s momentum to %s", where, found, target.name)
        out.update(momentum)
        return out

    # ------------------------------------------------------------------ introspection
    def state_nbytes(self, muon_only: bool = True) -> int:
        """Bytes of optimizer state tensors (Muon parameters only by default)."""
        total = 0
        for group in self.param_groups:
            if muon_only and not group["use_muon"]:
                continue
            for p in group["params"]:
                total += qstate.state_nbytes(self.state.get(p, {}))
        return total


class GraspMuon(QMuon):
    """:class:`QMuon` with GRASP 4-bit momentum (``state_format="grasp4"``) by default.

    The momentum is stored as an 8-bit rank-``rank`` factor ``P R^T`` tracked by one warm-started
    power iteration per step plus a 4-bit residual with ``grid_block x grid_block`` grid
    quantization (:mod:`qmuon_lightning.quant.grasp`): <= 0.578 bytes per element on GPT-small shapes.
    """

    def __init__(self, params, lr: float = 1e-3, *args: Any, state_format: str = "grasp4", rank: int = 4,
                 grid_block: int = 32, **kwargs: Any) -> None:
        super().__init__(params, lr, *args, state_format=state_format, rank=rank, grid_block=grid_block, **kwargs)
