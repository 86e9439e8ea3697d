"""Temperature: log q divided by it (0 is greedy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dual_sampling.checks import is_number, require
from dual_sampling.decision.stages.base import Stage, StageBatch, column

__all__ = ["MAX_TEMPERATURE", "MIN_TEMPERATURE", "Temperature", "TemperatureSettings"]

MIN_TEMPERATURE = 1e-2
"""The smallest non-zero temperature: below it the tempered log q overflows float32 (0 is greedy)."""
MAX_TEMPERATURE = 100.0
"""The largest temperature: past it q is uniform over the kept tokens to float32 precision."""


@dataclass(kw_only=True)
class TemperatureSettings:
    temperature: float = 1.0
    """Divides log q before the draw; 0 is greedy (the mode of q), otherwise in [0.01, 100]."""


class Temperature(Stage):
    """Divide log q by the temperature (greedy rows, temperature 0, are left as they are: the draw takes their
    mode)."""

    order = 50
    settings = TemperatureSettings

    def check(self, options: Any) -> None:
        t = options.temperature
        require(
            is_number(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE),
            f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {t!r}",
        )

    def used(self, row: Any) -> bool:
        return row.temperature != 1.0

    def apply(self, x: Tensor, batch: StageBatch) -> None:
        temps = column(batch, "temperature", x, x.dtype)
        x.div_(torch.where(temps == 0, torch.ones_like(temps), temps).unsqueeze(-1))
