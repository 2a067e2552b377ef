"""Every momentum format through the one :class:`~qmuon.quant.StateFormat` interface:
init / update / dequantize / encode / validate / nbytes / describe / placement for each registered
format, conversion between every pair (with the resume-compatibility rules), a format registered
by a test that works through ``QMuon(state_format=...)`` without touching any other module, and a
guard that no code outside ``quant/`` and ``ops/`` branches on a format name.

Single process, small matrices (the sharded update is tested in ``test_distributed_4bit.py``).
"""

from __future__ import annotations

import ast
import math
import pathlib

import pytest
import torch

from _helpers import roundtrip_state_dict
from qmuon import QMuon
from qmuon.ops import reference as ref
from qmuon.quant import fidelity
from qmuon.quant import state as qstate
from qmuon.quant.formats.base import PLACEMENTS, STEP, FormatOptions, FormatSpec, StateFormat

BUILTIN = tuple(qstate.STATE_FORMATS)  # the momentum formats (FORMATS also holds the ecc8 weight correction)
MOMENTUM = {n: f for n, f in qstate.FORMATS.items() if f.role == qstate.MOMENTUM}
OPTS = FormatOptions(block_size=32, rank=3, grid_block=16)
#: relative Frobenius error of one encode of the test matrices, per format (4-bit: 0.5)
TOL = {"fp32": 1e-6, "bf16": 5e-3, "int8": 0.05, "uint8": 0.05}
CPU = torch.device("cpu")


def _tol(name: str) -> float:
    return TOL.get(name, 0.5)


