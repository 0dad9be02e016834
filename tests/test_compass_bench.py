"""rmm.bench.compass: its search loop scores what `rmm eval-controller` scores, the reranker it trains
learns from the search's sampled slates, the graph walk is timed, and the split is rmm train's."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from test_bm25_over_dense import fake_minilm  # noqa: F401 - every encoder name loads a bag of words, private cache

from rmm.bench.compass import by_category, gold_linkage, paired_gain, run_search, scorable, subset, train_reranker
from rmm.data.locomo import load_locomo
from rmm.eval.benchmark_bank import open_retriever
from rmm.eval.controller_recall import evaluate_controller_recall
from rmm.frontends.compass import CompassConfig
from rmm.llm.simulated import SimulatedLLM
from rmm.memory.graph import Edge
from rmm.memory.store import MemoryStore
from rmm.policy.recipes import LearnerConfig
from rmm.training.splits import split_users_in_order
from rmm.types import Dataset, Memory, Question


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


def test_paired_gain_is_the_mean_difference_with_its_paired_standard_error() -> None:
    rows = [{"category": 1, "r_search": 1.0, "r_direct": 0.5}, {"category": 1, "r_search": 0.5, "r_direct": 0.5},
            {"category": 2, "r_search": 0.0, "r_direct": 1.0}]
    gains = paired_gain(rows, "r")
    assert gains["1"]["mean"] == 25.0 and gains["1"]["n"] == 2
    assert math.isclose(gains["1"]["se"], 25.0)  # differences 50 and 0: sample sd 25·√2, over √2 questions
    assert gains["all"]["mean"] == -50 / 3 and gains["all"]["n"] == 3
    assert math.isnan(gains["2"]["se"])  # one question: no spread to estimate


def test_gold_linkage_counts_gold_events_and_their_edges_to_each_other(tmp_path) -> None:
    def ev(memory_id: str, refs: list[str]) -> Memory:
        return Memory(id=memory_id, user_id="u", kind="event", text=memory_id, refs=refs,
                      time_span=("2024-01-01", None))

    store = MemoryStore(tmp_path / "bank.sqlite")
    # gold of q1: a (t1), b (t2), c (t3); a - b linked (b -> a, read both ways), c only to d (not gold)
    store.add_events("u", [ev("a", ["t1"]), ev("b", ["t2", "t9"]), ev("c", ["t3"]), ev("d", ["t4"])],
                     [Edge("b", "a", "next"), Edge("c", "d", "similar")], embeddings=torch.eye(4))
    questions = [Question("q1", "u", "?", "", ["t1", "t2", "t3"], [], category=1),
                 Question("q2", "u", "?", "", ["t4"], [], category=4),
                 Question("q3", "v", "?", "", ["t1"], [], category=4)]  # a user with no memories: no gold events
    found = gold_linkage(Dataset("x", {"u": [], "v": []}, questions), store)
    assert found["1"] == {"gold_events": 3, "spread": 100.0, "linked": 200 / 3}
    assert found["4"] == {"gold_events": 0.5, "spread": 0.0, "linked": 0.0}
    assert found["all"]["gold_events"] == 4 / 3 and math.isclose(found["all"]["linked"], 50.0)
    first = gold_linkage(Dataset("x", {"u": [], "v": []}, questions), store, limit=1)  # as the searches' --limit
    assert set(first) == {"1", "all"} and first["all"] == found["1"]
