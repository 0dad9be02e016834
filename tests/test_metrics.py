"""Retrieval metrics against hand-computed values and LongMemEval's own nDCG definition."""

from __future__ import annotations

import math
import random

import pytest

from rmm.eval.metrics import (
    METRICS,
    aggregate,
    ndcg_at_k,
    recall_all_at_k,
    recall_any_at_k,
    recall_at_k,
    score_question,
)

RANKED = [{"a"}, {"x"}, {"b"}, {"a"}]
GOLD = {"a", "b", "c"}


@pytest.mark.parametrize(("k", "expected"), [(1, 1 / 3), (2, 1 / 3), (3, 2 / 3), (4, 2 / 3), (50, 2 / 3)])
def test_fractional_recall(k: int, expected: float) -> None:
    assert recall_at_k(RANKED, GOLD, k) == pytest.approx(expected)


def test_any_versus_all() -> None:
    assert recall_any_at_k(RANKED, GOLD, 1) == 1.0
    assert recall_any_at_k(RANKED, GOLD, 10) == 1.0
    assert recall_any_at_k([{"x"}, {"a"}], GOLD, 1) == 0.0
    assert recall_all_at_k(RANKED, GOLD, 10) == 0.0  # "c" is never retrieved
    assert recall_all_at_k(RANKED, {"a", "b"}, 2) == 0.0
    assert recall_all_at_k(RANKED, {"a", "b"}, 3) == 1.0


def test_duplicates_count_once_and_multi_unit_memories() -> None:
    assert recall_at_k([{"a"}, {"a"}, {"a"}], {"a", "b"}, 3) == 0.5
    assert recall_at_k([{"a", "b", "z"}], GOLD, 1) == pytest.approx(2 / 3)
    assert recall_all_at_k([{"a", "b", "c"}], GOLD, 1) == 1.0


def test_gold_given_as_list_with_repeats_is_a_set() -> None:
    assert recall_at_k([{"a"}], ["a", "a", "b"], 1) == 0.5


def test_k_larger_than_list_and_empty_ranking() -> None:
    assert recall_at_k([{"b"}], GOLD, 100) == pytest.approx(1 / 3)
    assert recall_at_k([], GOLD, 5) == 0.0
    assert recall_any_at_k([], GOLD, 5) == 0.0
    assert ndcg_at_k([], GOLD, 5) == 0.0


@pytest.mark.parametrize("fn", [recall_at_k, recall_any_at_k, recall_all_at_k, ndcg_at_k])
def test_empty_gold_and_bad_k_raise(fn) -> None:
    with pytest.raises(ValueError, match="gold is empty"):
        fn([{"a"}], [], 5)
    with pytest.raises(ValueError, match="k must be"):
        fn([{"a"}], {"a"}, 0)


def test_ndcg_hand_computed() -> None:
    ranked = [{"x"}, {"a"}, {"y"}, {"b"}]
    # LongMemEval discount: rank 1 -> 1, rank i >= 2 -> 1/log2(i).
    # DCG = 1/log2(2) + 1/log2(4) = 1.5 ; ideal (2 relevant) = 1 + 1/log2(2) = 2.
    assert ndcg_at_k(ranked, {"a", "b"}, 4) == pytest.approx(0.75)
    # Cut at k=2: DCG = 1 ; ideal = 2.
    assert ndcg_at_k(ranked, {"a", "b"}, 2) == pytest.approx(0.5)
    # Standard discount 1/log2(i+1): (1/log2 3 + 1/log2 5) / (1 + 1/log2 3).
    standard = (1 / math.log2(3) + 1 / math.log2(5)) / (1 + 1 / math.log2(3))
    assert ndcg_at_k(ranked, {"a", "b"}, 4, discount="standard") == pytest.approx(standard)
    assert ndcg_at_k([{"a"}, {"b"}], {"a", "b"}, 10) == pytest.approx(1.0)


def test_ndcg_ideal_from_n_relevant() -> None:
    # One relevant item found at rank 1, three relevant in the bank: 1 / (1 + 1 + 1/log2 3).
    expected = 1 / (2 + 1 / math.log2(3))
    assert ndcg_at_k([{"a"}], {"a"}, 5, n_relevant=3) == pytest.approx(expected)
    # The ideal is cut at k as well: at k=1 the ideal is a single relevant item.
    assert ndcg_at_k([{"a"}], {"a"}, 1, n_relevant=3) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        ndcg_at_k([{"a"}], {"a"}, 5, n_relevant=0)


def test_ndcg_duplicates() -> None:
    ranked = [{"a"}, {"a"}]
    assert ndcg_at_k(ranked, {"a", "b"}, 2) == pytest.approx(0.5)  # second copy earns nothing
    assert ndcg_at_k(ranked, {"a", "b"}, 2, unique_coverage=False) == pytest.approx(1.0)
    # Without unique coverage the score is clipped, never above 1.
    assert ndcg_at_k([{"a"}, {"a"}, {"a"}], {"a"}, 3, unique_coverage=False) == 1.0


def _official_ndcg(rankings: list[int], correct: set[str], corpus_ids: list[str], k: int) -> float:
    """LongMemEval's `eval_utils.ndcg`, re-expressed: relevance over the whole corpus."""

    def dcg(rel: list[int]) -> float:
        rel = rel[:k]
        return sum(r if i == 0 else r / math.log2(i + 1) for i, r in enumerate(rel))

    relevances = [1 if doc in correct else 0 for doc in corpus_ids]
    ideal = dcg(sorted(relevances, reverse=True))
    actual = dcg([relevances[i] for i in rankings[:k]])
    return 0.0 if ideal == 0 else actual / ideal


def test_ndcg_matches_longmemeval_on_random_rankings() -> None:
    rng = random.Random(0)
    for _ in range(200):
        corpus = [f"d{i}" for i in range(rng.randint(3, 30))]
        gold = set(rng.sample(corpus, rng.randint(1, min(5, len(corpus)))))
        rankings = list(range(len(corpus)))
        rng.shuffle(rankings)
        k = rng.choice([1, 3, 5, 10, 50])
        ranked = [{corpus[i]} for i in rankings]
        assert ndcg_at_k(ranked, gold, k) == pytest.approx(
            _official_ndcg(rankings, gold, corpus, k)
        )


def test_metrics_registry_and_score_question() -> None:
    assert set(METRICS) == {"recall", "recall_any", "recall_all", "ndcg"}
    row = score_question(RANKED, GOLD, ks=(1, 3))
    assert set(row) == {f"{m}@{k}" for m in METRICS for k in (1, 3)}
    assert row["recall@3"] == pytest.approx(2 / 3)
    assert row["recall_any@1"] == 1.0
    assert row["recall_all@3"] == 0.0


def test_aggregate_means() -> None:
    rows = [{"r@5": 1.0, "n@5": 0.5}, {"r@5": 0.0}, {"r@5": 0.5, "n@5": 0.25}]
    assert aggregate(rows) == pytest.approx({"r@5": 0.5, "n@5": 0.375})
    assert aggregate([]) == {}
