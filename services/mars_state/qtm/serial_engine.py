"""One blocking engine, driven from the event loop one call at a time, with a cap on calls in flight.

Why: vLLM's offline `LLM` is not safe to call from several threads, and a caller that gives up at its
deadline cannot stop a `generate` already running in a thread. So every call runs on one dedicated worker
thread (calls queue behind it, never overlap, even after their callers were cancelled), a call abandoned
before it started is dropped from the queue, and at most `max_in_flight` calls (the running one, the
abandoned one still running, and those queued) are admitted: past that a caller fails fast with
`EngineBusy`, an endpoint error, so the QTM guard answers from the rules instead of queueing behind a
stuck engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

from mars.llm_json import EndpointError

T = TypeVar("T")


class EngineBusy(EndpointError):
    """The engine already has its cap of calls in flight (an endpoint error: the guard falls back)."""


class SerialEngine:
    def __init__(self, max_in_flight: int = 4, name: str = "engine") -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.max_in_flight = max_in_flight
        self.name = name
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        # Admissions and releases come from the loop thread, the worker and cancelling callers.
        self._count_lock = threading.Lock()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        """Calls admitted and not finished: running (even if their caller left) or queued."""
        with self._count_lock:
            return self._in_flight

    def _release(self, _: concurrent.futures.Future[T]) -> None:
        with self._count_lock:
            self._in_flight -= 1

    async def run(self, call: Callable[[], T]) -> T:
        """`call()` on the worker thread after the calls admitted before it; EngineBusy past the cap."""
        with self._count_lock:
            if self._in_flight >= self.max_in_flight:
                raise EngineBusy(
                    f"{self.name}: {self._in_flight} calls already in flight (cap {self.max_in_flight})"
                )
            self._in_flight += 1
        try:
            future = self._worker.submit(call)
        except RuntimeError as exc:  # submitted after close()
            with self._count_lock:
                self._in_flight -= 1
            raise EndpointError(f"{self.name} is closed") from exc
        future.add_done_callback(self._release)
        # wrap_future cancels the queued call when the caller is cancelled (its deadline passed); a call
        # already running cannot be stopped and keeps the worker, so the next call waits for it.
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """Drop queued calls and stop admitting; a running call finishes in the background."""
        self._worker.shutdown(wait=False, cancel_futures=True)
