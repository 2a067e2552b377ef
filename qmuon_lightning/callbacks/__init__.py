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
    QuantizedStateCheckpoint,
    QuantizedStateMismatchError,
    export_fp32_momentum,
    load_quantized_state,
)
from .fidelity import QuantFidelityError, QuantFidelityMonitor, UpdateFidelityTracker
from .profiler import OptimizerStepProfiler
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
    "export_fp32_momentum",
    "load_quantized_state",
    "EpochBoundaryResume",
    "ContinueCheckpointNames",
    "resolve_ckpt_path",
    "RichEpochProgressBar",
    "TQDMEpochProgressBar",
    "default_progress_bar",
]
