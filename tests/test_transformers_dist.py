"""QMuonFactory under ``transformers.Trainer`` on 2 gloo CPU processes (torchrun), through
``TrainingArguments`` alone: DDP, and FSDP2 (``fsdp=True``, ``fsdp_config={"fsdp_version": 2, ...}``).

FSDP on CPU: Accelerate's ``AcceleratorState`` sets ``DistributedType.FSDP`` only when the process
group runs on an accelerator (``MULTI_GPU``, ``MULTI_XPU``, ...; not ``MULTI_CPU``), so with
``use_cpu=True`` the Trainer's FSDP plugin is dropped without a word and training runs as DDP. The
FSDP2 scenario here asserts that first, then sets the distributed type by hand right after the
Trainer builds its ``Accelerator`` (what tests/test_accelerate.py does for Accelerate alone): from there
on, every step is the Trainer's and Accelerate's own FSDP2 code (``fully_shard``, the in-place swap
of the optimizer's parameters for DTensors, the Trainer's FSDP checkpointing and
``resume_from_checkpoint``), on gloo.

DeepSpeed ZeRO 2 and 3 (``deepspeed={...}``, without ``use_cpu``: Accelerate drops DeepSpeed under
``use_cpu=True``; DeepSpeed's CPU accelerator then runs it over gloo): QMuonFactory returns the
whole-matrix ZeRO client optimizer, which attaches to DeepSpeed's ZeRO optimizer by itself; a plain
QMuon handed to DeepSpeed by a naive factory refuses its first step.

Checked per rank: the optimizer and its state hold the model's parameters (DTensors under FSDP2);
6 steps + ``resume_from_checkpoint`` + 6 steps equal 12 uninterrupted steps bit for bit (parameters
and QMuon's state as each rank holds it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers") if __name__ != "__main__" else __import__("transformers")

import qmuon  # noqa: E402
from _dist import free_port, run_launcher, subprocess_env  # noqa: E402
from _helpers import assert_same  # noqa: E402

SUBPROCESS_TIMEOUT_S = 420


def _torchrun(mode: str, out: Path) -> list[dict[str, Any]]:
    backend = "reference" if qmuon.ops.backend() == "reference" else os.environ.get("QMUON_BACKEND", "auto")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(Path(__file__).resolve()), "--worker", mode, "--out", str(out)]
    run_launcher(cmd, timeout=SUBPROCESS_TIMEOUT_S, env=subprocess_env(QMUON_BACKEND=backend),
                 what=f"torchrun Trainer worker '{mode}'")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_fsdp2_through_training_arguments_resumes_bit_identically(tmp_path) -> None:
    for r, rep in enumerate(_torchrun("fsdp2", tmp_path)):
        assert rep["plugin_dropped_on_cpu"], "Accelerate applied FSDP on CPU by itself: update the docs and this test"
        assert rep["is_fsdp2"] and rep["params_are_dtensors"], rep
        assert rep["optimizer_params_are_model_params"] and rep["state_keys_are_dtensors"], rep
        assert rep["mismatches"] == [], f"rank {r}: {rep['mismatches'][:5]}"
        assert rep["global_step"] == 12 and rep["losses_equal"], rep
        assert rep["routing_on_wrapped_equal"] and rep["routing_on_wrapped_dtensors"], rep


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_through_training_arguments_resumes_bit_identically(tmp_path, stage: int) -> None:
    """TrainingArguments(deepspeed={... stage ...}) without use_cpu: DeepSpeed's CPU accelerator over gloo."""
    pytest.importorskip("deepspeed")
    for r, rep in enumerate(_torchrun(f"zero{stage}", tmp_path)):
        assert rep["zero_wrapper"] == ("DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer")
        assert rep["attached"] == ("zero3" if stage == 3 else "partitioned"), rep
        assert rep["muon_items"] == 7, rep  # 14 hidden matrices, whole, half of them orthogonalized per rank
        assert rep["mismatches"] == [], f"rank {r}: {rep['mismatches'][:5]}"
        assert rep["global_step"] == 12 and rep["losses_equal"], rep
        assert rep["naive_error"] and "no longer holds the matrices it was routed with" in rep["naive_error"], rep
        assert rep.get("partitioned", stage != 3), rep  # stage 3: the model reached the factory partitioned


