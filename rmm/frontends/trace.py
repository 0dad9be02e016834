"""What the goal front end did for one question: JSON for machines, a tree for people.

A trace records every breadth step (goal, rule, variables, subgoals), every depth step (the
refinement, the queries with the memories each retrieved, the unification's bindings, grounded
and unresolved subgoals), every LLM call with its tokens and seconds, and how the question ended.
`GoalTrace.from_json(trace.to_json())` gives the same trace back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.tree import Tree

from rmm.llm.base import Usage

__all__ = [
    "BreadthStep",
    "DepthStep",
    "GoalTrace",
    "GroundingRecord",
    "LLMCall",
    "QueryRecord",
    "RefineRecord",
    "UnifyRecord",
    "print_trace",
    "render_trace",
]


@dataclass
class LLMCall:
    step: str  # decompose | unify | refine | answer
    breadth: int
    depth: int
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    output: str = ""
    error: str | None = None  # why the output could not be parsed


@dataclass
class QueryRecord:
    subgoal: str
    query: str  # the text sent to retriever → reranker
    memory_ids: list[str]  # shown by this query's selection, in pick order (after budget clipping)
    new_ids: list[str]  # those not retrieved earlier in this breadth
    reward: list[float] | None = None  # per memory, once the question is answered; None = not learned


@dataclass
class GroundingRecord:
    subgoal: str
    facts: list[str]  # memory ids
    known_info: bool = False
    bindings: dict[str, str] = field(default_factory=dict)


@dataclass
class UnifyRecord:
    status: str | None
    substitution: dict[str, str]
    grounded: list[GroundingRecord]
    unresolved: dict[str, str]  # subgoal → why
    final_answer: str = ""
    known_info: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class RefineRecord:
    status: str
    missing_info: str = ""
    relation_type: str = ""
    subgoals: list[str] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)
    rationale: str = ""
    error: str | None = None


@dataclass
class DepthStep:
    depth: int
    subgoals: list[str]  # the decomposition's (depth 0) or the refined ones
    refine: RefineRecord | None = None
    queries: list[QueryRecord] = field(default_factory=list)
    unify: UnifyRecord | None = None
    new_memories: int = 0
    bindings: dict[str, str] = field(default_factory=dict)  # θ after this step
    resolved: list[str] = field(default_factory=list)  # S after this step
    unresolved: list[str] = field(default_factory=list)  # U after this step


@dataclass
class BreadthStep:
    breadth: int
    goal: str = ""
    rule: str = ""
    variables: list[str] = field(default_factory=list)
    subgoals: list[str] = field(default_factory=list)
    difference: str = ""
    error: str | None = None
    steps: list[DepthStep] = field(default_factory=list)
    outcome: str = ""  # grounded | malformed | no-new-memory | stopped | depth-exhausted | budget-spent


@dataclass
class GoalTrace:
    question: str
    user: str
    goal: str = ""
    breadths: list[BreadthStep] = field(default_factory=list)
    outcome: str = ""  # grounded | fallback | no-memories
    stop_reason: str = ""
    answer: str = ""
    grounded_goal: str = ""
    bindings: dict[str, str] = field(default_factory=dict)
    answer_facts: list[str] = field(default_factory=list)  # memory ids shown to the final answer
    cited: list[str] = field(default_factory=list)
    supporting: list[str] = field(default_factory=list)  # F of the grounded breadth
    retrieved: list[str] = field(default_factory=list)  # every distinct memory, in retrieval order
    fallback_queries: list[QueryRecord] = field(default_factory=list)  # the question itself, when nothing else was
    memories: dict[str, str] = field(default_factory=dict)  # id → text, for reading the trace
    calls: list[LLMCall] = field(default_factory=list)
    budget: int = 0
    seconds: float = 0.0

    @property
    def usage(self) -> Usage:
        return Usage(calls=len(self.calls), prompt_tokens=sum(c.prompt_tokens for c in self.calls),
                     completion_tokens=sum(c.completion_tokens for c in self.calls),
                     seconds=sum(c.seconds for c in self.calls))

    @property
    def queries(self) -> list[QueryRecord]:
        return [q for b in self.breadths for s in b.steps for q in s.queries] + self.fallback_queries

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        usage = self.usage
        out["usage"] = {"calls": usage.calls, "prompt_tokens": usage.prompt_tokens,
                        "completion_tokens": usage.completion_tokens, "seconds": usage.seconds}
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GoalTrace:
        data = {k: v for k, v in data.items() if k != "usage"}
        data["calls"] = [LLMCall(**c) for c in data.get("calls", [])]
        data["breadths"] = [_breadth(b) for b in data.get("breadths", [])]
        data["fallback_queries"] = [QueryRecord(**q) for q in data.get("fallback_queries", [])]
        return cls(**data)


def _breadth(data: dict[str, Any]) -> BreadthStep:
    return BreadthStep(**{**data, "steps": [_depth(s) for s in data.get("steps", [])]})


def _depth(data: dict[str, Any]) -> DepthStep:
    unify = data.get("unify")
    if unify is not None:
        unify = UnifyRecord(**{**unify, "grounded": [GroundingRecord(**g) for g in unify.get("grounded", [])]})
    refine = data.get("refine")
    return DepthStep(**{**data, "unify": unify, "refine": RefineRecord(**refine) if refine else None,
                        "queries": [QueryRecord(**q) for q in data.get("queries", [])]})


# -- the readable view ------------------------------------------------------------------------------
def _short(text: str, width: int = 110) -> str:
    text = " ".join(str(text).split())
    return escape(text if len(text) <= width else text[: width - 1] + "…")


def _bindings(bindings: dict[str, str]) -> str:
    return escape("{" + ", ".join(f"{k} / {v}" for k, v in bindings.items()) + "}")


def render_trace(trace: GoalTrace, *, show_memories: bool = True) -> Tree:
    """The question's search as a tree: breadths → depths → queries, unification, bindings."""
    usage = trace.usage
    root = Tree(f"[bold]{_short(trace.question)}[/bold]  [dim]user {escape(trace.user)} · {trace.outcome}"
                f"{' (' + escape(trace.stop_reason) + ')' if trace.stop_reason else ''} · {usage.calls} LLM calls · "
                f"{usage.prompt_tokens}+{usage.completion_tokens} tokens · {trace.seconds:.1f}s · "
                f"{len(trace.retrieved)}/{trace.budget} memories[/dim]")
    for b in trace.breadths:
        node = root.add(f"[bold cyan]breadth {b.breadth}[/bold cyan] [dim]{escape(b.outcome)}[/dim]")
        if b.error:
            node.add(f"[red]decomposition unreadable:[/red] {_short(b.error)}")
        if b.goal:
            node.add(f"goal: {_short(b.goal)}")
        if b.rule:
            node.add(f"rule: {_short(b.rule)}")
        if b.variables:
            node.add(f"variables: {_short(', '.join(b.variables))}")
        if b.difference:
            node.add(f"new: {_short(b.difference)}")
        for step in b.steps:
            _render_step(node, step, trace, show_memories)
    for q in trace.fallback_queries:
        fallback = root.add(f"[magenta]fallback query[/magenta] {_short(q.query, 90)}  [dim]{len(q.memory_ids)} memories[/dim]")
        if show_memories:
            for memory_id in q.memory_ids:
                fallback.add(f"[dim]{escape(memory_id)}[/dim] {_short(trace.memories.get(memory_id, ''), 90)}")
    if trace.grounded_goal:
        root.add(f"[green]grounded goal:[/green] {_short(trace.grounded_goal)}  {_bindings(trace.bindings)}")
    answer = root.add(f"[bold]answer:[/bold] {_short(trace.answer)}")
    for memory_id in trace.cited:
        answer.add(f"[dim]cited[/dim] {escape(memory_id)}: {_short(trace.memories.get(memory_id, ''), 90)}")
    return root


