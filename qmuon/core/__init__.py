"""The Muon step, written once, for every driver (docs/core.md).

* :mod:`.config`: :class:`QMuonConfig` (every QMuon argument, one set of defaults, validation) and
  :func:`check_resume` (the one compatibility check of saved Muon state);
* :mod:`.plan`: the matrices and fused parts of a parameter and their learning-rate factors;
* :mod:`.pipeline`: momentum through the state format, same-shape Newton-Schulz batching within a
  memory budget, apply;
* :mod:`.variants`: NorMuon's per-row second moment and cautious weight decay (pure functions the
  pipeline calls);
* :mod:`.gram_newton_schulz`: Newton-Schulz iterated on the Gram matrix (``ns_method``);
* :mod:`.newton_schulz`: the Newton-Schulz engine (coefficient schedules incl. Polar Express, the NS
  compute dtype with ``ns_dtype="auto"``, the folded batched iteration and its textbook reference).

``QMuon`` (``optim``), the sharded step (``distributed``), the DeepSpeed optimizer
(``integrations``) and the fidelity monitor (``callbacks``) call these functions.
"""

from .config import QMuonConfig, ResumeMismatch, check_resume

from .newton_schulz import newton_schulz_folded, resolve_ns_dtype, resolve_schedule

from .pipeline import NSItem, NSSettings, orthogonalize
from .plan import FusedParts, MatrixPart, ParamPlan, adjusted_lr, plan_param

__all__ = [
    "QMuonConfig",
    "ResumeMismatch",
    "check_resume",
    "NSItem",
    "NSSettings",
    "orthogonalize",
    "FusedParts",
    "MatrixPart",
    "ParamPlan",
    "adjusted_lr",
    "plan_param",
    "newton_schulz_folded",
    "resolve_ns_dtype",
    "resolve_schedule",
]
