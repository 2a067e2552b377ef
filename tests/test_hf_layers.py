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

One 2-process launch (``torch.distributed.run``; this file is also that worker:
``python tests/test_hf_layers.py --worker OUT``) runs GPT-2 under DeepSpeed ZeRO 0 and 2 (compared
here, bit for bit, with single-process QMuon on the averaged gradient), and GPT-2, Llama and Qwen3
under Accelerate's FSDP2 (forced on CPU, as tests/test_accelerate.py does) and under
``Trainer(strategy="qmuon_fsdp")``: per-layer targets on the first step, and resume from a sharded
checkpoint bit-exact. Lightning Fabric is covered where its strategy is tested.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers") if __name__ != "__main__" else None

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qmuon  # noqa: E402
from _dist import run_workers  # noqa: E402
from _helpers import assert_same, fabric_resume_scenario  # noqa: E402
from _dist import run_launcher, subprocess_env  # noqa: E402
from qmuon.optim import format_routing_table, route_parameters  # noqa: E402

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 256, 64, 4, 2, 32, 4
LR = 0.02
#: The issue's targets for the per-layer update against torch.optim.Muon.
MIN_COSINE, NORM_TOL = 0.99, 0.10
FAMILIES = ("gpt2", "llama", "qwen3")


# ------------------------------------------------------------------------------------------ models
def make_model(family: str, seed: int = 0, tie: bool = True, *, d: int = D, heads: int = HEADS,
               layers: int = LAYERS) -> torch.nn.Module:
    """A tiny causal LM of ``family`` built from a config (random weights, no download, no dropout)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, tie_word_embeddings=tie)
    if family == "gpt2":
        cfg = tf.GPT2Config(n_embd=d, n_layer=layers, n_head=heads, n_positions=SEQ, bos_token_id=0, eos_token_id=0,
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
    opt = qmuon.build_optimizer(model, lr=LR, weight_decay=0.0, state_format="fp32", newton_schulz={"dtype": "bf16"}, verbose=False, **build)
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
    opt = qmuon.build_optimizer(model, verbose=False)
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
    opt = qmuon.build_optimizer(model, verbose=False)
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
    report = first_step_report("gpt2", routing={"orientations": {r"\.c_\w+\.weight$": "out_in"}, "fused_parts": {r"c_attn\.weight$": {"sizes": [3 * D], "axis": 1}}})
    q_cos, _ = report["transformer.h.0.attn.q"]
    _, fc_norm = report["transformer.h.0.mlp.c_fc"]
    assert q_cos < MIN_COSINE and abs(fc_norm - 0.5) < 0.05, (q_cos, fc_norm)


def test_single_process_checkpoint_resume_is_bit_exact() -> None:
    """int8 momentum: save after one step, load into a fresh model and optimizer, step again:
    identical to the uninterrupted run; the constructed optimizer's layout is kept."""

    def run(steps: range, model: torch.nn.Module, opt: Any) -> None:
        for s in steps:
            lm_loss(model, tokens(s)).backward()
            opt.step()
            opt.zero_grad()

    kw = dict(lr=LR, state_format="int8", verbose=False)
    m1 = make_model("gpt2")
    o1 = qmuon.build_optimizer(m1, **kw)
    run(range(1), m1, o1)
    saved = copy.deepcopy((m1.state_dict(), o1.state_dict()))
    run(range(1, 3), m1, o1)
    m2 = make_model("gpt2", seed=7)
    o2 = qmuon.build_optimizer(m2, **kw)
    model_sd, opt_sd = saved
    m2.load_state_dict(model_sd)
    o2.load_state_dict(opt_sd)
    assert [g.get("orientation") for g in o2.param_groups] == [g.get("orientation") for g in o1.param_groups]
    run(range(1, 3), m2, o2)
    assert_same(m2.state_dict(), m1.state_dict(), "params")
    assert_same([dict(o2.state[p]) for p in m2.parameters() if p in o2.state],
                [dict(o1.state[p]) for p in m1.parameters() if p in o1.state], "optimizer state")


