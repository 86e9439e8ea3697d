"""top-k, top-p and min-p: filters of the tempered q."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from dual_sampling.checks import MAX_COUNT, is_count, is_number, require
from dual_sampling.decision.stages.base import Stage, StageBatch, column, keep_top_k_top_p

__all__ = ["FilterSettings", "Filters"]


@dataclass(kw_only=True)
class FilterSettings:
    top_p: float = 1.0
    """Nucleus filter on the tempered q, in (0, 1]; 1 is off."""
    top_k: int = -1
    """Keep the k most likely tokens of q; -1 is off."""
    min_p: float = 0.0
    """Drop tokens below min_p times the most likely token's probability, in [0, 1]; 0 is off."""


class Filters(Stage):
    """Keep the tempered q's top-k, top-p and min-p sets (the most likely token always stays)."""

    order = 60
    settings = FilterSettings

    def check(self, options: Any) -> None:
        require(is_number(options.top_p) and 0 < options.top_p <= 1, f"top_p must lie in (0, 1], got {options.top_p!r}")
        require(
            options.top_k == -1 or is_count(options.top_k, 1),
            f"top_k must be -1 (off) or an integer in [1, {MAX_COUNT}], got {options.top_k!r}",
        )
        require(
            is_number(options.min_p) and 0 <= options.min_p <= 1, f"min_p must lie in [0, 1], got {options.min_p!r}"
        )

    def used(self, row: Any) -> bool:
        return row.top_k > 0 or row.top_p < 1.0 or row.min_p > 0.0

    def apply(self, x: Tensor, batch: StageBatch) -> None:
        keep = keep_top_k_top_p(
            x, column(batch, "top_k", x), column(batch, "top_p", x, x.dtype), column(batch, "min_p", x, x.dtype)
        )
        if keep is not None:
            x.masked_fill_(~keep, -math.inf)
