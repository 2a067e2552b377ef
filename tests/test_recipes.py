"""Every recipe under ``recipes/``: its documented command parses (``--print_config``), the model
builds on the meta device (its vocabulary resolved by the datamodule, as ``qmuon-train``'s link does;
a ``data.source=tokens`` recipe gets a stand-in meta.json with the vocabulary its header states)
with the parameter count and size class its header states, the memory
budget in its header matches :func:`memory_budget` recomputed from the merged config, the
optimizer builds, and an FSDP strategy name resolves to the registered strategy.

Nothing here allocates a real 124M / 350M model: parameters live on the meta device.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml

from _dist import REPO
from qmuon_lightning.callbacks.summary import optimizer_state_bytes
from qmuon_lightning.cli import main
from qmuon_lightning.data import ByteLMDataModule
from qmuon_lightning.data.token_corpus import CORPUS_FORMAT, CORPUS_VERSION, token_dtype
from qmuon_lightning.models.lm_module import DecoderLMModule, OptimizerSpec, build_lm_optimizer, memory_budget

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec", "ignore:.*GPU available but not used")

RECIPES = sorted(p for p in (REPO / "recipes").rglob("*.yaml") if p.name != "base.yaml")
UNITS = {"MiB": 2**20, "GiB": 2**30}


def _header(path: Path) -> str:
    return "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))


def _command(path: Path) -> list[str]:
    """The ``--config`` arguments of the ``qmuon-train fit`` command in the recipe's header."""
    m = re.search(r"qmuon-train fit((?: --config \S+)+)\s*$", _header(path), re.M)
    assert m, f"{path}: the header must show the command: qmuon-train fit --config ..."
    args = shlex.split(m.group(1))
    assert args[-1] == str(path.relative_to(REPO)), f"{path}: the command must end with --config of this file"
    return args


def _merged(path: Path, capsys) -> dict:
    args = [a if a == "--config" else str(REPO / a) for a in _command(path)]
    with pytest.raises(SystemExit) as exc:
        main(["fit", *args, "--print_config"])
    assert exc.value.code in (None, 0)
    return yaml.safe_load(capsys.readouterr().out)


def _data_vocab(cfg: dict, header: str, tmp_path: Path) -> int:
    """The vocabulary the datamodule resolves (the source of qmuon-train's link to model.vocab_size).

    A ``tokens`` recipe points at a corpus prepared on the user's machine; here a stand-in corpus
    directory carries a meta.json with the vocabulary the header states ("vocabulary 50,257").
    """
    data = dict(cfg["data"])
    if data["source"] == "tokens":
        m = re.search(r"vocabulary ([\d,]+)", header)
        assert m, "a data.source=tokens recipe's header must state the tokenizer's vocabulary"
        vocab = int(m.group(1).replace(",", ""))
        dtype = token_dtype(vocab)
        for name in ("train.bin", "val.bin"):
            (tmp_path / name).write_bytes(b"")
        (tmp_path / "meta.json").write_text(json.dumps({
            "format": CORPUS_FORMAT, "version": CORPUS_VERSION, "dtype": dtype, "vocab_size": vocab,
            "tokens": {"train": 0, "val": 0}, "tokenizer": {"name_or_path": "stand-in"}}))
        data["paths"] = [str(tmp_path)]
    return ByteLMDataModule(**data).vocab_size


def _module(cfg: dict, vocab_size: int) -> DecoderLMModule:
    kw = dict(cfg["model"])
    # --print_config leaves out link targets; qmuon-train sets these two from data (test_cli checks the links).
    kw["max_seq_len"] = cfg["data"]["seq_len"]
    kw["vocab_size"] = vocab_size
    kw["optimizer"] = OptimizerSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in kw["optimizer"].items()})
    return DecoderLMModule(**kw)


def test_recipes_exist():
    names = {str(p.relative_to(REPO / "recipes")) for p in RECIPES}
    assert "cpu/smoke.yaml" in names
    for size in ("gpt124m", "gpt350m"):
        for opt in ("adamw", "torch_muon", "bf16", "int8", "grasp4"):
            assert f"gb10/{size}_{opt}.yaml" in names
    assert any("fsdp" in n for n in names)
    for size in ("gpt124m", "gpt350m"):  # FineWeb-Edu / GPT-2 tokenizer family (data.source=tokens)
        for opt in ("adamw", "int8", "grasp4"):
            assert f"gb10/fineweb_{size}_{opt}.yaml" in names


