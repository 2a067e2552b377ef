"""Accelerate 1.15 + FSDP2 + tensor parallelism (issue 22): ``ParallelismConfig(dp_shard_size=2,
tp_size=2)`` on 4 gloo CPU processes, a tiny Hugging Face ``LlamaForCausalLM`` (built locally) with
transformers' own TP plan, ``prepare_qmuon``.

What was observed with the installed versions (Accelerate 1.15.0, transformers 5.24):

- ``Accelerator._prepare_tp`` (the FSDP2 branch) imports ``ReplicateParallel`` from
  ``transformers.integrations.tensor_parallel``, which transformers 5 removed: ``prepare`` raises
  ``ImportError`` for any optimizer. ``prepare_qmuon`` refuses that pair up front, naming the
  Lightning / Fabric route (:func:`test_prepare_qmuon_names_the_accelerate_transformers_blocker`).
- ``from_pretrained(path, tp_plan="auto", device_mesh=mesh["tp"])`` ignores ``device_mesh`` and
  shards over a ``tp`` mesh of all 4 ranks, which FSDP2 cannot stack ``dp_shard`` on
  ("Cannot concatenate overlapping meshes"); ``prepare_qmuon`` names that and the fix
  (``apply_tensor_parallelism`` on the accelerator's ``tp`` mesh).

To check QMuon's side of the path that works once Accelerate and transformers agree, the slow test
puts back a ``ReplicateParallel`` written as transformers 4.5x defined it (inputs made ``Replicate``
DTensors on the ``tp`` mesh, outputs made local; Accelerate uses it for the norms) and applies
transformers' TP plan with ``apply_tensor_parallelism`` on Accelerate's ``tp`` mesh. Then
Accelerate's own ``fully_shard`` makes colwise weights ``(_StridedShard(0, sf=2), Shard(0))``,
rowwise ones ``(Shard(0), Shard(1))`` and the norms ``(Shard(0), Replicate())``, and with bf16
carriers every step's parameters and QMuon state equal single-process QMuon's on the same
gradients bit for bit (as tests/test_tensor_parallel.py checks for Lightning and Fabric).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import qmuon  # noqa: E402
from qmuon.integrations.accelerate import (  # noqa: E402
    UnsupportedAccelerateConfig,
    accelerate_tp_blocker,
    check_configuration,
)
from test_tensor_parallel import BF16_WIRE, KW, batch, full, make_llama  # noqa: E402


def _has_replicate_parallel() -> bool:
    from transformers.integrations import tensor_parallel as hf_tp

    return hasattr(hf_tp, "ReplicateParallel")


def test_prepare_qmuon_names_the_accelerate_transformers_blocker() -> None:
    """FSDP2 + TP: refused exactly when the installed transformers lacks the class Accelerate's
    ``_prepare_tp`` imports; TP without FSDP2 is always refused."""
    with pytest.raises(UnsupportedAccelerateConfig, match="FSDP2 only"):
        check_configuration("MULTI_GPU", tensor_parallel=True)
    if _has_replicate_parallel():
        assert accelerate_tp_blocker() == ""
        check_configuration("FSDP", fsdp_version=2, tensor_parallel=True)
        return
    with pytest.raises(UnsupportedAccelerateConfig) as e:
        check_configuration("FSDP", fsdp_version=2, tensor_parallel=True)
    msg = str(e.value)
    for part in ("ReplicateParallel", "_prepare_tp", "ImportError", "QMuonFSDPStrategy(data_parallel_size=D, "
                 "tensor_parallel_size=T)", "QMuonFabricStrategy(parallelize_fn=", "tp_size=1"):
        assert part in msg, (part, msg)


def _install_replicate_parallel() -> None:
    """transformers 4.5x's ``ReplicateParallel`` (what Accelerate 1.15 imports): the module's
    parameters are already ``Replicate`` DTensors on the tp mesh (Accelerate makes them); inputs
    become ``Replicate`` DTensors, outputs local tensors."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from transformers.integrations import tensor_parallel as hf_tp

    class ReplicateParallel:
        def prepare_module_tp(self, module: torch.nn.Module, mesh: Any) -> torch.nn.Module:
            def inputs(mod: Any, args: tuple, mesh: Any) -> tuple:
                x = args[0]
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                    x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                return (x, *args[1:])

            def outputs(mod: Any, out: Any, mesh: Any) -> Any:
                return out.to_local() if isinstance(out, DTensor) else out

            return distribute_module(module, mesh, input_fn=inputs, output_fn=outputs)

    if not hasattr(hf_tp, "ReplicateParallel"):  # a transformers that has it again is used as it is
        hf_tp.ReplicateParallel = ReplicateParallel


