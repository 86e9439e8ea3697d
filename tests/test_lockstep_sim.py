"""Lockstep under adversarial schedules: the real plugins and driver on two simulated engines (seconds per run).

Every run checks: identical token streams on both engines (the driver verifies them; a
mismatch would fail the sample as ``diverged``), records equal to a recomputation from the
fixed logits, no timeouts, and no slot left held once the engines are idle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import random
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dual_sampling.decision.pipeline import RowSampling
from dual_sampling.lockstep import (
    Bell,
    ErrorCode,
    ModelSlot,
    ModelWord,
    SessionLayout,
    Slot,
    SyncError,
    SyncSession,
    Writer,
    slot_word,
)
from dual_sampling.testing import tiny_models
from dual_sampling.testing.sim_engines import (
    MOMENTS,
    VOCAB,
    Adversity,
    SimEnginePair,
    check_records,
    join_session,
    make_requests,
    run_simulation,
    sim_configs,
    sim_driver,
    sim_tokenizer,
)
from dual_sampling.text import decode, engine_tokenizer
from processors import LeaderLogitsProcessor
from processors.base import TrackedRow
from tests import processes
from tests.tolerances import ALPHA_TWO_SOLVES_ATOL, TWO_NORMALISATIONS_ATOL

THETA_ROW_STEP = slot_word(ModelSlot.ROW_STEP, 1)
"""The control word where the pair's follower (θ, roster position 1) announces its row's step."""


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
        check_records(sample, run.requests[index], run.token_steps)


def assert_same_batches(run, busy: bool = True, refused: frozenset = frozenset()) -> None:
    """Lockstep seen from outside the plugins: at every step both engines' vLLM schedulers ran the same requests.

    The logs are each scheduler's own output (request ids and tokens per step), written by the simulated engine
    loops, not by the plugins under test. Token counts differ only where prefill does: the prompts differ.
    ``refused``: requests that one side's vLLM refused to admit or wanted to preempt (they fail alone, on one side
    first); they are left out of both logs, and steps that held nothing else with them."""
    teacher, theta = (
        [b for b in ([x for x in a if x[0] not in refused] for a in run.batches[side]) if b]
        for side in ("teacher", "theta")
    )
    assert len(teacher) == len(theta), f"{len(teacher)} teacher steps against {len(theta)} theta steps"
    for step, (a, b) in enumerate(zip(teacher, theta)):
        assert [rid for rid, _ in a] == [rid for rid, _ in b], f"step {step}: teacher ran {a}, theta ran {b}"
    if busy:  # the run had something to compare: many steps, several of them decode steps alone
        # How many steps mix prefills in depends on when requests arrive, which a loaded machine moves (one run
        # under load saw 14 decode steps of 43): a majority is not asked for.
        decode = sum(all(n == 1 for _, n in a) for a in teacher)
        assert len(teacher) > 10 and decode >= 5, (len(teacher), decode)


def stream_errors(driver, requests, timeout: float) -> list[str]:
    """Stream every request at once; each one's SyncError message, or "no error"."""

    async def one(request):
        try:
            async for _ in driver.stream(request):
                pass
        except SyncError as exc:
            return str(exc)
        return "no error"

    async def main():
        return await asyncio.gather(*(one(r) for r in requests))

    return driver.call(main(), timeout=timeout)


@pytest.mark.parametrize("seed", range(4))
def test_long_teacher_prompts_and_short_theta_prompts_stay_in_lockstep(seed):
    # One engine alone would admit one long teacher prompt per step but many short theta
    # prompts; deliveries to the teacher lag by up to 30 ms. The leader admits for both.
    run = run_simulation(seed, count=24, max_num_seqs=4, adversity=Adversity(delay_turns={"teacher": 3, "theta": 0}))
    assert_clean(run)
    assert all(s.finish_reason in ("stop", "length") for s in run.samples)
    assert run.stats["split_steps"] == 0 and run.stats["follower_diverged"] == 0
    assert run.stats["leader_admitted"] == 24
    assert_same_batches(run)


@pytest.mark.parametrize("seed", range(3))
def test_a_hold_with_keep_mid_flight_keeps_lockstep_and_every_record(seed):
    # pause(mode="keep") each time 12 more deltas have streamed, while deliveries to each side lag (so a follower may
    # be a plan behind when a hold comes), stop strings end requests on the leader's word, and some requests are
    # aborted: the simulated engines complete the pause as vLLM's do (once idle, stepping meanwhile while they have
    # ended requests to report; then their KV caches reset, their running requests preempted). Every held request
    # goes on at the same step on both sides after the resume, and its records match the oracle.
    run = run_simulation(
        seed,
        count=16,
        max_num_seqs=4,
        adversity=Adversity(delay_turns={"teacher": 2, "theta": 2}),
        stops=("ab", "q"),
        abort_rate=0.2,
        hold=(12, 0.02),
    )
    assert len(run.held) >= 3 and max(run.held) > 0, run.held
    assert_clean(run)
    assert run.stats["split_steps"] == 0 and run.stats["follower_diverged"] == 0
    assert_same_batches(run)


def test_a_theta_row_computed_out_of_phase_fails_the_record_oracle():
    """Positive control of the record oracle: a runner one step out of phase on theta's side is caught.

    The plugins cannot see it (theta publishes a finite row each step; tokens agree), which is why the simulated
    logits depend on the engine step and :func:`check_records` recomputes both rows at the teacher's step."""
    run = run_simulation(0, count=12, max_num_seqs=4, min_tokens=1, adversity=Adversity(theta_step_offset=1))
    completed = [(s, r) for s, r in zip(run.samples, run.requests) if s.error is None]
    assert len(completed) == 12 and run.stats["follower_diverged"] == 0
    for sample, request in completed:
        with pytest.raises(AssertionError, match="stale theta row|alpha"):
            check_records(sample, request, run.token_steps)


def test_the_batch_observer_sees_a_request_missing_from_one_side():
    """Positive control of :func:`assert_same_batches`: one request left out of one theta step, or one step dropped,
    fails it (the logs of a clean run pass)."""
    run = run_simulation(1, count=12, max_num_seqs=4)
    assert_same_batches(run)
    theta = run.batches["theta"]
    step = next(i for i, batch in enumerate(theta) if len(batch) > 1)
    left_out = [*theta[:step], theta[step][1:], *theta[step + 1 :]]
    dropped = theta[:step] + theta[step + 1 :]
    for mutated, message in ((left_out, rf"step {step}: teacher ran"), (dropped, "teacher steps against")):
        with pytest.raises(AssertionError, match=message):
            assert_same_batches(dataclasses.replace(run, batches={"teacher": run.batches["teacher"], "theta": mutated}))


