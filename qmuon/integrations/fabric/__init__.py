"""QMuon under Lightning Fabric: :class:`QMuonFabricStrategy` (FSDP2 / HSDP / TP with whole-matrix
Newton-Schulz, quantized-state checkpoints that reshard), the strategy ``qmuon-litgpt`` builds LitGPT's
Fabric with. It needs ``lightning`` (``qmuon[fabric]``; LitGPT and the kit install it too, and the kit
registers it as ``L.Fabric(strategy="qmuon_fsdp")``). ``import qmuon`` does not import this package.

The pieces it shares with the kit's Trainer strategy live beside it: :mod:`.mixin` (names, presets,
constructor checks), :mod:`.options`, :mod:`.sharding`, :mod:`.optimizer_swap`, :mod:`.checkpoint_state`.
"""

from __future__ import annotations

from .. import require_extra

require_extra("lightning", "fabric", "qmuon.integrations.fabric (the Fabric strategy)")

from .sharding import ShardPolicy  # noqa: E402
from .strategy import QMuonFabricStrategy  # noqa: E402

__all__ = ["QMuonFabricStrategy", "ShardPolicy"]
