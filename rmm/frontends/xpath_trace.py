"""What the Semantic XPath front end did for one question: JSON for machines, a tree for people.

A trace records every query attempt (the LLM's, its one retry, the template) with its text and why
it was refused (the parser's message with its column, or "selected no memory"), the query that ran
and which fallback was taken, each step of its execution (the step, how many nodes its axis
reached, how many it kept, and the best of them with their weights), the candidates handed to the
reranker with their XPath weights, the memories shown with their rewards, and the answer.
`XPathTrace.from_json(trace.to_json())` gives the same trace back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.markup import escape
from rich.tree import Tree

from rmm.frontends.trace import FrontendTrace, memory_lines, shorten

__all__ = ["QueryAttempt", "StepRecord", "XPathTrace", "render_xpath_trace"]


@dataclass
class QueryAttempt:
    source: str  # llm | retry | template
    text: str  # the query as written (the LLM's reply's query, or the template)
    error: str | None = None  # why it was not used: a parse error (with its column) or an empty result
    raw: str = ""  # the LLM's whole reply (empty for the template)


@dataclass
class StepRecord:
    step: str  # the step's canonical text
    reached: int  # nodes its axis reached
    kept: int  # nodes left after the type, position and predicate (weight 0 included)
    top: list[tuple[str, str, float]] = field(default_factory=list)  # (node id, type, weight), best first


@dataclass
class XPathTrace(FrontendTrace):
    """One question: `outcome` is queried (the LLM's query ran) | fallback (the template ran) | no-memories."""

    scorer: str = ""
    schema: str = ""  # Σ as the prompt showed it
    attempts: list[QueryAttempt] = field(default_factory=list)
    query: str = ""  # the query that ran
    fallback: str = ""  # "" (the LLM's first query ran) | retry | template
    steps: list[StepRecord] = field(default_factory=list)
    candidates: list[tuple[str, float]] = field(default_factory=list)  # (memory id, XPath weight), best first
    shown: list[str] = field(default_factory=list)  # in pick order
    reward: list[float] | None = None  # per shown memory; None: not learned from
    sampled: bool = False  # the selection was a Gumbel sample (learnable), not greedy

    @classmethod
    def _records(cls, data: dict[str, Any]) -> dict[str, Any]:
        return {**data, "attempts": [QueryAttempt(**a) for a in data.get("attempts", [])],
                "steps": [StepRecord(**{**s, "top": [tuple(t) for t in s.get("top", [])]}) for s in data.get("steps", [])],
                "candidates": [tuple(c) for c in data.get("candidates", [])]}

    def render(self, *, show_memories: bool = True) -> Tree:
        return render_xpath_trace(self, show_memories=show_memories)


def render_xpath_trace(trace: XPathTrace, *, show_memories: bool = True) -> Tree:
    """Attempts → the query with each step's weights → candidates → shown memories → answer."""
    root = trace.header(f"scorer {trace.scorer}", f"fallback {trace.fallback or 'none'}")
    attempts = root.add("query attempts")
    for a in trace.attempts:
        status = f"[red]{shorten(a.error, 90)}[/red]" if a.error else "[green]ran[/green]"
        attempts.add(f"[magenta]{escape(a.source)}[/magenta] {shorten(a.text, 100)}  {status}")
    if trace.query:
        query = root.add(f"[bold]query[/bold] {shorten(trace.query, 110)}")
        for s in trace.steps:
            best = ", ".join(f"{escape(node)} {weight:.3f}" for node, _, weight in s.top[:3])
            query.add(f"{escape(s.step)}  [dim]reached {s.reached}, kept {s.kept}[/dim]  {best}")
    if trace.candidates:
        root.add("candidates: " + ", ".join(f"{escape(i)} {w:.3f}" for i, w in trace.candidates[:10]))
    reward = "" if trace.reward is None else "  reward " + " ".join(f"{r:+.0f}" for r in trace.reward)
    shown = root.add(f"shown {len(trace.shown)}{' (sampled)' if trace.sampled else ''}{reward}")
    if show_memories:
        memory_lines(shown, trace.shown, trace.memories, lambda memory_id: memory_id)
    root.add(f"[bold]answer:[/bold] {shorten(trace.answer)}")
    return root
