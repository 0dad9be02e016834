"""A cached benchmark bank is opened and filled by one process at a time (`benchmark_bank.building`):
two runs over one cache folder must not interleave a build (duplicate or deleted users, an index
read before the bank is whole)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from filelock import FileLock, Timeout

import rmm.eval.benchmark_bank as benchmark_bank
from rmm.data import load_dataset
from rmm.eval.benchmark_bank import building, open_retriever


def _held_elsewhere(lock_path: Path) -> bool:
    """Whether another holder has `lock_path`: a fresh lock in another thread (its own open file,
    which flock treats as another owner) cannot take it at once."""
    taken: list[bool] = []

    def probe() -> None:
        other = FileLock(str(lock_path))
        try:
            other.acquire(timeout=0)
        except Timeout:
            taken.append(False)
        else:
            other.release()
            taken.append(True)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return not taken[0]


def test_a_bank_is_filled_under_its_lock_and_released_after(tiny_data_dir: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = load_dataset("locomo", tiny_data_dir)
    seen: list[bool] = []
    real_fill = benchmark_bank.fill

    def fill(store, data, granularity, progress=True):
        lock = next((tmp_path / "cache" / "banks" / ".locks").glob("*.lock"))
        seen.append(_held_elsewhere(lock))
        return real_fill(store, data, granularity, progress)

    monkeypatch.setattr(benchmark_bank, "fill", fill)
    opened = open_retriever("bm25", dataset, "turn", cache=tmp_path / "cache", progress=False)
    assert seen == [True]  # held while the bank was filled
    lock = next((tmp_path / "cache" / "banks" / ".locks").glob("*.lock"))
    assert not _held_elsewhere(lock)  # and released once it was whole
    assert opened.path is not None and opened.path.name + ".lock" == lock.name
    assert not list((tmp_path / "cache" / "banks").glob("*.lock"))  # the banks' folder lists banks only


def test_a_second_builder_waits_for_the_first(tmp_path: Path) -> None:
    order: list[str] = []
    bank = tmp_path / "banks" / "b"
    first_in = threading.Event()

    def second() -> None:
        first_in.wait()
        with building(bank):
            order.append("second")

    thread = threading.Thread(target=second)
    with building(bank):
        thread.start()
        first_in.set()
        thread.join(timeout=0.5)  # blocked on the lock: still running
        assert thread.is_alive()
        order.append("first")
    thread.join(timeout=10)
    assert order == ["first", "second"]
