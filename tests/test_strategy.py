"""QMuonFSDPStrategy: registration, argument validation, sharding policy, optimizer swap (single
process), and end-to-end Lightning runs on 2 CPU processes with gloo.

The multi-process tests run this file as a script (``python tests/test_strategy.py <scenario>``):
Lightning's ``Trainer(accelerator="cpu", devices=2)`` then starts rank 1 itself by re-running the
same command, as it does for any training script. Each scenario writes one JSON file of
measurements per rank; the tests assert on them. A hung collective fails through the process-group
timeout and the subprocess timeout instead of blocking CI.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lightning as L
from lightning.pytorch.strategies import StrategyRegistry

import qmuon_lightning  # noqa: F401  (registers the strategies)
from _helpers import assert_same
from _dist import run_launcher, subprocess_env
from qmuon import QMuon
from qmuon_lightning.models import DecoderLM
from qmuon_lightning.strategies import QMuonFSDPStrategy
from qmuon.integrations.fabric.mixin import PRESETS
from qmuon.integrations.fabric.sharding import select_blocks, select_roots
from qmuon.integrations.fabric import optimizer_swap as swap
from qmuon.integrations.fabric.sharding import resolve_policy

# ---------------------------------------------------------------------------------------------
# Shared model (also used by the worker scenarios)

VOCAB, D, SEQ = 64, 32, 16
USER_ADAMW = {"lr": 3e-3, "betas": (0.8, 0.9), "eps": 1e-7, "weight_decay": 0.05}
WARMUP = 3


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP)


class TinyLM(L.LightningModule):
    """A 2-block DecoderLM with a frozen matrix (used in forward) and an unused trainable matrix
    (never in forward, so its gradient stays None). ``configure_optimizers`` returns plain AdamW
    with a warmup LambdaLR, as a user's module would; no ``configure_model``."""

    def __init__(self, shard_itself: bool = False) -> None:
        super().__init__()
        self.model = DecoderLM(vocab_size=VOCAB, d_model=D, n_layers=2, n_heads=2, max_seq_len=SEQ, mlp_hidden=64)
        self.model.unused = nn.Linear(D, D, bias=False)
        self.model.blocks[0].attn.proj.weight.requires_grad_(False)
        self.shard_itself = shard_itself

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model.loss(x, y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.model.loss(x, y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], **USER_ADAMW)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class SelfShardingLM(TinyLM):
    """Shards itself in ``configure_model`` (the Lightning ModelParallelStrategy way)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class DirectParamLM(TinyLM):
    """Holds a parameter directly on the LightningModule, so the LightningModule itself is the
    root FSDP unit; the training step goes through ``self(...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.ones(VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) * self.logit_scale

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))


def make_data(n: int = 16) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    ds = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)


def _strategy(**kw: Any) -> QMuonFSDPStrategy:
    return QMuonFSDPStrategy(timeout=timedelta(seconds=120), **kw)


# ---------------------------------------------------------------------------------------------
# Registration and the three ways to name the strategy

def _trainer(strategy: Any, **kw: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, **kw,
    )


def test_registered_names_resolve_to_the_strategy() -> None:
    for name, (description, params) in PRESETS.items():
        assert name in StrategyRegistry, name
        assert StrategyRegistry[name]["description"] == description
        trainer = _trainer(name)
        s = trainer.strategy
        assert type(s) is QMuonFSDPStrategy
        assert s.optimizer_mode == params.get("optimizer", "qmuon")
        assert s.optimizer_kwargs == dict(params.get("optimizer_kwargs", {}))
        assert trainer.num_devices == 2
    assert StrategyRegistry["qmuon_fsdp_grasp4"]["init_params"]["optimizer_kwargs"] == {"state_format": "grasp4"}


def test_registration_is_idempotent_and_lists_names() -> None:
    from qmuon_lightning.strategies import register_strategies

    names = register_strategies()
    assert set(PRESETS) <= set(names)
    assert register_strategies() == names  # re-registering overrides, does not raise


def test_instance_is_used_as_given() -> None:
    s = QMuonFSDPStrategy(optimizer="keep", shard_policy="root", save_distributed_checkpoint=False)
    assert _trainer(s).strategy is s


def test_yaml_class_path_through_lightning_cli(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 2\n"
        "  logger: false\n"
        "  strategy:\n"
        "    class_path: qmuon_lightning.strategies.QMuonFSDPStrategy\n"
        "    init_args:\n"
        "      optimizer: qmuon\n"
        "      optimizer_kwargs: {state_format: uint8, lr: 0.01, state: {rounding: stochastic}}\n"
        "      shard_policy: [qmuon_lightning.models.decoder_lm.Block]\n"
        "      save_distributed_checkpoint: false\n"
    )
    cli = LightningCLI(TinyLM, run=False, args=["--config", str(cfg)], save_config_callback=None)
    s = cli.trainer.strategy
    assert type(s) is QMuonFSDPStrategy
    assert s.optimizer_kwargs == {"state_format": "uint8", "lr": 0.01, "state": {"rounding": "stochastic"}}
    assert s._shard_policy == ["qmuon_lightning.models.decoder_lm.Block"]
    assert s._save_distributed_checkpoint is False
    # The string form through the CLI too.
    cli = LightningCLI(TinyLM, run=False, args=["--trainer.strategy=qmuon_fsdp_grasp4", "--trainer.accelerator=cpu",
                                               "--trainer.devices=2", "--trainer.logger=false"],
                       save_config_callback=None)
    assert type(cli.trainer.strategy) is QMuonFSDPStrategy


