"""The driver's counters, and the statistics it reports: the engines' plugin counters from the session beside them."""

from __future__ import annotations

import collections

from dual_sampling.driver.versions import WeightVersions
from dual_sampling.lockstep import ErrorCode, SyncSession

__all__ = ["FINISH_REASONS", "new_counters", "statistics"]

FINISH_REASONS = ("stop", "length", "abort", "error")
"""How a sample ends (:attr:`SampleRecord.finish_reason`)."""


def new_counters() -> collections.Counter:
    """Requests submitted, tokens of verified samples, alpha updates, finished by reason and failed by error code, all
    at 0."""
    names = [
        "requests",
        "tokens",
        "alpha_updates",
        *(f"finished_{reason}" for reason in FINISH_REASONS),
        *(f"failed_{code.label}" for code in ErrorCode if code != ErrorCode.NONE),
    ]
    return collections.Counter(dict.fromkeys(names, 0))


def statistics(
    session: SyncSession, counters: collections.Counter, versions: WeightVersions, in_flight: int, queued: int
) -> dict[str, float]:
    """The engines' counters (rows, waits in seconds, timeouts, plans) and the driver's, with weight updates per
    role and the requests in flight and queued now."""
    stats: dict[str, float] = {}
    if not session.closed:
        stats.update(session.statistics())
    for name in [k for k in stats if k.endswith("_ns")]:
        stats[name[:-3] + "_s"] = stats.pop(name) / 1e9
    stats.update(counters)
    stats.update({f"{role}_updates": count for role, count in versions.updates.items()})
    stats["in_flight"] = in_flight
    stats["queued"] = queued
    return stats
