"""A training step that reads nothing back, checked on the GPU itself: ``torch.cuda.set_sync_debug_mode("error")``.

tests/test_host_reads.py counts host reads on the CPU (where they are free) by wrapping the reading
methods. On a GPU the direct check is CUDA's own: under ``torch.cuda.set_sync_debug_mode("error")``
every operation that makes the host wait for the device (``item``, ``tolist``, ``bool``, a blocking
copy to or from the device, ``torch.cuda.synchronize``, ``nonzero``, ...) raises. This script trains
the host-reads test's model (an embedding, 3 blocks of two biased linears: the 6 Muon matrices, a norm
and a biased head; 17 parameters, the embedding and head 5120 elements each so quantized AdamW moments
really run) on the GPU for several configurations:

* ``--warmup`` steps first, outside the mode: the first step creates the optimizer state and runs the
  compiled kernels' first-use canary (which compares each op against its reference and does read
  back: once per process and op), and ``"auto"`` choices are fixed then; with ``compile_step`` the
  warm-up steps also compile the graphs (a compile synchronizes);
* then ``--steps`` whole training steps (forward, backward, ``step()``, ``zero_grad()``) inside
  ``set_sync_debug_mode("error")``, one of them with a NaN loss (every gradient non-finite: every
  parameter's update is skipped on the device, and the host learns it a step late through a pinned
  non-blocking copy);
* after them, outside the mode: the skip counters must show exactly that one skipped step (reading
  them waits for the device once, by design), and the weights must be finite.

The model avoids the ops that synchronize by themselves on CUDA (the embedding's backward counts its
unique indices on the host, ``cross_entropy`` with class indices checks them): the embedding is applied
as a one-hot matmul with ``nn.Embedding``'s weight (routing still sees an ``nn.Embedding``) and the loss
is cross entropy against one-hot probabilities. The first row, ``model alone``, runs the same steps
with no optimizer to show that the model itself never synchronizes; if it does, the optimizer rows
step inside the mode only (``step()`` and ``zero_grad()``; gradient release, which steps inside
backward, then cannot be checked) and say so.

A failing configuration is reported with its exception and the innermost frames in qmuon; it is run
again under ``set_sync_debug_mode("warn")`` to list where every synchronization of those steps came
from. Each configuration has a time limit (``--limit``; a hang dumps the stacks and ends the process:
the rows done so far are already printed). Without CUDA the steps run on the CPU with no sync check
(the CPU rehearsal of this script), and the rows say so.

    python benchmarks/gpu_step_check.py --out /tmp/step_sync.md     # on a GPU machine
    python benchmarks/gpu_step_check.py --configs int8,grasp4       # some of them
"""

from __future__ import annotations

import argparse
import faulthandler
import platform
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import qmuon  # noqa: E402  (after the path: runs from a source tree without install)

VOCAB, D, HIDDEN, BATCH, SEQ = 160, 32, 48, 4, 12

#: name -> (build_optimizer keywords, weight dtype, gradient release, compile_step (True) / capture_step ("captured"))
CONFIGS: dict[str, tuple[dict, torch.dtype, bool, bool | str]] = {
    "int8": (dict(state_format="int8"), torch.float32, False, False),
    "int4": (dict(state_format="int4"), torch.float32, False, False),
    "grasp4": (dict(state_format="grasp4"), torch.float32, False, False),
    "normuon": (dict(update={"variant": "normuon"}), torch.float32, False, False),
    # bf16 weights (no fp32 copy), stochastic rounding of the weight write, int8 AdamW moments
    "bf16-stochastic-adamw8": (dict(bf16_update="stochastic", adamw_state_format="int8"), torch.bfloat16, False, False),
    "int8-release": (dict(state_format="int8"), torch.float32, True, False),  # gradient release: steps in backward
    "int8-compiled": (dict(state_format="int8"), torch.float32, False, True),  # qmuon.compile_step (inductor)
    # update.capturable + qmuon.capture_step: one CUDA graph (the first warm-up step eager, the second captures)
    "bf16-adamw8-captured": (dict(adamw_state_format="int8", update={"capturable": True}), torch.bfloat16, False,
                             "captured"),
}
MODEL_ONLY = "model alone"


