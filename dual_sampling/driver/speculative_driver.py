"""The driver of ``mode="speculative"``: the lockstep driver's slots, session, records and failure handling, over one
engine whose sampling step checks theta's drafts against q (``processors.speculative``).

What differs from :class:`~dual_sampling.driver.lockstep_driver.LockstepDriver`:

- a request goes to one engine, its prompt without the last token, which the engine's step emits first and the
  driver drops (so theta's drafts condition on the whole prompt, and every generated token has both rows);
- stop strings, EOS and ``max_tokens`` are vLLM's own (no lockstep scheduler runs): the engine is asked for one
  token more than the request, for the held-back one;
- an abort is vLLM's abort;
- only requests the mode can serve exactly are accepted (:func:`check_speculative`), and theta's weights cannot be
  replaced (it is the engine's draft model; vLLM reloads the target's weights only).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from dual_sampling.decision.pipeline import RowSampling
from dual_sampling.driver.collect import delta_of
from dual_sampling.driver.lockstep_driver import LockstepDriver
from dual_sampling.driver.requests import DualRequest, Flight
from dual_sampling.lockstep import RequestFailed
from dual_sampling.records import SampleRecord
from dual_sampling.roster import THETA, Role
from dual_sampling.text import sample_text

__all__ = ["SpeculativeDriver", "check_speculative", "start_speculative"]

SERVED = ("seed", "stop_token_ids")
"""RowSampling fields the speculative mode serves at any value; every other field must keep its default."""


def check_speculative(request: DualRequest) -> None:
    """Refuse, naming the field, a request the speculative mode cannot draw exactly from q. (Its length is the
    lockstep check's: the driver's ``max_model_len`` is what a request may use, the engine's holds 2γ more.)"""
    defaults = RowSampling()
    for f in dataclasses.fields(RowSampling):
        if f.name not in SERVED and getattr(request.sampling, f.name) != getattr(defaults, f.name):
            raise ValueError(
                f"{f.name} is not served in mode='speculative' (got {getattr(request.sampling, f.name)!r}; only "
                "plain sampling at temperature 1; use mode='lockstep')"
            )
    if request.teacher_prompt_ids != request.theta_prompt_ids:
        raise ValueError(
            "teacher_prompts: mode='speculative' gives both models the same prompt (theta drafts inside the "
            "teacher's engine, from the teacher's tokens); use mode='lockstep' for teacher hints"
        )
    prompt = request.teacher_prompt_ids
    if len(prompt) < 2:
        raise ValueError(
            "prompt: mode='speculative' needs at least 2 prompt tokens (the last one is emitted by the step)"
        )
    if not request.sampling.stop_token_ids:
        raise ValueError("stop_token_ids: mode='speculative' needs one (a failed request is ended with it)")
    if prompt[-1] in request.sampling.stop_token_ids:
        raise ValueError("prompt: its last token is a stop token, which would end the request at once")


class SpeculativeDriver(LockstepDriver):
    """One speculative engine behind the lockstep driver's API; see the module docstring."""

    def __init__(self, *args: Any, alpha: tuple[str, dict[str, Any]], gamma: int, **kwargs: Any) -> None:
        self.gamma = gamma
        self._alpha_start = alpha
        self._aborting: set[asyncio.Future] = set()
        super().__init__(*args, **kwargs)

    async def start_engines(self, engine_factory: Any) -> Any:
        engines = await super().start_engines(engine_factory)
        method, config = self._alpha_start
        vocab = self.session.layout.vocab
        gammas = await engines.teacher.collective_rpc(
            "dual_sampling_install_speculative", args=(self.session.name, method, config, vocab)
        )
        if list(gammas) != [self.gamma]:
            raise RuntimeError(f"the speculative step was installed on {len(gammas)} workers with γ = {gammas}")
        return engines

    def check(self, request: DualRequest) -> None:
        super().check(request)
        check_speculative(request)

    def abort_launched(self, flight: Flight) -> None:
        task = asyncio.ensure_future(self.engines.teacher.abort(flight.request_id))
        self._aborting.add(task)  # held until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._aborting.discard)

    def engine_holding(self, role: Role) -> Any:
        """The one engine: theta is its draft model (updated through its weight-transfer engine's draft start)."""
        return self.engines.teacher

    def statistics(self) -> dict[str, float | str]:
        stats = super().statistics()
        stats["mode"] = "speculative"
        stats["num_speculative_tokens"] = self.gamma
        drafted = stats.get("drafted", 0)
        stats["acceptance"] = stats.get("accepted", 0) / drafted if drafted else float("nan")
        return stats

    async def relay(self, flight: Flight) -> None:
        """Submit one request to the engine, its prompt less the last token; relay the tokens after that one."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        r = flight.request
        prompt = r.teacher_prompt_ids
        pairing = {"slot": flight.slot, "key": flight.key, "sampling": r.sampling.to_dict(), "force": prompt[-1]}
        params = SamplingParams(
            n=1,
            temperature=1.0,  # not greedy: vLLM's drafter then keeps its rows (the mixture's step draws every token)
            max_tokens=r.max_tokens + 1,  # the held-back prompt token comes first
            stop_token_ids=list(r.sampling.stop_token_ids),
            stop=list(r.stop) or None,
            detokenize=bool(r.stop),
            output_kind=RequestOutputKind.DELTA,
            extra_args={"dual_sampling": pairing},
        )
        try:
            await self._run(flight, prompt, params)
        finally:
            # No plugin on the engine says when it lets a request go; its final output (or the abort that closed
            # the stream) does. A step still running for it writes nothing once the slot is closed (its key).
            for position in range(self.session.layout.models):
                self.session.release(flight.slot, flight.key, position)

    async def _run(self, flight: Flight, prompt: list[int], params: Any) -> None:
        held_back = True
        async for out in self.engines.teacher.generate({"prompt_token_ids": prompt[:-1]}, params, flight.request_id):
            completion = out.outputs[0]
            new = list(completion.token_ids)
            if held_back and new:
                if new[0] != prompt[-1]:
                    raise RequestFailed(f"the engine's first token was {new[0]}, not the prompt's last {prompt[-1]}")
                new, held_back = new[1:], False
            start = len(flight.tokens)
            flight.tokens += new
            if out.finished:
                sample = self._finish_speculative(flight, completion)
                flight.outbox.put_nowait(delta_of(self.session, flight, start, sample))
                return
            if new:
                flight.outbox.put_nowait(delta_of(self.session, flight, start))
        raise RequestFailed("the engine ended a request without a final output")

    def _finish_speculative(self, flight: Flight, completion: Any) -> SampleRecord:
        """The verified sample (the tokens the engine emitted, each with its record), ended as vLLM ended it."""
        sample = self.finish(flight, {THETA: list(flight.tokens)}, completion.finish_reason)
        if sample.finish_reason == "stop" and flight.tokens:
            # A stop string (vLLM names it), else a stop token: EOS (vLLM names none) or one of stop_token_ids.
            stop = completion.stop_reason
            string = stop if isinstance(stop, str) else None
            sample.stop_reason = string if string is not None else flight.tokens[-1]
            sample.text = sample_text(self.tokenizer, flight.tokens, string, stop_token=string is None)
        return sample


def start_speculative(config: Any, tokenizer: Any, engine_len: int, **settings: Any) -> SpeculativeDriver:
    """The driver of ``mode="speculative"`` (``dual_sampling.modes``): the teacher's engine, of ``engine_len``
    positions, with theta as its draft model; ``settings`` are the driver's (its ``max_model_len`` keeps 2γ free)."""
    from dual_sampling.driver.speculative_engine import SpeculativeEngine

    return SpeculativeDriver(
        lambda session_name: SpeculativeEngine(config, session_name, engine_len),
        tokenizer,
        alpha=(config.alpha_method, config.alpha_kwargs),
        gamma=config.num_speculative_tokens,
        **settings,
    )
