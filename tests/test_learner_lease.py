"""The learner lease's connection: a follower keeps one open between tries and still takes over.

Against the embedded PostgreSQL (skipped where `pgserver` cannot be imported). Each `PgDatabase`
stands for one replica; the lease's tries are driven directly, one call per try, and once through
its thread. The end-to-end takeover by a replica is in test_pg_serve_state.py and, with killed
processes, test_chaos_replicas.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("psycopg", reason="PostgreSQL banks need psycopg (postgres extra)")

import psycopg

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


def released(db: PgDatabase, timeout: float = 5.0) -> None:
    """Wait until the server has ended the learner's session (a closed socket is not yet a released
    lock; a lease tries again a second later, a test waits for exactly that moment)."""
    deadline = time.monotonic() + timeout
    while holder(db) is not None:
        assert time.monotonic() < deadline, "the learner lock was not released"
        time.sleep(0.01)


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
    assert not leader.lease.try_acquire()  # the old learner, back, follows
    assert leader.connects == 2


def test_a_broken_try_connection_is_replaced_at_the_next_try(pg_url: str, replicas: list[Replica]) -> None:
    leader, follower = Replica(pg_url), Replica(pg_url)
    replicas += [leader, follower]
    assert leader.lease.try_acquire() and not follower.lease.try_acquire()
    idle = follower.lease._idle
    assert idle is not None
    with leader.db.tx() as cur:  # an administrator (or a server restart) ends the follower's session
        cur.execute("SELECT pg_terminate_backend(%s)", (idle.info.backend_pid,))
    with pytest.raises(psycopg.OperationalError):
        follower.lease.try_acquire()  # the thread logs this and tries again a second later
    assert not follower.lease.try_acquire() and follower.connects == 2
    assert follower.lease._idle is not None and not follower.lease._idle.broken
    leader.lease.stop()
    released(follower.db)
    assert follower.lease.try_acquire() and follower.connects == 2


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
