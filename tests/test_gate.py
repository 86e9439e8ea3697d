"""The admission gate (dual_sampling.sync) and the CPU placement of the two engines."""

from __future__ import annotations

import threading
import time

import pytest

from dual_sampling.engine import DualEngineConfig, engine_cpus, split_cpu_binding
from dual_sampling.sync import SessionLayout, SyncSession


@pytest.fixture
def session():
    with SyncSession.create(SessionLayout(vocab=8, slots=2, max_steps=4)) as s:
        yield s


def _park_in_thread(session: SyncSession, role: str, limit: float) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        start = time.monotonic()
        out["parked_s"] = session.park_if_held(role, limit)
        out["returned_after"] = time.monotonic() - start

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_no_hold_means_no_park(session):
    assert session.park_if_held("teacher", 5.0) == 0.0
    g = session.hold_gate()
    session.open_gate(g)
    assert session.park_if_held("theta", 5.0) == 0.0


def test_both_sides_park_until_the_gate_opens(session):
    g = session.hold_gate()
    assert session.parked(g) == (False, False)
    threads = [_park_in_thread(session, role, 10.0) for role in ("teacher", "theta")]
    deadline = time.monotonic() + 5
    while session.parked(g) != (True, True) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert session.parked(g) == (True, True)
    time.sleep(0.1)
    assert all(t.is_alive() for t, _ in threads), "a processor left before the gate opened"
    session.open_gate(g)
    for t, out in threads:
        t.join(timeout=5)
        assert not t.is_alive()
        assert 0.1 <= out["parked_s"] < 5
    # A later hold is a new generation: being parked for the old one does not count.
    assert session.parked(session.hold_gate()) == (False, False)


def test_park_is_bounded_and_shutdown_releases_it(session):
    session.hold_gate()
    t, out = _park_in_thread(session, "teacher", 0.3)
    t.join(timeout=5)
    assert 0.3 <= out["returned_after"] < 2
    t, out = _park_in_thread(session, "theta", 30.0)
    time.sleep(0.05)
    session.shutdown()
    t.join(timeout=5)
    assert not t.is_alive() and out["returned_after"] < 5


def test_split_binding_halves_the_cpus(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {4, 0, 2})
    assert split_cpu_binding() == {"teacher": "0,2", "theta": "4"}
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {3})
    assert split_cpu_binding() == {}
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert split_cpu_binding() == {}, "the user's own binding must win"


def test_engine_cpus_sets_and_restores_the_variable(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "7")
    import os

    with engine_cpus("1"):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "7"
    with engine_cpus(None):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "7"


def test_bad_cpu_binding_is_named(tiny_same):
    with pytest.raises(ValueError, match="cpu_binding must be 'split' or 'vllm', got 'both'"):
        DualEngineConfig(*tiny_same, cpu_binding="both")
