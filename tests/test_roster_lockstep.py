"""Three models in lockstep: one leader that decides, two followers (θ and a second teacher), through the real plugins.

The simulated engines (``dual_sampling.testing.sim_engines``) run vLLM's own schedulers with our scheduler and
processor plugins, one engine per model of the roster, on a session whose shared memory is indexed by roster
position. No driver: the test opens the slots and submits to each engine as a driver of three would. The oracle
recomputes every record from the fixed simulated logits in float64: q ∝ π_θ^(1−α₁−α₂)·π₁^α₁·π₂^α₂.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from alpha import get_alpha_computer
from dual_sampling.decision.pipeline import ModelRows, RowSampling, decide
from dual_sampling.lockstep import CONFIG_KEY, PLAN_RING, ErrorCode, SessionLayout, Slot, SyncError, SyncSession
from dual_sampling.roster import THETA, Roster
from dual_sampling.testing.sim_engines import EOS, NAN_STEP, VOCAB, Adversity, SimEnginePair, sim_configs, sim_logits

ROSTER = Roster(("teacher", THETA, "coach"))
"""The leader first (a teacher), then θ, then a second teacher: both teachers are not at the roster's ends."""
ALPHA = (0.35, 0.25)
"""The teachers' fixed weights, in :attr:`Roster.teachers` order (teacher, coach); θ's is 0.4."""
MAX_MODEL_LEN = 96
ROSTER_WIDTH = len(ROSTER.token_columns)


def params(slot: int, key: int, sampling: RowSampling, max_tokens: int, kind: RequestOutputKind) -> SamplingParams:
    """What a driver sends every engine: greedy on the one allowed token, with the pairing the plugins read."""
    pairing = {"slot": slot, "key": key, "sampling": sampling.to_dict(), "stop": []}
    return SamplingParams(
        n=1,
        temperature=0.0,
        max_tokens=max_tokens,
        stop_token_ids=list(sampling.stop_token_ids),
        detokenize=False,
        output_kind=kind,
        extra_args={CONFIG_KEY: pairing},
    )


async def final_tokens(
    engine, prompt: list[int], sampling_params: SamplingParams, request_id: str
) -> tuple[list[int], str | None]:
    """An engine's tokens for one request, and its finish reason."""
    tokens: list[int] = []
    reason = None
    async for out in engine.generate({"prompt_token_ids": prompt}, sampling_params, request_id):
        shown = list(out.outputs[0].token_ids)
        tokens = shown if sampling_params.output_kind == RequestOutputKind.FINAL_ONLY else tokens + shown
        reason = out.outputs[0].finish_reason
    return tokens, reason


def expected_records(
    seed: int,
    steps: dict[str, list[int]] | list[int],
    tokens: list[int],
    roster: Roster = ROSTER,
    teachers: tuple[str, ...] | None = None,
) -> np.ndarray:
    """float64 records of each token in ``roster``'s columns, recomputed from the simulated logits at each model's
    own step of each token (``steps`` by model name; one list: every model's is the leader's): α per teacher, log π
    of each model, log q. ``teachers``: the request's teacher set (the others weigh 0; their log π columns are NaN
    here, never compared)."""
    chosen = roster.teachers if teachers is None else teachers
    alpha = torch.tensor([a if t in chosen else 0.0 for t, a in zip(roster.teachers, ALPHA)], dtype=torch.float64)
    out = []
    for position, token in enumerate(tokens):
        logp = {
            name: torch.log_softmax(
                sim_logits(
                    name, seed, position, (steps if isinstance(steps, list) else steps[name])[position]
                ).double(),
                -1,
            )
            for name in roster.names
            if name == THETA or name in chosen
        }
        mixed = (1 - alpha.sum()) * logp[THETA] + sum(a * logp[t] for t, a in zip(roster.teachers, alpha) if a > 0)
        logq = torch.log_softmax(mixed, -1)
        logps = [float(logp[name][token]) if name in logp else float("nan") for name in roster.names]
        out.append([*alpha.tolist(), *logps, float(logq[token])])
    return np.array(out).reshape(len(tokens), len(roster.token_columns))


@dataclass
class TrioRun:
    """What one run of the three simulated engines left: each request's tokens per engine (leader first), and the
    session's words, records and statistics, read before the session closed."""

    requests: list
    tokens: list
    """Per request, each engine's tokens (leader first)."""
    reasons: list
    """Per request, each engine's finish reason."""
    errors: list
    records: list
    recorded_tokens: list
    released: list
    stats: dict
    batches: list
    token_steps: dict
    """The leader's step of each token, per sample seed."""
    model_steps: dict
    """Each model's own step of each token, per model name and sample seed."""
    admit_plans: list
    """Per request, the number of the leader's plan that admitted it."""


