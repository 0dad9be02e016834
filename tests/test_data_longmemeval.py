"""LongMemEval loader on small files written in the official schema."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from rmm.data.longmemeval import KNOWN_QUESTION_TYPES, load_longmemeval
from rmm.errors import DataError


def _items() -> list[dict[str, Any]]:
    return [
        {
            "question_id": "q1",
            "question_type": "single-session-user",
            "question": "What colour is my car?",
            "answer": "red",
            "question_date": "2023/05/30 (Tue) 23:40",
            "haystack_session_ids": ["sharegpt_a", "answer_x_1"],
            "haystack_dates": ["2023/05/20 (Sat) 02:21", "2023/05/25 (Thu) 10:00"],
            "haystack_sessions": [
                [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "bye"},
                ],
                [
                    {"role": "user", "content": "I bought a red car", "has_answer": True},
                    {"role": "assistant", "content": "A red car!", "has_answer": True},
                    {"role": "user", "content": "it is fast", "has_answer": False},
                ],
            ],
            "answer_session_ids": ["answer_x_1"],
        },
        {
            "question_id": "q2_abs",
            "question_type": "temporal-reasoning",
            "question": "When did I sell my boat?",
            "answer": "You did not mention selling a boat.",
            "question_date": "2023/06/01 (Thu) 08:00",
            "haystack_session_ids": ["sharegpt_a", "answer_y"],
            "haystack_dates": ["2023/05/21 (Sun) 09:00", "2023/05/22 (Mon) 09:00"],
            "haystack_sessions": [
                [{"role": "user", "content": "hi again"}],
                [{"role": "user", "content": "I bought a boat", "has_answer": True}],
            ],
            "answer_session_ids": ["answer_y", "answer_not_in_haystack"],
        },
        {
            "question_id": "q3",
            "question_type": "multi-session",
            "question": "How many dogs do I have?",
            "answer": 3,
            "question_date": "2023/07/01 (Sat) 12:00",
            "haystack_session_ids": ["answer_z"],
            "haystack_dates": ["2023/06/30 (Fri) 12:00"],
            "haystack_sessions": [
                [
                    {"role": "assistant", "content": "Welcome back."},
                    {"role": "user", "content": "My dogs are Rex, Max and Bo.", "has_answer": True},
                ]
            ],
            "answer_session_ids": ["answer_z"],
        },
    ]


def _write(tmp_path: Path, data: Any, name: str = "longmemeval_s_cleaned.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_users_sessions_and_user_turns_only(tmp_path: Path) -> None:
    ds = load_longmemeval(_write(tmp_path, _items()))
    assert ds.name == "longmemeval:s"
    assert ds.users == ["q1", "q2_abs", "q3"]
    s1, s2 = ds.sessions["q1"]
    assert [s1.id, s2.id] == ["q1:sharegpt_a", "q1:answer_x_1"]
    assert s1.time == "2023/05/20 (Sat) 02:21" and s2.time == "2023/05/25 (Thu) 10:00"
    # turn numbers count every turn of the session (official ids): user turns are 1 and 3
    assert [t.id for t in s1.turns] == ["q1:sharegpt_a_1", "q1:sharegpt_a_3"]
    assert [t.text for t in s2.turns] == ["I bought a red car", "it is fast"]
    assert all(t.speaker == "user" for t in s1.turns + s2.turns)
    assert all(t.time == s2.time and t.session_id == s2.id for t in s2.turns)
    assert [t.id for t in ds.sessions["q3"][0].turns] == ["q3:answer_z_2"]


def test_session_ids_unique_across_questions(tmp_path: Path) -> None:
    ds = load_longmemeval(_write(tmp_path, _items()))
    all_sessions = [s.id for u in ds.users for s in ds.sessions[u]]
    assert len(all_sessions) == len(set(all_sessions))
    assert ds.sessions["q2_abs"][0].id == "q2_abs:sharegpt_a"
    assert ds.sessions["q2_abs"][0].turns[0].text == "hi again"


def test_gold_and_flags(tmp_path: Path) -> None:
    ds = load_longmemeval(_write(tmp_path, _items()))
    q1, q2, q3 = ds.questions
    assert q1.id == q1.user_id == "q1"
    assert q1.evidence_sessions == ["q1:answer_x_1"]
    # the assistant turn with has_answer (turn 2) is neither indexed nor gold
    assert q1.evidence_turns == ["q1:answer_x_1_1"]
    assert "q1:answer_x_1_2" not in {t.id for t in ds.turns("q1")}
    assert q1.time == "2023/05/30 (Tue) 23:40" and q1.answer == "red"
    assert not q1.abstention and q2.abstention and not q3.abstention
    assert q2.evidence_sessions == ["q2_abs:answer_y"]  # the unknown answer id is dropped
    assert q3.answer == "3" and q3.evidence_turns == ["q3:answer_z_2"]
    known = {t.id for u in ds.users for t in ds.turns(u)}
    assert all(set(q.evidence_turns) <= known for q in ds.questions)


def test_categories_fixed_sorted_mapping(tmp_path: Path) -> None:
    items = _items()
    items[2]["question_type"] = "brand-new-type"
    ds = load_longmemeval(_write(tmp_path, items))
    expected = {i + 1: name for i, name in enumerate(sorted(KNOWN_QUESTION_TYPES))}
    expected[7] = "brand-new-type"
    assert ds.categories == expected
    assert ds.categories[6] == "temporal-reasoning"
    assert [(q.category, q.category_name) for q in ds.questions] == [
        (5, "single-session-user"), (6, "temporal-reasoning"), (7, "brand-new-type"),
    ]


def test_dataset_name_from_file(tmp_path: Path) -> None:
    assert load_longmemeval(_write(tmp_path, _items(), "longmemeval_oracle.json")).name == (
        "longmemeval:oracle"
    )
    assert load_longmemeval(_write(tmp_path, _items(), "longmemeval_m_cleaned.json")).name == (
        "longmemeval:m"
    )
    assert load_longmemeval(_write(tmp_path, _items(), "mine.json")).name == "longmemeval"


def test_missing_dates_allowed(tmp_path: Path) -> None:
    items = _items()
    del items[0]["haystack_dates"]
    del items[0]["question_date"]
    ds = load_longmemeval(_write(tmp_path, items))
    assert ds.sessions["q1"][0].time is None and ds.questions[0].time is None


# --- malformed ------------------------------------------------------------------------------


def test_not_json_and_wrong_top_level(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("[{")
    with pytest.raises(DataError, match="not valid JSON") as err:
        load_longmemeval(path)
    assert str(path) in str(err.value)
    with pytest.raises(DataError, match="expected a JSON list"):
        load_longmemeval(_write(tmp_path, {"question_id": "q1"}))


@pytest.mark.parametrize(
    "key", ["question_id", "question_type", "question", "answer", "haystack_session_ids",
            "haystack_sessions", "answer_session_ids"],
)
def test_missing_keys(tmp_path: Path, key: str) -> None:
    items = _items()
    del items[1][key]
    path = _write(tmp_path, items)
    with pytest.raises(DataError, match=f"missing the key '{key}'") as err:
        load_longmemeval(path)
    assert str(path) in str(err.value)


def test_structural_errors(tmp_path: Path) -> None:
    base = _items()
    cases: list[tuple[str, Any]] = []
    items = copy.deepcopy(base)
    items[0]["haystack_session_ids"].append("extra")
    cases.append(("2 haystack_sessions", items))
    items = copy.deepcopy(base)
    items[0]["haystack_dates"] = ["only one"]
    cases.append(("haystack_dates", items))
    items = copy.deepcopy(base)
    items[0]["haystack_sessions"][0] = {"role": "user"}
    cases.append(("should be a list of turns", items))
    items = copy.deepcopy(base)
    del items[0]["haystack_sessions"][1][0]["role"]
    cases.append(("turn 0 is missing the key 'role'", items))
    items = copy.deepcopy(base)
    items[1]["question_id"] = "q1"
    cases.append(("duplicate question_id", items))
    items = copy.deepcopy(base)
    items[0]["haystack_session_ids"] = ["same", "same"]
    cases.append(("duplicate haystack_session_ids", items))
    items = copy.deepcopy(base)
    items[2] = "not an object"
    cases.append(("should be a JSON object", items))
    for message, data in cases:
        with pytest.raises(DataError, match=message):
            load_longmemeval(_write(tmp_path, data))
