"""A sharded checkpoint of ``Trainer(strategy="qmuon_fsdp")`` on 2 processes becomes one file that
loads for inference, by the commands docs/strategy.md gives ("One file for inference"): the test
reads the shell command and the Python block from the page and runs them as written.

The training runs this file as a script (``python tests/test_consolidate.py train OUT``; Lightning's
``Trainer(accelerator="cpu", devices=2)`` starts rank 1 by re-running the command), in ``OUT``, so
the checkpoint lands where the documented command looks for it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning as L

from _dist import REPO, run_launcher, subprocess_env
from qmuon_lightning.models import DecoderLM

VOCAB, SEQ = 64, 16


class MyModule(L.LightningModule):
    """The page's example module: a plain AdamW that the strategy replaces by QMuon."""

    def __init__(self) -> None:
        super().__init__()
        self.model = DecoderLM(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_seq_len=SEQ, mlp_hidden=64)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model.loss(*batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        # 32 windows, 16 per rank, batches of 4: 4 steps in epoch 0, the checkpoint the page names
        tokens = torch.randint(0, VOCAB, (32, SEQ + 1), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)


def _page_blocks() -> tuple[str, str]:
    """The consolidation command and the loading block of docs/strategy.md."""
    text = (REPO / "docs" / "strategy.md").read_text()
    section = text.split("### One file for inference", 1)[1]
    command = re.search(r"```bash\n(.*?)\n```", section, re.S).group(1)
    load = re.search(r"```python\n(.*?)\n```", section, re.S).group(1)
    return command, load


@pytest.mark.slow
def test_sharded_checkpoint_consolidates_and_loads_for_inference(tmp_path: Path) -> None:
    command, load = _page_blocks()
    assert command.startswith("python -m lightning.pytorch.utilities.consolidate_checkpoint "), command
    run_launcher([sys.executable, str(Path(__file__).resolve()), "train", str(tmp_path)], timeout=300,
                 env=subprocess_env(PYTHONWARNINGS="ignore"), cwd=tmp_path, what="2-process qmuon_fsdp training")
    ckpt = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=4.ckpt"
    assert ckpt.is_dir() and (ckpt / ".metadata").is_file(), sorted(p.name for p in tmp_path.rglob("*"))

    # The page's shell command, as written (python is this interpreter).
    shell = command.replace("python ", f"{sys.executable} ", 1)
    done = subprocess.run(shell, shell=True, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    # The page's Python block, in a fresh process's view: a new module, then the file.
    namespace: dict[str, Any] = {"MyModule": MyModule}
    cwd = Path.cwd()
    try:
        os.chdir(tmp_path)
        exec(compile(load, "docs/strategy.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    model = namespace["model"]
    assert isinstance(model, MyModule) and not model.training

    trained = torch.load(tmp_path / "trained.pt", weights_only=True)
    fresh = MyModule().state_dict()
    got = model.state_dict()
    assert got.keys() == trained.keys()
    for k, v in trained.items():
        assert torch.equal(got[k], v), k
    # the weights moved in training (so equality above is not the initialization twice)
    assert any(not torch.equal(fresh[k], v) for k, v in trained.items())
    blob = torch.load(tmp_path / "model.ckpt", weights_only=False)
    assert blob["global_step"] == 4 and blob["qmuon_fsdp"]["world_size"] == 2
    assert blob["qmuon_fsdp"]["optimizer_types"] == ["QMuon"] and len(blob["optimizer_states"]) == 1


def _train(out: Path) -> None:
    """2 processes, qmuon_fsdp, 4 steps; rank 0 writes the consolidated trained weights to trained.pt."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import qmuon_lightning  # noqa: F401  (registers "qmuon_fsdp")

    torch.set_num_threads(1)
    os.chdir(out)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="qmuon_fsdp", max_steps=4, enable_progress_bar=False,
                        enable_model_summary=False)
    module = MyModule()
    trainer.fit(module)
    full = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.global_rank == 0:
        torch.save(full, out / "trained.pt")


if __name__ == "__main__":
    assert sys.argv[1] == "train"
    _train(Path(sys.argv[2]))
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()  # see its docstring
