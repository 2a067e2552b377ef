"""A training step reads nothing back from the tensors it computes (issue: "a step the GPU never waits on").

On a GPU every ``item`` / ``tolist`` / ``bool`` / ``int`` / ``float`` / ``cpu`` / ``numpy`` of a device
tensor stops the host until the device has caught up; inside a gradient-release hook it serializes
backward. On this CPU such reads are free, so they are counted instead: every one of those methods is
wrapped while the optimizer steps (and, under gradient release, while backward runs its hooks).

Not counted, by design:
- the per-parameter ``step`` counters: 0-d CPU tensors, torch.optim's convention (they stay on the host
  whatever the parameters' device, so reading them never waits for a device);
- the non-finite ledger's staged flags (:mod:`qmuon.optim.nonfinite`): on a GPU the host copy of a
  step's flags is made with ``non_blocking=True`` into pinned memory at the end of that step and read
  by the next one, so the read does not wait for the device's current work. The test checks that
  these are the only other tensors read, and only in the step after the one that computed them.

The model is the issue's: 6 Muon matrices with their biases, an embedding, a norm and a head (17
parameters). A direct GPU check (``torch.cuda.set_sync_debug_mode("error")``) is in
benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import qmuon

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


class HostReads:
    """Counts host reads of tensors not in ``exempt`` (by identity) while active."""

    def __init__(self) -> None:
        self.exempt: set[int] = set()
        self.seen: list[tuple[str, tuple, str]] = []
        self.exempt_reads = 0

    def record(self, name: str, t: torch.Tensor) -> None:
        self.seen.append((name, tuple(t.shape), str(t.dtype)))

    @contextlib.contextmanager
    def counting(self, exempt: list[torch.Tensor]):
        self.exempt = {id(t) for t in exempt}
        saved = {name: getattr(torch.Tensor, name) for name in READS}

        def wrap(name, fn):
            def counted(t, *args, **kwargs):
                if id(t) in self.exempt:
                    self.exempt_reads += 1
                else:
                    self.record(name, t)
                return fn(t, *args, **kwargs)
            return counted

        try:
            for name, fn in saved.items():
                setattr(torch.Tensor, name, wrap(name, fn))
            yield self
        finally:
            for name, fn in saved.items():
                setattr(torch.Tensor, name, fn)


class Net(nn.Module):
    """An embedding, 3 blocks of two biased linears (the 6 Muon matrices), a norm and a biased head."""

    def __init__(self, vocab: int = 160, d: int = 32, hidden: int = 48) -> None:
        # vocab x d = 5120 elements: the embedding and the head keep quantized AdamW moments (>= 4096)
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)) for _ in range(3))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(self.norm(h))


def _exempt(opt) -> list[torch.Tensor]:
    steps = [st["step"] for st in opt.state.values() if "step" in st]
    return steps + opt._nonfinite.staged()


# configuration name -> (build_optimizer kwargs, model dtype)
CONFIGS = {
    "int8": (dict(state_format="int8"), torch.float32),
    "fp32 momentum": (dict(state_format="fp32"), torch.float32),
    "bf16 momentum": (dict(state_format="bf16"), torch.float32),
    "int4": (dict(state_format="int4"), torch.float32),
    "e0m3": (dict(state_format="e0m3"), torch.float32),
    "grasp4": (dict(state_format="grasp4"), torch.float32),
    "normuon": (dict(update={"variant": "normuon"}), torch.float32),
    "cautious": (dict(weight_decay=0.1, update={"cautious_weight_decay": True}), torch.float32),
    "stochastic momentum": (dict(state={"rounding": "stochastic"}), torch.float32),
    "int8 adamw": (dict(adamw_state_format="int8"), torch.float32),
    "int4 adamw": (dict(adamw_state_format="int4"), torch.float32),
    "bf16 nearest": (dict(bf16_update="nearest"), torch.bfloat16),
    "bf16 stochastic": (dict(bf16_update="stochastic"), torch.bfloat16),
    "bf16 stochastic + int8 adamw": (dict(bf16_update="stochastic", adamw_state_format="int8"), torch.bfloat16),
    "bf16 ecc8": (dict(bf16_update="ecc8"), torch.bfloat16),
}


def _run(config: str, release: bool, bad_steps=(3,), steps: int = 5):
    kw, dtype = CONFIGS[config]
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = qmuon.build_optimizer(model, lr=0.02, adamw_lr=1e-3, verbose=False, gradient_release=release, **kw)
    counter = HostReads()
    x = torch.randint(0, 64, (4, 12))
    per_step = []
    for step in range(steps):
        def backward():
            loss = nn.functional.cross_entropy(model(x).float().flatten(0, 1), x.flatten())
            if step in bad_steps:
                loss = loss * float("nan")
            loss.backward()

        if release:
            # the hooks step inside backward: count during backward as well
            with counter.counting(_exempt(opt)) if step >= 2 else contextlib.nullcontext():
                backward()
                opt.step()
        else:
            backward()
            with counter.counting(_exempt(opt)) if step >= 2 else contextlib.nullcontext():
                opt.step()
        opt.zero_grad()
        per_step.append(list(counter.seen))
        counter.seen.clear()
    return model, opt, per_step, counter


@pytest.mark.parametrize("release", [False, True], ids=["step", "release"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_step_reads_nothing_back(config, release):
    """Steps 2-4 (after the first steps made the state and fixed "auto"'s choices), one of them with a
    NaN loss: zero host reads of computed tensors; the only other reads are of the staged flags."""
    if release and config == "grasp4":
        pass  # grasp4 steps per parameter like the others
    model, opt, per_step, counter = _run(config, release)
    reads = [r for s in per_step[2:] for r in s]
    assert reads == [], f"{config}: host reads in the step: {reads}"
    assert counter.exempt_reads > 0  # the step counters (and the staged flags) were read: the wrap works
    # the NaN step (3) skipped every parameter: after settling, nothing of it remains
    assert opt.nonfinite_skipped_steps == 1 and opt.nonfinite_skips == len(list(model.parameters()))


def test_the_counter_sees_a_host_read():
    """The harness counts: the pre-change pattern (a flag read with ``tolist``) is seen."""
    counter = HostReads()
    t = torch.ones(3)
    with counter.counting([]):
        torch.isfinite(t).tolist()
        bool((t > 0).any())
    assert [name for name, *_ in counter.seen] == ["tolist", "__bool__"]
