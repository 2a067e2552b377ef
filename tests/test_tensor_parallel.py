"""Data parallel x tensor parallel (issue 22, item 2): sharded QMuon on a 2 x 2 ``(dp, tp)`` mesh,
4 CPU processes (gloo).

A tiny Hugging Face ``LlamaForCausalLM`` (built locally) gets the usual TP plan with
``parallelize_module`` on the ``tp`` dim (attention q / k / v and MLP gate / up colwise, o and
down rowwise), then FSDP2 ``fully_shard`` on the ``dp`` dim (what Lightning's
``ModelParallelStrategy`` and ``qmuon_fsdp`` with ``tensor_parallel_size`` do). torch 2.13 makes
colwise weights ``(_StridedShard(0, sf=2), Shard(0))`` and rowwise ones ``(Shard(0), Shard(1))``;
embeddings, norms and the head stay ``(Shard(0),)`` on the dp sub-mesh.

Each rank trains the TP model with real forward / backward passes and, next to it, a whole
single-process copy stepped with the TP run's gradients (gathered with ``full_tensor``). With bf16
carriers both ways and bf16 Newton-Schulz every step's parameters and state equal single-process
QMuon's bit for bit; with int8 carriers the displacement stays within the bound stated in
tests/test_distributed.py (0.04: 2 trips x 0.9% RMS rounding error x 2). A DCP checkpoint saved on
2 x 2 resumes on a 1-D mesh of 4 and on plain tensors and continues identically.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import qmuon  # noqa: E402
from _dist import run_workers  # noqa: E402

LR = 0.02
#: rowwise shards hold 32 (o_proj) and 64 (down_proj) columns: momentum blocks of 32 never straddle two
KW = dict(lr=LR, weight_decay=0.01, state={"block_size": 32}, verbose=False)
BF16_WIRE = dict(newton_schulz={"dtype": "bf16", "comm_carrier": "bf16", "comm_return": "bf16"})


def make_llama(seed: int = 0, **size: int) -> torch.nn.Module:
    """The tiny Llama (``size``: LlamaConfig fields replacing hidden 64, MLP 128, 2 layers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kw = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, **size}
    cfg = LlamaConfig(vocab_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, **kw)
    return LlamaForCausalLM(cfg)


