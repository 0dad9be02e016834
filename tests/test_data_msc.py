"""MSC loader: the real valid split, a synthetic folder, and malformed files."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from rmm.data.msc import MSC_CATEGORIES, load_msc
from rmm.errors import DataError
from rmm.types import Dataset


@pytest.fixture(scope="module")
def msc(data_root: Path) -> Dataset:
    folder = data_root / "msc"
    if not (folder / "msc_personasummary" / "session_1" / "valid.txt").is_file():
        pytest.skip("MSC data not present")
    return load_msc(folder)


def test_real_counts(msc: Dataset) -> None:
    assert len(msc.users) == 500
    assert msc.users[0] == "msc-valid_0"
    assert all(len(sessions) == 4 for sessions in msc.sessions.values())
    assert sum(len(msc.turns(u)) for u in msc.users) == 25459
    assert msc.categories == MSC_CATEGORIES
    by_category = Counter(q.category for q in msc.questions)
    assert by_category == {1: 16212, 2: 2000}


def test_real_sessions_hold_only_their_own_dialog(msc: Dataset) -> None:
    for sessions in msc.sessions.values():
        assert [s.id.rsplit(":", 1)[1] for s in sessions] == ["S1", "S2", "S3", "S4"]
        for earlier, later in zip(sessions, sessions[1:]):
            assert not {t.text for t in earlier.turns} & {t.text for t in later.turns}
    first = msc.sessions["msc-valid_0"]
    assert len(first[0].turns) == 16 and [len(s.turns) for s in first[1:]] == [12, 12, 12]
    assert first[0].turns[0].id == "msc-valid_0:D1:1"
    assert first[0].turns[0].speaker == "Speaker 1" and first[0].turns[1].speaker == "Speaker 2"
    assert first[1].turns[0].text.startswith("I've heard they're making a new Stephen King")


def test_real_questions(msc: Dataset) -> None:
    questions = {q.id: q for q in msc.questions_of("msc-valid_0")}
    persona = questions["msc-valid_0:p0"]
    assert persona.text == "What do you know about: I have two jobs?"
    assert persona.answer == "I have two jobs." and persona.evidence_turns == ["msc-valid_0:D1:2"]
    assert persona.evidence_sessions == ["msc-valid_0:S1"]
    followup = questions["msc-valid_0:f1"]
    assert followup.text.startswith("So, have you read any more books since our last chat?")
    assert followup.evidence_sessions == ["msc-valid_0:S1"]
    assert len(followup.evidence_turns) == 16
    known = {t.id for u in msc.users for t in msc.turns(u)}
    assert all(q.evidence_turns and set(q.evidence_turns) <= known for q in msc.questions)


# --- synthetic ------------------------------------------------------------------------------


def _turn(speaker: str, text: str, fact: str | None = None) -> dict[str, Any]:
    turn: dict[str, Any] = {"id": speaker, "text": text, "convai2_id": "x", "agg_persona_list": []}
    if fact is not None:
        turn["persona_text"] = fact
    return turn


def _episode(eid: str, k: int) -> dict[str, Any]:
    dialog = [
        _turn("bot_0", f"{eid} s{k} hello", "I like tea." if k in (1, 3) else None),
        _turn("bot_1", f"{eid} s{k} hi", f"I have {k} cats."),
    ]
    return {"initial_data_id": eid, "dialog": dialog, "followup": f"{eid} after s{k}?",
            "newfact": "x", "init_personachat": {"init_personas": [[], []]}}


def _write_folder(root: Path, rows: dict[int, list[Any]] | None = None) -> Path:
    rows = rows or {k: [_episode("valid_0", k), _episode("valid_1", k)] for k in range(1, 5)}
    for k, episodes in rows.items():
        folder = root / "msc" / "msc_personasummary" / f"session_{k}"
        folder.mkdir(parents=True, exist_ok=True)
        lines = [e if isinstance(e, str) else json.dumps(e) for e in episodes]
        (folder / "valid.txt").write_text("\n".join(lines) + "\n")
    return root / "msc"


def test_synthetic_folder(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path)
    ds = load_msc(folder)
    assert ds.users == ["msc-valid_0", "msc-valid_1"]
    sessions = ds.sessions["msc-valid_1"]
    assert [s.id for s in sessions] == [f"msc-valid_1:S{k}" for k in range(1, 5)]
    assert sessions[2].turns[1].id == "msc-valid_1:D3:2"
    assert sessions[2].text() == "Speaker 1: valid_1 s3 hello\nSpeaker 2: valid_1 s3 hi"
    questions = {q.id: q for q in ds.questions_of("msc-valid_0")}
    tea = next(q for q in questions.values() if q.answer == "I like tea.")
    # the same fact stated in sessions 1 and 3 is one question with both turns as gold
    assert tea.text == "What do you know about: I like tea?"
    assert tea.evidence_turns == ["msc-valid_0:D1:1", "msc-valid_0:D3:1"]
    assert tea.evidence_sessions == ["msc-valid_0:S1", "msc-valid_0:S3"]
    assert sum(q.category == 1 for q in questions.values()) == 5  # tea + 4 cat counts
    f2 = questions["msc-valid_0:f2"]
    assert f2.text == "valid_0 after s2?" and f2.category_name == "followup"
    assert f2.evidence_sessions == ["msc-valid_0:S2"]
    assert f2.evidence_turns == ["msc-valid_0:D2:1", "msc-valid_0:D2:2"]
    # the persona_summary folder itself is accepted too
    assert load_msc(folder / "msc_personasummary").users == ds.users


def test_followup_subset(tmp_path: Path) -> None:
    ds = load_msc(_write_folder(tmp_path), followup_sessions=(4,))
    assert sorted(q.id for q in ds.questions if q.category == 2) == [
        "msc-valid_0:f4", "msc-valid_1:f4"
    ]


def test_episode_missing_from_later_session(tmp_path: Path) -> None:
    rows = {k: [_episode("valid_0", k), _episode("valid_1", k)] for k in range(1, 5)}
    rows[4] = [_episode("valid_0", 4)]
    ds = load_msc(_write_folder(tmp_path, rows))
    assert len(ds.sessions["msc-valid_0"]) == 4 and len(ds.sessions["msc-valid_1"]) == 3


# --- malformed ------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    rows = {k: [_episode("valid_0", k)] for k in (1, 2, 4)}
    folder = _write_folder(tmp_path, rows)
    with pytest.raises(DataError, match=r"session_3[/\\]valid.txt: file not found"):
        load_msc(folder)
    with pytest.raises(DataError, match="file not found"):
        load_msc(folder, split="test")


def test_bad_lines(tmp_path: Path) -> None:
    rows = {k: [_episode("valid_0", k)] for k in range(1, 5)}
    rows[2] = [_episode("valid_0", 2), "{broken"]
    with pytest.raises(DataError, match=r"session_2[/\\]valid.txt: line 2 is not valid JSON"):
        load_msc(_write_folder(tmp_path / "a", rows))
    rows[2] = ["[1, 2]"]
    with pytest.raises(DataError, match="line 1 should be a JSON object"):
        load_msc(_write_folder(tmp_path / "b", rows))
    rows[2] = [{"dialog": []}]
    with pytest.raises(DataError, match="missing the key 'initial_data_id'"):
        load_msc(_write_folder(tmp_path / "c", rows))
    rows[2] = [{"initial_data_id": "valid_0"}]
    with pytest.raises(DataError, match="missing the key 'dialog'"):
        load_msc(_write_folder(tmp_path / "d", rows))
    rows[2] = [_episode("valid_0", 2), _episode("valid_0", 2)]
    with pytest.raises(DataError, match="appears twice"):
        load_msc(_write_folder(tmp_path / "e", rows))
    bad_turn = _episode("valid_0", 2)
    del bad_turn["dialog"][1]["text"]
    rows[2] = [bad_turn]
    with pytest.raises(DataError, match="turn 1 is missing the key 'text'"):
        load_msc(_write_folder(tmp_path / "f", rows))
    rows[2] = []
    with pytest.raises(DataError, match="no episodes"):
        load_msc(_write_folder(tmp_path / "g", rows))
