"""Prompts of the paper's appendix D in our own words, and tolerant parsers for their outputs.

Templates are the `*.txt` files of this package (`string.Template`, `$name` placeholders).
Output formats are the paper's: extraction → `{"extracted_memories": [{"summary", "reference"}]}`
or `NO_TRAIT`; update → lines `Add()` / `Merge(index, merged_summary)`; answer → `… [0, 2]` /
`[NO_CITE]` (parsed by `rmm.policy.citations.parse_citations`), or `{"answer", "citations"}` under
structured decoding; judge → Yes / No.

Parsers either return a result or raise `PromptParseError` — never anything else — and never
invent: a turn reference that is not one of the session's turns and a merge index outside the
list shown are dropped (and recorded in the result's `warnings`).
"""

from __future__ import annotations

from rmm.prompts.goal_parse import (
    Decomposition,
    Grounding,
    Refinement,
    Unification,
    Unresolved,
    Variable,
    parse_bindings,
    parse_decomposition,
    parse_refinement,
    parse_unification,
)
from rmm.prompts.goal_render import (
    decompose_messages,
    format_bindings,
    goal_answer_messages,
    refine_messages,
    render_fact,
    unify_messages,
)
from rmm.prompts.parse import (
    ExtractedMemory,
    ExtractionResult,
    PromptParseError,
    UpdateAction,
    UpdateResult,
    parse_extraction,
    parse_judge,
    parse_update,
)
from rmm.prompts.render import (
    ANSWER_SCHEMA,
    EXTRACTION_SCHEMA,
    answer_messages,
    extraction_messages,
    extraction_turn_ids,
    is_answer_prompt,
    judge_messages,
    load_template,
    normalize_memory_text,
    parse_shown_memories,
    update_messages,
)

__all__ = [
    "ANSWER_SCHEMA",
    "EXTRACTION_SCHEMA",
    "Decomposition",
    "ExtractedMemory",
    "ExtractionResult",
    "Grounding",
    "PromptParseError",
    "Refinement",
    "Unification",
    "Unresolved",
    "UpdateAction",
    "UpdateResult",
    "Variable",
    "answer_messages",
    "decompose_messages",
    "extraction_messages",
    "extraction_turn_ids",
    "format_bindings",
    "goal_answer_messages",
    "is_answer_prompt",
    "judge_messages",
    "load_template",
    "normalize_memory_text",
    "parse_bindings",
    "parse_decomposition",
    "parse_extraction",
    "parse_judge",
    "parse_refinement",
    "parse_shown_memories",
    "parse_unification",
    "parse_update",
    "refine_messages",
    "render_fact",
    "unify_messages",
    "update_messages",
]
