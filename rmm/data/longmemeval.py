"""LongMemEval (Wu et al., ICLR 2025): 500 questions, each with its own haystack of sessions.

Follows the official retrieval protocol (`src/retrieval/run_retrieval.py` upstream):
- Each question object is its own user (user id = `question_id`): its haystack is its bank.
- Only USER turns are indexed: assistant turns are not loaded at all, so a `has_answer` on an
  assistant turn is never gold (single-session-assistant questions then have no gold turns).
- Turn ids are `{session}_{i+1}` where `i` is the turn's position among ALL turns of the session,
  user and assistant (upstream enumerates every turn and keeps the user ones), so user turns are
  numbered 1, 3, 5, ... in a strictly alternating session.
- Session ids are prefixed with the question id, `{question_id}:{session_id}`, because the
  haystacks of different questions share sessions (the same `sharegpt_…` id appears under many
  questions) while rmm's ids are globally unique. Turn ids therefore read
  `{question_id}:{session_id}_{i+1}`; everything after the first `:` is the official id.
- Gold sessions = `answer_session_ids`; gold turns = user turns with `has_answer: true`.
  (Upstream additionally demotes an answer session none of whose user turns has `has_answer`;
  we keep `answer_session_ids` as given, as the data README states.)
- `_abs` questions are flagged `abstention=True` (excluded from retrieval metrics).
- Categories: the question types, numbered 1.. in sorted order of the six known types (fixed,
  so oracle / S / M files agree), unknown types appended in sorted order after them.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from rmm.data.locomo import read_json, require
from rmm.errors import DataError
from rmm.types import Dataset, Question, Session, Turn

logger = logging.getLogger(__name__)

KNOWN_QUESTION_TYPES: tuple[str, ...] = (
    "knowledge-update",
    "multi-session",
    "single-session-assistant",
    "single-session-preference",
    "single-session-user",
    "temporal-reasoning",
)
ABSTENTION_SUFFIX = "_abs"
USER_ROLE = "user"


def session_key(question_id: str, session_id: str) -> str:
    return f"{question_id}:{session_id}"


def turn_key(question_id: str, session_id: str, turn_index: int) -> str:
    """The official turn id `{session}_{turn_index+1}`, prefixed with the question id."""
    return f"{session_key(question_id, session_id)}_{turn_index + 1}"


def category_map(question_types: set[str]) -> dict[str, int]:
    ordered = sorted(KNOWN_QUESTION_TYPES)
    ordered += sorted(question_types - set(KNOWN_QUESTION_TYPES))
    return {name: number for number, name in enumerate(ordered, start=1)}


def _load_item(raw: Any, position: int, path: Path) -> tuple[list[Session], Question, str]:
    where = f"item #{position}"
    qid = require(raw, "question_id", str, path, where)
    where = f"question {qid}"
    qtype = require(raw, "question_type", str, path, where)
    text = require(raw, "question", str, path, where)
    if "answer" not in raw:
        raise DataError(f"{path}: {where} is missing the key 'answer'")
    date = raw.get("question_date")
    session_ids = require(raw, "haystack_session_ids", list, path, where)
    dates = raw.get("haystack_dates")
    raw_sessions = require(raw, "haystack_sessions", list, path, where)
    answer_ids = require(raw, "answer_session_ids", list, path, where)
    if len(session_ids) != len(raw_sessions):
        raise DataError(
            f"{path}: {where} has {len(session_ids)} haystack_session_ids but "
            f"{len(raw_sessions)} haystack_sessions"
        )
    if dates is None:
        dates = [None] * len(raw_sessions)
    if not isinstance(dates, list) or len(dates) != len(raw_sessions):
        raise DataError(f"{path}: {where}: haystack_dates must be a list as long as the sessions")
    if len(set(map(str, session_ids))) != len(session_ids):
        raise DataError(f"{path}: {where} has duplicate haystack_session_ids")

    sessions: list[Session] = []
    gold_turns: list[str] = []
    for sid_raw, raw_session, sdate in zip(session_ids, raw_sessions, dates, strict=True):
        sid = str(sid_raw)
        swhere = f"{where} session {sid}"
        if not isinstance(raw_session, list):
            raise DataError(f"{path}: {swhere} should be a list of turns")
        key = session_key(qid, sid)
        stime = sdate if isinstance(sdate, str) else None
        turns: list[Turn] = []
        for index, turn in enumerate(raw_session):
            twhere = f"{swhere} turn {index}"
            role = require(turn, "role", str, path, twhere)
            content = require(turn, "content", str, path, twhere)
            if role != USER_ROLE:
                continue  # official protocol: index user turns only
            tid = turn_key(qid, sid, index)
            turns.append(Turn(id=tid, session_id=key, speaker=USER_ROLE, text=content, time=stime))
            if turn.get("has_answer") is True:
                gold_turns.append(tid)
        sessions.append(Session(id=key, user_id=qid, turns=turns, time=stime))

    known = {str(s) for s in session_ids}
    gold_sessions = []
    for aid in answer_ids:
        if str(aid) in known:
            gold_sessions.append(session_key(qid, str(aid)))
        else:
            logger.info(
                "%s: %s: answer session %s is not in its haystack; dropped", path, where, aid
            )
    question = Question(
        id=qid,
        user_id=qid,
        text=text,
        answer=str(raw["answer"]),
        evidence_turns=gold_turns,
        evidence_sessions=list(dict.fromkeys(gold_sessions)),
        category=None,  # filled in once every question type is known
        category_name=qtype,
        time=date if isinstance(date, str) else None,
        abstention=qid.endswith(ABSTENTION_SUFFIX),
    )
    return sessions, question, qtype


def _variant_name(path: Path) -> str:
    stem = path.stem.lower()
    for variant in ("oracle", "s", "m"):
        if re.search(rf"(^|_){variant}(_|$)", stem):
            return f"longmemeval:{variant}"
    return "longmemeval"


def load_longmemeval(path: str | Path) -> Dataset:
    """Read a LongMemEval file (oracle, S or M; original or cleaned) into a `Dataset`."""
    path = Path(path)
    data = read_json(path)
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of questions, got {type(data).__name__}")
    sessions: dict[str, list[Session]] = {}
    questions: list[Question] = []
    for position, raw in enumerate(data):
        user_sessions, question, _ = _load_item(raw, position, path)
        if question.user_id in sessions:
            raise DataError(f"{path}: duplicate question_id {question.user_id!r}")
        sessions[question.user_id] = user_sessions
        questions.append(question)
    mapping = category_map({q.category_name for q in questions})
    for q in questions:
        q.category = mapping[q.category_name]
    categories = {number: name for name, number in mapping.items()}
    return Dataset(
        name=_variant_name(path), sessions=sessions, questions=questions, categories=categories
    )
