"""What every stage is: the :class:`Stage` interface, the :class:`StageBatch` it applies to, and the settings every
decision reads whatever its stages (:class:`CoreSettings`). The stages themselves are this package's other modules,
one each."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

__all__ = ["CoreSettings", "Stage", "StageBatch", "column", "keep_top_k_top_p"]


@dataclass(kw_only=True)
class CoreSettings:
    """The first-token rule and what is recorded besides each token: the per-token settings no stage owns."""

    force_first_token: bool = False
    """Sample the first token from the teacher alone (α = 1 at step 0)."""
    top_logprobs: int = 0
    """Also record, per token, this many of q's most likely tokens with their log-probabilities (0-20)."""
    dense_logprobs: int = 0
    """Also record, per token, the teacher's k most likely tokens and theta's k most likely, each with both log π_t
    and log π_θ (untempered, unfiltered: the models' own distributions at that position); at most the engine's
    ``max_dense_logprobs``. The dense signal of a distillation loss, forward (the teacher's top k) or reverse (θ's)."""


@dataclass
class StageBatch:
    """What the stages of one batch see. Every sequence has one entry per row of log q."""

    logp_teacher: Tensor | None
    """``[b, V]`` log π_t (untempered): the teacher-support constraint reads it. None with several teachers (no
    stage that reads it runs there)."""
    steps: Sequence[int]
    """Tokens each row's sample has generated so far."""
    rows: Sequence[Any]
    """Each row's settings (``RowSampling``; ``prompt_token_ids`` holds theta's prompt where a stage
    :meth:`~Stage.needs_prompt`)."""
    outputs: Sequence[Sequence[int]] | None = None
    """Each row's generated tokens so far (its step is their count); the penalties read them."""
    diversity: Sequence[dict[int, int]] | None = None
    """Per row, the tokens the earlier members of its diverse group took at this step, with their counts."""
    logit_offset: Tensor | None = None
    """``[b]`` float64: log q + this is the mixture's logit z = (1 − α)·ℓ_θ + α·ℓ_t of the raw logits ℓ (the
    log-normalisers (1 − α)·L_θ + α·L_t), given where a row's stage :meth:`~Stage.needs_logit_offset`."""


class Stage:
    """One step between log q and the draw, in its own module of this package (found there by the package, placed by
    :attr:`order`). A subclass sets :attr:`order`, :attr:`settings` and, where a kernel implements it,
    :attr:`fused_on`, and implements :meth:`used` and :meth:`apply`; a stage is applied only to batches where some
    row uses it."""

    order: ClassVar[int]
    """Where the stage runs: stages run by ascending order (vLLM's order for the stages it has: 10 teacher support,
    20 min_tokens, 30 logit_bias, 40 penalties, 50 temperature, 60 filters, 70 diversity)."""
    settings: ClassVar[type]
    """The kw-only dataclass of the per-row settings this stage reads, each field with its docstring:
    ``DecisionOptions`` is composed of every stage's."""
    fields: ClassVar[tuple[str, ...]] = ()
    """The names of :attr:`settings`' fields (derived)."""
    fused_on: ClassVar[frozenset[str]] = frozenset()
    """The kernel devices ("cpu", "cuda") whose fused kernel implements this stage; a row that uses a stage its
    device's kernel does not goes to the reference."""
    several_teachers: ClassVar[bool] = True
    """Whether the stage has a meaning with several teachers; False refuses a row that uses it there, by its fields."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.fields = tuple(f.name for f in dataclasses.fields(cls.settings))

    @property
    def name(self) -> str:
        return type(self).__name__

    def check(self, options: Any) -> None:
        """Refuse, naming the field, a value of :attr:`fields` this stage cannot apply (``options``: the request's
        ``SamplingOptions``); a valid value may be put in the form the stage applies (logit_bias: clamped floats)."""

    def used(self, row: Any) -> bool:
        """Whether ``row``'s settings turn this stage on (at some step)."""
        raise NotImplementedError

    def needs_prompt(self, row: Any) -> bool:
        """Whether the stage reads the row's prompt (theta's token ids travel with the row only then)."""
        return False

    def needs_logit_offset(self, row: Any) -> bool:
        """Whether the stage reads the mixture's raw logits z (:attr:`StageBatch.logit_offset`; theta then publishes
        its log-normaliser for the row)."""
        return False

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


def column(batch: StageBatch, name: str, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Each row's ``name`` setting as a ``[b]`` tensor on ``like``'s device."""
    return torch.tensor([getattr(r, name) for r in batch.rows], device=like.device, dtype=dtype)