def test_mxfp8_input_encodes_the_stored_block_and_runs_ns_on_the_layer() -> None:
    """ns_input="mxfp8" on a column part of an (in, out) weight (GPT-2's q): the MXFP8 carrier of
    the stored block (blocks along stored rows, what a sharded rank can encode alone), Newton-Schulz
    on its transpose, the lr factor of the (out, in) shape: rebuilt by hand, bit for bit."""
    from qmuon.core.newton_schulz import newton_schulz_folded
    from qmuon.core.plan import lr_scale
    from qmuon.quant.mxfp8 import mxfp8_roundtrip_normalized

    model = make_model("gpt2")
    opt = qmuon.build_optimizer(model, lr=LR, weight_decay=0.0, state_format="fp32", newton_schulz={"dtype": "bf16", "input": "mxfp8"}, verbose=False)
    lm_loss(model, tokens()).backward()
    w = model.transformer.h[0].attn.c_attn.weight
    w0 = w.detach().clone()
    opt.step()
    g = w.grad[:, :D]  # after step(), .grad holds the NS input (docs/core.md)
    inv = 1.0 / torch.clamp(g.float().square().sum(dim=1, keepdim=True).sum().sqrt(), min=1e-7)
    x = mxfp8_roundtrip_normalized(g.contiguous(), inv)  # stored (in, out) block
    o = newton_schulz_folded(x.mT.unsqueeze(0), torch.ones(1), "muon", 5, dtype=torch.bfloat16)[0].mT
    want = w0[:, :D].clone()
    want.add_(o.contiguous(), alpha=-LR * lr_scale(None, D, D))
    assert torch.equal(w.detach()[:, :D], want)


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
    # model[2] is a (16, 48) nn.Linear: the layer shape of part a, so NS batches the two together.
    model = torch.nn.Sequential(InOut(), torch.nn.Tanh(), torch.nn.Linear(48, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 8))
    (d,) = [d for d in route_parameters(model) if d.name == "0.weight"]
    assert (d.parts, d.parts_axis, d.orientation) == ((16, 32), 1, "in_out")
    opt = qmuon.build_optimizer(model, lr=LR, weight_decay=0.0, state_format="fp32", newton_schulz={"dtype": "bf16"}, verbose=False)
    model(torch.randn(256, 48)).square().mean().backward()
    w0, g = model[0].weight.detach().clone(), model[0].weight.grad.clone()
    lin0, lin_g = model[2].weight.detach().clone(), model[2].weight.grad.clone()
    opt.step()
    upd = model[0].weight.detach() - w0
    for c0, c1 in ((0, 16), (16, 48)):
        cos, ratio = compare(upd[:, c0:c1].T, torch_muon_update(w0[:, c0:c1].T, g[:, c0:c1].T))
        assert cos >= 0.999 and abs(ratio - 1) < 0.01, (c0, cos, ratio)
    cos, ratio = compare(model[2].weight.detach() - lin0, torch_muon_update(lin0, lin_g))
    assert cos >= 0.999 and abs(ratio - 1) < 0.01, ("linear", cos, ratio)


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
        qmuon.QMuon([{"params": [p], "parts": (2, 2), "parts_axis": 1}])
    with pytest.raises(ValueError, match="orientation must be one of"):
        qmuon.QMuon([{"params": [p], "orientation": "transposed"}])


