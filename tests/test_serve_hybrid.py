"""`rmm serve` with `retriever: hybrid`: candidates carry the lexical feature, the pending selection
stores it, and feedback after a restart learns exactly what an in-process learner learns from the
selection as sampled. Rows without the feature (dense, or written before the column) still rebuild."""

from __future__ import annotations

import copy
import sqlite3
import time
from pathlib import Path

import pytest
import torch
from test_serve_service import FACTS, _capture_records, make_service, one

from rmm.errors import ConfigError
from rmm.policy.learner import rewards_from_citations
from rmm.serve.feedback import rebuild
from rmm.serve.pending import PendingSelection, SelectionStore
from rmm.serve.records import NewMemory
from rmm.serve.service import RetrievalService
from rmm.types import Selection


def capture_selections(service: RetrievalService) -> list[Selection]:
    """The Selections the server samples (as the batch retriever hands them on), in order."""
    seen: list[Selection] = []
    select = service.retriever._select

    def spy(items, candidates):
        picked = select(items, candidates)
        seen.extend(selection for selection, _ in picked.values())
        return picked

    service.retriever._select = spy  # type: ignore[method-assign]
    return seen


def test_retriever_is_dense_by_default_and_checked(tmp_path: Path) -> None:
    service = make_service(tmp_path, start=False)
    try:
        assert service.config.retriever == "dense" and service.retriever.first_stage is service.bank
    finally:
        service.close()
    with pytest.raises(ConfigError, match="retriever must be one of 'dense', 'hybrid' or 'bm25'"):
        make_service(tmp_path / "bad", start=False, retriever="sparse")


def restart_then_learn(tmp_path: Path, retriever: str, query: str = "sourdough bread on Sundays") -> Selection:
    """Sample under `retriever`, restart the server, give feedback: the restarted learner's weights
    equal an in-process learner's fed the selection as sampled. Returns that selection."""
    settings = {"retriever": retriever, "learner": {"batch_size": 1}}
    service = make_service(tmp_path, **settings)
    service.add_memories("alpha", "ana", [NewMemory(text=t, id=f"f{i}") for i, t in enumerate(FACTS)])
    reference = copy.deepcopy(service.learner("alpha"))  # the learner before anything was sampled
    w0 = reference.reranker.lexical_weight.item()
    sampled = capture_selections(service)
    result = one(service, "ana", query, k=5, m=3, explore=True)
    (selection,) = sampled
    lexical = selection.candidates.lexical
    assert lexical is not None and lexical.shape == (5,) and float(lexical.max()) > 0
    service.close()
    service = make_service(tmp_path, **settings)
    seen = _capture_records(service)
    try:
        answer = service.feedback("alpha", result.selection_id, cited=[0])
        assert answer.learned and answer.updated
        (rebuilt,) = seen
        assert torch.equal(rebuilt.candidates.lexical, lexical)  # restored from the row, not recomputed
        reference.record(selection, rewards_from_citations(3, [0], False))
        learned = service.learner("alpha").reranker.state_dict()
        for name, value in reference.reranker.state_dict().items():
            assert torch.equal(value, learned[name]), name
        assert learned["lexical_weight"].item() != w0  # w was learned from the stored feature
    finally:
        service.close()
    return selection


def test_hybrid_feedback_after_a_restart_learns_bit_equal_to_an_in_process_learner(tmp_path: Path) -> None:
    restart_then_learn(tmp_path, "hybrid")


def test_bm25_feedback_after_a_restart_learns_bit_equal_to_an_in_process_learner(tmp_path: Path) -> None:
    # every fact names Ana, so BM25 returns all of them (it returns only memories sharing a term)
    selection = restart_then_learn(tmp_path, "bm25", "Ana sourdough bread on Sundays")
    lexical = selection.candidates.lexical
    assert lexical is not None
    # BM25's ranking alone: candidates in BM25's order, so its scaled score never rises down the list
    assert float(lexical[0]) == 1.0 and bool((lexical[:-1] >= lexical[1:]).all()), lexical
    assert selection.candidates.memory_ids[0].endswith("f1")  # the sourdough memory, BM25's best for the query


def test_a_memory_written_after_the_first_retrieve_is_found_by_bm25(tmp_path: Path) -> None:
    service = make_service(tmp_path, retriever="hybrid")
    try:
        service.add_memories("alpha", "ana", [NewMemory(text=t, id=f"f{i}") for i, t in enumerate(FACTS)])
        one(service, "ana", "which instrument, a theremin?", k=5, m=3)  # BM25 index built here
        service.add_memories("alpha", "ana", [NewMemory(text="Ana is learning the theremin", id="new")])
        sampled = capture_selections(service)
        result = one(service, "ana", "which instrument, a theremin?", k=5, m=3)
        (selection,) = sampled
        assert selection.candidates.memory_ids[0] == "new" and float(selection.candidates.lexical[0]) == 1.0
        assert result.memories[0].id == "new"
    finally:
        service.close()


def test_dense_selections_store_no_lexical_feature(tmp_path: Path) -> None:
    service = make_service(tmp_path, learner={"batch_size": 1})
    try:
        service.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
        result = one(service, "ana", "cello orchestra", k=5, m=3, explore=True)
        seen = _capture_records(service)
        assert service.feedback("alpha", result.selection_id, cited=[0]).updated
        assert seen[0].candidates.lexical is None
    finally:
        service.close()


def pending(sid: str, lexical: torch.Tensor | None) -> PendingSelection:
    g = torch.Generator().manual_seed(0)
    now = time.time()
    return PendingSelection(
        id=sid, tenant="alpha", user_id="alpha:ana", reranker_key="alpha", query="q", memory_ids=["a", "b", "c"],
        chosen=[1, 0], explore=True, query_embedding=torch.randn(4, generator=g), scores=torch.randn(3, generator=g),
        logp=torch.tensor([-0.5, -0.7]), noise=None, created_at=now, expires_at=now + 60,
        embeddings=torch.randn(3, 4, generator=g), tau=0.05, version=0, lexical=lexical)


def test_sqlite_rows_keep_the_feature_and_rows_from_before_the_column_rebuild_without_it(tmp_path: Path) -> None:
    path = tmp_path / "selections.sqlite"
    store = SelectionStore(path, ttl_s=60)
    feature = torch.tensor([1.0, 0.25, 0.5])
    store.put_many([pending("hybrid", feature), pending("old", None)])
    store.close()
    with sqlite3.connect(path) as conn:  # a file written by an rmm from before the column
        conn.execute("ALTER TABLE selections DROP COLUMN lexical")
    store = SelectionStore(path, ttl_s=60)  # adds the column back: NULL in every old row
    try:
        old = rebuild(store.claim("alpha", "old"))
        assert old.candidates.lexical is None and old.chosen == [1, 0]
    finally:
        store.close()
    store = SelectionStore(path, ttl_s=60)
    store.put_many([pending("new", feature)])
    try:
        assert torch.equal(rebuild(store.claim("alpha", "new")).candidates.lexical, feature)
    finally:
        store.close()
