"""Multi-Session Chat (Xu et al., ACL 2022), ParlAI `msc_v0.1`, `msc_personasummary` part.

Files `msc_personasummary/session_{1..4}/{split}.txt` are JSON Lines, one episode per line.
Session k's file holds ONLY session k's dialog (checked on the valid split: session 2 opens
with a line derived from session 1's `followup`/`newfact`, never with session 1's turns), so an
episode's history is rebuilt by joining the four files on `initial_data_id` (same ids, same
order in the valid split): 4 sessions, ~51 turns. An episode missing from a later file (the
train split thins out) keeps the sessions it has.

Ids: user `msc-{initial_data_id}` (`msc-valid_0`), session `msc-valid_0:S2`, turn
`msc-valid_0:D2:5` (1-based position in the session), mirroring LoCoMo. Speakers `bot_0` /
`bot_1` become `Speaker 1` / `Speaker 2`. MSC has no timestamps (`time=None`).

MSC has no QA, so retrieval labels are derived (category numbers in `MSC_CATEGORIES`):
1 persona  - one question per distinct persona fact (`persona_text`, compared after lowercasing
             and collapsing spaces) of an episode: text `"What do you know about: {fact}?"`
             (a cheap, fixed question form), answer = the fact, gold = every turn stating it.
2 followup - session k's `followup` (the opener written for the next session, referring back
             to session k): gold = session k and all its turns. Caveat: for k = 1..3 ParlAI
             often uses that line verbatim as the first turn of session k+1 (about half of the
             valid episodes), so a bank holding every session contains a near-copy of the
             query outside the gold session; session 4's followup has no such copy. The
             default emits k = 1..4; pass `followup_sessions=(4,)` for the leak-free subset.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rmm.data.locomo import require
from rmm.errors import DataError
from rmm.types import Dataset, Question, Session, Turn

logger = logging.getLogger(__name__)

MSC_CATEGORIES: dict[int, str] = {1: "persona", 2: "followup"}
PERSONA, FOLLOWUP = 1, 2
SESSION_NUMBERS: tuple[int, ...] = (1, 2, 3, 4)
SPEAKERS: dict[str, str] = {"bot_0": "Speaker 1", "bot_1": "Speaker 2"}
PERSONA_QUESTION = "What do you know about: {fact}?"


def user_key(initial_data_id: str) -> str:
    return f"msc-{initial_data_id}"


def persona_question(fact: str) -> str:
    return PERSONA_QUESTION.format(fact=fact.strip().rstrip(".!?").strip())


def _normalise(fact: str) -> str:
    return re.sub(r"\s+", " ", fact.strip().lower()).rstrip(".!? ")


def _persona_root(folder: Path) -> Path:
    """Accept the ParlAI `msc/` folder or its `msc_personasummary/` child."""
    nested = folder / "msc_personasummary"
    return nested if nested.is_dir() else folder


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    rows: list[dict[str, Any]] = []
    try:
        with path.open(encoding="utf-8") as fh:
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}: line {number} is not valid JSON ({exc})") from exc
                if not isinstance(row, dict):
                    raise DataError(
                        f"{path}: line {number} should be a JSON object, got {type(row).__name__}"
                    )
                rows.append(row)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc})") from exc
    if not rows:
        raise DataError(f"{path}: no episodes")
    return rows


def _session(
    row: dict[str, Any], number: int, user: str, path: Path, line: int
) -> tuple[Session, list[tuple[str, str]]]:
    """The session and its (turn id, persona fact) pairs."""
    where = f"line {line}"
    dialog = require(row, "dialog", list, path, where)
    sid = f"{user}:S{number}"
    turns: list[Turn] = []
    facts: list[tuple[str, str]] = []
    for index, raw in enumerate(dialog):
        twhere = f"{where} turn {index}"
        speaker = require(raw, "id", str, path, twhere)
        text = require(raw, "text", str, path, twhere)
        tid = f"{user}:D{number}:{index + 1}"
        name = SPEAKERS.get(speaker, speaker)
        turns.append(Turn(id=tid, session_id=sid, speaker=name, text=text))
        fact = raw.get("persona_text")
        if isinstance(fact, str) and fact.strip():
            facts.append((tid, fact.strip()))
    return Session(id=sid, user_id=user, turns=turns), facts


def load_msc(
    folder: str | Path,
    split: str = "valid",
    *,
    followup_sessions: Iterable[int] = SESSION_NUMBERS,
) -> Dataset:
    """Rebuild MSC episodes into multi-session users with derived retrieval questions."""
    root = _persona_root(Path(folder))
    followups = set(followup_sessions)
    histories: dict[str, list[Session]] = {}
    facts: dict[str, list[tuple[str, str]]] = {}
    followup_rows: dict[str, dict[int, str]] = {}
    for number in SESSION_NUMBERS:
        path = root / f"session_{number}" / f"{split}.txt"
        for line, row in enumerate(_read_jsonl(path), start=1):
            episode = require(row, "initial_data_id", str, path, f"line {line}")
            user = user_key(episode)
            history = histories.setdefault(user, [])
            if any(s.id == f"{user}:S{number}" for s in history):
                raise DataError(f"{path}: line {line}: episode {episode!r} appears twice")
            session, session_facts = _session(row, number, user, path, line)
            history.append(session)
            facts.setdefault(user, []).extend(session_facts)
            followup = row.get("followup")
            if isinstance(followup, str) and followup.strip():
                followup_rows.setdefault(user, {})[number] = followup.strip()

    short = sum(1 for h in histories.values() if len(h) < len(SESSION_NUMBERS))
    if short:
        logger.info("%s (%s): %d episodes have fewer than %d sessions",
                    root, split, short, len(SESSION_NUMBERS))

    questions: list[Question] = []
    for user, history in histories.items():
        grouped: dict[str, tuple[str, list[str]]] = {}
        for tid, fact in facts.get(user, []):
            grouped.setdefault(_normalise(fact), (fact, []))[1].append(tid)
        turn_session = {t.id: t.session_id for s in history for t in s.turns}
        for index, (fact, tids) in enumerate(grouped.values()):
            questions.append(
                Question(
                    id=f"{user}:p{index}",
                    user_id=user,
                    text=persona_question(fact),
                    answer=fact,
                    evidence_turns=tids,
                    evidence_sessions=list(dict.fromkeys(turn_session[t] for t in tids)),
                    category=PERSONA,
                    category_name=MSC_CATEGORIES[PERSONA],
                )
            )
        by_number = {int(s.id.rsplit(":S", 1)[1]): s for s in history}
        for number, followup in sorted(followup_rows.get(user, {}).items()):
            if number not in followups:
                continue
            session = by_number[number]
            questions.append(
                Question(
                    id=f"{user}:f{number}",
                    user_id=user,
                    text=followup,
                    answer="",
                    evidence_turns=[t.id for t in session.turns],
                    evidence_sessions=[session.id],
                    category=FOLLOWUP,
                    category_name=MSC_CATEGORIES[FOLLOWUP],
                )
            )
    return Dataset(name="msc", sessions=histories, questions=questions,
                   categories=dict(MSC_CATEGORIES))
