"""Durable memory storage: SQLite in WAL mode, one file per bank (DESIGN.md §4 "Index and bank").

The store is the source of truth. It keeps every `Memory` field and each memory's embedding
(float32 blob), so any vector index can be rebuilt from it without re-encoding, and a crash never
loses an acknowledged write: a public write returns only after its transaction has committed.

Durability choice: `PRAGMA synchronous=FULL`. In WAL mode, `NORMAL` only guarantees that a
commit survives an application crash; after a power loss or OS crash the last commits can roll
back. `FULL` fsyncs the WAL at every commit, so a write that returned ("acknowledged") survives
power loss too. The cost is one fsync per write call, which is cheap at our write rate (a few
batched writes per dialogue session, not per token).

Each user has a generation counter, bumped in the same transaction as any write to that user's
memories. Readers (the bank's vector index, BM25) compare it with the generation they were built
from to know whether they are stale — also across processes. The counter is per user and
strictly +1 per write transaction, and survives `delete_user` (the user row is marked deleted,
not removed), so a number is never reused for different contents of the same user; together with
the store's random `store_id` (in `meta`) it identifies a snapshot exactly.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rmm.errors import CorruptFileError, RmmError, UnknownUserError
from rmm.memory import graph, tree
from rmm.memory.structures import StructureMethods
from rmm.memory.validation import (
    MAX_LISTED_USERS,
    DuplicateMemoryError,
    as_matrix,
    check_dim,
    check_memory,
    check_meta_value,
    check_user_name,
    duplicate_keys,
    require_embedded,
    require_ids,
    unknown_user,
)
from rmm.types import Memory

__all__ = ["SCHEMA_VERSION", "DuplicateMemoryError", "MemoryStore"]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 3  # 2: the event graph's tables (rmm.memory.graph); 3: the XPath tree's (rmm.memory.tree); added in place
_SQLITE_MAGIC = b"SQLite format 3\x00"
_BUSY_TIMEOUT_S = 30.0

_SCHEMA = """
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE users (
    user_id    TEXT PRIMARY KEY,
    generation INTEGER NOT NULL,
    active     INTEGER NOT NULL
);
CREATE TABLE memories (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    user_id     TEXT NOT NULL,
    id          TEXT NOT NULL,
    kind        TEXT NOT NULL,
    text        TEXT NOT NULL,
    refs        TEXT NOT NULL,
    source_text TEXT NOT NULL,
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL,
    merged_from TEXT NOT NULL,
    time_span   TEXT,
    UNIQUE (user_id, id)
);
CREATE TABLE embeddings (
    user_id TEXT NOT NULL,
    id      TEXT NOT NULL,
    dim     INTEGER NOT NULL,
    vector  BLOB NOT NULL,
    PRIMARY KEY (user_id, id)
);
"""

_MEMORY_COLUMNS = "id, user_id, kind, text, refs, source_text, created_at, updated_at, merged_from, time_span"


def _memory_row(memory: Memory) -> tuple[Any, ...]:
    check_memory(memory)
    span = None if memory.time_span is None else json.dumps(list(memory.time_span))
    return (
        memory.id,
        memory.user_id,
        memory.kind,
        memory.text,
        json.dumps(list(memory.refs)),
        memory.source_text,
        float(memory.created_at),
        float(memory.updated_at),
        json.dumps(list(memory.merged_from)),
        span,
    )


def _memory_from_row(row: Sequence[Any]) -> Memory:
    span = None if row[9] is None else tuple(json.loads(row[9]))
    return Memory(
        id=row[0],
        user_id=row[1],
        kind=row[2],
        text=row[3],
        refs=list(json.loads(row[4])),
        source_text=row[5],
        created_at=row[6],
        updated_at=row[7],
        merged_from=list(json.loads(row[8])),
        time_span=span,  # type: ignore[arg-type]
    )


class MemoryStore(StructureMethods):
    """Memories, embeddings and metadata of every user of one bank, in one SQLite file.

    Thread-safe: one connection (`check_same_thread=False`) guarded by a lock, since a server
    calls it from several threads; several processes may open the same file (SQLite locking,
    WAL lets readers proceed during a write).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = path if path == ":memory:" else Path(path)
        self._lock = threading.RLock()
        self._closed = False
        if isinstance(self.path, Path):
            self._check_header(self.path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
        target = str(self.path)
        try:
            self._conn = sqlite3.connect(target, timeout=_BUSY_TIMEOUT_S, check_same_thread=False, isolation_level=None)
        except sqlite3.DatabaseError as exc:
            raise CorruptFileError(f"cannot open memory store {self.path}: {exc}") from exc
        try:
            self._open_schema()
        except BaseException:
            self._conn.close()
            raise

    # ----------------------------------------------------------------- opening

    @staticmethod
    def _check_header(path: Path) -> None:
        """Refuse a file that is not SQLite before SQLite touches it, so it stays unmodified."""
        if path.is_dir():
            raise CorruptFileError(f"memory store path {path} is a directory, not an SQLite file")
        if not path.exists() or path.stat().st_size == 0:
            return
        with path.open("rb") as fh:
            header = fh.read(len(_SQLITE_MAGIC))
        if header != _SQLITE_MAGIC:
            raise CorruptFileError(f"{path} is not an SQLite database (bad header); refusing to open it as a memory store")

    def _open_schema(self) -> None:
        with self._lock, self._errors():
            tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if tables and "meta" not in tables:
                raise CorruptFileError(f"{self.path} is an SQLite database but not an rmm memory store (tables: {sorted(tables)})")
            if tables:
                row = self._conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
                if row is None:
                    raise CorruptFileError(f"{self.path} has no schema_version: not an rmm memory store")
                version = int(row[0])
                if version > SCHEMA_VERSION:
                    raise CorruptFileError(
                        f"{self.path} has schema version {version}, newer than this rmm supports ({SCHEMA_VERSION}); upgrade rmm"
                    )
                if version < SCHEMA_VERSION:
                    self._upgrade()
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            # deleted rows are zeroed, not left in free pages: an erased user's text leaves the file
            self._conn.execute("PRAGMA secure_delete=ON")
            if not tables:
                with self._transaction() as cur:
                    # Another process may have created it between our check and BEGIN IMMEDIATE.
                    if cur.execute("SELECT 1 FROM sqlite_master WHERE name='meta'").fetchone() is None:
                        for statement in filter(None, (s.strip() for s in (_SCHEMA + graph.SQLITE_TABLES + tree.SQLITE_TABLES).split(";"))):
                            cur.execute(statement)
                        cur.executemany(
                            "INSERT INTO meta(key, value) VALUES (?, ?)",
                            [("schema_version", str(SCHEMA_VERSION)), ("store_id", uuid.uuid4().hex), ("created_at", str(time.time()))],
                        )
                log.debug("created memory store %s", self.path)

    def _upgrade(self) -> None:
        """Bring an older file to `SCHEMA_VERSION` in place, in one transaction (version 1 → 2: the
        graph's tables; 2 → 3: the tree's); another process upgrading at the same time finds the work done."""
        with self._transaction() as cur:
            version = int(cur.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0])
            if version < 2:
                for statement in filter(None, (s.strip() for s in graph.SQLITE_TABLES.split(";"))):
                    cur.execute(statement)
            if version < 3:
                for statement in filter(None, (s.strip() for s in tree.SQLITE_TABLES.split(";"))):
                    cur.execute(statement)
            if version < SCHEMA_VERSION:
                cur.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
                log.info("memory store %s upgraded from schema version %d to %d", self.path, version, SCHEMA_VERSION)

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """Map SQLite's corruption errors to `CorruptFileError` naming the file."""
        try:
            yield
        except sqlite3.IntegrityError:
            raise
        except sqlite3.OperationalError as exc:
            if "malformed" in str(exc) or "not a database" in str(exc):
                raise CorruptFileError(f"memory store {self.path} is corrupt: {exc}") from exc
            raise
        except sqlite3.DatabaseError as exc:
            raise CorruptFileError(f"memory store {self.path} is corrupt: {exc}") from exc

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Cursor]:
        """One write transaction: committed entirely, or rolled back entirely on any error."""
        cur = self._conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            yield cur
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        else:
            cur.execute("COMMIT")
        finally:
            cur.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RmmError(f"memory store {self.path} is closed")

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Cursor]:
        with self._lock, self._errors():
            self._check_open()
            with self._transaction() as cur:
                yield cur

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._errors():
            self._check_open()
            yield self._conn

    _mark = "?"  # for the SQL `rmm.memory.graph` and `rmm.memory.tree` share with PostgreSQL

    @contextmanager
    def _reading(self, user: str) -> Iterator[sqlite3.Cursor]:
        with self._read() as conn:
            self._require_user(conn, user)
            cur = conn.cursor()
            try:
                yield cur
            finally:
                cur.close()

    @contextmanager
    def _writing(self, user: str) -> Iterator[sqlite3.Cursor]:
        with self._write() as cur:
            self._require_user(cur, user)
            self._bump(cur, user)
            yield cur

    # ----------------------------------------------------------------- helpers

    def _unknown_user(self, conn: sqlite3.Connection | sqlite3.Cursor, user: str) -> UnknownUserError:
        users = [r[0] for r in conn.execute("SELECT user_id FROM users WHERE active=1 ORDER BY user_id LIMIT ?",
                                            (MAX_LISTED_USERS + 1,))]
        total = len(users)
        if total > MAX_LISTED_USERS:
            total = int(conn.execute("SELECT COUNT(*) FROM users WHERE active=1").fetchone()[0])
        return unknown_user(user, self.location, users, total)

    def _require_user(self, conn: sqlite3.Connection | sqlite3.Cursor, user: str) -> None:
        if conn.execute("SELECT 1 FROM users WHERE user_id=? AND active=1", (user,)).fetchone() is None:
            raise self._unknown_user(conn, user)

    def _require_ids(self, conn: sqlite3.Connection | sqlite3.Cursor, user: str, ids: Sequence[str]) -> None:
        require_ids(user, ids, self._present_ids(conn, user, ids))

    @staticmethod
    def _present_ids(conn: sqlite3.Connection | sqlite3.Cursor, user: str, ids: Sequence[str]) -> set[str]:
        present: set[str] = set()
        unique = list(dict.fromkeys(ids))
        for start in range(0, len(unique), 500):
            chunk = unique[start : start + 500]
            marks = ",".join("?" * len(chunk))
            present.update(r[0] for r in conn.execute(f"SELECT id FROM memories WHERE user_id=? AND id IN ({marks})", (user, *chunk)))
        return present

    @staticmethod
    def _bump(cur: sqlite3.Cursor, user: str) -> None:
        cur.execute(
            "INSERT INTO users(user_id, generation, active) VALUES (?, 1, 1) "
            "ON CONFLICT(user_id) DO UPDATE SET generation = generation + 1, active = 1",
            (user,),
        )

    def _check_dim(self, cur: sqlite3.Cursor, dim: int) -> None:
        row = cur.execute("SELECT value FROM meta WHERE key='embedding_dim'").fetchone()
        if row is None:
            cur.execute("INSERT INTO meta(key, value) VALUES ('embedding_dim', ?)", (str(dim),))
        else:
            check_dim(dim, int(row[0]), self.location)

    # ----------------------------------------------------------------- writes

    def add(self, memories: list[Memory], embeddings: torch.Tensor | np.ndarray | None = None) -> None:
        """Insert new memories (and their embeddings) in one transaction; existing ids are refused."""
        memories = list(memories)
        if not memories:
            return
        rows = [_memory_row(m) for m in memories]
        duplicate_keys(memories)
        vectors = None if embeddings is None else as_matrix(embeddings, len(memories))
        with self._write() as cur:
            self._insert(cur, memories, rows, vectors)

    def _insert(self, cur: sqlite3.Cursor, memories: list[Memory], rows: list[tuple[Any, ...]],
                vectors: np.ndarray | None) -> None:
        """`add`'s rows on an open transaction (`add_events` writes its graph rows after them)."""
        keys = [(m.user_id, m.id) for m in memories]
        if vectors is not None:
            self._check_dim(cur, vectors.shape[1])
        for row in rows:
            try:
                cur.execute(f"INSERT INTO memories({_MEMORY_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)", row)
            except sqlite3.IntegrityError as exc:
                raise DuplicateMemoryError(
                    f"memory {row[0]!r} already exists for user {row[1]!r}; use update() to change it"
                ) from exc
        if vectors is not None:
            cur.executemany(
                "INSERT INTO embeddings(user_id, id, dim, vector) VALUES (?,?,?,?)",
                [(u, i, vectors.shape[1], vectors[j].tobytes()) for j, (u, i) in enumerate(keys)],
            )
        for user in dict.fromkeys(m.user_id for m in memories):
            self._bump(cur, user)

    def _memories_with(self, user: str, memories: list[Memory], vectors: np.ndarray | None,
                       write: Callable[[Any], None]) -> None:
        """Insert `memories` (or, with none, check the user and bump its generation), then `write`
        the rows that point at them on the same cursor: one transaction for both."""
        rows = [_memory_row(m) for m in memories]
        with self._write() as cur:
            if memories:
                self._insert(cur, memories, rows, vectors)
            else:
                self._require_user(cur, user)
                self._bump(cur, user)
            write(cur)

    def update(self, memory: Memory, embedding: torch.Tensor | np.ndarray | None = None) -> None:
        """Replace every field of an existing memory; the embedding too when one is given."""
        row = _memory_row(memory)
        vector = None if embedding is None else as_matrix(embedding.reshape(1, -1), 1)[0]
        with self._write() as cur:
            self._require_user(cur, memory.user_id)
            self._require_ids(cur, memory.user_id, [memory.id])
            cur.execute(
                "UPDATE memories SET kind=?, text=?, refs=?, source_text=?, created_at=?, updated_at=?, merged_from=?, time_span=? "
                "WHERE user_id=? AND id=?",
                (*row[2:], memory.user_id, memory.id),
            )
            if vector is not None:
                self._check_dim(cur, vector.shape[0])
                cur.execute(
                    "INSERT INTO embeddings(user_id, id, dim, vector) VALUES (?,?,?,?) "
                    "ON CONFLICT(user_id, id) DO UPDATE SET dim=excluded.dim, vector=excluded.vector",
                    (memory.user_id, memory.id, vector.shape[0], vector.tobytes()),
                )
            self._bump(cur, memory.user_id)
            tree.memory_updated(cur, "?", memory.user_id, memory)  # the old text stays as a node version

    def delete(self, user: str, ids: list[str]) -> None:
        """Remove memories of one user; all ids must exist, else nothing is removed."""
        ids = list(ids)
        with self._write() as cur:
            self._require_user(cur, user)
            if not ids:
                return
            self._require_ids(cur, user, ids)
            for memory_id in dict.fromkeys(ids):
                cur.execute("DELETE FROM memories WHERE user_id=? AND id=?", (user, memory_id))
                cur.execute("DELETE FROM embeddings WHERE user_id=? AND id=?", (user, memory_id))
            graph.delete_memories(cur, "?", user, ids)
            self._bump(cur, user)
            tree.delete_memories(cur, "?", user, ids)  # after the bump: its lock serialises tree writes

    def delete_user(self, user: str) -> None:
        """Remove a user and all their memories (the generation counter is kept, see module doc)."""
        with self._write() as cur:
            self._require_user(cur, user)
            cur.execute("DELETE FROM memories WHERE user_id=?", (user,))
            cur.execute("DELETE FROM embeddings WHERE user_id=?", (user,))
            graph.delete_user(cur, "?", user)
            tree.delete_user(cur, "?", user)
            cur.execute("UPDATE users SET generation = generation + 1, active = 0 WHERE user_id=?", (user,))

    def set_meta(self, key: str, value: str) -> None:
        check_meta_value(value)
        with self._write() as cur:
            cur.execute("INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value", (key, value))

    def set_meta_if_absent(self, key: str, value: str) -> str:
        """Store `value` unless `key` has one; return what is stored (first writer wins, across processes)."""
        check_meta_value(value)
        with self._write() as cur:
            cur.execute("INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO NOTHING", (key, value))
            return str(cur.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()[0])

    # ----------------------------------------------------------------- reads

    @property
    def location(self) -> str:
        """The file, for messages (`MemoryStorage.location`)."""
        return str(self.path)

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        with self._read() as conn:
            row = conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return default if row is None else row[0]

    @property
    def store_id(self) -> str:
        """Random id made at creation: tells index files of a re-created bank from the old one's."""
        value = self.get_meta("store_id")
        assert value is not None
        return value

    def users(self) -> list[str]:
        with self._read() as conn:
            return [r[0] for r in conn.execute("SELECT user_id FROM users WHERE active=1 ORDER BY user_id")]

    def require_user(self, user: str) -> None:
        """Raise `UnknownUserError` (naming the users there are) unless `user` has memories here."""
        check_user_name(user)
        with self._read() as conn:
            self._require_user(conn, user)

    def has_user(self, user: str) -> bool:
        with self._read() as conn:
            return conn.execute("SELECT 1 FROM users WHERE user_id=? AND active=1", (user,)).fetchone() is not None

    def generation(self, user: str) -> int:
        with self._read() as conn:
            row = conn.execute("SELECT generation FROM users WHERE user_id=? AND active=1", (user,)).fetchone()
            if row is None:
                raise self._unknown_user(conn, user)
            return int(row[0])

    def count(self, user: str) -> int:
        with self._read() as conn:
            self._require_user(conn, user)
            return int(conn.execute("SELECT COUNT(*) FROM memories WHERE user_id=?", (user,)).fetchone()[0])

    def get(self, user: str, ids: list[str]) -> list[Memory]:
        """Memories in the order of `ids`: one query when they are all there (every retrieval
        reads its shown memories here); the user and the ids are checked only when some are not,
        so the error still names what is missing."""
        check_user_name(user)
        ids = list(ids)
        unique = list(dict.fromkeys(ids))
        found: dict[str, Memory] = {}
        with self._read() as conn:
            for start in range(0, len(unique), 500):
                chunk = unique[start : start + 500]
                marks = ",".join("?" * len(chunk))
                for row in conn.execute(f"SELECT {_MEMORY_COLUMNS} FROM memories WHERE user_id=? AND id IN ({marks}) "
                                        "AND EXISTS (SELECT 1 FROM users WHERE user_id=? AND active=1)",
                                        (user, *chunk, user)):
                    found[row[0]] = _memory_from_row(row)
            if not unique or len(found) < len(unique):
                self._require_user(conn, user)
                self._require_ids(conn, user, ids)
        return [found[i] for i in ids]

    def memories(self, user: str) -> list[Memory]:
        """All memories of a user in insertion order."""
        with self._read() as conn:
            self._require_user(conn, user)
            rows = conn.execute(f"SELECT {_MEMORY_COLUMNS} FROM memories WHERE user_id=? ORDER BY seq", (user,)).fetchall()
        return [_memory_from_row(r) for r in rows]

    def embeddings(self, user: str, ids: list[str] | None = None) -> tuple[list[str], torch.Tensor]:
        """(ids, float32 [N, d]): all embedded memories in insertion order, or exactly `ids` in order.

        With explicit `ids`, a memory that exists but has no embedding is an error: the caller
        asked for a vector that is not there.
        """
        with self._read() as conn:
            self._require_user(conn, user)
            dim_row = conn.execute("SELECT value FROM meta WHERE key='embedding_dim'").fetchone()
            dim = 0 if dim_row is None else int(dim_row[0])
            if ids is None:
                rows = conn.execute(
                    "SELECT e.id, e.vector FROM embeddings e JOIN memories m ON m.user_id=e.user_id AND m.id=e.id "
                    "WHERE e.user_id=? ORDER BY m.seq",
                    (user,),
                ).fetchall()
                out_ids = [r[0] for r in rows]
                blobs = [r[1] for r in rows]
            else:
                ids = list(ids)
                self._require_ids(conn, user, ids)
                found: dict[str, bytes] = {}
                unique = list(dict.fromkeys(ids))
                for start in range(0, len(unique), 500):
                    chunk = unique[start : start + 500]
                    marks = ",".join("?" * len(chunk))
                    for r in conn.execute(f"SELECT id, vector FROM embeddings WHERE user_id=? AND id IN ({marks})", (user, *chunk)):
                        found[r[0]] = r[1]
                require_embedded(user, ids, found)
                out_ids = ids
                blobs = [found[i] for i in ids]
        if not blobs:
            return out_ids, torch.zeros((0, dim), dtype=torch.float32)
        matrix = np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(blobs), -1)
        return out_ids, torch.from_numpy(matrix.copy())

    # ----------------------------------------------------------------- lifecycle

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MemoryStore({str(self.path)!r})"
