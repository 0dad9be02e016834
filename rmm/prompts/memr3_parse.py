"""Reading the MemR³ generate node's JSON (paper App. A): evidence with memory handles, gaps, decision.

Models wrap the object in chatter or code fences, write `"gaps": "None"` or a list, put the handles
in brackets or parentheses, leave the decision out, or stop mid-object at max_tokens. The parser
takes the first JSON object that has one of the schema's keys (a truncated one is closed after
its last complete element — never completed with guesses), records what it repaired or dropped
in `warnings`, and raises `PromptParseError` only when no such object is there.

Handles are the `[M3]` labels the prompt gave the snippets. A handle that was not citable in that
prompt is dropped, never mapped to something else, so a bullet only ever points at a memory that
was really shown.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal

from rmm.prompts.parse import (
    _MAX_CANDIDATE,
    PromptParseError,
    _json_values,
    _loads,
    _require_text,
    _warn,
)

__all__ = ["Decision", "EvidenceBullet", "Generation", "parse_generation"]

Decision = Literal["retrieve", "answer", "reflect"]
DECISIONS: tuple[Decision, ...] = ("retrieve", "answer", "reflect")
KEYS = ("evidence", "gaps", "decision", "retrieval_query", "detailed_answer", "reasoning")
# which conditional key implies which decision when the decision itself is missing or unknown
_IMPLIED: dict[str, Decision] = {"retrieval_query": "retrieve", "detailed_answer": "answer", "reasoning": "reflect"}

_MAX_TEXT = 20_000
_MAX_BULLETS = 12
_MAX_GAPS = 6
_MAX_CHARS = 600
_MAX_REPAIRS = 24

# The template's worked example: a model that copies it has not read the snippets at hand.
EXAMPLE_EVIDENCE = frozenset({"tom adopted a cat from the shelter in spring 2023 said on 3 may 2023"})

_HANDLE_GROUP = re.compile(r"[\[(]\s*((?:M\s*#?\d{1,4}\s*(?:[,;&/]|\band\b)?\s*)+)[\])]", re.IGNORECASE)
_HANDLE = re.compile(r"M\s*#?(\d{1,4})", re.IGNORECASE)
_TEXT_KEYS = ("text", "fact", "bullet", "evidence", "content", "statement")
_ID_KEYS = ("ids", "memories", "memory_ids", "sources", "source", "refs", "references", "citations", "id")
_NONE = re.compile(r"[\W_]*(?:none|n/?a|nothing|null|no gaps?(?: noted)?)[\W_]*", re.IGNORECASE)


@dataclass
class EvidenceBullet:
    text: str
    handles: list[int]  # the memory handles it cites, among those citable in its prompt


@dataclass
class Generation:
    evidence: list[EvidenceBullet]
    gaps: list[str]
    decision: Decision | None  # None: missing or unknown, and no conditional key implies one
    retrieval_query: str = ""
    detailed_answer: str = ""
    reasoning: str = ""
    warnings: list[str] = field(default_factory=list)


def parse_generation(text: str, citable: Collection[int]) -> Generation:
    """Evidence (with the handles each bullet cites), gaps, decision and its payload.

    `citable` are the handle numbers the prompt showed (snippets and carried-over evidence).
    Raises PromptParseError when the output holds no JSON object with any of the schema's keys.
    """
    text = _require_text(text)[:_MAX_TEXT]
    warnings: list[str] = []
    data = next((v for v in _json_values(text) if isinstance(v, dict) and any(k in v for k in KEYS)), None)
    if data is None:
        data = _close_truncated(text)
        if data is None:
            raise PromptParseError(f"no JSON object with evidence, gaps or decision in the output: {text[:120]!r}")
        _warn(warnings, "closed a JSON object cut off before its end (its last, incomplete element dropped)")
    extra = sorted(str(k) for k in data if k not in KEYS)
    if extra:
        _warn(warnings, f"ignored extra keys {extra[:5]}")
    evidence = _evidence(data.get("evidence"), set(citable), warnings)
    gaps = [g for g in _strings(data.get("gaps"), warnings, "gaps") if not _NONE.fullmatch(g)][:_MAX_GAPS]
    payload = {key: " ".join(_strings(data.get(key), warnings, key)) for key in _IMPLIED}
    return Generation(evidence=evidence, gaps=gaps, decision=_decision(data.get("decision"), payload, warnings),
                      retrieval_query=payload["retrieval_query"][:_MAX_CHARS],
                      detailed_answer=payload["detailed_answer"][:_MAX_CHARS],
                      reasoning=payload["reasoning"][: 4 * _MAX_CHARS], warnings=warnings)


def _decision(raw: Any, payload: dict[str, str], warnings: list[str]) -> Decision | None:
    word = next(iter(re.findall(r"[a-z]+", str(raw).lower())), "") if isinstance(raw, str) else ""
    found = next((d for d in DECISIONS if word.startswith(d[:6])), None) if word else None
    if found is not None:
        return found
    implied = [decision for key, decision in _IMPLIED.items() if payload[key]]
    if len(implied) == 1:
        _warn(warnings, f"decision {raw!r:.30} read as {implied[0]!r} from its payload")
        return implied[0]
    _warn(warnings, f"no usable decision ({raw!r:.30})")
    return None


def _strings(raw: Any, warnings: list[str], key: str) -> list[str]:
    """A string or list of strings as clean one-line strings (numbers kept, nested values flattened)."""
    if raw is None:
        return []
    if isinstance(raw, str):
        lines = [re.sub(r"^\s*(?:[-*•]|\d{1,2}[.)])\s+", "", line) for line in raw.splitlines()]
        return [" ".join(line.split())[:_MAX_CHARS] for line in lines if line.strip()]
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return [str(raw)]
    if isinstance(raw, list):
        return [s for item in raw[:_MAX_BULLETS * 2] for s in _strings(item, warnings, key)]
    if isinstance(raw, dict):
        return [s for value in list(raw.values())[:_MAX_BULLETS] for s in _strings(value, warnings, key)]
    _warn(warnings, f"ignored {key} of type {type(raw).__name__}")
    return []


def _evidence(raw: Any, citable: set[int], warnings: list[str]) -> list[EvidenceBullet]:
    items = raw if isinstance(raw, list) else [] if raw is None else [raw]
    bullets: list[EvidenceBullet] = []
    seen: set[str] = set()
    for item in items:
        if isinstance(item, dict):
            body = next((item[k] for k in _TEXT_KEYS if isinstance(item.get(k), str)), "")
            ids = " ".join(str(i) for k in _ID_KEYS if k in item for i in _as_list(item[k]))
            texts = [f"{body} {_bracketed(ids)}"] if body else []
        else:
            texts = _strings(item, warnings, "evidence")
        for line in texts:
            bullet = _bullet(line, citable, warnings)
            key = _normal(bullet.text) if bullet else ""
            if bullet is None or not key or _NONE.fullmatch(bullet.text):
                continue
            if key in EXAMPLE_EVIDENCE:
                _warn(warnings, "dropped evidence copied from the prompt's example")
                continue
            if key in seen:
                continue
            seen.add(key)
            bullets.append(bullet)
    if len(bullets) > _MAX_BULLETS:
        _warn(warnings, f"kept the first {_MAX_BULLETS} evidence bullets")
    return bullets[:_MAX_BULLETS]


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _bracketed(ids: str) -> str:
    """Bare ids from a bullet object's id field (`M2`, `2`, `"M1, M3"`) as a bracketed handle group."""
    numbers = re.findall(r"\d{1,4}", ids)
    return "[" + ", ".join(f"M{n}" for n in numbers) + "]" if numbers else ""


