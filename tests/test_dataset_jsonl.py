"""rmm's own dataset format (docs/dataset-format.md): reader, writer, `rmm data validate|convert`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rmm.cli import main
from rmm.data import load_dataset
from rmm.data.jsonl import JsonlDataError, dataset_records, load_jsonl, read_jsonl, write_jsonl
from rmm.errors import DataError
from rmm.types import Dataset, Question, Session, Turn


def small_dataset() -> Dataset:
    s1 = Session(id="u1:s1", user_id="u1", time="2024-05-01 10:00", turns=[
        Turn(id="u1:t1", session_id="u1:s1", speaker="Ana", text="I adopted a puppy named Rex", time="2024-05-01"),
        Turn(id="u1:t2", session_id="u1:s1", speaker="assistant", text="Congratulations! ✨")])
    s2 = Session(id="u1:s2", user_id="u1", time=None, turns=[
        Turn(id="u1:t3", session_id="u1:s2", speaker="Ana", text="Rex chewed my shoes")])
    s3 = Session(id="u2:s1", user_id="u2", turns=[Turn(id="u2:t1", session_id="u2:s1", speaker="Bo", text="hi")])
    questions = [
        Question(id="q1", user_id="u1", text="What is the puppy called?", answer="Rex", evidence_turns=["u1:t1"],
                 evidence_sessions=["u1:s1"], category=1, category_name="single-hop", time="2024-06-01"),
        Question(id="q2", user_id="u1", text="Did Ana buy a cat?", answer="", evidence_turns=[],
                 evidence_sessions=[], category=None, abstention=True),
        Question(id="q3", user_id="u2", text="What did Bo say?", answer="hi", evidence_turns=["u2:t1"],
                 evidence_sessions=["u2:s1"], category=2, category_name="other"),
    ]
    return Dataset(name="mine", sessions={"u1": [s1, s2], "u2": [s3], "u3": []}, questions=questions,
                   categories={1: "single-hop", 2: "other"})


def write_lines(path: Path, *records: dict | str) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def problems_of(path: Path) -> list[str]:
    with pytest.raises(JsonlDataError) as caught:
        read_jsonl(path)
    return [str(p) for p in caught.value.problems]


# ---- round trips ---------------------------------------------------------------------------------
def test_write_then_read_gives_an_equal_dataset(tmp_path: Path) -> None:
    dataset = small_dataset()
    path = tmp_path / "mine.jsonl"
    assert write_jsonl(dataset_records(dataset), path) == 1 + 3 + 3 + 4 + 3
    assert load_jsonl(path) == dataset
    assert load_dataset(f"jsonl:{path}") == dataset
    assert not (tmp_path / "mine.jsonl.partial").exists()


def test_a_folder_of_files_reads_as_one_dataset(tmp_path: Path) -> None:
    lines = (tmp_path / "all.jsonl")
    write_jsonl(dataset_records(small_dataset()), lines)
    rows = lines.read_text(encoding="utf-8").splitlines(keepends=True)
    folder = tmp_path / "parts"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(rows[:6]), encoding="utf-8")
    (folder / "b.jsonl").write_text("".join(rows[6:]), encoding="utf-8")
    (folder / "notes.txt").write_text("ignored")
    assert load_dataset(f"jsonl:{folder}") == small_dataset()


def test_minimal_records_take_their_defaults(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "logs.jsonl",
                       {"type": "dataset", "categories": {"2": "preferences"}},
                       {"type": "session", "id": "s1", "user": "ana"},
                       {"type": "turn", "id": "t1", "session": "s1", "speaker": "ana", "text": "I love hiking"},
                       "",
                       {"type": "question", "id": "q1", "user": "ana", "text": "What do I love?", "gold_turns": ["t1"]},
                       {"type": "question", "id": "q2", "user": "ana", "text": "No gold here", "category": 2})
    dataset = load_jsonl(path)
    assert dataset.name == "logs" and dataset.users == ["ana"] and dataset.categories == {2: "preferences"}
    q1, q2 = dataset.questions
    assert q1.evidence_sessions == ["s1"] and q1.answer == "" and q1.category is None and not q1.abstention
    assert q2.evidence_turns == [] and q2.evidence_sessions == []  # questions without gold are allowed
    assert q2.category_name == "preferences"  # named by the header


def test_converted_locomo_loads_back_identical(tmp_path: Path, data_root: Path, capsys) -> None:
    out = tmp_path / "locomo.jsonl"
    assert main(["data", "convert", "locomo", str(out), "--data-dir", str(data_root)]) == 0
    assert load_dataset(f"jsonl:{out}") == load_dataset("locomo", data_root)
    assert main(["data", "validate", str(out)]) == 0
    assert "10 users, 272 sessions, 5882 turns, 1974 questions" in capsys.readouterr().out
    full = tmp_path / "locomo-all.jsonl"
    assert main(["data", "convert", "locomo", str(full), "--data-dir", str(data_root), "--no-dedup"]) == 0
    assert load_dataset(f"jsonl:{full}") == load_dataset("locomo", data_root, dedup=False)


def test_converted_msc_loads_back_identical(tmp_path: Path, data_root: Path) -> None:
    if not (data_root / "msc" / "msc_personasummary" / "session_1" / "valid.txt").exists():
        pytest.skip("MSC not in the data folder")
    out = tmp_path / "msc.jsonl"
    assert main(["data", "convert", "msc", str(out), "--data-dir", str(data_root)]) == 0
    assert load_dataset(f"jsonl:{out}") == load_dataset("msc", data_root)


def test_converted_longmemeval_loads_back_identical(tmp_path: Path) -> None:
    """LongMemEval's schema, written small here (the real file is not in the test data)."""
    source = tmp_path / "lme.json"
    source.write_text(json.dumps([{
        "question_id": "q-1", "question_type": "single-session-user", "question": "Where did I move?",
        "answer": "Lisbon", "question_date": "2023/05/30 (Tue) 10:00", "answer_session_ids": ["s-a"],
        "haystack_dates": ["2023/05/01 (Mon) 09:00", "2023/05/02 (Tue) 09:00"], "haystack_session_ids": ["s-a", "s-b"],
        "haystack_sessions": [[{"role": "user", "content": "I moved to Lisbon", "has_answer": True},
                               {"role": "assistant", "content": "Nice!"}],
                              [{"role": "user", "content": "Any soup recipes?"}]]}]))
    out = tmp_path / "lme.jsonl"
    assert main(["data", "convert", f"longmemeval:{source}", str(out)]) == 0
    assert load_dataset(f"jsonl:{out}") == load_dataset(f"longmemeval:{source}")


