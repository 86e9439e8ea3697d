"""Every mode on tiny twins of the model families users run (``dual_sampling.testing.twins``), against float64
re-scoring in plain transformers.

Two rounds in a row, a quirk of real checkpoints (a tied output projection, an embedding padded past the tokenizer)
broke exactness in a feature whose tests used easier models. So every mode runs here on every twin it applies to:

- lockstep, on all twins: records with n > 1 and both models' dense top-k; stop strings and a teacher hint; every
  EOS id of the family ends a sample; new weights by state dict and by folder, into theta and into the teacher,
  with a prompt cached before the update; the sampler–trainer mismatch helper on a tied and an untied student;
- the speculative mode, on every pair vLLM's draft model takes (equal embedding rows, one kind of attention layer),
  and a refusal by name, before any engine starts, on the others;
- the draw itself (``tests.draws``), in each mode, on a padded twin and an unpadded one;
- the sampling surface on q in lockstep: penalties, a diverse group and a beam search, re-scored.

One engine per twin and mode serves all of its cases (a module fixture parametrized by the pair). A feature added
later joins this matrix: a test here, parametrized over the twins it applies to. With ``DUAL_SAMPLING_TWIN_MATRIX``
set to a file name, the run writes every cell's largest |recorded − oracle| and p-values there as JSON
(``docs/testing.md`` shows the table made that way).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from dual_sampling import OptimalSamplingDual
from dual_sampling.distill.mismatch import sampler_trainer_mismatch
from dual_sampling.testing.twins import PADDING_MASS_PROMPT, TWIN_PAIRS, twin_pair
from tests.draws import FIXED_ALPHA, LEVEL, first_token_p, two_token_p_values
from tests.oracles import (
    assert_dense_match_rescoring,
    assert_kl_symmetry_alpha,
    assert_records_match_rescoring,
    np_mix,
    oracle_alpha,
    rescore,
)
from tests.tolerances import BF16_ALPHA_ATOL, BF16_RESCORE_ATOL, RESCORE_ATOL

pytestmark = pytest.mark.engine

SPECULATIVE_REFUSED = {"qwen2.5": "embedding rows", "gemma3": "layer_types"}
"""Pairs vLLM's draft model cannot take, and what the refusal names: the Qwen2.5 pair's unequal padding, and Gemma
3's mix of sliding-window and global layers (two KV-cache groups)."""

SPECULATIVE = [name for name in TWIN_PAIRS if name not in SPECULATIVE_REFUSED]
BF16_TEACHER = {"mixed-dtype"}
"""Pairs whose teacher runs in bfloat16 (``teacher_engine_kwargs``), as released; theta stays float32 in lockstep.
In the speculative mode vLLM runs the draft in the target's dtype, so theta is bfloat16 there too."""

DRAWS = {"lockstep": ["qwen2.5", "mixed"], "speculative": ["qwen2.5-alike", "mixed"]}
"""The draw tests' twins: padded (theta with a large share of its mass past the tokenizer), and unpadded."""

MISMATCH = ["qwen2.5", "mixed"]
"""The mismatch helper's twins: a tied student (Qwen2.5-1.5B) and an untied one."""

GAMMA = 3
DENSE_K = 8
SEEDS = 1500
"""Seeds per draw test: the controls are rejected at p < 1e-6 with this many (see each test)."""

LONG_PROMPT = " ".join(f"item {i} costs {3 * i + 1} coins;" for i in range(12))
"""About 100 tokens: past the Gemma twin's 16-token sliding window and over several KV blocks."""
PROMPTS = [LONG_PROMPT, "Once upon a time", PADDING_MASS_PROMPT]
HINT = "Hint: every answer is a number. "

CELLS: dict[str, dict[str, float]] = {}
"""Largest |recorded − oracle| (and p-values) of each cell, "twin/mode/case" → figures."""


