"""The alpha package against an independent float64 NumPy reference (plain bisection)."""

from __future__ import annotations

import math
from importlib.metadata import EntryPoint

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import alpha.registry
from alpha import AlphaComputer, available_alpha_methods, geometric_mix, get_alpha_computer
from tests.oracles import (
    np_alpha_ess,
    np_alpha_kl,
    np_alpha_trust_region,
    np_ess_log_ratio,
    np_kl,
    np_kl_residual,
    np_mix,
)
from tests.tolerances import alpha_atol


def logp(probs, dtype=torch.float64) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().to(dtype)


def random_pair(batch: int, vocab: int, seed: int, scale: float = 3.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    th = torch.log_softmax(torch.randn(batch, vocab, generator=g, dtype=torch.float64) * scale, -1)
    t = torch.log_softmax(torch.randn(batch, vocab, generator=g, dtype=torch.float64) * scale, -1)
    return th.to(dtype), t.to(dtype)


# ---------------------------------------------------------------- exact methods


def test_known_example_values():
    th, t = logp([[0.98, 0.01, 0.01]]), logp([[0.33, 0.33, 0.34]])
    a_kl = get_alpha_computer("kl_symmetry")(th, t).item()
    a_ess = get_alpha_computer("ess_balance")(th, t).item()
    assert a_kl == pytest.approx(0.591, abs=5e-4)
    assert a_ess == pytest.approx(0.707, abs=5e-4)
    assert a_kl == pytest.approx(np_alpha_kl(th[0].numpy(), t[0].numpy()), abs=1e-9)
    assert a_ess == pytest.approx(np_alpha_ess(th[0].numpy(), t[0].numpy()), abs=1e-9)


@pytest.mark.parametrize("scale", [0.3, 3.0, 10.0])
def test_kl_residual_and_ess_ratio_at_returned_alpha(scale):
    th, t = random_pair(16, 2000, seed=int(scale * 10), scale=scale)
    a_kl = get_alpha_computer("kl_symmetry")(th, t)
    a_ess = get_alpha_computer("ess_balance")(th, t)
    for b in range(16):
        x, y = th[b].numpy(), t[b].numpy()
        assert abs(np_kl_residual(x, y, a_kl[b].item())) <= 1e-6
        assert abs(math.exp(np_ess_log_ratio(x, y, a_ess[b].item())) - 1) <= 1e-6
        assert a_kl[b].item() == pytest.approx(np_alpha_kl(x, y), abs=1e-7)


def test_float32_matches_float64_reference():
    th, t = random_pair(8, 5000, seed=3)
    for method in ("kl_symmetry", "ess_balance", "entropy"):
        ac = get_alpha_computer(method)
        a64 = ac(th, t)
        a32 = ac(th.float(), t.float())
        assert a32.dtype == torch.float32
        torch.testing.assert_close(a32.double(), a64, atol=alpha_atol(5000), rtol=0)


def test_symmetric_pairs_give_one_half():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    th, t = p.log().unsqueeze(0), p.flip(0).log().unsqueeze(0)
    for method in ("kl_symmetry", "ess_balance", "entropy"):
        assert get_alpha_computer(method)(th, t).item() == pytest.approx(0.5, abs=1e-9)


def test_swapping_models_reflects_alpha():
    th, t = random_pair(6, 300, seed=5)
    for method in ("kl_symmetry", "ess_balance", "entropy"):
        ac = get_alpha_computer(method)
        torch.testing.assert_close(ac(th, t) + ac(t, th), torch.ones(6, dtype=torch.float64), atol=1e-8, rtol=0)


def test_identical_inputs_give_one_half_clamped():
    th, _ = random_pair(3, 100, seed=7)
    for method in ("kl_symmetry", "ess_balance", "entropy"):
        assert torch.allclose(get_alpha_computer(method)(th, th), torch.full((3,), 0.5, dtype=torch.float64))
        assert torch.allclose(
            get_alpha_computer(method, alpha_max=0.2)(th, th), torch.full((3,), 0.2, dtype=torch.float64)
        )


def test_entropy_formula_direction():
    th, t = logp([[0.98, 0.01, 0.01]]), logp([[0.33, 0.33, 0.34]])
    h = lambda x: -float(np.sum(np.exp(x) * x))
    expected = h(t[0].numpy()) / (h(th[0].numpy()) + h(t[0].numpy()))
    assert get_alpha_computer("entropy")(th, t).item() == pytest.approx(expected, abs=1e-12)
    assert expected > 0.5  # the flatter teacher gets the larger weight, as with kl_symmetry


def test_fixed_alpha():
    th, t = random_pair(4, 10, seed=1)
    assert torch.equal(get_alpha_computer("fixed", alpha=0.3)(th, t), torch.full((4,), 0.3, dtype=torch.float64))
    assert torch.equal(
        get_alpha_computer("fixed", alpha=0.9, alpha_max=0.6)(th, t), torch.full((4,), 0.6, dtype=torch.float64)
    )


def test_clamps_equal_clamped_unconstrained_root():
    th, t = random_pair(32, 400, seed=11, scale=4.0)
    free = get_alpha_computer("kl_symmetry")(th, t)
    lo, hi = float(free.quantile(0.3)), float(free.quantile(0.7))
    clamped = get_alpha_computer("kl_symmetry", alpha_min=lo, alpha_max=hi)(th, t)
    torch.testing.assert_close(clamped, free.clamp(lo, hi), atol=1e-9, rtol=0)


def test_warm_start_converges_to_same_root_in_fewer_passes():
    th, t = random_pair(16, 3000, seed=13)
    ac = get_alpha_computer("kl_symmetry")
    cold = ac.compute(th, t)
    warm = ac.compute(th, t, alpha_init=cold.alpha + 1e-3)
    torch.testing.assert_close(warm.alpha, cold.alpha, atol=1e-9, rtol=0)
    assert warm.passes < cold.passes


def test_newton_needs_few_passes_on_realistic_rows():
    th, t = random_pair(32, 49152, seed=17, scale=2.0, dtype=torch.float32)
    for method in ("kl_symmetry", "ess_balance"):
        assert get_alpha_computer(method).compute(th, t).passes <= 6


# ---------------------------------------------------------------- geometric mixture


def test_geometric_mix_endpoints_and_midpoint():
    th, t = random_pair(5, 50, seed=19)
    torch.testing.assert_close(geometric_mix(th, t, 0.0), th)
    torch.testing.assert_close(geometric_mix(th, t, 1.0), t)
    half = np.sqrt(np.exp(th.numpy()) * np.exp(t.numpy()))
    half /= half.sum(-1, keepdims=True)
    torch.testing.assert_close(geometric_mix(th, t, 0.5).exp(), torch.from_numpy(half))


def test_geometric_mix_per_row_alpha_matches_reference():
    th, t = random_pair(4, 30, seed=23)
    a = torch.tensor([0.0, 0.25, 0.8, 1.0], dtype=torch.float64)
    q = geometric_mix(th, t, a).exp()
    for b in range(4):
        np.testing.assert_allclose(q[b].numpy(), np_mix(th[b].numpy(), t[b].numpy(), a[b].item()), atol=1e-12)


def test_geometric_mix_rejects_bad_alpha():
    th, t = random_pair(2, 5, seed=0)
    with pytest.raises(ValueError, match="alpha must lie in"):
        geometric_mix(th, t, 1.5)
    with pytest.raises(ValueError, match="one entry per row"):
        geometric_mix(th, t, torch.tensor([0.1, 0.2, 0.3]))


# ---------------------------------------------------------------- masked tokens


def test_masked_tokens_equal_solving_on_the_reduced_vocabulary():
    th, t = random_pair(4, 40, seed=29)
    mask = torch.zeros(40, dtype=torch.bool)
    mask[::3] = True
    th_masked = torch.log_softmax(th.masked_fill(mask, -math.inf), -1)
    t_masked = torch.log_softmax(t.masked_fill(mask, -math.inf), -1)
    for method in ("kl_symmetry", "ess_balance", "entropy"):
        ac = get_alpha_computer(method)
        torch.testing.assert_close(ac(th_masked, t_masked), ac(th[:, ~mask], t[:, ~mask]), atol=1e-9, rtol=0)


def test_one_hot_inputs():
    one_hot = logp([[1.0, 0.0, 0.0]])
    broad = logp([[0.5, 0.25, 0.25]])
    kl = get_alpha_computer("kl_symmetry")
    assert kl(one_hot, one_hot).item() == 0.5
    # On the joint support {0}, q is one-hot for every α < 1, so only α = 1 lowers KL(q‖π_t).
    assert kl(one_hot, broad).item() == 1.0
    assert kl(broad, one_hot).item() == 0.0
    assert get_alpha_computer("entropy")(one_hot, broad).item() == 1.0
    q = geometric_mix(one_hot, broad, 0.5).exp()
    torch.testing.assert_close(q, torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64))


