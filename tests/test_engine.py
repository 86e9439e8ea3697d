"""The dual engine on real vLLM CPU engines (tiny models), checked against independent oracles."""

from __future__ import annotations

import math
import os

import pytest
import torch

from alpha import geometric_mix, get_alpha_computer
from dual_sampling import OptimalSamplingDual, models
from dual_sampling.sync import SESSION_PREFIX
from tests.oracles import assert_records_match_rescoring, rescore

pytestmark = pytest.mark.engine

PROMPTS = ["Hello there", "The capital of France is", "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3, "x"]


def test_streams_identical_and_records_match_offline_rescoring(dual_engine, hf_models):
    teacher_prompts = [p + " (hint: think)" for p in PROMPTS]
    out = dual_engine.generate(PROMPTS, teacher_prompts=teacher_prompts, max_tokens=24, seed=3)
    t_model, th_model = hf_models
    checked = 0
    for req in out.requests:
        sample = req.samples[0]
        assert sample.error is None and sample.token_ids
        assert sample.teacher_token_ids == sample.theta_token_ids == sample.token_ids
        assert req.teacher_prompt_token_ids != req.theta_prompt_token_ids
        checked += assert_records_match_rescoring(req, t_model, th_model, dual_engine.vocab, "kl_symmetry")
    assert checked >= 4 * 10
    assert 0.0 < out.alpha_stats["std"]  # α really varies token by token


def test_temperature_and_top_k_shape_the_recorded_logq(dual_engine, hf_models):
    out = dual_engine.generate(PROMPTS[:2], max_tokens=12, temperature=0.7, top_k=50, seed=5)
    t_model, th_model = hf_models
    for req in out.requests:
        s = req.samples[0]
        lt = rescore(t_model, req.teacher_prompt_token_ids, s.token_ids, dual_engine.vocab)
        lth = rescore(th_model, req.theta_prompt_token_ids, s.token_ids, dual_engine.vocab)
        x = geometric_mix(lth, lt, get_alpha_computer("kl_symmetry")(lth, lt)) / 0.7
        kth = x.topk(50, dim=-1).values[:, -1:]
        x = torch.log_softmax(x.masked_fill(x < kth, -math.inf), -1)
        tok = torch.tensor(s.token_ids).unsqueeze(-1)
        assert torch.isfinite(x.gather(-1, tok)).all()  # every token inside the top-50 of q
        torch.testing.assert_close(torch.tensor(s.logq), x.gather(-1, tok).squeeze(-1).float(), atol=2e-4, rtol=0)


def test_greedy_picks_the_mode_of_q(dual_engine):
    out = dual_engine.generate(PROMPTS[:2], max_tokens=8, temperature=0.0)
    for req in out.requests:
        assert req.samples[0].logq == [0.0] * len(req.samples[0].token_ids)
    again = dual_engine.generate(PROMPTS[:2], max_tokens=8, temperature=0.0, seed=99)
    assert again.generated_ids == out.generated_ids


def test_same_seed_same_output_and_seeds_matter(dual_engine):
    a = dual_engine.generate(PROMPTS, max_tokens=16, seed=11, n=2)
    b = dual_engine.generate(PROMPTS, max_tokens=16, seed=11, n=2)
    c = dual_engine.generate(PROMPTS, max_tokens=16, seed=12, n=2)
    assert a.generated_ids == b.generated_ids
    assert [s.alpha for r in a.requests for s in r.samples] == [s.alpha for r in b.requests for s in r.samples]
    assert a.generated_ids != c.generated_ids


def test_many_requests_mixed_lengths_early_stops_no_timeouts(dual_engine):
    before = dual_engine.get_sync_statistics()
    prompts = [("word " * (1 + (7 * i) % 60)).strip() for i in range(14)]  # more than max_num_seqs=4
    common = [t for t, _ in zip(range(200, 49152, 97), range(400))]  # many stop ids: early EOS-like stops
    out = dual_engine.generate(prompts, max_tokens=30, n=2, seed=1, stop_token_ids=common, stop=["ing"])
    after = dual_engine.get_sync_statistics()
    lengths = out.num_tokens
    assert len(lengths) == 28 and min(lengths) < 30 and max(lengths) >= 1
    assert all(s.error is None for r in out.requests for s in r.samples)
    assert after["teacher_timeouts"] == before["teacher_timeouts"] and after["theta_timeouts"] == before["theta_timeouts"]
    for r in out.requests:
        for s in r.samples:
            assert s.teacher_token_ids == s.theta_token_ids
            if s.finish_reason == "stop" and s.token_ids and s.token_ids[-1] in common:
                assert len(s.token_ids) == len(s.alpha)


def test_admission_keeps_the_two_batches_in_phase(dual_engine):
    # A request taken in by one engine a step before the other makes every step of its life
    # a split step (the teacher's rows arrive in two theta steps). 12 requests of 20 tokens
    # through 4 seats give about 60 steps; a few split steps can come from the teacher catching
    # theta in the microseconds between two rows' step words, a misadmitted request from 20 on.
    before = dual_engine.get_sync_statistics()
    out = dual_engine.generate([("word " * (1 + 5 * i)).strip() for i in range(12)], max_tokens=20, min_tokens=20, seed=4)
    after = dual_engine.get_sync_statistics()
    assert out.num_tokens == [20] * 12
    steps = after["teacher_steps"] - before["teacher_steps"]
    split = after["split_steps"] - before["split_steps"]
    assert steps >= 40 and split < 5, (steps, split)


def test_n_and_best_of(dual_engine):
    out = dual_engine.generate(PROMPTS[:2], max_tokens=10, n=2, best_of=4, best_of_score="logp_theta", seed=2)
    full = dual_engine.generate(PROMPTS[:2], max_tokens=10, n=4, seed=2)
    for kept, everything in zip(out.requests, full.requests):
        assert len(kept.samples) == 2
        scores = sorted((math.fsum(s.logp_theta) for s in everything.samples), reverse=True)
        assert [math.fsum(s.logp_theta) for s in kept.samples] == pytest.approx(scores[:2])
        assert len({tuple(s.token_ids) for s in everything.samples}) > 1


def test_min_tokens_and_force_first_token(dual_engine):
    eos = dual_engine.eos_token_ids
    out = dual_engine.generate(PROMPTS[:2], max_tokens=6, min_tokens=6, stop_token_ids=list(range(0, 49152, 2)),
                               force_first_token=True, seed=4)
    for req in out.requests:
        s = req.samples[0]
        assert len(s.token_ids) == 6 and all(t % 2 == 1 and t not in eos for t in s.token_ids[:-1])
        assert s.alpha[0] == 1.0


def test_bad_generate_arguments_are_named(dual_engine):
    with pytest.raises(ValueError, match="temperature"):
        dual_engine.generate(["a"], temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        dual_engine.generate(["a"], top_p=0)
    with pytest.raises(ValueError, match="best_of"):
        dual_engine.generate(["a"], n=3, best_of=2)
    with pytest.raises(ValueError, match="prompts\\[1\\] is empty"):
        dual_engine.generate(["a", ""])
    with pytest.raises(ValueError, match="teacher_prompts has 1 entries"):
        dual_engine.generate(["a", "b"], teacher_prompts=["c"])
    with pytest.raises(ValueError, match="prompt 0 has"):
        dual_engine.generate(["word " * 400])
    with pytest.raises(ValueError, match="unsupported sampling options: presence_penalty"):
        dual_engine.generate(["a"], presence_penalty=0.5)


def test_construction_errors_before_any_engine_starts(tiny_same, tmp_path):
    teacher, theta = tiny_same
    _, foreign = models.tiny_pair("foreign")
    before = {f for f in os.listdir("/dev/shm") if f.startswith(SESSION_PREFIX)}
    with pytest.raises(ValueError, match="tokenizers differ"):
        OptimalSamplingDual(teacher, foreign)
    with pytest.raises(ValueError, match="unknown alpha method 'nope'"):
        OptimalSamplingDual(teacher, theta, alpha_method="nope")
    with pytest.raises(ValueError, match="alpha_min=0.9 > alpha_max=0.1"):
        OptimalSamplingDual(teacher, theta, alpha_min=0.9, alpha_max=0.1)
    with pytest.raises(FileNotFoundError, match="model_theta"):
        OptimalSamplingDual(teacher, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=1000 is too small"):
        OptimalSamplingDual(teacher, theta, kv_cache_memory_bytes=1000)
    assert {f for f in os.listdir("/dev/shm") if f.startswith(SESSION_PREFIX)} <= before


def test_padded_vocab_pair_and_cleanup():
    teacher, theta = models.tiny_pair("padded")
    with OptimalSamplingDual(teacher, theta, max_num_seqs=2, max_model_len=128, use_tqdm=False) as s:
        assert s.vocab == 49152
        name = s.session.name
        assert os.path.exists(f"/dev/shm/{name}")
        out = s.generate(PROMPTS[:3], max_tokens=12, seed=0)
        for r in out.requests:
            smp = r.samples[0]
            assert smp.error is None and all(t < s.vocab for t in smp.token_ids)
            assert smp.teacher_token_ids == smp.theta_token_ids
    assert not os.path.exists(f"/dev/shm/{name}")
