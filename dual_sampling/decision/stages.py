"""The stages between log q and the draw (steps 4–10 of :mod:`dual_sampling.decision.pipeline`), as named objects in
the order they run.

Each stage names the per-row settings it reads (:attr:`Stage.fields`, fields of :class:`DecisionOptions`), checks
their values where a request is made (:meth:`Stage.check`, called by ``SamplingOptions``: one home for each rule,
every error naming its field), says whether a row uses it (:meth:`Stage.used`) and whether the fused kernels
implement it (:attr:`Stage.fused_on`; ``fusable.kernel_rows`` derives its rule from these two), and applies itself
to a batch's log q ``[b, V]`` in place (:meth:`Stage.apply`). The order is vLLM's v1 sampler's for the stages both
have (min_tokens and logit_bias, then the penalties, then temperature, then min-p, top-k and top-p), after the
teacher-support constraint, which only a mixture has, and before the diversity of a group's samples, which acts on
the law each would draw from. A new stage is one class here (its settings in
:class:`DecisionOptions`) and one entry in :data:`STAGES`.

:class:`DecisionOptions` holds every per-token setting once, with its docstring: ``SamplingOptions`` (a request's
options) and ``RowSampling`` (what the teacher engine receives per sample) both extend it, so neither copies it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from dual_sampling.checks import MAX_COUNT, is_count, is_int, is_number, require

__all__ = [
    "LOGIT_BIAS_LIMIT",
    "MAX_PENALTY",
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "STAGES",
    "DecisionOptions",
    "Stage",
    "StageBatch",
    "clamped_logit_bias",
    "keep_top_k_top_p",
    "penalised_logits",
    "penalised_tokens",
]

LOGIT_BIAS_LIMIT = 100.0
"""logit_bias values are clamped to ±this, as vLLM clamps them."""
MIN_TEMPERATURE = 1e-2
"""The smallest non-zero temperature: below it the tempered log q overflows float32 (0 is greedy)."""
MAX_TEMPERATURE = 100.0
"""The largest temperature: past it q is uniform over the kept tokens to float32 precision."""
MAX_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [−this, this], as vLLM (and OpenAI's API) bound them."""


@dataclass(kw_only=True)
class DecisionOptions:
    """The settings of each token's decision from q ∝ π_θ^(1−α)·π_t^α (α is the teacher weight): what the stages
    read, the first-token rule and what is recorded besides the token."""

    temperature: float = 1.0
    """Divides log q before the draw; 0 is greedy (the mode of q), otherwise in [0.01, 100]."""
    top_p: float = 1.0
    """Nucleus filter on the tempered q, in (0, 1]; 1 is off."""
    top_k: int = -1
    """Keep the k most likely tokens of q; -1 is off."""
    min_p: float = 0.0
    """Drop tokens below min_p times the most likely token's probability, in [0, 1]; 0 is off."""
    min_tokens: int = 0
    """Generated tokens before any stop token or stop string may end a sample."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to log q per token id before temperature; clamped to ±100 as in vLLM."""
    repetition_penalty: float = 1.0
    """Applied to the mixture's logit z of every token in the prompt (theta's) or the output so far, as vLLM applies
    it to one model's: z/p where z > 0, z·p otherwise; > 0, 1 is off."""
    presence_penalty: float = 0.0
    """Subtracted from the mixture's logit of every token the output holds already, in [−2, 2]; 0 is off."""
    frequency_penalty: float = 0.0
    """Subtracted from the mixture's logit of each token once per time the output holds it, in [−2, 2]; 0 is off."""
    diversity_penalty: float = 0.0
    """With n > 1: the samples of one prompt are decided in order at each step, and each draws from
    q(y)·exp(−λ·c(y)), c(y) counting the earlier samples that took y at that step (λ ≥ 0; 0 is off); named as
    transformers names it for group beam search."""
    force_first_token: bool = False
    """Sample the first token from the teacher alone (α = 1 at step 0)."""
    teacher_support_top_k: int = -1
    """Restrict q to the teacher's k most likely tokens; -1 is off."""
    teacher_support_top_p: float = 1.0
    """Restrict q to the teacher's top-p set, in (0, 1]; 1 is off."""
    top_logprobs: int = 0
    """Also record, per token, this many of q's most likely tokens with their log-probabilities (0-20)."""
    dense_logprobs: int = 0
    """Also record, per token, the teacher's k most likely tokens and theta's k most likely, each with both log π_t
    and log π_θ (untempered, unfiltered: the models' own distributions at that position); at most the engine's
    ``max_dense_logprobs``. The dense signal of a distillation loss, forward (the teacher's top k) or reverse (θ's)."""