# ---------------------------------------------------------------------------------------------
# Argument validation: bad input fails at construction, before any process starts

@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"optimizer": "adam"}, r"optimizer='adam' is not one of"),
        ({"optimizer_kwargs": {"lrr": 0.1}}, r"unknown QMuon option 'lrr'; did you mean 'lr'"),
        ({"optimizer_kwargs": {"state_format": "int3"}}, r"int3"),
        ({"optimizer_kwargs": {"lr": -1.0}}, r"lr must be >= 0"),
        ({"optimizer_kwargs": {"state": {"block_size": 100}}}, r"block_size must be a multiple of 32"),
        ({"optimizer_kwargs": {"state": {"rounding": "up"}}}, r"rounding must be"),
        ({"optimizer_kwargs": {"verbose": True}}, r"unknown QMuon option 'verbose'"),
        ({"optimizer_kwargs": {"rounding": "up"}}, r"unknown QMuon option 'rounding'; did you mean 'state.rounding'"),
        ({"optimizer_kwargs": {"update": {"lr_ratios": "always"}}}, r"lr_ratios must be one of \('warn', 'hold', 'off'\)"),
        ({"optimizer": "keep", "optimizer_kwargs": {"lr": 0.1}}, r"optimizer='keep'.*would be ignored"),
        ({"shard_policy": "blocks"}, r"shard_policy='blocks' is not a policy"),
        ({"shard_policy": ["no_such_pkg.Block"]}, r"cannot import it"),
        ({"shard_policy": ["torch.optim.AdamW"]}, r"not an nn.Module subclass"),
        ({"shard_policy": [3]}, r"entries must be classes or class names"),
        ({"shard_policy": []}, r"non-empty list"),
        ({"tensor_parallel_size": 0}, r"tensor_parallel_size must be"),
        ({"data_parallel_size": "all"}, r"data_parallel_size must be"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        QMuonFSDPStrategy(**kwargs)


def test_optimizer_kwargs_type_is_checked() -> None:
    with pytest.raises(TypeError, match="optimizer_kwargs must be a QMuonConfig or a dict"):
        QMuonFSDPStrategy(optimizer_kwargs=[("lr", 0.1)])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Sharding policy (which modules become FSDP units)

def test_auto_policy_picks_module_list_children_then_roots() -> None:
    lm = TinyLM()
    blocks = select_blocks(lm, "auto")
    assert [n for n, _ in blocks] == ["model.blocks.0", "model.blocks.1"]
    assert [n for n, _ in select_roots(lm, blocks)] == ["model"]


def test_auto_policy_without_module_list_uses_repeated_classes() -> None:
    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
            self.norm = nn.LayerNorm(16)
            self.out = nn.Linear(16, 4)

    m = MLP()
    blocks = [n for n, _ in select_blocks(m, "auto")]
    # Linear occurs 3 times; ReLU (twice) holds no parameters; LayerNorm occurs once.
    assert blocks == ["body.0", "body.2", "out"]
    # body holds no parameter outside its blocks, so it needs no unit of its own.
    assert [n for n, _ in select_roots(m, select_blocks(m, "auto"))] == ["norm"]


def test_outermost_match_and_tied_weights() -> None:
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.x = Inner()
            self.y = Inner()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight  # tied: head cannot be a unit of its own

    m = Outer()
    assert [n for n, _ in select_blocks(m, [nn.Linear])] == ["x.a", "y.a"]
    assert [n for n, _ in select_blocks(m, ["Inner"])] == ["x", "y"]  # bare class name
    assert [n for n, _ in select_blocks(m, "auto")] == ["x", "y"]  # Inner outermost; Linear inside it
    assert [n for n, _ in select_roots(m, select_blocks(m, "auto"))] == ["emb", "head"]
    assert select_blocks(m, lambda name, mod: name == "x") == [("x", m.x)]
    assert select_blocks(m, "root") == []


def test_direct_parameters_make_the_module_itself_the_root() -> None:
    class WithOwn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    m = WithOwn()
    blocks = select_blocks(m, "auto")
    assert [n for n, _ in blocks] == ["layers.0", "layers.1"]
    assert select_roots(m, blocks) == [("", m)]


def test_root_policy_descends_into_containers() -> None:
    class Top(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.heads = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 3)})
            self.act = nn.ReLU()

    m = Top()
    assert select_blocks(m, "root") == []
    assert [n for n, _ in select_roots(m, [])] == ["layers.0", "layers.1", "heads.a", "heads.b"]
    blocks = select_blocks(m, "auto")
    assert [n for n, _ in blocks] == ["layers.0", "layers.1"]
    assert [n for n, _ in select_roots(m, blocks)] == ["heads.a", "heads.b"]


