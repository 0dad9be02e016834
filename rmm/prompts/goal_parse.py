"""Tolerant parsers for the GOAL-MEM prompts' line-prefixed outputs (paper App. I formats).

Each output is a set of `Header: value` lines, some followed by `- item` lines. Models bold the
headers, number the items, skip sections, and sometimes run on into a new example; the parsers
read what is there, record what they repaired or dropped in `warnings`, and raise
`PromptParseError` only when nothing usable is left — never anything else. Fact numbers are
1-based in the unification prompt (`<= Fact 3`); a number outside the facts shown is dropped,
never guessed, so a grounding always points at a memory that was really shown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from rmm.prompts.parse import PromptParseError, _warn
from rmm.prompts.parse import _require_text as _require_str

__all__ = [
    "Decomposition",
    "Grounding",
    "Refinement",
    "Unification",
    "Unresolved",
    "Variable",
    "parse_bindings",
    "parse_decomposition",
    "parse_refinement",
    "parse_unification",
]

UnifyStatus = Literal["satisfied", "unsatisfied", "conflict"]
RefineStatus = Literal["refine", "stop"]

_MAX_TEXT = 20_000
_MAX_ITEMS = 20
_MAX_ITEM_CHARS = 500

# Subgoals of the decomposition prompt's worked example: a small model that copies them has not
# decomposed the question at hand.
EXAMPLE_NAME = "maria"
EXAMPLE_SUBGOALS = frozenset({"marias sister had a wedding", "maria moved to xcity after the wedding"})


@dataclass
class Variable:
    name: str
    type: str
    description: str = ""


@dataclass
class Decomposition:
    goal: str
    rule: str
    variables: list[Variable]
    subgoals: list[str]
    difference: str = ""
    warnings: list[str] = field(default_factory=list)


@dataclass
class Grounding:
    """One `<subgoal> <= Fact N; bindings: …` line; `facts` are 0-based indices of shown facts."""

    subgoal: str
    facts: list[int]
    known_info: bool = False
    bindings: dict[str, str] = field(default_factory=dict)


@dataclass
class Unresolved:
    subgoal: str
    why: str = ""


@dataclass
class Unification:
    status: UnifyStatus | None
    substitution: dict[str, str]
    grounded: list[Grounding]
    unresolved: list[Unresolved]
    final_answer: str = ""
    known_info: list[str] = field(default_factory=list)
    reasoning: str = ""
    warnings: list[str] = field(default_factory=list)


@dataclass
class Refinement:
    status: RefineStatus
    missing_info: str
    relation_type: str
    subgoals: list[str]
    queries: list[str]
    rationale: str = ""
    warnings: list[str] = field(default_factory=list)


# -- sections -----------------------------------------------------------------------------------
_MARKUP = re.compile(r"^[\s#>*_`]+|[\s*_`]+$")
_BULLET = re.compile(r"^\s*(?:[-*•+]|\d{1,3}[.)])\s+")
_NONE = re.compile(r"[\W_]*(?:none|n/?a|nothing|null|empty)[\W_]*", re.IGNORECASE)


def _require_text(text: object) -> str:
    return _require_str(text)[:_MAX_TEXT]


def _header_pattern(names: dict[str, str]) -> re.Pattern[str]:
    alternatives = "|".join(sorted((re.escape(n) for n in names), key=len, reverse=True))
    return re.compile(rf"^(?:\d{{1,2}}[.)]\s*)?({alternatives})\s*\**\s*[:：]\s*\**\s*(.*)$", re.IGNORECASE)


@dataclass
class _Section:
    inline: str = ""
    items: list[str] = field(default_factory=list)


def _clean_item(line: str) -> str:
    item = _BULLET.sub("", line, count=1).strip()
    item = _MARKUP.sub("", item).strip().strip("\"'“”")
    return " ".join(item.split())[:_MAX_ITEM_CHARS]


def _sections(text: str, names: dict[str, str], stop: tuple[str, ...], warnings: list[str]) -> dict[str, _Section]:
    """Header lines → sections (canonical name → inline value + item lines).

    `names` maps header spellings (lower case) to canonical names. A header seen again after its
    section was filled, or one of `stop` after anything was read, means the model went on with a
    new case: reading stops there.
    """
    pattern = _header_pattern({**names, **{s: s for s in stop}})
    found: dict[str, _Section] = {}
    current: str | None = None
    for raw in text.replace("```", "\n").splitlines():
        line = _MARKUP.sub("", raw.strip()) if raw.strip().startswith(("*", "#", "_")) else raw.strip()
        match = pattern.match(line)
        if match:
            name = match.group(1).lower()
            if name in stop:
                if found:
                    _warn(warnings, f"ignored what follows an echoed {match.group(1)!r} header")
                    break
                current = None
                continue
            canonical = names[name]
            if canonical in found:
                _warn(warnings, f"ignored what follows a repeated {match.group(1)!r} section")
                break
            found[canonical] = _Section(inline=_clean_item(match.group(2)) if match.group(2).strip() else "")
            current = canonical
            continue
        if current is None or not line:
            continue
        item = _clean_item(line)
        section = found[current]
        if not item:
            continue
        if len(section.items) < _MAX_ITEMS:
            section.items.append(item)
        elif len(section.items) == _MAX_ITEMS:
            _warn(warnings, f"kept the first {_MAX_ITEMS} lines of {current}")
            section.items.append("")  # sentinel: warn once
    for section in found.values():
        section.items = [i for i in section.items if i]
    return found


def _is_none(text: str) -> bool:
    return not text or bool(_NONE.fullmatch(text))


def _items(section: _Section | None) -> list[str]:
    """A list section's items ("none" dropped); an inline value counts as the first item."""
    if section is None:
        return []
    items = ([section.inline] if section.inline else []) + section.items
    return [i for i in items if not _is_none(i)]


