"""`--retriever bm25:DENSE`: BM25's ranking over a dense bank's own store (`HybridRetriever(bank,
fusion="lexical")`), so a BM25 first stage can be reranked — same ids, order and scores as plain
BM25, every candidate with the bank's embeddings and BM25's score scaled to [0, 1] as its lexical
feature; at turn, session and topic granularity, in `rmm eval`, `rmm train`, `rmm chat` and
`rmm serve`; malformed names refused with one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fakes import BagOfWordsEncoder, drive
from rmm.training.online import OnlineConfig, OnlineTrainer
from test_chat import fakes  # noqa: F401  (fixture)
from test_hybrid import (
    ConceptEncoder,
    bank,  # noqa: F401  (fixture: the concept bank of test_hybrid)
)
from test_lexical_feature import Made, TableEncoder, three_turn_dataset
from test_serve_service import FACTS, make_service, one

from rmm.cli import main
from rmm.data import load_dataset
from rmm.errors import RmmError
from rmm.eval.benchmark_bank import RetrieverName, fill, open_retriever, parse_retriever
from rmm.memory.bank import MemoryBank
from rmm.memory.bm25 import BM25Retriever
from rmm.memory.hybrid import HybridRetriever
from rmm.policy.learner import Learner, LearnerConfig
from rmm.policy.reranker import ResidualLinearReranker
from rmm.serve.records import NewMemory
from rmm.types import Dataset

QUERIES = ["feline", "Pixel the piano cat", "sleeps", "music at night", "nothing matches zzzq"]


class NormalizedBagOfWords(BagOfWordsEncoder):
    """The hashed bag of words as a benchmark bank loads it: a passage-cache hook and a config."""

    passage_cache = None
    config = SimpleNamespace(normalize=True)


@pytest.fixture
def fake_minilm(tmp_path, monkeypatch):
    """Every encoder name loads the bag of words (no model weights), in a cache of this test's own."""
    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))
    import rmm.eval.benchmark_bank

    monkeypatch.setattr(rmm.eval.benchmark_bank, "load_encoder", lambda name, **kw: NormalizedBagOfWords())


def test_names_parse_once_for_every_command() -> None:
    assert parse_retriever("bm25") == RetrieverName(None)
    assert parse_retriever("minilm") == RetrieverName("minilm")
    assert parse_retriever("bm25:minilm") == RetrieverName("minilm", "lexical")
    assert parse_retriever("bm25:/models/e5") == RetrieverName("/models/e5", "lexical")
    assert parse_retriever("hybrid") == RetrieverName("minilm", "rrf")
    for bad in ("", "bm25:", "bm25:bm25", "bm25:hybrid", "bm25:hybrid:e5", "hybrid:bm25:minilm", "bm25:bm25:e5"):
        with pytest.raises(RmmError):
            parse_retriever(bad)


def test_bm25_over_the_bank_ranks_exactly_as_plain_bm25(bank: MemoryBank) -> None:  # noqa: F811
    plain = BM25Retriever(bank.store)
    over = HybridRetriever(bank, fusion="lexical", depth=4)
    for k in (1, 3, 7):
        for mine, theirs in zip(over.search(QUERIES, "u", k), plain.search(QUERIES, "u", k)):
            assert mine.memory_ids == theirs.memory_ids  # same ids, same order
            assert torch.equal(mine.retriever_scores, theirs.retriever_scores)  # BM25's own scores
            assert mine.embeddings is not None and mine.embeddings.shape == (len(mine), bank.dim)
            if len(mine):
                assert torch.equal(mine.embeddings, bank.embeddings("u", mine.memory_ids))
    (none,) = over.search(["nothing matches zzzq"], "u", 3)
    assert none.memory_ids == [] and none.embeddings.shape == (0, bank.dim) and none.lexical.shape == (0,)


