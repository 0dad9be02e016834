"""A benchmark's dialogue as a searchable memory bank, one user per retrieval scope.

Encoding a benchmark is the slow part of every evaluation and training run, so the bank is kept
in the cache directory, keyed by dataset content, encoder and granularity, and reused.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from rmm.bank import MemoryBank
from rmm.bm25 import BM25Retriever
from rmm.encoders import Encoder, load_encoder
from rmm.paths import cache_dir
from rmm.store import MemoryStore
from rmm.types import Dataset, Memory, Retriever

log = logging.getLogger(__name__)

GRANULARITIES = ("turn", "session")
LEXICAL_RETRIEVERS = ("bm25",)


def documents(dataset: Dataset, user: str, granularity: str) -> list[Memory]:
    """One memory per turn or per session, each carrying refs to the turns it holds."""
    if granularity == "turn":
        return [
            Memory(id=t.id, user_id=user, kind="turn", text=f"{t.speaker}: {t.text}", refs=[t.id],
                   source_text=t.text, time_span=(s.time, s.time))
            for s in dataset.sessions[user] for t in s.turns
        ]
    if granularity == "session":
        return [
            Memory(id=s.id, user_id=user, kind="session", text=s.text(), refs=[t.id for t in s.turns],
                   source_text=s.text(), time_span=(s.time, s.time))
            for s in dataset.sessions[user] if s.turns
        ]
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def dataset_digest(dataset: Dataset, granularity: str) -> str:
    """A short content hash: a changed dataset never reuses a stale cached bank."""
    h = hashlib.sha256(f"{dataset.name}|{granularity}".encode())
    for user, sessions in dataset.sessions.items():
        h.update(user.encode())
        for s in sessions:
            for t in s.turns:
                h.update(f"{t.id}\x1f{t.speaker}\x1f{t.text}\x1e".encode())
    return h.hexdigest()[:16]


def fill(bank_or_store: MemoryBank | MemoryStore, dataset: Dataset, granularity: str,
         progress: bool = True) -> None:
    """Add every user's documents that are not there yet (an interrupted build resumes)."""
    for user in tqdm(dataset.users, desc=f"building {granularity} bank", unit="user", disable=not progress):
        store = bank_or_store.store if isinstance(bank_or_store, MemoryBank) else bank_or_store
        if store.has_user(user) and len(store.memories(user)) == len(documents(dataset, user, granularity)):
            continue
        if store.has_user(user):
            bank_or_store.delete_user(user)  # partial from an interrupted build: redo it whole
        docs = documents(dataset, user, granularity)
        if isinstance(bank_or_store, MemoryBank):
            bank_or_store.add(user, docs)
        else:
            bank_or_store.add(docs)


@dataclass
class DatasetRetriever:
    """A retriever over a dataset plus what built it (for reports and reuse)."""

    name: str
    retriever: Retriever
    encoder: Encoder | None
    path: Path | None


def open_retriever(name: str, dataset: Dataset, granularity: str, *, cache: str | Path | None = None,
                   device: str = "auto", index_backend: str = "torch", batch_size: int = 64,
                   progress: bool = True) -> DatasetRetriever:
    """`bm25`, an encoder preset, or an encoder folder → a filled, cached retriever for `dataset`."""
    digest = dataset_digest(dataset, granularity)
    root = cache_dir(cache) / "banks"
    if name in LEXICAL_RETRIEVERS:
        path = root / f"{dataset.name}-{granularity}-{digest}-bm25.sqlite"
        path.parent.mkdir(parents=True, exist_ok=True)
        store = MemoryStore(path)
        fill(store, dataset, granularity, progress)
        return DatasetRetriever(name, BM25Retriever(store), None, path)
    encoder = load_encoder(name, device=device, batch_size=batch_size)
    enc_key = hashlib.sha256(encoder.fingerprint.encode()).hexdigest()[:12]
    path = root / f"{dataset.name}-{granularity}-{digest}-{enc_key}"
    bank = MemoryBank(path, encoder, index_backend=index_backend, device=device)
    fill(bank, dataset, granularity, progress)
    log.info("bank for %s/%s with %s at %s", dataset.name, granularity, encoder.name, path)
    return DatasetRetriever(name, bank, encoder, path)
