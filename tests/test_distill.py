"""The distillation loop: its loss and weights against float64 NumPy references, and two rounds on the tiny pair
(a random student learning a fixed random teacher) in which the held-out KL must fall."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

from dual_sampling.distill import DistillConfig, Distiller
from dual_sampling.distill.loss import (
    ess_fraction,
    recorded_reverse_kl,
    recorded_teacher_logp,
    state_weights,
    top_k_forward_kl,
)
from dual_sampling.options import EngineOptions, SamplingOptions
from dual_sampling.run_output import single_writer
from dual_sampling.run_settings import ModelsAndPrompts
from tests.distill_runs import small_run, write_prompts
from tests.tolerances import SAME_WEIGHTS_TWO_RUNS


def _log_softmax(x: np.ndarray) -> np.ndarray:
    return x - (x.max(-1, keepdims=True) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)))


def test_recorded_reverse_kl_is_the_coarsened_kl_over_both_models_top_tokens():
    """Against float64 NumPy: KL(π_θ‖π_t) between the distributions coarsened to {both models' top k, rest}; never
    above the full reverse KL; the full one when every token is recorded; padding and order change nothing."""
    rng = np.random.default_rng(1)
    n, vocab, k = 5, 60, 6
    lt = _log_softmax(rng.normal(0, 3, (n, vocab)))
    student = rng.normal(0, 1.5, (n, vocab))
    ls = _log_softmax(student)
    rows = []
    for i in range(n):
        union = sorted(set(np.argsort(-lt[i])[:k]) | set(np.argsort(-ls[i])[:k]))
        rows.append(union)
    m = max(len(r) for r in rows) + 2  # padded past the longest union
    ids = np.full((n, m), -1)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = rng.permutation(r)
    teacher_at = np.where(ids >= 0, np.take_along_axis(lt, np.maximum(ids, 0), -1), 123.0)  # junk at padding
    got = recorded_reverse_kl(torch.tensor(student), torch.tensor(ids), torch.tensor(teacher_at))
    for i, r in enumerate(rows):
        ps, pt = np.exp(ls[i, r]), np.exp(lt[i, r])
        rest_s, rest_t = 1 - ps.sum(), 1 - pt.sum()
        want = (ps * np.log(ps / pt)).sum() + rest_s * math.log(rest_s / rest_t)
        full = (np.exp(ls[i]) * (ls[i] - lt[i])).sum()
        assert got[i].item() == pytest.approx(want, rel=1e-5)
        assert got[i].item() <= full + 1e-9
    every = np.tile(np.arange(vocab), (n, 1))
    whole = recorded_reverse_kl(torch.tensor(student), torch.tensor(every), torch.tensor(lt))
    np.testing.assert_allclose(whole.numpy(), (np.exp(ls) * (ls - lt)).sum(-1), rtol=1e-5)


def test_recorded_reverse_kl_has_the_reverse_kl_gradient_and_refuses_repeated_ids():
    rng = np.random.default_rng(2)
    lt = torch.tensor(_log_softmax(rng.normal(0, 2, (3, 20))))
    student = torch.tensor(rng.normal(0, 1, (3, 20)), requires_grad=True)
    ids = torch.tensor([[0, 3, 7, -1], [1, 2, 4, 5], [19, 18, -1, -1]])
    teacher_at = lt.gather(-1, ids.clamp(min=0))
    assert torch.autograd.gradcheck(lambda x: recorded_reverse_kl(x, ids, teacher_at), (student,))
    every = torch.arange(20).repeat(3, 1)
    recorded_reverse_kl(student, every, lt).sum().backward()  # no rest bucket: the gradient is still finite
    assert torch.isfinite(student.grad).all()
    full = (torch.softmax(student, -1) * (torch.log_softmax(student, -1) - lt)).sum()
    expected = torch.autograd.grad(full, student)[0]
    torch.testing.assert_close(student.grad, expected, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="ids must be distinct"):
        recorded_reverse_kl(student, torch.tensor([[0, 0, 1, 2]] * 3), teacher_at)


def _peaked_rows(dtype: torch.dtype, permutation: np.ndarray) -> tuple[Tensor, Tensor, np.ndarray, np.ndarray]:
    """Student logits ``[4, 64]`` whose recorded tokens hold all the mass a float32 or float64 row can show, the
    recorded ids ``[4, 8]`` and the teacher's full log-probabilities ``[4, 64]`` (float64), the columns permuted by
    ``permutation`` so that a reduction adds them in another order. Row 0 records every token (no rest at all); in
    rows 1 to 3 the other tokens sit 1e4, 200 and 40 nats below: 0 in both dtypes, 0 in float32 only, and a rest of
    about 1e-16 that 1 − Σ p cannot resolve in either."""
    rng = np.random.default_rng(11)
    vocab, k = 64, 8
    student = rng.normal(0, 1, (4, vocab))
    for row, gap in zip((1, 2, 3), (1e4, 200.0, 40.0)):
        student[row, k:] -= gap
    student = student[:, permutation]
    teacher = _log_softmax(rng.normal(0, 2, (4, vocab)))[:, permutation]
    where = np.argsort(permutation)  # the column each original token moved to
    ids = np.tile(where[:k], (4, 1))
    every = np.tile(where, (1, 1))[0]
    ids = np.concatenate([ids, np.full((4, vocab - k), -1)], 1)
    ids[0] = every
    return torch.tensor(student, dtype=dtype, requires_grad=True), torch.tensor(ids), student, teacher


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_recorded_reverse_kl_gradient_is_the_full_ones_where_the_ids_hold_all_the_mass(dtype):
    """Where the recorded tokens hold all of the student's mass (every token recorded, or the rest below what the
    dtype or 1 − Σ p resolves), the loss is the full reverse KL and so is its gradient, finite, in float32 and float64
    and whatever order the columns are summed in; against float64 NumPy: ∂KL/∂z_j = p_j (log p_j − log t_j − KL)."""
    for seed in range(6):
        permutation = np.random.default_rng(seed).permutation(64)
        logits, ids, student, teacher = _peaked_rows(dtype, permutation)
        teacher_at = torch.tensor(np.where(ids >= 0, np.take_along_axis(teacher, ids.clamp(min=0).numpy(), -1), 0.0))
        loss = recorded_reverse_kl(logits, ids, teacher_at)
        loss.sum().backward()
        assert torch.isfinite(loss).all() and torch.isfinite(logits.grad).all(), (seed, logits.grad)
        ls = _log_softmax(student)
        p = np.exp(ls)
        full = (p * (ls - teacher)).sum(-1)
        want = p * (ls - teacher - full[:, None])
        # float32: the log-softmax of one row is within a few units of roundoff of the exact one (|log p| < 30 at the
        # recorded tokens), and so is each term; float64 likewise at its own roundoff.
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        np.testing.assert_allclose(loss.detach().double().numpy(), full, rtol=0, atol=tol)
        np.testing.assert_allclose(logits.grad.double().numpy(), want, rtol=0, atol=tol)
        # The forward KL on the same rows, the teacher's rest not empty: its student rest is summed the same way
        # and floored at e^-80 (rows 1 and 2), where its gradient is 0.
        top = ids[1:2, :8].expand(4, 8)
        logits.grad = None
        forward = top_k_forward_kl(logits, top, torch.tensor(np.take_along_axis(teacher, top.numpy(), -1)))
        forward.sum().backward()
        assert torch.isfinite(forward).all() and torch.isfinite(logits.grad).all(), (seed, logits.grad)
        inside = np.zeros_like(p, dtype=bool)
        np.put_along_axis(inside, top.numpy(), True, -1)
        t = np.exp(teacher) * inside
        t_rest = 1 - t.sum(-1)
        log_s_rest = np.logaddexp.reduce(np.where(inside, -np.inf, ls), axis=-1)
        floored = log_s_rest < -80
        kl = (t * np.where(inside, teacher - ls, 0.0)).sum(-1) + t_rest * (np.log(t_rest) - np.maximum(log_s_rest, -80))
        grad = -t + t.sum(-1, keepdims=True) * p
        p_over = np.exp(np.where(inside, -np.inf, ls - log_s_rest[:, None]))  # p_j / the rest, outside the top k
        grad += np.where(floored[:, None], 0.0, -t_rest[:, None] * (p_over - p))
        np.testing.assert_allclose(forward.detach().double().numpy(), kl, rtol=0, atol=tol)
        np.testing.assert_allclose(logits.grad.double().numpy(), grad, rtol=0, atol=tol)


def test_the_reverse_kl_of_a_samples_dense_records_is_the_kl_over_the_union_of_both_top_k():
    """A sample's dense records as the engine writes them (each model's top k, both models' log-probabilities at
    them, float32) give the coarsened KL(π_θ‖π_t) over the union of the two top k, against float64 NumPy; a token in
    both top k counts once."""
    rng = np.random.default_rng(4)
    n, vocab, k = 6, 40, 5
    lt = _log_softmax(rng.normal(0, 2.5, (n, vocab)))
    student = rng.normal(0, 1.5, (n, vocab))
    student[:3, :4] += 6  # rows where the two top k overlap, and rows where they mostly do not
    lt[:3, :4] += 6
    lt = _log_softmax(lt)
    ls = _log_softmax(student)
    tops = np.stack([np.argsort(-lt, -1)[:, :k], np.argsort(-ls, -1)[:, :k]], 1)  # [n, 2, k]
    own = np.stack([np.take_along_axis(lt, tops[:, 0], -1), np.take_along_axis(ls, tops[:, 1], -1)], 1)
    other = np.stack([np.take_along_axis(ls, tops[:, 0], -1), np.take_along_axis(lt, tops[:, 1], -1)], 1)
    records = [torch.from_numpy(a) for a in (tops.astype(np.int32), own.astype(np.float32), other.astype(np.float32))]
    ids, teacher_at = recorded_teacher_logp(*records)
    assert ids.shape == teacher_at.shape == (n, 2 * k)
    got = recorded_reverse_kl(torch.tensor(student), ids, teacher_at.double())
    overlaps = 0
    for i in range(n):
        union = sorted(set(tops[i, 0]) | set(tops[i, 1]))
        overlaps += 2 * k - len(union)
        assert sorted(ids[i][ids[i] >= 0].tolist()) == union
        ps, pt = np.exp(ls[i, union]), np.exp(lt[i, union])
        want = (ps * np.log(ps / pt)).sum() + (1 - ps.sum()) * math.log((1 - ps.sum()) / (1 - pt.sum()))
        assert got[i].item() == pytest.approx(want, rel=1e-5, abs=1e-6)  # float32 records of log π_t
    assert overlaps >= 3 * 3  # the overlapping rows were exercised


def test_a_named_teachers_dense_records_of_several_give_the_kl_to_that_teacher():
    """A sample of three models (two teachers and θ) records every model's top k and every model's log π at them
    (``[n, 3, k]``, ``[n, 3, 3, k]``, float32); its pair form for (teacher 1, θ) gives the coarsened reverse KL(π_θ‖π_1)
    over the union of their top k and the forward KL on teacher 1's top k, against float64 NumPy on those two models'
    rows alone: the other teacher's records play no part. A sample of one teacher's pair form is its own records."""
    from dual_sampling.records import SampleRecord

    rng = np.random.default_rng(8)
    n, vocab, k = 5, 40, 4
    rows = [_log_softmax(rng.normal(0, 2.5, (n, vocab))) for _ in range(3)]  # teacher 0, teacher 1, θ
    tops = np.stack([np.argsort(-r, -1)[:, :k] for r in rows], 1)  # [n, 3, k]
    at = np.stack([np.stack([np.take_along_axis(rows[j], tops[:, i], -1) for j in range(3)], 1) for i in range(3)], 1)
    sample = SampleRecord(text="", token_ids=[0] * n, finish_reason="length", seed=0)
    sample.dense_ids, sample.dense_logp = tops.astype(np.int32), at.astype(np.float32)  # [n, 3, 3, k]: [:, i, j]
    ids, own, other = sample.dense_pair(1, 2)
    assert ids.shape == own.shape == other.shape == (n, 2, k)
    records = [torch.from_numpy(np.ascontiguousarray(a)) for a in (ids, own, other)]
    union_ids, teacher_at = recorded_teacher_logp(*records)
    student = torch.tensor(rows[2])
    reverse = recorded_reverse_kl(student, union_ids, teacher_at.double())
    forward = top_k_forward_kl(student, records[0][:, 0].long(), records[1][:, 0].double())
    lt, ls = rows[1], rows[2]
    for i in range(n):
        union = sorted(set(tops[i, 1]) | set(tops[i, 2]))
        ps, pt = np.exp(ls[i, union]), np.exp(lt[i, union])
        want = (ps * np.log(ps / pt)).sum() + (1 - ps.sum()) * math.log((1 - ps.sum()) / (1 - pt.sum()))
        assert reverse[i].item() == pytest.approx(want, rel=1e-5, abs=1e-6)
        top = tops[i, 1]
        pt, ps = np.exp(lt[i, top]), np.exp(ls[i, top])
        want = (pt * np.log(pt / ps)).sum() + (1 - pt.sum()) * math.log((1 - pt.sum()) / (1 - ps.sum()))
        assert forward[i].item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    pair = SampleRecord(text="", token_ids=[0] * n, finish_reason="length", seed=0)
    pair.dense_ids, pair.dense_logp, pair.dense_other_logp = ids, own, other
    assert all(a is b for a, b in zip(pair.dense_pair(0, 1), (ids, own, other)))


def test_steps_on_the_recorded_reverse_kl_lower_the_full_reverse_kl():
    """The reverse loss as a training signal: a small student takes AdamW steps on the coarsened KL(π_θ‖π_t) of
    records made at its own states (both models' top 8 of 64 tokens, as the engine records them), and the full reverse
    KL over the vocabulary at those states, computed in float64, falls."""
    torch.manual_seed(0)
    n, vocab, k = 32, 64, 8
    teacher = _log_softmax(np.random.default_rng(5).normal(0, 3, (n, vocab)))
    logits = torch.nn.Parameter(torch.randn(n, vocab, dtype=torch.float64))
    optimizer = torch.optim.AdamW([logits], lr=0.05)

    def full() -> float:
        ls = torch.log_softmax(logits.detach(), -1).numpy()
        return float((np.exp(ls) * (ls - teacher)).sum(-1).mean())

    before = full()
    for _ in range(40):
        ls = torch.log_softmax(logits.detach(), -1).numpy()
        tops = np.stack([np.argsort(-teacher, -1)[:, :k], np.argsort(-ls, -1)[:, :k]], 1)
        own = np.stack([np.take_along_axis(teacher, tops[:, 0], -1), np.take_along_axis(ls, tops[:, 1], -1)], 1)
        other = np.stack([np.take_along_axis(ls, tops[:, 0], -1), np.take_along_axis(teacher, tops[:, 1], -1)], 1)
        ids, teacher_at = recorded_teacher_logp(*(torch.from_numpy(a.astype(np.float32)) for a in (tops, own, other)))
        recorded_reverse_kl(logits, ids.long(), teacher_at.double()).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert full() < 0.5 * before, (before, full())


def test_top_k_forward_kl_is_the_coarsened_kl_and_bounds_the_full_one():
    rng = np.random.default_rng(0)
    n, vocab, k = 6, 50, 7
    teacher = rng.normal(0, 3, (n, vocab))
    student = rng.normal(0, 1, (n, vocab))
    lt = teacher - np.log(np.exp(teacher).sum(-1, keepdims=True))
    ls = student - np.log(np.exp(student).sum(-1, keepdims=True))
    ids = np.argsort(-lt, axis=-1)[:, :k]
    got = top_k_forward_kl(
        torch.tensor(student, dtype=torch.float64), torch.tensor(ids), torch.tensor(np.take_along_axis(lt, ids, -1))
    )
    for i in range(n):
        pt, ps = np.exp(lt[i, ids[i]]), np.exp(ls[i, ids[i]])
        rest_t, rest_s = 1 - pt.sum(), 1 - ps.sum()
        want = (pt * np.log(pt / ps)).sum() + rest_t * math.log(rest_t / rest_s)
        full = (np.exp(lt[i]) * (lt[i] - ls[i])).sum()
        assert got[i].item() == pytest.approx(want, rel=1e-5)
        assert got[i].item() <= full + 1e-9
    # With the whole vocabulary as the top k, it is the full KL (no rest bucket, no 0·log 0).
    all_ids = np.argsort(-lt, axis=-1)
    whole = top_k_forward_kl(
        torch.tensor(student), torch.tensor(all_ids), torch.tensor(np.take_along_axis(lt, all_ids, -1))
    )
    full = (np.exp(lt) * (lt - ls)).sum(-1)
    assert np.allclose(whole.numpy(), full, rtol=1e-4, atol=1e-6)


def test_state_weights_follow_their_definitions():
    rng = np.random.default_rng(1)
    log_w = [rng.normal(0, 0.5, m) for m in (3, 5, 4)]
    as_t = [torch.tensor(x) for x in log_w]
    lengths = [len(x) for x in log_w]

    def normalised(per_token):
        flat = np.concatenate(per_token)
        return [x / flat.mean() for x in per_token]

    want = {
        "none": normalised([np.ones(m) for m in lengths]),
        "token": normalised([np.exp(x) for x in log_w]),
        "sequence_mean": normalised([np.full(len(x), np.exp(x.mean())) for x in log_w]),
        "sequence": normalised([np.full(len(x), np.exp(x.sum())) for x in log_w]),
    }
    for mode, expected in want.items():
        got = state_weights(as_t, mode)
        for g, e in zip(got, expected):
            assert np.allclose(g.numpy(), e, rtol=1e-12), mode
    clipped = state_weights(as_t, "sequence", max_weight=1.2)
    assert max(float(c.max()) for c in clipped) <= 1.2
    # Log-weights far beyond float64's exp range keep their ratios.
    huge = state_weights([torch.tensor([800.0]), torch.tensor([799.0])], "sequence")
    assert float(huge[0] / huge[1]) == pytest.approx(math.e)
    with pytest.raises(ValueError, match="weighting"):
        state_weights(as_t, "sqrt")
    w = np.exp(rng.normal(0, 1, 20))
    assert ess_fraction(torch.tensor(np.log(w))) == pytest.approx(w.sum() ** 2 / (20 * (w**2).sum()))
    assert ess_fraction(torch.zeros(5)) == pytest.approx(1.0)


PAIR = ModelsAndPrompts("t", "s")
"""Model folders that are never opened: the config checks run before any model is."""


def test_config_names_the_bad_field(tmp_path):
    with pytest.raises(ValueError, match="weighting"):
        DistillConfig(prompts="p.jsonl", output=str(tmp_path), source=PAIR, weighting="sqrt")
    for name in ("eval_every", "tokens_per_round"):
        with pytest.raises(ValueError, match=f"^{name} must be an integer >= 0"):
            DistillConfig(prompts="p.jsonl", output=str(tmp_path), source=PAIR, **{name: -1})
    with pytest.raises(ValueError, match=r"^loss must be one of \('forward', 'reverse', 'reverse_full'\), got 'jsd'"):
        DistillConfig(prompts="p.jsonl", output=str(tmp_path), source=PAIR, loss="jsd")
    with pytest.raises(ValueError, match="steps_per_round"):
        DistillConfig(prompts="p.jsonl", output=str(tmp_path), source=PAIR, prompts_per_round=2, steps_per_round=3)
    for name, value in (("max_weight", 0), ("learning_rate", math.inf), ("weight_decay", math.nan)):
        with pytest.raises(ValueError, match=name):
            DistillConfig(prompts="p.jsonl", output=str(tmp_path), source=PAIR, **{name: value})
    with pytest.raises(ValueError, match="unknown setting 'round'"):
        DistillConfig.from_settings({"prompts": "p", "output": "o", "round": 3})
    with pytest.raises(ValueError, match="dense_logprobs=4 differs from loss_top_k=8"):  # never overridden silently
        DistillConfig.from_settings(
            {"prompts": "p", "output": "o", "teacher": "t", "theta": "s", "loss_top_k": 8, "dense_logprobs": 4}
        )
    with pytest.raises(ValueError, match="^use_beam_search: distillation trains on samples of q"):
        DistillConfig.from_settings(
            {"prompts": "p", "output": "o", "teacher": "t", "theta": "s", "use_beam_search": True, "n": 2}
        )
    with pytest.raises(ValueError, match=r"^trainer_dtype must be one of \('float32', 'bfloat16'\), got 'float16'"):
        DistillConfig(prompts="p.jsonl", output=str(tmp_path), source=PAIR, trainer_dtype="float16")
    with pytest.raises(ValueError, match="^trainer_device must be a torch device"):
        DistillConfig(prompts="p.jsonl", output=str(tmp_path), source=PAIR, trainer_device="gpu0")
    with pytest.raises(ValueError, match="^loss='forward' reads each model's top k .* use loss='reverse_full'"):
        DistillConfig.from_settings(
            {"prompts": "p", "output": "o", "teacher": "t", "theta": "s", "mode": "speculative"}
        )
    for name, value in (("max_weight", 0), ("learning_rate", -1.0), ("rounds", True), ("max_grad_norm", math.nan)):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            DistillConfig(prompts="p.jsonl", output=str(tmp_path), source=PAIR, **{name: value})
    cfg = DistillConfig.from_settings(
        {
            "prompts": "p",
            "output": "o",
            "teacher": "t",
            "theta": "s",
            "loss_top_k": 8,
            "alpha_method": "fixed",
            "temperature": 0.9,
        }
    )
    assert cfg.sampling.dense_logprobs == 8 and cfg.engine.max_dense_logprobs >= 8
    assert cfg.engine.alpha_method == "fixed" and cfg.sampling.temperature == 0.9 and cfg.sampling.max_tokens == 128


@pytest.fixture
def prompts_file(tmp_path):
    return write_prompts(tmp_path / "prompts.jsonl")


def _distiller_without_engine(tiny_same, prompts_file, tmp_path, **settings) -> Distiller:
    """A Distiller on the tiny pair with a stand-in for the dual engine (what the constructor reads of it), no
    teacher loaded (eval_every=0)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    teacher, theta = tiny_same
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    dual = SimpleNamespace(vocab=len(tokenizer), eos_token_ids={tokenizer.eos_token_id}, tokenizer=tokenizer)
    cfg = DistillConfig(
        prompts=str(prompts_file),
        output=str(tmp_path / "run"),
        source=ModelsAndPrompts(str(teacher), str(theta), prompt_field="question"),
        eval_every=0,
        **settings,
    )
    return Distiller(cfg, dual)


def test_the_trainer_runs_where_and_how_it_is_told(tiny_same, prompts_file, tmp_path):
    """trainer_dtype="bfloat16" runs the student's forwards under bfloat16 autocast and keeps its weights float32;
    a CUDA trainer_device where torch sees none is refused by name before a model loads."""
    ids = torch.tensor([[1, 2, 3, 4]])
    plain = _distiller_without_engine(tiny_same, prompts_file, tmp_path)
    with plain._forward():
        assert plain.student(ids).logits.dtype == torch.float32
    mixed = _distiller_without_engine(tiny_same, prompts_file, tmp_path, trainer_dtype="bfloat16")
    with mixed._forward():
        assert mixed.student(ids).logits.dtype == torch.bfloat16
    assert {p.dtype for p in mixed.student.parameters()} == {torch.float32}
    assert mixed.student.device == mixed.device == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="trainer_device='cuda:0': torch sees no CUDA device here"):
            _distiller_without_engine(tiny_same, prompts_file, tmp_path, trainer_device="cuda:0")


