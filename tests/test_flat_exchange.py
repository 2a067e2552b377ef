"""The Newton-Schulz exchange over flat partitions (:mod:`qmuon.distributed.flat`, what DeepSpeed
ZeRO runs on): slices cut into row pieces, the sharded step's carriers applied per piece, the
owners dealt by the sharded step's planner, and the byte figures of ``QMuon.comm_stats``.

In process: the row pieces and part runs tile a slice exactly; one rank moves nothing lossy. Two
gloo processes: a flat buffer of three matrices cut in the middle of a row (as ZeRO-2 cuts it),
each carrier: the owner receives exactly the carrier's round trip of every holder's pieces, every
holder receives exactly the round trip of its pieces of the result, and the bytes each rank counts
add up to the all-ranks total, which is the carriers' size of the slices that cross.
"""

from __future__ import annotations

import pytest
import torch

from qmuon.core.plan import MatrixPart
from qmuon.distributed.carrier import get_carrier
from qmuon.distributed.flat import FlatExchange, FlatParam, Segment, deal_owners, part_runs, row_pieces

SHAPES = [(6, 40), (9, 300), (4, 7)]  # 300 columns: two int8 carrier blocks per row (256 + 44)
PAIRS = [("fp32", "fp32"), ("bf16", "bf16"), ("int8", "int8"), ("mxfp8", "int8")]  # (comm_carrier, comm_return)


def test_row_pieces_tile_the_slice_on_row_boundaries():
    for cols, start, length in [(7, 3, 30), (7, 0, 14), (5, 12, 1), (300, 299, 602), (1, 4, 9)]:
        pieces = row_pieces(cols, start, length)
        at = 0
        for off, r, w in pieces:
            assert off == at and (r == 1 or w == cols) and ((start + off) % cols + w <= cols)
            at += r * w
        assert at == length and len(pieces) <= 3


def test_part_runs_cover_the_part_in_the_slice():
    cols, rows = 10, 9
    part = MatrixPart(2, 7, 3, 8, 1.0)  # rows [2, 7), columns [3, 8)
    want = torch.zeros(rows, cols, dtype=torch.bool)
    want[2:7, 3:8] = True
    for start, length in [(0, 90), (25, 31), (44, 3), (13, 60)]:
        got = torch.zeros(length, dtype=torch.bool)
        for off, n, width, c0, c1 in part_runs(part, cols, start, length):
            view = got.narrow(0, off, n * width).view(n, width)
            assert not view[:, c0:c1].any()  # each element once
            view[:, c0:c1] = True
        assert torch.equal(got, want.view(-1)[start:start + length]), (start, length)


def test_one_rank_moves_nothing_lossy():
    """Nothing crosses a process boundary: the carriers are fp32 whatever the options say."""
    ex = FlatExchange(None, 1, 0, "int8", "int8")
    assert ex.fwd.name == ex.ret.name == "fp32"
    p = FlatParam(0, 0, 0, torch.Size((5, 9)), 45, True, holders=[Segment(0, 45, 0)])
    g = torch.randn(45)
    ex.start(True)
    whole, _ = ex.gather({0: [p]}, {0: g}, torch.float32, torch.device("cpu"))
    assert torch.equal(whole[0], g)
    got = {}
    ex.scatter({0: [p]}, {0: 2 * g}, torch.device("cpu"), lambda q, seg, o: got.setdefault(q.index, o))
    assert torch.equal(got[0], 2 * g)
    ex.count([p], True, 0)
    assert ex.comm_stats["ns_bytes_total"] == 0 and ex.comm_stats["muon_elements"] == 45


def _layout(world: int) -> list[FlatParam]:
    """SHAPES in one flat buffer cut into ``world`` equal partitions (mid-row), as ZeRO-1/2 does."""
    total = sum(r * c for r, c in SHAPES)
    bounds = [total * k // world for k in range(world + 1)]
    params, at = [], 0
    for i, (r, c) in enumerate(SHAPES):
        holders = []
        for k in range(world):
            lo, hi = max(at, bounds[k]), min(at + r * c, bounds[k + 1])
            holders.append(Segment(lo - at, hi - lo, lo - bounds[k]) if hi > lo else None)
        params.append(FlatParam(i, 0, i, torch.Size((r, c)), r * c, True, holders=holders))
        at += r * c
    return params


def _roundtrip(carrier: str, p: FlatParam, seg: Segment, flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (the slice's elements) through ``carrier``, piece by piece."""
    c = get_carrier(carrier)
    out = torch.empty(seg.length)
    for off, r, w in row_pieces(p.cols, seg.start, seg.length):
        out.narrow(0, off, r * w).view(r, w).copy_(c.roundtrip(flat.narrow(0, off, r * w).view(r, w)))
    return out


def _worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)  # the same tensors on every rank
    grads = [torch.randn(r * c) for r, c in SHAPES]
    results = [torch.randn(r * c) for r, c in SHAPES]
    out = {}
    for carrier, ret in PAIRS:
        params = _layout(world)
        deal_owners(params, world)
        by_owner: dict[int, list[FlatParam]] = {}
        for p in params:
            by_owner.setdefault(p.owner, []).append(p)
        ex = FlatExchange(None, world, rank, carrier, ret)
        ex.start(True)
        mine = {p.index: grads[p.index].narrow(0, p.holders[rank].start, p.holders[rank].length)
                for p in params if p.holders[rank] is not None}
        whole, _ = ex.gather(by_owner, mine, torch.float32, torch.device("cpu"))
        for i, g in whole.items():  # the owner's gradient: every holder's pieces through the carrier
            p = params[i]
            for seg in filter(None, p.holders):
                want = _roundtrip(carrier, p, seg, grads[i].narrow(0, seg.start, seg.length))
                assert torch.equal(g.narrow(0, seg.start, seg.length), want), (carrier, i)
        got: dict[int, torch.Tensor] = {}
        ex.scatter(by_owner, {i: results[i] for i in whole}, torch.device("cpu"),
                   lambda p, seg, o: got.setdefault(p.index, o.float()))
        for p in params:
            seg = p.holders[rank]
            if seg is not None:
                assert torch.equal(got[p.index], _roundtrip(ret, p, seg, results[p.index].narrow(0, seg.start,
                                                                                                   seg.length)))
        ex.count(params, True, 0)
        c, cr = get_carrier(carrier), get_carrier(ret)
        crossing = sum(c.nbytes(r, w) + cr.nbytes(r, w) for p in params for s, seg in enumerate(p.holders)
                       if seg is not None and s != p.owner for _, r, w in row_pieces(p.cols, seg.start, seg.length))
        out[carrier] = {**ex.comm_stats, "expected_total": crossing, "owners": [p.owner for p in params],
                        "split": sum(sum(h is not None for h in p.holders) > 1 for p in params)}
    return out


@pytest.mark.slow
def test_two_ranks_carry_every_piece_through_the_carriers():
    from _dist import run_workers

    res = run_workers(_worker, 2, timeout=120)
    for carrier, _ in PAIRS:
        a, b = res[0][carrier], res[1][carrier]
        assert a["owners"] == b["owners"] and a["split"] >= 1  # the cut falls inside a matrix
        assert a["ns_bytes_total"] == b["ns_bytes_total"] == a["expected_total"] > 0, (carrier, a)
        assert a["ns_bytes_sent"] + b["ns_bytes_sent"] == a["ns_bytes_total"], (carrier, a, b)
    # int8 carries about a quarter of fp32's bytes (1 byte per element + a 4-byte scale per 256-element block)
    assert res[0]["int8"]["ns_bytes_total"] < 0.3 * res[0]["fp32"]["ns_bytes_total"]