def _momentum_like(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Low rank + noise with per-row scales over a decade (so the 4-bit formats have structure)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.randn(rows, 2, generator=g) @ torch.randn(2, cols, generator=g)
    x = low + 0.3 * torch.randn(rows, cols, generator=g)
    return (x * torch.exp(torch.empty(rows, 1).uniform_(math.log(0.1), 0.0, generator=g)) * 1e-3).float()


def _bytes(st: dict) -> int:
    return sum(v.numel() * v.element_size() for k, v in st.items() if k != STEP)


# --------------------------------------------------------------------------- every format, one interface
def test_registry_derived_tables():
    assert BUILTIN == ("fp32", "bf16", "int8", "uint8", "int4", "e0m3", "grasp4")
    assert tuple(qstate.STATE_FORMATS) == BUILTIN
    assert dict(qstate.DEFAULT_BLOCK_SIZE) == {n: f.default_block_size for n, f in MOMENTUM.items()}
    assert qstate.DEFAULT_BLOCK_SIZE["int4"] == 128 and qstate.DEFAULT_BLOCK_SIZE["int8"] == 256
    assert tuple(qstate.SUPPORTED_SHARDED_FORMATS) == tuple(n for n, f in MOMENTUM.items() if f.shardable)
    assert set(qstate.COLLECTIVE_FORMATS) == {n for n, f in MOMENTUM.items() if not f.row_local}
    assert [n for n, f in qstate.FORMATS.items() if f.role == qstate.WEIGHT_CORRECTION] == ["ecc8"]
    assert {n: f.layout_options for n, f in MOMENTUM.items()} == {
        "fp32": (), "bf16": (), "int8": ("block_size",), "uint8": ("block_size",), "int4": ("block_size",),
        "e0m3": (), "grasp4": ("rank", "grid_block")}
    with pytest.raises(qstate.StateFormatError, match="unknown state_format 'fp8'; choose one of fp32, bf16"):
        qstate.get_format("fp8")


@pytest.mark.parametrize("name", BUILTIN)
@pytest.mark.parametrize("rows,cols", [(20, 50), (9, 33)])
def test_interface_round_trip(name, rows, cols):
    fmt = qstate.get_format(name)
    assert fmt.name == name == fmt.spec.name
    # init: the declared keys, a valid zero state that decodes to zeros; nbytes counts exactly it
    zero = fmt.init(rows, cols, OPTS, CPU)
    assert set(zero) == set(fmt.spec.keys)
    fmt.validate(zero, rows, cols, OPTS, name)
    assert fmt.owns(zero) and qstate.detect_state_format(zero) == name
    assert torch.equal(fmt.dequantize(zero, OPTS, cols), torch.zeros(rows, cols))
    assert fmt.nbytes(rows, cols, OPTS) == _bytes(zero)
    assert qstate.momentum_nbytes(name, rows, cols, OPTS) == _bytes(zero)
    full = qstate.init_momentum_state(name, rows, cols, opts=OPTS, device=CPU)
    assert set(full) == set(zero) | {STEP} and full[STEP].shape == ()
    # encode -> validate -> dequantize
    x = _momentum_like(rows, cols, seed=rows + cols)
    st = fmt.encode(x, OPTS)
    assert {k: (v.shape, v.dtype) for k, v in st.items()} == {k: (v.shape, v.dtype) for k, v in zero.items()}
    fmt.validate(st, rows, cols, OPTS, name)
    assert qstate.detect_state_format(st) == name
    assert fidelity.momentum_relative_error(fmt.dequantize(st, OPTS, cols), x) < _tol(name)
    assert torch.equal(qstate.dequantize_momentum(st, opts=OPTS, cols=cols), fmt.dequantize(st, OPTS, cols))
    # one update from zero momentum: m = (1 - beta) g, the NS input (Nesterov) written into the gradient
    # buffer and its per-row-block sums of squares into block_sums
    beta = 0.9
    g = _momentum_like(rows, cols, seed=7) * 10
    states = [dict(zero)]
    g2 = g.clone()
    sums = torch.full((rows, ref.num_blocks(cols, OPTS.block_size)), float("nan"))
    fmt.update(states, [g2], [sums], beta=beta, nesterov=True, opts=OPTS, streams=[-1], offsets=[0], keys=[0], seed=0)
    m_ref = (1 - beta) * g.double()
    assert fidelity.momentum_relative_error(fmt.dequantize(states[0], OPTS, cols), m_ref) < _tol(name)
    ns_ref = g.double() + beta * (m_ref - g.double())
    assert fidelity.momentum_relative_error(g2, ns_ref) < 1e-5
    torch.testing.assert_close(sums, ref.block_sumsq(g2, OPTS.block_size), rtol=1e-5, atol=0)
    fmt.validate(states[0], rows, cols, OPTS, name)
    # the sharded update of row-local formats is the plain one (no collective, params unused)
    if fmt.row_local:
        st2, g3 = [dict(fmt.init(rows, cols, OPTS, CPU))], g.clone()
        sums2 = torch.empty_like(sums)
        fmt.update_sharded([None], st2, [g3], [sums2], beta=beta, nesterov=True, opts=OPTS, streams=[-1],
                           offsets=[0], keys=[0], seed=0, process_group=None)
        assert all(torch.equal(st2[0][k], states[0][k]) for k in fmt.spec.keys)
        assert torch.equal(g3, g2) and torch.equal(sums2, sums)
    # describe, layout kwargs, placements
    text = fmt.describe(OPTS)
    assert text.startswith(name)
    for key in fmt.layout_options:
        assert str(getattr(OPTS, key)) in text
    assert fmt.layout_kwargs(OPTS) == {"state_format": name, **{k: getattr(OPTS, k) for k in fmt.layout_options}}
    assert fmt.placement(STEP) == "scalar"
    for key, v in zero.items():
        where = fmt.placement(key)
        assert where in PLACEMENTS, (key, where)
        assert (where == "scalar") == (v.ndim == 0), (key, where)
        if where == "rows":
            assert v.shape[0] == rows, key
        if where == "tiles":
            assert v.shape[0] == ref.num_blocks(rows, fmt.tile_rows(OPTS)), key
    if any(fmt.placement(k) != "rows" for k, v in zero.items() if v.ndim):
        assert not fmt.row_local  # a tensor that is not split with the rows needs a collective update
    assert fmt.convertible_when_sharded(name)


def test_describe_examples():
    assert qstate.get_format("int8").describe(qstate.format_options({"state_format": "int8"})) == "int8 (block 256)"
    assert qstate.get_format("int4").describe(qstate.format_options({"state_format": "int4"})) == "int4 (block 128)"
    assert qstate.get_format("grasp4").describe(FormatOptions()) == "grasp4 (rank 4, grid 32)"
    assert qstate.get_format("fp32").describe(OPTS) == "fp32"


def test_detect_reports_broken_states():
    i8 = qstate.encode_momentum(torch.ones(4, 32), "int8", opts=OPTS)
    with pytest.raises(qstate.StateFormatError, match="momentum_codes present without momentum_absmax"):
        qstate.detect_state_format({"momentum_codes": i8["momentum_codes"]})
    with pytest.raises(qstate.StateFormatError, match="momentum_buffer has dtype torch.float16"):
        qstate.detect_state_format({"momentum_buffer": torch.zeros(2, 2, dtype=torch.float16)})
    with pytest.raises(qstate.StateFormatError, match="no momentum tensors in state"):
        qstate.detect_state_format({"exp_avg": torch.zeros(2)})


# --------------------------------------------------------------------------- conversion between every pair
def _group(name: str, **kw) -> dict:
    return {"state_format": name, "block_size": OPTS.block_size, "rank": OPTS.rank, "grid_block": OPTS.grid_block, **kw}


@pytest.mark.parametrize("dst", BUILTIN)
@pytest.mark.parametrize("src", BUILTIN)
def test_convert_every_pair(src, dst):
    rows, cols = 16, 40
    x = _momentum_like(rows, cols, seed=3)
    saved = {STEP: torch.tensor(5.0), **qstate.encode_momentum(x, src, opts=OPTS)}
    out = qstate.convert_state(saved, _group(src), _group(dst), (rows, cols), "w")
    target = qstate.get_format(dst)
    assert set(out) == set(target.spec.keys) | {STEP} and out[STEP] is saved[STEP]
    target.validate(out, rows, cols, OPTS, "w")
    assert qstate.detect_state_format(out) == dst
    m_src = qstate.get_format(src).dequantize(saved, OPTS, cols)
    if src == dst:  # same format: the saved tensors, untouched
        assert all(out[k] is saved[k] for k in target.spec.keys)
    else:
        assert fidelity.momentum_relative_error(target.dequantize(out, OPTS, cols), m_src) < _tol(dst)
    # a 3-D parameter: cols are the trailing dims
    out3 = qstate.convert_state(saved, _group(src), _group(dst), (rows, 8, 5), "w")
    assert all(torch.equal(out3[k], out[k]) for k in out)
    # on one rank's rows of a sharded parameter, formats that need the whole matrix to encode refuse
    if target.convertible_when_sharded(src):
        out_sh = qstate.convert_state(saved, _group(src), _group(dst), (rows, cols), "w", sharded=True)
        assert all(torch.equal(out_sh[k], out[k]) for k in out)
    else:
        assert not target.row_local and src != dst
        with pytest.raises(NotImplementedError, match=f"converting {src} momentum to {dst} needs the whole matrix"):
            qstate.convert_state(saved, _group(src), _group(dst), (rows, cols), "w", sharded=True)


_SAME_KIND = [(a, b) for a in BUILTIN for b in BUILTIN
              if qstate.FORMATS[a].spec.kind == qstate.FORMATS[b].spec.kind and qstate.FORMATS[a].layout_options]


@pytest.mark.parametrize("src,dst", _SAME_KIND)
def test_convert_same_kind_needs_the_same_layout_options(src, dst):
    x = _momentum_like(16, 64, seed=4)
    fmt = qstate.get_format(src)
    for key in fmt.layout_options:
        saved_opts = {**_group(src), key: getattr(OPTS, key) * 2}
        st = {STEP: torch.tensor(1.0), **qstate.encode_momentum(x, src, opts=qstate.format_options(saved_opts))}
        with pytest.raises(qstate.StateFormatError,
                           match=rf"w: momentum was saved with {key}={getattr(OPTS, key) * 2} but this optimizer uses "
                                 rf"{key}={getattr(OPTS, key)}; construct the optimizer with state=\{{'{key}': "):
            qstate.convert_state(st, saved_opts, _group(dst), (16, 64), "w")


def test_convert_other_kind_ignores_layout_options_and_checks_labels():
    x = _momentum_like(16, 64, seed=5)
    st = {STEP: torch.tensor(1.0), **qstate.encode_momentum(x, "int8", block_size=64)}
    out = qstate.convert_state(st, {"state_format": "int8", "block_size": 64}, _group("int4"), (16, 64), "w")
    assert out["momentum_absmax"].shape == (16, 2)  # re-encoded with this optimizer's block size 32
    with pytest.raises(qstate.StateFormatError, match="state_format='uint8' but the tensors are int8"):
        qstate.convert_state(st, {"state_format": "uint8", "block_size": 64}, _group("int8"), (16, 64), "w")
    with pytest.raises(qstate.StateFormatError, match="momentum_codes has shape"):
        qstate.convert_state(st, {"state_format": "int8", "block_size": 64}, _group("int8"), (8, 64), "w")


# --------------------------------------------------------------------------- a format defined by a test
TOY_KEY = "toy_momentum_fp16"


class ToyFp16Format(StateFormat):
    """fp16 momentum in pure PyTorch: what a third party (or a test) adds without touching the package."""

    spec = FormatSpec("toy_fp16", "toy", torch.float16, (TOY_KEY,))
    order = 95

    def init(self, rows, cols, opts, device):
        return {TOY_KEY: torch.zeros((rows, cols), dtype=torch.float16, device=device)}

    def update(self, states, grads2d, block_sums, *, beta, nesterov, opts, streams, offsets, keys, seed):
        for st, g2, out in zip(states, grads2d, block_sums, strict=True):
            m_new, ns = ref._q8_momentum_and_ns_input(st[TOY_KEY].float(), g2.float(), beta, nesterov)
            st[TOY_KEY].copy_(m_new)
            g2.copy_(ns)
            out.copy_(ref.block_sumsq(ns, opts.block_size))

    def dequantize(self, state, opts, cols=None):
        return state[TOY_KEY].float()

    def encode(self, m, opts):
        return {TOY_KEY: m.to(torch.float16).contiguous()}

    def owns(self, state):
        return TOY_KEY in state

    def validate(self, state, rows, cols, opts, where):
        self._check(state, TOY_KEY, (rows, cols), torch.float16, where)


@pytest.fixture
def toy():
    fmt = qstate.register_format(ToyFp16Format())
    try:
        yield fmt
    finally:
        qstate.unregister_format(fmt.name)
    assert "toy_fp16" not in qstate.FORMATS


def _mats(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(16, 40, generator=g) * 0.1), torch.nn.Parameter(torch.randn(8, 4, 4, generator=g))]