def test_two_rounds_make_the_held_out_kl_fall_and_a_run_resumes(dual_engine, tiny_same, prompts_file, tmp_path):
    theta = tiny_same[1]
    settings = small_run(
        tiny_same,
        prompts_file,
        tmp_path,
        eval_max_tokens=12,
        rounds=1,
        prompts_per_round=16,
        steps_per_round=2,
        learning_rate=1e-3,
        plot=True,
        sampling=SamplingOptions(max_tokens=16),
    )
    try:
        rows = Distiller(DistillConfig(**settings), dual_engine).run()
        assert [r["round"] for r in rows] == [0, 1]
        assert dual_engine.weight_versions["theta"] == "round-1"
        # Resumed with more rounds: round 1's checkpoint is the start, round 2 follows; a stale partial is ignored.
        (tmp_path / "run" / "checkpoints" / "round-2.partial").mkdir()
        rows = Distiller(DistillConfig(**{**settings, "rounds": 2, "resume": True}), dual_engine).run()
        assert [r["round"] for r in rows] == [0, 1, 2]
        kl = [r["kl_teacher_student"] for r in rows]
        assert kl[2] < kl[1] < kl[0], kl
        assert rows[2]["kl_student_teacher"] < rows[0]["kl_student_teacher"]
        assert rows[2]["tokens"] > rows[1]["tokens"] > 0 and rows[2]["wall_s"] > rows[1]["wall_s"]
        for r in rows[1:]:
            # The trainer is the re-scoring oracle's computation (a transformers float32 forward): the engine's log π_θ
            # is within RESCORE_ATOL of it; its float64 normalisation against the trainer's float32 adds far less.
            assert 0 <= r["sampler_mismatch_mean"] <= r["sampler_mismatch_max"] <= SAME_WEIGHTS_TWO_RUNS, r
            assert 0 < r["ess_sequence"] <= 1 and 0 < r["ess_token"] <= 1 and 0 <= r["mean_alpha"] <= 1
            assert r["theta_version"] == f"round-{r['round']}" and r["update_s"] > 0
        assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["round-2"]
        # The checkpoint's tokenizer names its folder's class (the sampler's own is vLLM's cached subclass).
        saved, source = (
            json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"]
            for folder in (tmp_path / "run" / "checkpoints" / "round-2", Path(dual_engine.config.tokenizer_folder))
        )
        assert saved == source and not saved.startswith("Cached"), (saved, source)
        assert (tmp_path / "run" / "plot.png").stat().st_size > 0
        lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["round"] for x in lines] == [0, 1, 2]
        assert json.loads((tmp_path / "run" / "eval_set.json").read_text())["references"]
        # Killed after round 3's metrics line but before its checkpoint was whole: the line is dropped, round 3 redone.
        with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"round": 3, "killed": True}) + "\n")
        # Its partial checkpoint is a link planted elsewhere: removed, never written through.
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (tmp_path / "run" / "checkpoints" / "round-3.partial").symlink_to(elsewhere)
        resumed = DistillConfig(**{**settings, "rounds": 3, "resume": True})
        held_elsewhere = single_writer(resumed.output, tmp_path / "run.lock")  # another run holds the output
        with held_elsewhere, pytest.raises(FileExistsError, match="being written by another run"):
            Distiller(resumed, dual_engine).run()
        rows = Distiller(resumed, dual_engine).run()
        assert [r["round"] for r in rows] == [0, 1, 2, 3] and "killed" not in rows[3] and rows[3]["samples"] > 0
        assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["round-3"]
        assert not list(elsewhere.iterdir()) and not (tmp_path / "run" / "checkpoints" / "round-3").is_symlink()
        with pytest.raises(ValueError, match="learning_rate"):
            Distiller(DistillConfig(**{**settings, "learning_rate": 1e-2, "resume": True}), dual_engine).run()
        with pytest.raises(FileExistsError):
            Distiller(DistillConfig(**settings), dual_engine).run()
    finally:
        dual_engine.update_theta(str(theta), version="0")