#: o_proj and down_proj of 256 columns: rowwise shards of 128 columns on tp 2, narrower than the
#: default block_size (256)
NARROW = {"hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 1}


def tp_plan(model: torch.nn.Module) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(len(model.model.layers)):
        pre = f"model.layers.{i}."
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[pre + n] = ColwiseParallel()
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            plan[pre + n] = RowwiseParallel()
    return plan


def parallelize(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """TP on ``mesh["tp"]``, then FSDP2 on ``mesh["dp"]`` per decoder layer and at the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh["tp"], tp_plan(model))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 + seed))


def full(t: Any) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def local_piece(full_t: torch.Tensor, like: Any) -> Any:
    """A DTensor with ``like``'s mesh and placements holding this rank's piece of ``full_t``."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, off = compute_local_shape_and_global_offset(full_t.shape, like.device_mesh, like.placements)
    piece = full_t[tuple(slice(o, o + n) for o, n in zip(off, shape))].clone()  # own storage: QMuon writes .grad
    return DTensor.from_local(piece, like.device_mesh, like.placements, run_check=False, shape=full_t.shape,
                              stride=full_t.stride())


def _train(mesh: Any, kw: dict[str, Any], steps: int, save_at: int | None = None, ckpt: str = "",
           random_grads: bool = False) -> dict[str, Any]:
    """TP model (``mesh`` 2-D; 1-D: FSDP2 only) and whole copy, stepped side by side with the
    sharded run's gradients (``random_grads``: full-rank normal gradients instead of backward)."""
    model = make_llama()
    if mesh.ndim == 2:
        tp = parallelize(model, mesh)
    else:
        from torch.distributed.fsdp import fully_shard

        tp = fully_shard(model, mesh=mesh)
    whole = make_llama()
    o_tp, o_whole = qmuon.build_optimizer(tp, **kw), qmuon.build_optimizer(whole, **kw)
    wp = dict(whole.named_parameters())
    out: dict[str, Any] = {"placements": {n: str(tuple(p.placements)) for n, p in tp.named_parameters()},
                           "params_equal": [], "state_equal": [], "losses": [], "grads": []}
    init = {n: p.detach().clone() for n, p in whole.named_parameters()}
    ids = batch(0)  # one batch, revisited: the loss must fall
    for step in range(steps):
        if random_grads:
            g = torch.Generator().manual_seed(step)
            grads = {n: torch.randn(p.shape, generator=g) * 0.01 for n, p in wp.items()}
            for n, p in tp.named_parameters():
                p.grad = local_piece(grads[n], p)
        else:
            loss = tp(input_ids=ids, labels=ids).loss
            loss.backward()
            out["losses"].append(float(loss.detach()))
            grads = {n: full(p.grad) for n, p in tp.named_parameters()}
        out["grads"].append(grads)
        for n, p in wp.items():
            p.grad = grads[n].clone()
        o_tp.step()
        o_whole.step()
        o_tp.zero_grad()
        o_whole.zero_grad()
        tpp = dict(tp.named_parameters())
        out["params_equal"].append({n: torch.equal(full(tpp[n]), p.detach()) for n, p in wp.items()})
        out["state_equal"].append({
            n: all(torch.equal(full(v), o_whole.state[p][k]) for k, v in o_tp.state[tpp[n]].items())
            for n, p in wp.items() if p in o_whole.state})
        if save_at is not None and step == save_at:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

            dcp.save({"model": get_model_state_dict(tp), "optim": get_optimizer_state_dict(tp, o_tp)}, checkpoint_id=ckpt)
    out["params"] = {n: full(p) for n, p in tp.named_parameters()}
    out["ref_params"] = {n: p.detach().clone() for n, p in wp.items()}
    out["init"] = init
    out["stats"] = dict(o_tp.comm_stats)
    return out


def _resume(ckpt: str, grads: list[dict[str, torch.Tensor]], first: int, mesh1d: Any | None,
            size: dict[str, int] | None = None, kw: dict[str, Any] | None = None,
            layouts: dict[str, dict[str, Any]] | None = None) -> dict[str, torch.Tensor]:
    """Load the 2 x 2 checkpoint into a model on ``mesh1d`` (None: plain tensors) and step with the
    recorded gradients of steps ``first ..`` (``size``, ``kw``: the model and optimizer as saved;
    ``layouts``: the per-parameter layouts it was saved with, by name, given to the new optimizer
    before its state exists, as the Lightning strategies do from the checkpoint's metadata: DCP
    loads into the destination's tensor shapes)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    m = make_llama(seed=7, **(size or {}))
    if mesh1d is not None:
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh1d)
        fully_shard(m, mesh=mesh1d)
    o = qmuon.build_optimizer(m, **(kw if kw is not None else dict(KW, **BF16_WIRE)))
    named = dict(m.named_parameters())
    for n, layout in (layouts or {}).items():
        o.promote_param(named[n], layout)
    sd = {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, o)}
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(m, sd["model"])
    set_optimizer_state_dict(m, o, sd["optim"])
    for g in grads[first:]:
        for n, p in m.named_parameters():
            p.grad = distribute_tensor(g[n].clone(), p.device_mesh, p.placements) if hasattr(p, "device_mesh") \
                else g[n].clone()
        o.step()
        o.zero_grad()
    return {n: full(p) for n, p in m.named_parameters()}


class FusedBlock(torch.nn.Module):
    """Fused parts and orientation under TP: ``qkv`` (three row parts) colwise, ``proj`` (two column
    parts) and ``conv`` (declared ``(in, out)``) rowwise, and ``extra``, a Muon matrix outside the
    TP plan (the same rows on both tp ranks: one sends, both get the result)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96, bias=False)
        self.qkv.qmuon_fused_parts = {"weight": (32, 32, 32)}
        self.proj = torch.nn.Linear(64, 32, bias=False)
        self.proj.qmuon_fused_parts = {"weight": {"sizes": (32, 32), "axis": 1}}
        self.conv = torch.nn.Linear(64, 48, bias=False)
        self.conv.qmuon_orientation = {"weight": "in_out"}
        self.extra = torch.nn.Linear(32, 40, bias=False)


def _fused_parts(mesh: Any) -> dict[str, Any]:
    """FusedBlock on the (dp, tp) mesh and whole, 2 steps on the same full-rank random gradients."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(1)
    tp = FusedBlock()
    torch.manual_seed(1)
    whole = FusedBlock()
    parallelize_module(tp, mesh["tp"], {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                        "conv": RowwiseParallel()})
    fully_shard(tp, mesh=mesh["dp"])
    # A bag of layers, not a model: no layer is its output, so route without the head-by-role rule
    # (it would take ``extra``, the last non-square Linear, for the head).
    rules = [r for r in qmuon.optim.DEFAULT_RULES if r.role != qmuon.optim.OUTPUT_HEAD]
    kw = dict(KW, state_format="int8", routing={"rules": rules}, **BF16_WIRE)
    o_tp, o_whole = qmuon.build_optimizer(tp, **kw), qmuon.build_optimizer(whole, **kw)
    tpp = dict(tp.named_parameters())
    for step in range(2):
        g = torch.Generator().manual_seed(10 + step)
        for n, p in whole.named_parameters():
            p.grad = torch.randn(p.shape, generator=g) * 0.01
            tpp[n].grad = local_piece(p.grad, tpp[n])
        o_tp.step()
        o_whole.step()
    return {"params_equal": {n: torch.equal(full(tpp[n]), p.detach()) for n, p in whole.named_parameters()},
            "state_equal": {n: all(torch.equal(full(v), o_whole.state[p][k]) for k, v in o_tp.state[tpp[n]].items())
                            for n, p in whole.named_parameters()},
            "muon": sorted(n for g in o_whole.param_groups if g["use_muon"] for n in g["param_names"]),
            "placements": {n: str(tuple(p.placements)) for n, p in tpp.items()}, "stats": dict(o_tp.comm_stats)}


def _worker(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    res: dict[str, Any] = {"fused": _fused_parts(mesh)}
    for fmt in ("fp32", "int8"):
        r = _train(mesh, dict(KW, state_format=fmt, **BF16_WIRE), steps=3, save_at=0 if fmt == "int8" else None,
                   ckpt=ckpt)
        res[fmt] = {k: r[k] for k in ("placements", "params_equal", "state_equal", "losses", "stats")}
        if fmt == "int8":
            res["straight"] = r["params"]
            res["resumed_1d"] = _resume(ckpt, r["grads"], 1, init_device_mesh("cpu", (4,)))
            res["resumed_whole"] = _resume(ckpt, r["grads"], 1, None)
    return res


# ------------------------------------------- narrow rowwise shards: 128 columns, block_size 256 (issue 38)
FP32_WIRE = {"newton_schulz": {"dtype": "fp32", "comm_carrier": "fp32", "comm_return": "fp32"}}


def _narrow(mesh: Any, kw: dict[str, Any], steps: int, ckpt: str = "") -> dict[str, Any]:
    """The NARROW Llama on the (dp, tp) mesh, stepped with real gradients next to two whole
    copies: one with the group's block_size everywhere, one with the tensor-parallel run's
    per-parameter layout overrides (the blocks it picked). DCP save after step 0 (``ckpt``)."""
    import logging

    class Count(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.records: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record.getMessage())

    count = Count()
    logging.getLogger("qmuon.distributed.tensor_parallel").addHandler(count)
    tp = parallelize(make_llama(**NARROW), mesh)
    whole, fit, dense = make_llama(**NARROW), make_llama(**NARROW), make_llama(**NARROW)
    o_tp, o_whole, o_fit = (qmuon.build_optimizer(m, **kw) for m in (tp, whole, fit))
    o_dense = qmuon.build_optimizer(dense, **dict(kw, state_format="fp32"))  # the reference of fidelity
    tpp = dict(tp.named_parameters())
    init = {n: p.detach().clone() for n, p in whole.named_parameters()}
    # 256 tokens: a 32-token batch makes rank-deficient gradients, along whose null directions
    # Newton-Schulz lifts any rounding (int8 momentum itself: cosine 0.975 to fp32 momentum)
    ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(5))
    out: dict[str, Any] = {"losses": [], "grads": [], "fit_equal": []}
    for step in range(steps):
        loss = tp(input_ids=ids, labels=ids).loss
        loss.backward()
        out["losses"].append(float(loss.detach()))
        grads = {n: full(p.grad) for n, p in tpp.items()}
        out["grads"].append(grads)
        for m in (whole, fit, dense):
            for n, p in m.named_parameters():
                p.grad = grads[n].clone()
        o_tp.step()
        if step == 0:  # the blocks the (dp, tp) layout picked, before the copy's first step
            for g_fit, g_tp in zip(o_fit.param_groups, o_tp.param_groups):
                if g_tp.get("format_overrides"):
                    g_fit["format_overrides"] = dict(g_tp["format_overrides"])
        o_whole.step()
        o_fit.step()
        o_dense.step()
        for o in (o_tp, o_whole, o_fit, o_dense):
            o.zero_grad()
        fp = dict(fit.named_parameters())
        out["fit_equal"].append({n: torch.equal(full(p), fp[n].detach()) for n, p in tpp.items()}
                                | {f"{n}/{k}": torch.equal(full(v), o_fit.state[fp[n]][k])
                                   for n, p in tpp.items() if p in o_tp.state for k, v in o_tp.state[p].items()})
        if ckpt and step == 0:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

            dcp.save({"model": get_model_state_dict(tp), "optim": get_optimizer_state_dict(tp, o_tp)},
                     checkpoint_id=ckpt)
    logging.getLogger("qmuon.distributed.tensor_parallel").removeHandler(count)
    if ckpt:  # one process's 256-blocks straddle the 128-column shards: refused on load, on every rank
        from qmuon.distributed import load_full_state_dict

        again = parallelize(make_llama(**NARROW), mesh)
        try:
            load_full_state_dict(qmuon.build_optimizer(again, **kw), o_whole.state_dict())
            out["straddle_error"] = ""
        except ValueError as e:
            out["straddle_error"] = str(e)
    out.update(params={n: full(p) for n, p in tpp.items()}, ref={n: p.detach().clone() for n, p in whole.named_parameters()},
               dense={n: p.detach().clone() for n, p in dense.named_parameters()}, init=init, log=count.records, placements={n: str(tuple(p.placements)) for n, p in tpp.items()},
               overrides=[{g["param_names"][i]: v for i, v in (g.get("format_overrides") or {}).items()}
                          for g in o_tp.param_groups],
               state_shapes={n: {k: tuple(v.shape) for k, v in o_tp.state[p].items()} for n, p in tpp.items()
                             if p in o_tp.state})
    return out


def _too_narrow(mesh: Any, fmt: str) -> str:
    """A rowwise layer of 96 columns (48 per shard: no multiple of 32 divides it), one step."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 96, bias=False), torch.nn.Linear(96, 32, bias=False))
    parallelize_module(m, mesh["tp"], {"1": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp"])
    o = qmuon.QMuon([{"params": [m[1].weight], "param_names": ["1.weight"]}], lr=LR, state_format=fmt)
    m[1].weight.grad = local_piece(torch.randn(32, 96, generator=torch.Generator().manual_seed(0)), m[1].weight)
    try:
        o.step()
    except NotImplementedError as e:
        return str(e)
    return ""


def _narrow_worker(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    res: dict[str, Any] = {"fp32": _narrow(mesh, dict(KW, state={}, state_format="fp32", **FP32_WIRE), steps=3)}
    kw8 = dict(KW, state={}, state_format="int8", **BF16_WIRE)
    r = _narrow(mesh, kw8, steps=3, ckpt=ckpt)
    layouts = {n: v for g in r["overrides"] for n, v in g.items()}
    r["resumed_1d"] = _resume(ckpt, r["grads"], 1, init_device_mesh("cpu", (4,)), NARROW, kw8, layouts)
    r["resumed_whole"] = _resume(ckpt, r["grads"], 1, None, NARROW, kw8, layouts)
    res["int8"] = r
    res["too_narrow"] = {fmt: _too_narrow(mesh, fmt) for fmt in ("int8", "fp32", "bf16")}
    for fmt in ("fp32", "int8"):
        del res[fmt]["grads"]
    return res


def _muon(names: Any) -> list[str]:
    return sorted(n for n in names if "proj" in n)


@pytest.mark.slow
@pytest.mark.ns_equivalence
def test_fsdp_x_tp_narrow_rowwise_shards_train_like_single_process(tmp_path: Path) -> None:
    """Rowwise shards of 128 columns under block_size 256. fp32 momentum: accepted as is, equal to
    single-process QMuon to float reordering (fp32 NS and carriers; only the summation order of
    ``||G||`` differs). int8: that parameter's blocks become 128 (logged once, kept as its layout
    override), so the run equals single-process QMuon with those blocks bit for bit, moves like
    single-process QMuon with 256-blocks (cosine), and its checkpoint reshards bit for bit."""
    res = run_workers(_narrow_worker, 4, timeout=500, ckpt=str(tmp_path / "ckpt"))
    out = res[0]
    assert out["fp32"]["placements"]["model.layers.0.self_attn.o_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"
    narrow = ["model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"]
    for r, o in enumerate(res):
        for fmt in ("fp32", "int8"):
            assert o[fmt]["losses"][-1] < o[fmt]["losses"][0], (r, fmt, o[fmt]["losses"])  # it trains
    # fp32: no blocks, nothing overridden, nothing logged
    f = out["fp32"]
    assert all(not g for g in f["overrides"]) and f["log"] == [], (f["overrides"], f["log"])
    rel = _displacement_rel(f["params"], f["ref"], f["init"])
    # The block sums of ||G|| are added in another order (two 128-column sums per row instead of
    # one 256-column sum): a last-bit change of 1 / ||G|| in fp32, which fp32 Newton-Schulz and 3
    # steps carry to a relative displacement error of 1.4e-6 (o_proj; down_proj happened to round
    # alike: 0); 1e-5 still fails on any real layout error (a lost or doubled block sum changes the
    # norm by a factor: error ~1).
    assert max(rel[n] for n in _muon(rel)) < 1e-5, {n: rel[n] for n in _muon(rel)}
    assert max(v for n, v in rel.items() if n not in _muon(rel)) == 0.0, rel  # AdamW: untouched
    # int8: blocks of 128 for the two rowwise matrices, logged once (one record, 3 steps)
    q = out["int8"]
    assert q["overrides"][0] == {n: {"state_format": "int8", "block_size": 128} for n in narrow}, q["overrides"]
    assert len(q["log"]) == 1 and all(n in q["log"][0] for n in narrow) and "blocks of 128" in q["log"][0], q["log"]
    assert q["state_shapes"][narrow[1]]["momentum_absmax"] == (256, 2), q["state_shapes"]
    for r, o in enumerate(res):
        for step, eq in enumerate(o["int8"]["fit_equal"]):  # = one process with the same blocks, bit for bit
            assert all(eq.values()), (r, step, [n for n, ok in eq.items() if not ok])
    # against one process with 256-blocks everywhere: same direction and size of every update
    # (issue 38's target for sharded int8: cosine >= 0.99, norm within 5%; measured >= 0.9990, norm
    # within 0.03%), and no further from fp32 momentum than it (smaller blocks; measured o_proj 0.99910
    # vs 0.99900, down_proj 0.99894 vs 0.99878)
    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))

    for n in _muon(q["params"]):
        d_tp, d_1, d_32 = (q[k][n] - q["init"][n] for k in ("params", "ref", "dense"))
        ratio = float(d_tp.norm() / d_1.norm())
        assert cos(d_tp, d_1) >= 0.99 and abs(ratio - 1) <= 0.05, (n, cos(d_tp, d_1), ratio)
        assert cos(d_tp, d_32) >= cos(d_1, d_32) - 1e-4, (n, cos(d_tp, d_32), cos(d_1, d_32))
    # DCP saved on 2 x 2 after step 0 (blocks of 128 and the override in the param groups): a 1-D
    # mesh of 4 and plain tensors keep the blocks and continue bit for bit
    for o in res:
        for label in ("resumed_1d", "resumed_whole"):
            bad = [n for n, t in o["int8"][label].items() if not torch.equal(t, o["int8"]["params"][n])]
            assert not bad, (label, bad)
    for o in res:
        msg = o["int8"]["straddle_error"]
        assert "momentum_absmax" in msg and "straddle" in msg and "promote_param" in msg, msg
    # 48 columns per shard: no block size fits; int8 is refused naming the fix, fp32 and bf16 (no
    # blocks) are accepted
    msg = out["too_narrow"]["int8"]
    assert "48 of 96 columns" in msg and "'1.weight'" in msg and "state_format='fp32'" in msg, msg
    assert out["too_narrow"]["fp32"] == "" and out["too_narrow"]["bf16"] == "", out["too_narrow"]


def test_lightning_resume_gives_back_a_fitted_block_size() -> None:
    """The Lightning strategies reapply the saved per-parameter layouts before loading (DCP reads
    into the destination's shapes): a block size alone (blocks fitted to narrow rowwise shards,
    same format) must be reapplied too."""
    from qmuon.integrations.fabric.checkpoint_state import apply_format_overrides

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256, bias=False))
    o = qmuon.QMuon([{"params": list(m.parameters()), "param_names": ["0.weight", "1.weight"]}], lr=LR,
                    state_format="int8")
    layout = {"state_format": "int8", "block_size": 128}
    apply_format_overrides(m, [o], {"format_overrides": [{"1.weight": layout}]}, "test")
    assert o.param_layout(m[1].weight)["block_size"] == 128 and o.param_layout(m[0].weight)["block_size"] == 256
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    o.step()
    assert o.state[m[1].weight]["momentum_absmax"].shape == (256, 2), o.state[m[1].weight]["momentum_absmax"].shape


def test_shard_block_size() -> None:
    from qmuon.distributed.tensor_parallel import shard_block_size

    assert shard_block_size(128, 256) == 128 and shard_block_size(512, 256) == 256
    assert shard_block_size(384, 256) == 192 and shard_block_size(160, 256) == 160
    assert shard_block_size(96, 64) == 32 and shard_block_size(48, 256) is None and shard_block_size(16, 256) is None


def _carrier_worker(rank: int, world: int) -> dict[str, Any]:
    """QMuon's default int8 carriers both ways: full-rank gradients (the bound's setting), then real
    ones on the (dp, tp) mesh and on a 1-D mesh of 4."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    res: dict[str, Any] = {}
    keep = ("params", "ref_params", "init", "stats")
    r = _train(mesh, dict(KW, state_format="int8"), steps=3, random_grads=True)
    res["int8_carrier"] = {k: r[k] for k in keep}
    r = _train(mesh, dict(KW, state_format="int8"), steps=3)
    res["int8_carrier_real"] = {k: r[k] for k in keep}
    r = _train(init_device_mesh("cpu", (4,)), dict(KW, state_format="int8"), steps=3)
    res["int8_carrier_real_1d"] = {k: r[k] for k in keep}
    return res


def _displacement_rel(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                      init: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: float((got[n] - ref[n]).norm() / (ref[n] - init[n]).norm().clamp_min(1e-30)) for n in ref}


@pytest.mark.slow
def test_fsdp_x_tp_2x2_trains_like_single_process_and_reshards(tmp_path: Path) -> None:
    res = run_workers(_worker, 4, timeout=400, ckpt=str(tmp_path / "ckpt"))
    pl = res[0]["fp32"]["placements"]
    assert pl["model.layers.0.self_attn.q_proj.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", pl
    assert pl["model.layers.0.mlp.down_proj.weight"] == "(Shard(dim=0), Shard(dim=1))", pl
    assert pl["model.embed_tokens.weight"] == "(Shard(dim=0),)", pl
    for r, out in enumerate(res):
        for fmt in ("fp32", "int8"):
            for step, (eq, st) in enumerate(zip(out[fmt]["params_equal"], out[fmt]["state_equal"])):
                assert eq and all(eq.values()), (r, fmt, step, [n for n, ok in eq.items() if not ok])
                assert st and all(st.values()), (r, fmt, step, [n for n, ok in st.items() if not ok])
            losses = out[fmt]["losses"]
            assert losses[-1] < losses[0], losses  # it trains
    # fused parts (rows cut by pieces; column parts inside one column shard), in_out orientation, a
    # Muon matrix outside the TP plan: single-process QMuon bit for bit
    for r, out in enumerate(res):
        f = out["fused"]
        assert f["muon"] == ["conv.weight", "extra.weight", "proj.weight", "qkv.weight"], f["muon"]
        assert f["placements"]["extra.weight"] == "(Shard(dim=0),)", f["placements"]
        assert all(f["params_equal"].values()) and all(f["state_equal"].values()), (r, f)
    # every matrix orthogonalized once, the work dealt over all 4 ranks
    shares = [out["fp32"]["stats"]["ns_share"] for out in res]
    assert abs(sum(shares) - 1.0) < 1e-9 and max(shares) <= 0.25 * 1.25, shares
    # DCP saved on 2 x 2 after step 0: a 1-D mesh of 4 and plain tensors continue bit for bit
    for out in res:
        for label in ("resumed_1d", "resumed_whole"):
            bad = [n for n, t in out[label].items() if not torch.equal(t, out["straight"][n])]
            assert not bad, (label, bad)


@pytest.mark.slow
@pytest.mark.ns_equivalence
def test_fsdp_x_tp_int8_carriers_within_bound() -> None:
    """int8 carriers both ways: within the stated carrier bound (measured 0.019 with bf16 NS, 0.013 with
    fp32 NS, 1-D mesh of 4 the same; AMX Xeon, native and capped to AVX2); AdamW untouched by the carrier."""
    res = run_workers(_carrier_worker, 4, timeout=300)
    c = res[0]["int8_carrier"]
    rel = _displacement_rel(c["params"], c["ref_params"], c["init"])
    muon = {n: v for n, v in rel.items() if "proj" in n}
    assert max(muon.values()) < 0.04, muon
    assert max(v for n, v in rel.items() if n not in muon) == 0.0, rel
    # real gradients of a 32-token batch are rank-deficient: Newton-Schulz lifts the carrier's
    # rounding along their null directions, on any mesh. The (dp, tp) pieces (int8 blocks of a
    # column shard instead of whole rows) must not add to it: within 1.5x the 1-D mesh's figure.
    real = [_displacement_rel(*(res[0][k][x] for x in ("params", "ref_params", "init")))
            for k in ("int8_carrier_real", "int8_carrier_real_1d")]
    worst = [max(v for n, v in r.items() if "proj" in n) for r in real]
    assert worst[0] <= 1.5 * worst[1], worst  # measured 0.23 vs 0.24 (bf16 NS), 0.21 vs 0.22 (fp32 NS)


def _placement_error(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    lin = torch.nn.Linear(8, 8, bias=False)
    lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(1)]))
    opt = qmuon.QMuon([{"params": [lin.weight], "param_names": ["proj.weight"]}], lr=LR)
    lin.weight.grad = distribute_tensor(torch.ones(8, 8), mesh, [Shard(1)])
    try:
        opt.step()
    except NotImplementedError as e:
        return str(e)
    return ""


@pytest.mark.slow
def test_unsupported_placement_error_names_parameter_and_layouts() -> None:
    msg = run_workers(_placement_error, 1, timeout=120, start_method="fork")[0]
    assert "'proj.weight'" in msg and "(Shard(dim=1),)" in msg, msg
    for supported in ("(Shard(0),)", "HSDP", "(Replicate(), Shard(0))", "colwise", "rowwise", "(Shard(0), Shard(1))"):
        assert supported in msg, (supported, msg)


def _fabric_worker(rank: int, world: int) -> dict[str, Any]:
    """Fabric with a ``parallelize_fn`` that applies the TP plan only: the strategy adds FSDP2 on
    the data-parallel dim and swaps the AdamW for QMuon; 3 steps against a whole copy."""
    import os

    import lightning as L
    from torch.distributed.tensor.parallel import parallelize_module

    from qmuon_lightning.strategies import QMuonFabricStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # run_workers joined the group (as torchrun)

    def tp_only(module: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        return parallelize_module(module, mesh["tensor_parallel"], tp_plan(module))

    kw = dict(KW, state_format="int8", **BF16_WIRE)
    kw.pop("verbose")
    strategy = QMuonFabricStrategy(parallelize_fn=tp_only, data_parallel_size=2, tensor_parallel_size=2,
                                   optimizer_kwargs=kw)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(make_llama())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    whole = make_llama()
    o_whole = qmuon.build_optimizer(whole, **kw, verbose=False)
    wp = dict(whole.named_parameters())
    equal = []
    ids = batch(rank // 2)  # one batch per data-parallel rank
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        for n, p in model.module.named_parameters():
            wp[n].grad = full(p.grad).clone()
        opt.step()
        o_whole.step()
        opt.zero_grad()
        o_whole.zero_grad()
        # the Muon matrices (the auxiliary AdamW took the user's AdamW settings, the copy QMuon's defaults)
        equal.append(all(torch.equal(full(p), wp[n].detach()) for n, p in model.module.named_parameters()
                         if "proj" in n))
    q = model.module.model.layers[0].self_attn.q_proj.weight
    return {"equal": equal, "optimizer": type(opt.optimizer if hasattr(opt, "optimizer") else opt).__name__,
            "placements": str(tuple(q.placements)), "fsdp": strategy.sharded_roots}


@pytest.mark.slow
def test_fabric_tensor_parallel_matches_single_process() -> None:
    res = run_workers(_fabric_worker, 4, timeout=300)
    for r in res:
        assert r["placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", r
        assert r["optimizer"] == "QMuon" and r["fsdp"], r
        assert r["equal"] == [True] * 3, r


# ------------------------------------- Trainer(strategy=QMuonFSDPStrategy(tensor_parallel_size=2)), 4 processes
def _trainer_main(out: Path) -> None:
    """Worker of the 4-process launch: ``configure_model`` applies the TP plan on
    ``self.device_mesh["tensor_parallel"]`` (the strategy adds FSDP2 on the data-parallel dim);
    fit 2 epochs, then resume from the checkpoint of epoch 0."""
    import os

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.tensor.parallel import parallelize_module

    from _helpers import assert_same
    from qmuon_lightning.strategies import QMuonFSDPStrategy

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])

    class Lit(L.LightningModule):
        def __init__(self, seed: int = 0) -> None:
            super().__init__()
            # rowwise shards of 128 columns (blocks fitted to them); 2 layers: 14 matrices deal evenly over 4 ranks
            self.model = make_llama(seed, **dict(NARROW, num_hidden_layers=2))

        def configure_model(self) -> None:
            parallelize_module(self.model, self.device_mesh["tensor_parallel"], tp_plan(self.model))

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            loss = self.model(input_ids=batch[0], labels=batch[0]).loss
            self.log("loss", loss.detach(), on_epoch=True, sync_dist=False)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def data() -> Any:
        ids = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2, shuffle=False)

    def fit(seed: int, resume: Path | None, callbacks: list) -> Any:
        L.seed_everything(0, verbose=False)
        strategy = QMuonFSDPStrategy(data_parallel_size=2, tensor_parallel_size=2,
                                     optimizer_kwargs=dict(lr=LR, weight_decay=0.0))
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_epochs=2, callbacks=callbacks,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=bool(callbacks), num_sanity_val_steps=0)
        trainer.fit(Lit(seed), data(), ckpt_path=str(resume) if resume else None)
        return trainer

    def local(trainer: Any) -> dict[str, Any]:
        m, o = trainer.lightning_module, trainer.optimizers[0]
        loc = lambda t: (t.to_local() if hasattr(t, "to_local") else t).detach().clone()  # noqa: E731
        return {"params": {n: loc(p) for n, p in m.named_parameters()},
                "state": [{k: loc(v) for k, v in o.state[p].items()} for g in o.param_groups for p in g["params"]]}

    ckpt = ModelCheckpoint(dirpath=out / "ckpt", filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    t1 = fit(0, None, [ckpt])
    lm = t1.lightning_module.model.model.layers[0]
    res = {"placements": [str(tuple(lm.self_attn.q_proj.weight.placements)),
                          str(tuple(lm.mlp.down_proj.weight.placements))],
           "stats": dict(t1.optimizers[0].comm_stats), "steps": t1.global_step,
           "optimizer": type(t1.optimizers[0]).__name__}
    straight = local(t1)
    t2 = fit(3, out / "ckpt" / "epoch=0.ckpt", [])
    res["block_sizes"] = [sorted(v["block_size"] for v in (g.get("format_overrides") or {}).values())
                          for t in (t1, t2) for g in t.optimizers[0].param_groups if g["use_muon"]]
    try:
        assert_same(local(t2), straight, "FSDP x TP resume")
        res["mismatch"] = ""
    except AssertionError as e:
        res["mismatch"] = str(e)
    torch.save(res, out / f"rank{rank}.pt")
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()


@pytest.mark.slow
def test_trainer_tensor_parallel_trains_and_resumes(tmp_path: Path) -> None:
    """QMuonFSDPStrategy(data_parallel_size=2, tensor_parallel_size=2) with a configure_model that
    applies the TP plan: QMuon steps the colwise / rowwise DTensors, the Newton-Schulz work is dealt
    over all 4 ranks, and a resume from the sharded checkpoint of epoch 0 is bit-exact. The model
    is the NARROW Llama with int8's default block_size 256: the rowwise o_proj / down_proj shards
    hold 128 columns, so their momentum is kept in blocks of 128, through the strategy and its resume."""
    from _dist import torchrun_cmd, run_launcher, subprocess_env

    cmd = torchrun_cmd(4, Path(__file__).resolve(), "--trainer", str(tmp_path))
    run_launcher(cmd, timeout=600, env=subprocess_env(PYTHONWARNINGS="ignore"), what="4-process FSDP x TP Trainer")
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    for r in res:
        assert r["placements"] == ["(_StridedShard(dim=0, sf=2), Shard(dim=0))", "(Shard(dim=0), Shard(dim=1))"], r
        assert r["optimizer"] == "QMuon" and r["steps"] == 8, r  # 16 samples / (batch 2 x dp 2) x 2 epochs
        assert r["mismatch"] == "", r["mismatch"]
        assert r["block_sizes"] == [[128] * 4] * 2, r["block_sizes"]  # o_proj, down_proj x 2 layers; both runs
    shares = [r["stats"]["ns_share"] for r in res]
    assert abs(sum(shares) - 1) < 1e-9 and max(shares) <= 0.25 * 1.25, shares


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--trainer":
        _trainer_main(Path(sys.argv[2]))
    else:
        sys.exit(f"usage: {sys.argv[0]} --trainer OUT")
