"""Per-candidate features over a PostgreSQL bank (migration 0004): a selection row keeps the [K, F]
matrix and its names as sampled, rows from before the columns rebuild without features, a row
whose blob does not match K × F is refused for that selection alone — at the claim (nothing
changes) and, should it be corrupted after its claim, in the learner's queue (set aside, the rest
still read) — and feedback sent after the sampling replica died trains the feature weights
exactly as an in-process learner does from the selection as sampled."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("psycopg", reason="PostgreSQL banks need psycopg (postgres extra)")

from test_pg_serve_state import (  # noqa: F401
    FACTS,
    _row,
    db,
    make_replica,
    pending,
    retrieve,
    url,
    wait_for,
)
from test_pg_store import drop_schema, fresh_schema
from test_serve_hybrid import capture_selections

from rmm.memory.features import CANDIDATE_FEATURES
from rmm.memory.pg_database import PgDatabase
from rmm.policy.learner import rewards_from_citations
from rmm.serve.errors import CorruptSelectionError
from rmm.serve.feedback import rebuild
from rmm.serve.pg_pending import _FORMAT, PgSelectionStore, unapplied_feedback
from rmm.serve.records import NewMemory
from rmm.serve.selection_rows import SELECTION_COLUMNS, selection_row

NAMES = ("fused", "dense_rank", "length", "coverage")


def featured(sid: str, seed: int = 0):
    selection = pending(sid, seed=seed)  # K = 4 candidates
    selection.features = torch.randn(4, len(NAMES), generator=torch.Generator().manual_seed(seed))
    selection.feature_names = NAMES
    return selection


def test_rows_keep_features_and_names_and_rows_without_them_rebuild_without(db: PgDatabase) -> None:  # noqa: F811
    with db.tx() as cur:
        types = dict(cur.execute("SELECT column_name, data_type FROM information_schema.columns "
                                 "WHERE table_schema = current_schema() AND table_name = 'selections' "
                                 "AND column_name IN ('features', 'feature_names')").fetchall())
    assert types == {"features": "bytea", "feature_names": "jsonb"}
    store = PgSelectionStore(db, ttl_s=60)
    hybrid, old = featured("h1"), pending("o1", seed=1)
    store.put_many([hybrid, old])
    with db.tx() as cur:  # a dense selection, or one written before migration 0004: NULL in both
        assert cur.execute("SELECT features IS NULL, feature_names IS NULL FROM selections WHERE id = 'o1'"
                           ).fetchone() == (True, True)
        assert cur.execute("SELECT feature_names FROM selections WHERE id = 'h1'").fetchone() == (list(NAMES),)
    got = rebuild(store.claim("alpha", "h1", lambda s: {"rewards": [1.0, -1.0]}))
    assert torch.equal(got.candidates.features, hybrid.features) and got.candidates.feature_names == NAMES
    bare = rebuild(store.claim("alpha", "o1", lambda s: {"rewards": [1.0, -1.0]}))
    assert bare.candidates.features is None and bare.candidates.feature_names == ()
    with db.tx() as cur:  # the learner reads the same matrix back
        assert [torch.equal(r.selection.features, hybrid.features) for r in unapplied_feedback(cur)
                if r.selection.id == "h1"] == [True]


def test_a_corrupt_blob_refuses_that_selection_alone_and_changes_nothing(db: PgDatabase) -> None:  # noqa: F811
    store = PgSelectionStore(db, ttl_s=60)
    store.put_many([featured("bad"), featured("good", seed=2)])
    with db.tx() as cur:  # one float too many for K × F
        cur.execute("UPDATE selections SET features = features || '\\x00000000'::bytea WHERE id = 'bad'")
    for _ in range(2):
        with pytest.raises(CorruptSelectionError, match=r"'bad' is stored corrupt: its candidate features hold "
                                                        r"17 floats, not 4 × 4"):
            store.claim("alpha", "bad", lambda s: {"rewards": [1.0, -1.0]})
    with db.tx() as cur:  # not marked rewarded, no feedback appended
        assert cur.execute("SELECT consumed_at FROM selections WHERE id = 'bad'").fetchone() == (None,)
        assert cur.execute("SELECT count(*) FROM feedback").fetchone() == (0,)
    good = rebuild(store.claim("alpha", "good", lambda s: {"rewards": [1.0, -1.0]}))
    assert torch.equal(good.candidates.features, featured("good", seed=2).features)
    assert store.count_pending() == 1


def test_a_row_corrupted_after_its_claim_is_set_aside_and_the_rest_still_reach_the_learner(
        db: PgDatabase) -> None:  # noqa: F811
    store = PgSelectionStore(db, ttl_s=60)
    store.put_many([featured("first"), featured("second", seed=1), featured("third", seed=2)])
    for sid in ("first", "second", "third"):
        store.claim("alpha", sid, lambda s: {"rewards": [1.0, -1.0]})
    with db.tx() as cur:
        cur.execute("UPDATE selections SET feature_names = '[\"fused\"]'::jsonb WHERE id = 'second'")  # F now 1
    with db.tx() as cur:
        rows = unapplied_feedback(cur)
    assert [r.selection.id for r in rows] == ["first", "third"]
    with db.tx() as cur:
        assert cur.execute("SELECT learn FROM feedback WHERE selection_id = 'second'").fetchone() == (False,)
        assert [r.selection.id for r in unapplied_feedback(cur)] == ["first", "third"]  # for good


def test_a_schema_from_before_migration_0004_gains_the_columns_and_its_rows_read_without_features(
        pg_server_url: str) -> None:
    schema_url = fresh_schema(pg_server_url)
    old_columns = SELECTION_COLUMNS[:SELECTION_COLUMNS.index("features")]  # what rmm wrote up to migration 0003
    try:
        database = PgDatabase(schema_url, pool_max=1)
        with database.tx() as cur:  # back to the schema as migration 0003 left it, with a row of its time
            cur.execute("ALTER TABLE selections DROP COLUMN features, DROP COLUMN feature_names")
            cur.execute("DELETE FROM _yoyo_migration WHERE migration_id = '0004.features'")
            cur.execute(f"INSERT INTO selections ({', '.join(old_columns)}) "
                        f"VALUES ({', '.join(['%s'] * len(old_columns))})",
                        selection_row(pending("old"), _FORMAT)[:len(old_columns)])
        database.close()
        database = PgDatabase(schema_url, pool_max=1)  # an rmm with migration 0004 opens it
        try:
            store = PgSelectionStore(database, ttl_s=60)
            old = rebuild(store.claim("alpha", "old", lambda s: {"rewards": [1.0, -1.0]}))
            assert old.candidates.features is None and old.candidates.feature_names == () and old.chosen == [2, 0]
            store.put_many([featured("new")])
            new = rebuild(store.claim("alpha", "new", lambda s: {"rewards": [1.0, -1.0]}))
            assert torch.equal(new.candidates.features, featured("new").features)
        finally:
            database.close()
    finally:
        drop_schema(pg_server_url, schema_url)


def test_hybrid_feedback_after_the_sampler_died_trains_the_feature_weights_bit_equal(
        tmp_path: Path, url: str) -> None:  # noqa: F811
    settings = {"retriever": "hybrid", "learner": {"batch_size": 1}}
    a = make_replica(tmp_path, url, "a", **settings)
    try:
        wait_for(lambda: a.shared_learning.is_learner)
        a.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
        reference = copy.deepcopy(a.learner("alpha"))
        sampled = capture_selections(a)
        result = retrieve(a, "sourdough bread on Sundays")
        (selection,) = sampled
        assert selection.candidates.feature_names == CANDIDATE_FEATURES
        with a.db.tx() as cur:
            stored = _row(cur, result.selection_id)
        assert torch.equal(stored.features, selection.candidates.features)
        assert stored.feature_names == CANDIDATE_FEATURES
    finally:
        a.close()
    b = make_replica(tmp_path, url, "b", **settings)
    try:
        wait_for(lambda: b.shared_learning.is_learner)
        assert b.feedback("alpha", result.selection_id, cited=[1]).learned
        wait_for(lambda: b.learner("alpha").stats.step == 1)
        reference.record(selection, rewards_from_citations(2, [1], False))
        learned = b.learner("alpha").reranker.state_dict()
        for name, value in reference.reranker.state_dict().items():
            assert torch.equal(value, learned[name]), (name, float((value - learned[name]).abs().max()))
        assert learned["feature_weight"].abs().sum() > 0
    finally:
        b.close()
