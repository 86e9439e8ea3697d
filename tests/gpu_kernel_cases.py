"""The fused GPU decision (``dual_sampling.decision.gpu_kernel``) under Triton's interpreter, against float64 oracles.

Run by ``tests/test_gpu_kernel.py`` in a process of its own with ``TRITON_INTERPRET=1`` set before anything imports
Triton (the interpreter needs Triton's own library functions built for it too; transformers imports Triton, so a
test session has it loaded long before). The kernel runs on CPU tensors, one row program at a time, on small
vocabularies with small blocks so that every row spans full blocks and a partial one.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from alpha import get_alpha_computer
from dual_sampling.decision import pipeline
from dual_sampling.decision.kernel import decide_fused
from dual_sampling.decision.pipeline import ModelRows, RowSampling, counter_uniform, decide
from tests.oracles import np_alpha_kl, np_log_softmax, rows_sent_to_the_reference
from tests.test_draw_boundaries import boundary_cases, pair, reference_cdf
from tests.test_gpu_kernel import LEVEL, masked_draw_p_values, masked_edits
from tests.tolerances import ALPHA_ATOL, ALPHA_TWO_SOLVES_ATOL, ONE_NORMALISATION_ATOL, TWO_NORMALISATIONS_ATOL

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/test_gpu_kernel.py, under TRITON_INTERPRET=1", allow_module_level=True)

VOCAB = 700
"""As in tests/test_draw_boundaries.py: with 256-token blocks, two full blocks and a partial one."""


@pytest.fixture(scope="module")
def interpreted():
    """The kernel module, its kernels built for Triton's interpreter."""
    import dual_sampling.decision.gpu_kernel as module

    return module


def run(gk, teacher, theta, computer, uniforms, forced=None, masked=None, warm=None, normalized=False, block=64):
    forced = [False] * teacher.shape[0] if forced is None else forced
    edits = None if masked is None else masked_edits(masked, teacher.shape[-1])
    out = gk.decide_gpu(
        ModelRows.pair(teacher, theta, theta_normalized=normalized), uniforms, forced, computer, warm, edits, block
    )
    return out.numpy()


def two_decisions_logq_atol(a, b, teacher, theta, scale: float = 1.0) -> float:
    """|log q(y)| of one row from two float32 decisions (V ≤ SMALL_VOCAB) at their own α ``a`` and ``b``: the two
    normalisations, plus the move of log q(y) between the two α, |Δα|·|s(y)·d(y) − E_q[s·d]| ≤ |Δα|·2·max s·max |d|
    (d = log π_t − log π_θ; s: the factor a repetition penalty multiplies a logit by, at most ``scale``)."""
    d = torch.log_softmax(teacher.double(), -1) - torch.log_softmax(theta.double(), -1)
    d = d.abs().nan_to_num(nan=0.0, posinf=0.0)  # a token masked on either side lies outside q's support
    delta = (a.double() - b.double()).abs()
    return TWO_NORMALISATIONS_ATOL + (delta * 2 * scale * d.amax(-1)).max().item()


