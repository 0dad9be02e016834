"""The server's encoder behind one lock.

Retrieval batches, write batches and reflection jobs run in different threads, and Hugging Face
tokenizers are not safe to call concurrently. An encoder whose queries run elsewhere
(`thread_safe_queries`: the query encoder's own process) is not locked for them, so a child that
is restarting never holds up the passages of a write. The call counters let tests and benchmarks
see how many requests one batched encode served.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from rmm.encoders.protocol import EncoderLike

__all__ = ["LockedEncoder"]


class LockedEncoder:
    """Wraps an encoder: one call at a time, CPU float tensors out, calls counted."""

    def __init__(self, encoder: EncoderLike) -> None:
        self.inner = encoder
        self.name, self.dim, self.fingerprint = encoder.name, int(encoder.dim), encoder.fingerprint
        self._lock = threading.Lock()
        self._query_lock = contextlib.nullcontext() if getattr(encoder, "thread_safe_queries", False) else self._lock
        self.query_calls = 0
        self.passage_calls = 0

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        with self._query_lock:
            self.query_calls += 1
            return torch.as_tensor(self.inner.encode_queries(texts)).detach().float().cpu()

    def encode_passages(self, texts: list[str]) -> torch.Tensor:
        with self._lock:
            self.passage_calls += 1
            return torch.as_tensor(self.inner.encode_passages(texts)).detach().float().cpu()
