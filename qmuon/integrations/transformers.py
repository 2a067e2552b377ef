"""QMuon for Hugging Face ``transformers.Trainer`` (and TRL's trainers, which subclass it) in one line::

    Trainer(model=model, args=args, train_dataset=ds,
            optimizer_cls_and_kwargs=(QMuonFactory, {"lr": 2e-5, "state_format": "int8"}))

The hook: when the first element of ``optimizer_cls_and_kwargs`` is not a ``torch.optim.Optimizer``
subclass, ``Trainer.create_optimizer`` calls ``factory()(model, **kwargs)``
(``transformers.trainer_optimizer.is_optimizer_factory``). :class:`QMuonFactory` routes the model it
is handed with :func:`qmuon.build_optimizer` (hidden matrices to Muon; embeddings, the head found by
``get_output_embeddings()``, norms and biases to AdamW; a tied weight once, by identity).

Learning rate and weight decay. The hook passes only ``kwargs``, never ``TrainingArguments``, so
``args.learning_rate`` and ``args.weight_decay`` reach QMuon only through them: pass
``{"args": training_args}`` (the factory reads both from it) or ``{"lr": ..., "weight_decay": ...}``.
Without either, the factory uses ``TrainingArguments``' defaults (read from its dataclass fields:
learning rate 5e-5, weight decay 0) and warns that it does. The Muon groups use ``update.adjust_lr_fn="match_rms_adamw"``
(``lr * 0.2 * sqrt(max(rows, cols))``: Muon's update gets the RMS of an AdamW update), so one
learning rate serves both families, as Moonlight's fine-tuning recipe does; ``adamw_lr`` and
``adamw_weight_decay`` default to ``lr`` and ``weight_decay``. The Trainer's scheduler (warmup,
cosine, ...) is a ``LambdaLR`` on this optimizer: it multiplies every group's initial lr by the same
factor. A DeepSpeed config with an ``optimizer`` section makes the Trainer skip the factory.

Where the factory is called, and what it returns:

- one process, DDP: the model as given; QMuon steps it.
- FSDP2 (``fsdp_config={"fsdp_version": 2}``): the Trainer calls the factory on the unwrapped model,
  then ``accelerator.prepare`` shards it and swaps the optimizer's parameters for ``DTensor`` s in
  place; QMuon's state is created lazily, keyed by them, and its sharded step runs. Accelerate applies
  FSDP only on accelerators (``AcceleratorState`` sets ``DistributedType.FSDP`` for ``MULTI_GPU`` and
  its kin, not ``MULTI_CPU``), so on CPU the plugin is dropped and training runs as DDP.
- DeepSpeed (``TrainingArguments(deepspeed=...)``): ZeRO would hand a plain client optimizer flat 1-D
  partitions. The factory returns QMuon inside the whole-matrix ZeRO client optimizer
  (:class:`qmuon.integrations.deepspeed.WholeMatrixZeroOptimizer`, stages 0-3), which attaches to
  the ZeRO optimizer DeepSpeed wraps it in at its first step (or checkpoint load), through the links
  DeepSpeed puts on the model's parameters; configurations that path refuses
  (optimizer offload, ...) raise :class:`UnsupportedTrainerConfig` with the fix. Independently, QMuon
  refuses to step a Muon group whose tensors are no longer the matrices it was routed with.
- PEFT (``PeftModel``): frozen base weights are left out (no state); LoRA's ``lora_A`` / ``lora_B``
  go to Muon by default (``lora="muon"``) or to AdamW (``lora="adamw"``). The default is measured
  (benchmarks/bench_lora.py): at each one's best learning rate Muon ended below AdamW, with a best
  rate 3x AdamW's; an AdamW LoRA recipe's rate undertrains Muon, so ``lora="adamw"`` keeps such a
  recipe as it was.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn
from torch.optim import Optimizer

from ..core.config import ConfigError, QMuonConfig
from ..optim.routing import DEFAULT_RULES, RoutingRule, build_optimizer
from . import require_extra

transformers = require_extra("transformers", "hf", "qmuon.integrations.transformers", "Hugging Face transformers")

__all__ = ["QMuonFactory", "UnsupportedTrainerConfig", "LORA_CHOICES", "LORA_REGEX", "trainer_defaults"]

#: Where LoRA's factors go: ``"muon"`` (default) or ``"adamw"``.
LORA_CHOICES = ("muon", "adamw")
#: PEFT's LoRA factor weights (``...q_proj.lora_A.default.weight``); embeddings' LoRA factors
#: (``lora_embedding_A``) are AdamW by the default head / embedding name rule already.
LORA_REGEX = r"(^|\.)lora_[AB]\."


class UnsupportedTrainerConfig(ValueError):
    """A Trainer configuration QMuon cannot train under; the message names the fix."""


def trainer_defaults() -> dict[str, float]:
    """``TrainingArguments``' own defaults for ``learning_rate`` and ``weight_decay`` (read from its
    dataclass fields, so they follow the installed transformers)."""
    fields = {f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)}
    return {"lr": float(fields["learning_rate"]), "weight_decay": float(fields["weight_decay"])}


def _deepspeed_config(args: Any = None) -> Any:
    """The DeepSpeed config of the Trainer being built, or None. Given ``args``, theirs
    (``args.hf_deepspeed_config``; ``deepspeed_init`` has filled its "auto" values by the time the
    Trainer calls the factory). Without: the one ``TrainingArguments(deepspeed=...)`` registered with
    transformers (a process-wide weak reference, which an older ``TrainingArguments`` still alive may
    hold), else an Accelerate DeepSpeed plugin."""
    if args is not None:
        hf = getattr(args, "hf_deepspeed_config", None)
        if getattr(args, "deepspeed", None) and hf is not None:
            return hf.config
        plugin = getattr(args, "deepspeed_plugin", None)
        return plugin.deepspeed_config if plugin is not None else None
    try:
        from transformers.integrations.deepspeed import deepspeed_config

        if deepspeed_config() is not None:
            return deepspeed_config()
    except ImportError:  # pragma: no cover - transformers without the DeepSpeed integration module
        pass
    try:
        from accelerate.state import AcceleratorState

        if AcceleratorState._shared_state and AcceleratorState().distributed_type.name == "DEEPSPEED":
            return AcceleratorState().deepspeed_plugin.deepspeed_config
    except ImportError:  # pragma: no cover
        pass
    return None


def _is_fsdp1(model: nn.Module) -> bool:
    return any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules())


class QMuonFactory:
    """The optimizer factory for ``Trainer(optimizer_cls_and_kwargs=(QMuonFactory, kwargs))``.

    The Trainer instantiates it without arguments and calls the instance with the model and
    ``kwargs``. ``kwargs`` take every :class:`~qmuon.QMuonConfig` option (``lr``, ``state_format``,
    ``adamw_state_format``, ``newton_schulz={...}``, ``routing={...}``, ...; a misspelled one
    raises :class:`~qmuon.core.config.ConfigError` naming the closest valid one, when the Trainer
    builds the optimizer), plus:

    - ``args``: the ``TrainingArguments``; ``lr`` and ``weight_decay`` default to its
      ``learning_rate`` and ``weight_decay``;
    - ``lora``: ``"muon"`` (default) or ``"adamw"``, where PEFT's LoRA factors go;
    - ``verbose``: print the routing table on rank 0 (default False: it goes to the ``qmuon`` logger).

    Defaults that differ from :func:`qmuon.build_optimizer`'s: ``update.adjust_lr_fn`` is
    ``"match_rms_adamw"``, ``lr`` and ``weight_decay`` are ``TrainingArguments``' (5e-5, 0.0), and
    ``adamw_lr`` / ``adamw_weight_decay`` follow ``lr`` / ``weight_decay``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:  # a transformers without the factory hook treats the class as an optimizer class
            raise UnsupportedTrainerConfig(
                f"QMuonFactory was called as an optimizer class (with parameters): transformers "
                f"{transformers.__version__} predates the optimizer-factory hook of Trainer.create_optimizer "
                "(transformers.trainer_optimizer.is_optimizer_factory). Upgrade: pip install 'qmuon[hf]'")

    def __call__(self, model: nn.Module, **kwargs: Any) -> Optimizer:
        return self.build(model, **kwargs)

    @staticmethod
    def config(args: Any = None, lora: str = "muon", **kwargs: Any) -> QMuonConfig:
        """The :class:`~qmuon.QMuonConfig` the factory builds for ``kwargs`` (checked; raises
        :class:`~qmuon.core.config.ConfigError` for an unknown option or a bad value)."""
        if lora not in LORA_CHOICES:
            raise ConfigError(f"QMuonFactory: lora must be one of {LORA_CHOICES}, got {lora!r}")
        base = QMuonConfig.from_kwargs(None, **kwargs)  # unknown keys: ConfigError with the closest one
        given = {k for k, v in kwargs.items() if v is not None}
        defaults = trainer_defaults()
        if args is None and "lr" not in given:
            import warnings

            warnings.warn(
                f"QMuonFactory got neither {{'args': args}} nor 'lr': it uses TrainingArguments' default "
                f"learning_rate={defaults['lr']:g} and weight_decay={defaults['weight_decay']:g}, not the values your "
                "TrainingArguments hold (the Trainer's hook passes the factory no TrainingArguments). Add "
                "{'args': args} to the factory's kwargs to use them.", UserWarning, stacklevel=3)
        if args is not None:
            defaults = {"lr": float(args.learning_rate), "weight_decay": float(args.weight_decay)}
        lr = kwargs["lr"] if "lr" in given else defaults["lr"]
        wd = kwargs["weight_decay"] if "weight_decay" in given else defaults["weight_decay"]
        over: dict[str, Any] = {"lr": lr, "weight_decay": wd,
                                "adamw_lr": kwargs["adamw_lr"] if "adamw_lr" in given else lr,
                                "adamw_weight_decay": kwargs["adamw_weight_decay"] if "adamw_weight_decay" in given
                                else wd}
        update = kwargs.get("update")
        if update is None or (isinstance(update, dict) and "adjust_lr_fn" not in update):
            over["update"] = {"adjust_lr_fn": "match_rms_adamw"}
        if lora == "adamw":
            rules = base.routing.rules if base.routing.rules is not None else DEFAULT_RULES
            lora_rule = RoutingRule("adamw", name_regex=LORA_REGEX, reason="LoRA factor (lora='adamw')")
            over["routing"] = {"rules": (lora_rule, *rules)}
        return base.replace(**over)

    @classmethod
    def build(cls, model: nn.Module, *, args: Any = None, lora: str = "muon", verbose: bool = False,
              **kwargs: Any) -> Optimizer:
        """Check the setting, then :func:`qmuon.build_optimizer` with :meth:`config`: a
        :class:`~qmuon.QMuon`, or under DeepSpeed the ``WholeMatrixZeroOptimizer`` around one."""
        cfg = cls.config(args=args, lora=lora, **kwargs)  # bad options raise before anything else
        if cfg.gradient_release:
            _check_release(args)
        ds_config = _deepspeed_config(args)
        _warn_if_fsdp_dropped(args)
        if _is_fsdp1(model):
            raise UnsupportedTrainerConfig(
                "QMuonFactory got an FSDP1-wrapped model: FSDP1 flattens parameters into 1-D FlatParameters, so "
                "Muon never sees a matrix. Use FSDP2: TrainingArguments(fsdp=True, fsdp_config={'fsdp_version': 2, "
                "...})")
        if ds_config is not None:
            return _for_deepspeed(model, cfg, ds_config, verbose)
        return build_optimizer(model, cfg, verbose=verbose)


