"""One PostgreSQL bank schema as a handle for the server's shared state (not the memories).

The memory store (`pg_store.PostgresStore`) owns its own pool for memories and search; the
server's other tables — selections, feedback, jobs, reranker versions (migration 0002) — are
reached through this handle, which migrates the schema once, keeps a small pool for short
transactions, and opens the dedicated connections a session-level advisory lock needs (a pooled
connection would hand the lock to whoever borrows it next).
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
)

if TYPE_CHECKING:
    import psycopg

__all__ = ["PgDatabase"]

log = logging.getLogger(__name__)


class PgDatabase:
    """A migrated bank schema: pooled transactions (`tx`) and dedicated connections (`dedicated`)."""

    def __init__(self, url: str, *, pool_min: int = 1, pool_max: int = 6, pool_timeout_s: float = 10.0) -> None:
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
    def tx(self) -> Iterator[psycopg.Cursor[Any]]:
        """One transaction on a pooled connection: committed when the block ends, else rolled back."""
        if self._closed:
            raise RmmError(f"database handle {self.location} is closed")
        with (database_errors(self.location), self.pool.connection() as conn, conn.transaction(),
              conn.cursor() as cur):
            yield cur

    def dedicated(self, **params: Any) -> psycopg.Connection[Any]:
        """A new autocommit connection of its own (search_path set to the bank schema), e.g. to hold
        a session-level advisory lock that must die with exactly this connection."""
        return _connect(self.where, options=self.options, **params)

    def close(self) -> None:
        with self._close_lock:
            if not self._closed:
                self._closed = True
                self.pool.close()