@dataclass
class StageBatch:
    """What the stages of one batch see. Every sequence has one entry per row of log q."""

    logp_teacher: Tensor
    """``[b, V]`` log π_t (untempered): the teacher-support constraint reads it."""
    steps: Sequence[int]
    """Tokens each row's sample has generated so far."""
    rows: Sequence[Any]
    """Each row's settings (``RowSampling``)."""
    outputs: Sequence[Sequence[int]] | None = None
    """Each row's generated tokens so far (its step is their count); the penalties read them."""
    diversity: Sequence[dict[int, int]] | None = None
    """Per row, the tokens the earlier members of its diverse group took at this step, with their counts."""
    logit_offset: Tensor | None = None
    """``[b]`` float64: log q + this is the mixture's logit z = (1 − α)·ℓ_θ + α·ℓ_t of the raw logits ℓ (the
    log-normalisers (1 − α)·L_θ + α·L_t); the repetition penalty reads z's sign."""


class Stage:
    """One step between log q and the draw. Subclasses set :attr:`fields` and :attr:`fused_on` and implement the rest;
    a stage is applied only to batches where some row uses it."""

    fields: ClassVar[tuple[str, ...]] = ()
    """The :class:`DecisionOptions` fields this stage reads."""
    fused_on: ClassVar[frozenset[str]] = frozenset()
    """The kernel devices ("cpu", "cuda") whose fused kernel implements this stage; a row that uses a stage its
    device's kernel does not goes to the reference."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def check(self, options: Any) -> None:
        """Refuse, naming the field, a value of :attr:`fields` this stage cannot apply (``options``: the request's
        ``SamplingOptions``); a valid value may be put in the form the stage applies (logit_bias: clamped floats)."""

    def used(self, row: Any) -> bool:
        """Whether ``row``'s settings turn this stage on (at some step)."""
        raise NotImplementedError

    def apply(self, x: Tensor, batch: StageBatch) -> None:
        """Apply the stage to log q ``x`` ``[b, V]`` in place (up to a per-row constant; -inf removes a token)."""
        raise NotImplementedError


