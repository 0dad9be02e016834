"""A user-partitioned memory bank: store + per-user vector search + encoder (DESIGN.md §4).

Where the bank lives is one string (`rmm.memory.storage`):

* a folder (the default; nothing to run) — an SQLite store and in-process indexes::

      <bank>/bank.json          encoder name, fingerprint, dim — the bank refuses any other encoder
      <bank>/memories.sqlite    MemoryStore: the source of truth (memories + embeddings)
      <bank>/index/<user>.safetensors   per-user index cache (`rmm.memory.index_cache`)

* a ``postgresql://…?schema=NAME`` URL — a PostgreSQL schema with pgvector that any number of
  processes share; the database is both the store and the index (`rmm.memory.pg_store`), and the
  encoder record lives in its `meta` table.

Writes go to the store first — a write is acknowledged once its transaction commits — and then,
for a folder bank, to the in-memory index, whose files are only a cache rebuilt whenever they do
not match the store. Nothing acknowledged can therefore be lost by a crash, and another process
writing to the same bank is noticed at the next search.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Self, cast

import torch

from rmm.device import resolve_device
from rmm.errors import (
    CorruptFileError,
    DimensionMismatchError,
    EncoderMismatchError,
    RmmError,
)
from rmm.encoders.protocol import EncoderLike
from rmm.memory.index import BACKENDS, VectorIndex
from rmm.memory.index_cache import UserIndexCache
from rmm.memory.storage import MemoryStorage, VectorSearchStorage, is_database_url
from rmm.memory.store import MemoryStore
from rmm.types import Candidates, Memory

__all__ = ["BANK_FILE", "DATABASE_OPTIONS", "INDEX_DIR", "STORE_FILE", "MemoryBank"]

log = logging.getLogger(__name__)

BANK_FILE = "bank.json"
STORE_FILE = "memories.sqlite"
INDEX_DIR = "index"
_BANK_FORMAT = 1
# What `index_options` may hold for a PostgreSQL bank (`PostgresStore`'s keyword arguments).
DATABASE_OPTIONS = ("exact_limit", "ef_search", "pool_min", "pool_max", "pool_timeout_s")


def _write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        with tmp.open("rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class MemoryBank:
    """Per-user memories with dense retrieval. Thread-safe; usable as a context manager.

    `path` is a bank folder, or a ``postgresql://`` URL. `index_options` are passed to
    `make_index` for a folder bank (e.g. ``{"nprobe": 32}`` for faiss-ivf), or to `PostgresStore`
    for a database bank (`DATABASE_OPTIONS`, e.g. ``{"exact_limit": 20000}``).
    """

    store: MemoryStorage
    path: Path | None  # the bank folder; None for a database bank (see `location`)

    def __init__(
        self,
        path: str | Path,
        encoder: EncoderLike,
        index_backend: str = "torch",
        device: str | torch.device = "auto",
        index_options: dict[str, Any] | None = None,
    ) -> None:
        if index_backend not in BACKENDS:
            raise ValueError(f"unknown index backend {index_backend!r}; use one of {BACKENDS}")
        for attribute in ("dim", "fingerprint", "name", "encode_queries", "encode_passages"):
            if not hasattr(encoder, attribute):
                raise TypeError(f"encoder {type(encoder).__name__} lacks {attribute!r}; pass an rmm Encoder")
        self.encoder = encoder
        self.dim = int(encoder.dim)
        self.index_backend = index_backend
        self.index_options = dict(index_options or {})
        self.device = resolve_device(device)
        self._lock = threading.RLock()
        self._cache: UserIndexCache | None = None
        self._closed = False
        if is_database_url(path):
            self._open_database(str(path))
        else:
            self._open_folder(Path(path))

    def _open_database(self, url: str) -> None:
        from rmm.memory.pg_store import PostgresStore

        if self.index_backend != "torch":
            raise ValueError(f"index backend {self.index_backend!r} is for folder banks: a PostgreSQL bank searches "
                             "in the database (pgvector)")
        unknown = sorted(set(self.index_options) - set(DATABASE_OPTIONS))
        if unknown:
            raise ValueError(f"index options {unknown} do not apply to a PostgreSQL bank; it takes {list(DATABASE_OPTIONS)}")
        self.path = None
        self.index_backend = "pgvector"
        self.store = PostgresStore(url, **self.index_options)
        self.location = self.store.location
        try:
            self._reconcile_encoder_record(None)
        except BaseException:
            self.store.close()
            raise

    def _open_folder(self, path: Path) -> None:
        self.path = path
        self.location = str(path)
        if path.exists() and not path.is_dir():
            raise CorruptFileError(f"bank path {path} is a file; a bank is a directory")
        existing = self._read_bank_json(path)
        if existing is not None:
            self._check_encoder(existing, source=path / BANK_FILE)
        store_path = path / STORE_FILE
        if existing is None and store_path.exists():
            # bank.json lost (or a crash before it was written): the store keeps a copy.
            MemoryStore._check_header(store_path)
        path.mkdir(parents=True, exist_ok=True)
        store = MemoryStore(store_path)
        self.store = store
        try:
            self._reconcile_encoder_record(existing)
        except BaseException:
            store.close()
            raise
        self._cache = UserIndexCache(store, path / INDEX_DIR, backend=self.index_backend, dim=self.dim,
                                     device=self.device, options=self.index_options,
                                     fingerprint=self.encoder.fingerprint)

    # -------------------------------------------------------------- encoder record

    @staticmethod
    def _read_bank_json(path: Path) -> dict[str, Any] | None:
        file = path / BANK_FILE
        if not file.exists():
            return None
        try:
            payload = json.loads(file.read_text(encoding="utf-8"))
            int(payload["dim"]), str(payload["fingerprint"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptFileError(f"bank file {file} is not valid bank metadata: {exc}") from exc
        return payload

    def _check_encoder(self, record: dict[str, Any], source: Path | str) -> None:
        if int(record["dim"]) != self.dim:
            raise DimensionMismatchError(
                f"bank {self.location} holds {int(record['dim'])}-d embeddings from encoder {record.get('encoder_name')!r} "
                f"(fingerprint {record['fingerprint']!r}); the given encoder {self.encoder.name!r} "
                f"(fingerprint {self.encoder.fingerprint!r}) makes {self.dim}-d vectors. Open the bank with its "
                f"encoder, or re-encode into a new bank. [{source}]"
            )
        if str(record["fingerprint"]) != self.encoder.fingerprint:
            raise EncoderMismatchError(
                f"bank {self.location} was built with encoder {record.get('encoder_name')!r} "
                f"(fingerprint {record['fingerprint']!r}); refusing encoder {self.encoder.name!r} "
                f"(fingerprint {self.encoder.fingerprint!r}): their vectors are not comparable. Open the bank with "
                f"its encoder, or re-encode into a new bank. [{source}]"
            )

    def _reconcile_encoder_record(self, existing: dict[str, Any] | None) -> None:
        """Keep bank.json and the store's copy of it in agreement; write them for a new bank.

        The store's record is written only if absent (first writer wins), so two processes creating
        one bank with different encoders cannot both succeed.
        """
        source = self.path / STORE_FILE if self.path is not None else self.store.location
        record = {
            "format": _BANK_FORMAT,
            "encoder_name": self.encoder.name,
            "fingerprint": self.encoder.fingerprint,
            "dim": self.dim,
        }
        stored = self.store.get_meta("encoder")
        if stored is None:
            stored = self.store.set_meta_if_absent("encoder", json.dumps(record, sort_keys=True))
        self._check_encoder(json.loads(stored), source=source)
        if self.path is not None and existing is None:
            _write_json_atomic(self.path / BANK_FILE, {**record, "created_at": time.time()})

    # -------------------------------------------------------------- helpers

    def _check_open(self) -> None:
        if self._closed:
            raise RmmError(f"memory bank {self.location} is closed")

    def _guard(self) -> threading.RLock | nullcontext[None]:
        """The bank lock around an SQLite bank's index cache; a database bank needs none (its pool is
        thread-safe and the database orders concurrent writes)."""
        return self._lock if self._cache is not None else nullcontext()

    def _generation_or_none(self, user: str) -> int | None:
        return None if self._cache is None else self._cache.generation_or_none(user)

    def _apply(self, user: str, before: int | None, change: Callable[[VectorIndex], None]) -> None:
        if self._cache is not None:
            self._cache.apply(user, before, change)

    def _encode(self, texts: list[str], queries: bool) -> torch.Tensor:
        vectors = self.encoder.encode_queries(texts) if queries else self.encoder.encode_passages(texts)
        vectors = torch.as_tensor(vectors).detach().float().cpu()
        if vectors.ndim != 2 or vectors.shape != (len(texts), self.dim):
            raise DimensionMismatchError(
                f"encoder {self.encoder.name!r} returned shape {tuple(vectors.shape)} for {len(texts)} texts; "
                f"expected [{len(texts)}, {self.dim}]"
            )
        return vectors

    # -------------------------------------------------------------- writes

    def add(self, user: str, memories: list[Memory], embeddings: torch.Tensor | None = None) -> list[str]:
        """Store and index new memories of `user` (texts encoded as passages in one batch).

        `embeddings` are the memories' passage vectors when the caller already encoded them
        (the server encodes many requests' memories in one call); they must come from this
        bank's encoder.
        """
        memories = list(memories)
        if not isinstance(user, str) or not user:
            raise ValueError(f"user must be a non-empty string, got {user!r}")
        if not memories:
            return []
        wrong = [m.id for m in memories if m.user_id != user]
        if wrong:
            raise ValueError(f"memories {wrong[:5]} belong to another user than {user!r}; set memory.user_id")
        if embeddings is None:
            vectors = self._encode([m.text for m in memories], queries=False)
        else:
            vectors = torch.as_tensor(embeddings).detach().float().cpu()
            if vectors.shape != (len(memories), self.dim):
                raise DimensionMismatchError(f"embeddings of shape {tuple(vectors.shape)} for {len(memories)} "
                                             f"memories; this bank needs ({len(memories)}, {self.dim})")
        ids = [m.id for m in memories]
        with self._guard():
            self._check_open()
            before = self._generation_or_none(user)
            self.store.add(memories, vectors)
            self._apply(user, before, lambda index: index.add(ids, vectors))
        return ids

    def update(self, user: str, memory: Memory, embedding: torch.Tensor | None = None) -> Memory:
        """Replace a memory's fields; re-embed when its text changed. Returns the stored memory.

        `updated_at` is set to now and `created_at` kept from the stored memory. `embedding` is the
        new text's passage vector when the caller already encoded it (with this bank's encoder),
        so several updates can share one encoder call; it is used only if the text changed.
        """
        if memory.user_id != user:
            raise ValueError(f"memory {memory.id!r} belongs to user {memory.user_id!r}, not {user!r}")
        given = None
        if embedding is not None:
            given = torch.as_tensor(embedding).detach().float().cpu().reshape(1, -1)
            if given.shape != (1, self.dim):
                raise DimensionMismatchError(f"embedding of shape {tuple(torch.as_tensor(embedding).shape)} for "
                                             f"memory {memory.id!r}; this bank needs ({self.dim},)")
        with self._guard():
            self._check_open()
            self.store.require_user(user)
            (old,) = self.store.get(user, [memory.id])
            updated = replace(memory, created_at=old.created_at, updated_at=max(time.time(), old.updated_at + 1e-6))
            vector = None
            if updated.text != old.text:
                vector = given if given is not None else self._encode([updated.text], queries=False)
            before = self._generation_or_none(user)
            self.store.update(updated, None if vector is None else vector[0])

            def change(index: VectorIndex) -> None:
                if vector is not None:
                    index.remove([updated.id])
                    index.add([updated.id], vector)

            self._apply(user, before, change)
        return updated

    def delete(self, user: str, ids: list[str]) -> None:
        ids = list(dict.fromkeys(ids))
        with self._guard():
            self._check_open()
            self.store.require_user(user)
            before = self._generation_or_none(user)
            self.store.delete(user, ids)
            if ids:
                self._apply(user, before, lambda index: index.remove(ids))

    def delete_user(self, user: str) -> None:
        with self._guard():
            self._check_open()
            self.store.require_user(user)
            self.store.delete_user(user)
            if self._cache is not None:
                self._cache.forget(user)

    # -------------------------------------------------------------- reads

    def users(self) -> list[str]:
        return self.store.users()

    def get(self, user: str, ids: list[str]) -> list[Memory]:
        return self.store.get(user, ids)  # checks the user itself

    def memories(self, user: str) -> list[Memory]:
        self.store.require_user(user)
        return self.store.memories(user)

    def embeddings(self, user: str, ids: list[str]) -> torch.Tensor:
        """Stored embeddings [len(ids), d] in the order of `ids`."""
        self.store.require_user(user)
        return self.store.embeddings(user, list(ids))[1]

    def search(self, queries: list[str], user: str, k: int) -> list[Candidates]:
        """Top-k memories of `user` for each query: one encoder call, one index search."""
        if isinstance(queries, str):
            raise TypeError("queries must be a list of strings (got one string)")
        queries = list(queries)
        self._check_k(k)
        self.store.require_user(user)
        if not queries:
            return []
        return self.search_embeddings(self._encode(queries, queries=True), user, k, queries=queries)

    def query_matrix(self, query_embs: torch.Tensor, n_texts: int | None = None) -> torch.Tensor:
        """Given query vectors as a float [n, dim] matrix, refused when they cannot be this bank's (a
        wrong dim, or `n_texts` query texts for another number of vectors); one check for every
        retriever that searches with vectors it was handed."""
        q = torch.as_tensor(query_embs).detach().float()
        if q.ndim == 1:
            q = q.unsqueeze(0)
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise DimensionMismatchError(f"query embeddings of shape {tuple(q.shape)} do not match the bank's dim {self.dim}")
        if n_texts is not None and n_texts != q.shape[0]:
            raise ValueError(f"{n_texts} query texts for {q.shape[0]} query embeddings")
        return q

    def search_embeddings(
        self, query_embs: torch.Tensor, user: str, k: int, queries: list[str] | None = None,
        search_with: torch.Tensor | None = None,
    ) -> list[Candidates]:
        """Search with query vectors already computed. `search_with` (one row per query, e.g. the
        reranker's learned `q @ A`) is what the index is searched with instead of `query_embs`:
        it chooses the candidates, which still carry `query_embs` as their query embedding."""
        self._check_k(k)
        q = self.query_matrix(query_embs, None if queries is None else len(queries))
        s = q if search_with is None else self.query_matrix(search_with, q.shape[0])
        texts = list(queries) if queries is not None else [""] * q.shape[0]
        with self._guard():
            self._check_open()
            if self._cache is None:  # the database searches: scores, ids and the hits' vectors in one go
                scores, ids, gathered = cast(VectorSearchStorage, self.store).search(user, s.cpu(), k)
            else:
                index = self._cache.index_for(user)
                scores, ids = index.search(s, k)
                flat = [i for row in ids for i in row]
                gathered = index.vectors(flat) if flat else torch.zeros((0, self.dim))
        q_cpu = q.cpu()
        out: list[Candidates] = []
        offset = 0
        for b, row in enumerate(ids):
            out.append(
                Candidates(
                    query=texts[b],
                    memory_ids=list(row),
                    retriever_scores=scores[b, : len(row)].clone(),
                    embeddings=gathered[offset : offset + len(row)].clone(),
                    query_embedding=q_cpu[b].clone(),
                    user_id=user,
                )
            )
            offset += len(row)
        return out

    @staticmethod
    def _check_k(k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")

    # -------------------------------------------------------------- lifecycle

    def flush(self) -> None:
        """Write every index changed since it was last saved (they are rebuildable anyway)."""
        with self._lock:
            if self._cache is not None:
                self._cache.flush()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self.flush()
            finally:
                self._closed = True
                if self._cache is not None:
                    self._cache.clear()
                self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MemoryBank({self.location!r}, encoder={self.encoder.name!r}, index={self.index_backend!r})"
