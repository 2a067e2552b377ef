"""The step paths' transient memory: what each ``optimizer.step()`` path allocates and frees.

Pure functions of shapes and dtypes (see ``docs/memory.md`` for the formulas and the measurements
behind them); :mod:`.model` takes the maximum over the phases of a step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from qmuon.core import adamw as core_adamw
from qmuon.core import pipeline
from qmuon.quant import adamw as qadamw
from qmuon.quant import state as qstate

if TYPE_CHECKING:
    from .model import ParamInfo


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _uses_foreach(device: str) -> bool:
    """Whether ``torch.optim.AdamW`` (``foreach=None``) takes its foreach path on ``device``:
    torch defaults to foreach where its foreach kernels are supported (CUDA, XPU, ...), and to
    the per-tensor loop elsewhere (CPU)."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    return torch.device(device).type in _get_foreach_kernels_supported_devices()


def adamw_phase_bytes(groups: Sequence[Sequence[int]], elem_bytes: int, *, foreach: bool) -> int:
    """Largest transient of ``torch.optim.AdamW`` (``foreach=None``, ``capturable=False``), whose
    functional form QMuon's AdamW groups call too. ``groups``: element counts per parameter
    group, in step order; ``elem_bytes``: bytes per element of the parameters (state follows them).

    * foreach (CUDA): ``torch._foreach_sqrt(exp_avg_sqs)`` materializes ``sqrt(v)`` of the whole
      group at once, then divides and adds in place: one copy of the group (per device and dtype).
    * per tensor (CPU): ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`` holds
      ``sqrt(v)`` and its quotient together (2 copies of the tensor), while the previous tensor's
      ``denom`` is still bound (the name is rebound only after the new one exists): tensor ``i``
      peaks at ``numel[i-1] + 2 numel[i]`` elements within a group.
    """
    peak = 0
    for sizes in groups:
        if not sizes:
            continue
        if foreach:
            peak = max(peak, sum(sizes) * elem_bytes)
            continue
        prev = 0
        for n in sizes:
            peak = max(peak, (prev + 2 * n) * elem_bytes)
            prev = n
    return peak


def torch_muon_phase_bytes(matrices: Iterable[tuple[int, int]], elem_bytes: int) -> int:
    """Largest transient of ``torch.optim.Muon`` (one matrix at a time; ``_single_tensor_muon``):
    ``update = grad.lerp(buf, momentum)`` (``elem_bytes n``), its bf16 copy (``2 n``; none when the
    gradient is bf16 already), and in each Newton-Schulz iteration the new iterate (``2 n``) while
    the old one and the bf16 Gram matrix and its polynomial (``2 r^2`` each, ``r = min(rows, cols)``)
    are alive: ``elem_bytes n + (2 n if fp32) + 2 n + 4 r^2``."""
    peak = 0
    for rows, cols in matrices:
        n, r = rows * cols, min(rows, cols)
        copy = 2 * n if elem_bytes != 2 else 0
        peak = max(peak, elem_bytes * n + copy + 2 * n + 4 * r * r)
    return peak


