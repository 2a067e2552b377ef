"""QMuon under Hugging Face Accelerate: qmuon.integrations.accelerate and
examples/accelerate_train.py.

In-process tests run one process (``Accelerator(cpu=True)``, distributed type ``NO``). The DDP test
launches this file under ``torchrun --nproc_per_node 2`` (``Accelerator(cpu=True)`` then gives
``MULTI_CPU`` DDP over gloo) in worker mode; the FSDP2 test does the same on GPUs and is marked
``cuda``. Every resume comparison is bit-exact (``torch.equal``): the resumed run sees the same
data, the same fp32 parameters and the same int8 codes / fp32 scales, and every op involved is
deterministic on CPU, so there is no tolerance to state.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

import qmuon  # noqa: E402
from _helpers import assert_same  # noqa: E402
from _dist import REPO, free_port, run_launcher, subprocess_env  # noqa: E402
from qmuon.integrations.accelerate import (  # noqa: E402
    UnsupportedAccelerateConfig,
    check_accelerator,
    check_configuration,
    check_state_keys,
    prepare_qmuon,
    unwrap_qmuon,
)
from qmuon_lightning.models import DecoderLM  # noqa: E402

VOCAB, SEQ, BATCH = 64, 16, 4
SUBPROCESS_TIMEOUT_S = 300


# ---------------------------------------------------------------------------------------------- helpers
def tiny_model(seed: int) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_seq_len=SEQ)


def batch(step: int, rank: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``rank`` at ``step``: a function of (step, rank) only, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    w = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return w[:, :-1].to(device), w[:, 1:].to(device)


def train(acc: Accelerator, model: torch.nn.Module, opt: Any, steps: range) -> list[float]:
    losses = []
    for s in steps:
        x, y = batch(s, acc.process_index, acc.device)
        logits = model(x)  # through the wrapper: DDP synchronizes gradients only then
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def snapshot(model: torch.nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """Parameters by name and optimizer state by (group, index, key), cloned to CPU."""
    out = {f"param/{n}": _full(p).detach().cpu().clone() for n, p in model.named_parameters()}
    qm = unwrap_qmuon(opt)
    for gi, group in enumerate(qm.param_groups):
        for i, p in enumerate(group["params"]):
            for k, v in qm.state.get(p, {}).items():
                out[f"state/{gi}/{i}/{k}"] = _full(v).detach().cpu().clone() if torch.is_tensor(v) else torch.tensor(v)
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def mismatches(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """:func:`assert_same`'s message as a list (empty when bit-identical), for a worker's JSON report."""
    try:
        assert_same(a, b, "snapshot")
    except AssertionError as e:
        return [str(e)]
    return []


def resume_scenario(
    ckpt: str, make_accelerator: Callable[[], Accelerator], k: int = 3, m: int = 3, **build_kwargs: Any
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """Run A: prepare, k steps, save_state, m steps. Run B (new Accelerator, model with another
    init, new optimizer): prepare, load_state, the same m steps. Returns both snapshots and facts."""
    build_kwargs.setdefault("verbose", False)
    acc = make_accelerator()
    model, opt = prepare_qmuon(acc, tiny_model(0), **build_kwargs)
    info: dict[str, Any] = {"state_before_first_step": sum(len(s) for s in unwrap_qmuon(opt).state.values())}
    train(acc, model, opt, range(k))
    check_state_keys(model, opt)
    live = {id(p) for p in model.parameters()}
    info["state_keys_are_live_params"] = all(id(p) in live for p in unwrap_qmuon(opt).state)
    info["state_entries"] = len(unwrap_qmuon(opt).state)
    acc.save_state(ckpt)
    acc.wait_for_everyone()  # rank 0 writes model and optimizer; the others must not read early
    info["losses_a"] = train(acc, model, opt, range(k, k + m))
    a = snapshot(model, opt)

    acc2 = make_accelerator()
    model2, opt2 = prepare_qmuon(acc2, tiny_model(1), **build_kwargs)
    acc2.load_state(ckpt)
    check_state_keys(model2, opt2)
    info["losses_b"] = train(acc2, model2, opt2, range(k, k + m))
    b = snapshot(model2, opt2)
    return a, b, info


@pytest.fixture
def fresh_accelerate():
    """Accelerate keeps process-wide singletons; each test builds its own configuration."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


