"""QK-clip (MuonClip): measure every attention head's largest logit in the forward pass, and after
each optimizer step rescale the W_q / W_k rows of the heads whose largest logit exceeded ``tau``.

Turned on by one option, ``build_optimizer(model, qk_clip={"tau": 100})`` (the strategies'
``optimizer_kwargs``, ``qmuon-train``'s ``model.optimizer.qk_clip.tau`` and ``QMuonFactory`` pass it
through). ``build_optimizer`` finds the model's attention layers (:func:`find_attention`) before it
changes anything, and refuses a model whose attention it cannot measure.

Measuring. The attention kernels (SDPA, FlashAttention) never return the scores, so each layer's
queries and keys are handed to :func:`observe_logits`, which recomputes ``Q K^T`` in fp32 in a
chunked side computation (:func:`qmuon.core.qk_clip.max_logits`: exact, masked: only the pairs the
causal or given mask allows) and folds the per-head maximum into a running device buffer
(``torch.maximum``; nothing is read to the host). Who calls it:

- the kit's ``DecoderLM`` attention (its forward calls :func:`observe_logits`), and any module with a
  ``qmuon_attention()`` method returning an :class:`AttentionSpec`;
- Hugging Face attention (Llama, Qwen3, ..., GQA included) through transformers' attention
  interface, without editing model code (:mod:`qmuon.integrations.hf_attention`, registered as an
  adapter here when ``qmuon`` is imported).

Capping (``forward_cap``, on by default). The weight rescale uses the logits of the forward
*before* the update, and that update can raise them again. So :func:`observe_logits` also returns
the queries with each head over ``tau`` scaled by ``tau / max`` of this very forward, each
sequence of the batch by its own maximum (:func:`qmuon.core.qk_clip.cap_queries`): the attention
that runs on them sees at most ``tau``, in training and in evaluation forwards alike (an
evaluation forward measures for the cap only).

Only modules in training mode fold their maxima into the clip (evaluation forwards do not move it); the maximum
runs over every forward since the last step (gradient accumulation included) and, under data
parallelism or FSDP2, over every rank (one ``all_reduce(MAX)`` of all layers' maxima per step, so
every rank scales the same heads).

Clipping. A step post-hook of the optimizer (it runs after ``optimizer.step()``, which under
gradient release closes the step after the hooks stepped every parameter) computes the factors
with :func:`qmuon.core.qk_clip.qk_clip_factors` (``torch.where``: no host read, no branch) and
multiplies the rows of each head in place: a plain tensor directly, a sharded DTensor (FSDP2,
rows split over ranks) on the rows it holds locally. Heads at or under ``tau`` are multiplied by
exactly 1.0, which leaves fp32 and bf16 weights bit-identical. Biases of the projections (Qwen2,
``attention_bias=True``) get the same factors as their rows. The momentum is not touched (MuonClip
rescales weights only). Layers with QK-norm (Qwen3: an RMSNorm gain of ``head_dim`` shared by all
heads after the projection) cannot be clipped through W_q / W_k, whose scale the norm removes; their
shared gains ``q_norm.weight`` and ``k_norm.weight`` take ``sqrt(min_h eta_h)`` each, which scales
every head of the layer by the smallest head's factor (the heads under ``tau`` are clipped too).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from ..core.pipeline import is_dtensor
from ..core.qk_clip import cap_queries, max_logits, qk_clip_factors

__all__ = [
    "AttentionSpec",
    "QKClip",
    "attach_qk_clip",
    "find_attention",
    "observe_logits",
    "register_attention_adapter",
    "SUPPORTED_ATTENTION",
]

#: What :func:`find_attention` can measure, for the error that refuses anything else.
SUPPORTED_ATTENTION = (
    "qmuon_lightning.models.DecoderLM attention",
    "Hugging Face attention with q_proj / k_proj (LlamaAttention, Qwen3Attention, ... GQA included) under "
    "attn_implementation 'eager' or 'sdpa'",
    "a module with a qmuon_attention() method returning qmuon.optim.qk_clip.AttentionSpec",
)

#: A row block of a parameter: ``(owner module, parameter name, first row of head 0)``. The module
#: and name, not the tensor: FSDP2 and Accelerate swap parameters for DTensors after the optimizer
#: is built, and the clip must scale the parameter the module holds then.
RowBlock = tuple[nn.Module, str, int]


@dataclass
class AttentionSpec:
    """One attention layer as QK-clip sees it.

    Args:
        name: the module's qualified name (telemetry labels).
        module: the module whose forward calls :func:`observe_logits`.
        n_heads, n_kv_heads, head_dim: query heads, key heads (GQA: fewer), and their width.
        q, k: where the heads' rows are: head ``h`` owns rows ``row0 + h * head_dim`` up to
            ``row0 + (h + 1) * head_dim`` of each listed parameter (weights, and biases if any).
        qk_norm: ``((module, name), (module, name))`` of QK-norm gains shared by all heads (Qwen3):
            they are scaled instead of ``q`` / ``k``.
        install: what makes the module call :func:`observe_logits` (the Hugging Face adapter switches
            the attention implementation); run once, after every layer was found.
    """

    name: str
    module: nn.Module
    n_heads: int
    n_kv_heads: int
    head_dim: int
    q: Sequence[RowBlock] = ()
    k: Sequence[RowBlock] = ()
    qk_norm: tuple[tuple[nn.Module, str], tuple[nn.Module, str]] | None = None
    install: Callable[[], None] | None = field(default=None, repr=False)


#: ``fn(name, module) -> AttentionSpec | None`` for attention modules that do not describe
#: themselves; an adapter raises ``ValueError`` for one it recognizes but cannot measure.
_ADAPTERS: list[Callable[[str, nn.Module], AttentionSpec | None]] = []


def register_attention_adapter(fn: Callable[[str, nn.Module], AttentionSpec | None]) -> None:
    """Let :func:`find_attention` recognize more attention modules (integrations register theirs)."""
    if fn not in _ADAPTERS:
        _ADAPTERS.append(fn)


def _looks_like_attention(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention) or "attention" in type(module).__name__.lower()


def find_attention(model: nn.Module) -> list[AttentionSpec]:
    """Every attention layer of ``model`` QK-clip can measure, or ``ValueError`` naming the first it
    cannot (a module that looks like attention, by type or by name, and that no adapter handles)
    and the supported kinds. Changes nothing."""
    specs: list[AttentionSpec] = []
    handled: list[str] = []
    for name, module in model.named_modules():
        describe = getattr(module, "qmuon_attention", None)
        spec = describe() if callable(describe) else None
        for adapter in _ADAPTERS:
            if spec is not None:
                break
            spec = adapter(name, module)
        if spec is not None:
            spec.name = spec.name or name
            _check_spec(spec)
            specs.append(spec)
            handled.append(name)
    for name, module in model.named_modules():
        inside = not name or any(h == name or h.startswith(name + ".") or name.startswith(h + ".") for h in handled)
        if _looks_like_attention(module) and not inside:
            raise ValueError(
                f"qk_clip: {type(module).__name__} at {name or '<model>'!r} looks like attention, but QK-clip cannot "
                f"measure its logits, so it would not be clipped. Supported: {'; '.join(SUPPORTED_ATTENTION)}. "
                "Use a supported attention, give the module a qmuon_attention() method, or drop qk_clip")
    if not specs:
        raise ValueError(
            f"qk_clip: found no attention layer in {type(model).__name__} whose logits QK-clip can measure. "
            f"Supported: {'; '.join(SUPPORTED_ATTENTION)}. Drop qk_clip for this model")
    return specs


def _check_spec(spec: AttentionSpec) -> None:
    if spec.n_heads % spec.n_kv_heads:
        raise ValueError(f"qk_clip: {spec.name}: {spec.n_heads} query heads are not a multiple of "
                         f"{spec.n_kv_heads} key heads")
    if spec.qk_norm is None:
        for blocks, heads, what in ((spec.q, spec.n_heads, "q"), (spec.k, spec.n_kv_heads, "k")):
            if not blocks:
                raise ValueError(f"qk_clip: {spec.name}: no {what} rows to rescale")
            for owner, pname, row0 in blocks:
                rows = getattr(owner, pname).shape[0]
                if row0 + heads * spec.head_dim > rows:
                    raise ValueError(
                        f"qk_clip: {spec.name}: {what} heads {heads} x {spec.head_dim} from row {row0} exceed the "
                        f"{rows} rows of {pname}")


class _Probe:
    """What an attention module carries to report its logits: a weak link to the :class:`QKClip`
    and the layer's index. A copy of the module (``deepcopy``, pickling) gets an inert probe: it
    does not measure into the original's optimizer."""

    __slots__ = ("clip", "index")

    def __init__(self, clip: "QKClip | None", index: int) -> None:
        self.clip = weakref.ref(clip) if clip is not None else None
        self.index = index

    def __reduce__(self) -> tuple:
        return (_Probe, (None, -1))

    def __deepcopy__(self, memo: dict) -> "_Probe":
        return _Probe(None, -1)


