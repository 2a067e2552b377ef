"""How :class:`~qmuon.integrations.deepspeed.WholeMatrixZeroOptimizer` finds the DeepSpeed optimizer
that wraps it, in one process (no engine needed): through what DeepSpeed, Accelerate or the
Hugging Face Trainer hand over (:func:`~qmuon.integrations.deepspeed.layout.resolve_zero`), through
the links DeepSpeed puts on the model's parameters (ZeRO-1/2 ``_hp_mapping``, ZeRO-3
``_z3_optimizer``), or not at all, with an error naming ``attach`` raised before anything changes.
Never through the garbage collector: no module of ``qmuon`` uses ``gc``.

The multi-process runs that attach to real engines are tests/test_deepspeed*.py (``attach(engine)``),
tests/test_transformers_dist.py (the Trainer, through the parameter links) and
tests/test_deepspeed_accelerate.py (Accelerate's DeepSpeed plugin)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("deepspeed")

import qmuon  # noqa: E402
from qmuon.core.config import FORMAT_OVERRIDES  # noqa: E402
from qmuon.integrations import deepspeed as qds  # noqa: E402
from qmuon.integrations.deepspeed import layout as ds_layout  # noqa: E402

PACKAGE = Path(qmuon.__file__).parent


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))


def _wrapper(model: torch.nn.Module | None = None) -> qds.WholeMatrixZeroOptimizer:
    return qds.WholeMatrixZeroOptimizer(qmuon.build_optimizer(model or _model(), lr=0.02, verbose=False))


def test_no_module_of_qmuon_uses_the_garbage_collector() -> None:
    """``gc.get_referrers`` is documented for debugging only; nothing in qmuon may find objects that way."""
    users = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module == "gc":
                names.append("gc")
            if "gc" in names:
                users.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert users == [], f"modules importing gc: {users}"


def test_resolve_follows_what_accelerate_and_the_trainer_hand_over() -> None:
    client = object()
    zero = SimpleNamespace(optimizer=client)
    engine = SimpleNamespace(optimizer=zero)
    assert ds_layout.resolve_zero(zero, client) == (zero, None)
    assert ds_layout.resolve_zero(engine, client)[0] is zero
    accelerator = SimpleNamespace(deepspeed_engine_wrapped=SimpleNamespace(engine=engine))
    assert ds_layout.resolve_zero(accelerator, client)[0] is zero
    prepared_optimizer = SimpleNamespace(optimizer=zero)  # accelerate's DeepSpeedOptimizerWrapper
    assert ds_layout.resolve_zero(prepared_optimizer, client)[0] is zero
    trainer = SimpleNamespace(model_wrapped=engine, optimizer=prepared_optimizer)
    assert ds_layout.resolve_zero(trainer, client)[0] is zero
    assert ds_layout.resolve_zero(client, client) == (client, None)  # stage 0, fp32: the engine steps it
    with pytest.raises(TypeError, match="Pass the engine deepspeed.initialize returned"):
        ds_layout.resolve_zero(SimpleNamespace(model_wrapped=torch.nn.Linear(2, 2)), client)
    with pytest.raises(TypeError, match="no DeepSpeed optimizer wrapping"):
        ds_layout.resolve_zero(SimpleNamespace(optimizer=SimpleNamespace(optimizer=object())), client)


def test_attach_refuses_an_optimizer_it_cannot_read() -> None:
    wrapper = _wrapper()
    with pytest.raises(ValueError, match="does not wrap this optimizer"):
        wrapper._attach_to(SimpleNamespace(optimizer=object()), None)
    with pytest.raises(qds.UnsupportedDeepSpeedConfig, match="whose layout QMuon does not read"):
        wrapper.attach(SimpleNamespace(optimizer=wrapper))
    assert wrapper._mode is None


class _Address(SimpleNamespace):
    pass


def _link(p: torch.Tensor, flat: torch.Tensor, group: int, start: int, numel: int, local: int) -> None:
    """What DeepSpeed's ``link_hp_params`` sets on a ZeRO-1/2 parameter (``tensor_fragment``'s fields read)."""
    p._hp_mapping = SimpleNamespace(lp_fragment_address=_Address(start=start, numel=numel),
                                    hp_fragment_address=_Address(start=local, numel=numel),
                                    hp_fragment=flat.narrow(0, local, numel), param_group_index=group)
    p._dp_group = None


def test_zero12_links_give_the_layout_and_a_wrong_link_is_refused() -> None:
    """One rank holding a whole flat group (world 1): each parameter's fragment is read from its link."""
    model = _model()
    wrapper = _wrapper(model)
    groups = wrapper._all_groups
    infos = wrapper._params
    flats = []
    for gi, g in enumerate(groups):
        members = [(info, p) for info, p in zip(infos, wrapper._model_params) if info.group == gi]
        flat = torch.zeros(sum(info.numel for info, _ in members) + 3)  # DeepSpeed pads the partition
        at = 0
        for info, p in members:
            _link(p, flat, gi, 0, info.numel, at)
            at += info.numel
        flats.append(flat)
        g["params"] = [flat]  # what DeepSpeed's ZeRO optimizer leaves in the client's groups
    wrapper._require_attached()  # no attach() call: found through the links
    assert wrapper._mode == "partitioned" and wrapper._world == 1
    at = {}
    for info in infos:
        seg = info.holders[0]
        assert (seg.start, seg.length) == (0, info.numel)
        assert seg.local == at.setdefault(info.group, 0)
        at[info.group] += info.numel

    other = _wrapper(_model())
    for info, p in zip(other._params, other._model_params):
        _link(p, torch.zeros(info.numel), info.group, 0, info.numel, 0)  # a view of some other tensor
    for g in other._all_groups:
        g["params"] = [torch.zeros(64)]
    with pytest.raises(RuntimeError, match="not a view of group"):
        other._require_attached()


