"""Integrations with training frameworks other than Lightning.

Each submodule imports its framework when it is imported itself, never from here, so
``import qmuon_lightning`` does not pull Accelerate or DeepSpeed in:

- :mod:`qmuon_lightning.integrations.accelerate`: ``prepare_qmuon(accelerator, model, ...)`` for
  Hugging Face Accelerate (single process, DDP, FSDP2), with configuration checks.
- :mod:`qmuon_lightning.integrations.deepspeed`: QMuon under the DeepSpeed engine.
"""
