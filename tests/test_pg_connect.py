"""What a PostgreSQL failure is called: a pool that ran short names `pool_max` (not a lost server),
and both database errors answer HTTP 503 (retry later), not 422 (your request is wrong)."""

from __future__ import annotations

import logging

import pytest

from rmm.memory.pg_connect import DatabasePoolExhaustedError, DatabaseUnavailableError
from rmm.memory.pg_database import DEFAULT_POOL_MAX, PgDatabase


def test_a_full_pool_is_exhaustion_naming_pool_max_not_an_unreachable_server(pg_url: str) -> None:
    db = PgDatabase(pg_url, pool_min=1, pool_max=1, pool_timeout_s=0.3)
    try:
        with db.tx() as cur:  # the pool's one connection, held
            with pytest.raises(DatabasePoolExhaustedError, match=r"pool_max") as caught, db.tx():
                pass
            assert "unreachable" not in str(caught.value) and "all 1 connections in use" in str(caught.value)
            assert cur.execute("SELECT 1").fetchone() == (1,)  # the holder is unharmed
        with db.tx() as cur:  # given back: the next transaction gets it
            assert cur.execute("SELECT 2").fetchone() == (2,)
        assert db.pool.get_stats()["pool_available"] == 1
    finally:
        db.close()


def test_the_default_pool_covers_what_two_pools_did() -> None:
    assert DEFAULT_POOL_MAX == 14  # 8 (memories) + 6 (server state) before they became one pool


def test_database_errors_answer_503_with_their_own_codes(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("fastapi")
    from rmm.serve.http_errors import error_response

    caplog.set_level(logging.WARNING, logger="rmm.serve.http_errors")
    busy = error_response(DatabasePoolExhaustedError("no free PostgreSQL connection"))
    down = error_response(DatabaseUnavailableError("PostgreSQL at x is unreachable"))
    # the answer names no internal detail (the database's URL, its host); the log keeps the full message
    assert (busy.status_code, busy.body) == (503, b'{"detail":"the database is busy (every connection of this server '
                                                  b'is in use); retry shortly","code":"database_busy"}')
    assert (down.status_code, down.body) == (503, b'{"detail":"the database is unreachable; retry shortly",'
                                                  b'"code":"database_unavailable"}')
    logged = [(r.levelno, r.getMessage()) for r in caplog.records]  # the operator sees what the client got
    assert (logging.WARNING, "answered 503 database_busy: no free PostgreSQL connection") in logged
    assert (logging.WARNING, "answered 503 database_unavailable: PostgreSQL at x is unreachable") in logged


def test_pooled_connections_carry_tcp_keepalives(pg_url: str) -> None:
    db = PgDatabase(pg_url, pool_min=1, pool_max=1, pool_timeout_s=2.0)
    try:
        with db.pool.connection() as conn:
            assert conn.info.get_parameters().get("keepalives") == "1"
            assert conn.info.get_parameters().get("keepalives_idle") == "5"
    finally:
        db.close()
