"""R@T, recall within a budget of T dialogue turns shown (`rmm.eval.metrics.recall_at_turns`): memories
of different sizes compare at equal text shown, in `rmm eval`, `rmm train` and `rmm eval-controller`."""

from __future__ import annotations

import io
import json

import pytest
import torch
from fakes import BagOfWordsEncoder
from rich.console import Console
from test_goal_cli import OneHopLLM, isolated_cache, scripted  # noqa: F401 (fixtures)

from rmm.cli import main
from rmm.cli.eval import granularity_figures, turn_budget_figures
from rmm.cli.eval_controller import controller_figures, turn_budget_figures as controller_turn_figures
from rmm.cli.tables import Figures, print_figures
from rmm.cli.train import train_figures
from rmm.data.locomo import load_locomo
from rmm.eval.controller_recall import evaluate_controller_recall
from rmm.eval.metrics import recall_at_k, recall_at_turns, score_turn_budgets, within_turns
from rmm.eval.retrieval import GoldScorer, evaluate_orders
from rmm.memory.bank import MemoryBank
from rmm.memory.store import MemoryStore
from rmm.training.online import OnlineReport
from rmm.types import Candidates, Dataset, Memory, Question, Session, Turn

SESSION = [f"s1:{i}" for i in range(10)]  # one session memory of ten turns
GOLD = ["s1:2", "s1:7"]


def _render(figures: Figures, width: int = 80) -> str:
    out = io.StringIO()
    print_figures(figures, Console(file=out, width=width))
    return out.getvalue()


def test_a_ten_turn_session_equals_its_ten_turn_memories_at_fifteen_turns() -> None:
    session = [SESSION]
    turns = [[t] for t in SESSION]
    assert recall_at_turns(session, GOLD, 15) == recall_at_turns(turns, GOLD, 15) == 1.0
    # R@K is what the budget corrects: at K = 1 the session shows ten turns, the turn memory one.
    assert recall_at_k(session, GOLD, 1) == 1.0 and recall_at_k(turns, GOLD, 1) == 0.0
    assert recall_at_turns(turns, GOLD, 5) == 0.5 and recall_at_turns(session, GOLD, 5) == 0.0


def test_the_memory_that_would_cross_the_budget_is_excluded_and_ends_the_walk() -> None:
    big = [f"s2:{i}" for i in range(20)]
    ranked = [["s1:0"], big, ["s1:2"]]  # 1 turn, then 20 (1 + 20 > 15), then a gold turn
    assert within_turns(ranked, 15) == [["s1:0"]]
    assert recall_at_turns(ranked, ["s2:3"], 15) == 0.0  # inside the crossing memory: not shown
    assert recall_at_turns(ranked, ["s1:2"], 15) == 0.0  # after it: the walk stopped (a prefix, as R@K's top k)
    assert recall_at_turns(ranked, ["s2:3", "s1:2"], 22) == 1.0  # 1 + 20 + 1 = 22 fits exactly
    assert recall_at_turns([SESSION, SESSION[:6]], GOLD, 15) == 1.0  # 10 fit, 10 + 6 would not
    assert within_turns([SESSION, SESSION[:6]], 15) == [SESSION]


def test_a_memory_without_refs_costs_one_turn() -> None:
    ranked = [[] for _ in range(15)] + [["s1:2"]]
    assert recall_at_turns(ranked, ["s1:2"], 15) == 0.0  # 15 empty memories fill the budget
    assert recall_at_turns(ranked, ["s1:2"], 16) == 1.0
    assert len(within_turns([["a", "a", "b"], ["c"]], 3)) == 2  # a turn cited twice is shown once


def test_turn_budget_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        within_turns([["a"]], 0)
    with pytest.raises(ValueError):
        recall_at_turns([["a"]], [], 15)
    assert score_turn_budgets([["a"]], []) == {}  # no gold turns: no R@T, left out of the means
    assert score_turn_budgets([["a"], ["b"]], ["b"]) == {"recall_turns@15": 1.0, "recall_turns@25": 1.0}


def _dataset() -> Dataset:
    """One user, three sessions of 10 turns; a question whose gold turns are s1:2 and s1:7."""
    sessions = [Session(id=s, user_id="u", turns=[Turn(id=f"{s}:{i}", session_id=s, speaker="a", text=f"turn {s} {i}")
                                                  for i in range(10)]) for s in ("s1", "s2", "s3")]
    question = Question(id="q", user_id="u", text="q?", answer="", evidence_turns=list(GOLD),
                        evidence_sessions=["s1"], category=1)
    return Dataset(name="tiny", sessions={"u": sessions}, questions=[question], categories={1: "one"})


