"""docs/results.md's tables are one commit's measurements, each row with the command that made it
(issue 35 item 8)."""

from __future__ import annotations

import argparse
import json
import shlex

import pytest

from rmm.bench import ablation_table, ablations, results


def _row(commit: str | None, name: str = "final", **extra) -> dict:
    figures = {"questions": 10, "base recall@5": 0.4, "reranked recall@5": 0.5, "base recall@20": 0.7,
               "reranked recall@20": 0.7, "base ndcg@5": 0.3, "reranked ndcg@5": 0.4, "headroom_captured": 1 / 3,
               "base recall_turns@15": 0.45, "reranked recall_turns@15": 0.55, "base recall_turns@25": 0.6,
               "reranked recall_turns@25": 0.65}
    return {"name": name, "dataset": "locomo", "retriever": "hybrid", "granularity": "turn", "commit": commit,
            "command": "python -m rmm.bench.ablations --run final", "heldout": {"headline": figures}, **extra}


def test_a_table_refuses_rows_of_different_commits() -> None:
    with pytest.raises(SystemExit, match="2 commits"):
        ablation_table.one_commit([_row("abc"), _row("def")])
    assert ablation_table.one_commit([_row("abc"), _row("abc")]) == "abc"


def test_every_headline_row_carries_its_command_and_turn_budget_recall() -> None:
    line = ablation_table.headline_table([_row("abc")])[-1]
    assert "`python -m rmm.bench.ablations --run final`" in line
    assert "45.0 → 55.0" in line and "60.0 → 65.0" in line  # R@15t and R@25t, alone → reranked


def test_the_row_command_measures_that_row_alone() -> None:
    args = argparse.Namespace(dataset="msc", retriever="bm25:minilm", granularity="topic", limit=3000, recipe="auto",
                              no_dedup=False, strip_prefix=False, read_heldout=True, alone=False, threads=1)
    command = shlex.split(ablations.row_command(args, 'seq:credit="sequence"'))
    assert command[:3] == ["python", "-m", "rmm.bench.ablations"]
    assert command[command.index("--run") + 1] == 'seq:credit="sequence"' and command.count("--run") == 1
    for flag, value in (("--dataset", "msc"), ("--retriever", "bm25:minilm"), ("--granularity", "topic"),
                        ("--limit", "3000"), ("--threads", "1")):
        assert command[command.index(flag) + 1] == value
    assert "--read-heldout" in command and "--out" not in command


def test_a_job_is_done_only_when_every_run_has_a_row_at_this_commit(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(results, "OUT", tmp_path)
    section = results.Section("t", "prequential", (results._ablations("locomo", "hybrid", "turn", "a", "b:tau=0.1"),))
    job = section.jobs[0]
    row = {"dataset": "locomo", "retriever": "hybrid", "granularity": "turn", "limit": None}
    section.path.write_text(json.dumps({**row, "name": "a", "commit": "c1"}) + "\n")
    assert not results.done(section, job, "c1")
    with section.path.open("a") as f:
        f.write(json.dumps({**row, "name": "b", "commit": "c0"}) + "\n")
    assert not results.done(section, job, "c1")  # b was measured at another commit
    with section.path.open("a") as f:
        f.write(json.dumps({**row, "name": "b", "commit": "c1"}) + "\n")
    assert results.done(section, job, "c1")


def test_every_held_out_job_reads_held_out_and_no_training_section_does() -> None:
    for section in results.SECTIONS.values():
        for job in section.jobs:
            assert ("--read-heldout" in job.argv) == (section.name == "heldout"), (section.name, job.argv)


def test_render_rebuilds_every_table_block_from_its_json(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(results, "OUT", tmp_path)
    (tmp_path / "heldout.jsonl").write_text(json.dumps(_row("abc")) + "\n")
    doc = "intro\n<!-- table: heldout -->\n| stale | 1.0 |\n<!-- /table -->\noutro\n"
    rendered = results.render(doc)
    assert "stale" not in rendered and "Measured at commit abc" in rendered
    assert rendered.startswith("intro\n<!-- table: heldout -->\n") and rendered.endswith("<!-- /table -->\noutro\n")
    assert results.render(rendered) == rendered  # a rendered document is its own render: --check passes


def test_docs_results_tables_are_the_render_of_their_json() -> None:
    """docs/results.md's tables are built from the JSON beside it, never typed by hand."""
    doc = results.OUT.parent / "results.md"
    text = doc.read_text()
    assert "<!-- table: heldout -->" in text
    assert results.render(text) == text, "python -m rmm.bench.results render docs/results.md"
