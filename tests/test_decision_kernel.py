"""The compiled decision kernel (dual_sampling.decision.kernel) against the torch reference and float64 oracles."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from alpha import get_alpha_computer
from dual_sampling.decision import kernel
from dual_sampling.decision.edits import row_edits
from dual_sampling.decision.fusable import kernel_rows
from dual_sampling.decision.kernel import decide_fused
from dual_sampling.decision.pipeline import Decision, ModelRows, RowSampling, counter_uniform, decide
from tests.oracles import rows_sent_to_the_reference
from tests.tolerances import (
    ALPHA_ATOL,
    ALPHA_TWO_SOLVES_ATOL,
    ONE_NORMALISATION_ATOL,
    TWO_NORMALISATIONS_ATOL,
    one_normalisation_atol,
)


def pair(batch: int, vocab: int, seed: int, agreement: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher logits and theta log-probabilities that partly agree, as models' rows do."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(batch, vocab, generator=g) * 3
    theta = torch.log_softmax(torch.randn(batch, vocab, generator=g) * 3 + agreement * teacher, -1)
    return teacher, theta


def kernel_vs_reference_logq_atol(a, b, teacher, theta, tokens, masked=None) -> float:
    """|log q(y)| of the kernel against the torch reference, each at its own float32 α (``a``, ``b``): the kernel's
    normalisation (ONE_NORMALISATION_ATOL at any V) plus torch's (one_normalisation_atol(V)), plus the move of the
    exact log q(y) between the two α, |Δα|·|d(y) − E_q[d]| to first order (doubled for the curvature). ``masked``:
    ids taken out of q after α (a stop-token mask), per row, or None."""
    lt, lth = torch.log_softmax(teacher.double(), -1), theta.double()
    d = lt - lth
    x = lth + a.double().unsqueeze(-1) * d
    for r, ids in enumerate(masked or ()):
        x[r, list(ids)] = -math.inf
    q = torch.softmax(x, -1)
    slope = (d.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - (q * d.nan_to_num(posinf=0, neginf=0)).sum(-1)).abs()
    move = 2 * ((a.double() - b.double()).abs() * slope).max().item()
    return ONE_NORMALISATION_ATOL + one_normalisation_atol(teacher.shape[-1]) + move


def float64_root(lth: torch.Tensor, lt: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """kl_symmetry's α by 200 bisections in float64 (E_q[d] is non-decreasing in α)."""
    d = lt - lth
    low, high = torch.full((lt.shape[0],), lo, dtype=torch.float64), torch.full((lt.shape[0],), hi, dtype=torch.float64)
    for _ in range(200):
        mid = 0.5 * (low + high)
        q = torch.softmax(lth + mid.unsqueeze(-1) * d, -1)
        up = (q * d).sum(-1) > 0
        high, low = torch.where(up, mid, high), torch.where(up, low, mid)
    return 0.5 * (low + high)