def test_theta_deliveries_late_and_many_seats():
    run = run_simulation(
        7, count=30, max_num_seqs=8, adversity=Adversity(delay_turns={"teacher": 0, "theta": 5}), budget=200
    )
    assert_clean(run)
    assert run.stats["split_steps"] == 0
    assert_same_batches(run)


def test_stop_strings_end_both_engines_at_the_same_token_after_min_tokens():
    tokenizer = sim_tokenizer()
    # Four one-character stops (of the 47 characters ids 17 to 63 decode to) and a two-character one: about half the
    # samples end by a stop string, whatever the schedule (the simulated tokens depend on the engine step).
    stops = ("5", "AB", "%", "=", "K")
    run = run_simulation(
        3,
        count=30,
        max_num_seqs=4,
        stops=stops,
        min_tokens=3,
        adversity=Adversity(delay_turns={"teacher": 1, "theta": 2}),
    )
    assert_clean(run)
    assert_same_batches(run, busy=False)  # a stop string ends a request at the same step on both sides
    by_string = [s for s in run.samples if isinstance(s.stop_reason, str)]
    assert len(by_string) >= 5, f"only {len(by_string)} of 30 samples ended by a stop string"
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
    # Each abort acts by its request's state: waiting for a slot, while the teacher engine computes its prefill (the
    # abort lands inside that step), or after a drawn number of streamed tokens.
    run = run_simulation(
        11, count=40, max_num_seqs=4, abort_rate=0.5, adversity=Adversity(delay_turns={"teacher": 2, "theta": 2})
    )
    assert_clean(run)
    assert_same_batches(run)
    assert {run.acted[i] for i in run.aborted} == set(MOMENTS), run.acted
    for i in run.aborted:
        sample = run.samples[i]
        if run.acted[i] == "queued":  # it never reached an engine
            assert sample.finish_reason == "abort" and sample.token_ids == []
        elif run.acted[i] == "prefill":  # at most the token its prefill computed
            assert len(sample.token_ids) <= 1, (i, sample.token_ids)
            # The abort ends the request at the next step boundary; the token its prefill step drew may end it first
            # (a stop id, or its only allowed token), as in CI once (seed 11, request 21 drew its stop id 27).
            request = run.requests[i]
            ended_first = sample.token_ids and (
                sample.token_ids[-1] in request.sampling.stop_token_ids or request.max_tokens == 1
            )
            assert sample.finish_reason == "abort" or (
                ended_first and sample.finish_reason == ("length" if request.max_tokens == 1 else "stop")
            ), (i, sample.finish_reason, sample.token_ids)
    # Every request nobody aborted completed; one aborted in decode ended by the abort or finished first.
    assert all(s.finish_reason in ("stop", "length") for i, s in enumerate(run.samples) if i not in run.aborted)


def test_callers_walking_away_free_their_slots():
    run = run_simulation(12, count=30, max_num_seqs=4, cancel_rate=0.4, slots=6)
    assert_clean(run)
    assert_same_batches(run, busy=False)
    assert set(run.acted.values()) == set(MOMENTS), run.acted
    assert all(run.samples[i] is None for i in run.acted if run.acted[i] != "decode")
    assert sum(s is not None and s.finish_reason in ("stop", "length") for s in run.samples) >= 10


def test_vllm_aborts_reaching_one_engine_become_lockstep_aborts():
    run = run_simulation(
        13,
        count=40,
        max_num_seqs=4,
        adversity=Adversity(one_sided_abort_rate=0.4, delay_turns={"teacher": 1, "theta": 3}),
    )
    assert_clean(run, engine_aborts=True)
    assert_same_batches(run)
    ended = [s for s in run.samples if s.finish_reason == "abort"]
    assert len(ended) >= 3 and all(s.teacher_token_ids == s.theta_token_ids for s in ended)


@pytest.mark.parametrize("side", ["teacher", "theta"])
def test_prefix_cache_hits_on_one_side_only_keep_lockstep(side):
    # That side's prompts share 48 tokens (3 blocks) and only its vLLM caches prefixes: its prefills schedule fewer
    # tokens than the prompt, the other side's the whole prompt. The leader plans as if nothing were cached.
    run = run_simulation(
        15, count=16, max_num_seqs=4, shared_prefix={side: 48}, adversity=Adversity(prefix_caching=frozenset({side}))
    )
    assert_clean(run)
    assert_same_batches(run)
    other = "theta" if side == "teacher" else "teacher"
    first = {s: {} for s in (side, other)}
    for s in first:
        for batch in run.batches[s]:
            for rid, tokens in batch:
                first[s].setdefault(rid, tokens)
    length = lambda s, rid: len(getattr(run.requests[int(rid[1:])], f"{s}_prompt_ids"))
    hits = [rid for rid, n in first[side].items() if n < length(side, rid)]
    assert len(hits) >= 8, f"{len(hits)} prefix cache hits on the {side} side"
    assert all(n == length(other, rid) for rid, n in first[other].items())


def test_contexts_that_fill_max_model_len_end_on_both_sides_at_the_same_token():
    # Half the requests leave 1 to 4 tokens of room on one side or the other; their max_tokens is that room.
    run = run_simulation(16, count=24, max_num_seqs=4, near_full=0.5, min_tokens=1)
    assert_clean(run)
    assert_same_batches(run, busy=False)  # most steps are prefills here
    full = 0
    for sample, request in zip(run.samples, run.requests):
        longest = max(len(request.teacher_prompt_ids), len(request.theta_prompt_ids))
        assert longest + len(sample.token_ids) <= 96
        if longest + request.max_tokens == 96 and sample.finish_reason == "length":
            full += 1
            assert longest + len(sample.token_ids) == 96
    assert full >= 4, f"only {full} samples filled max_model_len"


@pytest.mark.parametrize("side", ["theta", "teacher"])
def test_a_preemption_attempt_fails_its_request_alone(side):
    # One side's KV cache holds 4 usable blocks of 16 tokens, less than 4 seats need: vLLM would preempt a
    # running request (refused: it fails as "preempted") or fail to admit a planned one (it fails as
    # "diverged"). Start-up refuses such a cache on real engines; here the refusal paths run, on either side.
    run = run_simulation(14, count=16, max_num_seqs=4, adversity=Adversity(kv_blocks={side: 5}))
    assert_clean(run, allow_errors=frozenset({"preempted", "diverged"}))
    errors = [s.error for s in run.samples if s.error]
    assert any(e.startswith("preempted") for e in errors)
    assert sum(s.error is None for s in run.samples) >= 4


