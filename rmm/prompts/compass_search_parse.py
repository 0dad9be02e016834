"""Reading CompassMem's search replies (paper App. F.2): sub-goals, selected nodes, the explorer's
action, the refined query.

Models bold the labels (`**ACTION:**`), write lists with or without brackets, number sub-goals
`1.` instead of `Sub-goal 1:`, name nodes `N3`, `[N3]`, `node 3` or `3`, and stop mid-line at
max_tokens. Each parser takes what it cheaply can, records what it dropped in `warnings`, and raises
`PromptParseError` only when nothing usable is there (the front end then retries once and falls
back). A node handle that was not shown in that prompt is dropped, never mapped to another node,
so a reply can only move the search to, or keep, a node it was really shown.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

from rmm.prompts.parse import PromptParseError, _require_text, _warn

__all__ = ["ACTIONS", "Action", "ExplorerStep", "NodeChoice", "Refinement", "SubgoalPlan", "parse_action",
           "parse_node_choice", "parse_refinement", "parse_subgoals"]

Action = Literal["SKIP", "EXPAND", "ANSWER"]
ACTIONS: tuple[Action, ...] = ("SKIP", "EXPAND", "ANSWER")
MAX_SUBGOALS = 5
MAX_NEXT = 3  # the action prompt's bound on next nodes

_MAX_TEXT = 20_000
_MAX_SUBGOAL_CHARS = 300
_MAX_QUERY_CHARS = 400
_LABEL = r"[\s*_#>`-]*{}[\s*_`]*[:：]?[\s*_`]*"  # a label, bold or not, with or without a colon
_SUBGOAL_LINE = re.compile(r"^[\s*_#>`-]*(?:sub[\s-]?goal|subgoal|goal|h)\s*_?#?\s*(\d{1,2})[\s*_`]*[:.)\-–]\s*(.+)$",
                           re.IGNORECASE)
_NUMBERED_LINE = re.compile(r"^\s*(?:[-*•]\s*)?(\d{1,2})[.)]\s+(.+)$")
_HANDLE = re.compile(r"\b(?:N|node|node[\s_-]?id)?\s*#?[\s_-]?(\d{1,4})\b", re.IGNORECASE)
_NONE = re.compile(r"^[\s\[\](){}'\"*_`.]*(?:none|n/?a|nothing|null|no\s+nodes?|empty|-)?[\s\[\](){}'\"*_`.]*$",
                   re.IGNORECASE)


@dataclass
class SubgoalPlan:
    subgoals: list[str]
    warnings: list[str] = field(default_factory=list)


@dataclass
class NodeChoice:
    handles: list[int]  # shown handle numbers, in the order named, without repeats
    warnings: list[str] = field(default_factory=list)


@dataclass
class ExplorerStep:
    action: Action
    next_nodes: list[int]  # handles among the neighbours shown, at most MAX_NEXT
    satisfied: list[int]  # 1-based sub-goal numbers
    reasoning: str = ""
    warnings: list[str] = field(default_factory=list)


@dataclass
class Refinement:
    query: str
    targets: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _clean(text: str) -> str:
    text = re.sub(r"^[\s\[*_`\"']+|[\s\]*_`\"']+$", "", text)
    return " ".join(text.split())


def _field(text: str, label: str, stops: Collection[str]) -> str | None:
    """The value after `label:` up to the next known label (or the end), None when the label is absent."""
    match = re.search(_LABEL.format(label), text, re.IGNORECASE)
    if match is None:
        return None
    rest = text[match.end():]
    ends = [m.start() for stop in stops if stop != label
            for m in [re.search(r"(?:^|\n)" + _LABEL.format(stop), rest, re.IGNORECASE)] if m is not None]
    return rest[: min(ends)] if ends else rest


def parse_subgoals(text: str) -> SubgoalPlan:
    """2-5 sub-goals from `Sub-goal N: …` lines (or a numbered / bulleted list). More than five are
    cut to five; one is kept with a warning (the question is then its own second aspect). Raises
    PromptParseError when no sub-goal can be read."""
    text = _require_text(text)[:_MAX_TEXT]
    warnings: list[str] = []
    lines = text.splitlines()
    found = [m.group(2) for m in map(_SUBGOAL_LINE.match, lines) if m is not None]
    if not found:
        found = [m.group(2) for m in map(_NUMBERED_LINE.match, lines) if m is not None]
        if found:
            _warn(warnings, "sub-goals read from a numbered list (no 'Sub-goal N:' labels)")
    if not found:
        bullets = [re.sub(r"^\s*[-*•]\s+", "", line) for line in lines if re.match(r"^\s*[-*•]\s+\S", line)]
        if bullets:
            _warn(warnings, "sub-goals read from a bulleted list")
        found = bullets
    subgoals: list[str] = []
    for raw in found:
        goal = _clean(raw)[:_MAX_SUBGOAL_CHARS]
        if goal and goal.lower() not in {s.lower() for s in subgoals} and not goal.startswith("[First specific"):
            subgoals.append(goal)
    if not subgoals:
        raise PromptParseError(f"no sub-goal found (expected 'Sub-goal 1: …' lines) in {text[:120]!r}")
    if len(subgoals) > MAX_SUBGOALS:
        _warn(warnings, f"{len(subgoals)} sub-goals: kept the first {MAX_SUBGOALS}")
        subgoals = subgoals[:MAX_SUBGOALS]
    if len(subgoals) < 2:
        _warn(warnings, "only one sub-goal (the planner asks for 2-5)")
    return SubgoalPlan(subgoals, warnings)


def _handles(value: str, shown: Collection[int], warnings: list[str], what: str) -> list[int]:
    out: list[int] = []
    for match in _HANDLE.finditer(value):
        number = int(match.group(1))
        if number not in shown:
            _warn(warnings, f"{what}: node {number} was not shown; dropped")
        elif number not in out:
            out.append(number)
    return out


def _list_part(value: str) -> str:
    """The bracketed list at the start of a field (or its first line when unbracketed)."""
    value = value.strip()
    match = re.match(r"^[*_`\s]*\[([^\]]*)\]?", value)
    if match is not None:
        return match.group(1)
    return value.splitlines()[0] if value else ""


def parse_node_choice(text: str, shown: Collection[int], max_nodes: int) -> NodeChoice:
    """`Selected Nodes: [N1, N3]` → the shown handles named (at most `max_nodes`). An explicit empty
    list or NONE is an empty choice; no `Selected Nodes` line and no shown handle anywhere is a
    PromptParseError."""
    text = _require_text(text)[:_MAX_TEXT]
    warnings: list[str] = []
    value = _field(text, r"selected[\s_]+nodes?", ("reasoning", "reason"))
    if value is None:
        _warn(warnings, "no 'Selected Nodes:' line: read the node handles named anywhere")
        handles = [h for h in _handles(" ".join(re.findall(r"\bN\d{1,4}\b", text)), shown, warnings, "selection")]
        if not handles:
            raise PromptParseError(f"no 'Selected Nodes:' line and no shown node named in {text[:120]!r}")
    else:
        part = _list_part(value)
        if _NONE.match(part):
            return NodeChoice([], warnings)
        handles = _handles(part, shown, warnings, "selection")
        if not handles:
            raise PromptParseError(f"'Selected Nodes:' names no shown node: {part[:120]!r}")
    if len(handles) > max_nodes:
        _warn(warnings, f"{len(handles)} nodes selected: kept the first {max_nodes}")
        handles = handles[:max_nodes]
    return NodeChoice(handles, warnings)


def parse_action(text: str, neighbours: Collection[int], n_subgoals: int) -> ExplorerStep:
    """ACTION / NEXT_NODES / SATISFIED_SUBGOALS / REASONING. Raises PromptParseError when no action
    can be read; next nodes outside the shown neighbours and sub-goal numbers outside 1..n are dropped,
    more than three next nodes are cut to three, SKIP's satisfied list is emptied (the format says [])."""
    text = _require_text(text)[:_MAX_TEXT]
    warnings: list[str] = []
    labels = ("action", r"next[\s_]*nodes?", r"satisfied[\s_]*sub[\s_-]*goals?", "reasoning")
    value = _field(text, "action", labels)
    action: Action | None = None
    if value is not None:
        word = re.search(r"\b(SKIP|EXPAND|ANSWER)\b", value.split("\n", 1)[0], re.IGNORECASE)
        action = word.group(1).upper() if word else None  # type: ignore[assignment]
    if action is None:
        named = {w.upper() for w in re.findall(r"\b(SKIP|EXPAND|ANSWER)\b", text)}
        if len(named) == 1:
            action = named.pop()  # type: ignore[assignment]
            _warn(warnings, "no readable 'ACTION:' line: took the one action word in the reply")
    if action is None:  # a small model often leads with its choice ("1. EXPAND") and then muses on the others
        first = next((line for line in text.splitlines() if line.strip()), "")
        leading = {w.upper() for w in re.findall(r"\b(SKIP|EXPAND|ANSWER)\b", first, re.IGNORECASE)}
        if len(leading) == 1:
            action = leading.pop()  # type: ignore[assignment]
            _warn(warnings, "no readable 'ACTION:' line: took the action word of the reply's first line")
    if action is None:
        raise PromptParseError(f"no action (SKIP / EXPAND / ANSWER) found in {text[:120]!r}")
    next_nodes: list[int] = []
    raw_next = _field(text, r"next[\s_]*nodes?", labels)
    if raw_next is not None:
        part = _list_part(raw_next)
        if not _NONE.match(part):
            next_nodes = _handles(part, neighbours, warnings, "next nodes")
    if len(next_nodes) > MAX_NEXT:
        _warn(warnings, f"{len(next_nodes)} next nodes: kept the first {MAX_NEXT}")
        next_nodes = next_nodes[:MAX_NEXT]
    satisfied: list[int] = []
    raw_satisfied = _field(text, r"satisfied[\s_]*sub[\s_-]*goals?", labels)
    if raw_satisfied is not None:
        for number in map(int, re.findall(r"\d{1,2}", _list_part(raw_satisfied))):
            if not 1 <= number <= n_subgoals:
                _warn(warnings, f"sub-goal {number} does not exist (1..{n_subgoals}); dropped")
            elif number not in satisfied:
                satisfied.append(number)
    elif action != "SKIP":
        _warn(warnings, f"{action} without SATISFIED_SUBGOALS: none counted as satisfied")
    if action == "SKIP" and satisfied:
        _warn(warnings, "SKIP with satisfied sub-goals: ignored (a skipped node supports nothing)")
        satisfied = []
    reasoning = _field(text, "reasoning", labels)
    return ExplorerStep(action, next_nodes, sorted(satisfied), " ".join((reasoning or "").split())[:1000], warnings)


