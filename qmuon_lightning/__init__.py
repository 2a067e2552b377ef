"""qmuon_lightning: the Lightning kit around the :mod:`qmuon` optimizer library.

``Trainer(strategy="qmuon_fsdp")`` and ``L.Fabric(strategy="qmuon_fsdp")`` (registered on import), callbacks,
the ``qmuon-train`` CLI and its recipes, models, data, memory estimates and ``qmuon-doctor``. The optimizer
itself lives in :mod:`qmuon` (torch only); its three entry points are re-exported here for kit users.

Layers (imports flow one way): :mod:`qmuon` -> ``strategies`` / ``callbacks`` / ``models`` / ``data`` /
``memory`` -> ``cli``, ``cli_litgpt``, ``doctor``, ``estimate``. :mod:`qmuon` never imports this package.
"""

from qmuon import QMuon, QMuonConfig, __version__, build_optimizer

# Registers Trainer(strategy="qmuon_fsdp"), L.Fabric(strategy="qmuon_fsdp") and their presets in Lightning's
# strategy registries (Lightning has no entry points for strategies).
from .strategies import QMuonFabricStrategy, QMuonFSDPStrategy

__all__ = ["QMuon", "QMuonConfig", "build_optimizer", "QMuonFSDPStrategy", "QMuonFabricStrategy", "__version__"]
