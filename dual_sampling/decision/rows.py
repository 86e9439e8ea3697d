"""One decoding step's rows of every model of a roster: what the decision reads, as one object.

The decision (:func:`dual_sampling.decision.pipeline.decide`) takes a :class:`ModelRows`, not a positional pair: the
roster (``dual_sampling.roster``) names the models, so the same call serves one teacher and several. Each model's
rows are ``[b, V]`` over the shared tokenizer's vocabulary (embedding rows beyond it already cut off), in roster
order. θ's rows may arrive normalised: θ's engine takes its log-softmax on its own cores while the teacher waits,
and then sends the log-normalisers the repetition penalty needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from dual_sampling.roster import PAIR, THETA, Roster

__all__ = ["ModelRows"]


@dataclass(frozen=True)
class ModelRows:
    """Each model's logits at one step, ``[b, V]`` per model, in :attr:`roster` order."""

    logits: tuple[Tensor, ...]
    """One ``[b, V]`` tensor per model of the roster, in its order; one shape and device for all."""
    roster: Roster = PAIR
    """The models' names; :data:`~dual_sampling.roster.THETA` among them, every other one a teacher."""
    theta_normalized: bool = False
    """θ's rows are log-softmax outputs already (its engine normalised them)."""
    theta_log_normalisers: Tensor | None = None
    """``[b]``: log Σ exp of θ's raw logits, where :attr:`theta_normalized` (the repetition penalty reads them)."""
    teacher_log_normalisers: tuple[Tensor | None, ...] = ()
    """Per teacher (:attr:`Roster.teachers` order), ``[b]`` log Σ exp of its raw logits where its rows arrive
    normalised (its engine follows: several teachers), for the repetition penalty; empty, or None for a teacher
    whose rows are its raw logits (the leader's)."""

    def __post_init__(self) -> None:
        if not isinstance(self.logits, tuple) or len(self.logits) != len(self.roster.names):
            raise ValueError(
                f"logits must be a tuple of one tensor per model of the roster {self.roster.names}, "
                f"got {type(self.logits).__name__} of {len(self.logits)}"
            )
        shape, device = self.logits[0].shape, self.logits[0].device
        for name, rows in zip(self.roster.names, self.logits, strict=True):
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
        """The two-model rows of :data:`~dual_sampling.roster.PAIR`: the teacher's, then θ's."""
        return cls((teacher_logits, theta_logits), PAIR, theta_normalized, theta_log_normalisers)

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

    @property
    def theta(self) -> Tensor:
        return self[THETA]

    @property
    def teachers(self) -> tuple[Tensor, ...]:
        """The teachers' rows, in roster order."""
        return tuple(self[name] for name in self.roster.teachers)

    @property
    def teacher(self) -> Tensor:
        """The one teacher's rows; ValueError where the roster has several (their code paths take :attr:`teachers`)."""
        teachers = self.roster.teachers
        if len(teachers) != 1:
            raise ValueError(f"this path serves one teacher; the roster has {len(teachers)}: {teachers}")
        return self[teachers[0]]

    def take(self, index: Tensor) -> ModelRows:
        """The rows at ``index`` (a 1-D int64 tensor) of every model."""
        on = index.to(self.device)

        def rows_of(normalisers: Tensor | None) -> Tensor | None:
            return None if normalisers is None else normalisers[index.to(normalisers.device)]

        return ModelRows(
            tuple(rows[on] for rows in self.logits),
            self.roster,
            self.theta_normalized,
            rows_of(self.theta_log_normalisers),
            tuple(rows_of(n) for n in self.teacher_log_normalisers),
        )