def run_trio(
    seed: int,
    count: int,
    adversity: Adversity,
    max_num_seqs: int = 4,
    roster: Roster = ROSTER,
    teacher_sets: list | None = None,
    waves: list[int] | None = None,
    **sampling: object,
) -> TrioRun:
    """``count`` requests through three simulated engines (``roster``'s), each with a distinct prompt of its own on
    each engine, as a driver of three would submit them; ``teacher_sets``: per request, the teachers it takes (None:
    all), its slot naming its participants and only their engines receiving it; ``waves``: per request, the wave it
    is submitted in (each wave once the one before has ended; None: all at once); ``sampling``: further RowSampling
    fields."""
    rng = random.Random(seed)
    teacher_sets = teacher_sets or [None] * count
    configs = sim_configs(
        max_num_seqs,
        MAX_MODEL_LEN,
        MAX_MODEL_LEN,
        20.0,
        adversity.prefix_caching,
        roster=roster.names,
        alpha_method="fixed",
        alpha_config={"alpha": ALPHA},
    )
    layout = SessionLayout(vocab=VOCAB, slots=count, max_steps=MAX_MODEL_LEN, plan_width=max_num_seqs, models=3)
    requests = []
    for k in range(count):
        # Distinct prompts of uneven lengths on each engine: the leader budgets every follower's prefill.
        prompts = [[rng.randrange(17, VOCAB) for _ in range(rng.randint(1, 40))] for _ in roster.names]
        stops = (EOS, rng.randrange(17, VOCAB))
        requests.append(
            (
                k,
                k + 1,
                prompts,
                RowSampling(seed=rng.randrange(1 << 40), stop_token_ids=stops, **sampling),
                rng.randint(4, 20),
            )
        )

    with SyncSession.create(layout) as session:
        session.names = roster.names
        engines = SimEnginePair(session.name, configs, random.Random(seed + 1), adversity, max_num_seqs, MAX_MODEL_LEN)
        try:

            async def one(slot, key, prompts, sampling, max_tokens):
                chosen = teacher_sets[slot]
                running = [n for n in roster.names if n == THETA or chosen is None or n in chosen]
                session.open_slot(slot, key, [len(p) for p in prompts], [roster.position(n) for n in running])
                kinds = [RequestOutputKind.DELTA] + [RequestOutputKind.FINAL_ONLY] * (len(prompts) - 1)
                out = await asyncio.gather(
                    *(
                        final_tokens(engines.engines[name], p, params(slot, key, sampling, max_tokens, kind), f"r{key}")
                        for name, p, kind in zip(roster.names, prompts, kinds)
                        if name in running
                    )
                )
                session.close_slot(slot)  # the driver has read it
                # Per model of the roster: its (tokens, finish reason), or (None, None) for a model left out.
                got = dict(zip(running, out))
                return [got.get(name, (None, None)) for name in roster.names]

            async def waves_in_turn():
                order = waves or [0] * count
                out = [None] * count
                for wave in sorted(set(order)):
                    now = [k for k in range(count) if order[k] == wave]
                    for k, result in zip(now, await asyncio.gather(*(one(*requests[k]) for k in now))):
                        out[k] = result
                return out

            async def main():
                return await asyncio.wait_for(waves_in_turn(), 240)

            outputs = asyncio.run(main())
            deadline = time.monotonic() + 10  # the engines release finished requests at their next step
            while session.held_slots() and time.monotonic() < deadline:
                time.sleep(0.02)
            counts = [int(session.control[slot, Slot.NUM_RECORDS]) for slot, *_ in requests]
            return TrioRun(
                requests,
                [[tokens for tokens, _ in out] for out in outputs],
                [[reason for _, reason in out] for out in outputs],
                [session.error(slot) for slot, *_ in requests],
                [session.records[slot, :n].astype(np.float64) for (slot, *_), n in zip(requests, counts)],
                [session.tokens[slot, :n].tolist() for (slot, *_), n in zip(requests, counts)],
                session.held_slots(),
                session.statistics(),
                [[[rid for rid, _ in b] for b in engines.cores[name].batches] for name in roster.names],
                engines.cores[roster.names[0]].token_steps,
                {name: engines.cores[name].token_steps for name in roster.names},
                [int(session.control[slot, Slot.ADMIT_PLAN]) for slot, *_ in requests],
            )
        finally:
            engines.close()


def check_records(run: TrioRun, index: int) -> None:
    """Request ``index``'s records against the float64 re-scoring, at the leader's step of each token."""
    (_, key, _, sampling, _), got = run.requests[index], run.records[index]
    steps = run.token_steps.get(sampling.seed, [])[: len(got)]
    want = expected_records(sampling.seed, steps, run.recorded_tokens[index])
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5, err_msg=f"request {key}")