@pytest.mark.parametrize("vocab", [1, 7, 255, 256, 257, 1000, 49152])
@pytest.mark.parametrize("method", ["fixed", "kl_symmetry"])
def test_kernel_matches_float64_and_the_reference(vocab, method):
    batch = 12
    teacher, theta = pair(batch, vocab, seed=vocab)
    computer = (
        get_alpha_computer(method, alpha_min=0.1, alpha_max=0.9)
        if method == "kl_symmetry"
        else (get_alpha_computer("fixed", alpha=0.3))
    )
    rows = [RowSampling(seed=i, force_first_token=(i % 5 == 0)) for i in range(batch)]
    steps = [i % 3 for i in range(batch)]
    warm = torch.linspace(0.0, 1.0, batch)
    out, passes = decide_fused(
        ModelRows.pair(teacher, theta, theta_normalized=True),
        [counter_uniform(r.seed, s) for r, s in zip(rows, steps)],
        [r.force_first_token and s == 0 for r, s in zip(rows, steps)],
        computer,
        warm,
    )
    assert (out[:, 5] == 0).all(), "every row here is the kernel's to decide"
    if method == "fixed":
        assert passes == batch  # one pass a row: nothing to solve
    else:  # a solve from a cold start: more passes than rows where there is something to solve, a few per row
        assert (passes == batch) if vocab == 1 else (batch < passes <= 6 * batch), passes
    lt, lth = torch.log_softmax(teacher.double(), -1), theta.double()
    forced = torch.tensor([r.force_first_token and s == 0 for r, s in zip(rows, steps)])
    if method == "fixed":
        expected_alpha = torch.full((batch,), 0.3, dtype=torch.float64)
    else:
        expected_alpha = float64_root(lth, lt, 0.1, 0.9) if vocab > 1 else torch.full((batch,), 0.5).double()
    expected_alpha = torch.where(forced, torch.ones_like(expected_alpha), expected_alpha)
    alpha = torch.from_numpy(out[:, 1])
    if vocab > 1:
        torch.testing.assert_close(alpha, expected_alpha, rtol=0, atol=ALPHA_ATOL)
    tokens = torch.from_numpy(out[:, 0]).long().unsqueeze(-1)
    logq = torch.log_softmax((1 - alpha.unsqueeze(-1)) * lth + alpha.unsqueeze(-1) * lt, -1)
    for column, full in ((2, lt), (3, lth), (4, logq)):
        torch.testing.assert_close(
            torch.from_numpy(out[:, column]), full.gather(-1, tokens).squeeze(-1), rtol=0, atol=ONE_NORMALISATION_ATOL
        )
    reference = decide(ModelRows.pair(teacher, theta, theta_normalized=True), steps, rows, computer, warm, fused=False)
    assert torch.equal(reference.tokens, tokens.squeeze(-1)), "the same uniform must pick the same token"


def test_alpha_stays_accurate_when_the_models_nearly_agree():
    """Var_q(d) is small here, so any error in E_q[d] moves α by that error / Var_q(d).

    Large raw logits (a log-normaliser near 52) used to round the constant in d and put α
    about 1.5e-3 off; the float32 torch reference is about 3e-3 off on these rows.
    """
    g = torch.Generator().manual_seed(1)
    base = torch.randn(64, 49152, generator=g) * 3
    teacher = base + 40.0
    theta = torch.log_softmax(base + 0.05 * torch.randn(64, 49152, generator=g), -1)
    computer = get_alpha_computer("kl_symmetry")
    out, _ = decide_fused(
        ModelRows.pair(teacher, theta, theta_normalized=True), [0.5] * 64, [False] * 64, computer, None
    )
    assert (out[:, 5] == 0).all()
    lt, lth = torch.log_softmax(teacher.double(), -1), theta.double()
    expected = float64_root(lth, lt, computer.alpha_min, computer.alpha_max)
    torch.testing.assert_close(torch.from_numpy(out[:, 1]), expected, rtol=0, atol=3e-4)


