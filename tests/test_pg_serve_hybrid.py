"""`retriever: hybrid` over a PostgreSQL bank: the selection row keeps the lexical feature
(migration 0003), a row from before the column rebuilds without it, and feedback sent after the
sampling replica died is learned by the next learner exactly as an in-process learner learns it."""

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
from test_serve_hybrid import capture_selections

from rmm.memory.pg_database import PgDatabase
from rmm.policy.learner import rewards_from_citations
from rmm.serve.feedback import rebuild
from rmm.serve.pg_pending import PgSelectionStore
from rmm.serve.records import NewMemory


def test_rows_keep_the_feature_and_rows_without_it_rebuild_without(db: PgDatabase) -> None:  # noqa: F811
    store = PgSelectionStore(db, ttl_s=60)
    hybrid, old = pending("h1"), pending("o1", seed=1)
    hybrid.lexical = torch.tensor([1.0, 0.5, 0.0, 0.25])
    store.put_many([hybrid, old])
    with db.tx() as cur:
        assert cur.execute("SELECT lexical IS NULL FROM selections WHERE id = 'o1'").fetchone() == (True,)
    got = rebuild(store.claim("alpha", "h1", lambda s: {"rewards": [1.0, -1.0]}))
    assert torch.equal(got.candidates.lexical, hybrid.lexical)
    assert rebuild(store.claim("alpha", "o1", lambda s: {"rewards": [1.0, -1.0]})).candidates.lexical is None


def test_hybrid_feedback_after_the_sampler_died_is_learned_bit_equal(tmp_path: Path, url: str) -> None:  # noqa: F811
    settings = {"retriever": "hybrid", "learner": {"batch_size": 1}}
    a = make_replica(tmp_path, url, "a", **settings)
    try:
        wait_for(lambda: a.shared_learning.is_learner)
        a.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
        reference = copy.deepcopy(a.learner("alpha"))
        sampled = capture_selections(a)
        result = retrieve(a, "sourdough bread on Sundays")
        (selection,) = sampled
        assert selection.candidates.lexical is not None
        with a.db.tx() as cur:
            assert torch.equal(_row(cur, result.selection_id).lexical, selection.candidates.lexical)
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
    finally:
        b.close()