def test_policy_resolution_accepts_classes_and_dotted_paths() -> None:
    pred = resolve_policy(["qmuon_lightning.models.decoder_lm.Block", nn.Embedding])
    lm = TinyLM()
    assert pred("x", lm.model.blocks[0]) and pred("x", lm.model.embed) and not pred("x", lm.model.norm)


# ---------------------------------------------------------------------------------------------
# Optimizer swap, single process (the same code path the strategy runs after sharding)

def _connect(strategy: QMuonFSDPStrategy, module: L.LightningModule) -> None:
    """Give the strategy the module and its configured optimizers the way Lightning's
    ``_init_optimizers_and_lr_schedulers`` does, without starting processes."""
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    trainer = _trainer(strategy)
    module.trainer = trainer
    strategy.connect(module)
    strategy.optimizers, strategy.lr_scheduler_configs = _init_optimizers_and_lr_schedulers(module)


def test_swap_keeps_user_adamw_settings_and_rebinds_the_scheduler(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    lm = TinyLM()
    s = QMuonFSDPStrategy(optimizer_kwargs={"lr": 0.02, "state_format": "int8"})
    _connect(s, lm)
    user_opt = s.optimizers[0]
    with caplog.at_level("INFO"):
        s._swap_optimizer()
    opt = s.optimizers[0]
    assert isinstance(opt, QMuon) and opt is not user_opt
    assert s.lightning_module.optimizers(use_pl_optimizer=False) is opt
    muon = [g for g in opt.param_groups if g["use_muon"]]
    adamw = [g for g in opt.param_groups if not g["use_muon"]]
    assert muon and adamw
    for g in adamw:
        assert g["initial_lr"] == USER_ADAMW["lr"]
        assert g["betas"] == USER_ADAMW["betas"] and g["eps"] == USER_ADAMW["eps"]
    assert {g["weight_decay"] for g in adamw} == {USER_ADAMW["weight_decay"], 0.0}  # 1-D group: no decay
    assert {g["initial_lr"] for g in muon} == {0.02}
    # The warmup factor applied at construction (step 0: 1/3) carries over to every new group.
    for g in opt.param_groups:
        assert g["lr"] == pytest.approx(g["initial_lr"] * warmup(0), rel=1e-12)
    sched = s.lr_scheduler_configs[0].scheduler
    assert sched.optimizer is opt and len(sched.lr_lambdas) == len(opt.param_groups)
    # Frozen parameters are left out; the unused trainable one is optimized.
    names = [n for g in opt.param_groups for n in g["param_names"]]
    assert "model.blocks.0.attn.proj.weight" not in names and "model.unused.weight" in names
    routing = {d.name: d.target for d in s.routing}
    assert routing["model.blocks.0.attn.proj.weight"] == "frozen"
    assert routing["model.embed.weight"] == "adamw" and routing["model.lm_head.weight"] == "adamw"
    assert routing["model.blocks.1.attn.qkv.weight"] == "muon"
    assert "QMuon parameter routing" in caplog.text and "model.blocks.1.attn.qkv.weight" in caplog.text

    # Two optimizer + scheduler steps follow the user's warmup shape from each group's own base lr.
    for step in range(2):
        for p in lm.parameters():
            if p.requires_grad and p is not lm.model.unused.weight:
                p.grad = torch.randn_like(p) * 1e-2
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "optimizer.step() overridden" / order warnings
            opt.step()
            sched.step()
        for g in opt.param_groups:
            assert g["lr"] == pytest.approx(g["initial_lr"] * warmup(step + 1), rel=1e-12)
    assert s.lightning_module.trainer.strategy is s


def test_swap_routing_logged_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    import qmuon_lightning.strategies.fsdp as mod

    messages: list[str] = []
    monkeypatch.setattr(mod, "rank_zero_info", lambda msg, *a, **k: messages.append(msg))
    s = QMuonFSDPStrategy()
    _connect(s, TinyLM())
    s._swap_optimizer()
    # A second setup (e.g. fit called again): optimizers are configured and swapped again, the table is not re-logged.
    s.optimizers, s.lr_scheduler_configs = _init_optimizers_and_lr_schedulers(s.lightning_module)
    s._swap_optimizer()
    assert isinstance(s.optimizers[0], QMuon)
    assert sum("QMuon parameter routing" in m for m in messages) == 1


def test_swap_warns_when_nothing_goes_to_muon() -> None:
    class OnlyEmbeddings(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.bias = nn.Parameter(torch.zeros(4))

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters())

    s = QMuonFSDPStrategy()
    _connect(s, OnlyEmbeddings())
    with pytest.warns(UserWarning, match="no parameter was routed to Muon"):
        s._swap_optimizer()


def test_swap_explicit_adamw_kwargs_win_and_none_optimizer_builds_from_kwargs() -> None:
    s = QMuonFSDPStrategy(optimizer_kwargs={"adamw_lr": 1e-4})
    _connect(s, TinyLM())
    s._swap_optimizer()
    adamw = [g for g in s.optimizers[0].param_groups if not g["use_muon"]]
    assert {g["initial_lr"] for g in adamw} == {1e-4} and {g["betas"] for g in adamw} == {USER_ADAMW["betas"]}

    class NoOptimizer(TinyLM):
        def configure_optimizers(self) -> None:
            return None

    s = QMuonFSDPStrategy(optimizer_kwargs={"state_format": "grasp4", "adamw_lr": 2e-4})
    with pytest.warns(UserWarning, match="returned `None`"):
        _connect(s, NoOptimizer())
    s._swap_optimizer()
    opt = s.optimizers[0]
    assert isinstance(opt, QMuon)
    assert {g["state_format"] for g in opt.param_groups if g["use_muon"]} == {"grasp4"}


def test_swap_refusals_name_the_fix() -> None:
    class TwoOptimizers(TinyLM):
        automatic_optimization = False

        def configure_optimizers(self) -> Any:
            return [torch.optim.AdamW(self.model.parameters()), torch.optim.AdamW(self.model.parameters())]

    s = QMuonFSDPStrategy()
    _connect(s, TwoOptimizers())
    with pytest.raises(swap.SwapError, match="returned 2 optimizers.*optimizer='keep'"):
        s._swap_optimizer()

    class Partial(TinyLM):
        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.model.blocks.parameters())

    s = QMuonFSDPStrategy()
    _connect(s, Partial())
    with pytest.raises(swap.SwapError, match=r"does not update \d+ trainable parameter.*requires_grad_\(False\)"):
        s._swap_optimizer()

    class UsesSGD(TinyLM):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    s = QMuonFSDPStrategy()
    _connect(s, UsesSGD())
    with pytest.raises(swap.SwapError, match="returned SGD.*adamw_lr"):
        s._swap_optimizer()

    class OneCycle(TinyLM):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters())
            return [opt], [torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=10)]

    s = QMuonFSDPStrategy()
    _connect(s, OneCycle())
    with pytest.raises(swap.SwapError, match="OneCycleLR writes absolute"):
        s._swap_optimizer()