class Net(nn.Module):
    """tests/test_host_reads.py's Net; the embedding as a one-hot matmul (no host read in its backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D))
                                    for _ in range(3))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, onehot: torch.Tensor) -> torch.Tensor:
        h = onehot @ self.emb.weight
        for b in self.blocks:
            h = h + b(h)
        return self.head(self.norm(h))


class SyncMode:
    """``torch.cuda.set_sync_debug_mode(mode)`` inside, 0 after; nothing on the CPU."""

    def __init__(self, device: torch.device, mode: str) -> None:
        self.on = device.type == "cuda"
        self.mode = mode

    def __enter__(self):
        if self.on:
            torch.cuda.set_sync_debug_mode(self.mode)
        return self

    def __exit__(self, *exc):
        if self.on:
            torch.cuda.set_sync_debug_mode(0)
        return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _qmuon_frames(tb, n: int = 3) -> str:
    """The innermost ``n`` frames in qmuon's code (where the read was asked for)."""
    frames = [f for f in traceback.extract_tb(tb) if "/qmuon/" in f.filename.replace("\\", "/")
              or "/qmuon_lightning/" in f.filename.replace("\\", "/")]
    return "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-n:])


def _short(e: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[:limit] + " ..."


def run_config(name: str, device: torch.device, warmup: int, steps: int, nan_at: int, model_syncs: bool,
               mode: str = "error") -> dict:
    """Warm-up, then ``steps`` steps in the sync debug ``mode`` (the one at index ``nan_at`` with a NaN loss)."""
    torch.manual_seed(0)
    if name == MODEL_ONLY:
        kw, dtype, release, compiled = {}, torch.float32, False, False
    else:
        kw, dtype, release, compiled = CONFIGS[name]
    model = Net().to(device=device, dtype=dtype)
    tokens = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    onehot = nn.functional.one_hot(tokens, VOCAB).to(device=device, dtype=dtype)  # made outside the mode
    target = nn.functional.one_hot(tokens, VOCAB).flatten(0, 1).to(device=device, dtype=torch.float32)
    opt = step = None
    if name != MODEL_ONLY:
        opt = qmuon.build_optimizer(model, lr=0.02, adamw_lr=1e-3, verbose=False, gradient_release=release, **kw)
        if compiled == "captured":
            if device.type != "cuda":
                return {"config": name, "mode": mode, "warmup": warmup, "steps": steps, "nan_at": nan_at, "ok": True,
                        "detail": "CUDA graphs need CUDA", "syncs": [], "scope": "-", "skipped": True}
            step = qmuon.capture_step(opt, warmup_steps=1)
        else:
            step = qmuon.compile_step(opt) if compiled else opt.step
    out = {"config": name, "mode": mode, "warmup": warmup, "steps": steps, "nan_at": nan_at, "ok": False,
           "detail": "", "syncs": []}
    scope = "step() + zero_grad()" if (model_syncs and not release) else "forward + backward + step()"
    out["scope"] = scope if opt is not None else "forward + backward"

    def forward_backward(bad: bool) -> None:
        loss = nn.functional.cross_entropy(model(onehot).float().flatten(0, 1), target)
        if bad:
            loss = loss * float("nan")
        loss.backward()

    def one_step(bad: bool) -> None:
        if opt is None:
            forward_backward(bad)
            for p in model.parameters():
                p.grad = None
            return
        if model_syncs and not release:  # forward / backward outside the mode, the optimizer inside
            forward_backward(bad)
            with SyncMode(device, mode):
                step()
                opt.zero_grad(set_to_none=compiled != "captured")  # a captured step reads .grad in place
        else:
            forward_backward(bad)
            step()
            opt.zero_grad(set_to_none=compiled != "captured")

    t0 = time.perf_counter()
    for _ in range(warmup):
        one_step(False)
    _sync(device)
    t_warm = time.perf_counter() - t0
    if model_syncs and release:
        out["detail"] = "not checked: the model alone synchronizes, and release steps inside backward"
        return out
    rec: list = []
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            t1 = time.perf_counter()
            if model_syncs and not release:
                for i in range(steps):
                    one_step(i == nan_at)
            else:
                with SyncMode(device, mode):
                    for i in range(steps):
                        one_step(i == nan_at)
            _sync(device)
            t_steps = time.perf_counter() - t1
    except Exception as e:  # noqa: BLE001 - reported per configuration
        out["detail"] = _short(e)
        where = _qmuon_frames(e.__traceback__)
        if where:
            out["detail"] += f" (at {where})"
        return out
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    out["syncs"] = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in rec
                           if "synchroniz" in str(w.message).lower()})
    problems = []
    if opt is not None:
        if opt.nonfinite_skipped_steps != 1:  # settles: waits for the device once (outside the mode)
            problems.append(f"nonfinite_skipped_steps = {opt.nonfinite_skipped_steps}, expected 1")
        n_params = len(list(model.parameters()))
        if opt.nonfinite_skips != n_params:
            problems.append(f"nonfinite_skips = {opt.nonfinite_skips}, expected {n_params}")
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        problems.append(f"non-finite weights after the steps: {', '.join(bad)}")
    out["ok"] = not problems and (mode == "error" or not out["syncs"])
    out["detail"] = "; ".join(problems) or (f"warm-up {t_warm:.1f}s, {steps} steps {t_steps * 1e3:.0f} ms")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of: {', '.join(CONFIGS)}")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the check (state, canary, compile)")
    ap.add_argument("--steps", type=int, default=4, help="steps inside set_sync_debug_mode('error')")
    ap.add_argument("--nan-at", type=int, default=1, help="which of the checked steps has a NaN loss")
    ap.add_argument("--limit", type=float, default=60.0, help="seconds per configuration (twice that with "
                    "compile_step); past it the stacks are dumped and the process ends")
    ap.add_argument("--out", type=Path, help="markdown table to write")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: this torch sees no CUDA device")
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; choose from: {', '.join(CONFIGS)}")
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    from qmuon.ops import _extension

    st = _extension.status()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
    head = [f"### A step under `torch.cuda.set_sync_debug_mode(\"error\")` ({where})", "",
            f"torch {torch.__version__}, qmuon kernels: cpu={st.cpu} cuda={st.cuda}. Per configuration: "
            f"{args.warmup} warm-up steps outside the mode (state creation, the first-use canary and, with "
            f"`compile_step`, the compile read back: expected), then {args.steps} training steps inside it, "
            f"step {args.nan_at + 1} of them with a NaN loss; afterwards the skip counters must show one skipped "
            "step and the weights must be finite.", ""]
    if device.type != "cuda":
        print("gpu_step_check: no CUDA: the steps run on the CPU without set_sync_debug_mode "
              "(nothing synchronizes on a CPU; tests/test_host_reads.py counts host reads there)", flush=True)
        head += ["**No CUDA device: the steps ran on the CPU with no synchronization check (a rehearsal of "
                 "this script only).**", ""]
    rows, results = [], []

    def row(r: dict) -> list[str]:
        verdict = ("PASS" if r["ok"] else "FAIL") if device.type == "cuda" else ("ran" if r["ok"] else "FAIL")
        if r.get("skipped"):
            verdict = "skipped"
        detail = r["detail"].replace("|", "\\|")
        if r.get("warn_syncs"):
            detail += " — under \"warn\", syncs from: " + ", ".join(r["warn_syncs"][:8])
        return [r["config"], r["scope"], verdict, detail]

    def text(note: str = "") -> str:
        table = ["| configuration | inside the mode | result | detail |", "| --- | --- | --- | --- |"]
        table += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(head + table + ([note] if note else [])) + "\n"

    def emit(r: dict) -> None:
        results.append(r)
        rows.append(row(r))
        print(f"[{rows[-1][2]}] {r['config']}: {rows[-1][3]}", flush=True)
        if args.out:  # after every row: a hang later (the process is ended) leaves the rows done so far
            args.out.write_text(text("" if len(rows) == len(names) + 1 else
                                     "\n(the rows so far: a configuration after them did not finish)"))

    # the model alone first: does forward + backward synchronize by itself?
    faulthandler.dump_traceback_later(args.limit, exit=True)
    try:
        base = run_config(MODEL_ONLY, device, args.warmup, args.steps, args.nan_at, model_syncs=False)
    except Exception as e:  # noqa: BLE001
        base = {"config": MODEL_ONLY, "scope": "forward + backward", "ok": False, "detail": _short(e)}
    finally:
        faulthandler.cancel_dump_traceback_later()
    emit(base)
    model_syncs = not base["ok"]
    if model_syncs:
        print("gpu_step_check: the model alone synchronizes: the optimizer rows check step() + zero_grad() only",
              flush=True)
    for name in names:  # a compiling configuration gets twice the time (the warm-up compiles two graphs)
        faulthandler.dump_traceback_later(args.limit * (2 if CONFIGS[name][3] else 1), exit=True)
        try:
            try:
                r = run_config(name, device, args.warmup, args.steps, args.nan_at, model_syncs)
            except Exception as e:  # noqa: BLE001 - building or warming up failed
                r = {"config": name, "scope": "-", "ok": False, "detail": f"before the check: {_short(e)}"
                     + (f" (at {_qmuon_frames(e.__traceback__)})" if _qmuon_frames(e.__traceback__) else "")}
            if not r["ok"] and device.type == "cuda" and r.get("mode") == "error":
                try:  # where do the synchronizations come from? the same steps under "warn"
                    w = run_config(name, device, args.warmup, args.steps, args.nan_at, model_syncs, mode="warn")
                    r["warn_syncs"] = w["syncs"] or ["(none recorded)"]
                except Exception as e:  # noqa: BLE001
                    r["warn_syncs"] = [f"warn rerun failed: {_short(e, 120)}"]
        finally:
            faulthandler.cancel_dump_traceback_later()
        emit(r)
    print("\n" + text(), flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
