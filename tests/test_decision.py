"""The per-token decision (dual_sampling.decision.pipeline) against direct references."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from alpha import get_alpha_computer
from dual_sampling.decision.pipeline import (
    ModelRows,
    RowSampling,
    counter_uniform,
    decide,
    draw_tokens,
    inverse_cdf,
)
from dual_sampling.decision.result import dense_top
from dual_sampling.decision.stages import keep_top_k_top_p
from dual_sampling.options import SamplingOptions
from dual_sampling.records import own_and_other
from tests.oracles import np_alpha_kl, np_mix
from tests.tolerances import (
    ALPHA_ATOL,
    F32_U,
    ONE_NORMALISATION_ATOL,
    TWO_NORMALISATIONS_ATOL,
    one_normalisation_atol,
    sum_roundings,
)


@pytest.mark.parametrize("vocab", [1, 7, 256, 1000, 49152])
def test_inverse_cdf_matches_a_full_float64_cdf(vocab):
    g = torch.Generator().manual_seed(vocab)
    # Unnormalised weights, a different scale per row: the draw must not assume a sum of 1.
    p = torch.softmax(torch.randn(16, vocab, generator=g) * 3, -1) * torch.rand(16, 1, generator=g) * 50
    if vocab > 1:
        p[:, ::5] = 0
    u = torch.rand(16, generator=g, dtype=torch.float64)
    cdf = torch.cumsum(p.double(), -1)
    expected = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    index, total = inverse_cdf(p, u)
    assert torch.equal(index, expected)
    # Totals: float32 sums of inverse_cdf's 256-token blocks carried in float64, each within its roundings (relative).
    torch.testing.assert_close(total, cdf[:, -1], rtol=sum_roundings(256) * F32_U, atol=0)


def test_draw_accepts_unnormalised_log_q_and_leaves_it_alone():
    g = torch.Generator().manual_seed(5)
    logq = torch.log_softmax(torch.randn(6, 300, generator=g), -1)
    shifted = logq + torch.randn(6, 1, generator=g) * 20  # a per-row constant changes nothing
    before = shifted.clone()
    rows = [RowSampling(seed=i, temperature=0.7, top_p=0.9, min_tokens=3, stop_token_ids=(1,)) for i in range(6)]
    t1, lq1, _, _ = draw_tokens(logq, logq, [0] * 6, rows)
    t2, lq2, _, _ = draw_tokens(shifted, logq, [0] * 6, rows)
    assert torch.equal(shifted, before)
    assert torch.equal(t1, t2)
    torch.testing.assert_close(lq1, lq2, rtol=0, atol=TWO_NORMALISATIONS_ATOL)
    # The oracle: the same stages written out in float64.
    x = (logq.double() / 0.7).clone()
    x[:, 1] = -math.inf
    p = torch.softmax(x, -1)
    order = torch.sort(p, -1, descending=True)
    above = torch.cumsum(order.values, -1) - order.values
    keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order.indices, above < 0.9)
    ref = torch.log_softmax(x.masked_fill(~keep, -math.inf), -1)
    # The shifted rows reach |x| ≈ 100 after the temperature, past the 64 ONE_NORMALISATION_ATOL assumes: twice it.
    torch.testing.assert_close(
        lq2.double(), ref.gather(-1, t2.unsqueeze(-1)).squeeze(-1), rtol=0, atol=TWO_NORMALISATIONS_ATOL
    )


def test_draw_frequencies_follow_q():
    q = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    draws = 20000
    logq = q.log().expand(draws, -1).contiguous()
    rows = [RowSampling(seed=s) for s in range(draws)]
    tokens, logq_token, ok, _ = draw_tokens(logq, logq, [0] * draws, rows)
    assert ok.all()
    freq = torch.bincount(tokens, minlength=6).double() / draws
    sigma = torch.sqrt(q.double() * (1 - q.double()) / draws)
    assert ((freq - q.double()).abs() <= 4 * sigma + 1e-12).all(), freq
    torch.testing.assert_close(logq_token, q.log()[tokens], rtol=0, atol=ONE_NORMALISATION_ATOL)


def test_counter_uniform_is_uniform_and_reproducible():
    u = np.array([counter_uniform(7, s) for s in range(20000)])
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.005
    assert counter_uniform(7, 3) != counter_uniform(8, 3)
    # Reproducible means in another process too (a resumed run draws its remaining samples there).
    code = "from dual_sampling.decision.pipeline import counter_uniform as c; print([c(7, s) for s in (0, 3, 19999)])"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str([float(u[0]), float(u[3]), float(u[19999])])


def test_top_k_top_p_min_p_masks_match_reference():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -math.inf]])
    p = np.exp(logits.numpy()[0] - np.logaddexp.reduce(logits.numpy()[0]))
    keep = keep_top_k_top_p(logits, torch.tensor([3]), torch.tensor([1.0]))
    assert keep[0].tolist() == [True, True, True, False, False, False]
    # top_p keeps the smallest prefix whose mass reaches p
    cut = 0.8
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    expected = np.zeros(6, dtype=bool)
    expected[order[before < cut]] = True
    assert keep_top_k_top_p(logits, torch.tensor([-1]), torch.tensor([cut]))[0].tolist() == expected.tolist()
    keep = keep_top_k_top_p(logits, torch.tensor([-1]), torch.tensor([1.0]), torch.tensor([0.3]))
    assert keep[0].tolist() == (p >= 0.3 * p.max()).tolist()
    assert keep_top_k_top_p(logits, torch.tensor([-1]), torch.tensor([1.0]), torch.tensor([0.0])) is None


def test_temperature_min_tokens_bias_and_greedy():
    logq = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, 0.0]]), -1)
    t, lq, _, _ = draw_tokens(logq, logq, [0], [RowSampling(temperature=0.0)])
    assert t.item() == 0 and lq.item() == 0.0
    t, lq, _, _ = draw_tokens(logq, logq, [0], [RowSampling(temperature=0.0, min_tokens=2, stop_token_ids=(0,))])
    assert t.item() == 1
    t, _, _, _ = draw_tokens(logq, logq, [5], [RowSampling(temperature=0.0, min_tokens=2, stop_token_ids=(0,))])
    assert t.item() == 0  # min_tokens reached: stop tokens allowed again
    t, _, _, _ = draw_tokens(logq, logq, [0], [RowSampling(temperature=0.0, logit_bias={3: 10.0})])
    assert t.item() == 3
    tempered = torch.log_softmax(logq / 0.5, -1)
    t, lq, _, _ = draw_tokens(logq, logq, [0], [RowSampling(seed=1, temperature=0.5)])
    assert lq.item() == pytest.approx(tempered[0, t.item()].item(), abs=TWO_NORMALISATIONS_ATOL)  # float32, twice


def test_support_constraint_and_empty_rows():
    lt = torch.log_softmax(torch.tensor([[5.0, 4.0, -5.0, -6.0]]), -1)
    logq = torch.log_softmax(torch.tensor([[-5.0, -5.0, 5.0, 5.0]]), -1)
    t, _, ok, _ = draw_tokens(logq, lt, [0], [RowSampling(seed=3, teacher_support_top_k=2)])
    assert ok.item() and t.item() in (0, 1)
    t, _, ok, _ = draw_tokens(
        logq, lt, [0], [RowSampling(seed=3, teacher_support_top_k=1, min_tokens=1, stop_token_ids=(0,))]
    )
    assert not ok.item()


def test_decide_records_match_float64_references():
    g = torch.Generator().manual_seed(0)
    teacher, theta = torch.randn(3, 50, generator=g) * 3, torch.randn(3, 50, generator=g)
    rows = [RowSampling(seed=i, force_first_token=(i == 0)) for i in range(3)]
    d = decide(ModelRows.pair(teacher, theta), [0, 0, 4], rows, get_alpha_computer("kl_symmetry"))
    lt, lth = torch.log_softmax(teacher.double(), -1).numpy(), torch.log_softmax(theta.double(), -1).numpy()
    # α: the forced first step's is 1; the others are the float64 bisection's root (not the alpha package).
    root = [1.0] + [np_alpha_kl(lth[i], lt[i]) for i in (1, 2)]
    torch.testing.assert_close(d.alpha.double(), torch.tensor(root, dtype=torch.float64), atol=ALPHA_ATOL, rtol=0)
    tokens = d.tokens.tolist()
    one = ONE_NORMALISATION_ATOL
    assert d.logp[:, 0].tolist() == pytest.approx([lt[i, t] for i, t in enumerate(tokens)], abs=one)
    assert d.logp[:, 1].tolist() == pytest.approx([lth[i, t] for i, t in enumerate(tokens)], abs=one)
    logq = [math.log(np_mix(lth[i], lt[i], float(d.alpha[i]))[t]) for i, t in enumerate(tokens)]
    assert d.logq.tolist() == pytest.approx(logq, abs=ONE_NORMALISATION_ATOL)


def test_top_logprobs_are_the_final_distributions_most_likely_tokens():
    g = torch.Generator().manual_seed(9)
    logq = torch.log_softmax(torch.randn(3, 500, generator=g) * 2, -1)
    rows = [RowSampling(seed=i, temperature=0.8, top_k=40, top_logprobs=5) for i in range(3)]
    drawn = draw_tokens(logq.clone(), logq, [0] * 3, rows, top_logprobs=5)
    ids, top = drawn.top
    # Reference: temperature, then top-k, then normalise, in float64.
    x = logq.double() / 0.8
    kth = x.topk(40, -1).values[:, -1:]
    ref = torch.log_softmax(x.masked_fill(x < kth, -math.inf), -1)
    ref_vals, ref_ids = ref.topk(5, -1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(top.double(), ref_vals, atol=ONE_NORMALISATION_ATOL, rtol=0)
    torch.testing.assert_close(
        drawn.logq.double(), ref.gather(-1, drawn.tokens.unsqueeze(-1)).squeeze(-1), atol=ONE_NORMALISATION_ATOL, rtol=0
    )


def test_a_huge_logit_bias_is_clamped_and_draws_its_token_with_a_finite_logq():
    """A bias of 1e39 overflowed float32 to inf: q held NaN, a wrong token was drawn with log q = NaN and ok=True."""
    g = torch.Generator().manual_seed(4)
    teacher, theta = torch.randn(2, 50, generator=g), torch.randn(2, 50, generator=g)
    rows = [RowSampling(seed=1, logit_bias={7: 1e39}), RowSampling(seed=2, logit_bias={7: -1e39, 8: float("inf")})]
    assert rows[0].logit_bias == {7: 100.0} and rows[1].logit_bias == {7: -100.0, 8: 100.0}
    assert RowSampling.from_dict(rows[1].to_dict()) == rows[1]
    d = decide(ModelRows.pair(teacher, theta), [0, 0], rows, get_alpha_computer("kl_symmetry"))
    assert d.tokens.tolist() == [7, 8] and bool(d.ok.all())
    assert torch.isfinite(d.logq).all() and d.logq.tolist() == pytest.approx([0.0, 0.0], abs=1e-6)
    with pytest.raises(ValueError, match=r"logit_bias\[3\] is NaN"):
        RowSampling(logit_bias={3: float("nan")})


def test_the_options_hold_the_logit_bias_the_rows_apply():
    """Records and a run's identity show the options' logit_bias: the clamped floats the rows apply, whatever the
    spelling (JSON keys, integers, values past the clamp)."""
    options = SamplingOptions(logit_bias={"5": 1000, 7: 2, 9: -0.5})
    assert options.logit_bias == {5: 100.0, 7: 2.0, 9: -0.5}
    assert all(type(v) is float for v in options.logit_bias.values())
    assert options.row(seed=1).logit_bias == options.logit_bias


@pytest.mark.parametrize("vocab", [300, 49152])
def test_dense_top_k_values_are_the_records_at_the_drawn_token(vocab):
    """One record, one number: the kernel's rows and the reference's (a filter sends a row there), theta's rows
    already log-softmax as the engines pass them. The teacher's values against float64 log-softmax; theta's are its
    rows as given, bit for bit (``theta_normalized``: the decision takes them as log-probabilities, so re-normalising
    them in float64 would measure only the test's own float32 log_softmax, whose rounding depends on the CPU's
    reduction: 2.8e-5 at V = 49,152 under AVX2, 1.4e-5 under AVX-512)."""
    g = torch.Generator().manual_seed(vocab)
    teacher = torch.randn(6, vocab, generator=g) * 6  # logits up to about 60: a float32 logsumexp rounds visibly
    theta = torch.randn(6, vocab, generator=g) * 3
    teacher[:, :8] += 40  # the drawn tokens fall among both top k
    theta[:, :8] += 15
    theta = torch.log_softmax(theta, -1)
    rows = [RowSampling(seed=i, top_k=50 if i % 2 else 0) for i in range(6)]
    d = decide(ModelRows.pair(teacher, theta, theta_normalized=True), [1] * 6, rows, get_alpha_computer("kl_symmetry"))
    ids, logp = dense_top(ModelRows.pair(teacher, theta, theta_normalized=True), 16, d)
    values, other = (torch.from_numpy(a) for a in own_and_other(logp.numpy()))  # the pair's sample arrays
    teacher_exact = torch.log_softmax(teacher.double(), -1)
    assert torch.equal(values[:, 1], theta.gather(-1, ids[:, 1]))  # theta at its own top k
    assert torch.equal(other[:, 0], theta.gather(-1, ids[:, 0]))  # and at the teacher's
    torch.testing.assert_close(
        values[:, 0].double(), teacher_exact.gather(-1, ids[:, 0]), atol=one_normalisation_atol(vocab), rtol=0
    )
    torch.testing.assert_close(
        other[:, 1].double(), teacher_exact.gather(-1, ids[:, 1]), atol=one_normalisation_atol(vocab), rtol=0
    )
    hits = 0
    for side, record in enumerate(d.logp.unbind(-1)):
        assert torch.equal(ids[:, side], [teacher, theta][side].topk(16, -1).indices)
        assert (values[:, side, :-1] >= values[:, side, 1:]).all()
        for row in range(6):
            hit = (ids[row, side] == d.tokens[row]).nonzero().flatten()
            if hit.numel():
                hits += 1
                assert values[row, side, hit[0]].item() == record[row].item()
                # The other model's value at the drawn token is its record too: one normaliser per model and row.
                other_record = d.logp[:, 1 - side]
                assert other[row, side, hit[0]].item() == other_record[row].item()
    assert hits >= 10