def _accelerator() -> Any:
    """Accelerate's (dp_shard 2, tp 2) mesh with FSDP2; the distributed type is forced to FSDP on
    CPU and the config attached as tests/test_hsdp.py does (Accelerate builds its mesh for FSDP2 or
    GPU only), then checked by Accelerate's own validation."""
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    acc.state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP
    pc = ParallelismConfig(dp_shard_size=2, tp_size=2)
    acc.state.parallelism_config = pc
    acc.state.device_mesh = pc.get_device_mesh(acc.device.type)
    pc._validate_accelerator(acc)
    return acc


def _main(out: Path) -> None:
    import os

    import torch.distributed as dist
    from transformers import LlamaForCausalLM
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from qmuon.integrations.accelerate import prepare_qmuon, unwrap_qmuon

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    res: dict[str, Any] = {}
    acc = _accelerator()
    # from_pretrained's tp_plan path: its own tp mesh over all 4 ranks, refused with the fix
    if rank == 0:
        make_llama().save_pretrained(out / "llama")
    dist.barrier()
    loaded = LlamaForCausalLM.from_pretrained(out / "llama", tp_plan="auto", device_mesh=acc.torch_device_mesh["tp"])
    res["from_pretrained_mesh"] = str(loaded.model.layers[0].self_attn.q_proj.weight.device_mesh)
    _install_replicate_parallel()
    try:
        prepare_qmuon(acc, loaded, **KW)
        res["from_pretrained_error"] = ""
    except UnsupportedAccelerateConfig as e:
        res["from_pretrained_error"] = str(e)
    del loaded

    acc = _accelerator()
    model = make_llama()
    apply_tensor_parallelism(model, acc.torch_device_mesh["tp"], model._expand_parallel_plan(model._tp_plan))
    kw = dict(KW, state_format="int8", **BF16_WIRE)
    model, opt = prepare_qmuon(acc, model, **kw)
    qm = unwrap_qmuon(opt)
    whole = make_llama()
    o_whole = qmuon.build_optimizer(whole, **kw)
    wp = dict(whole.named_parameters())
    named = {n.removeprefix("module."): p for n, p in model.named_parameters()}
    res["placements"] = {n: str(tuple(p.placements)) for n, p in named.items()}
    res.update(params_equal=[], state_equal=[], losses=[])
    ids = batch(rank // 2)  # one batch per data-parallel rank, the same on both tp ranks
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        res["losses"].append(float(loss.detach()))
        for n, p in named.items():
            wp[n].grad = full(p.grad).clone()
        opt.step()
        o_whole.step()
        opt.zero_grad(set_to_none=True)
        o_whole.zero_grad()
        res["params_equal"].append({n: torch.equal(full(named[n]), p.detach()) for n, p in wp.items()})
        res["state_equal"].append({
            n: all(torch.equal(full(v), o_whole.state[p][k]) for k, v in qm.state[named[n]].items())
            for n, p in wp.items() if p in o_whole.state})
    res["muon"] = sorted(n for g in qm.param_groups if g["use_muon"] for n in g["param_names"])
    res["stats"] = dict(qm.comm_stats)
    torch.save(res, out / f"rank{rank}.pt")
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()


@pytest.mark.slow
def test_accelerate_fsdp2_tp_matches_single_process(tmp_path: Path) -> None:
    from _dist import run_launcher, subprocess_env, torchrun_cmd

    cmd = torchrun_cmd(4, Path(__file__).resolve(), "--worker", str(tmp_path))
    run_launcher(cmd, timeout=300, env=subprocess_env(PYTHONWARNINGS="ignore"), what="4-process Accelerate FSDP2 x TP")
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    r0 = res[0]
    assert "tp=4" in r0["from_pretrained_mesh"], r0["from_pretrained_mesh"]  # transformers' own mesh, not ours
    assert "apply_tensor_parallelism" in r0["from_pretrained_error"], r0["from_pretrained_error"]
    pl = r0["placements"]
    assert pl["model.layers.0.self_attn.q_proj.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", pl
    assert pl["model.layers.0.mlp.down_proj.weight"] == "(Shard(dim=0), Shard(dim=1))", pl
    assert pl["model.layers.0.input_layernorm.weight"] == "(Shard(dim=0), Replicate())", pl
    assert "model.layers.0.self_attn.o_proj.weight" in r0["muon"] and "model.norm.weight" not in r0["muon"], r0["muon"]
    for r, out in enumerate(res):
        for step, (eq, st) in enumerate(zip(out["params_equal"], out["state_equal"])):
            assert eq and all(eq.values()), (r, step, [n for n, ok in eq.items() if not ok])
            assert st and all(st.values()), (r, step, [n for n, ok in st.items() if not ok])
        assert out["losses"][-1] < out["losses"][0], out["losses"]  # it trains
    shares = [out["stats"]["ns_share"] for out in res]
    assert abs(sum(shares) - 1.0) < 1e-9 and max(shares) <= 0.25 * 1.25, shares


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _main(Path(sys.argv[2]))
    else:
        sys.exit(f"usage: {sys.argv[0]} --worker OUT")
