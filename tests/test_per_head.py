"""Per-head Muon (``routing.per_head``, qmuon/optim/heads.py): each attention head's block of q, k,
v (output rows) and of the output projection (input columns) is its own Newton-Schulz matrix.

The reference is ``torch.optim.Muon`` applied to each head's block on its own (one parameter per
block, the block's gradient): QMuon's per-head update must point the same way (cosine) with the
same size (the lr adjustment is the block's: ``sqrt(max(1, rows / cols))`` of a ``head_dim x
d_model`` q block is 1, of a ``d_model x head_dim`` o block ``sqrt(d_model / head_dim)``), on a GQA
Hugging Face Llama, GPT-2 (``Conv1D``, stored ``(in, out)``) and the kit's DecoderLM (fused qkv).
"""

from __future__ import annotations

import os
import types

import pytest
import torch
from torch import nn

import qmuon
from qmuon.optim.routing import route_parameters

tf = pytest.importorskip("transformers")

LR, BETA, STEPS = 0.02, 0.95, 3
VOCAB, SEQ, BATCH = 64, 16, 8


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return tf.LlamaForCausalLM(cfg)


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=SEQ, bos_token_id=0,
                        eos_token_id=0)
    return tf.GPT2LMHeadModel(cfg)


def _decoder_lm(d_model: int = 64, n_heads: int = 4, n_kv_heads: int = 2) -> nn.Module:
    from qmuon_lightning.models.decoder_lm import DecoderLM

    torch.manual_seed(0)
    return DecoderLM(vocab_size=VOCAB, d_model=d_model, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads,
                     max_seq_len=SEQ)


def _mqa_lm() -> nn.Module:
    """3 query heads, 1 kv head (MQA), head_dim 16: the fused qkv has 5 head blocks of 16 rows (80), so
    FSDP2 on 2 ranks (40 rows each) cuts the third block in two."""
    return _decoder_lm(d_model=48, n_heads=3, n_kv_heads=1)


MODELS = {"llama": _llama, "gpt2": _gpt2, "decoder_lm": _decoder_lm}


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))
    if hasattr(model, "loss"):
        return model.loss(x[:, :-1], x[:, 1:])
    return model(x, labels=x).loss


def _blocks(d) -> list[tuple[str, int, tuple[slice, slice], bool]]:
    """``(name, index, stored slices, transposed)`` of every Muon matrix of decision ``d``."""
    rows, cols = d.shape
    out = []
    start = 0
    for i, n in enumerate(d.parts or ((rows,) if d.parts_axis == 0 else (cols,))):
        sl = (slice(start, start + n), slice(None)) if d.parts_axis == 0 else (slice(None), slice(start, start + n))
        out.append((d.name, i, sl, d.orientation == "in_out"))
        start += n
    return out


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.flatten().double() @ b.flatten().double()) / (a.double().norm() * b.double().norm()))


def _side_by_side(make, state_format: str, adjust_lr_fn=None, per_head=True, state=None):
    """Three steps of QMuon (per head) next to ``torch.optim.Muon`` over every head block as its own
    parameter (and every other Muon matrix whole), fed the same gradients. Before each step the
    reference blocks are reset to the model's weights, so each step's update is compared, not two
    drifting trajectories (momentum depends on the gradients only). Weight decay 0: the update is
    the orthogonalized momentum alone. Returns ``{(name, block): [(cosine, norm ratio), ...]}``."""
    model = make()
    opt = qmuon.build_optimizer(model, lr=LR, weight_decay=0.0, momentum=BETA, state_format=state_format,
                                adamw_lr=0.0, update={"adjust_lr_fn": adjust_lr_fn}, routing={"per_head": per_head},
                                state=state)
    head = route_parameters(model, per_head=True)  # the reference's blocks: always per head
    params = dict(model.named_parameters())
    blocks = [b for d in head if d.target == "muon" for b in _blocks(d)]

    def logical(t: torch.Tensor, sl, transposed: bool) -> torch.Tensor:
        b = t[sl]
        return b.T if transposed else b

    ref = {(n, i): nn.Parameter(logical(params[n].detach(), sl, tr).clone()) for n, i, sl, tr in blocks}
    ref_opt = torch.optim.Muon(list(ref.values()), lr=LR, weight_decay=0.0, momentum=BETA, adjust_lr_fn=adjust_lr_fn)
    out: dict = {}
    for step in range(STEPS):
        _loss(model, step).backward()
        before = {n: p.detach().clone() for n, p in params.items()}
        for n, i, sl, tr in blocks:
            with torch.no_grad():
                ref[(n, i)].copy_(logical(before[n], sl, tr))
            ref[(n, i)].grad = logical(params[n].grad, sl, tr).clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        for n, i, sl, tr in blocks:
            ours = logical(params[n].detach() - before[n], sl, tr)
            theirs = ref[(n, i)].detach() - logical(before[n], sl, tr)
            out.setdefault((n, i), []).append((_cos(ours, theirs), float(ours.norm() / theirs.norm())))
    return out, head


