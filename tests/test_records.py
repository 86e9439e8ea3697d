"""Sample records: the best_of ranking that the API and the server share."""

from __future__ import annotations

import math

import pytest

from dual_sampling.records import SampleRecord, best_of_score


def sample(logq: list[float], finish_reason: str = "stop", error: str | None = None) -> SampleRecord:
    n = len(logq)
    return SampleRecord(
        text="",
        token_ids=list(range(n)),
        finish_reason=finish_reason,
        seed=0,
        alpha=[0.5] * n,
        logp_teacher=[v - 1.0 for v in logq],
        logp_theta=[v + 1.0 for v in logq],
        logq=logq,
        error=error,
    )


@pytest.mark.parametrize("name", ["logq", "logp_theta", "logp_teacher"])
def test_best_of_scores_sum_the_named_values(name):
    s = sample([-0.5, -1.25, -2.0])
    assert best_of_score(s, name) == math.fsum(getattr(s, name))


def test_aborted_and_failed_samples_rank_below_every_complete_one():
    complete = sample([-30.0] * 8)  # a long, unlikely sample
    aborted = sample([-0.1], finish_reason="abort")  # short, so its sum alone would win
    failed = sample([-0.1], finish_reason="error", error="decision_error at step 1")
    ranked = sorted([aborted, failed, complete], key=lambda s: -best_of_score(s, "logq"))
    assert ranked[0] is complete
    assert best_of_score(aborted, "logq") == best_of_score(failed, "logq") == -math.inf
