"""``mode="speculative"`` on a real vLLM engine (the tiny pair): theta drafts inside the teacher's engine and the
teacher's step checks every draft against q (``processors.speculative``).

- Records (α, log π_t, log π_θ, log q) against re-scoring in plain transformers, with the lockstep mode's oracle
  and tolerance.
- The first two tokens over 1,500 seeds follow q at a fixed α: their randomised probability integral transforms
  under q (from re-scoring in float64) are independent uniforms, by a chi-square test on a 5 x 5 grid at level 0.001;
  the same draws fail the test under π_t, so it has the power to tell.
- Seeds reproduce whatever else is in the batch; the acceptance counters add up; what the mode cannot serve is
  refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.oracles import assert_records_match_rescoring, np_mix, rescore

pytestmark = pytest.mark.engine

GAMMA = 3
ALPHA = 0.5
"""The fixed teacher weight of the exactness test."""
SEEDS = 1500
LEVEL = 1e-3


def speculative_engine(pair, max_model_len: int):
    """A speculative engine of γ = GAMMA on ``pair`` (a context manager)."""
    from dual_sampling import OptimalSamplingDual

    teacher, theta = pair
    return OptimalSamplingDual(
        teacher,
        theta,
        mode="speculative",
        num_speculative_tokens=GAMMA,
        max_num_seqs=16,
        max_model_len=max_model_len,
        sync_timeout=30,
        use_tqdm=False,
    )


@pytest.fixture(scope="module")
def spec_engine(tiny_same):
    with speculative_engine(tiny_same, 256) as engine:
        yield engine


PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3, 4,"]


def samples(out) -> list:
    return [s for r in out.requests for s in r.samples]


def test_records_match_rescoring(spec_engine, hf_models):
    out = spec_engine.generate(PROMPTS, max_tokens=24, n=2, seed=3)
    checked = sum(assert_records_match_rescoring(r, *hf_models, spec_engine.vocab, "kl_symmetry") for r in out.requests)
    assert checked == sum(len(s.token_ids) for s in samples(out)) > 0
    assert all(s.finish_reason in ("stop", "length") for s in samples(out))
    stats = spec_engine.get_sync_statistics()
    assert stats["mode"] == "speculative" and stats["drafted"] > 0
    assert 0 < stats["accepted"] <= stats["drafted"]
    assert stats["acceptance"] == pytest.approx(stats["accepted"] / stats["drafted"])


def _rows(model, prompt: list[int], firsts: list[int], vocab: int) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """log-probabilities in float64: the row after ``prompt`` and, for each first token a, the row after it (one
    batched forward)."""
    first = rescore(model, prompt, [0], vocab)[0].numpy()
    unique = sorted(set(firsts))
    with torch.no_grad():
        logits = model(torch.tensor([[*prompt, a] for a in unique])).logits[:, -1, :vocab]
    after = torch.log_softmax(logits.double(), -1).numpy()
    return first, dict(zip(unique, after))


def _pit(p: np.ndarray, token: int, v: float) -> float:
    """Randomised probability integral transform of ``token`` under ``p`` (tokens ordered by decreasing p):
    uniform on [0, 1) when the token is drawn from p."""
    order = np.argsort(-p, kind="stable")
    rank = int(np.flatnonzero(order == token)[0])
    return float(p[order[:rank]].sum() + v * p[token])


def _uniform_grid_p(u: np.ndarray, bins: int = 5) -> float:
    """Chi-square p-value of pairs ``u`` ``[n, 2]`` against independent uniforms, on a bins x bins grid."""
    cells = np.minimum((u * bins).astype(int), bins - 1)
    observed = np.bincount(cells[:, 0] * bins + cells[:, 1], minlength=bins * bins)
    expected = len(u) / bins**2
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = bins * bins - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_first_two_tokens_follow_q(spec_engine, hf_models):
    """At a fixed α (set through update_alpha, which the mode serves too). q spreads over thousands of tokens here
    (theta is flat), so the two tokens are tested through their randomised PITs: under q, (F_q0(y0), F_q1(y1 | y0))
    are independent uniforms whatever the vocabulary."""
    hf_teacher, hf_theta = hf_models
    vocab = spec_engine.vocab
    prompt = spec_engine.tokenizer(PROMPTS[0])["input_ids"]
    spec_engine.update_alpha("fixed", alpha=ALPHA)
    try:
        out = spec_engine.generate([prompt], max_tokens=2, n=SEEDS, seed=11)
    finally:
        spec_engine.update_alpha("kl_symmetry")
    pairs = [s.token_ids[:2] for s in samples(out) if len(s.token_ids) == 2]  # a stop token first: ~1e-5 of q
    assert len(pairs) >= SEEDS - 5
    firsts = [a for a, _ in pairs]
    t0, t1 = _rows(hf_teacher, prompt, firsts, vocab)
    h0, h1 = _rows(hf_theta, prompt, firsts, vocab)
    q0 = np_mix(h0, t0, ALPHA)
    q1 = {a: np_mix(h1[a], t1[a], ALPHA) for a in t1}
    v = np.random.default_rng(0).random((len(pairs), 2))
    under_q = np.array([[_pit(q0, a, v[i, 0]), _pit(q1[a], b, v[i, 1])] for i, (a, b) in enumerate(pairs)])
    assert _uniform_grid_p(under_q) > LEVEL
    # The same draws against the teacher's own distribution: rejected, so the test can tell the two apart.
    under_t = np.array(
        [[_pit(np.exp(t0), a, v[i, 0]), _pit(np.exp(t1[a]), b, v[i, 1])] for i, (a, b) in enumerate(pairs)]
    )
    assert _uniform_grid_p(under_t) < LEVEL


def test_seeds_reproduce_whatever_the_batch(spec_engine):
    alone = spec_engine.generate([PROMPTS[1]], max_tokens=16, seed=5, prompt_keys=["b"])
    crowded = spec_engine.generate(PROMPTS, max_tokens=16, seed=5, prompt_keys=["a", "b", "c"])
    again = spec_engine.generate([PROMPTS[1]], max_tokens=16, seed=5, prompt_keys=["b"])
    sample = samples(alone)[0]
    assert sample.token_ids == samples(again)[0].token_ids and sample.logq == samples(again)[0].logq
    assert crowded.requests[1].samples[0].seed == sample.seed
    assert crowded.requests[1].samples[0].token_ids == sample.token_ids


def test_streamed_deltas_join_into_the_sample_and_an_abort_ends_the_request(spec_engine):
    import asyncio

    async def run():
        tokens, records, final = [], [], None
        async for delta in spec_engine.stream(PROMPTS[2], max_tokens=20, seed=9):
            tokens += delta.token_ids
            records.append(delta.records)
            final = delta.sample or final
        aborted = None
        async for delta in spec_engine.stream(PROMPTS[0], max_tokens=200, seed=9, request_id="spec-abort"):
            if delta.sample is not None:
                aborted = delta.sample
            elif delta.token_ids:
                spec_engine.abort("spec-abort")
        return tokens, np.concatenate(records), final, aborted

    tokens, records, final, aborted = asyncio.run(run())
    assert final is not None and final.error is None and tokens == final.token_ids
    np.testing.assert_allclose(records[:, 3], final.logq, rtol=0, atol=0)
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) < 200
    assert spec_engine.get_sync_statistics()["in_flight"] == 0


def test_the_server_serves_the_mode_and_refuses_a_teacher_prompt_by_name(spec_engine):
    """The OpenAI-compatible server over a speculative engine: a chat completion equals the offline sample of the
    same seed; teacher messages (a hint) are refused with a 400 that names the field."""
    from openai import BadRequestError, OpenAI

    from dual_sampling.server.app import build_app
    from dual_sampling.server.serve_options import ServeOptions
    from tests.test_serve import Server

    server = Server(build_app(spec_engine, ServeOptions(api_key="k", max_n=2)))
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
        messages = [{"role": "user", "content": "Count to five."}]
        r = client.chat.completions.create(model="dual", messages=messages, max_tokens=10, seed=4)
        prompt = spec_engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        offline = samples(spec_engine.generate([prompt], max_tokens=10, seed=4))[0]
        extra = r.choices[0].model_extra["dual_sampling"]
        assert r.choices[0].message.content == offline.text and extra["error"] is None
        assert r.usage.completion_tokens == len(offline.token_ids)
        with pytest.raises(BadRequestError, match="teacher"):
            client.chat.completions.create(
                model="dual", messages=messages, max_tokens=4, extra_body={"teacher_messages": messages * 2}
            )
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"top_k": 5}, "top_k"),
        ({"temperature": 0.7}, "temperature"),
        ({"teacher_prompts": ["A hint. Once upon a time"]}, "teacher_prompts"),
        ({"min_tokens": 2}, "min_tokens"),
    ],
)
def test_what_the_mode_cannot_serve_is_refused_by_name(spec_engine, options, named):
    with pytest.raises(ValueError, match=named):
        spec_engine.generate([PROMPTS[0]], max_tokens=4, **options)


def test_theta_weights_cannot_be_updated_in_place(spec_engine, tiny_same):
    with pytest.raises(ValueError, match="role='theta'"):
        spec_engine.update_theta(tiny_same[1])


# ---------------------------------------------------------------------------- padded vocabularies

PADDED_PROMPT = "1, 2, 3, 4,"
"""Theta puts a third of its mass on the padding rows after this prompt (tiny_models._PADDING_LOGIT_SCALE)."""
FIRST_TOKEN_SEEDS = 1500


@pytest.fixture(scope="module")
def padded_pair():
    from dual_sampling.testing.tiny_models import tiny_pair

    return tiny_pair("padded_alike")


@pytest.fixture(scope="module")
def padded_spec_engine(padded_pair):
    with speculative_engine(padded_pair, 128) as engine:
        yield engine


@pytest.fixture(scope="module")
def padded_hf_models(padded_pair):
    from transformers import AutoModelForCausalLM

    return tuple(AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in padded_pair)


@pytest.mark.budget(150, reason="a speculative engine on the padded pair and two transformers models start here")
def test_padded_theta_records_match_rescoring_over_the_tokenizers_ids(padded_spec_engine, padded_hf_models):
    """Theta's embedding has 1,024 rows past the tokenizer carrying a real share of its mass: the recorded log π_θ
    (and α, log q) must be normalised over the tokenizer's ids, as the re-scoring oracle is."""
    out = padded_spec_engine.generate([PADDED_PROMPT, *PROMPTS], max_tokens=16, n=2, seed=7)
    checked = sum(
        assert_records_match_rescoring(r, *padded_hf_models, padded_spec_engine.vocab, "kl_symmetry")
        for r in out.requests
    )
    assert checked == sum(len(s.token_ids) for s in samples(out)) > 0


