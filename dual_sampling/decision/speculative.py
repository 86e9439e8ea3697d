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

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from alpha import AlphaComputer, geometric_log_weights
from dual_sampling.decision.pipeline import counter_uniform, inverse_cdf
from dual_sampling.decision.result import token_columns
from dual_sampling.decision.rows import ModelRows

__all__ = ["STREAMS", "Round", "Span", "send", "stream_uniform", "verification_block", "verify_drafts"]

STREAMS = {"draw": 0, "accept": 0x5851F42D4C957F2D, "draft": 0x2545F4914F6CDD1D}
"""The counter's streams: ``draw`` is the lockstep mode's own uniform for (seed, step), so a token drawn from q
(a bonus, or the lockstep decision) uses the same uniform in both modes; ``accept`` decides acceptances and
``draft`` theta's drafts."""


_DRAW_CHUNK_ELEMENTS = 1 << 24
"""Elements of one float64 [spans, V] temporary of the draws (128 MiB): vLLM's memory profile never sees this step."""


def send(values: Sequence[float], device: torch.device) -> Tensor:
    """``values`` as a float64 tensor on ``device``, sent without waiting for the device: from page-locked memory
    on CUDA (a copy from pageable memory would first wait for the stream's queued work)."""
    host = torch.tensor(values, dtype=torch.float64)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


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
    logp: Tensor
    """``[c, 2]``: log π of each model at each token, in the roster's order (the teacher's, θ's)."""
    logq: Tensor
    finite: bool = True
    """False when a row of the span was not finite (a teacher logit not finite; a θ value NaN or +inf, or no finite θ
    value at all): then nothing above is meaningful and the request must fail."""

    def token_records(self) -> Tensor:
        """``[c, 4]`` float64: the tokens' records in the pair's token columns (α, log π_t, log π_θ, log q)."""
        return token_columns(self.alpha, self.logp, self.logq)


def verify_drafts(
    models: ModelRows,
    spans: Sequence[Span],
    alpha_computer: AlphaComputer,
    alpha_init: Tensor | None = None,
) -> list[Round]:
    """Steps 1–4 of the module docstring for every span of a batch.

    ``models`` holds the one teacher's and θ's ``[N, V]`` rows over the shared vocabulary (a one-teacher roster; θ's
    may be log-softmax outputs already), row ``span.start + j`` being position j of that span's round.
    ``alpha_init`` ``[N]`` warm-starts the α solve.

    Everything runs on the rows' device, for the whole batch at once: α for every row in one call (as the lockstep
    decision solves a batch), every draft's acceptance in one comparison, and one draw per span at the row where
    its round ends (the first rejection's residual, or the bonus row's q). The uniforms are computed on the host
    from (seed, step) and sent along; the draw's uniform is sent for every position a round could end at, and the
    one at the actual end is picked on the device. So the decision waits for the device once per call for its
    result, when the emitted tokens and records come back, however many drafts the batch has; the α computer's
    input and convergence checks and the mixing's support check read a few values per call besides.
    """
    n, vocab = len(models), models.vocab
    for i, span in enumerate(spans):
        if span.start < 0 or span.start + span.rows > n:
            raise ValueError(f"spans[{i}]: rows {span.start}..{span.start + span.rows} outside the batch's {n}")
        if any(not 0 <= t < vocab for t in span.drafts):
            raise ValueError(f"spans[{i}].drafts: a token id outside the vocabulary of {vocab}")
    if not spans:
        return []
    if n == 0:  # spans with no rows (no drafts, no bonus row): nothing to emit
        empty = torch.zeros(0, dtype=torch.float64)
        return [Round([], 0, empty, empty.reshape(0, 2), empty) for _ in spans]
    block = verification_block(models, spans, alpha_computer, alpha_init)
    # The one wait: tokens, counts and records come back together, read on the host as NumPy (no further tensor reads).
    block = block.cpu().numpy()
    width = max(len(span.drafts) for span in spans) + 1
    rounds = []
    for k in range(len(spans)):
        c = int(block[k, -2])
        r = torch.from_numpy(block[k, : 4 * width].reshape(width, 4)[:c].copy())
        rounds.append(
            Round(
                tokens=block[k, 4 * width : 4 * width + c].astype(np.int64).tolist(),
                accepted=int(block[k, -1]),
                alpha=r[:, 0],
                logp=r[:, 1:3],
                logq=r[:, 3],
                finite=bool(block[k, -3]),
            )
        )
    return rounds


