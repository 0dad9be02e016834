"""`--retriever hybrid[:DENSE]` in the agent's commands: `rmm chat`, `rmm eval-qa` and
`rmm eval-controller` select through BM25 + dense (the controller and its direct baseline alike)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import BagOfWordsEncoder, drive
from test_chat import fakes  # noqa: F401  (fixture)
from test_goal_cli import scripted  # noqa: F401  (fixture)

from rmm.cli import main
from rmm.cli.chat import first_stage_choice
from rmm.errors import RmmError
from rmm.memory.hybrid import HybridRetriever


class CachedBagOfWords(BagOfWordsEncoder):
    passage_cache = None  # benchmark banks attach their passage cache to the encoder while they build


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))
    import rmm.eval.benchmark_bank

    monkeypatch.setattr(rmm.eval.benchmark_bank, "load_encoder", lambda name, **kw: CachedBagOfWords())


@pytest.fixture
def hybrid_searches(monkeypatch) -> list[list[str]]:
    """The queries every HybridRetriever search was asked (the first stage was hybrid iff non-empty)."""
    asked: list[list[str]] = []
    search = HybridRetriever.search

    def spy(self, queries, user, k):
        asked.append(list(queries))
        return search(self, queries, user, k)

    monkeypatch.setattr(HybridRetriever, "search", spy)
    return asked


def test_first_stage_choice() -> None:
    assert first_stage_choice("dense", None) == ("minilm", None)
    assert first_stage_choice("dense", "e5") == ("e5", None)
    assert first_stage_choice("hybrid", None) == ("minilm", "rrf")
    assert first_stage_choice("hybrid", "e5") == ("e5", "rrf")
    assert first_stage_choice("hybrid:e5", None) == ("e5", "rrf")
    assert first_stage_choice("hybrid:e5", "e5") == ("e5", "rrf")
    assert first_stage_choice("bm25", "e5") == ("e5", "lexical")  # BM25 over the chat bank, rerankable
    assert first_stage_choice("bm25:e5", None) == ("e5", "lexical")
    with pytest.raises(RmmError, match="give one"):
        first_stage_choice("hybrid:e5", "minilm")
    with pytest.raises(RmmError, match="give one"):
        first_stage_choice("bm25:e5", "minilm")
    with pytest.raises(RmmError, match=r"dense, hybrid\[:DENSE\] or bm25\[:DENSE\]"):
        first_stage_choice("minilm", None)  # an encoder name alone: --encoder names the bank's encoder
    with pytest.raises(RmmError, match="needs a dense encoder preset"):
        first_stage_choice("bm25:hybrid", None)


def test_chat_over_a_hybrid_first_stage(tmp_path: Path, monkeypatch, capsys, fakes, hybrid_searches) -> None:  # noqa: F811
    bank = tmp_path / "bank"
    drive(monkeypatch, ["I play the cello in an orchestra", "/end", "What instrument do I play?", "/quit"])
    assert main(["chat", "--bank", str(bank), "--user", "ana", "--llm", "scripted", "--device", "cpu",
                 "--retriever", "hybrid"]) == 0
    out = capsys.readouterr().out
    assert "cited: The user plays the cello" in out  # the memory reflected mid-chat is retrieved
    assert hybrid_searches == [["What instrument do I play?"]]
    meta = json.loads((bank / "reranker" / "meta.json").read_text())
    assert meta["stats"]["records"] == 1


def test_chat_refuses_two_encoders(tmp_path: Path, capsys, fakes) -> None:  # noqa: F811
    assert main(["chat", "--bank", str(tmp_path / "b"), "--user", "u", "--llm", "x", "--device", "cpu",
                 "--retriever", "hybrid:e5", "--encoder", "minilm"]) == 2
    assert "give one" in capsys.readouterr().out


def test_eval_qa_takes_hybrid(tiny_data_dir, tmp_path, isolated_cache, hybrid_searches) -> None:  
    out = tmp_path / "qa.json"
    assert main(["eval-qa", "--data-dir", str(tiny_data_dir), "--llm", "simulated", "--retriever", "hybrid",
                 "--limit", "4", "--k", "4", "--m", "2", "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["overall"]["n"] == 4 and len(hybrid_searches) == 4
    assert report["reranker"]["records"] >= 1


def test_eval_controller_takes_hybrid_for_both_sides(tiny_data_dir, tmp_path, scripted, isolated_cache,  # noqa: F811
                                                     hybrid_searches) -> None:
    out = tmp_path / "goal.json"
    assert main(["eval-controller", "--data-dir", str(tiny_data_dir), "--llm", "hf:x", "--category", "1",
                 "--limit", "2", "--k", "4", "--m", "3", "--device", "cpu", "--retriever", "hybrid",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    direct = [row["question"] for row in report["rows"]]
    assert report["n"] == 2
    assert all([q] in hybrid_searches for q in direct)  # the direct baseline searched through hybrid too
    assert len(hybrid_searches) > len(direct)  # and so did the controller's subgoal queries
