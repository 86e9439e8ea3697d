"""min_tokens: a sample cannot end before it has generated this many tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from dual_sampling.checks import is_int, require
from dual_sampling.decision.stages.base import Stage, StageBatch

__all__ = ["MinTokens", "MinTokensSettings"]


@dataclass(kw_only=True)
class MinTokensSettings:
    min_tokens: int = 0
    """Generated tokens before any stop token or stop string may end a sample."""


class MinTokens(Stage):
    """Remove the row's stop tokens (its EOS ids and stop_token_ids) while fewer than min_tokens were generated."""

    order = 20
    settings = MinTokensSettings
    fused_on = frozenset({"cpu", "cuda"})  # both kernels mask each row's stop ids before min_tokens

    def check(self, options: Any) -> None:
        require(
            is_int(options.min_tokens) and 0 <= options.min_tokens <= options.max_tokens,
            f"min_tokens must be an integer in [0, max_tokens={options.max_tokens}], got {options.min_tokens!r}",
        )

    def used(self, row: Any) -> bool:
        return row.min_tokens > 0 and bool(row.stop_token_ids)

    def apply(self, x: Tensor, batch: StageBatch) -> None:
        vocab = x.shape[-1]
        for i, (r, s) in enumerate(zip(batch.rows, batch.steps)):
            if s < r.min_tokens and r.stop_token_ids:
                x[i, [t for t in r.stop_token_ids if t < vocab]] = -math.inf