@dataclass
class Twin:
    """One twin pair on one running engine, with its transformers oracle (float32 weights, float64 softmax)."""

    name: str
    folders: tuple[Path, Path]
    engine: OptimalSamplingDual
    hf: tuple  # (teacher, theta)
    atol: float
    """The re-scoring tolerance of this pair's records (bfloat16 rounding where a model runs in it)."""
    alpha_atol: float
    """The tolerance of its α (``BF16_ALPHA_ATOL`` where a model runs in bfloat16, else ``atol``)."""

    def check(self, out, case: str, **sampling) -> int:
        """Every record of ``out`` against re-scoring by the twin's own models; tokens checked."""
        worst = CELLS.setdefault(f"{self.name}/{self.engine.config.mode}/{case}", {})
        checked = sum(
            assert_records_match_rescoring(
                r,
                *self.hf,
                self.engine.vocab,
                "kl_symmetry",
                self.atol,
                worst=worst,
                alpha_atol=self.alpha_atol,
                **sampling,
            )
            for r in out.requests
        )
        assert checked == sum(len(s.token_ids) for r in out.requests for s in r.samples) > 0
        return checked

    def check_alpha(self, recorded, lth: np.ndarray, lt: np.ndarray) -> float:
        """kl_symmetry's α of one sample's tokens (``recorded`` [T]) against the float64 root on its re-scored rows
        (``lth``, ``lt`` [T, V] log-probabilities); the largest |recorded − root|."""
        lth, lt = torch.from_numpy(lth), torch.from_numpy(lt)
        root = oracle_alpha(lth, lt)
        recorded = torch.tensor(list(recorded), dtype=torch.float64)
        assert_kl_symmetry_alpha(recorded, root, lth, lt, self.alpha_atol, residual_atol=self.atol / 10)
        return float((recorded - root).abs().max())


def _hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _start(name: str, mode: str) -> OptimalSamplingDual:
    teacher, theta = twin_pair(name)
    kwargs = {"max_dense_logprobs": DENSE_K} if mode == "lockstep" else {"num_speculative_tokens": GAMMA}
    if name in BF16_TEACHER:
        kwargs["teacher_engine_kwargs"] = {"dtype": "bfloat16"}
    return OptimalSamplingDual(
        teacher, theta, mode=mode, max_num_seqs=16, max_model_len=256, sync_timeout=30, use_tqdm=False, **kwargs
    )


def _twin(name: str, mode: str):
    folders = twin_pair(name)
    atol, alpha_atol = (BF16_RESCORE_ATOL, BF16_ALPHA_ATOL) if name in BF16_TEACHER else (RESCORE_ATOL, RESCORE_ATOL)
    with _start(name, mode) as engine:
        yield Twin(name, folders, engine, tuple(_hf(f) for f in folders), atol, alpha_atol)


@pytest.fixture(scope="module", params=list(TWIN_PAIRS))
def lockstep(request):
    yield from _twin(request.param, "lockstep")


@pytest.fixture(scope="module", params=SPECULATIVE)
def speculative(request):
    yield from _twin(request.param, "speculative")


@pytest.fixture(scope="module", autouse=True)
def matrix_report():
    """Write :data:`CELLS` to ``$DUAL_SAMPLING_TWIN_MATRIX`` after the module, when that is set."""
    yield
    if target := os.environ.get("DUAL_SAMPLING_TWIN_MATRIX"):
        Path(target).write_text(json.dumps(CELLS, indent=1, sort_keys=True))


def samples(out) -> list:
    return [s for r in out.requests for s in r.samples]


# ---------------------------------------------------------------------------------------------------- lockstep


def test_lockstep_records_n_and_dense_top_k(lockstep):
    out = lockstep.engine.generate(PROMPTS, max_tokens=16, n=2, seed=3, dense_logprobs=DENSE_K)
    lockstep.check(out, "records")
    for r in out.requests:
        assert len(r.samples) == 2 and r.samples[0].seed != r.samples[1].seed
        assert r.samples[0].token_ids != r.samples[1].token_ids  # two seeds, two draws (q is spread here)
        largest = assert_dense_match_rescoring(r, *lockstep.hf, lockstep.engine.vocab, DENSE_K, lockstep.atol)
        cell = CELLS.setdefault(f"{lockstep.name}/lockstep/dense", {})
        cell["dense"] = max(cell.get("dense", 0.0), largest)
    if TWIN_PAIRS[lockstep.name][0].adds_bos:  # the tokenizer's BOS on both sides, and scored with it
        assert all(r.teacher_prompt_token_ids[0] == r.theta_prompt_token_ids[0] == 1 for r in out.requests)
    if lockstep.name in BF16_TEACHER:
        worst = CELLS[f"{lockstep.name}/lockstep/records"]
        # Theta runs float32 (its float32 bound holds); the teacher really runs bfloat16 (far off float32's).
        assert worst["logp_theta"] <= RESCORE_ATOL < 10 * RESCORE_ATOL < worst["logp_teacher"]