def test_disjoint_supports():
    th, t = logp([[0.7, 0.3, 0.0, 0.0]]), logp([[0.0, 0.0, 0.4, 0.6]])
    assert get_alpha_computer("kl_symmetry")(th, t).item() == 0.5
    assert get_alpha_computer("ess_balance")(th, t).item() == 0.5
    torch.testing.assert_close(geometric_mix(th, t, 0.0), th)
    torch.testing.assert_close(geometric_mix(th, t, 1.0), t)
    with pytest.raises(ValueError, match="disjoint in rows 0"):
        geometric_mix(th, t, 0.5)


def test_disjoint_row_does_not_disturb_the_others():
    th, t = random_pair(3, 4, seed=31)
    th[1] = logp([0.7, 0.3, 0.0, 0.0])
    t[1] = logp([0.0, 0.0, 0.4, 0.6])
    a = get_alpha_computer("kl_symmetry")(th, t)
    assert a[1].item() == 0.5
    for b in (0, 2):
        assert a[b].item() == pytest.approx(np_alpha_kl(th[b].numpy(), t[b].numpy()), abs=1e-8)


# ---------------------------------------------------------------- validation and registry


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"alpha_min": -0.1}, "alpha_min must lie in \\[0, 1\\], got -0.1"),
        ({"alpha_max": 1.5}, "alpha_max must lie in \\[0, 1\\], got 1.5"),
        ({"alpha_min": 0.8, "alpha_max": 0.2}, "alpha_min=0.8 > alpha_max=0.2"),
        ({"alpha_min": float("nan")}, "alpha_min"),
        ({"alpha_min": "0.1"}, "alpha_min must be a number"),
    ],
)
def test_bad_bounds_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        get_alpha_computer("kl_symmetry", **kwargs)


