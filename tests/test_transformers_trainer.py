"""QMuon in Hugging Face ``transformers.Trainer`` through its optimizer-factory hook:
``Trainer(optimizer_cls_and_kwargs=(QMuonFactory, kwargs))`` (qmuon.integrations.transformers).

One process, tiny Llama / Qwen3 models built from configs (no download). Checked against the
Trainer's own behaviour where there is one: the learning rate every QMuon group gets per step is the
one the Trainer's default AdamW gets from the same ``TrainingArguments``; a resumed run equals an
uninterrupted one bit for bit; ``load_best_model_at_end`` restores the best checkpoint's weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import qmuon  # noqa: E402
from _helpers import assert_same  # noqa: E402
from qmuon.core.config import ConfigError  # noqa: E402
from qmuon.integrations.transformers import QMuonFactory, UnsupportedTrainerConfig  # noqa: E402

VOCAB, D, SEQ, BATCH = 256, 64, 32, 4


def tiny_lm(family: str = "llama", tie: bool = False, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=tie, bos_token_id=0,
                  eos_token_id=1, pad_token_id=2)
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=D // 4, **common)).float()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).float()


class Tokens(torch.utils.data.Dataset):
    """Random token rows, the same for a given index (the Trainer's resume skips batches by index)."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randint(3, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(self.seed * 100003 + i))
        return {"input_ids": x, "labels": x.clone()}


def targs(out: Path, **kw: Any) -> Any:
    base = dict(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=6, learning_rate=1e-3,
                report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no", seed=0, data_seed=0,
                disable_tqdm=True, dataloader_num_workers=0)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def trainer(args: Any, model: torch.nn.Module | None = None, opt_kwargs: dict[str, Any] | None = None,
            **kw: Any) -> Any:
    hook = (QMuonFactory, dict({"args": args, "verbose": False}, **(opt_kwargs or {}))) if opt_kwargs != {} else None
    return transformers.Trainer(model=model if model is not None else tiny_lm(), args=args,
                                train_dataset=kw.pop("train_dataset", Tokens()), optimizer_cls_and_kwargs=hook, **kw)


def qmuon_of(tr: Any) -> qmuon.QMuon:
    opt = tr.optimizer
    while not isinstance(opt, qmuon.QMuon):
        opt = opt.optimizer
    return opt


def groups_by_name(opt: qmuon.QMuon) -> dict[str, str]:
    """parameter name -> 'muon' / 'adamw'."""
    return {n: ("muon" if g["use_muon"] else "adamw") for g in opt.param_groups for n in g["param_names"]}


# ------------------------------------------------------------------------------------------ routing
@pytest.mark.parametrize("family,tie", [("llama", False), ("llama", True), ("qwen3", False)])
def test_hidden_linears_in_muon_embedding_head_norms_in_adamw(tmp_path, family: str, tie: bool) -> None:
    model = tiny_lm(family, tie=tie)
    tr = trainer(targs(tmp_path), model)
    opt = tr.create_optimizer()
    assert isinstance(opt, qmuon.QMuon)
    routed = groups_by_name(opt)
    head = model.get_output_embeddings()
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    assert linears and all(routed[n] == "muon" for n in linears), {n: routed[n] for n in linears}
    muon = {n for n, t in routed.items() if t == "muon"}
    assert muon == linears
    assert routed["model.embed_tokens.weight"] == "adamw"
    if tie:  # one Parameter: routed once, as the embedding
        assert model.lm_head.weight is model.model.embed_tokens.weight and "lm_head.weight" not in routed
    else:
        assert routed["lm_head.weight"] == "adamw"
    norms = [f"{n}.weight" for n, m in model.named_modules() if "norm" in type(m).__name__.lower()]
    assert norms and all(routed[n] == "adamw" for n in norms)
    # every trainable parameter exactly once
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


# ------------------------------------------------------------------------------------------ learning rates
def test_lr_and_weight_decay_sources(tmp_path) -> None:
    defaults = transformers.TrainingArguments(str(tmp_path))
    cfg = QMuonFactory.config()
    assert (cfg.lr, cfg.adamw_lr) == (defaults.learning_rate,) * 2
    assert (cfg.weight_decay, cfg.adamw_weight_decay) == (defaults.weight_decay,) * 2
    assert cfg.update.adjust_lr_fn == "match_rms_adamw"
    args = targs(tmp_path, learning_rate=3e-4, weight_decay=0.05)
    cfg = QMuonFactory.config(args=args)
    assert (cfg.lr, cfg.adamw_lr, cfg.weight_decay, cfg.adamw_weight_decay) == (3e-4, 3e-4, 0.05, 0.05)
    cfg = QMuonFactory.config(args=args, lr=1e-3, adamw_lr=2e-4, adamw_weight_decay=0.0, state_format="grasp4",
                              update={"nesterov": False})
    assert (cfg.lr, cfg.adamw_lr, cfg.weight_decay, cfg.adamw_weight_decay) == (1e-3, 2e-4, 0.05, 0.0)
    assert cfg.state_format == "grasp4" and not cfg.update.nesterov and cfg.update.adjust_lr_fn == "match_rms_adamw"
    assert QMuonFactory.config(update={"adjust_lr_fn": "original"}).update.adjust_lr_fn == "original"


def test_misspelled_option_names_the_closest_one_when_the_trainer_builds_it(tmp_path) -> None:
    tr = trainer(targs(tmp_path), opt_kwargs={"state_fromat": "int8"})
    with pytest.raises(ConfigError, match="state_format"):
        tr.create_optimizer()
    with pytest.raises(ConfigError, match="lora"):
        QMuonFactory.config(lora="both")


def _lrs_per_step(tr: Any) -> list[list[float]]:
    seen: list[list[float]] = []

    class Record(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **kw):  # noqa: ANN001
            seen.append([g["lr"] for g in optimizer.param_groups])

    tr.add_callback(Record())
    tr.train()
    return seen


def test_scheduler_and_warmup_scale_every_group_like_the_trainers_own_adamw(tmp_path) -> None:
    args = targs(tmp_path, max_steps=8, warmup_steps=3, lr_scheduler_type="cosine", learning_rate=2e-3)
    ours = _lrs_per_step(trainer(args))
    theirs = _lrs_per_step(trainer(args, opt_kwargs={}))  # the Trainer's default optimizer (AdamW)
    assert len(ours) == len(theirs) == 8
    assert len(ours[0]) >= 3  # muon, adamw, adamw_no_decay
    for step, (mine, ref) in enumerate(zip(ours, theirs)):
        assert all(lr == ref[0] for lr in mine), (step, mine, ref)
    assert ours[0][0] == 0.0 and max(r[0] for r in ours) == pytest.approx(2e-3)


# ------------------------------------------------------------------------------------------ checkpoints
def _final(tr: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    model = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
    return model, qmuon_of(tr).state_dict()


def test_resume_from_checkpoint_is_bit_identical(tmp_path) -> None:
    kw = dict(max_steps=12, save_strategy="steps", save_steps=6, warmup_steps=2, lr_scheduler_type="cosine",
              learning_rate=2e-3, weight_decay=0.01)
    opt_kwargs = {"state_format": "int8", "adamw_state_format": "int8"}
    whole = trainer(targs(tmp_path / "a", **kw), opt_kwargs=opt_kwargs)
    whole.train()
    ref = _final(whole)
    ckpt = tmp_path / "a" / "checkpoint-6"
    assert (ckpt / "optimizer.pt").is_file() and (ckpt / "scheduler.pt").is_file()
    resumed = trainer(targs(tmp_path / "b", **kw), opt_kwargs=opt_kwargs)
    resumed.train(resume_from_checkpoint=str(ckpt))
    got = _final(resumed)
    assert resumed.state.global_step == 12
    assert_same(got[0], ref[0], "model")
    assert_same(got[1], ref[1], "optimizer")
    codes = [st["momentum_codes"] for st in qmuon_of(resumed).state.values() if "momentum_codes" in st]
    assert codes and all(c.dtype == torch.int8 for c in codes)
    # and the checkpoint did matter: a fresh run from the same start differs after 12 steps
    fresh = trainer(targs(tmp_path / "c", **dict(kw, max_steps=6)), opt_kwargs=opt_kwargs)
    fresh.train()
    assert not torch.equal(fresh.model.state_dict()["model.layers.0.mlp.up_proj.weight"],
                           ref[0]["model.layers.0.mlp.up_proj.weight"])


def test_save_only_model_and_load_best_model_at_end(tmp_path) -> None:
    only = trainer(targs(tmp_path / "only", max_steps=4, save_strategy="steps", save_steps=2, save_only_model=True))
    only.train()
    ck = tmp_path / "only" / "checkpoint-4"
    assert (ck / "model.safetensors").is_file() and not (ck / "optimizer.pt").exists()
    reloaded = transformers.LlamaForCausalLM.from_pretrained(str(ck))
    assert_same({k: v for k, v in reloaded.state_dict().items()},
                {k: v for k, v in only.model.state_dict().items()}, "save_only_model weights")
    # a resume from it continues the step count and the schedule, but QMuon's state starts afresh
    # (the Trainer finds no optimizer file), as for any optimizer
    again = trainer(targs(tmp_path / "again", max_steps=4, save_only_model=True))
    again.train(resume_from_checkpoint=str(tmp_path / "only" / "checkpoint-2"))
    assert again.state.global_step == 4
    assert {int(st["step"]) for st in qmuon_of(again).state.values()} == {2}

    args = targs(tmp_path / "best", max_steps=6, save_strategy="steps", save_steps=2, eval_strategy="steps",
                 eval_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                 greater_is_better=False, learning_rate=5e-2, per_device_eval_batch_size=BATCH)
    best = trainer(args, eval_dataset=Tokens(8, seed=1))
    best.train()
    path = best.state.best_model_checkpoint
    assert path is not None and Path(path).is_dir()
    from safetensors.torch import load_file

    saved = load_file(os.path.join(path, "model.safetensors"))
    now = best.model.state_dict()
    for k, v in saved.items():
        assert torch.equal(now[k], v), k
    losses = {h["step"]: h["eval_loss"] for h in best.state.log_history if "eval_loss" in h}
    assert int(path.rsplit("-", 1)[1]) == min(losses, key=losses.get)


# ------------------------------------------------------------------------------------------ DeepSpeed, FSDP1
def test_under_deepspeed_the_factory_uses_the_whole_matrix_zero_path_or_refuses(tmp_path) -> None:
    pytest.importorskip("deepspeed")
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from qmuon.integrations.deepspeed import WholeMatrixZeroOptimizer

    def build(ds: dict[str, Any], **kw: Any) -> Any:
        keep = HfDeepSpeedConfig(ds)  # what TrainingArguments(deepspeed=...) registers, process-wide
        try:
            return QMuonFactory()(tiny_lm(), verbose=False, **kw)
        finally:
            del keep
            unset_hf_deepspeed_config()

    opt = build({"zero_optimization": {"stage": 2}, "train_batch_size": 4})
    assert isinstance(opt, WholeMatrixZeroOptimizer) and opt.auto_attach
    with pytest.raises(UnsupportedTrainerConfig, match="offload_optimizer"):
        build({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "train_batch_size": 4})
    assert isinstance(QMuonFactory()(tiny_lm(), verbose=False), qmuon.QMuon)  # no DeepSpeed: plain QMuon
    # given args without deepspeed, a DeepSpeed config left registered by other TrainingArguments is not read
    assert isinstance(build({"zero_optimization": {"stage": 2}, "train_batch_size": 4}, args=targs(tmp_path)),
                      qmuon.QMuon)


# ------------------------------------------------------------------------------------------ PEFT
def _lora(model: torch.nn.Module) -> torch.nn.Module:
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, cfg)


@pytest.mark.parametrize("lora", ["muon", "adamw"])
def test_lora_frozen_base_gets_no_state(tmp_path, lora: str) -> None:
    model = _lora(tiny_lm())
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert frozen and trainable and all(".lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    tr = trainer(targs(tmp_path, max_steps=3), model, opt_kwargs={"lora": lora})
    tr.train()
    opt = qmuon_of(tr)
    held = [p for g in opt.param_groups for p in g["params"]]
    assert len(held) == len(trainable) and not any(id(p) in frozen for p in held)
    assert opt.state and not any(id(p) in frozen for p in opt.state)
    routed = groups_by_name(opt)
    assert set(routed) == set(trainable) and set(routed.values()) == {lora}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, before[n]), n
    b = next(p for n, p in model.named_parameters() if "lora_B" in n)
    assert b.abs().sum() > 0  # LoRA B starts at zero: it moved


# ------------------------------------------------------------------------------------------ TRL
def _byte_tokenizer() -> Any:
    """examples/hf_finetune.py's byte-level tokenizer (256 byte tokens + 3 specials, built locally)."""
    import importlib.util

    from _dist import REPO

    spec = importlib.util.spec_from_file_location("hf_finetune_example", REPO / "examples" / "hf_finetune.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.byte_tokenizer()


def test_trl_sft_trainer_with_the_same_line(tmp_path) -> None:
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tok = _byte_tokenizer()
    text = ["the quick brown fox jumps over the lazy dog " * 2, "pack my box with five dozen liquor jugs " * 2] * 16
    ds = datasets.Dataset.from_dict({"text": text})
    model = tiny_lm()
    model.resize_token_embeddings(len(tok))
    cfg = trl.SFTConfig(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=2e-3,
                        report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, max_length=SEQ,
                        disable_tqdm=True, seed=0)
    tr = trl.SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok,
                        optimizer_cls_and_kwargs=(QMuonFactory, {"args": cfg, "verbose": False}))
    tr.train()
    opt = qmuon_of(tr)
    assert opt.state and any(g["use_muon"] for g in opt.param_groups)
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_trl_dpo_trainer_through_the_trainer_attribute(tmp_path) -> None:
    """trl 1.16's DPOTrainer has no optimizer_cls_and_kwargs argument; the Trainer reads the attribute
    in create_optimizer, so setting it before train() is the same hook."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import copy

    tok = _byte_tokenizer()
    model = tiny_lm()
    model.resize_token_embeddings(len(tok))
    ds = datasets.Dataset.from_dict({"prompt": ["2+2=", "the sky is "] * 8, "chosen": ["4", "blue"] * 8,
                                     "rejected": ["5", "green"] * 8})
    cfg = trl.DPOConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
                        report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, max_length=32,
                        disable_tqdm=True, seed=0)
    tr = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=cfg, train_dataset=ds,
                        processing_class=tok)
    tr.optimizer_cls_and_kwargs = (QMuonFactory, {"args": cfg, "verbose": False})
    tr.train()
    opt = qmuon_of(tr)
    assert opt.state and any(g["use_muon"] and len(g["params"]) == 14 for g in opt.param_groups)
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert len(losses) == 3 and losses[-1] < losses[0]  # the preference margin grows


def test_gradient_release_checks_the_trainers_clipping_and_accumulation(tmp_path) -> None:
    """Release frees each gradient inside backward: the Trainer's clip would clip nothing, silently."""
    with pytest.raises(ConfigError, match="needs {'args'"):
        QMuonFactory()(tiny_lm(), gradient_release=True, verbose=False)
    with pytest.raises(ConfigError, match=r"max_grad_norm=1\.0"):
        QMuonFactory()(tiny_lm(), args=targs(tmp_path), gradient_release=True, verbose=False)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        QMuonFactory()(tiny_lm(), args=targs(tmp_path, max_grad_norm=0.0, gradient_accumulation_steps=2),
                       gradient_release=True, verbose=False)
    # allowed: trains, and equals the run without release bit for bit
    runs = []
    for release in (True, False):
        tr = trainer(targs(tmp_path / str(release), max_grad_norm=0.0, max_steps=3),
                     opt_kwargs={"gradient_release": release})
        tr.train()
        runs.append({k: v.detach().clone() for k, v in tr.model.state_dict().items()})
        assert (qmuon_of(tr).gradient_release is not None) == release
    assert_same(runs[0], runs[1], "release vs none")


def test_fsdp_dropped_on_cpu_is_said(tmp_path) -> None:
    """Accelerate keeps no FSDP plugin on CPU (the Trainer refuses FSDP on one process; on 2 CPU processes it
    runs DDP): the factory says so when the TrainingArguments it is given ask for FSDP."""
    import types

    tr = trainer(targs(tmp_path))  # builds the Accelerator: one CPU process
    asks = types.SimpleNamespace(**{k: getattr(tr.args, k) for k in ("learning_rate", "weight_decay")},
                                 fsdp_plugin_args={"fsdp_version": 2})
    with pytest.warns(UserWarning, match="applies FSDP only on accelerators"):
        opt = QMuonFactory()(tr.model, args=asks, verbose=False)
    assert isinstance(opt, qmuon.QMuon)


@pytest.mark.slow
def test_example_pretrains_then_fine_tunes_with_sft_and_lora(tmp_path) -> None:
    import subprocess
    import sys

    pytest.importorskip("trl")
    pytest.importorskip("peft")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "examples" / "hf_finetune.py"), "--pretrain-steps", "3",
                           "--steps", "3", "--batch", "2", "--sft", "--lora", "muon", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "after fine-tuning (SFTTrainer, LoRA (muon))" in proc.stdout
