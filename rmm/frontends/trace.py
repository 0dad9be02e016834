"""What a query-side front end did for one question: JSON for machines, a tree for people.

`FrontendTrace` is what every front end's trace shares — the question and how it ended, the
memories retrieved, every LLM call with its tokens and seconds, the usage they add up to, the JSON
form (the record plus its usage) and the way back, and the header of the readable view;
`print_trace` prints any of them. `LLMCall` and `QueryRecord` are the records every front end
writes.

`GoalTrace` (GOAL-MEM) records every breadth step (goal, rule, variables, subgoals), every depth
step (the refinement, the queries with the memories each retrieved, the unification's bindings,
grounded and unresolved subgoals) and how the question ended; `MemR3Trace` lives beside the MemR³
front end (`rmm.frontends.memr3_trace`). `Trace.from_json(trace.to_json())` gives the same trace back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Self

from rich.console import Console
from rich.markup import escape
from rich.tree import Tree

from rmm.llm.base import Usage

__all__ = [
    "BreadthStep",
    "DepthStep",
    "FrontendTrace",
    "GoalTrace",
    "GroundingRecord",
    "LLMCall",
    "QueryRecord",
    "RefineRecord",
    "UnifyRecord",
    "memory_lines",
    "print_trace",
    "render_trace",
    "shorten",
]


@dataclass
class LLMCall:
    step: str  # goal: decompose | unify | refine | answer; MemR³: generate | answer
    breadth: int  # MemR³ has one loop: always 0
    depth: int  # MemR³: the iteration (-1: the final answer)
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    output: str = ""
    error: str | None = None  # why the output could not be parsed


@dataclass
class QueryRecord:
    subgoal: str  # MemR³: the refinement Δq
    query: str  # the text sent to retriever → reranker (MemR³: q ⊕ Δq)
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
    outcome: str = ""  # grounded | malformed | no-new-memory | stopped | depth-exhausted | budget-spent
    error: str | None = None  # why the decomposition could not be read
    goal: str = ""
    rule: str = ""
    variables: list[str] = field(default_factory=list)
    subgoals: list[str] = field(default_factory=list)
    difference: str = ""
    steps: list[DepthStep] = field(default_factory=list)


@dataclass
class FrontendTrace:
    """What every front end's trace has: the question, how it ended, the memories and the LLM calls.

    Subclasses are dataclasses that add their own steps; `_records` turns those steps' JSON back
    into records and `render` draws them under `header`.
    """

    question: str
    user: str
    outcome: str = ""
    stop_reason: str = ""
    answer: str = ""
    cited: list[str] = field(default_factory=list)  # ids of the memories the answer cites
    retrieved: list[str] = field(default_factory=list)  # every distinct memory, in retrieval order
    memories: dict[str, str] = field(default_factory=dict)  # id → text, for reading the trace
    calls: list[LLMCall] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def usage(self) -> Usage:
        return Usage(calls=len(self.calls), prompt_tokens=sum(c.prompt_tokens for c in self.calls),
                     completion_tokens=sum(c.completion_tokens for c in self.calls),
                     seconds=sum(c.seconds for c in self.calls))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "usage": asdict(self.usage)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        fields = {k: v for k, v in data.items() if k != "usage"}
        fields["calls"] = [LLMCall(**c) for c in data.get("calls", [])]
        return cls(**cls._records(fields))

    @classmethod
    def _records(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The subclass's own nested records, from their JSON objects."""
        return data

    def render(self, *, show_memories: bool = True) -> Tree:
        """The readable view: a tree under `header`."""
        raise NotImplementedError(f"{type(self).__name__} has no readable view")

    def header(self, *facts: str) -> Tree:
        """The question with user, ending, LLM calls, tokens, seconds and the subclass's `facts`."""
        usage = self.usage
        ending = f"{self.outcome} ({self.stop_reason})" if self.stop_reason else self.outcome
        summary = [f"user {self.user}", ending, f"{usage.calls} LLM calls",
                   f"{usage.prompt_tokens}+{usage.completion_tokens} tokens", f"{self.seconds:.1f}s", *facts]
        return Tree(f"[bold]{shorten(self.question)}[/bold]  [dim]{escape(' · '.join(summary))}[/dim]")


@dataclass
class GoalTrace(FrontendTrace):
    """GOAL-MEM's search for one question; `outcome` is grounded | fallback | no-memories."""

    goal: str = ""
    breadths: list[BreadthStep] = field(default_factory=list)
    grounded_goal: str = ""
    bindings: dict[str, str] = field(default_factory=dict)
    answer_facts: list[str] = field(default_factory=list)  # memory ids shown to the final answer
    supporting: list[str] = field(default_factory=list)  # F of the grounded breadth
    fallback_queries: list[QueryRecord] = field(default_factory=list)  # the question itself, when nothing else was
    budget: int = 0

    @property
    def queries(self) -> list[QueryRecord]:
        return [q for b in self.breadths for s in b.steps for q in s.queries] + self.fallback_queries

    @classmethod
    def _records(cls, data: dict[str, Any]) -> dict[str, Any]:
        return {**data, "breadths": [_breadth(b) for b in data.get("breadths", [])],
                "fallback_queries": [QueryRecord(**q) for q in data.get("fallback_queries", [])]}

    def render(self, *, show_memories: bool = True) -> Tree:
        return render_trace(self, show_memories=show_memories)


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
def shorten(text: str, width: int = 110) -> str:
    """One line of at most `width` characters, escaped for rich markup."""
    text = " ".join(str(text).split())
    return escape(text if len(text) <= width else text[: width - 1] + "…")


