"""`--frontend memr3` in `rmm chat`, `rmm eval-qa` and `rmm eval-controller`, with a scripted LLM; the
front-end options checked at parse time; LoCoMo read with MemR³'s dedup by the QA commands."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from fakes import BagOfWordsEncoder, ScriptedMemR3LLM, drive
from rich.console import Console

import rmm.encoders
import rmm.llm
from rmm.cli import build_parser, main
from rmm.cli.eval_controller import controller_figures
from rmm.cli.eval_qa import load_questions
from rmm.cli.tables import print_figures
from rmm.eval.controller_recall import ControllerRecallReport
from rmm.memory.bank import MemoryBank
from rmm.types import Memory


def _generate(prompt: str) -> str:
    """First call: retrieve with a refinement; then answer, citing the first snippet shown."""
    if "# Prior Query\nNone" in prompt:
        return json.dumps({"evidence": [], "gaps": ["more detail"], "decision": "retrieve",
                           "retrieval_query": "more about it"})
    first = re.search(r"^\[M(\d+)\] (.*)$", prompt.split("# Memory snippets\n", 1)[1], re.MULTILINE)
    evidence = [f"{first.group(2)[:60]} [M{first.group(1)}]"] if first else []
    return json.dumps({"evidence": evidence, "gaps": [], "decision": "answer", "detailed_answer": "yes"})


@pytest.fixture
def scripted(monkeypatch) -> list[ScriptedMemR3LLM]:
    made: list[ScriptedMemR3LLM] = []

    def load_llm(spec: str, **options):
        if spec == "simulated":
            from rmm.llm.simulated import SimulatedLLM

            return SimulatedLLM()
        made.append(ScriptedMemR3LLM(generate=[_generate], answer=["Yes, that is right. [0]"]))
        return made[-1]

    monkeypatch.setattr(rmm.llm, "load_llm", load_llm)
    monkeypatch.setattr(rmm.encoders, "load_encoder", lambda name, **kw: BagOfWordsEncoder())
    return made


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))
    import rmm.eval.benchmark_bank

    monkeypatch.setattr(rmm.eval.benchmark_bank, "load_encoder", lambda name, **kw: BagOfWordsEncoder())


def test_chat_through_memr3_prints_the_trace_saves_it_and_learns(tmp_path: Path, monkeypatch, capsys,
                                                                   scripted) -> None:
    bank_path = tmp_path / "bank"
    with MemoryBank(bank_path, BagOfWordsEncoder(), device="cpu") as bank:
        bank.add("ana", [Memory(id=f"m{i}", user_id="ana", kind="topic", text=text) for i, text in
                         enumerate(["Ana plays the cello in an orchestra", "Ana bakes sourdough bread",
                                    "Ana hikes on weekends", "Ana reads detective novels"])])
    traces = tmp_path / "traces.jsonl"
    drive(monkeypatch, ["Does Ana play the cello in an orchestra?", "/quit"])
    assert main(["chat", "--bank", str(bank_path), "--user", "ana", "--llm", "hf:whatever", "--device", "cpu",
                 "--frontend", "memr3", "--n-chk", "2", "--n-max", "3", "--k", "4", "--m", "2",
                 "--trace-json", str(traces), "-v"]) == 0
    out = capsys.readouterr().out
    assert "assistant> Yes, that is right." in out and "cited:" in out
    assert "iteration 1" in out and "iteration 2" in out and "n_chk 2, n_cap 1" in out and "3 LLM calls" in out
    assert scripted[0].kinds == ["generate", "generate", "answer"]
    (line,) = traces.read_text().splitlines()
    trace = json.loads(line)
    assert trace["outcome"] == "answered" and trace["usage"]["calls"] == 3 and len(trace["retrieved"]) == 4
    assert trace["iterations"][0]["retrieval"]["query"].endswith("more about it")
    meta = json.loads((bank_path / "reranker" / "meta.json").read_text())
    assert meta["stats"]["records"] == 2  # both retrievals' selections reached the shared reranker


def test_eval_qa_through_memr3(tiny_data_dir, tmp_path, capsys, scripted, isolated_cache) -> None:
    out, traces = tmp_path / "qa.json", tmp_path / "traces.jsonl"
    assert main(["eval-qa", "--data-dir", str(tiny_data_dir), "--llm", "hf:x", "--frontend", "memr3", "--limit", "3",
                 "--k", "4", "--m", "2", "--n-chk", "2", "--device", "cpu", "--json", str(out),
                 "--trace-json", str(traces), "--show-trace"]) == 0
    printed = capsys.readouterr().out
    assert "MemR³ front end" in printed and "iteration 2" in printed
    report = json.loads(out.read_text())
    assert report["frontend"] == "memr3" and report["overall"]["n"] == 3
    assert all(row["trace"]["outcome"] == "answered" and row["prediction"] == "Yes, that is right."
               for row in report["rows"])
    assert report["reranker"]["records"] == 6  # two retrievals per question, each rewarded
    assert [json.loads(line)["question"] for line in traces.read_text().splitlines()] == \
        [row["question"] for row in report["rows"]]


def test_eval_controller_compares_memr3_with_a_direct_query(tiny_data_dir, tmp_path, capsys, scripted,
                                                            isolated_cache) -> None:
    out = tmp_path / "memr3.json"
    assert main(["eval-controller", "--frontend", "memr3", "--data-dir", str(tiny_data_dir), "--llm", "hf:x",
                 "--category", "1", "--k", "4", "--m", "2", "--n-chk", "2", "--device", "cpu",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "MemR³" in printed and "memr3" in printed and "answered" in printed  # headers may wrap
    report = json.loads(out.read_text())
    assert report["frontend"] == "memr3" and report["n"] == 6 and report["answered"] == 1.0
    assert report["config"]["n_chk"] == 2 and report["config"]["answer"] is False
    for row in report["rows"]:
        gold = set(row["gold_turns"])
        assert row["n_memories"] == len(row["memr3_ids"]) == len(row["direct_ids"]) == 4  # two retrievals of 2
        assert row["recall_memr3"] == len(gold & set(row["memr3_ids"])) / len(gold)
        assert row["recall_direct"] == len(gold & set(row["direct_ids"])) / len(gold)
        assert row["answer"] is None and row["llm_calls"] == 2  # two generate calls, no answer call
    assert report["recall_memr3"] == sum(r["recall_memr3"] for r in report["rows"]) / 6


def test_the_memr3_table_keeps_every_figure_within_80_columns() -> None:
    report = ControllerRecallReport("locomo", "hf:/models/smollm2", 1, 10, 0.25, 0.3, 21.0, 0.1, 6.0, 9876, 654, 31.5,
                                    frontend="memr3")
    out = io.StringIO()
    print_figures(controller_figures(report), Console(file=out, width=80))
    lines = out.getvalue().splitlines()
    assert max(map(len, lines)) <= 80
    assert any(all(cell in line for cell in ("10", "25.0", "30.0", "21.0", "9876", "654", "31.5")) for line in lines)
    assert report.to_json()["recall_memr3"] == 0.25 and report.to_json()["answered"] == 0.1


def test_memr3_refuses_the_simulated_llm(tiny_data_dir, tmp_path, capsys, scripted) -> None:
    for argv in (["eval-controller", "--frontend", "memr3"], ["eval-qa", "--frontend", "memr3"]):
        assert main([*argv, "--data-dir", str(tiny_data_dir), "--llm", "simulated", "--device", "cpu"]) == 2
        assert "cannot write evidence, gaps or decisions" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(("argv", "named"), [
    (["eval-controller", "--frontend", "memr3", "--n-max", "0"], "--n-max"),
    (["eval-qa", "--frontend", "memr3", "--n-chk", "-2"], "--n-chk"),
    (["eval-qa", "--frontend", "memr3", "--n-cap", "one"], "--n-cap"),
    (["eval-controller", "--n-max", "3"], "--n-max is a MemR³ option: it needs --frontend memr3 (got goal)"),
    (["eval-qa", "--frontend", "memr3", "--budget", "10"], "--budget is a GOAL-MEM option"),
    (["eval-qa", "--trace-json", "t.jsonl"], "--trace-json shows the goal or memr3 front end's traces"),
    (["eval-controller", "--frontend", "direct"], "--frontend"),
])
def test_front_end_options_are_checked_at_parse_time(argv, named, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--llm", "x"])
    assert exited.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"rmm {argv[0]}") and named in errors[0]


def test_memr3_options_reach_its_config() -> None:
    from rmm.cli.frontend_options import frontend_config
    from rmm.frontends.memr3 import MemR3Config

    parser = build_parser()
    config = frontend_config(parser.parse_args(["eval-qa", "--llm", "x", "--frontend", "memr3", "--n-max", "2",
                                                "--n-cap", "3"]))
    assert config == MemR3Config(n_max=2, n_cap=3)  # n_chk: the paper's 5
    assert frontend_config(parser.parse_args(["chat", "--bank", "b", "--user", "u", "--llm", "x"])) is None


def test_eval_goal_is_not_a_command() -> None:
    """`eval-goal` was eval-controller's name before any release: no alias is kept."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval-goal", "--llm", "x"])
    args = build_parser().parse_args(["eval-controller", "--llm", "x", "--b-max", "2"])
    assert args.frontend == "goal" and args.b_max == 2 and args.func.__module__ == "rmm.cli.eval_controller"


