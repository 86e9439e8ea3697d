"""Diversity within a group: the n samples of one prompt, decided in order at each step, each penalised for the
tokens the earlier ones took."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dual_sampling.checks import is_number, require
from dual_sampling.decision.stages.base import Stage, StageBatch

__all__ = ["Diversity", "DiversitySettings"]


@dataclass(kw_only=True)
class DiversitySettings:
    diversity_penalty: float = 0.0
    """With n > 1: the samples of one prompt are decided in order at each step, and each draws from
    q(y)·exp(−λ·c(y)), c(y) counting the earlier samples that took y at that step (λ ≥ 0; 0 is off); named as
    transformers names it for group beam search."""


class Diversity(Stage):
    """Divide q by exp(λ·c(y)) for the tokens the earlier members of the row's group took at this step (last: it acts
    on the distribution the member would otherwise draw from, tempered and filtered)."""

    order = 70
    settings = DiversitySettings
    fused_on = frozenset({"cpu", "cuda"})  # a sparse edit after α, as the penalties

    def check(self, options: Any) -> None:
        v = options.diversity_penalty
        require(is_number(v) and v >= 0, f"diversity_penalty must be a finite number >= 0, got {v!r}")

    def used(self, row: Any) -> bool:
        # Only in a group (RowSampling.diverse): a sample alone draws from q itself.
        return row.diversity_penalty > 0.0 and getattr(row, "group", 0) != 0

    def apply(self, x: Tensor, batch: StageBatch) -> None:
        if batch.diversity is None:
            return  # no earlier member took a token at this step
        vocab = x.shape[-1]
        for i, row in enumerate(batch.rows):
            taken = {t: c for t, c in batch.diversity[i].items() if 0 <= t < vocab}
            if self.used(row) and taken:
                index = torch.tensor(list(taken), device=x.device)
                counts = torch.tensor(list(taken.values()), device=x.device, dtype=x.dtype)
                x[i, index] -= row.diversity_penalty * counts
