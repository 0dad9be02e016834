"""The micro-batcher on its own: coalescing, limits, per-item errors, the unbatched baseline, shutdown."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from types import SimpleNamespace

import pytest

from rmm.serve.batcher import BatcherClosedError, MicroBatcher


class Recorder:
    """A batch function that remembers every call (and can be slowed down or made to fail)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls: list[list[int]] = []
        self.threads: set[str] = set()
        self.delay = delay

    def __call__(self, items: list[int]) -> list[int | Exception]:
        self.calls.append(list(items))
        self.threads.add(threading.current_thread().name)
        if self.delay:
            time.sleep(self.delay)
        return [ValueError(f"odd {i}") if i < 0 else i * 10 for i in items]


def run(coro):
    return asyncio.run(coro)


def test_concurrent_submits_become_one_call() -> None:
    fn = Recorder()

    async def main() -> list[int]:
        batcher = MicroBatcher(fn, max_batch=64, max_wait_ms=50)
        try:
            return list(await asyncio.gather(*(batcher.submit(i) for i in range(20))))
        finally:
            await batcher.close()

    assert run(main()) == [i * 10 for i in range(20)]
    assert fn.calls == [list(range(20))]
    assert all(name.startswith("rmm-batch") for name in fn.threads)  # ran off the event loop


def test_max_batch_splits_and_keeps_order() -> None:
    fn = Recorder()

    async def main() -> list[int]:
        batcher = MicroBatcher(fn, max_batch=8, max_wait_ms=20)
        try:
            return await batcher.submit_many(list(range(20)))
        finally:
            await batcher.close()

    assert run(main()) == [i * 10 for i in range(20)]
    assert [len(c) for c in fn.calls] == [8, 8, 4]
    assert [i for c in fn.calls for i in c] == list(range(20))


def test_a_lone_item_waits_at_most_max_wait() -> None:
    fn = Recorder()

    async def main() -> float:
        batcher = MicroBatcher(fn, max_batch=64, max_wait_ms=30)
        try:
            started = time.perf_counter()
            await batcher.submit(1)
            return time.perf_counter() - started
        finally:
            await batcher.close()

    elapsed = run(main())
    assert 0.025 <= elapsed < 1.0
    assert fn.calls == [[1]]


def test_items_arriving_while_a_batch_runs_form_the_next_batch() -> None:
    fn = Recorder(delay=0.1)

    async def main() -> None:
        batcher = MicroBatcher(fn, max_batch=64, max_wait_ms=0)
        try:
            first = asyncio.ensure_future(batcher.submit(0))
            await asyncio.sleep(0.03)  # batch [0] is now running in the worker
            rest = [asyncio.ensure_future(batcher.submit(i)) for i in range(1, 11)]
            await asyncio.gather(first, *rest)
        finally:
            await batcher.close()

    run(main())
    assert fn.calls == [[0], list(range(1, 11))]


def test_one_failed_item_fails_only_its_caller() -> None:
    fn = Recorder()

    async def main() -> list:
        batcher = MicroBatcher(fn, max_batch=64, max_wait_ms=20)
        try:
            return await asyncio.gather(batcher.submit(1), batcher.submit(-1), batcher.submit(2),
                                        return_exceptions=True)
        finally:
            await batcher.close()

    good1, bad, good2 = run(main())
    assert (good1, good2) == (10, 20)
    assert isinstance(bad, ValueError) and "odd -1" in str(bad)
    assert len(fn.calls) == 1


def test_a_failing_call_fails_every_caller_in_the_batch() -> None:
    def explode(items: list[int]) -> list[int]:
        raise RuntimeError("encoder crashed")

    async def main() -> list:
        batcher = MicroBatcher(explode, max_batch=64, max_wait_ms=20)
        try:
            return await asyncio.gather(*(batcher.submit(i) for i in range(3)), return_exceptions=True)
        finally:
            await batcher.close()

    results = run(main())
    assert all(isinstance(r, RuntimeError) and "encoder crashed" in str(r) for r in results)


def test_wrong_number_of_results_is_an_error() -> None:
    async def main() -> None:
        batcher = MicroBatcher(lambda items: items[:-1], max_batch=4, max_wait_ms=5)
        try:
            await batcher.submit_many([1, 2])
        finally:
            await batcher.close()

    with pytest.raises(RuntimeError, match="returned 1 results for 2 items"):
        run(main())


