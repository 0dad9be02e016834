"""The `rmm` command end to end on a tiny LoCoMo-schema file (real MiniLM, real SQLite bank)."""

from __future__ import annotations

import json

import pytest

from rmm.cli import main
from rmm.data import load_dataset
from rmm.eval.benchmark_bank import documents, open_retriever


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))


def test_eval_bm25_and_minilm_write_the_documented_json(tiny_data_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = main(["eval", "--data-dir", str(tiny_data_dir), "--retriever", "bm25", "--k", "1", "5",
                 "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert {"overall", "by_category"} <= set(report)
    assert report["overall"]["recall@1"] > 0.8  # each question shares words with its evidence turn
    for key in ("recall@5", "recall_any@5", "recall_all@5", "ndcg@5"):
        assert 0.0 <= report["overall"][key] <= 1.0
    assert report["by_category"]["1"]["name"] == "multi-hop"
    printed = capsys.readouterr().out
    assert "1 multi-hop" in printed and "5 adversarial" in printed

    both = tmp_path / "both.json"
    assert main(["eval", "--data-dir", str(tiny_data_dir), "--retriever", "minilm", "bm25",
                 "--granularity", "turn", "session", "--k", "5", "--json", str(both)]) == 0
    reports = json.loads(both.read_text())
    assert set(reports) == {"minilm/turn", "bm25/turn", "minilm/session", "bm25/session"}
    assert reports["minilm/turn"]["overall"]["recall@5"] > 0.8


def test_bank_is_cached_between_runs(tiny_data_dir):
    dataset = load_dataset("locomo", data_dir=tiny_data_dir)
    first = open_retriever("minilm", dataset, "turn", progress=False)
    n = sum(len(first.retriever.memories(u)) for u in dataset.users)
    assert n == sum(len(documents(dataset, u, "turn")) for u in dataset.users)
    generation = first.retriever.store.generation(dataset.users[0])
    first.retriever.close()
    second = open_retriever("minilm", dataset, "turn", progress=False)
    assert second.path == first.path
    assert second.retriever.store.generation(dataset.users[0]) == generation  # nothing re-added


def test_train_writes_report_and_plot(tiny_data_dir, tmp_path, capsys):
    out, png = tmp_path / "train.json", tmp_path / "curves.png"
    code = main(["train", "--data-dir", str(tiny_data_dir), "--json", str(out), "--plot", str(png),
                 "--k", "8", "--heldout", "0.34"])
    assert code == 0
    report = json.loads(out.read_text())
    for key in ("retriever", "reranker_prequential", "reranker_heldout", "retriever_heldout"):
        assert "recall@5" in report[key]
    assert report["citer"].startswith("simulated")
    assert report["config"]["recipe"] == "normalized"  # MiniLM is L2-normalised
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "simulated" in printed and "held-out" in printed


def test_flags_override_the_recipe(tiny_data_dir, tmp_path):
    out = tmp_path / "train.json"
    assert main(["train", "--data-dir", str(tiny_data_dir), "--json", str(out), "--k", "8", "--recipe", "paper",
                 "--lr", "0.01", "--baseline", "mean", "--heldout", "0.34"]) == 0
    cfg = json.loads(out.read_text())["config"]
    assert (cfg["recipe"], cfg["lr"], cfg["baseline"], cfg["tau"]) == ("paper", 0.01, "mean", 0.5)


def test_missing_dataset_is_one_clear_line(tmp_path, capsys):
    code = main(["eval", "--data-dir", str(tmp_path / "nowhere"), "--no-download", "--retriever", "bm25"])
    assert code == 2
    err = capsys.readouterr().out
    assert "error:" in err and "locomo" in err and "Traceback" not in err


def test_unknown_encoder_is_one_clear_line(tiny_data_dir, tmp_path, capsys):
    code = main(["eval", "--data-dir", str(tiny_data_dir), "--retriever", str(tmp_path / "no-such-model")])
    assert code == 2
    assert "error:" in capsys.readouterr().out


def test_bad_baseline_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--baseline", "half"])
    assert "expected a number or 'mean'" in capsys.readouterr().err


def test_train_learns_over_session_memories_when_asked(tiny_data_dir, tmp_path, capsys):
    out = tmp_path / "train.json"
    assert main(["train", "--data-dir", str(tiny_data_dir), "--json", str(out), "--k", "2", "--m", "1",
                 "--heldout", "0.34", "--granularity", "session"]) == 0
    report = json.loads(out.read_text())
    assert report["granularity"] == "session"
    assert "recall@1" in report["reranker_heldout"]  # read at M = 1, what the generator is shown
    assert "session memories" in capsys.readouterr().out