_PROBE = "_qmuon_qk_probe"


def observe_logits(module: nn.Module, q: Tensor, k: Tensor, *, scale: float, causal: bool = True,
                   mask: Tensor | None = None) -> Tensor:
    """Measure the per-head maximum logit of ``q`` ``(B, H, T, D)`` and ``k`` ``(B, KV, S, D)`` (see
    :func:`qmuon.core.qk_clip.max_logits` for ``causal`` / ``mask``), fold it into the QK-clip buffer
    of ``module`` (training mode only), and return the queries the attention must use: ``q`` itself,
    or with the forward cap on, ``q`` with each head over ``tau`` scaled back to ``tau``.

    A module no :class:`QKClip` watches gets ``q`` back untouched and measures nothing, as does an
    evaluation forward without the cap."""
    probe = module.__dict__.get(_PROBE)
    clip = probe.clip() if probe is not None and probe.clip is not None else None
    if clip is None or not (module.training or clip.forward_cap):
        return q
    # per sequence: each sequence is capped by its own maximum (its output does not depend on the
    # rest of the batch, nor on how the batch is split over ranks)
    m = max_logits(q, k, scale, causal=causal, mask=mask, per_sample=True)
    if module.training:
        clip.observe(probe.index, m.amax(dim=0))
    return cap_queries(q, m, clip.tau) if clip.forward_cap else q


