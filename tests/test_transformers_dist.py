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

Checked per rank: the optimizer and its state hold the model's DTensor parameters; 6 steps +
``resume_from_checkpoint`` + 6 steps equal 12 uninterrupted steps bit for bit (parameters and QMuon's
sharded state).
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
from _helpers import assert_same, free_port, run_launcher, subprocess_env  # noqa: E402

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


def _worker(mode: str, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_transformers_trainer import Tokens, qmuon_of, tiny_lm

    from qmuon.integrations.transformers import QMuonFactory

    torch.set_num_threads(1)
    forced = _force_fsdp_on_cpu() if mode == "fsdp2" else None
    extra: dict[str, Any] = {}
    if mode == "fsdp2":
        extra = dict(fsdp=True, fsdp_config={"fsdp_version": 2,
                                                     "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})

    def run(sub: str, resume: str | None = None) -> Any:
        args = transformers.TrainingArguments(
            output_dir=str(out / sub), per_device_train_batch_size=2, max_steps=12, learning_rate=2e-3,
            warmup_steps=2, lr_scheduler_type="cosine", weight_decay=0.01, report_to=[], use_cpu=True,
            save_strategy="steps", save_steps=6, logging_steps=1, seed=0, data_seed=0, disable_tqdm=True,
            dataloader_num_workers=0, ddp_backend="gloo", **extra)
        tr = transformers.Trainer(model=tiny_lm(), args=args, train_dataset=Tokens(),
                                  optimizer_cls_and_kwargs=(QMuonFactory, {"args": args, "verbose": False}))
        tr.train(resume_from_checkpoint=resume)
        return tr

    rank = int(os.environ["RANK"])
    a = run("a")
    b = run("b", resume=str(out / "a" / "checkpoint-6"))
    qa, qb = qmuon_of(a), qmuon_of(b)
    params = list(a.model.parameters())
    rep: dict[str, Any] = {
        "plugin_dropped_on_cpu": bool(forced is not None and forced.dropped),
        "is_fsdp2": bool(a.is_fsdp_enabled),
        "params_are_dtensors": all(isinstance(p, DTensor) for p in params),
        "optimizer_params_are_model_params": {id(p) for g in qa.param_groups for p in g["params"]}
        <= {id(p) for p in params},
        "state_keys_are_dtensors": len(qa.state) > 0 and all(isinstance(p, DTensor) for p in qa.state),
        "global_step": b.state.global_step,
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
    if mode == "ddp":  # every rank holds the whole model: the replicas agree
        flat = torch.cat([p.detach().reshape(-1) for p in a.model.parameters()])
        other = flat.clone()
        dist.broadcast(other, 0)
        rep["replicas_equal"] = bool(torch.equal(flat, other))
    (out / f"rank{rank}.json").write_text(json.dumps(rep))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=["fsdp2", "ddp"], required=True)
    ap.add_argument("--out", type=Path, required=True)
    ns = ap.parse_args()
    _worker(ns.worker, ns.out)