def test_unknown_method_and_field_are_named():
    with pytest.raises(ValueError, match="unknown alpha method 'klsym'.*kl_symmetry"):
        get_alpha_computer("klsym")
    with pytest.raises(ValueError, match="kl_symmetry.*alpha_maximum"):
        get_alpha_computer("kl_symmetry", alpha_maximum=0.3)
    with pytest.raises(ValueError, match="alpha must lie in"):
        get_alpha_computer("fixed", alpha=2)


def test_nan_and_shape_errors():
    th, t = random_pair(3, 10, seed=37)
    bad = t.clone()
    bad[2, 4] = float("nan")
    with pytest.raises(ValueError, match="logp_teacher contains NaN in rows 2"):
        get_alpha_computer("kl_symmetry")(th, bad)
    with pytest.raises(ValueError, match="same shape"):
        get_alpha_computer("kl_symmetry")(th, t[:, :5])
    with pytest.raises(ValueError, match="no finite entry"):
        get_alpha_computer("kl_symmetry")(th, torch.full_like(t, -math.inf))


def test_one_dimensional_input_gives_scalar():
    th, t = logp([0.98, 0.01, 0.01]), logp([0.33, 0.33, 0.34])
    a = get_alpha_computer("kl_symmetry")(th, t)
    assert a.dim() == 0 and a.item() == pytest.approx(0.591, abs=5e-4)
    assert geometric_mix(th, t, a).shape == (3,)


@pytest.mark.parametrize("method", ["fixed", "kl_symmetry", "ess_balance", "trust_region", "entropy"])
def test_builtin_methods_registered(method):
    ac = get_alpha_computer(method)
    assert isinstance(ac, AlphaComputer) and ac.name == method


