"""Parameter routing on a torch.nn.Transformer language model."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from qmuon import QMuon, RoutingRule, build_optimizer, route_parameters
from qmuon.optim import DEFAULT_RULES, format_routing_table

E, V, FF = 16, 50, 32


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, E)
        self.transformer = nn.Transformer(d_model=E, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                          dim_feedforward=FF, dropout=0.0, batch_first=True)
        self.lm_head = nn.Linear(E, V)

    def forward(self, src, tgt):
        return self.lm_head(self.transformer(self.embed(src), self.embed(tgt)))


def _model():
    torch.manual_seed(0)
    return TinyLM()


def _by_name(decisions):
    return {d.name: d for d in decisions}


def test_default_routing_of_transformer_lm():
    model = _model()
    d = _by_name(route_parameters(model))
    assert set(d) == {n for n, _ in model.named_parameters()}
    assert d["embed.weight"].target == "adamw" and d["embed.weight"].reason == "embedding table"
    assert d["lm_head.weight"].target == "adamw" and "head" in d["lm_head.weight"].reason
    mha = [n for n in d if n.endswith("in_proj_weight")]
    assert len(mha) == 3  # encoder self-attn, decoder self-attn, decoder cross-attn
    for n in mha:
        assert d[n].target == "muon" and d[n].parts == (E, E, E), n
    for name, p in model.named_parameters():
        if p.ndim == 1:
            assert d[name].target == "adamw_no_decay", name  # biases and norm gains
        elif name not in ("embed.weight", "lm_head.weight"):
            assert d[name].target == "muon", name
            if not name.endswith("in_proj_weight"):
                assert d[name].parts is None, name
    assert d["transformer.encoder.layers.0.self_attn.out_proj.weight"].target == "muon"
    assert d["transformer.decoder.layers.0.linear2.weight"].target == "muon"


def test_build_optimizer_groups_table_and_training_step(capsys):
    model = _model()
    opt = build_optimizer(model, lr=0.02, adamw_lr=1e-3, adamw_weight_decay=0.05, state_format="int8")
    out = capsys.readouterr().out
    assert out.startswith("QMuon parameter routing:")
    for name, _ in model.named_parameters():
        assert name in out, name
    assert f"muon parts=[{E}, {E}, {E}]" in out
    assert "adamw_no_decay" in out and "parameters per optimizer:" in out

    assert isinstance(opt, QMuon)
    assert [d.name for d in opt.routing] == [n for n, _ in model.named_parameters()]
    assert all(d.param is None for d in opt.routing)  # the table does not keep tensors alive
    groups = opt.param_groups
    muon_plain = [g for g in groups if g["use_muon"] and g["parts"] is None]
    fused = [g for g in groups if g["use_muon"] and g["parts"] is not None]
    adamw = [g for g in groups if not g["use_muon"]]
    # the three in_proj weights share one layout, so they share one group
    assert len(muon_plain) == 1 and len(fused) == 1 and len(adamw) == 2
    assert fused[0]["parts"] == (E, E, E) and len(fused[0]["params"]) == 3
    assert all(n.endswith("in_proj_weight") for n in fused[0]["param_names"])
    decay, no_decay = adamw
    assert set(decay["param_names"]) == {"embed.weight", "lm_head.weight"}
    assert decay["weight_decay"] == 0.05 and decay["lr"] == 1e-3
    assert no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 1 for p in no_decay["params"])
    # every trainable parameter is in exactly one group
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())

    # and it trains
    src = torch.randint(0, V, (2, 7))
    tgt = torch.randint(0, V, (2, 5))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = nn.functional.cross_entropy(model(src, tgt).reshape(-1, V), tgt.reshape(-1))
    loss.backward()
    opt.step()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert set(changed) == set(before), set(before) - set(changed)


def test_build_optimizer_quiet_when_not_verbose(capsys):
    build_optimizer(_model(), verbose=False)
    assert capsys.readouterr().out == ""


def test_user_rule_overrides_defaults():
    model = _model()
    rules = [RoutingRule("adamw", name_regex=r"\.linear1\.", reason="user: ffn in"), *DEFAULT_RULES]
    d = _by_name(route_parameters(model, rules=rules))
    for n in d:
        if ".linear1." in n:
            # first match wins: even the 1-D bias goes to "adamw", not "adamw_no_decay"
            assert d[n].target == "adamw" and d[n].reason == "user: ffn in", n
    assert d["transformer.encoder.layers.0.linear2.weight"].target == "muon"
    opt = build_optimizer(model, routing={"rules": rules}, verbose=False)
    decay = next(g for g in opt.param_groups if not g["use_muon"] and g["weight_decay"] > 0)
    assert "transformer.encoder.layers.0.linear1.weight" in decay["param_names"]


def test_fused_parts_by_regex_and_module_attribute():
    model = _model()
    # a regex beats the automatic MultiheadAttention detection
    fused = {r"encoder\.layers\.0\.linear1\.weight$": (16, 16), r"encoder\.layers\.0\.self_attn\.in_proj_weight$": (32, 16)}
    model.transformer.decoder.layers[0].linear1.qmuon_fused_parts = {"weight": (8, 24)}
    d = _by_name(route_parameters(model, fused_parts=fused))
    assert d["transformer.encoder.layers.0.linear1.weight"].parts == (16, 16)
    assert d["transformer.encoder.layers.0.self_attn.in_proj_weight"].parts == (32, 16)
    assert d["transformer.decoder.layers.0.linear1.weight"].parts == (8, 24)
    assert d["transformer.decoder.layers.0.self_attn.in_proj_weight"].parts == (E, E, E)
    opt = build_optimizer(model, routing={"fused_parts": fused}, verbose=False)
    parts = {g["param_names"][0]: g["parts"] for g in opt.param_groups if g["use_muon"] and g["parts"]}
    assert parts["transformer.encoder.layers.0.linear1.weight"] == (16, 16)
    assert parts["transformer.decoder.layers.0.linear1.weight"] == (8, 24)


def test_frozen_parameters_are_listed_but_not_optimized(capsys):
    model = _model()
    frozen = model.transformer.encoder.layers[0].linear2.weight
    frozen.requires_grad_(False)
    model.embed.weight.requires_grad_(False)
    opt = build_optimizer(model)
    d = _by_name(opt.routing)
    assert d["transformer.encoder.layers.0.linear2.weight"].target == "frozen"
    assert d["embed.weight"].target == "frozen"
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(frozen) not in ids and id(model.embed.weight) not in ids
    assert re.search(r"transformer\.encoder\.layers\.0\.linear2\.weight\s+16x32\s+frozen", capsys.readouterr().out)


def test_tied_weights_are_routed_once():
    model = _model()
    model.lm_head.weight = model.embed.weight  # tie
    decisions = route_parameters(model)
    assert [x.name for x in decisions].count("embed.weight") == 1
    assert "lm_head.weight" not in {x.name for x in decisions}
    opt = build_optimizer(model, verbose=False)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids))


def test_rule_table_without_catch_all_is_an_error():
    with pytest.raises(ValueError, match=r"no routing rule matched parameter 'embed.weight'.*catch-all"):
        route_parameters(_model(), rules=[RoutingRule("adamw_no_decay", max_ndim=1)])
    with pytest.raises(ValueError, match="RoutingRule target must be one of"):
        RoutingRule("sgd")


def test_format_routing_table_counts():
    table = format_routing_table(route_parameters(_model()))
    last = table.splitlines()[-1]
    model = _model()
    n_muon = sum(p.numel() for n, p in model.named_parameters() if p.ndim >= 2 and n not in ("embed.weight", "lm_head.weight"))
    assert f"muon={n_muon:,}" in last
