"""A PostgreSQL server that comes back is reached within seconds, however long it was away.

psycopg_pool re-tries a lost connection with a doubling delay (1, 2, 4 … s): after a 150 s
outage its next try came ~100 s after the server's return (issue 36, item 6). `open_pool` caps
that delay. The outage here is a database that refuses connections (`ALLOW_CONNECTIONS false`,
its sessions terminated) and comes back at once, so the time to recover is the pool's alone; the
pool's first delay is scaled down (10 ms, not 1 s) so a 3 s outage is as long, in doublings, as
a 5 min one.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest

psycopg = pytest.importorskip("psycopg", reason="PostgreSQL banks need psycopg (postgres extra)")
psycopg_pool = pytest.importorskip("psycopg_pool", reason="PostgreSQL banks need psycopg_pool (postgres extra)")

from psycopg import sql  # noqa: E402

from rmm.memory.pg_connect import RECONNECT_MAX_DELAY_S, open_pool, parse_location  # noqa: E402
from rmm.memory.pg_database import PgDatabase  # noqa: E402

OUTAGE_S = 3.0  # ~8 doublings of the scaled first delay: like ~5 min at psycopg_pool's 1 s


@pytest.fixture
def outage_db(pg_server_url: str) -> Iterator[tuple[str, str]]:
    """(URL of a database of its own, its name): taking it away touches no other test's database."""
    name = f"outage_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = urlunsplit(urlsplit(pg_server_url)._replace(path=f"/{name}"))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")  # the pool's connections register its type
    yield url, name
    with psycopg.connect(pg_server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _set_reachable(admin_url: str, name: str, reachable: bool) -> None:
    """Let connections into database `name` again, or refuse new ones and end the open ones."""
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS {}").format(
            sql.Identifier(name), sql.Literal(reachable)))
        if not reachable:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = %s AND pid <> pg_backend_pid()", (name,))


def test_the_pool_reaches_a_returning_server_within_its_capped_delay(
        pg_server_url: str, outage_db: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    url, name = outage_db
    monkeypatch.setattr(psycopg_pool.base.AttemptWithBackoff, "INITIAL_DELAY", 0.01)
    pool = open_pool(parse_location(url), "", min_size=1, max_size=1, timeout_s=0.3, reconnect_max_delay_s=0.1)
    try:
        with pool.connection() as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        _set_reachable(pg_server_url, name, False)
        start = time.monotonic()
        with pytest.raises(psycopg_pool.PoolTimeout), pool.connection():  # finds its connection dead:
            pass  # the pool starts re-connecting, every try refused
        time.sleep(max(0.0, start + OUTAGE_S - time.monotonic()))
        _set_reachable(pg_server_url, name, True)
        back = time.monotonic()
        while True:
            try:
                with pool.connection(timeout=0.05) as conn:
                    conn.execute("SELECT 1")
                break
            except psycopg_pool.PoolTimeout:
                assert time.monotonic() - back < 15, "the pool never reached the returned server"
        recovered_s = time.monotonic() - back
        # uncapped, the next try after 3 s of doublings from 10 ms is at ~5.1 s: > 1.5 s late
        assert recovered_s < 1.0, f"reconnected {recovered_s:.2f} s after the server was back"
    finally:
        pool.close()


def test_a_bank_pool_retries_at_least_every_few_seconds(pg_url: str) -> None:
    """What `rmm serve` opens: the default cap, a few seconds (the README's outage paragraph)."""
    db = PgDatabase(pg_url, pool_min=1, pool_max=1, pool_timeout_s=1.0)
    try:
        assert db.pool.reconnect_max_delay_s == RECONNECT_MAX_DELAY_S <= 5.0  # type: ignore[attr-defined]
    finally:
        db.close()
