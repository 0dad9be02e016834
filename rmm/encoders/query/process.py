"""The query encoder in a child process: a forward pass that never waits for the server's GIL.

A CPU forward pass is a few hundred torch ops, and each one hands Python's GIL back and takes it
again. In the server the other threads (the event loop parsing requests, the stage that searches,
reranks and stores selections) hold the GIL between their own ops, so every retake of the encoder
waits for them: an encoder that needs 26 ms for 16 queries alone took 42 ms in the server, and
with one pure-Python thread beside it, seconds. In its own process the encoder has its own GIL and
the server's two pipeline stages really run on two cores (`rmm/bench/serve.py`).

The child loads the same encoder (by the config's name or folder) with the same query path and
thread count, so a query's vector is the one the server would compute in-process (the start-up
compares fingerprints). Only query encoding moves; passages (what the bank stores) are still
encoded by the server's own encoder.

The calling thread talks to the child over one pipe: it sends the texts and blocks on the answer
with the GIL released, so a round trip costs the server one GIL handoff. (A process pool needs
three — its feeder thread, its result thread, then the caller — and each waits for whichever thread
holds the GIL. In `python -m rmm.bench.serve --setting goal` the encoding stage was busy 97 % of the
time while the child computed 73 % with a pool, and 87 % vs 75 % over the pipe.) A child found dead before a
call is replaced first; one that dies during a call fails that call with `EncoderUnavailableError`
(503), and the next call starts a new one.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rmm.errors import ConfigError
from rmm.encoders.protocol import EncoderLike
from rmm.encoders.query.choice import EngineChoice
from rmm.errors import EncoderUnavailableError

__all__ = ["ProcessQueryEncoder", "QueryProcessSpec"]

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 300.0  # importing torch and loading a model in a fresh interpreter
_PARENT_POLL_S = 1.0  # how often the child checks that the server is still there
_STOP_TIMEOUT_S = 5.0  # a closed child exits at once; after this it is terminated


@dataclass(frozen=True)
class QueryProcessSpec:
    """What the child needs to build the server's query encoder: `load_encoder(encoder)` on the
    CPU at `threads` intra-op threads, then the engine `precision` asks for, measured on the child's
    own threads (`choose_query_engine` over probe batches of `batch_sizes`, its timings cached
    under `cache_dir`)."""

    encoder: str
    precision: str
    threads: int | None
    batch_sizes: tuple[int, ...] = (1, 16, 32)
    cache_dir: str | None = None


# ---- the child ----------------------------------------------------------------------------

def _serve(conn: Connection, spec: QueryProcessSpec) -> None:
    """The child's main: load, report the fingerprint, then answer texts with vectors until the
    pipe closes. A failure is sent back as the exception (the child lives on)."""
    logging.getLogger().setLevel(logging.WARNING)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="rmm-parent-watch", daemon=True).start()
    try:
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        from rmm.encoders import load_encoder
        from rmm.encoders.query.choice import choose_query_engine

        encoder, choice = choose_query_engine(load_encoder(spec.encoder, device="cpu", show_progress=False),
                                              spec.precision, batch_sizes=spec.batch_sizes,
                                              cache_dir=None if spec.cache_dir is None else Path(spec.cache_dir))
    except BaseException as err:  # noqa: BLE001 - whatever stops the load is the parent's error message
        _reply(conn, "error", err)
        return
    _reply(conn, "ready", (str(encoder.fingerprint), choice.to_json()))
    while True:
        try:
            texts = conn.recv()
        except (EOFError, OSError):  # the server closed the pipe (or is gone)
            return
        try:
            # a numpy array pickles by value (16 queries: 24 KB); a tensor would go through shared memory
            _reply(conn, "ok", encoder.encode_queries(texts).numpy())
        except Exception as err:  # noqa: BLE001 - the caller's request fails, the child stays
            _reply(conn, "error", err)


def _reply(conn: Connection, status: str, payload: Any) -> None:
    try:
        conn.send((status, payload))  # pickled before anything is written
    except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle: its text does
        conn.send((status, RuntimeError(f"{type(payload).__name__}: {payload}")))


def _exit_with_parent(parent: int) -> None:
    """A server killed with `kill -9` cannot stop its child: leave once re-parented."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    os._exit(0)


# ---- the server's side --------------------------------------------------------------------