def _attention_blocks(head) -> dict[str, int]:
    """``{weight name: head blocks}`` of the weights the routing split per head."""
    return {d.name: len(d.parts or (1,)) for d in head if "per head" in d.reason}


#: (model, state format, state options): the GQA models in the formats of the target; GPT-2 (4 heads,
#: no GQA, stored (in, out)) in int8 with 32-element blocks (see test_gpt2_int8_default_blocks);
#: the 4-bit formats on the GQA Llama, grasp4 on all three, and bf16 / uint8.
CASES = [("llama", "fp32", None), ("llama", "int8", None), ("decoder_lm", "fp32", None), ("decoder_lm", "int8", None),
         ("gpt2", "fp32", None), ("gpt2", "int8", 32),
         ("llama", "grasp4", None), ("decoder_lm", "grasp4", None), ("gpt2", "grasp4", None),
         ("llama", "bf16", None), ("llama", "uint8", None), ("llama", "int4", None), ("llama", "e0m3", None)]
FOUR_BIT = ("grasp4", "int4", "e0m3")
EXPECTED_BLOCKS = {"llama": {"q_proj": 4, "k_proj": 2, "v_proj": 2, "o_proj": 4},
                   "gpt2": {"c_attn": 3 * 4, "attn.c_proj": 4},
                   "decoder_lm": {"qkv": 4 + 2 * 2, "attn.proj": 4}}


@pytest.mark.parametrize("model,state_format,block_size", CASES, ids=[f"{m}-{f}" for m, f, _ in CASES])
def test_per_head_equals_torch_muon_per_block(model, state_format, block_size):
    """Target (issue 40): update cosine >= 0.999 against per-head ``torch.optim.Muon`` for q, k, v
    and o, and the same size (the block's lr adjustment).

    Tolerances. torch.optim.Muon runs Newton-Schulz in bf16 (unit roundoff 2^-8): with fp32 momentum
    the two updates differ by the two implementations' bf16 NS rounding (about 2% of the update,
    tests/test_torch_parity.py; measured cosine >= 0.9995 on the head blocks here), int8 momentum
    adds its rounding (absmax / 127 per block). The batch (8 x 16 = 128 tokens) gives gradients of
    full rank: on a rank-deficient gradient (2 x 12 tokens into a 96 x 64 MLP) NS amplifies the bf16
    rounding of the null space, and torch's bf16 update itself moves by cosine 0.98. The other
    matrices (MLP, unsplit, the same with per_head off) measure >= 0.9987 with fp32 momentum, bound
    0.998, and >= 0.996 with int8 (GPT-2's c_fc, stored (in, out)), bound 0.995. The 4-bit formats
    (grasp4, int4, e0m3) measure >= 0.96 on the head blocks (their 4-bit error): bound 0.95, a check
    that they step per head too; their unsplit MLP matrices measure >= 0.917 (int4), bound 0.9.
    Sizes: bf16 NS moves an update's norm by ~1% (measured <= 1.2%; 4-bit <= 3%): bounds 3% and 6%."""
    state = {"block_size": block_size} if block_size else None
    got, head = _side_by_side(MODELS[model], state_format, state=state)
    blocks = _attention_blocks(head)
    for key, count in EXPECTED_BLOCKS[model].items():
        names = [n for n in blocks if f"{key}.weight" in n]
        assert names and all(blocks[n] == count for n in names), (key, blocks)
    four_bit = state_format in FOUR_BIT
    cos_heads = min(c for (n, _), v in got.items() if n in blocks for c, _ in v)
    cos_rest = min((c for (n, _), v in got.items() if n not in blocks for c, _ in v), default=1.0)
    assert cos_heads >= (0.95 if four_bit else 0.999), cos_heads
    assert cos_rest >= (0.9 if four_bit else 0.995 if state_format in ("int8", "uint8") else 0.998), cos_rest
    ratios = [r for v in got.values() for _, r in v]
    assert max(abs(r - 1) for r in ratios) < (0.06 if four_bit else 0.03), (min(ratios), max(ratios))