def test_the_scorer_reads_gold_turns_at_session_granularity() -> None:
    dataset = _dataset()
    scorer = GoldScorer.for_dataset(dataset, "session")
    row = scorer.score([SESSION], dataset.questions[0], [1])
    assert row["recall@1"] == 1.0  # R@K on gold sessions
    assert row["recall_turns@15"] == 1.0 and row["recall_turns@25"] == 1.0  # R@T on gold turns


class Ranked:
    """Returns the user's turns in a fixed order, the gold turns at ranks 22 and 23."""

    def __init__(self, store: MemoryStore, order: list[str]) -> None:
        self.store, self.order = store, order

    def search(self, queries: list[str], user: str, k: int) -> list[Candidates]:
        ids = self.order[:k]
        return [Candidates(query=q, memory_ids=ids, retriever_scores=torch.zeros(len(ids)), user_id=user)
                for q in queries]


def test_evaluate_searches_deep_enough_to_fill_the_largest_budget() -> None:
    dataset = _dataset()
    store = MemoryStore(":memory:")
    turns = [t for s in dataset.sessions["u"] for t in s.turns]
    store.add([Memory(id=t.id, user_id="u", kind="turn", text=t.text, refs=[t.id]) for t in turns])
    others = [t.id for t in turns if t.id not in GOLD]
    order = others[:21] + GOLD + others[21:]

    def first_two_last(found: list[Candidates]) -> list[list[str]]:  # a "reranker" of the top 20
        assert all(len(c) == 20 for c in found)
        return [c.memory_ids[2:] + c.memory_ids[:2] for c in found]

    reports = evaluate_orders(dataset, Ranked(store, order), "turn", [5], {"base": None, "reranked": first_two_last},
                              progress=False, ceiling=20)
    base = reports["base"].overall
    assert base["recall@20"] == 0.0 and base["recall_turns@15"] == 0.0 and base["recall_turns@25"] == 1.0
    # the reranked list: its top 20 reordered, then the retriever's tail, so 25 turns are still shown
    assert reports["reranked"].overall["recall_turns@25"] == 1.0
    assert reports["base"].to_json()["turn_budgets"] == [15, 25]
    text = " ".join(_render(turn_budget_figures(reports["base"])).split())
    assert "R@15t" in text and "R@25t" in text and "R@5" in text and "dialogue turns" in text


