"""Write docs/options.md, the option reference, from ``qmuon.QMuonConfig`` (names, defaults, group keys
and the meanings in the dataclasses' docstrings): one source, so the page cannot drift from the code.

    python docs/options.py            # rewrite docs/options.md
    python docs/options.py --check    # exit 1 if docs/options.md is not what the code gives
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from qmuon.core.config import GROUP_KEYS, SECTIONS, QMuonConfig

PAGE = Path(__file__).resolve().parent / "options.md"


def _meanings(cls: type) -> dict[str, str]:
    """``{field: text}`` from the ``Args:`` block of ``cls``'s docstring (``a, b: text`` documents both)."""
    doc = cls.__doc__ or ""
    block = doc.split("Args:", 1)[1] if "Args:" in doc else ""
    out: dict[str, str] = {}
    names: list[str] = []
    for line in block.splitlines():
        m = re.match(r"^ {8}([\w, ]+): (.*)$", line)
        if m and all(n.strip().isidentifier() for n in m.group(1).split(",")):
            names = [n.strip() for n in m.group(1).split(",")]
            for n in names:
                out[n] = m.group(2).strip()
        elif line.startswith(" " * 12) and names:
            for n in names:
                out[n] += " " + line.strip()
    return out


#: Options of the auxiliary AdamW, stored in the AdamW groups under torch.optim.AdamW's names.
ADAMW_KEYS = {"adamw_lr": "lr", "adamw_weight_decay": "weight_decay", "adamw_state_format": "state_format",
              "update.adamw_betas": "betas", "update.adamw_eps": "eps"}


def _default(value: object) -> str:
    return f"`{value!r}`"


def _markdown(text: str) -> str:
    """reST markup of the docstrings as Markdown: ``x`` -> `x`, :role:`~a.b` -> `b`."""
    text = re.sub(r":\w+:`~?([\w.]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    return text.replace("``", "`").replace("|", "\\|")


def _key(path: str) -> str:
    if path in ADAMW_KEYS:
        return f"`{ADAMW_KEYS[path]}` (AdamW groups)"
    return f"`{GROUP_KEYS[path]}`" if path in GROUP_KEYS else ""


def render() -> str:
    cfg = QMuonConfig()
    top = _meanings(QMuonConfig)
    lines = [
        "# Options",
        "",
        "Every QMuon option, its default and what it does, generated from `qmuon.QMuonConfig` by",
        "`python docs/options.py` (a test checks that this page is what the code gives). The same names",
        "work everywhere: `qmuon.build_optimizer(model, lr=..., newton_schulz={...})`, `qmuon.QMuon(params, ...)`,",
        "the strategies' `optimizer_kwargs`, `qmuon-train`'s `model.optimizer` section (YAML, or",
        "`--model.optimizer.newton_schulz.dtype=fp32`) and `qmuon-litgpt --qmuon.newton_schulz.dtype fp32`.",
        "A section is given as a dict of its fields, which merge with the defaults field by field.",
        "Inside the optimizer each param group holds its own optimizer's options under their group keys",
        "(a group may set its own): a Muon group the Muon options, an AdamW group only AdamW's (`lr`, `betas`,",
        "`eps`, `weight_decay`, `state_format`) and the weight-write, rounding and non-finite options",
        "(`qmuon.core.config.ADAMW_GROUP_KEYS`), as a `torch.optim.AdamW` group holds AdamW's.",
        "",
        "## Top-level options",
        "",
        "| option | default | group key | meaning |",
        "|---|---|---|---|",
    ]
    for f in dataclasses.fields(QMuonConfig):
        if f.name in SECTIONS:
            continue
        lines.append(f"| `{f.name}` | {_default(getattr(cfg, f.name))} | {_key(f.name)} | "
                     f"{_markdown(top.get(f.name, ''))} |")
    for name, cls in SECTIONS.items():
        meanings = _meanings(cls)
        summary = _markdown((cls.__doc__ or "").split("Args:")[0].strip().replace("\n    ", " "))
        lines += ["", f"## `{name}`", "", summary, "", "| option | default | group key | meaning |", "|---|---|---|---|"]
        section = getattr(cfg, name)
        for f in dataclasses.fields(cls):
            lines.append(f"| `{name}.{f.name}` | {_default(getattr(section, f.name))} | {_key(f'{name}.{f.name}')} | "
                         f"{_markdown(meanings.get(f.name, ''))} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv[1:]:
        sys.exit(0 if PAGE.read_text() == text else "docs/options.md is out of date: run python docs/options.py")
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
