"""LoCoMo loader: the real file's counts and quirks, a synthetic file, and malformed inputs."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from rmm.data.locomo import LOCOMO_CATEGORIES, load_locomo, parse_evidence
from rmm.errors import DataError
from rmm.types import Dataset


@pytest.fixture(scope="module")
def locomo(data_root: Path) -> Dataset:
    return load_locomo(data_root / "locomo" / "locomo10.json")


def _question(ds: Dataset, qid: str):
    return next(q for q in ds.questions if q.id == qid)


# --- real data ------------------------------------------------------------------------------


def test_real_counts(locomo: Dataset) -> None:
    assert len(locomo.users) == 10
    assert locomo.users[0] == "conv-26" and locomo.users[-1] == "conv-50"
    assert sum(len(s) for s in locomo.sessions.values()) == 272
    assert sum(len(locomo.turns(u)) for u in locomo.users) == 5882
    assert len(locomo.questions) == 1986
    by_category = Counter(q.category for q in locomo.questions)
    assert by_category == {1: 282, 2: 321, 3: 96, 4: 841, 5: 446}
    assert locomo.categories == LOCOMO_CATEGORIES
    assert {q.category_name for q in locomo.questions if q.category == 1} == {"multi-hop"}
    assert {q.category_name for q in locomo.questions if q.category == 4} == {"single-hop"}


def test_real_sessions_numeric_order_and_dates(locomo: Dataset) -> None:
    sessions = locomo.sessions["conv-26"]
    # conv-26 has date keys up to session_35 but only 19 turn lists.
    assert [s.id for s in sessions] == [f"conv-26:S{n}" for n in range(1, 20)]
    assert sessions[0].time == "1:56 pm on 8 May, 2023"
    assert sessions[9].time == "8:56 pm on 20 July, 2023"
    first = sessions[0].turns[0]
    assert first.id == "conv-26:D1:1" and first.session_id == "conv-26:S1"
    assert first.speaker == "Caroline" and first.time == sessions[0].time
    assert not first.text.startswith("Caroline")
    assert sessions[0].text().startswith("Caroline: Hey Mel!")
    ids = [t.id for u in locomo.users for t in locomo.turns(u)]
    assert len(ids) == len(set(ids))


def test_real_image_captions(locomo: Dataset) -> None:
    captioned = [t for u in locomo.users for t in locomo.turns(u) if "[image: " in t.text]
    assert len(captioned) == 709 + 311 + 179 + 22 + 5  # every turn with a blip_caption
    assert all(t.text.endswith("]") for t in captioned)


def test_real_malformed_evidence_ids(locomo: Dataset) -> None:
    # "D8:6; D9:17" -> two ids
    assert _question(locomo, "conv-26:q37").evidence_turns == ["conv-26:D8:6", "conv-26:D9:17"]
    assert _question(locomo, "conv-26:q37").evidence_sessions == ["conv-26:S8", "conv-26:S9"]
    # "D:11:26" -> D11:26
    assert "conv-43:D11:26" in _question(locomo, "conv-43:q18").evidence_turns
    # "D30:05" -> turn 5
    assert _question(locomo, "conv-50:q69").evidence_turns == ["conv-50:D30:5"]
    # a bare "D" matches nothing; the other ids stay
    assert _question(locomo, "conv-42:q88").evidence_turns == ["conv-42:D1:18", "conv-42:D1:20"]


def test_real_space_separated_ids(locomo: Dataset, data_root: Path) -> None:
    raw = json.loads((data_root / "locomo" / "locomo10.json").read_text())
    conv49 = next(c for c in raw if c["sample_id"] == "conv-49")
    index = next(i for i, q in enumerate(conv49["qa"]) if "D9:1 D4:4 D4:6" in q["evidence"])
    turns = _question(locomo, f"conv-49:q{index}").evidence_turns
    assert {"conv-49:D9:1", "conv-49:D4:4", "conv-49:D4:6"} <= set(turns)


def test_real_nonexistent_turns_dropped(
    data_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="rmm.data.locomo"):
        ds = load_locomo(data_root / "locomo" / "locomo10.json")
    assert any("dropped 2 evidence ids" in r.getMessage() for r in caplog.records)
    q42 = _question(ds, "conv-42:q58")
    assert "conv-42:D10:19" not in q42.evidence_turns and len(q42.evidence_turns) == 6
    q47 = _question(ds, "conv-47:q38")
    assert q47.evidence_turns == ["conv-47:D18:1", "conv-47:D18:7"]
    known = {t.id for u in ds.users for t in ds.turns(u)}
    session_of = {t.id: t.session_id for u in ds.users for t in ds.turns(u)}
    for q in ds.questions:
        assert set(q.evidence_turns) <= known
        assert q.evidence_sessions == list(dict.fromkeys(session_of[t] for t in q.evidence_turns))


def test_real_empty_evidence_and_answers(locomo: Dataset) -> None:
    empty = [q.id for q in locomo.questions if not q.evidence_turns]
    assert empty == ["conv-26:q30", "conv-26:q46", "conv-50:q39", "conv-50:q42"]
    assert _question(locomo, "conv-26:q1").answer == "2022"  # int answer
    adversarial = _question(locomo, "conv-26:q167")  # has both keys: adversarial_answer wins
    assert adversarial.category == 5 and adversarial.answer == "Yes"
    assert all(q.answer for q in locomo.questions if q.category == 5)


def test_real_dedup_matches_memr3_appendix_c3(locomo: Dataset, data_root: Path) -> None:
    deduped = load_locomo(data_root / "locomo" / "locomo10.json", dedup=True)
    assert Counter(q.category for q in deduped.questions) == {1: 282, 2: 321, 3: 96, 4: 830, 5: 445}
    removed = [q.id for q in locomo.questions if q.id not in {d.id for d in deduped.questions}]
    # the paper's list (1-based): conversation 2 question 96, conversation 8 questions 90-100
    assert removed == ["conv-30:q95"] + [f"conv-48:q{i}" for i in range(89, 100)]
    assert _question(locomo, "conv-30:q95").category == 5  # the adversarial copy goes, the single-hop stays
    assert _question(deduped, "conv-30:q61").text == "What did Gina receive from a dance contest?"
    for user in deduped.users:
        texts = [" ".join(q.text.split()) for q in deduped.questions_of(user)]
        assert len(texts) == len(set(texts))
    assert deduped.sessions.keys() == locomo.sessions.keys()  # only questions change


# --- synthetic file -------------------------------------------------------------------------


def _turn(dia: str, speaker: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"speaker": speaker, "dia_id": dia, "text": text, **extra}


def _conversation() -> dict[str, Any]:
    return {
        "sample_id": "conv-x",
        "conversation": {
            "speaker_a": "Ann",
            "speaker_b": "Bob",
            "session_10_date_time": "ten o'clock",
            "session_10": [_turn("D10:1", "Ann", "late"), _turn("D10:2", "Bob", "later")],
            "session_2_date_time": "two o'clock",
            "session_2": [
                _turn("D2:1", "Ann", "look", img_url=["u"], blip_caption="a photo of a cat"),
                _turn("D2:2", "Bob", "nice"),
            ],
            "session_3_date_time": "no session here",
            "session_4": [_turn("D4:1", "Ann", "undated")],
        },
        "qa": [
            {"question": "q0", "answer": 7, "evidence": ["D2:1; D10:02", "D:4:1", "D2:1"],
             "category": 2},
            {"question": "q1", "adversarial_answer": "adv", "evidence": ["D9:9", "D"],
             "category": 5},
            {"question": "q2", "answer": "a", "evidence": [], "category": 4},
        ],
    }


def test_synthetic_file(tmp_path: Path) -> None:
    path = tmp_path / "mini.json"
    path.write_text(json.dumps([_conversation()]))
    ds = load_locomo(path)
    sessions = ds.sessions["conv-x"]
    assert [s.id for s in sessions] == ["conv-x:S2", "conv-x:S4", "conv-x:S10"]
    assert [s.time for s in sessions] == ["two o'clock", None, "ten o'clock"]
    assert sessions[0].turns[0].text == "look [image: a photo of a cat]"
    assert sessions[0].text().splitlines()[0] == "Ann: look [image: a photo of a cat]"
    q0, q1, q2 = ds.questions
    assert q0.id == "conv-x:q0" and q0.answer == "7" and q0.category_name == "temporal"
    assert q0.evidence_turns == ["conv-x:D2:1", "conv-x:D10:2", "conv-x:D4:1"]
    assert q0.evidence_sessions == ["conv-x:S2", "conv-x:S10", "conv-x:S4"]
    assert q1.answer == "adv" and q1.evidence_turns == [] and q1.category_name == "adversarial"
    assert q2.evidence_turns == [] and q2.evidence_sessions == []


def test_synthetic_dedup_keeps_the_first_of_each_question_per_conversation(tmp_path: Path) -> None:
    first = _conversation()
    first["qa"].append({"question": " q0 ", "answer": "again", "evidence": [], "category": 5})
    second = {**_conversation(), "sample_id": "conv-y"}  # the same texts in another conversation stay
    path = tmp_path / "dup.json"
    path.write_text(json.dumps([first, second]))
    assert len(load_locomo(path).questions) == 7
    ids = [q.id for q in load_locomo(path, dedup=True).questions]
    assert ids == ["conv-x:q0", "conv-x:q1", "conv-x:q2", "conv-y:q0", "conv-y:q1", "conv-y:q2"]


def test_parse_evidence_patterns() -> None:
    assert parse_evidence(["D8:6; D9:17"]) == [(8, 6), (9, 17)]
    assert parse_evidence(["D:11:26", "D30:05", "D"]) == [(11, 26), (30, 5)]
    assert parse_evidence(["D9:1 D4:4 D4:6", "D9:1"]) == [(9, 1), (4, 4), (4, 6)]
    assert parse_evidence([]) == []


# --- malformed files ------------------------------------------------------------------------


def _write(tmp_path: Path, content: str) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(content)
    return path


def test_not_json(tmp_path: Path) -> None:
    path = _write(tmp_path, "{not json")
    with pytest.raises(DataError, match="not valid JSON") as err:
        load_locomo(path)
    assert str(path) in str(err.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="file not found"):
        load_locomo(tmp_path / "absent.json")


def test_wrong_top_level_type(tmp_path: Path) -> None:
    path = _write(tmp_path, json.dumps({"sample_id": "conv-1"}))
    with pytest.raises(DataError, match="expected a JSON list") as err:
        load_locomo(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("key", ["sample_id", "conversation", "qa"])
def test_missing_top_keys(tmp_path: Path, key: str) -> None:
    conv = _conversation()
    del conv[key]
    path = _write(tmp_path, json.dumps([conv]))
    with pytest.raises(DataError, match=f"missing the key '{key}'") as err:
        load_locomo(path)
    assert str(path) in str(err.value)


def test_missing_turn_and_question_keys(tmp_path: Path) -> None:
    conv = _conversation()
    del conv["conversation"]["session_2"][1]["dia_id"]
    with pytest.raises(DataError, match="session_2 turn 1 is missing the key 'dia_id'"):
        load_locomo(_write(tmp_path, json.dumps([conv])))
    conv = _conversation()
    del conv["qa"][0]["evidence"]
    with pytest.raises(DataError, match="qa #0 is missing the key 'evidence'"):
        load_locomo(_write(tmp_path, json.dumps([conv])))
    conv = _conversation()
    conv["qa"][0]["category"] = "two"
    with pytest.raises(DataError, match="should be int"):
        load_locomo(_write(tmp_path, json.dumps([conv])))


def test_bad_dia_ids(tmp_path: Path) -> None:
    conv = _conversation()
    conv["conversation"]["session_2"][0]["dia_id"] = "turn one"
    with pytest.raises(DataError, match="malformed dia_id"):
        load_locomo(_write(tmp_path, json.dumps([conv])))
    conv = _conversation()
    conv["conversation"]["session_2"][1]["dia_id"] = "D2:1"
    with pytest.raises(DataError, match="duplicate dia_ids"):
        load_locomo(_write(tmp_path, json.dumps([conv])))
    conv = _conversation()
    conv["conversation"]["session_2"][1]["dia_id"] = "D3:2"
    with pytest.raises(DataError, match="outside its session"):
        load_locomo(_write(tmp_path, json.dumps([conv])))
