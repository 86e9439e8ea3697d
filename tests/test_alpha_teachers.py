"""α for several teachers against independent float64 oracles: SciPy's SLSQP for kl_symmetry's optimum, NumPy for
the mixture and the KLs; K = 1 against today's pair calls, to the bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from alpha import alpha_methods_for_several_teachers, geometric_mix, geometric_mix_teachers, get_alpha_computer
from tests.tolerances import alpha_atol


def random_rows(models: int, batch: int, vocab: int, seed: int, scale: float = 3.0, dtype=torch.float64):
    """θ's rows ``[B, V]`` and ``models − 1`` teachers' ``[K, B, V]``, log-softmax of Gaussian logits."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.log_softmax(torch.randn(models, batch, vocab, generator=g, dtype=torch.float64) * scale, -1)
    return rows[0].to(dtype), rows[1:].to(dtype)


def np_log_partition(theta: np.ndarray, teachers: np.ndarray, a: np.ndarray) -> float:
    """log Σ_y π_θ(y)·Π_i e^(a_i·d_i(y)) in float64, on the joint support of all models."""
    joint = np.isfinite(theta) & np.isfinite(teachers).all(0)
    x = theta[joint] + a @ (teachers[:, joint] - theta[joint])
    top = x.max()
    return float(top + np.log(np.exp(x - top).sum()))


def scipy_optimum(theta: np.ndarray, teachers: np.ndarray, lo: float = 0.0, hi: float = 1.0) -> np.ndarray:
    """SLSQP's minimiser of the log-partition over {a ≥ 0, lo ≤ Σa ≤ hi}, from several starts, the best kept."""
    k = teachers.shape[0]
    constraints = [{"type": "ineq", "fun": lambda a: hi - a.sum()}, {"type": "ineq", "fun": lambda a: a.sum() - lo}]
    best = None
    for start in (np.full(k, 1.0 / (k + 1)), np.eye(k)[0] * hi, np.full(k, hi / k)):
        result = minimize(
            lambda a: np_log_partition(theta, teachers, a),
            start,
            method="SLSQP",
            bounds=[(0.0, 1.0)] * k,
            constraints=constraints,
            options={"ftol": 1e-15, "maxiter": 500},
        )
        if best is None or result.fun < best.fun:
            best = result
    return best.x


def np_kls(theta: np.ndarray, teachers: np.ndarray, a: np.ndarray) -> np.ndarray:
    """KL(q‖π_j) for θ and each teacher, q the mixture at teacher weights ``a``, float64."""
    models = np.concatenate([theta[None], teachers])
    weights = np.concatenate([[1.0 - a.sum()], a])
    logq = (weights[:, None] * models).sum(0)
    logq -= logq.max() + np.log(np.exp(logq - logq.max()).sum())
    q = np.exp(logq)
    return np.array([float((q * (logq - m)).sum()) for m in models])


def inner_teacher(theta: torch.Tensor, teacher: torch.Tensor, seed: int) -> torch.Tensor:
    """A teacher near the pair's own Chernoff point, so its weight in the three-model optimum is 0 (KL to it is
    smaller than to either end), perturbed so that its d is not collinear with the others'."""
    middle = get_alpha_computer("kl_symmetry")(theta, teacher)
    g = torch.Generator().manual_seed(seed)
    near = geometric_mix(theta, teacher, middle) + 0.05 * torch.randn(theta.shape, generator=g, dtype=theta.dtype)
    return torch.log_softmax(near, -1)


