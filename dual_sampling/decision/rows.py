"""One decoding step's rows of every model of a roster: what the decision reads, as one object.

The decision (:func:`dual_sampling.decision.pipeline.decide`) takes a :class:`ModelRows`, not a positional pair: the
roster (``dual_sampling.roster``) names the models, so the same call serves one teacher and several. Each model's
rows are ``[b, V]`` over the shared tokenizer's vocabulary (embedding rows beyond it already cut off), in roster
order. A follower's rows may arrive normalised: its engine takes its log-softmax on its own cores while the leader
waits, and then sends the log-normalisers the repetition penalty needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dual_sampling.roster import PAIR, Roster

__all__ = ["ModelRows"]


@dataclass(frozen=True)
class ModelRows:
    """Each model's logits at one step, ``[b, V]`` per model, in :attr:`roster` order."""

    logits: tuple[Tensor, ...]
    """One ``[b, V]`` tensor per model of the roster, in its order; one shape and device for all."""
    roster: Roster = PAIR
    """The models' names; :data:`~dual_sampling.roster.THETA` among them, every other one a teacher."""
    normalized: tuple[bool, ...] = ()
    """Per model, in roster order: its rows are log-softmax outputs already (a follower's engine normalised them on
    its own cores while the leader waited). Empty: every model's rows are its raw logits."""
    log_normalisers: tuple[Tensor | None, ...] = ()
    """Per model, in roster order: ``[b]`` log Σ exp of its raw logits, where its rows arrive normalised and a
    repetition penalty needs them (it acts on the mixture's raw logits); None where not sent; empty: none sent."""
    absent: Tensor | None = None
    """``[b, M]`` bool, in roster order: the models whose rows were not computed for a row (its request names some
    teachers only, ``DualRequest.teachers``). Their rows and log-normalisers are never read, and their teachers
    weigh 0; θ is never absent, nor is every teacher. None: every model computed every row."""

    def __post_init__(self) -> None:
        names = self.roster.names
        if not isinstance(self.logits, tuple) or len(self.logits) != len(names):
            raise ValueError(
                f"logits must be a tuple of one tensor per model of the roster {names}, "
                f"got {type(self.logits).__name__} of {len(self.logits)}"
            )
        for field in ("normalized", "log_normalisers"):
            given = getattr(self, field)
            if not isinstance(given, tuple) or len(given) not in (0, len(names)):
                raise ValueError(f"{field} must be a tuple of one entry per model of the roster {names}, got {given!r}")
        shape, device = self.logits[0].shape, self.logits[0].device
        if self.absent is not None:
            if self.absent.shape != (shape[0], len(names)) or self.absent.dtype != torch.bool:
                raise ValueError(f"absent must be a [b, M] = [{shape[0]}, {len(names)}] bool tensor")
            if bool(self.absent[:, self.student_position].any()):
                raise ValueError(f"absent: {self.roster.student} takes part in every row")
        for name, rows in zip(names, self.logits, strict=True):
            if not isinstance(rows, Tensor) or rows.dim() != 2:
                raise ValueError(f"logits of {name!r} must be a [b, V] tensor, got {getattr(rows, 'shape', rows)!r}")
            if rows.shape != shape or rows.device != device:
                raise ValueError(
                    f"logits of {name!r} have shape {tuple(rows.shape)} on {rows.device}; the roster's first model's "
                    f"are {tuple(shape)} on {device}: every model's rows must match"
                )

    @classmethod
    def pair(
        cls,
        teacher_logits: Tensor,
        theta_logits: Tensor,
        *,
        theta_normalized: bool = False,
        theta_log_normalisers: Tensor | None = None,
    ) -> ModelRows:
        """The two-model rows of :data:`~dual_sampling.roster.PAIR`: the teacher's (raw logits), then θ's."""
        return cls((teacher_logits, theta_logits), PAIR, (False, theta_normalized), (None, theta_log_normalisers))

    def __len__(self) -> int:
        return self.logits[0].shape[0]

    def __getitem__(self, name: str) -> Tensor:
        """The rows of the model named ``name``."""
        return self.logits[self.roster.names.index(name)]

    @property
    def vocab(self) -> int:
        return self.logits[0].shape[-1]

    @property
    def device(self):
        return self.logits[0].device

    def is_normalized(self, position: int) -> bool:
        """Whether the rows of the model at roster ``position`` are log-softmax outputs already."""
        return bool(self.normalized) and self.normalized[position]

    def log_normaliser(self, position: int) -> Tensor | None:
        """``[b]`` log Σ exp of the raw logits of the model at roster ``position``, where its rows arrive normalised
        and they were sent; None otherwise."""
        return self.log_normalisers[position] if self.log_normalisers else None

    @property
    def student_position(self) -> int:
        return self.roster.position(self.roster.student)

    @property
    def student(self) -> Tensor:
        """θ's rows (:attr:`Roster.student`)."""
        return self.logits[self.student_position]

    @property
    def teacher_positions(self) -> tuple[int, ...]:
        """The teachers' roster positions, in roster order."""
        return tuple(self.roster.position(name) for name in self.roster.teachers)

    @property
    def teachers(self) -> tuple[Tensor, ...]:
        """The teachers' rows, in roster order."""
        return tuple(self.logits[p] for p in self.teacher_positions)

    @property
    def teacher(self) -> Tensor:
        """The one teacher's rows; ValueError where the roster has several (their code paths take :attr:`teachers`)."""
        teachers = self.teachers
        if len(teachers) != 1:
            raise ValueError(f"this path serves one teacher; the roster has {len(teachers)}: {self.roster.teachers}")
        return teachers[0]

    def take(self, index: Tensor) -> ModelRows:
        """The rows at ``index`` (a 1-D int64 tensor) of every model."""
        on = index.to(self.device)

        def rows_of(normalisers: Tensor | None) -> Tensor | None:
            return None if normalisers is None else normalisers[index.to(normalisers.device)]

        return ModelRows(
            tuple(rows[on] for rows in self.logits),
            self.roster,
            self.normalized,
            tuple(rows_of(n) for n in self.log_normalisers),
            None if self.absent is None else self.absent[index.to(self.absent.device)],
        )

    @property
    def absent_teachers(self) -> Tensor | None:
        """``[b, K]`` bool: per row, the teachers (in roster order) whose rows were not computed; None if none."""
        if self.absent is None or not bool(self.absent.any()):
            return None
        return self.absent[:, list(self.teacher_positions)].to(self.device)