# ------------------------------------------------------------------------- sharded (fully_shard)
def _sharded_worker(rank: int, world: int, family: str) -> dict[str, Any]:
    """Each rank: the same model twice; one sharded with fully_shard (Shard(0): for GPT-2's (in, out)
    weights that splits the input features), one whole. Both get the same gradients (the whole
    model's, sharded with distribute_tensor) and step. Returns rank 0's comparison."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    out: dict[str, Any] = {}
    for label, kw in (("fp32_state", dict(state_format="fp32")), ("int8_state", dict(state_format="int8")),
                      ("grasp4_state", dict(state_format="grasp4"))):
        kw = dict(kw, lr=LR, weight_decay=0.0, verbose=False,
                  newton_schulz={"dtype": "bf16", "comm_carrier": "bf16", "comm_return": "bf16"})
        whole, sharded = make_model(family), make_model(family)
        layers = sharded.transformer.h if family == "gpt2" else sharded.model.layers
        for block in layers:
            fully_shard(block)
        fully_shard(sharded)
        o_whole, o_sharded = qmuon.build_optimizer(whole, **kw), qmuon.build_optimizer(sharded, **kw)
        sp = dict(sharded.named_parameters())
        init = {n: p.detach().clone() for n, p in whole.named_parameters()}
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
        out[f"{label}_displacement_rel_diff"] = {
            n: ((full[n] - p.detach()).norm() / (p.detach() - init[n]).norm()).item()
            for n, p in whole.named_parameters() if (p.detach() - init[n]).norm() > 0}
        st_equal = {}
        for n, p in whole.named_parameters():
            if p in o_whole.state:
                sts = o_sharded.state[sp[n]]
                st_equal[n] = all(torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, o_whole.state[p][k])
                                  for k, v in sts.items())
        out[f"{label}_state_equal"] = st_equal
    return out if rank == 0 else {}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2"])
def test_sharded_update_is_single_process_bit_for_bit(family: str) -> None:
    """FSDP2 Shard(0) of (in, out) weights and of column-fused c_attn, 2 processes: parameters and
    quantized (int8) or fp32 state equal single-process QMuon's after 2 steps, grasp4 (4-bit, low-rank
    factor over the stored rows) follows it within its own sharded bound, and the per-layer update
    meets the targets against torch.optim.Muon."""
    (res, _) = run_workers(_sharded_worker, 2, timeout=300, family=family)
    n_params = len(dict(make_model(family).named_parameters()))
    for label in ("fp32_state", "int8_state"):
        assert len(res[f"{label}_params_equal"]) == n_params
        assert all(res[f"{label}_params_equal"].values()), \
            [n for n, ok in res[f"{label}_params_equal"].items() if not ok]
        assert res[f"{label}_state_equal"] and all(res[f"{label}_state_equal"].values()), res[f"{label}_state_equal"]
    assert_targets(res["fp32_state_report"], f"{family} sharded")
    # grasp4: the sharded power iteration sums its factor in another fp32 order, which can flip a
    # few codes (tests/test_distributed_4bit.py: bound 1 % on the displacement); the layouts must
    # not add to that (measured here: identical).
    worst = max(res["grasp4_state_displacement_rel_diff"].values())
    assert worst < 1e-2, res["grasp4_state_displacement_rel_diff"]


# ----------------------------------------- DeepSpeed, Accelerate, Trainer, Fabric: one 2-process launch
#: GPT-2 shape for the DeepSpeed runs: odd widths, so ZeRO's partition boundary falls inside a row
#: of a column-fused c_attn (the test checks it does).
DS_GPT2 = dict(d=33, heads=3, layers=3)
# fp32 AdamW moments: DeepSpeed steps flat ZeRO slices, whose AdamW moments QMuon keeps in fp32
# fp32 carriers: the gradient slices travel to the owner and the update back unchanged (bit-exact runs)
DS_KW = dict(lr=LR, weight_decay=0.1, state_format="int8", state={"rounding": "stochastic"}, adamw_lr=3e-3,
             adamw_state_format="fp32", newton_schulz={"comm_carrier": "fp32", "comm_return": "fp32"}, verbose=False)
#: GPT-2's c_attn whose row the ZeRO-2 boundary cuts, total update after DS_STEPS steps against one
#: process, relative Frobenius error. Origin: the cut row's block is quantized per rank (within 2 int8
#: steps of the whole block's momentum, test_deepspeed.py::test_cut_block_momentum_bound), and bf16
#: Newton-Schulz of these small, nearly rank-deficient gradients amplifies it; the same bound as
#: test_deepspeed_zero3.py's CUT_UPDATE_RTOL (measured there 0.9-8.9e-2); SGD or a skipped NS is >= 87% off.
CUT_UPDATE_RTOL = 0.15
DS_STEPS = 2
TRAINER_FAMILIES = FAMILIES
#: Decoder block classes (FSDP units of the Accelerate runs).
BLOCK_CLASS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer", "qwen3": "Qwen3DecoderLayer"}
#: QMuon arguments of the Trainer and Accelerate runs. GPT-2 runs QMuon's defaults (int8 momentum, int8 carriers).
#: Llama and Qwen3 run fp32 momentum with bf16 carriers: with 2 key/value heads for 4 query heads
#: at initialization, o_proj's input (the attention output) spans about half its 64 dims, so its
#: gradient is nearly rank-deficient and Newton-Schulz amplifies any rounding in the near-null
#: directions; int8 momentum and carriers there measured cosine 0.97 against torch.optim.Muon
#: (every other layer >= 0.99). Their layers are plain (out, in): the run checks that they stay so.
TRAINER_KW = {"gpt2": dict(lr=LR, weight_decay=0.0),
              "llama": dict(lr=LR, weight_decay=0.0, state_format="fp32", newton_schulz={"comm_carrier": "bf16", "comm_return": "bf16"}),
              "qwen3": dict(lr=LR, weight_decay=0.0, state_format="fp32", newton_schulz={"comm_carrier": "bf16", "comm_return": "bf16"})}


def _ds_model(seed: int = 0) -> torch.nn.Module:
    return make_model("gpt2", seed, **DS_GPT2)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worker_deepspeed(rank: int) -> dict[str, Any]:
    from qmuon.integrations import deepspeed as qds

    res: dict[str, Any] = {}
    for stage in (0, 2):
        model = _ds_model()
        cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
               "gradient_clipping": 0.0, "zero_optimization": {"stage": stage, "reduce_bucket_size": 500,
                                                               "allgather_bucket_size": 500}}
        engine, opt, _, _ = qds.initialize(model, qmuon.build_optimizer(model, **DS_KW), cfg)
        first = None
        for step in range(DS_STEPS):
            x = tokens(step, rank)
            engine.backward(lm_loss(engine, x))
            engine.step()
            if step == 0:
                first = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        res[f"stage{stage}"] = {
            "first": first,
            "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
            "holders": {opt._all_groups[p.group]["param_names"][p.pos]:
                        [None if s is None else (s.start, s.length) for s in p.holders] for p in opt._params},
        }
        del engine, opt
    return res


def _worker_accelerate(out: Path, family: str) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from qmuon.integrations.accelerate import prepare_qmuon

    def make() -> Accelerator:
        # Accelerate's FSDP2 code forced on CPU (gloo), as tests/test_accelerate.py does.
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=[BLOCK_CLASS[family]],
                                                state_dict_type="SHARDED_STATE_DICT")
        acc = Accelerator(cpu=True)
        acc.state.fsdp_plugin = plugin
        acc.state.distributed_type = DistributedType.FSDP
        PartialState().distributed_type = DistributedType.FSDP
        return acc

    def run(acc: Any, model: Any, opt: Any, steps: range, first: dict | None = None) -> None:
        for s in steps:
            acc.backward(lm_loss(model, tokens(s, acc.process_index)))
            if first is not None and s == 0:
                first["before"] = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
                first["grads"] = {n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
            opt.step()
            opt.zero_grad(set_to_none=True)
            if first is not None and s == 0:
                first["after"] = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}

    def snap(model: Any, opt: Any) -> dict[str, torch.Tensor]:
        from qmuon.integrations.accelerate import unwrap_qmuon

        qm = unwrap_qmuon(opt)
        snap = {f"param/{n}": _full(p.detach()).clone() for n, p in model.named_parameters()}
        for gi, g in enumerate(qm.param_groups):
            for i, p in enumerate(g["params"]):
                for k, v in qm.state.get(p, {}).items():
                    snap[f"state/{gi}/{i}/{k}"] = _full(v).clone()
        return snap

    acc = make()
    model, opt = prepare_qmuon(acc, make_model(family), **TRAINER_KW[family], verbose=False)
    first: dict[str, Any] = {}
    run(acc, model, opt, range(2), first)
    ckpt = str(out / f"acc_ckpt_{family}")
    acc.save_state(ckpt)
    acc.wait_for_everyone()
    run(acc, model, opt, range(2, 4))
    a = snap(model, opt)
    acc2 = make()
    model2, opt2 = prepare_qmuon(acc2, make_model(family, seed=5), **TRAINER_KW[family], verbose=False)
    acc2.load_state(ckpt)
    run(acc2, model2, opt2, range(2, 4))
    b = snap(model2, opt2)
    try:
        assert_same(a, b, f"{family} accelerate resume")
        mismatch: list[str] = []
    except AssertionError as e:
        mismatch = [str(e)]
    report = {}
    for layer, (pname, view) in logical_layers(family, model).items():
        ours = view(first["after"][pname] - first["before"][pname])
        report[layer] = compare(ours, torch_muon_update(view(first["before"][pname]), view(first["grads"][pname])))
    return {"report": report, "mismatches": mismatch, "n_snap": len(a)}


def _worker_trainer(out: Path, family: str) -> dict[str, Any]:
    """Trainer(strategy="qmuon_fsdp") (automatic sharding, AdamW swapped for QMuon): the first
    step's per-layer update against torch.optim.Muon on the gradient FSDP averaged, the optimizer's
    layout groups, and resume from a sharded checkpoint at step 2 == the uninterrupted run."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from qmuon_lightning.strategies import QMuonFSDPStrategy

    class Lit(L.LightningModule):
        def __init__(self, seed: int = 0) -> None:
            super().__init__()
            self.model = make_model(family, seed)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return lm_loss(self.model, batch[0])

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    class FirstStep(L.Callback):
        def __init__(self) -> None:
            self.before: dict = {}
            self.grads: dict = {}
            self.after: dict = {}

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            if trainer.global_step == 0:
                self.before = {n: _full(p.detach()).clone() for n, p in module.model.named_parameters()}
                self.grads = {n: _full(p.grad).clone() for n, p in module.model.named_parameters() if p.grad is not None}

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            if trainer.global_step == 1:
                self.after = {n: _full(p.detach()).clone() for n, p in module.model.named_parameters()}

    def data() -> Any:
        # 16 sequences: 2 steps of BATCH per rank per epoch (a global batch of 256 tokens: full-rank gradients)
        x = torch.cat([tokens(s) for s in range(4)])
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=BATCH, shuffle=False)

    def local(trainer: Any) -> dict[str, Any]:
        m, o = trainer.lightning_module, trainer.optimizers[0]
        names = {id(p): n for n, p in m.named_parameters()}
        loc = lambda t: (t.to_local() if hasattr(t, "to_local") else t).detach().clone()  # noqa: E731
        return {"params": {n: loc(p) for n, p in m.named_parameters()},
                "state": {names[id(p)]: {k: loc(v) for k, v in st.items()} for p, st in o.state.items()}}

    def fit(epochs: int, seed: int, resume: Path | None, callbacks: list) -> Any:
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=QMuonFSDPStrategy(optimizer_kwargs=TRAINER_KW[family]),
                            max_epochs=epochs, callbacks=callbacks, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=bool(callbacks), num_sanity_val_steps=0)
        trainer.fit(Lit(seed), data(), ckpt_path=str(resume) if resume else None)
        return trainer

    first = FirstStep()
    ckpt = ModelCheckpoint(dirpath=out / f"trainer_{family}", filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    t1 = fit(2, 0, None, [first, ckpt])
    straight = local(t1)
    groups = [{"names": g["param_names"], "parts": g["parts"], "parts_axis": g["parts_axis"],
               "orientation": g["orientation"]} for g in t1.optimizers[0].param_groups if g.get("use_muon")]
    t2 = fit(2, 3, out / f"trainer_{family}" / "epoch=0.ckpt", [])
    resumed = local(t2)
    try:
        assert_same(resumed, straight, f"{family} resume")
        mismatch: list[str] = []
    except AssertionError as e:
        mismatch = [str(e)]
    report = {}
    for layer, (pname, view) in logical_layers(family, t1.lightning_module.model).items():
        ours = view(first.after[pname] - first.before[pname])
        report[layer] = compare(ours, torch_muon_update(view(first.before[pname]), view(first.grads[pname])))
    return {"report": report, "mismatches": mismatch, "groups": groups, "steps": t1.global_step,
            "sharded_ckpt": (out / f"trainer_{family}" / "epoch=0.ckpt").is_dir()}


def _worker_fabric(out: Path, family: str) -> dict[str, Any]:
    """A plain Fabric loop with ``strategy="qmuon_fsdp"`` (automatic sharding policy,
    ``setup_optimizers(build_optimizer(...))``): the first step's per-layer update against
    torch.optim.Muon, and fabric.save / fabric.load (sharded) at step 2 == the uninterrupted run."""
    import lightning as L

    from qmuon_lightning.strategies import QMuonFabricStrategy

    def make(seed: int) -> tuple[Any, Any, Any]:
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=QMuonFabricStrategy())
        fabric.launch()
        model = fabric.setup_module(make_model(family, seed))
        opt = fabric.setup_optimizers(qmuon.build_optimizer(model, **TRAINER_KW[family], verbose=False))
        return fabric, model, opt

    ckpt = out / f"fabric_{family}"
    res = fabric_resume_scenario(make, lambda m, s, r: lm_loss(m, tokens(s, r)), ckpt)
    first, model = res["first"], res["model"]
    report = {}
    for layer, (pname, view) in logical_layers(family, model.module).items():
        ours = view(first["after"][pname] - first["before"][pname])
        report[layer] = compare(ours, torch_muon_update(view(first["before"][pname]), view(first["grads"][pname])))
    return {"report": report, "mismatches": res["mismatches"], "n_snap": res["n_snap"],
            "sharded_ckpt": (ckpt / ".metadata").is_file(), "resumed_at": res["resumed_at"]}


