"""qmuon_lightning: the Lightning kit around the :mod:`qmuon` optimizer library.

``Trainer(strategy="qmuon_fsdp")`` and ``L.Fabric(strategy="qmuon_fsdp")`` (registered on import), callbacks,
the ``qmuon-train`` CLI and its recipes, models, data, memory estimates and ``qmuon-doctor``. The optimizer
itself lives in :mod:`qmuon` (torch only); its three entry points are re-exported here for kit users.

Layers (imports flow one way): :mod:`qmuon` -> ``strategies`` / ``callbacks`` / ``models`` / ``data`` /
``memory`` -> ``cli``, ``doctor``, ``estimate``. :mod:`qmuon` never imports this package; the Fabric strategy
and ``qmuon-litgpt`` live in the library: :mod:`qmuon.integrations.fabric`, :mod:`qmuon.integrations.litgpt`).
"""

from importlib.metadata import PackageNotFoundError, version

import qmuon
from qmuon import QMuon, QMuonConfig, build_optimizer

try:
    __version__ = version("qmuon-lightning")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+source"


def check_library_version(kit: str, library: str) -> None:
    """Raise ``ImportError`` unless the kit (``qmuon-lightning``) and the library (``qmuon``) are one
    release: the kit reaches into the library's internals (the sharded step, checkpoint layouts), which
    change between versions without notice. A source tree without install has no versions to compare."""
    if kit != library and "0.0.0+source" not in (kit, library):
        raise ImportError(
            f"qmuon-lightning {kit} needs qmuon {kit}, but qmuon {library} is installed "
            f"({qmuon.__file__}). Install the matching pair: pip install 'qmuon=={kit}' "
            f"(or, from a checkout, pip install -e . -e ./kit)")


check_library_version(__version__, qmuon.__version__)

# Registers Trainer(strategy="qmuon_fsdp"), L.Fabric(strategy="qmuon_fsdp") and their presets in Lightning's
# strategy registries (Lightning has no entry points for strategies).
from .strategies import QMuonFabricStrategy, QMuonFSDPStrategy

__all__ = ["QMuon", "QMuonConfig", "build_optimizer", "QMuonFSDPStrategy", "QMuonFabricStrategy", "__version__",
           "check_library_version"]