def _padded_first_token_rows(hf_teacher, hf_theta, prompt: list[int], vocab: int) -> tuple[np.ndarray, ...]:
    """After ``prompt`` in float64: log π_t, log π_θ over the tokenizer's ids, and θ's mass on the padding rows."""
    with torch.no_grad():
        teacher = torch.log_softmax(hf_teacher(torch.tensor([prompt])).logits[0, -1, :vocab].double(), -1).numpy()
        full = torch.log_softmax(hf_theta(torch.tensor([prompt])).logits[0, -1].double(), -1).numpy()
    theta = full[:vocab] - np.log(np.exp(full[:vocab]).sum())
    return teacher, theta, float(np.exp(full[vocab:]).sum())


def _first_token_p(tokens: list[int], law: np.ndarray, order_by: np.ndarray, seed: int = 0) -> float:
    """Chi-square p-value, on 10 bins, of the tokens' randomised PITs under ``law`` with the tokens ordered by
    decreasing ``order_by``: uniforms when the tokens are drawn from ``law``, whatever the (fixed) order. Ordered by
    the acceptance ratio q/π_θ, the test looks where an error in the acceptance step moves mass."""
    order = np.argsort(-order_by, kind="stable")
    before = np.empty_like(law)
    before[order] = np.cumsum(law[order]) - law[order]
    picked = np.asarray(tokens)
    u = before[picked] + np.random.default_rng(seed).random(len(picked)) * law[picked]
    observed = np.bincount(np.minimum((u * 10).astype(int), 9), minlength=10)
    expected = len(u) / 10
    stat = float(((observed - expected) ** 2 / expected).sum())
    return float(torch.special.gammaincc(torch.tensor(4.5, dtype=torch.float64), torch.tensor(stat / 2)))


