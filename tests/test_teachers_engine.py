"""Several teachers at decode time, each in its own vLLM engine: q ∝ π_θ^(1−α₁−α₂)·π₁^α₁·π₂^α₂, exact and recorded.

One trio of tiny twins (``mixed-trio``): a Qwen2-architecture teacher ("qwen"), a Llama-architecture teacher
("llama") and the padded, tied Qwen2.5-1.5B twin as θ, three engines in lockstep through the front door. Every
recorded α, log π and log q is checked against a teacher-forced re-scoring of each model in plain transformers,
normalised in float64, with each teacher given its own prompt (a hint only it sees); the K-teacher kl_symmetry α
against SciPy's optimiser of the log-partition over the simplex. One engine trio serves every test (a module fixture);
the α computer a test changes is put back.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dual_sampling import OptimalSamplingDual
from dual_sampling.options import DualEngineConfig
from dual_sampling.roster import THETA
from dual_sampling.testing.twins import PADDING_MASS_PROMPT, twin_trio
from tests.oracles import rescore
from tests.test_alpha_teachers import scipy_optimum
from tests.tolerances import RESCORE_ATOL

pytestmark = pytest.mark.engine

ALPHA = (0.35, 0.25)
"""The teachers' fixed weights, qwen's then llama's: θ's is 0.4."""
LONG_HINT = "Hint: the answer is a number, and every step of the working is written out in full. " * 6
"""A hint of about 100 tokens that only the qwen teacher sees: its prompt is much longer than the others'."""
PROMPTS = ["Once upon a time", PADDING_MASS_PROMPT]
DENSE_K = 4


@pytest.fixture(scope="module")
def trio():
    from transformers import AutoModelForCausalLM

    teachers, theta = twin_trio("mixed-trio")
    engine = OptimalSamplingDual(
        {name: str(folder) for name, folder in teachers.items()},
        str(theta),
        alpha_method="fixed",
        alpha_config={"alpha": list(ALPHA)},
        max_num_seqs=8,
        max_model_len=256,
        max_dense_logprobs=DENSE_K,
        sync_timeout=30,
        use_tqdm=False,
    )
    hf = {
        name: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        for name, folder in {**teachers, THETA: theta}.items()
    }
    try:
        yield engine, hf
    finally:
        engine.close()


def _rows(hf, prompts: dict[str, list[int]], tokens: list[int], vocab: int) -> dict[str, np.ndarray]:
    """Each model's float64 log-probability rows [T, vocab] before each of ``tokens``, given its own prompt."""
    return {name: rescore(hf[name], prompts[name], tokens, vocab).numpy() for name in hf}


def _mixture(rows: dict[str, np.ndarray], alpha: np.ndarray) -> np.ndarray:
    """log q [T, vocab] of the geometric mixture at per-token weights ``alpha`` [T, 2] (qwen, llama)."""
    x = (1 - alpha.sum(1))[:, None] * rows[THETA] + alpha[:, :1] * rows["qwen"] + alpha[:, 1:] * rows["llama"]
    return x - np.logaddexp.reduce(x, axis=1, keepdims=True)


def _check_sample(sample, rows: dict[str, np.ndarray], alpha: np.ndarray) -> float:
    """Every record of one sample against the re-scored rows at weights ``alpha``; returns the largest miss."""
    tokens = np.array(sample.token_ids)
    steps = np.arange(len(tokens))
    columns = sample.roster_columns
    worst = 0.0
    for name in rows:
        worst = max(worst, float(np.abs(np.array(columns[f"logp_{name}"]) - rows[name][steps, tokens]).max()))
    logq = _mixture(rows, alpha)[steps, tokens]
    worst = max(worst, float(np.abs(np.array(columns["logq"]) - logq).max()) / 2)  # log q's bound is twice log π's
    return worst


def test_records_of_two_teachers_with_their_own_prompts_match_float64_rescoring(trio):
    """Fixed weights (0.35, 0.25); the qwen teacher sees a long hint, the llama teacher θ's prompt. Every recorded
    α, log π of each model and log q equals the float64 re-scoring; the sample's own θ and q fields are the roster
    columns', and its one-teacher fields stay empty. Positive control: the qwen teacher re-scored without its hint
    misses by far more than the tolerance, so the hint reached its engine alone."""
    engine, hf = trio
    assert engine.roster.names == ("qwen", "llama", THETA)
    out = engine.generate(PROMPTS, teacher_prompts={"qwen": [LONG_HINT + p for p in PROMPTS]}, n=2, max_tokens=12)
    vocab, checked, without_hint = engine.vocab, 0, 0.0
    for request in out.requests:
        prompts = {**request.teacher_prompt_token_ids, THETA: request.theta_prompt_token_ids}
        assert len(prompts["qwen"]) > len(prompts["llama"]) + 50 and prompts["llama"] == prompts[THETA]
        for sample in request.samples:
            assert sample.ok, sample.error
            assert sorted(sample.roster_columns) == sorted(engine.roster.token_columns)
            assert sample.roster_columns["alpha_qwen"] == pytest.approx([ALPHA[0]] * len(sample.token_ids))
            assert sample.roster_columns["alpha_llama"] == pytest.approx([ALPHA[1]] * len(sample.token_ids))
            assert sample.logp_theta == sample.roster_columns["logp_theta"]
            assert sample.logq == sample.roster_columns["logq"]
            assert sample.alpha == [] and sample.logp_teacher == []
            rows = _rows(hf, prompts, sample.token_ids, vocab)
            alpha = np.tile(ALPHA, (len(sample.token_ids), 1))
            assert _check_sample(sample, rows, alpha) < RESCORE_ATOL
            blind = rescore(hf["qwen"], prompts[THETA], sample.token_ids, vocab).numpy()
            steps = np.arange(len(sample.token_ids))
            without_hint = max(
                without_hint,
                float(np.abs(np.array(sample.roster_columns["logp_qwen"]) - blind[steps, sample.token_ids]).max()),
            )
            checked += len(sample.token_ids)
    assert checked == 2 * 2 * 12 - sum(12 - len(s.token_ids) for r in out.requests for s in r.samples) > 0
    assert without_hint > 100 * RESCORE_ATOL, f"the hint changed nothing measurable ({without_hint})"


