"""Reading CompassMem's construction replies (App. F.1): events, their relations, a fusion decision.

The three prompts ask for strict JSON, and small models still wrap it in fences and chatter, rename
keys (`participants` for `people`, `refs` for `turns`), list four people, cite turns the session
does not have, or point a relation at an event they never extracted. As the other parsers of this
package do, each parser keeps what it can trust, records what it dropped or repaired in
`warnings`, and raises `PromptParseError` — with what was wrong — only when nothing usable is left,
so the builder retries once and then falls back without losing anything already stored.

Turn references are the turn numbers the prompt showed (`Turn N`, 0-based) or the turn ids
themselves; anything else is dropped, never mapped to a guess. An event is only kept with at
least one valid turn: an event that cannot say where it came from could not be checked or cited.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rmm.prompts.parse import (
    PromptParseError,
    _json_values,
    _refs,
    _require_text,
    _warn,
    _Warned,
)

__all__ = [
    "EventExtraction",
    "ExtractedEvent",
    "FusionDecision",
    "Relation",
    "RelationExtraction",
    "parse_events",
    "parse_fusion",
    "parse_relations",
]

MAX_PARTICIPANTS = 3  # the paper's constraint, and the event graph's (rmm.memory.validation)
_MAX_TEXT = 60_000
_MAX_EVENTS = 40  # far beyond the 6-10 asked for: a looping model's list is cut here
_MAX_SUMMARY = 2_000
_MAX_LABEL = 40

_EVENT_LIST_KEYS = ("events", "event_list", "extracted_events")
_SUMMARY_KEYS = ("summary", "description", "event", "text", "content")
_TURN_KEYS = ("turns", "turn_ids", "turn", "refs", "references", "reference", "utterances", "utterance_ids",
              "observations", "evidence")
_PEOPLE_KEYS = ("people", "participants", "persons", "speakers")
_TIME_KEYS = ("time", "date", "when", "timestamp")
_ID_KEYS = ("id", "event_id", "label", "name")
_RELATION_LIST_KEYS = ("relations", "relation_list", "edges", "event_relations")
_SOURCE_KEYS = ("source", "from", "head", "event1", "e1", "src")
_TARGET_KEYS = ("target", "to", "tail", "event2", "e2", "dst")
_TYPE_KEYS = ("type", "label", "relation", "relation_type", "predicate")
_NONE_WORD = re.compile(r"\s*(?:none|null|n/?a|unknown|-)?\s*", re.IGNORECASE)
_EVENT_LABEL = re.compile(r"\s*\[?\s*(?:event\s*)?(E?\s*\d{1,3})\s*\]?\s*", re.IGNORECASE)

# Summaries of the templates' worked examples: a model that copies them has not read the session.
EXAMPLE_EVENTS = frozenset({
    "maya signed up for the pottery class on fifth street downtown starting the following monday her grandmother "
    "owned a pottery wheel when maya was a child",
    "tom travels to lisbon on friday for a conference where he presents his team s robot arm maya asks him to "
    "bring back tiles and he agrees",
})


@dataclass
class ExtractedEvent:
    """One event of a session: `label` as the reply named it (E1…), refs as turn ids."""

    label: str
    summary: str
    refs: list[str]
    participants: list[str] = field(default_factory=list)
    time: str | None = None


class EventExtraction(_Warned):
    """`list[ExtractedEvent]` with `.warnings`."""


@dataclass(frozen=True)
class Relation:
    """A directed relation between two events of the session, by their positions in the extraction."""

    source: int
    target: int
    label: str
    evidence: tuple[str, ...] = ()


class RelationExtraction(_Warned):
    """`list[Relation]` with `.warnings`."""


@dataclass
class FusionDecision:
    same_event: bool
    has_overlap: bool
    relation_type: str | None
    reasoning: str = ""
    warnings: list[str] = field(default_factory=list)


def _normal(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9]", " ", text.lower()).split())


def _first(item: dict[str, Any], keys: Sequence[str]) -> tuple[str | None, Any]:
    for key in keys:
        if key in item:
            return key, item[key]
    lowered = {str(k).lower(): k for k in item}
    for key in keys:
        if key in lowered:
            return lowered[key], item[lowered[key]]
    return None, None


def _list_under(text: str, keys: Sequence[str], what: str) -> list[Any]:
    """The list under one of `keys` in the first JSON object that has one (a bare list of objects too)."""
    text = _require_text(text)[:_MAX_TEXT]
    values = _json_values(text)
    for value in values:
        if isinstance(value, dict):
            key, items = _first(value, keys)
            if key is None:
                continue
            if isinstance(items, list):
                return items
            if isinstance(items, dict):
                return [items]
            if items is None or (isinstance(items, str) and _NONE_WORD.fullmatch(items)):
                return []
            raise PromptParseError(f"{key!r} must be a list of {what}, got {type(items).__name__}: {str(items)[:80]!r}")
    for value in values:
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            return value
    found = ", ".join(sorted({str(k) for v in values if isinstance(v, dict) for k in v})[:8])
    raise PromptParseError(f"no JSON object with a {keys[0]!r} list in the output"
                           + (f" (keys found: {found})" if found else "") + f": {text[:120]!r}")


def _clean(value: Any, limit: int) -> str:
    return " ".join(str(value).split())[:limit] if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""


def _people(raw: Any, warnings: list[str], where: str, limit: int) -> list[str]:
    if raw is None:
        return []
    items = [p for p in re.split(r"\s*(?:,|;|\band\b)\s*", raw)] if isinstance(raw, str) else raw
    if not isinstance(items, list):
        _warn(warnings, f"{where}: ignored people of type {type(raw).__name__}")
        return []
    names: list[str] = []
    for item in items:
        if isinstance(item, dict):
            item = next((item[k] for k in ("name", "person", "speaker") if isinstance(item.get(k), str)), None)
        name = _clean(item, 80)
        if name and not _NONE_WORD.fullmatch(name) and name.lower() not in (n.lower() for n in names):
            names.append(name)
    if len(names) > limit:
        _warn(warnings, f"{where}: kept the first {limit} of {len(names)} people {names}")
        names = names[:limit]
    return names


def parse_events(text: str, turn_ids: Sequence[str], *, max_participants: int = MAX_PARTICIPANTS) -> EventExtraction:
    """The events of one session's extraction reply, refs mapped to `turn_ids` (in the prompt's order).

    Dropped with a warning: items without a summary or without any valid turn, copies of the
    prompt's example, repeated summaries (their turns pooled into the first). People beyond
    `max_participants` are cut to the first ones (warned). Raises PromptParseError when the reply
    holds no ``events`` list or none of its events is usable.
    """
    ids = [str(t) for t in turn_ids]
    valid = set(ids)
    warnings: list[str] = []
    items = _list_under(text, _EVENT_LIST_KEYS, "events")
    if len(items) > _MAX_EVENTS:
        _warn(warnings, f"kept the first {_MAX_EVENTS} of {len(items)} events")
        items = items[:_MAX_EVENTS]
    result = EventExtraction([], warnings)
    labels: set[str] = set()
    for position, item in enumerate(items):
        where = f"event {position + 1}"
        if not isinstance(item, dict):
            _warn(warnings, f"{where}: skipped an item that is not an object ({str(item)[:40]!r})")
            continue
        summary = _clean(_first(item, _SUMMARY_KEYS)[1], _MAX_SUMMARY)
        if not summary:
            _warn(warnings, f"{where}: skipped an event without a summary (keys: {sorted(map(str, item))[:6]})")
            continue
        if _normal(summary) in EXAMPLE_EVENTS:
            _warn(warnings, f"{where}: dropped a copy of the prompt's example")
            continue
        refs = list(dict.fromkeys(_refs(_first(item, _TURN_KEYS)[1], ids, valid, warnings)))
        if not refs:
            _warn(warnings, f"{where}: dropped {summary[:40]!r}: no valid turn of this session")
            continue
        repeated = next((e for e in result if _normal(e.summary) == _normal(summary)), None)
        if repeated is not None:
            repeated.refs = list(dict.fromkeys(repeated.refs + refs))
            _warn(warnings, f"{where}: merged a repeated summary into {repeated.label}")
            continue
        label = _label(_first(item, _ID_KEYS)[1]) or f"E{position + 1}"
        if label in labels:
            _warn(warnings, f"{where}: label {label} used twice; renamed E{position + 1}#")
            label = f"E{position + 1}#"
        labels.add(label)
        time = _clean(_first(item, _TIME_KEYS)[1], 200) or None
        people = _people(_first(item, _PEOPLE_KEYS)[1], warnings, where, max_participants)
        result.append(ExtractedEvent(label, summary, refs, people, None if time and _NONE_WORD.fullmatch(time) else time))
    if not result:
        detail = "; ".join(warnings[:3])
        raise PromptParseError(f"no usable event in the reply ({len(items)} items" + (f": {detail}" if detail else "") + ")")
    return result


def _label(raw: Any) -> str | None:
    """`E3`, `e3`, `Event 3`, `3`, `[E3]` → ``E3``; anything else None."""
    if isinstance(raw, bool) or raw is None:
        return None
    if isinstance(raw, (int, float)):
        return f"E{int(raw)}" if float(raw).is_integer() else None
    if isinstance(raw, str):
        match = _EVENT_LABEL.fullmatch(raw[:_MAX_LABEL])
        if match:
            return "E" + re.sub(r"\D", "", match.group(1))
    return None


def parse_relations(text: str, event_labels: Sequence[str], turn_ids: Sequence[str]) -> RelationExtraction:
    """The relations among one session's events: ends as positions in `event_labels` (the labels the
    prompt showed, E1…), evidence mapped to `turn_ids`.

    Dropped with a warning: relations naming an event that was not shown, a relation from an event
    to itself, one without a label, repeats. An empty ``relations`` list is a valid answer (no
    relations); raises PromptParseError when the reply holds no ``relations`` list at all.
    """
    ids = [str(t) for t in turn_ids]
    valid = set(ids)
    position = {label: i for i, label in enumerate(event_labels)}
    warnings: list[str] = []
    items = _list_under(text, _RELATION_LIST_KEYS, "relations")
    result = RelationExtraction([], warnings)
    seen: set[tuple[int, int, str]] = set()
    for n, item in enumerate(items[: 4 * len(event_labels) ** 2 + 8]):
        where = f"relation {n + 1}"
        if not isinstance(item, dict):
            _warn(warnings, f"{where}: skipped an item that is not an object ({str(item)[:40]!r})")
            continue
        ends = [_label(_first(item, keys)[1]) for keys in (_SOURCE_KEYS, _TARGET_KEYS)]
        unknown = [str(_first(item, keys)[1])[:20] for keys, end in zip((_SOURCE_KEYS, _TARGET_KEYS), ends)
                   if end not in position]
        if unknown:
            _warn(warnings, f"{where}: dropped: no such event {unknown} (shown: {list(event_labels)[:12]})")
            continue
        source, target = position[ends[0]], position[ends[1]]  # type: ignore[index]
        if source == target:
            _warn(warnings, f"{where}: dropped a relation of {ends[0]} to itself")
            continue
        label = _relation_label(_first(item, _TYPE_KEYS)[1])
        if not label:
            _warn(warnings, f"{where}: dropped a relation without a type")
            continue
        evidence = tuple(dict.fromkeys(_refs(_first(item, ("evidence", *_TURN_KEYS))[1], ids, valid, warnings)))
        if (source, target, label) in seen:
            continue
        seen.add((source, target, label))
        result.append(Relation(source, target, label, evidence))
    return result


def _relation_label(raw: Any) -> str:
    """A short free-form label: lower case, words joined by underscores (`Follow up` → `follow_up`)."""
    text = _clean(raw, 200).lower()
    words = re.findall(r"[a-z0-9]+", text)
    return "_".join(words)[:_MAX_LABEL].strip("_")


def _boolean(raw: Any, key: str, warnings: list[str]) -> bool | None:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, (int, float)) and raw in (0, 1):
        return bool(raw)
    if isinstance(raw, str):
        word = raw.strip().lower()
        if word in ("true", "yes", "y", "1"):
            return True
        if word in ("false", "no", "n", "0"):
            return False
    _warn(warnings, f"{key} is not a boolean: {str(raw)[:30]!r}")
    return None


def parse_fusion(text: str) -> FusionDecision:
    """The coreference / overlap decision between a new event and its nearest stored one.

    Raises PromptParseError without a JSON object holding both ``same_event`` and ``has_overlap``
    as booleans (``"yes"``/``"no"`` strings are read as such). ``same_event`` implies overlap.
    """
    text = _require_text(text)[:_MAX_TEXT]
    warnings: list[str] = []
    values = [v for v in _json_values(text) if isinstance(v, dict)]
    data = next((v for v in values if "same_event" in v or "has_overlap" in v), None)
    if data is None:
        found = ", ".join(sorted({str(k) for v in values for k in v})[:8])
        raise PromptParseError("no JSON object with same_event / has_overlap in the reply"
                               + (f" (keys found: {found})" if found else "") + f": {text[:120]!r}")
    same = _boolean(data.get("same_event"), "same_event", warnings)
    overlap = _boolean(data.get("has_overlap"), "has_overlap", warnings)
    if same is None or overlap is None:
        raise PromptParseError(f"same_event and has_overlap must both be booleans, got "
                               f"{data.get('same_event')!r:.30} and {data.get('has_overlap')!r:.30}")
    raw_type = data.get("relation_type")
    label = "" if raw_type is None or (isinstance(raw_type, str) and _NONE_WORD.fullmatch(raw_type)) \
        else _relation_label(raw_type)
    if same and not overlap:
        _warn(warnings, "same_event without has_overlap: read as overlapping")
        overlap = True
    return FusionDecision(same, overlap, label or None, _clean(data.get("reasoning", ""), 600), warnings)
