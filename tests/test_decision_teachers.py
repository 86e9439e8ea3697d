"""The per-token decision with several teachers (``decide`` on a three-model roster), against float64 NumPy: the
recorded α, each model's log π and log q at the drawn token, the draws' law (with a one-teacher control that the same
test rejects), the penalties on the K-teacher mixture's logits, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from alpha import get_alpha_computer
from dual_sampling.decision.pipeline import ModelRows, RowSampling, decide
from dual_sampling.roster import Roster
from tests.draws import LEVEL, _chi_square_p
from tests.test_penalties import numpy_penalised
from tests.tolerances import ALPHA_ATOL, ONE_NORMALISATION_ATOL

TRIO = Roster(("math", "general", "theta"))
"""Two teachers and θ: the first leads, as the pair's teacher does."""


def trio_logits(batch: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, vocab, generator=g) * scale for scale in (4.0, 3.0, 2.0))


def np_log_softmax(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x - np.logaddexp.reduce(x)


def test_records_of_two_teachers_are_float64s_at_the_recorded_alpha():
    math_, general, theta = trio_logits(6, 300, seed=1)
    rows = [RowSampling(seed=s, temperature=t) for s, t in enumerate((1.0, 1.0, 0.7, 1.3, 1.0, 0.5))]
    computer = get_alpha_computer("kl_symmetry")
    d = decide(ModelRows((math_, general, theta), TRIO), [3] * 6, rows, computer)
    assert d.alpha.shape == (6, 2) and d.logp.shape == (6, 3) and d.ok.all()
    wide = computer.compute_teachers(
        torch.log_softmax(theta.double(), -1), torch.log_softmax(torch.stack([math_, general]).double(), -1)
    )
    torch.testing.assert_close(d.alpha.double(), wide.alpha, atol=ALPHA_ATOL, rtol=0)
    for r in range(6):
        token, a = int(d.tokens[r]), d.alpha[r].double().numpy()
        logp = [np_log_softmax(m[r].double().numpy()) for m in (math_, general, theta)]
        assert d.logp[r, :2].tolist() == pytest.approx([logp[0][token], logp[1][token]], abs=1e-5)
        assert float(d.logp[r, 2]) == pytest.approx(logp[2][token], abs=1e-5)
        mixed = (1 - a.sum()) * logp[2] + a[0] * logp[0] + a[1] * logp[1]
        expected = np_log_softmax(mixed / rows[r].temperature)[token]
        assert float(d.logq[r]) == pytest.approx(expected, abs=1e-4), r


def test_draws_of_two_teachers_follow_q_and_a_one_teacher_law_is_rejected():
    vocab, draws, alpha = 12, 6000, (0.3, 0.4)
    math_, general, theta = (m[:1].expand(draws, vocab) for m in trio_logits(1, vocab, seed=2))
    rows = [RowSampling(seed=s) for s in range(draws)]
    d = decide(ModelRows((math_, general, theta), TRIO), [0] * draws, rows, get_alpha_computer("fixed", alpha=alpha))
    logp = [np_log_softmax(m[0].double().numpy()) for m in (math_, general, theta)]
    q = np.exp(np_log_softmax(0.3 * logp[0] + 0.4 * logp[1] + 0.3 * logp[2]))
    counts = np.bincount(d.tokens.numpy(), minlength=vocab)
    assert _chi_square_p(counts, draws * q) > LEVEL
    # Control: the same draws judged under the mixture with the first teacher alone at the teachers' total weight.
    one = np.exp(np_log_softmax(0.7 * logp[0] + 0.3 * logp[2]))
    assert _chi_square_p(counts, draws * one) < LEVEL


def test_penalties_act_on_the_k_teacher_mixtures_logits():
    math_, general, theta = trio_logits(2, 40, seed=3)
    prompt, output = [1, 2, 3], [3, 7, 7, 9]
    settings = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2)
    rows = [RowSampling(seed=s, temperature=0.0, prompt_token_ids=tuple(prompt), **settings) for s in range(2)]
    alpha = (0.25, 0.35)
    d = decide(
        ModelRows((math_, general, theta), TRIO),
        [len(output)] * 2,
        rows,
        get_alpha_computer("fixed", alpha=alpha),
        top_logprobs=40,
        outputs=[output] * 2,
    )
    for r in range(2):
        # The mixture's logits of the raw logits: (1 − Σα)·ℓ_θ + Σ α_i·ℓ_i, penalised as vLLM penalises one model's.
        z = 0.4 * theta[r].double().numpy() + 0.25 * math_[r].double().numpy() + 0.35 * general[r].double().numpy()
        expected = np_log_softmax(numpy_penalised(z, prompt, output, settings))
        ids = d.top_ids[r].numpy()
        np.testing.assert_allclose(d.top_logq[r].double().numpy(), expected[ids], atol=4 * ONE_NORMALISATION_ATOL)
        assert int(d.tokens[r]) == int(np.argmax(expected))
        assert d.top_logp.shape == (2, 3, 40)


