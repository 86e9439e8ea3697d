"""vLLM's model runner as the plugins meet it: Model Runner V1, the one module that speaks its interface.

Every plugin that runs inside a worker reaches vLLM's model runner through this module only, so a port to Model
Runner V2 changes this module and nothing else of ours (``tests/test_layout.py`` holds the other modules to it;
``docs/architecture.md`` lists what such a port needs). Three seams:

- **Logits processors** (the lockstep plugins): :class:`BatchRowsProcessor` is a V1 ``LogitsProcessor``. It follows
  the persistent batch through V1's ``BatchUpdate`` (removed, then added, then moved, SWAPs included) and hands each
  step's rows, keyed by batch index, to :meth:`BatchRowsProcessor.process`. A row's generated tokens are V1's live
  list from the ``added`` tuple: its length is the row's step.
- **The sampling step** (the speculative mode): :class:`SpeculativeRunner` replaces the runner's ``_sample`` and its
  drafter's ``_sample_from_logits``, and reads the batch, the drafts and the drafter's rows where V1 keeps them.
- **The worker** (the worker extension): :func:`runner_model`, :func:`logits_processors`, :func:`speculative_runner`,
  :func:`installed_speculative`.

The driver asks for V1 with :func:`prefer_v1_runner` before an engine starts and refuses one that runs V2
(:func:`runner_problem`); V2 takes processors of another shape (``apply(logits, ctx)`` keyed by request slot) and
refuses V1's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

__all__ = [
    "RUNNER_VARIABLE",
    "BatchRowsProcessor",
    "SpeculativeRunner",
    "installed_speculative",
    "logits_processors",
    "prefer_v1_runner",
    "runner_model",
    "runner_problem",
    "speculative_runner",
]

RUNNER_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"
"""vLLM's switch between its model runners: "0" selects V1, whose interface the plugins implement."""

Row = TypeVar("Row")


def prefer_v1_runner() -> None:
    """Ask for Model Runner V1 in the engines this process starts, unless the user chose a runner (GPUs default to
    V2 since vLLM 0.32)."""
    os.environ.setdefault(RUNNER_VARIABLE, "0")


def runner_problem(vllm_config: Any) -> str | None:
    """Why an engine of ``vllm_config`` cannot host the plugins (it runs Model Runner V2), or None."""
    if vllm_config.use_v2_model_runner:
        return f"Model Runner V2 is on; the plugins implement V1's interface (set {RUNNER_VARIABLE}=0)"
    return None


