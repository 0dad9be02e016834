"""`rmm eval-controller --users heldout|train` and `--user ID`: which users' questions a controller is
scored on (rmm train's split), with CompassMem's LLM-free heuristic search and the simulated LLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import BagOfWordsEncoder

from rmm.cli import build_parser, main
from rmm.cli.eval_controller import questions_of, select_users
from rmm.data import load_locomo
from rmm.errors import RmmError
from rmm.training.splits import hold_out_users

HEURISTIC = ["eval-controller", "--frontend", "compass", "--policy", "heuristic", "--threshold", "0.0",
             "--llm", "simulated", "--category", "1", "--k", "4", "--m", "2", "--start-k", "2", "--pool", "6",
             "--device", "cpu"]


@pytest.fixture
def offline(tmp_path, monkeypatch) -> None:
    """Bag-of-words encoders and a fresh bank cache (the simulated LLM is the real one)."""
    import rmm.encoders
    import rmm.eval.benchmark_bank

    monkeypatch.setattr(rmm.encoders, "load_encoder", lambda name, **kw: BagOfWordsEncoder())
    monkeypatch.setattr(rmm.eval.benchmark_bank, "load_encoder", lambda name, **kw: BagOfWordsEncoder())
    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))


def _run(tiny_data_dir: Path, out: Path, *extra: str) -> dict:
    assert main([*HEURISTIC, "--data-dir", str(tiny_data_dir), "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def _user(row: dict) -> str:
    return row["id"].rsplit(":", 1)[0]


def test_heldout_reads_only_the_held_out_users_questions(tiny_data_dir, tmp_path, capsys, offline) -> None:
    dataset = load_locomo(tiny_data_dir / "locomo" / "locomo10.json")
    held, kept = hold_out_users(dataset.users, 0.3, 0)  # rmm train's defaults
    traces = tmp_path / "held.jsonl"
    report = _run(tiny_data_dir, tmp_path / "held.json", "--users", "heldout", "--trace-json", str(traces))
    assert report["users"] == held and report["user_set"] == "heldout"
    assert (report["heldout"], report["seed"]) == (0.3, 0)
    expected = [q.id for q in dataset.questions if q.user_id in held and q.category == 1 and q.evidence_turns]
    assert [row["id"] for row in report["rows"]] == expected and report["n"] == len(expected) > 0
    assert {_user(row) for row in report["rows"]} == set(held)
    assert len(traces.read_text().splitlines()) == report["n"]  # no trace of a training user's question
    assert f"users {', '.join(held)}" in " ".join(capsys.readouterr().out.split())

    train = _run(tiny_data_dir, tmp_path / "train.json", "--users", "train")
    assert train["users"] == [u for u in dataset.users if u in kept]
    assert not {_user(row) for row in train["rows"]} & set(held)
    everyone = _run(tiny_data_dir, tmp_path / "all.json")  # the default: every user, as before
    assert everyone["users"] == dataset.users and everyone["user_set"] == "all" and "seed" not in everyone
    by_id = {row["id"]: row for row in everyone["rows"]}
    assert sorted(by_id) == sorted(row["id"] for row in report["rows"] + train["rows"])
    for row in report["rows"]:  # same bank, same search: a user's rows do not depend on who else is scored
        assert row["compass_ids"] == by_id[row["id"]]["compass_ids"]
        assert row["recall_compass"] == by_id[row["id"]]["recall_compass"]


def test_user_narrows_to_the_named_users(tiny_data_dir, tmp_path, offline) -> None:
    report = _run(tiny_data_dir, tmp_path / "one.json", "--user", "conv-2", "--user", "conv-0", "--user", "conv-2")
    assert report["users"] == ["conv-0", "conv-2"]  # dataset order, once each
    assert {_user(row) for row in report["rows"]} == {"conv-0", "conv-2"} and report["n"] > 0


def test_an_unknown_user_exits_2_with_one_line(tiny_data_dir, tmp_path, capsys, offline) -> None:
    out = tmp_path / "never.json"
    assert main([*HEURISTIC, "--data-dir", str(tiny_data_dir), "--json", str(out), "--user", "conv-99"]) == 2
    printed = capsys.readouterr().out.strip()
    assert len(printed.splitlines()) == 1 and "no user conv-99" in printed and "conv-0" in printed
    assert not out.exists() and not (tmp_path / "cache").exists()  # refused before any bank was built


def test_a_named_user_outside_the_split_is_refused(tiny_data_dir, tmp_path, capsys, offline) -> None:
    dataset = load_locomo(tiny_data_dir / "locomo" / "locomo10.json")
    held, kept = hold_out_users(dataset.users, 0.3, 0)
    assert main([*HEURISTIC, "--data-dir", str(tiny_data_dir), "--users", "heldout", "--user", kept[0]]) == 2
    printed = capsys.readouterr().out.strip()
    assert len(printed.splitlines()) == 1 and f"--user {kept[0]}: not a heldout user" in printed
    with pytest.raises(RmmError) as refused:  # one line however long the split's user list
        select_users(dataset, "train", [*kept, *held], 0.3, 0)
    assert "\n" not in str(refused.value) and str(refused.value).startswith(f"--user {', '.join(held)}: not a train")


def test_select_users_splits_as_rmm_train_does(tiny_data_dir) -> None:
    dataset = load_locomo(tiny_data_dir / "locomo" / "locomo10.json")
    for seed in (0, 1, 7):
        held, _ = hold_out_users(dataset.users, 0.5, seed)
        heldout = select_users(dataset, "heldout", None, 0.5, seed)
        train = select_users(dataset, "train", None, 0.5, seed)
        assert sorted(heldout) == sorted(held) and not set(heldout) & set(train)
        assert sorted(heldout + train) == sorted(dataset.users)
        assert heldout == [u for u in dataset.users if u in heldout]  # dataset order
    assert select_users(dataset, "all", None, 0.3, 0) == dataset.users
    narrowed = questions_of(dataset, ["conv-1"])
    assert narrowed.sessions == dataset.sessions  # the bank is the one over every user
    assert {q.user_id for q in narrowed.questions} == {"conv-1"} and narrowed.questions
    with pytest.raises(RmmError, match="only 1 user"):
        select_users(questions_of(type(dataset)(dataset.name, {"conv-0": dataset.sessions["conv-0"]}, []),
                                  ["conv-0"]), "heldout", None, 0.3, 0)
    with pytest.raises(RmmError, match="--users must be one of"):
        select_users(dataset, "everyone", None, 0.3, 0)


def test_split_defaults_are_rmm_trains() -> None:
    parser = build_parser()
    train = parser.parse_args(["train"])
    controller = parser.parse_args(["eval-controller", "--llm", "x"])
    assert (controller.heldout, controller.seed) == (train.heldout, train.seed)
    assert controller.users == "all" and controller.user is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--users", "some"], "--users"),
    (["--heldout", "1"], "--heldout"),
    (["--seed", "-1"], "--seed"),
])
def test_bad_selection_flags_are_refused_at_parse_time(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["eval-controller", "--llm", "x", *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err
