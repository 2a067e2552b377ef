"""Weights + master + optimizer state bytes per parameter under DeepSpeed ZeRO with QMuon: DeepSpeed's
fp32 master partitions against its bf16 master partitions (``bf16_master_weights_and_grads`` +
``bf16_optimizer_states``), where QMuon writes its updates through ``bf16_update``.

Model: a tiny Hugging Face ``LlamaForCausalLM`` built locally (hidden 256, 4 layers, untied 8k
vocabulary), routed by ``qmuon_lightning.build_optimizer`` (int8 Muon momentum; AdamW moments fp32 or
int8). 2 processes (gloo, DeepSpeed's CPU accelerator), ZeRO-2 and ZeRO-3, bf16 training, two steps
on random tokens, then every rank counts the live tensors that persist between steps, each storage
once (``untyped_storage().nbytes()``, deduplicated by storage pointer):

- weights: the bf16 model weights the rank holds (ZeRO-2: DeepSpeed's flat bf16 buffers, the whole
  model; ZeRO-3: the rank's bf16 partitions);
- master: the flat partitions DeepSpeed hands the optimizer (fp32, or bf16 with the bf16 master);
  a master that *is* the weights' storage (ZeRO-3 with the bf16 master: DeepSpeed steps the bf16
  partitions in place) is counted once, under weights;
- optimizer state: QMuon's (``WholeMatrixZeroOptimizer.state_nbytes(muon_only=False)``: the int8
  momentum of the rows of the rank's Muon slices, the AdamW moments of its slices, the ``weight_ecc``
  codes of its slices under ``"ecc8"``).

Gradients and step temporaries are not counted (DeepSpeed's reduce buckets and gradient partitions
are the same size in all rows of one stage except the bf16 master's bf16 gradient partitions, which
are half the fp32 ones). Bytes per parameter = the rank's bytes / the model's parameter count (the
mean over the 2 ranks). Writes ``benchmarks/results/deepspeed_bf16_memory.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's qmuon_lightning, also in the workers
from _common import RESULTS_DIR, header_lines, md_table  # noqa: E402

ROWS = [  # (label, bf16 master, adamw_state_format, bf16_update)
    ("bf16 weights, DeepSpeed fp32 master; QMuon int8 + fp32 AdamW", False, "fp32", "stochastic"),
    ("bf16 weights, DeepSpeed fp32 master; QMuon int8 + int8 AdamW", False, "int8", "stochastic"),
    ("bf16 master, `bf16_update=\"stochastic\"`; QMuon int8 + int8 AdamW", True, "int8", "stochastic"),
    ("bf16 master, `bf16_update=\"ecc8\"`; QMuon int8 + int8 AdamW", True, "int8", "ecc8"),
]


def llama(vocab: int, hidden: int, layers: int):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _nbytes(tensors: list[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def _worker(rank: int, world: int, stage: int, master_bf16: bool, adamw: str, rule: str, vocab: int, hidden: int,
            layers: int) -> dict[str, Any]:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import qmuon
    from qmuon.integrations import deepspeed as qds

    model = llama(vocab, hidden, layers)
    n_params = sum(p.numel() for p in model.parameters())
    opt = qmuon.build_optimizer(model, state_format="int8", adamw_state_format=adamw, bf16_update=rule, verbose=False)
    bf16 = {"enabled": True}
    if master_bf16:
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}, "bf16": bf16}
    engine, opt, _, _ = qds.initialize(model, opt, cfg)
    for s in range(2):
        x = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(10 * s + rank))
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    zero = engine.optimizer
    seen: set[int] = set()
    if stage == 3:
        weights = _nbytes(list(zero.fp16_partitioned_groups_flat), seen)
        master = _nbytes(list(zero.fp32_partitioned_groups_flat), seen)
        master_dtype = zero.fp32_partitioned_groups_flat[0].dtype
    else:
        weights = _nbytes(list(zero.bit16_groups_flat), seen)
        master = _nbytes(list(zero.single_partition_of_fp32_groups), seen)
        master_dtype = zero.single_partition_of_fp32_groups[0].dtype
    state = opt.state_nbytes(muon_only=False)
    ecc = sum(t.numel() for st in opt._weight_state.values() for t in st.values()) + sum(
        st["weight_ecc"].numel() for sts in opt._slice_state.values() for st in sts if "weight_ecc" in st)
    return {"params": n_params, "weights": weights, "master": master, "state": state, "ecc": ecc,
            "master_dtype": str(master_dtype).replace("torch.", ""), "zero": type(zero).__name__}


def main() -> None:
    from _dist import run_workers

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--out", default=str(RESULTS_DIR / "deepspeed_bf16_memory.md"))
    args = ap.parse_args()
    os.environ["DS_ACCELERATOR"] = "cpu"  # inherited by the spawned workers, read on deepspeed's import
    header = ["ZeRO", "configuration", "master dtype", "weights B/param", "master B/param", "optimizer state B/param",
              "total B/param, per rank", "ecc8 codes / param (sum over ranks)"]
    rows, n = [], 0
    for stage in (int(s) for s in args.stages.split(",")):
        for label, master_bf16, adamw, rule in ROWS:
            res = run_workers(_worker, 2, timeout=600, stage=stage, master_bf16=master_bf16, adamw=adamw, rule=rule,
                              vocab=args.vocab, hidden=args.hidden, layers=args.layers)
            n = res[0]["params"]
            mean = {k: sum(r[k] for r in res) / len(res) / n for k in ("weights", "master", "state")}
            total = mean["weights"] + mean["master"] + mean["state"]
            rows.append([str(stage), label, res[0]["master_dtype"], f"{mean['weights']:.2f}", f"{mean['master']:.2f}",
                         f"{mean['state']:.2f}", f"**{total:.2f}**", f"{sum(r['ecc'] for r in res) / n:.2f}"])
            print(rows[-1], res[0]["zero"], flush=True)
    lines = header_lines("QMuon under DeepSpeed: fp32 vs bf16 master partitions, bytes per parameter")
    lines += [f"Model: `LlamaForCausalLM` (vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, untied), "
              f"{n:,} parameters; 2 processes (gloo, DeepSpeed CPU accelerator), bf16 training, 2 steps. Per rank: "
              "persistent live tensors, each storage counted once (see the script's docstring); B/param = mean over "
              "the 2 ranks of the rank's bytes / the model's parameters.", "",
              md_table(header, rows), ""]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