@pytest.mark.parametrize("method", ["fixed", "kl_symmetry", "ess_balance", "trust_region", "entropy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_teacher_is_the_pair_call_to_the_bit(method, dtype):
    theta, teachers = random_rows(2, 12, 300, seed=1, dtype=dtype)
    theta[3, :40] = -torch.inf  # a masked row goes the same way
    computer = get_alpha_computer(method)
    pair = computer.compute(theta, teachers[0])
    many = computer.compute_teachers(theta, teachers)
    assert many.alpha.shape == (12, 1)
    assert torch.equal(many.alpha[:, 0], pair.alpha) and many.passes == pair.passes
    alpha = many.alpha
    assert torch.equal(geometric_mix_teachers(theta, teachers, alpha), geometric_mix(theta, teachers[0], alpha[:, 0]))


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])
def test_kl_symmetry_for_two_teachers_is_scipys_optimum_and_balances_the_kls(scale):
    theta, teachers = random_rows(3, 12, 400, seed=int(10 * scale), scale=scale)
    # Rows 0-3: a teacher near the other two's middle, whose weight must be 0.
    for row in range(4):
        teachers[1, row] = inner_teacher(theta[row], teachers[0, row], seed=row)
    alpha = get_alpha_computer("kl_symmetry").compute_teachers(theta, teachers).alpha
    for row in range(12):
        x, ts, a = theta[row].numpy(), teachers[:, row].numpy(), alpha[row].numpy()
        reference = scipy_optimum(x, ts)
        # The objective is strictly convex here (no two d_i collinear), so the optimum is one point.
        assert np_log_partition(x, ts, a) <= np_log_partition(x, ts, reference) + 1e-12
        np.testing.assert_allclose(a, reference, atol=1e-5)
        kls = np_kls(x, ts, a)
        positive = np.concatenate([[1.0 - a.sum() > 1e-9], a > 1e-9])
        assert kls[positive].max() - kls[positive].min() <= 1e-8, (row, kls, a)
        # A model of weight 0 is no farther from q than the balanced ones.
        assert (kls[~positive] <= kls[positive].min() + 1e-8).all(), (row, kls, a)
        if row < 4:
            assert a[1] == 0.0, (row, a)
            # Then the first teacher's weight is the pair's own root.
            pair = get_alpha_computer("kl_symmetry")(theta[row], teachers[0, row]).item()
            assert a[0] == pytest.approx(pair, abs=1e-7)


def test_kl_symmetry_for_three_teachers_and_a_clamped_total_match_scipy():
    theta, teachers = random_rows(4, 6, 300, seed=21, scale=2.0)
    for lo, hi in ((0.0, 1.0), (0.0, 0.4), (0.9, 1.0)):
        alpha = get_alpha_computer("kl_symmetry", alpha_min=lo, alpha_max=hi).compute_teachers(theta, teachers).alpha
        for row in range(6):
            x, ts, a = theta[row].numpy(), teachers[:, row].numpy(), alpha[row].numpy()
            assert lo - 1e-12 <= a.sum() <= hi + 1e-12 and (a >= 0).all()
            reference = scipy_optimum(x, ts, lo, hi)
            assert np_log_partition(x, ts, a) <= np_log_partition(x, ts, reference) + 1e-12
            np.testing.assert_allclose(a, reference, atol=1e-5)


def test_kl_symmetry_for_two_teachers_on_masked_rows_solves_on_the_joint_support():
    theta, teachers = random_rows(3, 4, 200, seed=5)
    theta[0, :50] = -torch.inf
    teachers[0, 1, 100:150] = -torch.inf
    teachers[1, 2, 20:180] = -torch.inf
    # Masks renormalise the rows (the solver does too): each model is a distribution on its own support.
    theta, teachers = torch.log_softmax(theta, -1), torch.log_softmax(teachers, -1)
    alpha = get_alpha_computer("kl_symmetry").compute_teachers(theta, teachers).alpha
    for row in range(3):
        x, ts, a = theta[row].numpy(), teachers[:, row].numpy(), alpha[row].numpy()
        np.testing.assert_allclose(a, scipy_optimum(x, ts), atol=1e-5)
    # No token that all three allow: equal weights, the symmetric limit (the pair's 0.5).
    teachers[0, 3, :100] = -torch.inf
    teachers[1, 3, 100:] = -torch.inf
    alpha = get_alpha_computer("kl_symmetry").compute_teachers(theta, teachers).alpha
    np.testing.assert_allclose(alpha[3].numpy(), [1 / 3, 1 / 3])


@pytest.mark.parametrize(("vocab", "scale"), [(5000, 3.0), (5000, 0.5), (49152, 2.0)])
def test_kl_symmetry_for_two_teachers_in_float32_matches_float64(vocab, scale):
    theta, teachers = random_rows(3, 16, vocab, seed=vocab, scale=scale)
    computer = get_alpha_computer("kl_symmetry")
    wide = computer.compute_teachers(theta, teachers)
    narrow = computer.compute_teachers(theta.float(), teachers.float())
    assert narrow.alpha.dtype == torch.float32
    torch.testing.assert_close(narrow.alpha.double(), wide.alpha, atol=alpha_atol(vocab), rtol=0)
    assert narrow.passes <= 8, narrow.passes


def test_identical_models_give_equal_weights_and_a_warm_start_needs_fewer_passes():
    theta, teachers = random_rows(3, 5, 100, seed=9)
    same = torch.stack([theta, theta])
    np.testing.assert_allclose(get_alpha_computer("kl_symmetry").compute_teachers(theta, same).alpha, 1 / 3)
    computer = get_alpha_computer("kl_symmetry")
    cold = computer.compute_teachers(theta, teachers)
    warm = computer.compute_teachers(theta, teachers, alpha_init=cold.alpha + 1e-3)
    torch.testing.assert_close(warm.alpha, cold.alpha, atol=1e-9, rtol=0)
    assert warm.passes < cold.passes


