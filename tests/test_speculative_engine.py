"""``mode="speculative"`` on a real vLLM engine (the tiny pair): theta drafts inside the teacher's engine and the
teacher's step checks every draft against q (``processors.speculative``).

- Records (α, log π_t, log π_θ, log q) against re-scoring in plain transformers, with the lockstep mode's oracle
  and tolerance.
- Seeds reproduce whatever else is in the batch; the acceptance counters add up; what the mode cannot serve is
  refused by name.

The mode on the model families users run (padded vocabularies, the pairs it refuses) and the tests of its draws are
in ``tests/test_twin_matrix.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.oracles import assert_records_match_rescoring

pytestmark = pytest.mark.engine

GAMMA = 3


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
        with pytest.raises(BadRequestError, match="use_beam_search is served in mode='lockstep' only"):
            client.chat.completions.create(
                model="dual", messages=messages, max_tokens=4, n=2, extra_body={"use_beam_search": True}
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
        ({"use_beam_search": True, "n": 2}, "use_beam_search is served in mode='lockstep' only"),
    ],
)
def test_what_the_mode_cannot_serve_is_refused_by_name(spec_engine, options, named):
    with pytest.raises(ValueError, match=named):
        spec_engine.generate([PROMPTS[0]], max_tokens=4, **options)


def test_pause_with_keep_is_refused_by_name(spec_engine):
    with pytest.raises(ValueError, match="mode='keep' is served in mode='lockstep' only"):
        spec_engine.pause("keep")
    assert not spec_engine.paused


def test_theta_takes_new_weights_as_the_draft_model_and_the_records_follow(spec_engine, hf_models, tiny_same):
    """θ drafts inside the teacher's engine; vLLM updates a draft model only through its weight-transfer engine's draft
    start. A state dict of a changed θ (its MLPs and embedding halved: exact in float32; the embedding is the output
    projection too if tied) goes in; the next records re-score against it, not the θ the engine started with, and the
    teacher's against the teacher (nothing of the target moved); a NaN is refused by name and changes nothing; the
    folder θ started from (sent as a chunk) puts it back, and the records re-score against it again."""
    import copy
    import math

    hf_teacher, hf_theta = hf_models
    changed = copy.deepcopy(hf_theta)
    with torch.no_grad():
        for name, param in changed.named_parameters():
            if ".mlp." in name or "embed_tokens" in name:
                param.mul_(0.5)
    version = spec_engine.update_theta(changed.state_dict())
    out = spec_engine.generate(PROMPTS, max_tokens=16, n=2, seed=9)
    assert all(s.theta_version == version for s in samples(out))
    checked = sum(
        assert_records_match_rescoring(r, hf_teacher, changed, spec_engine.vocab, "kl_symmetry") for r in out.requests
    )
    assert checked == sum(len(s.token_ids) for s in samples(out)) > 0
    with pytest.raises(AssertionError):  # the oracle tells the two θ apart on these records
        for r in out.requests:
            assert_records_match_rescoring(r, hf_teacher, hf_theta, spec_engine.vocab, "kl_symmetry")

    poisoned = {k: v.clone() for k, v in hf_theta.state_dict().items()}
    poisoned["model.norm.weight"][0] = math.nan
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' holds a NaN"):
        spec_engine.update_theta(poisoned)
    assert spec_engine.weight_versions["theta"] == version

    spec_engine.update_theta(str(tiny_same[1]), version="as-started")
    out = spec_engine.generate(PROMPTS, max_tokens=16, n=2, seed=9)
    checked = sum(
        assert_records_match_rescoring(r, hf_teacher, hf_theta, spec_engine.vocab, "kl_symmetry") for r in out.requests
    )
    assert checked > 0 and all(s.theta_version == "as-started" for s in samples(out))


def test_distillation_runs_two_rounds_with_theta_drafting(spec_engine, tiny_same, tmp_path):
    """Each round pushes the trainer's θ into the draft model; the per-round sampler check (the records' log π_θ
    against the trainer's θ on the round's first batch) stops a run whose engine kept an older θ, so two rounds
    passing it means each round drew from the θ the trainer held. loss='reverse_full': the mode records no top k."""
    from dual_sampling.distill import DistillConfig, Distiller
    from dual_sampling.options import EngineOptions, SamplingOptions
    from tests.distill_runs import small_run, write_prompts

    prompts = write_prompts(tmp_path / "prompts.jsonl")
    engine = EngineOptions(mode="speculative", num_speculative_tokens=GAMMA)
    settings = small_run(tiny_same, prompts, tmp_path, engine=engine, loss="reverse_full", eval_max_tokens=8, rounds=2)
    config = DistillConfig(
        **settings,
        prompts_per_round=8,
        steps_per_round=2,
        learning_rate=1e-3,
        plot=False,
        sampling=SamplingOptions(max_tokens=12),
    )
    try:
        rows = Distiller(config, spec_engine).run()
        assert [r["round"] for r in rows] == [0, 1, 2]
        assert spec_engine.weight_versions["theta"] == "round-2"
        assert all(r["sampler_mismatch_max"] <= config.max_sampler_mismatch for r in rows[1:])
    finally:
        spec_engine.update_theta(str(tiny_same[1]), version="after-distillation")
