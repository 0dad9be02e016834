"""A user-partitioned memory bank: store + per-user vector index + encoder (DESIGN.md §4).

Directory layout::

    <bank>/bank.json          encoder name, fingerprint, dim — the bank refuses any other encoder
    <bank>/memories.sqlite    MemoryStore: the source of truth (memories + embeddings)
    <bank>/index/<user>.safetensors   per-user index, stamped with the store generation it reflects

Writes go to the store first — a write is acknowledged once its transaction commits — and then to
the in-memory index. Index files are a cache: one is written after a (re)build and, for indexes
changed since, on `flush()` / `close()`. A file whose stamp (store id, user, generation, backend,
encoder) does not match the store is stale and is rebuilt from the stored embeddings; an unreadable
one is rebuilt with a warning. Nothing acknowledged can therefore be lost by a crash, and another
process writing to the same bank is noticed at the next search (the generation moved).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, Self

import torch

from rmm.device import resolve_device
from rmm.errors import (
    CorruptFileError,
    DimensionMismatchError,
    EncoderMismatchError,
    RmmError,
)
from rmm.memory.index import BACKENDS, VectorIndex, index_file_info, load_index, make_index
from rmm.memory.store import MemoryStore
from rmm.types import Candidates, Memory

__all__ = ["BANK_FILE", "INDEX_DIR", "STORE_FILE", "EncoderLike", "MemoryBank"]

log = logging.getLogger(__name__)

BANK_FILE = "bank.json"
STORE_FILE = "memories.sqlite"
INDEX_DIR = "index"
_BANK_FORMAT = 1


class EncoderLike(Protocol):
    """What the bank needs of an encoder (`rmm.encoders.Encoder` satisfies it)."""

    name: str
    dim: int
    fingerprint: str

    def encode_queries(self, texts: list[str]) -> torch.Tensor: ...

    def encode_passages(self, texts: list[str]) -> torch.Tensor: ...


@dataclass
class _UserIndex:
    index: VectorIndex
    generation: int
    dirty: bool  # changed since it was last written to disk


def _index_filename(user: str) -> str:
    """A safe, unique file name for any user id (readable prefix + hash of the exact id)."""
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", user)[:48].lstrip(".") or "user"
    digest = hashlib.sha1(user.encode("utf-8")).hexdigest()[:12]
    return f"{readable}-{digest}.safetensors"


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

    `index_options` are passed to `make_index` (e.g. ``{"nprobe": 32}`` for faiss-ivf).
    """

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
        self.path = Path(path)
        self.encoder = encoder
        self.dim = int(encoder.dim)
        self.index_backend = index_backend
        self.index_options = dict(index_options or {})
        self.device = resolve_device(device)
        self._lock = threading.RLock()
        self._indexes: dict[str, _UserIndex] = {}
        self._closed = False

        if self.path.exists() and not self.path.is_dir():
            raise CorruptFileError(f"bank path {self.path} is a file; a bank is a directory")
        existing = self._read_bank_json()
        if existing is not None:
            self._check_encoder(existing, source=self.path / BANK_FILE)
        store_path = self.path / STORE_FILE
        if existing is None and store_path.exists():
            # bank.json lost (or a crash before it was written): the store keeps a copy.
            MemoryStore._check_header(store_path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.store = MemoryStore(store_path)
        try:
            self._reconcile_encoder_record(existing)
        except BaseException:
            self.store.close()
            raise
        (self.path / INDEX_DIR).mkdir(exist_ok=True)

    # -------------------------------------------------------------- encoder record

    def _read_bank_json(self) -> dict[str, Any] | None:
        file = self.path / BANK_FILE
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
                f"bank {self.path} holds {int(record['dim'])}-d embeddings from encoder {record.get('encoder_name')!r} "
                f"(fingerprint {record['fingerprint']!r}); the given encoder {self.encoder.name!r} "
                f"(fingerprint {self.encoder.fingerprint!r}) makes {self.dim}-d vectors. Open the bank with its "
                f"encoder, or re-encode into a new bank. [{source}]"
            )
        if str(record["fingerprint"]) != self.encoder.fingerprint:
            raise EncoderMismatchError(
                f"bank {self.path} was built with encoder {record.get('encoder_name')!r} "
                f"(fingerprint {record['fingerprint']!r}); refusing encoder {self.encoder.name!r} "
                f"(fingerprint {self.encoder.fingerprint!r}): their vectors are not comparable. Open the bank with "
                f"its encoder, or re-encode into a new bank. [{source}]"
            )

    def _reconcile_encoder_record(self, existing: dict[str, Any] | None) -> None:
        """Keep bank.json and the store's copy of it in agreement; write them for a new bank."""
        stored = self.store.get_meta("encoder")
        if stored is not None:
            self._check_encoder(json.loads(stored), source=self.path / STORE_FILE)
        record = {
            "format": _BANK_FORMAT,
            "encoder_name": self.encoder.name,
            "fingerprint": self.encoder.fingerprint,
            "dim": self.dim,
        }
        if stored is None:
            self.store.set_meta("encoder", json.dumps(record, sort_keys=True))
        if existing is None:
            _write_json_atomic(self.path / BANK_FILE, {**record, "created_at": time.time()})

    # -------------------------------------------------------------- index cache

    def _check_open(self) -> None:
        if self._closed:
            raise RmmError(f"memory bank {self.path} is closed")

    def _index_path(self, user: str) -> Path:
        return self.path / INDEX_DIR / _index_filename(user)

    def _stamp(self, user: str, generation: int) -> dict[str, str]:
        return {
            "store_id": self.store.store_id,
            "user": user,
            "generation": str(generation),
            "fingerprint": self.encoder.fingerprint,
            "options": json.dumps(self.index_options, sort_keys=True),
        }

    def _index_for(self, user: str) -> VectorIndex:
        """The user's index at the store's current generation: cached, loaded, or rebuilt."""
        self.store.require_user(user)
        generation = self.store.generation(user)
        cached = self._indexes.get(user)
        if cached is not None and cached.generation == generation:
            return cached.index
        index = self._load_index_file(user, generation)
        if index is None:
            ids, vectors = self.store.embeddings(user)
            index = make_index(self.index_backend, self.dim, device=self.device, **self.index_options)
            if ids:
                index.add(ids, vectors)
            self._indexes[user] = _UserIndex(index, generation, dirty=True)
            self._save_index(user)
            log.debug("built %s index for user %r (%d vectors, generation %d)", self.index_backend, user, len(ids), generation)
        else:
            self._indexes[user] = _UserIndex(index, generation, dirty=False)
        return index

    def _load_index_file(self, user: str, generation: int) -> VectorIndex | None:
        file = self._index_path(user)
        if not file.exists():
            return None
        expected = self._stamp(user, generation)
        try:
            info = index_file_info(file)
            stamp = info["metadata"]
            if info["backend"] != self.index_backend or info["dim"] != self.dim or stamp != expected:
                log.info("index file %s is stale (generation %s, store at %d); rebuilding", file, stamp.get("generation"), generation)
                return None
            index = load_index(file, device=self.device)
        except CorruptFileError as exc:
            log.warning("index file %s is unreadable (%s); rebuilding it from the store", file, exc)
            return None
        return index

    def _save_index(self, user: str) -> None:
        entry = self._indexes.get(user)
        if entry is None or not entry.dirty:
            return
        if self._generation_or_none(user) != entry.generation:
            return  # another writer moved on: this snapshot would only be stale on disk
        entry.index.metadata = self._stamp(user, entry.generation)
        try:
            entry.index.save(self._index_path(user))
            entry.dirty = False
        except OSError as exc:  # the index is only a cache: failing to persist it loses nothing
            log.warning("could not write index file for user %r: %s", user, exc)

    def _apply(self, user: str, before: int | None, change: Any) -> None:
        """Bring a cached index along with a store write that moved `before` → now.

        Applied incrementally only if the cache reflected `before` and no other writer slipped in
        (generation moved by exactly one); otherwise the cache is dropped and rebuilt on demand.
        """
        entry = self._indexes.get(user)
        if entry is None:
            return
        try:
            after = self.store.generation(user) if self.store.has_user(user) else None
            if before is None or after != before + 1 or entry.generation != before:
                del self._indexes[user]
                return
            change(entry.index)
            entry.generation = after
            entry.dirty = True
        except BaseException:
            self._indexes.pop(user, None)
            raise

    def _generation_or_none(self, user: str) -> int | None:
        return self.store.generation(user) if self.store.has_user(user) else None

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
        with self._lock:
            self._check_open()
            before = self._generation_or_none(user)
            self.store.add(memories, vectors)
            self._apply(user, before, lambda index: index.add(ids, vectors))
        return ids

    def update(self, user: str, memory: Memory) -> Memory:
        """Replace a memory's fields; re-embed when its text changed. Returns the stored memory.

        `updated_at` is set to now and `created_at` kept from the stored memory.
        """
        if memory.user_id != user:
            raise ValueError(f"memory {memory.id!r} belongs to user {memory.user_id!r}, not {user!r}")
        with self._lock:
            self._check_open()
            self.store.require_user(user)
            (old,) = self.store.get(user, [memory.id])
            updated = replace(memory, created_at=old.created_at, updated_at=max(time.time(), old.updated_at + 1e-6))
            vector = self._encode([updated.text], queries=False) if updated.text != old.text else None
            before = self.store.generation(user)
            self.store.update(updated, None if vector is None else vector[0])

            def change(index: VectorIndex) -> None:
                if vector is not None:
                    index.remove([updated.id])
                    index.add([updated.id], vector)

            self._apply(user, before, change)
        return updated

    def delete(self, user: str, ids: list[str]) -> None:
        ids = list(dict.fromkeys(ids))
        with self._lock:
            self._check_open()
            self.store.require_user(user)
            before = self.store.generation(user)
            self.store.delete(user, ids)
            if ids:
                self._apply(user, before, lambda index: index.remove(ids))

    def delete_user(self, user: str) -> None:
        with self._lock:
            self._check_open()
            self.store.require_user(user)
            self.store.delete_user(user)
            self._indexes.pop(user, None)
            self._index_path(user).unlink(missing_ok=True)

    # -------------------------------------------------------------- reads

    def users(self) -> list[str]:
        return self.store.users()

    def get(self, user: str, ids: list[str]) -> list[Memory]:
        self.store.require_user(user)
        return self.store.get(user, ids)

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

    def search_embeddings(
        self, query_embs: torch.Tensor, user: str, k: int, queries: list[str] | None = None
    ) -> list[Candidates]:
        """Search with query vectors already computed (e.g. transformed by the reranker's W_q)."""
        self._check_k(k)
        q = torch.as_tensor(query_embs).detach().float()
        if q.ndim == 1:
            q = q.unsqueeze(0)
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise DimensionMismatchError(f"query embeddings of shape {tuple(q.shape)} do not match the bank's dim {self.dim}")
        texts = list(queries) if queries is not None else [""] * q.shape[0]
        if len(texts) != q.shape[0]:
            raise ValueError(f"{len(texts)} query texts for {q.shape[0]} query embeddings")
        with self._lock:
            self._check_open()
            index = self._index_for(user)
            scores, ids = index.search(q, k)
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
            for user in list(self._indexes):
                self._save_index(user)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self.flush()
            finally:
                self._closed = True
                self._indexes.clear()
                self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MemoryBank({str(self.path)!r}, encoder={self.encoder.name!r}, index={self.index_backend!r})"