@pytest.mark.parametrize("side", ["theta", "teacher"])
def test_nan_logits_fail_only_their_request_with_a_named_error(side):
    # min_tokens=3: every sample reaches the NaN at step 2 (its length would otherwise depend on the schedule, since the
    # simulated logits depend on the engine step).
    seeds = [r.sampling.seed for r in make_requests(random.Random(5), 16, 96, (), 3)]
    nan = frozenset(seeds[:8])
    run = run_simulation(5, count=16, max_num_seqs=4, min_tokens=3, adversity=Adversity(nan_seeds=nan, nan_side=side))
    assert_clean(run, allow_errors=frozenset({"bad_logits"}))
    assert_same_batches(run, busy=False)  # a failed row ends its request on both sides at that step
    failed = {s.seed for s in run.samples if s.error}
    assert failed == nan and all(s.error == "bad_logits at step 2" for s in run.samples if s.error)
    assert all(s.finish_reason == "error" and s.alpha == [] for s in run.samples if s.error)  # no records to train on


def test_an_engine_emitting_another_token_fails_that_sample_as_diverged():
    # A broken engine (it ignores the forced logits once): the driver's three-stream check catches it.
    seeds = [r.sampling.seed for r in make_requests(random.Random(8), 12, 96, (), 3)]  # min_tokens=3: all reach step 1
    wrong = frozenset(seeds[:6])
    run = run_simulation(8, count=12, max_num_seqs=4, min_tokens=3, adversity=Adversity(wrong_token_seeds=wrong))
    failed = {s.seed: s for s in run.samples if s.error}
    assert set(failed) == wrong and run.leaked_slots == []
    for s in failed.values():
        assert s.error == "diverged at step 1" and s.finish_reason == "error" and s.theta_token_ids != s.token_ids
    for s, request in zip(run.samples, run.requests):
        if s.error is None:
            check_records(s, request, run.token_steps)


def test_a_stalled_engine_fails_its_requests_and_later_ones_complete():
    # Theta stops stepping after its first step (requests are running) for 250 turns of 10 ms; sync_timeout is 1 s.
    run = run_simulation(6, count=24, max_num_seqs=4, sync_timeout=1.0, adversity=Adversity(stall=("theta", 1, 250)))
    assert run.leaked_slots == []
    errors = [s.error for s in run.samples if s.error]
    assert errors and all(e.split(" at ")[0] in ("sync_timeout", "diverged") for e in errors)
    assert any(e.startswith("sync_timeout") for e in errors)
    assert sum(s.error is None for s in run.samples) >= 4
    for s, request in zip(run.samples, run.requests):
        if s.error is None:
            check_records(s, request, run.token_steps)


def test_engines_that_stop_answering_fail_every_request_running_or_queued(monkeypatch):
    """Once both engines stop stepping, the watch closes them; no caller may wait on their streams forever."""
    import dual_sampling.driver.health as health

    monkeypatch.setattr(health, "STALL_GRACE_S", 0.5)
    rng = random.Random(0)
    requests = make_requests(rng, 5, 96, (), 0)  # 2 hold the slots, 3 wait for one
    driver = sim_driver(rng, Adversity(stall=("both", 0, 10**9)), 2, 96, sync_timeout=0.5)

    try:
        errors = stream_errors(driver, requests, timeout=30)  # the watch's 0.5 s grace, or a hang failing at 30 s
        assert all(e.startswith("neither engine served a row") for e in errors), errors
        later = stream_errors(driver, requests, timeout=30)  # later requests are refused, with the same reason
        assert all(e.startswith("neither engine served a row") for e in later), later
    finally:
        driver.close()


def test_engines_that_compute_without_serving_rows_are_not_a_stall(monkeypatch):
    """A long prefill serves no row for minutes; while the engines' processes compute, the watch must wait."""
    import dual_sampling.driver.health as health

    monkeypatch.setattr(health, "STALL_GRACE_S", -9.0)  # with sync_timeout 10: a stall after 1 s without progress
    monkeypatch.setattr(SimEnginePair, "worker_cpu_seconds", lambda self: time.monotonic())  # one core, busy
    run = run_simulation(3, count=6, max_num_seqs=2, sync_timeout=10.0, adversity=Adversity(stall=("both", 1, 300)))
    assert [s.error for s in run.samples] == [None] * 6
    assert run.leaked_slots == []
    for s, request in zip(run.samples, run.requests):
        check_records(s, request, run.token_steps)


SIM_EXAMPLES = 40 if os.environ.get("HYPOTHESIS_PROFILE") == "explore" else 10
"""Simulated runs per property test (a second or more each): 10 fixed examples in CI, 40 new ones to explore."""


# Derandomized or not by the profile (conftest): HYPOTHESIS_PROFILE=explore searches new examples here too. A run's
# adversity is a function of its drawn data (delays and stalls count turns of the engine loops, not seconds), so a
# failing example replays it; the interleaving of the two engine threads is still the machine's.
@settings(max_examples=SIM_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    max_num_seqs=st.integers(1, 6),
    count=st.integers(1, 20),
    abort_rate=st.sampled_from([0.0, 0.3]),
    teacher_delay=st.integers(0, 4),
    theta_delay=st.integers(0, 4),
    one_sided=st.sampled_from([0.0, 0.2]),
    budget=st.sampled_from([None, 120, 200]),
    min_tokens=st.sampled_from([0, 3]),
    caching=st.sampled_from([(), ("teacher",), ("theta",), ("teacher", "theta")]),
    near_full=st.sampled_from([0.0, 0.3]),
    cancel_rate=st.sampled_from([0.0, 0.3]),
    stops=st.sampled_from([(), ("7",), ("7", "ab")]),
    short_kv=st.sampled_from([None, "teacher", "theta"]),
    stall=st.one_of(st.none(), st.tuples(st.sampled_from(["teacher", "theta", "both"]), st.integers(0, 8))),
)
def test_property_every_request_completes_or_is_aborted(
    seed,
    max_num_seqs,
    count,
    abort_rate,
    teacher_delay,
    theta_delay,
    one_sided,
    budget,
    min_tokens,
    caching,
    near_full,
    cancel_rate,
    stops,
    short_kv,
    stall,
):
    # A short KV cache on one side: 7 blocks of 16 tokens, one seat at max_model_len (96) and vLLM's null block, the
    # least vLLM's own start-up allows (with less, a prompt near max_model_len would wait forever on any engine). vLLM
    # there would preempt or fail to admit, which fails those requests alone (as in
    # test_a_preemption_attempt_fails_its_request_alone). A stall of 20 turns (0.2 s) after a drawn number of steps is
    # far below sync_timeout (10 s): nothing may fail for it.
    run = run_simulation(
        seed,
        count=count,
        max_num_seqs=max_num_seqs,
        abort_rate=abort_rate,
        cancel_rate=cancel_rate,
        stops=stops,
        budget=budget,
        min_tokens=min_tokens,
        shared_prefix={side: 32 for side in caching},
        near_full=near_full,
        adversity=Adversity(
            delay_turns={"teacher": teacher_delay, "theta": theta_delay},
            one_sided_abort_rate=one_sided,
            prefix_caching=frozenset(caching),
            kv_blocks={short_kv: 7} if short_kv else {},
            stall=(*stall, 20) if stall else None,
        ),
    )
    refusals = frozenset({"preempted", "diverged"}) if short_kv else frozenset()
    assert_clean(run, allow_errors=refusals, engine_aborts=one_sided > 0)
    assert all(s is None or s.finish_reason in ("stop", "length", "abort", "error") for s in run.samples)
    assert all(s.finish_reason != "error" or s.error for s in run.samples if s is not None)
    assert all(s is not None for i, s in enumerate(run.samples) if i not in run.acted)  # only a cancel drops one
    refused = frozenset(f"r{i}" for i, s in enumerate(run.samples) if s is not None and s.error)
    assert run.stats["follower_diverged"] <= len(refused)
    assert_same_batches(run, busy=False, refused=refused)