def test_an_update_the_engine_missed_stops_the_run_by_name(dual_engine, tiny_same, prompts_file, tmp_path, monkeypatch):
    """The engine acknowledges every update but keeps its weights: round 1 samples from the θ it was started with
    (which the trainer holds too, so it passes), round 2 from that θ again while the trainer holds round 1's. The
    per-round check stops the run before round 2 trains, naming the setting."""
    import dual_sampling.driver.weight_loads
    from dual_sampling.distill import SamplerMismatchError

    theta = tiny_same[1]

    async def keep_the_old_weights(engine):
        return None

    monkeypatch.setattr(dual_sampling.driver.weight_loads, "reload_from", lambda folder: keep_the_old_weights)
    monkeypatch.setattr(dual_sampling.driver.weight_loads, "transfer", lambda *chunks, draft: keep_the_old_weights)
    config = DistillConfig(
        **small_run(
            tiny_same,
            prompts_file,
            tmp_path,
            eval_max_tokens=8,
            rounds=2,
            prompts_per_round=8,
            steps_per_round=2,
            learning_rate=1e-2,
            plot=False,
            sampling=SamplingOptions(max_tokens=12),
        )
    )
    try:
        with pytest.raises(SamplerMismatchError, match=r"round 2: .*max_sampler_mismatch=0\.05") as caught:
            Distiller(config, dual_engine).run()
        print(caught.value)
        assert caught.value.mismatch.max_abs > 10 * config.max_sampler_mismatch  # far past the threshold
        rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [0, 1] and rows[1]["sampler_mismatch_max"] <= SAME_WEIGHTS_TWO_RUNS
    finally:
        monkeypatch.undo()
        dual_engine.update_theta(str(theta), version="0")


