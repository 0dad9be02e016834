"""The micro-batcher on its own: coalescing, limits, per-item errors, the unbatched baseline, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

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
