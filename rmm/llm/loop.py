"""An asyncio event loop in a daemon thread, for backends whose client is asynchronous.

The OpenAI-compatible backend keeps one `AsyncOpenAI` client (one connection pool) bound to one
loop. Running that loop in its own thread lets blocking callers (`generate`) and callers on any
other event loop (`agenerate`, e.g. a trainer keeping many requests in flight) share the client:
both submit coroutines here instead of driving the client from a loop it does not belong to.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from rmm.errors import LLMError

__all__ = ["BackgroundLoop"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class BackgroundLoop:
    """A started event loop; `run` blocks on a coroutine, `wait` awaits it from another loop."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def _submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        if self.loop.is_closed() or not self.loop.is_running():
            coroutine.close()
            raise LLMError("this LLM backend is closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """The coroutine's result, blocking this thread (not allowed on the loop's own thread)."""
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise LLMError("a blocking call from the backend's own event loop would deadlock; await agenerate")
        future = self._submit(coroutine)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: stop the requests instead of leaving them running
            raise

    async def wait(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Await the coroutine's result from the caller's own event loop (cancellation propagates)."""
        return await asyncio.wrap_future(self._submit(coroutine))

    def stop(self, cleanup: Callable[[], Awaitable[object]] | None = None, timeout_s: float = 10.0) -> None:
        """Run `cleanup` on the loop (e.g. closing a client), then stop the loop and its thread."""
        if self.loop.is_closed():
            return
        if cleanup is not None and self.loop.is_running() and threading.current_thread() is not self._thread:
            try:
                asyncio.run_coroutine_threadsafe(_awaited(cleanup), self.loop).result(timeout_s)
            except (TimeoutError, RuntimeError, OSError) as error:  # closing is best effort: the loop still stops
                log.debug("cleanup before stopping the event loop failed: %r", error)
        self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self.loop.close()


async def _awaited(make: Callable[[], Awaitable[object]]) -> None:
    await make()
