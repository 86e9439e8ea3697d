"""Lockstep under adversarial schedules: the real plugins and driver on two simulated engines (seconds per run).

Every run checks: identical token streams on both engines (the driver verifies them; a
mismatch would fail the sample as ``diverged``), records equal to a recomputation from the
fixed logits, no timeouts, and no slot left held once the engines are idle.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dual_sampling.protocol import SESSION_PREFIX, Bell, Header, SessionLayout, Slot, SyncSession, Writer
from dual_sampling.sampling import RowSampling
from dual_sampling.text import decode
from processors import TeacherSyncLogitsProcessor
from processors.base import TrackedRow
from tests.sim_engines import (
    VOCAB,
    Adversity,
    SimEnginePair,
    check_records,
    make_requests,
    run_simulation,
    sim_configs,
    sim_scheduler,
    sim_tokenizer,
)


def assert_clean(run, *, allow_errors: frozenset = frozenset(), engine_aborts: bool = False) -> None:
    """Every sample completed (or was aborted/cancelled) with correct records; nothing leaked or timed out."""
    assert run.leaked_slots == []
    assert run.stats["teacher_timeouts"] == run.stats["theta_timeouts"] == 0
    for index, sample in enumerate(run.samples):
        if sample is None:
            continue  # the caller walked away
        if sample.error is not None:
            assert sample.error.split(" at ")[0] in allow_errors, (index, sample.error)
            continue
        assert sample.teacher_token_ids == sample.theta_token_ids == sample.token_ids
        if sample.finish_reason == "abort" and not engine_aborts:
            assert index in run.aborted
        check_records(sample, run.requests[index])


@pytest.mark.parametrize("seed", range(4))
def test_long_teacher_prompts_and_short_theta_prompts_stay_in_lockstep(seed):
    # One engine alone would admit one long teacher prompt per step but many short theta
    # prompts; deliveries to the teacher lag by up to 30 ms. The leader admits for both.
    run = run_simulation(seed, count=24, max_num_seqs=4, adversity=Adversity(delay_s={"teacher": 0.03, "theta": 0.0}))
    assert_clean(run)
    assert all(s.finish_reason in ("stop", "length") for s in run.samples)
    assert run.stats["split_steps"] == 0 and run.stats["follower_diverged"] == 0
    assert run.stats["leader_admitted"] == 24


def test_theta_deliveries_late_and_many_seats():
    run = run_simulation(
        7, count=30, max_num_seqs=8, adversity=Adversity(delay_s={"teacher": 0.0, "theta": 0.05}), budget=200
    )
    assert_clean(run)
    assert run.stats["split_steps"] == 0


def test_stop_strings_end_both_engines_at_the_same_token_after_min_tokens():
    tokenizer = sim_tokenizer()
    stops = ("5", "AB", "%")
    run = run_simulation(
        3,
        count=30,
        max_num_seqs=4,
        stops=stops,
        min_tokens=3,
        adversity=Adversity(delay_s={"teacher": 0.01, "theta": 0.02}),
    )
    assert_clean(run)
    by_string = [s for s in run.samples if isinstance(s.stop_reason, str)]
    assert len(by_string) >= 5, "the stop strings should end several samples"
    for s in run.samples:
        ids = s.token_ids
        # Independent oracle: the first prefix (of at least min_tokens) whose last token completes a stop string.
        ends = [
            n
            for n in range(3, len(ids) + 1)
            for x in stops
            if decode(tokenizer, ids[:n]).rfind(x) + len(x) > len(decode(tokenizer, ids[: n - 1]))
            and x in decode(tokenizer, ids[:n])
        ]
        if isinstance(s.stop_reason, str):
            assert len(ids) == min(ends), (ids, ends)
            # The text stops right before an occurrence of that stop string which the last token completes.
            full, before = decode(tokenizer, ids), decode(tokenizer, ids[:-1])
            assert full.startswith(s.text) and full[len(s.text) :].startswith(s.stop_reason)
            assert len(s.text) + len(s.stop_reason) > len(before)
        else:
            # No stop string completed within the sample, unless at its last token, where the stop token
            # or max_tokens (checked first, as in vLLM) ended it.
            assert not ends or min(ends) == len(ids), (ids, ends)
            expected = decode(tokenizer, ids[:-1] if s.finish_reason == "stop" else ids)
            assert s.text == expected


def test_aborts_while_queued_in_prefill_and_in_decode_end_only_their_request():
    run = run_simulation(
        11,
        count=40,
        max_num_seqs=4,
        abort_rate=0.5,
        act_within_s=0.05,
        adversity=Adversity(delay_s={"teacher": 0.02, "theta": 0.02}),
    )
    assert_clean(run)
    aborted = [i for i, s in enumerate(run.samples) if s.finish_reason == "abort"]
    assert len(aborted) >= 5 and set(aborted) <= run.aborted
    assert any(not s.token_ids for s in run.samples if s.finish_reason == "abort"), "no abort caught a queued request"
    assert any(s.token_ids for s in run.samples if s.finish_reason == "abort"), "no abort caught a running request"
    # Every request nobody aborted completed; an aborted one either ended by the abort or finished first.
    assert all(s.finish_reason in ("stop", "length") for i, s in enumerate(run.samples) if i not in run.aborted)


def test_callers_walking_away_free_their_slots():
    run = run_simulation(12, count=30, max_num_seqs=4, cancel_rate=0.4, slots=6)
    assert_clean(run)
    assert sum(s is None for s in run.samples) >= 5
    assert sum(s is not None and s.finish_reason in ("stop", "length") for s in run.samples) >= 10


def test_vllm_aborts_reaching_one_engine_become_lockstep_aborts():
    run = run_simulation(
        13,
        count=40,
        max_num_seqs=4,
        adversity=Adversity(one_sided_abort_rate=0.4, delay_s={"teacher": 0.01, "theta": 0.03}),
    )
    assert_clean(run, engine_aborts=True)
    ended = [s for s in run.samples if s.finish_reason == "abort"]
    assert len(ended) >= 3 and all(s.teacher_token_ids == s.theta_token_ids for s in ended)


def test_a_preemption_attempt_fails_its_request_alone():
    # Theta's KV cache holds 4 usable blocks of 16 tokens, less than 4 seats need: vLLM would preempt a
    # running request (refused: it fails as "preempted") or fail to admit a planned one (it fails as
    # "diverged"). Start-up refuses such a cache on real engines; here the refusal paths run.
    run = run_simulation(14, count=16, max_num_seqs=4, adversity=Adversity(kv_blocks={"theta": 5}))
    assert_clean(run, allow_errors=frozenset({"preempted", "diverged"}))
    errors = [s.error for s in run.samples if s.error]
    assert any(e.startswith("preempted") for e in errors)
    assert sum(s.error is None for s in run.samples) >= 4


@pytest.mark.parametrize("side", ["theta", "teacher"])
def test_nan_logits_fail_only_their_request_with_a_named_error(side):
    run0 = run_simulation(5, count=16, max_num_seqs=4)
    nan = frozenset(s.seed for s in run0.samples[:8] if len(s.token_ids) > 2)
    run = run_simulation(5, count=16, max_num_seqs=4, adversity=Adversity(nan_seeds=nan, nan_side=side))
    assert_clean(run, allow_errors=frozenset({"bad_logits"}))
    failed = {s.seed for s in run.samples if s.error}
    assert failed == nan and all(s.error == "bad_logits at step 2" for s in run.samples if s.error)
    assert all(s.finish_reason == "error" and s.alpha == [] for s in run.samples if s.error)  # no records to train on


def test_an_engine_emitting_another_token_fails_that_sample_as_diverged():
    # A broken engine (it ignores the forced logits once): the driver's three-stream check catches it.
    run0 = run_simulation(8, count=12, max_num_seqs=4)
    wrong = frozenset(s.seed for s in run0.samples[:6] if len(s.token_ids) > 2)
    run = run_simulation(8, count=12, max_num_seqs=4, adversity=Adversity(wrong_token_seeds=wrong))
    failed = {s.seed: s for s in run.samples if s.error}
    assert set(failed) == wrong and run.leaked_slots == []
    for s in failed.values():
        assert s.error == "diverged at step 1" and s.finish_reason == "error" and s.theta_token_ids != s.token_ids
    for s, request in zip(run.samples, run.requests):
        if s.error is None:
            check_records(s, request)


def test_a_stalled_engine_fails_its_requests_and_later_ones_complete():
    # Theta stops stepping for 2.5 s (from 20 ms in, with requests running); sync_timeout is 1 s.
    run = run_simulation(6, count=24, max_num_seqs=4, sync_timeout=1.0, adversity=Adversity(stall=("theta", 0.02, 2.5)))
    assert run.leaked_slots == []
    errors = [s.error for s in run.samples if s.error]
    assert errors and all(e.split(" at ")[0] in ("sync_timeout", "diverged") for e in errors)
    assert any(e.startswith("sync_timeout") for e in errors)
    assert sum(s.error is None for s in run.samples) >= 4
    for s, request in zip(run.samples, run.requests):
        if s.error is None:
            check_records(s, request)


def test_engines_that_stop_answering_fail_every_request_running_or_queued(monkeypatch):
    """Once both engines stop stepping, the watch closes them; no caller may wait on their streams forever."""
    import dual_sampling.scheduler as driver
    from dual_sampling.scheduler import SyncError

    monkeypatch.setattr(driver, "_STALL_GRACE_S", 0.5)
    rng = random.Random(0)
    requests = make_requests(rng, 5, 96, (), 0)  # 2 hold the slots, 3 wait for one
    scheduler = sim_scheduler(rng, Adversity(stall=("both", 0.0, 1000.0)), 2, 96, sync_timeout=0.5)

    async def one(request):
        try:
            async for _ in scheduler.stream(request):
                pass
        except SyncError as exc:
            return str(exc)
        return "no error"

    async def main():
        return await asyncio.gather(*(one(r) for r in requests))

    try:
        start = time.monotonic()
        errors = scheduler.call(main(), timeout=30)
        assert time.monotonic() - start < 10
        assert all(e.startswith("neither engine served a row") for e in errors), errors
        later = scheduler.call(main(), timeout=30)  # later requests are refused, with the same reason
        assert all(e.startswith("neither engine served a row") for e in later), later
    finally:
        scheduler.close()


def test_engines_that_compute_without_serving_rows_are_not_a_stall(monkeypatch):
    """A long prefill serves no row for minutes; while the engines' processes compute, the watch must wait."""
    import dual_sampling.scheduler as driver

    monkeypatch.setattr(driver, "_STALL_GRACE_S", -9.0)  # with sync_timeout 10: a stall after 1 s without progress
    monkeypatch.setattr(SimEnginePair, "worker_cpu_seconds", lambda self: time.monotonic())  # one core, busy
    run = run_simulation(3, count=6, max_num_seqs=2, sync_timeout=10.0, adversity=Adversity(stall=("both", 0.05, 3.0)))
    assert [s.error for s in run.samples] == [None] * 6
    assert run.leaked_slots == []
    for s, request in zip(run.samples, run.requests):
        check_records(s, request)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(
    seed=st.integers(0, 10_000),
    max_num_seqs=st.integers(1, 6),
    count=st.integers(1, 20),
    abort_rate=st.sampled_from([0.0, 0.3]),
    teacher_delay=st.sampled_from([0.0, 0.02]),
    theta_delay=st.sampled_from([0.0, 0.02]),
    one_sided=st.sampled_from([0.0, 0.2]),
)
def test_property_every_request_completes_or_is_aborted(
    seed, max_num_seqs, count, abort_rate, teacher_delay, theta_delay, one_sided
):
    run = run_simulation(
        seed,
        count=count,
        max_num_seqs=max_num_seqs,
        abort_rate=abort_rate,
        stops=("7",),
        adversity=Adversity(delay_s={"teacher": teacher_delay, "theta": theta_delay}, one_sided_abort_rate=one_sided),
    )
    assert_clean(run, engine_aborts=one_sided > 0)
    assert all(s.finish_reason in ("stop", "length", "abort") for s in run.samples)
    assert run.stats["follower_diverged"] == 0