def test_no_session_file_left_behind():
    before = processes.our_shm_files()
    run_simulation(0, count=3, max_num_seqs=2)
    assert processes.our_shm_files() <= before


def test_teacher_waits_out_a_theta_publication_it_saw_half_of():
    """A scan that overlaps theta's stores sees part of a step; the teacher must not decide that part alone."""
    session = SyncSession.create(SessionLayout(vocab=VOCAB, slots=2, max_steps=8, plan_width=2))
    try:
        config = sim_configs(2, 96, 96, sync_timeout=10.0)["teacher"]
        join_session(config, session.name)
        teacher = LeaderLogitsProcessor(config, torch.device("cpu"), False)
        batch = []
        for slot in (0, 1):
            session.open_slot(slot, key=slot + 1, prompt_lens=(3, 3))
            session.follower_logprobs[0][slot] = np.log(np.full(VOCAB, 1.0 / VOCAB, dtype=np.float32))
            batch.append((slot, TrackedRow(slot, slot + 1, [], RowSampling(seed=slot))))
        logits = torch.zeros(2, VOCAB)
        decided: dict = {}

        # Theta is mid-publication: one step word stored, the sequence word odd.
        session.model_words[1, ModelWord.PUBLICATIONS] = 1
        session.control[0, THETA_ROW_STEP] = 0
        waiting, wait = threading.Event(), teacher.wait

        def noted_wait(*args):
            waiting.set()
            return wait(*args)

        teacher.wait = noted_wait
        worker = threading.Thread(target=lambda: decided.update(teacher.synchronise(logits, batch)))
        worker.start()
        assert waiting.wait(timeout=10), "the teacher never scanned"
        worker.join(timeout=0.3)
        assert worker.is_alive() and int(session.control[0, Slot.DECIDED_STEP]) == -1, "decided half a step"

        # Theta finishes: the teacher decides both rows in one round.
        session.control[1, THETA_ROW_STEP] = 0
        session.model_words[1, ModelWord.PUBLICATIONS] = 2
        session.ring(Bell.ROWS, Writer.PROCESSOR.at(1))
        worker.join(timeout=10)
        assert not worker.is_alive() and set(decided) == {0, 1}
        assert session.statistics()["split_steps"] == 0
        assert [int(session.control[s, Slot.DECIDED_STEP]) for s in (0, 1)] == [0, 0]

        # Control: a genuinely partial step (no publication in progress) is decided at once, row by row.
        for row in (r for _, r in batch):
            row.output_token_ids.append(int(session.control[row.slot, Slot.TOKEN]))
        session.control[0, THETA_ROW_STEP] = 1
        session.model_words[1, ModelWord.PUBLICATIONS] = 4
        worker = threading.Thread(target=lambda: decided.update(teacher.synchronise(logits, batch)))
        worker.start()
        deadline = time.monotonic() + 5
        while int(session.control[0, Slot.DECIDED_STEP]) != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert int(session.control[0, Slot.DECIDED_STEP]) == 1 and worker.is_alive()
        session.control[1, THETA_ROW_STEP] = 1
        session.ring(Bell.ROWS, Writer.PROCESSOR.at(1))
        worker.join(timeout=10)
        assert not worker.is_alive() and session.statistics()["split_steps"] == 1
    finally:
        session.close()


def test_row_gatherer_returns_the_selected_rows_as_a_view_or_in_its_kept_buffer():
    from processors.leader import RowGatherer

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


# ---------------------------------------------------------------------- one request's failure stays its own


async def _sample_all(driver, requests) -> list:
    return list(await asyncio.gather(*(driver.sample(r) for r in requests)))


def _processor_with_rows(role: str, settings: list[RowSampling], vocab: int = VOCAB):
    """A real processor of ``role`` on a fresh session, tracking one row per settings at step 0 (slot = batch index)."""
    from types import SimpleNamespace

    from vllm.v1.sample.logits_processor import BatchUpdate

    from processors import FollowerLogitsProcessor

    session = SyncSession.create(SessionLayout(vocab=vocab, slots=len(settings), max_steps=8, plan_width=4))
    config = sim_configs(4, 96, 96, sync_timeout=2.0)[role]
    join_session(config, session.name)
    cls = LeaderLogitsProcessor if role == "teacher" else FollowerLogitsProcessor
    processor = cls(config, torch.device("cpu"), False)
    added = []
    for slot, sampling in enumerate(settings):
        session.open_slot(slot, key=slot + 1, prompt_lens=(3, 3))
        pairing = {"slot": slot, "key": slot + 1, "sampling": sampling.to_dict()}
        added.append((slot, SimpleNamespace(extra_args={"dual_sampling": pairing}), [1, 2, 3], []))
    processor.update_state(BatchUpdate(len(settings), [], added, []))
    return session, processor


def _publish_theta_rows(session, rows: torch.Tensor) -> None:
    """Theta's side of step 0, as its processor publishes it."""
    session.follower_logprobs[0][: rows.shape[0]] = torch.log_softmax(rows, -1).numpy()
    session.control[: rows.shape[0], THETA_ROW_STEP] = 0