def test_candidates_carry_the_query_vector_and_bm25_scaled_to_one(bank: MemoryBank) -> None:  # noqa: F811
    query = "Pixel plays piano music on the boat in the Alps"  # four BM25 matches, one more than the depth
    over = HybridRetriever(bank, fusion="lexical", depth=3)
    (c,) = over.search([query], "u", 4)  # k above the depth
    assert torch.allclose(c.query_embedding, ConceptEncoder().encode_queries([query])[0])
    # The feature is BM25's score min-max scaled over BM25's list at the depth (3, not k); below it, 0.
    (deep,) = BM25Retriever(bank.store).search([query], "u", 4)
    assert c.memory_ids == deep.memory_ids and len(deep) == 4
    lo, hi = float(deep.retriever_scores[:3].min()), float(deep.retriever_scores[:3].max())
    assert torch.allclose(c.lexical, ((c.retriever_scores - lo) / (hi - lo)).clamp(min=0.0))
    assert float(c.lexical[0]) == 1.0 and 0.0 < float(c.lexical[1]) < 1.0 and c.lexical[2:].tolist() == [0.0, 0.0]
    (first,) = over.search([query], "u", 2)  # the scale does not move with k
    assert first.memory_ids == c.memory_ids[:2] and torch.equal(first.lexical, c.lexical[:2])
    # The learned-query search (scope bank) ranks by BM25 too; without the text it is the dense search.
    (again,) = over.search_embeddings(c.query_embedding[None], "u", 4, queries=[c.query])
    assert again.memory_ids == c.memory_ids and torch.equal(again.lexical, c.lexical)
    (dense,) = over.search_embeddings(c.query_embedding[None], "u", 2)
    assert dense.memory_ids == bank.search([c.query], "u", 2)[0].memory_ids and dense.lexical is None


def test_open_retriever_bm25_dense_is_plain_bm25_at_every_granularity(tiny_data_dir: Path, fake_minilm) -> None:
    dataset = load_dataset("locomo", data_dir=tiny_data_dir)
    for granularity in ("turn", "session"):
        over = open_retriever("bm25:minilm", dataset, granularity, progress=False)
        plain = open_retriever("bm25", dataset, granularity, progress=False)
        assert isinstance(over.retriever, HybridRetriever) and over.retriever.fusion == "lexical"
        assert over.encoder is not None and plain.encoder is None
        for q in dataset.questions:
            (mine,) = over.retriever.search([q.text], q.user_id, 5)
            (theirs,) = plain.retriever.search([q.text], q.user_id, 5)
            assert mine.memory_ids == theirs.memory_ids and mine.embeddings is not None
    # Topic memories live in a dense bank: plain bm25 is refused there and pointed at bm25:DENSE.
    with pytest.raises(RmmError, match="bm25:DENSE"):
        open_retriever("bm25", dataset, "topic", progress=False)
    topic = open_retriever("bm25:minilm", dataset, "topic", progress=False)
    retriever = topic.retriever
    assert isinstance(retriever, HybridRetriever) and retriever.fusion == "lexical"
    user = dataset.questions[0].user_id
    assert {m.kind for m in retriever.memories(user)} == {"topic"}
    texts = BM25Retriever(retriever.store)
    for q in dataset.questions:
        (mine,) = retriever.search([q.text], q.user_id, 5)
        assert mine.memory_ids == texts.search([q.text], q.user_id, 5)[0].memory_ids


def keyword_problem(n_users: int = 3, n_questions: int = 12) -> tuple[Dataset, TableEncoder]:
    """Each question names a keyword; two short decoys repeat it (BM25 ranks them first) while the
    gold turn says it once in a long sentence, but only the gold's embedding matches the question's:
    BM25 orders these candidates wrong and a reranker over their embeddings can put them right."""
    def make(u: int, j: int, g: torch.Generator) -> Made:
        word = f"zq{u}x{j}"
        topic = torch.nn.functional.normalize(torch.randn(12, generator=g), dim=0)
        gold = (f"{word} came up once in a long story about travel cooking weather and friends", topic)
        decoys = [(text, torch.nn.functional.normalize(torch.randn(12, generator=g), dim=0))
                  for text in (f"{word} {word} indeed", f"{word} {word} again")]
        return f"what about {word}", topic, [gold, *decoys]
    return three_turn_dataset(n_users, n_questions, make)


def test_rmm_train_reranks_bm25_candidates(tmp_path: Path) -> None:
    dataset, encoder = keyword_problem()
    with MemoryBank(tmp_path / "bank", encoder, device="cpu") as keyword_bank:
        fill(keyword_bank, dataset, "turn", progress=False)
        over = HybridRetriever(keyword_bank, fusion="lexical")
        q = dataset.questions[0]
        (c,) = over.search([q.text], q.user_id, 3)
        assert c.memory_ids[-1] == f"{q.user_id}:D0:0" and c.lexical is not None  # BM25 puts the gold last
        cfg = OnlineConfig(tau=0.2, baseline="mean", lr=0.05, k=3, m=1, eval_k=1, heldout_fraction=0.25)
        report = OnlineTrainer(dataset, over, cfg, progress=False).run()
    assert report.retriever_heldout["recall@1"] == 0.0  # BM25's first is always a decoy
    assert report.reranker_heldout["recall@1"] >= 0.9  # the trained reranker puts the gold first
    assert report.learner["step"] > 0 and report.config["lexical_feature"]