def test_trust_region_for_two_teachers_keeps_the_shares_and_spends_the_budget():
    theta, teachers = random_rows(3, 8, 300, seed=31, scale=2.0)
    budget, shares = 0.05, (3.0, 1.0)
    computer = get_alpha_computer("trust_region", kl_budget=budget, teacher_shares=shares)
    alpha = computer.compute_teachers(theta, teachers).alpha.numpy()
    np.testing.assert_allclose(alpha[:, 0], 3 * alpha[:, 1], rtol=1e-12)
    for row in range(8):
        kls = np_kls(theta[row].numpy(), teachers[:, row].numpy(), alpha[row])
        # KL(q‖π_θ) is at the budget (the total is interior on these rows).
        assert 0 < alpha[row].sum() < 1 and kls[0] == pytest.approx(budget, abs=1e-9)


def test_fixed_weights_per_teacher_and_the_clamped_total():
    theta, teachers = random_rows(3, 4, 50, seed=2)
    alpha = get_alpha_computer("fixed", alpha=[0.2, 0.5]).compute_teachers(theta, teachers).alpha
    assert torch.equal(alpha, torch.tensor([[0.2, 0.5]] * 4, dtype=torch.float64))
    clamped = get_alpha_computer("fixed", alpha=[0.2, 0.6], alpha_max=0.4).compute_teachers(theta, teachers).alpha
    torch.testing.assert_close(clamped, torch.tensor([[0.1, 0.3]] * 4, dtype=torch.float64), atol=1e-15, rtol=0)


def test_the_mixture_of_several_teachers_is_numpys_and_a_weightless_teachers_masks_take_no_part():
    theta, teachers = random_rows(4, 3, 60, seed=4)
    teachers[2, :, :30] = -torch.inf
    alpha = torch.tensor([[0.2, 0.3, 0.0], [0.1, 0.1, 0.1], [0.0, 0.0, 0.0]], dtype=torch.float64)
    logq = geometric_mix_teachers(theta, teachers, alpha)
    for row in range(3):
        a = alpha[row].numpy()
        weights = np.concatenate([[1 - a.sum()], a])
        models = np.concatenate([theta[row, None].numpy(), teachers[:, row].numpy()])
        mixed = sum(w * m for w, m in zip(weights, models, strict=True) if w > 0)
        expected = mixed - np.logaddexp.reduce(mixed[np.isfinite(mixed)])
        np.testing.assert_allclose(logq[row].numpy(), expected, atol=1e-12)
    assert torch.isfinite(logq[0]).all()  # the third teacher's masks: it has weight 0 there
    assert torch.isinf(logq[1, :30]).all()
    assert torch.equal(logq[2], theta[2])


def test_several_teachers_are_refused_by_name_where_a_method_has_no_form_for_them():
    theta, teachers = random_rows(3, 2, 20, seed=6)
    assert alpha_methods_for_several_teachers() == ["fixed", "kl_symmetry", "trust_region"]
    for method in ("ess_balance", "entropy"):
        with pytest.raises(ValueError, match=rf"alpha method '{method}' has no form for 2 teachers.*kl_symmetry"):
            get_alpha_computer(method).compute_teachers(theta, teachers)
    with pytest.raises(ValueError, match=r"alpha must list one weight per teacher \(2\)"):
        get_alpha_computer("fixed", alpha=0.5).check_teacher_count(2)
    with pytest.raises(ValueError, match=r"alpha must list one weight per teacher \(1\)"):
        get_alpha_computer("fixed", alpha=[0.1, 0.2]).compute(theta, teachers[0])
    with pytest.raises(ValueError, match=r"alpha\[1\] must lie in \[0, 1\]"):
        get_alpha_computer("fixed", alpha=[0.1, 1.5])
    with pytest.raises(ValueError, match="summing to at most 1"):
        get_alpha_computer("fixed", alpha=[0.6, 0.6])
    with pytest.raises(ValueError, match=r"teacher_shares must list one share per teacher \(2\)"):
        get_alpha_computer("trust_region", teacher_shares=[1.0]).check_teacher_count(2)
    with pytest.raises(ValueError, match=r"teacher_shares\[0\] must be a finite number"):
        get_alpha_computer("trust_region", teacher_shares=[-1.0, 2.0])
    bad = teachers.clone()
    bad[1, 0, 3] = torch.nan
    with pytest.raises(ValueError, match=r"logp_teachers\[1\] contains NaN in rows 0"):
        get_alpha_computer("kl_symmetry").compute_teachers(theta, bad)
    with pytest.raises(ValueError, match=r"alpha must have shape \[K\] or \[B, K\]"):
        geometric_mix_teachers(theta, teachers, torch.tensor([0.5]))
    with pytest.raises(ValueError, match="sum per row is at most 1"):
        geometric_mix_teachers(theta, teachers, torch.tensor([0.6, 0.6]))


