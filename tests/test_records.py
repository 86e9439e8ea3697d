"""Sample records: the best_of ranking that the API and the server share."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from dual_sampling.records import SampleRecord, best_of, best_of_score


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


@pytest.mark.parametrize("name", ["logq", "logp_theta", "logp_teacher"])
def test_length_normalised_scores_average_the_named_values_per_token(name):
    s = sample([-0.5, -1.25, -2.0])
    assert best_of_score(s, f"{name}_mean") == pytest.approx(math.fsum(getattr(s, name)) / 3, abs=1e-15)


def test_a_length_normalised_score_stops_favouring_short_samples():
    short, long = sample([-1.0, -1.0]), sample([-0.5] * 10)  # log q sums -2 and -5; means -1 and -0.5
    assert best_of([short, long], 1, "logq") == [0]
    assert best_of([short, long], 1, "logq_mean") == [1]


def test_aborted_and_failed_samples_rank_below_every_complete_one():
    complete = sample([-30.0] * 8)  # a long, unlikely sample
    aborted = sample([-0.1], finish_reason="abort")  # short, so its sum alone would win
    failed = sample([-0.1], finish_reason="error", error="decision_error at step 1")
    assert best_of([aborted, failed, complete], 1, "logq") == [2]
    assert best_of_score(aborted, "logq") == best_of_score(failed, "logq") == -math.inf


def test_best_of_never_ranks_samples_of_two_weight_versions_together():
    """An update can land between the draws of one request (more draws than free slots): scores of two θ do not
    compare, so only the samples of the version that drew the most are ranked."""
    old = [sample([-3.0]), sample([-1.0]), sample([-2.0])]
    new = [dataclasses.replace(sample([-0.1]), theta_version="round-2")]  # best of all, but drawn by another θ
    assert best_of([*old, *new], 2, "logq") == [1, 2]
    assert best_of([new[0], old[0]], 1, "logq") == [1]  # a tie in size: the pair whose first sample comes later
    with pytest.raises(ValueError, match=r"best_of: .*'round-2'.*too few by one version to rank n=3"):
        best_of([*old[:2], *new, dataclasses.replace(new[0], logq=[-0.2])], 3, "logq")
    assert best_of(old, 3, "logq") == [1, 2, 0]
    # A sample held across an update (pause with keep) names each token's θ: it ranks with samples that spanned the
    # same versions, not with those of its first token's version alone.
    spanning = dataclasses.replace(sample([-0.5, -0.5]), theta_versions=["0", "round-2"])
    assert best_of([*old[:2], spanning], 2, "logq") == [1, 0]
    with pytest.raises(ValueError, match=r"best_of: .*'0 then round-2'.*rank n=2"):
        best_of([spanning, new[0]], 2, "logq")
    assert best_of([spanning, dataclasses.replace(spanning, logq=[0.0, 0.0]), new[0]], 2, "logq") == [1, 0]


def test_the_first_tokens_of_a_sample_cut_every_per_token_field_alike():
    n, k = 5, 3
    dense = [np.arange(n * 2 * k, dtype=dt).reshape(n, 2, k) for dt in (np.int32, np.float32, np.float32)]
    s = SampleRecord(
        text="abcde", token_ids=list(range(10, 15)), finish_reason="stop", seed=1, alpha=[0.1] * n,
        logp_teacher=[-1.0] * n, logp_theta=[-2.0] * n, logq=[-1.5] * n, teacher_token_ids=list(range(10, 15)),
        theta_token_ids=list(range(10, 15)), dense_ids=dense[0], dense_logp=dense[1], dense_other_logp=dense[2],
    )  # fmt: skip
    cut = s.first(2)
    per_token = [f.name for f in dataclasses.fields(s) if isinstance(getattr(s, f.name), (list, np.ndarray))]
    assert len(per_token) == 10  # every list and array of a sample is per token
    for name in per_token:
        assert len(getattr(cut, name)) == 2 and np.array_equal(np.asarray(getattr(cut, name)), getattr(s, name)[:2])
    assert cut.finish_reason == "length" and s.finish_reason == "stop" and len(s.token_ids) == n
    assert s.first(n).finish_reason == "stop"
    with pytest.raises(ValueError, match=r"n must be in \[0, 5\], got 6"):
        s.first(6)
    held = dataclasses.replace(s, theta_versions=["0", "0", "1", "1", "1"])
    assert held.first(3).theta_versions == ["0", "0", "1"] and held.first(2).theta_versions is None
    assert held.first(2).theta_version == "0"


def test_record_fields_past_the_first_are_given_by_name():
    """A sample's and a beam's records share their declaration (``TokenRecords``); a positional value past a record's
    own leading fields is refused, never stored in another field."""
    from dual_sampling.beams import BeamSequence

    with pytest.raises(TypeError):
        SampleRecord("", [1], "stop", 0, [0.5])
    with pytest.raises(TypeError):
        BeamSequence([1], [0.5])
    beam = BeamSequence([1], alpha=[0.5], logq=[-1.0])
    assert beam.alpha == [0.5] and beam.finish_reason is None and beam.cum_logq == -1.0
