"""QK-clip (MuonClip): the measured per-head maximum logit, the per-head rescale, and where they
plug in (``DecoderLM``, Hugging Face Llama / Qwen3 through the attention interface, release, bf16
weights, int8 state, FSDP2).

What the tests hold, and why each tolerance:

- the measure equals the exact maximum: a float64 recomputation of the masked scores from the
  queries and keys the model makes; ``rtol=2e-6`` is fp32 rounding of a 16-term dot product
  (about 16 x 2^-24 relative) with margin;
- the clip maths: with the update switched off (lr 0) one step brings each head's logit on the
  same batch to exactly ``min(max, tau)`` (GQA: every q head by its own factor; Qwen3's shared
  QK-norm gains: the whole layer by its largest head's factor), ``rtol=1e-5``: the rescaled fp32
  weights (two roundings per element) feed a fresh fp32 forward;
- a head at or under ``tau`` is multiplied by exactly 1.0: whole runs are bit-identical
  (``torch.equal``) to runs without QK-clip, fp32 and bf16 weights;
- a run whose learning rate makes logits grow past 20 x tau without the clip (measured: 40x-46x)
  stays within 2 x tau with it. MuonClip clips with the logits of the forward before the update,
  so the next forward sees one update's growth on top of tau (measured here at lr 0.3: up to 1.81x
  tau on the kit's LM, 1.49x on Llama; docs/qk_clip.md);
- with the forward cap (the default) the attention kernel itself never receives a logit over tau in
  that run (a spy on SDPA recomputes them in float64; ``tau * (1 + 1e-5)``: fp32 rounding of the
  capped queries and of the measure that gave the factor).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
from torch import nn

import qmuon
from qmuon.core.config import ConfigError
from qmuon.core.qk_clip import max_logits, qk_clip_factors
from qmuon.optim.qk_clip import find_attention
from qmuon_lightning.models.decoder_lm import DecoderLM, _apply_rope

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec", "ignore:.*GPU available but not used")

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 64, 16, 4


def lm(seed: int = 0, dtype: torch.dtype = torch.float32) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ).to(dtype)


def llama(seed: int = 0, impl: str = "sdpa", dtype: torch.dtype = torch.float32, bias: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=bias,
                                   max_position_embeddings=64, attn_implementation=impl)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def qwen3(seed: int = 0, impl: str = "sdpa", dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64, attn_implementation=impl)
    return transformers.Qwen3ForCausalLM(cfg).to(dtype)


MODELS = {"lm": lm, "llama_sdpa": llama, "llama_eager": lambda seed=0, dtype=torch.float32: llama(seed, "eager", dtype),
          "qwen3_sdpa": qwen3}


def batch(step: int = 0, n: int = BATCH) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))


def loss_of(m: nn.Module, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(m, DecoderLM):
        return m.loss(x[:, :-1], x[:, 1:])
    return m(input_ids=x[:, :-1], attention_mask=mask, labels=x[:, :-1]).loss


def amplify(m: nn.Module, factor: float) -> None:
    """Scale every W_q / W_k (or QK-norm gain) by ``factor`` per head, with a different factor per
    head so that some heads are over tau and some are not."""
    with torch.no_grad():
        for spec in find_attention(m):
            per_head = factor * torch.linspace(0.5, 1.5, spec.n_heads)
            if spec.qk_norm is not None:
                for owner, pname in spec.qk_norm:
                    getattr(owner, pname).mul_(factor)
                continue
            for owner, pname, row0 in spec.q:
                w = getattr(owner, pname)
                w[row0: row0 + spec.n_heads * spec.head_dim] *= per_head.repeat_interleave(spec.head_dim).view(
                    -1, *([1] * (w.ndim - 1))).to(w.dtype)
            for owner, pname, row0 in spec.k:
                w = getattr(owner, pname)
                w[row0: row0 + spec.n_kv_heads * spec.head_dim] *= factor


def measured(m: nn.Module, x: torch.Tensor, opt) -> torch.Tensor:
    """The per-head maxima of one training forward on ``x`` (taken from the running buffer)."""
    if opt.qk_clip.running is not None:
        opt.qk_clip.running.fill_(float("-inf"))
    loss_of(m, x)
    return opt.qk_clip.running.clone()


# ------------------------------------------------------------------------- the exact reference
def reference_maxima(m: nn.Module, x: torch.Tensor, mask2d: torch.Tensor | None = None) -> torch.Tensor:
    """Each head's max logit, float64, from the queries and keys the model makes (a pre-hook
    recomputes them with the model's own modules) and a causal (and padding) mask built here."""
    out: list[torch.Tensor] = []

    def ref(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
        q, k = q.double(), k.double()
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = q @ k.transpose(-1, -2) * scale
        t = s.shape[-1]
        allowed = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        if mask2d is not None:
            allowed = allowed & mask2d.bool()[:, None, None, :]
        return s.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))

    def lm_hook(mod, args):
        xin, cos, sin = args
        cfg = mod.cfg
        b, t, _ = xin.shape
        q, k, _ = mod.qkv(xin).split([cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim,
                                      cfg.kv_heads * cfg.head_dim], dim=-1)
        q = _apply_rope(q.view(b, t, cfg.n_heads, -1).transpose(1, 2), cos[:t], sin[:t])
        k = _apply_rope(k.view(b, t, cfg.kv_heads, -1).transpose(1, 2), cos[:t], sin[:t])
        out.append(ref(q, k, cfg.head_dim ** -0.5))

    def hf_hook(mod, args, kwargs):
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        shape = (*h.shape[:-1], -1, mod.head_dim)
        q, k = mod.q_proj(h).view(shape), mod.k_proj(h).view(shape)
        if getattr(mod, "q_norm", None) is not None:
            q, k = mod.q_norm(q), mod.k_norm(k)
        rope = __import__(type(mod).__module__, fromlist=["apply_rotary_pos_emb"]).apply_rotary_pos_emb
        q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        out.append(ref(q, k, mod.scaling))

    handles = []
    for spec in find_attention(m):
        if isinstance(m, DecoderLM):
            handles.append(spec.module.register_forward_pre_hook(lm_hook))
        else:
            handles.append(spec.module.register_forward_pre_hook(hf_hook, with_kwargs=True))
    try:
        with torch.no_grad():
            loss_of(m, x, mask2d)
    finally:
        for h in handles:
            h.remove()
    return torch.cat(out)


