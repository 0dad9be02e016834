"""`rmm chat`, `rmm eval --granularity topic` and `rmm eval-qa`, driven through `main`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import BagOfWordsEncoder, drive

import rmm.encoders
import rmm.llm
from rmm.cli import main
from rmm.llm.base import LLM, Usage
from rmm.memory.store import MemoryStore
from rmm.prompts import is_answer_prompt, parse_shown_memories


class ChatLLM(LLM):
    """Extracts one memory per session (the user's first turn); cites memories mentioning 'cello'."""

    def __init__(self) -> None:
        super().__init__("scripted-chat")

    def _generate(self, batch, *, json_schema=None, max_tokens=512, temperature=0.0):
        out = []
        for conversation in batch:
            prompt = conversation[-1]["content"]
            if is_answer_prompt(conversation):
                cited = [i for i, text in enumerate(parse_shown_memories(conversation)) if "cello" in text]
                out.append(f"You play the cello! [{', '.join(map(str, cited))}]" if cited else "Tell me more! [NO_CITE]")
            elif "Turn 0" in prompt:
                out.append('{"extracted_memories": [{"summary": "The user plays the cello", "reference": [0]}]}')
            else:
                out.append("Add()")
        self._record(Usage(calls=1))
        return out


@pytest.fixture
def fakes(monkeypatch):
    specs: list[str] = []
    monkeypatch.setattr(rmm.encoders, "load_encoder", lambda name, **kw: BagOfWordsEncoder())

    def load_llm(spec: str, **options):
        specs.append(spec)
        return ChatLLM()

    monkeypatch.setattr(rmm.llm, "load_llm", load_llm)
    return specs


def test_chat_end_to_end_persists_everything(tmp_path: Path, monkeypatch, capsys, fakes) -> None:
    bank = tmp_path / "bank"
    args = ["chat", "--bank", str(bank), "--user", "ana", "--llm", "scripted", "--device", "cpu"]
    drive(monkeypatch, ["I play the cello in an orchestra", "/end", "/memories", "What instrument do I play?",
                        "Any news?", "/quit", "never read"])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert fakes == ["scripted"]
    assert "1 topic memories added or merged" in out
    assert "[topic] The user plays the cello" in out
    assert "You play the cello!" in out and "cited: The user plays the cello" in out
    assert (bank / "reranker" / "meta.json").exists() and (bank / "sessions.sqlite").exists()

    drive(monkeypatch, ["/end"])  # a new process: the open session (2 exchanges) is still there; EOF exits
    assert main(args) == 0
    assert "1 topic memories added or merged" in capsys.readouterr().out
    meta = json.loads((bank / "reranker" / "meta.json").read_text())
    assert meta["stats"]["records"] == 2


def test_chat_on_empty_bank_and_unknown_frontend(tmp_path: Path, monkeypatch, capsys, fakes) -> None:
    drive(monkeypatch, ["/memories", "hello"])
    assert main(["chat", "--bank", str(tmp_path / "b"), "--user", "zoe", "--llm", "x", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "no memories yet" in out and "Tell me more!" in out
    with pytest.raises(SystemExit):  # argparse names the valid front ends
        main(["chat", "--bank", str(tmp_path / "b"), "--user", "zoe", "--llm", "x", "--frontend", "sideways"])
    assert "invalid choice: 'sideways'" in capsys.readouterr().err


def test_chat_keeps_citation_warnings_off_the_screen_and_in_the_log(tmp_path: Path, monkeypatch, capsys,
                                                                    fakes) -> None:
    bank = tmp_path / "bank"
    args = ["chat", "--bank", str(bank), "--user", "ana", "--llm", "scripted", "--device", "cpu"]
    drive(monkeypatch, ["I play the cello", "/end", "Do I play the cello? [7]"])
    monkeypatch.setattr(ChatLLM, "_generate", lambda self, batch, **kw: [
        "Yes! [0, 9]" if is_answer_prompt(c) else
        ('{"extracted_memories": [{"summary": "The user plays the cello", "reference": [0]}]}'
         if "Turn 0" in c[-1]["content"] else "Add()") for c in batch])
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "Yes!" in captured.out and "out-of-range" not in captured.out + captured.err
    assert "dropped out-of-range index 9" in (bank / "chat.log").read_text()


def test_chat_refuses_the_simulated_llm(tmp_path: Path, capsys) -> None:
    assert main(["chat", "--bank", str(tmp_path / "b"), "--user", "zoe", "--llm", "simulated"]) == 2
    assert "writes no answers" in capsys.readouterr().out
    assert not (tmp_path / "b").exists()


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A private cache, and the bag-of-words encoder in place of MiniLM (speed: the tiny
    dataset's questions share words with their evidence)."""
    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))
    import rmm.eval.benchmark_bank

    monkeypatch.setattr(rmm.eval.benchmark_bank, "load_encoder", lambda name, **kw: BagOfWordsEncoder())


def test_eval_topic_granularity_side_by_side(tiny_data_dir, tmp_path, capsys, isolated_cache) -> None:
    out = tmp_path / "eval.json"
    assert main(["eval", "--data-dir", str(tiny_data_dir), "--granularity", "turn", "session", "topic",
                 "--k", "5", "--device", "cpu", "--json", str(out)]) == 0
    reports = json.loads(out.read_text())
    assert set(reports) == {"minilm/turn", "minilm/session", "minilm/topic"}
    topic = reports["minilm/topic"]
    assert "fallback" in topic["retriever"] and topic["overall"]["recall@5"] > 0.8
    printed = capsys.readouterr().out
    assert "memory granularity" in printed and "topic R@5" in printed and "session R@5" in printed
    assert "fallback" in printed
    banks = list((tmp_path / "cache" / "banks").glob("locomo-topic-*"))
    assert len(banks) == 1
    # cached: a second run reflects nothing again (no user's generation moves)
    def generations() -> dict[str, int]:
        with MemoryStore(banks[0] / "memories.sqlite") as store:
            return {u: store.generation(u) for u in store.users()}

    before = generations()
    assert len(before) == 3 and all(v > 0 for v in before.values())
    assert main(["eval", "--data-dir", str(tiny_data_dir), "--granularity", "topic", "--k", "5",
                 "--device", "cpu"]) == 0
    assert generations() == before


class QALLM(LLM):
    """Answers with the shown memory that shares most words with the question; judges by F1 > 0."""

    def __init__(self) -> None:
        super().__init__("scripted-qa")

    def _generate(self, batch, *, json_schema=None, max_tokens=512, temperature=0.0):
        out = []
        for conversation in batch:
            prompt = conversation[-1]["content"]
            if is_answer_prompt(conversation):
                shown = parse_shown_memories(conversation)
                out.append(f"{shown[0]} [0]" if shown else "unknown [NO_CITE]")
            else:
                out.append("Yes" if "hiking" in prompt.lower() else "No")
        return out


def test_eval_qa_scores_judge_f1_and_citations(tiny_data_dir, tmp_path, monkeypatch, capsys, isolated_cache) -> None:
    monkeypatch.setattr(rmm.llm, "load_llm", lambda spec, **kw: QALLM())
    out = tmp_path / "qa.json"
    assert main(["eval-qa", "--data-dir", str(tiny_data_dir), "--llm", "scripted", "--limit", "6",
                 "--device", "cpu", "--k", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["overall"]["n"] == 6 and not report["simulated"]
    assert 0 <= report["overall"]["judge"] <= 1 and report["overall"]["f1"] is not None
    assert report["reranker"]["records"] == 6
    assert "judge" in capsys.readouterr().out


def test_eval_qa_with_the_simulated_generator_reports_citations_only(tiny_data_dir, tmp_path, capsys,
                                                                    isolated_cache) -> None:
    out = tmp_path / "qa.json"
    assert main(["eval-qa", "--data-dir", str(tiny_data_dir), "--llm", "simulated", "--device", "cpu",
                 "--k", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["simulated"] and report["overall"]["judge"] is None and report["overall"]["f1"] is None
    assert report["overall"]["shown_recall"] >= 0.4 and report["overall"]["cited_precision"] >= 0.8
    assert report["reranker"]["records"] > 0
    assert "simulated generator" in capsys.readouterr().out


def test_eval_qa_no_learn_shows_the_top_m_and_updates_nothing(tiny_data_dir, tmp_path, isolated_cache) -> None:
    runs = {}
    for flag in ([], ["--no-learn"]):
        out = tmp_path / f"qa{len(flag)}.json"
        assert main(["eval-qa", "--data-dir", str(tiny_data_dir), "--llm", "simulated", "--device", "cpu",
                     "--k", "8", "--json", str(out), *flag]) == 0
        runs[bool(flag)] = json.loads(out.read_text())
    assert runs[False]["reranker"]["records"] > 0 and runs[True]["reranker"]["records"] == 0
    # the tiny dataset's evidence shares words with its question: the plain top-M finds it
    assert runs[True]["overall"]["shown_recall"] >= runs[False]["overall"]["shown_recall"]
