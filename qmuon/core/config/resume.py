"""The one compatibility check of saved Muon state (:func:`check_resume`): whether momentum saved
with one group's layout can be resumed by another. Part of the configuration
(:mod:`qmuon.core.config`, which re-exports every name); ``QMuon.load_state_dict``,
``QuantizedStateCheckpoint`` and the strategy call it.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...quant import state as qstate


class ResumeMismatch(qstate.StateFormatError):
    """Saved Muon state that cannot be resumed as it is by this optimizer."""


def state_layout(group: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a Muon group that fixes how its momentum is stored: the format and the
    options that are part of that format's layout (for example int8's ``block_size``)."""
    fmt = qstate.get_format(group["state_format"])
    opts = qstate.format_options(dict(group))
    out: dict[str, Any] = {"state_format": fmt.name}
    for key in fmt.layout_options:
        out[key] = getattr(opts, key)
    return out


def describe_layout(layout: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in layout.items())


def check_resume(saved: Mapping[str, Any], current: Mapping[str, Any], *, where: str,
                 allow_format_change: bool) -> str | None:
    """Whether Muon state saved with group ``saved`` can be resumed by group ``current`` (the one
    check ``QMuon.load_state_dict``, ``QuantizedStateCheckpoint`` and the strategy make).

    Same layout: fine (returns None). Options that must match for the codes to be kept (the rule
    is :func:`qmuon.quant.registry.layout_conflicts`: e.g. int8 saved with
    ``block_size=128``, resumed with 256) differ: always :class:`ResumeMismatch`, naming the
    constructor argument that resumes it. Another format: allowed only when
    ``allow_format_change`` (the momentum is dequantized and re-encoded: returns a note saying
    so), else :class:`ResumeMismatch`.
    """
    conflicts = qstate.layout_conflicts(saved, current)
    if conflicts:
        raise ResumeMismatch(qstate.describe_conflicts(conflicts, where))
    a, b = state_layout(saved), state_layout(current)
    if a["state_format"] == b["state_format"]:
        return None
    msg = f"{where}: saved with {describe_layout(a)}, this optimizer uses {describe_layout(b)}"
    if allow_format_change:
        return msg + "; QMuon.load_state_dict converts the momentum (dequantize and re-encode; not bit-exact)"
    raise ResumeMismatch(
        msg + f". Build the optimizer with {describe_layout(a)} to resume, or allow a format change (QMuon."
        "load_state_dict converts; QuantizedStateCheckpoint(allow_format_change=True))")
