"""Diverse groups: with n > 1 and a diversity_penalty λ, the samples of one prompt are decided in order at each step,
and member i draws from q_i(y) ∝ q(y)·exp(−λ·c_i(y)), c_i(y) counting the earlier members that took y at that step.

Checked against float64: the decision with given counts (reference and CPU kernel), and on the engines the law of
member 2's first token given member 1's (chi-square of randomised PITs, with a positive control), every
member's log q and both models' log-probabilities.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from alpha import get_alpha_computer
from dual_sampling.decision.pipeline import ModelRows, RowSampling, decide
from dual_sampling.options import SamplingOptions
from tests.draws import _chi_square_p, pits
from tests.oracles import rescore
from tests.tolerances import ALPHA_TWO_RUNS_ATOL, RESCORE_ATOL, one_normalisation_atol


def test_a_members_law_is_q_divided_by_exp_lambda_per_earlier_member():
    vocab, b = 5000, 4
    g = torch.Generator().manual_seed(2)
    teacher, theta = 3 * torch.randn(b, vocab, generator=g), 2 * torch.randn(b, vocab, generator=g)
    z = 0.6 * torch.log_softmax(theta.double(), -1) + 0.4 * torch.log_softmax(teacher.double(), -1)
    # Earlier members took q's likeliest tokens, so the penalty moves every row's law well past the tolerance.
    top = z.topk(2, dim=-1).indices.tolist()
    taken = [{}, {top[1][0]: 1}, {top[2][0]: 2, top[2][1]: 1}, {int(teacher[3].argmax()): 1}]
    rows = [RowSampling(seed=r, diversity_penalty=1.5, group=9, member=r, temperature=0.8) for r in range(b)]
    rows[1].temperature = 1.0  # the kernel takes this row; the others (tempered) go to the reference
    computer = get_alpha_computer("fixed", alpha=0.4)
    d = decide(ModelRows.pair(teacher, theta), [3] * b, rows, computer, diversity=taken)
    assert bool(d.handed_back.sum() == 0)
    # Two float32 log-softmaxes feed the mixture and one more normalises it, at V = 5000 (past SMALL_VOCAB); the
    # mixture's row constants cancel, so twice one normalisation's bound.
    tol = 2 * one_normalisation_atol(vocab)
    for r in range(b):
        x = z[r] / rows[r].temperature
        plain = torch.log_softmax(x, -1)
        for token, count in taken[r].items():
            x[token] -= 1.5 * count
        logq = torch.log_softmax(x, -1)
        assert abs(float(d.logq[r]) - float(logq[d.tokens[r]])) < tol, r
        if taken[r]:  # the control: the unpenalised law is far from what was recorded, past both laws' tolerances
            assert abs(float(d.logq[r]) - float(plain[d.tokens[r]])) > 2 * tol, r
    with pytest.raises(ValueError, match="diversity_penalty"):
        SamplingOptions(max_tokens=4, diversity_penalty=-0.1)


def test_member_two_follows_q_without_member_ones_token(dual_engine, hf_models):
    # Two prompts per call (four samples, the engine's four slots): both members of each group decide their first
    # token at the same engine step. Temperature 0.2 puts most of q on a few tokens, and λ = 10 all but removes
    # member 1's token for member 2.
    prompt, lam, temperature, calls = "Once upon a time", 10.0, 0.2, 150
    pairs, alphas, models = [], [], []
    for call in range(calls):
        out = dual_engine.generate(
            [prompt] * 2, n=2, max_tokens=1, temperature=temperature, diversity_penalty=lam, seed=call
        )
        for r in out.requests:
            first, second = r.samples
            assert first.ok and second.ok
            pairs.append((first.token_ids[0], second.token_ids[0], first.logq[0], second.logq[0]))
            alphas.append(first.alpha[0])
            models.append([(m.token_ids[0], m.logp_teacher[0], m.logp_theta[0]) for m in (first, second)])
    request = out.requests[0]
    vocab = dual_engine.vocab
    lt = rescore(hf_models[0], request.teacher_prompt_token_ids, [0], vocab)[0]
    lth = rescore(hf_models[1], request.theta_prompt_token_ids, [0], vocab)[0]
    a = float(np.median(alphas))  # one α: the same rows at every call
    assert max(alphas) - min(alphas) < ALPHA_TWO_RUNS_ATOL
    # Both members record the models' own log-probabilities, untouched by the group's penalty.
    for token, logp_teacher, logp_theta in (m for both in models for m in both):
        assert (
            abs(logp_teacher - float(lt[token])) < RESCORE_ATOL and abs(logp_theta - float(lth[token])) < RESCORE_ATOL
        )
    x = ((1 - a) * lth + a * lt) / temperature
    q = torch.softmax(x, -1).numpy()
    rng = np.random.default_rng(0)
    together, diverse_pits, plain_pits = [], [], []
    for y0, y1, logq0, logq1 in pairs:
        law = q.copy()
        law[y0] *= np.exp(-lam)
        law /= law.sum()
        assert abs(logq0 - np.log(q[y0])) < 1e-4, y0
        if abs(logq1 - np.log(law[y1])) >= 1e-4:
            # Member 2 admitted a step after member 1 (its arrival later than GROUP_WAIT_S, as on a loaded machine:
            # docs/theory.md) draws from q itself, and its record must say so.
            assert abs(logq1 - np.log(q[y1])) < 1e-4, (y0, y1)
            continue
        together.append((y0, y1))
        v = rng.random()
        diverse_pits.append(pits(law, np.array([y1]), np.array([v]), order_by=q)[0])
        plain_pits.append(pits(q, np.array([y1]), np.array([v]))[0])
    assert len(together) >= len(pairs) // 2, f"only {len(together)} of {len(pairs)} groups stepped together"

    def p_value(u):
        return _chi_square_p(np.bincount(np.minimum((np.array(u) * 10).astype(int), 9), minlength=10), len(u) / 10)

    assert sum(y0 == y1 for y0, y1 in together) < 0.5 * sum(q[y0] for y0, _ in together)
    assert p_value(diverse_pits) > 1e-3
    assert p_value(plain_pits) < 1e-4, "the control (member 2 judged under q itself) must be rejected"


def test_a_sample_outside_a_group_has_no_place_in_one():
    # generate() numbers every draw; only a diverse group keeps the number (the speculative mode refuses any other
    # RowSampling field away from its default, and drew n = 2 through generate()).
    from dual_sampling.driver.requests import DualRequest
    from dual_sampling.driver.speculative_driver import check_speculative

    row = SamplingOptions(max_tokens=4).row(7, (2,), (5, 6), group=0, member=1, group_size=2)
    assert (row.group, row.member, row.group_size) == (0, 0, 1) and not row.diverse
    check_speculative(DualRequest([5, 6, 7], [5, 6, 7], row, 4))
    grouped = SamplingOptions(max_tokens=4, diversity_penalty=1.0).row(7, (2,), (), group=9, member=1, group_size=2)
    assert (grouped.group, grouped.member, grouped.group_size) == (9, 1, 2) and grouped.diverse
