"""One PostgreSQL bank schema: migrated once, reached through one pool.

Everything a process keeps in a bank schema goes through one handle: the memory store
(`pg_store.PostgresStore` is built on it and exposes it as `.database`) and the server's other
tables — selections, feedback, jobs, reranker versions (migration 0002). So a replica migrates
once and holds one pool, sized by the serve config's `database:` section. The handle also opens
the dedicated connections a session-level advisory lock needs (a pooled connection would hand
the lock to whoever borrows it next).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rmm.errors import RmmError
from rmm.memory.pg_connect import (
    _connect,
    database_errors,
    migrate,
    open_pool,
    parse_location,
    pool_exhausted,
)

if TYPE_CHECKING:
    import psycopg

__all__ = ["DEFAULT_POOL_MAX", "PgDatabase"]

log = logging.getLogger(__name__)

# Connections per process. One pool serves memory search and writes, selections, feedback claims
# (the feedback route is sync: up to 40 threadpool threads), reflection jobs and their lease
# renewals, sweeps, version reloads and /metrics — what two pools (8 + 6) used to.
DEFAULT_POOL_MAX = 14


class PgDatabase:
    """A migrated bank schema: pooled transactions (`tx`) and dedicated connections (`dedicated`)."""

    def __init__(self, url: str, *, pool_min: int = 1, pool_max: int = DEFAULT_POOL_MAX,
                 pool_timeout_s: float = 10.0) -> None:
        if pool_min < 0 or pool_max < max(1, pool_min) or pool_timeout_s <= 0:
            raise ValueError(f"need 0 <= pool_min <= pool_max, pool_max >= 1 and pool_timeout_s > 0, "
                             f"got {pool_min}, {pool_max}, {pool_timeout_s}")
        self.where = parse_location(url)
        self.options = migrate(self.where)
        self.pool = open_pool(self.where, self.options, min_size=pool_min, max_size=pool_max, timeout_s=pool_timeout_s)
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def location(self) -> str:
        """The URL without its password, for messages."""
        return self.where.display

    @contextmanager
    def tx(self, binary: bool = False) -> Iterator[psycopg.Cursor[Any]]:
        """One transaction on a pooled connection: committed when the block ends, else rolled back.
        `binary`: results in PostgreSQL's binary format (vectors read without text parsing)."""
        if self._closed:
            raise RmmError(f"database handle {self.location} is closed")
        with (database_errors(self.location), self._connection() as conn, conn.transaction(),
              conn.cursor(binary=binary) as cur):
            yield cur

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection. A pool timeout while the pool is at full size (`pool_max`) is this
        process's pool running short, not the server going away. The pool's own state decides it:
        a count of ours, read after the timeout, could see a connection handed back at that moment."""
        from psycopg_pool import PoolTimeout

        try:
            with self.pool.connection() as conn:
                yield conn
        except PoolTimeout as exc:  # only this getconn's: a nested tx() has mapped its own already
            if self.pool.get_stats().get("pool_size", 0) >= self.pool.max_size:
                raise pool_exhausted(self.location, self.pool.max_size, exc) from exc
            raise

    def dedicated(self, **params: Any) -> psycopg.Connection[Any]:
        """A new autocommit connection of its own (search_path set to the bank schema), e.g. to hold
        a session-level advisory lock that must die with exactly this connection."""
        return _connect(self.where, options=self.options, **params)

    def close(self) -> None:
        with self._close_lock:
            if not self._closed:
                self._closed = True
                self.pool.close()
