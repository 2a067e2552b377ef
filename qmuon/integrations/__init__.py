"""Integrations with training frameworks other than Lightning.

Each submodule imports its framework when it is imported itself, never from here, so
``import qmuon`` does not pull Accelerate, DeepSpeed or transformers in:

- :mod:`qmuon.integrations.accelerate`: ``prepare_qmuon(accelerator, model, ...)`` for
  Hugging Face Accelerate (single process, DDP, FSDP2), with configuration checks.
- :mod:`qmuon.integrations.deepspeed`: QMuon under the DeepSpeed engine.
- :mod:`qmuon.integrations.transformers`: ``QMuonFactory`` for ``transformers.Trainer`` (and TRL's
  trainers): ``Trainer(optimizer_cls_and_kwargs=(QMuonFactory, {...}))``.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require_extra(module: str, extra: str, user: str, name: str | None = None) -> ModuleType:
    """``import module``, or an ImportError saying that ``user`` needs it and which extra of
    qmuon installs it (the plain install has none of the frameworks)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{user} needs {name or module}: pip install 'qmuon[{extra}]' "
                          f"(or pip install {module})") from e