def test_the_trust_region_budget_anneals_linearly_to_zero():
    engine = EngineOptions(alpha_method="trust_region", alpha_config={"kl_budget": 0.3})
    cfg = DistillConfig(prompts="p.jsonl", output="o", source=PAIR, engine=engine, kl_budget_warmup_rounds=3)
    assert [cfg.kl_budget(r) for r in range(1, 6)] == pytest.approx([0.3, 0.2, 0.1, 0.0, 0.0], abs=1e-15)
    assert DistillConfig(prompts="p.jsonl", output="o", source=PAIR, engine=engine).kl_budget(1) is None
    with pytest.raises(ValueError, match="kl_budget_warmup_rounds=2 anneals a trust_region budget; alpha_method is"):
        DistillConfig(prompts="p.jsonl", output="o", source=PAIR, kl_budget_warmup_rounds=2)
    with pytest.raises(ValueError, match="kl_budget_warmup_rounds must be an integer >= 0"):
        DistillConfig(prompts="p.jsonl", output="o", source=PAIR, engine=engine, kl_budget_warmup_rounds=-1)


def test_arms_whose_samples_differ_in_length_train_on_one_sequence_of_problems():
    """Two arms of one seed: one's samples all run to the cap, the other's end early on every third problem, so a round
    takes 4 samples of one arm's draw of 8 and more of the other's. Each round trains on exactly the budget, and both
    arms train on the seeded order's problems in sequence, none skipped: the arm that needs more problems has walked
    further along the same sequence. (Counting every drawn problem as used skipped the rest of each draw: arms of one
    seed then shared only part of their problems.)"""
    from dual_sampling.distill.loop import draw_round
    from dual_sampling.records import RequestRecord, SampleRecord

    order = list(range(50))
    np.random.default_rng(5).shuffle(order)

    def arm(length, sizes):
        def draw(picks):  # one sample per problem; the problem's id stands in for its prompt ids
            sizes.append(len(picks))
            return [
                RequestRecord(i, [p], [p], [SampleRecord("", [7] * n, "stop" if n < 16 else "length", seed=0)])
                for i, (p, n) in enumerate((p, length(p)) for p in picks)
            ]

        return draw

    walks, drawn = {}, {}
    for name, length in (("at_cap", lambda p: 16), ("stopping", lambda p: 16 if p % 3 else 5)):
        for per_problem in (0, 16):  # full draws of 8; draws of only what the budget can use at 16 tokens a sample
            used, trained, picked = 0, [], []
            draw = arm(length, picked)
            for r in range(1, 5):
                taken, used = draw_round(r, draw, order, used, 8, 64, per_problem)
                assert sum(len(s.token_ids) for s, _ in taken) == 64
                trained += [(req.theta_prompt_token_ids[0], len(s.token_ids)) for s, req in taken]
                assert used == len(trained)  # a problem counts once its sample is trained on, and only then
            walks[name, per_problem], drawn[name, per_problem] = trained, picked
    for name in ("at_cap", "stopping"):
        # The same samples in the same order, cut at the same place, with fewer problems drawn.
        assert walks[name, 0] == walks[name, 16]
        assert max(drawn[name, 16]) <= 4 and sum(drawn[name, 16]) < sum(drawn[name, 0])
    assert [p for p, _ in walks["at_cap", 0]] == order[:16] and drawn["at_cap", 16] == [4] * 4
    assert [p for p, _ in walks["stopping", 0]] == order[: len(walks["stopping", 0])]
    assert len(walks["stopping", 0]) > 16