def _worker_main(out: Path) -> None:
    import os

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    res: dict[str, Any] = {"rank": rank, "deepspeed": _worker_deepspeed(rank)}
    for family in FAMILIES:
        res[f"accelerate_{family}"] = _worker_accelerate(out, family)
    for family in FAMILIES:
        res[f"trainer_{family}"] = _worker_trainer(out, family)
    for family in FAMILIES:
        res[f"fabric_{family}"] = _worker_fabric(out, family)
    torch.save(res, out / f"rank{rank}.pt")
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from _dist import torchrun_cmd

    pytest.importorskip("deepspeed")
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("hf_layers")
    cmd = torchrun_cmd(2, Path(__file__).resolve(), "--worker", str(out))
    run_launcher(cmd, timeout=900, env=subprocess_env(DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore"),
                 what="2-process HF worker (DeepSpeed, Accelerate, Trainer, Fabric)")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _ds_reference() -> list[dict[str, torch.Tensor]]:
    """Single-process QMuon on DeepSpeed's gradient (the mean of both ranks' micro-batch gradients):
    the weights after each of the DS_STEPS steps."""
    model = _ds_model()
    opt = qmuon.build_optimizer(model, **DS_KW)
    out = []
    for step in range(DS_STEPS):
        grads = []
        for r in range(2):
            model.zero_grad(set_to_none=True)
            lm_loss(model, tokens(step, r)).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        for n, p in model.named_parameters():
            p.grad = (grads[0][n] + grads[1][n]) / 2 if n in grads[0] else None
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_gpt2_matches_single_process(two_process_run: list[dict], stage: int) -> None:
    """ZeRO 0 / 2 on 2 processes: GPT-2's (in, out) weights and column-fused c_attn get the
    single-process QMuon update bit for bit (int8 momentum, stochastic rounding), also where the
    ZeRO partition boundary cuts a c_attn row: there the first step is exact, and from the second on
    the cut row's quantization block (each rank quantizes its part with its own absmax,
    docs/deepspeed.md "Sharded momentum") moves that matrix's update within
    :data:`CUT_UPDATE_RTOL`; every other parameter stays exact."""
    steps = _ds_reference()
    want, want_first = steps[-1], steps[0]
    init = dict(_ds_model().named_parameters())
    holders = two_process_run[0]["deepspeed"]["stage2"]["holders"]
    cut = set()
    if stage == 2:
        cut = {n for n, segs in holders.items() if segs[1] is not None and segs[1][1] and segs[0] is not None
               and segs[0][1] and segs[1][0] % (want[n].numel() // want[n].shape[0]) % 256}  # int8's block_size
        assert any("c_attn.weight" in n for n in cut), f"no c_attn row is cut by the partition boundary: {holders}"
    for r, res in enumerate(two_process_run):
        run = res["deepspeed"][f"stage{stage}"]
        assert_same(run["first"], want_first, f"rank {r} ZeRO {stage}, step 1")
        assert_same({n: t for n, t in run["params"].items() if n not in cut},
                    {n: t for n, t in want.items() if n not in cut}, f"rank {r} ZeRO {stage}")
        for n in cut:
            u, v = run["params"][n] - init[n].detach(), want[n] - init[n].detach()
            err = float((u - v).norm() / v.norm())
            assert err <= CUT_UPDATE_RTOL, f"rank {r} ZeRO {stage}: {n} (a cut block) update off by {err:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_accelerate_fsdp2_update_and_resume(two_process_run: list[dict], family: str) -> None:
    """Accelerate's FSDP2 (forced on CPU; arguments: TRAINER_KW): per-layer targets against
    torch.optim.Muon, and save_state / load_state (sharded) bit-exact."""
    for r, res in enumerate(two_process_run):
        acc = res[f"accelerate_{family}"]
        assert acc["mismatches"] == [], f"rank {r}: {acc['mismatches']}"
        assert acc["n_snap"] > 0
        assert_targets(acc["report"], f"{family} accelerate rank {r}")


@pytest.mark.slow
@pytest.mark.parametrize("family", TRAINER_FAMILIES)
def test_trainer_qmuon_fsdp_hf_models(two_process_run: list[dict], family: str) -> None:
    """Trainer(strategy="qmuon_fsdp"), 2 processes: the layouts reach the optimizer, the per-layer
    update meets the targets (arguments: TRAINER_KW), and a sharded-checkpoint resume is bit-exact."""
    for r, res in enumerate(two_process_run):
        run = res[f"trainer_{family}"]
        assert run["steps"] == 4 and run["sharded_ckpt"]
        assert run["mismatches"] == [], f"rank {r}: {run['mismatches']}"
        assert_targets(run["report"], f"{family} Trainer rank {r}")
        layouts = {(tuple(g["parts"]) if g["parts"] else None, g["parts_axis"], g["orientation"]) for g in run["groups"]}
        if family == "gpt2":
            assert layouts == {((D, D, D), 1, "in_out"), (None, 0, "in_out")}
            assert any(n.endswith("attn.c_attn.weight") for g in run["groups"] if g["parts"] for n in g["names"])
        else:
            assert layouts == {(None, 0, "out_in")}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_fabric_qmuon_fsdp_hf_models(two_process_run: list[dict], family: str) -> None:
    """L.Fabric(strategy="qmuon_fsdp"), 2 processes, plain loop: the per-layer update meets the
    targets (arguments: TRAINER_KW) and fabric.save / fabric.load of a sharded checkpoint continue
    bit-exactly."""
    for r, res in enumerate(two_process_run):
        run = res[f"fabric_{family}"]
        assert run["sharded_ckpt"] and run["resumed_at"] == 2 and run["n_snap"] > 0
        assert run["mismatches"] == [], f"rank {r}: {run['mismatches']}"
        assert_targets(run["report"], f"{family} Fabric rank {r}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker_main(Path(sys.argv[2]))
    else:
        sys.exit(f"usage: {sys.argv[0]} --worker OUT")
