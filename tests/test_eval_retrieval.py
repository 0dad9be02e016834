"""The Recall@K runner: gold mapping per granularity, skipping, per-category summaries."""

from __future__ import annotations

import pytest
import torch

from rmm.data.locomo import load_locomo
from rmm.eval.retrieval import GoldScorer, evaluate, scorable
from rmm.memory.store import MemoryStore
from rmm.types import Candidates, Memory


class ScriptedRetriever:
    """Returns, for each question text, a fixed ranking of memory ids."""

    def __init__(self, store: MemoryStore, rankings: dict[str, list[str]]) -> None:
        self.store, self.rankings = store, rankings

    def search(self, queries: list[str], user: str, k: int) -> list[Candidates]:
        out = []
        for q in queries:
            ids = self.rankings.get(q, [])[:k]
            out.append(Candidates(query=q, memory_ids=ids, retriever_scores=torch.zeros(len(ids)), user_id=user))
        return out


@pytest.fixture
def tiny(tiny_data_dir):
    dataset = load_locomo(tiny_data_dir / "locomo" / "locomo10.json")
    store = MemoryStore(":memory:")
    for user in dataset.users:
        store.add([Memory(id=t.id, user_id=user, kind="turn", text=t.text, refs=[t.id]) for t in dataset.turns(user)])
    return dataset, store


def test_gold_at_session_granularity_maps_turn_refs_to_sessions(tiny):
    dataset, _ = tiny
    scorer = GoldScorer.for_dataset(dataset, "session")
    q = dataset.questions[0]
    assert scorer.gold(q) == set(q.evidence_sessions)
    turn = q.evidence_turns[0]
    assert scorer.units([turn]) == set(q.evidence_sessions)
    assert GoldScorer.for_dataset(dataset, "turn").units([turn]) == {turn}


def test_perfect_and_empty_rankings_score_one_and_zero(tiny):
    dataset, store = tiny
    report = evaluate(dataset, _PerUser(store, dataset), "turn", (1, 5), progress=False)  # ranks gold first
    assert report.overall["recall@1"] == pytest.approx(1.0)
    assert report.overall["recall_any@5"] == pytest.approx(1.0)
    empty = evaluate(dataset, ScriptedRetriever(store, {}), "turn", (5,), progress=False)
    assert empty.overall["recall@5"] == 0.0


class _PerUser(ScriptedRetriever):
    def __init__(self, store, dataset) -> None:
        super().__init__(store, {})
        self.gold = {(q.user_id, q.text): q.evidence_turns for q in dataset.questions}

    def search(self, queries, user, k):
        return [Candidates(query=q, memory_ids=self.gold[(user, q)][:k], retriever_scores=torch.zeros(1),
                           user_id=user) for q in queries]


def test_adversarial_category_is_reported_beside_the_headline(tiny):
    dataset, store = tiny
    report = evaluate(dataset, _PerUser(store, dataset), "turn", (5,), progress=False)
    assert set(report.separate) == {"5"}
    assert report.by_category["5"]["name"] == "adversarial"
    headline_n = sum(r["n"] for c, r in report.by_category.items() if c != "5")
    assert report.overall["n"] == headline_n


def test_questions_without_gold_are_skipped(tiny):
    dataset, store = tiny
    dataset.questions[0].evidence_turns.clear()
    dataset.questions[0].evidence_sessions.clear()
    scorer = GoldScorer.for_dataset(dataset, "turn")
    assert dataset.questions[0] not in scorable(dataset.questions, scorer)
    report = evaluate(dataset, _PerUser(store, dataset), "turn", (5,), progress=False)
    assert report.skipped == 1


def test_headroom_captured() -> None:
    from rmm.cli.tables import headroom_cell
    from rmm.eval.retrieval import headroom_captured

    # base R@5 0.30, base R@20 0.46 (ceiling): 0.16 of headroom; reranked R@5 0.34 took a quarter of it.
    assert headroom_captured(0.34, 0.30, 0.46) == pytest.approx(0.25)
    assert headroom_captured(0.46, 0.30, 0.46) == pytest.approx(1.0)
    assert headroom_captured(0.26, 0.30, 0.46) == pytest.approx(-0.25)  # the reranker lost ground
    assert headroom_captured(0.40, 0.40, 0.40) is None  # no headroom: nothing to capture, no division by zero
    with pytest.raises(ValueError, match="recall@K"):
        headroom_captured(0.3, 0.5, 0.4)
    assert headroom_cell(0.25) == "25%" and headroom_cell(None) == "n/a (no headroom)"
