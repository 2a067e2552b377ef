"""Gradient release (``build_optimizer(..., gradient_release=True)``, :mod:`qmuon.optim.release`).

Each parameter is stepped inside backward by its post-accumulate-grad hook and its gradient freed.
The arithmetic per parameter is the one ``step()`` runs (``QMuon.step_params``), so a run with
release must equal the same run without it bit for bit: a small model with an embedding, fused
attention (``nn.MultiheadAttention``: q, k, v along dim 0) and an ``(in, out)`` layer; tiny
Hugging Face GPT-2 (``Conv1D``, fused ``c_attn`` along dim 1, tied embedding) and Llama models
built locally from configs; fp32, int8 and GRASP 4-bit momentum; under an LR scheduler; through
checkpoint / resume; with non-finite gradients skipped. Under FSDP2 (2 gloo processes) the sharded
run with release equals the sharded run without it, also across a DCP save / load.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qmuon
from qmuon.optim.release import GradientRelease, check_trainer_compatible, release_of

VOCAB, SEQ, BATCH = 48, 8, 4


class Small(nn.Module):
    """Embedding, fused attention (MHA in_proj: q, k, v along dim 0), an (in, out) layer, an MLP, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.proj = nn.Parameter(torch.randn(32, 24) / 32 ** 0.5)  # stored (in, out): y = x @ W
        self.qmuon_orientation = {"proj": "in_out"}
        self.up = nn.Linear(24, 64)
        self.down = nn.Linear(64, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.mha(h, h, h, need_weights=False)[0]
        h = h + self.down(F.gelu(self.up(h @ self.proj)))
        return self.head(self.norm(h))


def small(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Small()


def hf(family: str, seed: int = 0) -> nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, vocab_size=VOCAB, bos_token_id=0,
                            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
        return tf.GPT2LMHeadModel(cfg).float()
    cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=SEQ, vocab_size=VOCAB, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    return tf.LlamaForCausalLM(cfg).float()


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x) if isinstance(model, Small) else model(input_ids=x).logits
    return F.cross_entropy(out[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def build(model: nn.Module, release: bool, **kw) -> qmuon.QMuon:
    return qmuon.build_optimizer(model, lr=0.02, adamw_lr=3e-3, verbose=False, gradient_release=release, **kw)


def train(model: nn.Module, opt: qmuon.QMuon, steps: range, *, sched=None, closure: bool = False,
          check_released: bool = False) -> list[float]:
    losses = []
    for s in steps:
        x = tokens(s)
        opt.zero_grad(set_to_none=True)
        if closure:
            def fn() -> torch.Tensor:
                loss = loss_of(model, x)
                loss.backward()
                return loss
            losses.append(opt.step(fn).detach().item())
        else:
            loss = loss_of(model, x)
            loss.backward()
            if check_released:
                # every gradient was consumed and freed inside backward
                assert all(p.grad is None for p in model.parameters())
                rel = release_of(opt)
                assert rel is not None and rel.released_in_step == sum(1 for p in model.parameters() if p.requires_grad)
            opt.step()
            losses.append(loss.detach().item())
        if sched is not None:
            sched.step()
    return losses


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{n}: max |diff| {(p - q).abs().max().item():.3g}"


def assert_same_state(oa: qmuon.QMuon, ob: qmuon.QMuon) -> None:
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys(), k
        for kk in sa[k]:
            assert torch.equal(sa[k][kk], sb[k][kk]), (k, kk)


# ----------------------------------------------------------------------------------- equality
@pytest.mark.parametrize("fmt", ["fp32", "int8", "grasp4"])
def test_release_equals_step_bit_for_bit(fmt: str) -> None:
    base = small()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    oa, ob = build(a, False, state_format=fmt), build(b, True, state_format=fmt)
    assert isinstance(release_of(ob), GradientRelease) and release_of(oa) is None
    la = train(a, oa, range(4))
    lb = train(b, ob, range(4), check_released=True)
    assert la == lb
    assert_same(a, b)
    assert_same_state(oa, ob)


@pytest.mark.parametrize("rule", ["nearest", "stochastic", "ecc8"])
@pytest.mark.parametrize("fmt,adamw_fmt", [("int8", "int8"), ("grasp4", "int4")])
def test_release_equals_step_bit_for_bit_on_bf16_weights(fmt: str, adamw_fmt: str, rule: str) -> None:
    """The memory rows that use release store the weights in bf16 (no fp32 master) with quantized
    Muon and AdamW state: each bf16 rounding rule (stochastic's counter, ecc8's correction codes)
    must see the same inputs in the hook as in step(), so weights and every state tensor match."""
    base = small().to(torch.bfloat16)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    kw = dict(state_format=fmt, adamw_state_format=adamw_fmt, bf16_update=rule)
    oa, ob = build(a, False, **kw), build(b, True, **kw)
    la = train(a, oa, range(4))
    lb = train(b, ob, range(4), check_released=True)
    assert la == lb
    assert_same(a, b)
    assert_same_state(oa, ob)
    assert all(p.dtype == torch.bfloat16 for p in b.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(b.parameters(), base.parameters()))  # it trained


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_release_equals_step_on_hf_models(family: str) -> None:
    a, b = hf(family), hf(family)
    oa, ob = build(a, False, state_format="int8"), build(b, True, state_format="int8")
    # the router found the layouts release must keep: GPT-2's (in, out) Conv1D with fused q, k, v columns
    if family == "gpt2":
        assert any(g.get("orientation") == "in_out" and g.get("parts_axis") == 1 for g in ob.param_groups)
    train(a, oa, range(3))
    train(b, ob, range(3), check_released=True)
    assert_same(a, b)


def test_closure_scheduler_and_zero_grad_see_a_normal_optimizer() -> None:
    """Lightning's automatic loop calls step(closure): the hooks fire in the closure's backward.
    An LR scheduler changes lr between steps; the hooks read the group's lr of that moment."""
    base = small()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    oa, ob = build(a, False), build(b, True)
    sa = torch.optim.lr_scheduler.LambdaLR(oa, lambda s: 1.0 / (1 + s))
    sb = torch.optim.lr_scheduler.LambdaLR(ob, lambda s: 1.0 / (1 + s))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        la = train(a, oa, range(3), sched=sa)
        lb = train(b, ob, range(3), sched=sb, closure=True)
    assert la == lb
    assert_same(a, b)
    assert ob.param_groups[0]["lr"] == oa.param_groups[0]["lr"] != 0.02


def test_checkpoint_resume_with_release_is_bit_exact() -> None:
    a = small()
    oa = build(a, True, state_format="int8", state={"rounding": "stochastic"})
    train(a, oa, range(2))
    saved_model, saved_opt = copy.deepcopy(a.state_dict()), copy.deepcopy(oa.state_dict())
    train(a, oa, range(2, 5))
    b = small(seed=1)  # other weights: everything comes from the checkpoint
    ob = build(b, True, state_format="int8", state={"rounding": "stochastic"})
    b.load_state_dict(saved_model)
    ob.load_state_dict(saved_opt)
    train(b, ob, range(2, 5), check_released=True)
    assert_same(a, b)
    assert_same_state(oa, ob)


def test_dcp_state_dict_dry_run_and_leftover_gradients() -> None:
    """torch.distributed.checkpoint's get_state_dict initializes a fresh optimizer with a dry-run
    step on zero gradients set by hand (no hooks fire): step() must step them like a normal step.
    A gradient set by hand is stepped by step() too."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    a, b = small(), small()
    oa, ob = build(a, False), build(b, True)
    _, osd_a = get_state_dict(a, oa)
    _, osd_b = get_state_dict(b, ob)
    assert osd_a["state"].keys() == osd_b["state"].keys() and osd_b["state"]
    assert_same(a, b)
    for m in (a, b):
        for p in m.parameters():
            p.grad = torch.full_like(p, 1e-3)
    oa.step()
    ob.step()
    assert release_of(ob).stepped_by_step == len(list(b.parameters()))
    assert_same(a, b)


# ----------------------------------------------------------------------------------- non-finite
def _poison(model: nn.Module, name: str, steps: set[int], counter: list[int]) -> None:
    """Make ``name``'s gradient NaN in the given steps (a tensor hook: runs before accumulation,
    so the post-accumulate hook of release sees the NaN, as a real overflow would look)."""
    p = dict(model.named_parameters())[name]

    def hook(g: torch.Tensor) -> torch.Tensor:
        return torch.full_like(g, float("nan")) if counter[0] in steps else g

    p.register_hook(hook)


def _count_steps(opt: qmuon.QMuon, counter: list[int]) -> None:
    opt.register_step_post_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))


@pytest.mark.parametrize("name", ["up.weight", "emb.weight"])
def test_nonfinite_skip_per_parameter_without_poisoning_state(name: str) -> None:
    base = small()
    runs = []
    for release in (False, True):
        m, counter = copy.deepcopy(base), [0]
        opt = build(m, release, state_format="int8", safety={"max_nonfinite_skips": 3})
        _poison(m, name, {1, 2}, counter)
        _count_steps(opt, counter)
        train(m, opt, range(5))
        runs.append((m, opt))
    (a, oa), (b, ob) = runs
    assert_same(a, b)
    assert_same_state(oa, ob)
    for o in (oa, ob):
        assert o.nonfinite_skips == 2 and o.nonfinite_skipped_steps == 2 and o.nonfinite_max_consecutive == 2
    assert all(torch.isfinite(p).all() for p in b.parameters())
    for st in ob.state.values():
        assert all(torch.isfinite(v.float()).all() for v in st.values())


def test_nonfinite_raise_and_max_skips_raise_inside_backward() -> None:
    m, counter = small(), [0]
    opt = build(m, True, safety={"nonfinite": "raise"})
    _poison(m, "down.weight", {1}, counter)
    _count_steps(opt, counter)
    train(m, opt, range(1))
    before = m.down.weight.detach().clone()
    state_before = {k: v.clone() for k, v in opt.state[m.down.weight].items()}
    with pytest.raises(FloatingPointError, match="down.weight"):
        loss_of(m, tokens(1)).backward()
    assert torch.equal(m.down.weight, before)  # the bad parameter and its state are untouched
    assert all(torch.equal(v, state_before[k]) for k, v in opt.state[m.down.weight].items())

    m, counter = small(), [0]
    opt = build(m, True, safety={"max_nonfinite_skips": 1})
    _poison(m, "up.weight", {0, 1}, counter)
    _count_steps(opt, counter)
    train(m, opt, range(1))
    before = m.up.weight.detach().clone()
    train(m, opt, range(1, 2))  # the second skip in a row passes the limit: read by the next step
    assert torch.equal(m.up.weight, before)
    with pytest.raises(qmuon.NonFiniteGradientError, match="max_nonfinite_skips=1"):
        train(m, opt, range(2, 3))  # raised in the first hook of backward, before anything changes
    assert torch.equal(m.up.weight, before)


# ----------------------------------------------------------------------------------- what cannot combine
def test_second_backward_before_step_is_refused() -> None:
    m = small()
    opt = build(m, True)
    loss_of(m, tokens(0)).backward()
    with pytest.raises(RuntimeError, match="accumulated over several backward passes"):
        loss_of(m, tokens(1)).backward()


def test_setup_refusals_name_the_reason_and_the_fix() -> None:
    with pytest.raises(ValueError, match="accumulate_grad_batches=4"):
        check_trainer_compatible(accumulate_grad_batches=4)
    with pytest.raises(ValueError, match="release_clip_norm"):
        check_trainer_compatible(gradient_clip_val=1.0)
    with pytest.raises(ValueError, match="bf16"):
        check_trainer_compatible(scaler=torch.amp.GradScaler("cpu"))
    check_trainer_compatible(accumulate_grad_batches=1, gradient_clip_val=None, scaler=None)
    m = small()
    with pytest.raises(ValueError, match="gradient_release=True only"):
        qmuon.build_optimizer(m, verbose=False, safety={"release_clip_norm": 1.0})
    with pytest.raises(TypeError, match="True or False"):
        qmuon.build_optimizer(m, verbose=False, gradient_release="yes")
    with pytest.raises(ValueError, match="already has gradient release"):
        qmuon.optim.attach_gradient_release(build(m, True))
    with pytest.raises(ValueError, match="positive finite"):
        qmuon.optim.attach_gradient_release(build(m, False), clip_norm=-1.0)


def test_strategy_optimizer_kwargs_accept_release() -> None:
    from qmuon_lightning.strategies import QMuonFabricStrategy, QMuonFSDPStrategy

    s = QMuonFSDPStrategy(optimizer_kwargs={"gradient_release": True, "safety": {"release_clip_norm": 1.0}})
    assert s.optimizer_kwargs["gradient_release"] is True
    f = QMuonFabricStrategy(optimizer_kwargs={"gradient_release": True})
    assert f.optimizer_kwargs["gradient_release"] is True
    with pytest.raises(ValueError, match="gradient_release=True only"):
        QMuonFSDPStrategy(optimizer_kwargs={"safety": {"release_clip_norm": 1.0}})
    with pytest.raises(ValueError, match="True or False"):
        QMuonFSDPStrategy(optimizer_kwargs={"gradient_release": 1})


def test_per_parameter_clipping_of_the_adamw_group() -> None:
    """release_clip_norm clips each AdamW-group gradient to that norm before its step: the same as
    torch.nn.utils.clip_grad_norm_ on each AdamW parameter alone, without release."""
    base = small()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    oa, ob = build(a, False), build(b, True, safety={"release_clip_norm": 0.05})
    adamw = [p for g in oa.param_groups if not g["use_muon"] for p in g["params"]]
    clipped = 0
    for s in range(3):
        oa.zero_grad()
        loss_of(a, tokens(s)).backward()
        for p in adamw:
            clipped += int(p.grad.norm() > 0.05)
            torch.nn.utils.clip_grad_norm_([p], 0.05)
        oa.step()
        ob.zero_grad()
        loss_of(b, tokens(s)).backward()
        ob.step()
    assert clipped > 0  # the bound was active
    assert_same(a, b)


# ----------------------------------------------------------------------------------- FSDP2, 2 processes
def _fsdp_worker(rank: int, world: int, root: str) -> dict:
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from qmuon_lightning.models.decoder_lm import DecoderLM

    mesh = init_device_mesh("cpu", (world,))

    def model(seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        m = DecoderLM(vocab_size=32, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=48, max_seq_len=16)
        for blk in m.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m

    def batch(step: int):
        tok = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(77 + step))
        tok = tok[rank * 2: rank * 2 + 2]
        return tok[:, :-1], tok[:, 1:]

    def opt_of(m: nn.Module, release: bool) -> qmuon.QMuon:
        return qmuon.build_optimizer(m, lr=0.02, adamw_lr=1e-2, verbose=False, state_format="int8", newton_schulz={"comm_carrier": "bf16", "comm_return": "bf16"}, gradient_release=release)

    out: dict = {"freed": [], "units": []}

    def run(m: nn.Module, o: qmuon.QMuon, steps: range, release: bool) -> None:
        for s in steps:
            x, y = batch(s)
            o.zero_grad(set_to_none=True)
            if release:
                calls: list[int] = []
                orig = o.step_params
                o.step_params = lambda params=None: (calls.append(len(list(params or []))), orig(params))[1]
            m.loss(x, y).backward()
            if release:
                out["freed"].append(all(p.grad is None for p in m.parameters()))
                out["units"].append(calls)
                del o.step_params
            o.step()

    def full(m: nn.Module) -> dict:
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in m.named_parameters()}

    a, b = model(), model()
    oa, ob = opt_of(a, False), opt_of(b, True)
    assert all(isinstance(p, DTensor) for p in b.parameters())
    run(a, oa, range(3), False)
    run(b, ob, range(3), True)
    out["plain"], out["release"] = full(a), full(b)
    out["comm"] = dict(ob.comm_stats)
    out["comm_plain"] = dict(oa.comm_stats)
    # DCP save / load with release on: the continuation is bit-identical
    path = os.path.join(root, "ckpt")
    msd, osd = get_state_dict(b, ob)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    run(b, ob, range(3, 5), True)
    out["cont"] = full(b)
    c = model(seed=5)
    oc = opt_of(c, True)
    msd, osd = get_state_dict(c, oc)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(c, oc, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    run(c, oc, range(3, 5), True)
    out["resumed"] = full(c)
    # a non-finite gradient on one rank only (a shard of blocks.1.mlp.down.weight at step 1, and of
    # the AdamW-routed lm_head at step 2): every rank skips the same parameter, with or without release
    skipped = {}
    for release in (False, True):
        m = model()
        counter = [0]
        params = dict(m.named_parameters())

        def poison(p: torch.Tensor, name: str) -> None:
            when = {"blocks.1.mlp.down.weight": 1, "lm_head.weight": 2}[name]
            if rank == 1 and counter[0] == when:
                p.grad.to_local().fill_(float("nan"))

        for name in ("blocks.1.mlp.down.weight", "lm_head.weight"):  # registered before release's hooks
            params[name].register_post_accumulate_grad_hook(lambda p, name=name: poison(p, name))
        o = opt_of(m, release)
        o.register_step_post_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
        run(m, o, range(4), release)
        skipped[release] = (o.nonfinite_skips, o.nonfinite_skipped_steps, full(m))
    out["skips"] = [skipped[r][:2] for r in (False, True)]
    out["nan_plain"], out["nan_release"] = skipped[False][2], skipped[True][2]
    # a second backward before step() is refused on every rank
    x, y = batch(9)
    c.loss(x, y).backward()
    try:
        c.loss(x, y).backward()
        out["accum_error"] = None
    except RuntimeError as e:
        out["accum_error"] = str(e)
    return out


@pytest.mark.slow
def test_fsdp2_release_equals_sharded_step_and_resumes_bit_exact(tmp_path) -> None:
    from _dist import run_workers

    res = run_workers(_fsdp_worker, 2, timeout=240, root=str(tmp_path))
    for r in res:
        assert all(r["freed"])  # no sharded gradient outlives backward
        # one collective step_params per FSDP unit (2 blocks + the root), same sizes on every rank
        assert all(len(u) == 3 for u in r["units"]), r["units"]
        for n in r["plain"]:
            assert torch.equal(r["plain"][n], r["release"][n]), n
            assert torch.equal(r["cont"][n], r["resumed"][n]), n
        assert r["comm"]["muon_elements"] == r["comm_plain"]["muon_elements"] > 0
        assert r["accum_error"] is not None and "several backward passes" in r["accum_error"]
        assert r["skips"] == [(2, 2), (2, 2)]  # both ranks skipped, in both runs
        for n in r["nan_plain"]:
            assert torch.equal(r["nan_plain"][n], r["nan_release"][n]), n
            assert torch.isfinite(r["nan_release"][n]).all(), n
    assert res[0]["units"] == res[1]["units"]


# ----------------------------------------------------------------------------------- Lightning
def _lightning_worker(rank: int, world: int) -> dict:
    """Trainer(strategy=QMuonFSDPStrategy) on one CPU process (the process group of run_workers),
    automatic optimization: optimizer.step(closure) runs forward / backward in the closure, where
    the hooks fire; a LambdaLR steps after each optimizer step."""
    from datetime import timedelta

    import lightning as L
    from torch.distributed.tensor import DTensor

    from qmuon_lightning.models import DecoderLM
    from qmuon_lightning.strategies import QMuonFSDPStrategy

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = DecoderLM(vocab_size=32, d_model=32, n_layers=2, n_heads=2, max_seq_len=8, mlp_hidden=48)
            self.grads_seen: list[bool] = []

        def training_step(self, batch, batch_idx):
            return self.model.loss(*batch)

        def on_before_optimizer_step(self, optimizer) -> None:  # after the closure's backward
            self.grads_seen.append(any(p.grad is not None for p in self.parameters()))

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    g = torch.Generator().manual_seed(3)
    tok = torch.randint(0, 32, (16, 9), generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tok[:, :-1], tok[:, 1:]), batch_size=4)

    def fit(release: bool, **trainer_kw) -> tuple[L.LightningModule, L.Trainer]:
        L.seed_everything(0, verbose=False)
        module = LM()
        strategy = QMuonFSDPStrategy(optimizer_kwargs={"gradient_release": release, "state_format": "int8"},
                                     timeout=timedelta(seconds=60))
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            **trainer_kw)
        trainer.fit(module, data)
        return module, trainer

    def full(m):
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in m.named_parameters()}

    a, ta = fit(False)
    b, tb = fit(True)
    out = {"plain": full(a), "release": full(b), "grads_seen": (a.grads_seen, b.grads_seen),
           "released": release_of(tb.optimizers[0]) is not None,
           "lr": (ta.optimizers[0].param_groups[0]["lr"], tb.optimizers[0].param_groups[0]["lr"])}
    for kw in ({"accumulate_grad_batches": 2}, {"gradient_clip_val": 1.0}):
        try:
            fit(True, **kw)
            out[str(kw)] = None
        except ValueError as e:
            out[str(kw)] = str(e)
    # fp16 loss scaling: on CPU, Trainer(precision="16-mixed") falls back to bf16 (no scaler), so the
    # user's explicit plugin with a CPU GradScaler is the way a scaler reaches the strategy here.
    from lightning.pytorch.plugins import MixedPrecision

    try:
        fit(True, plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
        out["scaler"] = None
    except ValueError as e:
        out["scaler"] = str(e)
    return out


@pytest.mark.slow
def test_lightning_trainer_with_release_equals_without() -> None:
    from _dist import run_workers

    # spawn: a forked child of the suite's process (threads of earlier tests) hung in CI
    (r,) = run_workers(_lightning_worker, 1, timeout=240, start_method="spawn")
    assert r["released"]
    plain_seen, release_seen = r["grads_seen"]
    assert all(plain_seen) and len(release_seen) == 4 and not any(release_seen)  # freed inside the closure
    for n in r["plain"]:
        assert torch.equal(r["plain"][n], r["release"][n]), n
    assert r["lr"][0] == r["lr"][1]
    assert "accumulate_grad_batches=2" in r["{'accumulate_grad_batches': 2}"]
    assert "gradient_clip_val=1.0" in r["{'gradient_clip_val': 1.0}"] and "release_clip_norm" in r["{'gradient_clip_val': 1.0}"]
    assert r["scaler"] is not None and "GradScaler" in r["scaler"] and "bf16" in r["scaler"]


# ----------------------------------------------------------------------------------- Accelerate
def test_accelerate_prepare_qmuon_with_release_equals_without() -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from qmuon.integrations.accelerate import prepare_qmuon, unwrap_qmuon

    def run(release: bool, **acc_kw):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator(cpu=True, **acc_kw)
        model, opt = prepare_qmuon(acc, small(), verbose=False, gradient_release=release, state_format="int8")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        for s in range(3):
            loss = loss_of(model, tokens(s))
            acc.backward(loss)
            if release:
                assert all(p.grad is None for p in model.parameters())
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        return model, unwrap_qmuon(opt)

    try:
        a, _ = run(False)
        b, ob = run(True)
        assert release_of(ob) is not None
        assert_same(a, b)
        with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
            run(True, gradient_accumulation_steps=2)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_accelerate_clipping_under_release_raises_and_plain_clipping_still_works() -> None:
    """Under release the gradients are stepped and freed inside ``accelerator.backward``, so
    Accelerate's own clip would return a norm of 0 and clip nothing: prepare_qmuon makes it raise
    with the alternative. The same accelerator still clips a model that is not released, and an
    accelerator prepared without release clips as before."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from qmuon.integrations.accelerate import prepare_qmuon

    def fresh() -> Accelerator:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        return Accelerator(cpu=True)

    try:
        acc = fresh()
        model, opt = prepare_qmuon(acc, small(), verbose=False, gradient_release=False)
        acc.backward(loss_of(model, tokens(0)))
        before = [p.grad.clone() for p in model.parameters()]
        norm = acc.clip_grad_norm_(model.parameters(), 1e-3)
        assert float(norm) > 1e-3  # the plain path: a real norm, and the gradients were scaled down
        assert any(not torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))
        acc.clip_grad_value_(model.parameters(), 1e-4)
        assert all(float(p.grad.abs().max()) <= 1e-4 for p in model.parameters())

        acc = fresh()
        model, opt = prepare_qmuon(acc, small(), verbose=False, gradient_release=True)
        plain = acc.prepare(nn.Linear(4, 4))  # a second model, not released
        acc.backward(loss_of(model, tokens(0)) + plain(torch.ones(2, 4)).square().sum())
        with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(max_norm=1.0\).*release_clip_norm"):
            acc.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(RuntimeError, match=r"clip_grad_value_\(clip_value=0.5\).*release_clip_norm"):
            acc.clip_grad_value_(model.parameters(), 0.5)
        with pytest.raises(RuntimeError, match="release_clip_norm"):  # one released tensor is enough
            acc.clip_grad_norm_(next(model.parameters()), 1.0)
        assert float(acc.clip_grad_norm_(plain.parameters(), 1e-3)) > 1e-3
        opt.step()  # the refusal changed nothing: the loop goes on
        opt.zero_grad()
        release_of(opt).detach()  # no release any more: Accelerate clips the model's gradients again
        acc.backward(loss_of(model, tokens(1)))
        assert float(acc.clip_grad_norm_(model.parameters(), 1e-3)) > 1e-3
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_a_new_optimizer_takes_the_parameters_over() -> None:
    """A second optimizer with release on the same model (a second trainer.fit, a rebuilt
    optimizer) takes the hooks over: the parameters are stepped once per backward, by it."""
    base = small()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    old = build(b, True)
    ob = build(b, True)
    assert release_of(old) is None and release_of(ob) is not None
    oa = build(a, False)
    train(a, oa, range(2))
    train(b, ob, range(2), check_released=True)
    assert_same(a, b)
    assert not old.state  # the old optimizer never stepped


def test_a_released_model_can_be_copied_and_saved(tmp_path) -> None:
    """Release keeps nothing on the parameters: a deepcopy of a released model gets its own
    release without disturbing the original's, and torch.save(model) works."""
    a = small()
    oa = build(a, True)
    b = copy.deepcopy(a)
    ob = build(b, True)
    assert release_of(oa) is not None and release_of(ob) is not None
    torch.save(a, tmp_path / "model.pt")
    train(a, oa, range(1), check_released=True)
    train(b, ob, range(1), check_released=True)
    assert_same(a, b)


# ----------------------------------------------------------------------------------- Fabric
def _fabric_worker(rank: int, world: int) -> dict:
    """L.Fabric(strategy=QMuonFabricStrategy(optimizer_kwargs={"gradient_release": True})) on one
    CPU process: the AdamW passed to setup_optimizers is replaced by a QMuon with release; the
    loop (fabric.backward, optimizer.step) equals the one without; fabric.clip_gradients refuses."""
    import lightning as L
    from torch.distributed.tensor import DTensor

    from qmuon_lightning.models import DecoderLM
    from qmuon_lightning.strategies import QMuonFabricStrategy

    def run(release: bool):
        fabric = L.Fabric(accelerator="cpu", devices=1,
                          strategy=QMuonFabricStrategy(optimizer_kwargs={"gradient_release": release}))
        fabric.launch()
        torch.manual_seed(0)
        model = fabric.setup_module(DecoderLM(vocab_size=32, d_model=32, n_layers=2, n_heads=2, max_seq_len=8))
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
        freed = []
        for s in range(3):
            tok = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(s))
            fabric.backward(model.loss(tok[:, :-1], tok[:, 1:]))
            freed.append(all(p.grad is None for p in model.parameters()))
            opt.step()
            opt.zero_grad()
        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                  for n, p in model.named_parameters()}
        return fabric, model, opt, params, freed

    _, _, _, plain, freed_plain = run(False)
    fabric, model, opt, released, freed = run(True)
    out = {"plain": plain, "release": released, "freed": (freed_plain, freed), "clip_error": None}
    fabric.backward(model.loss(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long)))
    try:
        fabric.clip_gradients(model, opt, max_norm=1.0)
    except RuntimeError as e:
        out["clip_error"] = str(e)
    return out


@pytest.mark.slow
def test_fabric_with_release_equals_without_and_refuses_clipping() -> None:
    from _dist import run_workers

    # spawn: a forked child of the suite's process (threads of earlier tests) hung in CI
    (r,) = run_workers(_fabric_worker, 1, timeout=240, start_method="spawn")
    assert not any(r["freed"][0]) and all(r["freed"][1])
    for n in r["plain"]:
        assert torch.equal(r["plain"][n], r["release"][n]), n
    assert r["clip_error"] is not None and "release_clip_norm" in r["clip_error"]


def test_deepspeed_wrapper_refuses_release() -> None:
    pytest.importorskip("deepspeed")
    from qmuon.integrations import deepspeed as qds

    with pytest.raises(ValueError, match="cannot combine with DeepSpeed ZeRO"):
        qds.WholeMatrixZeroOptimizer(build(small(), True))
