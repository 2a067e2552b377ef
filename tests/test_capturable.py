"""``update.capturable``: step counters on the parameters' device, learning rates read from device copies,
so the step can be captured in a CUDA graph (``qmuon.capture_step``) and a compiled step follows an lr
schedule with one graph (``qmuon.compile_step``).

On this CPU the device is the CPU, so "on the device" is checked as "read by no host read": the
capturable step is counted with no exemption for its step counters. What it must equal is the
non-capturable step: bf16 weights (every rounding rule) and quantized AdamW bit for bit, fp32 weights
within one rounding per write (the kernel fuses ``w * decay + u * alpha`` into one FMA, the device-scalar
path rounds the product first: torch has no FMA with a tensor scalar). The CUDA graph itself is
checked by the ``cuda`` tests at the end (skipped without a GPU; benchmarks/gpu_check.sh runs them).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import qmuon
from conftest import requires_cuda
from test_host_reads import HostReads, Net


BIT_EXACT = {
    "bf16 stochastic": dict(dtype=torch.bfloat16),
    "bf16 nearest": dict(dtype=torch.bfloat16, bf16_update="nearest"),
    "bf16 ecc8": dict(dtype=torch.bfloat16, bf16_update="ecc8"),
    "bf16 + int8 adamw": dict(dtype=torch.bfloat16, adamw_state_format="int8"),
    "bf16 + int4 adamw + grasp4": dict(dtype=torch.bfloat16, adamw_state_format="int4", state_format="grasp4"),
    "bf16 + fp32 adamw + cautious": dict(dtype=torch.bfloat16, adamw_state_format="fp32",
                                         update={"cautious_weight_decay": True}),
    "bf16 normuon": dict(dtype=torch.bfloat16, update={"variant": "normuon"}),
}


def _merged(kw: dict, capturable: bool) -> dict:
    kw = dict(kw)
    kw["update"] = {**kw.get("update", {}), "capturable": capturable}
    return kw


def _run(config: dict, capturable: bool, **extra):
    kw = _merged(config, capturable)
    dtype = kw.pop("dtype")
    update = kw.pop("update")
    torch.manual_seed(0)
    return _train_with(dtype, update, kw, **extra)


def _train_with(dtype, update, kw, steps=4, bad_steps=(), step_fn=None, device="cpu"):
    torch.manual_seed(0)
    model = Net().to(device=device, dtype=dtype)
    opt = qmuon.build_optimizer(model, lr=0.02, adamw_lr=3e-3, verbose=False, update=update, **kw)
    step = step_fn(opt) if step_fn is not None else opt.step
    gen = torch.Generator().manual_seed(1)
    for s in range(steps):
        x = torch.randint(0, 64, (4, 12), generator=gen).to(device)
        loss = nn.functional.cross_entropy(model(x).float().flatten(0, 1), x.flatten())
        if s in bad_steps:
            loss = loss * float("nan")
        loss.backward()
        for g in opt.param_groups:  # an lr schedule: every step a new lr
            g["lr"] = g["lr"] * 0.9
        step()
        opt.zero_grad(set_to_none=device == "cpu")
    opt.settle_nonfinite()
    return model, opt


def _states_equal(a, b) -> None:
    for (pa, sa), (pb, sb) in zip(a.state.items(), b.state.items()):
        assert sa.keys() == sb.keys()
        for k in sa:
            va, vb = sa[k], sb[k]
            if isinstance(va, torch.Tensor):
                assert torch.equal(va.cpu(), vb.cpu()), k


@pytest.mark.parametrize("name", list(BIT_EXACT))
def test_capturable_step_equals_the_eager_step(name):
    """Four steps, each at a new lr, one of them with a non-finite gradient: weights, state and step
    counters bit for bit those of the non-capturable optimizer, skip counts included."""
    (ma, oa), (mb, ob) = (_run(BIT_EXACT[name], c, bad_steps=(2,)) for c in (False, True))
    for (n, pa), pb in zip(ma.named_parameters(), mb.parameters()):
        assert torch.equal(pa, pb), n
    _states_equal(oa, ob)
    assert ob.nonfinite_skips == oa.nonfinite_skips == len(list(ma.parameters()))
    assert ob.nonfinite_skipped_steps == oa.nonfinite_skipped_steps == 1


@pytest.mark.parametrize("adamw", ["fp32", "int8"])
def test_fp32_weights_within_one_rounding(adamw):
    """fp32 weights, one step from the same state: the device-scalar write rounds ``u * alpha`` before
    the add where the kernel fuses them into one FMA. The two results differ by at most the product's
    rounding plus the sum's: ulp(u * alpha) + ulp(w_new) <= 2**-23 (|u * alpha| + |w_new|), and
    |u * alpha| <= |w_new| + |w_old| (it is w_new - decay * w_old up to those roundings), so the bound
    is 2**-23 (2 |w_new| + |w_old|); where the update dwarfs a weight near zero that is many ulps of
    the weight (up to 272 measured), a few of the update. The momentum and AdamW state, computed
    before the write, are bit-identical."""
    torch.manual_seed(0)
    before = [p.detach().clone() for p in Net().parameters()]
    (ma, oa), (mb, ob) = (_train_with(torch.float32, {"capturable": c}, {"adamw_state_format": adamw}, steps=1)
                          for c in (False, True))
    for (n, pa), pb, old in zip(ma.named_parameters(), mb.parameters(), before):
        bound = torch.finfo(torch.float32).eps * (2 * pa.abs() + old.abs()) + torch.finfo(torch.float32).tiny
        assert bool(((pa - pb).abs() <= bound).all()), n
    _states_equal(oa, ob)


@pytest.mark.parametrize("release", [False, True], ids=["step", "release"])
def test_capturable_step_reads_nothing_at_all(release):
    """Counted with no exemption for the step counters (a non-capturable step reads its CPU ones):
    only the previous step's staged non-finite flags are read, as in tests/test_host_reads.py."""
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    opt = qmuon.build_optimizer(model, lr=0.02, adamw_lr=1e-3, verbose=False, gradient_release=release,
                                adamw_state_format="int8", update={"capturable": True})
    counter = HostReads()
    x = torch.randint(0, 64, (4, 12))
    for step in range(5):
        with counter.counting(opt._nonfinite.staged()) if step >= 2 else _nothing():
            loss = nn.functional.cross_entropy(model(x).float().flatten(0, 1), x.flatten())
            (loss * float("nan") if step == 3 else loss).backward()
            for g in opt.param_groups:
                g["lr"] = g["lr"] * 0.9
            opt.step()
        opt.zero_grad()
        assert counter.seen == [], f"step {step}: {counter.seen}"
    opt.settle_nonfinite()
    assert opt.nonfinite_skipped_steps == 1


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_compiled_capturable_step_follows_an_lr_schedule_with_one_graph():
    """Six steps, a new lr every step: the compiled step is traced twice (the first step creates the
    state, every later one runs the steady graph) and equals the eager capturable step bit for bit
    (aot_eager keeps the eager kernels: what is checked is the trace, not a backend's fusion)."""
    from torch._dynamo.utils import counters

    config = dict(dtype=torch.bfloat16, adamw_state_format="int8")
    ma, _ = _run(config, True, steps=6)
    torch._dynamo.reset()
    counters.clear()
    mb, _ = _run(config, True, steps=6, step_fn=lambda opt: qmuon.compile_step(opt, backend="aot_eager"))
    for (n, pa), pb in zip(ma.named_parameters(), mb.parameters()):
        assert torch.equal(pa, pb), n
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 2, f"{graphs} graphs for 6 steps with 6 learning rates"