@pytest.mark.parametrize("kind", list(MODELS))
def test_measured_max_equals_exact_max(kind: str) -> None:
    m = MODELS[kind]()
    amplify(m, 6.0)
    x = batch()
    want = reference_maxima(m, x)
    opt = qmuon.build_optimizer(m, qk_clip={"tau": 1e6})
    got = measured(m, x, opt)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=0)
    assert want.max() > 5.0  # amplified: the maxima are not all near 0


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_padding_mask_is_respected(impl: str) -> None:
    """Keys a padding mask hides do not count (HF builds a 4-D mask then: boolean for SDPA,
    additive for eager; the measure reads it as the kernel does)."""
    m = llama(impl=impl)
    amplify(m, 6.0)
    x = batch()
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, SEQ // 2:] = 0
    mask[2, SEQ - 3:] = 0
    want = reference_maxima(m, x, mask)
    opt = qmuon.build_optimizer(m, qk_clip={"tau": 1e6})
    loss_of(m, x, mask)
    torch.testing.assert_close(opt.qk_clip.running.double(), want, rtol=2e-6, atol=0)


@pytest.mark.parametrize("shape", [(2, 6, 3, 40, 40), (2, 4, 2, 10, 25), (1, 4, 4, 25, 10), (3, 2, 1, 7, 7)],
                         ids=["gqa", "cache", "fewer_keys", "mqa"])
@pytest.mark.parametrize("causal", [True, False])
def test_chunked_measure_equals_the_full_score_matrix(shape: tuple, causal: bool) -> None:
    """Any chunking (one query row at a time up to one piece), GQA / MQA, more keys than queries
    (a KV cache: bottom-right causal alignment) and fewer: the float64 maximum of the full masked
    score matrix (rtol 2e-6: fp32 rounding of 8-term dot products)."""
    b, h, kv, t, s = shape
    d = 8
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(b, h, t, d, generator=g), torch.randn(b, kv, s, d, generator=g)
    scores = q.double() @ k.double().repeat_interleave(h // kv, 1).transpose(-1, -2) * 0.3
    if causal:
        scores = scores.masked_fill(torch.arange(s)[None, :] > torch.arange(t)[:, None] + (s - t), float("-inf"))
    want = scores.amax(dim=(0, 2, 3))
    for chunk in (1, 50, 300, 1 << 18):
        got = max_logits(q, k, 0.3, causal=causal, chunk_elements=chunk)
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=0)
        per_seq = max_logits(q, k, 0.3, causal=causal, chunk_elements=chunk, per_sample=True)
        torch.testing.assert_close(per_seq.double(), scores.amax(dim=(2, 3)), rtol=2e-6, atol=0)


