"""Filling CompassMem's construction templates (`compass_events.txt`, `compass_relations.txt`,
`compass_fusion.txt`; the paper's App. F.1 in our layout).

Turns are numbered 0…n-1 as `Turn N - speaker: text`, as in the extraction prompt of App. D, and
the replies cite those numbers (`rmm.prompts.compass_parse` maps them back to turn ids with the
same order, `session_turn_ids`). Each worked example is a user → assistant exchange before the
case (small chat models copy an assistant turn's format far more reliably). The schemas bound what
constrained decoding may emit.
"""

from __future__ import annotations

from collections.abc import Sequence

from rmm.prompts.goal_render import _messages, _one_line
from rmm.types import Message, Session

__all__ = ["EVENTS_SCHEMA", "FUSION_SCHEMA", "RELATIONS_SCHEMA", "events_messages", "fusion_messages",
           "relations_messages", "session_turn_ids"]

_MAX_TURN_CHARS = 1_200
_MAX_EVENT_CHARS = 1_500

EVENTS_SCHEMA: dict = {
    "title": "compass_events",
    "type": "object",
    "properties": {
        "events": {
            "type": "array", "minItems": 1, "maxItems": 12,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "string", "maxLength": 8},
                    "summary": {"type": "string", "maxLength": 1200},
                    "turns": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 40},
                    "people": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3},
                    "time": {"type": "string", "maxLength": 80},
                },
                "required": ["id", "summary", "turns", "people", "time"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["events"],
    "additionalProperties": False,
}

RELATIONS_SCHEMA: dict = {
    "title": "compass_relations",
    "type": "object",
    "properties": {
        "relations": {
            "type": "array", "maxItems": 45,
            "items": {
                "type": "object",
                "properties": {
                    "source": {"type": "string", "maxLength": 8},
                    "target": {"type": "string", "maxLength": 8},
                    "type": {"type": "string", "maxLength": 40},
                    "evidence": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 8},
                },
                "required": ["source", "target", "type", "evidence"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["relations"],
    "additionalProperties": False,
}

FUSION_SCHEMA: dict = {
    "title": "compass_fusion",
    "type": "object",
    "properties": {
        "same_event": {"type": "boolean"},
        "has_overlap": {"type": "boolean"},
        "relation_type": {"type": ["string", "null"], "maxLength": 40},
        "reasoning": {"type": "string", "maxLength": 400},
    },
    "required": ["same_event", "has_overlap", "relation_type", "reasoning"],
    "additionalProperties": False,
}


def session_turn_ids(session: Session) -> list[str]:
    """The turn ids in the order the prompts number them (pass to the parsers)."""
    return [t.id for t in session.turns]


def _turns(session: Session) -> str:
    return "\n".join(f"Turn {i} - {_one_line(t.speaker)}: {_one_line(t.text)[:_MAX_TURN_CHARS]}"
                     for i, t in enumerate(session.turns))


def _when(session: Session) -> str:
    return f" held {_one_line(session.time)}" if session.time else ""


def events_messages(session: Session) -> list[Message]:
    """Ask for the session's events (6-10, strict JSON) citing turn numbers."""
    if not session.turns:
        raise ValueError(f"session {session.id} has no turns to extract events from")
    return _messages("compass_events", turns=_turns(session), session_time=_when(session))


def relations_messages(session: Session, events: Sequence[tuple[str, str, Sequence[str]]]) -> list[Message]:
    """Ask for the relations among the session's `events`, given as (label, summary, turn ids)."""
    if len(events) < 2:
        raise ValueError(f"relations need at least two events, got {len(events)}")
    number = {t.id: i for i, t in enumerate(session.turns)}
    lines = []
    for label, summary, refs in events:
        turns = ", ".join(str(number[r]) for r in refs if r in number)
        lines.append(f"{label}: {_one_line(summary)[:_MAX_EVENT_CHARS]}" + (f" (turns {turns})" if turns else ""))
    return _messages("compass_relations", events="\n".join(lines), turns=_turns(session), session_time=_when(session))


def fusion_messages(new: tuple[str, str | None, Sequence[str]], existing: tuple[str, str | None, Sequence[str]]) -> list[Message]:
    """Ask whether two events (summary, time, participants) are the same one, overlap, or neither.
    Event A is the stored one, B the new one (B's session comes later)."""
    def fields(event: tuple[str, str | None, Sequence[str]]) -> tuple[str, str, str]:
        summary, time, people = event
        return (_one_line(summary)[:_MAX_EVENT_CHARS], _one_line(time) if time else "time unknown",
                ", ".join(_one_line(p) for p in people) or "people unknown")

    event_a, time_a, people_a = fields(existing)
    event_b, time_b, people_b = fields(new)
    return _messages("compass_fusion", event_a=event_a, time_a=time_a, people_a=people_a,
                     event_b=event_b, time_b=time_b, people_b=people_b)