# ---- problems ------------------------------------------------------------------------------------
def test_every_problem_is_reported_with_its_line_and_field(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "bad.jsonl",
        {"type": "dataset", "name": "bad", "categories": {"x": "oops"}},  # 1
        {"type": "session", "id": "s1", "user": "ana", "colour": "red"},  # 2 unknown field
        "{not json",  # 3
        "[1, 2]",  # 4 not an object
        {"type": "chapter", "id": "c"},  # 5 unknown type
        {"type": "session", "id": "s2", "user": "ana"},  # 6
        {"type": "turn", "id": "t1", "session": "s2", "speaker": "ana"},  # 7 missing text
        {"type": "turn", "id": "t2", "session": "s2", "speaker": "ana", "text": 5},  # 8 wrong type
        {"type": "turn", "id": "t3", "session": "s2", "speaker": "ana", "text": "ok"},  # 9
        {"type": "turn", "id": "t3", "session": "s9", "speaker": "ana", "text": "again"},  # 10 dup + unknown session
        {"type": "session", "id": "s2", "user": "bo"},  # 11 duplicate session
        {"type": "question", "id": "q1", "user": "ana", "text": "?", "gold_turns": ["t404"]},  # 12 missing gold
        {"type": "question", "id": "q1", "user": "ana", "text": "?"},  # 13 duplicate question
        {"type": "question", "id": "q2", "user": "zed", "text": "?"},  # 14 unknown user
        {"type": "question", "id": "q3", "user": "ana", "text": "?", "gold_sessions": ["s404"],
         "abstention": "yes"},  # 15 wrong type
        {"type": "user", "id": ""},  # 16 empty id
        {"type": "memory", "id": "m1", "user": "ana", "kind": "diary", "text": "x"},  # 17 bad kind
        {"type": "feedback", "selection": "x", "user": "nobody", "query": "q", "shown": []},  # 18 unknown user
    )
    found = problems_of(path)
    where = [p.split(": ", 2)[0].rsplit(":", 1)[1] + ":" + p.split(": ", 2)[1] for p in found]
    assert where == ["1:categories", "2:colour", "3:not valid JSON (Expecting property name enclosed in double "
                     "quotes at column 2)", "4:a line must be a JSON object, got list", "5:type", "7:text", "8:text",
                     "10:id", "10:session", "11:id", "12:gold_turns", "13:id", "14:user", "15:abstention", "16:id",
                     "17:kind", "18:user"]
    assert "duplicate turn id 't3' (first at" in found[7] and found[7].endswith("bad.jsonl:9)")
    assert "gold turn 't404' is not a turn in the data" in found[10]
    with pytest.raises(DataError, match="17 problem"):
        load_dataset(f"jsonl:{path}")