# ------------------------------------------------------------------------- the clip maths
def test_factors_split_as_muonclip_and_gqa() -> None:
    m = torch.tensor([50.0, 10.0, 200.0, 100.0])  # two kv heads, groups (50, 10) and (200, 100)
    q, k = qk_clip_factors(m, 100.0, 2)
    eta = torch.tensor([1.0, 1.0, 0.5, 1.0])
    torch.testing.assert_close(q * k.repeat_interleave(2), eta)  # each head's logit scales by its own eta
    assert torch.equal(k[0], torch.tensor(1.0)) and torch.equal(q[:2], torch.ones(2))  # untouched group: exactly 1
    torch.testing.assert_close(k[1], torch.tensor(0.5).sqrt())
    q1, k1 = qk_clip_factors(torch.tensor([400.0, 1.0]), 100.0, 2)  # no GQA: sqrt(eta) on each side
    torch.testing.assert_close(q1, torch.tensor([0.5, 1.0]))
    torch.testing.assert_close(k1, torch.tensor([0.5, 1.0]))
    qn, kn = qk_clip_factors(torch.tensor([float("nan"), float("inf")]), 1.0, 2)  # non-finite: no clip
    assert torch.equal(qn, torch.ones(2)) and torch.equal(kn, torch.ones(2))


@pytest.mark.parametrize("kind", list(MODELS))
def test_one_clip_brings_each_head_to_tau(kind: str) -> None:
    m = MODELS[kind]()
    amplify(m, 8.0)
    x = batch()
    opt = qmuon.build_optimizer(m, lr=0.0, adamw_lr=0.0, weight_decay=0.0, qk_clip={"tau": 1.0})
    before = measured(m, x, opt)  # the clip's input (running is not reset by measured())
    tau = float(before.median())  # half the heads over tau, half under
    opt.qk_clip.tau = tau
    opt.step()  # lr 0: the weights change by the clip only
    opt.zero_grad()
    after = measured(m, x, opt)
    # The first layer only: its input (the embeddings) is unchanged; a later layer's input changes
    # with the clipped layers before it.
    before, after = before[:4], after[:4]
    if kind.startswith("qwen3"):  # shared QK-norm gains: the layer by its largest head's factor
        want = before * min(1.0, tau / float(before.max()))
    else:
        want = torch.clamp(before, max=tau)
    torch.testing.assert_close(after, want, rtol=1e-5, atol=0)
    assert opt.qk_clip.metrics()["qk_clip/heads_clipped"] >= float((before > tau).sum()) > 0


def test_biases_are_rescaled_with_their_rows() -> None:
    m = llama(bias=True)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.normal_(0, 0.5)
    amplify(m, 8.0)
    x = batch()
    opt = qmuon.build_optimizer(m, lr=0.0, adamw_lr=0.0, weight_decay=0.0, qk_clip={"tau": 1.0})
    before = measured(m, x, opt)
    tau = float(before.median())
    opt.qk_clip.tau = tau
    opt.step()
    after = measured(m, x, opt)[:4]  # the first layer (its input is unchanged)
    torch.testing.assert_close(after, torch.clamp(before[:4], max=tau), rtol=1e-5, atol=0)


# ------------------------------------------------------------------------- whole runs
def train(m: nn.Module, steps: int, **kw) -> tuple[list[float], list[float], object]:
    opt = qmuon.build_optimizer(m, **kw)
    losses, maxima = [], []
    for s in range(steps):
        loss = loss_of(m, batch(s))
        loss.backward()
        losses.append(loss.item())
        if opt.qk_clip is not None:
            maxima.append(float(opt.qk_clip.running.max()))
        opt.step()
        opt.zero_grad()
    return losses, maxima, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["lm", "llama_sdpa", "qwen3_sdpa"])