@pytest.mark.slow
def test_ddp_through_training_arguments_resumes_bit_identically(tmp_path) -> None:
    for r, rep in enumerate(_torchrun("ddp", tmp_path)):
        assert not rep["is_fsdp2"] and not rep["params_are_dtensors"], rep
        assert rep["mismatches"] == [], f"rank {r}: {rep['mismatches'][:5]}"
        assert rep["global_step"] == 12 and rep["replicas_equal"], rep


# ------------------------------------------------------------------------------------------ worker
def _force_fsdp_on_cpu() -> None:
    """Make the Trainer's Accelerator keep its FSDP plugin on CPU (see the module docstring)."""
    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    class CPUFSDPAccelerator(accelerate.Accelerator):
        def __init__(self, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, fsdp_plugin=fsdp_plugin, **kwargs)
            if fsdp_plugin is not None and getattr(self.state, "fsdp_plugin", None) is None:
                CPUFSDPAccelerator.dropped = True
                self.state.fsdp_plugin = fsdp_plugin
                self.state.distributed_type = DistributedType.FSDP
                PartialState().distributed_type = DistributedType.FSDP

    CPUFSDPAccelerator.dropped = False
    transformers.trainer.Accelerator = CPUFSDPAccelerator
    return CPUFSDPAccelerator


def zero_of(tr: Any) -> Any:
    """The WholeMatrixZeroOptimizer inside the Trainer's DeepSpeed optimizer."""
    from qmuon.integrations.deepspeed import WholeMatrixZeroOptimizer

    opt = tr.optimizer
    while not isinstance(opt, WholeMatrixZeroOptimizer):
        opt = opt.optimizer
    return opt