def test_stop_tokens_before_min_tokens_are_masked_after_alpha():
    """The stop-token mask before min_tokens runs in the kernel: α on the full rows, q without the stop tokens."""
    batch, vocab = 8, 3000
    teacher, theta = pair(batch, vocab, seed=6)
    for logits in (teacher, theta):
        top = logits[:4].amax(-1)
        logits[:4, 7] = top - 1.5  # a stop token with a good share of the mass on both sides
        logits[:4, vocab - 1] = top - 2.0  # another, in the last (partial) block
    theta = torch.log_softmax(theta, -1)
    teacher[4, 9] += 30.0  # ... and one with nearly all of it: a subtraction from the total would cancel there
    stops = (7, 9, 7, vocab - 1, vocab + 5)  # repeated and out-of-vocabulary ids are harmless
    rows = [RowSampling(seed=i, min_tokens=3, stop_token_ids=stops) for i in range(batch)]
    steps = [1] * 6 + [3, 4]  # the last two rows are past min_tokens: nothing is masked
    computer = get_alpha_computer("kl_symmetry")
    uniforms = [counter_uniform(r.seed, s) for r, s in zip(rows, steps)]
    masked = [r.stop_token_ids if s < r.min_tokens else () for r, s in zip(rows, steps)]
    edits = row_edits(rows, steps, None, vocab, None)
    out, _ = decide_fused(
        ModelRows.pair(teacher, theta, theta_normalized=True), uniforms, [False] * batch, computer, None, edits
    )
    assert out[:, 5].tolist() == [0] * batch  # the blocks of the masked tokens are summed again: none goes back
    lt, lth = torch.log_softmax(teacher.double(), -1), theta.double()
    alpha = float64_root(lth, lt, computer.alpha_min, computer.alpha_max)
    q = torch.softmax((1 - alpha.unsqueeze(-1)) * lth + alpha.unsqueeze(-1) * lt, -1)
    masked_mass = q[:, [7, vocab - 1]].sum(-1)
    assert (masked_mass[:4] > 0.05).all(), "the mask must matter"
    assert q[4, 9] > 0.5, "row 4's masked token must hold most of q (the kernel handed such rows back before)"
    ok = torch.from_numpy(out[:, 5] == 0)
    torch.testing.assert_close(torch.from_numpy(out[:, 1])[ok], alpha[ok], rtol=0, atol=ALPHA_ATOL)
    tokens = torch.from_numpy(out[:, 0]).long()
    for r in ok.nonzero().flatten().tolist():
        x = (1 - alpha[r]) * lth[r] + alpha[r] * lt[r]
        if masked[r]:
            x[[7, 9, vocab - 1]] = -math.inf
        logq = torch.log_softmax(x, -1)
        assert tokens[r] not in ((7, 9, vocab - 1) if masked[r] else ())
        assert abs(out[r, 4] - float(logq[tokens[r]])) < ONE_NORMALISATION_ATOL
    # Through decide(): the kernel's rows and the handed-back row agree with the reference.
    via_kernel = decide(ModelRows.pair(teacher, theta, theta_normalized=True), steps, rows, computer)
    reference = decide(ModelRows.pair(teacher, theta, theta_normalized=True), steps, rows, computer, fused=False)
    assert torch.equal(via_kernel.tokens, reference.tokens)
    torch.testing.assert_close(via_kernel.alpha, reference.alpha, rtol=0, atol=ALPHA_TWO_SOLVES_ATOL)
    stopped = [((7, 9, vocab - 1) if s < r.min_tokens else ()) for r, s in zip(rows, steps)]
    atol = kernel_vs_reference_logq_atol(via_kernel.alpha, reference.alpha, teacher, theta, reference.tokens, stopped)
    torch.testing.assert_close(via_kernel.logq, reference.logq, rtol=0, atol=atol)


def test_draws_follow_q():
    q = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05] + [0.0] * 300)
    draws = 20000
    logq = torch.log(q).clamp_min(-60.0).expand(draws, -1).contiguous()  # finite: the kernel's domain
    out, _ = decide_fused(
        ModelRows.pair(logq, logq),
        [counter_uniform(s, 0) for s in range(draws)],
        [False] * draws,
        get_alpha_computer("fixed"),
        None,
    )
    assert (out[:, 5] == 0).all()
    freq = torch.bincount(torch.from_numpy(out[:, 0]).long(), minlength=305)[:5].double() / draws
    p = q[:5].double()
    assert ((freq - p).abs() <= 4 * torch.sqrt(p * (1 - p) / draws)).all(), freq


def test_a_block_sum_rounded_up_does_not_favour_the_blocks_last_token():
    """The draw finds a block by its vectorised float32 sum, then re-sums the block in order.

    The two sums can differ in the last bits. A target between them must not fall through to
    the block's last token, whose own weight here is e^-50 of the others'.
    """
    vocab = 2 * 256
    theta = torch.randn(1, vocab, generator=torch.Generator().manual_seed(8)).numpy()
    theta[0, 255] = theta[0].max() - 50.0
    teacher = theta.copy()
    top = float(theta.max())
    weights = np.array([kernel._exp32(np.float32(x - top)) for x in theta[0]], dtype=np.float64)
    first, second = weights[:256].sum(), weights[256:].sum()
    blocks = np.array([first * (1 + 1e-7), second])  # the first block's sum rounded up
    total = blocks.sum()
    u = (first * (1 + 0.5e-7)) / total  # the target lies between the two sums of the first block
    no_edit = np.zeros(1, dtype=np.int64)
    token = kernel._draw(theta[0], teacher[0], 0.0, top, top, blocks, total, u, no_edit, np.zeros(1), 0)
    assert token == int(np.flatnonzero(weights[:255] > 0)[-1]), "the last non-negligible token of the block"


