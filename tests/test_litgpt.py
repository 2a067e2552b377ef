"""LitGPT: its fused ``attn.qkv`` read as q, k, v; learning rates that survive loops writing one lr
into every group; the ``qmuon-litgpt`` launcher (train, resume, ``litgpt generate``), offline.

The LitGPT tests need ``litgpt`` (an environment of its own: docs/litgpt.md, .ci/run-litgpt; checked
with 0.5.13) and skip cleanly without it; the learning-rate and legacy-layout tests do not need it.

Yardstick of the per-layer test: each logical layer's update against ``torch.optim.Muon`` stepping
that layer alone with the same gradient (lr 0.02, "original" adjustment, no weight decay). The
issue's targets: cosine >= 0.99 and norm within 10%, under default ``build_optimizer`` routing
(int8 momentum). Without the LitGPT rule (``fused_parts={qkv: None}``: q, k, v orthogonalized as
one 128 x 64 matrix) the same check misses them (``test_qkv_as_one_matrix_misses_the_targets``).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import qmuon  # noqa: E402
from _dist import REPO, run_launcher, subprocess_env  # noqa: E402
from qmuon.integrations.litgpt import split_qmuon_args  # noqa: E402
from qmuon.optim import format_routing_table, route_parameters  # noqa: E402

HAVE_LITGPT = importlib.util.find_spec("litgpt") is not None
needs_litgpt = pytest.mark.skipif(not HAVE_LITGPT, reason="litgpt is not installed (its environment: "
                                  "docs/litgpt.md, .ci/run-litgpt; tested with litgpt 0.5.13)")

LR, ADAMW_LR = 0.02, 1e-3
MIN_COSINE, NORM_TOL = 0.99, 0.10


# ------------------------------------------------------------------------------ learning rates
def _two_group_opt(mode: str) -> tuple[qmuon.QMuon, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16, bias=True), nn.Linear(16, 32, bias=False))
    opt = qmuon.build_optimizer(model, lr=LR, adamw_lr=ADAMW_LR, state_format="fp32", verbose=False, update={"lr_ratios": mode})
    return opt, model


def _loss(model: nn.Module) -> torch.Tensor:
    x = torch.arange(16).remainder(32).view(2, 8)
    return F.cross_entropy(model(x).view(-1, 32), x.view(-1))


def _foreign_step(opt: qmuon.QMuon, model: nn.Module, lr: float) -> None:
    """What LitGPT's pretrain loop does before each step (pretrain.py: ``for param_group in
    optimizer.param_groups: param_group["lr"] = lr``)."""
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad()
    _loss(model).backward()
    opt.step()


def test_hold_keeps_each_groups_ratio_to_the_muon_lr():
    opt, model = _two_group_opt("hold")
    for lr in (0.02, 0.01, 0.005):
        _foreign_step(opt, model, lr)
        for g in opt.param_groups:
            want = lr if g["use_muon"] else lr * ADAMW_LR / LR
            assert g["lr"] == pytest.approx(want, rel=1e-12), (g["param_names"], g["lr"], want)


def test_warn_names_the_groups_once_and_changes_nothing():
    opt, model = _two_group_opt("warn")
    with pytest.warns(UserWarning, match=r"every parameter group has lr 0\.02.*AdamW: 0\.weight.*configured lr 0\.001"):
        _foreign_step(opt, model, 0.02)
    assert all(g["lr"] == 0.02 for g in opt.param_groups)  # warn mode leaves the loop's values
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _foreign_step(opt, model, 0.01)  # once per optimizer


def test_schedulers_that_scale_each_group_never_trigger():
    for mode in ("warn", "hold"):
        opt, model = _two_group_opt(mode)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for step in range(3):
                opt.zero_grad()
                _loss(model).backward()
                opt.step()
                sched.step()
        for g in opt.param_groups:
            base = LR if g["use_muon"] else ADAMW_LR
            assert g["lr"] == pytest.approx(base / 4)


def test_off_and_bad_modes():
    opt, model = _two_group_opt("off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _foreign_step(opt, model, 0.02)
    assert all(g["lr"] == 0.02 for g in opt.param_groups)
    with pytest.raises(ValueError, match="lr_ratios must be one of"):
        _two_group_opt("sometimes")


# ------------------------------------------------------------------------------ layouts without litgpt
class _Cfg:
    def __init__(self, n_head: int, n_query_groups: int, head_size: int) -> None:
        self.n_head, self.n_query_groups, self.head_size = n_head, n_query_groups, head_size


class CausalSelfAttention(nn.Module):  # LitGPT < 0.5's layout: one `attn` Linear, interleaved per group
    def __init__(self, n_head: int = 4, groups: int = 2, hs: int = 8, legacy: bool = True, rows: int | None = None):
        super().__init__()
        self.config = _Cfg(n_head, groups, hs)
        out = rows or (n_head + 2 * groups) * hs
        if legacy:
            self.attn = nn.Linear(n_head * hs, out, bias=False)
        else:
            self.qkv = nn.Linear(n_head * hs, out, bias=False)
        self.proj = nn.Linear(n_head * hs, n_head * hs, bias=False)


def test_legacy_interleaved_layout_is_refused_with_the_fix():
    model = nn.ModuleDict({"attn": CausalSelfAttention(legacy=True)})
    with pytest.raises(ValueError, match=r"interleaved per query group.*litgpt >= 0\.5.*fused_parts"):
        qmuon.build_optimizer(model, verbose=False)
    # the user's declaration wins: one matrix, as asked
    opt = qmuon.build_optimizer(model, verbose=False, routing={"fused_parts": {r"attn\.attn\.weight$": None}})
    assert all(g.get("parts") is None for g in opt.param_groups)
    # one query group (MQA): interleaved == contiguous, read as q, k, v
    mqa = nn.ModuleDict({"attn": CausalSelfAttention(n_head=4, groups=1, legacy=True)})
    parts = {d.name: d.parts for d in route_parameters(mqa)}
    assert parts["attn.attn.weight"] == (32, 8, 8)


def test_qkv_rows_that_disagree_with_the_config_are_refused():
    model = nn.ModuleDict({"attn": CausalSelfAttention(legacy=False, rows=40)})
    with pytest.raises(ValueError, match=r"qkv has 40 rows, but its config gives q, k, v of \[32, 16, 16\]"):
        qmuon.build_optimizer(model, verbose=False)


# ------------------------------------------------------------------------------ routing on LitGPT
def _tiny_gpt(seed: int = 0):
    from litgpt import GPT, Config

    from _litgpt_support import TINY_CONFIG

    torch.manual_seed(seed)
    return GPT(Config(**TINY_CONFIG)).float()


def _gpt_grads(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, model.config.vocab_size, (4, 33), generator=g)
    logits = model(x[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()


def _layers(model: nn.Module) -> dict[str, tuple[str, slice]]:
    """Every hidden layer of the tiny GPT as (parameter, rows), written from litgpt/model.py:
    ``q, k, v = qkv.split((n_head * hs, n_query_groups * hs, n_query_groups * hs))``."""
    c = model.config
    q, kv = c.n_head * c.head_size, c.n_query_groups * c.head_size
    out = {}
    for i in range(c.n_layer):
        pre = f"transformer.h.{i}"
        out[f"{pre}.attn.q"] = (f"{pre}.attn.qkv.weight", slice(0, q))
        out[f"{pre}.attn.k"] = (f"{pre}.attn.qkv.weight", slice(q, q + kv))
        out[f"{pre}.attn.v"] = (f"{pre}.attn.qkv.weight", slice(q + kv, q + 2 * kv))
        for name in ("attn.proj", "mlp.fc_1", "mlp.fc_2", "mlp.proj"):
            out[f"{pre}.{name}"] = (f"{pre}.{name}.weight", slice(None))
    return out


def _per_layer_agreement(**build_kwargs) -> dict[str, tuple[float, float]]:
    """{layer: (cosine, norm ratio)} of QMuon's first update against torch.optim.Muon's."""
    model = _tiny_gpt()
    _gpt_grads(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt = qmuon.build_optimizer(model, lr=LR, weight_decay=0.0, verbose=False, **build_kwargs)
    opt.step()
    after = dict(model.named_parameters())
    out = {}
    for layer, (pname, rows) in _layers(model).items():
        ours = (after[pname].detach() - before[pname])[rows]
        p = nn.Parameter(before[pname][rows].clone().contiguous())
        p.grad = grads[pname][rows].clone().contiguous()
        torch.optim.Muon([p], lr=LR, weight_decay=0.0, adjust_lr_fn="original").step()
        ref = p.detach() - before[pname][rows]
        cos = float(F.cosine_similarity(ours.flatten(), ref.flatten(), dim=0))
        out[layer] = (cos, float(ours.norm() / ref.norm()))
    return out


@needs_litgpt
def test_router_reads_litgpt_qkv_from_its_config():
    model = _tiny_gpt()
    decisions = {d.name: d for d in route_parameters(model)}
    print(format_routing_table(list(decisions.values())))
    for i in range(2):
        d = decisions[f"transformer.h.{i}.attn.qkv.weight"]
        assert (d.target, d.parts, d.parts_axis) == ("muon", (64, 32, 32), 0)  # 4 heads x 16, 2 groups x 16 twice
        for name in ("attn.proj", "mlp.fc_1", "mlp.fc_2", "mlp.proj"):  # separate Linear layers: not fused
            assert decisions[f"transformer.h.{i}.{name}.weight"].parts is None
    assert decisions["transformer.wte.weight"].target == "adamw"
    assert decisions["lm_head.weight"].target == "adamw"


@needs_litgpt
def test_qkv_updates_match_torch_muon_per_layer():
    got = _per_layer_agreement()  # default build_optimizer: int8 momentum
    print(json.dumps({k: [round(c, 4), round(r, 4)] for k, (c, r) in got.items()}, indent=1))
    for layer, (cos, ratio) in got.items():
        assert cos >= MIN_COSINE, (layer, cos)
        assert abs(ratio - 1.0) <= NORM_TOL, (layer, ratio)


@needs_litgpt
def test_qkv_as_one_matrix_misses_the_targets():
    # What build_optimizer did before the LitGPT rule: the fused 128 x 64 matrix orthogonalized whole.
    got = _per_layer_agreement(routing={"fused_parts": {r"attn\.qkv\.weight$": None}})
    print(json.dumps({k: [round(c, 4), round(r, 4)] for k, (c, r) in got.items() if ".attn." in k}, indent=1))
    worst = min(got[f"transformer.h.{i}.attn.{x}"][0] for i in range(2) for x in "qkv")
    assert worst < MIN_COSINE


@needs_litgpt
def test_lora_qkv_adapters_are_split_per_enabled_matrix():
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    from _litgpt_support import TINY_CONFIG

    model = GPT(Config(**TINY_CONFIG, lora_r=4, lora_alpha=8, lora_query=True, lora_key=False, lora_value=True))
    mark_only_lora_as_trainable(model)
    d = {x.name: x for x in route_parameters(model)}
    assert d["transformer.h.0.attn.qkv.linear.weight"].target == "frozen"
    assert d["transformer.h.0.attn.qkv.lora_A"].parts == (4, 4)  # r rows per enabled matrix (q, v)
    assert d["transformer.h.0.attn.qkv.lora_B"].parts == (64, 32)  # q rows, v rows
    opt = qmuon.build_optimizer(model, verbose=False)
    _gpt_grads(model)
    opt.step()


# ------------------------------------------------------------------------------ the launcher
def test_split_qmuon_args():
    rest, opts = split_qmuon_args(["--config", "a.yaml", "--qmuon.state_format", "grasp4", "--qmuon.lr=0.01",
                                   "--train.max_tokens", "10", "--qmuon.sharded_checkpoint", "true"])
    assert rest == ["--config", "a.yaml", "--train.max_tokens", "10"]
    assert opts == {"state_format": "grasp4", "lr": 0.01, "sharded_checkpoint": True}
    _, opts = split_qmuon_args(["--qmuon.newton_schulz.dtype", "fp32", "--qmuon.newton_schulz.steps=6"])
    assert opts == {"newton_schulz": {"dtype": "fp32", "steps": 6}}
    with pytest.raises(SystemExit, match="--qmuon.state_fromat: unknown QMuon option 'state_fromat'; did you mean 'state_format'"):
        split_qmuon_args(["--qmuon.state_fromat", "int8"])
    with pytest.raises(SystemExit, match="did you mean 'newton_schulz.dtype'"):
        split_qmuon_args(["--qmuon.ns_dtype", "fp32"])


def _write_setup(tmp: Path, devices: int, max_tokens: int) -> Path:
    import yaml

    from _litgpt_support import TINY_CONFIG, train_tokenizer, write_corpus

    write_corpus(tmp / "corpus.txt")
    train_tokenizer(tmp / "corpus.txt", tmp / "tokenizer")
    cfg = dict(
        model_name=TINY_CONFIG["name"], model_config=TINY_CONFIG, out_dir=str(tmp / "out"), precision="32-true",
        tokenizer_dir=str(tmp / "tokenizer"),
        data={"class_path": "_litgpt_support.LocalTextData", "init_args": {"path": str(tmp / "corpus.txt")}},
        train=dict(save_interval=2, log_interval=1, global_batch_size=4 * devices, micro_batch_size=2,
                   max_tokens=max_tokens, max_seq_length=32, lr_warmup_steps=2, min_lr=0.0, max_norm=1.0,
                   tie_embeddings=False),
        eval=dict(interval=1000, max_iters=2, initial_validation=False, final_validation=False),
        optimizer={"class_path": "torch.optim.AdamW",
                   "init_args": {"lr": ADAMW_LR, "weight_decay": 0.1, "betas": [0.9, 0.95]}},
        devices=devices, logger_name="csv", seed=42,
    )
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(config: Path, *extra: str, timeout: float = 300) -> str:
    env = subprocess_env(PYTHONPATH=f"{REPO}:{REPO / 'tests'}")
    cmd = [sys.executable, "-m", "qmuon.integrations.litgpt", "pretrain", "--config", str(config),
           "--qmuon.lr", str(LR), *extra]
    return run_launcher(cmd, timeout=timeout, env=env, cwd=config.parent, what="qmuon-litgpt pretrain")


def _metrics(out: Path) -> list[dict[str, str]]:
    rows = []
    for f in sorted((out / "logs" / "csv").glob("version_*/metrics.csv")):
        with open(f) as fh:
            rows += list(csv.DictReader(fh))
    return rows


def _check_lr_log(rows: list[dict[str, str]], accum: int) -> int:
    """Every optimizer step: the AdamW groups' lr is LitGPT's schedule value (its ``learning_rate``,
    computed from the Muon lr) times adamw_lr / lr, and the Muon groups' is that value. Returns the
    number of steps checked."""
    litgpt_lr = {int(r["step"]): float(r["learning_rate"]) for r in rows if r.get("learning_rate")}
    checked = 0
    for r in rows:
        keys = [k for k in r if k.startswith("qmuon/lr_g") and r[k]]
        if not keys:
            continue
        step = int(r["step"])  # optimizer steps taken; LitGPT logs that step's lr at iteration step * accum - 1
        lr = litgpt_lr[step * accum - 1]
        for k in keys:
            want = lr if k.endswith("_muon") else lr * ADAMW_LR / LR
            assert float(r[k]) == pytest.approx(want, rel=1e-9, abs=1e-15), (step, k, r[k], want)
        assert any(k.endswith("_adamw") for k in keys) and any(k.endswith("_muon") for k in keys)
        checked += 1
    return checked


@needs_litgpt
@pytest.mark.slow
def test_launcher_trains_resumes_and_litgpt_generate_reads_it(tmp_path):
    config = _write_setup(tmp_path, devices=1, max_tokens=512)  # 8 iterations of 2 x 32 tokens: 4 steps
    log = _launch(config)
    out = tmp_path / "out"
    assert "attn.qkv.weight" in log and "parts=[64, 32, 32]" in log  # the routing table
    assert (out / "final" / "lit_model.pth").is_file()  # consolidated: one file, as litgpt expects
    first = _check_lr_log(_metrics(out), accum=2)
    assert first == 4

    log = _launch(config, "--resume", "true", "--train.max_tokens", "1024")
    assert re.search(r"Resuming training from \S*step-00000004/lit_model\.pth", log)
    assert "iter 10 step 5" in log  # LitGPT's counters continue
    rows = _metrics(out)
    steps = sorted({int(r["step"]) for r in rows if r.get("qmuon/lr_g0_muon")})
    assert steps == list(range(1, 9))  # the optimizer state (AdamW step counts) was restored
    assert _check_lr_log(rows, accum=2) == 8
    losses = [float(r["loss"]) for r in rows if r.get("loss")]
    assert losses[-1] < losses[0]

    gen = run_launcher([sys.executable, "-m", "litgpt", "generate", str(out / "final"), "--prompt", "the cat",
                        "--max_new_tokens", "8", "--precision", "32-true"],
                       timeout=180, env=subprocess_env(PYTHONPATH=str(REPO)), cwd=tmp_path, what="litgpt generate")
    assert "the cat" in gen and "Time for inference" in gen


@needs_litgpt
@pytest.mark.slow
def test_launcher_two_processes_trains_and_resumes(tmp_path):
    config = _write_setup(tmp_path, devices=2, max_tokens=1024)  # per device 512 tokens: 8 iterations, 4 steps
    log = _launch(config)
    out = tmp_path / "out"
    assert (out / "step-00000004" / "lit_model.pth").is_file()
    assert _check_lr_log(_metrics(out), accum=2) == 4
    log = _launch(config, "--resume", "true", "--train.max_tokens", "2048")
    assert "iter 10 step 5" in log
    assert _check_lr_log(_metrics(out), accum=2) == 8


@needs_litgpt
@pytest.mark.slow
@pytest.mark.parametrize("command", ["finetune_full", "finetune_lora"])
def test_finetune_starts_from_the_checkpoint_and_keeps_the_lr_ratio(tmp_path, command):
    """``qmuon-litgpt finetune_full`` / ``finetune_lora`` load the given checkpoint into the sharded
    model (for full models LitGPT's own ModelParallelStrategy loader assumes LoRA names: the launcher
    loads with ``fabric.load_raw``), and LitGPT's scheduler drives every group from its own base lr.
    LoRA: only the adapters train, and ``lora_A`` / ``lora_B`` of ``attn.qkv`` are split per matrix."""
    from litgpt.utils import save_config

    from _litgpt_support import train_tokenizer, write_corpus

    ckpt = tmp_path / "base"
    model = _tiny_gpt(seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_f" in name:
                p.fill_(2.0)  # a random init (LitGPT's, 1.0) cannot produce these
    ckpt.mkdir()
    torch.save(model.state_dict(), ckpt / "lit_model.pth")
    save_config(model.config, ckpt)
    write_corpus(tmp_path / "corpus.txt")
    train_tokenizer(tmp_path / "corpus.txt", ckpt)
    rows = [{"instruction": f"repeat {w}", "input": "", "output": f"{w} {w}"} for w in ["cat", "dog", "boat"] * 20]
    (tmp_path / "train.json").write_text(json.dumps(rows))
    lora = ["--lora_r", "4", "--lora_query", "true", "--lora_value", "true"] if command == "finetune_lora" else []
    cmd = [sys.executable, "-m", "qmuon.integrations.litgpt", command, str(ckpt), *lora, "--data", "JSON",
           "--data.json_path", str(tmp_path / "train.json"), "--data.val_split_fraction", "0.1",
           "--train.epochs", "1", "--train.max_steps", "4", "--train.global_batch_size", "4",
           "--train.micro_batch_size", "2", "--train.save_interval", "2", "--train.lr_warmup_steps", "1",
           "--train.max_seq_length", "32", "--eval.interval", "100", "--eval.initial_validation", "false",
           "--eval.final_validation", "false", "--precision", "32-true", "--devices", "1", "--logger_name", "csv",
           "--out_dir", str(tmp_path / "ft"), "--optimizer",
           json.dumps({"class_path": "torch.optim.AdamW", "init_args": {"lr": ADAMW_LR}}), "--qmuon.lr", str(LR)]
    log = run_launcher(cmd, timeout=300, env=subprocess_env(PYTHONPATH=str(REPO)), cwd=tmp_path,
                       what=f"qmuon-litgpt {command}")
    if command == "finetune_lora":
        assert re.search(r"attn\.qkv\.lora_B\s+96x4\s+muon parts=\[64, 32\]", log)
    final = torch.load(tmp_path / "ft" / "final" / "lit_model.pth", map_location="cpu", weights_only=False)
    final = final.get("model", final)
    norms = [v for k, v in final.items() if "norm" in k or "ln_f" in k]
    assert norms and all(float((v - 2.0).abs().max()) < 0.05 for v in norms)  # trained from the checkpoint
    rows = _metrics(tmp_path / "ft")
    logged = [r for r in rows if r.get("qmuon/lr_g0_muon")]
    assert len(logged) == 4
    for r in logged:
        muon = float(r["qmuon/lr_g0_muon"])
        for k in r:
            if k.endswith("_adamw") and r[k]:
                assert float(r[k]) == pytest.approx(muon * ADAMW_LR / LR, rel=1e-9, abs=1e-15)
    assert any(float(r["qmuon/lr_g0_muon"]) > 0 for r in logged)