def memory_lines(parent: Tree, ids: list[str], memories: dict[str, str],
                 label: Callable[[str], str] = str) -> None:
    """One line per memory under `parent`: its label (dim; by default its id), then its text."""
    for memory_id in ids:
        parent.add(f"[dim]{escape(label(memory_id))}[/dim] {shorten(memories.get(memory_id, ''), 90)}")


def print_trace(trace: FrontendTrace, console: Console | None = None, *, show_memories: bool = True) -> None:
    """Any front end's trace as its tree."""
    (console or Console()).print(trace.render(show_memories=show_memories), highlight=False)


def _bindings(bindings: dict[str, str]) -> str:
    return escape("{" + ", ".join(f"{k} / {v}" for k, v in bindings.items()) + "}")


def render_trace(trace: GoalTrace, *, show_memories: bool = True) -> Tree:
    """The question's search as a tree: breadths → depths → queries, unification, bindings."""
    root = trace.header(f"{len(trace.retrieved)}/{trace.budget} memories")
    for b in trace.breadths:
        node = root.add(f"[bold cyan]breadth {b.breadth}[/bold cyan] [dim]{escape(b.outcome)}[/dim]")
        if b.error:
            node.add(f"[red]decomposition unreadable:[/red] {shorten(b.error)}")
        for label, value in (("goal", b.goal), ("rule", b.rule), ("variables", ", ".join(b.variables)),
                             ("new", b.difference)):
            if value:
                node.add(f"{label}: {shorten(value)}")
        for step in b.steps:
            _render_step(node, step, trace, show_memories)
    for q in trace.fallback_queries:
        fallback = root.add(f"[magenta]fallback query[/magenta] {shorten(q.query, 90)}  "
                            f"[dim]{len(q.memory_ids)} memories[/dim]")
        if show_memories:
            memory_lines(fallback, q.memory_ids, trace.memories)
    if trace.grounded_goal:
        root.add(f"[green]grounded goal:[/green] {shorten(trace.grounded_goal)}  {_bindings(trace.bindings)}")
    answer = root.add(f"[bold]answer:[/bold] {shorten(trace.answer)}")
    memory_lines(answer, trace.cited, trace.memories, lambda memory_id: f"cited {memory_id}:")
    return root


def _render_step(parent: Tree, step: DepthStep, trace: GoalTrace, show_memories: bool) -> None:
    node = parent.add(f"[bold]depth {step.depth}[/bold] [dim]{step.new_memories} new memories[/dim]")
    if step.refine is not None:
        r = step.refine
        if r.error:
            node.add(f"[red]refinement unreadable:[/red] {shorten(r.error)}")
        else:
            node.add(f"refine: {escape(r.status)}" + (f" · {escape(r.relation_type)}" if r.relation_type else "")
                     + (f" · missing: {shorten(r.missing_info, 80)}" if r.missing_info else ""))
    subgoals = node.add("subgoals")
    for s in step.subgoals:
        subgoals.add(shorten(s))
    for q in step.queries:
        reward = "" if q.reward is None else "  reward " + " ".join(f"{r:+.0f}" for r in q.reward)
        query = node.add(f"[magenta]query[/magenta] {shorten(q.query, 90)}  [dim]{len(q.memory_ids)} memories, "
                         f"{len(q.new_ids)} new{reward}[/dim]")
        if show_memories:
            memory_lines(query, q.memory_ids, trace.memories)
    if step.unify is not None:
        u = step.unify
        if u.error:
            node.add(f"[red]unification unreadable:[/red] {shorten(u.error)}")
        else:
            unify = node.add(f"unify: {escape(str(u.status))} θ={_bindings(u.substitution)}")
            for g in u.grounded:
                support = ", ".join(g.facts) or "known info"
                unify.add(f"[green]✓[/green] {shorten(g.subgoal, 80)} [dim]<= {escape(support)}[/dim]")
            for s, why in u.unresolved.items():
                unify.add(f"[yellow]✗[/yellow] {shorten(s, 80)}" + (f" [dim]-- {shorten(why, 60)}[/dim]" if why else ""))
            for c in u.conflicts:
                unify.add(f"[red]conflict[/red] {shorten(c)}")
    node.add(f"θ={_bindings(step.bindings)} · grounded {len(step.resolved)} · unresolved {len(step.unresolved)}")
