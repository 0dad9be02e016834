"""`rmm chat --frontend goal`, `rmm eval-qa --frontend goal` and `rmm eval-controller` (GOAL-MEM by
default), with a scripted LLM."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fakes import BagOfWordsEncoder, drive

import rmm.encoders
import rmm.llm
from rmm.cli import main
from rmm.data import load_locomo
from rmm.eval.controller_recall import evaluate_controller_recall
from rmm.frontends.goal import GoalConfig
from rmm.llm.base import LLM, Usage
from rmm.memory.bank import MemoryBank
from rmm.types import Memory


class OneHopLLM(LLM):
    """Decomposes a question into itself (one subgoal), grounds it with fact 1, answers citing fact 0."""

    def __init__(self) -> None:
        super().__init__("scripted-goal")
        self.kinds: list[str] = []

    def _generate(self, batch, *, json_schema=None, max_tokens=512, temperature=0.0):
        out = []
        for conversation in batch:
            system, prompt = conversation[0]["content"], conversation[-1]["content"]
            if system.startswith("You plan"):
                question = re.search(r"Question: (.*)", prompt).group(1).rstrip("?")
                self.kinds.append("decompose")
                out.append(f"Goal: {question}.\nVariables:\n- none\nSubgoals:\n- {question}.")
            elif "verifiable unification" in system:
                subgoal = re.search(r"Subgoals:\n- (.*)", prompt).group(1)
                self.kinds.append("unify")
                out.append(f"Unification Status: satisfied\nSubstitution: {{}}\nGrounded Subgoals:\n"
                           f"- {subgoal} <= Fact 1; bindings: none\nUnresolved Subgoals:\n- none\nFinal Answer: yes")
            else:
                self.kinds.append("answer")
                out.append("From what you told me: yes. [0]")
        self._record(Usage(calls=len(batch), prompt_tokens=50, completion_tokens=10))
        return out


@pytest.fixture
def scripted(monkeypatch) -> list[OneHopLLM]:
    made: list[OneHopLLM] = []

    def load_llm(spec: str, **options):
        if spec == "simulated":
            from rmm.llm.simulated import SimulatedLLM

            return SimulatedLLM()
        made.append(OneHopLLM())
        return made[-1]

    monkeypatch.setattr(rmm.llm, "load_llm", load_llm)
    monkeypatch.setattr(rmm.encoders, "load_encoder", lambda name, **kw: BagOfWordsEncoder())
    return made


def test_chat_with_the_goal_front_end_prints_and_saves_traces(tmp_path: Path, monkeypatch, capsys, scripted) -> None:
    bank_path = tmp_path / "bank"
    with MemoryBank(bank_path, BagOfWordsEncoder(), device="cpu") as bank:
        bank.add("ana", [Memory(id="m0", user_id="ana", kind="topic", text="Ana plays the cello in an orchestra"),
                         Memory(id="m1", user_id="ana", kind="topic", text="Ana bakes sourdough bread")])
    traces = tmp_path / "traces.jsonl"
    drive(monkeypatch, ["Does Ana play the cello in an orchestra?", "/quit"])
    assert main(["chat", "--bank", str(bank_path), "--user", "ana", "--llm", "hf:whatever", "--device", "cpu",
                 "--frontend", "goal", "--k", "1", "--m", "1", "--trace-json", str(traces), "-v"]) == 0
    out = capsys.readouterr().out
    assert "assistant> From what you told me: yes." in out and "cited: Ana plays the cello" in out
    assert "breadth 1" in out and "depth 0" in out and "3 LLM calls" in out and "query Does Ana play" in out
    assert scripted[0].kinds == ["decompose", "unify", "answer"]
    (line,) = traces.read_text().splitlines()
    trace = json.loads(line)
    assert trace["outcome"] == "grounded" and trace["cited"] == ["m0"] and trace["usage"]["calls"] == 3
    meta = json.loads((bank_path / "reranker" / "meta.json").read_text())
    assert meta["stats"]["records"] == 1  # the subgoal query's selection reached the shared reranker


def test_goal_front_end_refuses_the_simulated_llm(tiny_data_dir: Path, tmp_path: Path, capsys, scripted) -> None:
    assert main(["eval-controller", "--data-dir", str(tiny_data_dir), "--llm", "simulated", "--device", "cpu"]) == 2
    assert "cannot decompose" in capsys.readouterr().out
    assert main(["eval-qa", "--data-dir", str(tiny_data_dir), "--llm", "simulated", "--frontend", "goal",
                 "--device", "cpu"]) == 2
    assert "cannot decompose" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["chat", "--bank", str(tmp_path / "b"), "--user", "u", "--llm", "x", "--frontend", "sideways"])


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))
    import rmm.eval.benchmark_bank

    monkeypatch.setattr(rmm.eval.benchmark_bank, "load_encoder", lambda name, **kw: BagOfWordsEncoder())


def test_eval_qa_through_the_goal_front_end(tiny_data_dir, tmp_path, capsys, scripted, isolated_cache) -> None:
    out, traces = tmp_path / "qa.json", tmp_path / "traces.jsonl"
    assert main(["eval-qa", "--data-dir", str(tiny_data_dir), "--llm", "hf:x", "--frontend", "goal", "--limit", "3",
                 "--k", "4", "--m", "2", "--device", "cpu", "--json", str(out), "--trace-json", str(traces)]) == 0
    report = json.loads(out.read_text())
    assert report["frontend"] == "goal" and report["overall"]["n"] == 3
    assert all(row["trace"]["outcome"] == "grounded" for row in report["rows"])
    assert report["reranker"]["records"] == 3  # one subgoal query per question, rewarded
    assert len(traces.read_text().splitlines()) == 3
    assert "GOAL-MEM" in capsys.readouterr().out


def test_eval_controller_compares_goal_recall_at_equal_budget(tiny_data_dir, tmp_path, capsys, scripted,
                                                              isolated_cache) -> None:
    out = tmp_path / "goal.json"
    assert main(["eval-controller", "--data-dir", str(tiny_data_dir), "--llm", "hf:x", "--category", "1", "--k", "4",
                 "--m", "3", "--device", "cpu", "--show-trace", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "recall" in printed and "direct" in printed and "breadth 1" in printed
    report = json.loads(out.read_text())
    assert report["n"] == 6 and report["category"] == 1  # the tiny data set has 6 category-1 questions
    for row in report["rows"]:
        gold = set(row["gold_turns"])
        assert row["n_memories"] == len(row["goal_ids"]) == len(row["direct_ids"]) == 3
        # turn memories: a memory's id is its turn's id, so recall is plain set arithmetic
        assert row["recall_goal"] == len(gold & set(row["goal_ids"])) / len(gold)
        assert row["recall_direct"] == len(gold & set(row["direct_ids"])) / len(gold)
        assert row["answer"] is None and row["llm_calls"] == 2  # no answer call: retrieval only
    assert report["llm_calls"] == 2 and 0 <= report["recall_goal"] <= 1 and report["config"]["budget"] == 60


def test_evaluate_controller_recall_respects_the_goal_budget(tiny_data_dir, tmp_path) -> None:
    dataset = load_locomo(tiny_data_dir / "locomo" / "locomo10.json")
    from rmm.eval.benchmark_bank import fill

    with MemoryBank(tmp_path / "bank", BagOfWordsEncoder(), device="cpu") as bank:
        fill(bank, dataset, "turn", progress=False)
        seen = []
        report = evaluate_controller_recall(dataset, bank, OneHopLLM(), category=None, limit=4, k=6, m=4,
                                      config=GoalConfig(budget=2), answer=True, progress=False,
                                      on_trace=lambda q, t: seen.append(q.id))
    assert report.n == 4 and len(seen) == 4 and report.category is None
    assert all(row["n_memories"] == 2 == len(row["direct_ids"]) for row in report.rows)
    assert all(row["answer"] for row in report.rows) and report.llm_calls == 3
