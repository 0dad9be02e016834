"""rmm/bench/reranker_features.py: the per-candidate features the supervised ceiling study compares."""

from __future__ import annotations

import math

import pytest

from rmm.bench.reranker_features import (
    FEATURE_GROUPS,
    TurnPlace,
    candidate_features,
    content_words,
    coverage,
    feature_names,
    jaccard,
    min_max_scores,
    rank_features,
    rrf_feature,
    scaled_scores,
    speaker_share,
)


def test_content_words_drop_question_scaffolding_and_stopwords() -> None:
    assert content_words("What do you know about: I love hiking in the Alps?") == {"love", "hiking", "alps"}


def test_overlap_measures() -> None:
    q, m = {"hiking", "alps", "love"}, {"hiking", "dog"}
    assert jaccard(q, m) == pytest.approx(1 / 4)
    assert coverage(q, m) == pytest.approx(1 / 3)
    assert jaccard(set(), set()) == 0.0 and coverage(set(), m) == 0.0


def test_rank_features_put_absent_ids_at_the_lists_depth() -> None:
    rr, log_rank = rank_features(["b", "z", "a"], ["a", "b", "c"], depth=3)
    assert rr == pytest.approx([1 / 2, 1 / 4, 1.0])
    assert log_rank == pytest.approx([math.log(2) / math.log(4), 1.0, 0.0])
    with pytest.raises(ValueError):
        rank_features(["a"], ["a"], depth=0)


def test_scaled_scores_divide_by_the_best_and_zero_the_absent() -> None:
    assert scaled_scores(["b", "x", "a"], ["a", "b"], [4.0, 1.0]) == pytest.approx([0.25, 0.0, 1.0])
    assert scaled_scores(["a"], [], []) == [0.0]
    with pytest.raises(ValueError):
        scaled_scores(["a"], ["a"], [])


def test_speaker_share_counts_the_head_of_the_list() -> None:
    assert speaker_share(["A", "A", "B", "B", "B"], top=3) == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3])


def test_candidate_features_cover_every_group_in_candidate_order() -> None:
    places = [TurnPlace(0, 4, 0, 10, "Speaker 1"), TurnPlace(3, 4, 9, 10, "Speaker 2")]
    feats = candidate_features(
        "What do you know about: I love hiking?", ["m1", "m2"], ["I love hiking a lot", "my dog barks"],
        places, fused=[1.0, 0.5], cosines=[0.9, 0.4], dense=(["m2", "m1"], [0.9, 0.4]),
        bm25=(["m1"], [3.0]), depth=50, majority_speaker="Speaker 2")
    assert set(feats) == set(feature_names(["all"]))
    assert feats["bm25_minmax"] == pytest.approx([1.0, 0.0])
    assert feats["dense_rr"] == pytest.approx([0.5, 1.0])
    assert feats["bm25_rr"] == pytest.approx([1.0, 1 / 51])
    assert feats["bm25_scaled"] == pytest.approx([1.0, 0.0])
    assert feats["cosine_gap"] == pytest.approx([0.0, -0.5])
    assert feats["session_position"] == pytest.approx([0.0, 1.0])
    assert feats["turn_position"] == pytest.approx([0.0, 1.0])
    assert feats["speaker_major"] == [0.0, 1.0]
    assert feats["jaccard"] == pytest.approx([2 / 3, 0.0])  # {love, hiking} vs {love, hiking, lot}
    assert feats["query_coverage"] == pytest.approx([1.0, 0.0])
    assert feats["log_tokens"] == pytest.approx([math.log1p(5), math.log1p(3)])
    with pytest.raises(ValueError):
        candidate_features("q", ["m1"], [], [], [], [], ([], []), ([], []), 50, "A")


def test_feature_names_expand_groups_once_and_refuse_unknown_ones() -> None:
    assert feature_names(["fused", "bm25", "fused"]) == ["fused", "bm25_scaled", "bm25_minmax"]
    assert feature_names(["all"]) == [n for g in FEATURE_GROUPS.values() for n in g]
    with pytest.raises(ValueError, match="unknown feature group"):
        feature_names(["colour"])


def test_min_max_and_rrf_features() -> None:
    assert min_max_scores(["b", "x", "a", "c"], ["a", "b", "c"], [4.0, 2.0, 1.0]) == pytest.approx([1 / 3, 0.0, 1.0, 0.0])
    assert min_max_scores(["a"], ["a"], [2.0]) == [1.0]
    # first in both lists = 1; second in one list only = (1/12) / (2/11)
    assert rrf_feature(["a", "b", "z"], [["a", "b"], ["a"]], rrf_k=10) == pytest.approx([1.0, 11 / 24, 0.0])
