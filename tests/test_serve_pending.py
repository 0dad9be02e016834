"""The pending-selection store: rows carry their update as sampled; old rows are upgraded once."""

from __future__ import annotations

import dataclasses
import json
import logging
import sqlite3
import time
from pathlib import Path

import pytest
import torch

from rmm.errors import UnknownMemoryError
from rmm.serve.errors import SelectionExpiredError
from rmm.serve.feedback import rebuild
from rmm.serve.pending import PendingSelection, SelectionStore

# The table as rmm wrote it before embeddings, tau, version, mask and feedback were stored.
_OLD_SCHEMA = """
CREATE TABLE selections (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, user_id TEXT NOT NULL, reranker_key TEXT NOT NULL,
    query TEXT NOT NULL, memory_ids TEXT NOT NULL, chosen TEXT NOT NULL, explore INTEGER NOT NULL,
    query_emb BLOB NOT NULL, scores BLOB NOT NULL, logp BLOB, noise BLOB, created_at REAL NOT NULL,
    expires_at REAL NOT NULL, consumed_at REAL
);
"""


def pending(selection_id: str, k: int = 4, d: int = 3, **overrides) -> PendingSelection:
    gen = torch.Generator().manual_seed(len(selection_id))
    now = time.time()
    base = PendingSelection(
        id=selection_id, tenant="alpha", user_id="alpha:ana", reranker_key="alpha", query="q",
        memory_ids=[f"m{i}" for i in range(k)], chosen=[2, 0], explore=True,
        query_embedding=torch.randn(d, generator=gen), scores=torch.randn(k, generator=gen),
        logp=torch.tensor([-0.5, -1.25]), noise=torch.randn(k, generator=gen), created_at=now, expires_at=now + 60,
        embeddings=torch.randn(k, d, generator=gen), tau=0.3, version=7, mask=torch.tensor([True, False, True, True]))
    return dataclasses.replace(base, **overrides)


def test_a_row_round_trips_everything_its_update_needs(tmp_path: Path) -> None:
    store = SelectionStore(tmp_path / "s.sqlite", ttl_s=60)
    original = pending("a")
    store.put_many([original, pending("bb", mask=None, tau=None, version=None)])
    store.close()
    again = SelectionStore(tmp_path / "s.sqlite", ttl_s=60)
    try:
        got = again.claim("alpha", "a", check=lambda p: {"cited": [1]})
        selection = rebuild(got)
        assert torch.equal(selection.candidates.embeddings, original.embeddings)
        assert torch.equal(selection.candidates.query_embedding, original.query_embedding)
        assert torch.equal(selection.logp, original.logp) and torch.equal(selection.mask, original.mask)
        assert selection.tau == pytest.approx(0.3) and selection.version == 7 and selection.chosen == [2, 0]
        assert again.feedback_of("alpha", "a") == {"cited": [1]}
        bare = rebuild(again.claim("alpha", "bb"))
        assert bare.mask is None and bare.tau is None and bare.version is None
    finally:
        again.close()


def test_a_selection_without_embeddings_is_refused_on_write(tmp_path: Path) -> None:
    store = SelectionStore(tmp_path / "s.sqlite", ttl_s=60)
    try:
        with pytest.raises(ValueError, match="no candidate embeddings"):
            store.put_many([pending("a", embeddings=None)])
        assert store.count_pending() == 0
    finally:
        store.close()


def _legacy_file(path: Path, rows: list[PendingSelection]) -> None:
    conn = sqlite3.connect(str(path))
    conn.executescript(_OLD_SCHEMA)
    for s in rows:
        conn.execute("INSERT INTO selections VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                     (s.id, s.tenant, s.user_id, s.reranker_key, s.query, json.dumps(s.memory_ids),
                      json.dumps(s.chosen), int(s.explore), s.query_embedding.numpy().tobytes(),
                      s.scores.numpy().tobytes(), s.logp.numpy().tobytes(), s.noise.numpy().tobytes(),
                      s.created_at, s.expires_at, None))
    conn.commit()
    conn.close()


def test_rows_written_before_embeddings_were_stored_are_upgraded_or_expired(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "s.sqlite"
    kept, gone = pending("kept"), pending("gone", memory_ids=["m0", "m1", "deleted", "m3"])
    _legacy_file(path, [kept, gone])
    vectors = {f"m{i}": torch.full((3,), float(i)) for i in range(4)}

    def embeddings_of(user_id: str, ids: list[str]) -> torch.Tensor:
        missing = [i for i in ids if i not in vectors]
        if missing:
            raise UnknownMemoryError(f"unknown memories {missing}")
        return torch.stack([vectors[i] for i in ids])

    store = SelectionStore(path, ttl_s=60)
    try:
        with caplog.at_level(logging.WARNING, logger="rmm.serve.pending"):
            assert store.upgrade_legacy(embeddings_of) == (1, 1)
        assert "2 pending selections written by an older rmm" in caplog.text and "1 expired" in caplog.text
        assert store.upgrade_legacy(embeddings_of) == (0, 0)  # once
        upgraded = rebuild(store.claim("alpha", "kept"))
        assert torch.equal(upgraded.candidates.embeddings, torch.stack([vectors[f"m{i}"] for i in range(4)]))
        assert upgraded.tau is None and upgraded.version is None  # unknown: the learner assumes its own
        assert torch.equal(upgraded.logp, kept.logp)
        with pytest.raises(SelectionExpiredError):
            store.claim("alpha", "gone")
    finally:
        store.close()
