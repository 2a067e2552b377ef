"""Helpers shared by the benchmark scripts: GPT-shaped matrix sets and the results header."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class MatrixSpec:
    name: str
    shape: tuple[int, int]
    parts: tuple[int, ...] | None = None  # fused row blocks (q, k, v)


def gpt_matrices(d_model: int, n_layers: int, mlp_ratio: int = 4) -> list[MatrixSpec]:
    """The Muon-managed matrices of a GPT-2 style stack (``nn.Linear`` weights are ``out x in``).

    Per layer: fused qkv ``3d x d`` (parts ``(d, d, d)``), attention out ``d x d``, MLP fc
    ``4d x d``, MLP proj ``d x 4d``. Embeddings / head / norms are AdamW's and are left out.
    """
    d, h = d_model, mlp_ratio * d_model
    out = []
    for i in range(n_layers):
        out += [
            MatrixSpec(f"h.{i}.attn.qkv", (3 * d, d), (d, d, d)),
            MatrixSpec(f"h.{i}.attn.out", (d, d)),
            MatrixSpec(f"h.{i}.mlp.fc", (h, d)),
            MatrixSpec(f"h.{i}.mlp.proj", (d, h)),
        ]
    return out


def make_params(specs: list[MatrixSpec], seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s.shape, generator=g) * 0.02) for s in specs]


def qmuon_param_groups(specs: list[MatrixSpec], params: list[torch.Tensor]) -> list[dict]:
    """One Muon group per distinct ``parts`` value (fused qkv declares ``parts=(d, d, d)``)."""
    by_parts: dict[tuple[int, ...] | None, list[torch.Tensor]] = {}
    for s, p in zip(specs, params):
        by_parts.setdefault(s.parts, []).append(p)
    groups = []
    for parts, ps in by_parts.items():
        g: dict = {"params": ps}
        if parts is not None:
            g["parts"] = parts
        groups.append(g)
    return groups


#: build_optimizer's AdamW settings, used for torch.optim.Muon's auxiliary AdamW and for plain AdamW
ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
ADAMW_WD = 0.1
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)


def build_compared_optimizers(name: str, model: torch.nn.Module, decisions=None, **qmuon_kwargs) -> list:
    """The optimizers the memory benchmarks compare, on ``model``:

    ``torch.AdamW`` AdamW on every parameter (weight decay 0.1 on matrices, 0 on 1-D tensors);
    ``torch.Muon`` ``torch.optim.Muon`` on what ``route_parameters`` sends to Muon plus AdamW on the
    rest (the split build_optimizer makes); ``qmuon-FORMAT`` ``build_optimizer(model, state_format=FORMAT)``.
    ``decisions``: the routing of ``model`` when the caller has it already."""
    import qmuon
    import qmuon_lightning

    if name == "torch.AdamW":
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        return [torch.optim.AdamW([{"params": decay, "weight_decay": ADAMW_WD},
                                   {"params": no_decay, "weight_decay": 0.0}], **ADAMW)]
    if name == "torch.Muon":
        decisions = decisions if decisions is not None else qmuon.route_parameters(model)
        muon = [d.param for d in decisions if d.target == "muon"]
        adamw = [{"params": [d.param for d in decisions if d.target == t], "weight_decay": wd}
                 for t, wd in (("adamw", ADAMW_WD), ("adamw_no_decay", 0.0))]
        return [torch.optim.Muon(muon, **MUON), torch.optim.AdamW([g for g in adamw if g["params"]], **ADAMW)]
    if name.startswith("qmuon-"):
        return [qmuon_lightning.build_optimizer(model, state_format=name[len("qmuon-"):], verbose=False,
                                                **qmuon_kwargs)]
    raise ValueError(f"unknown optimizer {name!r}")


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ensure_backend() -> str:
    """Build / load the compiled ``torch.ops.qmuon`` kernels now (not inside a timed region) and
    return the backend name (``reference``, ``cpu-extension``, ...)."""
    try:
        from qmuon import ops

        return ops.backend()
    except Exception as e:  # pragma: no cover - informational only
        return f"unknown ({type(e).__name__}: {e})"


def _git_state() -> str:
    """Commit of the checkout, and whether library files differ from it (the measurement is of the
    working tree, which may be ahead of the commit)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "qmuon_lightning", "csrc"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    return f"git {rev}" + (" + uncommitted changes in qmuon_lightning/ or csrc/" if dirty else "")


def header_lines(title: str) -> list[str]:
    """Markdown header: how the file was produced and on what."""
    # The environment that caps the CPU's instruction set is part of the command (an AVX2-only emulation).
    env = [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if os.environ.get(k)]
    cmd = " ".join(shlex.quote(a) for a in [*env, Path(sys.executable).name, *sys.argv])
    try:
        import qmuon_lightning

        qv = qmuon_lightning.__version__
    except Exception:  # pragma: no cover - informational only
        qv = "?"
    backend = ensure_backend()
    git = _git_state()
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [
        f"# {title}",
        "",
        f"- command: `{cmd}` (run from the repository root)",
        f"- date: {now}",
        f"- torch {torch.__version__}, qmuon_lightning {qv} (`torch.ops.qmuon` backend: {backend}), "
        f"Python {platform.python_version()}",
        f"- source: {git}",
        f"- machine: {cpu_name()}, {default_threads()} CPU(s) available, torch threads = {torch.get_num_threads()}, "
        f"ATen CPU capability {torch.backends.cpu.get_cpu_capability()}",
        "",
    ]


def md_table(header: list[str], rows: list[list[str]], align: list[str] | None = None) -> str:
    align = align or ["l"] + ["r"] * (len(header) - 1)
    sep = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
