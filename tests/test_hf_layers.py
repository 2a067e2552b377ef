"""Layer meaning with Hugging Face models: orientation (``(in, out)`` ``Conv1D``), fused parts
along an axis (GPT-2's ``c_attn``), tied embeddings, on tiny configs built here (no download).

Yardstick: each logical layer's update against ``torch.optim.Muon`` stepping that layer stored
``(out, in)`` with the same gradient (same lr rule: both use the ``"original"`` adjustment, the
default of each). Both run Newton-Schulz in bf16, so they agree to bf16 rounding: measured cosine
>= 0.999 and norm ratio within 0.4% on full-rank gradients (the batches here hold 4 x 32 = 128
tokens, more than any layer's smaller dim, 64). The targets of the issue are cosine >= 0.99 and
norm within 10%; the same check on the layout as the weights are stored (what QMuon did before:
c_attn as one 64 x 192 matrix, c_fc's lr adjusted for 64 x 256) gives cosine 0.44 (q) and a
norm ratio of 0.50 (c_fc), so it fails the targets (``test_stored_layout_misses_the_targets``).

Sharded runs (2 processes, gloo, ``fully_shard``): with bf16 carriers both ways and bf16 NS the
sharded update is single-process QMuon's bit for bit (docs/core.md), for ``(in, out)`` weights and
column parts too, with int8 momentum.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers") if __name__ != "__main__" else None

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qmuon_lightning as ql  # noqa: E402
from _dist import run_workers  # noqa: E402
from _helpers import assert_same, run_launcher, subprocess_env  # noqa: E402
from qmuon_lightning.optim import format_routing_table, route_parameters  # noqa: E402

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 256, 64, 4, 2, 32, 4
LR = 0.02
#: The issue's targets for the per-layer update against torch.optim.Muon.
MIN_COSINE, NORM_TOL = 0.99, 0.10
FAMILIES = ("gpt2", "llama", "qwen3")


# ------------------------------------------------------------------------------------------ models
def make_model(family: str, seed: int = 0, tie: bool = True) -> torch.nn.Module:
    """A tiny causal LM of ``family`` built from a config (random weights, no download)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, tie_word_embeddings=tie)
    if family == "gpt2":
        cfg = tf.GPT2Config(n_embd=D, n_layer=LAYERS, n_head=HEADS, n_positions=SEQ, bos_token_id=0, eos_token_id=0,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            **common)
        model = tf.GPT2LMHeadModel(cfg)
    elif family == "llama":
        cfg = tf.LlamaConfig(hidden_size=D, intermediate_size=2 * D, num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, max_position_embeddings=SEQ,
                             bos_token_id=0, eos_token_id=0, pad_token_id=0, **common)
        model = tf.LlamaForCausalLM(cfg)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(hidden_size=D, intermediate_size=2 * D, num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, head_dim=D // HEADS,
                             max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0, **common)
        model = tf.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(family)
    return model.float()


