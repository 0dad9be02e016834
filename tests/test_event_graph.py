"""The event graph in the memory layer (rmm.memory.graph) on both stores: events are memories of kind
``event``; edges, topics and memberships are written in the events' transaction, deleted with them,
moved by a merge (`rewire`), and a failure half-way through a write leaves nothing."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch
from test_store import store  # noqa: F401 - the same two stores (SQLite, embedded PostgreSQL)

from fakes import run_in_threads

from rmm.errors import UnknownMemoryError, UnknownUserError
from rmm.memory import graph
from rmm.memory.graph import Edge, Event, Topic
from rmm.memory.storage import MemoryStorage
from rmm.memory.store import SCHEMA_VERSION, MemoryStore
from rmm.types import Memory


def event(memory_id: str, user: str = "alice", text: str | None = None, **fields: object) -> Memory:
    fields.setdefault("refs", [f"t:{memory_id}"])
    fields.setdefault("time_span", ("2024-01-01", None))
    return Memory(id=memory_id, user_id=user, kind="event", text=text or f"event {memory_id}", **fields)  # type: ignore[arg-type]


def chain(store: MemoryStorage) -> None:
    """a -> b -> c (``next``), a -> c (``causes``), topics t1 = {a, b}, t2 = {c}."""
    store.add_events("alice", [Event(event("a"), ("Ana", "Bo")), event("b"), event("c")],
                     [Edge("a", "b", "next", ("t:1",)), Edge("b", "c", "next"), Edge("a", "c", "causes", ("t:2", "t:3"))],
                     [Topic("t1", "travel", ("a", "b")), Topic("t2", "work", ("c",))], embeddings=torch.eye(3))


def test_events_are_memories_the_index_sees(store: MemoryStorage) -> None:
    chain(store)
    assert [m.kind for m in store.memories("alice")] == ["event"] * 3
    ids, vectors = store.embeddings("alice")
    assert ids == ["a", "b", "c"] and vectors.shape == (3, 3)
    assert store.participants("alice", ["a", "b", "nope"]) == {"a": ("Ana", "Bo"), "b": ()}


def test_neighbour_reads_by_direction_and_label(store: MemoryStorage) -> None:
    chain(store)
    assert store.neighbours("alice", "a") == [Edge("a", "b", "next", ("t:1",)), Edge("a", "c", "causes", ("t:2", "t:3"))]
    assert store.neighbours("alice", "a", "out", label="causes") == [Edge("a", "c", "causes", ("t:2", "t:3"))]
    assert [(e.source, e.target) for e in store.neighbours("alice", "c", "in")] == [("a", "c"), ("b", "c")]
    assert [(e.source, e.target) for e in store.neighbours("alice", "b", "both")] == [("a", "b"), ("b", "c")]
    with pytest.raises(ValueError, match="direction"):
        store.neighbours("alice", "a", "sideways")  # type: ignore[arg-type]
    with pytest.raises(UnknownMemoryError):
        store.neighbours("alice", "zzz")
    with pytest.raises(UnknownUserError):
        store.neighbours("nobody", "a")


def test_topics_and_members(store: MemoryStorage) -> None:
    chain(store)
    assert store.topics("alice") == [Topic("t1", "travel", ("a", "b")), Topic("t2", "work", ("c",))]
    store.add_events("alice", [event("d")], [Edge("c", "d", "next")], [Topic("t2", members=("d",))])
    assert store.members("alice", "t2") == ["c", "d"] and store.members("alice", "none") == []
    assert store.topics("alice")[1].summary == "work"  # an empty summary keeps the stored one


def test_an_edge_added_again_pools_its_evidence(store: MemoryStorage) -> None:
    chain(store)
    store.add_events("alice", [], [Edge("a", "b", "next", ("t:9", "t:1"))])
    assert store.neighbours("alice", "a", label="next") == [Edge("a", "b", "next", ("t:1", "t:9"))]


def test_bad_graph_writes_are_refused_and_change_nothing(store: MemoryStorage) -> None:
    chain(store)
    generation = store.generation("alice")
    with pytest.raises(UnknownMemoryError, match="not stored events"):  # an edge to a missing event
        store.add_events("alice", [event("d")], [Edge("d", "missing", "next")])
    store.add_events("alice", [], [], [])
    store.add([Memory(id="turn1", user_id="alice", kind="turn", text="a turn")])
    with pytest.raises(UnknownMemoryError, match="not stored events"):  # ends must be events
        store.add_events("alice", [], [Edge("a", "turn1", "next")])
    with pytest.raises(ValueError, match="at most 3"):
        store.add_events("alice", [Event(event("e"), ("p", "q", "r", "s"))])
    with pytest.raises(ValueError, match="explicit time"):
        store.add_events("alice", [event("e", time_span=None)])
    with pytest.raises(ValueError, match="kind must be 'event'"):
        store.add_events("alice", [Memory(id="e", user_id="alice", kind="turn", text="x")])
    with pytest.raises(ValueError, match="belongs to user"):
        store.add_events("alice", [event("e", user="bo")])
    with pytest.raises(ValueError, match="its own neighbour"):
        Edge("a", "a", "next")
    assert [m.id for m in store.memories("alice")] == ["a", "b", "c", "turn1"]
    assert store.generation("alice") == generation + 2  # the empty write and the turn, nothing else
    assert len(store.neighbours("alice", "a", "both")) == 2


def test_deleting_an_event_deletes_its_edges_and_memberships(store: MemoryStorage) -> None:
    chain(store)
    store.delete("alice", ["b"])
    assert store.neighbours("alice", "a", "both") == [Edge("a", "c", "causes", ("t:2", "t:3"))]
    assert store.neighbours("alice", "c", "in") == [Edge("a", "c", "causes", ("t:2", "t:3"))]
    assert store.members("alice", "t1") == ["a"]
    assert store.participants("alice", ["a", "b"]) == {"a": ("Ana", "Bo")}
    store.add_events("alice", [event("b")])  # the id is free again, with no stale edge
    assert store.neighbours("alice", "b", "both") == []


def test_deleting_a_user_deletes_the_whole_graph(store: MemoryStorage) -> None:
    chain(store)
    store.add_events("bo", [event("a", user="bo"), event("b", user="bo")], [Edge("a", "b", "next")], [Topic("t1", "bo's")])
    store.delete_user("alice")
    store.add_events("alice", [event("a")])
    assert store.neighbours("alice", "a", "both") == [] and store.topics("alice") == []
    assert store.participants("alice", ["a"]) == {"a": ()}
    assert store.neighbours("bo", "a") == [Edge("a", "b", "next")] and store.topics("bo") == [Topic("t1", "bo's")]


def test_a_merge_rewires_edges_and_memberships(store: MemoryStorage) -> None:
    chain(store)
    store.add_events("alice", [event("d"), event("ab")], [Edge("c", "d", "next"), Edge("b", "d", "causes", ("t:4",))],
                     [Topic("t3", "x", ("b",))])
    store.rewire("alice", ["a", "b"], "ab")  # a and b merged into ab; then the caller deletes them
    store.delete("alice", ["a", "b"])
    assert store.neighbours("alice", "ab") == [Edge("ab", "c", "causes", ("t:2", "t:3")), Edge("ab", "c", "next"),
                                               Edge("ab", "d", "causes", ("t:4",))]  # a -> b became a loop: dropped
    assert store.neighbours("alice", "ab", "in") == []
    assert store.members("alice", "t1") == ["ab"] and store.members("alice", "t3") == ["ab"]
    with pytest.raises(UnknownMemoryError):
        store.rewire("alice", ["a"], "ab")


def test_a_failure_inside_add_events_leaves_neither_events_nor_edges(store: MemoryStorage, monkeypatch) -> None:
    """The crash-consistency check at store level (no route writes events yet): the failure strikes
    after the events and their edges are written, before the transaction commits."""
    chain(store)
    generation = store.generation("alice")

    def fail(*args: object) -> None:
        raise RuntimeError("injected failure after the edges were written")

    monkeypatch.setattr(graph, "_write_topics", fail)
    with pytest.raises(RuntimeError, match="injected"):
        store.add_events("alice", [event("d"), event("e")], [Edge("c", "d", "next"), Edge("d", "e", "next")],
                         [Topic("t1", members=("d",))], embeddings=torch.ones(2, 3))
    monkeypatch.undo()
    assert [m.id for m in store.memories("alice")] == ["a", "b", "c"]
    assert store.embeddings("alice")[0] == ["a", "b", "c"]
    assert store.neighbours("alice", "c", "both") == [Edge("a", "c", "causes", ("t:2", "t:3")), Edge("b", "c", "next")]
    assert store.members("alice", "t1") == ["a", "b"] and store.generation("alice") == generation
    store.add_events("alice", [event("d")], [Edge("c", "d", "next")])  # nothing half-written is in the way
    assert store.neighbours("alice", "d", "in") == [Edge("c", "d", "next")]


def test_a_version_1_sqlite_file_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    with MemoryStore(path) as s:
        s.add([Memory(id="m", user_id="alice", kind="turn", text="kept")])
    conn = sqlite3.connect(path)
    for table in graph.GRAPH_TABLES:
        conn.execute(f"DROP TABLE {table}")
    conn.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
    conn.commit()
    conn.close()
    with MemoryStore(path) as s:
        assert s.get_meta("schema_version") == str(SCHEMA_VERSION) == "3"
        assert [m.text for m in s.memories("alice")] == ["kept"]
        s.add_events("alice", [event("a"), event("b")], [Edge("a", "b", "next")])
        assert s.neighbours("alice", "a") == [Edge("a", "b", "next")]


def test_concurrent_writers_of_one_edge_pool_their_evidence(pg_url: str) -> None:
    """PostgreSQL: writers in several connections adding the same edge neither fail nor lose evidence
    (the generation bump serialises one user's writes before the edge's read-modify-write)."""

    from rmm.memory.pg_store import PostgresStore

    stores = [PostgresStore(pg_url) for _ in range(4)]
    try:
        stores[0].add_events("alice", [event("a"), event("b")], [Edge("a", "b", "next", ("t:0",))])
        def add(i: int) -> None:
            for j in range(5):
                stores[i].add_events("alice", [], [Edge("a", "b", "next", (f"t:{i}.{j}",))])

        errors = run_in_threads(add, 4)
        assert not errors, errors
        (edge,) = stores[0].neighbours("alice", "a")
        assert sorted(edge.evidence) == sorted(["t:0", *(f"t:{i}.{j}" for i in range(4) for j in range(5))])
    finally:
        for store in stores:
            store.close()