@dataclass
class _Child:
    process: BaseProcess
    conn: Connection
    lock: threading.Lock = field(default_factory=threading.Lock)  # one call on the pipe at a time

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def stop(self) -> None:
        self.conn.close()  # the child's recv ends: it returns
        self.process.join(_STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(_STOP_TIMEOUT_S)


class ProcessQueryEncoder:
    """`encode_queries` in a child process; passages, name, dimension and fingerprint from the
    server's in-process encoder `local` (which the child's must match: a query path shares its
    float encoder's fingerprint, so `local` may be the float encoder itself)."""

    thread_safe_queries = True  # callers need no lock around encode_queries (the tokenizer is the child's)

    def __init__(self, local: EncoderLike, spec: QueryProcessSpec) -> None:
        self.inner = local
        self.name, self.dim, self.fingerprint = local.name, int(local.dim), local.fingerprint
        self.spec = spec
        self._lock = threading.Lock()  # (re)starting the child
        self._child: _Child | None = None
        self._closed = False
        self.choice: EngineChoice | None = None  # the engine the (last started) child runs, and why
        self._running()

    @property
    def child_pid(self) -> int | None:
        """The child's process id (None while none runs)."""
        child = self._child
        return None if child is None else child.pid

    def _running(self) -> _Child:
        """The live child, started (or restarted, if found dead) first."""
        with self._lock:
            child = self._child
            if child is not None and not child.process.is_alive():
                log.warning("the query encoder process (pid %s) died with exit code %s; starting a new one",
                            child.pid, child.process.exitcode)
                self._child = child = None
            if child is None:
                if self._closed:
                    raise EncoderUnavailableError("the query encoder process is closed (shutting down)")
                child = self._child = self._spawn()
            return child

    def _spawn(self) -> _Child:
        # spawn: a fork of a process with threads (the server's) may inherit held locks
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        process = context.Process(target=_serve, args=(child_conn, self.spec), name="rmm-query-encoder", daemon=True)
        process.start()
        child_conn.close()  # the child holds its end: EOF here once it exits
        child = _Child(process, conn)
        try:
            if not conn.poll(_START_TIMEOUT_S):
                raise TimeoutError(f"no answer in {_START_TIMEOUT_S:.0f} s")
            status, payload = conn.recv()
        except (EOFError, OSError, TimeoutError) as err:
            child.stop()
            detail = "it exited while loading" if isinstance(err, EOFError) else f"{type(err).__name__}: {err}"
            raise ConfigError(f"the query encoder process for {self.spec.encoder!r} did not start: {detail} "
                              f"(exit code {process.exitcode})") from err
        if status != "ready":
            child.stop()
            raise ConfigError(f"the query encoder process for {self.spec.encoder!r} did not start: "
                              f"{type(payload).__name__}: {payload}")
        fingerprint, choice = payload
        if fingerprint != self.fingerprint:
            child.stop()
            raise ConfigError(f"the query encoder process loaded {fingerprint}, not the server's {self.fingerprint}")
        self.choice = EngineChoice.from_json(choice)
        log.info("query encoder %s: in its own process (pid %s)", self.name, child.pid)
        return child

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        if not texts:
            return torch.empty(0, self.dim)
        try:
            child = self._running()
        except ConfigError as err:  # a restart after the child died: the server's failure, not the request's
            raise EncoderUnavailableError(f"the query encoder process could not be restarted: {err}") from err
        with child.lock:
            try:
                child.conn.send(list(texts))
                status, payload = child.conn.recv()  # blocks with the GIL released
            except (EOFError, OSError) as err:
                self._discard(child)
                raise EncoderUnavailableError("the query encoder process died; retry the request") from err
        if status != "ok":
            raise payload
        return torch.from_numpy(payload)

    def _discard(self, child: _Child) -> None:
        """Forget a child that failed a call (the next call starts a new one)."""
        with self._lock:
            if self._child is child:
                self._child = None
        child.stop()

    def encode_passages(self, texts: list[str]) -> torch.Tensor:
        return self.inner.encode_passages(texts)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            child, self._child = self._child, None
        if child is not None:
            in_flight = not child.lock.acquire(timeout=_STOP_TIMEOUT_S)  # let the call in flight finish
            child.stop()
            if not in_flight:
                child.lock.release()