def _render_step(parent: Tree, step: DepthStep, trace: GoalTrace, show_memories: bool) -> None:
    node = parent.add(f"[bold]depth {step.depth}[/bold] [dim]{step.new_memories} new memories[/dim]")
    if step.refine is not None:
        r = step.refine
        if r.error:
            node.add(f"[red]refinement unreadable:[/red] {_short(r.error)}")
        else:
            node.add(f"refine: {escape(r.status)}" + (f" · {escape(r.relation_type)}" if r.relation_type else "")
                     + (f" · missing: {_short(r.missing_info, 80)}" if r.missing_info else ""))
    subgoals = node.add("subgoals")
    for s in step.subgoals:
        subgoals.add(_short(s))
    for q in step.queries:
        reward = "" if q.reward is None else "  reward " + " ".join(f"{r:+.0f}" for r in q.reward)
        query = node.add(f"[magenta]query[/magenta] {_short(q.query, 90)}  [dim]{len(q.memory_ids)} memories, "
                         f"{len(q.new_ids)} new{reward}[/dim]")
        if show_memories:
            for memory_id in q.memory_ids:
                query.add(f"[dim]{escape(memory_id)}[/dim] {_short(trace.memories.get(memory_id, ''), 90)}")
    if step.unify is not None:
        u = step.unify
        if u.error:
            node.add(f"[red]unification unreadable:[/red] {_short(u.error)}")
        else:
            unify = node.add(f"unify: {escape(str(u.status))} θ={_bindings(u.substitution)}")
            for g in u.grounded:
                support = ", ".join(g.facts) or "known info"
                unify.add(f"[green]✓[/green] {_short(g.subgoal, 80)} [dim]<= {escape(support)}[/dim]")
            for s, why in u.unresolved.items():
                unify.add(f"[yellow]✗[/yellow] {_short(s, 80)}" + (f" [dim]-- {_short(why, 60)}[/dim]" if why else ""))
            for c in u.conflicts:
                unify.add(f"[red]conflict[/red] {_short(c)}")
    node.add(f"θ={_bindings(step.bindings)} · grounded {len(step.resolved)} · unresolved {len(step.unresolved)}")


def print_trace(trace: GoalTrace, console: Console | None = None, *, show_memories: bool = True) -> None:
    (console or Console()).print(render_trace(trace, show_memories=show_memories), highlight=False)
