"""The sync protocol under many random schedules, without vLLM engines (seconds per schedule)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dual_sampling.sync import SESSION_PREFIX
from tests.sim_engines import run_simulation


@pytest.mark.parametrize("seed", range(6))
def test_random_schedules_complete_without_stale_reads(seed):
    summary = run_simulation(seed, n_requests=25, max_seqs=4)
    assert summary["completed"] == 25
    assert summary["leaked_slots"] == []
    assert summary["stats"]["teacher_timeouts"] == summary["stats"]["theta_timeouts"] == 0


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), max_seqs=st.integers(1, 6), n=st.integers(1, 20), abort_rate=st.sampled_from([0.0, 0.2]))
def test_property_every_request_completes_or_is_aborted(seed, max_seqs, n, abort_rate):
    summary = run_simulation(seed, n_requests=n, max_seqs=max_seqs, abort_rate=abort_rate)
    assert summary["completed"] + summary["aborted"] == n
    assert summary["leaked_slots"] == []
    assert summary["stats"]["teacher_timeouts"] == summary["stats"]["theta_timeouts"] == 0


def test_no_session_file_left_behind():
    before = {f for f in os.listdir("/dev/shm") if f.startswith(SESSION_PREFIX)}
    run_simulation(0, n_requests=3, max_seqs=2)
    assert {f for f in os.listdir("/dev/shm") if f.startswith(SESSION_PREFIX)} <= before


def test_nan_logits_fail_only_their_request_with_a_named_error():
    nan_keys = frozenset({3, 7, 11})
    summary = run_simulation(5, n_requests=16, max_seqs=4, nan_keys=nan_keys)
    assert summary["failed"] and set(summary["failed"]) <= nan_keys
    assert set(summary["failed"].values()) == {"bad_logits"}
    assert summary["completed"] + len(summary["failed"]) == 16
    assert summary["leaked_slots"] == []
    assert summary["stats"]["teacher_timeouts"] == summary["stats"]["theta_timeouts"] == 0