def test_rows_with_filters_go_to_the_reference_and_the_batch_stays_in_order():
    teacher, theta = pair(6, 3000, seed=3)
    computer = get_alpha_computer("kl_symmetry")
    rows = [
        RowSampling(seed=0),
        RowSampling(seed=1, temperature=0.7),
        RowSampling(seed=2),
        RowSampling(seed=3, top_p=0.9),
        RowSampling(seed=4, min_tokens=5, stop_token_ids=(2,)),
        RowSampling(seed=5, logit_bias={7: 2.0}),
    ]
    steps = [1, 1, 1, 1, 1, 1]
    assert kernel_rows(rows, computer, torch.device("cpu")) == [True, False, True, False, True, False]
    assert not any(kernel_rows(rows, get_alpha_computer("ess_balance"), torch.device("cpu")))
    assert not any(kernel_rows(rows, computer, torch.device("meta")))
    mixed = decide(ModelRows.pair(teacher, theta, theta_normalized=True), steps, rows, computer)
    reference = decide(ModelRows.pair(teacher, theta, theta_normalized=True), steps, rows, computer, fused=False)
    assert torch.equal(mixed.tokens, reference.tokens)
    assert mixed.ok.all()
    # Two float32 computations of each: the kernel's and torch's (at V = 3000, past SMALL_VOCAB), log q at two α.
    torch.testing.assert_close(mixed.alpha, reference.alpha, rtol=0, atol=ALPHA_TWO_SOLVES_ATOL)
    atol = ONE_NORMALISATION_ATOL + one_normalisation_atol(teacher.shape[-1])
    torch.testing.assert_close(mixed.logp, reference.logp, rtol=0, atol=atol)  # log π_t and log π_θ
    stopped = [(2,) if r.min_tokens > s else () for r, s in zip(rows, steps)]
    atol = kernel_vs_reference_logq_atol(mixed.alpha, reference.alpha, teacher, theta, reference.tokens, stopped)
    torch.testing.assert_close(mixed.logq, reference.logq, rtol=0, atol=atol)
    # The filtered rows are the reference's own, bit for bit.
    for i in (1, 3, 5):
        assert mixed.logq[i] == reference.logq[i]


def test_rows_outside_the_kernels_domain_are_handed_back():
    teacher, theta = pair(3, 600, seed=4)
    teacher[0, 5] = -math.inf  # a masked token: the reference handles the joint support
    teacher[1] = torch.arange(600.0) * 2.0  # the two models disagree by hundreds of nats
    theta[1] = torch.log_softmax(-torch.arange(600.0) * 2.0, -1)
    computer = get_alpha_computer("fixed", alpha=0.5)
    out, _ = decide_fused(
        ModelRows.pair(teacher, theta, theta_normalized=True), [0.3, 0.6, 0.9], [False] * 3, computer, None
    )
    assert out[:, 5].tolist() == [1, 0, 0] or out[:, 5].tolist() == [1, 1, 0]
    rows = [RowSampling(seed=i) for i in range(3)]
    via_kernel = decide(ModelRows.pair(teacher, theta, theta_normalized=True), [1] * 3, rows, computer)
    reference = decide(ModelRows.pair(teacher, theta, theta_normalized=True), [1] * 3, rows, computer, fused=False)
    assert torch.equal(via_kernel.tokens, reference.tokens)
    # A fixed α: the kernel's normalisation and torch's at V = 600 (≤ SMALL_VOCAB).
    torch.testing.assert_close(via_kernel.logq, reference.logq, rtol=0, atol=TWO_NORMALISATIONS_ATOL)
    assert via_kernel.handed_back.tolist() == out[:, 5].astype(bool).tolist()
    assert not via_kernel.unconverged.any() and not reference.handed_back.any()


