"""Host reads per optimizer step under sharding: FSDP2, HSDP, FSDP x TP and DeepSpeed ZeRO-2.

The single-device step reads nothing back (tests/test_host_reads.py). A sharded step must read what
its collectives decide: which parameters every rank skips (sharded steps leave a skipped parameter
out of the Newton-Schulz exchange instead of passing device flags to the kernels), and, under HSDP,
the sizes of the buffers the replicas share. This file counts those reads with the same wrapping
technique (every ``item`` / ``tolist`` / ``__bool__`` / ``__int__`` / ``__float__`` / ``__index__`` /
``cpu`` / ``numpy`` of a tensor during ``optimizer.step()`` / ``engine.step()``; the CPU ``step``
counters exempt) and names where each happens: the two innermost frames of qmuon or DeepSpeed code
(file and function, not line, so that edits elsewhere in a file do not move the key).

The figures asserted here are the ones in docs/distributed.md and docs/deepspeed.md ("Host reads per
optimizer step"). A new read in the step, or one that disappears, fails the test: update the table
and the figures below together.

Steps counted: 2 (steady state: the state exists, the layout is cached), 3 (a NaN in one
parameter's gradient), 4 (steady again), 5 (every gradient NaN: ``loss * nan``). One launch of 2
gloo processes runs three layouts (FSDP2 on a mesh of 2, HSDP on a 2 x 1 ``(replicate, shard)``
mesh, FSDP x TP on a 1 x 2 ``(dp, tp)`` mesh), one of 4 processes the 2 x 2 HSDP and FSDP x TP
meshes; one ``torch.distributed.run`` launch runs DeepSpeed ZeRO-2 (this file is its worker:
``python tests/test_host_reads_sharded.py --ds-worker OUT [--stage N]``). The layouts' figures follow one
formula (:func:`expected_reads`), asserted site by site; the totals are the docs' table.

``python tests/test_host_reads_sharded.py --table`` prints the per-step reads of the FSDP2 / HSDP /
TP layouts, by site (about 20 s on 2 cores).
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _dist import REPO, run_launcher, run_workers, subprocess_env, torchrun_cmd
from test_host_reads import HostReads, Net

sys.path.insert(0, str(REPO))

pytestmark = pytest.mark.slow

_QMUON = str(REPO / "qmuon") + os.sep

# ----------------------------------------------------------------------------- the read sites
#: The reads, keyed "innermost library frame <- its caller" (file relative to the repository or
#: site-packages, and function). Line numbers as of this file's commit are in the docs' table.
FLAGS = "qmuon/core/pipeline.py:finite_flags <- qmuon/optim/qmuon.py:_updatable_params"
AGREE = "qmuon/distributed/orthogonalize.py:agree_on_updates <- qmuon/optim/qmuon.py:_updatable_params"
SIZES = "qmuon/distributed/orthogonalize.py:_share_replicas <- qmuon/distributed/orthogonalize.py:finish"
DS_FLAGS = "qmuon/core/pipeline.py:finite_flags <- qmuon/distributed/flat_step.py:_finite_params"
DS_AGREED = "qmuon/distributed/flat_step.py:_finite_params <- qmuon/distributed/flat_step.py:_flat_step"
DS_ENGINE = "deepspeed/runtime/utils.py:is_invalid_grad_norm <- deepspeed/runtime/zero/stage_1_and_2.py:step"


def _frame_key(filename: str, func: str) -> str | None:
    if filename.startswith(_QMUON):
        return f"{os.path.relpath(filename, REPO)}:{func}"
    at = filename.find(os.sep + "deepspeed" + os.sep)
    if at >= 0:
        return f"{filename[at + 1:]}:{func}"
    return None


def _site() -> str:
    """Where the read happens: the two innermost qmuon / DeepSpeed frames (comprehension frames
    skipped), or the innermost frame when none is library code."""
    stack = traceback.extract_stack()[:-2]  # without _site and the wrapper
    keys = [k for f in reversed(stack) if not f.name.startswith("<")
            and (k := _frame_key(f.filename, f.name)) is not None]
    if not keys:
        f = stack[-1]
        return f"other: {f.filename}:{f.lineno}:{f.name}"
    return " <- ".join(keys[:2])


class SiteReads(HostReads):
    """Counts host reads of tensors not in ``exempt`` (by identity) while active, by (site, method)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[tuple[str, str]] = collections.Counter()  # type: ignore[assignment]

    def record(self, name: str, t: torch.Tensor) -> None:
        self.seen[(_site(), name)] += 1

    def take(self) -> dict[str, int]:
        """This step's reads as ``{"site method": count}``; resets the count."""
        out = {f"{site} {name}": n for (site, name), n in sorted(self.seen.items())}
        self.seen.clear()
        return out


