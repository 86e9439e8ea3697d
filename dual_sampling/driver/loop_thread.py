"""The driver's asyncio loop on a thread of its own, and the ways into it from other threads and loops.

One loop serves blocking callers (``OptimalSamplingDual.generate``), asyncio callers on
loops of their own (the server) and Ray actors alike: each reaches it through
:meth:`LoopThread.call` (blocking), :meth:`LoopThread.run` (a coroutine) or
:meth:`LoopThread.bridge` (an async iterator).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread", "as_coroutine"]

T = TypeVar("T")

_POLL_S = 0.05
"""How often a blocking :meth:`LoopThread.submit` checks that the loop still runs."""


async def as_coroutine(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` as a coroutine, to run it on the loop from another thread."""
    return function(*args)


class LoopThread:
    """An asyncio loop running forever on a daemon thread.

    ``interrupt_wait`` (seconds) bounds how long :meth:`call` waits for a cancelled coroutine
    to wind down after a KeyboardInterrupt before it re-raises.
    """

    def __init__(self, name: str, interrupt_wait: float) -> None:
        self.interrupt_wait = interrupt_wait
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    @property
    def on_loop(self) -> bool:
        """Whether the caller runs on the loop's own thread."""
        return threading.get_ident() == self.thread.ident

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop from another thread and return its result.

        A KeyboardInterrupt (or a SystemExit from SIGTERM) while waiting cancels it: its
        requests are aborted on both engines, and it is raised again once they are released.
        That holds wherever the interrupt lands, even before the future is in hand (between
        scheduling the coroutine and waiting on it, where the loop may already run it).
        """
        started, finished, abandoned = threading.Event(), threading.Event(), threading.Event()
        tasks: list[asyncio.Task] = []

        async def tracked() -> T:
            tasks.append(asyncio.current_task())
            started.set()
            try:
                if abandoned.is_set():  # interrupted before it began: none of its work starts
                    coro.close()
                    raise asyncio.CancelledError
                return await coro
            finally:
                finished.set()

        future = None
        try:
            future = asyncio.run_coroutine_threadsafe(tracked(), self.loop)
            return future.result(timeout)
        except (KeyboardInterrupt, SystemExit):
            # Set before ``started`` is read, as tracked() sets ``started`` before it reads this: one of the two sees
            # the other, so a coroutine that begins late ends at once, and one that began is cancelled once.
            abandoned.set()
            if future is not None:
                # cancel() marks the future cancelled at once, before the coroutine has even seen it: its own end
                # (its requests released) is waited out on the event its finally sets, if it began.
                future.cancel()
            elif started.is_set():  # the interrupt came before the future was in hand, the coroutine running
                self.loop.call_soon_threadsafe(tasks[0].cancel)
            if started.is_set():
                # A second interrupt meanwhile propagates at once.
                finished.wait(self.interrupt_wait)
            raise

    def submit(self, function: Callable[..., T], *args: Any, default: T) -> T:
        """``function(*args)`` on the loop, from another thread; ``default`` if the loop stops before it runs.

        Waits in short polls, so a loop stopped meanwhile (by :meth:`stop`) never leaves the caller waiting.
        """
        if not self.loop.is_running():
            return default
        future = asyncio.run_coroutine_threadsafe(as_coroutine(function, *args), self.loop)
        while True:
            with contextlib.suppress(concurrent.futures.TimeoutError):
                return future.result(_POLL_S)
            if not self.loop.is_running() and not future.done():
                return default

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the loop from any asyncio loop; cancelling the caller cancels it."""
        if asyncio.get_running_loop() is self.loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def bridge(self, aiter: AsyncIterator[T]) -> AsyncIterator[T]:
        """Iterate ``aiter`` (which runs on the loop) from the caller's own loop; cancelling ends it."""
        caller = asyncio.get_running_loop()
        if caller is self.loop:
            async for item in aiter:
                yield item
            return
        inbox: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump() -> None:
            try:
                async for item in aiter:
                    caller.call_soon_threadsafe(inbox.put_nowait, (item, None))
                caller.call_soon_threadsafe(inbox.put_nowait, (done, None))
            except BaseException as exc:  # delivered to the caller, which re-raises it
                caller.call_soon_threadsafe(inbox.put_nowait, (done, exc))

        task = asyncio.run_coroutine_threadsafe(pump(), self.loop)
        try:
            while True:
                item, exc = await inbox.get()
                if item is done:
                    if exc is not None and not isinstance(exc, asyncio.CancelledError):
                        raise exc
                    return
                yield item
        finally:
            task.cancel()

    def stop(self) -> None:
        """Stop the loop and join its thread (at most 10 s)."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
