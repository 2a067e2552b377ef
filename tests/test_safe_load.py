"""Checkpoints are read with ``weights_only=True`` (qmuon.distributed.safe_load): QMuon's own state
loads that way, and a file whose pickle would run code is refused with a message, never run."""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import qmuon
from qmuon.distributed import resume, safe_load
from qmuon.distributed.safe_load import UnsafeCheckpointError

ROOT = Path(__file__).resolve().parents[1]


class RunsCode:
    """Unpickling calls ``open(marker, "w")``: a stand-in for any code a checkpoint could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _stepped(state_format: str = "int8"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 32))
    opt = qmuon.build_optimizer(model, state_format=state_format)
    model(torch.randint(0, 32, (4, 5))).square().mean().backward()
    opt.step()
    return model, opt


def _dcp_save(state: dict, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving as a single process"
        dcp.save(state, checkpoint_id=str(path))


@pytest.mark.parametrize("state_format", ["int8", "grasp4"])
def test_qmuon_state_dict_loads_with_weights_only(tmp_path, state_format):
    model, opt = _stepped(state_format)
    torch.save({"optimizer": opt.state_dict(), "model": model.state_dict()}, tmp_path / "ck.pt")
    loaded = safe_load.load(tmp_path / "ck.pt", map_location="cpu")
    opt2 = qmuon.build_optimizer(model, state_format=state_format)
    opt2.load_state_dict(loaded["optimizer"])
    for p in model.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt2.state[p][k])), k


def test_a_file_that_would_run_code_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    ck = tmp_path / "evil.ckpt"
    torch.save({"global_step": 3, "state_dict": {"w": torch.zeros(2)}, "extra": RunsCode(marker)}, ck)
    with pytest.raises(UnsafeCheckpointError, match=r"refused to load .*evil\.ckpt.*add_safe_globals") as e:
        safe_load.load(ck)
    assert "it names io.open" in str(e.value), str(e.value)  # names what it met
    # the resume scan and the kit's strategies read checkpoints through it
    with pytest.raises(UnsafeCheckpointError):
        resume.checkpoint_step(ck)
    from qmuon.integrations.fabric.checkpoint_state import load_file

    with pytest.raises(UnsafeCheckpointError):
        load_file(ck, None, mmap=True, map_location="cpu")
    assert not marker.exists()
    with pytest.raises(ValueError, match="weights_only=True only"):
        safe_load.load(ck, weights_only=False)
    with pytest.raises(ValueError, match=r"weights_only=True only .*add_safe_globals"):  # Lightning's argument
        load_file(ck, False, mmap=True, map_location="cpu")
    assert not marker.exists()


def test_deepspeed_world_size_check_refuses_a_file_that_would_run_code(tmp_path):
    marker = tmp_path / "ran"
    tag = tmp_path / "ds" / "t"
    tag.mkdir(parents=True)
    torch.save({"dp_world_size": 2, "extra": RunsCode(marker)}, tag / "mp_rank_00_model_states.pt")
    from qmuon.integrations.deepspeed.checkpoint import saved_world_size

    with pytest.raises(UnsafeCheckpointError, match="refused"):
        saved_world_size(tmp_path / "ds", "t")
    assert not marker.exists()
    torch.save({"dp_world_size": 2, "module": {"w": torch.zeros(2)}}, tag / "mp_rank_00_model_states.pt")
    assert saved_world_size(tmp_path / "ds", "t") == 2


def test_dcp_checkpoint_loads_through_the_safe_reader_and_planner(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(12.0).reshape(3, 4).to(torch.bfloat16), "opt": {"step": 7, "fmt": "int8",
             "codes": torch.arange(6, dtype=torch.uint8), "betas": (0.9, 0.95)}}
    _dcp_save(state, tmp_path / "ck")
    meta = safe_load.read_dcp_metadata(tmp_path / "ck")
    assert {"w", "opt.step", "opt.codes"} <= set(meta.state_dict_metadata)
    assert resume.checkpoint_problem(tmp_path / "ck") is None
    out = {"w": torch.zeros(3, 4, dtype=torch.bfloat16), "opt": {"step": 0, "fmt": "", "codes": torch.zeros(6, dtype=torch.uint8),
           "betas": (0.0, 0.0)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=safe_load.dcp_reader(tmp_path / "ck"), planner=safe_load.dcp_planner())
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["opt"]["codes"], state["opt"]["codes"])
    assert out["opt"]["step"] == 7 and out["opt"]["fmt"] == "int8" and tuple(out["opt"]["betas"]) == (0.9, 0.95)


def test_dcp_entry_that_would_run_code_is_refused_not_run(tmp_path):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    _dcp_save({"w": torch.ones(2), "extra": RunsCode(marker)}, tmp_path / "ck")
    assert not marker.exists()
    out = {"w": torch.zeros(2), "extra": None}
    # DCP reports a rank's exception inside its CheckpointException (a BaseException)
    with pytest.raises(BaseException, match=r"refused to load the entry 'extra'.*it names io\.open"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=safe_load.dcp_reader(tmp_path / "ck"), planner=safe_load.dcp_planner())
    assert not marker.exists()


def test_dcp_metadata_that_would_run_code_is_refused_not_run(tmp_path):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    _dcp_save({"w": torch.ones(2)}, tmp_path / "ck")
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"names io\.open, which is not part of"):
        safe_load.read_dcp_metadata(tmp_path / "ck")
    with pytest.raises(UnsafeCheckpointError):  # the resume scan says so instead of skipping it as damaged
        resume.checkpoint_problem(tmp_path / "ck")
    with pytest.raises(BaseException, match=r"names io\.open"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"w": torch.zeros(2)}, storage_reader=safe_load.dcp_reader(tmp_path / "ck"))
    assert not marker.exists()


def test_no_unsafe_loading_in_the_sources():
    """No ``torch.load(weights_only=False)``, plain ``pickle.load`` or DCP reader with its unrestricted
    metadata unpickling in qmuon/ or qmuon_lightning/ (a caller's ``weights_only=False`` is refused)."""
    found = []
    for pkg in ("qmuon", "qmuon_lightning"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for i, line in enumerate(f.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if re.search(r"load\(.*weights_only=False|pickle\.loads?\(|dcp\.FileSystemReader\(", code):
                    found.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)
