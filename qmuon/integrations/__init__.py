"""Integrations with training frameworks other than Lightning.

Each submodule imports its framework when it is imported itself, never from here, so
``import qmuon`` does not pull Accelerate, DeepSpeed or transformers in:

- :mod:`qmuon.integrations.accelerate`: ``prepare_qmuon(accelerator, model, ...)`` for
  Hugging Face Accelerate (single process, DDP, FSDP2), with configuration checks.
- :mod:`qmuon.integrations.deepspeed`: QMuon under the DeepSpeed engine.
- :mod:`qmuon.integrations.transformers`: ``QMuonFactory`` for ``transformers.Trainer`` (and TRL's
  trainers): ``Trainer(optimizer_cls_and_kwargs=(QMuonFactory, {...}))``.
"""