@pytest.mark.timeout(300)
def test_three_models_in_lockstep_record_the_mixture_of_two_teachers_and_theta():
    assert ROSTER.token_columns == (
        "alpha_teacher",
        "alpha_coach",
        "logp_teacher",
        "logp_theta",
        "logp_coach",
        "logq",
    )
    run = run_trio(7, 6, Adversity())
    assert all(reason in ("stop", "length") for reasons in run.reasons for reason in reasons), run.reasons
    for index, ((_, key, _, _, max_tokens), tokens) in enumerate(zip(run.requests, run.tokens)):
        assert tokens[0] == tokens[1] == tokens[2], f"request {key}: the engines emitted {tokens}"
        assert 1 <= len(tokens[0]) <= max_tokens and run.errors[index] == (ErrorCode.NONE, -1)
        assert run.recorded_tokens[index] == tokens[0]
        check_records(run, index)
    # Every model's steps ran the same requests (their own schedulers' logs, not the plugins').
    assert run.batches[0] == run.batches[1] == run.batches[2] and len(run.batches[0]) > 5
    stats = run.stats
    assert stats["teacher_rows"] == stats["theta_rows"] == stats["coach_rows"] == sum(len(t[0]) for t in run.tokens)
    assert stats["follower_diverged"] == 0 and stats["split_steps"] == 0
    assert run.released == [], "a slot some engine never released"


@pytest.mark.timeout(300)
def test_three_models_hold_lockstep_under_late_deliveries_one_sided_aborts_and_bad_rows():
    """The hazards of a pair, with two followers: every engine's messages arrive late by its own draws (the second
    teacher's latest), vLLM aborts reach one engine only, one follower caches prefixes, and NaN logits strike the
    second teacher for one request. Each request completes with records equal to the re-scoring, is aborted, or fails
    alone by name; the three engines' steps always run the same requests, and every slot is released."""
    hazards = dict(
        delay_turns={"teacher": 2, "theta": 4, "coach": 8},
        one_sided_abort_rate=0.25,
        prefix_caching=frozenset({"coach"}),
    )
    # The same run without the NaN (a run is a function of its seeds): aim it at a request that lives past NAN_STEP.
    first = run_trio(11, 10, Adversity(**hazards))
    aim = next(
        i for i, (t, r) in enumerate(zip(first.tokens, first.reasons)) if r[0] != "abort" and len(t[0]) > NAN_STEP
    )
    nan_seed = first.requests[aim][3].seed
    run = run_trio(11, 10, Adversity(**hazards, nan_side="coach", nan_seeds=frozenset({nan_seed})))
    outcomes = {"complete": 0, "abort": 0, "bad_logits": 0}
    for index, ((_, key, _, sampling, _), tokens) in enumerate(zip(run.requests, run.tokens)):
        code, step = run.errors[index]
        reasons = run.reasons[index]
        # Every engine emitted the same tokens and ended alike, whatever ended the request: at one step on all three.
        assert tokens[0] == tokens[1] == tokens[2], f"request {key}: the engines emitted {tokens}"
        assert reasons[0] == reasons[1] == reasons[2], f"request {key}: the engines ended as {reasons}"
        if code == ErrorCode.BAD_LOGITS:
            assert sampling.seed == nan_seed and step == NAN_STEP and reasons[0] == "error", (key, step, reasons)
            outcomes["bad_logits"] += 1
        else:
            assert code == ErrorCode.NONE, f"request {key} failed: {code.label} at step {step}"
            assert run.recorded_tokens[index] == tokens[0]
            outcomes["abort" if reasons[0] == "abort" else "complete"] += 1
        check_records(run, index)  # what was recorded is right, however the request ended
    assert outcomes["bad_logits"] == 1 and outcomes["abort"] >= 1 and outcomes["complete"] >= 3, outcomes
    assert run.batches[0] == run.batches[1] == run.batches[2]
    assert run.stats["follower_diverged"] == 0 and run.stats["split_steps"] == 0
    assert run.released == [], "a slot some engine never released"


@pytest.mark.timeout(300)
def test_a_repetition_penalty_reads_every_followers_raw_logits():
    """The followers' rows reach the leader normalised; the repetition penalty acts on the mixture's raw logits, so
    the leader must add back θ's and the second teacher's log-normalisers. Each token of the run equals the decision
    on the raw simulated logits (the torch reference, given the tokens before it)."""
    run = run_trio(5, 4, Adversity(), repetition_penalty=1.8, presence_penalty=0.3)
    computer = get_alpha_computer("fixed", alpha=ALPHA)
    checked = 0
    for index, (_, key, _, sampling, _) in enumerate(run.requests):
        tokens = run.recorded_tokens[index]
        assert run.errors[index] == (ErrorCode.NONE, -1) and tokens == run.tokens[index][0]
        steps = run.token_steps[sampling.seed]
        for position, token in enumerate(tokens):
            raw = tuple(
                sim_logits(name, sampling.seed, position, steps[position]).unsqueeze(0) for name in ROSTER.names
            )
            d = decide(ModelRows(raw, ROSTER), [position], [sampling], computer, outputs=[tokens[:position]])
            assert int(d.tokens[0]) == token, f"request {key} token {position}"
            assert float(d.logq[0]) == pytest.approx(float(run.records[index][position, -1]), abs=2e-5)
            checked += 1
    assert checked > 10


