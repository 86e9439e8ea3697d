"""The speculative mixture's plugin: the teacher engine's sampling step, replaced, and its drafter's draws.

In ``mode="speculative"`` one vLLM engine runs the teacher with theta as its draft model (vLLM's ``draft_model``
speculation: theta's KV cache, its γ draft steps and the rollback of rejected drafts are vLLM's). Two of the model
runner's steps are replaced (through :class:`processors.model_runner.SpeculativeRunner`, the one module that touches
the runner) by the worker extension (``dual_sampling_install_speculative``):

- ``runner._sample`` (the step that turns the teacher's logits into tokens): for every request, theta's drafts are
  checked against q with :func:`dual_sampling.decision.speculative.verify_drafts`, and the emitted tokens and their
  records (α, log π_t, log π_θ, log q) are written to the request's slot of the shared-memory session, as the
  lockstep teacher writes them. vLLM's rejection sampler targets π_t; a plugin that changes only its target
  (a logits processor) is refused by vLLM while speculation is on, so the seam is this method, which has the request
  ids, the raw logits and the drafts.
- ``drafter._sample_from_logits`` (theta's draw of each draft): inverse CDF with the (seed, position) counter on its
  ``draft`` stream, so a seed reproduces its drafts whatever the batch (vLLM's draws use one global generator), and
  the row it returns is log π_θ (vLLM keeps it for its rejection sampler; here only this module reads it back).

The first token after the prompt: vLLM draws it from the teacher's prefill row alone, with no θ row. The driver
therefore submits the prompt without its last token and this step emits that token itself (``force`` in the
pairing); the drafter then conditions on the whole prompt, and every generated token has both rows. After γ
accepted drafts the position beyond has no θ row either (the drafter stops at γ), so a round ends there without a
bonus token; where vLLM scheduled fewer than γ drafts, theta's next row exists and the round may end with a draw
from q there.

A request whose rows are missing (drafts zeroed by vLLM because a sequence outgrew the drafter: the driver's length
cap prevents it) or not finite fails alone: its slot records the error and the step emits its first stop token,
which ends it in vLLM. Nothing falls back to one model's distribution.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any

import torch

from alpha import get_alpha_computer
from dual_sampling.decision.pipeline import inverse_cdf
from dual_sampling.decision.rows import ModelRows
from dual_sampling.decision.speculative import Span, send, stream_uniform, verify_drafts
from dual_sampling.lockstep import ErrorCode, ModelWord, Slot, Stat, SyncSession, Writer
from processors.base import request_pairing
from processors.model_runner import SpeculativeRunner

__all__ = ["SpeculativeSampler"]

logger = logging.getLogger(__name__)


class SpeculativeSampler:
    """Replaces a model runner's sampling step and its drafter's draws; see the module docstring."""

    def __init__(
        self, runner: SpeculativeRunner, session: str, alpha_method: str, alpha_config: dict, vocab: int
    ) -> None:
        self.runner = runner
        self.session = SyncSession.attach(session)
        self.alpha_computer = get_alpha_computer(alpha_method, **alpha_config)
        self.vocab = vocab
        self._plan: list[tuple[int, int]] = []
        """(seed, index of the next generated token) per batch row, for the drafts proposed after this step."""
        self._draft_calls = 0
        self._warned = False

    def install(self) -> None:
        self.runner.install(self, self.sample, self.draft)

    # ------------------------------------------------------------------ the teacher's step

    def sample(self, logits: torch.Tensor, metadata: Any) -> Any:
        runner, vocab = self.runner, self.vocab
        batch = runner.batch()
        b = len(batch)
        # The logits hold, per request, its n drafted positions then its bonus position, so the indices are derived
        # on the host from the counts; only the draft ids are read back from the device (one wait, the other being
        # the decision's result).
        num_draft, draft_ids = runner.drafts(metadata)
        cu = list(itertools.accumulate(num_draft))
        bonus = [c - 1 for c in itertools.accumulate(n + 1 for n in num_draft)]
        target = [i for n, last in zip(num_draft, bonus) for i in range(last - n, last)]
        gamma = runner.gamma
        out = torch.full((b, max(num_draft, default=0) + 1), -1, dtype=torch.int32)
        teacher_index, theta_rows, spans, owners = [], [], [], []
        rows_so_far = 0
        self._plan = []
        for i, (params, done, drafted) in enumerate(batch):
            pairing = request_pairing(params, "teacher")
            seed = int(pairing["sampling"]["seed"])
            self._plan.append((seed, max(done - 1, 0)))
            if done == 0:  # the prompt's last token, held back by the driver: theta drafts from the whole prompt
                out[i, 0] = int(pairing["force"])
                continue
            n = num_draft[i]
            # The drafter computed γ rows; when vLLM scheduled fewer drafts (n < γ), theta's row after the last one
            # is at hand, and the teacher's bonus row beside it: the round may end with a draw from q there.
            extra = int(n < gamma)
            if drafted is None:
                self._fail(i, pairing, ErrorCode.DECISION_ERROR, done - 1, out, "no draft rows")
                continue
            teacher_index += target[cu[i] - n : cu[i]] + [bonus[i]] * extra
            theta_rows.append(drafted[: n + extra, :vocab])  # log π_θ: what draft() returned
            spans.append(Span(rows_so_far, tuple(draft_ids[cu[i] - n : cu[i]]), seed, done - 1, bool(extra)))
            rows_so_far += n + extra
            # Generated tokens this request may still take: vLLM cuts a row at max_tokens, the slot must hold it.
            owners.append((i, pairing, int(params.max_tokens) - done))
        if spans:
            # One index for every request's teacher rows, sent as the uniforms are (a list index would be copied
            # from pageable memory once per request, each copy a wait).
            index = send(teacher_index, logits.device).long()
            self._verify(logits.index_select(0, index)[:, :vocab], torch.cat(theta_rows), spans, owners, out)
        self.session.add_model_stat(0, ModelWord.STEPS, 1)
        self.session.add_model_stat(0, ModelWord.ROWS, b)  # the health watch reads rows served as progress
        self._draft_calls = 0
        sampled = out.pin_memory() if logits.device.type == "cuda" else out
        return runner.output(sampled.to(logits.device, non_blocking=True))

    def _verify(self, teacher: torch.Tensor, theta: torch.Tensor, spans: list[Span], owners: list, out) -> None:
        try:  # one wait on the device for the whole batch (verify_drafts)
            rows = ModelRows.pair(teacher, theta, theta_normalized=True)
            rounds = verify_drafts(rows, spans, self.alpha_computer)
        except Exception:  # an exception here fails these requests, never the engine
            logger.exception("dual-sampling: the speculative decision failed")
            for span, (i, pairing, _) in zip(spans, owners):
                self._fail(i, pairing, ErrorCode.DECISION_ERROR, span.step, out, "decision error")
            return
        s = self.session
        good = []
        for span, (i, pairing, left), r in zip(spans, owners, rounds):
            if r.finite:
                good.append((span, i, pairing, left, r))
            else:
                self._fail(i, pairing, ErrorCode.BAD_LOGITS, span.step, out, "non-finite logits")
        # Checked: the drafts up to and including a round's first rejection (those after it are never looked at), so
        # accepted / checked estimates the per-position acceptance Σ min(π_θ, q).
        s.add_stat(Stat.DRAFTED, sum(min(len(span.drafts), r.accepted + 1) for span, *_, r in good))
        s.add_stat(Stat.ACCEPTED, sum(r.accepted for *_, r in good))
        for span, i, pairing, left, r in good:
            emitted = min(len(r.tokens), left)
            records = r.token_records()[:emitted]
            slot, step = int(pairing["slot"]), span.step
            if int(s.control[slot, Slot.KEY]) != int(pairing["key"]):  # the driver closed it (an abort): not ours now
                out[i, :emitted] = torch.tensor(r.tokens[:emitted], dtype=torch.int32)
                continue
            if not bool(torch.isfinite(records).all()):
                self._fail(i, pairing, ErrorCode.NON_FINITE, step, out, "non-finite records")
                continue
            s.records[slot, step : step + emitted] = records.numpy()
            s.tokens[slot, step : step + emitted] = r.tokens[:emitted]
            s.control[slot, Slot.NUM_RECORDS] = step + emitted
            out[i, :emitted] = torch.tensor(r.tokens[:emitted], dtype=torch.int32)
            self._plan[i] = (span.seed, step + emitted)

    def _fail(self, i: int, pairing: dict, code: ErrorCode, step: int, out: torch.Tensor, why: str) -> None:
        """Fail one request: its slot records ``code``, and its first stop token ends it in vLLM."""
        logger.warning("dual-sampling: request in slot %s failed at step %s: %s", pairing["slot"], step, why)
        self.session.fail_slot(int(pairing["slot"]), int(pairing["key"]), code, step, Writer.PROCESSOR.at(0))
        out[i, 0] = int(pairing["sampling"]["stop_token_ids"][0])

    # ------------------------------------------------------------------ theta's drafts

    def draft(self, logits: torch.Tensor, sampling_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Theta's draft of every batch row at the next draft position: (token ids, log π_θ rows)."""
        k, self._draft_calls = self._draft_calls, self._draft_calls + 1
        # π_θ is normalised over the tokenizer's ids: embedding rows past it (a padded vocabulary) are never drafted,
        # and a softmax over the whole width would leave the row sub-normalised, so every ratio q/π_θ and the
        # recorded log π_θ would be off by the mass on the padding rows.
        logp = torch.full(logits.shape, -math.inf, dtype=torch.float32, device=logits.device)
        logp[:, : self.vocab] = torch.log_softmax(logits[:, : self.vocab].float(), dim=-1)
        rows = logp.shape[0]
        if len(self._plan) != rows and not self._warned:
            self._warned = True
            logger.warning(
                "dual-sampling: %d draft rows for %d requests; drafts are not seed-reproducible", rows, len(self._plan)
            )
        plan = self._plan if len(self._plan) == rows else [(0, 0)] * rows
        u = send([stream_uniform(seed, nxt + k, "draft") for seed, nxt in plan], logits.device)
        tokens, _ = inverse_cdf(logp[:, : self.vocab].exp(), u)  # on the logits' device: no wait per draft
        return tokens, logp