def unconverged_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(teacher, theta, warm start) of two rows for kl_symmetry: row 0 starts at its float64 root, so one pass
    settles it; row 1 starts at 0, far from its root, and needs several."""
    teacher, theta = pair(2, 1000, seed=seed)
    computer = get_alpha_computer("kl_symmetry")
    root = float64_root(theta.double(), torch.log_softmax(teacher.double(), -1), computer.alpha_min, computer.alpha_max)
    return teacher, theta, torch.tensor([float(root[0]), 0.0])


def test_a_solve_that_does_not_converge_is_handed_back_not_drawn(monkeypatch):
    """With one pass allowed, the row started at its root converges on it; the other does not and comes back
    (status 1, flagged unconverged) where the reference's solver would raise. ``_MAX_PASSES`` is read at each call:
    a constant compiled into the kernel would ignore the patch."""
    monkeypatch.setattr(kernel, "_MAX_PASSES", 1)
    teacher, theta, warm = unconverged_case(seed=13)
    computer = get_alpha_computer("kl_symmetry")
    out, passes = decide_fused(
        ModelRows.pair(teacher, theta, theta_normalized=True), [0.3, 0.3], [False, False], computer, warm
    )
    assert out[:, 5].tolist() == [0, 1], "status"
    assert out[:, 7].tolist() == [0, 1], "unconverged"
    assert out[:, 6].tolist() == [1, 1] and passes == 2, "passes: exactly _MAX_PASSES, the last one tested"


def test_decide_gives_an_unconverged_row_to_the_reference_and_counts_it(monkeypatch):
    """decide() on the CPU: the row the kernel could not solve in its passes is decided by the reference (which
    solves it in its own), matches decide() with every row on the reference, and is flagged in the Decision."""
    monkeypatch.setattr(kernel, "_MAX_PASSES", 1)
    reference_rows = rows_sent_to_the_reference(monkeypatch)
    teacher, theta, warm = unconverged_case(seed=14)
    rows = [RowSampling(seed=0), RowSampling(seed=1)]
    computer = get_alpha_computer("kl_symmetry")
    mixed = decide(ModelRows.pair(teacher, theta, theta_normalized=True), [1, 1], rows, computer, alpha_init=warm)
    assert reference_rows == [1], "the unconverged row (and only it) goes to the reference"
    assert mixed.handed_back.tolist() == [False, True] and mixed.unconverged.tolist() == [False, True]
    assert Decision.concatenate([mixed, mixed]).unconverged.tolist() == [False, True, False, True]
    full = decide(
        ModelRows.pair(teacher, theta, theta_normalized=True), [1, 1], rows, computer, alpha_init=warm, fused=False
    )
    assert mixed.tokens.tolist() == full.tokens.tolist()
    torch.testing.assert_close(mixed.alpha, full.alpha, atol=ALPHA_TWO_SOLVES_ATOL, rtol=0)  # row 1: two solves
    assert not full.handed_back.any() and not full.unconverged.any()


def test_row_maximum_and_finiteness_from_the_bits():
    """The kernel's max works on the float bits as integers; compare it with NumPy on the hard cases."""
    rng = np.random.default_rng(0)
    cases = {
        "mixed signs": rng.standard_normal(1003).astype(np.float32),
        "all negative": -np.abs(rng.standard_normal(1003)).astype(np.float32) - 5,
        "signed zeros": np.array([-0.0, -1.0, 0.0, -2.0], dtype=np.float32),
        "near the float32 limit": np.array([-3.0e38, -2.9e38, -3.4e38], dtype=np.float32),
        "one entry": np.array([-7.25], dtype=np.float32),
    }
    for name, row in cases.items():
        top, finite = kernel._max_if_finite(row)
        assert finite and top == row.max(), name
    for position in (0, 500, 1002):
        for bad in (math.nan, -math.nan, math.inf, -math.inf):
            row = cases["mixed signs"].copy()
            row[position] = bad
            assert not kernel._max_if_finite(row)[1], (position, bad)


def test_rows_of_different_shapes_are_refused():
    teacher, theta = pair(2, 300, seed=7)
    with pytest.raises(ValueError, match="every model.s rows must match"):
        decide_fused(
            ModelRows.pair(teacher, theta[:, :299]), [0.5, 0.5], [False, False], get_alpha_computer("fixed"), None
        )


def test_bad_rows_still_raise_a_named_error():
    teacher, theta = pair(2, 300, seed=5)
    teacher[1, 3] = math.nan
    with pytest.raises(ValueError, match="NaN in rows 1"):
        decide(
            ModelRows.pair(teacher, theta), [1, 1], [RowSampling(), RowSampling()], get_alpha_computer("kl_symmetry")
        )


def test_exp_polynomial_is_within_float32_resolution():
    x = np.linspace(-86.0, 0.0, 200001, dtype=np.float32)
    values = np.array([kernel._exp32(v) for v in x[::97]], dtype=np.float64)
    relative = np.abs(values / np.exp(x[::97].astype(np.float64)) - 1)
    assert relative.max() < 2e-7
    assert kernel._exp32(np.float32(-200.0)) == 0.0