def parse_refinement(text: str, n_subgoals: int) -> Refinement:
    """`New Query: …` (and `Target Sub-goals: [2]`). Without the label, a single non-empty line is taken
    as the query (with a warning); otherwise PromptParseError."""
    text = _require_text(text)[:_MAX_TEXT]
    warnings: list[str] = []
    labels = (r"new[\s_]*query", r"target[\s_]*sub[\s_-]*goals?")
    value = _field(text, r"new[\s_]*query", labels)
    if value is None:
        lines = [line for line in (_clean(x) for x in text.splitlines()) if line]
        if len(lines) != 1:
            raise PromptParseError(f"no 'New Query:' line in {text[:120]!r}")
        _warn(warnings, "no 'New Query:' label: took the reply's one line")
        value = lines[0]
    query = _clean(value.strip().split("\n", 1)[0])[:_MAX_QUERY_CHARS]
    if not re.search(r"\w{2}", query) or query.startswith("Your refined search query"):
        raise PromptParseError(f"the refined query is empty or the template's placeholder: {text[:120]!r}")
    targets: list[int] = []
    raw = _field(text, r"target[\s_]*sub[\s_-]*goals?", labels)
    for number in map(int, re.findall(r"\d{1,2}", raw or "")):
        if 1 <= number <= n_subgoals and number not in targets:
            targets.append(number)
    return Refinement(query, targets, warnings)
