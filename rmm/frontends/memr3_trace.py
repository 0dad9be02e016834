"""What the MemR³ front end did for one question: JSON for machines, a tree for people.

A trace records the first retrieval (the question itself), then every iteration: the decision
directive the generate call was given, what the LLM decided and what the router made of it (and
why), the evidence with the memories each bullet cites, the gaps, the payload (refined query,
reasoning or draft), the retrieval the iteration triggered with its rewards; then the final
answer, the evidence it cited, and every LLM call with its tokens and seconds.
`MemR3Trace.from_json(trace.to_json())` gives the same trace back.

What every front end's trace shares (question, ending, memories, LLM calls, usage, JSON) comes from
`rmm.frontends.trace.FrontendTrace`, with its records: `LLMCall` (MemR³ has one loop, so
`breadth` is always 0, `depth` is the iteration and -1 the final answer) and `QueryRecord`
(`subgoal` holds the refinement Δq, `query` the text searched, q ⊕ Δq; every id is new, the mask
sees to that).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.markup import escape
from rich.tree import Tree

from rmm.frontends.trace import FrontendTrace, QueryRecord, memory_lines, shorten

__all__ = ["EvidenceRecord", "IterationRecord", "MemR3Trace", "render_memr3_trace"]


@dataclass
class EvidenceRecord:
    text: str
    memories: list[str] = field(default_factory=list)  # ids of the memories the bullet cites


@dataclass
class IterationRecord:
    iteration: int  # k, 1-based: the k-th generate call
    directive: str  # the decision directive it was given (rmm.prompts.memr3_render.DIRECTIVES)
    decision: str | None  # what the LLM chose (None: unreadable or no decision)
    action: str  # what the router did: retrieve | reflect | answer
    override: str = ""  # why the router changed the LLM's choice
    evidence: list[EvidenceRecord] = field(default_factory=list)  # E_k
    gaps: list[str] = field(default_factory=list)  # G_k
    retrieval_query: str = ""  # Δq_k
    reasoning: str = ""  # F_k
    draft: str = ""  # w_k
    error: str | None = None  # why the output could not be read (E and G then stay as they were)
    warnings: list[str] = field(default_factory=list)
    retrieval: QueryRecord | None = None  # the retrieval this iteration's action ran


@dataclass
class MemR3Trace(FrontendTrace):
    """MemR³'s loop for one question; `outcome` is answered | budget | no-memories, `retrieved` is
    M^ret in retrieval order (handle n = position n) and `cited` the memories behind the cited evidence."""

    n_max: int = 0
    n_chk: int = 0
    n_cap: int = 0
    start: QueryRecord | None = None  # start → retrieve, with the question alone
    iterations: list[IterationRecord] = field(default_factory=list)
    draft: str = ""  # the draft the final answer was given
    evidence: list[EvidenceRecord] = field(default_factory=list)  # what the final answer saw
    cited_evidence: list[int] = field(default_factory=list)  # indices into `evidence`

    @property
    def queries(self) -> list[QueryRecord]:
        """Every retrieval, in order: the start, then those the iterations ran."""
        first = [self.start] if self.start is not None else []
        return first + [i.retrieval for i in self.iterations if i.retrieval is not None]

    @classmethod
    def _records(cls, data: dict[str, Any]) -> dict[str, Any]:
        start = data.get("start")
        return {**data, "start": QueryRecord(**start) if start else None,
                "iterations": [_iteration(i) for i in data.get("iterations", [])],
                "evidence": [EvidenceRecord(**e) for e in data.get("evidence", [])]}

    def render(self, *, show_memories: bool = True) -> Tree:
        return render_memr3_trace(self, show_memories=show_memories)


def _iteration(data: dict[str, Any]) -> IterationRecord:
    retrieval = data.get("retrieval")
    return IterationRecord(**{**data, "evidence": [EvidenceRecord(**e) for e in data.get("evidence", [])],
                              "retrieval": QueryRecord(**retrieval) if retrieval else None})


# -- the readable view ------------------------------------------------------------------------------
def _retrieval(parent: Tree, record: QueryRecord, trace: MemR3Trace, show_memories: bool) -> None:
    reward = "" if record.reward is None else "  reward " + " ".join(f"{r:+.0f}" for r in record.reward)
    node = parent.add(f"[magenta]retrieve[/magenta] {shorten(record.query, 90)}  "
                      f"[dim]{len(record.memory_ids)} new memories{reward}[/dim]")
    if show_memories:
        memory_lines(node, record.memory_ids, trace.memories,
                     lambda memory_id: f"M{trace.retrieved.index(memory_id) + 1} {memory_id}")


def _evidence(parent: Tree, evidence: list[EvidenceRecord], trace: MemR3Trace) -> None:
    for e in evidence:
        handles = ", ".join(f"M{trace.retrieved.index(i) + 1}" for i in e.memories if i in trace.retrieved)
        parent.add(f"[green]•[/green] {shorten(e.text, 100)}" + (f" [dim][{escape(handles)}][/dim]" if handles else ""))


def render_memr3_trace(trace: MemR3Trace, *, show_memories: bool = True) -> Tree:
    """The question's loop as a tree: start retrieval → iterations (decision, evidence, gaps, retrieval) → answer."""
    root = trace.header(f"{len(trace.retrieved)} memories",
                         f"n_max {trace.n_max}, n_chk {trace.n_chk}, n_cap {trace.n_cap}")
    if trace.start is not None:
        _retrieval(root, trace.start, trace, show_memories)
    for it in trace.iterations:
        override = f" [yellow]router: {escape(it.override)}[/yellow]" if it.override else ""
        node = root.add(f"[bold cyan]iteration {it.iteration}[/bold cyan] [dim]directive {escape(it.directive)} · "
                        f"LLM {escape(str(it.decision))} →[/dim] [bold]{escape(it.action)}[/bold]{override}")
        if it.error:
            node.add(f"[red]unreadable:[/red] {shorten(it.error)}")
        evidence = node.add(f"evidence ({len(it.evidence)})")
        _evidence(evidence, it.evidence, trace)
        node.add("gaps: " + (shorten("; ".join(it.gaps)) if it.gaps else "none"))
        for label, value in (("query", it.retrieval_query), ("reasoning", it.reasoning), ("draft", it.draft)):
            if value:
                node.add(f"{label}: {shorten(value)}")
        if it.retrieval is not None:
            _retrieval(node, it.retrieval, trace, show_memories)
    draft = f"  [dim]draft: {shorten(trace.draft, 60)}[/dim]" if trace.draft else ""
    answer = root.add(f"[bold]answer:[/bold] {shorten(trace.answer)}{draft}")
    for index in trace.cited_evidence:
        if 0 <= index < len(trace.evidence):
            cited = trace.evidence[index]
            answer.add(f"[dim]cited evidence [{index}][/dim] {shorten(cited.text, 90)} "
                       f"[dim]{escape(', '.join(cited.memories))}[/dim]")
    return root
