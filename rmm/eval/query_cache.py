"""Query embeddings kept on disk, keyed by (encoder, text), so repeated runs encode each question once.

A benchmark run searches every question of the benchmark; on MSC that is 18 212 questions, and
encoding them was most of an `rmm train` run's time on a loaded CPU. The bank caches passage
vectors already; this caches the query side. The key is the encoder's fingerprint (weights,
pooling, head, norm) plus its query prefix (which the fingerprint leaves out), so a file is only
ever read back by an encoder that would produce the same vectors.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rmm.paths import cache_dir

__all__ = ["QueryEmbeddingCache", "cache_queries", "encoder_key"]

log = logging.getLogger(__name__)


def encoder_key(encoder: Any) -> str:
    """What the query vectors depend on: the encoder's fingerprint and its query prefix."""
    prefix = getattr(getattr(encoder, "config", None), "query_prefix", "")
    return hashlib.sha256(f"{encoder.fingerprint}|{prefix}".encode()).hexdigest()[:16]


class QueryEmbeddingCache:
    """A text → vector map for one encoder, loaded from and written back to one file.

    Writes are atomic (temporary file, then rename) and merge what another process wrote in the
    meantime, so two runs sharing the file lose nothing and never read half a file.
    """

    def __init__(self, path: Path, key: str, flush_every: int = 4096) -> None:
        self.path, self.key, self.flush_every = path, key, flush_every
        self.vectors: dict[str, torch.Tensor] = {}
        self._unsaved = 0
        self.hits = self.misses = 0
        self._merge_from_disk()

    def _merge_from_disk(self) -> None:
        if not self.path.exists():
            return
        try:
            data = torch.load(self.path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError) as error:
            log.warning("query cache %s unreadable (%s); starting a new one", self.path, error)
            return
        if data.get("key") != self.key:
            log.warning("query cache %s belongs to another encoder; ignoring it", self.path)
            return
        for text, vector in zip(data["texts"], data["vectors"]):
            self.vectors.setdefault(text, vector)

    def encode(self, texts: Sequence[str], encode: Any) -> torch.Tensor:
        """The vectors of `texts`, encoding (with `encode`) only those not seen before, once each."""
        missing = list(dict.fromkeys(t for t in texts if t not in self.vectors))
        self.misses += len(missing)
        self.hits += len(texts) - len(missing)
        if missing:
            fresh = torch.as_tensor(encode(missing)).detach().float().cpu()
            self.vectors.update(zip(missing, fresh))
            self._unsaved += len(missing)
            if self._unsaved >= self.flush_every:
                self.flush()
        if not texts:
            return torch.zeros((0, 0))
        return torch.stack([self.vectors[t] for t in texts])

    def flush(self) -> None:
        """Write every vector (merged with the file's current content) atomically."""
        if not self._unsaved:
            return
        self._merge_from_disk()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        texts = list(self.vectors)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        torch.save({"key": self.key, "texts": texts, "vectors": torch.stack([self.vectors[t] for t in texts])}, tmp)
        tmp.replace(self.path)
        self._unsaved = 0
        log.info("query cache %s: %d vectors", self.path, len(texts))


def cache_queries(encoder: Any, cache: str | Path | None = None) -> QueryEmbeddingCache:
    """Route `encoder.encode_queries` through an on-disk cache (under the rmm cache directory).

    Call `.flush()` on the returned cache when done (it also flushes every `flush_every` new texts).
    """
    key = encoder_key(encoder)
    store = QueryEmbeddingCache(cache_dir(cache) / "queries" / f"{key}.pt", key)
    encode = encoder.encode_queries

    def cached(texts: Sequence[str]) -> torch.Tensor:
        return store.encode(list(texts), encode)

    encoder.encode_queries = cached
    return store
