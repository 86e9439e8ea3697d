"""The speculative mixture rule: theta's drafted tokens checked against q, so that every emitted token follows q.

Theta drafts tokens y_1 … y_γ, each drawn from π_θ at its prefix. One teacher forward over the prefix and the drafts
gives π_t at each drafted position (and one beyond). At position j, in order:

1. α_j from the alpha computer on (π_θ,j, π_t,j), exactly as the lockstep decision computes it, and
   q_j ∝ π_θ,j^(1−α_j)·π_t,j^α_j (α is the teacher weight);
2. y_j is accepted with probability min(1, q_j(y_j)/π_θ,j(y_j)), decided by a uniform from the (seed, step) counter
   on the ``accept`` stream;
3. at the first rejection a token is drawn from the residual r_j ∝ max(0, q_j − π_θ,j) (uniform from the ``draw``
   stream) and the round ends;
4. if every draft was accepted and theta's row after the last one is at hand, one more token is drawn from q there.

Why an emitted token follows q_j exactly: write m(y) = min(π_θ(y), q(y)) and β = Σ_y m(y). The draft is y with
probability π_θ(y) and kept with probability min(1, q(y)/π_θ(y)), which together give m(y); a rejection (probability
1 − β) draws y from max(0, q(y) − π_θ(y)) / (1 − β), since Σ max(0, q − π_θ) = Σ (q − m) = 1 − β. So
P(y) = m(y) + max(0, q(y) − π_θ(y)) = q(y). The next position is conditioned on the token emitted here, so the
sequence follows q token by token, for any α_j that depends only on the prefix (the alpha computers read only the
two rows). β is the expected acceptance at that position; a round of γ drafts emits Σ_{i<γ} β^i tokens on average
when every position has the same β and the round ends without a bonus token, (1 − β^(γ+1))/(1 − β) with one.

Every emitted token is recorded as the lockstep mode records it: α_j, log π_t,j(y), log π_θ,j(y) and log q_j(y), the
law it was drawn from whichever branch drew it, so importance weights w = π_θ/q mean the same in both modes.

Scope: rows at temperature 1 with no filter (top-k, top-p, min-p), bias or support constraint, which is what keeps
q a function of the two rows alone; a caller refuses other requests up front.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from alpha import AlphaComputer, geometric_log_weights
from dual_sampling.decision.pipeline import counter_uniform, inverse_cdf

__all__ = ["STREAMS", "Round", "Span", "stream_uniform", "verify_drafts"]

STREAMS = {"draw": 0, "accept": 0x5851F42D4C957F2D, "draft": 0x2545F4914F6CDD1D}
"""The counter's streams: ``draw`` is the lockstep mode's own uniform for (seed, step), so a token drawn from q
(a bonus, or the lockstep decision) uses the same uniform in both modes; ``accept`` decides acceptances and
``draft`` theta's drafts."""


def stream_uniform(seed: int, step: int, stream: str) -> float:
    """A uniform in [0, 1) from (seed, step) on one of :data:`STREAMS` (independent streams of the same counter)."""
    return counter_uniform(seed ^ STREAMS[stream], step)


@dataclass(frozen=True)
class Span:
    """One request's rows in a verification batch: ``len(drafts)`` rows from ``start``, one per drafted position,
    and one more after the last draft when ``bonus_row``; ``step`` is the index of the first drafted token among
    the request's generated tokens."""

    start: int
    drafts: tuple[int, ...]
    seed: int
    step: int
    bonus_row: bool = False

    @property
    def rows(self) -> int:
        return len(self.drafts) + int(self.bonus_row)


@dataclass
class Round:
    """What one request's verification emitted: the tokens and their records (float64, one entry per token)."""

    tokens: list[int]
    accepted: int
    """Drafts accepted (the emitted tokens are these, then one residual or bonus draw, if any)."""
    alpha: Tensor
    logp_teacher: Tensor
    logp_theta: Tensor
    logq: Tensor