@pytest.mark.parametrize("loss", ["reverse", "reverse_full"])
def test_a_run_samples_each_round_with_its_budget_and_gives_the_engine_its_alpha_back(
    dual_engine, tiny_same, prompts_file, tmp_path, loss
):
    """Trust-region blending as published: an annealed budget, trained on the per-prefix reverse KL of the records."""
    engine = EngineOptions(alpha_method="trust_region", alpha_config={"kl_budget": 0.05}, max_dense_logprobs=16)
    settings = small_run(tiny_same, prompts_file, tmp_path, eval_max_tokens=8, rounds=2, prompts_per_round=8)
    settings.update(engine=engine, kl_budget_warmup_rounds=1, steps_per_round=1, plot=False, loss=loss)
    # An equal budget of generated tokens, and no held-out metrics: draws of 8 prompts (at most 8 tokens each) until
    # 41 tokens, the last sample cut.
    settings.update(tokens_per_round=41, eval_every=0)
    started = dual_engine.alpha_settings
    try:
        rows = Distiller(DistillConfig(**settings, sampling=SamplingOptions(max_tokens=8)), dual_engine).run()
        assert [r.get("kl_budget") for r in rows] == [None, 0.05, 0.0]
        assert rows[2]["mean_alpha"] == 0.0  # ε = 0: every token from the student alone
        assert 0.0 < rows[1]["mean_alpha"] < 1.0
        assert dual_engine.alpha_settings == started  # the run's budget was the run's only
        assert all(0 < r["loss"] < math.inf for r in rows[1:])
        assert [r["tokens"] for r in rows] == [0, 41, 82]
        # One sample per problem: a round uses the problems it trained on, and the next continues the walk there.
        assert [r["prompts_used"] for r in rows] == [0, rows[1]["samples"], rows[1]["samples"] + rows[2]["samples"]]
        assert all("kl_teacher_student" not in r for r in rows)
        assert not (tmp_path / "run" / "eval_set.json").exists()
    finally:
        dual_engine.update_theta(str(tiny_same[1]), version="0")