class HalfwayAlpha(AlphaComputer):
    """A third-party method used to test entry-point discovery."""

    def solve(self, logp_theta, logp_teacher, alpha_init):
        return torch.full(logp_theta.shape[:1], 0.25, dtype=logp_theta.dtype), 0


def test_third_party_entry_point_is_discovered(monkeypatch):
    ep = EntryPoint(name="quarter", value=f"{__name__}:HalfwayAlpha", group=alpha.registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(alpha.registry, "entry_points", lambda group: [ep] if group == ep.group else [])
    monkeypatch.setattr(alpha.registry, "_entry_points_loaded", False)
    monkeypatch.setattr(alpha.registry, "_REGISTRY", dict(alpha.registry._REGISTRY))
    assert "quarter" in available_alpha_methods()
    th, t = random_pair(2, 5, seed=0)
    assert get_alpha_computer("quarter")(th, t).tolist() == [0.25, 0.25]


# ---------------------------------------------------------------- properties


@st.composite
def log_prob_pairs(draw):
    vocab = draw(st.integers(2, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.floats(0.05, 12.0))
    masked = draw(st.floats(0.0, 0.5))
    g = torch.Generator().manual_seed(seed)
    th = torch.randn(vocab, generator=g, dtype=torch.float64) * scale
    t = torch.randn(vocab, generator=g, dtype=torch.float64) * scale
    mask_th = torch.rand(vocab, generator=g) < masked
    mask_t = torch.rand(vocab, generator=g) < masked
    mask_th[0] = mask_t[0] = False  # keep the joint support non-empty
    return torch.log_softmax(th.masked_fill(mask_th, -math.inf), -1), torch.log_softmax(
        t.masked_fill(mask_t, -math.inf), -1
    )


def assert_is_clamped_root(residual, a: float, tol: float) -> None:
    """a solves the increasing equation residual = 0 on [0, 1], or sits at the end the root lies beyond."""
    assert 0.0 <= a <= 1.0
    if a == 0.0:
        assert residual(0.0) >= -tol
    elif a == 1.0:
        assert residual(1.0) <= tol
    else:
        assert abs(residual(a)) <= tol


@settings(max_examples=150, deadline=None)
@given(log_prob_pairs())
def test_property_kl_solves_its_equation(pair):
    th, t = pair
    a = get_alpha_computer("kl_symmetry")(th, t).item()
    assert_is_clamped_root(lambda x: np_kl_residual(th.numpy(), t.numpy(), x), a, 1e-6)


@settings(max_examples=150, deadline=None)
@given(log_prob_pairs())
def test_property_ess_solves_its_equation(pair):
    th, t = pair
    a = get_alpha_computer("ess_balance")(th, t).item()
    # ESS ratio within 1 ± 1e-6 means |log ratio| ≲ 1e-6; the log ratio decreases in α.
    assert_is_clamped_root(lambda x: -np_ess_log_ratio(th.numpy(), t.numpy(), x), a, 1e-6)


@settings(max_examples=100, deadline=None)
@given(log_prob_pairs(), st.floats(0.0, 1.0))
def test_property_geometric_mix_is_normalised_reference(pair, a):
    th, t = pair
    q = geometric_mix(th, t, a).exp().numpy()
    assert q.sum() == pytest.approx(1.0, abs=1e-12)
    if 0.0 < a < 1.0:
        np.testing.assert_allclose(q, np_mix(th.numpy(), t.numpy(), a), atol=1e-12)


def test_normalized_flag_skips_only_the_renormalisation():
    th, t = random_pair(8, 500, seed=41)
    for method in ("kl_symmetry", "ess_balance", "entropy"):
        ac = get_alpha_computer(method)
        torch.testing.assert_close(ac(th, t, normalized=True), ac(th, t), atol=1e-12, rtol=0)
    bad = t.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        get_alpha_computer("kl_symmetry")(th, bad, normalized=True)


# ---------------------------------------------------------------- trust_region: the largest α with KL(q_α‖π_θ) ≤ ε


@pytest.mark.parametrize("budget", [1e-3, 0.02, 0.3])
@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_trust_region_is_the_float64_bisection_boundary(budget, scale):
    th, t = random_pair(6, 300, seed=41, scale=scale)
    got = get_alpha_computer("trust_region", kl_budget=budget)(th, t)
    for b in range(th.shape[0]):
        lth, lt = th[b].numpy(), t[b].numpy()
        want = np_alpha_trust_region(lth, lt, budget)
        assert got[b].item() == pytest.approx(want, abs=1e-7), (b, budget)
        kl = np_kl(np_mix(lth, lt, got[b].item()), lth)
        assert kl <= budget + 1e-9 and (got[b].item() == 1.0 or kl >= budget - 1e-6)


def test_trust_region_clamps_a_zero_and_an_unreachable_budget():
    th, t = random_pair(4, 100, seed=42)
    assert torch.equal(get_alpha_computer("trust_region", kl_budget=0.0)(th, t), torch.zeros(4, dtype=torch.float64))
    lifted = get_alpha_computer("trust_region", kl_budget=0.0, alpha_min=0.2)(th, t)
    assert torch.equal(lifted, torch.full((4,), 0.2, dtype=torch.float64))  # even alpha_min exceeds ε = 0
    assert torch.equal(get_alpha_computer("trust_region", kl_budget=100.0)(th, t), torch.ones(4, dtype=torch.float64))
    capped = get_alpha_computer("trust_region", kl_budget=100.0, alpha_max=0.7)(th, t)
    assert torch.equal(capped, torch.full((4,), 0.7, dtype=torch.float64))


def test_trust_region_with_one_model_twice_takes_all_the_teacher_allowed():
    th, _ = random_pair(3, 50, seed=43)
    for budget in (0.0, 0.1):  # q_α = π_θ for every α: KL is 0, within any budget
        got = get_alpha_computer("trust_region", kl_budget=budget, alpha_max=0.9)(th, th.clone())
        assert torch.equal(got, torch.full((3,), 0.9, dtype=torch.float64))


def test_trust_region_on_masked_rows_matches_the_bisection_on_the_joint_support():
    th, t = random_pair(3, 200, seed=44)
    t = t.clone()
    t[0, 100:] = -math.inf  # the teacher's top-k-like mask: S holds half of π_θ's tokens
    t[1, 1:] = -math.inf  # a one-token support: KL(q_α‖π_θ) = −log π_θ(y) for every α
    th = th.clone()
    th[2] = torch.log_softmax(th[2].masked_fill(torch.arange(200) < 20, -math.inf), -1)  # a mask on theta's side
    for budget in (0.05, 2.0):
        got = get_alpha_computer("trust_region", kl_budget=budget)(th, t)
        for b in range(3):
            want = np_alpha_trust_region(th[b].numpy(), t[b].numpy(), budget)
            assert got[b].item() == pytest.approx(want, abs=1e-7), (b, budget)


def test_trust_region_in_float32_is_the_float64_answer():
    th, t = random_pair(8, 4000, seed=45)
    ac = get_alpha_computer("trust_region", kl_budget=0.05)
    torch.testing.assert_close(ac(th.float(), t.float()).double(), ac(th, t), atol=alpha_atol(4000), rtol=0)


def test_trust_region_budget_is_named():
    for bad in (-0.1, math.inf, math.nan, "0.1", True):
        with pytest.raises(ValueError, match="kl_budget must be a finite number >= 0"):
            get_alpha_computer("trust_region", kl_budget=bad)


@settings(max_examples=150, deadline=None)
@given(log_prob_pairs(), st.floats(0.0, 2.0))
def test_property_trust_region_is_the_largest_alpha_within_the_budget(pair, budget):
    th, t = pair
    lth, lt = th.numpy(), t.numpy()
    a = get_alpha_computer("trust_region", kl_budget=budget)(th, t).item()
    want = np_alpha_trust_region(lth, lt, budget)
    kl = lambda x: np_kl(np_mix(lth, lt, x), lth)
    # Where K(α) ≈ α²·Var/2 is below float64's rounding of the oracle's KL (nearly equal models, ε ≈ 0), the oracle's
    # boundary is that rounding's: there the two answers agree in KL, not in α.
    assert a == pytest.approx(want, abs=1e-6) or abs(kl(a) - kl(want)) <= 1e-12, (a, want, kl(a), kl(want))
    assert kl(a) <= budget + 1e-9 or a == want == 0.0  # or even α = 0 exceeds ε (a masked row): the clamp
