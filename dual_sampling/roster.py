"""The models of a run by name, and the record schema that follows from them.

Every generated token is recorded with the weight of each teacher, the log-probability of each model and log q; a
sample adds the sums of those and one log importance weight per model. Those column names are derived here, from
the roster, and from nowhere else: the shared-memory records (``lockstep.layout.RECORD_FIELDS``), a sample's record
(:class:`~dual_sampling.records.SampleRecord`), a beam's, a data run's JSONL/Parquet record
(``datagen.schema.Record``) and the server's payload follow it (``tests/test_roster.py`` holds each declaration to
it). The two-model roster :data:`PAIR` gives today's names, so old runs resume and old files read:

    alpha, logp_teacher, logp_theta, logq; sum_alpha, ..., sum_logq; log_w_theta, log_w_teacher

Convention: α is a teacher's weight. With one teacher its column is ``alpha``; with several, ``alpha_<name>`` per
teacher, in roster order, and q ∝ π_θ^(1−Σα)·Π π_i^α_i.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["PAIR", "THETA", "TOKEN_COLUMNS", "Role", "Roster", "token_column_count"]

THETA = "theta"
"""The student's name in every roster: the model whose π_θ the importance weights w = π_θ/q refer to."""


@dataclass(frozen=True)
class Roster:
    """The models of a run, by name: the one that decides first (its engine leads), then the ones that follow
    (:meth:`of_teachers` builds a run's)."""

    names: tuple[str, ...]
    """Model names, unique, each a Python identifier (they name record columns); :data:`THETA` among them."""

    def __post_init__(self) -> None:
        names = self.names
        if not isinstance(names, tuple) or len(names) < 2:
            raise ValueError(f"names must be a tuple of at least two model names, got {names!r}")
        for name in names:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"names: {name!r} is not a model name (a Python identifier)")
        if len(set(names)) != len(names):
            raise ValueError(f"names must be unique, got {names!r}")
        if THETA not in names:
            raise ValueError(f"names must include {THETA!r} (the student), got {names!r}")

    @classmethod
    def of_teachers(cls, teachers: Sequence[str] | None) -> Roster:
        """The roster of a run: :data:`PAIR` for one unnamed teacher (None), else θ, then the named ``teachers`` in
        order. With several teachers θ's engine leads: θ takes part in every mixture, so a request that names some
        teachers only (``generate(..., teachers=...)``) leaves every other engine idle."""
        if teachers is None:
            return PAIR
        return cls((THETA, *teachers))

    @property
    def student(self) -> str:
        """The model the importance weights w = π_θ/q refer to: :data:`THETA`."""
        return THETA

    def position(self, name: str) -> int:
        """The roster position of the model named ``name`` (0 leads); ValueError naming the roster otherwise."""
        if name not in self.names:
            raise ValueError(f"{name!r} is not a model of the roster {self.names}")
        return self.names.index(name)

    @property
    def teachers(self) -> tuple[str, ...]:
        """Every model but θ, in roster order: each has a weight α."""
        return tuple(n for n in self.names if n != THETA)

    def per_teacher(self, field: str, value: Any) -> dict[str, Any]:
        """A teacher setting ``field`` of every front end as ``{teacher: value}``, in roster order: one value (not a
        mapping) goes to every teacher; a mapping names some teachers (a teacher it leaves out gets None), and only a
        roster of several teachers takes one. ValueError naming ``field`` otherwise; the values are the caller's to
        check."""
        teachers = self.teachers
        if not isinstance(value, Mapping):
            return dict.fromkeys(teachers, value)
        if not value:
            raise ValueError(f"{field}: an empty mapping names no teacher; leave it out for none")
        if len(teachers) == 1:
            raise ValueError(f"{field}: a value per teacher name needs several teachers")
        unknown = sorted(map(str, set(value) - set(teachers)))
        if unknown:
            raise ValueError(f"{field}: {', '.join(map(repr, unknown))} names no teacher here ({', '.join(teachers)})")
        return {t: value.get(t) for t in teachers}

    @property
    def prompt_columns(self) -> tuple[str, ...]:
        """Each model's prompt (``<name>_prompt``), in roster order."""
        return tuple(f"{n}_prompt" for n in self.names)

    @property
    def alpha_columns(self) -> tuple[str, ...]:
        """Per-token α columns: ``alpha`` for one teacher, else ``alpha_<teacher>`` per teacher."""
        teachers = self.teachers
        return ("alpha",) if len(teachers) == 1 else tuple(f"alpha_{t}" for t in teachers)

    @property
    def token_columns(self) -> tuple[str, ...]:
        """The per-token record columns, in order: α per teacher, log π of each model (``logp_<name>``), log q."""
        return (*self.alpha_columns, *(f"logp_{n}" for n in self.names), "logq")

    @property
    def sum_columns(self) -> tuple[str, ...]:
        """A sample's sums of its token columns (``sum_<column>``), in their order."""
        return tuple(f"sum_{c}" for c in self.token_columns)

    @property
    def weight_columns(self) -> tuple[str, ...]:
        """A sample's log importance weights, Σ (log π_<name> − log q): θ's first, then each teacher's."""
        return tuple(f"log_w_{n}" for n in (THETA, *self.teachers))


def token_column_count(models: int) -> int:
    """Per-token record columns of any roster of ``models`` models: α per teacher (one column for one teacher), log π
    per model, log q."""
    teachers = models - 1
    return (1 if teachers == 1 else teachers) + models + 1


PAIR = Roster(("teacher", THETA))
"""The two-model roster of every run today: the teacher decides, θ follows."""

TOKEN_COLUMNS = PAIR.token_columns
"""The per-token record columns of :data:`PAIR`: ``("alpha", "logp_teacher", "logp_theta", "logq")``."""


class Role(str, Enum):
    """The two models of :data:`PAIR` as the two-model front door names them; equal to (and printed as) their names,
    "teacher" and "theta", the form records, routes and JSON use. Below the front door, models are roster positions."""

    TEACHER = "teacher"
    THETA = "theta"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__  # f"{role}" is its name on every Python version

    @classmethod
    def parse(cls, value: object, name: str = "role") -> Role:
        """``value`` as a Role; ValueError naming ``name`` for anything else."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{name} must be 'teacher' or 'theta', got {value!r}") from None

    def pick(self, teacher: T, theta: T) -> T:
        """``teacher`` for the teacher, ``theta`` for theta (the one place a per-role pair of values is split)."""
        return teacher if self is Role.TEACHER else theta