def test_a_row_whose_decision_raises_fails_alone_and_the_others_get_their_tokens(caplog):
    """top_k=2**63 overflows torch.tensor inside the decision; that used to kill the EngineCore."""
    settings = [RowSampling(seed=1), RowSampling(seed=2, top_k=2**63), RowSampling(seed=3, temperature=0.7)]
    session, teacher = _processor_with_rows("teacher", settings)
    try:
        g = torch.Generator().manual_seed(0)
        teacher_logits, theta_logits = torch.randn(3, VOCAB, generator=g), torch.randn(3, VOCAB, generator=g)
        _publish_theta_rows(session, theta_logits)
        with caplog.at_level("ERROR"):
            forced = teacher.apply(teacher_logits.clone())
        assert session.error(1) == (ErrorCode.DECISION_ERROR, 0)
        assert next(r for r in caplog.records if r.levelname == "ERROR").exc_info is not None
        assert len([r for r in caplog.records if "slot 1" in r.getMessage()]) == 1, "logged once"
        for slot in (0, 2):  # decided in the same step, as if the bad row had not been there
            assert session.error(slot)[0] == ErrorCode.NONE and int(session.control[slot, Slot.DECIDED_STEP]) == 0
            token = int(session.control[slot, Slot.TOKEN])
            assert torch.isfinite(forced[slot]).sum() == 1 and int(forced[slot].argmax()) == token
            alone = decide_one(teacher, teacher_logits[slot], session.follower_logprobs[0][slot], settings[slot])
            assert token == alone[0]
            # α, log π_t, log π_θ, log q of one row decided in a batch and alone: two float32 computations of each.
            # log q besides moves between the two α by |Δα|·|d(y) − E_q[d]| ≤ |Δα|·2·max |d|.
            got = session.records[slot, 0]
            d = torch.log_softmax(teacher_logits[slot].double(), -1) - torch.from_numpy(
                session.follower_logprobs[0][slot]
            )
            moved = abs(float(got[0]) - alone[1]) * 2 * float(d.abs().max())
            two = TWO_NORMALISATIONS_ATOL
            atol = np.array([ALPHA_TWO_SOLVES_ATOL, two, two, two + moved])
            off = np.abs(got - np.asarray(alone[1:]))
            assert (off <= atol).all(), (slot, off, atol)
        assert torch.isfinite(forced[1]).sum() == 1 and int(forced[1].argmax()) == teacher.rows[1].filler
        assert int(session.control[1, Slot.DECIDED_STEP]) == -1, "no token published for the failed row"
    finally:
        session.close()


def decide_one(teacher, logits: torch.Tensor, theta_logprobs: np.ndarray, sampling: RowSampling) -> list[float]:
    """(token, α, log π_t, log π_θ, log q) of one row decided alone at step 0."""
    from dual_sampling.decision.pipeline import ModelRows, decide

    d = decide(
        ModelRows.pair(
            logits.unsqueeze(0), torch.from_numpy(theta_logprobs.copy()).unsqueeze(0), theta_normalized=True
        ),
        [0],
        [sampling],
        teacher.alpha_computer,
        torch.tensor([0.5]),
    )
    return [t.item() for t in (d.tokens, d.alpha, *d.logp.unbind(-1), d.logq)]


@pytest.mark.parametrize("column", range(4))
def test_a_non_finite_record_fails_its_row_and_is_never_written(monkeypatch, column):
    """α, log π_t, log π_θ or log q not finite: the row fails as non_finite; nothing of it reaches the records."""
    session, teacher = _processor_with_rows("teacher", [RowSampling(seed=s) for s in range(3)])
    try:
        g = torch.Generator().manual_seed(1)
        _publish_theta_rows(session, torch.randn(3, VOCAB, generator=g))
        real = teacher._decide_rows

        def poisoned(*args):
            d = real(*args)
            field = (d.alpha, *d.logp.unbind(-1), d.logq)[column]
            field[1] = (math.nan, math.inf, -math.inf, math.nan)[column]
            return d

        monkeypatch.setattr(teacher, "_decide_rows", poisoned)
        teacher.apply(torch.randn(3, VOCAB, generator=g))
        assert session.error(1) == (ErrorCode.NON_FINITE, 0)
        assert int(session.control[1, Slot.NUM_RECORDS]) == 0 and not session.records[1, 0].any()
        assert int(session.control[1, Slot.DECIDED_STEP]) == -1
        for slot in (0, 2):
            assert session.error(slot)[0] == ErrorCode.NONE and np.isfinite(session.records[slot, 0]).all()
            assert int(session.control[slot, Slot.DECIDED_STEP]) == 0
    finally:
        session.close()


def test_a_theta_publication_that_raises_fails_its_requests_not_the_engine():
    """Theta's logits narrower than the session's rows: storing them raises; the step's requests fail by name."""
    session, theta = _processor_with_rows("theta", [RowSampling(seed=s) for s in range(2)], vocab=VOCAB + 8)
    try:
        forced = theta.apply(torch.randn(2, VOCAB))
        assert [session.error(s) for s in (0, 1)] == [(ErrorCode.DECISION_ERROR, 0)] * 2
        assert int(session.model_words[1, ModelWord.PUBLICATIONS]) % 2 == 0, "a publication left half open"
        assert [int(session.control[s, THETA_ROW_STEP]) for s in (0, 1)] == [-1, -1], "no row announced"
        assert all(int(torch.isfinite(row).sum()) == 1 for row in forced)
    finally:
        session.close()


def test_a_row_channel_read_that_raises_fails_its_requests_not_the_engine(monkeypatch):
    """The teacher cannot read theta's rows (the channel's device failed, say): that step's requests fail by name and
    no token is published for them; the step itself returns (forced rows), so the engine is not stopped."""
    session, teacher = _processor_with_rows("teacher", [RowSampling(seed=s) for s in range(2)])
    try:
        g = torch.Generator().manual_seed(2)
        _publish_theta_rows(session, torch.randn(2, VOCAB, generator=g))
        channel = teacher.row_channels[0]

        def broken(*args):
            raise RuntimeError("the device is gone")

        monkeypatch.setattr(channel, "read", broken)
        forced = teacher.apply(torch.randn(2, VOCAB, generator=g))
        assert [session.error(s) for s in (0, 1)] == [(ErrorCode.DECISION_ERROR, 0)] * 2
        assert [int(session.control[s, Slot.DECIDED_STEP]) for s in (0, 1)] == [-1, -1], "no token published"
        assert [int(row.argmax()) for row in forced] == [teacher.rows[i].filler for i in (0, 1)]
    finally:
        session.close()


