"""Held-out metrics of a student against its teacher, in plain transformers (the independent side of the loop).

- KL(π_t ‖ π_θ) and KL(π_θ ‖ π_t) per token, exact sums over the vocabulary in float64, on teacher-forced
  reference sequences (the teacher's greedy answers to the held-out prompts, fixed for a run);
- the teacher's mean log-likelihood per token of the student's greedy answers;
- the repetition rate of those answers: the share of their 4-grams that already occurred earlier in the answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "EvalSet",
    "build_eval_set",
    "distinct_n",
    "evaluate",
    "greedy",
    "repetition_rate",
    "sequence_divergences",
]


@dataclass
class EvalSet:
    """The held-out prompts (token ids, theta's rendering), the teacher's greedy answer to each, and the token ids
    that end an answer."""

    prompts: list[list[int]]
    references: list[list[int]]
    eos_ids: list[int]


def greedy(model: Any, prompts: Sequence[Sequence[int]], max_tokens: int, eos_ids: Sequence[int]) -> list[list[int]]:
    """Each prompt's greedy continuation (at most ``max_tokens``, ending at and without an EOS id)."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=list(eos_ids),
                pad_token_id=eos_ids[0],
            )[0, len(prompt) :].tolist()
        end = next((i for i, t in enumerate(gen) if t in eos_ids), len(gen))
        out.append(gen[:end])
    return out


def build_eval_set(teacher: Any, prompts: Sequence[Sequence[int]], max_tokens: int, eos_ids: Sequence[int]) -> EvalSet:
    return EvalSet([list(p) for p in prompts], greedy(teacher, prompts, max_tokens, eos_ids), sorted(eos_ids))


def _forced_logp(model: Any, prompt: Sequence[int], tokens: Sequence[int], vocab: int) -> torch.Tensor:
    """log-softmax rows ``[len(tokens), vocab]`` float64 predicting each of ``tokens`` after ``prompt``."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens), :vocab]
    return torch.log_softmax(logits.double(), -1)


def repetition_rate(tokens: Sequence[int], n: int = 4) -> float:
    """The share of the n-grams of ``tokens`` that occurred earlier in it (0 for fewer than n + 1 tokens)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if len(grams) < 2:
        return 0.0
    seen, repeats = set(), 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams)


def distinct_n(tokens: Sequence[int], n: int = 2) -> float:
    """The share of the n-grams of ``tokens`` that are distinct (1 when none repeats; nan for fewer than n tokens)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else math.nan


def sequence_divergences(
    student: Any, teacher: Any, prompt: Sequence[int], tokens: Sequence[int], vocab: int
) -> dict[str, float]:
    """Per-token sums over one sequence, each an exact sum over the vocabulary in float64 at every position of
    ``tokens`` after ``prompt`` (both models forced on the same ids): ``kl_student_teacher`` Σ KL(π_θ‖π_t),
    ``kl_teacher_student`` Σ KL(π_t‖π_θ), ``student_entropy`` Σ H(π_θ), ``teacher_entropy`` Σ H(π_t), and
    ``tokens``. Divide by ``tokens`` for per-token figures; sums add across sequences."""
    if not tokens:
        return dict.fromkeys(
            ("kl_student_teacher", "kl_teacher_student", "student_entropy", "teacher_entropy"), 0.0
        ) | {"tokens": 0}
    was_training = student.training
    student.eval()
    try:
        ls = _forced_logp(student, prompt, tokens, vocab)
        lt = _forced_logp(teacher, prompt, tokens, vocab)
    finally:
        student.train(was_training)
    ps, pt = ls.exp(), lt.exp()
    return {
        "kl_student_teacher": float((ps * (ls - lt)).sum()),
        "kl_teacher_student": float((pt * (lt - ls)).sum()),
        "student_entropy": float(-(ps * ls).sum()),
        "teacher_entropy": float(-(pt * lt).sum()),
        "tokens": len(tokens),
    }


def evaluate(student: Any, teacher: Any, eval_set: EvalSet, vocab: int, max_tokens: int) -> dict[str, float]:
    """The held-out metrics (see the module docstring); every mean is over tokens, pooled across prompts."""
    was_training = student.training
    student.eval()
    try:
        kl_ts = kl_st = 0.0
        n = 0
        for prompt, ref in zip(eval_set.prompts, eval_set.references):
            if not ref:
                continue
            lt = _forced_logp(teacher, prompt, ref, vocab)
            ls = _forced_logp(student, prompt, ref, vocab)
            kl_ts += float((lt.exp() * (lt - ls)).sum())
            kl_st += float((ls.exp() * (ls - lt)).sum())
            n += len(ref)
        answers = greedy(student, eval_set.prompts, max_tokens, eval_set.eos_ids)
        ll, m = 0.0, 0
        for prompt, answer in zip(eval_set.prompts, answers):
            if answer:
                lt = _forced_logp(teacher, prompt, answer, vocab)
                ll += float(lt.gather(1, torch.tensor(answer).unsqueeze(1)).sum())
                m += len(answer)
        return {
            "kl_teacher_student": kl_ts / n if n else math.nan,
            "kl_student_teacher": kl_st / n if n else math.nan,
            "teacher_logp_of_greedy": ll / m if m else math.nan,
            "repetition_rate": sum(map(repetition_rate, answers)) / len(answers) if answers else math.nan,
            "greedy_tokens": sum(map(len, answers)) / len(answers) if answers else math.nan,
        }
    finally:
        student.train(was_training)
