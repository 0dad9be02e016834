"""Dynamic micro-batching: concurrent requests' items coalesced into one call in a worker thread.

Encoding 32 queries in one forward pass costs far less than 32 passes of one (fixed per-call
overhead, matrix shapes the hardware likes), so a server that waits a few milliseconds for
company and then runs one batched call serves more requests per second at a small latency cost.

The batcher is generic: `fn(items) -> results` gets a list of items and returns one result per
item, in order; a result may be an exception instance, which fails only that item's caller. While
one batch runs in the worker thread the next one accumulates, so under load batches fill up by
themselves; `max_wait_ms` only bounds how long the first item of a quiet period waits (items that
queued while the worker was busy are dispatched without waiting).
With `enabled=False` every `submit_many` call runs on its own (in the default thread pool,
concurrently) — the baseline a server without micro-batching would be.

With `prepare`, a batch runs in two stages on two threads, `fn(items, prepare(items))`, as a
two-deep pipeline: the next batch's `prepare` runs while this batch's `fn` does, so a second core
works instead of idling (the server encodes queries in `prepare` and searches, reranks and persists
in `fn`). `fn` still sees one batch at a time, in arrival order, and at most one batch waits
between the stages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["BatcherClosedError", "MicroBatcher"]

log = logging.getLogger(__name__)

MIN_SPLIT = 8  # a pipeline splits a backlog only into halves of at least this many (small batches cost more per item)

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

    `on_batch(size, seconds)` is called after every call of `fn` (metrics): `seconds` is the
    batch's own work, `prepare` plus `fn`, not the time it waited for the previous batch's `fn`;
    `on_stage(stage, seconds)` reports each stage's work apart ("prepare", "finish"), so an
    operator sees which stage bounds the throughput. The batcher binds to the event loop of its
    first `submit`, so it can be built outside any loop.
    """

    def __init__(self, fn: Callable[..., Sequence[R | BaseException]], *, max_batch: int = 64,
                 max_wait_ms: float = 5.0, enabled: bool = True, name: str = "batch",
                 on_batch: Callable[[int, float], None] | None = None,
                 on_stage: Callable[[str, float], None] | None = None,
                 prepare: Callable[[list[T]], Any] | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        self.fn = fn
        self.prepare = prepare
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.enabled = enabled
        self.name = name
        self.on_batch = on_batch
        self.on_stage = on_stage
        self._pending: deque[_Entry[T, R]] = deque()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._prepare_executor: ThreadPoolExecutor | None = None
        self._closed = False

    # ---- submitting ----------------------------------------------------------------------
    async def submit(self, item: T) -> R:
        (result,) = await self.submit_many([item])
        return result

    async def submit_many(self, items: Sequence[T]) -> list[R]:
        """Results for `items` in order; the first failed item's exception is raised."""
        results = await self.submit_each(items)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results  # type: ignore[return-value]

    async def submit_each(self, items: Sequence[T]) -> list[R | Exception]:
        """Results for `items` in order, a failed item's exception in its place (the others still
        answered); only a failure of the whole batcher (closed) is raised."""
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
        return list(await asyncio.gather(*(e.future for e in entries), return_exceptions=True))

    async def _run_unbatched(self, items: list[T]) -> list[R | Exception]:
        loop = asyncio.get_running_loop()
        results, seconds = await loop.run_in_executor(None, self._call, items)
        self._report(len(items), seconds)
        return list(self._check_length(results, len(items)))  # type: ignore[arg-type]

    def _call(self, items: list[T]) -> tuple[Sequence[R | BaseException], float]:
        """Both stages in the calling thread (the unbatched baseline), and their work in seconds."""
        if self.prepare is None:
            return self._timed("finish", self.fn, items)
        prepared, seconds = self._timed("prepare", self.prepare, items)
        results, more = self._timed("finish", self.fn, items, prepared)
        return results, seconds + more

    def _timed(self, stage: str, call: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """`call(*args)` and its seconds (run in the worker thread, so queueing is not counted)."""
        started = time.perf_counter()
        try:
            return call(*args), time.perf_counter() - started
        finally:
            if self.on_stage is not None:
                self._guarded(self.on_stage, stage, time.perf_counter() - started)

    # ---- the collecting loop -------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rmm-{self.name}")
        if self.prepare is not None:
            self._prepare_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rmm-{self.name}-prepare")
        self._task = self._loop.create_task(self._collect(), name=f"rmm-{self.name}-batcher")

    async def _collect(self) -> None:
        assert self._wakeup is not None and self._loop is not None
        loop = self._loop
        second_stage: asyncio.Task[None] | None = None  # the previous batch's `fn`, still running
        try:
            quiet = True  # the first batch after start-up waits for company too
            while True:
                quiet = quiet or not self._pending
                while not self._pending:
                    if self._closed:
                        return
                    self._wakeup.clear()
                    await self._wakeup.wait()
                # Wait for company only after a quiet spell: items that queued up while the worker
                # was busy go at once (under load, waiting would only add latency).
                deadline = loop.time() + (self.max_wait if quiet else 0.0)
                while len(self._pending) < self.max_batch and not self._closed:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    self._wakeup.clear()
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), remaining)
                    except TimeoutError:
                        break
                size = self._batch_size(idle=second_stage is None or second_stage.done())
                batch = [self._pending.popleft() for _ in range(size)]
                batch = [e for e in batch if not e.future.done()]  # callers that gave up (disconnects)
                quiet = False
                if batch:
                    second_stage = await self._dispatch(batch, second_stage)
        finally:
            if second_stage is not None:
                await second_stage

    def _batch_size(self, *, idle: bool) -> int:
        """How many pending items the next batch takes: all (up to `max_batch`), except that a
        pipeline whose second stage is idle takes half of a large backlog, so the second stage
        starts on one half while the first stage prepares the other. Without the split, clients
        that all wait for one batch come back together and the stages take turns forever."""
        size = min(self.max_batch, len(self._pending))
        if self.prepare is not None and idle and size >= 2 * MIN_SPLIT:
            size = -(-size // 2)
        return size

    async def _dispatch(self, batch: list[_Entry[T, R]],
                        previous: asyncio.Task[None] | None) -> asyncio.Task[None] | None:
        """Run `batch`; with `prepare`, return its second stage still running (after `previous`)."""
        assert self._loop is not None
        items = [e.item for e in batch]
        if self.prepare is None:
            await self._finish(batch, 0.0, self._loop.run_in_executor(self._executor, self._timed, "finish",
                                                                        self.fn, items))
            return None
        try:
            prepared, prepare_seconds = await self._loop.run_in_executor(
                self._prepare_executor, self._timed, "prepare", self.prepare, items)
        except Exception as exc:  # the first stage failed: every caller in this batch gets the error
            log.exception("%s batch of %d failed", self.name, len(batch))
            self._fail(batch, exc)
            return previous
        if previous is not None:  # one batch at a time in `fn`, in order, and none piling up
            await previous
        second = self._loop.run_in_executor(self._executor, self._timed, "finish", self.fn, items, prepared)
        return self._loop.create_task(self._finish(batch, prepare_seconds, second), name=f"rmm-{self.name}-finish")

    async def _finish(self, batch: list[_Entry[T, R]], prepare_seconds: float,
                      call: asyncio.Future[tuple[Sequence[R | BaseException], float]]) -> None:
        """Hand each caller its result (never raises: a failed call fails every caller in it)."""
        try:
            results, seconds = await call
            results = self._check_length(results, len(batch))
        except Exception as exc:  # the whole call failed: every caller in it gets the error
            log.exception("%s batch of %d failed", self.name, len(batch))
            self._fail(batch, exc)
            return
        self._report(len(batch), prepare_seconds + seconds)
        for entry, result in zip(batch, results):
            if entry.future.done():
                continue
            if isinstance(result, BaseException):
                entry.future.set_exception(result)
            else:
                entry.future.set_result(result)

    def _fail(self, batch: list[_Entry[T, R]], exc: Exception) -> None:
        for entry in batch:
            if not entry.future.done():
                entry.future.set_exception(exc)

    def _check_length(self, results: Sequence[R | BaseException], n: int) -> Sequence[R | BaseException]:
        if len(results) != n:
            raise RuntimeError(f"{self.name} batch function returned {len(results)} results for {n} items")
        return results

    def _report(self, size: int, seconds: float) -> None:
        if self.on_batch is not None:
            self._guarded(self.on_batch, size, seconds)

    @staticmethod
    def _guarded(callback: Callable[..., None], *args: Any) -> None:
        try:
            callback(*args)
        except Exception:  # metrics must never fail a request
            log.exception("metrics callback %r failed", callback)

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
        for executor in (self._prepare_executor, self._executor):
            if executor is not None:
                executor.shutdown(wait=True)
        self._executor = self._prepare_executor = None
