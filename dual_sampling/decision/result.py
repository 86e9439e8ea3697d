"""What the decision returns for a batch of rows: one token per row, with its records per model of the roster.

Fields are in roster order (M models, K teachers; :class:`~dual_sampling.decision.rows.ModelRows`), so the same
object serves one teacher and several, and the records' columns follow from the roster
(:meth:`Decision.token_records`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dual_sampling.decision.rows import ModelRows

__all__ = ["Decision", "dense_top", "token_columns"]


def token_columns(alpha: Tensor, logp: Tensor, logq: Tensor) -> Tensor:
    """``[n, columns]``: records of n tokens in their roster's token columns
    (:attr:`~dual_sampling.roster.Roster.token_columns`), from α ``[n]`` (one teacher) or ``[n, K]``, log π of each
    model ``[n, M]`` and log q ``[n]``."""
    return torch.cat([alpha if alpha.dim() == 2 else alpha.unsqueeze(-1), logp, logq.unsqueeze(-1)], dim=-1)


@dataclass
class Decision:
    """One decided token per row, with what the records need, per model in roster order (M models, K teachers).
    ``[b]`` fields unless stated."""

    tokens: Tensor
    alpha: Tensor
    """Teacher weight used (after clamps and first-token forcing); ``[b, K]`` with several teachers."""
    logp: Tensor
    """``[b, M]``: log π of each model at the token (untempered)."""
    logq: Tensor
    """log-probability of the token under the distribution it was drawn from."""
    ok: Tensor
    """False where every token was removed (the row's token must not be used)."""
    top_ids: Tensor | None = None
    """``[b, k]``: the k most likely tokens of the final distribution (when asked for)."""
    top_logq: Tensor | None = None
    """``[b, k]``: their log-probabilities."""
    top_logp: Tensor | None = None
    """``[b, M, k]``: each model's log π at the same ids (untempered)."""
    dense_ids: Tensor | None = None
    """``[b, M, k]``: each model's own k most likely tokens (:func:`dense_top`), when asked for."""
    dense_logp: Tensor | None = None
    """``[b, M, M, k]``: ``[:, i, j]`` is log π_j at model i's k tokens (untempered, unfiltered)."""
    handed_back: Tensor | None = None
    """``[b]`` bool: rows a fused kernel gave to the reference (a non-finite entry, weights that underflow, masked
    tokens holding most of q, an unconverged α solve). Set by :func:`decide`; ``.sum()`` counts them."""
    unconverged: Tensor | None = None
    """``[b]`` bool: of those, the rows whose α solve did not converge in the kernel's passes (the reference's solver
    then solved them; where it cannot either, :func:`decide` raises). Set by :func:`decide`."""

    def token_records(self) -> Tensor:
        """``[b, columns]`` float32: each row's record in its roster's token columns
        (:attr:`~dual_sampling.roster.Roster.token_columns`: α per teacher, log π per model, log q)."""
        return token_columns(self.alpha, self.logp, self.logq).float()

    @classmethod
    def concatenate(cls, parts: Sequence[Decision]) -> Decision:
        """The decisions of consecutive row ranges (decided with the same ``top_logprobs``), as one."""
        return cls(
            *(
                None if getattr(parts[0], f.name) is None else torch.cat([getattr(p, f.name) for p in parts])
                for f in dataclasses.fields(cls)
            )
        )


def dense_top(models: ModelRows, k: int, decision: Decision) -> tuple[Tensor, Tensor]:
    """Each model's own k most likely tokens, and every model's log-probabilities at them: (ids ``[b, M, k]`` int64,
    logp ``[b, M, M, k]``), ``logp[:, i, j]`` being log π_j at model i's tokens, most likely first. Untempered and
    unfiltered: the loss of a distillation trainer needs the models' distributions, not the one sampled from; a
    reverse KL needs π_t where π_θ has its mass, hence every model's values at every model's tokens.

    One record, one number: each row's log-normaliser is the one ``decision`` used for its drawn token, read back as
    logit[token] − record (float64, where that difference of two float32 values is exact). So where the drawn token is
    among the k, its dense value equals its record bit for bit, and every dense value orders as its logit does. A
    computation of its own (a float32 logsumexp) would differ from the decision's by float32 rounding, about 1e-5 nats
    at SmolLM2's vocabulary. Rows without a usable token (``decision.ok`` False) use the row's own logsumexp.
    """
    k = min(k, models.vocab)
    pick = decision.tokens.to(models.device).unsqueeze(-1)
    ok = decision.ok.to(models.device).unsqueeze(-1)

    def normaliser(position: int) -> Tensor:
        """``[b, 1]`` float64: the log-normaliser the decision used for this model's rows."""
        logits = models.logits[position]
        own = torch.zeros_like(logits[:, :1], dtype=torch.float64)
        if not models.is_normalized(position):
            own = logits.logsumexp(-1, True).double()
        record = decision.logp[:, position].to(logits.device, torch.float64).unsqueeze(-1)
        from_record = logits.gather(-1, pick).double() - record
        return torch.where(ok & torch.isfinite(from_record), from_record, own)

    norms = [normaliser(p) for p in range(len(models.logits))]
    ids = torch.stack([logits.topk(k, dim=-1).indices for logits in models.logits], dim=1)
    logp = [
        torch.stack(
            [
                (logits.gather(-1, ids[:, i]).double() - norm).to(logits.dtype)
                for logits, norm in zip(models.logits, norms)
            ],
            dim=1,
        )
        for i in range(len(models.logits))
    ]
    return ids, torch.stack(logp, dim=1)