def test_lockstep_stops_on_every_eos_id_of_both_models(lockstep):
    """Each of the family's EOS ids (both models' generation_config, as vLLM reads them) ends a sample, pushed to the
    front by a logit bias, after one token."""
    expected = {lockstep.engine.tokenizer.eos_token_id}.union(*(spec.eos_ids for spec in TWIN_PAIRS[lockstep.name]))
    assert set(lockstep.engine.eos_token_ids) == expected
    for eos in sorted(expected):
        out = lockstep.engine.generate(PROMPTS[1:2], max_tokens=8, seed=1, logit_bias={eos: 100.0})
        sample = samples(out)[0]
        assert sample.token_ids == [eos] and sample.finish_reason == "stop", (eos, sample.token_ids)


def test_lockstep_stop_strings_and_a_teacher_hint(lockstep):
    theta_prompts = PROMPTS[:2]
    out = lockstep.engine.generate(
        theta_prompts, teacher_prompts=[HINT + p for p in theta_prompts], max_tokens=24, n=4, seed=5, stop=["e"]
    )
    lockstep.check(out, "stop+hint")
    stopped = 0
    for r in out.requests:
        assert r.teacher_prompt_token_ids != r.theta_prompt_token_ids
        for s in r.samples:
            assert "e" not in s.text
            stopped += s.stop_reason == "e"
    assert stopped > 0  # a stop string really cut some samples


def _perturbed(model, seed: int):
    """A copy of ``model`` with new input embeddings (so, tied, a new output projection) and a changed body."""
    changed = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        embedding = changed.get_input_embeddings().weight
        embedding.add_(0.5 * embedding.std() * torch.randn(embedding.shape, generator=generator))
        changed.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    tied = changed.config.get_text_config().tie_word_embeddings
    assert (changed.get_output_embeddings().weight is changed.get_input_embeddings().weight) is tied
    return changed


def test_lockstep_new_weights_by_state_dict_and_folder_into_both_models(lockstep, tmp_path):
    """A prompt's blocks cached before each update, then scored by the new weights; a tied output projection
    follows its embedding on every kind of update (a transformers folder of a tied model has no lm_head.weight)."""
    twin, engine = lockstep, lockstep.engine
    hf_teacher, hf_theta = twin.hf

    def drawn_from(teacher, theta, seed: int) -> None:
        for prompt in (LONG_PROMPT, "Once upon a time"):
            out = engine.generate([prompt], max_tokens=12, seed=seed)
            Twin(twin.name, twin.folders, engine, (teacher, theta), twin.atol, twin.alpha_atol).check(out, "live")

    engine.generate([LONG_PROMPT], max_tokens=4, n=2, seed=11)  # cached on both engines
    try:
        new_theta = _perturbed(hf_theta, seed=1)
        engine.update_theta(new_theta.state_dict(), version="theta-state-dict")
        drawn_from(hf_teacher, new_theta, seed=4)
        new_teacher = _perturbed(hf_teacher, seed=2)
        engine.update_teacher(new_teacher.state_dict(), version="teacher-state-dict")
        drawn_from(new_teacher, new_theta, seed=5)
        folder_theta = _perturbed(hf_theta, seed=3)
        folder_theta.save_pretrained(tmp_path / "theta")
        engine.update_theta(str(tmp_path / "theta"), version="theta-folder")
        drawn_from(new_teacher, folder_theta, seed=6)
    finally:
        engine.update_teacher(str(twin.folders[0]))
        engine.update_theta(str(twin.folders[1]))
    drawn_from(hf_teacher, hf_theta, seed=7)


