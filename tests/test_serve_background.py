"""`rmm.serve.background.Background`: one thread per loop, woken by stop, bounded shutdown."""

from __future__ import annotations

import threading
import time

from rmm.serve.background import Background


def test_a_loop_starts_once_and_a_stop_wakes_it_between_rounds() -> None:
    rounds: list[str] = []

    def loop() -> None:
        while not background.stopping.wait(60.0):  # a long wait: only the stop can end it in time
            rounds.append("round")
        rounds.append(threading.current_thread().name)

    background = Background("rmm-test-loop", loop)
    background.start()
    background.start()
    assert sum(t.name == "rmm-test-loop" for t in threading.enumerate()) == 1
    started = time.monotonic()
    assert background.stop(5.0)
    assert time.monotonic() - started < 1.0 and rounds == ["rmm-test-loop"]
    assert background.stop(5.0)  # stopping twice is harmless


def test_stop_gives_up_after_its_timeout_on_a_round_that_does_not_end() -> None:
    release = threading.Event()
    background = Background("rmm-test-stuck", lambda: release.wait(30.0))  # a round ignoring `stopping`
    background.start()
    try:
        started = time.monotonic()
        assert not background.stop(0.2)
        assert time.monotonic() - started < 2.0
    finally:
        release.set()