def _warn_if_fsdp_dropped(args: Any) -> None:
    """``TrainingArguments`` ask for FSDP, but Accelerate did not apply it: it keeps an FSDP plugin
    only for accelerator process groups (``AcceleratorState`` sets ``DistributedType.FSDP`` for
    ``MULTI_GPU``, ``MULTI_XPU``, ..., not for ``MULTI_CPU`` or one process), without a word."""
    if args is None or not getattr(args, "fsdp_plugin_args", None):
        return
    try:
        from accelerate.state import AcceleratorState
    except ImportError:  # pragma: no cover
        return
    if not AcceleratorState._shared_state:
        return
    kind = AcceleratorState().distributed_type.name
    if kind != "FSDP":
        import warnings

        warnings.warn(
            f"TrainingArguments ask for FSDP, but Accelerate runs this Trainer as {kind}: it applies FSDP only on "
            "accelerators (GPU, XPU, ...), not on CPU processes, and drops the plugin silently. QMuon steps the "
            "model unsharded (every rank holds all parameters and optimizer state)", stacklevel=3)


def _check_release(args: Any) -> None:
    """Gradient release steps and frees each gradient inside backward: the Trainer's global-norm
    clipping would then see no gradient and clip nothing (silently), and accumulation would step
    every micro-batch. Both settings live in ``TrainingArguments``, so release needs ``args``."""
    if args is None:
        raise ConfigError(
            "QMuonFactory: gradient_release=True needs {'args': training_args} in the kwargs, so that the factory "
            "can check the Trainer's max_grad_norm and gradient_accumulation_steps (release frees each gradient "
            "inside backward: the Trainer's clipping would clip nothing)")
    from ..optim.release import CLIPPING_ERROR, check_trainer_compatible

    if args.max_grad_norm:
        raise ConfigError("QMuonFactory: " + CLIPPING_ERROR.format(
            what=f"TrainingArguments(max_grad_norm={args.max_grad_norm}) (set max_grad_norm=0; the Trainer's default "
                 "is 1.0)"))
    check_trainer_compatible(
        accumulate_grad_batches=args.gradient_accumulation_steps, where="QMuonFactory(gradient_release=True)",
        accumulate_setting="TrainingArguments(gradient_accumulation_steps={n})")


