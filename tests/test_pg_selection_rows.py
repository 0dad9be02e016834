"""One selection-row codec for both stores: every field round-trips, and the stored spellings stay.

`rmm.serve.pending.selection_row` / `selection_from_row` write and read a selection for the SQLite
store and, with JSONB and BOOLEAN, for the PostgreSQL one. Every field of `PendingSelection` is
checked generically, so a field added to the dataclass but not to the codec fails here. The
PostgreSQL half runs against the embedded server (skipped where `pgserver` cannot be imported).
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from pathlib import Path

import torch

from rmm.serve.pending import PendingSelection, SelectionStore

D = 6


def full_selection(sid: str) -> PendingSelection:
    """A selection with every optional field set (consumed_at is set by the claim)."""
    g = torch.Generator().manual_seed(7)
    now = time.time()
    return PendingSelection(
        id=sid, tenant="alpha", user_id="alpha:ana", reranker_key="alpha", query="where did Ana hike?",
        memory_ids=["m0", "m1", "m2", "m3"], chosen=[3, 0], explore=True, query_embedding=torch.randn(D, generator=g),
        scores=torch.randn(4, generator=g), logp=torch.tensor([-0.5, -1.25]), noise=torch.randn(4, generator=g),
        created_at=now, expires_at=now + 60.0, consumed_at=None, embeddings=torch.randn(4, D, generator=g),
        tau=0.25, version=7, mask=torch.tensor([True, False, True, True]), lexical=torch.tensor([1.0, 0.5, 0.0, 0.25]),
        features=torch.randn(4, 3, generator=g), feature_names=("fused", "bm25_rank", "length"))


def assert_same_selection(got: PendingSelection, want: PendingSelection, consumed_at: float) -> None:
    for field in dataclasses.fields(PendingSelection):
        mine, theirs = getattr(got, field.name), getattr(want, field.name)
        if field.name == "consumed_at":
            assert mine == consumed_at
        elif isinstance(theirs, torch.Tensor):
            assert isinstance(mine, torch.Tensor) and mine.dtype == theirs.dtype, field.name
            assert torch.equal(mine, theirs), field.name
        else:
            assert theirs is not None, f"set {field.name} in full_selection"
            assert mine == theirs and type(mine) is type(theirs), field.name


def test_every_field_round_trips_through_the_sqlite_store_in_its_stored_spelling(tmp_path: Path) -> None:
    path = tmp_path / "selections.sqlite"
    store = SelectionStore(path, ttl_s=60)
    original = full_selection("s1")
    store.put_many([original])
    got = store.claim("alpha", "s1", now=original.created_at + 1.0)
    store.close()
    assert_same_selection(got, original, consumed_at=original.created_at + 1.0)
    with sqlite3.connect(path) as conn:  # what existing files hold: JSON text, a 0/1 flag, float32 bytes
        row = conn.execute("SELECT memory_ids, chosen, explore, typeof(explore), length(embeddings), length(mask), "
                           "length(features), feature_names FROM selections").fetchone()
    assert row == (json.dumps(original.memory_ids), json.dumps(original.chosen), 1, "integer", 4 * D * 4, 4,
                   4 * 3 * 4, json.dumps(list(original.feature_names)))


def test_every_field_round_trips_through_the_postgresql_store_in_its_stored_spelling(pg_url: str) -> None:
    from rmm.memory.pg_database import PgDatabase
    from rmm.serve.pg_pending import PgSelectionStore, unapplied_feedback

    db = PgDatabase(pg_url, pool_max=2)
    try:
        with db.tx() as cur:
            cur.execute("TRUNCATE feedback, selections RESTART IDENTITY")
        store = PgSelectionStore(db, ttl_s=60)
        original = full_selection("p1")
        store.put_many([original])
        got = store.claim("alpha", "p1", lambda s: {"rewards": [1.0, -1.0]}, now=original.created_at + 1.0)
        assert_same_selection(got, original, consumed_at=original.created_at + 1.0)
        with db.tx() as cur:
            (applied,) = unapplied_feedback(cur)  # the learner's read of the same row
            row = cur.execute("SELECT memory_ids, chosen, pg_typeof(explore)::text, explore, length(embeddings), "
                              "length(features), feature_names FROM selections").fetchone()
        assert_same_selection(applied.selection, original, consumed_at=original.created_at + 1.0)
        assert row == (original.memory_ids, original.chosen, "boolean", True, 4 * D * 4,  # JSONB arrays, BOOLEAN
                       4 * 3 * 4, list(original.feature_names))
    finally:
        db.close()
