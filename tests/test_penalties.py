"""Penalties on q (the decision's Penalties stage), against vLLM's own penalty function and a float64 recomputation.

The mixture's logits z = (1 − α)·ℓ_θ + α·ℓ_t (raw logits ℓ) are penalised as vLLM penalises one model's: at α = 0
that is vLLM's penalised theta, at α = 1 its penalised teacher. The engine-level check against vLLM's sampler is in
``tests/test_penalties_engine.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from alpha import get_alpha_computer
from dual_sampling.decision.pipeline import ModelRows, RowSampling, decide
from dual_sampling.options import SamplingOptions
from tests.draws import _chi_square_p
from tests.tolerances import ONE_NORMALISATION_ATOL, TWO_NORMALISATIONS_ATOL, one_normalisation_atol

VOCAB = 300
PENALTIES = [
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7),
    dict(presence_penalty=0.8, frequency_penalty=0.4),
    dict(repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=1.5),
]


def raw_logits(seed: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw logits of two models, each row shifted by its own constant (as real logits are): the repetition penalty
    reads their signs, so a decision that used log-probabilities instead would be caught."""
    g = torch.Generator().manual_seed(seed)
    teacher = 2.0 * torch.randn(b, VOCAB, generator=g) + 3.0 * torch.randn(b, 1, generator=g)
    theta = 2.0 * torch.randn(b, VOCAB, generator=g) - 2.0 * torch.randn(b, 1, generator=g)
    return teacher, theta


def history(seed: int) -> tuple[list[int], list[int]]:
    """(prompt, output) token ids with repeats, drawn from the first 60 ids (where the test models put mass)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 60, 12).tolist(), rng.integers(0, 60, 9).tolist()


def vllm_penalised(z: torch.Tensor, prompt: list[int], output: list[int], p: dict) -> torch.Tensor:
    """vLLM's own apply_penalties on float32 logits ``z`` ``[V]`` (the function its sampler calls)."""
    from vllm.model_executor.layers.utils import apply_penalties

    logits = z.float().clone().unsqueeze(0)
    return apply_penalties(
        logits,
        torch.tensor([prompt]),
        torch.tensor([output]),
        torch.tensor([p.get("presence_penalty", 0.0)]),
        torch.tensor([p.get("frequency_penalty", 0.0)]),
        torch.tensor([p.get("repetition_penalty", 1.0)]),
    )[0]


def numpy_penalised(z: np.ndarray, prompt: list[int], output: list[int], p: dict) -> np.ndarray:
    """The same penalties in float64 NumPy, written from vLLM's documented semantics."""
    z = z.astype(np.float64).copy()
    counts = np.bincount(output, minlength=z.size).astype(np.float64)
    seen = (counts > 0) | (np.bincount(prompt, minlength=z.size) > 0)
    r = p.get("repetition_penalty", 1.0)
    z[seen] = np.where(z[seen] > 0, z[seen] / r, z[seen] * r)
    return z - p.get("frequency_penalty", 0.0) * counts - p.get("presence_penalty", 0.0) * (counts > 0)


def penalised_row(p: dict, prompt: list[int], seed: int = 0, **extra) -> RowSampling:
    return SamplingOptions(max_tokens=64, seed=seed, **p, **extra).row(seed, prompt_token_ids=prompt)


@pytest.mark.parametrize("alpha", [0.0, 1.0, 0.3])
@pytest.mark.parametrize("penalty", range(len(PENALTIES)))
def test_penalised_q_is_vllms_penalised_mixture_logits(alpha, penalty):
    # Greedy rows report the whole final distribution through top_logprobs: it must be the log-softmax of vLLM's
    # penalties applied to z, and the greedy token its argmax.
    p = PENALTIES[penalty]
    teacher, theta = raw_logits(penalty, 3)
    histories = [history(10 * penalty + i) for i in range(3)]
    rows = [penalised_row(p, prompt, temperature=0.0) for prompt, _ in histories]
    d = decide(
        ModelRows.pair(teacher, theta),
        [len(out) for _, out in histories],
        rows,
        get_alpha_computer("fixed", alpha=alpha),
        top_logprobs=VOCAB,
        outputs=[out for _, out in histories],
    )
    for i, (prompt, output) in enumerate(histories):
        z = (1 - alpha) * theta[i].double() + alpha * teacher[i].double()
        expected = torch.log_softmax(vllm_penalised(z, prompt, output, p).double(), -1)
        got = torch.empty(VOCAB, dtype=torch.float64)
        got[d.top_ids[i]] = d.top_logq[i].double()
        torch.testing.assert_close(got, expected, rtol=0, atol=ONE_NORMALISATION_ATOL)
        np.testing.assert_allclose(
            got.numpy(),
            torch.log_softmax(torch.from_numpy(numpy_penalised(z.numpy(), prompt, output, p)), -1),
            atol=ONE_NORMALISATION_ATOL,
            rtol=0,
        )
        assert int(d.tokens[i]) == int(expected.argmax())
        # The penalties moved q: a test that passes without them would be no test.
        assert (got - torch.log_softmax(z, -1)).abs().max() > 0.05


