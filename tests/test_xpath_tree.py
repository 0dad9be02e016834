"""Semantic XPath's tree in the memory layer (rmm.memory.tree) on both stores: nodes with type,
position, attributes and parent, pointing at memories; versions on every edit; the induced schema Σ;
deletes cascade; refused writes change nothing; a failure before commit leaves nothing; an older
SQLite file is upgraded in place."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch
from test_store import store  # noqa: F401 - the same two stores (SQLite, embedded PostgreSQL)

from fakes import run_in_threads

from rmm.errors import UnknownMemoryError, UnknownUserError
from rmm.memory import graph, tree
from rmm.memory.storage import MemoryStorage
from rmm.memory.store import SCHEMA_VERSION, MemoryStore
from rmm.memory.tree import NodeEdit, TreeNode, TreeWriteError, UnknownNodeError, induce_schema
from rmm.types import Memory


def turn(memory_id: str, text: str | None = None, user: str = "alice") -> Memory:
    return Memory(id=memory_id, user_id=user, kind="turn", text=text or f"turn {memory_id}", refs=[memory_id])


def conversation(store: MemoryStorage, user: str = "alice") -> None:
    """User → two Sessions (s1 shows a session memory) → Turns t1, t2 (s1) and t3 (s2)."""
    memories = [turn("t1", "we went hiking", user), turn("t2", "the alps were cold", user),
                turn("t3", "I adopted a puppy", user),
                Memory(id="m-s1", user_id=user, kind="session", text="a hiking trip", refs=["t1", "t2"])]
    nodes = [TreeNode("u", "User", attributes={"name": user}),
             TreeNode("s1", "Session", "u", attributes={"date": "2023-05-01"}, memory_id="m-s1"),
             TreeNode("s2", "Session", "u", attributes={"date": "2023-06-01"}),
             TreeNode("n1", "Turn", "s1", memory_id="t1", attributes={"speaker": "Ana"}),
             TreeNode("n2", "Turn", "s1", memory_id="t2", attributes={"speaker": "Bo"}),
             TreeNode("n3", "Turn", "s2", memory_id="t3", attributes={"speaker": "Ana"})]
    store.add_nodes(user, nodes, memories, embeddings=torch.eye(4))


def shape(nodes: list[TreeNode]) -> list[tuple[str, str, str | None, int]]:
    return [(n.id, n.type, n.parent, n.position or 0) for n in nodes]


def test_nodes_and_their_memories_are_written_together(store: MemoryStorage) -> None:
    conversation(store)
    nodes = store.tree("alice")
    assert shape(nodes) == [("u", "User", None, 0), ("s1", "Session", "u", 0), ("n1", "Turn", "s1", 0),
                            ("n2", "Turn", "s1", 1), ("s2", "Session", "u", 1), ("n3", "Turn", "s2", 0)]
    by_id = {n.id: n for n in nodes}
    assert by_id["n1"].text == "we went hiking" and by_id["n1"].content == "we went hiking"
    assert by_id["s2"].text is None and by_id["s2"].content == "date: 2023-06-01"
    assert by_id["s1"].attributes == {"date": "2023-05-01"} and by_id["s1"].memory_id == "m-s1"
    assert all(n.version == 1 and n.revision == store.generation("alice") for n in nodes)
    # the memories are ordinary: the index sees them
    ids, vectors = store.embeddings("alice")
    assert ids == ["t1", "t2", "t3", "m-s1"] and vectors.shape == (4, 4)


def test_explicit_positions_order_siblings(store: MemoryStorage) -> None:
    store.add_nodes("alice", [TreeNode("d", "Day"), TreeNode("p3", "POI", "d", 30), TreeNode("p1", "POI", "d", 10),
                              TreeNode("p2", "POI", "d", 20)], [turn("t1")])
    store.add_nodes("alice", [TreeNode("p4", "POI", "d")])  # after the last sibling
    assert [(n.id, n.position) for n in store.tree("alice")] == [("d", 0), ("p1", 10), ("p2", 20), ("p3", 30), ("p4", 31)]


def test_an_edit_writes_a_version_and_keeps_the_history(store: MemoryStorage) -> None:
    conversation(store)
    before = store.generation("alice")
    store.edit_nodes("alice", [NodeEdit("s2", attributes={"date": "2023-06-02", "place": "Oslo"}),
                               NodeEdit("n3", parent="s1", position=5)])
    after = store.generation("alice")
    assert after == before + 1
    nodes = {n.id: n for n in store.tree("alice")}
    assert nodes["s2"].attributes == {"date": "2023-06-02", "place": "Oslo"} and nodes["s2"].version == 2
    assert nodes["n3"].parent == "s1" and nodes["n3"].revision == after
    assert [(v.version, v.attributes) for v in store.node_history("alice", "s2")] == [
        (1, {"date": "2023-06-01"}), (2, {"date": "2023-06-02", "place": "Oslo"})]
    # reads as of the earlier generation see the tree as it was
    old = store.tree("alice", as_of=before)
    assert shape(old) == shape(tree.tree_order(old)) and {n.id: n.parent for n in old}["n3"] == "s2"
    assert {n.id: n.attributes for n in old}["s2"] == {"date": "2023-06-01"}


def test_updating_a_memory_versions_the_nodes_that_show_it(store: MemoryStorage) -> None:
    conversation(store)
    before = store.generation("alice")
    store.update(turn("t1", "we went hiking in the Alps"))
    store.update(turn("t2", "the alps were cold"))  # same text: no new version
    node = {n.id: n for n in store.tree("alice")}["n1"]
    assert (node.version, node.text) == (2, "we went hiking in the Alps")
    assert [v.text for v in store.node_history("alice", "n1")] == ["we went hiking", "we went hiking in the Alps"]
    assert [v.version for v in store.node_history("alice", "n2")] == [1]
    assert {n.id: n.text for n in store.tree("alice", as_of=before)}["n1"] == "we went hiking"


def test_a_merge_repoints_the_node_and_keeps_what_it_replaced(store: MemoryStorage) -> None:
    conversation(store)
    store.add([turn("t12", "we went hiking; the alps were cold")])
    store.edit_nodes("alice", [NodeEdit("n1", memory_id="t12")])
    store.remove_nodes("alice", ["n2"])
    store.delete("alice", ["t1", "t2"])  # the merged memories go; the node's history keeps their text
    nodes = {n.id: n for n in store.tree("alice")}
    assert "n2" not in nodes and nodes["n1"].text == "we went hiking; the alps were cold"
    history = store.node_history("alice", "n1")
    assert [(v.memory_id, v.text) for v in history] == [(None, "we went hiking"), ("t12", "we went hiking; the alps were cold")]


def test_removing_a_node_tombstones_its_subtree(store: MemoryStorage) -> None:
    conversation(store)
    before = store.generation("alice")
    store.remove_nodes("alice", ["s1"])
    assert [n.id for n in store.tree("alice")] == ["u", "s2", "n3"]
    assert [n.id for n in store.tree("alice", as_of=before)] == ["u", "s1", "n1", "n2", "s2", "n3"]
    assert [v.deleted for v in store.node_history("alice", "n1")] == [False, True]
    assert [m.id for m in store.memories("alice")] == ["t1", "t2", "t3", "m-s1"]  # memories stay
    with pytest.raises(TreeWriteError, match="already in the tree"):  # a removed id keeps its history
        store.add_nodes("alice", [TreeNode("s1", "Session", "u")])
    with pytest.raises(UnknownNodeError):
        store.edit_nodes("alice", [NodeEdit("n1", attributes={})])


def test_schema_is_induced_from_what_is_stored(store: MemoryStorage) -> None:
    conversation(store)
    schema = induce_schema(store.tree("alice"))
    assert dict(schema.types) == {"User": 1, "Session": 2, "Turn": 3}
    assert dict(schema.attributes) == {"User": ("name",), "Session": ("date",), "Turn": ("speaker",)}
    assert dict(schema.children) == {(None, "User"): 1, ("User", "Session"): 2, ("Session", "Turn"): 3}
    assert schema.allows("Session", "Turn") and not schema.allows("Turn", "Session")
    assert schema.as_dict()["types"]["Session"] == {"count": 2, "attributes": ["date"], "children": {"Turn": 3}}
    assert schema.describe().splitlines() == ["(root) -> User (1)", "Session (2) [date] -> Turn (3)",
                                              "Turn (3) [speaker]", "User (1) [name] -> Session (2)"]
    store.add_nodes("alice", [TreeNode("e1", "Event", "s2", attributes={"what": "puppy"})])
    assert induce_schema(store.tree("alice")).allows("Session", "Event")


def test_deleting_a_memory_cascades_to_its_nodes_subtree(store: MemoryStorage) -> None:
    conversation(store)
    store.delete("alice", ["m-s1"])  # s1 shows it: s1 and its turns leave the tree (the turns' memories stay)
    assert [n.id for n in store.tree("alice")] == ["u", "s2", "n3"]
    with pytest.raises(UnknownNodeError):
        store.node_history("alice", "n1")
    assert [m.id for m in store.memories("alice")] == ["t1", "t2", "t3"]
    store.add_nodes("alice", [TreeNode("s1", "Session", "u")])  # the id is free again
    assert store.node_history("alice", "s1")[0].version == 1


def test_deleting_a_user_deletes_the_tree(store: MemoryStorage) -> None:
    conversation(store)
    conversation(store, "bo")
    store.delete_user("alice")
    with pytest.raises(UnknownUserError):
        store.tree("alice")
    store.add([turn("x")])
    assert store.tree("alice") == []
    assert len(store.tree("bo")) == 6


def test_bad_tree_writes_are_refused_and_change_nothing(store: MemoryStorage) -> None:
    conversation(store)
    generation, nodes = store.generation("alice"), store.tree("alice")
    refused = [
        (UnknownNodeError, lambda: store.add_nodes("alice", [TreeNode("x", "Turn", "nope")])),
        (UnknownMemoryError, lambda: store.add_nodes("alice", [TreeNode("x", "Turn", "s1", memory_id="zzz")])),
        (TreeWriteError, lambda: store.add_nodes("alice", [TreeNode("n1", "Turn", "s1")])),
        (TreeWriteError, lambda: store.add_nodes("alice", [TreeNode("x", "Turn"), TreeNode("x", "Turn")])),
        (TreeWriteError, lambda: store.add_nodes("alice", [TreeNode("a", "T", "b"), TreeNode("b", "T", "a")])),
        (TreeWriteError, lambda: store.edit_nodes("alice", [NodeEdit("u", parent="n1")])),  # a cycle
        (TreeWriteError, lambda: store.edit_nodes("alice", [NodeEdit("u", parent=None), NodeEdit("u", position=3)])),
        (UnknownNodeError, lambda: store.edit_nodes("alice", [NodeEdit("s1", parent="nope")])),
        (UnknownMemoryError, lambda: store.edit_nodes("alice", [NodeEdit("s1", memory_id="zzz")])),
        (UnknownNodeError, lambda: store.remove_nodes("alice", ["s1", "nope"])),
        (ValueError, lambda: store.add_nodes("alice", [TreeNode("x", "Turn")], [turn("new", user="bo")])),
        (UnknownUserError, lambda: store.add_nodes("nobody", [TreeNode("x", "Turn")])),
        (UnknownUserError, lambda: store.edit_nodes("nobody", [NodeEdit("x", attributes={})])),
        (ValueError, lambda: store.tree("alice", as_of=-1)),
        (TypeError, lambda: store.edit_nodes("alice", [TreeNode("s1", "Session")])),  # type: ignore[list-item]
        (TreeWriteError, lambda: store.remove_nodes("alice", [""])),
    ]
    for error, write in refused:
        with pytest.raises(error):
            write()
    # a memory in a refused batch is not stored either
    with pytest.raises(UnknownNodeError):
        store.add_nodes("alice", [TreeNode("x", "Turn", "nope", memory_id="t9")], [turn("t9")])
    assert store.tree("alice") == nodes and store.generation("alice") == generation
    assert [m.id for m in store.memories("alice")] == ["t1", "t2", "t3", "m-s1"]


@pytest.mark.parametrize(("build", "message"), [
    (lambda: TreeNode("x", "not a type"), "identifier"),
    (lambda: TreeNode("x", "1st"), "identifier"),
    (lambda: TreeNode("", "T"), "non-empty"),
    (lambda: TreeNode("x", "T", "x"), "own parent"),
    (lambda: TreeNode("x", "T", attributes={"node": "v"}), "other than 'node'"),
    (lambda: TreeNode("x", "T", attributes={"a b": "v"}), "identifier"),
    (lambda: TreeNode("x", "T", attributes={"a": 3}), "must be text"),
    (lambda: TreeNode("x", "T", position=1.5), "integer"),  # type: ignore[arg-type]
    (lambda: NodeEdit("x", position=True), "integer"),
])
def test_bad_records_are_refused_before_any_write(build, message: str) -> None:
    with pytest.raises(TreeWriteError, match=message):
        build()


def test_a_failure_before_commit_leaves_neither_nodes_nor_memories(store: MemoryStorage, monkeypatch) -> None:
    """Crash consistency at store level: the failure strikes after the memories and the first node
    rows are written, before the transaction commits."""
    conversation(store)
    generation, nodes = store.generation("alice"), store.tree("alice")
    real = tree._insert_version
    calls = {"n": 0}

    def fail_on_second(*args: object) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure after a node row was written")
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(tree, "_insert_version", fail_on_second)
    with pytest.raises(RuntimeError, match="injected"):
        store.add_nodes("alice", [TreeNode("s3", "Session", "u", memory_id="t4"), TreeNode("n4", "Turn", "s3")],
                        [turn("t4")], embeddings=torch.ones(1, 4))
    calls["n"] = 0
    with pytest.raises(RuntimeError, match="injected"):
        store.edit_nodes("alice", [NodeEdit("s1", attributes={}), NodeEdit("s2", attributes={})])
    calls["n"] = 0
    with pytest.raises(RuntimeError, match="injected"):
        store.update(turn("t1", "changed"))  # n1 versioned: only one row; then fail in the next write
        store.remove_nodes("alice", ["s1"])
    monkeypatch.undo()
    assert [m.id for m in store.memories("alice")] == ["t1", "t2", "t3", "m-s1"]
    assert store.embeddings("alice")[0] == ["t1", "t2", "t3", "m-s1"]
    assert store.tree("alice")[:2] == nodes[:2] and store.generation("alice") == generation + 1
    assert {n.id: n.text for n in store.tree("alice")}["n1"] == "changed"  # the update that committed
    assert {n.id: n.attributes for n in store.tree("alice")}["s1"] == {"date": "2023-05-01"}
    store.add_nodes("alice", [TreeNode("s3", "Session", "u", memory_id="t4")], [turn("t4")])  # nothing in the way
    assert store.node_history("alice", "s3")[0].version == 1


@pytest.mark.parametrize("old", [1, 2])
def test_an_older_sqlite_file_is_upgraded_in_place(tmp_path: Path, old: int) -> None:
    path = tmp_path / "old.sqlite"
    with MemoryStore(path) as s:
        s.add([turn("t1", "kept")])
    conn = sqlite3.connect(path)
    for table in tree.TREE_TABLES + (graph.GRAPH_TABLES if old == 1 else ()):
        conn.execute(f"DROP TABLE {table}")
    conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(old),))
    conn.commit()
    conn.close()
    with MemoryStore(path) as s:
        assert s.get_meta("schema_version") == str(SCHEMA_VERSION) == "3"
        assert [m.text for m in s.memories("alice")] == ["kept"]
        s.add_nodes("alice", [TreeNode("s", "Session"), TreeNode("n", "Turn", "s", memory_id="t1")])
        assert [(n.id, n.text) for n in s.tree("alice")] == [("s", None), ("n", "kept")]
    with MemoryStore(path) as s:  # opened again: nothing left to upgrade
        assert len(s.tree("alice")) == 2


def test_concurrent_writers_append_siblings_without_clashing_positions(pg_url: str) -> None:
    """PostgreSQL: writers in several connections appending children to one node each get their own
    position and version (the generation bump serialises one user's tree writes before they read it)."""

    from rmm.memory.pg_store import PostgresStore

    stores = [PostgresStore(pg_url) for _ in range(4)]
    try:
        stores[0].add_nodes("alice", [TreeNode("s", "Session")], [turn("t0")])
        def add(i: int) -> None:
            for j in range(5):
                stores[i].add_nodes("alice", [TreeNode(f"n{i}.{j}", "Turn", "s")],
                                    [turn(f"t{i}.{j}")] if j % 2 else [])
                stores[i].edit_nodes("alice", [NodeEdit("s", attributes={"last": f"{i}.{j}"})])

        errors = run_in_threads(add, 4)
        assert not errors, errors
        children = [n for n in stores[0].tree("alice") if n.parent == "s"]
        assert sorted(n.position for n in children) == list(range(20))  # type: ignore[type-var]
        assert [v.version for v in stores[0].node_history("alice", "s")] == list(range(1, 22))
    finally:
        for store in stores:
            store.close()