def test_gpt2_int8_default_blocks():
    """A limit, measured: int8 blocks run along *stored* rows. GPT-2's ``c_attn`` is stored
    ``(in, out)``, so one 256-element block of a row spans every head's q, k and v; at
    initialization q's and k's gradients are far smaller than v's (attention is near uniform), so
    their head blocks are quantized coarsely (cosine about 0.9 after 3 steps, where 32-element
    blocks give >= 0.999: test above). Not per-head's doing: the q/k/v parts of the fused c_attn
    share those blocks the same way (docs/usage.md, "Per-head Muon")."""
    got, head = _side_by_side(_gpt2, "int8")
    blocks = _attention_blocks(head)
    c_attn = min(c for (n, _), v in got.items() if n in blocks and "c_attn" in n for c, _ in v)
    assert c_attn < 0.99, c_attn  # if this fails, the limit is gone: update docs/usage.md


def test_whole_matrix_muon_is_not_per_head():
    """The yardstick can fail: Muon over whole q / k / v / o matrices (per_head off) is far from
    the per-block reference on the attention weights (MLP matrices, unsplit, still agree)."""
    got, head = _side_by_side(_llama, "fp32", per_head=False)
    attention = [min(c for c, _ in v) for (n, _), v in got.items() if "self_attn" in n]
    mlp = [min(c for c, _ in v) for (n, _), v in got.items() if ".mlp." in n]
    assert max(attention) < 0.99 and min(mlp) >= 0.999, (max(attention), min(mlp))


@pytest.mark.parametrize("adjust_lr_fn", ["match_rms_adamw"])
def test_lr_adjustment_is_per_block(adjust_lr_fn):
    """Moonlight's ``0.2 sqrt(max(rows, cols))`` per block: an o block (64 x 16) gets 0.2 * 8, not
    the whole o's 0.2 * 8 with 4x its norm spread; the update size matches torch's per block."""
    got, _ = _side_by_side(_llama, "fp32", adjust_lr_fn=adjust_lr_fn)
    assert min(c for v in got.values() for c, _ in v) >= 0.999
    assert max(abs(r - 1) for v in got.values() for _, r in v) < 0.03


