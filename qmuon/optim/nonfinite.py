"""The non-finite gradient policy without host reads: flags decided on the device, read one step late.

A GPU stops the host at every read of a device value (``item``, ``tolist``, ``bool``), and inside a
gradient-release hook such a read serializes backward. So the step never reads whether a gradient
was finite. It computes one flag per parameter on the device (:func:`~qmuon.core.pipeline.finite_mask`),
and every kernel that writes the parameter or its state reads its flag and leaves a flagged parameter
bit-identical (the ops' ``skip`` argument). The host learns about skips one step later:

- the step's flags are copied to host memory asynchronously at the end of the step (pinned memory
  and an event on CUDA; on the CPU the flags are host memory already);
- the next step, before it changes anything, reads that copy (:meth:`NonFiniteLedger.settle`): it
  rolls back the step counters of the skipped parameters (their updates never happened), counts the
  skips, logs them and raises :class:`NonFiniteGradientError` when a parameter has been skipped more
  than ``max_nonfinite_skips`` steps in a row. Reading a copy made a whole step earlier does not wait
  for the device.

So ``max_nonfinite_skips`` raises at the start of the step after the limit was passed (a delay of one
step, in which the other parameters trained and the bad ones were skipped again, untouched), and
nothing of the skipped parameters is lost. ``state_dict()`` and the counters (``nonfinite_skips``,
...) settle first, so what they show is exact; that read waits for the device once.

``nonfinite="raise"`` (a debugging policy) reads the flags of its groups in the step itself, as it
must to raise before anything changes.

The optimizer's side: :class:`QMuonNonFiniteMixin` gives :class:`~qmuon.QMuon` its counters
(``nonfinite_skips``, ``nonfinite_skipped_steps``, ``nonfinite_max_consecutive``) and
``settle_nonfinite``; the step's decision which parameters update stays in ``qmuon.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

__all__ = ["NonFiniteGradientError", "NonFiniteLedger"]

log = logging.getLogger("qmuon.optim.qmuon")


class NonFiniteGradientError(FloatingPointError):
    """Parameters whose gradient stayed non-finite for more optimizer steps in a row than
    ``max_nonfinite_skips`` allows (their updates were skipped each time)."""

    def __init__(self, message: str, params: list[str], streak: int) -> None:
        super().__init__(message)
        #: Names (or group / index labels) of the parameters over the limit.
        self.params = params
        #: Their number of skipped steps in a row.
        self.streak = streak


Key = tuple[int, int]  # (param group, index in the group)


@dataclass
class _StepFlags:
    """One step's skip flags: the device tensors recorded by its ``step_params`` calls, then (at the
    end of the step) their host copy."""

    keys: list[Key] = field(default_factory=list)
    flags: list[Tensor] = field(default_factory=list)  # per call: bool (n,) on the device, True = skipped
    steps: list[Tensor | None] = field(default_factory=list)  # per key: its step counter (rolled back if skipped)
    host: Tensor | None = None
    event: Any = None


class NonFiniteLedger:
    """The host's delayed view of one optimizer's non-finite skips (see the module docstring).

    ``label(key)`` names a parameter in messages; ``max_skips()`` is the optimizer's current
    ``max_nonfinite_skips``.
    """

    def __init__(self, label: Callable[[Key], str], max_skips: Callable[[], int | None]) -> None:
        self.label = label
        self.max_skips = max_skips
        #: The error found by a settle that was not allowed to raise (a counter read): raised by the
        #: next step, before it changes anything.
        self.error: NonFiniteGradientError | None = None
        #: Parameter updates skipped (settled steps).
        self.skips = 0
        #: Optimizer steps in which at least one update was skipped (settled steps).
        self.skipped_steps = 0
        #: The longest run of consecutive skipped steps of any one parameter so far (settled steps).
        self.max_consecutive = 0
        self.streaks: dict[Key, int] = {}
        self._current = _StepFlags()
        self._pending: list[_StepFlags] = []

    # ------------------------------------------------------------------ recording (no host reads)
    def record(self, keys: Sequence[Key], skip: Tensor, steps: Sequence[Tensor | None]) -> None:
        """The flags of one ``step_params`` call: ``skip`` (bool, one per key, on the device) and the
        step counters the call advanced (rolled back at :meth:`settle` for the skipped keys)."""
        if not keys:
            return
        if torch.compiler.is_compiling() and self._current.keys:
            raise RuntimeError(
                "QMuon: a compiled optimizer step found the previous step's non-finite flags unread. Compile the "
                "step with qmuon.compile_step(optimizer) (it reads them between steps), or call "
                "optimizer.settle_nonfinite() after each compiled optimizer.step()")
        self._current.keys.extend(keys)
        self._current.flags.append(skip)
        self._current.steps.extend(steps)

    def take_current(self) -> _StepFlags:
        """What this step recorded so far, removed from the ledger: a captured step
        (:func:`qmuon.capture_step`) records its flag tensors once, at capture, and each replay
        refills them (:meth:`replay`)."""
        cur, self._current = self._current, _StepFlags()
        return cur

    def replay(self, recorded: _StepFlags) -> None:
        """Record again, for this step, what a captured step recorded at capture (same flag tensors,
        refilled by the replay that just ran)."""
        self._current = _StepFlags(list(recorded.keys), list(recorded.flags), list(recorded.steps))

    def end_step(self) -> None:
        """Close the step: start the asynchronous host copy of its flags."""
        cur, self._current = self._current, _StepFlags()
        if not cur.keys:
            return
        flags = cur.flags[0] if len(cur.flags) == 1 else torch.cat([f.reshape(-1) for f in cur.flags])
        if flags.device.type == "cuda":
            cur.host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            cur.host.copy_(flags, non_blocking=True)
            cur.event = torch.cuda.Event()
            cur.event.record()
        elif flags.device.type == "cpu":
            cur.host = flags  # host memory already: read one step later like the device's copy
        else:  # other accelerators: a plain copy at settle time
            cur.host = flags
        cur.flags = []
        self._pending.append(cur)

    def staged(self) -> list[Tensor]:
        """The host copies waiting to be read (what :meth:`settle` reads; tests exempt them when
        they count the step's host reads)."""
        return [p.host for p in self._pending if p.host is not None]

    # ------------------------------------------------------------------ settling (reads old copies)
    def settle(self, raise_now: bool = True) -> None:
        """Read every closed step's flags (oldest first): roll back skipped parameters' step counters,
        count and log the skips, update the streaks. Parameters over ``max_nonfinite_skips`` raise
        :class:`NonFiniteGradientError` now, or (``raise_now=False``: a counter read) at the next
        :meth:`settle` that may raise."""
        while self._pending:
            entry = self._pending.pop(0)
            if entry.event is not None and not entry.event.query():
                # the copy started a step ago; waited for only when the device is that far behind (a
                # finished event is not waited on, so torch.cuda.set_sync_debug_mode sees nothing)
                entry.event.synchronize()
            assert entry.host is not None
            skipped = entry.host.to("cpu").tolist()
            try:
                self._settle_one(entry.keys, skipped, entry.steps)
            except NonFiniteGradientError as err:
                self.error = err
        if raise_now and self.error is not None:
            err, self.error = self.error, None
            raise err

    def _settle_one(self, keys: list[Key], skipped: list[bool], steps: list[Tensor | None]) -> None:
        bad: list[str] = []
        over: list[str] = []
        for key, was_skipped, step in zip(keys, skipped, steps, strict=True):
            if not was_skipped:
                self.streaks.pop(key, None)  # a finite update ends the parameter's run of skips
                continue
            if step is not None:
                step -= 1  # the update never happened
            label = self.label(key)
            bad.append(label)
            self.streaks[key] = n = self.streaks.get(key, 0) + 1
            self.max_consecutive = max(self.max_consecutive, n)
            limit = self.max_skips()
            if limit is not None and n > limit:
                over.append(label)
        if not bad:
            return
        self.skips += len(bad)
        self.skipped_steps += 1
        log.warning("QMuon: skipped update of %s (non-finite gradient)", ", ".join(bad))
        if over:
            n = max(self.streaks.values())
            raise NonFiniteGradientError(
                f"QMuon: the gradient of {', '.join(over)} was non-finite (NaN/Inf) for {n} optimizer steps in a row, "
                f"more than max_nonfinite_skips={self.max_skips()}; training stops here. Those parameters and their "
                "optimizer state were left untouched by every skipped step (the check reads each step's flags one "
                "step late, so the other parameters trained one more step). Fix: lower the learning rate, enable or "
                "tighten gradient clipping, check the loss scale (fp16) and the data of the last steps for NaN/Inf; "
                "raise max_nonfinite_skips (or set it to None) only if such runs recover", over, n)

    def record_read(self, keys: Sequence[Key], skipped: Sequence[bool]) -> None:
        """Flags read at once (sharded steps, the DeepSpeed driver): settled now, after the steps still
        pending. Their skipped parameters were left out of the step, so no counter is rolled back."""
        self.settle()
        self._settle_one(list(keys), list(skipped), [None] * len(keys))

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> dict[str, Any]:
        self.settle(raise_now=False)
        if self._current.keys:
            raise RuntimeError("QMuon: an optimizer cannot be copied in the middle of a step")
        return {k: v for k, v in self.__dict__.items() if k not in ("_pending", "_current")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._current = _StepFlags()
        self._pending = []


@dataclass
class StepSkips:
    """The skip flags of one ``step_params`` call: ``flags[j]`` (bool, on the device) for ``keys[j]``;
    ``flags`` is None when the call decided on the host (sharded steps: the skipped parameters were
    left out instead)."""

    keys: list[Key] = field(default_factory=list)
    flags: Tensor | None = None
    _index: dict[Key, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._index = {k: j for j, k in enumerate(self.keys)}

    def of(self, key: Key) -> Tensor | None:
        """The 0-d flag of parameter ``key`` (a view; nothing is read), or None."""
        return None if self.flags is None else self.flags[self._index[key]]


class QMuonNonFiniteMixin:
    """The non-finite skip counters of :class:`~qmuon.QMuon` (``self`` is the optimizer: ``_nonfinite``, its
    :class:`NonFiniteLedger`, ``max_nonfinite_skips`` and ``_param_label``)."""

    @property
    def nonfinite_skips(self) -> int:
        """Parameter updates skipped because their gradient was not finite (``nonfinite="skip"``).
        Reading it reads the skip flags of the steps not yet settled (one wait for the device)."""
        self._nonfinite.settle(raise_now=False)
        return self._nonfinite.skips

    @property
    def nonfinite_skipped_steps(self) -> int:
        """Optimizer steps in which at least one parameter update was skipped (non-finite gradient)."""
        self._nonfinite.settle(raise_now=False)
        return self._nonfinite.skipped_steps

    @property
    def nonfinite_max_consecutive(self) -> int:
        """The longest run of consecutive skipped steps of any one parameter so far."""
        self._nonfinite.settle(raise_now=False)
        return self._nonfinite.max_consecutive

    def settle_nonfinite(self) -> None:
        """Read the skip flags of the steps not read yet (normally the next step does, before it changes
        anything): roll back skipped parameters' step counters, count them, and raise
        :class:`NonFiniteGradientError` past ``max_nonfinite_skips``. Waits for the device once."""
        self._nonfinite.settle()

    def _key_label(self, key: tuple[int, int]) -> str:
        return self._param_label(*key)

    def _max_skips(self) -> int | None:
        return self.max_nonfinite_skips