def test_dense_top_k_of_every_model_matches_rescoring(trio):
    """``dense_logprobs``: before each token, each model's top k ids ``[n, 3, k]`` and every model's log π at them
    ``[n, 3, 3, k]`` (``[:, i, j]``: model j's at model i's ids), against the re-scored rows."""
    engine, hf = trio
    (request,) = engine.generate(PROMPTS[:1], max_tokens=8, dense_logprobs=DENSE_K, seed=5).requests
    (sample,) = request.samples
    assert sample.ok, sample.error
    prompts = {**request.teacher_prompt_token_ids, THETA: request.theta_prompt_token_ids}
    rows = _rows(hf, prompts, sample.token_ids, engine.vocab)
    names = engine.roster.names
    assert sample.dense_ids.shape == (len(sample.token_ids), 3, DENSE_K)
    assert sample.dense_logp.shape == (len(sample.token_ids), 3, 3, DENSE_K)
    assert sample.dense_other_logp is None
    for i, owner in enumerate(names):
        own_top = np.argsort(-rows[owner], axis=1)[:, :DENSE_K]
        # Ties aside, each model's own top k are its k most likely ids, most likely first.
        np.testing.assert_array_equal(sample.dense_ids[:, i], own_top)
        for j, scorer in enumerate(names):
            expected = np.take_along_axis(rows[scorer], sample.dense_ids[:, i].astype(np.int64), axis=1)
            np.testing.assert_allclose(sample.dense_logp[:, i, j], expected, atol=RESCORE_ATOL)


def test_kl_symmetry_weights_of_two_teachers_are_scipys_optimum(trio):
    """kl_symmetry for two teachers: each token's α is the minimiser of log Z(α) over the simplex (SciPy's SLSQP from
    several starts, float64), where the KLs of q to every model with weight are equal; log q at the recorded α."""
    engine, hf = trio
    engine.update_alpha("kl_symmetry")
    try:
        (request,) = engine.generate(PROMPTS[1:], n=2, max_tokens=8, seed=11).requests
    finally:
        engine.update_alpha("fixed", alpha=list(ALPHA))
    prompts = {**request.teacher_prompt_token_ids, THETA: request.theta_prompt_token_ids}
    worst = 0.0
    for sample in request.samples:
        assert sample.ok, sample.error
        rows = _rows(hf, prompts, sample.token_ids, engine.vocab)
        alpha = np.stack([sample.roster_columns["alpha_qwen"], sample.roster_columns["alpha_llama"]], axis=1)
        for t in range(len(sample.token_ids)):
            optimum = scipy_optimum(rows[THETA][t], np.stack([rows["qwen"][t], rows["llama"][t]]))
            worst = max(worst, float(np.abs(alpha[t] - optimum).max()))
        assert _check_sample(sample, rows, alpha) < RESCORE_ATOL
    assert worst < 1e-4, f"kl_symmetry's weights miss SciPy's optimum by {worst}"
    assert engine.alpha_settings[0] == "fixed"


def test_what_several_teachers_do_not_take_is_refused_by_name(trio, tmp_path):
    """Beam search, a best_of ranked by one teacher's log π, and new weights for a teacher are refused by name on the
    running trio; the speculative mode, a teacher's engine arguments not keyed by its name, and one teacher's
    weights for two are refused before any engine starts."""
    engine, _ = trio
    with pytest.raises(ValueError, match="beam_search with several teachers"):
        engine.beam_search(PROMPTS[:1], beam_width=2, max_tokens=4)
    with pytest.raises(ValueError, match="best_of_score='logp_teacher'"):
        engine.generate(PROMPTS[:1], n=1, best_of=2, best_of_score="logp_teacher", max_tokens=2)
    with pytest.raises(ValueError, match="role: new weights for one of several teachers"):
        engine.update_teacher(str(tmp_path))
    with pytest.raises(ValueError, match="teacher_prompts: with several teachers"):
        engine.generate(PROMPTS[:1], teacher_prompts={"coach": ["x"]}, max_tokens=2)
    with pytest.raises(ValueError, match="teacher_prompts: with several teachers"):
        engine.generate(PROMPTS[:1], teacher_prompts=["x"], max_tokens=2)
    teachers, theta = twin_trio("mixed-trio")
    folders = {name: str(folder) for name, folder in teachers.items()}
    with pytest.raises(ValueError, match="several teachers need mode='lockstep'"):
        DualEngineConfig(folders, str(theta), mode="speculative")
    with pytest.raises(ValueError, match="teacher_engine_kwargs: with several teachers"):
        DualEngineConfig(folders, str(theta), teacher_engine_kwargs={"dtype": "bfloat16"})
    with pytest.raises(ValueError, match="alpha must list one weight per teacher"):
        DualEngineConfig(folders, str(theta), alpha_method="fixed", alpha_config={"alpha": 0.3})
    with pytest.raises(ValueError, match="names must include|not a model name|unique"):
        DualEngineConfig({"theta": folders["qwen"], "llama": folders["llama"]}, str(theta))
    # After every refusal the trio still serves.
    (request,) = engine.generate(PROMPTS[:1], max_tokens=3).requests
    assert request.samples[0].ok