def test_fp32_equals_qmuon_on_separate_blocks():
    """Per-head QMuon (fp32 momentum, fp32 Newton-Schulz) against QMuon stepping each head block as a
    parameter of its own: the same arithmetic but for where the norm's sums of squares are added
    (per row of a column block vs per row block of a whole matrix), so the updates agree to float
    reordering: relative difference <= 1e-5 (measured about 1e-7)."""
    model = _llama()
    kw = dict(lr=LR, weight_decay=0.1, momentum=BETA, state_format="fp32", newton_schulz={"dtype": "fp32"})
    opt = qmuon.build_optimizer(model, adamw_lr=0.0, routing={"per_head": True}, **kw)
    head = [d for d in route_parameters(model, per_head=True) if d.target == "muon"]
    params = dict(model.named_parameters())
    blocks = [b for d in head for b in _blocks(d)]
    ref = {(n, i): nn.Parameter(params[n].detach()[sl].clone()) for n, i, sl, _ in blocks}
    ref_opt = qmuon.QMuon(list(ref.values()), **kw)
    worst = 0.0
    for step in range(STEPS):
        _loss(model, step).backward()
        before = {n: p.detach().clone() for n, p in params.items()}
        for n, i, sl, _ in blocks:
            ref[(n, i)].grad = params[n].grad[sl].clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        for n, i, sl, _ in blocks:
            upd = params[n].detach()[sl] - before[n][sl]
            ref_upd = ref[(n, i)].detach() - before[n][sl]
            worst = max(worst, float((upd - ref_upd).norm() / ref_upd.norm()))
            with torch.no_grad():
                ref[(n, i)].copy_(params[n][sl])
    assert worst <= 1e-5, worst


# ------------------------------------------------------------------------------- counts and refusals
def test_counts_given_or_read_and_gqa():
    """Counts read from the Hugging Face config (4 heads, 2 kv heads, head_dim 16) and given
    explicitly give the same blocks; the routing table says per head."""
    model = _llama()
    read = {d.name: (d.parts, d.parts_axis) for d in route_parameters(model, per_head=True) if d.parts}
    given = {d.name: (d.parts, d.parts_axis)
             for d in route_parameters(model, per_head={"num_heads": 4, "num_kv_heads": 2, "head_dim": 16}) if d.parts}
    assert read == given
    assert read["model.layers.0.self_attn.k_proj.weight"] == ((16, 16), 0)
    assert read["model.layers.0.self_attn.o_proj.weight"] == ((16,) * 4, 1)
    table = qmuon.format_routing_table(route_parameters(model, per_head=True))
    assert "per head (2 k heads)" in table and "parts=[16, 16, 16, 16] dim=1" in table


def test_litgpt_shaped_attention():
    """LitGPT's ``CausalSelfAttention`` (class name, config ``n_head`` / ``n_query_groups`` /
    ``head_size``; litgpt is not needed): the fused qkv's q/k/v parts are refined into heads."""
    class CausalSelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = types.SimpleNamespace(n_head=4, n_query_groups=2, head_size=8)
            self.qkv = nn.Linear(32, 64, bias=False)
            self.proj = nn.Linear(32, 32, bias=False)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = CausalSelfAttention()
            self.out = nn.Linear(32, 10)

    d = {d.name: d for d in route_parameters(Net(), per_head=True)}
    assert d["attn.qkv.weight"].parts == (8,) * 8 and d["attn.proj.weight"].parts == (8,) * 4


def test_refused_by_name():
    """Bad input (issue 40): a weight whose rows (o: columns) are not a multiple of the head count is
    refused by name, before any optimizer exists; so are a model without attention and fused parts
    that cut through a head."""
    model = _llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"q_proj\.weight.*64 output rows are not a multiple of its 5 heads"):
        qmuon.build_optimizer(model, routing={"per_head": {"num_heads": 5, "num_kv_heads": 1}})
    with pytest.raises(ValueError, match=r"k_proj\.weight.*32 output rows are not 4 heads of 16"):
        route_parameters(model, per_head={"num_kv_heads": 4})
    with pytest.raises(ValueError, match=r"no attention module found in Sequential.*q_proj/k_proj/v_proj"):
        route_parameters(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), per_head=True)
    with pytest.raises(ValueError, match=r"no attention module matching 'nothing'"):
        route_parameters(model, per_head={"modules": "nothing"})
    with pytest.raises(ValueError, match=r"fused parts \[40, 24, 64\].*cut through heads of 16"):
        route_parameters(_decoder_lm(), per_head=True, fused_parts={r"qkv\.weight$": (40, 24, 64)})
    with pytest.raises(qmuon.ConfigError, match=r"unknown key 'num_head'; did you mean 'num_heads'"):
        qmuon.build_optimizer(model, routing={"per_head": {"num_head": 4}})
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_modules_regex_selects_layers():
    model = _llama()
    d = {d.name: d for d in route_parameters(model, per_head={"modules": r"layers\.0\."})}
    assert d["model.layers.0.self_attn.q_proj.weight"].parts == (16,) * 4
    assert d["model.layers.1.self_attn.q_proj.weight"].parts is None