def test_the_sign_flip_test_is_exact_and_the_bootstrap_covers_the_mean():
    from dual_sampling.distill.compare import bootstrap_interval, sign_flip_p

    assert sign_flip_p([0.3, 0.1, 0.2, 0.5, 0.4, 0.6]) == 1 / 64  # every seed better: the least p six seeds give
    assert sign_flip_p([0.3, 0.1, 0.2, 0.5, 0.4, -0.05]) == 2 / 64  # flipping the −0.05 gives a larger sum
    assert sign_flip_p([-0.3, -0.1, -0.2]) == 1.0
    assert sign_flip_p([1.0, -1.0]) == 3 / 4  # ties count against the effect: (+,−), (−,+) and (+,+)
    # Against sign flips drawn at random (float64 NumPy), on differences with no structure.
    rng = np.random.default_rng(9)
    d = rng.normal(0.2, 1.0, 9)
    flips = rng.choice([-1.0, 1.0], (200_000, 9))
    assert sign_flip_p(d) == pytest.approx(((flips * d).sum(1) >= d.sum() - 1e-12).mean(), abs=0.004)
    lo, hi = bootstrap_interval(d, resamples=5000)
    assert lo < d.mean() < hi
    assert hi - lo == pytest.approx(2 * 1.96 * d.std() / 3, rel=0.35)  # about the normal interval of a mean of 9
    for bad in ([], [1.0, math.nan], [math.inf]):
        with pytest.raises(ValueError, match="differences must be a non-empty sequence of finite numbers"):
            sign_flip_p(bad)


