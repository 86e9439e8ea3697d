"""The service behind the routes (:class:`DualService`): admission (a bound on the samples held, 429 past it), the
fan-out of a request's samples to the dual engine and back as they come, and the answer, whole or as server-sent
events; :class:`Reservation` is the room one request holds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from dual_sampling.lockstep import SyncError
from dual_sampling.records import SampleDelta, best_of
from dual_sampling.server import render
from dual_sampling.server.metrics import Metrics
from dual_sampling.server.serve_options import ServeOptions
from dual_sampling.server.translate import Job, Translator
from dual_sampling.server.wire import BadRequest, error_body
from dual_sampling.text import TextStream

__all__ = ["DualService", "Reservation"]

logger = logging.getLogger(__name__)


class DualService:
    """The server's state: the dual engine, admission, metrics."""

    def __init__(self, dual: Any, options: ServeOptions) -> None:
        self.dual, self.options = dual, options
        self.held = 0
        """Samples accepted and not yet finished."""
        self.metrics = Metrics(self)
        self.translator = Translator(dual, options)
        self._pieces: dict[int, str] = {}
        # Parsing, templating and tokenizing take long for long bodies: one thread of their own keeps the event
        # loop (and /health) free. At most max_queue requests wait for it; past that a request gets 429.
        self.parser = ThreadPoolExecutor(1, thread_name_prefix="dual-sampling-parse")
        self.parsing = 0
        """Requests waiting for or in the parse thread."""

    # ------------------------------------------------------------------ parsing

    def parse(self, raw: bytes, kind: str, arrival: float) -> Job:
        """Read, validate and translate a request body (runs in :attr:`parser`, off the event loop).

        ``arrival`` (time.monotonic()) starts the request's ``request_timeout``.
        """
        return self.translator.parse(raw, kind, arrival)

    # ------------------------------------------------------------------ running

    def admit(self, job: Job) -> Reservation:
        """Hold room for the job's samples, or refuse at once (503 with dead engines, 429 past the bound)."""
        failure = self.dual.failure
        if failure is not None:
            raise BadRequest(f"the engines are not running: {failure}", None, 503, "service_unavailable")
        draws = job.sampling.draws
        if self.held + draws > self.options.max_queue:
            self.metrics.rejected += 1
            message = (
                f"the server holds {self.held} samples, the most it takes is {self.options.max_queue}; retry later"
            )
            raise BadRequest(message, None, 429, "rate_limit_error")
        self.held += draws
        return Reservation(self, draws)

    async def samples(self, job: Job) -> AsyncIterator[tuple[int, SampleDelta]]:
        """(sample index, delta) from every sample of ``job``, as they come; BadRequest(504) past its deadline."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def one(index: int) -> None:
            try:
                last = None
                async for last in self.dual.stream(
                    job.theta_ids,
                    job.teacher_ids,
                    sampling=job.sampling,
                    sample_key=0,
                    sample_index=index,
                    teachers=job.teachers,
                ):
                    queue.put_nowait((index, last))
                if last is None or last.sample is None:  # the driver was closed under it
                    raise SyncError(f"the dual engine stopped before sample {index} ended")
            except BaseException as exc:
                queue.put_nowait((index, exc))
                raise
            finally:
                queue.put_nowait((index, done))

        tasks = [asyncio.ensure_future(one(i)) for i in range(job.sampling.draws)]
        try:
            remaining = len(tasks)
            while remaining:
                try:
                    index, item = await asyncio.wait_for(queue.get(), max(0.0, job.deadline - time.monotonic()))
                except TimeoutError:
                    message = f"the request ran past request_timeout={self.options.request_timeout} s and was aborted"
                    raise BadRequest(message, None, 504, "timeout_error") from None
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    if isinstance(item, asyncio.CancelledError):
                        continue
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()  # aborts the samples still running on both engines
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ answers

    def piece(self, token: int) -> str:
        """One token decoded alone (cached: logprobs with alternatives decode hundreds of thousands)."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.dual.tokenizer.decode([token])
        return text

    async def complete(self, job: Job) -> bytes:
        """The whole response of a non-streaming request, as JSON bytes (a DualCompletionResponse or
        DualChatCompletionResponse)."""
        if job.sampling.use_beam_search:
            return await self._beam_search(job)
        deltas: dict[int, list[SampleDelta]] = {}
        # aclosing: a cancelled handler aborts its samples before it returns, not whenever the loop gets round to
        # finalising the abandoned generator (under load in CI the request then ran to its end).
        async with contextlib.aclosing(self.samples(job)) as samples:
            async for index, delta in samples:
                deltas.setdefault(index, []).append(delta)
        samples = [(i, ds) for i, ds in sorted(deltas.items())]
        if job.sampling.best_of:
            try:
                kept = best_of([ds[-1].sample for _, ds in samples], job.sampling.n, job.sampling.best_of_score)
            except ValueError as exc:  # drawn by two weight versions: the scores do not compare
                raise BadRequest(str(exc), "best_of", 409, "conflict") from None
            samples = [samples[k] for k in kept]
        for _, ds in samples:
            self.metrics.observe(ds[-1].sample)
        # Assembled and written off the event loop: n=16 with 20 alternatives per token is tens of MB of JSON.
        return await asyncio.to_thread(render.response_body, job, [ds for _, ds in samples], self.piece)

    async def _beam_search(self, job: Job) -> bytes:
        """The response of a ``use_beam_search`` request: its n best beams over q as the choices, each token with its
        records (as a sample's); BadRequest(504) past its deadline."""
        pair = self.dual.prepare(job.theta_ids, job.teacher_ids)
        search = self.dual.beam_search_samples(pair, job.sampling, [job.sampling.seed] * job.sampling.n)
        try:
            beams = await asyncio.wait_for(search, max(0.0, job.deadline - time.monotonic()))
        except TimeoutError:
            message = f"the request ran past request_timeout={self.options.request_timeout} s and was aborted"
            raise BadRequest(message, None, 504, "timeout_error") from None
        answers = []
        for sample in beams:
            columns = sample.columns()  # beam search is a pair's: its columns are job.columns
            records = np.array([columns[c] for c in job.columns], dtype=np.float32).T.reshape(-1, len(job.columns))
            answers.append([SampleDelta(sample.token_ids, records, sample)])
            self.metrics.observe(sample)
        return await asyncio.to_thread(render.response_body, job, answers, self.piece)

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """Server-sent events: OpenAI chunks, then ``data: [DONE]``; a failure ends it with an error event first."""
        request_id = render.response_id(job)
        created = int(time.time())
        tok = self.dual.tokenizer
        texts = {i: TextStream(tok, job.sampling.stop, job.sampling.stop_token_ids) for i in range(job.sampling.n)}
        completion_tokens = 0
        if job.kind == "chat":
            for i in range(job.sampling.n):
                yield render.sse(render.chunk(job, request_id, created, i, {"role": "assistant", "content": ""}))
        try:
            # aclosing: however this stream ends, its samples are aborted before the caller releases their room.
            async with contextlib.aclosing(self.samples(job)) as samples:
                async for index, delta in samples:
                    extra = render.token_records(job.columns, delta.token_ids, delta.records, delta.sample, delta.dense)
                    logprobs = render.logprobs_block(job, delta.token_ids, delta.records, delta.top, self.piece)
                    if delta.sample is None:
                        piece = texts[index].push(delta.token_ids)
                        yield render.sse(
                            render.chunk(job, request_id, created, index, piece, logprobs=logprobs, extra=extra)
                        )
                        continue
                    sample = delta.sample
                    completion_tokens += len(sample.token_ids)
                    self.metrics.observe(sample)
                    piece = texts[index].finish(sample.text)
                    yield render.sse(
                        render.chunk(
                            job,
                            request_id,
                            created,
                            index,
                            piece,
                            logprobs=logprobs,
                            extra=extra,
                            finish_reason=sample.finish_reason,
                            stop_reason=sample.stop_reason,
                        )
                    )
        except SyncError as exc:
            yield render.sse(error_body(str(exc), 503, "service_unavailable"))
        except BadRequest as exc:
            yield render.sse(error_body(exc.message, exc.status, exc.kind, exc.param))
        except Exception:
            logger.exception("a stream failed inside the server")
            self.metrics.server_errors.inc()
            yield render.sse(error_body("internal server error (logged)", 500, "internal_server_error"))
        if job.include_usage:
            usage = render.usage(len(job.theta_ids) * job.sampling.n, completion_tokens)
            yield render.sse(
                {
                    "id": request_id,
                    "object": render.chunk_object(job),
                    "created": created,
                    "model": job.model,
                    "choices": [],
                    "usage": usage,
                }
            )
        yield "data: [DONE]\n\n"

    def healthy(self) -> bool:
        """Both engines run: none exited, and vLLM declared none dead."""
        return self.dual.healthy()


class Reservation:
    """Room held for one request's samples; released once, however the request ends."""

    def __init__(self, service: DualService, draws: int) -> None:
        self.service, self.draws = service, draws

    def release(self) -> None:
        if self.draws:
            self.service.held -= self.draws
            self.draws = 0