def _train(opt, ps, steps, seed=100):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        opt.step()


def test_registered_format_is_listed_everywhere(toy):
    assert qstate.STATE_FORMATS[-1] == "toy_fp16" and "toy_fp16" in qstate.STATE_FORMATS
    assert "toy_fp16" in qstate.SUPPORTED_SHARDED_FORMATS and "toy_fp16" not in qstate.COLLECTIVE_FORMATS
    assert qstate.DEFAULT_BLOCK_SIZE["toy_fp16"] == 256
    assert qstate.detect_state_format(toy.encode(torch.ones(2, 3), OPTS)) == "toy_fp16"
    with pytest.raises(qstate.StateFormatError, match="choose one of .*grasp4, toy_fp16"):
        qstate.get_format("nope")
    assert toy.describe(OPTS) == "toy_fp16" and toy.placement(TOY_KEY) == "rows"


def test_registered_format_trains_and_converts_through_qmuon(toy):
    ps, ps_ref = _mats(), _mats()
    opt = QMuon(ps, lr=0.02, state_format="toy_fp16")
    opt_ref = QMuon(ps_ref, lr=0.02, state_format="fp32")
    _train(opt, ps, 3)
    _train(opt_ref, ps_ref, 3)
    init = _mats()
    for p, q, p0 in zip(ps, ps_ref, init):
        st = opt.state[p]
        assert set(st) == {STEP, TOY_KEY} and st[TOY_KEY].dtype == torch.float16
        assert fidelity.momentum_relative_error(st[TOY_KEY].float().view(p.shape), opt_ref.state[q]["momentum_buffer"].view(p.shape)) < 1e-3
        d, d_ref = (p - p0).detach(), (q - p0).detach()
        assert fidelity.momentum_relative_error(d, d_ref) < 2e-2
    # state dict round trip (weights_only) resumes bit-exactly in the same format
    sd = roundtrip_state_dict(opt.state_dict())
    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = QMuon(ps2, lr=0.02, state_format="toy_fp16")
    opt2.load_state_dict(sd)
    _train(opt, ps, 1, seed=7)
    _train(opt2, ps2, 1, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(ps, ps2))
    # conversion to a built-in format and back
    ps8 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt8 = QMuon(ps8, lr=0.02, state_format="int8")
    opt8.load_state_dict(roundtrip_state_dict(opt.state_dict()))
    for p, q in zip(ps, ps8):
        m8 = qstate.dequantize_momentum(opt8.state[q], opts=qstate.format_options(opt8.param_groups[0]))
        assert fidelity.momentum_relative_error(m8, opt.state[p][TOY_KEY].float().view(m8.shape)) < 0.02
    back = QMuon([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=0.02, state_format="toy_fp16")
    back.load_state_dict(roundtrip_state_dict(opt8.state_dict()))
    assert all(set(st) == {STEP, TOY_KEY} for st in back.state.values())
    _train(back, back.param_groups[0]["params"], 1)


# --------------------------------------------------------------------------- no format names outside quant/
_PKG = pathlib.Path(__file__).resolve().parents[1] / "qmuon_lightning"
#: format names that are nothing else in this package (bf16 / fp32 / int8 / uint8 also name NS dtypes,
#: carriers and token dtypes, so comparisons against them cannot be told apart syntactically)
_UNAMBIGUOUS = {"grasp4", "e0m3", "int4", "ecc8"}


def _literal_names(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def test_no_format_name_comparisons_outside_quant_and_ops():
    hits = []
    for path in sorted(_PKG.rglob("*.py")):
        rel = path.relative_to(_PKG).as_posix()
        if rel.startswith(("quant/", "ops/")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Compare):
                names = set().union(*(_literal_names(n) for n in [node.left, *node.comparators]))
                if names & _UNAMBIGUOUS:
                    hits.append(f"{rel}:{node.lineno}")
    assert not hits, f"format-name comparisons outside quant/ (ask the format object instead): {hits}"
