"""What the CompassMem search did for one question: JSON for machines, a tree for people, and the
paper's Table 4 statistics.

A trace records the planner's sub-goals, each localization round (the query, the pool, the slate
the reranker showed, the start nodes chosen), every explorer step (the node, its path length from
its start node, the neighbour slate it was shown and whether that slate was sampled, the action,
the next nodes, the sub-goals it satisfied, why an output was unreadable), the refinement, the
evidence the responder saw and every LLM call. `stats()` gives Table 4's figures for the question
(kept nodes, steps, paths, path lengths, refinement, actions, queue sizes, sub-goal satisfaction);
`table4(traces)` averages them over questions. `CompassTrace.from_json(trace.to_json())` gives the
same trace back.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.markup import escape
from rich.tree import Tree

from rmm.frontends.trace import FrontendTrace, memory_lines, shorten

__all__ = ["CompassTrace", "LocalizationRecord", "SlateRecord", "StepRecord", "render_compass_trace", "table4"]


@dataclass
class SlateRecord:
    """Nodes the reranker put in front of the search: the localization slate or a node's neighbours."""

    kind: str  # start | neighbours
    query: str  # the text the slate was scored against
    memory_ids: list[str]  # shown, in pick order
    candidates: int  # how many it was drawn from (unmasked)
    sampled: bool  # a Gumbel top-M the learner may learn from (False: all shown, or greedy)
    node: str = ""  # neighbours: whose
    reward: list[float] | None = None  # per shown node, once the question is answered; None = not learned


@dataclass
class LocalizationRecord:
    round: int  # 0: the question; 1: the refined query
    query: str
    pool: int  # first-stage candidates
    topics: int  # distinct topics the pool was diversified over (0: the user has no topic layer)
    slate: SlateRecord | None = None
    start: list[str] = field(default_factory=list)  # the start nodes pushed on the queue
    error: str | None = None  # why the start-node selection could not be read (then: fallback)


@dataclass
class StepRecord:
    step: int  # 1-based, over the question
    batch: int  # the generate call (one per batch of explorers)
    explorer: int
    node: str
    path_length: int  # 1 at a start node
    priority: float
    action: str  # SKIP | EXPAND | ANSWER
    next_nodes: list[str] = field(default_factory=list)
    satisfied: list[int] = field(default_factory=list)  # 1-based sub-goal numbers this step reported
    neighbours: SlateRecord | None = None
    reasoning: str = ""
    error: str | None = None  # unreadable even after the retry: the step fell back to SKIP, no next nodes
    warnings: list[str] = field(default_factory=list)


