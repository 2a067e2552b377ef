"""The single sample call of each compiled op (9 x 100 by default): what the first-use canary checked
before its coverage cases (:mod:`._canary_cases`). ``qmuon-doctor`` runs it at a larger size, and the ctypes
twin's tests and ``benchmarks/bench_canary.py`` (the canary before issue 37) use it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["samples"]


def samples(device: torch.device, rows: int = 9, cols: int = 100, bs: int = 32, grid: int = 16
            ) -> dict[str, Callable[[], tuple]]:
    """Arguments of one call of each op with a compiled twin (built fresh per call: the updates mutate
    them). The defaults are the canary's small input; ``qmuon-doctor`` uses a larger one."""
    from . import reference as ref
    from . import reference_4bit as ref4
    from . import reference_adamw as refa
    from . import reference_weight as refw

    gen = torch.Generator().manual_seed(20260)

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    m = randn(rows, cols, scale=0.02)
    g = randn(rows, cols, scale=0.1)
    master = randn(rows, cols).cpu()
    codes4 = torch.randint(-7, 8, (rows, cols), generator=gen, dtype=torch.int8)
    d = lambda t: t.to(device).clone()  # noqa: E731
    stream = ref.noise_stream(7, 3, 1)
    wstream = refw.weight_noise_stream(7, 3, 1)
    # State, built on the CPU by the reference (the same bits on every device) when a sample first needs
    # it: the canary checks one op, and encoding every format for it would cost more than the check.
    memo: dict[str, Any] = {}

    def state(key: str) -> Any:
        if key not in memo:
            memo[key] = {
                "q8": lambda: ref.quantize_rows(m.cpu(), bs, signed=True),
                "i4": lambda: ref4.int4_quantize(m.cpu(), bs),
                "e3": lambda: ref4.e0m3_quantize(m.cpu()),
                "gq": lambda: ref4.grid_quantize4(m.cpu(), grid),
                "m8": lambda: refa.encode_moment(m.cpu(), refa.M8, bs),
                "v8": lambda: refa.encode_moment((g * g).cpu(), refa.V8, bs),
                "wb": lambda: refw.nearest_bf16(master),
                "ecc": lambda: refw.ecc8_encode(master, state("wb")),
            }[key]()
        return memo[key]

    q8 = lambda k: state("q8")[k]  # noqa: E731
    i4 = lambda k: state("i4")[k]  # noqa: E731
    e3 = lambda k: state("e3")[k]  # noqa: E731
    gq = lambda k: state("gq")[k]  # noqa: E731
    m8 = lambda k: state("m8")[k]  # noqa: E731
    v8 = lambda k: state("v8")[k]  # noqa: E731

    def sums(block: int) -> list[Tensor]:
        return [torch.full((rows, ref.num_blocks(cols, block)), float("nan"), device=device)]

    return {
        "q8_momentum_update_multi_": lambda: ([d(q8(0))], [d(q8(1))], [g.to(torch.bfloat16)], sums(bs), 0.95, True,
                                              bs, [stream], [5]),
        "dense_momentum_update_multi_": lambda: ([d(m)], [g.clone()], sums(bs), 0.95, True, bs, [-1], [0]),
        "quantize_rows": lambda: (m.clone(), bs, True, stream, 3),
        "dequantize_rows": lambda: (d(q8(0)), d(q8(1)), bs),
        "pack_int4": lambda: (d(codes4),),
        "unpack_int4": lambda: (d(i4(0)), cols),
        "ue4m3_encode": lambda: (m.abs() * 1000, True),
        "ue4m3_decode": lambda: (torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device),),
        "int4_quantize": lambda: (m.clone(), bs, stream, 2),
        "int4_dequantize": lambda: (d(i4(0)), d(i4(1)), bs, cols),
        "e0m3_quantize": lambda: (m.clone(), True, stream, 1),
        "e0m3_dequantize": lambda: (d(e3(0)), d(e3(1)), d(e3(2)), cols),
        "grid_quantize4": lambda: (m.clone(), grid, stream, 0),
        "grid_quantize4_with_scale": lambda: (m.clone(), grid, d(gq(3)).reshape(1), -1, 0),
        "grid_dequantize4": lambda: (d(gq(0)), d(gq(1)), d(gq(2)), d(gq(3)), grid, cols),
        "int4_momentum_update_multi_": lambda: ([d(i4(0))], [d(i4(1))], [g.clone()], sums(bs), 0.95, True, bs,
                                                [stream], [0]),
        "e0m3_momentum_update_multi_": lambda: ([d(e3(0))], [d(e3(1))], [d(e3(2)).reshape(1)],
                                                [g.to(torch.float16)], sums(bs), 0.95, False, bs, [-1], [0]),
        "e0m3_momentum_amax_multi": lambda: ([d(e3(0))], [d(e3(1))], [d(e3(2)).reshape(1)], [g.clone()], 0.9),
        "e0m3_momentum_update_with_scale_multi_": lambda: (
            [d(e3(0))], [d(e3(1))], [d(e3(2)).reshape(1)], [torch.full((1,), 3e-4, device=device)], [g.clone()],
            sums(16), 0.9, True, 16, [stream], [11]),
        "adamw_q_update_": lambda: (g.to(torch.bfloat16), d(m8(0)), d(m8(1)), d(v8(0)), d(v8(1)),
                                    torch.empty(rows, cols, device=device), 0.9, 0.95, 1e-8, -1e-3, 0.5,
                                    refa.M8, refa.V8, bs, refa.adamw_noise_stream(7, 1, 3), 3 * cols),
        "bf16_weight_update_": lambda: (d(state("wb")), g.clone(), -0.3, 0.999, wstream, 5, cols),
        "bf16_ecc8_weight_update_": lambda: (d(state("wb")), d(state("ecc")), g.clone(), -0.3, 0.999),
        # fp32 weights, a transposed bf16 update (a tall Newton-Schulz output, read in place)
        "fp32_weight_update_": lambda: (d(master), g.to(torch.bfloat16).T.contiguous().mT, -0.3, 0.999),
    }