def test_gold_must_belong_to_the_questions_user(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl",
                       {"type": "session", "id": "a1", "user": "ana"},
                       {"type": "turn", "id": "ta", "session": "a1", "speaker": "ana", "text": "x"},
                       {"type": "session", "id": "b1", "user": "bo"},
                       {"type": "turn", "id": "tb", "session": "b1", "speaker": "bo", "text": "y"},
                       {"type": "question", "id": "q", "user": "ana", "text": "?", "gold_turns": ["tb"],
                        "gold_sessions": ["b1"]})
    assert problems_of(path) == [f"{path}:5: gold_turns: gold turn 'tb' is a turn of user 'bo'",
                                 f"{path}:5: gold_sessions: gold session 'b1' is a session of user 'bo'"]


def test_a_refused_line_is_not_reported_again_through_its_references(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl",
                       {"type": "session", "id": "s1", "user": "ana", "when": "today"},
                       {"type": "turn", "id": "t1", "session": "s1", "speaker": "ana", "text": "x"})
    assert problems_of(path) == [f"{path}:1: when: unknown field for a session (known: ['id', 'time', 'user'])"]


def test_files_and_headers_that_disagree(tmp_path: Path) -> None:
    folder = tmp_path / "d"
    folder.mkdir()
    write_lines(folder / "a.jsonl", {"type": "dataset", "name": "one", "categories": {"1": "a"}})
    write_lines(folder / "b.jsonl", {"type": "dataset", "name": "two", "categories": {"1": "b"}, "format": 99})
    found = problems_of(folder)
    assert any("name different datasets" in p for p in found)
    assert any("category 1 named both 'a' and 'b'" in p for p in found)
    assert any("version 99 is newer" in p for p in found)
    (folder / "c.jsonl").write_bytes(b'{"type": "user", "id": "\xff"}\n')
    assert any("is not UTF-8" in p for p in problems_of(folder))


def test_missing_paths_and_bare_names(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(f"jsonl:{tmp_path / 'nope.jsonl'}")
    with pytest.raises(DataError, match="holds no .jsonl file"):
        load_dataset(f"jsonl:{tmp_path}")
    with pytest.raises(DataError, match="needs a path"):
        load_dataset("jsonl:")


def test_validate_command_prints_every_problem_and_fails(tmp_path: Path, capsys) -> None:
    path = write_lines(tmp_path / "bad.jsonl", "nonsense", {"type": "user", "id": "a", "age": 3})
    assert main(["data", "validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"{path}:1: not valid JSON" in out and f"{path}:2: age: unknown field" in out
    assert "2 problem(s); nothing would be loaded" in out
    good = write_jsonl(dataset_records(small_dataset()), tmp_path / "good.jsonl")
    assert good and main(["data", "validate", str(tmp_path / "good.jsonl")]) == 0
    assert "3 users, 3 sessions, 4 turns, 3 questions (2 with gold turns)" in capsys.readouterr().out
