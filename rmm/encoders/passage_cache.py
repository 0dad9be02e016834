"""Encoder vectors kept on disk, keyed by exactly what the model reads: an encoder's token ids.

Why: the same texts are encoded again and again by one user's commands. `rmm eval --granularity
turn topic` encodes every turn for the turn bank and then again for the topic bank's segmentation;
a topic bank rebuilt with other reflector settings re-encodes every topic that comes out the same;
a merged topic whose text was already past `max_length` reads the same tokens as before; a script
that runs many trainings over one benchmark (`rmm/bench/ablations.py`) searches the same
questions in every run. A cache keyed by the token ids (after the prefix and the truncation, so
two texts that the model cannot tell apart share an entry) answers all of these without running
the model. Queries and passages share it: a query's ids include its prefix or instruction, so a
query and a passage meet in one entry only when the model reads the same tokens — and then it
computes the same vector.

One SQLite file per encoder *and* device/dtype: the fingerprint deliberately ignores where the
weights run (a bank built on a GPU opens on a CPU), but a bfloat16 vector is not a float32 one,
and a cache must hand back what this encoder would compute. Vectors computed in another batch
differ from a fresh encode only by float rounding (~1e-7). Never attach a cache to an encoder whose
weights are being trained: the fingerprint is computed once, at load. `rmm train` searches its
questions uncached (the cache is attached only while `open_retriever` builds a bank): another
batch's rounding could move near-ties and the README's figures must reproduce to the digit.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from rmm.errors import CorruptFileError
from rmm.paths import cache_dir

__all__ = ["CACHE_SUBDIR", "PassageCache", "attach_cache", "token_key"]

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS vectors (key BLOB PRIMARY KEY, vector BLOB NOT NULL);
"""
_LOOKUP_CHUNK = 500  # SQLite's host-parameter limit is 999 on old builds
CACHE_SUBDIR = "passages"  # the cache files' folder under the rmm cache directory


class _Identified(Protocol):
    fingerprint: str
    dim: int


def token_key(ids: Sequence[int]) -> bytes:
    """A 16-byte digest of a token-id sequence (the cache key)."""
    return hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=16).digest()


class PassageCache:
    """Token ids → vector (a passage's or a query's) for one encoder identity (`fingerprint`, `dim`,
    `variant`); an rmm `Encoder` reads it through its `passage_cache` attribute.

    `variant` names what the fingerprint leaves out but the numbers depend on (device type, dtype).
    A file written for another identity is refused, never silently mixed.
    """

    def __init__(self, path: str | Path, fingerprint: str, dim: int, variant: str = "") -> None:
        self.path = Path(path)
        self.dim = int(dim)
        self.identity = f"{fingerprint}|{variant}|{self.dim}"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=60, check_same_thread=False, isolation_level=None)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('identity', ?)", (self.identity,))
            (stored,) = self._db.execute("SELECT value FROM meta WHERE key = 'identity'").fetchone()
        except sqlite3.DatabaseError as err:
            self._db.close()
            raise CorruptFileError(f"passage cache {self.path} is not readable: {err}") from err
        if stored != self.identity:
            self._db.close()
            raise CorruptFileError(f"passage cache {self.path} holds vectors of {stored!r}, not {self.identity!r}")
        self.hits = 0
        self.misses = 0

    @classmethod
    def for_encoder(cls, folder: str | Path, encoder: _Identified) -> PassageCache:
        """The cache file of `encoder` (an rmm `Encoder`) under `folder`, named after its identity."""
        fingerprint, dim = str(encoder.fingerprint), int(encoder.dim)
        device, dtype = getattr(encoder, "device", "cpu"), getattr(encoder, "dtype", torch.float32)
        variant = f"{torch.device(device).type}-{str(dtype).removeprefix('torch.')}"
        name = hashlib.sha256(f"{fingerprint}|{variant}".encode()).hexdigest()[:16]
        return cls(Path(folder) / f"{name}.sqlite", fingerprint, dim, variant)

    def get(self, keys: Sequence[bytes]) -> dict[bytes, torch.Tensor]:
        """The cached vectors among `keys` (absent keys are simply missing from the answer)."""
        found: dict[bytes, torch.Tensor] = {}
        unique = list(dict.fromkeys(keys))
        with self._lock:
            for start in range(0, len(unique), _LOOKUP_CHUNK):
                chunk = unique[start:start + _LOOKUP_CHUNK]
                rows = self._db.execute(f"SELECT key, vector FROM vectors WHERE key IN ({','.join('?' * len(chunk))})",
                                        chunk).fetchall()
                for key, blob in rows:
                    if len(blob) == 4 * self.dim:
                        found[key] = torch.from_numpy(np.frombuffer(blob, dtype=np.float32).copy())
        self.hits += len(found)
        self.misses += len(unique) - len(found)
        return found

    def put(self, keys: Sequence[bytes], vectors: torch.Tensor) -> None:
        """Remember `vectors` (one row per key); a key already present keeps its first vector."""
        rows = vectors.detach().float().cpu().numpy()
        if rows.shape != (len(keys), self.dim):
            raise ValueError(f"{len(keys)} keys for vectors of shape {rows.shape}; this cache holds {self.dim}-d rows")
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany("INSERT OR IGNORE INTO vectors VALUES (?, ?)",
                                     [(key, row.tobytes()) for key, row in zip(keys, rows)])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM vectors").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __repr__(self) -> str:
        return f"PassageCache({str(self.path)!r}, dim={self.dim})"


def attach_cache(encoder: Any, cache: str | Path | None = None) -> PassageCache | None:
    """Give `encoder` its cache under `<cache>/passages/` (default the rmm cache directory) for the
    rest of the process, queries and passages alike: for scripts that encode the same questions
    run after run. None (nothing attached) for an encoder without the hook, i.e. not an rmm `Encoder`."""
    if not hasattr(encoder, "passage_cache"):
        return None
    opened = PassageCache.for_encoder(cache_dir(cache) / CACHE_SUBDIR, encoder)
    encoder.passage_cache = opened
    return opened
