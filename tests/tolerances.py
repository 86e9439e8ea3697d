"""The suite's numeric tolerances for float32 engine outputs, each derived where it is set.

Two engines, or an engine and plain transformers, compute the same log-probability from the same weights with
different float32 kernels (oneDNN against torch's matmul, other blockings for other batch compositions, fused
against separate norms). Their difference is rounding that passes through every layer, so it is not a small
multiple of float32's unit roundoff (u = 2**-24 ≈ 6e-8) per operation: it is measured, and each bound below is a
measured spread times a stated margin, or follows from another bound by the triangle inequality. Where two values
are one computation read twice, the suite asserts equality instead (a dense top-k value and the record of the same
token: ``dual_sampling.decision.result.dense_top``).

Measured by ``python -m tests.measure_spread tiny|smollm2`` with the suite's own oracle (``tests.oracles.rescore``):
the largest |engine − transformers| of log π_t and log π_θ over 576 sampled tokens (384 for SmolLM2), and the
largest |log π_θ − log π_t| of two engines holding the same weights, on 2026-11-26 on the CI machine's kind:

==========================  =====================  =========================
pair                        engine − transformers  same weights, two engines
==========================  =====================  =========================
tiny, untied (2 layers)     7.5e-6                 8.9e-6
tiny, tied (2 layers)       5.4e-6                 1.2e-5
SmolLM2 / pruned (30/24)    8.6e-5 (1.04e-4 after  not measured
                            a state-dict update;
                            7.4e-4 over 337 tokens
                            of other prompts, by
                            examples/sampler_mismatch)
==========================  =====================  =========================
"""

from __future__ import annotations

import math

F32_U = 2.0**-24
"""float32's unit roundoff."""

RESCORE_ATOL = 1e-4
"""|engine log π − transformers re-scoring| (``tests.oracles.rescore``: the model's float32 forward, normalised in
float64), two-layer tiny models: 13× the largest measured (7.5e-6).

The margin covers other prompts, lengths and batch compositions than the measurement's. A real defect is far
larger: a stale output projection was off by 1e-3 to 28 nats, a row one step out of phase by whole nats."""

RESCORE_ATOL_DEEP = 2e-3
"""The same for the SmolLM2 pair (30 and 24 layers): 2.7× the largest measured (7.4e-4, on a token far from the most
likely one: the error grows with |logit − log Z|). Rounding passes through 15 times as many layers as the tiny
models', with larger logits, and the spread is 10 to 100 times theirs. A stale output projection was off by nats."""

LOGQ_ATOL_FACTOR = 2
"""log q is checked at twice the log π bound: it is built from both models' log π (each within the bound) at a
recorded α, and log q = (1−α)·log π_θ + α·log π_t − log Z moves by at most the larger of the two errors plus
the same again through log Z."""

SAME_WEIGHTS_TWO_RUNS = 2 * RESCORE_ATOL
"""|a − b| for one log-probability computed by two engines holding the same weights, or by one engine in two
batch compositions: each is within RESCORE_ATOL of the same transformers re-scoring, so by the triangle inequality
within twice that of each other (measured: 1.2e-5, above the 1e-5 bound this replaced)."""

KERNEL_BLOCK = 256
"""Terms the compiled kernel sums in float32, in whatever order numba vectorises them, before it carries the sum in
float64 (``dual_sampling/decision/kernel.py`` ``_BLOCK``): the same on every CPU.

Its log-normaliser pass (``_maxima_and_log_normalisers``, which yields the recorded log π_t and log π_θ) sums
``_CHUNK`` = 2048 terms per float32 run instead. numba vectorises that sum (fastmath ``reassoc``) with at least 8 lanes
on the AVX2 and AVX-512 CPUs CI runs on, so each term goes through at most ⌈2048/8⌉ − 1 + 7 = 262 roundings: the
same as torch's at SMALL_VOCAB, so ONE_NORMALISATION_ATOL still covers it. A CPU without AVX (4 lanes: 514) or an
unvectorised build (2047) would not be covered."""

TORCH_LANES = 8
"""The fewest float32 lanes torch's vectorised CPU reductions (log_softmax, logsumexp, sum) keep on x86: ``Vectorized
<float>`` is 8 wide under the ``default`` and ``avx2`` capabilities and 16 under ``avx512``. Each lane adds every
8th (16th) term in order and the lanes are combined at the end, so the fewer the lanes the longer each run: 8 is the
worst case, and the bound holds for the wider ones."""

