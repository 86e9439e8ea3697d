"""logit_bias: a per-token additive bias on log q, clamped as vLLM clamps it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dual_sampling.checks import MAX_COUNT, is_count, is_number, require
from dual_sampling.decision.stages.base import Stage, StageBatch

__all__ = ["LOGIT_BIAS_LIMIT", "LogitBias", "LogitBiasSettings", "clamped_logit_bias"]

LOGIT_BIAS_LIMIT = 100.0
"""logit_bias values are clamped to ±this, as vLLM clamps them."""


@dataclass(kw_only=True)
class LogitBiasSettings:
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to log q per token id before temperature; clamped to ±100 as in vLLM."""


def clamped_logit_bias(bias: dict) -> dict[int, float]:
    """``bias`` as {token id: float}, each value clamped to ±:data:`LOGIT_BIAS_LIMIT` as vLLM clamps it (a bias of
    1e39 would be inf in float32, and q would then hold NaN); ValueError for a NaN."""
    out = {}
    for token, value in bias.items():
        if math.isnan(value):
            raise ValueError(f"logit_bias[{token}] is NaN")
        out[int(token)] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
    return out


class LogitBias(Stage):
    """Add each row's logit_bias to log q at its token ids."""

    order = 30
    settings = LogitBiasSettings

    def check(self, options: Any) -> None:
        for token, bias in options.logit_bias.items():
            require(is_count(token, 0), f"logit_bias keys must be token ids in [0, {MAX_COUNT}], got {token!r}")
            require(is_number(bias), f"logit_bias for token {token} must be a finite number, got {bias!r}")
        options.logit_bias = clamped_logit_bias(options.logit_bias)  # what the rows apply is what the options say

    def used(self, row: Any) -> bool:
        return bool(row.logit_bias)

    def apply(self, x: Tensor, batch: StageBatch) -> None:
        for i, r in enumerate(batch.rows):
            if r.logit_bias:
                ids = torch.tensor(list(r.logit_bias), device=x.device)
                x[i, ids] += torch.tensor(list(r.logit_bias.values()), device=x.device, dtype=x.dtype)
