"""rmm.bench.compass: its search loop scores what `rmm eval-controller` scores, the reranker it trains
learns from the search's sampled slates, the graph walk is timed, and the split is rmm train's."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from test_bm25_over_dense import fake_minilm  # noqa: F401 - every encoder name loads a bag of words, private cache

from rmm.bench.compass import by_category, run_search, scorable, subset, train_reranker
from rmm.data.locomo import load_locomo
from rmm.eval.benchmark_bank import open_retriever
from rmm.eval.controller_recall import evaluate_controller_recall
from rmm.frontends.compass import CompassConfig
from rmm.llm.simulated import SimulatedLLM
from rmm.policy.recipes import LearnerConfig
from rmm.training.splits import split_users_in_order
from rmm.types import Dataset


@pytest.fixture
def events(tiny_data_dir, fake_minilm):  # noqa: F811
    dataset = load_locomo(tiny_data_dir / "locomo" / "locomo10.json")
    opened = open_retriever("hybrid", dataset, "event", device="cpu", progress=False,
                            candidate_features=LearnerConfig.candidate_features)
    return dataset, opened.retriever


@pytest.mark.parametrize("policy", ["heuristic", "oracle"])
def test_search_rows_are_eval_controllers(events, policy: str) -> None:
    dataset, retriever = events
    config = CompassConfig(policy=policy, threshold=0.0, answer=False)
    run = run_search(policy, dataset, retriever, config)
    report = evaluate_controller_recall(dataset, retriever, SimulatedLLM(), category=None, config=config,
                                        progress=False)
    reference = {row["id"]: row for row in report.rows}
    assert run.rows and len(run.rows) == len(scorable(dataset)) and len(run.walk_ms) == len(run.rows)
    for row in run.rows:
        ref = reference[row["id"]]
        assert row["n_memories"] == ref["n_memories"]
        for t in (15, 25):
            assert row[f"recall_turns@{t}_search"] == ref[f"recall_turns@{t}_compass"]
            assert row[f"recall_turns@{t}_direct"] == ref[f"recall_turns@{t}_direct"]
    assert all(ms >= 0 for ms in run.walk_ms) and any(r["steps"] for r in run.rows)
    assert {r["category"] for r in run.rows} <= {1, 2, 3, 4}  # category 5 is reported apart
    assert run.table4["questions"] == len(run.rows) and run.table4["steps"] == sum(r["steps"] for r in run.rows) / len(
        run.rows)


def test_trained_reranker_learns_from_the_searchs_sampled_slates(events) -> None:
    dataset, retriever = events
    # a slate of 5 (the tiny graph's pools hold fewer than the heuristic's default 20: nothing would be sampled)
    config = CompassConfig(policy="heuristic", threshold=0.0, start_k=5)
    before = run_search("untrained", dataset, retriever, replace(config, answer=False))
    learner, stats = train_reranker(dataset, retriever, config)
    assert stats["questions"] == len(scorable(dataset)) and stats["records"] > 0 and learner.stats.step > 0
    after = run_search("learned", dataset, retriever, replace(config, answer=False), learner=learner)
    assert [r["id"] for r in after.rows] == [r["id"] for r in before.rows]
    assert learner.stats.records == stats["records"]  # reading with the trained reranker learns nothing more


def test_split_is_rmm_trains_and_categories_average_per_question() -> None:
    users = [f"conv-{n}" for n in (26, 30, 41, 42, 43, 44, 47, 48, 49, 50)]
    dataset = Dataset("locomo", {u: [] for u in users}, [])
    train, held = split_users_in_order(dataset.users, 0.3, 0)
    assert held == ["conv-30", "conv-48", "conv-49"] and set(train) == set(users) - set(held)
    assert subset(dataset, held).users == held
    rows = [{"category": 1, "x": 1.0}, {"category": 1, "x": 0.0}, {"category": 2, "x": 1.0}]
    means = by_category(rows, "x")
    assert means["1"] == 50.0 and means["2"] == 100.0 and math.isclose(means["all"], 200 / 3)
