"""The server's housekeeping thread: purge expired selections, checkpoint the rerankers.

Checkpoints every `checkpoint_interval_s` bound what a crash can cost (at most that much learning;
memories are durable on their own). A failed round is logged and retried at the next one, so a
full disk for a minute does not stop the server from checkpointing once space is back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from rmm.serve.background import Background

__all__ = ["Maintenance"]

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 60.0


class Maintenance:
    """Runs `sweep` and `checkpoint` on their own schedules in one daemon thread."""

    def __init__(self, *, sweep: Callable[[], object], checkpoint: Callable[[], object], checkpoint_interval_s: float,
                 selection_ttl_s: float) -> None:
        self.sweep, self.checkpoint = sweep, checkpoint
        self.checkpoint_interval_s = checkpoint_interval_s
        self.sweep_every_s = min(SWEEP_EVERY_S, selection_ttl_s)
        self._thread = Background("rmm-maintenance", self._run)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the thread to stop and wait up to `timeout` s for the round in progress to finish
        (a round still running then is logged and left to end on its own)."""
        if not self._thread.stop(timeout):
            log.warning("a maintenance round (sweep or checkpoint) was still running %.0f s after shutdown began",
                        timeout)

    def _run(self) -> None:
        interval = self.checkpoint_interval_s
        next_checkpoint = time.monotonic() + interval if interval else float("inf")
        next_sweep = time.monotonic() + self.sweep_every_s
        while not self._thread.stopping.wait(max(0.05, min(next_checkpoint, next_sweep) - time.monotonic())):
            now = time.monotonic()
            try:
                if now >= next_sweep:
                    self.sweep()
                    next_sweep = now + self.sweep_every_s
                if now >= next_checkpoint:
                    self.checkpoint()
                    next_checkpoint = now + interval
            except Exception:  # keep maintaining; the next round may succeed
                log.exception("background maintenance failed")