# ------------------------------------------------------------------------------- entry points
def test_entry_points_pass_the_option():
    """``build_optimizer`` keeps the option for groups added later (``optimizer.router``); qmuon-train's
    optimizer section (QMuonConfig itself) and ``QMuonFactory`` take it as a routing option."""
    from qmuon.integrations.transformers import QMuonFactory
    from qmuon_lightning.models.lm_module import OptimizerSpec, build_lm_optimizer

    opt = qmuon.build_optimizer(_llama(), routing={"per_head": True})
    assert opt.router.per_head is True
    spec = OptimizerSpec(routing={"per_head": True})
    lm_opt = build_lm_optimizer(_decoder_lm(), spec)
    assert any(g.get("parts") == (16,) * 8 for g in lm_opt.param_groups)
    hf_opt = QMuonFactory()(_llama(), lr=1e-3, routing={"per_head": True})
    assert any(g.get("parts") == (16,) * 4 and g.get("parts_axis") == 1 for g in hf_opt.param_groups)


def test_state_dict_round_trip_one_process():
    """Save after two steps, load into a fresh per-head optimizer, step on: the same bits as
    stepping on without the round trip (int8 state)."""
    import copy

    def run(reload: bool):
        model = _decoder_lm()
        opt = qmuon.build_optimizer(model, routing={"per_head": True})
        for step in range(4):
            if step == 2 and reload:
                sd = copy.deepcopy(opt.state_dict())
                opt = qmuon.build_optimizer(model, routing={"per_head": True})
                opt.load_state_dict(sd)
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    a, b = run(False), run(True)
    assert all(torch.equal(a[n], b[n]) for n in a)