def test_padded_theta_first_token_follows_q(padded_spec_engine, padded_hf_models):
    """The first token of 1,500 seeds at a fixed α follows q over the tokenizer's ids. The positive control: the law
    the rule emits when θ's row is left sub-normalised by its padding mass m (acceptance min(1, q/((1−m)·π_θ)),
    residual max(0, q − (1−m)·π_θ); total-variation distance 0.074 from q here), sampled as often, fails the same
    test (it did in 20 of 20 simulated runs)."""
    engine = padded_spec_engine
    prompt = engine.tokenizer(PADDED_PROMPT)["input_ids"]
    engine.update_alpha("fixed", alpha=ALPHA)
    try:
        out = engine.generate([prompt], max_tokens=1, n=FIRST_TOKEN_SEEDS, seed=23)
    finally:
        engine.update_alpha("kl_symmetry")
    firsts = [s.token_ids[0] for s in samples(out)]
    assert len(firsts) == FIRST_TOKEN_SEEDS
    teacher, theta, padding_mass = _padded_first_token_rows(*padded_hf_models, prompt, engine.vocab)
    assert padding_mass > 0.2  # the pair must keep the hazard it exists for
    q = np_mix(theta, teacher, ALPHA)
    ratio = np.log(q) - theta
    assert _first_token_p(firsts, q, ratio) > LEVEL
    kept = (1 - padding_mass) * np.exp(theta)
    accept = np.minimum(1.0, q / kept)
    residual = np.maximum(q - kept, 0.0)
    sub_normalised = np.exp(theta) * accept + (1 - float((np.exp(theta) * accept).sum())) * residual / residual.sum()
    control = np.random.default_rng(1).choice(len(q), size=FIRST_TOKEN_SEEDS, p=sub_normalised / sub_normalised.sum())
    assert _first_token_p(control.tolist(), q, ratio) < LEVEL


def test_unequal_embedding_sizes_are_refused_before_an_engine_starts():
    """The padded pair (teacher 128 rows past the tokenizer, theta none), as Qwen2.5-7B with Qwen2.5-1.5B: vLLM's
    draft model needs equal sizes, so the mode refuses it by name, at once."""
    from dual_sampling import OptimalSamplingDual
    from dual_sampling.testing.tiny_models import TINY_PADDED_EXTRA_ROWS, tiny_pair

    teacher, theta = tiny_pair("padded")
    vocab = 49152
    with pytest.raises(ValueError, match=rf"{vocab + TINY_PADDED_EXTRA_ROWS} embedding rows.*theta {vocab}.*lockstep"):
        OptimalSamplingDual(teacher, theta, mode="speculative", use_tqdm=False)