def verification_block(
    models: ModelRows,
    spans: Sequence[Span],
    alpha_computer: AlphaComputer,
    alpha_init: Tensor | None = None,
) -> Tensor:
    """:func:`verify_drafts`' work on the rows' device, without reading anything back: a float64 ``[S, 5(G + 1) + 3]``
    block, per span its records ``[G + 1, 4]`` (the one-teacher roster's token columns: α, log π_t, log π_θ, log q)
    flattened, its tokens ``[G + 1]``, then finite, count and accepted (ids are exact in float64 below 2^53). G is the
    longest draft list."""
    teacher_logits, theta_logits = models.teacher, models.student
    theta_normalized = models.is_normalized(models.student_position)
    n, device = len(models), models.device
    # A row that is not finite fails its span (``Round.finite``), checked with everything else in the one wait.
    # Three reductions decide it, NaN propagating through each: the teacher's logits all finite (its max and min
    # finite), θ's row neither NaN nor +inf and not wholly −inf (its max finite).
    row_ok = (
        torch.isfinite(teacher_logits.amax(-1))
        & torch.isfinite(teacher_logits.amin(-1))
        & torch.isfinite(theta_logits.amax(-1))
    )
    # A bad row becomes the uniform distribution, so the α solve and the draws of the other spans stay defined.
    bad, uniform = ~row_ok.unsqueeze(-1), -math.log(teacher_logits.shape[1])
    logp_teacher = torch.log_softmax(teacher_logits.float(), dim=-1).masked_fill_(bad, uniform)  # a fresh tensor: ours
    logp_theta = torch.where(bad, uniform, theta_logits.float())
    if not theta_normalized:
        logp_theta = torch.log_softmax(logp_theta, dim=-1)
    alpha = alpha_computer(logp_theta, logp_teacher, alpha_init=alpha_init, normalized=True)
    log_weights = geometric_log_weights(logp_theta, logp_teacher, alpha)
    logq = log_weights - torch.logsumexp(log_weights, dim=-1, keepdim=True)

    plan = _Plan.of(spans, device)
    # Acceptance of every draft at once: u < q(y)/π_θ(y), the ratio in float64.
    ratio = torch.exp(
        logq[plan.draft_rows, plan.draft_ids].double() - logp_theta[plan.draft_rows, plan.draft_ids].double()
    )
    accept = torch.ones(plan.shape, dtype=torch.bool, device=device)
    accept[plan.draft_cells] = plan.accept_u < ratio
    # Drafts kept: those before a span's first rejection (cells past its drafts count as accepted, then are cut).
    accepted = torch.minimum(torch.cumprod(accept.to(torch.int32), dim=1).sum(dim=1), plan.num_drafts)
    rejected = accepted < plan.num_drafts
    drawn = rejected | plan.bonus_row  # a round ends with a draw: the residual after a rejection, or q at the bonus
    end_row = plan.starts + accepted  # a bonus row sits right after the last draft, so the same formula holds
    end_row = torch.where(drawn, end_row, 0)  # spans ending without a draw: row 0, drawn from but unused
    draw_u = plan.draw_u.gather(1, accepted.unsqueeze(-1)).squeeze(-1)
    # The draws in chunks of spans, so the float64 [spans, V] temporaries stay near _DRAW_CHUNK_ELEMENTS each.
    token = torch.empty_like(accepted)
    chunk = max(1, _DRAW_CHUNK_ELEMENTS // logq.shape[1])
    for first in range(0, len(spans), chunk):
        part = slice(first, first + chunk)
        q_end = logq[end_row[part]].double().exp_()
        residual = logp_theta[end_row[part]].double().exp_().neg_().add_(q_end).clamp_min_(0.0)
        # At a rejection the residual max(0, q − π_θ); where it has no mass left (q and π_θ equal to rounding, a
        # rejection of probability ~0) and at the bonus row, q itself.
        use_residual = rejected[part] & (residual.sum(dim=-1) > 0)
        token[part], _ = inverse_cdf(torch.where(use_residual.unsqueeze(-1), residual, q_end), draw_u[part])

    # Every span's emitted tokens in a [S, G + 1] grid: the kept drafts, then the draw; records gathered beside them.
    columns = torch.arange(plan.shape[1] + 1, device=device)
    tokens = torch.cat([plan.draft_grid, torch.zeros_like(accepted).unsqueeze(-1)], dim=1)
    tokens.scatter_(1, accepted.unsqueeze(-1), token.unsqueeze(-1))
    count = accepted + drawn.long()
    rows = (plan.starts.unsqueeze(-1) + columns).clamp_max(n - 1)
    span_rows = plan.num_drafts + plan.bonus_row.long()
    span_ok = (row_ok[rows] | (columns >= span_rows.unsqueeze(-1))).all(dim=1)
    records = torch.stack(
        [
            alpha.double()[rows],
            logp_teacher[rows, tokens].double(),
            logp_theta[rows, tokens].double(),
            logq[rows, tokens].double(),
        ],
        dim=-1,
    )
    return torch.cat(
        [records.flatten(1), tokens.double(), *(v.double().unsqueeze(-1) for v in (span_ok, count, accepted))], dim=1
    )


@dataclass(frozen=True)
class _Plan:
    """A batch's spans laid out as ``[S, G]`` grids (S spans, G the longest draft list), on the rows' device.

    Built on the host from the spans alone (ids, seeds, steps, and the uniforms they give), then sent in one
    page-locked copy; nothing in it depends on the rows, so sending it never waits for the device."""

    shape: tuple[int, int]
    starts: Tensor
    """``[S]`` int64: each span's first row."""
    num_drafts: Tensor
    """``[S]`` int64."""
    bonus_row: Tensor
    """``[S]`` bool."""
    draft_grid: Tensor
    """``[S, G]`` int64: the drafts, 0 past each span's own."""
    draft_cells: tuple[Tensor, Tensor]
    """(span, position) of every draft, in span order: ``[D]`` each."""
    draft_rows: Tensor
    """``[D]`` int64: the row of every draft."""
    draft_ids: Tensor
    """``[D]`` int64: every draft's token id."""
    accept_u: Tensor
    """``[D]`` float64: every draft's uniform on the ``accept`` stream."""
    draw_u: Tensor
    """``[S, G + 1]`` float64: the ``draw`` stream's uniform at every position a round could end at."""

    @classmethod
    def of(cls, spans: Sequence[Span], device: torch.device) -> _Plan:
        s, g = len(spans), max(len(span.drafts) for span in spans)
        cells = [(k, j) for k, span in enumerate(spans) for j in range(len(span.drafts))]
        # One float64 block (ids and positions are exact in it): per span start, drafts, bonus, grid, draw uniforms;
        # per draft span, position, id, accept uniform.
        per_span = [
            [span.start, len(span.drafts), float(span.bonus_row)]
            + list(span.drafts)
            + [0] * (g - len(span.drafts))
            + [stream_uniform(span.seed, span.step + j, "draw") for j in range(g + 1)]
            for span in spans
        ]
        per_draft = [
            [k, j, spans[k].drafts[j], stream_uniform(spans[k].seed, spans[k].step + j, "accept")] for k, j in cells
        ]
        block = send([v for row in per_span for v in row] + [v for row in per_draft for v in row], device)
        spans_part = block[: s * (2 * g + 4)].reshape(s, 2 * g + 4)
        drafts_part = block[s * (2 * g + 4) :].reshape(len(cells), 4)
        starts = spans_part[:, 0].long()
        span_of, position = drafts_part[:, 0].long(), drafts_part[:, 1].long()
        return cls(
            shape=(s, g),
            starts=starts,
            num_drafts=spans_part[:, 1].long(),
            bonus_row=spans_part[:, 2] > 0,
            draft_grid=spans_part[:, 3 : 3 + g].long(),
            draft_cells=(span_of, position),
            draft_rows=starts[span_of] + position,
            draft_ids=drafts_part[:, 2].long(),
            accept_u=drafts_part[:, 3],
            draw_u=spans_part[:, 3 + g :],
        )
