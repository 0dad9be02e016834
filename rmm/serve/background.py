"""A server loop on a daemon thread of its own, asked to stop through one event.

Maintenance, the learner lease and the PostgreSQL job worker each run a loop until the server
closes: the loop waits on `stopping` between rounds (so a stop wakes it at once), `start` starts
it at most once, and `stop` asks it to end and waits a bounded time for the round in progress,
saying whether it ended — a loop stuck in a long call must not hold the server's shutdown forever,
and its owner decides what an unfinished round means.

A `Background` is single-use, like the server it belongs to: once stopped, `stopping` stays set
(a loop still finishing its round must keep seeing it), so `start` after `stop` raises instead of
starting a thread that would return at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Background"]


class Background:
    """One named daemon thread running `loop`; the loop returns once `stopping` is set."""

    def __init__(self, name: str, loop: Callable[[], None]) -> None:
        self.name = name
        self.stopping = threading.Event()
        self._loop = loop
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the loop; a second call while it runs does nothing; a call after `stop` raises."""
        if self.stopping.is_set():
            raise RuntimeError(f"background loop {self.name!r} was stopped and cannot start again "
                               "(a Background is single-use: build a new one)")
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the loop's thread is alive (e.g. a round that outlived `stop`'s timeout)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float) -> bool:
        """Set `stopping` and wait up to `timeout` s for the loop to return; False when it still runs
        (the thread stays referenced, so `running` and a later `stop` still see it)."""
        self.stopping.set()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()