def test_zero12_links_that_miss_elements_are_refused() -> None:
    wrapper = _wrapper()
    for gi, g in enumerate(wrapper._all_groups):
        flat = torch.zeros(256)
        for info, p in zip(wrapper._params, wrapper._model_params):
            if info.group == gi:
                _link(p, flat, gi, 0, info.numel - 1 if info.numel > 1 else info.numel, 0)
        g["params"] = [flat]
    with pytest.raises(RuntimeError, match="do not tile"):
        wrapper._require_attached()


def test_flat_groups_without_links_raise_naming_attach_before_the_step() -> None:
    model = _model()
    wrapper = _wrapper(model)
    for g in wrapper._all_groups:  # flattened by someone, no DeepSpeed link to read where things went
        g["params"] = [torch.zeros(sum(p.numel() for p in g["params"]), requires_grad=True)]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"optimizer\.attach\(engine\)"):
        wrapper.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert wrapper._mode is None


def test_a_zero3_link_to_another_optimizer_is_refused() -> None:
    model = _model()
    wrapper = _wrapper(model)
    for p in model.parameters():
        p._z3_optimizer = SimpleNamespace(optimizer=object())
    with pytest.raises(RuntimeError, match="does not wrap this"):
        wrapper._require_attached()


def test_the_sharded_steps_carriers_reach_the_exchange() -> None:
    """comm_carrier / comm_return are the carriers of the DeepSpeed exchange (qmuon.distributed.flat), as of
    FSDP2's; on one process nothing crosses a process boundary, so both are fp32 there, as under FSDP2.
    tests/test_flat_exchange.py runs the exchange on 2 ranks; tests/test_deepspeed_accelerate.py trains with
    the int8 default."""
    wrapper = qds.WholeMatrixZeroOptimizer(qmuon.build_optimizer(
        _model(), lr=0.02, verbose=False, newton_schulz={"comm_carrier": "mxfp8", "comm_return": "bf16"}))
    wrapper._require_attached()
    assert (wrapper._exchange.fwd.name, wrapper._exchange.ret.name) == ("fp32", "fp32")
    wrapper._world = 2  # as rank 0 of two ranks holding every matrix whole (stage 0)
    for info in wrapper._params:
        info.holders = info.holders * 2
    wrapper._plan_slices()
    assert (wrapper._exchange.fwd.name, wrapper._exchange.ret.name) == ("mxfp8", "bf16")
    # The default comm_carrier="auto": the NS input in its own dtype (int8 missed issue 38's cosine target
    # on the 4-rank ZeRO-2 run, qmuon.distributed.carrier.forward_carrier), the update through the int8 return.
    default = _wrapper()
    default._require_attached()
    default._world = 2
    for info in default._params:
        info.holders = info.holders * 2
    default._plan_slices()
    assert (default._exchange.fwd.name, default._exchange.ret.name) == ("fp32", "int8")


def test_a_format_that_is_not_row_local_keeps_the_whole_momentum_on_the_owner() -> None:
    """grasp4 factors a whole matrix, so a ZeRO slice's rows cannot be updated alone: at ZeRO 1-3 its
    matrices send their gradient (no sums of squares ride with it) and the owner keeps the whole momentum,
    while an int8 matrix beside it keeps the sliced momentum (tests/test_deepspeed.py runs grasp4 at ZeRO 2
    against one process)."""
    opt = qmuon.build_optimizer(_model(), lr=0.02, verbose=False, state_format="grasp4")
    gi = next(i for i, g in enumerate(opt.param_groups) if g["use_muon"])
    opt.param_groups[gi][FORMAT_OVERRIDES] = {0: {"state_format": "int8"}}  # one matrix row-local
    wrapper = qds.WholeMatrixZeroOptimizer(opt)
    wrapper._require_attached()
    wrapper._gather = True  # as if ZeRO 1-3 had cut the matrices into slices
    wrapper._plan_slices()
    muon = [p.index for p in wrapper._params if p.muon]
    first = next(p.index for p in wrapper._params if p.muon and p.group == gi and p.pos == 0)
    assert wrapper._whole_momentum == set(muon) - {first}
    assert set(wrapper._exchange.sum_blocks) == {first}
    assert wrapper._sliced(first) and not any(wrapper._sliced(i) for i in set(muon) - {first})


def test_an_accelerate_plugin_with_optimizer_offload_is_refused_when_the_wrapper_is_built() -> None:
    """With offload_optimizer, accelerator.prepare would swap the client optimizer for DeepSpeedCPUAdam
    without a word: the wrapper refuses to be built under such a plugin. The Accelerator's distributed
    type and plugin are set by hand (no DeepSpeed launcher in this process)."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        acc = accelerate.Accelerator(cpu=True)
        _wrapper()  # not DeepSpeed: nothing checked
        # set by hand, undone by the state resets below (a monkeypatch undo would run after them)
        acc.state.distributed_type = PartialState().distributed_type = DistributedType.DEEPSPEED
        acc.state.deepspeed_plugins = SimpleNamespace(deepspeed_config={
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
        with pytest.raises(qds.UnsupportedDeepSpeedConfig, match="Accelerate's DeepSpeed plugin: .*offload_optimizer"):
            _wrapper()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