def test_swap_keeps_a_qmuon_and_keep_mode_swaps_nothing() -> None:
    class ReturnsQMuon(TinyLM):
        def configure_optimizers(self) -> Any:
            return qmuon_lightning.build_optimizer(self, verbose=False)

    s = QMuonFSDPStrategy()
    _connect(s, ReturnsQMuon())
    opt = s.optimizers[0]
    s._swap_optimizer()
    assert s.optimizers[0] is opt


def test_adamw_settings_from_groups_and_adam_l2_note() -> None:
    m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    opt = torch.optim.AdamW(
        [{"params": [m[0].weight], "weight_decay": 0.1}, {"params": [m[0].bias, *m[1].parameters()], "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.99),
    )
    settings, notes = swap.adamw_settings(opt)
    assert settings == {"adamw_lr": 1e-3, "adamw_weight_decay": 0.1, "update": {"adamw_betas": (0.9, 0.99), "adamw_eps": 1e-8}}
    assert notes == []
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=0.01, amsgrad=True)
    _, notes = swap.adamw_settings(opt)
    assert any("L2 weight decay" in n for n in notes) and any("amsgrad" in n for n in notes)


def test_rebind_sequential_scheduler() -> None:
    m = nn.Linear(8, 8)
    old = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.SequentialLR(
        old,
        [torch.optim.lr_scheduler.LinearLR(old, start_factor=0.5, total_iters=2),
         torch.optim.lr_scheduler.CosineAnnealingLR(old, T_max=4)],
        milestones=[2],
    )
    new = QMuon([{"params": [m.weight], "lr": 0.02}, {"params": [m.bias], "use_muon": False, "lr": 1e-3}])
    swap.rebind_scheduler(sched, old, new)
    assert [g["lr"] for g in new.param_groups] == pytest.approx([0.02 * 0.5, 1e-3 * 0.5])
    for _ in range(3):
        m.weight.grad, m.bias.grad = torch.zeros_like(m.weight), torch.zeros_like(m.bias)
        new.step()
        sched.step()
    ratio = [g["lr"] / g["initial_lr"] for g in new.param_groups]
    assert ratio[0] == pytest.approx(ratio[1], rel=1e-9) and 0 < ratio[0] < 1


def test_rebind_reduce_on_plateau() -> None:
    m = nn.Linear(8, 8)
    old = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(old, factor=0.5, patience=0, min_lr=1e-6)
    new = QMuon([{"params": [m.weight], "lr": 0.02}, {"params": [m.bias], "use_muon": False, "lr": 1e-3}])
    swap.rebind_scheduler(sched, old, new)
    assert sched.min_lrs == [1e-6, 1e-6]
    for metric in (1.0, 2.0, 3.0):  # the first sets "best"; two worse values halve every group twice
        sched.step(metric)
    assert [g["lr"] for g in new.param_groups] == pytest.approx([0.02 / 4, 1e-3 / 4], rel=1e-12)


# ---------------------------------------------------------------------------------------------
# End to end: 2 CPU processes (gloo), launched by Lightning


def _run_worker(scenario: str, out: Path, *extra: str, timeout: float = 300) -> list[dict]:
    """Run ``python tests/test_strategy.py scenario out extra...`` in ``out`` (Lightning starts rank 1
    by re-running the command; on a timeout both ranks are killed); returns each rank's JSON."""
    log = run_launcher([sys.executable, str(Path(__file__).resolve()), scenario, str(out), *extra], timeout=timeout,
                       env=subprocess_env(PYTHONWARNINGS="ignore"), cwd=out, what=f"scenario {scenario}")
    results = sorted(out.glob(f"{scenario}_rank*.json"))
    if not results:
        pytest.fail(f"scenario {scenario} wrote no results; log tail:\n{log[-8000:]}")
    return [json.loads(p.read_text()) for p in results]


@pytest.fixture(scope="module")
def same_world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("qmuon_fsdp")
    return out, _run_worker("same_world", out, "qmuon")


@pytest.fixture(scope="module")
def one_proc(same_world: tuple[Path, list[dict]]) -> tuple[Path, list[dict]]:
    out, _ = same_world
    return out, _run_worker("one_proc", out, "qmuon")


@pytest.mark.slow
def test_two_processes_shard_swap_and_train(same_world: tuple[Path, list[dict]]) -> None:
    """A module without configure_model whose configure_optimizers returns AdamW + LambdaLR:
    the policy shards it, QMuon replaces AdamW (user AdamW settings kept), frozen and unused
    parameters are left alone, and the optimizer's communication bytes are logged."""
    _, ranks = same_world
    assert len(ranks) == 2
    for r in ranks:
        assert r["world_size"] == 2 and r["all_dtensor"]
        assert r["blocks"] == ["model.blocks.0", "model.blocks.1"] and r["roots"] == ["model"]
        assert r["optimizer_type"] == "QMuon" and r["global_step"] == 6
        muon_lrs = {lr for lr, m in zip(r["initial_lrs"], r["use_muon"]) if m}
        adamw_lrs = {lr for lr, m in zip(r["initial_lrs"], r["use_muon"]) if not m}
        assert muon_lrs == {0.02} and adamw_lrs == {USER_ADAMW["lr"]}
        # After 6 steps the warmup (3 steps) is over: lr == initial_lr in every group.
        assert r["lrs"] == pytest.approx(r["initial_lrs"], rel=1e-12)
        assert r["frozen_unchanged"] and not r["frozen_in_state"]
        assert r["unused_unchanged"] and not r["unused_in_state"]
        assert r["trained_changed"]
        assert math.isfinite(r["val_loss"]) and r["blocks_after_validate"] == r["blocks"]
        assert r["has_comm_attr"] and "qmuon/comm_bytes" in r["logged"] and r["comm_bytes"] > 0
        # configure_model that shards: the policy is not applied; optimizer="keep" keeps AdamW.
        assert r["self_sharded_policy_blocks"] == [] and r["self_sharded_optimizer"] == "AdamW"
        assert r["self_sharded_steps"] == 2
        # grasp4 is supported sharded, but this model's 32-row matrices split 16 + 16 rows, not on grasp4's
        # 32-row tiles: a clear error names the shape and the fix (on every rank alike, before any update)
        assert "not a multiple of grid_block=32" in r["grasp_error"], r["grasp_error"]
        assert r["direct_roots"] == [""] and r["direct_steps"] == 2 and r["direct_scale_trained"]
    assert ranks[0]["ckpt_A"] == ["epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt"]


@pytest.mark.slow
def test_resume_at_same_world_size_is_bit_exact(same_world: tuple[Path, list[dict]]) -> None:
    """Uninterrupted 6 steps == resume after 2 steps from a consolidated file == resume after 4
    steps from a sharded directory: every parameter shard and optimizer state tensor identical."""
    out, ranks = same_world
    for r in ranks:
        assert r["ckpt_B_is_dir"]
        assert r["full_resume_bitexact"], r["full_resume_max_diff"]
        assert r["sharded_resume_bitexact"], r["sharded_resume_max_diff"]
    assert (out / "A" / "epoch=0.ckpt").is_file()


@pytest.mark.slow
def test_resume_two_to_one_process(one_proc: tuple[Path, list[dict]]) -> None:
    """The sharded checkpoint written by 2 processes loads on 1: the consolidated model and
    optimizer state after loading equal those the 2-process run had after loading it."""
    out, ranks = one_proc
    assert len(ranks) == 1 and ranks[0]["world_size"] == 1 and ranks[0]["optimizer_type"] == "QMuon"
    assert ranks[0]["global_step"] == 4 + 4  # resumed at step 4, one more epoch of 4 batches on 1 process
    assert "saved with state_format='int8', block_size=256 (Muon group 0) but this run uses state_format='uint8'" \
        in ranks[0]["mismatch_format"]
    assert "optimizer_kwargs={'state_format': 'int8', 'block_size': 256}" in ranks[0]["mismatch_format"]
    assert "['QMuon']" in ranks[0]["mismatch_optimizer"] and "['AdamW']" in ranks[0]["mismatch_optimizer"]
    assert "holds no optimizer state (saved with save_weights_only=True?)" in ranks[0]["weights_only_error"]
    two = torch.load(out / "ref_2proc_epoch1.pt", weights_only=True)
    one = torch.load(out / "loaded_1proc_epoch1.pt", weights_only=True)
    assert two["global_step"] == one["global_step"] == 4
    assert_same(two["model"], one["model"], "model")
    assert_same(two["optim_state"], one["optim_state"], "optimizer")
    assert "model.unused.weight" not in one["optim_state"]


@pytest.mark.slow  # fast variants: the 2 -> 1 resume (same DCP resharding, other direction) and the same-world tests
def test_resume_one_to_two_processes(one_proc: tuple[Path, list[dict]]) -> None:
    out, _ = one_proc
    ranks = _run_worker("two_from_one", out, "qmuon")
    assert [r["world_size"] for r in ranks] == [2, 2] and ranks[0]["global_step"] == 8 + 2
    one = torch.load(out / "ref_1proc_epoch2.pt", weights_only=True)
    two = torch.load(out / "loaded_2proc_epoch2.pt", weights_only=True)
    assert one["global_step"] == two["global_step"] == 8
    assert_same(one["model"], two["model"], "model")
    assert_same(one["optim_state"], two["optim_state"], "optimizer")


@pytest.mark.slow
@pytest.mark.cuda
def test_cuda_nccl_train_and_resume_bit_exact(tmp_path: Path) -> None:
    """On a GPU: NCCL process group, parameters on CUDA, QMuon swapped in, sharded resume bit-exact."""
    (r,) = _run_worker("cuda_resume", tmp_path, "qmuon")
    assert r["backend"] == "nccl" and r["device"].startswith("cuda")
    assert r["optimizer_type"] == "QMuon"
    assert r["resume_bitexact"], r["resume_max_diff"]


# ---------------------------------------------------------------------------------------------
# Worker (runs in the subprocesses)

def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _local_state(trainer: L.Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's shards of every parameter and optimizer state tensor (copies)."""
    from torch.distributed.tensor import DTensor

    def loc(t: Any) -> Any:
        if isinstance(t, DTensor):
            t = t.to_local()
        return t.detach().clone() if isinstance(t, torch.Tensor) else t

    module = trainer.lightning_module
    opt = trainer.optimizers[0]
    names = {id(p): n for n, p in module.named_parameters()}
    params = {n: loc(p) for n, p in module.named_parameters()}
    state = {names[id(p)]: {k: loc(v) for k, v in st.items()} for p, st in opt.state.items()}
    return {"params": params, "state": state}


def _full_state(trainer: L.Trainer) -> dict[str, Any]:
    """Consolidated model and optimizer state (collective; rank 0 gets the values)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = trainer.strategy.model
    opt = trainer.optimizers[0]
    return {
        "model": get_model_state_dict(model, options=opts),
        "optim_state": get_optimizer_state_dict(model, opt, options=opts).get("state"),
        "global_step": trainer.global_step,
        "lrs": [float(g["lr"]) for g in opt.param_groups],
    }


class _DumpState(L.Callback):
    """Save the consolidated state (rank 0) when training starts (after a resume) or ends."""

    def __init__(self, path: Path, when: str) -> None:
        self.path, self.when = path, when

    def _dump(self, trainer: L.Trainer) -> None:
        full = _full_state(trainer)
        if trainer.global_rank == 0:
            torch.save(full, self.path)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.when == "start":
            self._dump(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.when == "end":
            self._dump(trainer)


def _fit(out: Path, strategy: QMuonFSDPStrategy, max_epochs: int, *, devices: int, ckpt_dir: str | None = None,
         resume: Path | None = None, dump: tuple[Path, str] | None = None, module: L.LightningModule | None = None,
         logger: bool = False, accelerator: str = "cpu", summary: bool = False) -> tuple[L.Trainer, L.LightningModule]:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    L.seed_everything(0, verbose=False)
    module = module or TinyLM()
    callbacks: list[L.Callback] = []
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=out / ckpt_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1))
    if dump:
        callbacks.append(_DumpState(*dump))
    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, strategy=strategy, max_epochs=max_epochs, callbacks=callbacks,
        logger=CSVLogger(out, name="logs") if logger else False, log_every_n_steps=1, enable_progress_bar=False,
        enable_model_summary=summary, enable_checkpointing=bool(ckpt_dir), num_sanity_val_steps=0,
    )
    trainer.fit(module, make_data(), ckpt_path=str(resume) if resume else None)
    return trainer, module


def _max_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for k in a:
        if isinstance(a[k], dict):
            worst = max(worst, _max_diff(a[k], b[k]))
        elif isinstance(a[k], torch.Tensor):
            if a[k].shape != b[k].shape:
                return math.inf
            if a[k].numel():
                worst = max(worst, (a[k].double() - b[k].double()).abs().max().item())
    return worst


def scenario_same_world(out: Path, optimizer: str) -> dict[str, Any]:
    """2 processes. A: 3 epochs (2 steps each), consolidated checkpoints. B: resume A's epoch-0 file
    with sharded checkpoints. C: resume B's epoch-1 directory. Final states must be bit-identical."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    res: dict[str, Any] = {}
    tA, mA = _fit(out, _strategy(optimizer=optimizer, save_distributed_checkpoint=False), 3, devices=2,
                  ckpt_dir="A", logger=True, summary=True)
    sA = _local_state(tA)
    s = tA.strategy
    opt = tA.optimizers[0]
    res["world_size"] = dist.get_world_size()
    res["blocks"], res["roots"] = s.sharded_blocks, s.sharded_roots
    res["all_dtensor"] = all(isinstance(p, DTensor) for p in mA.parameters())
    res["optimizer_type"] = type(opt).__name__
    res["global_step"] = tA.global_step
    res["lrs"] = [float(g["lr"]) for g in opt.param_groups]
    res["initial_lrs"] = [float(g.get("initial_lr", g["lr"])) for g in opt.param_groups]
    res["use_muon"] = [bool(g.get("use_muon", False)) for g in opt.param_groups]
    res["logged"] = sorted(tA.logged_metrics)
    res["has_comm_attr"] = hasattr(opt, "comm_bytes_last_step")
    res["comm_bytes"] = float(tA.logged_metrics["qmuon/comm_bytes"]) if "qmuon/comm_bytes" in tA.logged_metrics else None
    res["ckpt_A"] = sorted(p.name for p in (out / "A").iterdir()) if _rank() == 0 else None
    # The frozen matrix never changes; the unused one only by weight decay (no gradient, no update at all
    # for QMuon / AdamW: parameters without a gradient are skipped).
    fresh = _local_state_of_fresh_module(tA)
    res["frozen_unchanged"] = torch.equal(sA["params"]["model.blocks.0.attn.proj.weight"],
                                          fresh["model.blocks.0.attn.proj.weight"])
    res["unused_unchanged"] = torch.equal(sA["params"]["model.unused.weight"], fresh["model.unused.weight"])
    res["trained_changed"] = not torch.equal(sA["params"]["model.blocks.1.attn.qkv.weight"],
                                             fresh["model.blocks.1.attn.qkv.weight"])
    # Validation after fit: a second setup of the already sharded model (the policy is not re-applied).
    val = tA.validate(mA, make_data(8), verbose=False)
    res["val_loss"] = float(val[0]["val_loss"])
    res["blocks_after_validate"] = tA.strategy.sharded_blocks
    res["frozen_in_state"] = "model.blocks.0.attn.proj.weight" in sA["state"]
    res["unused_in_state"] = "model.unused.weight" in sA["state"]

    tB, _ = _fit(out, _strategy(optimizer=optimizer), 3, devices=2, ckpt_dir="B", resume=out / "A" / "epoch=0.ckpt")
    sB = _local_state(tB)
    tC, _ = _fit(out, _strategy(optimizer=optimizer), 3, devices=2, resume=out / "B" / "epoch=1.ckpt",
                 dump=(out / "ref_2proc_epoch1.pt", "start"))
    sC = _local_state(tC)
    res["ckpt_B_is_dir"] = (out / "B" / "epoch=1.ckpt").is_dir()
    res["full_resume_max_diff"] = _max_diff(sA, sB)
    res["sharded_resume_max_diff"] = _max_diff(sA, sC)
    res["full_resume_bitexact"] = res["full_resume_max_diff"] == 0.0 and _same_keys(sA, sB)
    res["sharded_resume_bitexact"] = res["sharded_resume_max_diff"] == 0.0 and _same_keys(sA, sC)

    # A module that shards itself in configure_model (the policy is not applied), optimizer kept.
    tS, _ = _fit(out, _strategy(optimizer="keep"), 1, devices=2, module=SelfShardingLM())
    res["self_sharded_policy_blocks"] = tS.strategy.sharded_blocks
    res["self_sharded_optimizer"] = type(tS.optimizers[0]).__name__
    res["self_sharded_steps"] = tS.global_step

    # Parameters on the LightningModule itself: the LightningModule is the root unit.
    tR, mR = _fit(out, _strategy(optimizer=optimizer), 1, devices=2, module=DirectParamLM())
    res["direct_roots"] = tR.strategy.sharded_roots
    res["direct_steps"] = tR.global_step
    res["direct_scale_trained"] = not torch.equal(mR.logit_scale.full_tensor(), torch.ones(VOCAB))

    # grasp4 on shards that do not start on its 32-row tiles is refused, on every rank alike.
    try:
        _fit(out, _strategy(optimizer_kwargs={"state_format": "grasp4"}), 1, devices=2)
        res["grasp_error"] = None
    except ValueError as e:
        res["grasp_error"] = str(e)
    return res


def _same_keys(a: dict, b: dict) -> bool:
    return set(a["params"]) == set(b["params"]) and set(a["state"]) == set(b["state"])


def _local_state_of_fresh_module(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The initial local shard of every parameter: the same seed and module, sharded like the trained one."""
    from torch.distributed.tensor import DTensor

    L.seed_everything(0, verbose=False)
    fresh = TinyLM()
    out = {}
    for n, p in trainer.lightning_module.named_parameters():
        full = dict(fresh.named_parameters())[n].detach()
        if isinstance(p, DTensor):
            from torch.distributed.tensor import distribute_tensor

            out[n] = distribute_tensor(full, p.device_mesh, p.placements).to_local()
        else:
            out[n] = full
    return out


def scenario_one_proc(out: Path, optimizer: str) -> dict[str, Any]:
    """1 process: resume the 2-process sharded checkpoint B/epoch=1 (2 -> 1), dump the loaded state,
    train the last epoch, save a sharded checkpoint D/epoch=2 and dump the final state."""
    res: dict[str, Any] = {}
    t, _ = _fit(out, _strategy(optimizer=optimizer), 3, devices=1, ckpt_dir="D", resume=out / "B" / "epoch=1.ckpt",
                dump=(out / "loaded_1proc_epoch1.pt", "start"))
    full = _full_state(t)
    torch.save(full, out / "ref_1proc_epoch2.pt")
    res["world_size"] = t.world_size
    res["global_step"] = t.global_step
    res["optimizer_type"] = type(t.optimizers[0]).__name__
    # A weights-only checkpoint cannot resume training: a clear error instead of a half-restored run.
    t.save_checkpoint(out / "weights_only.ckpt", weights_only=True)
    try:
        _fit(out, _strategy(optimizer=optimizer), 3, devices=1, resume=out / "weights_only.ckpt")
        res["weights_only_error"] = None
    except KeyError as e:
        res["weights_only_error"] = str(e)
    # Resuming with another state format or optimizer is refused before anything is loaded.
    for label, kw in (("format", {"optimizer": optimizer, "optimizer_kwargs": {"state_format": "uint8"}}),
                      ("optimizer", {"optimizer": "keep"})):
        try:
            _fit(out, _strategy(**kw), 3, devices=1, resume=out / "B" / "epoch=1.ckpt")
            res[f"mismatch_{label}"] = None
        except ValueError as e:
            res[f"mismatch_{label}"] = str(e)
    return res


def scenario_two_from_one(out: Path, optimizer: str) -> dict[str, Any]:
    """2 processes: resume the 1-process checkpoint D/epoch=2 (1 -> 2), dump the loaded state, train one epoch."""
    res: dict[str, Any] = {}
    t, _ = _fit(out, _strategy(optimizer=optimizer), 4, devices=2, resume=out / "D" / "epoch=2.ckpt",
                dump=(out / "loaded_2proc_epoch2.pt", "start"))
    res["world_size"] = t.world_size
    res["global_step"] = t.global_step
    return res


def scenario_cuda_resume(out: Path, optimizer: str) -> dict[str, Any]:
    """1 GPU (NCCL): 3 epochs with sharded checkpoints, then a resume from epoch 0; bit-identical end
    state. SDPA runs its math kernel (the fused kernels' backward may use atomics)."""
    import torch.distributed as dist

    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    res: dict[str, Any] = {}
    tA, mA = _fit(out, _strategy(optimizer=optimizer), 3, devices=1, ckpt_dir="G", accelerator="gpu")
    sA = _local_state(tA)
    res["backend"] = dist.get_backend()
    res["device"] = str(next(mA.parameters()).device)
    res["optimizer_type"] = type(tA.optimizers[0]).__name__
    tB, _ = _fit(out, _strategy(optimizer=optimizer), 3, devices=1, resume=out / "G" / "epoch=0.ckpt", accelerator="gpu")
    sB = _local_state(tB)
    res["resume_max_diff"] = _max_diff(sA, sB)
    res["resume_bitexact"] = res["resume_max_diff"] == 0.0 and _same_keys(sA, sB)
    return res


SCENARIOS = {
    "same_world": scenario_same_world,
    "one_proc": scenario_one_proc,
    "two_from_one": scenario_two_from_one,
    "cuda_resume": scenario_cuda_resume,
}


def _worker_main(argv: list[str]) -> int:
    scenario, out, optimizer = argv[0], Path(argv[1]), argv[2]
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    res = SCENARIOS[scenario](out, optimizer)
    rank = _rank()
    (out / f"{scenario}_rank{rank}.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    code = _worker_main(sys.argv[1:])
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()  # see its docstring
    sys.exit(code)
