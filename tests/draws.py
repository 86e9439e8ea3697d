"""Tests of the draw: do an engine's tokens follow q? (Re-scoring checks the records; only these check the tokens.)

q spreads over thousands of tokens on the tiny models, so the tokens are tested through their randomised probability
integral transforms (PITs): with the vocabulary put in a fixed order, a token y drawn from a law p gives
F_p(y⁻) + v·p(y), v uniform, which is uniform on [0, 1). For two tokens, (F_q0(y0), F_q1(y1 | y0)) are independent
uniforms, whatever the vocabulary. The laws come from float64 re-scoring in plain transformers; the p-values from a
chi-square test of the PITs' histogram. A positive control (the same draws judged under another law) must be
rejected by the same test, so each test shows it has the power to tell.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tests.oracles import np_mix, rescore

LEVEL = 1e-3
"""Reject at this p-value: a correct engine fails a draw test once in a thousand runs of it."""

FIXED_ALPHA = 0.5
"""The teacher weight draw tests set (``update_alpha("fixed")``): one α for every row, so q after any first token
is known without solving for α over thousands of rows."""


def _chi_square_p(observed: np.ndarray, expected: float) -> float:
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = observed.size - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def pits(p: np.ndarray, tokens: np.ndarray, v: np.ndarray, order_by: np.ndarray | None = None) -> np.ndarray:
    """Randomised PITs of ``tokens`` under ``p`` (probabilities over the vocabulary), tokens ordered by decreasing
    ``order_by`` (default ``p``); ``v``: one uniform per token."""
    order = np.argsort(-(p if order_by is None else order_by), kind="stable")
    before = np.empty_like(p)
    before[order] = np.cumsum(p[order]) - p[order]
    return before[tokens] + v * p[tokens]


def uniform_grid_p(u: np.ndarray, bins: int = 5) -> float:
    """Chi-square p-value of pairs ``u`` ``[n, 2]`` against independent uniforms, on a bins × bins grid."""
    cells = np.minimum((u * bins).astype(int), bins - 1)
    observed = np.bincount(cells[:, 0] * bins + cells[:, 1], minlength=bins * bins)
    return _chi_square_p(observed, len(u) / bins**2)


def first_token_p(tokens: list[int], law: np.ndarray, order_by: np.ndarray, seed: int = 0) -> float:
    """Chi-square p-value, on 10 bins, of the tokens' randomised PITs under ``law`` (probabilities over the
    vocabulary) with the tokens ordered by decreasing ``order_by``. Ordered by the acceptance ratio q/π_θ, the test
    looks where an error in a speculative acceptance step moves mass."""
    picked = np.asarray(tokens)
    u = pits(law, picked, np.random.default_rng(seed).random(len(picked)), order_by)
    observed = np.bincount(np.minimum((u * 10).astype(int), 9), minlength=10)
    return _chi_square_p(observed, len(u) / 10)


def rows_after(model, prompt: list[int], firsts: list[int], vocab: int) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """log-probabilities over the first ``vocab`` ids in float64: the row after ``prompt`` and, for each first token
    a, the row after it (one batched forward, the last position's logits only)."""
    first = rescore(model, prompt, [0], vocab)[0].numpy()
    unique = sorted(set(firsts))
    with torch.no_grad():
        logits = model(torch.tensor([[*prompt, a] for a in unique]), logits_to_keep=1).logits[:, -1, :vocab]
    after = torch.log_softmax(logits.double(), -1).numpy()
    return first, dict(zip(unique, after))


def two_token_p_values(pairs: list[list[int]], prompt: list[int], hf_teacher, hf_theta, vocab: int) -> dict[str, float]:
    """p-values of the first two tokens of many seeds (``pairs``, drawn at :data:`FIXED_ALPHA` after ``prompt``)
    under q, and under the teacher's own law (the positive control: a correct engine's draws fail it)."""
    firsts = np.asarray(pairs)[:, 0].tolist()
    t0, t1 = rows_after(hf_teacher, prompt, firsts, vocab)
    h0, h1 = rows_after(hf_theta, prompt, firsts, vocab)
    laws = {
        "q": (np_mix(h0, t0, FIXED_ALPHA), lambda a: np_mix(h1[a], t1[a], FIXED_ALPHA)),
        "teacher": (np.exp(t0), lambda a: np.exp(t1[a])),
    }
    return two_token_p_values_under(pairs, laws)


def two_token_p_values_under(
    pairs: list[list[int]], laws: dict[str, tuple[np.ndarray, Callable[[int], np.ndarray]]]
) -> dict[str, float]:
    """p-values of the first two tokens of many seeds (``pairs``) under each of ``laws``: name → (the first token's
    law, the second token's law given the first), probabilities over the vocabulary."""
    drawn = np.asarray(pairs)
    v = np.random.default_rng(0).random(drawn.shape)
    p_values = {}
    for name, (first_law, second_law) in laws.items():
        u = np.empty(drawn.shape)
        u[:, 0] = pits(first_law, drawn[:, 0], v[:, 0])
        for a in np.unique(drawn[:, 0]).tolist():  # the second token's law depends on the first: one per first token
            rows = np.flatnonzero(drawn[:, 0] == a)
            # In token-id order (any fixed order gives uniform PITs): a cumulative sum, no sort per law.
            law = second_law(a)
            u[rows, 1] = np.cumsum(law)[drawn[rows, 1]] - (1 - v[rows, 1]) * law[drawn[rows, 1]]
        p_values[name] = uniform_grid_p(u)
    return p_values