def test_penalties_on_a_following_teachers_normalised_rows_take_its_log_normaliser():
    """In lockstep every follower's rows arrive normalised: a teacher that follows (the second of two) brings its
    log-normaliser as θ does, and the penalised mixture is the one of the raw logits. Without it the repetition penalty
    would read the sign of the wrong logits."""
    math_, general, theta = trio_logits(2, 40, seed=3)
    general = general + 3.0  # a row whose log-normaliser is far from 0: its sign changes where the logits are small
    prompt, output = [1, 2, 3], [3, 7, 7, 9]
    settings = dict(repetition_penalty=1.8, frequency_penalty=0.5, presence_penalty=0.2)
    rows = [RowSampling(seed=s, temperature=0.0, prompt_token_ids=tuple(prompt), **settings) for s in range(2)]
    computer = get_alpha_computer("fixed", alpha=(0.25, 0.35))

    def decided(models: ModelRows):
        d = decide(models, [len(output)] * 2, rows, computer, top_logprobs=40, outputs=[output] * 2)
        return d.top_ids, d.top_logq

    raw = decided(ModelRows((math_, general, theta), TRIO))
    norms = [m.double().logsumexp(-1) for m in (general, theta)]
    follow = [torch.log_softmax(m, -1) for m in (general, theta)]
    normalised = ModelRows((math_, *follow), TRIO, (False, True, True), (None, *norms))
    got = decided(normalised)
    assert torch.equal(got[0], raw[0])
    torch.testing.assert_close(got[1], raw[1], atol=4 * ONE_NORMALISATION_ATOL, rtol=0)
    # The following teacher's rows taken for its raw logits: its normaliser read as 0.
    blind = decided(ModelRows((math_, *follow), TRIO, (False, False, True), (None, None, norms[1])))
    assert not torch.allclose(blind[1], raw[1], atol=1e-3), "the check cannot see a missing normaliser"
    # Normalised rows whose log-normaliser did not come: refused by name, never read as raw logits.
    with pytest.raises(ValueError, match=r"the repetition penalty needs general's log-normalisers"):
        decided(ModelRows((math_, *follow), TRIO, (False, True, True), (None, None, norms[1])))
    # θ between the teachers: each follower's normaliser is read at its roster position, not its teacher index.
    between = Roster(("math", "theta", "general"))
    moved = ModelRows((math_, follow[1], follow[0]), between, (False, True, True), (None, norms[1], norms[0]))
    got = decided(moved)
    assert torch.equal(got[0], raw[0])
    torch.testing.assert_close(got[1], raw[1], atol=4 * ONE_NORMALISATION_ATOL, rtol=0)


def test_a_forced_first_token_gives_theta_no_weight_and_teacher_support_is_refused_by_name():
    math_, general, theta = trio_logits(2, 50, seed=4)
    models = ModelRows((math_, general, theta), TRIO)
    forced = [RowSampling(seed=0, force_first_token=True), RowSampling(seed=1, force_first_token=True)]
    d = decide(models, [0, 1], forced, get_alpha_computer("fixed", alpha=(0.2, 0.2)))
    torch.testing.assert_close(d.alpha, torch.tensor([[0.5, 0.5], [0.2, 0.2]]))  # step 0 only
    with pytest.raises(ValueError, match=r"teacher_support_top_k / teacher_support_top_p: TeacherSupport"):
        decide(models, [1], [RowSampling(teacher_support_top_k=5)], get_alpha_computer("fixed", alpha=(0.2, 0.2)))
    with pytest.raises(ValueError, match="alpha method 'entropy' has no form for 2 teachers"):
        decide(models, [1, 1], forced, get_alpha_computer("entropy"))
    with pytest.raises(ValueError, match=r"logits of 'general' have shape \(2, 49\)"):
        ModelRows((math_, general[:, :49], theta), TRIO)


def test_dense_top_k_of_every_model_against_float64():
    """Each model's own top k, and every model's log π at them (a trainer's loss reads any teacher's distribution
    where any model has its mass): float64 log-softmax of the raw logits, the followers' rows arriving normalised as
    in lockstep; where the drawn token is among a model's k, every model's value there is its record, bit for bit."""
    from dual_sampling.decision.result import dense_top

    math_, general, theta = trio_logits(4, 300, seed=6)
    for model in (math_, general, theta):
        model[:, :4] += 6.0  # the drawn tokens fall among every model's top k
    follow = tuple(torch.log_softmax(m, -1) for m in (general, theta))
    models = ModelRows((math_, *follow), TRIO, (False, True, True))
    d = decide(models, [2] * 4, [RowSampling(seed=s) for s in range(4)], get_alpha_computer("fixed", alpha=(0.3, 0.3)))
    ids, logp = dense_top(models, 8, d)
    assert ids.shape == (4, 3, 8) and logp.shape == (4, 3, 3, 8)
    exact = [torch.log_softmax(m.double(), -1) for m in (math_, general, theta)]
    hits = 0
    for i, own in enumerate(exact):
        assert torch.equal(ids[:, i], own.topk(8, -1).indices)
        for j, other in enumerate(exact):
            torch.testing.assert_close(logp[:, i, j].double(), other.gather(-1, ids[:, i]), atol=1e-5, rtol=0)
        for r in range(4):
            hit = (ids[r, i] == d.tokens[r]).nonzero().flatten()
            if hit.numel():
                hits += 1
                assert logp[r, i, :, hit[0]].tolist() == d.logp[r].tolist()
    assert hits >= 6  # of 12: the bit-for-bit check ran for each model


def test_a_forced_first_token_takes_none_of_thetas_masks_in_float32():
    # The teachers' shares scaled to a total of 1 round to 1 − 6e-8 in float32: θ kept that weight, and its masks.
    math_, general, theta = trio_logits(64, 30, seed=5)
    theta[:, :10] = -torch.inf
    rows = [RowSampling(seed=s, force_first_token=True, temperature=0.0) for s in range(64)]
    computer = get_alpha_computer("kl_symmetry")  # weights of every kind, whose scaled sum rounds either way
    d = decide(ModelRows((math_, general, theta), TRIO), [0] * 64, rows, computer, top_logprobs=30)
    assert torch.isfinite(d.top_logq).all()
    torch.testing.assert_close(d.alpha.sum(-1), torch.ones(64), atol=2e-7, rtol=0)