def random_rows(b: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher, theta) float32 logits that disagree, theta flatter (α lands inside (0, 1))."""
    g = torch.Generator().manual_seed(seed)
    return 3.0 * torch.randn(b, vocab, generator=g), 1.5 * torch.randn(b, vocab, generator=g)


@pytest.mark.parametrize("normalized", [False, True])
def test_alpha_and_records_against_float64(interpreted, normalized):
    teacher, theta = random_rows(6, 300, seed=1)
    if normalized:
        theta = torch.log_softmax(theta, -1)
    uniforms = [counter_uniform(7, s) for s in range(6)]
    forced = [False, True, False, False, False, False]
    for computer in (get_alpha_computer("kl_symmetry"), get_alpha_computer("fixed", alpha=0.3)):
        out = run(interpreted, teacher, theta, computer, uniforms, forced, normalized=normalized)
        assert (out[:, 5] == 0).all(), "rows were handed back"
        for r in range(6):
            lt = np_log_softmax(teacher[r].double().numpy())
            lth = np_log_softmax(theta[r].double().numpy())
            want = 1.0 if forced[r] else np_alpha_kl(lth, lt) if computer.name == "kl_symmetry" else 0.3
            # The float32 solve's own tolerance, as for the CPU kernel.
            assert abs(out[r, 1] - want) < ALPHA_ATOL, (r, out[r, 1], want)
            token, a = int(out[r, 0]), out[r, 1]
            log_q = (1 - a) * lth + a * lt
            log_q -= np.log(np.exp(log_q - log_q.max()).sum()) + log_q.max()
            expected = [lt[token], lth[token], log_q[token]]  # log q at the kernel's own α
            np.testing.assert_allclose(out[r, 2:5], expected, atol=ONE_NORMALISATION_ATOL, rtol=0)
        # The CPU kernel draws the same tokens from the same uniforms (its blocks are 256 tokens, these 64).
        cpu, _ = decide_fused(
            ModelRows.pair(teacher, theta, theta_normalized=normalized), uniforms, forced, computer, None
        )
        assert (out[:, 0] == cpu[:, 0]).all()
        np.testing.assert_allclose(out[:, 1], cpu[:, 1], atol=ALPHA_TWO_SOLVES_ATOL, rtol=0)


def test_alpha_bounds_and_a_warm_start(interpreted):
    teacher, theta = random_rows(4, 300, seed=2)
    free = run(interpreted, teacher, theta, get_alpha_computer("kl_symmetry"), [0.5] * 4)[:, 1]
    low, high = float(free.min()) + 0.01, float(free.max()) - 0.01
    bounded = get_alpha_computer("kl_symmetry", alpha_min=low, alpha_max=high)
    out = run(interpreted, teacher, theta, bounded, [0.5] * 4)
    np.testing.assert_allclose(out[:, 1], np.clip(free, low, high), atol=ALPHA_TWO_SOLVES_ATOL, rtol=0)
    # A start at the root takes one pass; a start far from it more, to the same α.
    warm = run(interpreted, teacher, theta, get_alpha_computer("kl_symmetry"), [0.5] * 4, warm=torch.tensor(free))
    cold = run(interpreted, teacher, theta, get_alpha_computer("kl_symmetry"), [0.5] * 4, warm=torch.zeros(4))
    np.testing.assert_allclose(warm[:, 1], free, atol=ALPHA_TWO_SOLVES_ATOL, rtol=0)
    np.testing.assert_allclose(cold[:, 1], free, atol=ALPHA_TWO_SOLVES_ATOL, rtol=0)
    assert (warm[:, 6] == 1).all() and (cold[:, 6] > 1).all()


def test_the_draw_at_every_block_boundary(interpreted):
    """u just below and just above each CDF boundary near a block edge (and the first and last ones) draws the
    token on its side: ±1e-6 in u, with masked tokens at block edges. The 256-token blocks are the CPU's."""
    teacher, theta = pair(0)
    masked = [3, 255, 256, 511, 600, VOCAB - 1]
    for computer in (get_alpha_computer("fixed", alpha=0.37), get_alpha_computer("kl_symmetry")):
        probe = run(interpreted, *(torch.from_numpy(x[None]) for x in (teacher, theta)), computer, [0.5], block=256)
        alpha = float(probe[0, 1])
        cases = boundary_cases(reference_cdf(teacher, theta, alpha, masked))
        near_edge = [(u, want) for u, want in cases if min(want % 256, 255 - want % 256) <= 2]
        cases = [*near_edge, *cases[:2], *cases[-2:]]
        assert {want // 256 for _, want in cases} == {0, 1, 2}
        b = len(cases)
        out = run(
            interpreted,
            torch.from_numpy(np.tile(teacher, (b, 1))),
            torch.from_numpy(np.tile(theta, (b, 1))),
            computer,
            [u for u, _ in cases],
            masked=[masked] * b,
            block=256,
        )
        assert (out[:, 5] == 0).all()
        wrong = [(u, want, int(got)) for (u, want), got in zip(cases, out[:, 0]) if int(got) != want]
        assert not wrong, f"{len(wrong)} of {b} boundaries drawn wrong: {wrong[:5]}"


def test_rows_it_cannot_decide_come_back_and_the_rest_are_decided(interpreted):
    teacher, theta = random_rows(5, 200, seed=3)
    teacher[1, 17] = float("nan")
    theta[2, 150] = float("inf")
    teacher[3, 9] = 40.0  # holds nearly all of q's mass, and it is masked
    masked = [(), (), (), (9,), ()]
    out = run(interpreted, teacher, theta, get_alpha_computer("fixed", alpha=0.5), [0.3] * 5, masked=masked)
    assert out[:, 5].tolist() == [0, 1, 1, 1, 0]


def test_decide_on_a_kernel_device_mixes_kernel_and_reference_rows(interpreted, monkeypatch):
    """decide() as a CUDA device runs it (here with the interpreted kernel on CPU tensors): kernel rows, filtered
    rows for the reference and a handed-back row, against decide() with every row on the reference."""
    monkeypatch.setattr(pipeline, "kernel_device", lambda device: "cuda")
    teacher, theta = random_rows(5, 300, seed=4)
    theta[3, 5] = float("-inf")  # the kernel hands it back; the reference decides it
    rows = [
        RowSampling(seed=0),
        RowSampling(seed=1, top_p=0.9),
        RowSampling(seed=2, min_tokens=4, stop_token_ids=(1, 2)),
        RowSampling(seed=3),
        RowSampling(seed=4, temperature=0.7),
    ]
    computer = get_alpha_computer("kl_symmetry")
    mixed = decide(ModelRows.pair(teacher, theta), [1] * 5, rows, computer)
    reference = decide(ModelRows.pair(teacher, theta), [1] * 5, rows, computer, fused=False)
    assert mixed.tokens.tolist() == reference.tokens.tolist()
    atol = {"alpha": ALPHA_TWO_SOLVES_ATOL, "logp": TWO_NORMALISATIONS_ATOL}  # logp: log π_t and log π_θ
    atol["logq"] = two_decisions_logq_atol(mixed.alpha, reference.alpha, teacher, theta)
    for name in ("alpha", "logp", "logq"):
        torch.testing.assert_close(getattr(mixed, name), getattr(reference, name).float(), atol=atol[name], rtol=0)


@pytest.mark.parametrize("normalized", [False, True], ids=["raw-theta", "log-softmax-theta"])
def test_penalised_and_diverse_rows_are_the_references(interpreted, monkeypatch, normalized):
    """decide() as a CUDA device runs it, on rows with each penalty and with a group's diversity: the kernel decides
    them all (none handed back) and draws the reference's tokens from the same uniforms, with its records. With theta
    as log-softmax rows, the repetition penalty reads theta's log-normalisers, as the engines pass them."""
    monkeypatch.setattr(pipeline, "kernel_device", lambda device: "cuda")
    b, vocab = 24, 300
    teacher, theta = random_rows(b, vocab, seed=6)
    teacher += 4.0  # raw logits with an offset: the repetition penalty reads z's sign
    lse = torch.logsumexp(theta.double(), -1)
    if normalized:
        theta = torch.log_softmax(theta, -1)
    g = torch.Generator().manual_seed(7)
    kinds = [
        dict(repetition_penalty=1.4),
        dict(repetition_penalty=0.6, presence_penalty=0.5),
        dict(frequency_penalty=1.5, presence_penalty=-0.8),
        dict(diversity_penalty=3.0, group=1),
    ]
    rows, outputs, diversity = [], [], []
    for r in range(b):
        history = torch.randint(0, 40, (14,), generator=g).tolist()
        # The tokens most likely under q are the ones a penalty must move: put them in the history.
        history[:3] = torch.topk(teacher[r], 3).indices.tolist()
        rows.append(RowSampling(seed=r, prompt_token_ids=tuple(history[:6]), **kinds[r % 4]))
        outputs.append(history[6:])
        diversity.append({int(t): 1 + k for k, t in enumerate(history[:2])} if r % 4 == 3 else {})
    taken = []
    kernel = interpreted.decide_gpu
    # 64-token blocks: the edits fall in five blocks (the sums and the draw's block filter are per block).
    monkeypatch.setattr(
        interpreted, "decide_gpu", lambda t, *a, **k: taken.append(len(t)) or kernel(t, *a, **{**k, "block": 64})
    )
    computer = get_alpha_computer("kl_symmetry")
    models = ModelRows.pair(
        teacher, theta, theta_normalized=normalized, theta_log_normalisers=lse if normalized else None
    )
    shared = dict(outputs=outputs, diversity=diversity)
    fused = decide(models, [len(o) for o in outputs], rows, computer, **shared)
    reference = decide(models, [len(o) for o in outputs], rows, computer, fused=False, **shared)
    assert taken == [b] and not fused.handed_back.any()  # the kernel decided every row
    assert fused.tokens.tolist() == reference.tokens.tolist()
    atol = {"alpha": ALPHA_TWO_SOLVES_ATOL, "logp": TWO_NORMALISATIONS_ATOL}  # logp: log π_t and log π_θ
    atol["logq"] = two_decisions_logq_atol(fused.alpha, reference.alpha, teacher, theta, scale=1 / 0.6)
    for name in ("alpha", "logp", "logq"):
        torch.testing.assert_close(getattr(fused, name), getattr(reference, name).float(), atol=atol[name], rtol=0)
    # A weight past float32's range in its block sum (frequency_penalty −2 on a token held 50 times: +100 on its
    # logit) or past float64's (400 times: +800) comes back, and the reference draws that token.
    for times in (50, 400):
        big = [RowSampling(seed=1, frequency_penalty=-2.0)]
        one = ModelRows.pair(
            teacher[:1], theta[:1], theta_normalized=normalized, theta_log_normalisers=lse[:1] if normalized else None
        )
        over = decide(one, [times], big, computer, outputs=[[5] * times])
        assert over.handed_back.tolist() == [True] and over.tokens.tolist() == [5], times
    # The edits moved the law: without them, other tokens come out of the same uniforms.
    plain = [RowSampling(seed=r) for r in range(b)]
    unedited = decide(
        ModelRows.pair(teacher, theta, theta_normalized=normalized), [len(o) for o in outputs], plain, computer
    )
    assert fused.tokens.tolist() != unedited.tokens.tolist()


@pytest.mark.parametrize("forced", [False, True], ids=["masked", "forced-and-masked"])
def test_masked_rows_draw_q_without_the_masked_tokens(interpreted, forced):
    """The law of the draw on a masked row (α solved, or forced to 1), by chi-square over 100 seeds on 16 tokens in
    two 8-token blocks; the positive control (q with the masked tokens kept) must be rejected. tests/test_gpu_kernel.py
    runs the same on a GPU, where warps run at once (the interpreter runs one program's operations in order, so no
    missing barrier shows here)."""
    out, p_masked, p_unmasked = masked_draw_p_values(interpreted.decide_gpu, "cpu", 16, 100, forced, block=8)
    assert (out[:, 5] == 0).all()
    assert p_masked > LEVEL, p_masked
    # 2e-9 (solved α) and 1e-6 (forced) here; with the masked block sums left stale (the store skipped, as a read
    # before it sees them) p_masked is 1e-9 and 2e-7.
    assert p_unmasked < LEVEL, p_unmasked


def test_a_solve_that_does_not_converge_is_handed_back_not_drawn(interpreted, monkeypatch):
    """With one pass allowed, a row started at its root converges on it; one started at 0 does not, and comes back
    (status 1, flagged unconverged) where the reference's solver would raise."""
    monkeypatch.setattr(interpreted, "_MAX_PASSES", 1)
    teacher, theta = random_rows(2, 64, seed=5)
    root = np_alpha_kl(np_log_softmax(theta[0].double().numpy()), np_log_softmax(teacher[0].double().numpy()))
    out = run(interpreted, teacher, theta, get_alpha_computer("kl_symmetry"), [0.3, 0.3], warm=torch.tensor([root, 0]))
    assert out[:, 5].tolist() == [0, 1], "status"
    assert out[:, 7].tolist() == [0, 1], "unconverged"
    assert out[:, 6].tolist() == [1, 1], "passes"


def test_decide_gives_an_unconverged_row_to_the_reference(interpreted, monkeypatch):
    """decide() as a CUDA device runs it: the row the kernel could not solve in its passes is decided by the reference
    (which solves it in its own), and matches decide() with every row on the reference."""
    monkeypatch.setattr(pipeline, "kernel_device", lambda device: "cuda")
    monkeypatch.setattr(interpreted, "_MAX_PASSES", 1)
    reference_rows = rows_sent_to_the_reference(monkeypatch)
    teacher, theta = random_rows(2, 64, seed=6)
    root = np_alpha_kl(np_log_softmax(theta[0].double().numpy()), np_log_softmax(teacher[0].double().numpy()))
    rows = [RowSampling(seed=0), RowSampling(seed=1)]
    warm = torch.tensor([root, 0.0])  # row 0 converges in its one pass, row 1 does not
    computer = get_alpha_computer("kl_symmetry")
    mixed = decide(ModelRows.pair(teacher, theta), [1, 1], rows, computer, alpha_init=warm)
    assert reference_rows == [1], "the unconverged row (and only it) goes to the reference"
    full = decide(ModelRows.pair(teacher, theta), [1, 1], rows, computer, alpha_init=warm, fused=False)
    assert mixed.tokens.tolist() == full.tokens.tolist()
    torch.testing.assert_close(mixed.alpha, full.alpha.float(), atol=ALPHA_TWO_SOLVES_ATOL, rtol=0)