@pytest.mark.qmuon_train
@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(REPO / "recipes")) for p in RECIPES])
def test_recipe(path, capsys, tmp_path):
    cfg = _merged(path, capsys)
    header = _header(path)

    module = _module(cfg, _data_vocab(cfg, header, tmp_path))
    with torch.device("meta"):
        module.configure_model()
    assert all(p.is_meta for p in module.parameters())
    n = module.num_parameters()
    stated = re.search(r"([\d,]{6,}) parameters", header)
    assert stated, f"{path}: the header must state the exact parameter count"
    assert n == int(stated.group(1).replace(",", "")), (n, stated.group(0))
    size = re.search(r"size class: ([\d.]+)M parameters", header)
    assert size, f"{path}: the header must state 'size class: <N>M parameters'"
    # "124M-class" etc.: within 15% of the nominal size (the vocabulary moves the count a little).
    assert abs(n / (float(size.group(1)) * 1e6) - 1) < 0.15, (n, size.group(0))

    # The header's budget line == memory_budget recomputed from the merged config.
    t = cfg["trainer"]
    fsdp = str(t.get("strategy")).startswith("qmuon_fsdp")
    world = int(t["num_nodes"]) * int(t["devices"]) if fsdp else 1
    b = memory_budget(module, batch_size=cfg["data"]["batch_size"], seq_len=cfg["data"]["seq_len"],
                      precision=str(t["precision"]), world_size=world)
    m = re.search(r"budget: (.*) (MiB|GiB)$", header, re.M)
    assert m, f"{path}: the header must carry a 'budget: key=value ... GiB' line"
    stated_budget = dict(kv.split("=") for kv in m.group(1).split())
    for key, value in stated_budget.items():
        # The header rounds to 2 decimals.
        assert b[key] / UNITS[m.group(2)] == pytest.approx(float(value), abs=0.0051), (key, b[key], value)

    # The optimizer builds over the (meta) parameters with the recipe's settings.
    opt = build_lm_optimizer(module.model, module.optimizer_spec, verbose=False)
    assert len(opt.param_groups) >= 2

    if fsdp:
        from lightning.pytorch.strategies import StrategyRegistry

        from qmuon_lightning.strategies import QMuonFSDPStrategy

        strategy = StrategyRegistry.get(t["strategy"])
        assert isinstance(strategy, QMuonFSDPStrategy)
        if module.optimizer_spec.name in ("adamw", "torch_muon"):
            # A baseline must not be swapped for QMuon by the strategy.
            assert strategy.optimizer_mode == "keep"
    if path.parent.name == "gb10":
        # bf16 autocast over fp32 weights, or bf16 weights without an fp32 master (a bf16_update rule)
        assert t["accelerator"] == "cuda" and t["precision"] in ("bf16-mixed", "bf16-true")
        assert f"runs/gb10/{path.stem}" == t["default_root_dir"]
        assert t["callbacks"][0]["init_args"]["dirpath"] == f"runs/gb10/{path.stem}/checkpoints"


@pytest.mark.parametrize("name, state_format, variant, bf16_update",
                         [("qmuon", "int8", "muon", None), ("qmuon", "grasp4", "muon", None),
                          ("qmuon", "bf16", "muon", None), ("adamw", None, "muon", None),
                          ("torch_muon", None, "muon", None), ("qmuon", "int8", "normuon", None),
                          ("qmuon", "int8", "muon", "stochastic"), ("qmuon", "int8", "muon", "ecc8")])
def test_memory_budget_state_is_exact(name, state_format, variant, bf16_update):
    """memory_budget's optimizer-state bytes == the state tensors a real optimizer holds after a step
    (NorMuon: its per-row second moment too; bf16 weights (``bf16-true``): the ``bf16_update`` rule's
    correction codes, none for stochastic, one int8 per element for ecc8)."""
    torch.manual_seed(0)
    options = {k: v for k, v in (("state_format", state_format), ("bf16_update", bf16_update)) if v is not None}
    spec = OptimizerSpec(name=name, warmup_steps=0, update={"variant": variant}, **options)
    module = DecoderLMModule(d_model=64, n_layers=2, n_heads=2, max_seq_len=16, optimizer=spec)
    module.configure_model()
    precision = "bf16-mixed"
    if bf16_update is not None:
        module.model.to(torch.bfloat16)
        precision = "bf16-true"
    opt = build_lm_optimizer(module.model, spec, verbose=False)
    x = torch.randint(0, 256, (2, 16))
    module._loss((x, x)).backward()
    opt.step()
    held = sum(optimizer_state_bytes(opt))
    assert held == memory_budget(module, batch_size=2, seq_len=16, precision=precision)["optimizer_state"]
    if bf16_update == "ecc8":  # +1 byte per trained element over the same run without the codes
        assert held - memory_budget(module, batch_size=2, seq_len=16)["optimizer_state"] == sum(
            p.numel() for p in module.model.parameters())