def tokens(step: int = 0, rank: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def lm_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def logical_layers(family: str, model: torch.nn.Module) -> dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """Every hidden layer as ``(out, in)``: name -> (parameter name, stored tensor -> layer matrix).
    Written out from the models' own code (GPT-2's Conv1D computes ``x @ W``, c_attn splits its
    output into q, k, v of ``n_embd`` columns each), not from QMuon's router."""
    out: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {}
    for i in range(LAYERS):
        if family == "gpt2":
            pre = f"transformer.h.{i}"
            for j, qkv in enumerate("qkv"):
                out[f"{pre}.attn.{qkv}"] = (f"{pre}.attn.c_attn.weight", lambda t, j=j: t[:, j * D:(j + 1) * D].T)
            for name in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
                out[f"{pre}.{name}"] = (f"{pre}.{name}.weight", lambda t: t.T)
        else:
            pre = f"model.layers.{i}"
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                out[f"{pre}.{name}"] = (f"{pre}.{name}.weight", lambda t: t)
    return out


def torch_muon_update(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``torch.optim.Muon``'s first-step update of an (out, in) layer ``w`` with gradient ``g``
    (weight decay 0): ``w_after - w``."""
    p = torch.nn.Parameter(w.detach().clone().contiguous())
    p.grad = g.detach().clone().contiguous()
    torch.optim.Muon([p], lr=LR, weight_decay=0.0, adjust_lr_fn="original").step()
    return p.detach() - w


def compare(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(cosine, norm ratio) of two updates."""
    cos = F.cosine_similarity(ours.flatten().double(), ref.flatten().double(), dim=0).item()
    return cos, (ours.norm() / ref.norm()).item()


def first_step_report(family: str, **build: Any) -> dict[str, tuple[float, float]]:
    """One QMuon step (fp32 momentum, bf16 NS, no weight decay) on a tiny model: per logical layer,
    (cosine, norm ratio) of its update against torch.optim.Muon on the (out, in) layer."""
    model = make_model(family)
    opt = ql.build_optimizer(model, lr=LR, weight_decay=0.0, state_format="fp32", ns_dtype="bf16", verbose=False,
                             **build)
    lm_loss(model, tokens()).backward()
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    grads = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
    opt.step()
    report = {}
    for layer, (pname, view) in logical_layers(family, model).items():
        ours = view(params[pname].detach() - before[pname])
        ref = torch_muon_update(view(before[pname]), view(grads[pname]))
        report[layer] = compare(ours, ref)
    return report


def assert_targets(report: dict[str, tuple[float, float]], what: str) -> None:
    bad = {k: v for k, v in report.items() if not (v[0] >= MIN_COSINE and abs(v[1] - 1.0) <= NORM_TOL)}
    assert not bad, f"{what}: layers off torch.optim.Muon (cosine, norm ratio): {bad}"


# ------------------------------------------------------------------------------------ routing
def test_gpt2_routing_table_shows_orientation_and_column_parts() -> None:
    model = make_model("gpt2")
    decisions = {d.name: d for d in route_parameters(model)}
    for i in range(LAYERS):
        attn = decisions[f"transformer.h.{i}.attn.c_attn.weight"]
        assert (attn.target, attn.parts, attn.parts_axis, attn.orientation) == ("muon", (D, D, D), 1, "in_out")
        for name in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            d = decisions[f"transformer.h.{i}.{name}.weight"]
            assert (d.target, d.parts, d.orientation) == ("muon", None, "in_out"), name
    # Tied embedding: one entry (the table is keyed by identity), routed as the embedding it is.
    assert model.lm_head.weight is model.transformer.wte.weight
    assert decisions["transformer.wte.weight"].target == "adamw" and "lm_head.weight" not in decisions
    table = format_routing_table(list(decisions.values()))
    row = next(line for line in table.splitlines() if line.startswith("transformer.h.0.attn.c_attn.weight"))
    assert f"muon parts=[{D}, {D}, {D}] dim=1" in row and "in_out" in row
    row = next(line for line in table.splitlines() if line.startswith("transformer.h.0.mlp.c_fc.weight"))
    assert "in_out" in row and "parts" not in row
    # build_optimizer: one group per layout, each carrying it.
    opt = ql.build_optimizer(model, verbose=False)
    layouts = {(g["parts"], g["parts_axis"], g["orientation"]): g["param_names"] for g in opt.param_groups
               if g["use_muon"]}
    assert set(layouts) == {((D, D, D), 1, "in_out"), (None, 0, "in_out")}
    assert layouts[((D, D, D), 1, "in_out")] == [f"transformer.h.{i}.attn.c_attn.weight" for i in range(LAYERS)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("tie", [True, False])
def test_linear_families_route_as_out_in(family: str, tie: bool) -> None:
    model = make_model(family, tie=tie)
    decisions = {d.name: d for d in route_parameters(model)}
    for layer, (pname, _) in logical_layers(family, model).items():
        d = decisions[pname]
        assert (d.target, d.parts, d.orientation) == ("muon", None, "out_in"), layer
    assert decisions["model.embed_tokens.weight"].target == "adamw"
    if tie:
        assert "lm_head.weight" not in decisions  # the embedding, listed once
    else:
        assert decisions["lm_head.weight"].target == "adamw"
    opt = ql.build_optimizer(model, verbose=False)
    assert [(g["parts"], g["orientation"]) for g in opt.param_groups if g["use_muon"]] == [(None, "out_in")]


# ------------------------------------------------------------------------------ update parity
@pytest.mark.parametrize("family", FAMILIES)
def test_update_matches_torch_muon_on_the_out_in_layer(family: str) -> None:
    report = first_step_report(family)
    assert len(report) == len(logical_layers(family, make_model(family)))
    assert_targets(report, family)


def test_stored_layout_misses_the_targets() -> None:
    """The yardstick has teeth: optimizing GPT-2 as its tensors are stored (declared so through
    the router's own overrides) fails it on c_attn and c_fc."""
    report = first_step_report("gpt2", orientations={r"\.c_\w+\.weight$": "out_in"},
                               fused_parts={r"c_attn\.weight$": {"sizes": [3 * D], "axis": 1}})
    q_cos, _ = report["transformer.h.0.attn.q"]
    _, fc_norm = report["transformer.h.0.mlp.c_fc"]
    assert q_cos < MIN_COSINE and abs(fc_norm - 0.5) < 0.05, (q_cos, fc_norm)


def test_single_process_checkpoint_resume_is_bit_exact_and_old_groups_load() -> None:
    """int8 momentum: save after one step, load into a fresh model and optimizer, step again:
    identical to the uninterrupted run. A state dict without the new group keys (saved before
    they existed) loads too; the constructed optimizer's layout is kept."""

    def run(steps: range, model: torch.nn.Module, opt: Any) -> None:
        for s in steps:
            lm_loss(model, tokens(s)).backward()
            opt.step()
            opt.zero_grad()

    kw = dict(lr=LR, state_format="int8", verbose=False)
    m1 = make_model("gpt2")
    o1 = ql.build_optimizer(m1, **kw)
    run(range(1), m1, o1)
    saved = copy.deepcopy((m1.state_dict(), o1.state_dict()))
    run(range(1, 3), m1, o1)
    for strip in (False, True):
        m2 = make_model("gpt2", seed=7)
        o2 = ql.build_optimizer(m2, **kw)
        model_sd, opt_sd = copy.deepcopy(saved)
        if strip:
            for g in opt_sd["param_groups"]:
                g.pop("parts_axis", None)
                g.pop("orientation", None)
        m2.load_state_dict(model_sd)
        o2.load_state_dict(opt_sd)
        assert [g["orientation"] for g in o2.param_groups] == [g["orientation"] for g in o1.param_groups]
        run(range(1, 3), m2, o2)
        assert_same(m2.state_dict(), m1.state_dict(), f"params (old keys stripped: {strip})")
        assert_same([dict(o2.state[p]) for p in m2.parameters() if p in o2.state],
                    [dict(o1.state[p]) for p in m1.parameters() if p in o1.state], "optimizer state")


# ----------------------------------------------------------------------------- declarations
def test_declared_orientation_and_axis_parts_on_a_plain_module() -> None:
    """A user layer stored (in, out) with two fused outputs declares both with module attributes;
    each part's update is torch.optim.Muon's on its (out, in) matrix."""

    class InOut(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(48, 16 + 32) * 0.1)  # (in, out): outputs a | b
            self.qmuon_orientation = {"weight": "in_out"}
            self.qmuon_fused_parts = {"weight": {"sizes": (16, 32), "axis": 1}}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight

    torch.manual_seed(0)
    model = torch.nn.Sequential(InOut(), torch.nn.Tanh(), torch.nn.Linear(48, 8))
    (d,) = [d for d in route_parameters(model) if d.name == "0.weight"]
    assert (d.parts, d.parts_axis, d.orientation) == ((16, 32), 1, "in_out")
    opt = ql.build_optimizer(model, lr=LR, weight_decay=0.0, state_format="fp32", ns_dtype="bf16", verbose=False)
    model(torch.randn(256, 48)).square().mean().backward()
    w0, g = model[0].weight.detach().clone(), model[0].weight.grad.clone()
    opt.step()
    upd = model[0].weight.detach() - w0
    for c0, c1 in ((0, 16), (16, 48)):
        cos, ratio = compare(upd[:, c0:c1].T, torch_muon_update(w0[:, c0:c1].T, g[:, c0:c1].T))
        assert cos >= 0.999 and abs(ratio - 1) < 0.01, (c0, cos, ratio)


@pytest.mark.parametrize("spec, match", [
    ({"c_attn": (D, D)}, r"sizes \[64, 64\] sum to 128, but dim 0 of its shape \(64, 192\) is 64"),
    ({"c_attn": {"sizes": (D,) * 3, "axis": 2}}, r"axis must be 0 \(stored rows\) or 1"),
    ({"c_attn": {"size": (D,) * 3}}, r"expected \{'sizes'"),
    ({"c_attn": "qkv"}, r"expected \(n0, n1, ...\)"),
])
def test_bad_fused_parts_name_the_fix(spec: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        route_parameters(make_model("gpt2"), fused_parts=spec)


def test_bad_orientations_name_the_fix() -> None:
    with pytest.raises(ValueError, match=r"orientation must be one of \('out_in', 'in_out'\)"):
        route_parameters(make_model("gpt2"), orientations={"c_fc": "io"})
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3))
    with pytest.raises(ValueError, match="applies to 2-D weights"):
        route_parameters(conv, orientations={"weight": "in_out"})
    p = torch.nn.Parameter(torch.randn(4, 6))
    with pytest.raises(ValueError, match=r"parts \(2, 2\) sum to 4 columns \(parts_axis=1\) but parameter #0 has 6"):
        ql.QMuon([{"params": [p], "parts": (2, 2), "parts_axis": 1}])
    with pytest.raises(ValueError, match="orientation must be one of"):
        ql.QMuon([{"params": [p], "orientation": "transposed"}])


# ------------------------------------------------------------------------- sharded (fully_shard)
def _sharded_worker(rank: int, world: int, family: str) -> dict[str, Any]:
    """Each rank: the same model twice; one sharded with fully_shard (Shard(0): for GPT-2's (in, out)
    weights that splits the input features), one whole. Both get the same gradients (the whole
    model's, sharded with distribute_tensor) and step. Returns rank 0's comparison."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    out: dict[str, Any] = {}
    for label, kw in (("fp32_state", dict(state_format="fp32")), ("int8_state", dict(state_format="int8"))):
        kw = dict(kw, lr=LR, weight_decay=0.0, ns_dtype="bf16", comm_carrier="bf16", comm_return="bf16", verbose=False)
        whole, sharded = make_model(family), make_model(family)
        layers = sharded.transformer.h if family == "gpt2" else sharded.model.layers
        for block in layers:
            fully_shard(block)
        fully_shard(sharded)
        o_whole, o_sharded = ql.build_optimizer(whole, **kw), ql.build_optimizer(sharded, **kw)
        sp = dict(sharded.named_parameters())
        first: dict[str, torch.Tensor] = {}
        for step in range(2):
            lm_loss(whole, tokens(step)).backward()
            for n, p in whole.named_parameters():
                if p.grad is not None:
                    sp[n].grad = distribute_tensor(p.grad.detach().clone(), sp[n].device_mesh, sp[n].placements)
            before = {n: p.detach().clone() for n, p in whole.named_parameters()}
            grads = {n: p.grad.detach().clone() for n, p in whole.named_parameters() if p.grad is not None}
            o_whole.step()
            o_sharded.step()
            o_whole.zero_grad()
            o_sharded.zero_grad()
            full = {n: p.full_tensor() for n, p in sp.items()}
            if step == 0:
                first = {n: full[n] - before[n] for n in full}
                report = {}
                for layer, (pname, view) in logical_layers(family, whole).items():
                    report[layer] = compare(view(first[pname]), torch_muon_update(view(before[pname]),
                                                                                  view(grads[pname])))
                out[f"{label}_report"] = report
        out[f"{label}_params_equal"] = {n: torch.equal(full[n], p.detach()) for n, p in whole.named_parameters()}
        st_equal = {}
        for n, p in whole.named_parameters():
            if p in o_whole.state:
                sts = o_sharded.state[sp[n]]
                st_equal[n] = all(torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, o_whole.state[p][k])
                                  for k, v in sts.items())
        out[f"{label}_state_equal"] = st_equal
    return out if rank == 0 else {}


@pytest.mark.parametrize("family", ["gpt2"])
def test_sharded_update_is_single_process_bit_for_bit(family: str) -> None:
    """FSDP2 Shard(0) of (in, out) weights and of column-fused c_attn, 2 processes: parameters and
    quantized (int8) or fp32 state equal single-process QMuon's after 2 steps, and the per-layer
    update meets the targets against torch.optim.Muon."""
    (res, _) = run_workers(_sharded_worker, 2, timeout=300, family=family)
    n_params = len(dict(make_model(family).named_parameters()))
    for label in ("fp32_state", "int8_state"):
        assert len(res[f"{label}_params_equal"]) == n_params
        assert all(res[f"{label}_params_equal"].values()), \
            [n for n, ok in res[f"{label}_params_equal"].items() if not ok]
        assert res[f"{label}_state_equal"] and all(res[f"{label}_state_equal"].values()), res[f"{label}_state_equal"]
    assert_targets(res["fp32_state_report"], f"{family} sharded")