def test_disabled_runs_each_request_on_its_own() -> None:
    fn = Recorder()
    sizes: list[int] = []

    async def main() -> list[list[int]]:
        batcher = MicroBatcher(fn, max_batch=64, max_wait_ms=50, enabled=False,
                               on_batch=lambda size, seconds: sizes.append(size))
        try:
            return list(await asyncio.gather(*(batcher.submit_many([i, i + 100]) for i in range(5))))
        finally:
            await batcher.close()

    assert run(main()) == [[i * 10, (i + 100) * 10] for i in range(5)]
    assert sorted(map(sorted, fn.calls)) == sorted([[i, i + 100] for i in range(5)])
    assert sizes == [2] * 5


def test_on_batch_reports_sizes() -> None:
    sizes: list[int] = []

    async def main() -> None:
        batcher = MicroBatcher(Recorder(), max_batch=4, max_wait_ms=10, on_batch=lambda s, t: sizes.append(s))
        try:
            await batcher.submit_many(list(range(10)))
        finally:
            await batcher.close()

    run(main())
    assert sizes == [4, 4, 2]


def test_close_drains_queued_items_then_refuses_new_ones() -> None:
    fn = Recorder(delay=0.05)

    async def main() -> tuple[list[int], BaseException | None]:
        batcher = MicroBatcher(fn, max_batch=2, max_wait_ms=1000)
        futures = [asyncio.ensure_future(batcher.submit(i)) for i in range(5)]
        await asyncio.sleep(0.01)
        await batcher.close()
        done = list(await asyncio.gather(*futures))
        try:
            await batcher.submit(9)
        except BatcherClosedError as exc:
            return done, exc
        return done, None

    done, error = run(main())
    assert done == [0, 10, 20, 30, 40]
    assert error is not None and "closed" in str(error)


@pytest.mark.parametrize("kwargs", [{"max_batch": 0}, {"max_wait_ms": -1}])
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        MicroBatcher(Recorder(), **kwargs)


# ---- two stages: prepare(items) in one thread, fn(items, prepared) in another -------------------

class Stages:
    """A two-stage batch function that records when each stage of each batch ran, and where."""

    def __init__(self, prepare_delay: float = 0.0, finish_delay: float = 0.0) -> None:
        self.prepare_delay, self.finish_delay = prepare_delay, finish_delay
        self.events: list[tuple[str, str, float]] = []  # (stage, first item, time)
        self.finished: list[list[int]] = []
        self.threads: dict[str, set[str]] = {"prepare": set(), "finish": set()}
        self._lock = threading.Lock()

    def _note(self, stage: str, items: list[int], edge: str) -> None:
        with self._lock:
            self.events.append((f"{stage}-{edge}", str(items[0]), time.perf_counter()))
            self.threads[stage].add(threading.current_thread().name)

    def prepare(self, items: list[int]) -> list[int]:
        self._note("prepare", items, "start")
        if any(i == -99 for i in items):
            raise RuntimeError("prepare crashed")
        time.sleep(self.prepare_delay)
        self._note("prepare", items, "end")
        return [i * 10 for i in items]

    def finish(self, items: list[int], prepared: list[int]) -> list[int]:
        self._note("finish", items, "start")
        time.sleep(self.finish_delay)
        self.finished.append(list(items))
        self._note("finish", items, "end")
        return [p + 1 for p in prepared]


def test_two_stages_run_in_two_threads_and_compose() -> None:
    stages = Stages()

    async def main() -> list[int]:
        batcher = MicroBatcher(stages.finish, prepare=stages.prepare, max_batch=64, max_wait_ms=20)
        try:
            return list(await asyncio.gather(*(batcher.submit(i) for i in range(5))))
        finally:
            await batcher.close()

    assert run(main()) == [i * 10 + 1 for i in range(5)]
    assert stages.finished == [list(range(5))]
    (prepare_thread,), (finish_thread,) = stages.threads["prepare"], stages.threads["finish"]
    assert prepare_thread != finish_thread and prepare_thread.startswith("rmm-batch-prepare")


