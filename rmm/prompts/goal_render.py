"""Filling the GOAL-MEM templates (`goal_*.txt`): decompose, unify, refine, answer.

Facts are rendered as the paper's unification few-shots show them — numbered from 1, with the
time they were spoken — for the unify and refine prompts (`3- text [spoken at: …]`); the final
answer numbers them from 0, as RMM's citation format does (`Fact [0]: …`, cited as `[0, 2]`),
so its citations are read by `rmm.policy.citations.parse_citations`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rmm.prompts.render import few_shot_messages, load_template
from rmm.types import Memory, Message, Turn

__all__ = [
    "decompose_messages",
    "format_bindings",
    "goal_answer_messages",
    "refine_messages",
    "render_fact",
    "unify_messages",
]

_MAX_FACT_CHARS = 600


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _messages(name: str, **values: str) -> list[Message]:
    """The template `name` as few-shot chat messages (`rmm.prompts.render.few_shot_messages`)."""
    return few_shot_messages(load_template(name).template, **values)


def render_fact(memory: Memory) -> str:
    """A memory as one fact line: its text and, when known, when it was said."""
    text = _one_line(memory.text)[:_MAX_FACT_CHARS]
    when = memory.time_span[0] if memory.time_span else None
    return f"{text} [spoken at: {_one_line(when)}]" if when else text


def format_bindings(bindings: Mapping[str, str]) -> str:
    """θ in the paper's notation: `{x / Kyoto Latte, y / Matcha}` (`{}` when empty)."""
    return "{" + ", ".join(f"{k} / {_one_line(v)}" for k, v in bindings.items()) + "}"


def _lines(items: Sequence[str], bullet: str = "- ") -> str:
    return "\n".join(f"{bullet}{_one_line(i)}" for i in items) if items else "- none"


def _numbered_facts(facts: Sequence[Memory]) -> str:
    return "\n".join(f"{i}- {render_fact(m)}" for i, m in enumerate(facts, 1)) if facts else "(no facts found)"


def _optional(label: str, value: str) -> str:
    return f"\n{label}: {value}" if value else ""


def _context(substitution: Mapping[str, str], known: Sequence[str]) -> dict[str, str]:
    return {
        "substitution": _optional("Current Substitution", format_bindings(substitution) if substitution else ""),
        "known": _optional("Known Info", "; ".join(_one_line(k) for k in known)),
    }


def decompose_messages(question: str, *, goal: str = "", known: Sequence[str] = (),
                       avoid: Sequence[str] = ()) -> list[Message]:
    """Parse the question into an NL-Logic goal and decompose it (one call: PARSETONLLOGIC + Ψ_decomp).

    `avoid` lists prior decompositions that failed (their rules and unresolved subgoals): the
    breadth loop's next decomposition must take another way.
    """
    tried = ""
    if avoid:
        tried = ("\nExisting rules that failed — do NOT repeat them or their subgoals, find another way:\n"
                 + "\n".join(f"- {_one_line(a)}" for a in avoid)
                 + "\nAfter the subgoals, add one line: Difference From Prior Decompositions: <what is new>")
    return _messages("goal_decompose", question=_one_line(question), goal=_optional("Goal", _one_line(goal)),
                     known=_optional("Known Info (assume true)", "; ".join(_one_line(k) for k in known)),
                     avoid=tried)


def unify_messages(question: str, goal: str, rule: str, subgoals: Sequence[str], facts: Sequence[Memory], *,
                   substitution: Mapping[str, str] | None = None, known: Sequence[str] = ()) -> list[Message]:
    """One batched unification over every active subgoal and every retrieved fact (numbered from 1)."""
    return _messages("goal_unify", question=_one_line(question), goal=_one_line(goal) or "(infer it from the question)",
                     rule=_one_line(rule) or "(none)", subgoals=_lines(subgoals), facts=_numbered_facts(facts),
                     **_context(substitution or {}, known))


def refine_messages(question: str, goal: str, rule: str, unresolved: Sequence[tuple[str, str]],
                    facts: Sequence[Memory], *, substitution: Mapping[str, str] | None = None,
                    known: Sequence[str] = (), tried: Sequence[str] = ()) -> list[Message]:
    """One batched refinement of the unresolved subgoals (`(subgoal, why)` pairs)."""
    lines = [f"{s} -- {why}" if why else s for s, why in unresolved]
    previously = ("\nAlready tried (do NOT repeat or paraphrase):\n" + _lines(tried)) if tried else ""
    return _messages("goal_refine", question=_one_line(question), goal=_one_line(goal) or "(infer it from the question)",
                     rule=_one_line(rule) or "(none)", unresolved=_lines(lines), tried=previously,
                     facts=_numbered_facts(facts), **_context(substitution or {}, known))


def goal_answer_messages(question: str, grounded_goal: str, facts: Sequence[Memory],
                         history: Sequence[Turn] | None = None) -> list[Message]:
    """GENERATE(u, φ^g, F): the answer from the supporting facts only, citing them 0-based."""
    rendered = "\n".join(f"- Fact [{i}]: {render_fact(m)}" for i, m in enumerate(facts)) or "(none)"
    past = ""
    if history:
        past = "Conversation so far:\n" + "\n".join(f"{_one_line(t.speaker)}: {_one_line(t.text)}" for t in history)
    return _messages("goal_answer", history=past, question=_one_line(question),
                     goal=_one_line(grounded_goal) or "(not grounded)", facts=rendered)