def test_non_capturable_compiled_step_warns_when_the_lr_changes():
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_with(torch.float32, {}, {}, steps=3, step_fn=lambda opt: qmuon.compile_step(opt, backend="eager"))
    msgs = [str(w.message) for w in caught if "qmuon.compile_step" in str(w.message)]
    assert len(msgs) == 1 and "update={'capturable': True}" in msgs[0], msgs


def test_state_dict_round_trip_between_capturable_and_not():
    """A checkpoint moves both ways: the loaded optimizer places the step counters as it keeps them
    and then steps exactly like the one that saved it."""
    config = dict(dtype=torch.bfloat16, adamw_state_format="int8")
    for saver, loader in ((True, False), (False, True)):
        model, opt = _run(config, saver, steps=2)
        sd = opt.state_dict()
        twin = Net().to(torch.bfloat16)
        twin.load_state_dict(model.state_dict())
        opt2 = qmuon.build_optimizer(twin, lr=0.02, adamw_lr=3e-3, verbose=False, adamw_state_format="int8",
                                     update={"capturable": loader})
        opt2.load_state_dict(sd)
        for m, o in ((model, opt), (twin, opt2)):
            x = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(5))
            nn.functional.cross_entropy(m(x).float().flatten(0, 1), x.flatten()).backward()
            o.step()
        for pa, pb in zip(model.parameters(), twin.parameters()):
            assert torch.equal(pa, pb)
        _states_equal(opt, opt2)


