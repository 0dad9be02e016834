"""Lexical baseline retriever: BM25 over a user's memory texts (the `bm25s` package).

Same `search` signature as `MemoryBank.search`, returning `Candidates` without embeddings
(the reranker cannot rescore them; evaluation can). Each user's BM25 index is built lazily from
the store and rebuilt whenever the store's generation for that user has moved, so it never serves
memories that were deleted or misses ones added by another process.

Tokenisation is `rmm.memory.tokens.tokenize` (bm25s's tokenizer only maps its words to ids), the
same words the candidate features compare: lower-cased runs of two or more letters or digits,
stopwords removed, no stemming. A memory that shares no term with the query scores 0 and is not
returned, so a query can get fewer than k (or zero) candidates.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rmm.memory.storage import MemoryStorage
from rmm.memory.tokens import tokenize
from rmm.types import Candidates

__all__ = ["BM25Retriever"]

log = logging.getLogger(__name__)


@dataclass
class _UserBM25:
    generation: int
    ids: list[str]
    model: Any  # bm25s.BM25, or None for a user without memories
    tokenizer: Any  # bm25s.tokenization.Tokenizer holding the corpus vocabulary


class BM25Retriever:
    """BM25 (Lucene variant, k1=1.5, b=0.75 by default) per user, over `store`'s memory texts."""

    def __init__(self, store: MemoryStorage, k1: float = 1.5, b: float = 0.75, method: str = "lucene") -> None:
        self.store = store
        self.k1, self.b, self.method = k1, b, method
        self._lock = threading.RLock()
        self._cache: dict[str, _UserBM25] = {}

    def _user_index(self, user: str) -> _UserBM25:
        import bm25s
        from bm25s.tokenization import Tokenizer

        self.store.require_user(user)
        generation = self.store.generation(user)
        cached = self._cache.get(user)
        if cached is not None and cached.generation == generation:
            return cached
        memories = self.store.memories(user)
        tokenizer = Tokenizer(lower=False, splitter=tokenize, stopwords=None)  # tokenize lowers and drops them
        model = None
        if memories:
            corpus = tokenizer.tokenize([m.text for m in memories], return_as="ids", show_progress=False)
            model = bm25s.BM25(k1=self.k1, b=self.b, method=self.method)
            model.index(corpus, show_progress=False)
        entry = _UserBM25(generation, [m.id for m in memories], model, tokenizer)
        self._cache[user] = entry
        log.debug("built BM25 index for user %r (%d memories, generation %d)", user, len(memories), generation)
        return entry

    def search(self, queries: list[str], user: str, k: int) -> list[Candidates]:
        """Top-k memories per query by BM25 score (all queries scored in one bm25s call)."""
        if isinstance(queries, str):
            raise TypeError("queries must be a list of strings (got one string)")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        queries = list(queries)
        with self._lock:
            entry = self._user_index(user)
        results: list[tuple[list[str], list[float]]] = [([], []) for _ in queries]
        if entry.model is not None and queries:
            empty_id = entry.tokenizer.get_vocab_dict().get("")
            token_ids = entry.tokenizer.tokenize(queries, update_vocab=False, return_as="ids", show_progress=False)
            token_ids = [[t for t in row if t != empty_id] for row in token_ids]
            answerable = [i for i, row in enumerate(token_ids) if row]
            if answerable:
                top = min(k, len(entry.ids))
                with self._lock:  # bm25s models are not documented as thread-safe
                    docs, scores = entry.model.retrieve(
                        [token_ids[i] for i in answerable], k=top, show_progress=False, n_threads=1
                    )
                for row, i in enumerate(answerable):
                    keep = np.asarray(scores[row]) > 0
                    results[i] = (
                        [entry.ids[int(d)] for d in np.asarray(docs[row])[keep]],
                        [float(s) for s in np.asarray(scores[row])[keep]],
                    )
        return [
            Candidates(
                query=text,
                memory_ids=ids,
                retriever_scores=torch.tensor(scores, dtype=torch.float32),
                embeddings=None,
                query_embedding=None,
                user_id=user,
            )
            for text, (ids, scores) in zip(queries, results)
        ]