@pytest.mark.parametrize("lockstep", MISMATCH, indirect=True)
def test_the_mismatch_helper_on_a_tied_and_an_untied_student(lockstep):
    """The helper finds the records' θ within float32 rounding, and a θ one update behind far outside it."""
    engine, (_, hf_theta) = lockstep.engine, lockstep.hf
    out = engine.generate(PROMPTS, max_tokens=16, seed=8)
    same = sampler_trainer_mismatch(hf_theta, out.requests, engine.vocab)
    assert same.tokens == sum(len(s.token_ids) for s in samples(out)) and same.max_abs <= RESCORE_ATOL
    CELLS.setdefault(f"{lockstep.name}/lockstep/mismatch", {})["max_abs"] = same.max_abs
    try:
        engine.update_theta(_perturbed(hf_theta, seed=9).state_dict(), version="theta-moved-on")
        behind = sampler_trainer_mismatch(
            hf_theta, engine.generate(PROMPTS, max_tokens=16, seed=8).requests, engine.vocab
        )
    finally:
        engine.update_theta(str(lockstep.folders[1]))
    assert behind.max_abs > 100 * RESCORE_ATOL


def _first_two_tokens(twin: Twin, prompt: list[int]) -> list[list[int]]:
    twin.engine.update_alpha("fixed", alpha=FIXED_ALPHA)
    try:
        out = twin.engine.generate([prompt], max_tokens=2, n=SEEDS, seed=11)
    finally:
        twin.engine.update_alpha("kl_symmetry")
    pairs = [s.token_ids for s in samples(out) if len(s.token_ids) == 2]  # an EOS first: about 1e-4 of q
    assert len(pairs) >= SEEDS - 10
    return pairs


def _check_two_token_draws(twin: Twin) -> None:
    prompt = twin.engine.tokenizer(PADDING_MASS_PROMPT)["input_ids"]
    p = two_token_p_values(_first_two_tokens(twin, prompt), prompt, *twin.hf, twin.engine.vocab)
    CELLS.setdefault(f"{twin.name}/{twin.engine.config.mode}/draws", {}).update(
        {"p_under_q": p["q"], "p_under_teacher": p["teacher"]}
    )
    assert p["q"] > LEVEL and p["teacher"] < LEVEL, p


@pytest.mark.parametrize("lockstep", DRAWS["lockstep"], indirect=True)
def test_lockstep_first_two_tokens_follow_q(lockstep):
    """1,500 seeds' first two tokens at a fixed α: their PITs under q are independent uniforms, and the same draws
    judged under π_t are not (``tests.draws``)."""
    _check_two_token_draws(lockstep)


# ------------------------------------------------------------------------------------------------- speculative


def test_speculative_records_match_rescoring(speculative):
    out = speculative.engine.generate(PROMPTS, max_tokens=16, n=2, seed=3)
    speculative.check(out, "records")
    stats = speculative.engine.get_sync_statistics()
    assert stats["mode"] == "speculative" and 0 < stats["accepted"] <= stats["drafted"]


@pytest.mark.parametrize("speculative", DRAWS["speculative"], indirect=True)
def test_speculative_first_two_tokens_follow_q(speculative):
    """As in lockstep: every token after the first was drafted by theta and accepted or redrawn by the rule."""
    _check_two_token_draws(speculative)