def verify_drafts(
    teacher_logits: Tensor,
    theta_logits: Tensor,
    spans: Sequence[Span],
    alpha_computer: AlphaComputer,
    alpha_init: Tensor | None = None,
    theta_normalized: bool = False,
) -> list[Round]:
    """Steps 1–4 of the module docstring for every span of a batch.

    ``teacher_logits`` and ``theta_logits`` are ``[N, V]`` over the shared vocabulary, row ``span.start + j`` being
    position j of that span's round (``theta_normalized``: theta's rows are log-softmax outputs already).
    ``alpha_init`` ``[N]`` warm-starts the α solve. α is solved for every row in one call, as the lockstep decision
    solves a batch; the acceptances then run in order along each span.
    """
    if teacher_logits.shape != theta_logits.shape or teacher_logits.dim() != 2:
        raise ValueError(
            f"teacher_logits {tuple(teacher_logits.shape)} and theta_logits {tuple(theta_logits.shape)}: "
            "expected the same [N, V] shape"
        )
    n, vocab = teacher_logits.shape
    for i, span in enumerate(spans):
        if span.start < 0 or span.start + span.rows > n:
            raise ValueError(f"spans[{i}]: rows {span.start}..{span.start + span.rows} outside the batch's {n}")
        if any(not 0 <= t < vocab for t in span.drafts):
            raise ValueError(f"spans[{i}].drafts: a token id outside the vocabulary of {vocab}")
    logp_teacher = torch.log_softmax(teacher_logits.float(), dim=-1)
    logp_theta = theta_logits.float() if theta_normalized else torch.log_softmax(theta_logits.float(), dim=-1)
    alpha = alpha_computer(logp_theta, logp_teacher, alpha_init=alpha_init, normalized=True)
    log_weights = geometric_log_weights(logp_theta, logp_teacher, alpha)
    logq = log_weights - torch.logsumexp(log_weights, dim=-1, keepdim=True)
    return [_verify_span(span, alpha, logp_teacher, logp_theta, logq) for span in spans]


def _verify_span(span: Span, alpha: Tensor, logp_teacher: Tensor, logp_theta: Tensor, logq: Tensor) -> Round:
    rows: list[int] = []
    tokens: list[int] = []
    accepted = 0
    for j, draft in enumerate(span.drafts):
        row = span.start + j
        ratio = torch.exp(logq[row, draft].double() - logp_theta[row, draft].double())
        if stream_uniform(span.seed, span.step + j, "accept") < float(ratio):
            rows.append(row)
            tokens.append(draft)
            accepted += 1
            continue
        residual = (logq[row].double().exp() - logp_theta[row].double().exp()).clamp_min_(0.0)
        u = torch.tensor([stream_uniform(span.seed, span.step + j, "draw")])
        token, total = inverse_cdf(residual.unsqueeze(0), u)
        if float(total) <= 0.0:  # q and π_θ equal to rounding: a rejection of probability ~0, drawn from q instead
            token, _ = inverse_cdf(logq[row].double().exp().unsqueeze(0), u)
        rows.append(row)
        tokens.append(int(token))
        break
    else:
        if span.bonus_row:
            row = span.start + len(span.drafts)
            u = torch.tensor([stream_uniform(span.seed, span.step + len(span.drafts), "draw")])
            token, _ = inverse_cdf(logq[row].double().exp().unsqueeze(0), u)
            rows.append(row)
            tokens.append(int(token))
    index = torch.tensor(rows, dtype=torch.int64)
    picked = torch.tensor(tokens, dtype=torch.int64)
    return Round(
        tokens=tokens,
        accepted=accepted,
        alpha=alpha[index].double(),
        logp_teacher=logp_teacher[index, picked].double(),
        logp_theta=logp_theta[index, picked].double(),
        logq=logq[index, picked].double(),
    )