def test_a_stop_string_check_that_raises_fails_its_request_and_the_engine_serves_on(monkeypatch):
    """An exception in the leader's per-request work (here its stop-string check) used to kill the EngineCore."""
    from dual_sampling.text import StopStringWatch

    real = StopStringWatch.check

    def check(self, token_ids):
        if "boom" in self.stops:
            raise RuntimeError("this request's stop check breaks")
        return real(self, token_ids)

    monkeypatch.setattr(StopStringWatch, "check", check)
    rng = random.Random(21)
    requests = make_requests(rng, 12, 96, ("zz",), 0)
    for request in requests[::4]:
        request.stop, request.max_tokens = ("boom",), 8  # more than one token: max_tokens is checked first
    driver = sim_driver(rng, Adversity(), 4, 96)
    try:
        samples = driver.call(_sample_all(driver, requests), timeout=120)
        assert driver.failure is None
        for request, sample in zip(requests, samples):
            if request.stop == ("boom",):
                assert sample.error == "decision_error at step 1" and sample.finish_reason == "error"
            else:
                assert sample.error is None and sample.teacher_token_ids == sample.theta_token_ids == sample.token_ids
                check_records(sample, request, driver.engines.cores["teacher"].token_steps)
    finally:
        driver.close()


# ---------------------------------------------------------------------- stop strings: bounded state, bounded work


def _live_watches() -> int:
    import gc

    from dual_sampling.text import StopStringWatch

    gc.collect()
    return sum(isinstance(o, StopStringWatch) for o in gc.get_objects())


def test_stop_string_state_ends_with_its_request_and_no_tokenizer_loads_inside_a_step(monkeypatch):
    """A soak of 60 requests, each with stop strings of its own: the leader keeps no state once they end."""
    import transformers

    rng = random.Random(22)
    requests = make_requests(rng, 60, 96, (), 0)
    for n, request in enumerate(requests):
        request.stop = (f"never{n}", "~" * (n % 7 + 1) + "#")
    driver = sim_driver(rng, Adversity(), 4, 96)

    def no_loading(*args, **kwargs):
        raise AssertionError("a tokenizer was loaded inside an engine step")

    # Every engine-side load must have happened while the engines were built (above), into vLLM's cache (these
    # engines skip vLLM's own tokenizer). Every tokenizer class loads through its base's from_pretrained
    # (AutoTokenizer's and vLLM's cache alike).
    leader = driver.engines.cores["teacher"].scheduler
    assert leader.tokenizer is engine_tokenizer(tiny_models.tiny_pair("same")[0])
    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "from_pretrained", classmethod(no_loading))
    before = _live_watches()
    try:
        samples = driver.call(_sample_all(driver, requests), timeout=120)
        assert [s.error for s in samples] == [None] * 60
        deadline = time.monotonic() + 5  # the engines let go of finished requests at their next step
        while (leader.tickets or _live_watches() > before) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert leader.tickets == {}
        assert _live_watches() == before, "stop-string watchers outlived their requests"
    finally:
        driver.close()


class _CountingTokenizer:
    """The sim tokenizer, counting the tokens it is asked to decode."""

    def __init__(self) -> None:
        self.inner, self.decoded = sim_tokenizer(), 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.inner.decode(ids, **kwargs)


@settings(max_examples=60, deadline=None)
@given(
    # Single characters, spaces, words, and the three byte tokens of 😀 (10813, 242, 218), in any order.
    ids=st.lists(st.sampled_from([17, 18, 33, 34, 65, 66, 216, 253, 260, 10813, 242, 218]), min_size=1, max_size=60),
    stops=st.lists(
        st.sampled_from(["a", "AB", "!!", " ", "B!", "ab a", ".", "😀", "a😀", "😀 ", "B😀"]), min_size=1, max_size=3
    ),
    min_tokens=st.integers(0, 8),
)
@example(ids=[34, 10813, 242, 218], stops=["😀"], min_tokens=0)  # the last byte token completes the stop string
def test_stop_string_watch_matches_full_decodes(ids, stops, min_tokens):
    """Incremental checks find what decoding every prefix in full finds, and the sample's text is cut right there.

    The oracle: the first token (from min_tokens on) after which some stop string occurs ending
    beyond the text that the decodes with and without that token share (a character that token
    completed counts as new).
    """
    from dual_sampling.text import StopStringWatch, sample_text

    tokenizer = sim_tokenizer()
    watch = StopStringWatch(tokenizer, stops)
    for n in range(max(1, min_tokens), len(ids) + 1):
        full, before = decode(tokenizer, ids[:n]), decode(tokenizer, ids[: n - 1])
        shared = 0
        while shared < min(len(full), len(before)) and full[shared] == before[shared]:
            shared += 1
        expected = next((i for i, x in enumerate(stops) if full.find(x, max(0, shared - len(x) + 1)) >= 0), None)
        assert watch.check(ids[:n]) == expected, (ids[:n], stops)
        if expected is not None:
            text = sample_text(tokenizer, ids[:n], stops[expected])
            assert full.startswith(text) and full[len(text) :].startswith(stops[expected]), (ids[:n], text)
            return


def test_stop_string_watch_decodes_only_the_new_tokens():
    """The work per token depends on neither the sample's length nor the longest stop string's."""
    from dual_sampling.text import StopStringWatch

    tokenizer = _CountingTokenizer()
    watch = StopStringWatch(tokenizer, ["x" * 40, "never"])
    ids = [random.Random(3).randrange(33, 60) for _ in range(400)]
    watch.check(ids[:200])  # first check at min_tokens = 200: the text so far is read once
    tokenizer.decoded = 0
    for n in range(201, 401):
        assert watch.check(ids[:n]) is None
    assert tokenizer.decoded <= 200 * 16  # two decodes of the new token and the few before it, per token


# ---------------------------------------------------------------------- the driver


def test_an_engine_declared_dead_with_its_process_alive_fails_everything_for_good():
    """After an exception inside an EngineCore, vLLM raises EngineDeadError to every call; no process exits."""
    rng = random.Random(23)
    requests = make_requests(rng, 6, 96, (), 0)
    for request in requests:
        request.max_tokens = 24
    # After two steps the teacher stalls for good and theta dies: requests are still running (24 tokens each).
    # sync_timeout is an hour, so requests that waited for it instead would hit the 60 s deadline of the call.
    adversity = Adversity(engine_dead=("theta", 2), stall=("teacher", 2, 10**9))
    driver = sim_driver(rng, adversity, 2, 96, sync_timeout=3600.0, slots=2)

    try:
        errors = stream_errors(driver, requests, timeout=60)  # 2 running, 4 waiting for a slot when theta dies
        assert all(e.startswith("the theta engine failed") for e in errors), errors
        assert str(driver.failure).startswith("the theta engine failed") and not driver.alive
        assert "EngineDeadError" in str(driver.failure), "seen as vLLM's verdict, not as a process exit"
        later = stream_errors(driver, requests, timeout=30)
        assert all(e.startswith("the theta engine failed") for e in later), later
    finally:
        driver.close()


