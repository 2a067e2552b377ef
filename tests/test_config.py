"""One configuration: ``QMuonConfig`` is where every option, default and check lives; every entry
point takes it (or its keys) and a misspelled option raises the same error everywhere."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

import qmuon
from qmuon.core.config import GROUP_KEYS, SECTIONS, ConfigError, QMuonConfig


def _model() -> nn.Module:
    return nn.Sequential(nn.Embedding(16, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.Linear(32, 16))


def test_the_surface_is_small():
    """At most 15 top-level fields (a section counts as one: nine options and six sections, the
    sixth ``qk_clip``), build_optimizer at most 16 parameters, ``qmuon`` exports at most 30 names."""
    assert len(QMuonConfig.field_names()) <= 15
    assert len(inspect.signature(qmuon.build_optimizer).parameters) <= 16
    assert len(inspect.signature(qmuon.QMuon).parameters) <= 16
    assert len(qmuon.__all__) <= 30
    assert set(SECTIONS) <= set(QMuonConfig.field_names())


def test_every_option_has_one_group_key_and_one_default():
    cfg = QMuonConfig()
    group = cfg.muon_group_defaults()
    for path, key in GROUP_KEYS.items():
        assert group[key] == cfg.option(path), path
    # the defaults the optimizer stores are the config's
    opt = qmuon.QMuon([nn.Parameter(torch.zeros(8, 16))])
    assert all(opt.defaults[k] == v for k, v in group.items())


@pytest.mark.parametrize("make", [
    lambda **kw: QMuonConfig.from_kwargs(**kw),
    lambda **kw: qmuon.QMuon([nn.Parameter(torch.zeros(8, 16))], **kw),
    lambda **kw: qmuon.build_optimizer(_model(), verbose=False, **kw),
], ids=["config", "QMuon", "build_optimizer"])
@pytest.mark.parametrize("kwargs, message", [
    ({"state_fromat": "int8"}, "unknown QMuon option 'state_fromat'; did you mean 'state_format'?"),
    ({"ns_dtype": "fp32"}, "unknown QMuon option 'ns_dtype'; did you mean 'newton_schulz.dtype'"),
    ({"newton_schulz": {"dtpye": "fp32"}}, "unknown QMuon option 'newton_schulz.dtpye'; did you mean 'newton_schulz.dtype'"),
    ({"state": {"block_size": 100}}, "state.block_size must be a multiple of 32"),
])
def test_a_bad_option_raises_the_same_error_everywhere(make, kwargs, message):
    with pytest.raises(ConfigError) as e:
        make(**kwargs)
    assert message in str(e.value)


def test_the_strategy_raises_the_same_error_at_construction():
    from qmuon_lightning.strategies import QMuonFabricStrategy, QMuonFSDPStrategy

    for cls in (QMuonFSDPStrategy, QMuonFabricStrategy):
        with pytest.raises(ConfigError, match="did you mean 'newton_schulz.dtype'"):
            cls(optimizer_kwargs={"ns_dtype": "fp32"})


def test_sections_merge_field_by_field_and_a_config_is_a_base():
    base = QMuonConfig(lr=0.01, newton_schulz={"dtype": "fp32", "steps": 6})
    cfg = QMuonConfig.from_kwargs(base, newton_schulz={"method": "standard"}, state_format="int4")
    assert (cfg.lr, cfg.state_format) == (0.01, "int4")
    assert (cfg.newton_schulz.dtype, cfg.newton_schulz.steps, cfg.newton_schulz.method) == ("fp32", 6, "standard")
    opt = qmuon.build_optimizer(_model(), base, verbose=False, update={"variant": "normuon"})
    muon = [g for g in opt.param_groups if g["use_muon"]]
    assert all((g["ns_dtype"], g["ns_steps"], g["variant"], g["lr"]) == ("fp32", 6, "normuon", 0.01) for g in muon)
    assert opt.config.update.variant == "normuon"
    # a dict of the options works the same way (what YAML and optimizer_kwargs give)
    assert QMuonConfig.from_kwargs(base.to_dict()) == base


def test_gradient_release_is_build_optimizers():
    """Release hooks the model's parameters: build_optimizer attaches it, a QMuon from groups refuses."""
    opt = qmuon.build_optimizer(_model(), gradient_release=True, safety={"release_clip_norm": 1.0}, verbose=False)
    assert opt.gradient_release is not None and opt.config.gradient_release
    with pytest.raises(ConfigError, match="attach_gradient_release"):
        qmuon.QMuon([nn.Parameter(torch.zeros(8, 16))], config=QMuonConfig(gradient_release=True))
    with pytest.raises(ConfigError, match="release_clip_norm applies with gradient_release=True only"):
        QMuonConfig(safety={"release_clip_norm": 1.0})


def test_the_config_is_frozen_and_printable():
    cfg = QMuonConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0  # type: ignore[misc]
    assert "newton_schulz=NewtonSchulz(" in repr(cfg)


def test_the_option_reference_is_generated_from_the_config():
    """docs/options.md is what ``python docs/options.py`` writes from QMuonConfig (run it after
    changing an option), and it documents every option."""
    import runpy
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "options.md"
    render = runpy.run_path(str(page.parent / "options.py"))["render"]
    text = render()
    assert page.read_text() == text, "docs/options.md is out of date: run python docs/options.py"
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    options = [f for f in QMuonConfig.field_names() if f not in SECTIONS] + [
        f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    assert [r.split("`")[1] for r in rows] == options
    assert all(not r.rstrip().endswith("|  |") for r in rows), "an option without a meaning in its docstring"


def test_what_auto_chooses_is_printed_with_the_routing_table(capsys, monkeypatch):
    from qmuon.core.newton_schulz import NS_DTYPE_ENV

    monkeypatch.setenv(NS_DTYPE_ENV, "fp32")
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64), nn.Linear(64, 512))
    qmuon.build_optimizer(model, verbose=True)
    out = capsys.readouterr().out
    # 256x64 is 4:1 with a short side of 64: Gram on CPU in fp32 (core.gram_newton_schulz.pick_ns_method)
    assert "Newton-Schulz on cpu: dtype 'auto' -> float32, method 'auto' -> gram for 2 of 2 unfused matrices" in out
