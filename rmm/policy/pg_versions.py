"""Reranker versions in PostgreSQL: a learner checkpoint per learner key and version.

The one learner among the replicas writes a row per optimizer step (`version` = the learner's
step, the weights version stamped on every selection sampled under it); every replica reads the
newest version of each key it serves. Rows are immutable; old ones are pruned, keeping `keep`
per key. The checkpoint is `rmm.policy.checkpoint`'s folder packed into one tar, so the same
checksums and format checks apply as to a folder on disk.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rmm.memory.pg_database import PgDatabase
from rmm.policy.checkpoint import pack_checkpoint, unpack_checkpoint
from rmm.policy.learner import Learner

if TYPE_CHECKING:
    import psycopg

__all__ = ["RerankerVersions", "learner_from_bytes", "learner_to_bytes"]

log = logging.getLogger(__name__)


def learner_to_bytes(learner: Learner) -> bytes:
    """The learner's checkpoint (weights, optimizer, buffer, stats) as bytes."""
    with tempfile.TemporaryDirectory(prefix="rmm-ckpt-") as tmp:
        return pack_checkpoint(learner.save(Path(tmp) / "ckpt"))


def learner_from_bytes(data: bytes, *, encoder_name: str | None, dim: int | None, device: Any = "cpu",
                       lexical_feature: bool | None = None,
                       feature_names: Sequence[str] | None = None) -> Learner:
    """A learner from `learner_to_bytes`'s bytes (refuses another encoder, dimension or, when
    given, lexical-feature setting or candidate features — as `Learner.load` does for a folder)."""
    with tempfile.TemporaryDirectory(prefix="rmm-ckpt-") as tmp:
        folder = unpack_checkpoint(data, Path(tmp) / "ckpt")
        return Learner.load(folder, encoder_name=encoder_name, dim=dim, device=device,
                            lexical_feature=lexical_feature, feature_names=feature_names)


class RerankerVersions:
    """The `reranker_versions` table (migration 0002) of one bank schema."""

    def __init__(self, db: PgDatabase, *, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.db, self.keep = db, keep

    def latest(self) -> dict[str, int]:
        """The newest version of every key (one cheap query; what replicas poll)."""
        with self.db.tx() as cur:
            rows = cur.execute("SELECT reranker_key, max(version) FROM reranker_versions "
                               "GROUP BY reranker_key").fetchall()
        return {str(key): int(version) for key, version in rows}

    def read(self, key: str) -> tuple[int, bytes] | None:
        """(version, checkpoint bytes) of the newest version of `key`, or None when it has none."""
        with self.db.tx() as cur:
            row = cur.execute("SELECT version, checkpoint FROM reranker_versions WHERE reranker_key = %s "
                              "ORDER BY version DESC LIMIT 1", (key,)).fetchone()
        return None if row is None else (int(row[0]), bytes(row[1]))

    def write(self, cur: psycopg.Cursor[Any], key: str, version: int, data: bytes) -> None:
        """Insert `version` of `key` in the caller's transaction (a duplicate version — a second
        writer — fails it) and prune versions older than the newest `keep`."""
        cur.execute("INSERT INTO reranker_versions (reranker_key, version, created_at, checkpoint) "
                    "VALUES (%s, %s, %s, %s)", (key, int(version), time.time(), data))
        cur.execute("DELETE FROM reranker_versions WHERE reranker_key = %s AND version <= %s",
                    (key, int(version) - self.keep))

    def delete(self, key: str) -> int:
        """Forget every version of `key` (its user was deleted)."""
        with self.db.tx() as cur:
            return cur.execute("DELETE FROM reranker_versions WHERE reranker_key = %s", (key,)).rowcount