def test_an_engine_declared_dead_while_idle_turns_the_health_red():
    rng = random.Random(24)
    driver = sim_driver(rng, Adversity(), 2, 96)
    try:
        assert driver.alive
        driver.engines.cores["teacher"].declare_dead()
        deadline = time.monotonic() + 5
        while driver.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert str(driver.failure).startswith("the teacher engine failed") and not driver.alive
    finally:
        driver.close()


def test_an_abort_from_another_thread_while_the_slot_opens_ends_the_request(monkeypatch):
    """An abort sent from another thread while the driver's loop opens the request's slot (the loop is busy there, so
    the abort runs on it right after) must still end the request."""
    import dual_sampling.driver.loop_thread as loop_thread

    rng = random.Random(25)
    (request,) = make_requests(rng, 1, 96, (), 0)
    request.request_id, request.max_tokens = "late", 24
    driver = sim_driver(rng, Adversity(), 2, 96)
    opening, real_open = threading.Event(), driver.session.open_slot
    submitting, real_as_coroutine = threading.Event(), loop_thread.as_coroutine

    def as_coroutine(*args):  # the abort, in the test's thread, about to be handed to the driver's loop
        submitting.set()
        return real_as_coroutine(*args)

    def slow_open(*args):
        opening.set()
        assert submitting.wait(10)  # the other thread's abort arrives meanwhile
        real_open(*args)

    monkeypatch.setattr(loop_thread, "as_coroutine", as_coroutine)
    monkeypatch.setattr(driver.session, "open_slot", slow_open)
    try:
        future = asyncio.run_coroutine_threadsafe(driver.sample(request), driver.loop)
        assert opening.wait(10)
        assert driver.abort("late") is True
        sample = future.result(60)
        assert sample.finish_reason == "abort" and sample.error is None
    finally:
        driver.close()


def test_an_abort_after_the_slot_was_handed_over_but_before_launch_ends_the_request(monkeypatch):
    """One slot: the second request waits; its abort lands once the feeder gave it the slot, before it resumed."""
    rng = random.Random(26)
    first, second = make_requests(rng, 2, 96, (), 0)
    second.request_id = "waiting"
    driver = sim_driver(rng, Adversity(), 2, 96, slots=1)
    real_acquire = driver.slots.acquire

    async def acquire(waiter):
        slot = await real_acquire(waiter)
        if waiter.done() and driver._queued.get("waiting") is waiter:
            assert driver.abort("waiting") is True
        return slot

    monkeypatch.setattr(driver.slots, "acquire", acquire)
    try:
        samples = driver.call(_sample_all(driver, [first, second]), timeout=60)
        assert samples[0].finish_reason in ("stop", "length") and samples[0].error is None
        assert samples[1].finish_reason == "abort" and samples[1].token_ids == []
        assert driver.statistics()["requests"] == 2 and driver.in_flight() == []
    finally:
        driver.close()


class _StubEngine:
    """An engine frontend for driver tests: the teacher refuses the request, theta takes a while to let go.

    ``letting_go`` is set once theta's generator was told to stop; it then lets go only when cancelled again (an
    engine's abort takes a moment), so a test can act while the driver waits for theta, by state, not by a sleep."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.letting_go = asyncio.Event()

    async def generate(self, prompt, params, request_id):
        if self.role == "teacher":
            await asyncio.sleep(0)
            raise ValueError("the teacher refused the request")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.letting_go.set()
            await asyncio.sleep(3600)
            raise
        yield


class _StubEngines:
    def __init__(self, hold_close: bool = False) -> None:
        self.teacher, self.theta = _StubEngine("teacher"), _StubEngine("theta")
        self.engines = {"teacher": self.teacher, "theta": self.theta}
        self.closes = 0
        self.closing, self.release = threading.Event(), threading.Event()
        if not hold_close:
            self.release.set()

    def dead(self):
        return None

    def worker_cpu_seconds(self) -> float:
        return 0.0

    def close(self) -> None:
        """Counts the call; with ``hold_close`` it returns only once the test sets ``release``."""
        self.closes += 1
        self.closing.set()
        assert self.release.wait(60)


def _stub_driver(engines: _StubEngines):
    from dual_sampling.driver.lockstep_driver import LockstepDriver

    return LockstepDriver(
        lambda name: engines, sim_tokenizer(), vocab=VOCAB, max_model_len=96, max_num_seqs=2, sync_timeout=5
    )


def test_a_request_task_cancelled_while_it_waits_for_its_partner_ends_cancelled():
    """The flight task's own cancellation (as _fail and close() send it) must not be swallowed in its clean-up."""
    from dual_sampling.lockstep import EnginePairDead

    (request,) = make_requests(random.Random(27), 1, 96, (), 0)
    request.request_id = "r"
    driver = _stub_driver(_StubEngines())
    try:

        async def main():
            stream = asyncio.ensure_future(driver.sample(request))
            while "r" not in driver._flights:
                await asyncio.sleep(0.01)
            task = driver._flights["r"].task
            await driver.engines.theta.letting_go.wait()  # the teacher refused; the task waits for theta to let go
            assert not task.done()
            task.cancel()
            await asyncio.wait([task])
            with pytest.raises(EnginePairDead, match="closed"):  # not the teacher's refusal: the request was cancelled
                await stream
            return task.cancelled()

        assert driver.call(main(), timeout=30) is True
    finally:
        driver.close()


def test_engines_are_closed_once_when_a_failure_and_close_race():
    engines = _StubEngines(hold_close=True)
    driver = _stub_driver(engines)

    async def fail():
        driver._fail("an engine failed: test")

    driver.call(fail())
    assert engines.closing.wait(30)  # _fail's closing runs in the loop's executor, held there by the stub
    closer = threading.Thread(target=driver.close)
    closer.start()
    closer.join(0.3)  # a close() that does not wait for the closing returns at once
    assert closer.is_alive(), "close() returned while the engines were still closing"
    engines.release.set()
    closer.join(30)
    assert not closer.is_alive() and engines.closes == 1


