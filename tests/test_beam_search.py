"""Beam search over q (``OptimalSamplingDual.beam_search``, ``dual_sampling.beams``).

Checked against an independent beam search over a known table of log q (float64, written here from vLLM's
procedure), and on the engines: every returned beam's records against transformers re-scoring in float64, and
width 1 against greedy decoding of q.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from dual_sampling.beams import BeamSearchOptions, Candidates, run_beam_search
from tests.oracles import assert_records_match_rescoring

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
        scores = [b.cum_logq / len(b.tokens) for b in beams]
        assert scores == sorted(scores, reverse=True)
    greedy = dual_engine.generate(prompts, max_tokens=6, temperature=0.0)
    for (best,), sample in zip(dual_engine.beam_search(prompts, beam_width=1, max_tokens=6), greedy.requests):
        assert best.tokens == sample.samples[0].token_ids
    with pytest.raises(ValueError, match="max_tokens=300 does not fit"):
        dual_engine.beam_search(prompts, beam_width=2, max_tokens=300)