def test_sequence_divergences_are_exact_sums_over_the_vocabulary(hf_models):
    """Against float64 NumPy on the models' own logits (one forward of prompt and tokens each)."""
    from dual_sampling.distill.evaluate import continuation_logp, distinct_n, divergence_sums

    teacher, theta = hf_models
    prompt, tokens = [5, 9, 13, 2], [7, 7, 30, 41, 7, 7, 30]
    vocab = 600
    got = divergence_sums(*(continuation_logp(m, prompt, [tokens], vocab)[0] for m in (theta, teacher)))
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        rows = [m(ids).logits[0, len(prompt) - 1 : -1, :vocab].double().numpy() for m in (theta, teacher)]
    ls, lt = (_log_softmax(r) for r in rows)
    want = {
        "kl_student_teacher": (np.exp(ls) * (ls - lt)).sum(),
        "kl_teacher_student": (np.exp(lt) * (lt - ls)).sum(),
        "student_entropy": -(np.exp(ls) * ls).sum(),
        "teacher_entropy": -(np.exp(lt) * lt).sum(),
    }
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key  # batched float32 forwards against plain ones
    assert got["tokens"] == len(tokens) and got["kl_student_teacher"] > 0
    assert distinct_n(tokens) == 4 / 6 and distinct_n([1, 2, 3]) == 1.0 and math.isnan(distinct_n([1]))