class BatchRowsProcessor(LogitsProcessor, Generic[Row]):
    """A V1 logits processor that keeps one row object per request of its persistent batch, keyed by batch index.

    Subclasses say what a request's row is (:meth:`track`), what happens when it leaves (:meth:`untrack`), and what
    a step does with the logits of the rows it holds (:meth:`process`).
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, Row] = {}
        """The batch's rows by batch index."""
        self.attach(vllm_config, device)

    # ------------------------------------------------------------------ for subclasses

    def attach(self, vllm_config: Any, device: torch.device) -> None:
        """Set up for an engine of ``vllm_config`` whose logits live on ``device`` (called once, at the start)."""

    def track(self, params: Any, output_token_ids: list[int]) -> Row:
        """The row of a request entering the batch: its ``SamplingParams`` and its generated tokens (a live list)."""
        raise NotImplementedError

    def untrack(self, row: Row) -> None:
        """``row``'s request left the batch (finished, aborted or moved out)."""

    def process(self, logits: torch.Tensor, batch: list[tuple[int, Row]]) -> torch.Tensor:
        """This step's logits ``[num_rows, V]`` and the rows held, by batch index (ascending, all < num_rows)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ V1's interface

    def is_argmax_invariant(self) -> bool:
        # Ours force tokens, which changes the argmax: vLLM must run them for greedy requests too.
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._untrack(self.rows.pop(index, None))
        for index, params, _prompt_ids, output_ids in batch_update.added:
            self._untrack(self.rows.pop(index, None))
            self.rows[index] = self.track(params, output_ids)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if direction == MoveDirectionality.SWAP:
                if row_a is not None:
                    self.rows[b] = row_a
                if row_b is not None:
                    self.rows[a] = row_b
            else:
                # One-way move a -> b; whatever sat at b was already removed.
                self._untrack(row_b)
                if row_a is not None:
                    self.rows[b] = row_a

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        batch = [(i, row) for i, row in sorted(self.rows.items()) if i < logits.shape[0]]
        return self.process(logits, batch) if batch else logits

    def _untrack(self, row: Row | None) -> None:
        if row is not None:
            self.untrack(row)


class SpeculativeRunner:
    """A V1 model runner with a draft model (vLLM's ``draft_model`` speculation), as the speculative mode uses it."""

    def __init__(self, runner: Any) -> None:
        if getattr(runner, "drafter", None) is None:
            raise RuntimeError("this engine runs no draft model: mode='speculative' needs speculative_config")
        self._runner = runner

    @property
    def gamma(self) -> int:
        """Draft tokens per round (γ)."""
        return int(self._runner.num_spec_tokens)

    def install(
        self,
        owner: object,
        sample: Callable[[torch.Tensor, Any], Any],
        draft: Callable[[torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Replace the runner's sampling step by ``sample(logits, metadata)`` and its drafter's draws by
        ``draft(logits, metadata) -> (token ids, log-probability rows)``; :func:`speculative_runner` finds ``owner``."""
        self._runner._sample = sample
        self._runner.drafter._sample_from_logits = draft
        self._runner.dual_sampling_speculative = owner

    def batch(self) -> list[tuple[Any, int, torch.Tensor | None]]:
        """Per batch row, in batch order: the request's ``SamplingParams``, the tokens it generated so far, and the
        rows the drafter returned for it this round (``[γ, V']``, what the installed ``draft`` returned; None where
        it kept none)."""
        runner = self._runner
        probs = runner._draft_probs
        drafted = {rid: i for i, rid in enumerate(runner._draft_prob_req_ids or ())}
        out = []
        for rid in runner.input_batch.req_ids:
            state, row = runner.requests[rid], drafted.get(rid)
            rows = None if probs is None or row is None else probs[row]
            out.append((state.sampling_params, len(state.output_token_ids), rows))
        return out

    @staticmethod
    def drafts(metadata: Any) -> tuple[list[int], list[int]]:
        """A step's speculation metadata as (drafts per batch row, every row's draft ids, concatenated).

        With speculation on, V1 builds the metadata at every step (a request without drafts has 0). The step's
        logits hold, per request, its drafted positions then its bonus position (``_calc_spec_decode_metadata``).
        """
        return list(metadata.num_draft_tokens), metadata.draft_token_ids.tolist()

    @staticmethod
    def output(tokens: torch.Tensor) -> Any:
        """The step's result for V1: ``tokens`` ``[num_rows, max emitted]`` int32, -1 past each row's last."""
        from vllm.v1.outputs import SamplerOutput

        return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None)


def runner_model(worker: Any) -> Any:
    """The ``torch.nn.Module`` a worker's model runner runs."""
    return worker.model_runner.get_model()


def logits_processors(worker: Any) -> list[Any]:
    """Every logits processor a worker's model runner applies (vLLM's built-in ones included)."""
    return list(worker.model_runner.input_batch.logitsprocs.all)


def speculative_runner(worker: Any) -> SpeculativeRunner:
    """A worker's runner as a :class:`SpeculativeRunner` (RuntimeError where it runs no draft model)."""
    return SpeculativeRunner(worker.model_runner)


def installed_speculative(worker: Any) -> object | None:
    """The owner :meth:`SpeculativeRunner.install` installed on a worker's runner, or None."""
    return getattr(worker.model_runner, "dual_sampling_speculative", None)