def test_theta_normalised_rows_take_thetas_log_normaliser():
    # The engines hand the decision theta's log-softmax rows; its log-normaliser travels beside them.
    p = PENALTIES[0]
    teacher, theta = raw_logits(7, 2)
    histories = [history(70), history(71)]
    rows = [penalised_row(p, prompt, temperature=0.0) for prompt, _ in histories]
    args = ([len(o) for _, o in histories], rows, get_alpha_computer("fixed", alpha=0.4))
    kw = dict(top_logprobs=8, outputs=[o for _, o in histories])
    raw = decide(ModelRows.pair(teacher, theta), *args, **kw)
    normalised = decide(
        ModelRows.pair(
            teacher,
            torch.log_softmax(theta, -1),
            theta_normalized=True,
            theta_log_normalisers=theta.double().logsumexp(-1),
        ),
        *args,
        **kw,
    )
    assert torch.equal(raw.top_ids, normalised.top_ids)
    # Two float32 computations of one row (theta normalised here and by the test's log_softmax): V = 300.
    torch.testing.assert_close(raw.top_logq, normalised.top_logq, rtol=0, atol=TWO_NORMALISATIONS_ATOL)
    with pytest.raises(ValueError, match="theta_log_normalisers"):
        decide(ModelRows.pair(teacher, torch.log_softmax(theta, -1), theta_normalized=True), *args, **kw)


def test_penalised_draws_follow_the_penalised_law():
    # Chi-square of many seeds' tokens against the float64 penalised q; the unpenalised q, judged on the same
    # tokens, must be rejected (the positive control).
    p = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5)
    g = torch.Generator().manual_seed(3)
    teacher = torch.randn(1, 12, generator=g) + 1.0
    theta = torch.randn(1, 12, generator=g) - 0.5
    prompt, output = [0, 1, 2], [2, 3, 3, 4]
    draws = 6000
    rows = [SamplingOptions(max_tokens=16, **p).row(s, prompt_token_ids=prompt) for s in range(draws)]
    alpha = 0.6
    d = decide(
        ModelRows.pair(teacher.expand(draws, -1).contiguous(), theta.expand(draws, -1).contiguous()),
        [len(output)] * draws,
        rows,
        get_alpha_computer("fixed", alpha=alpha),
        outputs=[output] * draws,
    )
    z = ((1 - alpha) * theta[0] + alpha * teacher[0]).double().numpy()
    law = np.exp(numpy_penalised(z, prompt, output, p))
    law /= law.sum()
    plain = np.exp(z - z.max())
    plain /= plain.sum()
    observed = np.bincount(d.tokens.numpy(), minlength=12)
    assert _chi_square_p(observed, law * draws) > 1e-3
    assert _chi_square_p(observed, plain * draws) < 1e-6
    # The record is the law the token was drawn from; log π_t and log π_θ stay raw.
    one = ONE_NORMALISATION_ATOL
    np.testing.assert_allclose(d.logq.numpy(), np.log(law)[d.tokens.numpy()], atol=one, rtol=0)
    np.testing.assert_allclose(
        d.logp[:, 1].numpy(), torch.log_softmax(theta[0].double(), -1).numpy()[d.tokens.numpy()], atol=one, rtol=0
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", float("nan")),
    ],
)
def test_bad_penalties_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingOptions(max_tokens=4, **{field: value})