def test_the_held_out_sampler_draws_from_the_model_and_stops_at_eos(hf_models):
    """evaluate.sample, the engine-independent sampler of the held-out metrics: the first token's frequencies over
    2,000 draws a prompt match the model's softmax (float64) within sampling error; samples end at and with their
    first EOS; a seed reproduces them; prompts of different lengths (left-padded) keep their own distributions, in one
    batch or in batches that mix them (1,500 rows a batch: the third holds both prompts)."""
    from dual_sampling.distill.evaluate import sample

    _, theta = hf_models
    prompts = [[5, 9, 13, 2], [7, 8]]
    one_batch = sample(theta, prompts, 2000, 1, [1023], seed=3)
    batched = sample(theta, prompts, 2000, 1, [1023], seed=3, batch_size=1500)
    for prompt, group in [*zip(prompts, one_batch), *zip(prompts, batched)]:
        with torch.no_grad():
            p = torch.softmax(theta(torch.tensor([prompt])).logits[0, -1].double(), -1).numpy()
        counts = np.bincount([s[0] for s in group], minlength=p.size)
        top = np.argsort(-p)[:5]  # the likeliest tokens: each frequency within 4.5 standard errors
        se = np.sqrt(p[top] * (1 - p[top]) / len(group))
        assert (np.abs(counts[top] / len(group) - p[top]) < 4.5 * se + 1e-12).all(), (counts[top], p[top])
    a = sample(theta, prompts, 3, 12, [1023], seed=4)
    assert a == sample(theta, prompts, 3, 12, [1023], seed=4) and a != sample(theta, prompts, 3, 12, [1023], seed=5)
    common = max(set(t for g in a for s in g for t in s), key=lambda t: sum(s.count(t) for g in a for s in g))
    cut = sample(theta, prompts, 3, 12, [common], seed=4)  # a frequent token as the EOS id: samples end early
    cut_batched = sample(theta, prompts, 3, 12, [common], seed=4, batch_size=4)
    assert cut_batched == sample(theta, prompts, 3, 12, [common], seed=4, batch_size=4)
    for group in [*cut, *cut_batched]:
        for s in group:
            assert len(s) <= 12 and s.count(common) <= 1 and (common not in s or s[-1] == common)
    assert any(len(s) < 12 for g in cut for s in g)
    for bad in (-1, 1.5, True, "16"):  # a negative step would return no samples at all
        with pytest.raises(ValueError, match="batch_size"):
            sample(theta, prompts, 3, 12, [1023], seed=4, batch_size=bad)


def test_continuations_scored_in_one_batch_get_the_rows_of_separate_forwards(hf_models):
    """continuation_logp (the prompt once, the continuations right-padded in one batch) against one plain forward per
    sequence, for continuations of different lengths (one token, none)."""
    from dual_sampling.distill.evaluate import continuation_logp, forced_logp

    for model in hf_models:
        prompt = [5, 9, 13, 2, 40]
        continuations = [[7, 7, 30, 41, 7, 7, 30], [11], [], [3, 4, 5, 6]]
        got = continuation_logp(model, prompt, continuations, 600)
        for c, rows in zip(continuations, got):
            assert rows.shape == (len(c), 600) and rows.dtype == torch.float64
            if c:
                torch.testing.assert_close(rows, forced_logp(model, prompt, c, 600), atol=2e-5, rtol=0)


def test_the_second_experiments_rule_needs_both_tests_with_the_margin_on_the_right_side():
    from dual_sampling.distill.compare import trust_region_helps

    base = [1.0, 0.9, 1.1, 0.95, 1.05, 1.0, 0.98]
    worse_by = lambda x: [b + x for b in base]
    # Own KL 0.01 worse on every seed (inside the 0.05 margin), human NLL 0.2 better on every seed: helps.
    ok = trust_region_helps(
        {"student": base, "trust_region": worse_by(0.01)}, {"student": base, "trust_region": worse_by(-0.2)}, 0.05
    )
    assert ok["helps"] and ok["non_inferiority_own_kl"]["p_one_sided"] == 1 / 2**7
    assert ok["non_inferiority_own_kl"]["mean"] == pytest.approx(0.04)
    # 0.08 worse on own KL: outside the margin, so not non-inferior, whatever the human NLL says.
    bad = trust_region_helps(
        {"student": base, "trust_region": worse_by(0.08)}, {"student": base, "trust_region": worse_by(-0.2)}, 0.05
    )
    assert not bad["non_inferiority_own_kl"]["passes"] and bad["superiority_human_nll"]["passes"]
    assert not bad["helps"]
    # Equal on the human solutions: no superiority.
    tie = trust_region_helps({"student": base, "trust_region": base}, {"student": base, "trust_region": base}, 0.05)
    assert tie["non_inferiority_own_kl"]["passes"] and not tie["superiority_human_nll"]["passes"]
    with pytest.raises(ValueError, match="paired"):
        trust_region_helps({"student": base, "trust_region": base[:-1]}, {"student": base, "trust_region": base}, 0.05)


def _experiment_script():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "distill_experiment.py"
    spec = importlib.util.spec_from_file_location("distill_experiment", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_experiments_answer_reader_and_its_rule_on_cells():
    script = _experiment_script()
    read = script.final_answer
    assert read("He pays 3 * 4 = 12.\n#### 1,200") == "1200"
    assert read("so the total is $3.50 and then 7.", last_number=True) == "7"
    assert read("The answer is 3.50", last_number=True) == "3.5"
    assert read("no number here", last_number=True) is None and read("12 but no marker") is None
    # The "helps" rule over cells, paired by seed; a seed one arm has not finished is left out.
    design = dataclasses.asdict(script.SECOND) | {"seeds": [0, 1, 2, 3, 4, 5, 6]}
    cells = [
        {
            "arm": arm,
            "seed": s,
            script.PRIMARY: 1.0 + 0.01 * (arm == "trust_region"),
            "human_nll": 2.0 - 0.2 * (arm == "trust_region"),
        }
        for s in range(6)
        for arm in ("student", "trust_region")
    ] + [{"arm": "student", "seed": 6, script.PRIMARY: 9.0, "human_nll": 9.0}]
    result = script.analyse(cells, design)
    assert result["seeds_complete"] == [0, 1, 2, 3, 4, 5]
    verdict = result["verdicts"]["trust_region"]
    assert verdict["helps"] and verdict["superiority_human_nll"]["mean"] == pytest.approx(0.2)
    assert script.SECOND.anneal_rounds * 2 == script.SECOND.rounds  # ε reaches 0 half-way, as published
    # The teacher's held-out end rate: a sample shorter than the cap ended, one at the cap was cut.
    references = {"teacher_samples": [[[5, 2]], [[5, 5, 5, 5]], [[5, 5, 5, 2]], [[2]]]}
    assert script.teacher_end_rate(references, 4) == pytest.approx(0.5)