def test_no_head_over_tau_is_bit_identical(kind: str, dtype: torch.dtype) -> None:
    kw = dict(lr=0.02, state_format="int8", bf16_update="stochastic", state={"rounding": "stochastic"})
    a, b = MODELS[kind](dtype=dtype), MODELS[kind](dtype=dtype)
    la, maxima, opt = train(a, 4, qk_clip={"tau": 1e4}, **kw)
    lb, _, _ = train(b, 4, **kw)
    assert la == lb
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n
    assert all(0.0 < v < 1e4 for v in maxima)  # it measured, and nothing was over
    assert opt.qk_clip.metrics()["qk_clip/heads_clipped_total"] == 0.0


@pytest.mark.parametrize("kind,lr", [("lm", 0.3), ("llama_sdpa", 0.3)])
def test_clip_holds_logits_that_blow_up_without_it(kind: str, lr: float) -> None:
    tau, steps = 10.0, 40
    x = batch(0, 8)

    def run(clip_at: float) -> list[float]:
        m = MODELS[kind]()
        opt = qmuon.build_optimizer(m, lr=lr, weight_decay=0.0, qk_clip={"tau": clip_at})
        out = []
        for _ in range(steps):  # one batch again and again: the logits grow fastest
            loss_of(m, x).backward()
            out.append(float(opt.qk_clip.running.max()))
            opt.step()
            opt.zero_grad()
        return out

    free, clipped = run(1e9), run(tau)
    assert max(free) > 20 * tau  # measured: 455 (lm), 397 (llama)
    assert max(clipped) <= 2.0 * tau  # measured: 18.1 (lm), 14.9 (llama): one update's growth over tau
    assert max(clipped[-10:]) < max(free[-10:]) / 10


@contextlib.contextmanager
def kernel_logits():
    """Record, for every call of ``torch.nn.functional.scaled_dot_product_attention`` (the kernel both
    the kit's LM and transformers' SDPA attention call), the float64 maximum logit of the queries and
    keys it receives, over the pairs its mask allows: what the softmax sees, recomputed without any of
    QK-clip's code."""
    import torch.nn.functional as F

    seen: list[float] = []
    sdpa = F.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        q, k = query.detach().double(), key.detach().double()
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        sc = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
        if is_causal:
            t, s = sc.shape[-2:]
            sc = sc.masked_fill(torch.ones(t, s, dtype=torch.bool).tril(s - t).logical_not(), float("-inf"))
        if attn_mask is not None:
            sc = sc.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else sc + attn_mask.double()
        seen.append(float(sc.max()))
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)

    F.scaled_dot_product_attention = spy
    try:
        yield seen
    finally:
        F.scaled_dot_product_attention = sdpa


@pytest.mark.parametrize("kind", ["lm", "llama_sdpa"])  # Qwen3's QK-norm keeps its logits small: no blow-up
def test_forward_cap_holds_the_softmax_at_tau_every_step(kind: str) -> None:
    """The blow-up run of the test above (lr 0.3, one batch 40 times, tau 10), with the forward cap
    (the default): in every training forward, and in an evaluation forward after the run, the
    largest logit the attention kernel receives is at most tau. The bound ``tau * (1 + 1e-5)`` is
    fp32 rounding: the capped queries are rounded once (2^-24 relative per element) and the cap's
    factor comes from the fp32 measure of a 16-term dot product (about 16 x 2^-24 of
    ``sum |q_i k_i|``), both small against 1e-5 for the top logit. Without the cap (MuonClip alone)
    the same kernel sees more than tau: the check can fail."""
    tau, steps = 10.0, 40
    x = batch(0, 8)

    def run(forward_cap: bool) -> tuple[list[float], list[float], float]:
        m = MODELS[kind]()
        opt = qmuon.build_optimizer(m, lr=0.3, weight_decay=0.0, qk_clip={"tau": tau, "forward_cap": forward_cap})
        raw = []
        with kernel_logits() as seen:
            for _ in range(steps):
                loss_of(m, x).backward()
                raw.append(float(opt.qk_clip.running.max()))
                opt.step()
                opt.zero_grad()
            m.eval()
            with torch.no_grad():
                loss_of(m, x)
        return seen, raw, seen[-1]

    capped, raw, evaluated = run(True)
    assert len(capped) == (steps + 1) * 2  # every forward of both layers went through the kernel
    assert max(capped) <= tau * (1 + 1e-5)
    assert evaluated <= tau * (1 + 1e-5)
    assert max(raw) > 1.2 * tau  # the weights alone gave more: the cap did work (measured 1.4x-1.8x)
    muonclip, _, _ = run(False)
    assert max(muonclip) > 1.2 * tau  # MuonClip alone: one update's growth over tau reaches the softmax