# ---------------------------------------------------------------------------------------------- config checks
@pytest.mark.parametrize(
    "kind, kwargs, fragment",
    [
        ("DEEPSPEED", {"deepspeed_config": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}},
         "offload_optimizer"),
        ("DEEPSPEED", {"optimizer_has_state": True}, "must be fresh"),
        ("FSDP", {"fsdp_version": 1}, "fsdp_version=2"),
        ("MEGATRON_LM", {}, "plain local tensors"),
        ("XLA", {}, "XLA"),
        ("MULTI_GPU", {"tensor_parallel": True}, "FSDP2 only"),
        ("NO", {"mixed_precision": "fp8"}, "mixed_precision='bf16'"),
        ("SOME_FUTURE_TYPE", {}, "has not been tested"),
    ],
)
def test_refused_configurations_name_the_fix(kind: str, kwargs: dict, fragment: str) -> None:
    with pytest.raises(UnsupportedAccelerateConfig, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        check_configuration(kind, **kwargs)


@pytest.mark.parametrize("kind", ["NO", "MULTI_CPU", "MULTI_GPU", DistributedType.MULTI_CPU])
@pytest.mark.parametrize("mp", ["no", "bf16", "fp16"])
def test_supported_configurations_pass(kind: Any, mp: str) -> None:
    check_configuration(kind, mixed_precision=mp)


def test_fsdp2_needs_the_sharded_step_and_a_fresh_optimizer() -> None:
    if importlib.util.find_spec("qmuon.distributed") is None:
        with pytest.raises(UnsupportedAccelerateConfig, match="qmuon.distributed"):
            check_configuration("FSDP", fsdp_version=2)
        return
    check_configuration("FSDP", fsdp_version=2)
    with pytest.raises(UnsupportedAccelerateConfig, match="orphan"):
        check_configuration("FSDP", fsdp_version=2, optimizer_has_state=True)
    with pytest.warns(UserWarning, match="CPU offload"):
        check_configuration("FSDP", fsdp_version=2, fsdp_cpu_offload=True)


def test_prepare_qmuon_reads_the_accelerator_configuration(fresh_accelerate, monkeypatch) -> None:
    # No DeepSpeed accelerator can be built in this process without a launcher (Accelerate drops the
    # plugin with cpu=True), so the distributed type and plugin of a real Accelerator are set by hand
    # here; the DeepSpeed plugin itself trains in tests/test_deepspeed_accelerate.py.
    from types import SimpleNamespace

    acc = Accelerator(cpu=True)
    check_accelerator(acc)
    monkeypatch.setattr(acc.state, "distributed_type", DistributedType.DEEPSPEED)
    monkeypatch.setattr(acc.state, "deepspeed_plugins", SimpleNamespace(deepspeed_config={
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}), raising=False)
    model = tiny_model(0)
    with pytest.raises(UnsupportedAccelerateConfig, match="offload_optimizer"):
        prepare_qmuon(acc, model, verbose=False)
    assert acc._optimizers == [] and acc._models == []  # refused before anything was prepared


def test_prepare_qmuon_refuses_a_second_optimizer(fresh_accelerate) -> None:
    acc = Accelerator(cpu=True)
    model = tiny_model(0)
    with pytest.raises(TypeError, match="builds the optimizer itself"):
        prepare_qmuon(acc, model, torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)


# ---------------------------------------------------------------------------------------------- one process
def test_state_is_lazy_and_keyed_to_the_prepared_parameters(fresh_accelerate) -> None:
    acc = Accelerator(cpu=True)
    model, opt = prepare_qmuon(acc, tiny_model(0), state_format="int8", verbose=False)
    qm = unwrap_qmuon(opt)
    assert type(opt).__name__ == "AcceleratedOptimizer" and isinstance(qm, qmuon.QMuon)
    assert sum(len(s) for s in qm.state.values()) == 0, "state must not exist before the first step"
    group_params = [p for g in qm.param_groups for p in g["params"]]
    assert {id(p) for p in group_params} == {id(p) for p in model.parameters()}
    train(acc, model, opt, range(1))
    assert {id(p) for p in qm.state} == {id(p) for p in model.parameters()}  # every param had a grad
    for g in qm.param_groups:
        for p in g["params"]:
            st = qm.state[p]
            if g["use_muon"]:
                assert st["momentum_codes"].dtype == torch.int8 and st["momentum_codes"].shape == p.shape
            else:
                assert st["exp_avg"].shape == p.shape
    check_state_keys(model, opt)


def test_plain_prepare_recipe_works_too(fresh_accelerate) -> None:
    """The issue's one-liner, without the helper."""
    acc = Accelerator(cpu=True)
    model = tiny_model(0)
    model, opt = acc.prepare(model, qmuon.build_optimizer(model, verbose=False))
    losses = train(acc, model, opt, range(2))
    assert all(math.isfinite(v) for v in losses)
    check_state_keys(model, opt)


def test_check_state_keys_catches_swapped_parameters(fresh_accelerate) -> None:
    acc = Accelerator(cpu=True)
    model, opt = prepare_qmuon(acc, tiny_model(0), verbose=False)
    train(acc, model, opt, range(1))
    # What FSDP2's prepare does to an optimizer: replace the parameters in the groups in place.
    # State created before that is keyed by the old tensors.
    other = tiny_model(1)
    qm = unwrap_qmuon(opt)
    with pytest.raises(RuntimeError, match="not a parameter of the prepared model"):
        check_state_keys(other, opt)
    new = dict(zip((id(p) for p in model.parameters()), other.parameters()))
    for g in qm.param_groups:
        g["params"] = [new[id(p)] for p in g["params"]]
    with pytest.raises(RuntimeError, match="before Accelerator.prepare replaced the parameters"):
        check_state_keys(other, opt)


@pytest.mark.parametrize(
    "state_format, rounding, mixed_precision",
    [("int8", "stochastic", "no"), ("int8", "nearest", "bf16"), ("grasp4", "nearest", "no")],
)
def test_save_load_state_continues_bit_exact(fresh_accelerate, tmp_path, state_format, rounding, mixed_precision) -> None:
    autocast_dtypes: list[torch.dtype] = []

    def make() -> Accelerator:
        return Accelerator(cpu=True, mixed_precision=mixed_precision)

    a, b, info = resume_scenario(str(tmp_path / "ckpt"), make, state_format=state_format,
                                 state={"rounding": rounding})
    assert info["state_before_first_step"] == 0
    assert info["state_keys_are_live_params"]
    assert_same(a, b, "resumed vs uninterrupted")
    assert info["losses_a"] == info["losses_b"]
    # The checkpoint's optimizer file is plain tensors and primitives.
    sd = torch.load(tmp_path / "ckpt" / "optimizer.bin", weights_only=True)
    dtypes = {v.dtype for st in sd["state"].values() for v in st.values() if torch.is_tensor(v)}
    assert torch.int8 in dtypes and torch.float32 in dtypes
    assert all(g["state_format"] == state_format for g in sd["param_groups"] if g["use_muon"])
    # Quantized state keeps its storage dtypes under autocast: codes int8, scales fp32, params fp32.
    muon_codes = [v for k, v in a.items() if k.endswith("momentum_codes")]
    if state_format == "int8":
        assert muon_codes and all(v.dtype == torch.int8 for v in muon_codes)
        assert all(v.dtype == torch.float32 for k, v in a.items() if k.endswith("momentum_absmax"))
    assert all(v.dtype == torch.float32 for k, v in a.items() if k.startswith("param/"))
    if mixed_precision == "bf16":
        # Prove autocast really ran: a Linear output inside the prepared model is bf16.
        acc = make()
        model = tiny_model(0)
        model, _ = prepare_qmuon(acc, model, verbose=False)
        model.blocks[0].attn.proj.register_forward_hook(lambda m, i, o: autocast_dtypes.append(o.dtype))
        model(batch(0, 0)[0])
        assert autocast_dtypes == [torch.bfloat16]


# ---------------------------------------------------------------------------------------------- example
def _load_example():
    spec = importlib.util.spec_from_file_location("accelerate_train_example", REPO / "examples" / "accelerate_train.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_example_trains_and_resumes_bit_exact(fresh_accelerate, tmp_path) -> None:
    ex = _load_example()
    common = ["--steps", "6", "--save-every", "3", "--log-every", "3", "--d-model", "32", "--layers", "1",
              "--heads", "2", "--seq-len", "32", "--batch-size", "4", "--corpus-mb", "0.5", "--val-windows", "8",
              "--log-with", "none", "--cpu"]
    full = ex.main([*common, "--output-dir", str(tmp_path / "full")])
    assert (full.start_step, full.end_step) == (0, 6)
    assert full.final_val_loss < full.initial_val_loss  # 6 steps at lr 0.02 already move the model
    assert full.muon_state_bytes < 0.3 * full.fp32_momentum_bytes  # int8: 1 B + 4 B per 256 (+ partial blocks)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed = ex.main([*common, "--output-dir", str(tmp_path / "resumed"), "--resume",
                       str(tmp_path / "full" / "checkpoints" / "step_000003")])
    assert (resumed.start_step, resumed.end_step) == (3, 6)
    assert resumed.last_train_loss == full.last_train_loss
    from safetensors.torch import load_file

    fa, fb = (Path(r.last_checkpoint) for r in (full, resumed))
    wa, wb = load_file(fa / "model.safetensors"), load_file(fb / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa, ob = (torch.load(f / "optimizer.bin", weights_only=True) for f in (fa, fb))
    assert oa["state"].keys() == ob["state"].keys()
    for pid in oa["state"]:
        for key, v in oa["state"][pid].items():
            assert torch.equal(v, ob["state"][pid][key]), (pid, key)


def test_example_resume_latest_picks_the_newest_checkpoint(tmp_path) -> None:
    ex = _load_example()
    with pytest.raises(SystemExit, match="no checkpoint"):
        ex.resolve_resume("latest", str(tmp_path))
    for step in (3, 10, 9):
        (tmp_path / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    assert ex.resolve_resume("latest", str(tmp_path)).endswith("step_000010")
    with pytest.raises(SystemExit, match="no such checkpoint"):
        ex.resolve_resume(str(tmp_path / "missing"), str(tmp_path))


# ---------------------------------------------------------------------------------------------- 2 processes
def _torchrun(mode: str, out_dir: Path, nproc: int, extra: list[str] | None = None) -> list[dict[str, Any]]:
    """Run this file's worker under torchrun; return each rank's JSON report."""
    # Use the kernels this process already resolved: both ranks then load a built extension (or
    # the reference) instead of racing to build it.
    backend = "reference" if qmuon.ops.backend() == "reference" else os.environ.get("QMUON_BACKEND", "auto")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(Path(__file__).resolve()), "--worker", mode, "--out", str(out_dir), *(extra or [])]
    run_launcher(cmd, timeout=SUBPROCESS_TIMEOUT_S, env=subprocess_env(QMUON_BACKEND=backend),
                 what=f"torchrun worker '{mode}'")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def _check_fsdp2_report(rep: dict[str, Any], rank: int) -> None:
    assert rep["distributed_type"] == "FSDP" and rep["is_fsdp2"], rep
    assert rep["params_are_dtensors"] and rep["optimizer_params_are_model_params"]
    assert rep["state_before_prepare_step"] == 0 and rep["state_before_first_step"] == 0
    assert rep["state_keys_are_dtensors"] and rep["state_keys_are_live_params"]
    # Sharded vs one-process QMuon on the same global batches, after 3 steps. Two things differ by
    # design: FSDP2 reduce-scatters gradients in another summation order than one backward over the
    # concatenated batch (last-bit differences that can flip single int8 momentum codes), and the
    # distributed Newton-Schulz ships its input and output as int8 row-block codes by default
    # (QMuon comm_carrier / comm_return). Measured on CPU: lowest per-parameter update cosine 0.9976
    # (a 32x32 attention projection); 0.99 leaves room for GPU matmul rounding, while a wrong
    # shard, a missing all-reduce or a per-shard Newton-Schulz gives cosines far below it. The int8
    # carriers dominate, so the bound holds for either NS dtype: on an AMX Xeon 0.9981 with bf16 NS
    # and 0.9986 with fp32 NS (the same capped to AVX2: 0.9983 / 0.9986).
    assert rep["min_update_cosine_vs_reference"] >= 0.99, rep["update_cosines"]
    assert rep["mismatches"] == [], f"rank {rank}: resumed run differs: {rep['mismatches'][:5]}"
    assert rep["losses_a"] == rep["losses_b"]


@pytest.mark.slow
@pytest.mark.ns_equivalence
def test_two_processes_ddp_and_fsdp2_resume_bit_exact(tmp_path) -> None:
    """One ``torchrun --nproc_per_node 2`` launch on CPU (gloo): the DDP scenario with
    ``Accelerator(cpu=True)``, then the FSDP2 scenario with Accelerate's FSDP2 code forced on CPU
    (FULL_STATE_DICT and SHARDED_STATE_DICT checkpoints)."""
    reports = _torchrun("cpu", tmp_path, 2)
    ddp = [r["ddp"] for r in reports]
    for r, rep in enumerate(ddp):
        assert rep["distributed_type"] == "MULTI_CPU" and rep["num_processes"] == 2, rep
        assert rep["state_before_first_step"] == 0
        assert rep["state_keys_are_live_params"] and rep["state_entries"] > 0
        assert rep["mismatches"] == [], f"rank {r}: resumed run differs: {rep['mismatches'][:5]}"
        assert rep["losses_a"] == rep["losses_b"]
        assert rep["replicas_identical"], f"rank {r}: parameters differ across ranks (DDP gradients not synced?)"
        assert rep["optimizer_file_weights_only"] and rep["codes_dtype"] == "torch.int8"
    # The two ranks saw different data: their losses differ, yet their parameters are identical.
    assert ddp[0]["losses_a"] != ddp[1]["losses_a"]
    for sdt in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        for r, rep in enumerate(reports):
            _check_fsdp2_report(rep[f"fsdp2_{sdt}"], r)


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_fsdp2_through_accelerate_on_gpus(tmp_path, state_dict_type: str) -> None:
    """FSDP2 (fsdp_version=2) as Accelerate selects it: one process per GPU, at most 2."""
    nproc = min(2, torch.cuda.device_count())
    reports = _torchrun("fsdp2", tmp_path, nproc, ["--state-dict-type", state_dict_type])
    for r, rep in enumerate(reports):
        _check_fsdp2_report(rep[f"fsdp2_{state_dict_type}"], r)


# ---------------------------------------------------------------------------------------------- workers
def _worker_ddp(out: Path) -> dict[str, Any]:
    make = lambda: Accelerator(cpu=True)  # noqa: E731
    acc = make()
    ckpt = out / "ckpt"
    a, b, info = resume_scenario(str(ckpt), make, state_format="int8", state={"rounding": "stochastic"})
    rep: dict[str, Any] = {
        "distributed_type": acc.distributed_type.name, "num_processes": acc.num_processes,
        "mismatches": mismatches(a, b), **info,
    }
    flat = torch.cat([v.flatten().float() for k, v in sorted(a.items()) if k.startswith("param/")])
    gathered = [torch.empty_like(flat) for _ in range(acc.num_processes)]
    torch.distributed.all_gather(gathered, flat)
    rep["replicas_identical"] = all(torch.equal(gathered[0], g) for g in gathered)
    sd = torch.load(ckpt / "optimizer.bin", weights_only=True)
    rep["optimizer_file_weights_only"] = True
    rep["codes_dtype"] = str(next(v["momentum_codes"].dtype for v in sd["state"].values() if "momentum_codes" in v))
    return rep


def _fsdp2_accelerator(state_dict_type: str, force_on_cpu: bool) -> Accelerator:
    from accelerate.state import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"],
        state_dict_type=state_dict_type,
    )
    if not force_on_cpu:
        return Accelerator(fsdp_plugin=plugin)
    # Accelerate selects FSDP only on accelerators (with cpu=True it silently drops the plugin), but
    # its FSDP2 code (fully_shard, the in-place optimizer parameter swap, DCP / full-state
    # save_state and load_state) runs on CPU over gloo. Setting the distributed type by hand runs
    # that real code here; every new Accelerator / AcceleratedOptimizer re-reads the type from
    # PartialState, so both shared states are set.
    acc = Accelerator(cpu=True)
    acc.state.fsdp_plugin = plugin
    acc.state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP
    return acc


