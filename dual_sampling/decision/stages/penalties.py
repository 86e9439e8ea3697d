"""vLLM's repetition, frequency and presence penalties, on the mixture's logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dual_sampling.checks import is_number, require
from dual_sampling.decision.stages.base import Stage, StageBatch

__all__ = ["MAX_PENALTY", "Penalties", "PenaltySettings", "penalised_logits", "penalised_tokens"]

MAX_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [−this, this], as vLLM (and OpenAI's API) bound them."""


@dataclass(kw_only=True)
class PenaltySettings:
    repetition_penalty: float = 1.0
    """Applied to the mixture's logit z of every token in the prompt (theta's) or the output so far, as vLLM applies
    it to one model's: z/p where z > 0, z·p otherwise; > 0, 1 is off."""
    presence_penalty: float = 0.0
    """Subtracted from the mixture's logit of every token the output holds already, in [−2, 2]; 0 is off."""
    frequency_penalty: float = 0.0
    """Subtracted from the mixture's logit of each token once per time the output holds it, in [−2, 2]; 0 is off."""


class Penalties(Stage):
    """vLLM's repetition, frequency and presence penalties on the mixture's logits z = log q + offset (vLLM's order:
    repetition over the prompt's and the output's tokens, then frequency and presence over the output's).

    At α = 0 z is theta's raw logit row and this is vLLM's penalised sampling of theta; at α = 1, the teacher's. The
    prompt is theta's (``RowSampling.prompt_token_ids``): the sample's own context, not a teacher hint's. Only the
    tokens seen change: a sparse edit of each row.
    """

    order = 40
    settings = PenaltySettings
    fused_on = frozenset({"cpu", "cuda"})  # a sparse edit after α (decision.edits), in both kernels

    def check(self, options: Any) -> None:
        p = options.repetition_penalty
        require(is_number(p) and p > 0, f"repetition_penalty must be a finite number > 0, got {p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(options, name)
            require(
                is_number(v) and -MAX_PENALTY <= v <= MAX_PENALTY,
                f"{name} must lie in [{-MAX_PENALTY}, {MAX_PENALTY}], got {v!r}",
            )

    def used(self, row: Any) -> bool:
        return row.repetition_penalty != 1.0 or row.presence_penalty != 0.0 or row.frequency_penalty != 0.0

    def needs_prompt(self, row: Any) -> bool:
        return row.repetition_penalty != 1.0

    def needs_logit_offset(self, row: Any) -> bool:
        return row.repetition_penalty != 1.0  # z's sign decides which way it acts

    def apply(self, x: Tensor, batch: StageBatch) -> None:
        if batch.outputs is None:
            raise ValueError("penalties need each row's generated tokens (StageBatch.outputs)")
        vocab = x.shape[-1]
        for i, row in enumerate(batch.rows):
            if not self.used(row):
                continue
            ids, counts = penalised_tokens(row.prompt_token_ids, batch.outputs[i], vocab)
            if ids.size == 0:
                continue
            offset = 0.0
            if self.needs_logit_offset(row):
                if batch.logit_offset is None:
                    raise ValueError("the repetition penalty needs the rows' log-normalisers (StageBatch.logit_offset)")
                offset = float(batch.logit_offset[i])
            index = torch.from_numpy(ids).to(x.device)
            z = x[i, index].double() + offset
            z = penalised_logits(z, torch.from_numpy(counts).to(x.device), row)
            x[i, index] = (z - offset).to(x.dtype)


def penalised_tokens(prompt: Sequence[int], output: Sequence[int], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64, counts float64) of the tokens a penalty touches: the distinct ids of ``prompt`` and ``output``
    below ``vocab``, ascending, and how often the output holds each (0 for a prompt's token alone)."""
    out = np.asarray(output, dtype=np.int64)
    ids, counts = np.unique(out[(out >= 0) & (out < vocab)], return_counts=True)
    pr = np.asarray(prompt, dtype=np.int64)
    pr = np.setdiff1d(pr[(pr >= 0) & (pr < vocab)], ids)
    every = np.concatenate([ids, pr])
    order = np.argsort(every, kind="stable")
    counts = np.concatenate([counts.astype(np.float64), np.zeros(pr.size)])
    return every[order], counts[order]


def penalised_logits(z: Tensor, counts: Tensor, row: Any) -> Tensor:
    """vLLM's penalties on the logits ``z`` of the touched tokens (every one seen in the prompt or output;
    ``counts``: times in the output), in ``z``'s dtype: repetition, then frequency, then presence."""
    p = row.repetition_penalty
    if p != 1.0:
        z = torch.where(z > 0, z / p, z * p)
    return z - row.frequency_penalty * counts - row.presence_penalty * (counts > 0).to(z.dtype)
