"""CompassMem's heuristic walk (rmm.frontends.compass, module docstring): the walk score (the
reranker's plus the session-opener bonus), the look-ahead priority, the seeds that start the walk,
the kept nodes' diversified order against a brute-force MMR, the policy defaults and their checks,
and the benchmark's --users switch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fakes import BagOfWordsEncoder
from test_compass_frontend import frontend, front_question, write_graph

from rmm.bench.compass import FIRST_WALK
from rmm.bench.compass import main as bench_main
from rmm.frontends.compass import CompassConfig
from rmm.frontends.compass_trace import CompassTrace
from rmm.llm.simulated import SimulatedLLM
from rmm.memory.bank import MemoryBank

QUERY = "Jen recital cello sonatas Melanie"


@pytest.fixture
def bank(tmp_path: Path):
    with MemoryBank(tmp_path / "bank", BagOfWordsEncoder(), device="cpu") as b:
        write_graph(b)
        yield b


def question(front, query: str = QUERY):
    return front_question(front, CompassTrace(question=query, user="melanie"))


def test_walk_score_adds_the_opener_bonus_to_nodes_without_an_incoming_next_edge(bank: MemoryBank) -> None:
    front = frontend(bank, SimulatedLLM(), policy="heuristic", opener=0.25, answer=False)
    q = question(front)
    ids = ["meet", "recital", "cello", "hub", "bakery", "errand0"]
    scores, walk = front._scores(q, ids), front._walk_scores(q, ids)
    # recital -next-> cello: cello continues a session, every other node opens one (friendship, part-of edges don't count)
    assert walk["cello"] == pytest.approx(scores["cello"])
    assert all(walk[i] == pytest.approx(scores[i] + 0.25) for i in ids if i != "cello")
    plain = frontend(bank, SimulatedLLM(), policy="heuristic", opener=0.0, answer=False)
    assert plain._walk_scores(question(plain), ids) == pytest.approx(scores)


def test_priority_looks_ahead_to_the_best_neighbours_walk_score(bank: MemoryBank) -> None:
    front = frontend(bank, SimulatedLLM(), policy="heuristic", lookahead=0.5, opener=0.1, answer=False)
    q = question(front)
    walk = front._walk_scores(q, ["meet", "recital", "cello", "bakery", "hub", *[f"errand{i}" for i in range(10)]])
    got = front._priorities(q, ["recital", "meet", "bakery", "hub"])
    assert got["recital"] == pytest.approx(walk["recital"] + 0.5 * max(walk["meet"], walk["cello"]))  # both directions
    assert got["meet"] == pytest.approx(walk["meet"] + 0.5 * walk["recital"])
    assert got["bakery"] == pytest.approx(walk["bakery"])  # no neighbour: nothing to look ahead to
    assert got["hub"] == pytest.approx(walk["hub"] + 0.5 * max(walk[f"errand{i}"] for i in range(10)))
    flat = frontend(bank, SimulatedLLM(), policy="heuristic", lookahead=0.0, opener=0.1, answer=False)
    fq = question(flat)
    assert flat._priorities(fq, ["recital", "hub"]) == pytest.approx(flat._walk_scores(fq, ["recital", "hub"]))


def test_the_walk_starts_from_the_seeds_best_slate_nodes_over_the_threshold(bank: MemoryBank) -> None:
    front = frontend(bank, SimulatedLLM(), policy="heuristic", threshold=0.0, start_k=6, seeds=2, answer=False)
    trace = front.respond("melanie", QUERY, remember=False).trace
    (local,) = trace.localizations
    assert len(local.slate.memory_ids) == 6 and len(local.start) == 2 and set(local.start) <= set(local.slate.memory_ids)
    q = question(front)
    q.pool_scores = {}
    walk = front._walk_scores(q, local.slate.memory_ids)
    priority = front._priorities(q, local.slate.memory_ids)
    best = sorted((i for i in local.slate.memory_ids if walk[i] >= 0.0), key=lambda i: -priority[i])[:2]
    assert sorted(priority[i] for i in local.start) == pytest.approx(sorted(priority[i] for i in best))
    starts = [s for s in trace.steps if s.path_length == 1]
    assert [s.node for s in starts] == sorted(local.start, key=lambda i: -priority[i])  # popped best first
    # over a threshold nothing clears, no seed starts a walk: nothing kept, the slate is the fallback
    none = frontend(bank, SimulatedLLM(), policy="heuristic", threshold=5.0, answer=False).respond(
        "melanie", QUERY, remember=False).trace
    assert none.localizations[0].start == [] and none.kept == [] and none.fallback


def is_mmr_order(order: list[str], priority: dict[str, float], vectors: dict[str, torch.Tensor], lam: float) -> bool:
    """Each node placed has the best marginal relevance (to 1e-5: ties may fall either way) of those left."""
    left, placed = list(order), []
    for node in order:
        values = {i: priority[i] - lam * max((float(vectors[i] @ vectors[j]) for j in placed), default=0.0)
                  for i in left}
        if values[node] < max(values.values()) - 1e-5:
            return False
        left.remove(node)
        placed.append(node)
    return True


@pytest.mark.parametrize("lam", [0.0, 0.3, 2.0])
def test_kept_nodes_are_handed_on_in_marginal_relevance_order(bank: MemoryBank, lam: float) -> None:
    kept_order = frontend(bank, SimulatedLLM(), policy="heuristic", threshold=0.0, diversity=None, answer=False)
    plain = kept_order.respond("melanie", QUERY, remember=False).trace
    assert plain.kept == [s.node for s in plain.steps if s.action == "EXPAND"] and len(plain.kept) >= 3
    front = frontend(bank, SimulatedLLM(), policy="heuristic", threshold=0.0, diversity=lam, answer=False)
    trace = front.respond("melanie", QUERY, remember=False).trace
    assert sorted(trace.kept) == sorted(plain.kept) and trace.retrieved == trace.kept  # the same walk, reordered
    q = question(front)
    q.pool_scores = {}
    vectors = {i: torch.nn.functional.normalize(v.float(), dim=-1)
               for i, v in zip(plain.kept, bank.embeddings("melanie", plain.kept))}
    priority = {s.node: s.priority for s in plain.steps}
    assert is_mmr_order(trace.kept, priority, vectors, lam)
    assert not is_mmr_order(trace.kept[::-1], priority, vectors, lam)  # the check can fail


def test_policy_defaults_and_checks() -> None:
    heuristic, llm = CompassConfig(policy="heuristic"), CompassConfig(policy="llm")
    assert (heuristic.start_k, heuristic.topics) == (20, heuristic.pool) and (llm.start_k, llm.topics) == (5, 5)
    assert CompassConfig(policy="oracle").start_k == 5 and CompassConfig(policy="heuristic", pool=12).start_k == 12
    assert CompassConfig(policy="heuristic", start_k=7, topics=3).start_k == 7
    first = CompassConfig(policy="heuristic", **FIRST_WALK)
    assert (first.start_k, first.topics, first.lookahead, first.opener, first.diversity) == (5, 5, 0.0, 0.0, None)
    for bad in (dict(lookahead=-0.1), dict(opener=float("nan")), dict(diversity=float("inf")), dict(seeds=0),
                dict(lookahead=True), dict(diversity="0.2"), dict(policy="heuristic", pool=10, start_k=11)):
        with pytest.raises(ValueError):
            CompassConfig(**bad)


def test_bench_reads_training_users_only_without_the_learned_rows(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        bench_main(["--users", "train"])
    assert stop.value.code == 2 and "--no-learn" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main(["--users", "everyone", "--no-learn"])
