"""QMuon's quantized AdamW state against torchao's, the library users would otherwise pick.

The same embedding + head model trains for 60 steps from the same initialization on the same
batches under ``torch.optim.AdamW`` (fp32 moments, the reference), ``torchao.optim.AdamW8bit`` /
``AdamW4bit`` and QMuon's AdamW group with ``adamw_state_format="int8"`` / ``"int4"``. Each
quantized run's drift from the reference weights, relative to how far the reference moved,
``||W - W_ref|| / ||W_ref - W_0||`` per tensor, must be no larger than torchao's at the same width:
our state may not be a worse copy of AdamW's than the peer's. (The batches' targets are random, so
the final losses, printed, differ by noise: 7.1006 / 7.1008 at 8 bits, 7.1244 / 7.1195 at 4 bits,
7.1007 for fp32 AdamW.) Measured on an Intel Xeon (torch
2.13, torchao 0.18): int8 0.009 / 0.012 (embedding / head) vs torchao 0.037 / 0.026; int4 0.106 /
0.236 vs 0.190 / 0.395; fp32 state 0 (bit-identical to torch.optim.AdamW).

torchao compiles its per-parameter step with ``torch.compile(fullgraph=True)``; the tests run that
function eagerly (the same arithmetic, no inductor build in CI) by making ``torch.compile`` return
its argument for the duration of the test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qmuon

tao = pytest.importorskip("torchao.optim", reason="torchao is in the [test] extra: pip install -e '.[test]'")

VOCAB, DIM, STEPS = 1024, 64, 60
HP = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB, bias=False))


def _train(make_optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = make_optimizer(model)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, VOCAB, (8, 32), generator=g)
        y = torch.randint(0, VOCAB, (8, 32), generator=g)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], start, loss.item()


def _qmuon_adamw(state_format: str):
    def make(model: nn.Module) -> qmuon.QMuon:
        return qmuon.QMuon([{"params": list(model.parameters()), "use_muon": False}], adamw_lr=HP["lr"], update={"adamw_betas": HP["betas"]}, adamw_weight_decay=HP["weight_decay"], adamw_state_format=state_format)
    return make


@pytest.fixture(scope="module")
def reference():
    return _train(lambda m: torch.optim.AdamW(m.parameters(), **HP))


def _drift(weights, reference) -> list[float]:
    ref, start, _ = reference
    return [float((w - r).norm() / (r - s).norm()) for w, r, s in zip(weights, ref, start)]


def test_fp32_state_is_torch_adamw_bit_for_bit(reference):
    weights, _, _ = _train(_qmuon_adamw("fp32"))
    assert all(torch.equal(w, r) for w, r in zip(weights, reference[0]))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_state_tracks_adamw_at_least_as_closely_as_torchao(bits, reference, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    peer_cls = tao.AdamW8bit if bits == 8 else tao.AdamW4bit
    peer, _, peer_loss = _train(lambda m: peer_cls(m.parameters(), **HP))
    ours, _, our_loss = _train(_qmuon_adamw(f"int{bits}"))
    peer_drift, our_drift = _drift(peer, reference), _drift(ours, reference)
    print(f"int{bits}: drift from fp32 AdamW (embedding, head): QMuon {our_drift}, torchao {peer_drift}; "
          f"final loss QMuon {our_loss:.4f}, torchao {peer_loss:.4f}, AdamW {reference[2]:.4f}")
    assert all(0.0 < o <= p for o, p in zip(our_drift, peer_drift)), (our_drift, peer_drift)