@pytest.mark.parametrize("speculative", ["qwen2.5-alike"], indirect=True)
def test_speculative_first_token_follows_q_where_theta_puts_mass_past_the_tokenizer(speculative):
    """1,500 first tokens at a fixed α, their PITs ordered by the acceptance ratio q/π_θ, against q over the
    tokenizer's ids. The positive control: the law the rule emits when θ's row is left sub-normalised by its padding
    mass m (acceptance min(1, q/((1−m)·π_θ)), residual max(0, q − (1−m)·π_θ)), sampled as often, is rejected."""
    engine, (hf_teacher, hf_theta) = speculative.engine, speculative.hf
    prompt = engine.tokenizer(PADDING_MASS_PROMPT)["input_ids"]
    engine.update_alpha("fixed", alpha=FIXED_ALPHA)
    try:
        firsts = [s.token_ids[0] for s in samples(engine.generate([prompt], max_tokens=1, n=SEEDS, seed=23))]
    finally:
        engine.update_alpha("kl_symmetry")
    vocab = engine.vocab
    with torch.no_grad():
        teacher = torch.log_softmax(hf_teacher(torch.tensor([prompt])).logits[0, -1, :vocab].double(), -1).numpy()
        full = torch.log_softmax(hf_theta(torch.tensor([prompt])).logits[0, -1].double(), -1).numpy()
    theta = full[:vocab] - np.log(np.exp(full[:vocab]).sum())
    padding_mass = float(np.exp(full[vocab:]).sum())
    assert padding_mass > 0.2  # the twin must keep the hazard this test exists for
    q = np_mix(theta, teacher, FIXED_ALPHA)
    ratio = np.log(q) - theta
    kept = (1 - padding_mass) * np.exp(theta)
    accept = np.minimum(1.0, q / kept)
    residual = np.maximum(q - kept, 0.0)
    sub_normalised = np.exp(theta) * accept + (1 - float((np.exp(theta) * accept).sum())) * residual / residual.sum()
    control = np.random.default_rng(1).choice(len(q), size=SEEDS, p=sub_normalised / sub_normalised.sum())
    p = {"q": first_token_p(firsts, q, ratio), "control": first_token_p(control.tolist(), q, ratio)}
    CELLS.setdefault(f"{speculative.name}/speculative/first-token", {}).update(
        {"p_under_q": p["q"], "p_sub_normalised_control": p["control"], "padding_mass": padding_mass}
    )
    assert p["q"] > LEVEL and p["control"] < LEVEL, p


@pytest.mark.parametrize(("name", "named"), sorted(SPECULATIVE_REFUSED.items()))
def test_speculative_refuses_by_name_before_an_engine_starts(name, named):
    teacher, theta = twin_pair(name)
    with pytest.raises(ValueError, match=rf"mode='speculative'.*{named}.*mode='lockstep'"):
        OptimalSamplingDual(teacher, theta, mode="speculative", use_tqdm=False)