def test_the_next_batch_prepares_while_this_one_finishes_in_order() -> None:
    stages = Stages(prepare_delay=0.05, finish_delay=0.15)

    async def main() -> None:
        batcher = MicroBatcher(stages.finish, prepare=stages.prepare, max_batch=4, max_wait_ms=0)
        try:
            await batcher.submit_many(list(range(12)))
        finally:
            await batcher.close()

    run(main())
    assert stages.finished == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # one at a time, in order
    at = {(kind, first): t for kind, first, t in stages.events}
    # batch 2 was prepared while batch 1 was still in its second stage
    assert at[("prepare-start", "4")] < at[("finish-end", "0")]
    assert at[("prepare-end", "4")] < at[("finish-end", "0")]
    # and no second stage ever overlapped another
    spans = sorted((at[("finish-start", f)], at[("finish-end", f)]) for f in ("0", "4", "8"))
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))


class ConductedStages:
    """Two stages that block inside until the test's conductor releases them, under a fake clock the
    conductor sets: which clock readings the batcher takes (around each stage, in its worker threads)
    is decided by the script, not by how fast a loaded machine runs the threads."""

    TIMEOUT_S = 20.0

    def __init__(self) -> None:
        self.now = 0.0
        self._cond = threading.Condition()
        self.entered: set[tuple[str, int]] = set()
        self.released: set[tuple[str, int]] = set()
        self.reported: dict[tuple[str, int], float] = {}
        self._current: dict[str, int] = {}

    def perf_counter(self) -> float:
        with self._cond:
            return self.now

    def _work(self, stage: str, items: list[int]) -> None:
        with self._cond:
            self._current[stage] = items[0]
            self.entered.add((stage, items[0]))
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: (stage, items[0]) in self.released, self.TIMEOUT_S):
                raise TimeoutError(f"{stage} of batch {items[0]} was never released")

    def prepare(self, items: list[int]) -> list[int]:
        self._work("prepare", items)
        return [i * 10 for i in items]

    def finish(self, items: list[int], prepared: list[int]) -> list[int]:
        self._work("finish", items)
        return [p + 1 for p in prepared]

    def on_stage(self, stage: str, seconds: float) -> None:  # in the stage's worker thread, after its clock readings
        with self._cond:
            self.reported[(stage, self._current[stage])] = seconds
            self._cond.notify_all()

    def _await(self, what: str, keys: list[tuple[str, int]]) -> None:
        container = self.entered if what == "entered" else self.reported
        if not self._cond.wait_for(lambda: all(k in container for k in keys), self.TIMEOUT_S):
            raise TimeoutError(f"never {what}: {[k for k in keys if k not in container]}")

    def step(self, wait_entered: list[tuple[str, int]], now: float, release: tuple[str, int]) -> None:
        """Once every stage in `wait_entered` is inside (its start read taken), set the clock to `now`,
        release `release` and wait until it has reported (its end reads taken)."""
        with self._cond:
            self._await("entered", wait_entered)
            self.now = now
            self.released.add(release)
            self._cond.notify_all()
            self._await("reported", [release])


def test_batch_seconds_count_each_batchs_own_work_not_the_wait_between_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three batches of 4; batch 2's first stage ends at t=4, but its second stage may start only when
    batch 1's ends at t=19: the 15 s between are a wait, not its work. Each batch reports its own
    prepare + finish (19, 19, 17), where counting from its prepare's start would give 19, 34, 32."""
    import rmm.serve.batcher as batcher_module

    stages = ConductedStages()
    monkeypatch.setattr(batcher_module, "time", SimpleNamespace(perf_counter=stages.perf_counter))
    reported: list[float] = []

    async def main() -> None:
        batcher = MicroBatcher(stages.finish, prepare=stages.prepare, max_batch=4, max_wait_ms=0,
                               on_batch=lambda size, seconds: reported.append(seconds), on_stage=stages.on_stage)
        try:
            await batcher.submit_many(list(range(12)))
        finally:
            await batcher.close()

    def conduct() -> None:
        stages.step([("prepare", 0)], 2.0, ("prepare", 0))  # batch 1 prepares from 0 to 2
        # batch 1 finishes from 2 while batch 2 prepares from 2 to 4 ...
        stages.step([("finish", 0), ("prepare", 4)], 4.0, ("prepare", 4))
        stages.step([], 19.0, ("finish", 0))  # ... and batch 1's finish ends at 19
        stages.step([("finish", 4), ("prepare", 8)], 21.0, ("prepare", 8))  # batch 2 finishes from 19 ...
        stages.step([], 36.0, ("finish", 4))  # ... to 36
        stages.step([("finish", 8)], 51.0, ("finish", 8))  # batch 3 from 36 to 51

    conductor = threading.Thread(target=conduct, name="conductor")
    conductor.start()
    try:
        run(main())
    finally:
        conductor.join(ConductedStages.TIMEOUT_S)
    assert not conductor.is_alive()
    assert [stages.reported[("prepare", b)] for b in (0, 4, 8)] == [2.0, 2.0, 2.0]
    assert [stages.reported[("finish", b)] for b in (0, 4, 8)] == [17.0, 17.0, 15.0]
    assert reported == [19.0, 19.0, 17.0]