def test_a_run_of_one_teacher_refuses_weights_for_two_before_any_engine_starts(tiny_same):
    """Engine options alone know no teacher count (a vector α fits a run of several teachers); every config that
    names the models checks it: the engine's (built or composed) and a data run's."""
    from dual_sampling.datagen.run_config import RunConfig
    from dual_sampling.options import DualEngineConfig, EngineOptions

    teacher, theta = map(str, tiny_same)
    for options, message in (
        ({"alpha_method": "fixed", "alpha_config": {"alpha": [0.2, 0.3]}}, r"alpha must list one weight per teacher"),
        (
            {"alpha_method": "trust_region", "alpha_config": {"teacher_shares": [1.0, 1.0]}},
            r"teacher_shares must list one share per teacher",
        ),
    ):
        EngineOptions(**options)
        with pytest.raises(ValueError, match=message + r" \(1\)"):
            DualEngineConfig(model_teacher=teacher, model_theta=theta, **options)
        with pytest.raises(ValueError, match=message + r" \(1\)"):
            DualEngineConfig.of(teacher, theta, EngineOptions(**options))
        with pytest.raises(ValueError, match=message + r" \(1\)"):
            RunConfig.from_settings(
                {"input": "in.jsonl", "output": "out.jsonl", "teacher": teacher, "theta": theta, **options}
            )
    assert EngineOptions(alpha_method="fixed", alpha_config={"alpha": [0.2]}).alpha_method == "fixed"


def frank_wolfe_gap(theta: np.ndarray, teachers: np.ndarray, a: np.ndarray, lo: float, hi: float) -> float:
    """m·a − min over the polytope's vertices of m·s (m = ∇ log Z at a): an upper bound on log Z(a) − its minimum."""
    d = teachers - theta
    x = theta + a @ d
    w = np.exp(x - x.max())
    m = d @ (w / w.sum())
    vertices = [bound * np.eye(len(a))[i] for i in range(len(a)) for bound in (lo, hi)]
    return float(m @ a - min(m @ v for v in vertices))


