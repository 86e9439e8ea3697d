"""Beam search over q (``OptimalSamplingDual.beam_search``, ``dual_sampling.beams``).

Checked against an independent beam search over a known table of log q (float64, written here from vLLM's
procedure), and on the engines: every returned beam's records against transformers re-scoring in float64, and
width 1 against greedy decoding of q.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest

from dual_sampling.beams import BeamSearchOptions, Candidates, beam_samples, run_beam_search
from dual_sampling.options import SamplingOptions
from tests.oracles import assert_records_match_rescoring, rescore
from tests.tolerances import RESCORE_ATOL

VOCAB, EOS = 6, 0


def table_logq(prefix: list[int]) -> np.ndarray:
    """A fixed log q over 6 tokens after ``prefix`` (a hash of it seeds the row)."""
    rng = np.random.default_rng(abs(hash(tuple(prefix))) % (2**32))
    x = 2.5 * rng.standard_normal(VOCAB)
    return x - np.logaddexp.reduce(x)


def oracle_beam_search(width: int, max_tokens: int, length_penalty: float) -> list[tuple[list[int], float]]:
    """vLLM's procedure, written out: per step every beam's 2·width best tokens, EOS ends a beam, the width best
    of the rest by score live on; at the end everything ranked by score."""

    def score(tokens, cum):
        length = len(tokens) - (1 if tokens and tokens[-1] == EOS else 0)
        return cum / max(length, 1) ** length_penalty

    live, done = [([], 0.0)], []
    for _ in range(max_tokens):
        nxt = []
        for tokens, cum in live:
            row = table_logq(tokens)
            for t in np.argsort(-row, kind="stable")[: 2 * width]:
                (done if t == EOS else nxt).append(([*tokens, int(t)], cum + float(row[t])))
        live = sorted(nxt, key=lambda b: score(*b), reverse=True)[:width]
    return sorted(done + live, key=lambda b: score(*b), reverse=True)[:width]


def table_step(prefixes):
    out = []
    for _teacher, theta in prefixes:
        row = table_logq(theta[1:])  # the prompt is one token
        top = np.argsort(-row, kind="stable")[:20]
        out.append(Candidates(top.tolist(), row[top].tolist(), (row[top] - 1).tolist(), (row[top] - 2).tolist(), 0.5))
    return out


@pytest.mark.parametrize(("width", "length_penalty"), [(1, 1.0), (2, 1.0), (3, 0.0), (4, 2.0)])
def test_beams_are_the_procedures_on_a_known_table(width, length_penalty):
    options = BeamSearchOptions(beam_width=width, max_tokens=5, length_penalty=length_penalty)
    (got,) = run_beam_search([([9], [9])], options, [EOS], lambda p: table_step(p)[: len(p)])
    want = oracle_beam_search(width, 5, length_penalty)
    assert [b.tokens for b in got] == [tokens for tokens, _ in want]
    for beam, (_, cum) in zip(got, want):
        assert math.isclose(beam.cum_logq, cum, abs_tol=1e-9)
        assert beam.logp_teacher == [x - 1 for x in beam.logq] and beam.alpha == [0.5] * len(beam.tokens)
        assert beam.finish_reason == ("stop" if beam.tokens[-1] == EOS else "length")


@pytest.mark.parametrize(
    ("field", "value"), [("beam_width", 0), ("beam_width", 11), ("max_tokens", 0), ("length_penalty", math.nan)]
)
def test_bad_beam_settings_are_refused_by_name(field, value):
    settings = {"beam_width": 2, "max_tokens": 4, field: value}
    with pytest.raises(ValueError, match=field):
        BeamSearchOptions(**settings)


def test_beams_on_the_engines_carry_exact_records_and_width_one_is_greedy(dual_engine, hf_models):
    prompts = ["Once upon a time", "The answer is"]
    results = dual_engine.beam_search(prompts, beam_width=3, max_tokens=6)
    vocab = dual_engine.vocab
    for prompt, beams in zip(prompts, results):
        assert len(beams) == 3 and len({tuple(b.tokens) for b in beams}) == 3
        ids = dual_engine.prepare(prompt).theta_ids
        request = SimpleNamespace(
            teacher_prompt_token_ids=ids,
            theta_prompt_token_ids=ids,
            samples=[
                SimpleNamespace(
                    token_ids=b.tokens, alpha=b.alpha, logp_teacher=b.logp_teacher, logp_theta=b.logp_theta,
                    logq=b.logq, error=None,
                )
                for b in beams
            ],
        )  # fmt: skip
        assert_records_match_rescoring(request, *hf_models, vocab, "kl_symmetry")
        # The ranking by its definition: mean log q per token, a final EOS not counted as a token.
        lengths = [len(b.tokens) - (b.tokens[-1] in dual_engine.eos_token_ids) for b in beams]
        scores = [b.cum_logq / max(n, 1) for b, n in zip(beams, lengths)]
        assert scores == sorted(scores, reverse=True)
    greedy = dual_engine.generate(prompts, max_tokens=6, temperature=0.0)
    for prompt, (best,), sample in zip(
        prompts, dual_engine.beam_search(prompts, beam_width=1, max_tokens=6), greedy.requests
    ):
        assert best.tokens == sample.samples[0].token_ids
        # Width one is greedy on q itself: each token is the argmax of the float64 mixture of re-scored rows at its α
        # (a near tie, within float32 rounding, may go either way).
        ids = dual_engine.prepare(prompt).theta_ids
        teacher, theta = (rescore(model, ids, best.tokens, vocab) for model in hf_models)
        for t, token in enumerate(best.tokens):
            mixed = (1 - best.alpha[t]) * theta[t] + best.alpha[t] * teacher[t]
            # Two values each within RESCORE_ATOL of the engine's: their gap within twice it.
            assert float(mixed.max() - mixed[token]) < 2 * RESCORE_ATOL, (prompt, t)
    with pytest.raises(ValueError, match="max_tokens=300 does not fit"):
        dual_engine.beam_search(prompts, beam_width=2, max_tokens=300)


# ---------------------------------------------------------------- beam search as a request's samples (use_beam_search)


def _a_valid_other_value(name: str):
    """A value of setting ``name`` that SamplingOptions takes without beam search and that is not its default (the
    first that works of a few tries), or None."""
    default = getattr(SamplingOptions(), name)
    tries = [1, 2, True, ["x"], [1], {1: 1.0}, "logq_mean"]
    if isinstance(default, float):
        tries[:0] = [default + 0.5, default - 0.5]
    for value in tries:
        try:
            if getattr(SamplingOptions(max_tokens=8, **{name: value}), name) != default:
                return value
        except (ValueError, TypeError):
            continue
    return None


def test_every_setting_a_search_does_not_read_is_refused_by_name_with_use_beam_search():
    ignored = [f.name for f in dataclasses.fields(SamplingOptions) if not f.metadata.get("beam_search")]
    assert {"temperature", "stop", "best_of", "repetition_penalty", "top_logprobs"} <= set(ignored)
    for name in ignored:
        value = _a_valid_other_value(name)
        assert value is not None, f"no non-default value of {name} found to test with"
        with pytest.raises(ValueError, match=rf"^{name} is not used by beam search"):
            SamplingOptions(max_tokens=8, use_beam_search=True, **{name: value})
    search = SamplingOptions(max_tokens=8, n=3, seed=5, use_beam_search=True, length_penalty=0).beam_search()
    assert search == BeamSearchOptions(beam_width=3, max_tokens=8, length_penalty=0.0)


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"length_penalty": 0.5}, "length_penalty"),  # without use_beam_search
        ({"use_beam_search": True, "length_penalty": math.inf}, "length_penalty"),
        ({"use_beam_search": True, "n": 11}, "n"),
        ({"use_beam_search": "yes"}, "use_beam_search"),
    ],
)
def test_bad_beam_search_options_are_named(settings, field):
    with pytest.raises(ValueError, match=rf"^{field}"):
        SamplingOptions(**settings)


def _fake_stream(row_logq, versions=lambda step: ("0", "0"), fail_at=None):
    """A driver stream over the known table: each one-token request's delta reports q's 20 best tokens after its
    prefix (prompt [9]); ``fail_at``: the step whose requests fail; ``versions``: the weights of each step."""
    calls = {"step": 0}

    def make_request(teacher, theta):
        return theta[1:]

    async def stream(prefix):
        step = len(prefix)
        calls["step"] = max(calls["step"], step)
        row = row_logq(prefix)
        top = np.argsort(-row, kind="stable")[:20]
        records = np.array([[0.5, 0, 0, 0]], dtype=np.float32)
        top_arrays = (top[None], row[top][None], row[top][None] - 1, row[top][None] - 2)
        teacher_version, theta_version = versions(step)
        error = "sync_timeout at step 1" if step == fail_at else None
        sample = SimpleNamespace(error=error, teacher_version=teacher_version, theta_version=theta_version)
        yield SimpleNamespace(top=top_arrays, records=records, sample=None)
        yield SimpleNamespace(top=None, records=records[:0], sample=sample)

    return stream, make_request


def test_beam_samples_are_the_searchs_beams_and_a_failure_or_a_weight_change_fails_them_all():
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: " ".join(map(str, ids)))
    options = BeamSearchOptions(beam_width=3, max_tokens=5, length_penalty=1.0)

    def search(**fake):
        stream, make_request = _fake_stream(table_logq, **fake)
        return asyncio.run(beam_samples(stream, make_request, ([9], [9]), options, [EOS], tokenizer, [11, 12, 13]))

    got = search(versions=lambda step: ("t1", "th2"))
    want = oracle_beam_search(3, 5, 1.0)
    assert [(s.teacher_version, s.theta_version) for s in got] == [("t1", "th2")] * 3
    assert [s.token_ids for s in got] == [tokens for tokens, _ in want]
    for sample, (tokens, cum) in zip(got, want):
        assert sample.ok and sample.teacher_token_ids == sample.theta_token_ids == tokens
        assert math.isclose(math.fsum(sample.logq), cum, abs_tol=1e-9)
        assert sample.logp_theta == [x - 2 for x in sample.logq] and sample.alpha == [0.5] * len(tokens)
        assert sample.stop_reason == (EOS if sample.finish_reason == "stop" else None)
        shown = tokens[:-1] if sample.finish_reason == "stop" else tokens  # an ending EOS's text left out
        assert sample.text == " ".join(map(str, shown))
    assert [s.seed for s in got] == [11, 12, 13]
    failed = search(fail_at=3)
    assert len(failed) == 3
    assert all(s.finish_reason == "error" and "beam_search_failed" in s.error and not s.token_ids for s in failed)
    mixed = search(versions=lambda step: ("0", "1" if step >= 2 else "0"))
    assert len(mixed) == 3 and all(s.finish_reason == "error" and s.error.startswith("weight_update") for s in mixed)
    assert all(not s.ok for s in failed + mixed)


def test_generate_with_use_beam_search_returns_the_beams_as_samples(dual_engine, hf_models):
    """generate(use_beam_search=True): per prompt the n beams of beam_search(), best first, as SampleRecords with
    the records re-scoring gives, seeds derived as a sample's, and EOS-ended beams naming their stop token."""
    prompts = ["Once upon a time", "The answer is"]
    out = dual_engine.generate(
        prompts, prompt_keys=["a", "b"], max_tokens=6, n=3, seed=4, use_beam_search=True, length_penalty=0.5
    )
    direct = dual_engine.beam_search(prompts, beam_width=3, max_tokens=6, length_penalty=0.5)
    sampled = dual_engine.generate(prompts, prompt_keys=["a", "b"], max_tokens=1, n=3, seed=4)
    for request, beams, plain in zip(out.requests, direct, sampled.requests):
        assert [s.token_ids for s in request.samples] == [b.tokens for b in beams]
        assert [s.seed for s in request.samples] == [s.seed for s in plain.samples]  # as a sampled request's
        for sample, beam in zip(request.samples, beams):
            assert sample.ok and sample.finish_reason == beam.finish_reason and sample.text == beam.text
            assert sample.teacher_token_ids == sample.theta_token_ids == beam.tokens
            assert sample.stop_reason == (beam.tokens[-1] if beam.finish_reason == "stop" else None)
        assert_records_match_rescoring(request, *hf_models, dual_engine.vocab, "kl_symmetry")
    with pytest.raises(ValueError, match="stream"):
        asyncio.run(anext(dual_engine.stream("Hi", use_beam_search=True, n=2, max_tokens=3)))
    with pytest.raises(ValueError, match="^temperature is not used by beam search"):
        dual_engine.generate(prompts, n=2, max_tokens=3, use_beam_search=True, temperature=0.7)
