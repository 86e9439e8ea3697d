"""Penalties on q against vLLM's own penalised sampling: at α = 0 q is theta, at α = 1 the teacher.

One dual engine with a fixed α and one plain vLLM engine of the model q equals there (its sampler in
``logprobs_mode="processed_logprobs"``, which reports the penalised log-probabilities), both greedy with the same
repetition, presence and frequency penalties: the same tokens, and at every step the same top log-probabilities
(ours: q's, recorded by the teacher processor). Greedy paths with repeated tokens put every penalty to work; the
unpenalised path must differ (a positive control). Theta's side exercises the log-normaliser it publishes beside
its row, the teacher's side the one the teacher computes.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dual_sampling import OptimalSamplingDual
from dual_sampling.driver import engine_start
from tests.tolerances import two_engines_penalised_atol

pytestmark = pytest.mark.engine

PENALTIES = [
    dict(repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2),
    # Below 1 the repetition penalty favours the tokens seen: they lead q, so its top K shows them.
    dict(repetition_penalty=0.8, frequency_penalty=0.3),
]
PROMPTS = ["the cat and the cat and the", "1 2 3 1 2 3 1 2"]
STEPS = 24
K = 20
"""vLLM's largest logprobs count by default (TOP_LOGPROBS_MAX here)."""


def dual_steps(dual: OptimalSamplingDual, prompt: str, **penalties) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Greedy tokens and, per step, q's top-K (ids, log q) from the stream's deltas."""

    async def run():
        ids, top_ids, top_logq = [], [], []
        async for delta in dual.stream(prompt, max_tokens=STEPS, temperature=0.0, top_logprobs=K, **penalties):
            ids += delta.token_ids
            if delta.top is not None:
                top_ids.append(delta.top[0])
                top_logq.append(delta.top[1])
        return ids, np.concatenate(top_ids), np.concatenate(top_logq)

    return asyncio.run(run())


def vllm_steps(llm, prompt_ids: list[int], **penalties) -> tuple[list[int], list[dict[int, float]]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, logprobs=K, ignore_eos=True, **penalties)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False)
    completion = out.outputs[0]
    return list(completion.token_ids), [{t: lp.logprob for t, lp in step.items()} for step in completion.logprobs]


@pytest.fixture(scope="module", params=["theta", "teacher"])
def side(request, tiny_same, dual_engine):
    """(alpha, the session's dual engine at that fixed α, vLLM's engine of the model q equals there), one side at a
    time; the dual engine's alpha settings are restored after."""
    from vllm import LLM

    teacher, theta = tiny_same
    alpha, folder = (0.0, theta) if request.param == "theta" else (1.0, teacher)
    before = dual_engine.alpha_settings
    dual_engine.update_alpha("fixed", alpha=alpha)
    with engine_start.vllm_engines():  # as fast as the pair's
        llm = LLM(
            model=str(folder),
            dtype="float32",
            max_model_len=128,
            max_num_seqs=2,
            enforce_eager=True,
            logprobs_mode="processed_logprobs",
            kv_cache_memory_bytes=64 << 20,
            seed=0,
        )
    try:
        yield request.param, dual_engine, llm
    finally:
        del llm
        method, config = before
        dual_engine.update_alpha(method, **config)


@pytest.mark.parametrize("penalties", PENALTIES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_penalised_greedy_q_is_vllms_penalised_model(side, prompt, penalties):
    name, dual, llm = side
    prompt_ids = dual.prepare(prompt).theta_ids
    ours, top_ids, top_logq = dual_steps(dual, prompt, **penalties)
    # vLLM's engine ignores EOS: its path is ours, continued where an EOS ended ours.
    theirs, their_logprobs = vllm_steps(llm, list(prompt_ids), **penalties)
    assert ours == theirs[: len(ours)], f"{name}: greedy paths differ"
    assert len(ours) >= STEPS // 2, f"{name}: only {len(ours)} steps to compare"
    # Two engines' forwards of the same weights (ours: theta's or the teacher's engine, normalised by the kernel;
    # theirs: vLLM's float32 log_softmax of the penalised logits over the whole vocabulary).
    atol = two_engines_penalised_atol(dual.vocab, penalties.get("repetition_penalty", 1.0))
    for step in range(len(ours)):
        expected = sorted(their_logprobs[step].items(), key=lambda kv: -kv[1])[:K]
        assert top_ids[step].tolist() == [t for t, _ in expected], f"{name} step {step}"
        np.testing.assert_allclose(top_logq[step], [v for _, v in expected], atol=atol, rtol=0, err_msg=f"step {step}")
    plain, _, _ = dual_steps(dual, prompt)
    assert plain != ours, "the penalties changed nothing on this path: the test could not tell"