@pytest.mark.parametrize(("lo", "hi"), [(0.0, 1.0), (0.0, 0.4), (0.6, 0.6), (1.0, 1.0), (0.2, 0.9)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_confident_disagreeing_models_reach_the_optimum_within_every_kind_of_bound(lo, hi, dtype):
    # Logits of spread 10-50 put q on a token or two: C is tiny and near rank 1, f's differences vanish in rounding.
    # The Newton step then pointed uphill (a row was returned at its start, 8 nats from the optimum), float32 rows
    # went on until the solver raised, and a fixed total (lo == hi) never moved.
    for scale, teachers, vocab in ((10.0, 2, 32), (20.0, 3, 8), (50.0, 2, 64)):
        g = torch.Generator().manual_seed(int(scale) + teachers)
        rows = torch.log_softmax(torch.randn(teachers + 1, 64, vocab, generator=g, dtype=torch.float64) * scale, -1)
        computer = get_alpha_computer("kl_symmetry", alpha_min=lo, alpha_max=hi)
        alpha = computer.compute_teachers(rows[0].to(dtype), rows[1:].to(dtype), normalized=True).alpha
        assert alpha.dtype == dtype
        for b in range(64):
            a = alpha[b].double().numpy()
            assert lo - 1e-6 <= a.sum() <= hi + 1e-6 and (a >= 0).all()
            gap = frank_wolfe_gap(rows[0, b].numpy(), rows[1:, b].numpy(), a, lo, hi)
            # float64: the solver's own tolerance; float32: α rounded to float32 moves log Z by |m|·6e-8 at most.
            assert gap <= (1e-8 if dtype == torch.float64 else 1e-3), (scale, b, a, gap)


def test_the_reviewed_row_that_stopped_at_its_start_now_reaches_the_optimum():
    theta = torch.log_softmax(torch.tensor([-66.7, -57.0, 0.0], dtype=torch.float64), -1)
    teachers = torch.log_softmax(torch.tensor([[-57.2, -82.6, 0.0], [0.0, -23.6, -20.5]], dtype=torch.float64), -1)
    for dtype in (torch.float64, torch.float32):
        a = get_alpha_computer("kl_symmetry").compute_teachers(theta.to(dtype), teachers.to(dtype)).alpha
        np.testing.assert_allclose(a.double().numpy(), scipy_optimum(theta.numpy(), teachers.numpy()), atol=1e-4)


def test_a_bounded_total_is_exact_in_float64_and_unmixable_rows_keep_trust_regions_floor():
    theta, teachers = random_rows(3, 6, 100, seed=12, scale=4.0)
    alpha = get_alpha_computer("kl_symmetry", alpha_max=0.7).compute_teachers(theta, teachers).alpha
    at_bound = alpha.sum(-1) > 0.7 - 1e-6
    assert at_bound.any() and (alpha.sum(-1)[at_bound] == 0.7).all()
    apart = teachers.clone()
    apart[0, :, :50], apart[1, :, 50:] = -torch.inf, -torch.inf  # the teachers share no token in any row
    computer = get_alpha_computer("trust_region", alpha_min=0.1, teacher_shares=[1.0, 3.0])
    result = computer.compute_teachers(theta, torch.log_softmax(apart, -1))
    expected = torch.tensor([[0.025, 0.075]] * 6, dtype=torch.float64)
    torch.testing.assert_close(result.alpha, expected, atol=1e-15, rtol=0)
    assert result.passes == 0
    with pytest.raises(ValueError, match=r"alpha_init must have shape \[K\] or \[B, K\] = \[6, 2\], got \(6,\)"):
        get_alpha_computer("kl_symmetry").compute_teachers(theta, teachers, alpha_init=torch.zeros(6))


@pytest.mark.parametrize(
    ("method", "config"),
    [
        ("kl_symmetry", {}),
        ("kl_symmetry", {"alpha_min": 0.2, "alpha_max": 0.6}),
        ("kl_symmetry", {"alpha_min": 0.6, "alpha_max": 0.9}),  # a lower bound that binds among the present
        ("trust_region", {"kl_budget": 0.05, "alpha_min": 0.3, "teacher_shares": [0.0, 2.0, 3.0]}),
        ("trust_region", {"kl_budget": 0.3, "teacher_shares": [1.0, 2.0, 3.0]}),
        ("fixed", {"alpha": [0.2, 0.3, 0.1]}),
    ],
)
def test_a_row_that_leaves_teachers_out_weights_the_others_as_if_they_were_all_there_is(method, config):
    """A request that names some teachers only (``absent``): each of its rows gets exactly what the method gives
    the present teachers alone (SciPy's optimum for kl_symmetry), 0 for the others, whose rows are never read (NaN
    here). Rows of one call may leave different teachers out."""
    theta, teachers = random_rows(4, 3, 40, seed=21)
    absent = torch.tensor([[False, True, False], [True, False, True], [False, False, False]])
    blurred = torch.where(absent.T.unsqueeze(-1), torch.nan, teachers)  # an absent teacher's row: never computed
    ac = get_alpha_computer(method, **config)
    got = ac.compute_teachers(theta, blurred, normalized=True, absent=absent).alpha
    assert bool((got[absent] == 0).all())
    # A warm start (the previous token's α) moves no solution.
    warm = ac.compute_teachers(theta, blurred, torch.full((3, 3), 0.3), normalized=True, absent=absent).alpha
    np.testing.assert_allclose(warm.numpy(), got.numpy(), atol=1e-6)
    for row in range(3):
        present = (~absent[row]).nonzero().flatten().tolist()
        alone = dict(config)
        if method == "trust_region":
            shares = [config["teacher_shares"][i] for i in present]
            alone["teacher_shares"] = shares if sum(shares) > 0 else None  # asked for, so they split equally
        if method == "fixed":
            alone["alpha"] = [config["alpha"][i] for i in present]
            alone["alpha"] = alone["alpha"][0] if len(present) == 1 else alone["alpha"]
        want = (
            get_alpha_computer(method, **alone)
            .compute_teachers(theta[row], teachers[present, row], normalized=True)
            .alpha
        )
        np.testing.assert_allclose(got[row, present].numpy(), want.numpy(), atol=1e-9, err_msg=f"row {row}")
        if method == "kl_symmetry" and len(present) > 1:
            lo, hi = config.get("alpha_min", 0.0), config.get("alpha_max", 1.0)
            scipy = scipy_optimum(theta[row].numpy(), teachers[present, row].numpy(), lo, hi)
            np.testing.assert_allclose(got[row, present].numpy(), scipy, atol=1e-5)
    with pytest.raises(ValueError, match="absent leaves no teacher in rows 0"):
        ac.compute_teachers(theta[:1], teachers[:, :1], normalized=True, absent=torch.ones(1, 3, dtype=torch.bool))