def test_rmm_eval_and_train_take_bm25_dense(tiny_data_dir: Path, tmp_path: Path, fake_minilm) -> None:
    out = tmp_path / "train.json"
    assert main(["train", "--data-dir", str(tiny_data_dir), "--retriever", "bm25:minilm", "--k", "4", "--m", "2",
                 "--heldout", "0.34", "--device", "cpu", "--json", str(out)]) == 0
    assert "recall@2" in json.loads(out.read_text())["reranker_heldout"]  # read at M = 2
    encoder = NormalizedBagOfWords()
    reranker = ResidualLinearReranker(encoder.dim, lexical_feature=True, lexical_init=0.0)
    with torch.no_grad():
        reranker.W_q.weight.copy_(-2 * torch.eye(encoder.dim))  # q' = −q: reverses the embedding order
    folder = Learner(reranker, LearnerConfig(), encoder_name=encoder.fingerprint).save(tmp_path / "reranker")
    out = tmp_path / "eval.json"
    assert main(["eval", "--data-dir", str(tiny_data_dir), "--retriever", "bm25:minilm", "bm25", "--k", "1", "3",
                 "8", "--json", str(out)]) == 0
    reports = json.loads(out.read_text())
    base = reports["bm25:minilm/turn"]["overall"]
    assert base == reports["bm25/turn"]["overall"]  # BM25 over the dense bank scores as plain BM25
    # BM25 finds one turn per tiny question; a decoy that repeats each question gives it several, the
    # decoy first (base recall@1 0) and the gold, less like the question, before it once q' = −q.
    question_decoys(tiny_data_dir / "locomo" / "locomo10.json")
    out = tmp_path / "reranked.json"
    assert main(["eval", "--data-dir", str(tiny_data_dir), "--retriever", "bm25:minilm", "--k", "1", "3",
                 "--depth", "8", "--reranker", str(folder), "--json", str(out)]) == 0
    reports = json.loads(out.read_text())
    base = reports["bm25:minilm/turn"]["overall"]
    reranked = reports["bm25:minilm/turn+reranker"]["overall"]
    assert reranked["recall@8"] == pytest.approx(base["recall@8"]) == 1.0  # the same candidates, reranked
    assert base["recall@1"] == 0.0 and reranked["recall@1"] > 0.5  # in the reversed order, not BM25's
    out = tmp_path / "topic.json"
    assert main(["eval", "--data-dir", str(tiny_data_dir), "--retriever", "bm25:minilm", "--granularity", "topic",
                 "--k", "5", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["granularity"] == "topic"


def question_decoys(path: Path) -> None:
    """Rewrite a tiny LoCoMo file so that the filler after each stated topic repeats its question."""
    data = json.loads(path.read_text())
    for conversation in data:
        asked = {q["evidence"][0]: q["question"] for q in conversation["qa"] if q["category"] != 5}
        for key, turns in conversation["conversation"].items():
            if not (key.startswith("session_") and isinstance(turns, list)):
                continue
            for turn in turns:
                session, number = turn["dia_id"].split(":")
                if int(number) % 2 == 0:
                    turn["text"] = asked[f"{session}:{int(number) - 1}"]
    path.write_text(json.dumps(data))


def test_bad_names_are_one_line_and_exit_2(tiny_data_dir: Path, tmp_path: Path, capsys, fake_minilm) -> None:
    with pytest.raises(SystemExit) as exit_chat:
        main(["chat", "--bank", str(tmp_path / "b"), "--user", "u", "--llm", "x", "--retriever", "bm25:"])
    assert exit_chat.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --retriever: bm25:DENSE needs a dense encoder preset" in err and "Traceback" not in err
    for command in (["eval", "--retriever", "minilm", "bm25:hybrid"], ["train", "--retriever", "bm25:bm25"],
                    ["eval-qa", "--retriever", "hybrid:"], ["eval-controller", "--retriever", "bm25:"]):
        with pytest.raises(SystemExit) as parsed:  # refused while parsing, before any retriever is opened
            main([*command, "--data-dir", str(tiny_data_dir), "--device", "cpu"])
        assert parsed.value.code == 2
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and "error: argument --retriever:" in err and "Traceback" not in err, err
    assert main(["eval", "--retriever", "bm25", "--granularity", "topic", "--data-dir", str(tiny_data_dir),
                 "--device", "cpu"]) == 2  # a valid name at a granularity it cannot serve: refused at run time
    printed = capsys.readouterr().out
    flat = " ".join(printed.split())  # the console wraps one long line at its width
    assert flat.startswith("error:") and flat.count("error:") == 1 and "Traceback" not in printed, printed
    assert "bm25:DENSE" in flat
    assert not (tmp_path / "b").exists()  # refused before a bank was made


def test_serve_retriever_bm25_reranks_bm25_over_the_bank(tmp_path: Path) -> None:
    service = make_service(tmp_path, retriever="bm25")
    try:
        first_stage = service.retriever.first_stage
        assert isinstance(first_stage, HybridRetriever) and first_stage.fusion == "lexical"
        service.add_memories("alpha", "ana", [NewMemory(text=t, id=f"f{i}") for i, t in enumerate(FACTS)])
        plain = BM25Retriever(service.bank.store)
        (expected,) = plain.search(["sourdough bread on Sundays"], "alpha:ana", 5)
        result = one(service, "ana", "sourdough bread on Sundays", k=5, m=1)
        assert [m.id for m in result.memories] == expected.memory_ids[:1] == ["f1"]
    finally:
        service.close()



def test_chat_over_bm25_of_its_own_bank(tmp_path: Path, monkeypatch, capsys, fakes) -> None:  # noqa: F811
    folder = tmp_path / "bank"
    asked: list[tuple[str, list[str]]] = []
    search = HybridRetriever.search

    def spy(self, queries, user, k):
        asked.append((self.fusion, list(queries)))
        return search(self, queries, user, k)

    monkeypatch.setattr(HybridRetriever, "search", spy)
    drive(monkeypatch, ["I play the cello in an orchestra", "/end", "What instrument do I play cello?", "/quit"])
    assert main(["chat", "--bank", str(folder), "--user", "ana", "--llm", "scripted", "--device", "cpu",
                 "--retriever", "bm25"]) == 0
    assert "cited: The user plays the cello" in capsys.readouterr().out  # reflected mid-chat, found by BM25
    assert asked == [("lexical", ["What instrument do I play cello?"])]
    assert json.loads((folder / "reranker" / "meta.json").read_text())["stats"]["records"] == 1  # and learned from


def test_eval_qa_takes_bm25_dense(tiny_data_dir: Path, tmp_path: Path, monkeypatch, fake_minilm) -> None:
    fusions: list[str] = []
    search = HybridRetriever.search

    def spy(self, queries, user, k):
        fusions.append(self.fusion)
        return search(self, queries, user, k)

    monkeypatch.setattr(HybridRetriever, "search", spy)
    out = tmp_path / "qa.json"
    assert main(["eval-qa", "--data-dir", str(tiny_data_dir), "--llm", "simulated", "--retriever", "bm25:minilm",
                 "--limit", "4", "--k", "4", "--m", "2", "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["overall"]["n"] == 4 and fusions == ["lexical"] * 4


def test_commands_that_rerank_refuse_plain_bm25_while_parsing(tiny_data_dir: Path, tmp_path: Path, capsys,
                                                              monkeypatch) -> None:
    """train, eval-qa, eval-controller and eval --reranker rescore embeddings: plain bm25 is one
    `error:` line pointing to bm25:DENSE, before any dataset is read or retriever evaluated."""
    import rmm.eval.benchmark_bank

    def never(*args, **kwargs):
        raise AssertionError("a retriever was opened")

    monkeypatch.setattr(rmm.eval.benchmark_bank, "open_retriever", never)
    for command in (["train", "--retriever", "bm25"], ["eval-qa", "--llm", "simulated", "--retriever", "bm25"],
                    ["eval-controller", "--llm", "simulated", "--retriever", "bm25"],
                    ["eval", "--retriever", "minilm", "bm25", "--reranker", str(tmp_path / "r")]):
        with pytest.raises(SystemExit) as parsed:
            main([*command, "--data-dir", str(tiny_data_dir), "--device", "cpu"])
        assert parsed.value.code == 2
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and "plain bm25 has none; use bm25:DENSE" in err and "Traceback" not in err, err
    # Without --reranker, rmm eval reads plain bm25 as before.
    monkeypatch.undo()
    assert main(["eval", "--retriever", "bm25", "--k", "1", "--data-dir", str(tiny_data_dir), "--device", "cpu"]) == 0


def test_a_config_that_names_plain_bm25_is_refused_with_the_same_line(tiny_data_dir: Path, tmp_path: Path,
                                                                      capsys) -> None:
    config = tmp_path / "train.yaml"
    config.write_text("retriever: bm25\n")
    with pytest.raises(SystemExit) as parsed:  # a config's value goes through the same argument type
        main(["train", "--config", str(config), "--data-dir", str(tiny_data_dir), "--device", "cpu"])
    err = capsys.readouterr().err
    assert parsed.value.code == 2 and err.count("error:") == 1 and "plain bm25 has none; use bm25:DENSE" in err, err