MAX_TEST_LOGIT = 64
"""|logit| the test rows and engine logits stay below: subtracting a row maximum rounds by at most this many u."""


def sum_roundings(vocab: int) -> int:
    """The most roundings one term of a float32 sum of ``vocab`` positive terms goes through, over the reductions the
    code under test may use on any x86 CPU: the kernel's (KERNEL_BLOCK − 1 within a block; the float64 carry adds
    nothing at this precision) and torch's (⌈V / lanes⌉ − 1 along a lane and lanes − 1 to combine them, worst at
    TORCH_LANES). A sum of positive terms whose evaluation tree has height h is within h·u of the exact sum, relatively
    (to first order), whatever the order inside the tree: so this bounds every order either may pick."""
    return max(KERNEL_BLOCK - 1, math.ceil(vocab / TORCH_LANES) - 1 + TORCH_LANES - 1)


def one_normalisation_atol(vocab: int) -> float:
    """|float32 log-probability − exact| for one normalisation of ``vocab`` given float32 logits on any x86 CPU: a
    relative error of at most ``sum_roundings(V)`` u in the sum of exponentials, so as much in its log, plus one u for
    each exponential's own rounding and one for the log's (relative to a log-normaliser of at most ln V, so ⌈ln V⌉ u),
    plus the subtraction of the row maximum, MAX_TEST_LOGIT u. At V = 49,152 about 3.7e-4, against 2.8e-5 measured
    under AVX2 and 1.4e-5 under AVX-512 (a worst case, not a random walk); up to SMALL_VOCAB it is at most
    ONE_NORMALISATION_ATOL."""
    return (sum_roundings(vocab) + 2 + math.ceil(math.log(max(vocab, 1))) + MAX_TEST_LOGIT) * F32_U


SMALL_VOCAB = 2048
"""The widest rows most tests use: up to here torch's lanes run at most 262 terms, about the kernel's blocks."""

ONE_NORMALISATION_ATOL = one_normalisation_atol(SMALL_VOCAB)
"""The same for rows of V ≤ SMALL_VOCAB, and for the compiled kernel's own outputs at any V up to 262,144 (its blocks
do not grow with V: 255 + 2 + 13 + 64 < 262 + 2 + 8 + 64): 336 u, about 2.0e-5."""

TWO_NORMALISATIONS_ATOL = 2 * ONE_NORMALISATION_ATOL
"""One log-probability computed from the same float32 logits by two normalisations (the kernel and torch's
log_softmax; a mixture at α = 1 and the teacher's own): each within ONE_NORMALISATION_ATOL of the exact value (rows of
V ≤ SMALL_VOCAB; wider rows take ``2 * one_normalisation_atol(V)``)."""

BF16_RESCORE_ATOL = 0.25
"""The same where a model runs in bfloat16 in the engine (the ``mixed-dtype`` twin's teacher; in the speculative mode
theta too) and the oracle runs its stored bfloat16 weights, upcast exactly, in float32: 2.9× the largest measured
(8.6e-2, a dense top-k value; log π_t of sampled tokens 6.9e-2; ``tests/test_twin_matrix.py``, 2026-11-28).

bfloat16 keeps 8 significant bits (u = 2**-8 ≈ 3.9e-3), so rounding the twin's largest logits (about 18) alone
moves them by about 0.07, as measured. The records of a model that stays float32 beside it keep RESCORE_ATOL (the
twin matrix checks that, and that the bfloat16 side is far outside it, so the dtype really took effect)."""

BF16_ALPHA_ATOL = 5e-3
"""|α − float64 root| where a model runs in bfloat16 (the ``mixed-dtype`` twin: its teacher, and in the speculative mode
theta too): their log-probabilities move by up to BF16_RESCORE_ATOL's 0.09, which moves the root of E_q[d] = 0 by
about that over Var_q(d). Measured at most 1.3e-3 (lockstep records), 8.8e-4 (after new weights), 6.1e-4 (stop string
and hint) and 9.0e-4 (speculative records), ``tests/test_twin_matrix.py``, 2026-11-29: 3.9× the largest. α is a
weight in [0, 1], not a log-probability, so the nats tolerance is not its own."""

