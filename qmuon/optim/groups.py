"""QMuon's parameter groups: adding them (routed like ``build_optimizer``'s, validated before anything
changes), their names (what ``LearningRateMonitor`` logs), and their learning rates under loops and
callbacks that write them (lr links of routed sub-groups, ``lr_ratios``). A mixin of :class:`~qmuon.QMuon`.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Iterable, Mapping

import torch
from torch import Tensor

from ..core.config import LR_RATIO_MODES, validate_adamw_group, validate_muon_group
from ..core.plan import true_shape

__all__ = ["QMuonGroupsMixin", "group_name", "unique_group_name"]

log = logging.getLogger("qmuon.optim.qmuon")

#: Keys that make an added group explicit (added as given); any other group is routed.
_EXPLICIT_KEYS = ("use_muon", "parts", "parts_axis", "orientation", "parts_interleaved", "bank_dims")


def group_name(group: Mapping[str, Any]) -> str:
    """The default ``name`` of a parameter group (what ``LearningRateMonitor`` logs it as):
    ``adamw`` for an AdamW group; ``muon`` for plain ``(out, in)`` matrices, else
    ``muon_<layout>`` from the layout keys: ``bank`` (bank_dims), ``parts<n>`` (fused parts),
    ``cols`` (parts along dim 1), ``interleaved``, ``in_out`` (orientation); e.g. GPT-2's
    ``c_attn`` group is ``muon_parts3_cols_in_out``."""
    if not group.get("use_muon", True):
        return "adamw"
    pieces = ["muon"]
    if group.get("bank_dims"):
        pieces.append("bank")
    parts = group.get("parts")
    if parts:
        pieces.append(f"parts{len(parts)}")
        if group.get("parts_axis", 0) == 1:
            pieces.append("cols")
        if group.get("parts_interleaved"):
            pieces.append("interleaved")
    if group.get("orientation", "out_in") != "out_in":
        pieces.append(str(group["orientation"]))
    return "_".join(pieces)


def unique_group_name(base: str, taken: Iterable[str]) -> str:
    """``base``, or ``base_2``, ``base_3``, ... when taken (``LearningRateMonitor`` refuses two
    groups of one name)."""
    taken = set(taken)
    if base not in taken:
        return base
    k = 2
    while f"{base}_{k}" in taken:
        k += 1
    return f"{base}_{k}"


def _split_named(params: Any) -> tuple[list[Any], list[str] | None]:
    """A group's ``params`` as a list, and the names when given as ``(name, tensor)`` pairs (torch's
    rules and messages)."""
    if isinstance(params, Tensor):
        return [params], None
    if isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering of "
                        "tensors in sets will change between runs. Please use a list instead.")
    params = list(params)
    named = [isinstance(x, tuple) for x in params]
    if not any(named):
        return params, None
    if not all(named):
        raise ValueError("all optimizer params should be with/without names. Some param names are missing")
    return [x[1] for x in params], [x[0] for x in params]


class QMuonGroupsMixin:
    """Parameter groups of :class:`~qmuon.QMuon` (see the module docstring)."""

    # ------------------------------------------------------------------ groups and validation
    #: The routing of groups added to an optimizer without :attr:`router` (one built from groups):
    #: the default rules, by shape and label (a :class:`qmuon.optim.routing.ModelRouting` without a
    #: model, set by that module, which builds on this one).
    default_router: Any = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, validated as a whole before anything changes (a refused group
        leaves ``param_groups`` as it was).

        A group that names its family or layout (``use_muon``, ``parts``, ``parts_axis``,
        ``orientation``, ``parts_interleaved``, ``bank_dims``) is added as it is (``param_names`` and
        a ``name`` are filled in when the other groups have them). Any other group added after
        construction -- ``{"params": [...], "lr": ...}``, what Lightning's ``BaseFinetuning``
        adds when it unfreezes a backbone -- is *routed* like :func:`~qmuon.build_optimizer`'s
        groups: by the optimizer's :attr:`router` (the model's rule table, names and layouts), or
        by the default rules and shapes when the optimizer has none; it becomes one group per
        family and layout (:meth:`~qmuon.optim.routing.ModelRouting.split`: matrices to Muon, 1-D
        tensors, embeddings and heads to AdamW). The sub-groups get ``param_names`` (the model's
        names, else the caller's, else labels ``param_groups[<i>].params[<j>]``: the group index it
        was added at and the position in the caller's list) and ``name`` (the caller's ``name``
        with the family appended when split, else ``muon`` / ``adamw`` / ... made unique). The
        caller's other keys go to the sub-groups of the family they belong to (Muon keys such as
        ``momentum`` to Muon, ``betas`` to AdamW; keys of both, such as ``weight_decay``, to both,
        except that ``adamw_no_decay`` keeps weight decay 0).

        Learning rate of a routed group. Without ``lr`` each family takes its default
        (``defaults["lr"]`` for Muon, ``adamw_lr`` for AdamW), as torch takes ``defaults``. An ``lr``
        is read in the units of ``param_groups[0]``'s family -- how callers derive it: Lightning's
        ``BaseFinetuning`` passes ``param_groups[0]["lr"] / 10`` (``BackboneFinetuning``: times
        ``backbone_initial_ratio_lr``), meaning "a tenth of the current rate": sub-groups of that
        family get ``lr`` as it is, the other family's get ``lr`` times the ratio of the two
        families' current learning rates (the first group of each; their configured defaults where
        a family has no group yet or an lr of 0). With a Muon ``param_groups[0]`` at 0.02 and AdamW
        at 3e-4, ``lr=0.002`` gives the new Muon matrices 0.002 and the new biases 3e-5.

        The sub-groups stay together for later lr changes: the last one (of ``param_groups[0]``'s
        family when there is one: ``BackboneFinetuning`` writes its next lr into
        ``param_groups[-1]``) leads; the others carry ``lr_follows`` (its name) and
        ``lr_follow_ratio``, and at each step take the leader's lr times their ratio -- until their
        own lr is set by someone else (a scheduler, the user), which ends the link.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        if not self.__dict__.get("_constructed", True):
            self._append_groups([param_group])  # the constructor's groups: as given
            return
        params, caller_names = _split_named(param_group["params"])
        if any(k in param_group for k in _EXPLICIT_KEYS) or not params:
            self._append_groups([self._explicit_group(param_group, params, caller_names)])
            return
        groups = self._routed_groups(param_group, params, caller_names)
        self._append_groups(groups)
        self._link_lrs(groups)

    def _append_groups(self, groups: list[dict[str, Any]]) -> None:
        """Add and validate ``groups``; on any error none of them stays."""
        n0 = len(self.param_groups)
        try:
            for group in groups:
                self._add_one_group(group)
        except BaseException:
            del self.param_groups[n0:]
            del self._routed_shapes[n0:]
            raise
        for group in groups:
            self._note_configured_lr(group)
        self._plans.clear()
        self._sharded = None
        self._index = None
        self._layout_fresh = False

    def _add_one_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("use_muon", True):
            super().add_param_group(param_group)
        else:
            self._add_adamw_group(param_group)
        group = self.param_groups[-1]
        where = f"QMuon param group {len(self.param_groups) - 1}"
        if group["use_muon"]:
            validate_muon_group(group, where)
            self._validate_muon_params(group, where)
        else:
            validate_adamw_group(group, where)
        # The matrices a Muon group was routed with: step() refuses the group once a wrapper swapped
        # them for something else (check_routed_shapes).
        self._routed_shapes.append(tuple(tuple(true_shape(p)) for p in group["params"]) if group["use_muon"] else None)

    def muon_only_keys(self) -> set[str]:
        """The Muon options an AdamW group does not hold (Newton-Schulz, momentum, layout keys)."""
        return set(self.defaults) - set(self._adamw_defaults) - {"use_muon"}

    def _add_adamw_group(self, param_group: dict[str, Any]) -> None:
        """An AdamW group holds the AdamW options only (``config.ADAMW_GROUP_KEYS``), as a
        ``torch.optim.AdamW`` group holds AdamW's: torch fills in ``defaults``, which are the Muon
        group's, so they are swapped for the AdamW ones while torch adds it."""
        muon_only = self.muon_only_keys()
        given = sorted(k for k in muon_only & param_group.keys() if param_group[k] != self.defaults[k])
        if given:
            raise ValueError(
                f"QMuon param group {len(self.param_groups)}: {', '.join(given)} are Muon options, but the group is an "
                f"AdamW group (use_muon=False) and would ignore them. AdamW groups take {sorted(self._adamw_defaults)}; "
                "move the parameters to a Muon group or drop those keys")
        for k in muon_only & param_group.keys():  # what a group copied from an older QMuon carries: the defaults
            del param_group[k]
        for k, v in self._adamw_defaults.items():
            param_group.setdefault(k, v)
        param_group["use_muon"] = False
        muon_defaults = self.defaults
        self.defaults = {**self._adamw_defaults, "use_muon": False}
        try:
            super().add_param_group(param_group)
        finally:
            self.defaults = muon_defaults

    def check_routed_shapes(self, gi: int) -> None:
        """Raise ``RuntimeError`` when Muon group ``gi`` no longer holds the matrices it was routed
        with: a wrapper that flattened or swapped its tensors after construction (DeepSpeed's ZeRO
        optimizer hands a client optimizer flat 1-D partitions; Muon's algorithm on them is not
        Muon). Compares full shapes (``true_shape``: a DTensor's global shape, a ZeRO-3
        parameter's ``ds_shape``), so FSDP2's in-place swap for sharded DTensors passes. Called when
        the group's plans are (re)built, once per change of its parameters, not per step."""
        routed = self._routed_shapes[gi] if gi < len(self._routed_shapes) else None
        group = self.param_groups[gi]
        if routed is None or not group["use_muon"]:
            return
        now = tuple(tuple(true_shape(p)) for p in group["params"])
        if now == routed:
            return
        names = group.get("param_names") or []
        bad = next((i for i, (a, b) in enumerate(zip(now, routed)) if a != b), min(len(now), len(routed)))
        label = repr(names[bad]) if bad < len(names) else f"#{bad}"
        got = now[bad] if bad < len(now) else "nothing"
        was = routed[bad] if bad < len(routed) else "nothing"
        raise RuntimeError(
            f"QMuon: Muon param group {gi} ({group.get('name', 'muon')!r}) no longer holds the matrices it was routed "
            f"with: parameter {label} was {was}, it is now {got} ({len(routed)} tensors routed, {len(now)} held). A "
            "wrapper flattened or replaced the optimizer's parameters (DeepSpeed's ZeRO optimizer hands a client "
            "optimizer flat 1-D partitions), and Muon on them would not be Muon, so no step was taken. Under "
            "DeepSpeed use qmuon.integrations.deepspeed (WholeMatrixZeroOptimizer / qds.initialize; "
            "qmuon.integrations.accelerate.prepare_qmuon under Accelerate's DeepSpeed plugin; "
            "qmuon.integrations.transformers.QMuonFactory with the Trainer); otherwise build the optimizer from "
            "the model as the wrapper hands it over")

    def _taken_names(self) -> list[str]:
        return [g["name"] for g in self.param_groups if "name" in g]

    def _explicit_group(self, group: dict[str, Any], params: list[Tensor],
                        caller_names: list[str] | None) -> dict[str, Any]:
        """A group added as given, with ``param_names`` and ``name`` filled in where the other
        groups carry them (torch refuses a group without names among named ones)."""
        gi = len(self.param_groups)
        if caller_names is None and "param_names" not in group and params and all(
                "param_names" in g for g in self.param_groups):
            names = self._model_names(params)
            group["param_names"] = [names.get(id(p), f"param_groups[{gi}].params[{j}]") for j, p in enumerate(params)]
        if "name" not in group and any("name" in g for g in self.param_groups):
            group["name"] = unique_group_name(group_name(group), self._taken_names())
        return group

    def _model_names(self, params: list[Tensor]) -> dict[int, str]:
        model = self.router.model if self.router is not None else None
        if model is None:
            return {}
        ids = {id(p) for p in params}
        names: dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            if id(p) in ids:
                names.setdefault(id(p), n)  # a tied parameter: its first name, as routing names it
        return names

    def _routed_groups(self, group: dict[str, Any], params: list[Tensor],
                       caller_names: list[str] | None) -> list[dict[str, Any]]:
        """``group`` split by the rule table (see :meth:`add_param_group`), not yet added."""
        for p in params:
            if not isinstance(p, Tensor):
                raise TypeError("optimizer can only optimize Tensors, but one of the params is " + torch.typename(p))
        if caller_names is None and "param_names" in group:
            caller_names = list(group["param_names"])
            if len(caller_names) != len(params):
                raise ValueError(f"QMuon.add_param_group: {len(caller_names)} param_names for {len(params)} parameters")
        gi = len(self.param_groups)
        labels = caller_names or [f"param_groups[{gi}].params[{j}]" for j in range(len(params))]
        router = self.router if self.router is not None else type(self).default_router
        taken = self._taken_names()
        subs = router.split(params, labels, caller_names, taken)
        bases = ["adamw_no_decay" if not sub.get("use_muon", True) and sub.get("weight_decay") == 0.0
                 else group_name(sub) for sub in subs]  # the family labels, before the caller's keys
        ref_muon = bool(self.param_groups[0].get("use_muon", True))
        # The leader (last): a group of param_groups[0]'s family when there is one.
        lead = [i for i, g in enumerate(subs) if bool(g.get("use_muon", True)) == ref_muon]
        if lead and lead[-1] != len(subs) - 1:
            subs.append(subs.pop(lead[-1]))
            bases.append(bases.pop(lead[-1]))
        muon_keys = set(self.defaults) - set(self._adamw_defaults)
        adamw_keys = set(self._adamw_defaults) - set(self.defaults)
        named = all("param_names" in g for g in self.param_groups)
        for sub, base in zip(subs, bases):
            is_muon = bool(sub.get("use_muon", True))
            for k, v in group.items():
                if k in ("params", "param_names", "lr", "name") or (k in adamw_keys if is_muon else k in muon_keys):
                    continue
                if k == "weight_decay" and base == "adamw_no_decay":
                    continue  # the routing's "no decay" holds
                sub[k] = v
            if "lr" in group:
                sub["lr"] = group["lr"] if is_muon == ref_muon else group["lr"] * self._family_lr_ratio(is_muon, ref_muon)
            if not named:
                del sub["param_names"]  # torch: all groups with names, or none
        if "name" in group:
            names = list(taken)
            for sub, base in zip(subs, bases):
                sub["name"] = unique_group_name(str(group["name"]) if len(subs) == 1 else f"{group['name']}_{base}", names)
                names.append(sub["name"])
        return subs

    def _family_lr(self, use_muon: bool, current: bool = True) -> float:
        """The current lr of the first group of a family, else (or with ``current=False``) the
        family's default."""
        if current:
            for g in self.param_groups:
                if bool(g.get("use_muon", True)) == use_muon:
                    return float(g["lr"])
        return float(self.defaults["lr"] if use_muon else self._adamw_defaults["lr"])

    def _family_lr_ratio(self, use_muon: bool, ref_muon: bool) -> float:
        """lr of family ``use_muon`` per unit lr of family ``ref_muon`` (see :meth:`add_param_group`)."""
        for current in (True, False):
            a, b = self._family_lr(use_muon, current), self._family_lr(ref_muon, current)
            if b > 0 and math.isfinite(a) and math.isfinite(b):
                return a / b
        return 1.0

    def _link_lrs(self, groups: list[dict[str, Any]]) -> None:
        """Make ``groups`` (one routed group) follow the last one's lr (see :meth:`add_param_group`)."""
        if len(groups) < 2:
            return
        leader = groups[-1]
        lead = float(leader["lr"])
        if not lead > 0 or "name" not in leader:
            return
        for g in groups[:-1]:
            g["lr_follows"] = leader["name"]
            g["lr_follow_ratio"] = float(g["lr"]) / lead
            self._lr_follow_seen[g["name"]] = (lead, float(g["lr"]))

    def _follow_lrs(self) -> None:
        """Carry a leader's lr change to the groups that follow it (``lr_follows``); a follower
        whose own lr changed since the last step (set by someone else) stops following."""
        followers = [g for g in self.param_groups if "lr_follows" in g]
        if not followers:
            return
        by_name = {g["name"]: g for g in self.param_groups if "name" in g}
        seen = self._lr_follow_seen
        for g in followers:
            leader = by_name.get(g["lr_follows"])
            name = g.get("name")
            if leader is None or name is None:
                continue
            lead, own = float(leader["lr"]), float(g["lr"])
            last = seen.get(name)
            if last is None:  # first step after a load or a copy: take things as they are
                seen[name] = (lead, own)
                continue
            if own != last[1]:  # set by someone else: the caller's value wins from now on
                del g["lr_follows"], g["lr_follow_ratio"]
                del seen[name]
                continue
            if lead != last[0]:
                value = lead * float(g["lr_follow_ratio"])
                cur = g["lr"]
                g["lr"] = torch.tensor(value, dtype=cur.dtype, device=cur.device) if isinstance(cur, Tensor) else value
                seen[name] = (lead, float(g["lr"]))

    @staticmethod
    def _validate_muon_params(group: dict[str, Any], where: str) -> None:
        names = group.get("param_names")
        parts = group["parts"]
        for i, p in enumerate(group["params"]):
            label = f"parameter {names[i]!r}" if names else f"parameter #{i}"
            shape = true_shape(p)  # a DeepSpeed ZeRO-3 partitioned parameter: its full shape
            if len(shape) < 2:
                raise ValueError(
                    f"{where}: {label} has shape {tuple(shape)}: Muon orthogonalizes matrices. Put 1-D tensors "
                    "(biases, norm gains) in an AdamW group ({'params': [...], 'use_muon': False}) or build "
                    "the optimizer with qmuon.build_optimizer(model), which routes them for you"
                )
            if torch.is_complex(p):
                raise ValueError(f"{where}: {label} is complex; QMuon supports real parameters only")
            axis, orientation, bank = group["parts_axis"], group["orientation"], group["bank_dims"]
            if bank and len(shape) != bank + 2:
                raise ValueError(
                    f"{where}: {label} has shape {tuple(shape)}; a bank with bank_dims={bank} is (*bank, rows, cols) "
                    f"({bank + 2} dims). Set bank_dims to the number of leading dims that index matrices")
            if (axis == 1 or orientation != "out_in") and len(shape) != 2 + bank:
                raise ValueError(
                    f"{where}: {label} has shape {tuple(shape)}; orientation={orientation!r} and parts_axis={axis} "
                    "apply to 2-D weights (or the matrices of a bank, bank_dims >= 1) only. Put it in a group with the "
                    "defaults (orientation='out_in', parts_axis=0)")
            dim = bank + axis  # the parts' dim of the weight or of each bank member
            if parts is not None and sum(parts) != shape[dim]:
                unit = "rows" if axis == 0 else "columns (parts_axis=1)"
                what = f"each member of {label}" if bank else label
                raise ValueError(f"{where}: parts {parts} sum to {sum(parts)} {unit} but {what} has {shape[dim]} {unit}")

    # ------------------------------------------------------------------ learning rates from foreign loops
    #: What ``step()`` does when every group holds the same lr although the groups were configured
    #: with different ones (a training loop that writes one lr into every group, as LitGPT's
    #: pretrain loop does with ``optimizer.defaults["lr"]``): ``"warn"`` (default) warns once,
    #: naming the groups; ``"hold"`` reads that lr as the Muon lr ``L`` and gives each group
    #: ``L * ratio``, its configured ratio to ``defaults["lr"]`` (the AdamW groups keep ``adamw_lr /
    #: lr``); ``"off"``: neither. Schedulers that scale every group's own lr (LambdaLR, CosineAnnealing,
    #: the strategies' rebinding) keep the ratios by themselves and never trigger it.
    #: Set by the ``update.lr_ratios`` option, or assigned.
    lr_ratios: str = "warn"
    LR_RATIO_MODES = LR_RATIO_MODES

    def _note_configured_lr(self, group: dict[str, Any]) -> None:
        """Remember ``group``'s lr as a ratio to ``defaults["lr"]`` (what ``lr_ratios`` restores)."""
        base = float(self.defaults["lr"])
        ratios = self.__dict__.setdefault("_configured_lr_ratios", [])
        ratios.append(float(group["lr"]) / base if base > 0 else None)

    def _check_group_lrs(self) -> None:
        """Apply :attr:`lr_ratios` (see there) before a step."""
        mode = self.lr_ratios
        if mode not in self.LR_RATIO_MODES:
            raise ValueError(f"QMuon.lr_ratios must be one of {self.LR_RATIO_MODES}, got {mode!r}")
        ratios = self.__dict__.get("_configured_lr_ratios", [])
        if mode == "off" or None in ratios or len(ratios) != len(self.param_groups) or len(set(ratios)) <= 1:
            return
        lrs = {float(g["lr"]) for g in self.param_groups}
        if len(lrs) != 1:  # the groups differ: no loop wrote one value into all of them
            return
        (lr,) = lrs
        if mode == "hold":
            for g, r in zip(self.param_groups, ratios):
                g["lr"] = lr * r
            return
        if lr <= 0.0 or self.__dict__.get("_lr_ratio_warned"):
            return
        self._lr_ratio_warned = True
        base = float(self.defaults["lr"])
        off = [f"group {gi} ({'Muon' if g['use_muon'] else 'AdamW'}: {', '.join((g.get('param_names') or ['?'])[:3])}"
               f"{', ...' if len(g.get('param_names') or []) > 3 else ''}) configured lr {r * base:g}"
               for gi, (g, r) in enumerate(zip(self.param_groups, ratios)) if r != 1.0]
        msg = (f"QMuon: every parameter group has lr {lr:g}, but they were configured with different learning rates: "
               f"{'; '.join(off)}. A training loop probably wrote one lr into every group (e.g. LitGPT's pretrain loop), "
               "so these groups now train at the Muon lr. Set optimizer.lr_ratios = 'hold' (build_optimizer(..., "
               "update={'lr_ratios': 'hold'})) to keep each group's configured ratio to the Muon lr, or 'off' if this is intended")
        log.warning(msg)
        warnings.warn(msg, UserWarning, stacklevel=3)