def _worker(mode: str, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_transformers_trainer import Tokens, qmuon_of, tiny_lm

    from qmuon.integrations.transformers import QMuonFactory

    torch.set_num_threads(1)
    forced = _force_fsdp_on_cpu() if mode == "fsdp2" else None
    extra: dict[str, Any] = dict(use_cpu=True)
    if mode == "fsdp2":
        extra.update(fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    if mode.startswith("zero"):
        from qmuon.integrations.deepspeed import avoid_cpu_op_builds

        avoid_cpu_op_builds()  # DeepSpeed's CPU accelerator would JIT-build an inference kernel (~50 s)
        # Accelerate drops DeepSpeed under use_cpu=True (AcceleratorState: "ACCELERATE_USE_DEEPSPEED ... and
        # not cpu"); on a machine without GPUs DeepSpeed's CPU accelerator runs it on CPU over gloo.
        extra = dict(use_cpu=False, deepspeed={
            "zero_optimization": {"stage": int(mode[-1])}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "communication_data_type": "fp32"})

    def run(sub: str, resume: str | None = None) -> Any:
        args = transformers.TrainingArguments(
            output_dir=str(out / sub), per_device_train_batch_size=2, max_steps=12, learning_rate=2e-3,
            warmup_steps=2, lr_scheduler_type="cosine", weight_decay=0.01, report_to=[],
            save_strategy="steps", save_steps=6, logging_steps=1, seed=0, data_seed=0, disable_tqdm=True,
            dataloader_num_workers=0, ddp_backend="gloo", **extra)
        model = tiny_lm()
        if mode == "zero3":
            # As from_pretrained / from_config build it under a ZeRO-3 config: inside deepspeed.zero.Init,
            # every parameter an empty 1-D tensor between uses (its shape in ds_shape); the plain model's
            # weights are copied in, so that both runs start alike.
            import deepspeed

            part = type(model)._from_config(model.config)  # under the registered ZeRO-3 config: zero.Init
            rep_init["partitioned"] = all(p.numel() == 0 and hasattr(p, "ds_shape") for p in part.parameters())
            for p, q in zip(part.parameters(), model.parameters()):
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    if dist.get_rank() == 0:
                        p.data.copy_(q.data)
            model = part
        tr = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                  optimizer_cls_and_kwargs=(QMuonFactory, {"args": args, "verbose": False}))
        tr.train(resume_from_checkpoint=resume)
        return tr

    rank = int(os.environ["RANK"])
    rep_init: dict[str, Any] = {}
    a = run("a")
    b = run("b", resume=str(out / "a" / "checkpoint-6"))
    qa, qb = (qmuon_of(a), qmuon_of(b)) if not mode.startswith("zero") else (zero_of(a), zero_of(b))
    params = list(a.model.parameters())
    rep: dict[str, Any] = {
        "plugin_dropped_on_cpu": bool(forced is not None and forced.dropped),
        "is_fsdp2": bool(a.is_fsdp_enabled),
        "params_are_dtensors": all(isinstance(p, DTensor) for p in params),
        "optimizer_params_are_model_params": {id(p) for g in qa.param_groups for p in g["params"]}
        <= {id(p) for p in params},
        "state_keys_are_dtensors": len(qa.state) > 0 and all(isinstance(p, DTensor) for p in qa.state),
        "global_step": b.state.global_step,
        **rep_init,
    }

    def local_sd(tr: Any) -> dict[str, torch.Tensor]:
        return {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
                for k, v in tr.model.state_dict().items()}

    mismatches = []
    for what, x, y in (("model", local_sd(a), local_sd(b)), ("optimizer", qa.state_dict(), qb.state_dict())):
        try:
            assert_same(x, y, what)
        except AssertionError as e:
            mismatches.append(str(e))
    rep["mismatches"] = mismatches
    la = [h["loss"] for h in a.state.log_history if "loss" in h][6:]
    lb = [h["loss"] for h in b.state.log_history if "loss" in h][-6:]
    rep["losses_equal"] = la == lb and len(la) == 6
    if mode == "fsdp2":
        # The factory on the model as FSDP2 left it (DTensor parameters; what the Trainer hands over when
        # it creates the optimizer after wrapping): the same routing as on the plain model.
        def routed(opt: Any) -> dict[str, bool]:
            return {n: bool(g["use_muon"]) for g in opt.param_groups for n in g["param_names"]}

        again = QMuonFactory()(a.model, verbose=False)
        rep["routing_on_wrapped_equal"] = routed(again) == routed(qa) and len(routed(qa)) == len(params)
        rep["routing_on_wrapped_dtensors"] = all(isinstance(p, DTensor) for g in again.param_groups
                                                 for p in g["params"])
    if mode.startswith("zero"):
        # The naive factory (plain QMuon as DeepSpeed's client optimizer): its groups get flat 1-D
        # partitions, and its first step must refuse them instead of running non-Muon maths.
        class Naive:
            def __call__(self, model: torch.nn.Module, **kw: Any) -> qmuon.QMuon:
                return qmuon.build_optimizer(model, verbose=False, **kw)

        args = transformers.TrainingArguments(output_dir=str(out / "naive"), per_device_train_batch_size=2,
                                              max_steps=2, report_to=[], save_strategy="no", disable_tqdm=True,
                                              ddp_backend="gloo", **extra)
        try:
            transformers.Trainer(model=tiny_lm(), args=args, train_dataset=Tokens(),
                                 optimizer_cls_and_kwargs=(Naive, {})).train()
            rep["naive_error"] = None
        except RuntimeError as e:
            rep["naive_error"] = str(e)
        rep["zero_wrapper"] = type(a.model_wrapped.optimizer).__name__
        rep["attached"] = qa._mode
        rep["muon_items"] = sum(qa.ns_items.values()) if qa.ns_items else 0
    if mode == "ddp":  # every rank holds the whole model: the replicas agree
        flat = torch.cat([p.detach().reshape(-1) for p in a.model.parameters()])
        other = flat.clone()
        dist.broadcast(other, 0)
        rep["replicas_equal"] = bool(torch.equal(flat, other))
    (out / f"rank{rank}.json").write_text(json.dumps(rep))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=["fsdp2", "ddp", "zero0", "zero1", "zero2", "zero3"], required=True)
    ap.add_argument("--out", type=Path, required=True)
    ns = ap.parse_args()
    _worker(ns.worker, ns.out)
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()  # gloo's threads can abort Python's finalization (exit status -6)
