"""Dynamic micro-batching: concurrent requests' items coalesced into one call in a worker thread.

Encoding 32 queries in one forward pass costs far less than 32 passes of one (fixed per-call
overhead, matrix shapes the hardware likes), so a server that waits a few milliseconds for
company and then runs one batched call serves more requests per second at a small latency cost.

The batcher is generic: `fn(items) -> results` gets a list of items and returns one result per
item, in order; a result may be an exception instance, which fails only that item's caller. While
one batch runs in the worker thread the next one accumulates, so under load batches fill up by
themselves; `max_wait_ms` only bounds how long the first item of a quiet period waits.
With `enabled=False` every `submit_many` call runs on its own (in the default thread pool,
concurrently) — the baseline a server without micro-batching would be.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["BatcherClosedError", "MicroBatcher"]

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class BatcherClosedError(RuntimeError):
    """An item submitted after `close()` (the server is shutting down)."""


@dataclass
class _Entry(Generic[T, R]):
    item: T
    future: asyncio.Future[R]


class MicroBatcher(Generic[T, R]):
    """Coalesce items up to `max_batch`, waiting at most `max_wait_ms` for the batch to fill.

    `on_batch(size, seconds)` is called after every call of `fn` (metrics). The batcher binds to
    the event loop of its first `submit`, so it can be built outside any loop.
    """

    def __init__(self, fn: Callable[[list[T]], Sequence[R | BaseException]], *, max_batch: int = 64,
                 max_wait_ms: float = 5.0, enabled: bool = True, name: str = "batch",
                 on_batch: Callable[[int, float], None] | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        self.fn = fn
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.enabled = enabled
        self.name = name
        self.on_batch = on_batch
        self._pending: deque[_Entry[T, R]] = deque()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    # ---- submitting ----------------------------------------------------------------------
    async def submit(self, item: T) -> R:
        (result,) = await self.submit_many([item])
        return result

    async def submit_many(self, items: Sequence[T]) -> list[R]:
        """Results for `items` in order; the first failed item's exception is raised."""
        if self._closed:
            raise BatcherClosedError(f"{self.name} batcher is closed")
        items = list(items)
        if not items:
            return []
        if not self.enabled:
            return await self._run_unbatched(items)
        self._ensure_started()
        assert self._wakeup is not None and self._loop is not None
        entries = [_Entry(item, self._loop.create_future()) for item in items]
        self._pending.extend(entries)  # no await in between: a request's items stay adjacent
        self._wakeup.set()
        return list(await asyncio.gather(*(e.future for e in entries)))

    async def _run_unbatched(self, items: list[T]) -> list[R]:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        results = await loop.run_in_executor(None, self.fn, items)
        self._report(len(items), time.perf_counter() - started)
        out: list[R] = []
        for result in self._check_length(results, len(items)):
            if isinstance(result, BaseException):
                raise result
            out.append(result)
        return out

    # ---- the collecting loop -------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rmm-{self.name}")
        self._task = self._loop.create_task(self._collect(), name=f"rmm-{self.name}-batcher")

    async def _collect(self) -> None:
        assert self._wakeup is not None and self._loop is not None
        loop = self._loop
        while True:
            while not self._pending:
                if self._closed:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
            deadline = loop.time() + self.max_wait
            while len(self._pending) < self.max_batch and not self._closed:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except TimeoutError:
                    break
            batch = [self._pending.popleft() for _ in range(min(self.max_batch, len(self._pending)))]
            batch = [e for e in batch if not e.future.done()]  # callers that gave up (disconnects)
            if batch:
                await self._dispatch(batch)

    async def _dispatch(self, batch: list[_Entry[T, R]]) -> None:
        assert self._loop is not None
        started = time.perf_counter()
        try:
            results = await self._loop.run_in_executor(self._executor, self.fn, [e.item for e in batch])
            results = self._check_length(results, len(batch))
        except Exception as exc:  # the whole call failed: every caller in it gets the error
            log.exception("%s batch of %d failed", self.name, len(batch))
            for entry in batch:
                if not entry.future.done():
                    entry.future.set_exception(exc)
            return
        finally:
            self._report(len(batch), time.perf_counter() - started)
        for entry, result in zip(batch, results):
            if entry.future.done():
                continue
            if isinstance(result, BaseException):
                entry.future.set_exception(result)
            else:
                entry.future.set_result(result)

    def _check_length(self, results: Sequence[R | BaseException], n: int) -> Sequence[R | BaseException]:
        if len(results) != n:
            raise RuntimeError(f"{self.name} batch function returned {len(results)} results for {n} items")
        return results

    def _report(self, size: int, seconds: float) -> None:
        if self.on_batch is not None:
            try:
                self.on_batch(size, seconds)
            except Exception:  # metrics must never fail a request
                log.exception("on_batch callback failed")

    # ---- shutdown ------------------------------------------------------------------------
    async def close(self) -> None:
        """Refuse new items, finish the queued ones, stop the worker thread."""
        self._closed = True
        if self._task is not None:
            assert self._wakeup is not None
            self._wakeup.set()
            try:
                await self._task
            finally:
                self._task = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