def test_an_engine_whose_roster_is_not_the_sessions_is_refused_by_name():
    configs = sim_configs(2, MAX_MODEL_LEN, MAX_MODEL_LEN, 5.0, roster=ROSTER.names)
    layout = SessionLayout(vocab=VOCAB, slots=2, max_steps=MAX_MODEL_LEN, plan_width=2)
    with SyncSession.create(layout) as session, pytest.raises(SyncError, match=r"names 3 models; the session .* 2"):
        SimEnginePair(session.name, configs, random.Random(0), Adversity(), 2, MAX_MODEL_LEN)


LED_BY_THETA = Roster.of_teachers(("teacher", "coach"))
"""A run's roster of two teachers: θ leads (it takes part in every mixture), the teachers follow."""


@pytest.mark.timeout(300)
def test_requests_that_name_their_teachers_run_on_those_engines_alone_and_record_their_mixture():
    """Per-request teacher sets (``DualRequest.teachers``): each request runs on θ's engine and its teachers' only.
    The first requests take one teacher, so the other teacher's engine idles while the leader steps on past the
    plan ring (it must pass over plans that are not its own, then join exactly at its request's admission); later
    requests take either teacher, both or the default. Under late deliveries, one-sided aborts and a follower with
    prefix caching: every participant emits the same tokens, a left-out engine never schedules the request, each
    follower's steps are the leader's restricted to its requests, and every record equals a float64 re-scoring at
    each model's own step, a left-out teacher weighing exactly 0."""
    sets = [("teacher",)] * 4 + [("coach",), ("teacher", "coach"), None, ("coach",), ("teacher",), ("coach",)]
    hazards = dict(delay_turns={"theta": 2, "teacher": 4, "coach": 6}, one_sided_abort_rate=0.2)
    run = run_trio(
        23,
        len(sets),
        Adversity(**hazards, prefix_caching=frozenset({"coach"})),
        roster=LED_BY_THETA,
        teacher_sets=sets,
        waves=[0] * 4 + [1] * 6,
    )
    assert run.errors == [(ErrorCode.NONE, -1)] * len(sets), run.errors
    names = LED_BY_THETA.names
    completed = 0
    for index, ((_, key, _, sampling, _), chosen) in enumerate(zip(run.requests, sets)):
        running = {n for n in names if n == THETA or chosen is None or n in chosen}
        tokens = dict(zip(names, run.tokens[index]))
        reasons = dict(zip(names, run.reasons[index]))
        assert {n for n in names if tokens[n] is not None} == running
        assert len({tuple(tokens[n]) for n in running}) == 1, f"request {key}: {tokens}"
        assert len({reasons[n] for n in running}) == 1, f"request {key}: {reasons}"
        completed += reasons[THETA] != "abort"
        assert run.recorded_tokens[index] == tokens[THETA]
        for name in set(names) - running:  # its engine never scheduled the request
            assert all(f"r{key}" not in step for step in run.batches[names.index(name)]), (name, key)
        steps = {n: run.model_steps[n].get(sampling.seed, []) for n in running}
        want = expected_records(sampling.seed, steps, run.recorded_tokens[index], LED_BY_THETA, chosen)
        compared = [c for c, value in zip(LED_BY_THETA.token_columns, want[0] if len(want) else []) if value == value]
        got = run.records[index]
        for column in compared:
            k = LED_BY_THETA.token_columns.index(column)
            np.testing.assert_allclose(got[:, k], want[:, k], rtol=0, atol=2e-5, err_msg=f"request {key} {column}")
    assert completed >= 5
    # Each follower ran exactly the leader's steps that held one of its requests, each with exactly those requests.
    leader = run.batches[0]
    for position, name in enumerate(names[1:], 1):
        mine = {f"r{key}" for (_, key, *_), chosen in zip(run.requests, sets) if chosen is None or name in chosen}
        wanted = [[rid for rid in step if rid in mine] for step in leader]
        assert run.batches[position] == [step for step in wanted if step], name
    # The coach's engine ran nothing before its first request, which the leader admitted past the plan ring: the coach
    # had to pass over plans it could no longer read.
    assert run.admit_plans[sets.index(("coach",))] >= PLAN_RING, run.admit_plans
    # (Rows of one step may be decided in several rounds here: the two teachers publish theirs apart.)
    assert run.stats["follower_diverged"] == 0
    assert run.released == [], "a slot some engine never released"
