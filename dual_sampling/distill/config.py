"""The configuration of an on-policy distillation run: :class:`DistillConfig`, which composes the
:class:`SamplingOptions` of each round's samples and the :class:`EngineOptions` of the dual engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from alpha import get_alpha_computer
from dual_sampling.checks import need_int, need_number
from dual_sampling.distill.loss import LOSSES, WEIGHTINGS
from dual_sampling.modes import mode_of, modes_with
from dual_sampling.options import RUNTIME_ONLY, EngineOptions, SamplingOptions
from dual_sampling.run_settings import (
    ModelsAndPrompts,
    compose_settings,
    identity_settings,
    runtime_only,
)

__all__ = ["TRAINER_DTYPES", "DistillConfig"]

TRAINER_DTYPES = ("float32", "bfloat16")
"""The trainer's compute dtypes (see ``DistillConfig.trainer_dtype``)."""


@dataclass
class DistillConfig:
    """One distillation run: each round samples from q with the current θ, trains θ on those samples, pushes the new
    weights into the theta engine and evaluates on held-out prompts.

    On the command line and in ``--config distill.yaml`` every field of this class and of the parts it composes
    (:class:`ModelsAndPrompts`, :class:`SamplingOptions`, :class:`EngineOptions`) is one flat key (``--rounds 8``,
    ``alpha_method: ess_balance``).
    """

    PART_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "source": {"prompt_field": "question"},
        "sampling": {"max_tokens": 128},
    }
    """This run's own defaults for fields of its parts (GSM8K-style rows; answers of a few sentences)."""

    prompts: str
    """Training problems: a .jsonl file with one object per line (its last ``eval_prompts`` rows are held out)."""
    output: str = field(metadata=RUNTIME_ONLY)
    """Run directory: metrics.jsonl, config.json, the held-out set, checkpoints/round-N/ and the plot."""
    eval_prompts: int = 16
    """Held-out problems (the file's last rows), never trained on."""
    eval_max_tokens: int = 64
    """Tokens of the teacher's reference answers and of the student's greedy answers on the held-out problems."""
    eval_every: int = 1
    """Compute the held-out metrics before round 1 and after every this many rounds and the last; 0 never (the
    teacher's reference answers are then not built, and the run loads no teacher model)."""
    rounds: int = 4
    """Sample-train-update rounds."""
    prompts_per_round: int = 16
    """Problems sampled per draw, at most (one sample each, n > 1 for more; under ``tokens_per_round`` a draw takes
    only as many as the remaining budget can use at max_tokens a sample); the file is walked in a seeded order,
    continued from round to round. A problem counts as used once a sample of it is trained on: the problems of a
    draw after the last one trained on are drawn again next, so runs of one seed whose samples differ in length
    (other α) train on the same problems in the same order (``prompts_used`` in metrics.jsonl)."""
    tokens_per_round: int = 0
    """0: each round trains on one draw of ``prompts_per_round`` problems. > 0: an equal budget of generated tokens:
    each round draws until its samples hold this many tokens, and the last sample is cut to its first tokens to meet
    the budget exactly (a prefix of a sample of q is a sample of q's prefixes)."""
    steps_per_round: int = 4
    """Optimizer steps per round; each takes an equal share of the round's samples."""
    learning_rate: float = 5e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient norm clip per step."""
    loss: str = "forward"
    """The divergence each recorded position is trained on (:data:`dual_sampling.distill.loss.LOSSES`): ``forward``,
    KL(π_t ‖ π_θ) on the teacher's top ``loss_top_k``; ``reverse``, KL(π_θ ‖ π_t) on both models' top ``loss_top_k``
    (the per-prefix loss of on-policy distillation), each with a bucket for the rest of the vocabulary;
    ``reverse_full``, KL(π_θ ‖ π_t) over the whole vocabulary with the teacher run in the trainer."""
    loss_teacher: str | None = None
    """With several teachers, the one whose log π the loss pulls θ towards (default: the first); the samples still
    come from the mixture of all, weighted by π_θ/q. One named teacher, not their geometric mixture: the records
    carry each teacher's top k, and a KL to the mixture needs its normalizer over the whole vocabulary, which no
    top k holds. None with one teacher."""
    weighting: str = "sequence_mean"
    """How importance weights π_θ/q enter the loss: none, token, sequence_mean or sequence (docs/theory.md)."""
    max_weight: float = 5.0
    """Clip of the self-normalised state weights (truncated importance sampling)."""
    loss_top_k: int = 64
    """Each model's top k per token, recorded while sampling with both models' log-probabilities: the forward KL
    runs on the teacher's, the reverse KL on both (their union), each plus a rest bucket."""
    max_sampler_mismatch: float = 0.05
    """Largest |log π_θ(trainer) − log π_θ(record)| allowed on the sampled tokens of each round's first optimizer
    batch (1/``steps_per_round`` of the samples, before any step; :mod:`dual_sampling.distill.mismatch`), in nats;
    above it the run stops with ``SamplerMismatchError``. A float32 engine and trainer differ by at most 7.4e-4 on the
    default pair (``examples/sampler_mismatch.py``, 337 tokens; 13.8 nats against the model before an update): 68
    times that passes. Where either side runs bfloat16, raise it to about 4: on that pair a bfloat16 engine against
    a float32 trainer differed by up to 1.9 nats (mean 0.09), a float32 engine against a bfloat16-autocast trainer by
    up to 1.5 (mean 0.09), while a missed update is off by up to 13.8 (mean 2.6; ``examples/sampler_mismatch.py
    --engine-dtype bfloat16``, ``--trainer-dtype bfloat16``); a smaller fault then passes the check, so compare
    ``sampler_mismatch_mean`` with those figures. ``inf`` lets every finite
    figure pass (a NaN still stops the run; the figures are reported either way). The trainer's figure is computed in
    training mode, as its loss is: a student with dropout would differ by its dropout, not by a stale θ."""
    trainer_device: str = field(default="cpu", metadata=RUNTIME_ONLY)
    """Where the student trains and the trainer's teacher runs (held-out metrics, ``reverse_full``): a torch device,
    "cpu", "cuda" or "cuda:N". It loads after the engines start, into what their weights and KV caches leave of a
    GPU they share (docs/gpu.md): the student, its gradients and two AdamW moments, 16 bytes a parameter in float32,
    and the teacher's weights."""
    trainer_dtype: str = "float32"
    """The trainer's compute dtype: "float32", or "bfloat16": forwards under bfloat16 autocast (on CUDA, its tensor
    cores), the weights and AdamW's state kept in float32. bfloat16 rounding moves the trainer's log π_θ off the
    float32 engine's records by up to 1.5 nats on the default pair: raise ``max_sampler_mismatch`` (see there)."""
    kl_budget_warmup_rounds: int = 0
    """With ``alpha_method: trust_region``: W, the rounds over which its ``kl_budget`` ε (of ``alpha_config``) falls
    linearly, as trust-region behaviour blending anneals it: round r samples with ε·max(0, 1 − (r − 1)/W), so round
    W samples with ε/W and the budget is 0 (pure student sampling) from round W + 1 on. A run of ``rounds`` ≤ W never
    reaches 0: give it more rounds than W to end on the student's own samples, as the published method does. Each
    round's ε is in metrics.jsonl (``kl_budget``). 0 keeps ε for every round."""
    resume: bool = field(default=False, metadata=RUNTIME_ONLY)
    """Continue the run in ``output`` from its last complete round (same settings; ``rounds`` may grow)."""
    plot: bool = field(default=True, metadata=RUNTIME_ONLY)
    """Write plot.png (held-out metrics against round and wall time) at the end; needs matplotlib."""
    source: ModelsAndPrompts = field(default_factory=lambda: ModelsAndPrompts(**DistillConfig.PART_DEFAULTS["source"]))
    """The teacher, the student to start from, and the prompts' fields (the held-out metrics use no hint)."""
    sampling: SamplingOptions = field(
        default_factory=lambda: SamplingOptions(**DistillConfig.PART_DEFAULTS["sampling"])
    )
    """How each round samples; ``dense_logprobs`` is set to ``loss_top_k`` for the losses that read the records' top k
    (a different value is refused) and left as given for ``reverse_full`` (0 unless set). Its fields are flat keys."""
    engine: EngineOptions = field(default_factory=EngineOptions)
    """How the dual engine runs; its fields are flat keys."""

    @property
    def loss_teacher_name(self) -> str:
        """The roster name of the teacher the loss reads: :attr:`loss_teacher`, else the first teacher."""
        return self.loss_teacher or self.source.roster.teachers[0]

    def __post_init__(self) -> None:
        teachers = self.source.roster.teachers
        if len(teachers) == 1:
            if self.loss_teacher is not None:
                raise ValueError(f"loss_teacher={self.loss_teacher!r} names one of several teachers; this run has one")
        elif self.loss_teacher is not None and self.loss_teacher not in teachers:
            raise ValueError(f"loss_teacher={self.loss_teacher!r} is not a teacher of this run ({', '.join(teachers)})")
        self.engine.check_roster(self.source.roster)
        for name, least in (
            ("eval_prompts", 1),
            ("eval_max_tokens", 1),
            ("rounds", 1),
            ("prompts_per_round", 1),
            ("steps_per_round", 1),
            ("loss_top_k", 1),
            ("kl_budget_warmup_rounds", 0),
            ("eval_every", 0),
            ("tokens_per_round", 0),
        ):
            need_int(name, getattr(self, name), least)
        # max_weight may be inf (no clip) but not 0; the optimizer's settings must be finite.
        for name, positive, finite in (
            ("learning_rate", False, True),
            ("weight_decay", False, True),
            ("max_grad_norm", False, False),
            ("max_weight", True, False),
            ("max_sampler_mismatch", False, False),
        ):
            setattr(self, name, need_number(name, getattr(self, name), positive=positive, finite=finite))
        if self.kl_budget_warmup_rounds and self.engine.alpha_method != "trust_region":
            raise ValueError(
                f"kl_budget_warmup_rounds={self.kl_budget_warmup_rounds} anneals a trust_region budget; "
                f"alpha_method is {self.engine.alpha_method!r}"
            )
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.trainer_dtype not in TRAINER_DTYPES:
            raise ValueError(f"trainer_dtype must be one of {TRAINER_DTYPES}, got {self.trainer_dtype!r}")
        try:
            torch.device(self.trainer_device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"trainer_device must be a torch device (cpu, cuda, cuda:1), got {self.trainer_device!r}"
            ) from None
        mode = mode_of(self.engine.mode)
        if not mode.takes_new_theta:
            raise ValueError(
                f"mode={self.engine.mode!r}: distillation pushes new θ weights into the engine every round, and only "
                f"{modes_with('takes_new_theta')} takes them"
            )
        if self.loss != "reverse_full" and not mode.dense_logprobs:
            raise ValueError(
                f"loss={self.loss!r} reads each model's top k from the records, which only "
                f"{modes_with('dense_logprobs')} records; in mode={mode.name!r} use loss='reverse_full' (the teacher "
                "runs in the trainer)"
            )
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if not self.tokens_per_round and self.prompts_per_round * self.sampling.n < self.steps_per_round:
            raise ValueError(
                f"steps_per_round={self.steps_per_round} exceeds the {self.prompts_per_round * self.sampling.n} "
                "samples of a round (prompts_per_round × n)"
            )
        if self.sampling.use_beam_search:
            raise ValueError(
                "use_beam_search: distillation trains on samples of q (the records' log q weighs them); a beam search "
                "returns no samples"
            )
        if self.sampling.dense_logprobs not in (0, self.loss_top_k):  # set, and not to what the loss reads
            raise ValueError(
                f"dense_logprobs={self.sampling.dense_logprobs} differs from loss_top_k={self.loss_top_k}: a "
                "distillation run records the top loss_top_k tokens the loss reads; set loss_top_k only"
            )
        if self.loss != "reverse_full":  # reverse_full runs the teacher in the trainer and reads no top k
            self.sampling = dataclasses.replace(self.sampling, dense_logprobs=self.loss_top_k)
            self.engine = dataclasses.replace(
                self.engine, max_dense_logprobs=max(self.engine.max_dense_logprobs, self.loss_top_k)
            )

    def kl_budget(self, r: int) -> float | None:
        """The trust_region budget ε (nats) round ``r`` (1, 2, ...) samples with; None without a schedule."""
        if not self.kl_budget_warmup_rounds:
            return None
        start = get_alpha_computer(self.engine.alpha_method, **self.engine.alpha_kwargs).kl_budget
        return start * max(0.0, 1.0 - (r - 1) / self.kl_budget_warmup_rounds)

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> DistillConfig:
        """Build from flat keys (CLI flags, distill.yaml): each goes to the run, its sampling or its engine options."""
        return compose_settings(cls, settings)

    def identity(self) -> dict[str, Any]:
        """The settings a resumed run must share with the run it continues (all but the runtime ones and rounds)."""
        return identity_settings(self, _NOT_IDENTITY)


_NOT_IDENTITY = runtime_only(DistillConfig) | {"rounds"}
