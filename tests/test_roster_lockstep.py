"""Three models in lockstep: one leader that decides, two followers (θ and a second teacher), through the real plugins.

The simulated engines (``dual_sampling.testing.sim_engines``) run vLLM's own schedulers with our scheduler and
processor plugins, one engine per model of the roster, on a session whose shared memory is indexed by roster
position. No driver: the test opens the slots and submits to each engine as a driver of three would. The oracle
recomputes every record from the fixed simulated logits in float64: q ∝ π_θ^(1−α₁−α₂)·π₁^α₁·π₂^α₂.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from dual_sampling.decision.pipeline import RowSampling
from dual_sampling.lockstep import CONFIG_KEY, ErrorCode, ModelSlot, SessionLayout, Slot, SyncSession, slot_word
from dual_sampling.roster import THETA, Roster
from dual_sampling.testing.sim_engines import EOS, VOCAB, Adversity, SimEnginePair, sim_configs, sim_logits

ROSTER = Roster(("teacher", THETA, "coach"))
"""The leader first (a teacher), then θ, then a second teacher: both teachers are not at the roster's ends."""
ALPHA = (0.35, 0.25)
"""The teachers' fixed weights, in :attr:`Roster.teachers` order (teacher, coach); θ's is 0.4."""
MAX_MODEL_LEN = 96


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


async def final_tokens(engine, prompt: list[int], sampling_params: SamplingParams, request_id: str) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate({"prompt_token_ids": prompt}, sampling_params, request_id):
        shown = list(out.outputs[0].token_ids)
        tokens = shown if sampling_params.output_kind == RequestOutputKind.FINAL_ONLY else tokens + shown
    return tokens


def expected_records(seed: int, steps: list[int], tokens: list[int]) -> np.ndarray:
    """float64 records of each token in the roster's columns, recomputed from the simulated logits at the leader's
    step of each token: α per teacher, log π of each model, log q."""
    alpha = torch.tensor(ALPHA, dtype=torch.float64)
    out = []
    for position, (token, step) in enumerate(zip(tokens, steps)):
        logp = {name: torch.log_softmax(sim_logits(name, seed, position, step).double(), -1) for name in ROSTER.names}
        teachers = torch.stack([logp[name] for name in ROSTER.teachers])
        mixed = (1 - alpha.sum()) * logp[THETA] + (alpha[:, None] * teachers).sum(0)
        logq = torch.log_softmax(mixed, -1)
        out.append([*ALPHA, *(float(logp[name][token]) for name in ROSTER.names), float(logq[token])])
    return np.array(out)


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
    rng = random.Random(7)
    configs = sim_configs(
        4, MAX_MODEL_LEN, MAX_MODEL_LEN, 20.0, roster=ROSTER.names, alpha_method="fixed", alpha_config={"alpha": ALPHA}
    )
    layout = SessionLayout(vocab=VOCAB, slots=6, max_steps=MAX_MODEL_LEN, plan_width=4, models=len(ROSTER.names))
    requests = []
    for k in range(6):
        # Distinct prompts of uneven lengths on each engine: the leader budgets every follower's prefill.
        prompts = [[rng.randrange(17, VOCAB) for _ in range(rng.randint(1, 40))] for _ in ROSTER.names]
        sampling = RowSampling(seed=rng.randrange(1 << 40), stop_token_ids=(EOS, rng.randrange(17, VOCAB)))
        requests.append((k, k + 1, prompts, sampling, rng.randint(4, 20)))

    with SyncSession.create(layout) as session:
        session.names = ROSTER.names
        engines = SimEnginePair(session.name, configs, random.Random(3), Adversity(), 4, MAX_MODEL_LEN)
        try:

            async def one(slot, key, prompts, sampling, max_tokens):
                session.open_slot(slot, key, [len(p) for p in prompts])
                kinds = [RequestOutputKind.DELTA] + [RequestOutputKind.FINAL_ONLY] * (len(prompts) - 1)
                return await asyncio.gather(
                    *(
                        final_tokens(
                            engines.engines[name], prompt, params(slot, key, sampling, max_tokens, kind), f"r{key}"
                        )
                        for name, prompt, kind in zip(ROSTER.names, prompts, kinds)
                    )
                )

            async def main():
                return await asyncio.wait_for(asyncio.gather(*(one(*r) for r in requests)), 240)

            outcomes = asyncio.run(main())
            leader = engines.cores[ROSTER.names[0]]
            for (slot, key, _, sampling, max_tokens), tokens in zip(requests, outcomes):
                assert tokens[0] == tokens[1] == tokens[2], f"request {key}: the engines emitted {tokens}"
                assert 1 <= len(tokens[0]) <= max_tokens
                assert session.error(slot) == (ErrorCode.NONE, -1)
                n = int(session.control[slot, Slot.NUM_RECORDS])
                assert n == len(tokens[0]) and session.tokens[slot, :n].tolist() == tokens[0]
                steps = leader.token_steps[sampling.seed][:n]
                want = expected_records(sampling.seed, steps, tokens[0])
                got = session.records[slot, :n].astype(np.float64)
                np.testing.assert_allclose(got, want, rtol=0, atol=2e-5, err_msg=f"request {key}")
            # Every model's steps ran the same requests (their own schedulers' logs, not the plugins').
            logs = [[[rid for rid, _ in b] for b in engines.cores[name].batches] for name in ROSTER.names]
            assert logs[0] == logs[1] == logs[2] and len(logs[0]) > 5
            stats = session.statistics()
            assert (
                stats["teacher_rows"] == stats["theta_rows"] == stats["coach_rows"] == sum(len(t[0]) for t in outcomes)
            )
            assert stats["follower_diverged"] == 0 and stats["split_steps"] == 0
        finally:
            engines.close()
        # Every engine released every request: the slots are free once the driver has read them.
        for slot, key, *_ in requests:
            assert all(
                int(session.control[slot, slot_word(ModelSlot.RELEASED, p)]) == key for p in range(layout.models)
            )