def test_what_cannot_be_captured_is_refused_by_name():
    model = Net()
    with pytest.raises(qmuon.ConfigError, match="state.rounding='nearest'"):
        qmuon.build_optimizer(model, verbose=False, update={"capturable": True}, state={"rounding": "stochastic"})
    with pytest.raises(qmuon.ConfigError, match="update.capturable must be True or False"):
        qmuon.build_optimizer(model, verbose=False, update={"capturable": "yes"})
    plain = qmuon.build_optimizer(model, verbose=False)
    with pytest.raises(qmuon.ConfigError, match=r"update=\{'capturable': True\}"):
        qmuon.capture_step(plain)
    capt = qmuon.build_optimizer(model, verbose=False, update={"capturable": True})
    with pytest.raises(qmuon.ConfigError, match="compile_step"):
        qmuon.capture_step(capt)  # CPU parameters
    # a group added later with stochastic rounding: refused at the step, before anything changes
    extra = nn.Linear(8, 8, bias=False)
    capt.add_param_group({"params": [extra.weight], "rounding": "stochastic"})
    extra.weight.grad = torch.ones_like(extra.weight)
    before = extra.weight.detach().clone()
    with pytest.raises(qmuon.ConfigError, match="rounds its quantized state stochastically"):
        capt.step()
    assert torch.equal(extra.weight, before) and not capt.state[extra.weight]


# ---------------------------------------------------------------------------------------- CUDA graphs
@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["bf16 stochastic", "bf16 + int8 adamw", "bf16 ecc8"])
def test_captured_step_equals_the_eager_capturable_step(name):
    """Ten steps on the GPU, a new lr each step and a non-finite gradient at step 6 (after the capture):
    the replayed graph gives the eager capturable step's weights and state bit for bit."""
    config = dict(BIT_EXACT[name])
    (ma, oa) = _run(config, True, steps=10, bad_steps=(6,), device="cuda")
    (mb, ob) = _run(config, True, steps=10, bad_steps=(6,), device="cuda",
                    step_fn=lambda opt: qmuon.capture_step(opt, warmup_steps=3))
    for (n, pa), pb in zip(ma.named_parameters(), mb.parameters()):
        assert torch.equal(pa, pb), n
    _states_equal(oa, ob)
    assert ob.nonfinite_skipped_steps == oa.nonfinite_skipped_steps == 1


@requires_cuda
@pytest.mark.cuda
def test_captured_step_refuses_moved_gradients():
    torch.manual_seed(0)
    model = Net().cuda().to(torch.bfloat16)
    opt = qmuon.build_optimizer(model, verbose=False, update={"capturable": True})
    step = qmuon.capture_step(opt, warmup_steps=1)
    x = torch.randint(0, 64, (4, 12), device="cuda")
    for i in range(3):
        nn.functional.cross_entropy(model(x).float().flatten(0, 1), x.flatten()).backward()
        step()
        opt.zero_grad(set_to_none=i < 2)  # set_to_none after the capture (call 2): the next replay refuses
    nn.functional.cross_entropy(model(x).float().flatten(0, 1), x.flatten()).backward()
    with pytest.raises(RuntimeError, match="set_to_none=False"):
        step()