def _text(section: _Section | None) -> str:
    """An inline section's value, continued over following lines (e.g. a long rule)."""
    if section is None:
        return ""
    value = " ".join([section.inline, *section.items]).strip()
    return "" if _is_none(value) else value[: 4 * _MAX_ITEM_CHARS]


def _normal(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]", "", text.lower()).split())


def _dedupe(items: list[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for item in items:
        key = _normal(item)
        if key and key not in seen:
            seen.add(key)
            out.append(item)
    return out


# -- bindings -----------------------------------------------------------------------------------
_VARIABLE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,19}")
_BINDING = re.compile(
    r"^\(?\s*([A-Za-z][A-Za-z0-9_]{0,19})(?:\s*:\s*[^()/=]{0,60})?\s*\)?\s*(?:/|=|->|→|:)\s*(.+)$"
)


def _split_top_level(text: str) -> list[str]:
    """Split on commas/semicolons outside parentheses (a value may hold "(Momoco, Tokyo)")."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]" and depth:
            depth -= 1
        elif ch in ",;" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def parse_bindings(text: str) -> dict[str, str]:
    """`{x / Kyoto Latte, y / Matcha}` (also `x = …`, `x: …`, `(x:drink) / …`) → {"x": "Kyoto Latte", …}.

    `{}`, "none" and anything without a recognisable variable give {}; the first binding of a
    variable wins.
    """
    if not isinstance(text, str):
        return {}
    inner = text.strip()[:_MAX_ITEM_CHARS * 2].strip("{}[] \t\"'")
    if _is_none(inner):
        return {}
    bindings: dict[str, str] = {}
    for part in _split_top_level(inner):
        match = _BINDING.match(part.strip().strip("{}"))
        if not match:
            continue
        name, value = match.group(1), match.group(2).strip().strip("\"'“”{}").strip()
        value = re.sub(r"^\((.*)\)$", r"\1", value).strip()
        if value and not _is_none(value) and name not in bindings and len(bindings) < _MAX_ITEMS:
            bindings[name] = " ".join(value.split())[:200]
    return bindings


# -- decomposition ------------------------------------------------------------------------------
_DECOMPOSITION_HEADERS = {
    "goal": "goal", "nl-logic goal": "goal", "rule": "rule", "general rule": "rule", "variables": "variables",
    "variable": "variables", "subgoals": "subgoals", "sub-goals": "subgoals", "premises": "premises",
    "difference from prior decompositions": "difference", "difference": "difference",
}
_VARIABLE = re.compile(
    r"^\(\s*([A-Za-z][A-Za-z0-9_]{0,19})\s*:\s*([^()]{1,80}?)\s*\)\s*(?:[:\-–—]\s*(.*))?$"
)
_RULE_BODY = re.compile(r"^\s*IF\s+(.*?)(?:,?\s+THEN\s+.*)?$", re.IGNORECASE | re.DOTALL)


def _variables(section: _Section | None, goal: str) -> list[Variable]:
    if section is None:  # no Variables section: the goal's typed variables are the answer variables
        return [Variable(name, kind.strip()) for name, kind in _goal_variables(goal)]
    variables: list[Variable] = []
    for item in ([section.inline] if section.inline else []) + section.items:
        match = _VARIABLE.match(item)
        if match and not any(v.name == match.group(1) for v in variables):
            variables.append(Variable(match.group(1), match.group(2).strip(), (match.group(3) or "").strip()))
    return variables


def _goal_variables(text: str) -> list[tuple[str, str]]:
    """`(x:type)` occurrences whose name looks like a variable (x, y2, z_1), in order, unique."""
    out: list[tuple[str, str]] = []
    for name, kind in re.findall(r"\(\s*([a-z][0-9_]{0,3})\s*:\s*([^()]{1,80}?)\s*\)", text):
        if not any(n == name for n, _ in out):
            out.append((name, kind))
    return out


def parse_decomposition(text: str, question: str = "") -> Decomposition:
    """Goal, rule, variables and subgoals of a decomposition (I.1 format).

    Subgoals come from `Subgoals:`, else `Premises:`, else the rule's IF-part split on AND.
    Raises PromptParseError when no subgoal can be read.
    """
    text = _require_text(text)
    warnings: list[str] = []
    found = _sections(text, _DECOMPOSITION_HEADERS, ("question", "existing rules"), warnings)
    goal, rule = _text(found.get("goal")), _text(found.get("rule"))
    subgoals = _items(found.get("subgoals"))
    if not subgoals and _items(found.get("premises")):
        subgoals = _items(found.get("premises"))
        _warn(warnings, "no Subgoals section: used the Premises")
    if not subgoals and rule:
        body = _RULE_BODY.match(rule)
        if body:
            subgoals = [s.strip(" .,") for s in re.split(r"\s+AND\s+", body.group(1)) if s.strip(" .,")]
            _warn(warnings, "no Subgoals section: split the rule's IF-part")
    subgoals = _dedupe(subgoals)[:_MAX_ITEMS]
    if EXAMPLE_NAME not in question.lower():
        kept = [s for s in subgoals if _normal(s) not in EXAMPLE_SUBGOALS]
        if len(kept) < len(subgoals):
            _warn(warnings, "dropped subgoals copied from the prompt's example")
            subgoals = kept
    if not subgoals:
        raise PromptParseError(f"no subgoals in the decomposition: {text[:120]!r}")
    return Decomposition(goal=goal, rule=rule, variables=_variables(found.get("variables"), goal),
                         subgoals=subgoals, difference=_text(found.get("difference")), warnings=warnings)


# -- unification --------------------------------------------------------------------------------
_UNIFY_HEADERS = {
    "unification status": "status", "status": "status", "substitution": "substitution",
    "current substitution": "substitution", "grounded subgoals": "grounded", "grounded": "grounded",
    "unresolved subgoals": "unresolved", "unresolved": "unresolved", "reasoning": "reasoning",
    "final answer": "answer", "answer": "answer", "known info": "known", "known information": "known",
}
_STATUSES: dict[str, UnifyStatus] = {"satisfied": "satisfied", "unsatisfied": "unsatisfied",
                                      "not satisfied": "unsatisfied", "conflict": "conflict",
                                      "partially satisfied": "unsatisfied", "partial": "unsatisfied"}
_ARROW = re.compile(r"\s*(?:<=|⇐|<-|←|<==)\s*")
_FACT_REF = re.compile(r"\b(?:facts?|#)\s*#?\s*((?:\d{1,6}(?:\s*(?:,|and|&|/)\s*)?)+)", re.IGNORECASE)
_INTEGER = re.compile(r"\d{1,6}")
_BARE_NUMBERS = re.compile(r"[\s\d,&()\[\].]*(?:and[\s\d,&()\[\].]*)*", re.IGNORECASE)
_BINDINGS_LABEL = re.compile(r"[;,]?\s*bindings?\s*[:=]\s*", re.IGNORECASE)
_WHY = re.compile(r"\s+(?:--|—|–|-{3})\s*|\s*(?:--|—)\s+")


def _status(value: str, warnings: list[str]) -> UnifyStatus | None:
    key = " ".join(re.sub(r"[^a-z ]", " ", value.lower()).split())
    if not key:
        return None
    for word, status in sorted(_STATUSES.items(), key=lambda kv: -len(kv[0])):
        if key.startswith(word):
            return status
    _warn(warnings, f"unknown unification status {value[:40]!r}: read as unsatisfied")
    return "unsatisfied"


def _fact_indices(support: str, n_facts: int, warnings: list[str]) -> list[int]:
    """0-based indices of the facts a support clause names (`Fact 3`, `Facts 1 and 2`, `#2`, `3`)."""
    refs = _FACT_REF.findall(support)
    numbers = [int(n) for ref in refs for n in _INTEGER.findall(ref)]
    if not refs and _BARE_NUMBERS.fullmatch(support):  # "<= 3" or "<= 1, 2": fact numbers too
        numbers = [int(n) for n in _INTEGER.findall(support)[:_MAX_ITEMS]]
    out: list[int] = []
    for number in numbers:
        if 1 <= number <= n_facts:
            if number - 1 not in out:
                out.append(number - 1)
        else:
            _warn(warnings, f"dropped a reference to fact {number} (only {n_facts} facts were shown)")
    return out


def _grounding(item: str, n_facts: int, warnings: list[str]) -> Grounding | None:
    head, label, tail = item, None, ""
    label = _BINDINGS_LABEL.search(item)
    if label:
        head, tail = item[: label.start()], item[label.end():]
    parts = _ARROW.split(head, maxsplit=1)
    if len(parts) == 2:
        subgoal, support = parts
    else:
        ref = _FACT_REF.search(head)
        if ref is None:
            _warn(warnings, f"grounded subgoal without a supporting fact: {item[:60]!r}")
            return None
        subgoal, support = head[: ref.start()].rstrip(" ([-–—:;,"), head[ref.start():]
    subgoal = subgoal.strip(" -–—:;,")
    facts = _fact_indices(support, n_facts, warnings)
    known = "known" in support.lower()
    if not subgoal or (not facts and not known):
        _warn(warnings, f"grounding without a usable support was not counted: {item[:60]!r}")
        return None
    return Grounding(subgoal=subgoal, facts=facts, known_info=known and not facts, bindings=parse_bindings(tail))


def parse_unification(text: str, n_facts: int) -> Unification:
    """Status, substitution θ, grounded subgoals with their facts, unresolved subgoals, answer, known info.

    Fact numbers are read 1-based (as the prompt numbers them) and returned 0-based; those outside
    the `n_facts` shown are dropped. A grounding line with no usable support is not a grounding.
    Raises PromptParseError when none of the format's sections is there.
    """
    text = _require_text(text)
    if isinstance(n_facts, bool) or not isinstance(n_facts, int) or n_facts < 0:
        raise PromptParseError(f"n_facts must be a non-negative int, got {n_facts!r}")
    warnings: list[str] = []
    found = _sections(text, _UNIFY_HEADERS, ("question", "goal", "facts", "subgoals"), warnings)
    if not {"status", "grounded", "unresolved", "substitution"} & set(found):
        raise PromptParseError(f"no unification status, substitution or subgoal lists: {text[:120]!r}")
    grounded = [g for item in _items(found.get("grounded")) if (g := _grounding(item, n_facts, warnings))]
    unresolved = []
    for item in _items(found.get("unresolved")):
        subgoal, _, why = (p.strip() for p in _partition_why(item))
        if subgoal and not _is_none(subgoal):
            unresolved.append(Unresolved(subgoal, why))
    known = [k.strip() for k in _split_top_level(_text(found.get("known"))) if k.strip() and not _is_none(k.strip())]
    status = _status(_text(found.get("status")), warnings)
    substitution = parse_bindings(found["substitution"].inline) if "substitution" in found else {}
    return Unification(status=status, substitution=substitution, grounded=grounded, unresolved=unresolved,
                       final_answer=_text(found.get("answer")), known_info=known[:_MAX_ITEMS],
                       reasoning=_text(found.get("reasoning")), warnings=warnings)


def _partition_why(item: str) -> tuple[str, str, str]:
    match = _WHY.search(item)
    if match is None:
        return item, "", ""
    return item[: match.start()], match.group(0), item[match.end():]


# -- refinement ---------------------------------------------------------------------------------
_REFINE_HEADERS = {
    "refinement status": "status", "status": "status", "missing info": "missing", "missing information": "missing",
    "relation type": "relation", "refined subgoals": "subgoals", "refined subgoal": "subgoals",
    "subgoals": "subgoals", "retrieval queries": "queries", "retrieval query": "queries", "queries": "queries",
    "rationale": "rationale",
}
_RELATIONS = ("temporal", "causal", "semantic", "spatial")


def parse_refinement(text: str) -> Refinement:
    """Status (refine | stop), missing info, relation type, refined subgoals and their queries.

    Without a status line, refined subgoals or queries imply `refine`. Raises PromptParseError
    when there is neither a status nor anything to search for.
    """
    text = _require_text(text)
    warnings: list[str] = []
    found = _sections(text, _REFINE_HEADERS, ("question", "goal", "unresolved subgoals", "retrieved facts"),
                      warnings)
    subgoals = _dedupe(_items(found.get("subgoals")))[:_MAX_ITEMS]
    queries = _items(found.get("queries"))[:_MAX_ITEMS]
    raw_status = _text(found.get("status")).lower()
    first = next(iter(re.findall(r"[a-z]+", raw_status)), "")
    if first == "stop":
        status: RefineStatus = "stop"
    elif first.startswith("refin") or subgoals or queries:
        status = "refine"
        if not first.startswith("refin"):
            _warn(warnings, f"refinement status {raw_status[:30]!r} read as refine")
    else:
        raise PromptParseError(f"no refinement status and no refined subgoals or queries: {text[:120]!r}")
    relation = _text(found.get("relation")).lower()
    relation = next((r for r in _RELATIONS if r in relation), "")
    return Refinement(status=status, missing_info=_text(found.get("missing")), relation_type=relation,
                      subgoals=subgoals, queries=queries, rationale=_text(found.get("rationale")), warnings=warnings)