def _worker_fsdp2(out: Path, state_dict_type: str, force_on_cpu: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    make = lambda: _fsdp2_accelerator(state_dict_type, force_on_cpu)  # noqa: E731
    acc = make()
    rep: dict[str, Any] = {"distributed_type": acc.distributed_type.name, "is_fsdp2": bool(acc.is_fsdp2)}
    # prepare swaps the optimizer's parameters for DTensors; compare the sharded run with
    # one-process QMuon on the same global batches.
    ref_model = tiny_model(0).to(acc.device)
    ref_opt = qmuon.build_optimizer(ref_model, verbose=False)
    init = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    model, opt = prepare_qmuon(acc, tiny_model(0), verbose=False)
    qm = unwrap_qmuon(opt)
    rep["params_are_dtensors"] = all(isinstance(p, DTensor) for p in model.parameters())
    live = {id(p) for p in model.parameters()}
    rep["optimizer_params_are_model_params"] = all(id(p) in live for g in qm.param_groups for p in g["params"])
    rep["state_before_prepare_step"] = sum(len(s) for s in qm.state.values())
    steps = 3
    train(acc, model, opt, range(steps))
    check_state_keys(model, opt)
    rep["state_keys_are_dtensors"] = len(qm.state) > 0 and all(isinstance(p, DTensor) for p in qm.state)
    for s in range(steps):  # the reference sees every rank's batch: the mean loss of the global batch
        xs, ys = zip(*(batch(s, r, acc.device) for r in range(acc.num_processes)))
        logits = ref_model(torch.cat(xs))
        F.cross_entropy(logits.float().reshape(-1, VOCAB), torch.cat(ys).reshape(-1)).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    ref_params = dict(ref_model.named_parameters())
    cos = {}
    for n, p in model.named_parameters():
        ours = (_full(p.detach()) - init[n]).flatten().float()
        ref = (ref_params[n].detach() - init[n]).flatten().float()
        cos[n] = float(F.cosine_similarity(ours, ref, dim=0))
    rep["update_cosines"] = cos
    rep["min_update_cosine_vs_reference"] = min(cos.values())
    a, b, info = resume_scenario(str(out / f"ckpt_{state_dict_type}"), make, state={"rounding": "stochastic"})
    rep.update(info)
    rep["mismatches"] = mismatches(a, b)
    return rep


def _worker_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True, choices=["cpu", "fsdp2"])
    p.add_argument("--out", required=True)
    p.add_argument("--state-dict-type", default="FULL_STATE_DICT")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    if args.worker == "cpu":  # DDP, then FSDP2 forced on CPU with both checkpoint layouts, in one launch
        rep = {"ddp": _worker_ddp(out)}
        for sdt in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            rep[f"fsdp2_{sdt}"] = _worker_fsdp2(out, sdt, force_on_cpu=True)
    else:
        rep = {f"fsdp2_{args.state_dict_type}": _worker_fsdp2(out, args.state_dict_type, force_on_cpu=False)}
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps(rep, default=str))
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()  # see its docstring


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