def test_lockstep_penalised_records_match_rescoring(lockstep):
    """Penalties on q on every twin (padded vocabularies, a bfloat16 teacher): log q is the penalised law of the
    mixture's raw logits at the recorded α, then tempered (vLLM's order), recomputed in float64 from transformers'
    logits over the shared vocabulary (theta's prompt and the output so far counted, as vLLM counts them); log π_t
    and log π_θ stay the models' own; α is kl_symmetry's on the unpenalised rows, as re-scored. The twins'
    random weights spread q thinly, so at temperature 1 these penalties moved log q by 0.004–0.006 nats, under the
    bfloat16 twin's tolerance: a low temperature puts q's mass on a few tokens, as the group cell does."""
    from tests.test_penalties import numpy_penalised

    penalties = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)
    engine = lockstep.engine
    temperature = 0.3
    out = engine.generate(PROMPTS[:2], max_tokens=12, seed=5, temperature=temperature, **penalties)
    vocab = engine.vocab
    worst, moved, alpha_off = 0.0, 0.0, 0.0  # moved: the positive control, how far penalties took log q from plain q's
    for request in out.requests:
        (sample,) = request.samples
        raw = {}
        for role, model, prompt in zip(
            ("teacher", "theta"), lockstep.hf, (request.teacher_prompt_token_ids, request.theta_prompt_token_ids)
        ):
            ids = torch.tensor([list(prompt) + sample.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(sample.token_ids), :vocab]
            raw[role] = logits.double().numpy()
        log_rows = {role: row - np.logaddexp.reduce(row, axis=-1, keepdims=True) for role, row in raw.items()}
        alpha_off = max(alpha_off, lockstep.check_alpha(sample.alpha, log_rows["theta"], log_rows["teacher"]))
        for t, token in enumerate(sample.token_ids):
            a = sample.alpha[t]
            z = (1 - a) * raw["theta"][t] + a * raw["teacher"][t]
            zp = numpy_penalised(z, list(request.theta_prompt_token_ids), sample.token_ids[:t], penalties) / temperature
            logq = zp[token] - np.logaddexp.reduce(zp)
            worst = max(worst, abs(sample.logq[t] - logq))
            plain = z / temperature
            moved = max(moved, abs(logq - (plain[token] - np.logaddexp.reduce(plain))))
            for role, recorded in (("teacher", sample.logp_teacher[t]), ("theta", sample.logp_theta[t])):
                assert abs(recorded - log_rows[role][t][token]) < lockstep.atol, (role, t)
    CELLS.setdefault(f"{lockstep.name}/lockstep/penalised", {}).update(
        {"logq": worst, "moved": moved, "alpha": alpha_off}
    )
    assert worst < 2 * lockstep.atol, worst
    # Without the penalties the oracle must miss by more than the check allows, or the cell could not tell.
    assert moved > 2 * (2 * lockstep.atol), f"the penalties moved no law measurably ({moved})"


def test_lockstep_diverse_group_and_beam_search_records_match_rescoring(lockstep):
    """A diverse group and a beam search on every twin, against float64 re-scoring; α (solved on the members' and
    beams' unpenalised rows) against the float64 kl_symmetry root, and log q at the recorded α.

    Group: member i's log q at step t is log q_i(y), q_i ∝ q·exp(−λ·c_i), c_i counting the members before it that
    took y at step t (its members step together: the engine admits a group at once). Beams: each token's log q is
    q's at temperature 1 with no filter, given the beam's own prefix; a beam's score sums them."""
    engine, (hf_teacher, hf_theta) = lockstep.engine, lockstep.hf
    vocab, lam, temperature, tol = engine.vocab, 2.0, 0.3, 2 * lockstep.atol
    # A low temperature puts q's mass on a few tokens, so the members' penalties move each law visibly.
    out = engine.generate(PROMPTS[1:2], n=3, max_tokens=8, seed=3, diversity_penalty=lam, temperature=temperature)
    (request,) = out.requests
    teacher_ids, theta_ids = list(request.teacher_prompt_token_ids), list(request.theta_prompt_token_ids)
    members = request.samples
    worst = {"group": 0.0, "beams": 0.0, "alpha": 0.0}
    moved = 0.0  # the positive control: how far the penalties moved a member's log q from plain q's
    for i, sample in enumerate(members):
        assert sample.ok, sample.error
        lt = rescore(hf_teacher, teacher_ids, sample.token_ids, vocab).numpy()
        lth = rescore(hf_theta, theta_ids, sample.token_ids, vocab).numpy()
        worst["alpha"] = max(worst["alpha"], lockstep.check_alpha(sample.alpha, lth, lt))
        for t, token in enumerate(sample.token_ids):
            x = ((1 - sample.alpha[t]) * lth[t] + sample.alpha[t] * lt[t]) / temperature
            plain = x[token] - np.logaddexp.reduce(x)
            for earlier in members[:i]:
                if t < len(earlier.token_ids):
                    x[earlier.token_ids[t]] -= lam
            expected = x[token] - np.logaddexp.reduce(x)
            worst["group"] = max(worst["group"], abs(sample.logq[t] - expected))
            moved = max(moved, abs(expected - plain))
            assert abs(sample.logp_teacher[t] - lt[t][token]) < lockstep.atol  # the models' own, unpenalised
            assert abs(sample.logp_theta[t] - lth[t][token]) < lockstep.atol
    (beams,) = engine.beam_search(PROMPTS[1:2], beam_width=2, max_tokens=6)
    assert len(beams) == 2
    for beam in beams:
        lt = rescore(hf_teacher, teacher_ids, beam.tokens, vocab).numpy()
        lth = rescore(hf_theta, theta_ids, beam.tokens, vocab).numpy()
        worst["alpha"] = max(worst["alpha"], lockstep.check_alpha(beam.alpha, lth, lt))
        for t, token in enumerate(beam.tokens):
            x = (1 - beam.alpha[t]) * lth[t] + beam.alpha[t] * lt[t]
            worst["beams"] = max(worst["beams"], abs(beam.logq[t] - (x[token] - np.logaddexp.reduce(x))))
            assert abs(beam.logp_teacher[t] - lt[t][token]) < lockstep.atol
            assert abs(beam.logp_theta[t] - lth[t][token]) < lockstep.atol
    CELLS.setdefault(f"{lockstep.name}/lockstep/group-and-beams", {}).update(worst)
    assert worst["group"] < tol and worst["beams"] < tol, worst
    # Without the group's penalties the oracle must miss by more than the check allows, or the cell could not tell.
    assert moved > max(2 * tol, 0.05), f"the group's penalties moved no law measurably ({moved})"