def _exempt(opt) -> list[torch.Tensor]:
    return [st["step"] for st in opt.state.values() if "step" in st] + opt._nonfinite.staged()


# ----------------------------------------------------------------------------- FSDP2 / HSDP / TP
class TPNet(nn.Module):
    """An embedding, two MLP blocks (up colwise, down rowwise: bias-free, as TP plans keep them) and a head."""

    def __init__(self, vocab: int = 64, d: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.up0, self.down0 = nn.Linear(d, hidden, bias=False), nn.Linear(hidden, d, bias=False)
        self.up1, self.down1 = nn.Linear(d, hidden, bias=False), nn.Linear(hidden, d, bias=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.down0(torch.relu(self.up0(h)))
        h = h + self.down1(torch.relu(self.up1(h)))
        return self.head(h)


def _build(layout: str, world: int):
    """(model, name of the matrix whose gradient gets a NaN in step 3, ranks that put it there,
    data-parallel index of this rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    rank = torch.distributed.get_rank()
    if layout == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        dp = world // 2 if world > 2 else 1
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
        model = TPNet()
        parallelize_module(model, mesh["tp"], {"up0": ColwiseParallel(), "down0": RowwiseParallel(),
                                               "up1": ColwiseParallel(), "down1": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return model, "up0.weight", {world - 1}, mesh["dp"].get_local_rank()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        nan_ranks = {world - 1}  # one rank's rows: the agreement makes every rank skip the matrix
        dp_index = rank
    else:  # hsdp: 2 x 1 on 2 processes, 2 x 2 on 4
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        # replicas hold the same (all-reduced) gradient: a NaN reaches every replica
        nan_ranks = set(range(world))
        dp_index = rank
    model = Net()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, "blocks.1.0.weight", nan_ranks, dp_index


def _count_layout(layout: str, world: int, steps: int = 6) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    import qmuon

    model, nan_param, nan_ranks, dp_index = _build(layout, world)
    rank = torch.distributed.get_rank()
    kw = {"state": {"block_size": 32}} if layout == "tp" else {}
    opt = qmuon.build_optimizer(model, lr=0.02, adamw_lr=1e-3, verbose=False, **kw)
    counter = SiteReads()
    x = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(dp_index))
    per_step, nonfinite_local = [], []
    for step in range(steps):
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        if step == 5:
            loss = loss * float("nan")
        loss.backward()
        if step == 3 and rank in nan_ranks:
            g = dict(model.named_parameters())[nan_param].grad
            (g.to_local() if isinstance(g, DTensor) else g).fill_(float("nan"))
        # this rank's gradients that are not finite (read here, outside the count)
        nonfinite_local.append(sum(
            1 for p in model.parameters() if p.grad is not None
            and not bool(torch.isfinite(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).all())))
        with counter.counting(_exempt(opt)) if step >= 2 else contextlib.nullcontext():
            opt.step()
        opt.zero_grad()
        per_step.append(counter.take())
    return {"per_step": per_step, "nonfinite_local": nonfinite_local, "exempt_reads": counter.exempt_reads,
            "skips": opt.nonfinite_skips, "skipped_steps": opt.nonfinite_skipped_steps,
            "params": len(list(model.parameters()))}


def _worker(rank: int, world: int, layouts: tuple[str, ...]) -> dict[str, Any]:
    return {layout: _count_layout(layout, world) for layout in layouts}


def expected_reads(layout: str, world: int, step: int, nonfinite_local: int) -> dict[str, int]:
    """The documented reads of one optimizer step on one rank (docs/distributed.md, "Host reads per
    optimizer step"): ``nonfinite_local`` is the number of this rank's gradients (local shards) that
    are not finite."""
    replicas = 2 if layout == "hsdp" else 1
    shard_world = world // replicas
    out = {f"{FLAGS} tolist": 1}  # this rank's finite flags, read before the all-reduce
    if nonfinite_local:
        out[f"{FLAGS} __bool__"] = nonfinite_local  # the exact max-abs re-check, one per suspect
    if shard_world > 1:
        out[f"{AGREE} tolist"] = 1  # the all-reduced [has_grad, bad] flags
    if replicas > 1 and step != 5:  # step 5 skips every matrix: nothing for the replicas to share
        out[f"{SIZES} item"] = replicas  # the all-gathered payload sizes, one item() per replica
    return out


LAYOUTS_2 = ("fsdp", "hsdp", "tp")
LAYOUTS_4 = ("hsdp", "tp")


def _check_layout(layout: str, world: int, per_rank: list[dict[str, Any]]) -> dict[tuple[str, int, int], list[int]]:
    """Every counted step's reads, by site, against :func:`expected_reads`; returns the per-step
    totals (steps 2-5) per (layout, processes, rank)."""
    totals = {}
    for rank, r in enumerate(per_rank):
        where = f"{layout} on {world} processes, rank {rank}"
        assert r["per_step"][0] == {} and r["per_step"][1] == {}, "steps 0-1 are not counted"
        for step in (2, 3, 4, 5):
            got = r["per_step"][step]
            want = expected_reads(layout, world, step, r["nonfinite_local"][step])
            assert got == want, f"{where}, step {step}: host reads {got}, documented {want}"
        assert r["nonfinite_local"][2] == r["nonfinite_local"][4] == 0
        assert r["exempt_reads"] > 0  # the step counters were read: the wrap is active
        # step 3 skipped the NaN matrix on every rank, step 5 every parameter
        assert r["skips"] == 1 + r["params"] and r["skipped_steps"] == 2, where
        totals[(layout, world, rank)] = [sum(s.values()) for s in r["per_step"][2:]]
    return totals

#: The per-step totals of the docs' table (steps 2, 3, 4, 5) per (layout, processes, rank).
DOCUMENTED_TOTALS = {
    ("fsdp", 2, 0): [2, 2, 2, 19], ("fsdp", 2, 1): [2, 3, 2, 18],
    ("hsdp", 2, 0): [3, 4, 3, 18], ("hsdp", 2, 1): [3, 4, 3, 18],
    ("tp", 2, 0): [2, 2, 2, 9], ("tp", 2, 1): [2, 3, 2, 9],
    ("hsdp", 4, 0): [4, 5, 4, 19], ("hsdp", 4, 1): [4, 5, 4, 18],
    ("hsdp", 4, 2): [4, 5, 4, 19], ("hsdp", 4, 3): [4, 5, 4, 18],
    ("tp", 4, 0): [2, 2, 2, 9], ("tp", 4, 1): [2, 2, 2, 9], ("tp", 4, 2): [2, 2, 2, 9], ("tp", 4, 3): [2, 3, 2, 9],
}


def test_fsdp2_hsdp_tp_host_reads_per_step():
    """2 gloo processes: FSDP2 (mesh of 2), HSDP (2 x 1), FSDP x TP (1 x 2). Each step's reads, by
    site, equal the documented ones; the totals equal the docs' table."""
    ranks = run_workers(_worker, 2, timeout=150, layouts=LAYOUTS_2)
    totals = {}
    for layout in LAYOUTS_2:
        totals.update(_check_layout(layout, 2, [r[layout] for r in ranks]))
    # the figures of the docs' table (this model), not only the formula
    assert totals == {k: v for k, v in DOCUMENTED_TOTALS.items() if k[1] == 2}


def test_hsdp_and_tp_2x2_host_reads_per_step():
    """4 gloo processes: HSDP on a 2 x 2 (replicate, shard) mesh (the agreement and the replicas' size
    exchange both run) and FSDP x TP on a 2 x 2 (dp, tp) mesh."""
    ranks = run_workers(_worker, 4, timeout=200, layouts=LAYOUTS_4)
    totals = {}
    for layout in LAYOUTS_4:
        totals.update(_check_layout(layout, 4, [r[layout] for r in ranks]))
    assert totals == {k: v for k, v in DOCUMENTED_TOTALS.items() if k[1] == 4}


# ----------------------------------------------------------------------------- DeepSpeed ZeRO-2
DS_VOCAB, DS_SEQ = 64, 16


def ds_worker(out_dir: str, stage: int = 2) -> None:
    """ZeRO ``stage`` (the test: 2) on the CPU accelerator: 5 steps of a 2-layer DecoderLM; steps 2-4
    counted, step 3 with a NaN loss. Saves ``{"per_step", "calls", "groups", "exempt_reads"}`` to
    ``OUT/rank{r}.pt``; rank 0 prints the reads by site."""
    torch.set_num_threads(1)
    import deepspeed  # noqa: F401  (the CPU accelerator is chosen on import)

    import qmuon
    from qmuon.integrations import deepspeed as qds
    from qmuon_lightning.models.decoder_lm import DecoderLM, DecoderLMConfig

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig(vocab_size=DS_VOCAB, d_model=40, n_layers=2, n_heads=2, mlp_hidden=72,
                                      max_seq_len=DS_SEQ))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}}
    engine, opt, _, _ = qds.initialize(model, qmuon.build_optimizer(model, lr=0.02, adamw_lr=1e-3, verbose=False), cfg)
    calls = [0]
    wrapper_step = opt.step

    def counted_step(*args, **kwargs):  # DeepSpeed calls the client optimizer once per parameter group
        calls[0] += 1
        return wrapper_step(*args, **kwargs)

    opt.step = counted_step
    counter = SiteReads()
    per_step, per_calls = [], []
    for step in range(5):
        x = torch.randint(0, DS_VOCAB, (2, DS_SEQ), generator=torch.Generator().manual_seed(1000 * step + rank))
        logits = engine(x)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, DS_VOCAB), x[:, 1:].reshape(-1))
        if step == 3:
            loss = loss * float("nan")
        engine.backward(loss)
        calls[0] = 0
        with counter.counting(_ds_exempt(opt)) if step >= 2 else contextlib.nullcontext():
            engine.step()
        per_step.append(counter.take())
        per_calls.append(calls[0])
    torch.save({"per_step": per_step, "calls": per_calls, "groups": len(opt.param_groups),
                "exempt_reads": counter.exempt_reads, "zero_class": type(engine.optimizer).__name__},
               os.path.join(out_dir, f"rank{rank}.pt"))
    if rank == 0:
        for step in (2, 3, 4):
            print(f"ZeRO {stage} rank 0 step {step}: {sum(per_step[step].values())} reads, "
                  f"{per_calls[step]} calls of the wrapper's step()")
            for k, v in per_step[step].items():
                print(f"      {v} x {k}")
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()


