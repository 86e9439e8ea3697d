"""Paired comparisons of two arms of an experiment over seeds: an exact one-sided sign-flip test and a seed-level
bootstrap interval, both on the per-seed differences.

Why these two: with a handful of seeds, a t-test's normality cannot be checked, while the sign-flip test is exact
under the one assumption pairing gives (under no effect, each seed's difference is as likely to have either sign). With
n seeds its smallest p-value is 2^-n (1/64 at 6 seeds), so 6 seeds can reach p < 0.05 and 4 cannot. The bootstrap
interval says how large the effect is, not only whether it is there.
"""

from __future__ import annotations

import itertools
import random
import statistics
from collections.abc import Sequence

__all__ = ["bootstrap_interval", "paired_test", "sign_flip_p", "trust_region_helps"]

MAX_EXACT_SEEDS = 20
"""The test enumerates 2^n sign patterns: up to 20 seeds (about a million patterns)."""


def _finite_values(name: str, values: Sequence[float]) -> list[float]:
    out = [float(v) for v in values]
    if not out or not all(v == v and abs(v) != float("inf") for v in out):
        raise ValueError(f"{name} must be a non-empty sequence of finite numbers, got {values!r}")
    return out


def sign_flip_p(differences: Sequence[float]) -> float:
    """One-sided p-value of "the mean paired difference is above 0": the share of the 2^n sign patterns whose mean is
    at least the observed one (the observed pattern included, so p ≥ 2^-n). Exact; ties count against the effect."""
    d = _finite_values("differences", differences)
    if len(d) > MAX_EXACT_SEEDS:
        raise ValueError(f"differences has {len(d)} values; the exact test takes at most {MAX_EXACT_SEEDS}")
    observed = sum(d)
    # A relative tolerance so that float rounding of an equal sum never counts as smaller.
    slack = 1e-12 * sum(abs(x) for x in d)
    at_least = sum(
        sum(s * x for s, x in zip(signs, d)) >= observed - slack for signs in itertools.product((1, -1), repeat=len(d))
    )
    return at_least / 2 ** len(d)


def bootstrap_interval(
    differences: Sequence[float], level: float = 0.95, resamples: int = 20_000, seed: int = 0
) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean paired difference, resampling seeds with replacement."""
    d = _finite_values("differences", differences)
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(d, k=len(d))) for _ in range(resamples))
    tail = (1 - level) / 2
    return means[round(tail * (resamples - 1))], means[round((1 - tail) * (resamples - 1))]


def paired_test(differences: Sequence[float], level: float = 0.05) -> dict[str, object]:
    """One decision on per-seed differences (positive: the claim holds at that seed): it passes only if the exact
    one-sided sign-flip p is below ``level`` and the seed-bootstrap 95 % interval of the mean lies above 0."""
    d = _finite_values("differences", differences)
    lo, hi = bootstrap_interval(d)
    p = sign_flip_p(d)
    return {
        "differences": d,
        "mean": statistics.fmean(d),
        "p_one_sided": p,
        "bootstrap_95": [lo, hi],
        "passes": p < level and lo > 0,
    }


def trust_region_helps(
    own_kl: dict[str, Sequence[float]], human_nll: dict[str, Sequence[float]], margin: float, level: float = 0.05
) -> dict[str, object]:
    """The second experiment's rule (docs/distillation.md): trust-region blending helps only if both hold, each
    by :func:`paired_test` at ``level``, on values paired by seed (``{"student": [...], "trust_region": [...]}``,
    nats per token, lower is better):

    1. non-inferiority on the student's own samples: KL(π_θ‖π_t) of trust_region minus α = 0's below ``margin``,
       tested as margin − (trust_region − student) > 0;
    2. superiority on the human solutions: the student's NLL of α = 0 minus trust_region's above 0.

    An intersection-union rule: a false claim must pass both tests, so each at ``level`` keeps the rule's error at
    ``level`` with no correction for there being two."""
    lengths = {len(own_kl["student"]), len(own_kl["trust_region"]), len(human_nll["student"])}
    if len(lengths | {len(human_nll["trust_region"])}) != 1:
        raise ValueError("own_kl and human_nll must hold one value per seed for each arm, paired")
    non_inferior = paired_test([margin - (t - s) for s, t in zip(own_kl["student"], own_kl["trust_region"])], level)
    superior = paired_test([s - t for s, t in zip(human_nll["student"], human_nll["trust_region"])], level)
    return {
        "margin": margin,
        "level": level,
        "non_inferiority_own_kl": non_inferior,
        "superiority_human_nll": superior,
        "helps": bool(non_inferior["passes"] and superior["passes"]),
    }
