"""LoCoMo (Maharana et al., ACL 2024): 10 long two-person conversations with QA and evidence.

One conversation is one user (retrieval never crosses conversations). Ids:
user = `sample_id` (`conv-26`), session `conv-26:S3`, turn `conv-26:D3:5`, question `conv-26:q7`.

Quirks handled here (shared/data/README.md):
- `session_N_date_time` keys without a `session_N` turn list (conv-26 has dates up to 35 but
  19 sessions) are ignored, and a session without a date gets `time=None`.
- Image turns: the BLIP caption stands in for the image, `"{text} [image: {caption}]"`.
- Evidence ids are messy (`"D8:6; D9:17"`, `"D:11:26"`, `"D30:05"`, `"D9:1 D4:4 D4:6"`, `"D"`):
  the pattern `D:?(\\d+):(\\d+)` is run over the joined evidence list, numbers are read as ints
  (so `D30:05` is turn 5), and ids of turns that do not exist (conv-42 `D10:19`, conv-47
  `D4:36`) are dropped and counted in the log.
- Category 5 (adversarial) answers come from `adversarial_answer`; int answers become strings.
- Questions whose evidence is empty (4 of them) are kept, with empty `evidence_turns`: recall is
  undefined for them, so the evaluator skips them (`rmm.eval.metrics` raises on empty gold).
- `dedup=True` drops the 12 repeated questions MemR³ (App. C.3) found: a question whose text
  (whitespace-normalised) was already asked in the same conversation is skipped, which removes
  the adversarial copy of "What did Gina receive from a dance contest?" in conv-30 and 11
  single-hop repeats in conv-48 (category counts 282 / 321 / 96 / 830 / 445 instead of
  282 / 321 / 96 / 841 / 446). Question ids keep their position in the file (`conv-48:q16` stays).
  `rmm.data.load_dataset("locomo")` (every command) reads with `dedup=True` unless told otherwise;
  this reader keeps the file as it is by default.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from rmm.errors import DataError
from rmm.types import Dataset, Question, Session, Turn

logger = logging.getLogger(__name__)

#: Category numbers as in LoCoMo's own evaluation code (other write-ups permute the names).
LOCOMO_CATEGORIES: dict[int, str] = {
    1: "multi-hop",
    2: "temporal",
    3: "open-domain",
    4: "single-hop",
    5: "adversarial",
}
ADVERSARIAL = 5

DIA_ID = re.compile(r"D:?(\d+):(\d+)")
_SESSION_KEY = re.compile(r"session_(\d+)")


# --- shared JSON helpers (also used by the LongMemEval and MSC loaders) ---------------------


def read_json(path: Path) -> Any:
    """Parse a JSON file, turning every way it can fail into a `DataError` naming the file."""
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    try:
        with path.open("rb") as fh:
            return json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from exc
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc})") from exc


def require(obj: Any, key: str, kind: type | tuple[type, ...], path: Path, where: str) -> Any:
    """`obj[key]`, which must exist and be of `kind`; else a `DataError` saying where."""
    if not isinstance(obj, dict):
        raise DataError(f"{path}: {where} should be a JSON object, got {type(obj).__name__}")
    if key not in obj:
        raise DataError(f"{path}: {where} is missing the key {key!r}")
    value = obj[key]
    if not isinstance(value, kind):
        kinds = (kind,) if isinstance(kind, type) else kind
        expected = " or ".join(k.__name__ for k in kinds)
        raise DataError(
            f"{path}: {where}[{key!r}] should be {expected}, got {type(value).__name__}"
        )
    return value


# --- LoCoMo ----------------------------------------------------------------------------------


def turn_id(user_id: str, session: int, turn: int) -> str:
    return f"{user_id}:D{session}:{turn}"


def session_id(user_id: str, session: int) -> str:
    return f"{user_id}:S{session}"


def parse_evidence(evidence: list[Any]) -> list[tuple[int, int]]:
    """(session, turn) pairs in order of appearance, duplicates removed."""
    joined = " ".join(str(e) for e in evidence)
    pairs: list[tuple[int, int]] = []
    for match in DIA_ID.finditer(joined):
        pair = (int(match.group(1)), int(match.group(2)))
        if pair not in pairs:
            pairs.append(pair)
    return pairs


def _load_sessions(conv: dict[str, Any], user: str, path: Path) -> list[Session]:
    numbers = sorted(
        int(m.group(1))
        for key, value in conv.items()
        if (m := _SESSION_KEY.fullmatch(key)) and isinstance(value, list)
    )
    sessions: list[Session] = []
    for number in numbers:
        raw_time = conv.get(f"session_{number}_date_time")
        time = raw_time if isinstance(raw_time, str) else None
        sid = session_id(user, number)
        turns: list[Turn] = []
        for index, raw in enumerate(conv[f"session_{number}"]):
            where = f"{user} session_{number} turn {index}"
            speaker = require(raw, "speaker", str, path, where)
            text = require(raw, "text", str, path, where)
            dia_id = require(raw, "dia_id", str, path, where)
            match = DIA_ID.fullmatch(dia_id.strip())
            if match is None:
                raise DataError(f"{path}: {where} has a malformed dia_id {dia_id!r}")
            s, t = int(match.group(1)), int(match.group(2))
            if s != number:
                raise DataError(f"{path}: {where} has dia_id {dia_id!r} outside its session")
            caption = raw.get("blip_caption")
            if isinstance(caption, str) and caption.strip():
                text = f"{text} [image: {caption.strip()}]"
            turns.append(Turn(id=turn_id(user, s, t), session_id=sid, speaker=speaker,
                              text=text, time=time))
        sessions.append(Session(id=sid, user_id=user, turns=turns, time=time))
    return sessions


def _answer(raw: dict[str, Any], category: int | None) -> str:
    value = raw.get("adversarial_answer") if category == ADVERSARIAL else None
    if value is None:
        value = raw.get("answer")
    return "" if value is None else str(value)


def _question_key(text: str) -> str:
    return " ".join(text.split())


def load_locomo(path: str | Path, *, dedup: bool = False) -> Dataset:
    """Read `locomo10.json` into a `Dataset` (one user per conversation); `dedup` drops repeated questions."""
    path = Path(path)
    data = read_json(path)
    if not isinstance(data, list):
        raise DataError(
            f"{path}: expected a JSON list of conversations, got {type(data).__name__}"
        )
    sessions: dict[str, list[Session]] = {}
    questions: list[Question] = []
    dropped = repeated = 0
    for position, sample in enumerate(data):
        where = f"conversation #{position}"
        user = require(sample, "sample_id", str, path, where)
        where = f"conversation {user}"
        if user in sessions:
            raise DataError(f"{path}: duplicate sample_id {user!r}")
        conv = require(sample, "conversation", dict, path, where)
        qa = require(sample, "qa", list, path, where)
        user_sessions = _load_sessions(conv, user, path)
        if not user_sessions:
            raise DataError(f"{path}: {where} has no session_N turn lists")
        sessions[user] = user_sessions
        known = {t.id for s in user_sessions for t in s.turns}
        turn_session = {t.id: t.session_id for s in user_sessions for t in s.turns}
        if len(known) != sum(len(s.turns) for s in user_sessions):
            raise DataError(f"{path}: {where} has duplicate dia_ids")

        asked: set[str] = set()
        for index, raw in enumerate(qa):
            qwhere = f"{where} qa #{index}"
            text = require(raw, "question", str, path, qwhere)
            if dedup:
                if _question_key(text) in asked:
                    repeated += 1
                    logger.debug("%s: %s repeats an earlier question: %r", path, qwhere, text)
                    continue
                asked.add(_question_key(text))
            category = require(raw, "category", int, path, qwhere)
            evidence = require(raw, "evidence", list, path, qwhere)
            turns: list[str] = []
            for s, t in parse_evidence(evidence):
                tid = turn_id(user, s, t)
                if tid in known:
                    turns.append(tid)
                else:
                    dropped += 1
                    logger.debug("%s: %s cites a turn that does not exist: %s", path, qwhere, tid)
            evidence_sessions = list(dict.fromkeys(turn_session[t] for t in turns))
            questions.append(
                Question(
                    id=f"{user}:q{index}",
                    user_id=user,
                    text=text,
                    answer=_answer(raw, category),
                    evidence_turns=turns,
                    evidence_sessions=evidence_sessions,
                    category=category,
                    category_name=LOCOMO_CATEGORIES.get(category, f"category-{category}"),
                )
            )
    if dropped:
        logger.info("%s: dropped %d evidence ids that match no turn", path, dropped)
    if repeated:
        logger.info("%s: dropped %d repeated questions (dedup)", path, repeated)
    categories = dict(LOCOMO_CATEGORIES)
    for q in questions:
        if q.category is not None and q.category not in categories:
            categories[q.category] = q.category_name
    return Dataset(name="locomo", sessions=sessions, questions=questions, categories=categories)