# ------------------------------------------------------------------------------- sharded (FSDP2, 2 gloo processes)
def _grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {n: 0.01 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def _wire() -> str:
    """The carrier in the Newton-Schulz dtype (what makes the sharded step bit-exact)."""
    from qmuon.core.newton_schulz import resolve_ns_dtype

    return "fp32" if resolve_ns_dtype("auto", torch.device("cpu")) == torch.float32 else "bf16"


SHARD_KW = dict(lr=LR, adamw_lr=1e-2, routing={"per_head": True},
                newton_schulz={"comm_carrier": _wire(), "comm_return": _wire()})


def _shard_kw(state_format: str) -> dict:
    """grasp4's tiles span grid_block rows, and a shard must start on a tile: 8 divides every
    shard's first row here (40, 24, 128)."""
    return dict(SHARD_KW, state_format=state_format, state={"grid_block": 8} if state_format == "grasp4" else None)


def _sharded_worker(rank: int, world: int, root: str, state_format: str) -> dict:
    """FSDP2 DecoderLM (MQA, per head) next to a single-process copy, the same full gradients;
    DCP save after 2 steps (2 ranks), then 2 more steps; and the 1-rank checkpoint of the pytest
    process loaded into a fresh sharded model, stepped on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from _dist import full_copy, step_side_by_side
    from test_distributed import _dcp_load, _dcp_save

    mesh = init_device_mesh("cpu", (world,))
    kw = _shard_kw(state_format)

    def sharded():
        m = _mqa_lm()
        for b in m.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m

    ref, net = _mqa_lm(), sharded()
    opt_ref, opt = qmuon.build_optimizer(ref, **kw), qmuon.build_optimizer(net, **kw)
    step_side_by_side(ref, opt_ref, net, opt, lambda m, s: _grads(m, s), 2)
    _dcp_save(net, opt, os.path.join(root, "two"))
    out = {"parts": sorted((g.get("parts"), g.get("parts_axis")) for g in opt.param_groups if g.get("parts")),
           "equal_after_2": {n: torch.equal(full_copy(p), dict(ref.named_parameters())[n].detach())
                             for n, p in net.named_parameters()}}
    step_side_by_side(ref, opt_ref, net, opt, lambda m, s: _grads(m, s + 2), 2)
    out["params_4"] = {n: full_copy(p) for n, p in net.named_parameters()}
    out["equal_after_4"] = all(torch.equal(out["params_4"][n], p.detach()) for n, p in ref.named_parameters())
    # 1 -> 2: the single-process checkpoint written by the pytest process
    net2 = sharded()
    opt2 = qmuon.build_optimizer(net2, **kw)
    _dcp_load(net2, opt2, os.path.join(root, "one"))
    ref2 = _mqa_lm()
    with torch.no_grad():
        for n, p in ref2.named_parameters():
            p.copy_(full_copy(dict(net2.named_parameters())[n]))
    for step in range(2, 4):
        from _dist import set_grads

        set_grads(net2, _grads(ref2, step), True)
        opt2.step()
    out["from_one_params_4"] = {n: full_copy(p) for n, p in net2.named_parameters()}
    return out


def _one_process(root: str, state_format: str) -> dict:
    """The 1-rank side: 2 steps, DCP save (plain tensors), 2 more steps."""
    from test_distributed import _dcp_save

    model = _mqa_lm()
    opt = qmuon.build_optimizer(model, **_shard_kw(state_format))
    params = dict(model.named_parameters())

    def steps(rng):
        for s in rng:
            for n, g in _grads(model, s).items():
                params[n].grad = g
            opt.step()

    steps(range(2))
    _dcp_save(model, opt, os.path.join(root, "one"), no_dist=True)
    steps(range(2, 4))
    return {n: p.detach().clone() for n, p in params.items()}


@pytest.mark.slow
@pytest.mark.ns_equivalence
@pytest.mark.parametrize("state_format", ["int8", "fp32", "grasp4"])
def test_fsdp2_equals_one_process_and_reshards(tmp_path, state_format):
    """FSDP2 on 2 gloo ranks, per head, with the Newton-Schulz dtype's carriers both ways: the same
    bits as one process (the sharded step's contract, tests/test_distributed.py), with a head block
    that a shard cuts (MQA: qkv's 5 blocks of 16 rows on 2 ranks of 40 rows; o's column blocks on
    every rank). Checkpoints reshard both ways through DCP: 2 ranks -> 1 process and 1 process -> 2 ranks
    continue with the same bits as the uninterrupted run."""
    from _dist import run_workers
    from test_distributed import _dcp_load

    one = _one_process(str(tmp_path), state_format)
    res = run_workers(_sharded_worker, 2, timeout=300, root=str(tmp_path), state_format=state_format)
    r = res[0]
    assert r["parts"] == [((16,) * 3, 1), ((16,) * 5, 0), ((128, 128), 0)], r["parts"]  # o, qkv, gate_up
    assert all(r["equal_after_2"].values()), r["equal_after_2"]
    assert r["equal_after_4"]
    assert all(torch.equal(r["params_4"][n], one[n]) for n in one)  # sharded == single process
    assert all(torch.equal(r["from_one_params_4"][n], one[n]) for n in one)  # 1 -> 2 ranks
    # 2 ranks -> 1 process: load the 2-rank checkpoint into a plain per-head optimizer, step on
    model = _mqa_lm()
    opt = qmuon.build_optimizer(model, **_shard_kw(state_format))
    _dcp_load(model, opt, os.path.join(str(tmp_path), "two"), no_dist=True)
    params = dict(model.named_parameters())
    for s in range(2, 4):
        for n, g in _grads(model, s).items():
            params[n].grad = g
        opt.step()
    assert all(torch.equal(params[n].detach(), one[n]) for n in one)


# ------------------------------------------------------------------------------- tensor parallel (2 gloo processes)
class _Attention(nn.Module):
    """q / k / v / o of 3 query heads and 1 kv head of 16 (MQA): on tp 2 the colwise q (48 rows: 24
    per rank) and the rowwise o (48 columns: 24 per rank) each cut their second head in two."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = 3, 1, 16
        self.q_proj = nn.Linear(48, 48, bias=False)
        self.k_proj = nn.Linear(48, 16, bias=False)
        self.v_proj = nn.Linear(48, 16, bias=False)
        self.o_proj = nn.Linear(48, 48, bias=False)


class _AttnNet(nn.Module):
    """One attention module (no output head: the routing has nothing to keep on AdamW)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # FSDP2 wraps modules with a forward
        a = self.attn
        return a.o_proj(a.q_proj(x))


def _tp_worker(rank: int, world: int, state_format: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from test_tensor_parallel import full, local_piece

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    tp = _AttnNet()
    torch.manual_seed(0)
    whole = _AttnNet()
    parallelize_module(tp.attn, mesh["tp"], {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                                "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
    fully_shard(tp, mesh=mesh["dp"])
    kw = dict(SHARD_KW, state_format=state_format, newton_schulz={"dtype": _wire(), "comm_carrier": _wire(),
                                                                  "comm_return": _wire()})
    o_tp, o_whole = qmuon.build_optimizer(tp, **kw), qmuon.build_optimizer(whole, **kw)
    tpp = dict(tp.named_parameters())
    for step in range(3):
        g = torch.Generator().manual_seed(10 + step)
        for n, p in whole.named_parameters():
            p.grad = torch.randn(p.shape, generator=g) * 0.01
            tpp[n].grad = local_piece(p.grad, tpp[n])
        o_tp.step()
        o_whole.step()
    return {"parts": {n: g.get("parts") for g in o_whole.param_groups for n in g["param_names"]},
            "placements": {n: str(tuple(p.placements)) for n, p in tpp.items()},
            "equal": {n: torch.equal(full(tpp[n]), p.detach()) for n, p in whole.named_parameters()}}


@pytest.mark.slow
@pytest.mark.ns_equivalence
@pytest.mark.parametrize("state_format", ["fp32", "bf16"])
def test_tensor_parallel_heads_cut_by_shards(state_format):
    """Tensor parallel (1 x 2 (dp, tp) mesh): colwise q / k / v and rowwise o, with head blocks that
    the TP shards cut (q's rows, o's columns); each block is gathered whole on its owner, so the step
    is single-process per-head QMuon's bit for bit (carriers in the NS dtype). Momentum formats
    without blocks (fp32, bf16): int8's 32-element blocks would straddle these 24-column shards, which
    the TP layout check refuses (tests/test_tensor_parallel.py)."""
    from _dist import run_workers

    r = run_workers(_tp_worker, 2, timeout=300, state_format=state_format)[0]
    assert r["parts"]["attn.q_proj.weight"] == (16,) * 3 and r["parts"]["attn.o_proj.weight"] == (16,) * 3
    assert "Shard(dim=1)" in r["placements"]["attn.o_proj.weight"], r["placements"]
    assert all(r["equal"].values()), r["equal"]


def test_gradient_release_steps_per_head_too():
    """``gradient_release=True`` steps each parameter inside backward: per head, the same bits as
    ``optimizer.step()`` after backward (int8 state)."""
    def run(release: bool) -> dict[str, torch.Tensor]:
        model = _llama()
        opt = qmuon.build_optimizer(model, routing={"per_head": True}, gradient_release=release)
        for step in range(2):
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    a, b = run(False), run(True)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_resume_into_another_layout_is_refused():
    """A checkpoint saved without per-head does not load into a per-head optimizer (the groups'
    layouts differ): refused with the fix, not silently mixed."""
    model = _llama()
    opt = qmuon.build_optimizer(model)
    _loss(model, 0).backward()
    opt.step()
    sd = opt.state_dict()
    with pytest.raises(ValueError, match=r"3 parameter groups but this optimizer has 6; build the optimizer the same way"):
        qmuon.build_optimizer(model, routing={"per_head": True}).load_state_dict(sd)