def test_ctrl_c_waits_for_the_call_to_wind_down_and_a_second_one_propagates():
    """Ctrl-C cancels a blocking call and waits for its coroutine's own end (where its requests are released), not
    only for the future's cancellation, which returns at once; a second Ctrl-C meanwhile is not swallowed."""
    import signal

    from dual_sampling.driver.loop_thread import LoopThread

    wait_s = 60.0
    loop = LoopThread("interrupted-call", interrupt_wait=wait_s)
    began, winding, ended = threading.Event(), threading.Event(), threading.Event()

    async def slow_to_end(wind_down_s: float) -> None:
        began.set()
        try:
            await asyncio.sleep(wait_s)
        finally:
            winding.set()
            await asyncio.sleep(wind_down_s)  # releasing its requests takes a while
            ended.set()

    main = threading.main_thread().ident

    def interrupt(*events: threading.Event) -> None:
        for event in events:
            assert event.wait(10)
            time.sleep(0.05)
            # A real SIGINT to the main thread, as a terminal's Ctrl-C: it wakes a blocked wait, which
            # _thread.interrupt_main() does not.
            signal.pthread_kill(main, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job may ignore SIGINT
    try:
        # One Ctrl-C: the call returns only once the coroutine has ended.
        threading.Thread(target=interrupt, args=(began,), daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            loop.call(slow_to_end(0.5))
        assert ended.is_set()
        # A second Ctrl-C while it winds down: raised at once, not after interrupt_wait.
        began.clear(), winding.clear(), ended.clear()
        threading.Thread(target=interrupt, args=(began, winding), daemon=True).start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            loop.call(slow_to_end(wait_s))
        assert time.monotonic() - start < wait_s / 2 and not ended.is_set()
    finally:
        signal.signal(signal.SIGINT, previous)
        loop.stop()


@pytest.mark.parametrize("running", [True, False], ids=["coroutine-running", "coroutine-not-yet-begun"])
def test_ctrl_c_before_the_call_holds_its_future_still_ends_the_coroutine(monkeypatch, running):
    """Ctrl-C can land after the coroutine is handed to the loop but before the blocking call holds its future (a
    generate() once returned from Ctrl-C with 9 requests still in flight). Either the running coroutine is cancelled
    and waited out, or one that had not begun ends before it does any work."""
    from dual_sampling.driver import loop_thread as module

    loop = module.LoopThread("interrupted-early", interrupt_wait=60.0)
    began, ended, gate = threading.Event(), threading.Event(), threading.Event()
    real = asyncio.run_coroutine_threadsafe

    async def work() -> None:
        began.set()
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.2)  # releasing its requests takes a while
            ended.set()

    def interrupted_on_the_way(coro, event_loop):
        if not running:
            event_loop.call_soon_threadsafe(gate.wait, 10)  # the loop is busy: the coroutine cannot begin yet
        real(coro, event_loop)
        if running:
            assert began.wait(10)
        raise KeyboardInterrupt  # as if Ctrl-C came before run_coroutine_threadsafe's future was returned

    monkeypatch.setattr(module.asyncio, "run_coroutine_threadsafe", interrupted_on_the_way)
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.call(work())
        if running:
            assert ended.is_set(), "call() re-raised while the coroutine still ran"
        else:
            gate.set()
            time.sleep(0.3)
            assert not began.is_set(), "the abandoned coroutine began its work after call() re-raised"
    finally:
        gate.set()
        monkeypatch.undo()
        loop.stop()


def test_a_sample_with_a_non_finite_record_fails_by_name():
    """The driver's last check: whatever the engines wrote, a non-finite record never leaves as data."""
    from dual_sampling.driver.requests import DualRequest, Flight

    driver = _stub_driver(_StubEngines())
    try:
        s, slot, tokens = driver.session, 0, [20, 21, 22]
        s.open_slot(slot, 1, (3, 3))
        s.tokens[slot, :3] = tokens
        s.records[slot, :3] = [[0.5, -1.0, -1.0, -1.0], [0.5, -1.0, -1.0, math.nan], [0.5, -1.0, -math.inf, -1.0]]
        s.control[slot, Slot.NUM_RECORDS] = 3
        flight = Flight("r", slot, 1, DualRequest([1], [1], RowSampling(), 3), tokens=list(tokens))
        sample = driver.finish(flight, {"theta": list(tokens)}, "length")
        assert sample.error == "non_finite at step 1" and sample.finish_reason == "error" and sample.logq == []
        assert driver.counters["failed_non_finite"] == 1
    finally:
        driver.close()


def test_a_request_id_already_in_flight_is_refused():
    rng = random.Random(31)
    first, second = make_requests(rng, 2, 96, (), 0)
    first.request_id = second.request_id = "same"
    driver = sim_driver(rng, Adversity(), 2, 96)

    async def main():
        task = asyncio.ensure_future(driver.sample(first))
        await asyncio.sleep(0)  # it holds a slot now
        assert driver.in_flight() == ["same"]
        with pytest.raises(ValueError, match="request id 'same' is already in flight"):
            await driver.sample(second)
        return await task

    try:
        sample = driver.call(main(), timeout=60)
        assert sample.error is None  # the first one is untouched
    finally:
        driver.close()


def test_a_weight_load_cancelled_half_way_fails_the_dual_engine_for_good():
    """A load of several calls (vLLM's start, chunks, finish) cancelled between two of them (a Ctrl-C in
    update_theta cancels it) leaves the worker inside vLLM's layerwise reload: no request may run on it again."""
    rng = random.Random(31)
    driver = sim_driver(rng, Adversity(), 2, 96)
    try:
        driver.call(_sample_all(driver, make_requests(rng, 2, 96, (), 0)), timeout=60)  # the engines are up
        started = threading.Event()

        async def nothing(*args, **kwargs):
            return None

        for engine in driver.engines.engines.values():  # what the simulated engines lack of vLLM's AsyncLLM
            engine.pause_generation = engine.reset_prefix_cache = engine.resume_generation = nothing

        async def half_a_load(engine):
            started.set()
            await asyncio.sleep(3600)  # between vLLM's start and its first chunk

        update = asyncio.run_coroutine_threadsafe(driver.update_weights("theta", half_a_load), driver.loop)
        assert started.wait(30)
        update.cancel()
        deadline = time.monotonic() + 30
        while driver.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert driver.failure is not None and "loading new theta weights failed" in str(driver.failure)
        with pytest.raises(SyncError, match="loading new theta weights failed"):
            driver.call(_sample_all(driver, make_requests(rng, 1, 96, (), 0)), timeout=60)
    finally:
        driver.close()
