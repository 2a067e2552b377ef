"""Activation checkpointing: ``DecoderLM(activation_checkpointing=True)``, the ``qmuon_fsdp``
strategy's ``activation_checkpointing_policy``, and the memory estimate of activations with and
without it.

Equality is bit for bit (``torch.equal``): the recomputation in backward replays the same CPU
kernels on the same inputs, so nothing is reordered. With gradient release the optimizer steps
each parameter inside backward; the tests count the steps (each parameter once per step) and check
that the trained weights equal those of the run without checkpointing.
"""

from __future__ import annotations

import pytest
import torch

import qmuon
from qmuon.optim.release import release_of
from qmuon_lightning.models.decoder_lm import DecoderLM, DecoderLMConfig

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec", "ignore:.*GPU available but not used")

VOCAB, SEQ, BATCH = 64, 16, 3
SHAPES = {"mha": {"d_model": 32, "n_heads": 4}, "gqa": {"d_model": 32, "n_heads": 4, "n_kv_heads": 2}}


def model(ckpt: bool, seed: int = 0, dtype: torch.dtype = torch.float32, **shape) -> DecoderLM:
    torch.manual_seed(seed)
    m = DecoderLM(vocab_size=VOCAB, n_layers=3, max_seq_len=SEQ, activation_checkpointing=ckpt,
                  **(shape or SHAPES["mha"]))
    return m.to(dtype)


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))


def loss_of(m: DecoderLM, step: int) -> torch.Tensor:
    t = tokens(step)
    return m.loss(t[:, :-1], t[:, 1:])


def grads(m: DecoderLM, step: int = 0) -> tuple[float, dict[str, torch.Tensor]]:
    m.zero_grad(set_to_none=True)
    loss = loss_of(m, step)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()}


def saved_bytes(m: DecoderLM) -> int:
    """Bytes of the distinct storages autograd saves for backward in one training forward
    (what checkpointing removes; parameters and buffers aside)."""
    own = {t.untyped_storage().data_ptr() for t in [*m.parameters(), *m.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in own:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(m, 0)
    return sum(seen.values())


# ----------------------------------------------------------------------------------- the model
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_losses_and_gradients_are_bit_identical(shape: str, dtype: torch.dtype) -> None:
    plain, ckpt = model(False, dtype=dtype, **SHAPES[shape]), model(True, dtype=dtype, **SHAPES[shape])
    assert ckpt.activation_checkpointing and not plain.activation_checkpointing
    for step in range(2):
        la, ga = grads(plain, step)
        lb, gb = grads(ckpt, step)
        assert la == lb
        for n in ga:
            assert torch.equal(ga[n], gb[n]), n


def test_checkpointing_keeps_only_the_block_inputs() -> None:
    """The saved activations shrink to the blocks' inputs plus the head's (what the estimate counts);
    in eval or under no_grad the option changes nothing (no recomputation is set up)."""
    plain, ckpt = model(False), model(True)
    a, b = saved_bytes(plain), saved_bytes(ckpt)
    n_tokens, d = BATCH * SEQ, plain.cfg.d_model
    blocks_inputs = plain.cfg.n_layers * n_tokens * d * 4
    assert b < a / 2, (a, b)
    assert b >= blocks_inputs
    ckpt.eval()
    plain.eval()
    assert torch.equal(ckpt(tokens(0)[:, :-1]), plain(tokens(0)[:, :-1]))
    with torch.no_grad():
        ckpt.train()
        assert torch.equal(ckpt(tokens(0)[:, :-1]), plain(tokens(0)[:, :-1]))


def test_bad_option_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="activation_checkpointing must be True or False"):
        DecoderLMConfig(activation_checkpointing="blocks")
    # the override reaches a given config too
    assert DecoderLM(DecoderLMConfig(d_model=32, n_heads=4, n_layers=1), activation_checkpointing=True).activation_checkpointing


# ----------------------------------------------------------------------------------- gradient release
def _count_params_stepped(opt: qmuon.QMuon) -> dict[int, int]:
    """id(parameter) -> how many times ``step_params`` stepped it (release's hooks call it)."""
    counts: dict[int, int] = {}
    inner = opt.step_params

    def step_params(params, *args, **kwargs):
        for p in params:
            counts[id(p)] = counts.get(id(p), 0) + 1
        return inner(params, *args, **kwargs)

    opt.step_params = step_params
    return counts


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "int8"), (torch.bfloat16, "int8")], ids=["fp32", "bf16"])
def test_gradient_release_steps_each_parameter_once_and_matches(dtype: torch.dtype, fmt: str) -> None:
    """The recomputation runs each block's forward a second time inside backward; it must not fire
    the post-accumulate-grad hooks again nor step a parameter twice. Three steps with release and
    checkpointing == three steps with release alone == three steps of plain ``step()``, bit for bit."""
    extra = {"bf16_update": "stochastic"} if dtype == torch.bfloat16 else {}
    runs = {}
    for name, ckpt, release in (("plain", False, False), ("release", False, True), ("release+ckpt", True, True)):
        m = model(ckpt, dtype=dtype)
        opt = qmuon.build_optimizer(m, lr=0.02, adamw_lr=3e-3, verbose=False, state_format=fmt,
                                    gradient_release=release, **extra)
        counts = _count_params_stepped(opt) if release else {}
        losses = []
        for step in range(3):
            torch.manual_seed(1000 + step)  # bf16 stochastic rounding draws from the global generator
            opt.zero_grad(set_to_none=True)
            loss = loss_of(m, step)
            loss.backward()
            if release:
                assert all(p.grad is None for p in m.parameters())  # stepped and freed inside backward
                assert release_of(opt).released_in_step == len(list(m.parameters()))
                assert sorted(counts.values()) == [step + 1] * len(list(m.parameters())), "a parameter stepped twice"
            opt.step()
            losses.append(loss.item())
        runs[name] = (losses, {n: p.detach().clone() for n, p in m.named_parameters()})
    for name in ("release", "release+ckpt"):
        assert runs[name][0] == runs["plain"][0], name
        for n, p in runs["plain"][1].items():
            assert torch.equal(runs[name][1][n], p), (name, n)
