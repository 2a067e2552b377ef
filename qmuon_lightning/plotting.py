"""Loss curves from Lightning ``CSVLogger`` logs -> PNG.

    python -m qmuon_lightning.plotting runs/smoke --out benchmarks/results/smoke_loss.png
    python -m qmuon_lightning.plotting runs/gb10/gpt124m_int8 runs/gb10/gpt124m_torch_muon --out cmp.png

Each positional argument is a ``metrics.csv`` file or a directory searched recursively for them
(``<root>/csv/version_*/metrics.csv``). The files of one argument are one run: a resumed run writes
a new ``version_*`` folder, and the versions are merged in order (a later version's value for a step
wins). Training loss is drawn thin with an exponential moving average on top (``--smooth``, the
weight of the past, 0 to switch it off); validation loss as markers.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

__all__ = ["plot_runs", "main"]


@dataclass
class Curves:
    """One run's losses by optimizer step."""

    label: str
    train: dict[int, float] = field(default_factory=dict)
    val: dict[int, float] = field(default_factory=dict)


def _version_key(p: Path) -> tuple:
    m = re.search(r"version_(\d+)", str(p))
    return (int(m.group(1)) if m else -1, str(p))


def read_run(path: str | Path, label: str | None = None, train_key: str = "train_loss", val_key: str = "val_loss") -> Curves:
    """Read ``train_key`` / ``val_key`` by ``step`` from a metrics.csv file or every one under a directory."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.rglob("metrics.csv"), key=_version_key)
    if not files:
        raise FileNotFoundError(f"no metrics.csv at or under {path}; pass a CSVLogger log directory or file")
    curves = Curves(label or (path.name if path.is_dir() else path.parent.name))
    for f in files:
        with open(f, newline="") as fh:
            for row in csv.DictReader(fh):
                step = row.get("step")
                if not step:
                    continue
                for key, dest in ((train_key, curves.train), (val_key, curves.val)):
                    v = row.get(key)
                    if v not in (None, ""):
                        dest[int(step)] = float(v)
    if not curves.train and not curves.val:
        raise ValueError(f"{path}: the metrics files hold no {train_key!r} or {val_key!r} column values")
    return curves


def _ema(values: Sequence[float], weight: float) -> list[float]:
    out, m = [], None
    for v in values:
        m = v if m is None else weight * m + (1 - weight) * v
        out.append(m)
    return out


def plot_runs(runs: Sequence[Curves], out: str | Path, *, smooth: float = 0.6, title: str | None = None) -> Path:
    """Draw every run's train (thin + EMA) and validation (markers) loss; write ``out`` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("plotting needs matplotlib: pip install 'qmuon-lightning[bench]' (or pip install matplotlib)") from err
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"smooth must be in [0, 1), got {smooth}")
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        c = colors[i % len(colors)]
        if run.train:
            steps = sorted(run.train)
            ys = [run.train[s] for s in steps]
            if smooth > 0:
                ax.plot(steps, ys, color=c, alpha=0.25, linewidth=0.8)
                ax.plot(steps, _ema(ys, smooth), color=c, linewidth=1.6, label=f"{run.label} train (EMA {smooth})")
            else:
                ax.plot(steps, ys, color=c, linewidth=1.2, label=f"{run.label} train")
        if run.val:
            steps = sorted(run.val)
            ax.plot(steps, [run.val[s] for s in steps], "o--", color=c, markersize=5, linewidth=1,
                    label=f"{run.label} val")
    ax.axhline(math.log(256), color="gray", linestyle=":", linewidth=1, label="ln 256 (uniform bytes)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m qmuon_lightning.plotting", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="metrics.csv files or CSVLogger directories (one per run)")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--label", action="append", help="legend label per run (in order; default: directory name)")
    p.add_argument("--smooth", type=float, default=0.6, help="EMA weight of the past for train loss (0: raw)")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    labels = args.label or []
    if labels and len(labels) != len(args.runs):
        p.error(f"{len(labels)} --label values for {len(args.runs)} runs; give one per run or none")
    runs = [read_run(r, labels[i] if labels else None) for i, r in enumerate(args.runs)]
    try:
        out = plot_runs(runs, args.out, smooth=args.smooth, title=args.title)
    except ImportError as err:
        p.exit(2, f"{p.prog}: error: {err}\n")
    for r in runs:
        last_val = f", last val {r.val[max(r.val)]:.4f} at step {max(r.val)}" if r.val else ""
        print(f"{r.label}: {len(r.train)} train points{last_val}")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
