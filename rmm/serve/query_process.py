"""The query encoder in a child process: a forward pass that never waits for the server's GIL.

A CPU forward pass is a few hundred torch ops, and each one hands Python's GIL back and takes it
again. In the server the other threads (the event loop parsing requests, the stage that searches,
reranks and stores selections) hold the GIL between their own ops, so every retake of the encoder
waits for them: an encoder that needs 26 ms for 16 queries alone took 42 ms in the server, and
with one pure-Python thread beside it, seconds. In its own process the encoder has its own GIL and
the server's two pipeline stages really run on two cores (`scripts/bench_serve.py`).

The child loads the same encoder (by the config's name or folder) with the same query path and
thread count, so a query's vector is the one the server would compute in-process (the start-up
compares fingerprints). Only query encoding moves; passages (what the bank stores) are still
encoded by the server's own encoder. If the child dies, the call fails with
`EncoderUnavailableError` and the next call starts a new child.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rmm.errors import ConfigError
from rmm.memory.bank import EncoderLike
from rmm.serve.errors import EncoderUnavailableError

__all__ = ["ProcessQueryEncoder", "QueryProcessSpec"]

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 300.0  # importing torch and loading a model in a fresh interpreter
_PARENT_POLL_S = 1.0  # how often the child checks that the server is still there


@dataclass(frozen=True)
class QueryProcessSpec:
    """What the child needs to build the server's query encoder: `load_encoder(encoder)` on the
    CPU, then `query_encoder(…, precision)`, at `threads` intra-op threads."""

    encoder: str
    precision: str
    threads: int | None


_child_encoder: Any = None  # the child's encoder (set by `_load` in the child process)


def _load(spec: QueryProcessSpec) -> None:
    global _child_encoder
    logging.getLogger().setLevel(logging.WARNING)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="rmm-parent-watch", daemon=True).start()
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    from rmm.encoders import load_encoder
    from rmm.serve.query_encoder import query_encoder

    _child_encoder = query_encoder(load_encoder(spec.encoder, device="cpu", show_progress=False), spec.precision)


def _exit_with_parent(parent: int) -> None:
    """A server killed with `kill -9` cannot stop its child, and the child's end of the task queue
    never reports the parent gone (it holds both ends): leave once re-parented."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    os._exit(0)


def _fingerprint() -> str:
    return str(_child_encoder.fingerprint)


def _encode(texts: list[str]) -> np.ndarray:
    # a numpy array pickles by value (16 queries: 24 KB); a tensor would go through shared memory
    return _child_encoder.encode_queries(texts).numpy()


class ProcessQueryEncoder:
    """`encode_queries` in a child process; passages, name, dimension and fingerprint from the
    server's in-process encoder `local` (which the child's must match: a query path shares its
    float encoder's fingerprint, so `local` may be the float encoder itself)."""

    def __init__(self, local: EncoderLike, spec: QueryProcessSpec) -> None:
        self.inner = local
        self.name, self.dim, self.fingerprint = local.name, int(local.dim), local.fingerprint
        self.spec = spec
        self._lock = threading.Lock()  # (re)starting the child
        self._pool: ProcessPoolExecutor | None = None
        self._start()

    def _start(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # spawn: a fork of a process with threads (the server's) may inherit held locks
                pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                           initializer=_load, initargs=(self.spec,))
                try:
                    child = pool.submit(_fingerprint).result(timeout=_START_TIMEOUT_S)
                except Exception as err:
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise ConfigError(f"the query encoder process for {self.spec.encoder!r} did not start: "
                                      f"{type(err).__name__}: {err}") from err
                if child != self.fingerprint:
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise ConfigError(f"the query encoder process loaded {child}, not the server's {self.fingerprint}")
                self._pool = pool
                log.info("query encoder %s: in its own process", self.name)
            return self._pool

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        if not texts:
            return torch.empty(0, self.dim)
        try:
            pool = self._start()
        except ConfigError as err:  # a restart after the child died: the server's failure, not the request's
            raise EncoderUnavailableError(f"the query encoder process could not be restarted: {err}") from err
        try:
            return torch.from_numpy(pool.submit(_encode, list(texts)).result())
        except BrokenProcessPool as err:
            with self._lock:
                if self._pool is pool:
                    self._pool = None  # the next call starts a new child
            pool.shutdown(wait=False, cancel_futures=True)
            raise EncoderUnavailableError("the query encoder process died; retry the request") from err

    def encode_passages(self, texts: list[str]) -> torch.Tensor:
        return self.inner.encode_passages(texts)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
