"""Kill a ``qmuon-train`` run with SIGKILL at random moments, restart it with the same command.

For each case and world size (1: one process; 2: ``qmuon_fsdp`` on 2 CPU processes, gloo): an
uninterrupted run, then the same run started, killed (SIGKILL to the whole process group) at a
random moment after a random number of new checkpoints, and restarted with the same command
(``ckpt_path: auto`` in its config), ``--kills`` times, then run to completion. PASS when every
run completes with weights and optimizer state bit-identical to its uninterrupted run and the
same checkpoint names in every folder (no ``-vN`` duplicates), and nothing hidden is left.

Cases: ``single`` (one ``ModelCheckpoint``, every step, top-1 + last) and ``two`` (issue 20: the
recipe's ``ModelCheckpoint`` every 4 steps in ``checkpoints/`` plus a user's own every 3 steps in
``ck/``, both top-1 + last; a restart must resume from the newest checkpoint of either folder).
Issue 19's state and weights, each checkpointing every step as ``single``: ``adamw_int4`` (int4
AdamW moments; every case else keeps QMuon's default int8), ``bf16_stochastic`` / ``bf16_ecc8``
(``precision: bf16-true``, bf16 weights without an fp32 master, written with that ``bf16_update``;
ecc8's ``weight_ecc`` codes are compared too), ``release`` (``gradient_release: true``) and
``bf16_release`` (bf16-true + stochastic + release).

    python benchmarks/kill_resume.py                       # 20 kills per world size (1 and 2), both cases
    python benchmarks/kill_resume.py --kills 3 --world-sizes 1 --cases two --no-write   # quick look
    python benchmarks/kill_resume.py --cases two --kills 10 --steps 150 --append        # add a section
    python benchmarks/kill_resume.py --kills 3 --steps 40 --world-sizes 1 \
        --cases single,adamw_int4,bf16_stochastic,bf16_ecc8,release,bf16_release --append  # issue 19's cases

Writes ``benchmarks/results/kill_resume.md``. The run setup is tests/_crash.py's (also used by
tests/test_resume.py, which kills twice per world size).
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import _crash  # noqa: E402
from _common import RESULTS_DIR, header_lines  # noqa: E402

_RESUMED = re.compile(r"ckpt_path=auto: (resuming from (\S+) \(global step (\d+)\)|no complete checkpoint)")
#: case -> write_config arguments and the ``last.ckpt`` files compared
CASES = {
    "single": ({"every": 1}, ["checkpoints/last.ckpt"]),
    "two": ({"every": 4, "second": "periodic", "second_every": 3}, ["checkpoints/last.ckpt", "ck/last.ckpt"]),
    # issue 19: the quantized AdamW state, bf16 weights without an fp32 master, gradient release
    # (every one checkpointing every step, as "single")
    "adamw_int4": ({"every": 1, "optimizer": {"adamw_state_format": "int4"}}, ["checkpoints/last.ckpt"]),
    "bf16_stochastic": ({"every": 1, "precision": "bf16-true", "optimizer": {"bf16_update": "stochastic"}},
                        ["checkpoints/last.ckpt"]),
    "bf16_ecc8": ({"every": 1, "precision": "bf16-true", "optimizer": {"bf16_update": "ecc8"}},
                  ["checkpoints/last.ckpt"]),
    "release": ({"every": 1, "optimizer": {"gradient_release": True}}, ["checkpoints/last.ckpt"]),
    "bf16_release": ({"every": 1, "precision": "bf16-true",
                      "optimizer": {"bf16_update": "stochastic", "gradient_release": True}}, ["checkpoints/last.ckpt"]),
}
#: What each case's run stores, for the report (the tiny run's optimizer: int8 QMuon momentum with
#: stochastic rounding; AdamW moments in QMuon's default format, int8, unless the case says otherwise).
CASE_SETUP = {
    "single": "fp32 weights, int8 AdamW moments (default)",
    "two": "fp32 weights, int8 AdamW moments (default)",
    "adamw_int4": "fp32 weights, `adamw_state_format: int4`",
    "bf16_stochastic": "`precision: bf16-true`, `bf16_update: stochastic`, int8 AdamW moments",
    "bf16_ecc8": "`precision: bf16-true`, `bf16_update: ecc8` (weight_ecc codes in the state), int8 AdamW moments",
    "release": "fp32 weights, `gradient_release: true`, int8 AdamW moments",
    "bf16_release": "`precision: bf16-true`, `bf16_update: stochastic`, `gradient_release: true`, int8 AdamW moments",
}


def trial(world_size: int, kills: int, steps: int, seed: int, work: Path, case: str = "single") -> dict:
    straight, killed = work / f"{case}_w{world_size}_straight", work / f"{case}_w{world_size}_killed"
    options, lasts = CASES[case]
    t0 = time.perf_counter()
    _crash.run(_crash.write_config(straight, world_size, steps, **options))
    cfg = _crash.write_config(killed, world_size, steps, **options)
    rng = random.Random(seed)
    rows = []
    for i in range(kills):
        before = _crash.saved_steps(killed)
        after = min(steps, before + rng.randint(1, 2))
        outcome, log = _crash.run_and_kill(cfg, killed, after, rng, max_delay=0.3)
        m = _RESUMED.search(log)
        resumed = "-" if m is None else ("fresh" if m.group(2) is None else
                                         f"step {m.group(3)} ({Path(m.group(2)).parent.name}/{Path(m.group(2)).name})")
        reports = [line.strip() for line in log.splitlines() if "ckpt_path=auto: removed" in line
                   or "skipping incomplete" in line or "interrupted save" in line or "not tracked" in line]
        rows.append({"kill": i + 1, "outcome": outcome, "resumed": resumed, "steps_on_disk": _crash.saved_steps(killed),
                     "reports": reports})
        print(f"{case} world {world_size} kill {i + 1}: {outcome}, started from {resumed}, "
              f"checkpoint step after: {rows[-1]['steps_on_disk']}" + (f"; {len(reports)} report(s)" if reports else ""),
              flush=True)
        if outcome == "finished":
            break
    final = _crash.run(cfg)
    diff, n_tensors, final_steps = [], 0, []
    for last in lasts:  # every folder's last checkpoint (the step of its callback's last save)
        a, b = _crash.load_checkpoint(straight / last), _crash.load_checkpoint(killed / last)
        diff += [f"{last}: {k}" for k in _crash.state_differences(a, b)]
        if a["global_step"] != b["global_step"]:
            diff.append(f"{last}: global_step {b['global_step']} instead of {a['global_step']}")
        n_tensors += len(_crash.tensors({k: a[k] for k in a if k == "state_dict" or k.startswith("optimizer")}))
        final_steps.append(b["global_step"])
    names = (_crash.checkpoint_names(straight), _crash.checkpoint_names(killed))
    return {"case": case, "world_size": world_size, "rows": rows, "kills": sum(r["outcome"] == "killed" for r in rows),
            "diff": diff, "n_tensors": n_tensors, "names": names, "leftovers": _crash.hidden_leftovers(killed),
            "versioned": [n for n in names[1] if re.search(r"-v\d+\.ckpt$", n)],
            "fresh_restarts": sum(r["resumed"] == "fresh" for r in rows[1:]),
            "final_step": max(final_steps), "seconds": time.perf_counter() - t0, "final_log": final}


def torchrun_trial(kills: int, steps: int, seed: int, work: Path) -> dict:
    """The 2-process run under ``torchrun --max-restarts``: torchrun, not this script, restarts it."""
    straight, killed = work / "tr_straight", work / "tr_killed"
    t0 = time.perf_counter()
    _crash.run(_crash.write_config(straight, 2, steps))
    code, events, log = _crash.run_under_torchrun(_crash.write_config(killed, 2, steps), killed, kills, random.Random(seed))
    a = _crash.load_checkpoint(straight / "checkpoints" / "last.ckpt")
    b = _crash.load_checkpoint(killed / "checkpoints" / "last.ckpt")
    resumes = [m.group(0) for m in _RESUMED.finditer(log)]
    return {"code": code, "events": events, "resumes": resumes, "diff": _crash.state_differences(a, b),
            "names": (_crash.checkpoint_names(straight), _crash.checkpoint_names(killed)),
            "final_step": b["global_step"], "seconds": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--cases", default="single,two", help=f"comma-separated, of {sorted(CASES)}")
    ap.add_argument("--steps", type=int, default=300, help="max_steps of the run (a tiny model runs ~10 steps/s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torchrun", action="store_true",
                    help="instead: one 2-process run under torchrun --max-restarts=KILLS, a worker killed KILLS times")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--append", action="store_true",
                    help="append this report (with its own header) to --out instead of replacing the file")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "kill_resume.md")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qmuon_kill_resume_"))
    if args.torchrun:
        try:
            r = torchrun_trial(args.kills, args.steps, args.seed, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        ok = r["code"] == 0 and not r["diff"] and r["names"][0] == r["names"][1] and r["final_step"] == args.steps
        lines = [*header_lines("Worker SIGKILLs under `torchrun --max-restarts`"), "",
                 f"`torchrun --standalone --nproc_per_node 2 --max-restarts {args.kills} -m qmuon_lightning.cli fit "
                 "--config run.yaml` (tests/_crash.py's tiny run under `qmuon_fsdp`, a checkpoint every step, "
                 f"`ckpt_path: auto`, max_steps {args.steps}). Each time a new checkpoint appears one worker (picked at "
                 "random) gets SIGKILL; torchrun stops the other and restarts both with the same command.", "",
                 *[f"- {e}" for e in r["events"]], "", "Starts, as logged by rank 0:", "",
                 *[f"- `{x}`" for x in r["resumes"]], "",
                 f"torchrun exit code {r['code']}; final step {r['final_step']}; tensors differing from the uninterrupted "
                 f"2-process run: {len(r['diff'])}; checkpoint names equal: {r['names'][0] == r['names'][1]}; "
                 f"{r['seconds']:.0f} s.", "", f"**{'PASS' if ok else 'FAIL'}**"]
        text = "\n".join(lines) + "\n"
        print(text)
        if not args.no_write:
            (RESULTS_DIR / "kill_resume_torchrun.md").write_text(text)
        return 0 if ok else 1
    results = []
    try:
        for case in args.cases.split(","):
            for w in [int(x) for x in args.world_sizes.split(",")]:
                results.append(trial(w, args.kills, args.steps, args.seed + w, work, case))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = all(not r["diff"] and r["names"][0] == r["names"][1] and not r["leftovers"] and not r["versioned"]
             and not r["fresh_restarts"] and r["final_step"] == args.steps and r["kills"] >= min(args.kills, 1)
             for r in results)
    lines = [*header_lines(f"SIGKILL and `--ckpt_path auto` restart (cases: {args.cases})"), ""]
    lines.append(f"Tiny decoder LM (tests/_crash.py: d_model 32, 1 layer, int8 QMuon, stochastic rounding), "
                 f"max_steps {args.steps}, an epoch every 7 steps, `ckpt_path: auto` in the config. Case `single`: one "
                 "`ModelCheckpoint`, every step (top-1 + last) in `checkpoints/`. Case `two` (issue 20): the recipe's "
                 "`ModelCheckpoint` every 4 steps in `checkpoints/` plus a user's own every 3 steps in `ck/` (both "
                 "top-1 + last). Each start is killed (SIGKILL, whole process group) 0-0.3 s after 1-2 new checkpoints "
                 f"appear (in any folder), then restarted with the same command; after {args.kills} kills the run "
                 "completes. Compared with an uninterrupted run of the same case and world size: every weight and "
                 "optimizer tensor of each folder's `last.ckpt` bit for bit, and the checkpoint names of every folder.")
    lines += ["", "Cases' training setup: " + "; ".join(f"`{c}`: {CASE_SETUP[c]}" for c in args.cases.split(",")) + ".",
              ""]
    lines.append("| case | world size | kills | restarts that started over | final step | tensors differing | "
                 "checkpoint names equal | `-vN` names | hidden leftovers | wall time |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        lines.append(f"| {r['case']} | {r['world_size']} | {r['kills']} | {r['fresh_restarts']} | {r['final_step']} | "
                     f"{len(r['diff'])} of {r['n_tensors']} | {r['names'][0] == r['names'][1]} ({', '.join(r['names'][1])}) | "
                     f"{len(r['versioned'])} | {len(r['leftovers'])} | {r['seconds']:.0f} s |")
    for r in results:
        lines += ["", f"### {r['case']}, world size {r['world_size']}: each start", "",
                  "| start | outcome | resumed from | newest checkpoint step after | reports (removed / incomplete / interrupted / untracked) |",
                  "| --- | --- | --- | --- | --- |"]
        for row in r["rows"]:
            rep = "<br>".join(x.replace("|", "/")[:200] for x in row["reports"]) or "-"
            lines.append(f"| {row['kill']} | {row['outcome']} | {row['resumed']} | {row['steps_on_disk']} | {rep} |")
    lines += ["", f"**{'PASS' if ok else 'FAIL'}**: " + ("every run completed, bit-identical to its uninterrupted run, every "
              "restart resumed, same checkpoint names, no -vN names, no leftovers" if ok else "see the table")]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if args.append and args.out.exists():  # this report's title becomes a section of the file
            text = args.out.read_text().rstrip("\n") + "\n\n#" + text
        args.out.write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