# -- LoCoMo with MemR³'s dedup ------------------------------------------------------------------------
def test_qa_commands_read_the_real_locomo_file_without_its_repeated_questions(data_root: Path) -> None:
    parser = build_parser()

    def counts(*flags: str) -> dict[int, int]:
        args = parser.parse_args(["eval-qa", "--llm", "x", "--data-dir", str(data_root), "--no-download", *flags])
        found: dict[int, int] = {}
        for q in load_questions(args).questions:
            found[q.category] = found.get(q.category, 0) + 1
        return dict(sorted(found.items()))

    assert counts() == {1: 282, 2: 321, 3: 96, 4: 830, 5: 445}  # MemR³ App. C.3
    assert counts("--no-dedup") == {1: 282, 2: 321, 3: 96, 4: 841, 5: 446}
    path = data_root / "locomo" / "locomo10.json"
    assert counts("--dataset", f"locomo:{path}") == {1: 282, 2: 321, 3: 96, 4: 830, 5: 445}


def test_eval_qa_drops_a_repeated_question_unless_told_not_to(tiny_data_dir, tmp_path, isolated_cache,
                                                             scripted) -> None:
    path = tiny_data_dir / "locomo" / "locomo10.json"
    data = json.loads(path.read_text())
    data[0]["qa"].append(dict(data[0]["qa"][0], question="  " + data[0]["qa"][0]["question"]))  # same words
    path.write_text(json.dumps(data))

    def answered(*flags: str) -> int:
        out = tmp_path / "qa.json"
        assert main(["eval-qa", "--data-dir", str(tiny_data_dir), "--llm", "simulated", "--device", "cpu",
                     "--json", str(out), *flags]) == 0
        return sum(row["n"] for row in json.loads(out.read_text())["by_category"].values())

    assert answered("--no-dedup") == answered() + 1