def keep_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor | None = None) -> Tensor | None:
    """Bool mask ``[b, V]`` of the tokens each row keeps, or None when no filter is active.

    ``top_k`` ``[b]`` (≤ 0: off), ``top_p`` ``[b]`` in (0, 1] (1: off), ``min_p`` ``[b]`` in [0, 1]
    (0: off). The most likely token is always kept. Tokens already at -inf stay there.
    """
    keep = None
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        rank = torch.arange(logits.shape[-1], device=logits.device).expand_as(sorted_logits)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, logits.shape[-1]))
        keep_sorted = rank < k.unsqueeze(-1)
        probs = torch.softmax(sorted_logits.double(), dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        keep_sorted &= before < top_p.double().unsqueeze(-1)
        keep_sorted[:, 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    if min_p is not None and bool((min_p > 0).any()):
        logp = torch.log_softmax(logits, dim=-1)
        top = logp.max(dim=-1, keepdim=True).values
        above = logp >= top + torch.log(min_p.clamp_min(1e-30)).unsqueeze(-1)
        keep = above if keep is None else keep & above
    return keep


def _column(batch: StageBatch, name: str, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Each row's ``name`` setting as a ``[b]`` tensor on ``like``'s device."""
    return torch.tensor([getattr(r, name) for r in batch.rows], device=like.device, dtype=dtype)


class TeacherSupport(Stage):
    """Remove the tokens outside the teacher's top-k / top-p set (of the untempered π_t)."""

    fields = ("teacher_support_top_k", "teacher_support_top_p")

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
            _column(batch, "teacher_support_top_k", x),
            _column(batch, "teacher_support_top_p", x, x.dtype),
        )
        if keep is not None:
            x.masked_fill_(~keep, -math.inf)


class MinTokens(Stage):
    """Remove the row's stop tokens (its EOS ids and stop_token_ids) while fewer than min_tokens were generated."""

    fields = ("min_tokens",)
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

    fields = ("logit_bias",)

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


class Penalties(Stage):
    """vLLM's repetition, frequency and presence penalties on the mixture's logits z = log q + offset (vLLM's order:
    repetition over the prompt's and the output's tokens, then frequency and presence over the output's).

    At α = 0 z is theta's raw logit row and this is vLLM's penalised sampling of theta; at α = 1, the teacher's. The
    prompt is theta's (``RowSampling.prompt_token_ids``): the sample's own context, not a teacher hint's. Only the
    tokens seen change: a sparse edit of each row.
    """

    fields = ("repetition_penalty", "presence_penalty", "frequency_penalty")
    fused_on = frozenset({"cpu"})  # a sparse edit after α; the GPU kernel does not take it yet

    def check(self, options: Any) -> None:
        p = options.repetition_penalty
        require(is_number(p) and p > 0, f"repetition_penalty must be a finite number > 0, got {p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(options, name)
            require(
                is_number(v) and -MAX_PENALTY <= v <= MAX_PENALTY,
                f"{name} must lie in [{-MAX_PENALTY}, {MAX_PENALTY}], got {v!r}",
            )

    def used(self, row: Any) -> bool:
        return row.repetition_penalty != 1.0 or row.presence_penalty != 0.0 or row.frequency_penalty != 0.0

    def apply(self, x: Tensor, batch: StageBatch) -> None:
        if batch.outputs is None:
            raise ValueError("penalties need each row's generated tokens (StageBatch.outputs)")
        vocab = x.shape[-1]
        for i, row in enumerate(batch.rows):
            if not self.used(row):
                continue
            ids, counts = penalised_tokens(row.prompt_token_ids, batch.outputs[i], vocab)
            if ids.size == 0:
                continue
            offset = 0.0
            if row.repetition_penalty != 1.0:
                if batch.logit_offset is None:
                    raise ValueError("the repetition penalty needs the rows' log-normalisers (StageBatch.logit_offset)")
                offset = float(batch.logit_offset[i])
            index = torch.from_numpy(ids).to(x.device)
            z = x[i, index].double() + offset
            z = penalised_logits(z, torch.from_numpy(counts).to(x.device), row)
            x[i, index] = (z - offset).to(x.dtype)


def penalised_tokens(prompt: Sequence[int], output: Sequence[int], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64, counts float64) of the tokens a penalty touches: the distinct ids of ``prompt`` and ``output``
    below ``vocab``, ascending, and how often the output holds each (0 for a prompt's token alone)."""
    out = np.asarray(output, dtype=np.int64)
    ids, counts = np.unique(out[(out >= 0) & (out < vocab)], return_counts=True)
    pr = np.asarray(prompt, dtype=np.int64)
    pr = np.setdiff1d(pr[(pr >= 0) & (pr < vocab)], ids)
    every = np.concatenate([ids, pr])
    order = np.argsort(every, kind="stable")
    counts = np.concatenate([counts.astype(np.float64), np.zeros(pr.size)])
    return every[order], counts[order]


def penalised_logits(z: Tensor, counts: Tensor, row: Any) -> Tensor:
    """vLLM's penalties on the logits ``z`` of the touched tokens (every one seen in the prompt or output;
    ``counts``: times in the output), in ``z``'s dtype: repetition, then frequency, then presence."""
    p = row.repetition_penalty
    if p != 1.0:
        z = torch.where(z > 0, z / p, z * p)
    return z - row.frequency_penalty * counts - row.presence_penalty * (counts > 0).to(z.dtype)


class Temperature(Stage):
    """Divide log q by the temperature (greedy rows, temperature 0, are left as they are: the draw takes their
    mode)."""

    fields = ("temperature",)

    def check(self, options: Any) -> None:
        t = options.temperature
        require(
            is_number(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE),
            f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {t!r}",
        )

    def used(self, row: Any) -> bool:
        return row.temperature != 1.0

    def apply(self, x: Tensor, batch: StageBatch) -> None:
        temps = _column(batch, "temperature", x, x.dtype)
        x.div_(torch.where(temps == 0, torch.ones_like(temps), temps).unsqueeze(-1))


class Filters(Stage):
    """Keep the tempered q's top-k, top-p and min-p sets (the most likely token always stays)."""

    fields = ("top_k", "top_p", "min_p")

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
            x, _column(batch, "top_k", x), _column(batch, "top_p", x, x.dtype), _column(batch, "min_p", x, x.dtype)
        )
        if keep is not None:
            x.masked_fill_(~keep, -math.inf)


class Diversity(Stage):
    """Divide q by exp(λ·c(y)) for the tokens the earlier members of the row's group took at this step (last: it acts
    on the distribution the member would otherwise draw from, tempered and filtered)."""

    fields = ("diversity_penalty",)
    fused_on = frozenset({"cpu"})  # a sparse edit after α, as the penalties

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


STAGES: tuple[Stage, ...] = (
    TeacherSupport(),
    MinTokens(),
    LogitBias(),
    Penalties(),
    Temperature(),
    Filters(),
    Diversity(),
)
"""The stages in the order they run."""