def test_eval_prints_and_writes_r_at_t_for_every_granularity(tiny_data_dir, tmp_path, capsys,
                                                               monkeypatch) -> None:
    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "eval.json"
    assert main(["eval", "--data-dir", str(tiny_data_dir), "--retriever", "bm25", "--granularity", "turn", "session",
                 "--k", "5", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "R@15t" in printed and "R@25t" in printed and "R@5" in printed
    reports = json.loads(out.read_text())
    for key in ("bm25/turn", "bm25/session"):
        overall = reports[key]["overall"]
        assert 0.0 <= overall["recall_turns@15"] <= overall["recall_turns@25"] <= 1.0
    single = tmp_path / "single.json"
    assert main(["eval", "--data-dir", str(tiny_data_dir), "--retriever", "bm25", "--k", "5",
                 "--json", str(single)]) == 0
    printed = capsys.readouterr().out
    assert "R@15t" in printed and "R@25t" in printed
    assert "recall_turns@25" in json.loads(single.read_text())["overall"]


def test_the_granularity_table_has_r_at_t_within_80_columns() -> None:
    dataset = _dataset()
    store = MemoryStore(":memory:")
    turns = [t for s in dataset.sessions["u"] for t in s.turns]
    store.add([Memory(id=t.id, user_id="u", kind="turn", text=t.text, refs=[t.id]) for t in turns])
    report = evaluate_orders(dataset, Ranked(store, [t.id for t in turns]), "turn", [5, 20], {"x": None},
                             progress=False, ceiling=20)["x"]
    lines = _render(granularity_figures([report, report], "x")).splitlines()
    assert max(map(len, lines)) <= 80
    text = " ".join(lines)
    assert text.count("R@15t") == 2 and text.count("R@25t") == 2  # turn and session columns, beside R@5 / R@20


def test_train_report_has_r_at_t_rows_read_at_m() -> None:
    base = {"recall@5": 0.30, "recall_any@5": 0.4, "ndcg@5": 0.25, "recall@20": 0.46,
            "recall_turns@15": 0.3, "recall_turns@25": 0.3}
    better = {**base, "recall@5": 0.34, "recall_turns@15": 0.34, "recall_turns@25": 0.34}
    report = OnlineReport(base, better, base, better, better, "simulated", "split", {"eval_k": 5, "k": 20, "m": 5})
    text = _render(train_figures(report, "minilm"))
    assert "prequential R@15t" in text and "held-out R@25t" in text and "dialogue turns" in text
    assert "+4.0" in text.split("held-out R@25t")[1].splitlines()[0]


def test_train_scores_r_at_t_over_the_m_shown(tiny_data_dir, tmp_path) -> None:
    from rmm.eval.benchmark_bank import fill
    from rmm.training.online import OnlineConfig, OnlineTrainer

    dataset = load_locomo(tiny_data_dir / "locomo" / "locomo10.json")
    with MemoryBank(tmp_path / "bank", BagOfWordsEncoder(), device="cpu") as bank:
        fill(bank, dataset, "turn", progress=False)
        cfg = OnlineConfig(k=8, m=2, epochs=1, heldout_fraction=0.34)
        trainer = OnlineTrainer(dataset, bank, cfg, progress=False)
        report = trainer.run()
        beyond_m = 0
        for q in trainer.split.heldout:
            cand = trainer.cands[q.id]
            order = list(range(len(cand)))[::-1]
            ranked = [trainer.refs[cand.memory_ids[i]] for i in order]
            at_m = recall_at_turns(ranked[:2], q.evidence_turns, 25)  # the M = 2 shown, not the K = 8 listed
            assert trainer.score(cand, order, q)["recall_turns@25"] == at_m
            beyond_m += recall_at_turns(ranked, q.evidence_turns, 25) != at_m
        assert beyond_m  # some question's list beyond M would have scored otherwise
    for key in ("retriever", "reranker_prequential", "retriever_heldout", "reranker_heldout"):
        assert 0.0 <= report.to_json()[key]["recall_turns@15"] <= report.to_json()[key]["recall_turns@25"] <= 1.0


def test_eval_controller_reports_r_at_t_of_both_arms(tiny_data_dir, tmp_path) -> None:
    dataset = load_locomo(tiny_data_dir / "locomo" / "locomo10.json")
    from rmm.eval.benchmark_bank import fill

    with MemoryBank(tmp_path / "bank", BagOfWordsEncoder(), device="cpu") as bank:
        fill(bank, dataset, "turn", progress=False)
        report = evaluate_controller_recall(dataset, bank, OneHopLLM(), category=1, limit=3, k=6, m=4,
                                            progress=False)
    data = report.to_json()
    assert set(data["recall_turns_goal"]) == set(data["recall_turns_direct"]) == {"recall_turns@15", "recall_turns@25"}
    for row in report.rows:  # a handful of turn memories: both budgets hold them, R@T = recall
        assert row["recall_turns@15_goal"] == row["recall_turns@25_goal"] == row["recall_goal"]
        assert row["recall_turns@15_direct"] == row["recall_direct"]
    assert max(map(len, _render(controller_figures(report)).splitlines())) <= 80
    lines = _render(controller_turn_figures(report)).splitlines()
    assert max(map(len, lines)) <= 80
    text = " ".join(lines)
    assert "R@15t" in text and "R@25t" in text and "dialogue turns" in text and "direct" in text


def test_eval_controller_prints_and_writes_r_at_t(tiny_data_dir, tmp_path, capsys, scripted, isolated_cache) -> None:
    out = tmp_path / "goal.json"
    assert main(["eval-controller", "--data-dir", str(tiny_data_dir), "--llm", "hf:x", "--category", "1", "--k", "4",
                 "--m", "3", "--limit", "2", "--device", "cpu", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "R@15t" in printed and "R@25t" in printed
    report = json.loads(out.read_text())
    assert set(report["recall_turns_goal"]) == {"recall_turns@15", "recall_turns@25"}
    assert all("recall_turns@25_direct" in row for row in report["rows"])