def test_the_prompt_travels_only_with_a_repetition_penalty():
    opts = SamplingOptions(max_tokens=4, presence_penalty=0.5)
    assert opts.row(1, prompt_token_ids=[5, 6]).prompt_token_ids == ()
    row = SamplingOptions(max_tokens=4, repetition_penalty=1.1).row(1, prompt_token_ids=[5, 6])
    assert row.prompt_token_ids == (5, 6)
    assert RowSampling.from_dict(row.to_dict()) == row


def test_the_cpu_kernel_decides_penalised_rows_as_the_reference_does():
    # SmolLM2's vocabulary, theta's rows as the engines hand them (log-softmax plus the log-normaliser), and rows
    # whose penalised tokens hold most of q (the drawn tokens' block sums are recomputed, not subtracted from).
    vocab, b = 49152, 6
    g = torch.Generator().manual_seed(11)
    teacher = 3.0 * torch.randn(b, vocab, generator=g) + 5.0
    theta_raw = 2.0 * torch.randn(b, vocab, generator=g) - 1.0
    rng = np.random.default_rng(4)
    outputs = [rng.integers(0, vocab, 40).tolist() for _ in range(b)]
    prompt = rng.integers(0, vocab, 30).tolist()
    for r in range(3):  # a token of the output leads both models by far
        teacher[r, outputs[r][0]] += 25.0
        theta_raw[r, outputs[r][0]] += 20.0
    settings = [*PENALTIES, dict(repetition_penalty=1.1, frequency_penalty=-1.0), dict(presence_penalty=2.0)]
    rows = [penalised_row(settings[r], prompt, seed=r, min_tokens=50, stop_token_ids=(0, 5)) for r in range(b)]
    steps = [len(o) for o in outputs]
    computer = get_alpha_computer("kl_symmetry")
    models = ModelRows.pair(
        teacher,
        torch.log_softmax(theta_raw, -1),
        theta_normalized=True,
        theta_log_normalisers=theta_raw.double().logsumexp(-1),
    )
    fused = decide(models, steps, rows, computer, outputs=outputs)
    reference = decide(models, steps, rows, computer, outputs=outputs, fused=False)
    assert not fused.handed_back.any()
    assert torch.equal(fused.tokens, reference.tokens)
    # log q against float64 at the kernel's α: the mixture's logits penalised as vLLM does, the stop ids masked.
    for r in range(b):
        a = float(fused.alpha[r])
        z = (1 - a) * theta_raw[r].double().numpy() + a * teacher[r].double().numpy()
        zp = numpy_penalised(z, prompt, outputs[r], settings[r])
        zp[[0, 5]] = -np.inf
        logq = zp - np.logaddexp.reduce(zp)
        # The kernel's normalisation, and theta's float32 log_softmax it takes as input (V wide: torch's bound).
        bound = ONE_NORMALISATION_ATOL + one_normalisation_atol(theta_raw.shape[-1])
        assert abs(float(fused.logq[r]) - logq[int(fused.tokens[r])]) < bound, r
        if r < 3:
            q = np.exp(z - np.logaddexp.reduce(z))
            assert q[outputs[r][0]] > 0.9, "the penalised token must hold most of q"


def test_a_penalty_whose_weight_overflows_goes_to_the_reference():
    # frequency_penalty −2 on a token the output holds 400 times raises its logit by 800: its weight overflows
    # float64 in the kernel. The kernel must hand the row back (it once drew another token, with log q = −inf).
    g = torch.Generator().manual_seed(0)
    teacher, theta = torch.randn(2, 500, generator=g), torch.randn(2, 500, generator=g)
    rows = [RowSampling(seed=1, frequency_penalty=-2.0), RowSampling(seed=2, presence_penalty=-2.0)]
    outputs = [[5] * 400, [7] * 3]
    args = (ModelRows.pair(teacher, theta), [400, 3], rows, get_alpha_computer("kl_symmetry"))
    fused = decide(*args, outputs=outputs)
    reference = decide(*args, outputs=outputs, fused=False)
    assert fused.handed_back.tolist() == [True, False]
    assert fused.tokens.tolist() == reference.tokens.tolist() and int(fused.tokens[0]) == 5
    assert torch.isfinite(fused.logq).all() and float(fused.logq[0]) == 0.0