def _ds_exempt(opt) -> list[torch.Tensor]:
    """The wrapper's CPU step counters (momentum of its slices or owned matrices, AdamW pieces): read as QMuon
    reads its own."""
    return [st["step"] for d in (opt._muon_state, opt._muon_slices) for st in d.values() if "step" in st] + [
        st["step"] for sts in opt._slice_state.values() for st in sts]


def ds_expected(calls: int) -> dict[str, int]:
    """The documented reads of one ZeRO-2 ``engine.step()`` that calls the wrapper ``calls`` times
    (docs/deepspeed.md, "Host reads per optimizer step")."""
    if calls == 0:  # DeepSpeed found the gradient norm non-finite and skipped the step itself
        return {f"{DS_ENGINE} __bool__": 1}
    return {f"{DS_ENGINE} __bool__": 1,  # DeepSpeed's own: is the global gradient norm finite
            f"{DS_FLAGS} tolist": calls,  # this rank's finite flags, before the all-reduce
            f"{DS_AGREED} tolist": calls}  # the all-reduced [bad, present, step] rows, one tolist


def test_deepspeed_zero2_host_reads_per_step(tmp_path):
    """2 processes, ZeRO-2 on the CPU accelerator: per engine step 1 read of DeepSpeed's own and 2 per
    call of the wrapper (one call per parameter group: 5 here, so 11); a NaN step: DeepSpeed skips
    it before calling QMuon (1 read)."""
    pytest.importorskip("deepspeed")
    cmd = torchrun_cmd(2, Path(__file__).resolve(), "--ds-worker", str(tmp_path))
    run_launcher(cmd, timeout=240, env=subprocess_env(DS_ACCELERATOR="cpu"), what="2-process DeepSpeed ZeRO-2")
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert r["calls"] == [r["groups"]] * 3 + [0, r["groups"]], r["calls"]
        assert r["groups"] == 5 and r["zero_class"] == "DeepSpeedZeroOptimizer"
        assert r["exempt_reads"] > 0
        for step in (2, 3, 4):
            got, want = r["per_step"][step], ds_expected(r["calls"][step])
            assert got == want, f"rank {rank}, step {step}: host reads {got}, documented {want}"
        assert [sum(s.values()) for s in r["per_step"][2:]] == [11, 1, 11]


