"""User score functions: best_of keeps the n best samples by them; every record carries the value and its name; a
function that raises fails its sample by name; a bad name is refused before anything runs."""

from __future__ import annotations

import math

import pytest

from dual_sampling.options import SamplingOptions
from dual_sampling.records import USER_SCORE, SampleRecord, best_of, scored
from tests.scores import odd_first_token_raises, response_length


def sample(text: str, tokens: list[int], **kw) -> SampleRecord:
    return SampleRecord(text=text, token_ids=tokens, finish_reason="length", seed=0, **kw)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.scores", "'module:function'"),
        ("no_such_module_here:f", "cannot be imported"),
        ("tests.scores:missing", "cannot be imported"),
        ("tests.scores:NOT_CALLABLE", "not callable"),
        (3, "'module:function'"),
    ],
)
def test_a_score_that_cannot_be_used_is_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=f"score.*{message}"):
        SamplingOptions(max_tokens=4, score=spec)


def test_a_score_is_recorded_with_its_name_and_a_failing_one_fails_the_sample():
    ok = scored(sample("abc", [1, 2]), "p", "tests.scores:response_length")
    assert ok.score == 3.0 and ok.score_name == "tests.scores:response_length" and ok.ok
    by_callable = scored(sample("abc", [1, 2]), "p", response_length)
    assert by_callable.score_name == "tests.scores:response_length"
    failed = scored(sample("abc", [3, 2]), "p", odd_first_token_raises)
    assert not failed.ok and failed.score is None
    assert failed.error.startswith(
        "score_error: tests.scores:odd_first_token_raises raised RuntimeError: an odd sample"
    )
    import numpy as np
    import torch

    for number in (np.float32(2.5), np.int64(3), torch.tensor(1.5)):
        assert scored(sample("x", [1]), "p", lambda prompt, s, value=number: value).score == float(number)
    for bad in (math.nan, math.inf, "3", True, None, 10**400, [1.0]):
        out = scored(sample("x", [1]), "p", lambda prompt, s, value=bad: value)
        assert not out.ok and out.score is None and "not a finite number" in out.error, bad
    # A sample that is not complete is left alone, never scored.
    aborted = sample("x", [1], error=None)
    aborted.finish_reason = "abort"
    assert scored(aborted, "p", response_length).score is None


def test_best_of_ranks_by_the_user_score_and_never_keeps_a_failed_sample():
    samples = [scored(sample("x" * k, [1] * (2 * k)), "p", response_length) for k in (3, 9, 1, 5)]
    samples.append(scored(sample("y" * 20, [1] * 3), "p", odd_first_token_raises))  # fails: never kept
    assert best_of(samples, 2, USER_SCORE) == [1, 3]
    # Equal scores keep their draw order (the engine test below relies on it when two texts have one length).
    tied = [scored(sample(text, [1] * 4), "p", response_length) for text in ("ab", "cde", "xy", "fgh", "z")]
    assert best_of(tied, 4, USER_SCORE) == [1, 3, 0, 2]
    assert SamplingOptions(max_tokens=4, score=response_length).ranked_by == USER_SCORE
    assert SamplingOptions(max_tokens=4).ranked_by == "logq"


def test_generate_keeps_the_best_by_the_score_among_the_same_draws(dual_engine):
    prompts = ["Once upon a time", "The answer is"]
    common = dict(max_tokens=10, seed=4)
    every = dual_engine.generate(prompts, n=4, **common)
    kept = dual_engine.generate(prompts, n=2, best_of=4, score=response_length, **common)
    for all_four, best in zip(every.requests, kept.requests):
        expected = sorted(all_four.samples, key=lambda s: -len(s.text))[:2]
        assert [s.seed for s in best.samples] == [s.seed for s in expected]
        assert [s.score for s in best.samples] == [float(len(s.text)) for s in expected]
        assert all(s.score_name == "tests.scores:response_length" for s in best.samples)
    # One prompt's samples through the asyncio API carry the score too; a raising function fails by name there.
    import asyncio

    one = asyncio.run(dual_engine.complete(prompts[0], score="tests.scores:response_length", **common))
    assert one.score == float(len(one.text))
    odd = [
        s
        for r in dual_engine.generate(prompts, n=4, score=odd_first_token_raises, **common).requests
        for s in r.samples
    ]
    assert {s.token_ids[0] % 2 for s in odd} == {0, 1}, "both branches must be seen"
    for s in odd:
        if s.token_ids[0] % 2:
            assert s.finish_reason == "error" and s.error.startswith("score_error: tests.scores:odd_first_token_raises")
        else:
            assert s.ok and s.score == float(s.token_ids[0])
