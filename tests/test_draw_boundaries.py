"""The draw against a float64 CDF, token by token: deterministic boundary tests instead of frequencies.

For rows with a real α (teacher ≠ theta, α strictly inside (0, 1)), masked tokens and a logit bias, the float64
reference builds q's CDF c_0 ≤ c_1 ≤ … (c_k: mass of tokens 0..k). A uniform just below c_k / c_V must draw token k;
just above it, the next token with mass. Every boundary is tried, across the 256-token blocks of both draws (the
kernel's and the torch reference's) and the last, partial block. A frequency test of 20,000 draws sees a 3 % bias at
best; a draw off by one token, one block or α shifted by 1e-4 fails here at once.

The margin, 1e-6 in u, is ten times what float32 weights can move a CDF value (relative error ~1e-7 per weight,
accumulated in float64), and each boundary is used only where both neighbouring tokens hold more than twice the
margin, so a pass or a failure is never decided by rounding.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from alpha import get_alpha_computer
from dual_sampling.decision import pipeline
from dual_sampling.decision.edits import row_edits
from dual_sampling.decision.kernel import decide_fused
from dual_sampling.decision.pipeline import ModelRows, RowSampling, decide
from tests.oracles import np_alpha_kl, np_log_softmax
from tests.tolerances import ALPHA_ATOL

VOCAB = 700  # two full 256-token blocks and a partial one of 188
MARGIN = 1e-6


def pair(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(teacher, theta) float32 logits that disagree, theta flatter, so that α lands inside (0, 1)."""
    rng = np.random.default_rng(seed)
    return rng.normal(0, 3.0, VOCAB).astype(np.float32), rng.normal(0, 1.5, VOCAB).astype(np.float32)


def reference_cdf(
    teacher: np.ndarray, theta: np.ndarray, alpha: float, masked=(), bias: dict[int, float] | None = None
) -> np.ndarray:
    """q's CDF in float64, normalised to end at 1."""
    log_q = (1 - alpha) * np_log_softmax(theta.astype(np.float64)) + alpha * np_log_softmax(teacher.astype(np.float64))
    for token, value in (bias or {}).items():
        log_q[token] += value
    log_q[list(masked)] = -np.inf
    w = np.exp(log_q - log_q.max())
    return np.cumsum(w) / w.sum()


def boundary_cases(cdf: np.ndarray) -> list[tuple[float, int]]:
    """(u, the token u must draw) on both sides of every boundary both of whose tokens hold > 2·MARGIN."""
    mass = np.diff(np.concatenate([[0.0], cdf]))
    cases = []
    alive = np.flatnonzero(mass > 0)
    for k, nxt in itertools.pairwise(alive):
        if mass[k] > 2 * MARGIN and mass[nxt] > 2 * MARGIN:
            cases += [(cdf[k] - MARGIN, int(k)), (cdf[k] + MARGIN, int(nxt))]
    return cases


def assert_boundaries_drawn(draw, cdf: np.ndarray) -> int:
    cases = boundary_cases(cdf)
    blocks = {t // 256 for _, t in cases}
    assert blocks == {0, 1, 2}, "every block, the partial one too, must hold boundaries"
    got = draw([u for u, _ in cases])
    wrong = [(u, want, int(g)) for (u, want), g in zip(cases, got) if int(g) != want]
    assert not wrong, f"{len(wrong)} of {len(cases)} boundaries drawn wrong, first (u, want, got): {wrong[:5]}"
    return len(cases)


def kernel_draw(teacher, theta, computer, masked=()):
    def draw(uniforms):
        b = len(uniforms)
        out, _ = decide_fused(
            ModelRows.pair(torch.from_numpy(np.tile(teacher, (b, 1))), torch.from_numpy(np.tile(theta, (b, 1)))),
            uniforms,
            [False] * b,
            computer,
            None,
            edits=row_edits(
                [RowSampling(min_tokens=1, stop_token_ids=tuple(masked))] * b, [0] * b, None, teacher.size, None
            ),
        )
        assert (out[:, 5] == 0).all(), "the kernel handed rows back"
        return out[:, 0]

    return draw


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_draw_at_a_fixed_real_alpha(seed):
    teacher, theta = pair(seed)
    alpha = 0.37
    checked = assert_boundaries_drawn(
        kernel_draw(teacher, theta, get_alpha_computer("fixed", alpha=alpha)), reference_cdf(teacher, theta, alpha)
    )
    assert checked > 300


def test_kernel_draw_at_the_solved_alpha_with_masked_tokens():
    teacher, theta = pair(2)
    masked = [3, 255, 256, 511, 600, VOCAB - 1]  # block edges and the last token
    computer = get_alpha_computer("kl_symmetry")
    out, _ = decide_fused(
        ModelRows.pair(torch.from_numpy(teacher[None]), torch.from_numpy(theta[None])), [0.5], [False], computer, None
    )
    alpha = float(out[0, 1])
    # The kernel's α against the float64 bisection: the float32 solve's own tolerance.
    oracle = np_alpha_kl(
        np_log_softmax(theta.astype(np.float64))[None], np_log_softmax(teacher.astype(np.float64))[None]
    )
    assert 0.05 < alpha < 0.95 and abs(alpha - oracle) < ALPHA_ATOL
    assert_boundaries_drawn(kernel_draw(teacher, theta, computer, masked), reference_cdf(teacher, theta, alpha, masked))


def test_reference_draw_with_masks_and_logit_bias(monkeypatch):
    """The torch path (taken for rows with filters) on rows with a real α, stop tokens masked before min_tokens and
    a logit bias; its uniforms are injected where it takes them from the counter."""
    teacher, theta = pair(3)
    alpha = 0.61
    masked = [0, 256, 512, 699]
    bias = {10: 2.5, 300: -1.0, 650: 4.0}
    cdf = reference_cdf(teacher, theta, alpha, masked, bias)
    cases = boundary_cases(cdf)
    uniforms = {i: u for i, (u, _) in enumerate(cases)}
    monkeypatch.setattr(pipeline, "counter_uniform", lambda seed, step: uniforms[seed])

    def draw(us):
        rows = [
            RowSampling(seed=i, min_tokens=5, stop_token_ids=tuple(masked), logit_bias=dict(bias))
            for i in range(len(us))
        ]
        d = decide(
            ModelRows.pair(
                torch.from_numpy(np.tile(teacher, (len(us), 1))), torch.from_numpy(np.tile(theta, (len(us), 1)))
            ),
            [0] * len(us),
            rows,
            get_alpha_computer("fixed", alpha=alpha),
            fused=False,
        )
        return d.tokens.numpy()

    assert_boundaries_drawn(draw, cdf)
