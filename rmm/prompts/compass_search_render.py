"""Filling CompassMem's search templates (`compass_search_*.txt`, paper App. F.2): planner,
start-node selection, the explorer's action decision, refinement and the responder.

Nodes are shown by a handle local to the question (`N3`: the third node the search met), never
by their memory id, so a reply can only name nodes it was shown (`rmm.prompts.compass_search_parse`
maps handles back). Each template's worked example is a user → assistant exchange before the case,
as for the goal and MemR³ prompts (small chat models copy an assistant turn's format far more
reliably). The responder cites memories 0-based, as RMM's answers do, so
`rmm.policy.citations.parse_citations` reads it; the paper's responder does not cite (ours must:
its citations are the reranker's reward).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass

from rmm.prompts.render import _render_history, few_shot_messages, load_template
from rmm.types import Memory, Message, Turn

__all__ = ["NeighbourView", "NodeView", "action_messages", "compass_answer_messages", "node_handle",
           "plan_messages", "refine_messages", "start_messages"]

_MAX_NODE_CHARS = 400


def node_handle(number: int) -> str:
    """The label of the `number`-th node a question's search met (1-based): `N3`."""
    return f"N{number}"


@dataclass(frozen=True)
class NodeView:
    """A node as a prompt shows it: its handle number, its memory, participants, topic and score."""

    number: int
    memory: Memory
    participants: tuple[str, ...] = ()
    topic: str = ""
    score: float | None = None


@dataclass(frozen=True)
class NeighbourView:
    """A neighbour of the current node: the node and the edge's label and direction."""

    node: NodeView
    label: str
    outgoing: bool  # current -label-> neighbour (else neighbour -label-> current)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def render_node(view: NodeView, *, score: bool = False) -> str:
    """`[N3] summary (time: …; with: …)`, cut to a bounded length."""
    text = _one_line(view.memory.text)[:_MAX_NODE_CHARS]
    facts = []
    when = view.memory.time_span[0] if view.memory.time_span else None
    if when:
        facts.append(f"time: {_one_line(when)}")
    if view.participants:
        facts.append("with: " + ", ".join(_one_line(p) for p in view.participants))
    extra = f" ({'; '.join(facts)})" if facts else ""
    similarity = f" (similarity {view.score:.2f})" if score and view.score is not None else ""
    return f"[{node_handle(view.number)}] {text}{extra}{similarity}"


def _messages(name: str, **values: str) -> list[Message]:
    """The template `name` as few-shot chat messages (`rmm.prompts.render.few_shot_messages`); its
    instructions may name bounds (`$max_nodes`), filled first."""
    text = string.Template(load_template(name).template).safe_substitute(**{k: v for k, v in values.items()
                                                                          if k == "max_nodes"})
    return few_shot_messages(text, **values)


def _subgoals(subgoals: Sequence[str], satisfied: Sequence[bool] | None = None) -> str:
    if satisfied is None:
        return "\n".join(f"{i}. {_one_line(s)}" for i, s in enumerate(subgoals, 1)) or "(none)"
    return "\n".join(f"{i}. [{'x' if done else ' '}] {_one_line(s)}"
                     for i, (s, done) in enumerate(zip(subgoals, satisfied), 1)) or "(none)"


def plan_messages(question: str) -> list[Message]:
    """The planner (Eq. 7): the question → 2-5 sub-goals."""
    return _messages("compass_search_plan", question=_one_line(question))


def start_messages(question: str, subgoals: Sequence[str], groups: Sequence[tuple[str, Sequence[NodeView]]],
                   max_nodes: int) -> list[Message]:
    """Start-node selection (Ψ_start) over the localization slate, grouped by topic."""
    blocks = []
    for index, (_, nodes) in enumerate(groups):
        label = f"Topic {_topic_letter(index)}:"
        blocks.append("\n".join([label, *(render_node(n, score=True) for n in nodes)]))
    return _messages("compass_search_start", question=_one_line(question), subgoals=_subgoals(subgoals),
                     nodes="\n".join(blocks) or "(none)", max_nodes=str(max_nodes))


def _topic_letter(index: int) -> str:
    letters = string.ascii_uppercase
    return letters[index] if index < len(letters) else f"{letters[index // 26 - 1]}{letters[index % 26]}"


def action_messages(question: str, subgoals: Sequence[str], satisfied: Sequence[bool], kept: Sequence[NodeView],
                    current: NodeView, neighbours: Sequence[NeighbourView]) -> list[Message]:
    """The explorer's decision at one node (Eq. 9): SKIP / EXPAND / ANSWER, next nodes, satisfied sub-goals."""
    here = node_handle(current.number)
    lines = []
    for n in neighbours:
        there = node_handle(n.node.number)
        edge = f"{here} -{_one_line(n.label)}-> {there}" if n.outgoing else f"{there} -{_one_line(n.label)}-> {here}"
        text = render_node(n.node)
        lines.append(f"[{there}] ({edge}){text[len(there) + 2:]}")
    return _messages("compass_search_action", question=_one_line(question), subgoals=_subgoals(subgoals, satisfied),
                     kept="\n" + "\n".join(render_node(k) for k in kept) if kept else "(No information kept yet)",
                     current=render_node(current), neighbours="\n".join(lines) or "(none)")


def refine_messages(question: str, subgoals: Sequence[str], satisfied: Sequence[bool],
                    kept: Sequence[NodeView]) -> list[Message]:
    """Gap-aware refinement (Eq. 8): a new query aimed at the unsatisfied sub-goals."""
    done = [f"{i}. {_one_line(s)}" for i, (s, ok) in enumerate(zip(subgoals, satisfied), 1) if ok]
    open_ = [f"{i}. {_one_line(s)}" for i, (s, ok) in enumerate(zip(subgoals, satisfied), 1) if not ok]
    context = "\n".join(f"- {render_node(k)[len(node_handle(k.number)) + 3:]}" for k in kept) or "(nothing yet)"
    return _messages("compass_search_refine", question=_one_line(question), satisfied="; ".join(done) or "(none)",
                     unsatisfied="; ".join(open_) or "(none)", context=context)


def compass_answer_messages(question: str, evidence: Sequence[Memory],
                            history: Sequence[Turn] | None = None) -> list[Message]:
    """The responder: a short answer from the kept evidence, citing memories 0-based."""
    context = "\n".join(f"Memory [{i}]: {render_node(NodeView(0, m))[len(node_handle(0)) + 3:]}"
                        for i, m in enumerate(evidence)) or "(none)"
    return _messages("compass_search_answer", history=_render_history(history).strip(), question=_one_line(question),
                     context=context)