class QKClip:
    """The QK-clip of one optimizer (``optimizer.qk_clip``; :func:`attach_qk_clip` builds it).

    Attributes:
        tau: the threshold.
        forward_cap: whether :func:`observe_logits` caps each forward's queries at ``tau``.
        layers: the :class:`AttentionSpec` of each watched layer.
        running: fp32 ``(total heads,)``: each head's maximum logit since the last step (``-inf``
            when nothing was measured).
        last_max, last_clipped: after a step, the maxima it clipped with and which heads were over
            ``tau`` (device tensors; :meth:`metrics` reads them).
        clipped_total: how many head-clips since the start (device int64).
    """

    def __init__(self, layers: list[AttentionSpec], tau: float, forward_cap: bool = True) -> None:
        self.tau = float(tau)
        self.forward_cap = bool(forward_cap)
        self.layers = layers
        self._slices: list[slice] = []
        start = 0
        for spec in layers:
            self._slices.append(slice(start, start + spec.n_heads))
            start += spec.n_heads
        self.total_heads = start
        self.running: Tensor | None = None
        self.last_max: Tensor | None = None
        self.last_clipped: Tensor | None = None
        self.clipped_total: Tensor | None = None
        self._handle: Any = None
        for i, spec in enumerate(layers):
            object.__setattr__(spec.module, _PROBE, _Probe(self, i))

    # ------------------------------------------------------------------ measuring
    def _buffer(self, device: torch.device) -> Tensor:
        if self.running is None:
            self.running = torch.full((self.total_heads,), float("-inf"), device=device)
            self.last_max = self.running.clone()
            self.last_clipped = torch.zeros(self.total_heads, dtype=torch.bool, device=device)
            self.clipped_total = torch.zeros((), dtype=torch.int64, device=device)
        return self.running

    def observe(self, index: int, per_head_max: Tensor) -> None:
        """Fold layer ``index``'s per-head maxima into :attr:`running`."""
        spec = self.layers[index]
        if per_head_max.numel() != spec.n_heads:  # shapes only: no host read
            raise RuntimeError(
                f"qk_clip: {spec.name} ran {per_head_max.numel()} query heads, its spec has {spec.n_heads}: the "
                "heads are split over ranks (tensor-parallel attention), which QK-clip does not measure. Keep "
                "attention out of the tensor-parallel plan (FSDP2 / HSDP shard it by rows), or drop qk_clip")
        view = self._buffer(per_head_max.device)[self._slices[index]]
        torch.maximum(view, per_head_max, out=view)

    # ------------------------------------------------------------------ clipping
    def _device(self) -> torch.device:
        spec = self.layers[0]
        owner, pname = (spec.q[0][:2] if spec.qk_norm is None else spec.qk_norm[0])
        p = getattr(owner, pname)
        return p.to_local().device if is_dtensor(p) else p.device

    @torch.no_grad()
    def apply(self) -> None:
        """Rescale the heads over ``tau`` from :attr:`running`, then start a new maximum (the
        optimizer's step post-hook calls it)."""
        m = self._buffer(self._device())
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX)  # every rank clips the same heads by the same factors
        rows: dict[int, tuple[nn.Module, str, list[tuple[int, Tensor]]]] = {}
        for spec, sl in zip(self.layers, self._slices):
            if spec.qk_norm is not None:  # shared gains: the whole layer by its largest head
                q_f, k_f = qk_clip_factors(m[sl].amax().reshape(1), self.tau, 1)
                for (owner, pname), f in zip(spec.qk_norm, (q_f, k_f)):
                    _scale_rows(owner, pname, [(0, f.expand(getattr(owner, pname).shape[0]))], rows)
                continue
            q_f, k_f = qk_clip_factors(m[sl], self.tau, spec.n_kv_heads)
            for blocks, f in ((spec.q, q_f), (spec.k, k_f)):
                per_row = f.repeat_interleave(spec.head_dim)
                for owner, pname, row0 in blocks:
                    _scale_rows(owner, pname, [(row0, per_row)], rows)
        for owner, pname, blocks in rows.values():
            _apply_rows(getattr(owner, pname), blocks)
        over = (m > self.tau) & torch.isfinite(m)
        assert self.last_max is not None and self.last_clipped is not None and self.clipped_total is not None
        self.last_max.copy_(m)
        self.last_clipped.copy_(over)
        self.clipped_total += over.sum()
        m.fill_(float("-inf"))

    def metrics(self) -> dict[str, float]:
        """``qk_clip/max_logit/<layer>`` (the largest head's logit in the last step) and
        ``qk_clip/heads_clipped`` (heads over ``tau`` in the last step), ``qk_clip/heads_clipped_total``.
        Reads the device (one transfer): call it at log intervals, not every step."""
        if self.last_max is None or self.last_clipped is None or self.clipped_total is None:
            return {}
        per_layer = torch.stack([self.last_max[sl].amax() for sl in self._slices])
        packed = torch.cat([per_layer.float(), self.last_clipped.sum().reshape(1).float(),
                            self.clipped_total.reshape(1).float()]).tolist()
        out = {f"qk_clip/max_logit/{spec.name}": v for spec, v in zip(self.layers, packed)}
        out["qk_clip/heads_clipped"] = packed[-2]
        out["qk_clip/heads_clipped_total"] = packed[-1]
        return out

    def detach(self) -> None:
        """Stop measuring and clipping (the modules' probes and the step hook are removed)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for spec in self.layers:
            spec.module.__dict__.pop(_PROBE, None)


def _scale_rows(owner: nn.Module, pname: str, blocks: list[tuple[int, Tensor]],
                rows: dict[int, tuple[nn.Module, str, list[tuple[int, Tensor]]]]) -> None:
    """Collect row factors per parameter (a fused qkv weight gets its q and k blocks in one pass)."""
    p = getattr(owner, pname)
    entry = rows.setdefault(id(p), (owner, pname, []))
    entry[2].extend(blocks)


def _apply_rows(p: Tensor, blocks: list[tuple[int, Tensor]]) -> None:
    """Multiply rows ``row0 .. row0 + len(f)`` of ``p`` by ``f`` for each block, in place; a DTensor on
    the rows this rank holds (rows split by ``Shard(0)``, or replicated)."""
    n_rows = p.shape[0]
    first = blocks[0][1]
    factor = torch.ones(n_rows, dtype=torch.float32, device=first.device)
    for row0, f in blocks:
        factor[row0: row0 + f.numel()] = f
    if is_dtensor(p):
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        for pl in p.placements:
            if not (isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0)):
                raise RuntimeError(f"qk_clip: a parameter sharded as {p.placements}: only rows (Shard(0)) or "
                                   "replicas can be rescaled per head")
        loc = p.to_local()
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        factor = factor[offset[0]: offset[0] + shape[0]]
    else:
        loc = p.data
    if loc.shape[0] == 0:
        return
    loc.mul_(factor.to(loc.device).view(-1, *([1] * (loc.ndim - 1))))


def attach_qk_clip(optimizer: Any, model: nn.Module, tau: float,
                   layers: list[AttentionSpec] | None = None, *, forward_cap: bool = True) -> QKClip:
    """Measure ``model``'s attention logits and clip them at ``tau`` after every ``optimizer.step()``,
    and with ``forward_cap`` in every forward (``build_optimizer(model, qk_clip={"tau": ...})`` calls
    this). ``layers``: what :func:`find_attention` returned, if it was called already (before
    anything changed)."""
    if not (isinstance(tau, (int, float)) and 0 < tau < math.inf):
        raise ValueError(f"qk_clip: tau must be a finite threshold > 0, got {tau!r}")
    if not isinstance(forward_cap, bool):
        raise ValueError(f"qk_clip: forward_cap must be True or False, got {forward_cap!r}")
    layers = find_attention(model) if layers is None else layers
    clip = QKClip(layers, tau, forward_cap)
    for spec in layers:
        if spec.install is not None:
            spec.install()
    old = getattr(optimizer, "qk_clip", None)
    if old is not None:
        old.detach()
    clip._handle = optimizer.register_step_post_hook(lambda opt, args, kwargs: clip.apply())
    optimizer.qk_clip = clip
    return clip