def ns_phase_bytes(matrices: Sequence[tuple[int, int, bool]], ns_bytes: int, grad_bytes: int, *,
                   device: str, batch_budget: float = pipeline.DEFAULT_BATCH_BUDGET) -> int:
    """Largest transient of QMuon's Newton-Schulz phase (:func:`qmuon.core.pipeline.orthogonalize`).

    Matrices of one NS shape are stacked in batches of ``B`` matrices
    (:meth:`~qmuon.core.pipeline.BatchSizes.per_batch` of the step's matrices: at most
    ``cap // (rows cols)``, ``cap`` being ``batch_budget`` times the largest matrix or
    :data:`~qmuon.core.pipeline.BATCH_STEP_SHARE` of all Muon elements, on CPU at most
    :data:`~qmuon.core.pipeline.CPU_BATCH_MAX_ELEMENTS`; a short batch padded to ``B``).
    :func:`newton_schulz_folded <qmuon.core.newton_schulz.newton_schulz_folded>` of a batch
    holds the batch (a copy in the NS dtype, except for a lone matrix whose gradient has that dtype
    already), the iterate and its ping-pong buffer (``2 B n`` in the NS dtype) and the
    ``B x r x r`` Gram matrix and polynomial.
    """
    if not matrices:
        return 0
    ns_shapes = [(c, r) if t else (r, c) for r, c, t in matrices]
    sizes = pipeline.BatchSizes.of(ns_shapes, batch_budget)
    dev = torch.device(device).type
    peak = 0
    shapes: dict[tuple[int, int, bool], int] = {}
    for rows, cols, t in matrices:
        key = (cols, rows, True) if t else (rows, cols, False)
        shapes[key] = shapes.get(key, 0) + 1
    for (rows, cols, transposed), count in shapes.items():
        n, r = rows * cols, min(rows, cols)
        b = sizes.per_batch(rows, cols, dev)
        copied = not (b == 1 and not transposed and grad_bytes == ns_bytes)
        peak = max(peak, ns_bytes * b * ((3 if copied else 2) * n + 2 * r * r))
    return peak


def qmuon_muon_phase_bytes(groups: Sequence[Sequence[ParamInfo]], opts_of: Callable[[], qstate.FormatOptions],
                           fmt: qstate.StateFormat, grad_bytes: int = 4) -> int:
    """Largest transient of QMuon's momentum phase: per Muon group, the per-row-block sums of
    squares of every matrix of the group (fp32 ``rows x ceil(cols / block_size)``, alive until the
    group's NS items are made) plus the largest :meth:`~qmuon.quant.formats.base.StateFormat.update_workspace_nbytes`
    of one matrix (0 for the formats whose compiled kernels update in place)."""
    opts = opts_of()
    peak = 0
    per_shape: dict[tuple[int, int], tuple[int, int]] = {}  # (sums, workspace) per matrix shape: layers repeat
    for params in groups:
        sums = ws = 0
        for p in params:
            shape = (p.rows, p.cols)
            if shape not in per_shape:
                per_shape[shape] = (p.rows * math.ceil(p.cols / opts.block_size) * 4,
                                    fmt.update_workspace_nbytes(p.rows, p.cols, opts, grad_bytes))
            s, w = per_shape[shape]
            sums += s
            ws = max(ws, w)
        peak = max(peak, sums + ws)
    return peak


def adamw_chunked_step_bytes(shape: Sequence[int], family: str, weight_dtype: torch.dtype) -> int:
    """Transient of QMuon's per-tensor AdamW step of one parameter
    (:func:`qmuon.core.adamw.adamw_param_step`): blocks of whole rows of at most
    ``DEFAULT_CHUNK_ELEMENTS`` elements, each with its fp32 update buffer (``4 c`` bytes, ``c`` the
    block's elements), plus, for dense moments, torch's ops on the block: ``sqrt(v)`` (``4 c``) and
    fp32 copies of bf16 moments and gradient (``4 c`` each); quantized moments are updated by the
    fused kernel in place. Writing the weights (:func:`qmuon.core.apply.apply_update_`):
    fp32 in place; bf16 by the fused rounding kernels (``bf16_weight_update_``,
    ``bf16_ecc8_weight_update_``), in place, nothing more; fp16 (no rounding rule) through
    ``param.float() * decay + update * alpha``: the weights in fp32, their scaled copy and the sum
    alive at once (``12 c``)."""
    rows, cols = qadamw.matrix_shape(shape)
    c = core_adamw.chunk_rows(rows, cols) * cols
    m_fmt, v_fmt = qadamw.moment_formats(family, shape)
    words = 1  # the fp32 update buffer
    if m_fmt.spec.kind.startswith("adamw_dense") and v_fmt.spec.kind.startswith("adamw_dense"):
        words += 1  # denom = sqrt(v)
        words += sum(1 for f in (m_fmt, v_fmt) if f.spec.dtype != torch.float32)
        words += 1 if weight_dtype != torch.float32 else 0  # grad.float()
    if weight_dtype == torch.float16:
        words += 3  # apply_update_'s fp32 path
    return 4 * c * words
