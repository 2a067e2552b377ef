"""Device- and driver-independent building blocks of QMuon.

:mod:`.newton_schulz`: the Newton-Schulz engine (coefficient schedules incl. Polar Express, the NS
compute dtype with ``ns_dtype="auto"``, the folded batched iteration and its textbook reference).
"""

from .newton_schulz import (
    MUON_COEFFICIENTS,
    NS_DTYPE_ENV,
    NS_DTYPES,
    NS_PRESETS,
    POLAR_EXPRESS_COEFFICIENTS,
    POLAR_EXPRESS_RAW_COEFFICIENTS,
    POLAR_EXPRESS_SAFETY,
    NSCoefficientSpec,
    NSSchedule,
    newton_schulz_folded,
    newton_schulz_reference,
    ns_scalar_map,
    resolve_ns_dtype,
    resolve_schedule,
)

__all__ = [
    "MUON_COEFFICIENTS",
    "NS_DTYPE_ENV",
    "NS_DTYPES",
    "NS_PRESETS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "POLAR_EXPRESS_RAW_COEFFICIENTS",
    "POLAR_EXPRESS_SAFETY",
    "NSCoefficientSpec",
    "NSSchedule",
    "newton_schulz_folded",
    "newton_schulz_reference",
    "ns_scalar_map",
    "resolve_ns_dtype",
    "resolve_schedule",
]
