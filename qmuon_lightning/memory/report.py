"""Sizes in and out: ``--budget`` parsing and the ``accelerate estimate-memory`` style table."""

from __future__ import annotations

from collections.abc import Sequence


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int | float) -> int:
    """``"128GiB"``, ``"128 GB"``, ``"96gib"``, ``1e9`` -> bytes (GB = 10^9, GiB = 2^30)."""
    if isinstance(text, (int, float)):
        return int(text)
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):] or "b"
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot read a memory size from {text!r}; write e.g. 128GiB, 96GB or 4096MiB")
    return int(float(num) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """Human-readable, accelerate's style (``"1.23 GB"`` uses powers of 1024 there; so do we, as GiB)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_table(rows: Sequence[Sequence[str]], title: str = "") -> str:
    """A boxed table in the style of ``accelerate estimate-memory`` (title row, header row, body)."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    inner = sum(widths) + 3 * (len(widths) - 1)
    if title and len(title) > inner:
        widths[0] += len(title) - inner
        inner = len(title)
    bar = "┌" + "─" * (inner + 2) + "┐"
    out = [bar] if title else []
    if title:
        out.append("│ " + title.center(inner) + " │")
        out.append("├" + "┬".join("─" * (w + 2) for w in widths) + "┤")
    else:
        out.append("┌" + "┬".join("─" * (w + 2) for w in widths) + "┐")
    for i, r in enumerate(rows):
        cells = [str(c).ljust(w) if j == 0 else str(c).rjust(w) for j, (c, w) in enumerate(zip(r, widths))]
        out.append("│ " + " │ ".join(cells) + " │")
        if i == 0:
            out.append("├" + "┼".join("─" * (w + 2) for w in widths) + "┤")
    out.append("└" + "┴".join("─" * (w + 2) for w in widths) + "┘")
    return "\n".join(out)
