"""The sampler–trainer check: do the records' log π_θ come from the model being trained?

Every record carries log π_θ of its token as the theta engine computed it. A trainer that recomputes those
log-probabilities with its own copy of θ (the same weights the engine was given) must find the same numbers up to
float32 rounding. A larger gap means the engine sampled from another model than the one trained: an update that was
not applied, or applied in part (a tied output projection left stale was one such bug), or a dtype or kernel that
changes the distribution. RL frameworks call this the training–inference mismatch; here it is checked every round
(:class:`dual_sampling.distill.loop.Distiller`) and offered to anyone holding records and a transformers model
(:func:`sampler_trainer_mismatch`).

Units: nats per token, |log π_θ(trainer) − log π_θ(record)|, over the untempered distribution on the shared
vocabulary (the records' convention).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Mismatch", "SamplerMismatchError", "record_gaps", "sampler_trainer_mismatch"]


@dataclass(frozen=True)
class Mismatch:
    """How far a trainer's log π_θ is from the recorded one, over ``tokens`` tokens (nats)."""

    mean_abs: float
    """Mean of |Δ log π_θ| per token."""
    max_abs: float
    """Largest |Δ log π_θ| of any token."""
    tokens: int
    """Tokens compared."""

    @classmethod
    def of(cls, gaps: Sequence[torch.Tensor]) -> Mismatch:
        """From per-sample gap tensors (see :func:`record_gaps`); all zero for none."""
        flat = torch.cat([g.flatten() for g in gaps]) if gaps else torch.zeros(0, dtype=torch.float64)
        if not flat.numel():
            return cls(0.0, 0.0, 0)
        return cls(float(flat.mean()), float(flat.max()), int(flat.numel()))


class SamplerMismatchError(RuntimeError):
    """The records' log π_θ are not the trained model's: the engine sampled from another θ."""

    def __init__(self, message: str, mismatch: Mismatch) -> None:
        super().__init__(message)
        self.mismatch = mismatch
        """The figures that failed the check."""


def record_gaps(logits: torch.Tensor, token_ids: Sequence[int], recorded_logp_theta: Sequence[float]) -> torch.Tensor:
    """|log_softmax(logits)[t, token_t] − recorded_t| per token, float64 ``[T]``.

    ``logits`` ``[T, V]`` are the trainer's logits at the positions that predicted each generated token, cut to the
    shared vocabulary (the records' convention); any dtype, any autograd state (the gaps are detached).
    """
    with torch.no_grad():
        logp = torch.log_softmax(logits.detach().double(), dim=-1)
        own = logp.gather(-1, torch.as_tensor(list(token_ids), device=logp.device).unsqueeze(-1)).squeeze(-1)
        recorded = torch.as_tensor(list(recorded_logp_theta), dtype=torch.float64, device=logp.device)
        return (own - recorded).abs().cpu()


def sampler_trainer_mismatch(model: Any, requests: Iterable[Any], vocab: int | None = None) -> Mismatch:
    """The mismatch between ``model`` (a transformers causal LM holding θ) and the log π_θ of ``requests``.

    ``requests`` are :class:`~dual_sampling.records.RequestRecord` (``generate()``'s ``.requests``); each completed
    sample is scored teacher-forced after its request's theta prompt. ``vocab`` is the shared vocabulary the records
    use (``OptimalSamplingDual.vocab``; default: the model's whole output). The model is run in evaluation mode under
    ``torch.no_grad`` and left as it was found.
    """
    was_training = model.training
    model.eval()
    gaps = []
    try:
        with torch.no_grad():
            for request in requests:
                prompt = list(request.theta_prompt_token_ids)
                for sample in request.samples:
                    if sample.error is not None or not len(sample.token_ids):
                        continue
                    tokens = list(sample.token_ids)
                    ids = torch.tensor([prompt + tokens], device=model.device)
                    logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
                    if vocab is not None:
                        logits = logits[:, :vocab]
                    gaps.append(record_gaps(logits, tokens, sample.logp_theta))
    finally:
        model.train(was_training)
    return Mismatch.of(gaps)
