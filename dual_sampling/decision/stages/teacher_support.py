"""Teacher support: q restricted to the teacher's own top-k / top-p set (a constraint only a mixture has, so it runs
first)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from dual_sampling.checks import MAX_COUNT, is_count, is_number, require
from dual_sampling.decision.stages.base import Stage, StageBatch, column, keep_top_k_top_p

__all__ = ["TeacherSupport", "TeacherSupportSettings"]


@dataclass(kw_only=True)
class TeacherSupportSettings:
    teacher_support_top_k: int = -1
    """Restrict q to the teacher's k most likely tokens; -1 is off."""
    teacher_support_top_p: float = 1.0
    """Restrict q to the teacher's top-p set, in (0, 1]; 1 is off."""


class TeacherSupport(Stage):
    """Remove the tokens outside the teacher's top-k / top-p set (of the untempered π_t)."""

    order = 10
    settings = TeacherSupportSettings
    several_teachers = False  # with several teachers there is no one set to restrict q to

    def check(self, options: Any) -> None:
        require(
            options.teacher_support_top_k == -1 or is_count(options.teacher_support_top_k, 1),
            f"teacher_support_top_k must be -1 (off) or an integer in [1, {MAX_COUNT}], "
            f"got {options.teacher_support_top_k!r}",
        )
        require(
            is_number(options.teacher_support_top_p) and 0 < options.teacher_support_top_p <= 1,
            f"teacher_support_top_p must lie in (0, 1], got {options.teacher_support_top_p!r}",
        )

    def used(self, row: Any) -> bool:
        return row.teacher_support_top_k > 0 or row.teacher_support_top_p < 1.0

    def apply(self, x: Tensor, batch: StageBatch) -> None:
        keep = keep_top_k_top_p(
            batch.logp_teacher,
            column(batch, "teacher_support_top_k", x),
            column(batch, "teacher_support_top_p", x, x.dtype),
        )
        if keep is not None:
            x.masked_fill_(~keep, -math.inf)
