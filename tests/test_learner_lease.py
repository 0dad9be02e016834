"""The learner lease's connection: a follower keeps one open between tries and still takes over.

Against the embedded PostgreSQL (skipped where `pgserver` cannot be imported). Each `PgDatabase`
stands for one replica; the lease's tries are driven directly, one call per try, and once through
its thread. The end-to-end takeover by a replica is in test_pg_serve_state.py and, with killed
processes, test_chaos_replicas.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("psycopg", reason="PostgreSQL banks need psycopg (postgres extra)")

import psycopg

from rmm.memory.pg_connect import DatabaseUnavailableError
from rmm.memory.pg_database import PgDatabase
from rmm.policy.pg_versions import RerankerVersions
from rmm.policy.recipes import LearnerConfig
from rmm.policy.registry import LearnerRegistry
from rmm.serve.learner_lease import SharedLearning, learner_holder

D = 8


class Replica:
    """One replica's database handle and lease, counting the connections the lease opens."""

    def __init__(self, url: str, **lease: Any) -> None:
        self.db = PgDatabase(url, pool_max=2)
        self.connects = 0
        dedicated = self.db.dedicated

        def counted(**params: Any) -> psycopg.Connection[Any]:
            self.connects += 1
            return dedicated(**params)

        self.db.dedicated = counted  # type: ignore[method-assign]
        versions = RerankerVersions(self.db)
        registry = LearnerRegistry(D, LearnerConfig(), encoder_name="enc", versions=versions)
        self.lease = SharedLearning(self.db, registry, versions, **lease)
        self.tries = 0
        try_acquire = self.lease.try_acquire

        def counted_try() -> bool:
            self.tries += 1
            return try_acquire()

        self.lease.try_acquire = counted_try  # type: ignore[method-assign]

    def close(self) -> None:
        self.lease.stop()
        self.db.close()


@pytest.fixture
def replicas(pg_url: str) -> Iterator[list[Replica]]:
    made: list[Replica] = []
    yield made
    for replica in made:
        replica.close()


def holder(db: PgDatabase) -> int | None:
    with db.tx() as cur:
        return learner_holder(cur, db.where.schema)


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, what: str = "timed out",
             every: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(every)


def released(db: PgDatabase, timeout: float = 5.0) -> None:
    """Wait until the server has ended the learner's session (a closed socket is not yet a released
    lock; a lease tries again a second later, a test waits for exactly that moment)."""
    wait_for(lambda: holder(db) is None, timeout, "the learner lock was not released", every=0.01)


def test_a_follower_tries_on_one_connection_and_takes_the_lock_on_it_when_the_learner_goes(
        pg_url: str, replicas: list[Replica]) -> None:
    leader, follower = Replica(pg_url), Replica(pg_url)
    replicas += [leader, follower]
    assert leader.lease.try_acquire() and leader.lease.is_learner
    assert [follower.lease.try_acquire() for _ in range(20)] == [False] * 20
    assert follower.connects == 1 and not follower.lease.is_learner  # one session, not one per try
    leader.lease.stop()  # the learner's lock connection goes, as when its process dies
    released(follower.db)
    assert follower.lease.try_acquire() and follower.lease.is_learner  # at its next try
    assert follower.connects == 1  # on the connection it already had
    assert holder(follower.db) == os.getpid() and follower.lease.stats.acquisitions == 1
    leader.lease._thread.stopping.clear()  # back, as a restarted replica (a stopped lease tries nothing)
    assert not leader.lease.try_acquire()  # the old learner, back, follows
    assert leader.connects == 2


def terminate(db: PgDatabase, conn: psycopg.Connection[Any] | None) -> None:
    """End `conn`'s session from the server side, as a database restart or an administrator does."""
    assert conn is not None
    pid = conn.info.backend_pid
    with db.tx() as cur:
        cur.execute("SELECT pg_terminate_backend(%s)", (pid,))

    def gone() -> bool:  # from the server (the client's socket does not know yet)
        with db.tx() as cur:
            return cur.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone() == (0,)

    wait_for(gone, 5.0, "the terminated session is still there", every=0.01)


def test_a_try_connection_that_died_while_idle_is_replaced_within_the_same_try(
        pg_url: str, replicas: list[Replica]) -> None:
    leader, follower = Replica(pg_url), Replica(pg_url)
    replicas += [leader, follower]
    assert leader.lease.try_acquire() and not follower.lease.try_acquire()
    dead = follower.lease._idle
    terminate(leader.db, dead)
    assert dead is not None and not dead.broken  # nothing tells the client until it uses the connection
    assert not follower.lease.try_acquire()  # no error: the try reconnected and asked again
    assert follower.connects == 2 and dead.closed
    assert follower.lease._idle is not None and not follower.lease._idle.broken
    leader.lease.stop()
    released(follower.db)
    assert follower.lease.try_acquire() and follower.connects == 2  # on the new kept connection


def test_the_retry_is_one_reconnect_and_a_refused_one_fails_the_try(pg_url: str, replicas: list[Replica]) -> None:
    leader, follower = Replica(pg_url), Replica(pg_url)
    replicas += [leader, follower]
    assert leader.lease.try_acquire() and not follower.lease.try_acquire()
    terminate(leader.db, follower.lease._idle)
    connect = follower.db.dedicated

    def refused(**params: Any) -> psycopg.Connection[Any]:
        follower.connects += 1
        raise DatabaseUnavailableError("PostgreSQL at test is unreachable: connection refused")

    follower.db.dedicated = refused  # type: ignore[method-assign]
    with pytest.raises(DatabaseUnavailableError):
        follower.lease.try_acquire()  # the thread logs this round and tries again a second later
    assert follower.connects == 2 and follower.lease._idle is None
    follower.db.dedicated = connect  # type: ignore[method-assign]
    assert not follower.lease.try_acquire() and follower.lease._idle is not None


