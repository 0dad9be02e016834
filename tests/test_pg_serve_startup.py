"""A replica on a PostgreSQL bank starts with one migration run and one pool, sized by `database:`.

The memory store and the server's own tables (selections, feedback, jobs, reranker versions) live
in one bank schema; a replica must neither migrate it twice nor hold two pools on it (a second
pool doubles the connections the server's `max_connections` must allow per replica, and ignores
the configured size). Against the embedded PostgreSQL (skipped where `pgserver` cannot be imported).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("psycopg", reason="PostgreSQL banks need psycopg (postgres extra)")

import psycopg
import psycopg_pool
from psycopg import sql
from test_pg_serve_state import FACTS, make_replica, retrieve

from rmm.memory import pg_connect
from rmm.memory.pg_connect import parse_location, with_schema
from rmm.serve.records import NewMemory


@pytest.fixture
def fresh_url(pg_server_url: str) -> Iterator[str]:
    """A bank schema nobody has migrated yet, dropped afterwards."""
    url = with_schema(pg_server_url, f"t_startup_{uuid.uuid4().hex[:10]}")
    yield url
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(parse_location(url).schema)))


def test_a_replica_migrates_once_and_holds_one_pool_of_the_configured_size(
        tmp_path: Path, fresh_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    checks: list[str] = []  # every `migrate` call reads yoyo's record first
    applied: list[str] = []  # yoyo runs (its lock, then the pending migrations)
    pools: list[psycopg_pool.ConnectionPool] = []
    up_to_date, apply_migrations = pg_connect._up_to_date, pg_connect._apply_migrations

    def counted_check(conn: Any, location: Any) -> bool:
        checks.append(location.schema)
        return up_to_date(conn, location)

    def counted_apply(location: Any, options: str) -> None:
        applied.append(location.schema)
        apply_migrations(location, options)

    class CountedPool(pg_connect._capped_pool_class()):  # the pool class open_pool builds
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            pools.append(self)

    monkeypatch.setattr(pg_connect, "_up_to_date", counted_check)
    monkeypatch.setattr(pg_connect, "_apply_migrations", counted_apply)
    monkeypatch.setattr(pg_connect, "_capped_pool_class", lambda: CountedPool)
    schema = parse_location(fresh_url).schema

    replica = make_replica(tmp_path, fresh_url, "a", database={"pool_min": 1, "pool_max": 3, "ef_search": 120})
    try:
        assert checks == [schema] and applied == [schema]  # migrated once, by the one handle
        assert len(pools) == 1 and pools[0].max_size == 3 and pools[0].min_size == 1
        assert replica.db is replica.bank.store.database and replica.db.pool is pools[0]
        assert replica.bank.store.ef_search == 120  # the search settings still reach the store
        # serving memories, selections and feedback opens nothing more
        replica.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
        result = retrieve(replica, "sourdough bread")
        replica.feedback("alpha", result.selection_id, cited=[0])
        assert replica.stats()["pending_selections"] == 0
        assert len(pools) == 1 and checks == [schema]
    finally:
        replica.close()
    assert pools[0].closed  # closing the replica closes its one pool