def _bullet(line: str, citable: set[int], warnings: list[str]) -> EvidenceBullet | None:
    handles: list[int] = []
    for group in _HANDLE_GROUP.findall(line):
        for number in (int(n) for n in _HANDLE.findall(group)):
            if number not in citable:
                _warn(warnings, f"dropped handle M{number}: no such memory was shown")
            elif number not in handles:
                handles.append(number)
    text = " ".join(_HANDLE_GROUP.sub(" ", line).split()).strip(" ,;")
    return EvidenceBullet(text[:_MAX_CHARS], handles) if text else None


def _normal(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", text.lower()).split())


# -- a reply cut off mid-object -------------------------------------------------------------------------
def _scan(prefix: str) -> tuple[list[str], bool, list[int]] | None:
    """Closers still open at the end, whether a string is open, and where top-level-or-deeper commas are."""
    closers: list[str] = []
    commas: list[int] = []
    in_string = escaped = False
    for i, ch in enumerate(prefix):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            closers.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not closers or closers.pop() != ch:
                return None
        elif ch == ",":
            commas.append(i)
    return closers, in_string, commas


def _close_truncated(text: str) -> dict[str, Any] | None:
    """The object a reply started but did not finish, cut back to its last complete element."""
    start = text.find("{")
    if start < 0:
        return None
    body = text[start : start + _MAX_CANDIDATE]
    scanned = _scan(body)
    if scanned is None or not scanned[0]:
        return None
    cuts = scanned[2][::-1][:_MAX_REPAIRS] + [len(body)]  # last complete element first; all of it last
    for cut in cuts:
        state = _scan(body[:cut])
        if state is None or state[1] or not state[0]:
            continue
        candidate = body[:cut].rstrip().rstrip(",")
        if candidate.endswith(":"):
            continue
        value = _loads(candidate + "".join(reversed(state[0])))
        if isinstance(value, dict) and any(k in value for k in KEYS):
            return value
    return None