def _for_deepspeed(model: nn.Module, cfg: QMuonConfig, ds_config: Any, verbose: bool) -> Any:
    """Under ``TrainingArguments(deepspeed=...)``: QMuon inside the whole-matrix ZeRO client optimizer
    (:class:`qmuon.integrations.deepspeed.WholeMatrixZeroOptimizer`). Accelerate calls
    ``deepspeed.initialize`` with it and the factory never sees the engine: the wrapper attaches at
    its first step (or checkpoint load) through the links DeepSpeed puts on the model's parameters
    (ZeRO 1-3), or, with none (stage 0), to the matrices it holds (``auto_attach``)."""
    try:
        from .deepspeed import UnsupportedDeepSpeedConfig, WholeMatrixZeroOptimizer, check_config
    except ImportError as e:  # pragma: no cover - DeepSpeed configured but not importable
        raise UnsupportedTrainerConfig(f"QMuonFactory under DeepSpeed needs deepspeed importable: {e}") from e
    try:
        check_config(ds_config)
    except UnsupportedDeepSpeedConfig as e:
        raise UnsupportedTrainerConfig(f"QMuonFactory under DeepSpeed: {e}") from e
    wrapper = WholeMatrixZeroOptimizer(build_optimizer(model, cfg, verbose=verbose))
    wrapper.auto_attach = True  # Accelerate calls deepspeed.initialize: stage 0 attaches to the matrices held
    return wrapper
