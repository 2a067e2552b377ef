"""Print a command exactly as README.md writes it, so CI runs what a reader copies.

    python .ci/readme_commands.py quickstart   # the ```bash line that installs, then runs qmuon-train fit
    python .ci/readme_commands.py test         # the ```bash line that installs, then runs pytest

Exits non-zero, naming what is missing, when the README has no such line or more than one: CI then
fails instead of running a command the README no longer shows.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
#: The line a reader copies: its install step, then the command.
KINDS = {
    "quickstart": re.compile(r"^pip install .*&&\s*qmuon-train fit "),
    "test": re.compile(r"^pip install .*&&\s*python -m pytest\b"),
}


def bash_lines(text: str) -> list[str]:
    """Every non-comment line of every ```bash block, in order."""
    lines, inside = [], False
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("```"):
            inside = stripped == "```bash" if not inside else False
            continue
        if inside and stripped and not stripped.startswith("#"):
            lines.append(stripped)
    return lines


def command(kind: str, text: str) -> str:
    found = [line for line in bash_lines(text) if KINDS[kind].search(line)]
    if len(found) != 1:
        raise SystemExit(f"README.md: expected one ```bash line for the {kind} command, found {len(found)}: {found}")
    return found[0]


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in KINDS:
        raise SystemExit(f"usage: python {sys.argv[0]} {{{' | '.join(KINDS)}}}")
    print(command(sys.argv[1], README.read_text()))
