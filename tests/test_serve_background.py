"""`rmm.serve.background.Background`: one thread per loop, woken by stop, bounded shutdown."""

from __future__ import annotations

import threading
import time

import pytest

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


def test_a_stopped_loop_cannot_start_again_and_a_late_round_stays_visible() -> None:
    release = threading.Event()
    ended = threading.Event()

    def loop() -> None:
        release.wait(30.0)  # a round that outlives the stop's timeout
        ended.set()

    background = Background("rmm-test-single-use", loop)
    background.start()
    try:
        assert not background.stop(0.1)
        assert background.running  # still referenced while alive, not forgotten
        with pytest.raises(RuntimeError, match="single-use"):
            background.start()
        assert sum(t.name == "rmm-test-single-use" for t in threading.enumerate()) == 1  # no second thread
    finally:
        release.set()
    assert ended.wait(5.0) and background.stop(5.0) and not background.running
    with pytest.raises(RuntimeError, match="was stopped"):
        background.start()
    never = Background("rmm-test-never-started", lambda: None)
    assert never.stop(1.0) and not never.running
    with pytest.raises(RuntimeError, match="single-use"):
        never.start()