def test_the_series_step_lands_where_newtons_step_does_not():
    """From α 0.03 off the root, the cumulant series puts α within 1e-6 of it, Newton's step only within ~1e-4.

    The cumulants are computed here in float64 from the weights; the root is a float64 bisection.
    Where the truncated series has no root near Newton's step, the step stays Newton's.
    """
    teacher, theta = pair(1, 4096, seed=11)
    lt, lth = torch.log_softmax(teacher.double(), -1), theta.double()
    root = float(float64_root(lth, lt, 0.0, 1.0))
    d = (lt - lth)[0]

    def cumulants(alpha: float) -> tuple[float, float, float, float]:
        q = torch.softmax(lth[0] + alpha * d, -1)
        mean = float((q * d).sum())
        centred = d - mean
        k2, m3, m4 = (float((q * centred**k).sum()) for k in (2, 3, 4))
        return mean, k2, m3, m4 - 3 * k2 * k2

    start = root + 0.03
    g, k2, k3, k4 = cumulants(start)
    assert abs(start - g / k2 - root) > 1e-5, "the case must be one Newton's step does not settle"
    assert abs(start + kernel._series_step(g, k2, k3, k4) - root) < 1e-6
    assert kernel._series_step(1.0, 1.0, 0.0, -100.0) == -1.0  # 1 + δ − 100δ³/6 turns down before a root near −1
    assert kernel._series_step(1.0, 1.0, 1.5, 0.0) == -1.0  # 1 + δ + 0.75δ² has no real root


def test_a_warm_start_settles_on_the_second_pass():
    """α warm-started 0.02 off (as between decoding steps) needs one pass to step and one to confirm, in most rows."""
    batch = 32
    teacher, theta = pair(batch, 8192, seed=12)
    lt, lth = torch.log_softmax(teacher.double(), -1), theta.double()
    computer = get_alpha_computer("kl_symmetry")
    root = float64_root(lth, lt, computer.alpha_min, computer.alpha_max)
    warm = (root + 0.02).clamp(0, 1).float()
    out, passes = decide_fused(
        ModelRows.pair(teacher, theta, theta_normalized=True), [0.5] * batch, [False] * batch, computer, warm
    )
    assert (out[:, 5] == 0).all()
    torch.testing.assert_close(torch.from_numpy(out[:, 1]), root, rtol=0, atol=ALPHA_ATOL)
    assert passes <= 2.25 * batch, f"{passes / batch:.2f} passes per row (Newton's steps alone take 3)"


def test_log_normalisers_in_one_read_whatever_the_maximums_position():
    """The log-normaliser is summed chunk by chunk against the largest value so far; compare with float64."""
    rng = np.random.default_rng(1)
    noise = (rng.standard_normal(10_000) * 4).astype(np.float32)
    rows = {
        "rising (rescaled at every chunk)": np.sort(noise),
        "falling": np.sort(noise)[::-1].copy(),
        "spike in the last, partial chunk": np.concatenate([noise[:-1], np.float32([60.0])]),
        "large logits": noise + np.float32(300.0),
    }
    for name, teacher in rows.items():
        theta = rng.permutation(teacher)
        t_max, h_max, lse_t, lse_h, finite = kernel._maxima_and_log_normalisers(teacher, theta, False)
        expected = float(torch.logsumexp(torch.from_numpy(teacher).double(), 0))
        assert finite and t_max == teacher.max() and h_max == theta.max(), name
        # The kernel's float32 chunks (tests.tolerances.KERNEL_BLOCK); no row maximum rounds here, all within it.
        assert abs(lse_t - expected) < ONE_NORMALISATION_ATOL and abs(lse_h - expected) < ONE_NORMALISATION_ATOL, (
            name,
            lse_t,
            lse_h,
            expected,
        )
        assert kernel._maxima_and_log_normalisers(teacher, theta, True)[3] == 0.0
    broken = rows["falling"].copy()
    broken[-1] = math.nan
    assert not kernel._maxima_and_log_normalisers(rows["rising (rescaled at every chunk)"], broken, True)[4]
