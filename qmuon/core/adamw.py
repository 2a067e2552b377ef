"""The auxiliary AdamW step, one parameter at a time in bounded blocks of rows.

``torch.optim.adam``'s foreach path builds several whole-group temporaries (``sqrt(v)`` of every
tensor at once, the bias-corrected copies, ...): at GPT-2-small width they were the step's peak
(~442 MiB). Here each parameter is stepped in blocks of at most :data:`DEFAULT_CHUNK_ELEMENTS`
elements (whole rows), and a block's transient is its fp32 update (and, for dense moments, the
``sqrt(v)`` denominator): the step's transient memory is bounded by one block, whatever the model.

Per block: the moments are updated and the update emitted by :func:`qmuon.quant.adamw.update_rows`
(the fused quantized kernel, or torch's ops in ``torch.optim.AdamW``'s order for dense moments), and
the weights are written only through :func:`qmuon.core.apply.apply_update_`
(``param <- (1 - lr wd) param + update``), the one place both groups write weights.

Maths (``torch.optim.AdamW``, decoupled weight decay, no amsgrad), with ``t`` the step count::

    m = lerp(m, g, 1 - beta1);   v = beta2 v + (1 - beta2) g^2
    param = (1 - lr wd) param + (-lr / (1 - beta1^t)) m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

For fp32 parameters with fp32 moments every operation is torch's own, in its order: the results
equal ``torch.optim.AdamW(foreach=False)`` bit for bit.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ..ops.reference_adamw import bias_terms  # noqa: F401  (the AdamW bias terms; re-exported)
from ..quant import adamw as qadamw
from .apply import apply_update_, weight_state_init

__all__ = ["chunk_rows", "init_state", "adamw_param_step"]

#: Elements per block of rows (4 MiB of fp32 update): bounds the step's transient memory. 2^22 (16 MiB)
#: was 0.30 B/param of a 56M-parameter model's whole step (benchmarks/results/train_memory.md);
#: 2^20-element blocks still amortize the per-block call (a 32k x 512 embedding: 16 blocks).
DEFAULT_CHUNK_ELEMENTS = 1 << 20


def chunk_rows(rows: int, cols: int, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Rows per block: as many whole rows as fit in ``chunk_elements`` (at least one)."""
    return max(1, min(rows, chunk_elements // max(cols, 1)))


def init_state(family: str, global_shape: Sequence[int], p_local: Tensor, bf16_update: str) -> dict[str, Tensor]:
    """Zero moments for a parameter (``p_local``: its local rows), plus the weight-writing state
    its ``bf16_update`` rule keeps (:func:`~qmuon.core.apply.weight_state_init`)."""
    st = qadamw.init_adamw_state(family, global_shape, p_local.shape, p_local.device)
    st.update(weight_state_init(p_local, bf16_update))
    return st


def moment_stream(group: dict[str, Any], seed: int, key: int, step: int) -> int:
    """The op's ``stream`` for the quantized moments: -1 (nearest) unless the group's ``rounding`` is
    ``"stochastic"``, then the counter stream of (``seed``, parameter ``key``, ``step``)."""
    if group.get("rounding", "nearest") != "stochastic":
        return -1
    return qadamw.moment_noise_stream(seed, key, step)


def _row_view(t: Tensor, rows: int) -> Tensor:
    return t.view(rows, -1)


def adamw_param_step(p_local: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any], *,
                     global_shape: Sequence[int], key: int = 0, row_offset: int = 0,
                     first_index: int | None = None, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
                     skip: Tensor | None = None, device_lr: Tensor | None = None) -> None:
    """One AdamW step of one parameter (``p_local``, ``grad``, ``state``: local tensors; for a
    ``Shard(0)`` parameter its rows, starting at global row ``row_offset``).

    ``first_index``: the flat (row-major) index of ``p_local``'s first element in the whole
    parameter, when ``p_local`` is a ``(rows, width)`` piece of a flat slice rather than whole rows
    (DeepSpeed ZeRO partitions): its row ``r`` then starts at ``first_index + r * width``. Default:
    ``row_offset * cols``. It keys the stochastic rounding of bf16 weights and of quantized moments,
    so a piece draws the noise of the unsharded parameter.

    ``group``: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``state_format`` (the family) and,
    optionally, ``bf16_update``, ``rounding`` and ``seed`` (the rounding rule of low-precision weights,
    that of quantized moments, ``"nearest"`` or ``"stochastic"``, and the seed of their noise, keyed
    by the parameter ``key`` and the step; the two draw distinct streams).

    ``skip``: None, or the parameter's one-element device flag; when True the weights and moments are
    left bit-identical (the step counter still advances: the optimizer rolls it back when it reads the
    flag, :mod:`qmuon.optim.nonfinite`).

    ``device_lr``: a capturable step (``update.capturable``): the group's lr as a 0-d fp64 tensor on the
    parameter's device, whose ``state["step"]`` lives there too. The step counter then advances on the
    device, by 0 where ``skip`` is set, and every lr- or step-dependent scalar stays a device tensor."""
    wd, eps = float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = float(group["betas"][0]), float(group["betas"][1])
    m_fmt, v_fmt = qadamw.moment_formats(group["state_format"], global_shape)
    lr: float | Tensor
    step: int | Tensor
    if device_lr is not None:
        lr = device_lr
        counter = state["step"]
        counter.add_(1 if skip is None else (~skip.reshape(())).to(counter.dtype))  # a skip keeps the count
        step = counter
    else:
        lr = float(group["lr"])
        state["step"] += 1
        step = int(state["step"].item())  # a CPU counter: no device read (symbolic in a compiled step)
    decay = 1.0 - lr * wd
    rows, cols = qadamw.matrix_shape(p_local.shape)
    if rows == 0 or cols == 0:
        return
    p2d = _row_view(p_local, rows)
    g2d = _row_view(grad if grad.is_contiguous() else grad.contiguous(), rows)
    rule = group.get("bf16_update", "nearest")
    cautious = bool(group.get("cautious_weight_decay", False))  # decay only where the step shrinks |w|
    # the weight-writing state of low-precision weights (e.g. an error-correction term): one value per weight
    moment_keys = {"step", *m_fmt.spec.keys, *v_fmt.spec.keys}
    weight_keys = [k for k, v in state.items()
                   if k not in moment_keys and isinstance(v, Tensor) and v.numel() == p_local.numel()]
    n = chunk_rows(rows, cols, chunk_elements)
    buf = torch.empty((n, cols), dtype=torch.float32, device=p_local.device)
    seed = int(group.get("seed", 0))
    first = row_offset * cols if first_index is None else int(first_index)
    stream = moment_stream(group, seed, key, step)
    for r0 in range(0, rows, n):
        r1 = min(rows, r0 + n)
        update = buf[: r1 - r0]
        qadamw.update_rows(m_fmt, v_fmt, state, r0, r1, g2d[r0:r1], update, beta1=beta1, beta2=beta2, eps=eps,
                           lr=lr, step=step, stream=stream, index0=first + r0 * cols, skip=skip)
        wstate = {k: _row_view(state[k], rows)[r0:r1] for k in weight_keys if k in state}
        apply_update_(p2d[r0:r1], update, alpha=1.0, decay=decay, bf16_update=rule, state=wstate or None,
                      rng=(seed, key, step, first + r0 * cols), cautious=cautious, skip=skip)
