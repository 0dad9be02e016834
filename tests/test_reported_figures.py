"""Every figure `rmm train` / `rmm eval` print means what it says (issue 35, items 2, 3, 9, 10):
figures read at M, the memories the generator is shown; one LoCoMo question set for every command,
its size in every caption; a split and a learning line a person can read; the ablation script's
baseline on its run's own configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rmm.cli import build_parser, main
from rmm.cli.common import load_benchmark
from rmm.eval.benchmark_bank import open_retriever
from rmm.eval.retrieval import GoldScorer, scorable
from rmm.training.online import OnlineConfig
from rmm.training.online_report import same_question_lift, split_summary
from rmm.training.splits import split_questions
from rmm.types import Dataset, Question, Session, Turn

REPORTS = ("retriever", "reranker_prequential", "retriever_heldout", "reranker_heldout", "reranker_heldout_whole_bank")


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def repeated_data_dir(tiny_data_dir: Path) -> Path:
    """The tiny LoCoMo file with one question asked twice in conv-0 (same words, other spacing)."""
    path = tiny_data_dir / "locomo" / "locomo10.json"
    data = json.loads(path.read_text())
    data[0]["qa"].append(dict(data[0]["qa"][0], question="  " + data[0]["qa"][0]["question"]))
    path.write_text(json.dumps(data))
    return tiny_data_dir


def _captions(printed: str) -> str:
    return " ".join(printed.split())  # rich wraps captions over lines


# -- item 2: figures at M ---------------------------------------------------------------------------
@pytest.mark.parametrize("m", [3, 8])
def test_train_reads_every_figure_at_m_and_the_ceiling_at_k(repeated_data_dir, tmp_path, capsys, m) -> None:
    out = tmp_path / "train.json"
    flags = ["--no-dedup"] if m == 8 else []
    assert main(["train", "--data-dir", str(repeated_data_dir), "--device", "cpu", "--k", "10", "--m", str(m),
                 "--heldout", "0.34", "--json", str(out), *flags]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["eval_k"] == m
    for key in REPORTS:  # the whole-bank row included: it shows M memories, so only recall@M can count them
        assert f"recall@{m}" in report[key] and "recall@5" not in report[key], key
    assert report["headroom"]["m"] == m and report["headroom"]["k"] == 10
    held = report["headroom"]["heldout"]
    assert held[f"reranker_recall@{m}"] == report["reranker_heldout"][f"recall@{m}"]
    assert held["retriever_recall@10"] == report["retriever_heldout"]["recall@10"]
    printed = capsys.readouterr().out
    caption = _captions(printed)
    assert f"held-out recall@{m}, whole-bank search" in printed and f"held-out recall@10 = ceiling" in printed
    assert f"figures @{m}: among the M = {m} memories the generator is shown" in caption
    assert "recall@10: among the retriever's K = 10 candidates" in caption
    # item 3: the question set is in the caption — the repeated question dropped unless --no-dedup
    count = 28 if flags else 27
    assert report["questions"]["dataset"] == count
    kept = "(repeated ones kept: --no-dedup)" if flags else "(repeated ones dropped; --no-dedup keeps them)"
    assert f"{count} locomo questions {kept}" in caption
    # item 9: counts and a few users, every user only in the JSON; the lift on the same questions
    assert sorted(report["split_users"]["train"] + report["split_users"]["heldout"]) == ["conv-0", "conv-1", "conv-2"]
    assert "cited ratio" not in printed and "prequential recall@%d on the same questions" % m in caption


def test_eval_k_defaults_to_m_and_may_not_pass_it() -> None:
    assert OnlineConfig(m=3).eval_k == 3 and OnlineConfig(k=30, m=8).eval_k == 8
    assert OnlineConfig(m=3, eval_k=1).eval_k == 1  # a study may read the top of what is shown
    with pytest.raises(ValueError, match="eval_k"):
        OnlineConfig(m=3, eval_k=5)  # the whole-bank search shows 3: a figure at 5 would count nothing more


# -- item 3: one LoCoMo question set ----------------------------------------------------------------
def test_every_command_reads_locomo_without_its_repeats_unless_told(repeated_data_dir) -> None:
    parser = build_parser()
    common = ["--data-dir", str(repeated_data_dir), "--no-download"]
    for command in (["train"], ["eval"], ["eval-qa", "--llm", "x"], ["eval-controller", "--llm", "x"]):
        assert len(load_benchmark(parser.parse_args([*command, *common])).questions) == 27, command
        assert len(load_benchmark(parser.parse_args([*command, *common, "--no-dedup"])).questions) == 28, command


def test_eval_captions_carry_the_question_count(repeated_data_dir, tmp_path, capsys) -> None:
    def caption(*flags: str) -> str:
        out = tmp_path / "eval.json"
        assert main(["eval", "--data-dir", str(repeated_data_dir), "--retriever", "bm25", "--k", "1", "5",
                     "--json", str(out), *flags]) == 0
        return _captions(capsys.readouterr().out)

    assert "Questions: 27 locomo questions (repeated ones dropped; --no-dedup keeps them)" in caption()
    assert "Questions: 28 locomo questions (repeated ones kept: --no-dedup)" in caption("--no-dedup")
    both = caption("--granularity", "turn", "session")
    assert "memory granularity" in both and "Questions: 27 locomo questions" in both


def test_eval_qa_caption_carries_the_question_count(repeated_data_dir, tmp_path, capsys) -> None:
    assert main(["eval-qa", "--data-dir", str(repeated_data_dir), "--llm", "simulated", "--device", "cpu",
                 "--limit", "2", "--json", str(tmp_path / "qa.json")]) == 0
    assert "Questions: 27 locomo questions (repeated ones dropped" in _captions(capsys.readouterr().out)


# -- item 9: output a person can read ---------------------------------------------------------------
def _many_users(n: int) -> Dataset:
    sessions, questions = {}, []
    for u in range(n):
        user = f"user-{u:03d}"
        turn = Turn(id=f"{user}:D1:1", session_id=f"{user}:S1", speaker="a", text="t")
        sessions[user] = [Session(id=f"{user}:S1", user_id=user, turns=[turn])]
        questions.append(Question(id=f"{user}:q0", user_id=user, text="q", answer="", evidence_turns=[turn.id],
                                  evidence_sessions=[f"{user}:S1"], category=1))
    return Dataset("synthetic", sessions, questions, {1: "one"})


def test_split_summary_prints_counts_and_a_few_users_not_every_one() -> None:
    dataset = _many_users(500)
    split = split_questions(dataset, dataset.questions, OnlineConfig())
    line = split_summary(split, per_user=False)
    assert len(line) < 200, line
    assert "train on 350 users (" in line and "held out 150 users (" in line and "… 347 more" in line
    assert all(u in split.description for u in split.train_users)  # the full lists stay in the report


def test_same_question_lift_compares_both_on_the_same_questions() -> None:
    qs = [Question(id=f"q{i}", user_id="u", text="", answer="", evidence_turns=[], evidence_sessions=[])
          for i in range(20)]
    # the stream gets easier (the retriever's recall rises) while the reranker's lift grows from 0 to 0.5
    rows = {"retriever": {q.id: {"recall@3": i / 40} for i, q in enumerate(qs)},
            "reranker": {q.id: {"recall@3": i / 40 + (0.5 if i >= 18 else 0.0)} for i, q in enumerate(qs)}}
    lift = same_question_lift(rows, qs, "recall@3")
    assert lift["questions"] == 2 and lift["stream"] == 20
    assert lift["first"] == pytest.approx({"retriever": 0.5 / 40, "reranker": 0.5 / 40})
    assert lift["last"] == pytest.approx({"retriever": 18.5 / 40, "reranker": 18.5 / 40 + 0.5})
    assert same_question_lift(rows, [], "recall@3") == {}


# -- item 10: the ablation script's baseline on the run's own configuration -------------------------
def test_ablation_baseline_uses_the_runs_split_k_and_m(tiny_data_dir) -> None:
    from rmm.bench import ablations

    dataset = load_benchmark(build_parser().parse_args(["eval", "--data-dir", str(tiny_data_dir)]))
    opened = open_retriever("bm25", dataset, "turn", progress=False)
    name, _, extras, cfg = ablations.run_config("wide:k=6,m=2,heldout_fraction=0.5,lexical_init=0.1", {}, None)
    # lexical_init is an OnlineConfig field now (the learner setting), no longer a run extra
    assert (name, extras, cfg.k, cfg.m, cfg.heldout_fraction, cfg.lexical_init) == ("wide", {}, 6, 2, 0.5, 0.1)
    table = ablations.alone_table(dataset, opened.retriever, cfg)
    headline = table["headline"]
    assert {"base recall@2", "base recall@6", "base ndcg@2"} <= set(headline) and "base recall@5" not in headline
    scorer = GoldScorer.for_dataset(dataset, "turn")
    held = split_questions(dataset, scorable(dataset.questions, scorer), cfg).heldout
    default_held = split_questions(dataset, scorable(dataset.questions, scorer), OnlineConfig()).heldout
    assert len(held) != len(default_held)  # 2 of 3 conversations held out, not the default 1
    assert sum(t["questions"] for g, t in table.items() if g.startswith("category")) == len(held)
