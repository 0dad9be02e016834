"""MemoryStore: durable memories + embeddings in SQLite, generations, typed errors."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rmm.errors import CorruptFileError, DimensionMismatchError, UnknownMemoryError, UnknownUserError
from rmm.memory.storage import MemoryStorage
from rmm.memory.store import SCHEMA_VERSION, DuplicateMemoryError, MemoryStore
from rmm.types import Memory


def mem(memory_id: str, user: str = "alice", text: str | None = None, **fields: object) -> Memory:
    return Memory(id=memory_id, user_id=user, kind="turn", text=text or f"text of {memory_id}", **fields)  # type: ignore[arg-type]


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MemoryStorage]:
    """The same behaviour tests against both stores (PostgreSQL: the embedded test server)."""
    if request.param == "sqlite":
        s: MemoryStorage = MemoryStore(tmp_path / "memories.sqlite")
    else:
        from rmm.memory.pg_store import PostgresStore

        s = PostgresStore(request.getfixturevalue("pg_url"))
    yield s
    s.close()


def test_round_trip_keeps_every_field(store: MemoryStorage) -> None:
    original = Memory(
        id="t1",
        user_id="alice",
        kind="topic",
        text="Alice likes hiking",
        refs=["conv-1:D1:3", "conv-1:D2:1"],
        source_text="raw turns",
        created_at=1700000000.25,
        updated_at=1700000100.5,
        merged_from=["a", "b"],
        time_span=("2023-05-01", None),
    )
    store.add([original])
    (loaded,) = store.get("alice", ["t1"])
    assert loaded == original
    assert isinstance(loaded.time_span, tuple)
    store.add([mem("t2", time_span=None)])
    assert store.get("alice", ["t2"])[0].time_span is None


def test_memories_in_insertion_order_and_get_in_requested_order(store: MemoryStorage) -> None:
    store.add([mem("b"), mem("a")])
    store.add([mem("c")])
    assert [m.id for m in store.memories("alice")] == ["b", "a", "c"]
    assert [m.id for m in store.get("alice", ["c", "b"])] == ["c", "b"]


def test_users_and_partitioning(store: MemoryStorage) -> None:
    store.add([mem("1", "bob"), mem("1", "alice")])  # the same id may exist for two users
    assert store.users() == ["alice", "bob"]
    assert store.has_user("bob") and not store.has_user("carol")
    assert [m.user_id for m in store.memories("bob")] == ["bob"]


def test_embeddings_round_trip_exactly(store: MemoryStorage) -> None:
    vectors = torch.randn(3, 8)
    store.add([mem("a"), mem("b"), mem("c")], vectors)
    ids, loaded = store.embeddings("alice")
    assert ids == ["a", "b", "c"]
    assert loaded.dtype == torch.float32 and torch.equal(loaded, vectors)
    ids, picked = store.embeddings("alice", ["c", "a"])
    assert ids == ["c", "a"] and torch.equal(picked, vectors[[2, 0]])


def test_memories_without_embeddings_are_not_in_the_matrix(store: MemoryStorage) -> None:
    store.add([mem("a")], torch.ones(1, 4))
    store.add([mem("b")])
    ids, matrix = store.embeddings("alice")
    assert ids == ["a"] and matrix.shape == (1, 4)
    with pytest.raises(UnknownMemoryError):
        store.embeddings("alice", ["b"])


def test_wrong_embedding_shapes_are_refused(store: MemoryStorage) -> None:
    with pytest.raises(ValueError, match="shape"):
        store.add([mem("a"), mem("b")], torch.zeros(3, 4))
    store.add([mem("a")], torch.zeros(1, 4))
    with pytest.raises(DimensionMismatchError):
        store.add([mem("b")], torch.zeros(1, 5))
    with pytest.raises(ValueError, match="NaN"):
        store.add([mem("c")], torch.full((1, 4), float("nan")))
    assert [m.id for m in store.memories("alice")] == ["a"]


def test_existing_id_is_refused_and_the_batch_is_rolled_back(store: MemoryStorage) -> None:
    store.add([mem("a", text="original")], torch.zeros(1, 4))
    generation = store.generation("alice")
    with pytest.raises(DuplicateMemoryError, match="'a'"):
        # "new" is inserted first inside the transaction; the clash on "a" must undo it.
        store.add([mem("new"), mem("a", text="overwrite?")], torch.ones(2, 4))
    assert [m.id for m in store.memories("alice")] == ["a"]
    assert store.get("alice", ["a"])[0].text == "original"
    assert torch.equal(store.embeddings("alice")[1], torch.zeros(1, 4))
    assert store.generation("alice") == generation
    with pytest.raises(DuplicateMemoryError, match="repeated"):
        store.add([mem("x"), mem("x")])


def test_unknown_user_and_memory_errors(store: MemoryStorage) -> None:
    store.add([mem("a")])
    with pytest.raises(UnknownUserError, match="alice"):  # the message lists known users
        store.get("zed", ["a"])
    for call in (lambda: store.memories("zed"), lambda: store.delete_user("zed"), lambda: store.generation("zed"),
                 lambda: store.delete("zed", ["a"]), lambda: store.update(mem("a", "zed")), lambda: store.embeddings("zed")):
        with pytest.raises(UnknownUserError):
            call()
    with pytest.raises(UnknownMemoryError, match="nope"):
        store.get("alice", ["a", "nope"])
    with pytest.raises(UnknownMemoryError):
        store.update(mem("nope"))
    with pytest.raises(UnknownMemoryError):
        store.delete("alice", ["a", "nope"])
    assert [m.id for m in store.memories("alice")] == ["a"]  # the failed delete removed nothing
    assert store.get("alice", []) == []
    with pytest.raises(UnknownUserError):
        store.get("zed", [])
    store.delete_user("alice")
    with pytest.raises(UnknownUserError):  # the one-query read still knows a deleted user
        store.get("alice", ["a"])


def test_update_replaces_fields_and_optionally_the_embedding(store: MemoryStorage) -> None:
    store.add([mem("a", text="old")], torch.zeros(1, 4))
    store.update(mem("a", text="new", refs=["r1"], updated_at=5.0))
    (m,) = store.get("alice", ["a"])
    assert (m.text, m.refs, m.updated_at) == ("new", ["r1"], 5.0)
    assert torch.equal(store.embeddings("alice")[1], torch.zeros(1, 4))  # kept
    store.update(mem("a", text="newer"), torch.ones(4))
    assert torch.equal(store.embeddings("alice")[1], torch.ones(1, 4))
    assert [x.id for x in store.memories("alice")] == ["a"]


def test_delete_and_delete_user(store: MemoryStorage) -> None:
    store.add([mem("a"), mem("b"), mem("c")], torch.eye(3))
    store.add([mem("z", "bob")])
    store.delete("alice", ["b"])
    assert [m.id for m in store.memories("alice")] == ["a", "c"]
    assert store.embeddings("alice")[0] == ["a", "c"]
    store.delete_user("alice")
    assert store.users() == ["bob"]
    with pytest.raises(UnknownUserError):
        store.memories("alice")
    store.add([mem("a")])  # a deleted user can come back, empty
    assert [m.id for m in store.memories("alice")] == ["a"]


def test_generation_bumps_on_every_write_only(store: MemoryStorage) -> None:
    store.add([mem("a")], torch.zeros(1, 2))
    g1 = store.generation("alice")
    store.memories("alice"), store.get("alice", ["a"]), store.embeddings("alice")
    assert store.generation("alice") == g1
    store.add([mem("b")], torch.zeros(1, 2))
    g2 = store.generation("alice")
    store.update(mem("b", text="changed"))
    g3 = store.generation("alice")
    store.delete("alice", ["a"])
    g4 = store.generation("alice")
    assert g1 < g2 < g3 < g4 and g4 - g1 == 3
    store.add([mem("x", "bob")])
    assert store.generation("alice") == g4  # other users' writes do not move it
    store.delete_user("alice")
    store.add([mem("a")], torch.zeros(1, 2))
    assert store.generation("alice") > g4  # never reused after delete_user


def test_meta_schema_and_pragmas(tmp_path: Path) -> None:
    path = tmp_path / "m.sqlite"
    with MemoryStore(path) as store:
        assert store.get_meta("schema_version") == str(SCHEMA_VERSION)
        assert store.get_meta("missing") is None and store.get_meta("missing", "d") == "d"
        store.set_meta("k", "v1")
        store.set_meta("k", "v2")
        assert len(store.store_id) == 32
        assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        with pytest.raises(TypeError):
            store.set_meta("k", 3)  # type: ignore[arg-type]
        store_id = store.store_id
    with MemoryStore(path) as again:
        assert again.get_meta("k") == "v2" and again.store_id == store_id


def test_persists_across_connections(tmp_path: Path) -> None:
    path = tmp_path / "m.sqlite"
    first = MemoryStore(path)
    first.add([mem("a")], torch.arange(4.0).reshape(1, 4))
    second = MemoryStore(path)  # sees the committed write while the first is still open
    assert [m.id for m in second.memories("alice")] == ["a"]
    first.add([mem("b")], torch.ones(1, 4))
    assert second.generation("alice") == first.generation("alice")
    first.close()
    assert torch.equal(second.embeddings("alice")[1][0], torch.arange(4.0))
    second.close()


def test_in_memory_store(tmp_path: Path) -> None:
    with MemoryStore(":memory:") as store:
        store.add([mem("a")])
        assert store.users() == ["alice"]


def test_garbage_file_is_refused_and_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / "memories.sqlite"
    garbage = b"this is not a database\n" * 200
    path.write_bytes(garbage)
    with pytest.raises(CorruptFileError, match=str(path)):
        MemoryStore(path)
    assert path.read_bytes() == garbage
    assert not Path(str(path) + "-wal").exists()


def test_foreign_sqlite_file_is_refused_and_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / "other.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.raises(CorruptFileError, match="not an rmm memory store"):
        MemoryStore(path)
    assert path.read_bytes() == before


def test_damaged_pages_raise_corrupt_file_error(tmp_path: Path) -> None:
    path = tmp_path / "m.sqlite"
    with MemoryStore(path) as store:
        store.add([mem(f"m{i}", text="x" * 500) for i in range(200)], torch.randn(200, 16))
        store._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(path.read_bytes())
    page = 4096
    data[page : len(data)] = b"\xff" * (len(data) - page)  # keep the header page, wreck the rest
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match=str(path)):
        with MemoryStore(path) as store:
            store.memories("alice")


def test_concurrent_writers_from_threads(store: MemoryStorage) -> None:
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(20):
                store.add([mem(f"{t}-{i}", user=f"u{t % 2}")], torch.full((1, 4), float(t)))
                store.memories(f"u{t % 2}")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(store.memories("u0")) == 40 and len(store.memories("u1")) == 40
    assert store.generation("u0") == 40


def test_closed_store_refuses_work(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path / "m.sqlite")
    store.close()
    store.close()  # idempotent
    with pytest.raises(Exception, match="closed"):
        store.users()


def test_set_meta_if_absent_keeps_the_first_value(store: MemoryStorage) -> None:
    assert store.set_meta_if_absent("encoder", "first") == "first"
    assert store.set_meta_if_absent("encoder", "second") == "first"  # first writer wins
    assert store.get_meta("encoder") == "first"
    with pytest.raises(TypeError):
        store.set_meta_if_absent("k", 3)  # type: ignore[arg-type]
