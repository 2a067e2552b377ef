"""Run in the front door's fresh venv (the README's plain install, no extras): every entry point that
needs an optional package it lacks names the extra that installs it, and a command prints no traceback.

    python .ci/missing_extras.py      # exit 1 on a failed case; a case whose package is installed is
                                      # reported as not checked (never as passed)
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

PY = sys.executable
DEEPSPEED = ("import torch, qmuon; from qmuon.integrations import deepspeed as q; m = torch.nn.Linear(8, 8); "
             "q.initialize(m, qmuon.build_optimizer(m), {'train_micro_batch_size_per_gpu': 1})")


def cases(tmp: Path) -> list[tuple[str, str, list[str], str, bool]]:
    """(name, missing module, command, text the message must contain, whether it is a command whose
    output must hold no traceback)."""
    (tmp / "metrics.csv").write_text("step,train_loss\n0,1.0\n1,0.9\n")
    return [
        ("qmuon.integrations.accelerate", "accelerate", [PY, "-c", "import qmuon.integrations.accelerate"],
         "qmuon[accelerate]", False),
        ("qmuon.integrations.deepspeed.initialize", "deepspeed", [PY, "-c", DEEPSPEED],
         "qmuon[deepspeed]", False),
        ("qmuon-prepare", "datasets", ["qmuon-prepare", "--tokenizer", "gpt2", "--out", str(tmp / "c"), "--text",
                                        str(tmp / "metrics.csv")], "qmuon-lightning[data]", True),
        ("qmuon-estimate --hf_config", "transformers", ["qmuon-estimate", "--hf_config", str(tmp)],
         "pip install transformers", True),
        ("python -m qmuon_lightning.plotting", "matplotlib", [PY, "-m", "qmuon_lightning.plotting",
                                                              str(tmp / "metrics.csv"), "--out", str(tmp / "p.png")],
         "qmuon-lightning[bench]", True),
    ]


def main() -> int:
    failed = checked = 0
    with tempfile.TemporaryDirectory() as d:
        for name, module, cmd, needle, is_command in cases(Path(d)):
            if importlib.util.find_spec(module) is not None:
                print(f"not checked: {name} ({module} is installed here)")
                continue
            checked += 1
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            out = r.stdout + r.stderr
            problems = []
            if r.returncode == 0:
                problems.append("exited 0")
            if needle not in out:
                problems.append(f"the message does not name {needle!r}")
            if is_command and "Traceback" in out:
                problems.append("printed a traceback")
            last = out.strip().splitlines()[-1] if out.strip() else "(no output)"
            if problems:
                failed += 1
                print(f"FAIL: {name} without {module}: {'; '.join(problems)}\n{out[-3000:]}")
            else:
                print(f"ok: {name} without {module}: {last}")
    print(f"{checked} case(s) checked, {failed} failed")
    return 1 if failed or not checked else 0


if __name__ == "__main__":
    sys.exit(main())