ALPHA_ATOL = 5e-6
"""|α − float64 root| for a float32 solve: the solvers stop within ``tol`` = 1e-6 of the root of their own float32
E_q[d] (the kernel's rule keeps α within tol; the reference's too where Var_q(d) ≥ 1), and that float32 E_q[d] is off
the exact one by about ONE_NORMALISATION_ATOL·|d|, which moves the root by that over Var_q(d): about 4e-6 on the
test rows (|d| of a few nats, Var_q(d) of several nats²). Rows where the models nearly agree (small Var_q(d)) are
checked by their residual instead (``tests.oracles.assert_kl_symmetry_alpha``).

The same holds for ess_balance and entropy (each the root of one float32 expectation, off by the same order; measured
at most 6.5e-8 at V = 5000) and for trust_region's boundary K(α) = ε away from α = 0 (measured 1.4e-7 at ε = 0.05;
near 0 K is flat, and the boundary is judged in KL: ``tests.oracles.assert_trust_region_alpha``)."""


def alpha_atol(vocab: int) -> float:
    """ALPHA_ATOL for rows of ``vocab`` tokens: past SMALL_VOCAB torch's float32 reductions of E_q[d] round by up to
    one_normalisation_atol(V) relatively instead of ONE_NORMALISATION_ATOL, so the rounding part of ALPHA_ATOL (all
    but the solvers' ``tol`` = 1e-6) grows in that ratio: 9.4e-6 at V = 5000."""
    tol = 1e-6
    return tol + (ALPHA_ATOL - tol) * max(1.0, one_normalisation_atol(vocab) / ONE_NORMALISATION_ATOL)


ALPHA_TWO_SOLVES_ATOL = 2 * ALPHA_ATOL
"""|α − α'| for one row solved twice in float32 (the kernel and the torch reference, a GPU and a CPU kernel, a row in a
batch and alone, a bounded solve and the clipped free one, warm and cold starts): each within ALPHA_ATOL of the same
float64 root, so within twice that of each other by the triangle inequality."""

ENGINE_ALPHA_ATOL = 1e-4
"""|engine α − float64 root on the re-scored rows| accepted outright; rows beyond it are judged by their residual
instead (``tests.oracles.assert_kl_symmetry_alpha``). The engine's log π are within RESCORE_ATOL of the re-scored
ones, so E_q[d] (d = log π_t − log π_θ) moves by at most 2·RESCORE_ATOL and the root by that over Var_q(d): within
1e-4 wherever Var_q(d) ≥ 2 nats², as on the tiny pairs' rows (teacher logits of std 4, theta's 2). Measured at most
4.7e-7 on the float32 twins (docs/testing.md). α is a weight in [0, 1]: this is its own bound, not RESCORE_ATOL's
nats, though the value is the same."""

ALPHA_TWO_RUNS_ATOL = 2 * ENGINE_ALPHA_ATOL
"""|α − α'| for one sample's step from two engine runs (a server and an offline call, other batch compositions,
repeated calls): each within ENGINE_ALPHA_ATOL of the same root, so within twice that of each other."""


def two_engines_penalised_atol(vocab: int, repetition_penalty: float = 1.0) -> float:
    """|a − b| for one penalised log-probability from two engines holding the same weights, where one normalises its
    penalised float32 logits with the compiled kernel and the other with torch's float32 log_softmax over ``vocab``
    (vLLM's ``processed_logprobs``): the engines' forwards differ by at most SAME_WEIGHTS_TWO_RUNS in log π (measured
    on one CPU kind, normalisations included); the repetition penalty multiplies a logit by p or 1/p, and so its
    error by at most max(p, 1/p); and the two normalisations at their worst over x86 reduction orders add
    ONE_NORMALISATION_ATOL (the kernel's) and one_normalisation_atol(V) (torch's), which the measurement need not
    have met. The tiny models (V = 49,152, p = 1.4): 6.7e-4, against 2.2e-5 seen under AVX2; a penalty applied
    wrongly moves log q by tenths of a nat."""
    scale = max(repetition_penalty, 1.0 / repetition_penalty)
    return scale * SAME_WEIGHTS_TWO_RUNS + ONE_NORMALISATION_ATOL + one_normalisation_atol(vocab)