@pytest.mark.parametrize("kind", ["lm", "llama_sdpa"])
def test_gradient_release_bf16_int8_clip_as_without_release(kind: str) -> None:
    kw = dict(lr=0.3, weight_decay=0.0, state_format="int8", bf16_update="nearest", qk_clip={"tau": 2.0})
    a, b = MODELS[kind](dtype=torch.bfloat16), MODELS[kind](dtype=torch.bfloat16)
    _, ma, oa = train(a, 5, gradient_release=True, **kw)
    _, mb, ob = train(b, 5, **kw)
    assert oa.gradient_release is not None
    assert oa.qk_clip.metrics()["qk_clip/heads_clipped_total"] > 0
    assert ma == mb
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n


def test_heads_split_over_ranks_are_refused_by_name() -> None:
    """Tensor-parallel attention runs a rank's share of the heads; the measure would fold them into
    the wrong heads' maxima, so it raises, naming the layer, before any maximum is kept."""
    m = lm()
    opt = qmuon.build_optimizer(m, qk_clip={"tau": 100.0})
    attn = m.blocks[0].attn
    q, k = torch.randn(2, 2, 8, 16), torch.randn(2, 1, 8, 16)  # 2 of the 4 heads, as on one of 2 tp ranks
    with pytest.raises(RuntimeError, match="blocks.0.attn ran 2 query heads, its spec has 4.*tensor-parallel"):
        qmuon.optim.qk_clip.observe_logits(attn, q, k, scale=0.25)
    assert opt.qk_clip.running is None