# ----------------------------------------------------------------------------- the table
def _print_table() -> None:
    """Per-step totals (steps 2, 3, 4, 5) of every layout on 2 processes, and HSDP / FSDP x TP 2 x 2."""
    import time

    for world, layouts in ((2, LAYOUTS_2), (4, LAYOUTS_4)):
        t = time.time()
        ranks = run_workers(_worker, world, timeout=300, layouts=layouts)
        for layout in layouts:
            for rank, r in enumerate(ranks):
                totals = [sum(s.values()) for s in r[layout]["per_step"][2:]]
                print(f"{layout:5s} {world} processes rank {rank}: reads in steps 2-5 {totals}; "
                      f"non-finite local gradients {r[layout]['nonfinite_local'][2:]}")
                for step in (2, 3, 5):
                    for k, v in r[layout]["per_step"][step].items():
                        print(f"      step {step}: {v} x {k}")
        print(f"({time.time() - t:.0f} s)")


if __name__ == "__main__" and "--ds-worker" in sys.argv:
    ds_worker(sys.argv[sys.argv.index("--ds-worker") + 1],
              int(sys.argv[sys.argv.index("--stage") + 1]) if "--stage" in sys.argv else 2)
elif __name__ == "__main__" and "--table" in sys.argv:
    _print_table()
