"""Filling the MemR³ templates (`memr3_*.txt`): the generate node's JSON prompt and the final answer.

The generate prompt is the paper's Appendix A — the strict-JSON system prompt with its
`{decision_directive}` and the user prompt with question, evidence, gaps, memory snippets,
reasoning and prior query — with one addition: each snippet carries a handle local to the
question (`[M3]`, the third memory retrieved for it) and each evidence bullet must end with the
handles it comes from, which is what lets evidence reward the memories behind it. Its worked
example is a user → assistant exchange before the case, as for the goal prompts (small chat
models copy an assistant turn's format far more reliably). Empty blocks read "None".

The final answer (the paper uses Zep's answer prompt, not reproduced there; ours is written in
its spirit: faithful to the evidence, absolute dates) sees the question, the draft answer and the
evidence only — not the raw snippets — and cites evidence items 0-based, as RMM's answers cite
memories, so `rmm.policy.citations.parse_citations` reads it.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Literal

from rmm.prompts.goal_render import _messages, _one_line, render_fact
from rmm.prompts.render import _render_history
from rmm.types import Memory, Message, Turn

__all__ = ["DIRECTIVES", "MEMR3_SCHEMA", "Directive", "generate_messages", "handle", "memr3_answer_messages"]

Directive = Literal["default", "answer", "retrieve", "reflect"]

# `default` is the paper's text; `answer` and `retrieve` are its one-word directives with the reason;
# `reflect` (nothing unseen is left to retrieve) also lets the model answer (see rmm.frontends.memr3).
DIRECTIVES: dict[str, str] = {
    "default": ('"reflect" if you need to think about the evidence and gaps; choose "answer" ONLY when evidence is '
                'solid and no gaps are noted; choose "retrieve" otherwise'),
    "answer": '"answer" (the iteration budget is used up: answer from the evidence you have)',
    "retrieve": '"retrieve" (you have reflected enough: search for what the gaps still need)',
    "reflect": ('"reflect" if you need to think about the evidence and gaps, or "answer" when the evidence is '
                'solid (no unseen memory is left to retrieve)'),
}

# Bounds let constrained decoding close the JSON (a looping small model would otherwise run into
# max_tokens mid-string); the conditional keys are optional, as the system prompt says.
MEMR3_SCHEMA: dict = {
    "title": "memr3_generate",
    "type": "object",
    "properties": {
        "evidence": {"type": "array", "items": {"type": "string", "maxLength": 300}, "maxItems": 12},
        "gaps": {"type": "array", "items": {"type": "string", "maxLength": 200}, "maxItems": 6},
        "decision": {"type": "string", "enum": ["retrieve", "answer", "reflect"]},
        "retrieval_query": {"type": "string", "maxLength": 200},
        "detailed_answer": {"type": "string", "maxLength": 600},
        "reasoning": {"type": "string", "maxLength": 1200},
    },
    "required": ["evidence", "gaps", "decision"],
    "additionalProperties": False,
}

_NONE = "None"


def handle(number: int) -> str:
    """The label of the `number`-th memory retrieved for a question (1-based): `M3`."""
    return f"M{number}"


def _block(lines: Sequence[str]) -> str:
    return "\n".join(lines) if lines else _NONE


def _cites(handles: Sequence[int]) -> str:
    return f" [{', '.join(handle(h) for h in handles)}]" if handles else ""


def generate_messages(question: str, *, directive: Directive, evidence: Sequence[tuple[str, Sequence[int]]] = (),
                      gaps: Sequence[str] = (), snippets: Sequence[tuple[int, Memory]] = (), reasoning: str = "",
                      last_query: str = "") -> list[Message]:
    """The generate node's prompt: `evidence` as (bullet, handles), `snippets` as (handle number, memory)."""
    if directive not in DIRECTIVES:
        raise ValueError(f"unknown decision directive {directive!r}; use one of {sorted(DIRECTIVES)}")
    messages = _messages(
        "memr3_generate",
        question=_one_line(question),
        evidence=_block([f"- {_one_line(text)}{_cites(handles)}" for text, handles in evidence]),
        gaps=_block([f"- {_one_line(g)}" for g in gaps]),
        snippets=_block([f"[{handle(n)}] {render_fact(m)}" for n, m in snippets]),
        reasoning=_one_line(reasoning) or _NONE,
        last_query=_one_line(last_query) or _NONE,
    )
    system = messages[0]
    system["content"] = string.Template(system["content"]).substitute(decision_directive=DIRECTIVES[directive])
    return messages


def memr3_answer_messages(question: str, draft: str, evidence: Sequence[str],
                          history: Sequence[Turn] | None = None) -> list[Message]:
    """Eq. 6: the final answer from the question, the draft and the evidence, citing evidence 0-based."""
    rendered = "\n".join(f"- Evidence [{i}]: {_one_line(e)}" for i, e in enumerate(evidence)) or "(none)"
    return _messages("memr3_answer", history=_render_history(history).strip(), question=_one_line(question),
                     draft=_one_line(draft) or "(none)", evidence=rendered)