@dataclass
class CompassTrace(FrontendTrace):
    """CompassMem's search for one question; `outcome` is satisfied | exhausted | budget | no-memories.

    `retrieved` are the nodes the responder was given (the kept ones, or the first slate when none was
    kept), in the order they were kept."""

    policy: str = "llm"
    subgoals: list[str] = field(default_factory=list)
    satisfied: list[bool] = field(default_factory=list)
    plan_error: str | None = None
    localizations: list[LocalizationRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    refined_query: str = ""
    refine_error: str | None = None
    kept: list[str] = field(default_factory=list)
    fallback: bool = False  # nothing was kept: the responder saw the first slate
    max_queue: int = 0
    cited_evidence: list[int] = field(default_factory=list)

    @property
    def slates(self) -> list[SlateRecord]:
        """Every slate the reranker showed, in order."""
        starts = [loc.slate for loc in self.localizations if loc.slate is not None]
        return starts + [s.neighbours for s in self.steps if s.neighbours is not None]

    def stats(self) -> dict[str, Any]:
        """Table 4 for this question."""
        lengths: dict[str, int] = {}
        for step in self.steps:
            lengths[step.node] = step.path_length
        starts = [n for loc in self.localizations for n in loc.start]
        leaves = [s.path_length for s in self.steps if s.action == "SKIP" or not s.next_nodes]
        actions = Counter(s.action for s in self.steps)
        n = len(self.subgoals)
        return {
            "subgoals": n, "subgoal_satisfaction": sum(self.satisfied) / n if n else 0.0,
            "fully_satisfied": bool(n) and all(self.satisfied), "initial_nodes": len(self.localizations[0].start)
            if self.localizations else 0, "paths": len(starts), "steps": len(self.steps),
            "path_length": sum(leaves) / len(leaves) if leaves else 0.0,
            "max_path_length": max((s.path_length for s in self.steps), default=0),
            "refined": any(loc.round > 0 for loc in self.localizations), "kept_nodes": len(self.kept),
            "actions": {a: actions.get(a, 0) for a in ("EXPAND", "SKIP", "ANSWER")}, "max_queue": self.max_queue,
            "unreadable_steps": sum(1 for s in self.steps if s.error),
        }

    @classmethod
    def _records(cls, data: dict[str, Any]) -> dict[str, Any]:
        return {**data, "localizations": [_localization(x) for x in data.get("localizations", [])],
                "steps": [_step(x) for x in data.get("steps", [])]}

    def render(self, *, show_memories: bool = True) -> Tree:
        return render_compass_trace(self, show_memories=show_memories)


def _slate(data: dict[str, Any] | None) -> SlateRecord | None:
    return None if data is None else SlateRecord(**data)


def _localization(data: dict[str, Any]) -> LocalizationRecord:
    return LocalizationRecord(**{**data, "slate": _slate(data.get("slate"))})


def _step(data: dict[str, Any]) -> StepRecord:
    return StepRecord(**{**data, "neighbours": _slate(data.get("neighbours"))})


def table4(traces: Sequence[CompassTrace]) -> dict[str, float]:
    """The paper's Table 4 over questions: means of `stats()` (rates as fractions)."""
    rows = [t.stats() for t in traces]
    if not rows:
        return {}
    n = len(rows)
    actions = Counter()
    for r in rows:
        actions.update(r["actions"])
    total = sum(actions.values()) or 1
    out = {key: sum(float(r[key]) for r in rows) / n for key in
           ("subgoals", "subgoal_satisfaction", "fully_satisfied", "initial_nodes", "paths", "steps", "path_length",
            "kept_nodes", "max_queue", "unreadable_steps")}
    out["refinement_rate"] = sum(r["refined"] for r in rows) / n
    out["max_path_length"] = float(max(r["max_path_length"] for r in rows))
    out["no_kept_nodes"] = float(sum(r["kept_nodes"] == 0 for r in rows))
    out.update({f"action_{a.lower()}": actions[a] / total for a in ("EXPAND", "SKIP", "ANSWER")})
    out["questions"] = float(n)
    return out


# -- the readable view ------------------------------------------------------------------------------
def _reward(slate: SlateRecord) -> str:
    return "" if slate.reward is None else "  reward " + " ".join(f"{r:+.0f}" for r in slate.reward)


def render_compass_trace(trace: CompassTrace, *, show_memories: bool = True) -> Tree:
    """Sub-goals → localizations (slate, start nodes) → explorer steps → answer."""
    stats = trace.stats()
    root = trace.header(f"policy {trace.policy}", f"{stats['kept_nodes']} kept", f"{stats['steps']} steps",
                        f"max path {stats['max_path_length']}")
    goals = root.add("sub-goals" + (f" [red](plan unreadable: {shorten(trace.plan_error, 60)})[/red]"
                                    if trace.plan_error else ""))
    for goal, done in zip(trace.subgoals, trace.satisfied):
        goals.add(("[green]✓[/green] " if done else "[yellow]✗[/yellow] ") + shorten(goal, 100))
    for loc in trace.localizations:
        node = root.add(f"[magenta]localize[/magenta] {shorten(loc.query, 80)}  [dim]pool {loc.pool}, "
                        f"{loc.topics} topics[/dim]" + (f" [red]{shorten(loc.error, 60)}[/red]" if loc.error else ""))
        if loc.slate is not None:
            slate = node.add(f"slate ({'sampled' if loc.slate.sampled else 'greedy'}, {len(loc.slate.memory_ids)} of "
                             f"{loc.slate.candidates}){_reward(loc.slate)}")
            if show_memories:
                memory_lines(slate, loc.slate.memory_ids, trace.memories)
        node.add("start: " + escape(", ".join(loc.start) or "none"))
    for step in trace.steps:
        error = f" [red]unreadable: {shorten(step.error, 60)}[/red]" if step.error else ""
        node = root.add(f"[bold cyan]step {step.step}[/bold cyan] [dim]explorer {step.explorer}, path "
                        f"{step.path_length}, priority {step.priority:.2f}[/dim] {escape(step.node)} → "
                        f"[bold]{escape(step.action)}[/bold]{error}")
        if show_memories:
            node.add(shorten(trace.memories.get(step.node, ""), 100))
        if step.neighbours is not None:
            node.add(f"neighbours shown ({'sampled' if step.neighbours.sampled else 'all'}): "
                     f"{escape(', '.join(step.neighbours.memory_ids))}{_reward(step.neighbours)}")
        if step.next_nodes or step.satisfied:
            node.add(f"next {escape(', '.join(step.next_nodes) or 'none')} · satisfied {step.satisfied}")
    if trace.refined_query or trace.refine_error:
        root.add(f"refined: {shorten(trace.refined_query, 90)}" +
                 (f" [red]{shorten(trace.refine_error, 60)}[/red]" if trace.refine_error else ""))
    answer = root.add(f"[bold]answer:[/bold] {shorten(trace.answer)}" + ("  [dim](fallback: first slate)[/dim]"
                                                                        if trace.fallback else ""))
    memory_lines(answer, trace.cited, trace.memories, lambda memory_id: f"cited {memory_id}:")
    return root