def test_the_lease_thread_rides_out_a_lost_idle_connection_without_a_warning(
        pg_url: str, replicas: list[Replica], caplog: pytest.LogCaptureFixture) -> None:
    leader = Replica(pg_url)
    follower = Replica(pg_url, retry_s=0.05, reload_interval_s=0.05)
    replicas += [leader, follower]
    assert leader.lease.try_acquire()
    follower.lease.start()
    wait_for(lambda: follower.tries >= 2)
    caplog.set_level(logging.INFO, logger="rmm.serve.learner_lease")
    terminate(leader.db, follower.lease._idle)
    tries = follower.tries
    wait_for(lambda: follower.tries >= tries + 3)
    assert follower.connects == 2 and not follower.lease.is_learner
    records = [r for r in caplog.records if r.name == "rmm.serve.learner_lease"]
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
    assert any("lost while idle" in r.getMessage() for r in records)


def test_a_stop_that_began_during_a_try_gives_a_just_taken_lock_back(pg_url: str, replicas: list[Replica]) -> None:
    replica = Replica(pg_url)
    replicas.append(replica)
    connect = replica.db.dedicated

    def stop_while_connecting(**params: Any) -> psycopg.Connection[Any]:
        replica.lease._thread.stopping.set()  # stop() has begun while this try was under way
        return connect(**params)

    replica.db.dedicated = stop_while_connecting  # type: ignore[method-assign]
    assert not replica.lease.try_acquire()
    assert replica.connects == 1
    assert not replica.lease.is_learner and replica.lease._idle is None and replica.lease.stats.acquisitions == 0
    released(replica.db)


def test_a_try_after_stop_began_opens_no_connection(pg_url: str, replicas: list[Replica]) -> None:
    """stop() closed the kept connection under the thread: the next try does not reconnect (and take and
    give back the lock) just to see that it is stopping."""
    replica = Replica(pg_url)
    replicas.append(replica)
    replica.lease._thread.stopping.set()
    assert not replica.lease.try_acquire()
    assert replica.connects == 0 and replica.lease._idle is None and not replica.lease.is_learner


def test_a_part_applied_optimizer_step_stops_the_round_instead_of_setting_the_row_aside(
        pg_url: str, replicas: list[Replica], monkeypatch: pytest.MonkeyPatch) -> None:
    """A learner whose step failed half way is at fault, not the feedback row: the row is not set aside
    as unlearnable, the round raises, and the touched reranker is dropped when the lease is lost."""
    import rmm.serve.learner_lease as lease_module
    from rmm.policy.optimizer import OptimizerStepError

    replica = Replica(pg_url)
    replicas.append(replica)
    assert replica.lease.try_acquire()
    row = SimpleNamespace(seq=7, rewards=[1.0], selection=SimpleNamespace(reranker_key="t:u"))
    skipped: list[int] = []

    class HalfStepped:
        stats = SimpleNamespace(updates=0)

        def record(self, *_: object) -> None:
            raise OptimizerStepError("fused Adam's kernel failed on parameter group 1")

    monkeypatch.setattr(lease_module, "unapplied_feedback", lambda cur, exclude, limit: [row])
    monkeypatch.setattr(lease_module, "rebuild", lambda selection: selection)
    monkeypatch.setattr(lease_module, "skip_unlearnable", lambda cur, seq, why: skipped.append(seq))
    monkeypatch.setattr(replica.lease.registry, "get", lambda key: HalfStepped())
    with pytest.raises(OptimizerStepError):
        replica.lease.apply_pending()
    assert skipped == [] and "t:u" in replica.lease._touched


def test_a_lease_thread_that_outlives_stop_closes_its_own_connections(pg_url: str, replicas: list[Replica]) -> None:
    """stop() times out while the thread is still connecting; the lock it then takes is not kept."""
    replica = Replica(pg_url, retry_s=0.05)
    replicas.append(replica)
    connecting, go = threading.Event(), threading.Event()
    connect = replica.db.dedicated

    def slow(**params: Any) -> psycopg.Connection[Any]:
        connecting.set()
        go.wait(10.0)
        return connect(**params)

    replica.db.dedicated = slow  # type: ignore[method-assign]
    replica.lease.start()
    assert connecting.wait(5.0)
    replica.lease.stop(timeout=0.1)  # times out: nothing to close yet
    assert replica.lease._thread.running
    go.set()
    wait_for(lambda: not replica.lease._thread.running)
    assert replica.connects == 1 and not replica.lease.is_learner and replica.lease._idle is None
    released(replica.db)


def test_the_lease_thread_keeps_its_connection_between_tries(pg_url: str, replicas: list[Replica]) -> None:
    leader = Replica(pg_url)
    follower = Replica(pg_url, retry_s=0.05, reload_interval_s=0.05)
    replicas += [leader, follower]
    assert leader.lease.try_acquire()
    follower.lease.start()
    deadline = time.monotonic() + 10.0
    while follower.tries < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert follower.tries >= 10 and not follower.lease.is_learner and follower.connects == 1
    leader.lease.stop()
    deadline = time.monotonic() + 5.0
    while not follower.lease.is_learner and time.monotonic() < deadline:
        time.sleep(0.02)
    assert follower.lease.is_learner and follower.connects == 1
    follower.lease.stop()
    assert follower.lease._idle is None  # stopping gives everything back
    released(leader.db)
