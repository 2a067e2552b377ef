"""Lightning callbacks for QMuon runs.

* :class:`QuantizedStateCheckpoint`: a manifest of the quantized optimizer state in every
  checkpoint, checked on resume (an error names a format / layout mismatch), atomic standalone
  quantized-state files (keep last k), and export of the momentum dequantized to fp32.
* :class:`OptimizerStepProfiler`: ``torch.profiler`` windows around ``optimizer.step`` only, on a
  schedule; Chrome trace, key-averages table (``qmuon::`` ops), peak memory, ``optimizer_step_ms``.
* :class:`QuantFidelityMonitor`: every N steps, per-layer cosine of the quantized-state Muon update
  against the fp32-state update on the run's own gradients; warns, promotes the layer to a safer
  momentum format, or stops the run below a per-format threshold.
* :class:`BF16StallMonitor`: every N steps, the bf16 weights whose updates nearest rounding would lose.

* :func:`resolve_ckpt_path`, :class:`ContinueCheckpointNames`, :class:`EpochBoundaryResume`: resume
  from the newest complete checkpoint of every ``ModelCheckpoint`` folder, under the same names.
* :func:`default_progress_bar`: Lightning's progress bar showing the epochs the run will reach.

See ``docs/callbacks.md``.
"""

from .checkpoint import (
    MANIFEST_KEY,
    QuantizedStateCheckpoint,
    QuantizedStateMismatchError,
    atomic_torch_save,
    build_manifest,
    export_fp32_momentum,
    load_quantized_state,
    standalone_files,
    validate_manifest,
)
from .fidelity import DEFAULT_COSINE_THRESHOLD, QuantFidelityError, QuantFidelityMonitor, UpdateFidelityTracker
from .profiler import OptimizerStepProfiler, peak_allocated_from_trace
from .progress import RichEpochProgressBar, TQDMEpochProgressBar, default_progress_bar
from .resume import ContinueCheckpointNames, EpochBoundaryResume, resolve_ckpt_path
from .weight_numerics import BF16StallMonitor

__all__ = [
    "BF16StallMonitor",
    "QuantizedStateCheckpoint",
    "QuantizedStateMismatchError",
    "OptimizerStepProfiler",
    "QuantFidelityMonitor",
    "UpdateFidelityTracker",
    "QuantFidelityError",
    "DEFAULT_COSINE_THRESHOLD",
    "MANIFEST_KEY",
    "atomic_torch_save",
    "build_manifest",
    "validate_manifest",
    "export_fp32_momentum",
    "load_quantized_state",
    "standalone_files",
    "peak_allocated_from_trace",
    "EpochBoundaryResume",
    "ContinueCheckpointNames",
    "resolve_ckpt_path",
    "RichEpochProgressBar",
    "TQDMEpochProgressBar",
    "default_progress_bar",
]
