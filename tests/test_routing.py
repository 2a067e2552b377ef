"""Parameter routing on a torch.nn.Transformer language model."""

from __future__ import annotations

import logging
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
    opt = build_optimizer(model, lr=0.02, adamw_lr=1e-3, adamw_weight_decay=0.05, state_format="int8", verbose=True)
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


def test_build_optimizer_and_a_step_print_nothing_by_default(capfd, caplog):
    """A library is quiet unless asked: the routing table goes to the ``qmuon`` logger (INFO), which
    prints nothing until the application configures logging; ``verbose=True`` prints it."""
    model = _model()
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="qmuon"):
        opt = build_optimizer(model)
        model(torch.randint(0, V, (2, 7)), torch.randint(0, V, (2, 5))).square().mean().backward()
        opt.step()
    out, err = capfd.readouterr()
    assert (out, err) == ("", ""), (out, err)
    logged = [r for r in caplog.records if "QMuon parameter routing" in r.getMessage()]
    assert len(logged) == 1 and logged[0].name.startswith("qmuon.") and logged[0].levelno == logging.INFO
    assert "embed.weight" in logged[0].getMessage()


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
    opt = build_optimizer(model, verbose=True)
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


# ------------------------------------------------------------------------- output head by role
class TinyResNet(nn.Module):
    """ResNet's layout (torchvision-free): stem, stages, pooling, then the classifier ``fc``."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(torch.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def test_resnet_fc_head_is_found_by_role():
    from qmuon.optim import output_head

    model = TinyResNet()
    assert output_head(model) is model.fc
    d = _by_name(route_parameters(model))
    assert d["fc.weight"].target == "adamw" and d["fc.weight"].reason == "output head (by role)"
    assert d["fc.bias"].target == "adamw_no_decay"
    assert all(d[n].target == "muon" for n in ("conv1.weight", "layer1.0.weight", "layer2.0.weight"))
    opt = build_optimizer(model, verbose=False)
    opt.zero_grad()
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    opt.step()
    assert "exp_avg" in opt.state[model.fc.weight]


def test_head_by_role_rules():
    from qmuon.optim import output_head

    mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4), nn.Softmax(-1))
    assert output_head(mlp) is mlp[2]  # a Sequential's output is its last layer's (parameterless ones skipped)
    assert output_head(nn.Linear(8, 4)) is None  # a one-layer model is not its own head

    class Encoder(nn.Module):  # ends in a stack of blocks: no head
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.layers = nn.ModuleList(nn.Linear(16, 32) for _ in range(2))

    assert output_head(Encoder()) is None

    class Pooled(nn.Module):  # ends in a square map (a pooler): a hidden map, not a head
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.pooler = nn.Sequential(nn.Linear(16, 16), nn.Tanh())

    assert output_head(Pooled()) is None

    class Wrapped(nn.Module):  # a LightningModule-like wrapper: the descent reaches the inner model's head
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyResNet()
            self.loss = nn.CrossEntropyLoss()  # registered last, no parameters

    w = Wrapped()
    assert output_head(w) is w.model.fc
    assert _by_name(route_parameters(w))["model.fc.weight"].target == "adamw"


def test_head_by_role_can_be_left_out_of_the_rules():
    from qmuon.optim import OUTPUT_HEAD

    rules = [r for r in DEFAULT_RULES if r.role != OUTPUT_HEAD]
    assert _by_name(route_parameters(TinyResNet(), rules=rules))["fc.weight"].target == "muon"
    with pytest.raises(ValueError, match="RoutingRule role must be one of"):
        RoutingRule("adamw", role="decoder")


def _hf_llama(tie: bool):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("tie", [False, True])
def test_hf_head_comes_from_get_output_embeddings(tie: bool):
    from qmuon.optim.routing import DEFAULT_HEAD_REGEX, output_head

    model = _hf_llama(tie)
    assert output_head(model) is model.lm_head
    by_role = [r for r in DEFAULT_RULES if r.name_regex != DEFAULT_HEAD_REGEX]  # names alone no longer help
    d = _by_name(route_parameters(model, rules=by_role))
    if tie:  # one Parameter: routed once, as the embedding it is first registered as
        assert "lm_head.weight" not in d and d["model.embed_tokens.weight"].target == "adamw"
    else:
        assert d["lm_head.weight"].target == "adamw" and d["lm_head.weight"].reason == "output head (by role)"
    assert d["model.layers.0.mlp.down_proj.weight"].target == "muon"
    # the base model (no head): get_output_embeddings() is None, nothing is guessed
    assert output_head(model.model) is None
    assert all(x.target == "muon" for x in route_parameters(model.model) if x.name.startswith("layers.") and len(x.shape) == 2)


def test_hf_gpt2_tied_head_routes_once():
    transformers = pytest.importorskip("transformers")
    from qmuon.optim import output_head

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                                                 n_positions=16, bos_token_id=0, eos_token_id=0))
    assert output_head(model) is model.lm_head and model.lm_head.weight is model.transformer.wte.weight
    d = _by_name(route_parameters(model))
    assert "lm_head.weight" not in d and d["transformer.wte.weight"].reason == "embedding table"
    opt = build_optimizer(model, verbose=False)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids))


def test_group_names_name_the_family_and_layout():
    opt = build_optimizer(_model(), verbose=False)
    assert [g["name"] for g in opt.param_groups] == ["muon", "muon_parts3", "adamw", "adamw_no_decay"]
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                                                n_positions=16, bos_token_id=0, eos_token_id=0))
    names = [g["name"] for g in build_optimizer(gpt2, verbose=False).param_groups]
    assert names == ["muon_parts3_cols_in_out", "muon_in_out", "adamw", "adamw_no_decay"]




def _stepped_model() -> tuple[nn.Module, QMuon]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    opt = build_optimizer(model, verbose=False)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    return model, opt


def test_step_refuses_a_muon_group_a_wrapper_flattened():
    """What DeepSpeed's ZeRO optimizer does to a client optimizer: the Muon group's matrices become one
    flat 1-D partition. The next step raises, naming the parameter, and changes nothing."""
    model, opt = _stepped_model()
    g = next(g for g in opt.param_groups if g["use_muon"])
    flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in g["params"]]))
    flat.grad = torch.randn_like(flat)
    g["params"] = [flat]
    before = flat.detach().clone()
    with pytest.raises(RuntimeError, match=r"'0\.weight' was \(32, 16\), it is now \(1536,\).*no step was taken"):
        opt.step()
    assert torch.equal(flat, before) and flat not in opt.state


def test_step_refuses_a_swapped_matrix_and_accepts_a_same_shape_swap():
    model, opt = _stepped_model()
    g = next(g for g in opt.param_groups if g["use_muon"])
    # a same-shape replacement (what FSDP2 / Accelerate do, with DTensors of the global shape) steps
    g["params"][1] = nn.Parameter(g["params"][1].detach().clone())
    g["params"][1].grad = torch.randn_like(g["params"][1])
    opt.step()
    assert g["params"][1] in opt.state
    g["params"][1] = nn.Parameter(torch.zeros(32, 8))
    g["params"][1].grad = torch.ones(32, 8)
    with pytest.raises(RuntimeError, match=r"'2\.weight' was \(32, 32\), it is now \(32, 8\)"):
        opt.step()
    g["params"].append(nn.Parameter(torch.zeros(4, 4)))
    g["params"][1] = nn.Parameter(torch.zeros(32, 32))
    with pytest.raises(RuntimeError, match=r"parameter #2 was nothing, it is now \(4, 4\) \(2 tensors routed, 3 held\)"):
        opt.step()