def test_no_session_file_left_behind():
    before = {f for f in os.listdir("/dev/shm") if f.startswith(SESSION_PREFIX)}
    run_simulation(0, count=3, max_num_seqs=2)
    assert {f for f in os.listdir("/dev/shm") if f.startswith(SESSION_PREFIX)} <= before


def test_teacher_waits_out_a_theta_publication_it_saw_half_of():
    """A scan that overlaps theta's stores sees part of a step; the teacher must not decide that part alone."""
    session = SyncSession.create(SessionLayout(vocab=VOCAB, slots=2, max_steps=8, plan_width=2))
    try:
        config = sim_configs(2, 96, 96, sync_timeout=10.0)["teacher"]
        config.additional_config["dual_sampling"]["session"] = session.name
        teacher = TeacherSyncLogitsProcessor(config, torch.device("cpu"), False)
        batch = []
        for slot in (0, 1):
            session.open_slot(slot, key=slot + 1, teacher_prompt_len=3, theta_prompt_len=3)
            session.theta_logprobs[slot] = np.log(np.full(VOCAB, 1.0 / VOCAB, dtype=np.float32))
            batch.append((slot, TrackedRow(slot, slot + 1, [], RowSampling(seed=slot))))
        logits = torch.zeros(2, VOCAB)
        decided: dict = {}

        # Theta is mid-publication: one step word stored, the sequence word odd.
        session.header[Header.THETA_PUBLICATIONS] = 1
        session.control[0, Slot.THETA_STEP] = 0
        waiting, wait = threading.Event(), teacher.wait

        def noted_wait(*args):
            waiting.set()
            return wait(*args)

        teacher.wait = noted_wait
        worker = threading.Thread(target=lambda: decided.update(teacher.synchronise(logits, batch)))
        worker.start()
        assert waiting.wait(timeout=10), "the teacher never scanned"
        worker.join(timeout=0.3)
        assert worker.is_alive() and int(session.control[0, Slot.TEACHER_STEP]) == -1, "decided half a step"

        # Theta finishes: the teacher decides both rows in one round.
        session.control[1, Slot.THETA_STEP] = 0
        session.header[Header.THETA_PUBLICATIONS] = 2
        session.ring(Bell.THETA_ROWS, Writer.THETA_PROCESSOR)
        worker.join(timeout=10)
        assert not worker.is_alive() and set(decided) == {0, 1}
        assert session.statistics()["split_steps"] == 0
        assert [int(session.control[s, Slot.TEACHER_STEP]) for s in (0, 1)] == [0, 0]

        # Control: a genuinely partial step (no publication in progress) is decided at once, row by row.
        for row in (r for _, r in batch):
            row.output_token_ids.append(int(session.control[row.slot, Slot.TOKEN]))
        session.control[0, Slot.THETA_STEP] = 1
        session.header[Header.THETA_PUBLICATIONS] = 4
        worker = threading.Thread(target=lambda: decided.update(teacher.synchronise(logits, batch)))
        worker.start()
        deadline = time.monotonic() + 5
        while int(session.control[0, Slot.TEACHER_STEP]) != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert int(session.control[0, Slot.TEACHER_STEP]) == 1 and worker.is_alive()
        session.control[1, Slot.THETA_STEP] = 1
        session.ring(Bell.THETA_ROWS, Writer.THETA_PROCESSOR)
        worker.join(timeout=10)
        assert not worker.is_alive() and session.statistics()["split_steps"] == 1
    finally:
        session.close()


def test_row_gatherer_returns_the_selected_rows_as_a_view_or_in_its_kept_buffer():
    from processors.teacher import RowGatherer

    vocab = 300
    source = torch.randn(8, vocab)
    gather = RowGatherer(vocab)
    consecutive = gather(source, [2, 3, 4])
    assert torch.equal(consecutive, source[2:5]) and consecutive.data_ptr() == source[2].data_ptr(), "a view"
    permuted = gather(source, [5, 1, 6])
    assert torch.equal(permuted, source[[5, 1, 6]])
    buffer = permuted.data_ptr()
    assert gather(source, [7, 0]).data_ptr() == buffer, "the buffer is kept, not reallocated"
    padded = torch.randn(8, vocab + 64)  # logits wider than the shared vocabulary: never a view
    assert torch.equal(gather(padded, [3, 4]), padded[3:5, :vocab])
    assert torch.equal(gather(padded, [6, 2, 0]), padded[[6, 2, 0], :vocab])
    half = source.to(torch.bfloat16)  # other dtypes: a plain gather, converted
    assert torch.equal(gather(half, [1, 3]), half[[1, 3]].float())