def test_compiled_model_measures_and_clips_as_eager() -> None:
    """``torch.compile(model)`` (the measure and the cap run inside the compiled forward): on the
    first forward, the same maxima and the same capped output as the eager model (rtol 1e-5: the
    compiled forward reorders fp32 sums); over 2 steps, the same heads clipped."""
    import torch.nn.functional as F

    x = batch(0, 4)

    def run(compiled: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
        m = lm()
        amplify(m, 6.0)
        opt = qmuon.build_optimizer(m, lr=0.02, weight_decay=0.0, qk_clip={"tau": 3.0})
        fwd = torch.compile(m) if compiled else m
        for step in range(2):
            logits = fwd(x[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
            if step == 0:
                first, maxima = logits.detach(), opt.qk_clip.running.clone()
            opt.step()
            opt.zero_grad()
        return maxima, first, float(opt.qk_clip.clipped_total)

    got, out, clipped = run(True)
    want, out_eager, clipped_eager = run(False)
    assert bool((want > 3.0).any())  # the first forward was capped, so its output checks the cap
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(out, out_eager, rtol=1e-5, atol=1e-5)
    assert clipped == clipped_eager > 0


def test_evaluation_forwards_do_not_measure_and_outputs_are_unchanged() -> None:
    m = llama()
    x = batch()[:, :-1]
    with torch.no_grad():
        before = m(x).logits
    opt = qmuon.build_optimizer(m, qk_clip={"tau": 100.0})
    assert m.config._attn_implementation == "qmuon_qk_sdpa"
    m.eval()
    with torch.no_grad():
        assert torch.equal(m(x).logits, before)  # the same kernel runs
    assert opt.qk_clip.running is None  # nothing measured in eval mode


# ------------------------------------------------------------------------- entry points
def test_options_reach_the_factory_and_the_cli_spec() -> None:
    from qmuon.integrations.transformers import QMuonFactory
    from qmuon_lightning.models.lm_module import OptimizerSpec, build_lm_optimizer

    opt = QMuonFactory()(llama(), lr=1e-3, qk_clip={"tau": 50.0})
    assert opt.qk_clip is not None and opt.qk_clip.tau == 50.0
    spec = OptimizerSpec(qk_clip={"tau": 30.0})
    assert build_lm_optimizer(lm(), spec).qk_clip.tau == 30.0
    with pytest.raises(ValueError, match="qk_clip"):
        OptimizerSpec(name="adamw", qk_clip={"tau": 30.0})


def test_strategy_runs_and_logs_telemetry(tmp_path) -> None:
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    import qmuon_lightning  # noqa: F401  registers the strategy
    from qmuon_lightning.callbacks.summary import TrainSummary

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = lm()

        def training_step(self, b, i):
            return self.model.loss(b[0], b[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    t = batch(0, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(t[:, :-1], t[:, 1:]), batch_size=4)
    from qmuon_lightning.strategies.fsdp import QMuonFSDPStrategy

    strategy = QMuonFSDPStrategy(optimizer_kwargs={"lr": 0.3, "qk_clip": {"tau": 0.5}})
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=4, log_every_n_steps=2,
                        logger=CSVLogger(tmp_path), callbacks=[TrainSummary(filename=None)],
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    # The strategy starts a one-process gloo group and sets MASTER_ADDR / MASTER_PORT; the later tests of
    # the session (forked workers, Accelerate) must not inherit either.
    saved_env = dict(os.environ)
    started = not torch.distributed.is_initialized()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = Module()
            trainer.fit(module, data)
    finally:
        if started and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_env)
    qk = trainer.optimizers[0].qk_clip
    assert qk is not None and float(qk.clipped_total) > 0
    text = (next(tmp_path.rglob("metrics.csv"))).read_text()
    assert "qk_clip/max_logit/model.blocks.0.attn" in text and "qk_clip/heads_clipped" in text


# ------------------------------------------------------------------------- bad input
class CustomAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        return self.inner(x, x, x)[0]


def test_unmeasurable_attention_is_refused_before_anything_changes() -> None:
    with pytest.raises(ValueError, match="cannot measure.*Supported: .*DecoderLM.*eager.*sdpa"):
        qmuon.build_optimizer(nn.Sequential(nn.Linear(32, 32), CustomAttention()), qk_clip={"tau": 100})
    with pytest.raises(ValueError, match="found no attention layer"):
        qmuon.build_optimizer(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), qk_clip={"tau": 100})
    m = llama()
    m.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"attn_implementation='flex_attention'.*\('eager', 'sdpa'\)"):
        qmuon.build_optimizer(m, qk_clip={"tau": 100})
    assert m.config._attn_implementation == "flex_attention"  # unchanged
    assert all("_qmuon_qk_probe" not in mod.__dict__ for mod in m.modules())
    mixed = lm()
    mixed.extra = CustomAttention()  # one measurable attention does not excuse another
    with pytest.raises(ValueError, match="CustomAttention"):
        qmuon.build_optimizer(mixed, qk_clip={"tau": 100})


def test_bad_options_are_refused() -> None:
    with pytest.raises(ConfigError, match="qk_clip.tau must be"):
        qmuon.build_optimizer(lm(), qk_clip={"tau": -1.0})
    with pytest.raises(ConfigError, match="qk_clip.tau"):
        qmuon.build_optimizer(lm(), qk_clip={"tua": 100})
    with pytest.raises(ConfigError, match="build_optimizer"):
        qmuon.QMuon(lm().parameters(), qk_clip={"tau": 100})
    m = lm()
    with pytest.raises(ConfigError, match="qk_clip.forward_cap must be True or False"):
        qmuon.build_optimizer(m, qk_clip={"tau": 100, "forward_cap": "yes"})
    assert not hasattr(m.blocks[0].attn, "_qmuon_qk_probe")  # refused before anything was attached


# ------------------------------------------------------------------------- FSDP2
TAU_FSDP, LR_FSDP = 4.0, 0.2


def _fsdp_model(release: bool) -> DecoderLM:
    m = lm()
    amplify(m, 8.0)  # maxima of about 2-10 at the start: some heads over TAU_FSDP, some not
    return m


def _fsdp_worker(rank: int, world: int, release: bool, lr: float = LR_FSDP) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from _dist import local_copy

    mesh = init_device_mesh("cpu", (world,))
    m = _fsdp_model(release)
    for block in m.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = qmuon.build_optimizer(m, lr=lr, adamw_lr=3e-4 if lr else 0.0, weight_decay=0.0, state_format="int8",
                                gradient_release=release, qk_clip={"tau": TAU_FSDP})
    maxima = []
    for s in range(3):
        x = batch(s, 2 * BATCH)[rank * BATCH:(rank + 1) * BATCH]  # each rank its half of the batch
        loss_of(m, x).backward()
        opt.step()
        opt.zero_grad()
        maxima.append(opt.qk_clip.last_max.clone())  # all-reduced: the max over both halves
    return {"params": {n: local_copy(p) for n, p in m.named_parameters()}, "maxima": maxima,
            "clipped": float(opt.qk_clip.clipped_total)}


@pytest.mark.slow
@pytest.mark.parametrize("release", [False, True], ids=["step", "release"])
def test_fsdp2_clips_sharded_rows_as_one_process(release: bool) -> None:
    """FSDP2 on 2 gloo processes, int8 momentum, with and without gradient release.

    With the update off (lr 0) the weights change by the clip alone: the sharded rows are scaled
    as the one-process run scales the whole matrices (1e-6 of the weight's scale: the maxima
    come from two half-batch matmuls instead of one, fp32 rounding). With an update (lr 0.2) the
    ranks agree on the maxima and clip; the sharded Muon step itself differs from the one-process
    step (int8 carrier of the distributed Newton-Schulz, int8 codes), so weights are not compared."""
    from _dist import run_workers

    exact = run_workers(_fsdp_worker, 2, timeout=300, release=release, lr=0.0)
    ref = _fsdp_model(release)
    opt = qmuon.build_optimizer(ref, lr=0.0, adamw_lr=0.0, weight_decay=0.0, state_format="int8",
                                qk_clip={"tau": TAU_FSDP})
    for s in range(3):
        loss_of(ref, batch(s, 2 * BATCH)).backward()  # the whole batch: both ranks' halves
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(exact[0]["maxima"][s], opt.qk_clip.last_max, rtol=1e-6, atol=0)
    assert exact[0]["clipped"] == exact[1]["clipped"] == float(opt.qk_clip.clipped_total) > 0
    for n, p in ref.named_parameters():
        joined = torch.cat([t["params"][n] for t in exact]) if p.ndim else exact[0]["params"][n]
        torch.testing.assert_close(joined, p.detach(), rtol=0, atol=1e-6 * float(p.detach().abs().max()), msg=n)

    moving = run_workers(_fsdp_worker, 2, timeout=300, release=release, lr=LR_FSDP)
    assert moving[0]["clipped"] == moving[1]["clipped"] > 0
    for a, b in zip(moving[0]["maxima"], moving[1]["maxima"]):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------- no host reads
@pytest.mark.parametrize("release", [False, True], ids=["step", "release"])
@pytest.mark.parametrize("kind", ["lm", "llama_sdpa"])
def test_measure_and_clip_read_nothing_back(kind: str, release: bool) -> None:
    """Forward (the measure), backward and step (the clip) with QK-clip read no device value into
    Python beyond what the same run without it reads (tests/test_host_reads.py's counter; the
    model's own forward may read, e.g. transformers' mask code, and is counted on both sides)."""
    from test_host_reads import HostReads, _exempt

    def reads(clip: dict | None) -> list:
        m = MODELS[kind]()
        amplify(m, 8.0)
        opt = qmuon.build_optimizer(m, lr=0.3, gradient_release=release, qk_clip=clip)
        counter = HostReads()
        out = []
        for s in range(4):
            ctx = counter.counting(_exempt(opt)) if s >= 2 else contextlib.nullcontext()
            with ctx:
                loss_of(m, batch(s)).backward()
                opt.step()
            opt.zero_grad()
            out += counter.seen
            counter.seen.clear()
        if clip is not None:
            assert opt.qk_clip.metrics()["qk_clip/heads_clipped_total"] > 0  # it clipped in the counted steps
        return out

    assert reads({"tau": 1.0}) == reads(None)


def test_deepspeed_wrapper_refuses_qk_clip() -> None:
    """DeepSpeed's engine steps the flat partitions without ``QMuon.step()``: the clip's post-hook would
    never run, so the whole-matrix ZeRO wrapper refuses it instead of ignoring it."""
    pytest.importorskip("deepspeed")
    from qmuon.integrations.deepspeed import WholeMatrixZeroOptimizer

    with pytest.raises(ValueError, match="qk_clip cannot combine with DeepSpeed"):
        WholeMatrixZeroOptimizer(qmuon.build_optimizer(lm(), qk_clip={"tau": 100}))