@pytest.mark.parametrize(("items", "batches"), [
    (32, [16, 16]),  # a backlog is split in halves when the second stage is idle
    (10, [10]),  # below 2 * MIN_SPLIT it is not
])
def test_a_backlog_is_split_in_halves_when_the_second_stage_is_idle(items: int, batches: list[int]) -> None:
    stages = Stages(finish_delay=0.05)

    async def main() -> None:
        batcher = MicroBatcher(stages.finish, prepare=stages.prepare, max_batch=64, max_wait_ms=20)
        try:
            await asyncio.gather(*(batcher.submit(i) for i in range(items)))
        finally:
            await batcher.close()

    run(main())
    assert [len(b) for b in stages.finished] == batches
    assert [i for b in stages.finished for i in b] == list(range(items))


def test_a_failed_first_stage_fails_only_its_batch() -> None:
    stages = Stages()

    async def main() -> tuple[list, list[int]]:
        batcher = MicroBatcher(stages.finish, prepare=stages.prepare, max_batch=3, max_wait_ms=0)
        try:
            failed = await asyncio.gather(*(batcher.submit(i) for i in (1, -99, 2)), return_exceptions=True)
            later = await batcher.submit_many([3, 4])
            return failed, later
        finally:
            await batcher.close()

    failed, later = run(main())
    assert all(isinstance(r, RuntimeError) and "prepare crashed" in str(r) for r in failed)
    assert later == [31, 41]
    assert stages.finished == [[3, 4]]


def test_close_waits_for_the_batch_in_its_second_stage() -> None:
    stages = Stages(finish_delay=0.1)

    async def main() -> list[int]:
        batcher = MicroBatcher(stages.finish, prepare=stages.prepare, max_batch=64, max_wait_ms=0)
        future = asyncio.ensure_future(batcher.submit(7))
        await asyncio.sleep(0.03)  # prepared, now in the second stage
        await batcher.close()
        assert future.done()
        return [future.result()]

    assert run(main()) == [71]


def test_disabled_runs_both_stages_per_request() -> None:
    stages = Stages()

    async def main() -> list[list[int]]:
        batcher = MicroBatcher(stages.finish, prepare=stages.prepare, max_batch=64, max_wait_ms=50, enabled=False)
        try:
            return list(await asyncio.gather(*(batcher.submit_many([i]) for i in range(3))))
        finally:
            await batcher.close()

    assert run(main()) == [[i * 10 + 1] for i in range(3)]
    assert sorted(stages.finished) == [[0], [1], [2]]


def test_items_queued_while_busy_do_not_wait_for_company() -> None:
    fn = Recorder(delay=0.2)

    async def main() -> float:
        batcher = MicroBatcher(fn, max_batch=64, max_wait_ms=500)
        try:
            first = asyncio.ensure_future(batcher.submit(0))  # alone after a quiet spell: waits 500 ms
            await asyncio.sleep(0.6)  # [0] is running now
            queued = time.perf_counter()
            await batcher.submit(1)  # queued while the worker is busy
            waited = time.perf_counter() - queued
            await first
            return waited
        finally:
            await batcher.close()

    waited = run(main())
    assert fn.calls == [[0], [1]]
    assert waited < 0.45  # ran right after [0] (~0.1 s left + 0.2 s), not after another 500 ms wait
