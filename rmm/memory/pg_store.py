"""The memory store on PostgreSQL + pgvector: a bank several processes share, searched in the database.

Same contract as the SQLite `MemoryStore` (`rmm.memory.storage.MemoryStorage`): every public write
is one transaction and returns only after it committed (PostgreSQL's default `synchronous_commit`
makes that durable across a server crash); a refused write changes nothing; each user's
generation moves by exactly one per write. On top of it, `search` answers inner-product top-k in
the database, filtered by user, so no process keeps a vector index of its own:

* a user with at most `exact_limit` embedded memories is searched exactly (a scan of that user's
  rows, written so the planner cannot use the approximate index) — the same top-k as the
  in-process exact index;
* a larger user goes through the bank's HNSW index (`vector_ip_ops`) with `hnsw.ef_search` and
  pgvector's iterative scan, so the user filter still yields k results from a shared graph.

Connections come from the bank schema's one psycopg pool (`pg_database.PgDatabase`, exposed as
`.database` so the server's own tables share the migration and the pool); each is checked before
use, so a restarted server is reconnected to transparently; a lost server surfaces as
`DatabaseUnavailableError`, a pool whose connections all stayed busy as its subclass
`DatabasePoolExhaustedError` (naming `pool_max`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import torch

from rmm.errors import (
    DimensionMismatchError,
    RmmError,
    UnknownUserError,
)
from rmm.memory import graph, tree
from rmm.memory.pg_database import DEFAULT_POOL_MAX, PgDatabase
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

if TYPE_CHECKING:
    import psycopg

__all__ = ["APPROXIMATE_QUERY", "PostgresStore", "approximate_settings"]

log = logging.getLogger(__name__)

_COLUMNS = "id, user_id, kind, text, refs, source_text, created_at, updated_at, merged_from, time_span"
_INSERT = f"INSERT INTO memories ({_COLUMNS}, embedding) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
_EXACT = ("SELECT id, embedding, -(embedding <#> %(q)s) AS score FROM memories "
          "WHERE user_id = %(user)s AND embedding IS NOT NULL ORDER BY score DESC, seq LIMIT %(k)s")
APPROXIMATE_QUERY = ("SELECT id, embedding, -(embedding <#> %(q)s) AS score FROM memories "
                "WHERE user_id = %(user)s AND embedding IS NOT NULL ORDER BY embedding <#> %(q)s LIMIT %(k)s")


def approximate_settings(cur: psycopg.Cursor[Any], ef_search: int) -> None:
    """For this transaction: search through the HNSW index, continuing past the user filter.

    `enable_sort = off` takes the exact plan (filter by user, sort by distance) off the table, so
    a large user's search costs what the graph costs rather than what the planner guesses;
    `iterative_scan = strict_order` keeps scanning the graph until k rows pass the filter.
    """
    cur.execute("SELECT set_config('hnsw.ef_search', %s, true), set_config('hnsw.iterative_scan', 'strict_order', true), "
                "set_config('enable_sort', 'off', true)", (str(ef_search),))


def _row(memory: Memory, vector: np.ndarray | None) -> tuple[Any, ...]:
    from psycopg.types.json import Jsonb

    check_memory(memory)
    span = None if memory.time_span is None else Jsonb(list(memory.time_span))
    return (memory.id, memory.user_id, memory.kind, memory.text, Jsonb(list(memory.refs)), memory.source_text,
            float(memory.created_at), float(memory.updated_at), Jsonb(list(memory.merged_from)), span, vector)


def _memory(row: tuple[Any, ...]) -> Memory:
    return Memory(id=row[0], user_id=row[1], kind=row[2], text=row[3], refs=list(row[4]), source_text=row[5],
                  created_at=row[6], updated_at=row[7], merged_from=list(row[8]),
                  time_span=None if row[9] is None else tuple(row[9]))  # type: ignore[arg-type]


def _matrix(vectors: list[Any], dim: int) -> torch.Tensor:
    if not vectors:
        return torch.zeros((0, dim), dtype=torch.float32)
    return torch.from_numpy(np.stack([v.to_numpy() for v in vectors]).astype(np.float32, copy=False))


class PostgresStore(StructureMethods):
    """Memories, embeddings and users of one bank in a PostgreSQL schema. Thread-safe (a pool).

    `url` is ``postgresql://user:password@host:port/database?schema=BANK`` (schema defaults to
    ``rmm``). Opening it creates the schema and applies pending migrations.
    """

    def __init__(self, url: str, *, pool_min: int = 1, pool_max: int = DEFAULT_POOL_MAX, pool_timeout_s: float = 10.0,
                 exact_limit: int = 10_000, ef_search: int = 100) -> None:
        if exact_limit < 0 or ef_search < 1:
            raise ValueError(f"exact_limit must be >= 0 and ef_search >= 1, got {exact_limit}, {ef_search}")
        # the schema's migration and its one pool; the server's tables use the same (`database`)
        self.database = PgDatabase(url, pool_min=pool_min, pool_max=pool_max, pool_timeout_s=pool_timeout_s)
        self._where = self.database.where
        self.schema = self._where.schema
        self.exact_limit = exact_limit
        self.ef_search = ef_search
        self.path = None  # no file: see `location`
        self._closed = False
        self._embedded: dict[str, tuple[int, int]] = {}  # user → (generation, embedded count), for search
        log.debug("opened PostgreSQL memory store %s", self.location)

    # ----------------------------------------------------------------- plumbing

    @property
    def location(self) -> str:
        """The URL without its password (`MemoryStorage.location`)."""
        return self._where.display

    @contextmanager
    def _tx(self, binary: bool = False) -> Iterator[psycopg.Cursor[Any]]:
        """One transaction on a pooled connection: committed entirely, or rolled back on any error."""
        if self._closed:
            raise RmmError(f"memory store {self.location} is closed")
        with self.database.tx(binary) as cur:
            yield cur

    def _unknown_user(self, cur: psycopg.Cursor[Any], user: str) -> UnknownUserError:
        cur.execute('SELECT user_id FROM users WHERE active ORDER BY user_id COLLATE "C" LIMIT %s',
                    (MAX_LISTED_USERS + 1,))
        users = [r[0] for r in cur.fetchall()]
        total = len(users)
        if total > MAX_LISTED_USERS:
            total = int(cur.execute("SELECT count(*) FROM users WHERE active").fetchone()[0])  # type: ignore[index]
        return unknown_user(user, self.location, users, total)

    _mark = "%s"  # for the SQL `rmm.memory.graph` and `rmm.memory.tree` share with SQLite

    @contextmanager
    def _reading(self, user: str) -> Iterator[psycopg.Cursor[Any]]:
        with self._tx() as cur:
            self._generation(cur, user)
            yield cur

    @contextmanager
    def _writing(self, user: str) -> Iterator[psycopg.Cursor[Any]]:
        with self._tx() as cur:
            self._generation(cur, user)
            self._bump(cur, user)
            yield cur

    def _generation(self, cur: psycopg.Cursor[Any], user: str) -> int:
        row = cur.execute("SELECT generation FROM users WHERE user_id = %s AND active", (user,)).fetchone()
        if row is None:
            raise self._unknown_user(cur, user)
        return int(row[0])

    def _require_ids(self, cur: psycopg.Cursor[Any], user: str, ids: list[str]) -> None:
        cur.execute("SELECT id FROM memories WHERE user_id = %s AND id = ANY(%s)", (user, list(dict.fromkeys(ids))))
        require_ids(user, ids, (r[0] for r in cur.fetchall()))

    @staticmethod
    def _bump(cur: psycopg.Cursor[Any], user: str) -> None:
        cur.execute("INSERT INTO users (user_id, generation, active) VALUES (%s, 1, true) ON CONFLICT (user_id) "
                    "DO UPDATE SET generation = users.generation + 1, active = true", (user,))

    def _check_dim(self, cur: psycopg.Cursor[Any], dim: int) -> None:
        """The bank's dimension: set (column typed vector(d), HNSW index built) by the first embedding."""
        row = cur.execute("SELECT value FROM meta WHERE key = 'embedding_dim'").fetchone()
        if row is None:
            cur.execute("LOCK TABLE memories IN ACCESS EXCLUSIVE MODE")  # a concurrent first write waits here
            row = cur.execute("SELECT value FROM meta WHERE key = 'embedding_dim'").fetchone()
        if row is None:
            cur.execute("INSERT INTO meta (key, value) VALUES ('embedding_dim', %s)", (str(dim),))
            cur.execute(f"ALTER TABLE memories ALTER COLUMN embedding TYPE vector({int(dim)})")
            cur.execute("CREATE INDEX memories_embedding_hnsw ON memories USING hnsw (embedding vector_ip_ops)")
            log.info("bank %s: embedding dimension %d, HNSW index created", self.location, dim)
        else:
            check_dim(dim, int(row[0]), self.location)

    # ----------------------------------------------------------------- writes

    def add(self, memories: list[Memory], embeddings: torch.Tensor | np.ndarray | None = None) -> None:
        """Insert new memories (and their embeddings) in one transaction; existing ids are refused."""
        import psycopg

        memories = list(memories)
        if not memories:
            return
        for memory in memories:
            check_memory(memory)
        duplicate_keys(memories)
        vectors = None if embeddings is None else as_matrix(embeddings, len(memories))
        rows = [_row(m, None if vectors is None else vectors[j]) for j, m in enumerate(memories)]
        try:
            with self._tx() as cur:
                self._insert(cur, memories, rows, vectors)
        except psycopg.errors.UniqueViolation as exc:  # a concurrent writer added the same id first
            raise DuplicateMemoryError(f"memory already exists: {exc.diag.message_detail}; use update() to change it") from exc

    def _insert(self, cur: psycopg.Cursor[Any], memories: list[Memory], rows: list[tuple[Any, ...]],
                vectors: np.ndarray | None) -> None:
        """`add`'s rows on an open transaction (`add_events` writes its graph rows after them)."""
        if vectors is not None:
            self._check_dim(cur, vectors.shape[1])
        cur.execute("SELECT m.user_id, m.id FROM memories m JOIN unnest(%s::text[], %s::text[]) AS k(u, i) "
                    "ON m.user_id = k.u AND m.id = k.i LIMIT 1",
                    ([m.user_id for m in memories], [m.id for m in memories]))
        clash = cur.fetchone()
        if clash is not None:
            raise DuplicateMemoryError(f"memory {clash[1]!r} already exists for user {clash[0]!r}; "
                                       "use update() to change it")
        cur.executemany(_INSERT, rows)
        for user in sorted({m.user_id for m in memories}):  # one lock order: no deadlocks between writers
            self._bump(cur, user)

    def _memories_with(self, user: str, memories: list[Memory], vectors: np.ndarray | None,
                       write: Callable[[Any], None]) -> None:
        """Insert `memories` (or, with none, check the user and bump its generation), then `write`
        the rows that point at them on the same cursor: one transaction for both."""
        import psycopg

        rows = [_row(m, None if vectors is None else vectors[j]) for j, m in enumerate(memories)]
        try:
            with self._tx() as cur:
                if memories:
                    self._insert(cur, memories, rows, vectors)
                else:
                    self._generation(cur, user)
                    self._bump(cur, user)
                write(cur)
        except psycopg.errors.UniqueViolation as exc:
            raise DuplicateMemoryError(f"memory already exists: {exc.diag.message_detail}; use update() to change it") from exc

    def update(self, memory: Memory, embedding: torch.Tensor | np.ndarray | None = None) -> None:
        """Replace every field of an existing memory; the embedding too when one is given."""
        row = _row(memory, None)
        vector = None if embedding is None else as_matrix(embedding.reshape(1, -1), 1)[0]
        with self._tx() as cur:
            self._generation(cur, memory.user_id)
            self._require_ids(cur, memory.user_id, [memory.id])
            cur.execute("UPDATE memories SET kind=%s, text=%s, refs=%s, source_text=%s, created_at=%s, updated_at=%s, "
                        "merged_from=%s, time_span=%s WHERE user_id=%s AND id=%s",
                        (*row[2:10], memory.user_id, memory.id))
            if vector is not None:
                self._check_dim(cur, vector.shape[0])
                cur.execute("UPDATE memories SET embedding=%s WHERE user_id=%s AND id=%s",
                            (vector, memory.user_id, memory.id))
            self._bump(cur, memory.user_id)
            tree.memory_updated(cur, "%s", memory.user_id, memory)  # the old text stays as a node version

    def delete(self, user: str, ids: list[str]) -> None:
        """Remove memories of one user; all ids must exist, else nothing is removed."""
        ids = list(ids)
        with self._tx() as cur:
            self._generation(cur, user)
            if not ids:
                return
            self._require_ids(cur, user, ids)
            graph.delete_memories(cur, "%s", user, ids)
            cur.execute("DELETE FROM memories WHERE user_id = %s AND id = ANY(%s)", (user, list(dict.fromkeys(ids))))
            self._bump(cur, user)
            tree.delete_memories(cur, "%s", user, ids)  # after the bump: its lock serialises tree writes

    def delete_user(self, user: str) -> None:
        """Remove a user and all their memories (the generation counter is kept)."""
        with self._tx() as cur:
            self._generation(cur, user)
            graph.delete_user(cur, "%s", user)
            tree.delete_user(cur, "%s", user)
            cur.execute("DELETE FROM memories WHERE user_id = %s", (user,))
            cur.execute("UPDATE users SET generation = generation + 1, active = false WHERE user_id = %s", (user,))

    def set_meta(self, key: str, value: str) -> None:
        check_meta_value(value)
        with self._tx() as cur:
            cur.execute("INSERT INTO meta (key, value) VALUES (%s, %s) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                        (key, value))

    def set_meta_if_absent(self, key: str, value: str) -> str:
        """Store `value` unless `key` has one; return what is stored (first writer wins, across processes)."""
        check_meta_value(value)
        with self._tx() as cur:
            cur.execute("INSERT INTO meta (key, value) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING", (key, value))
            return str(cur.execute("SELECT value FROM meta WHERE key = %s", (key,)).fetchone()[0])  # type: ignore[index]

    # ----------------------------------------------------------------- reads

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        with self._tx() as cur:
            row = cur.execute("SELECT value FROM meta WHERE key = %s", (key,)).fetchone()
        return default if row is None else row[0]

    @property
    def store_id(self) -> str:
        """Random id made when the schema was created."""
        value = self.get_meta("store_id")
        assert value is not None
        return value

    def users(self) -> list[str]:
        with self._tx() as cur:
            return [r[0] for r in cur.execute('SELECT user_id FROM users WHERE active ORDER BY user_id COLLATE "C"')]

    def require_user(self, user: str) -> None:
        """Raise `UnknownUserError` (naming the users there are) unless `user` has memories here."""
        check_user_name(user)
        with self._tx() as cur:
            self._generation(cur, user)

    def has_user(self, user: str) -> bool:
        with self._tx() as cur:
            return cur.execute("SELECT 1 FROM users WHERE user_id = %s AND active", (user,)).fetchone() is not None

    def generation(self, user: str) -> int:
        with self._tx() as cur:
            return self._generation(cur, user)

    def count(self, user: str) -> int:
        with self._tx() as cur:
            self._generation(cur, user)
            return int(cur.execute("SELECT count(*) FROM memories WHERE user_id = %s", (user,)).fetchone()[0])  # type: ignore[index]

    def get(self, user: str, ids: list[str]) -> list[Memory]:
        """Memories in the order of `ids`."""
        ids = list(ids)
        with self._tx() as cur:
            self._generation(cur, user)
            self._require_ids(cur, user, ids)
            cur.execute(f"SELECT {_COLUMNS} FROM memories WHERE user_id = %s AND id = ANY(%s)", (user, list(set(ids))))
            found = {row[0]: _memory(row) for row in cur.fetchall()}
        return [found[i] for i in ids]

    def memories(self, user: str) -> list[Memory]:
        """All memories of a user in insertion order."""
        with self._tx() as cur:
            self._generation(cur, user)
            rows = cur.execute(f"SELECT {_COLUMNS} FROM memories WHERE user_id = %s ORDER BY seq", (user,)).fetchall()
        return [_memory(r) for r in rows]

    def _dim(self, cur: psycopg.Cursor[Any]) -> int:
        row = cur.execute("SELECT value FROM meta WHERE key = 'embedding_dim'").fetchone()
        return 0 if row is None else int(row[0])

    def embeddings(self, user: str, ids: list[str] | None = None) -> tuple[list[str], torch.Tensor]:
        """(ids, float32 [N, d]): all embedded memories in insertion order, or exactly `ids` in order."""
        with self._tx(binary=True) as cur:
            self._generation(cur, user)
            dim = self._dim(cur)
            if ids is None:
                rows = cur.execute("SELECT id, embedding FROM memories WHERE user_id = %s AND embedding IS NOT NULL "
                                   "ORDER BY seq", (user,)).fetchall()
                return [r[0] for r in rows], _matrix([r[1] for r in rows], dim)
            ids = list(ids)
            self._require_ids(cur, user, ids)
            cur.execute("SELECT id, embedding FROM memories WHERE user_id = %s AND id = ANY(%s) AND embedding IS NOT NULL",
                        (user, list(set(ids))))
            found = dict(cur.fetchall())
        require_embedded(user, ids, found)
        return ids, _matrix([found[i] for i in ids], dim)

    def search(self, user: str, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, list[list[str]], torch.Tensor]:
        """Inner-product top-k of `user`'s memories per query, in the database.

        Returns scores [B, k'] with k' = min(k, embedded memories) (-inf where the approximate
        search returned fewer), the ids per query, and the hits' vectors [Σ hits, d] in that order.
        """
        q = as_matrix(queries, queries.shape[0])
        with self._tx(binary=True) as cur:
            generation = self._generation(cur, user)
            dim = self._dim(cur)
            if dim and q.shape[1] != dim:
                raise DimensionMismatchError(f"queries have dimension {q.shape[1]}, the store has {dim} ({self.location})")
            n = self._embedded_count(cur, user, generation)
            width = min(k, n)
            exact = n <= self.exact_limit
            if not exact:
                approximate_settings(cur, max(self.ef_search, width))
            scores = torch.full((q.shape[0], width), float("-inf"), dtype=torch.float32)
            ids: list[list[str]] = []
            vectors: list[Any] = []
            for b in range(q.shape[0] if width else 0):
                rows = cur.execute(_EXACT if exact else APPROXIMATE_QUERY, {"q": q[b], "user": user, "k": width}).fetchall()
                ids.append([r[0] for r in rows])
                vectors += [r[1] for r in rows]
                scores[b, : len(rows)] = torch.tensor([float(r[2]) for r in rows], dtype=torch.float32)
        if not width:
            ids = [[] for _ in range(q.shape[0])]
        return scores, ids, _matrix(vectors, q.shape[1])

    def _embedded_count(self, cur: psycopg.Cursor[Any], user: str, generation: int) -> int:
        cached = self._embedded.get(user)
        if cached is not None and cached[0] == generation:
            return cached[1]
        n = int(cur.execute("SELECT count(*) FROM memories WHERE user_id = %s AND embedding IS NOT NULL",
                            (user,)).fetchone()[0])  # type: ignore[index]
        self._embedded[user] = (generation, n)
        return n

    # ----------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close the store and its database handle (the pool the server's tables share, too)."""
        self._closed = True
        self.database.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PostgresStore({self.location!r})"
