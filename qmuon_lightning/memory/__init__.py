"""Will it fit? The bytes of one training step, per optimizer configuration, from a model's shapes.

One accounting model, used by ``qmuon-estimate``, ``benchmarks/bench_train_memory.py`` and the
tests that hold it to PyTorch's ``MemTracker``. It reads a model built on the meta device (no
memory is allocated), routes it with :func:`~qmuon.optim.routing.route_parameters` (the
split :func:`~qmuon_lightning.build_optimizer` makes), and counts, per :class:`Setup`:

* **weights**: every parameter in the setup's weight dtype, plus the model's buffers;
* **grads**: one gradient per trainable parameter in its dtype; with gradient release only the
  largest single gradient is in flight (each is stepped and freed inside backward);
* **optimizer state**: what the optimizer keeps between steps, from the formats themselves:
  Muon momentum from the quant registry (:meth:`StateFormat.nbytes
  <qmuon.quant.formats.base.StateFormat.nbytes>`, the format's own tensors on the meta
  device), the bf16 weight-correction state from
  :func:`qmuon.core.apply.weight_state_init`, AdamW moments as ``torch.optim.AdamW``
  stores them (``zeros_like(param)`` twice) or in the group's AdamW state format, and each
  optimizer's 0-d ``step`` tensors;
* **step temporaries**: the largest transient working set of ``optimizer.step()``, from a model of
  what each step path allocates (:mod:`.paths`: ``adamw_phase_bytes``, ``torch_muon_phase_bytes``,
  ``qmuon_muon_phase_bytes``, ``ns_phase_bytes``; the formulas are in their docstrings).

The step's phases run one after the other (QMuon: Muon momentum per group, AdamW groups, then the
Newton-Schulz batches; torch.optim.Muon then torch.optim.AdamW), so the step's peak is
``weights + grads + state + max(phase temporaries)``; with gradient release it is
``weights + state + max over parameters (its gradient + its own step's temporaries)``.
Activations are not part of it: they are freed before ``optimizer.step()`` and, with release, the
estimate holds for a tiny batch. :func:`decoder_activations` (defined beside the model, in
:mod:`qmuon_lightning.models.activations`) estimates them for a DecoderLM, with and without
activation checkpointing; add its ``peak`` for the whole step.

What is counted is what PyTorch's ``MemTracker`` sees: tensor storages created through the
dispatcher. Scratch a compiled kernel allocates internally, the CUDA context and the caching
allocator's slack are not part of it (leave ~1-3 GiB of a budget for them on a GPU).
"""

from __future__ import annotations

from ..models.activations import (
    ActivationEstimate,
    decoder_activations,
)
from .measure import (
    Measurement,
    build_optimizers,
    measure_step,
)
from .model import (
    STANDARD_SETUPS,
    Inventory,
    MemoryEstimate,
    Setup,
    depth_inventories,
    estimate,
    largest_within,
    parameter_inventory,
)
from .report import (
    format_bytes,
    format_table,
    parse_bytes,
)

__all__ = [
    "STANDARD_SETUPS",
    "ActivationEstimate",
    "Inventory",
    "Measurement",
    "MemoryEstimate",
    "Setup",
    "build_optimizers",
    "decoder_activations",
    "depth_inventories",
    "estimate",
    "format_bytes",
    "format_table",
    "largest_within",
    "measure_step",
    "parameter_inventory",
    "parse_bytes",
]
