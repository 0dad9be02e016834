"""A server loop on a daemon thread of its own, asked to stop through one event.

Maintenance, the learner lease and the PostgreSQL job worker each run a loop until the server
closes: the loop waits on `stopping` between rounds (so a stop wakes it at once), `start` starts
it at most once, and `stop` asks it to end and waits a bounded time for the round in progress,
saying whether it ended — a loop stuck in a long call must not hold the server's shutdown forever,
and its owner decides what an unfinished round means.
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
        """Start the loop; a second call while it runs does nothing."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float) -> bool:
        """Set `stopping` and wait up to `timeout` s for the loop to return; False when it still runs."""
        self.stopping.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()
