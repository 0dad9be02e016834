"""MemR³ prompts: the paper's generate prompts with directive switching, the answer prompt, the tolerant parser."""

from __future__ import annotations

import json

import pytest

from rmm.policy.citations import parse_citations
from rmm.prompts.memr3_parse import parse_generation
from rmm.prompts.memr3_render import (
    DIRECTIVES,
    generate_messages,
    memr3_answer_messages,
)
from rmm.prompts.parse import PromptParseError
from rmm.types import Memory, Turn

SNIPPET = Memory(id="porto", user_id="ana", kind="topic", text="Clara moved to Porto in 2019",
                 time_span=("8 May 2023", "8 May 2023"))


# -- rendering ---------------------------------------------------------------------------------------
def test_generate_prompt_is_the_papers_with_handles() -> None:
    messages = generate_messages("Where does Clara live?", directive="default",
                                 evidence=[("Clara studies abroad", [2])], gaps=["the city"],
                                 snippets=[(3, SNIPPET)], reasoning="", last_query="Clara studies")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system, example, example_output, case = (m["content"] for m in messages)
    assert system.startswith("You are a memory agent that plans how to gather evidence")
    for phrase in ("Always reply with a strict JSON object", "retrieval_query: only when decision == \"retrieve\"",
                   'GOOD Query: "graduation ceremony date"', "Search for the MAPPED ENTITY",
                   "detailed_answer: only when decision == \"answer\"", "reasoning: only when decision == \"reflect\"",
                   "Never include extra keys or any text outside the JSON object.", "End every bullet with the ids"):
        assert phrase in system
    assert f"Choose {DIRECTIVES['default']}." in system and "$" not in system
    json.loads(example_output)  # the worked example answers in the format it asks for
    assert "[M1] Tom: I adopted a cat" in example
    assert case.startswith("# Question\nWhere does Clara live?\n\n# Evidence\n- Clara studies abroad [M2]\n\n"
                           "# Gaps\n- the city\n\n# Memory snippets\n[M3] Clara moved to Porto in 2019 "
                           "[spoken at: 8 May 2023]\n\n# Reasoning\nNone\n\n# Prior Query\nClara studies\n\n"
                           "# INSTRUCTIONS:\n1. Update the evidence as a JSON ARRAY")
    assert "4. Decide the next action and return ONLY the JSON object described in the system prompt." in case


@pytest.mark.parametrize("directive", list(DIRECTIVES))
def test_decision_directive_switches(directive: str) -> None:
    system = generate_messages("q?", directive=directive)[0]["content"]
    assert f"Choose {DIRECTIVES[directive]}." in system
    others = [d for d in DIRECTIVES if d != directive and DIRECTIVES[d] not in DIRECTIVES[directive]]
    assert not any(DIRECTIVES[d] in system for d in others)
    with pytest.raises(ValueError, match="directive"):
        generate_messages("q?", directive="think")  # type: ignore[arg-type]


def test_answer_prompt_sees_draft_and_evidence_and_is_cited_by_index() -> None:
    history = [Turn(id="t", session_id="s", speaker="ana", text="hi")]
    messages = memr3_answer_messages("Where does Clara live?", "Porto.", ["Clara moved to Porto in 2019", "Ana is a nurse"],
                                     history)
    case = messages[-1]["content"]
    assert "Draft answer: Porto." in case and "- Evidence [1]: Ana is a nurse" in case and "ana: hi" in case
    assert parse_citations("Porto. [0]", 2).cited == [0]
    empty = memr3_answer_messages("q?", "", [])[-1]["content"]
    assert "Draft answer: (none)" in empty and "Evidence:\n(none)" in empty


# -- parsing -----------------------------------------------------------------------------------------
def test_parses_the_format_amid_chatter_and_fences() -> None:
    text = ('Here you go:\n```json\n{"evidence": ["Clara moved to Porto in 2019 [M3]", "Ana is a nurse (M1, M2)"], '
            '"gaps": "None", "decision": "Retrieve.", "retrieval_query": "Clara Porto address"}\n```')
    g = parse_generation(text, {1, 2, 3})
    assert [(b.text, b.handles) for b in g.evidence] == [("Clara moved to Porto in 2019", [3]),
                                                         ("Ana is a nurse", [1, 2])]
    assert g.gaps == [] and g.decision == "retrieve" and g.retrieval_query == "Clara Porto address"
    assert not g.warnings


def test_handles_not_shown_are_dropped_never_remapped() -> None:
    g = parse_generation('{"evidence": ["Clara lives in Porto [M7]", "Ana [M2, M 9]"], "gaps": [], '
                         '"decision": "answer"}', {2})
    assert [(b.text, b.handles) for b in g.evidence] == [("Clara lives in Porto", []), ("Ana", [2])]
    assert sum("dropped handle" in w for w in g.warnings) == 2


def test_bullet_objects_gap_lists_and_python_literals() -> None:
    g = parse_generation("{'evidence': [{'fact': 'Clara is in Porto', 'ids': ['M1', 3]}, 'None'], "
                         "'gaps': '- the street\\n- the year', 'decision': 'REFLECT', 'reasoning': 'She moved.'}",
                         {1, 3})
    assert [(b.text, b.handles) for b in g.evidence] == [("Clara is in Porto", [1, 3])]
    assert g.gaps == ["the street", "the year"] and g.decision == "reflect" and g.reasoning == "She moved."


def test_missing_decision_is_read_from_a_single_payload_only() -> None:
    assert parse_generation('{"evidence": [], "detailed_answer": "Porto"}', set()).decision == "answer"
    both = parse_generation('{"evidence": [], "detailed_answer": "Porto", "reasoning": "hm"}', set())
    assert both.decision is None and any("no usable decision" in w for w in both.warnings)
    assert parse_generation('{"decision": "maybe", "gaps": ["x"]}', set()).decision is None


def test_example_copies_duplicates_and_extra_keys() -> None:
    g = parse_generation(json.dumps({
        "evidence": ["Tom adopted a cat from the shelter in spring 2023 (said on 3 May 2023) [M1]",
                     "Ana is a nurse [M1]", "ana is a NURSE [M1]"] + [f"fact {i} [M1]" for i in range(20)],
        "gaps": ["None"], "decision": "answer", "confidence": 0.9}), {1})
    texts = [b.text for b in g.evidence]
    assert texts[0] == "Ana is a nurse" and len(texts) == 12 and "ana is a NURSE" not in texts
    assert any("example" in w for w in g.warnings) and any("extra keys" in w for w in g.warnings)
    assert g.gaps == []


def test_a_reply_cut_off_keeps_only_its_complete_elements() -> None:
    g = parse_generation('{"evidence": ["Clara moved to Porto [M1]", "Clara studies arch', {1})
    assert [b.text for b in g.evidence] == ["Clara moved to Porto"] and g.decision is None
    late = parse_generation('{"evidence": ["Clara moved to Porto [M1]"], "gaps": [], "decision": "reflect", '
                            '"reasoning": "She moved there in 20', {1})
    assert late.decision == "reflect" and late.reasoning == "" and late.evidence[0].handles == [1]


@pytest.mark.parametrize("text", ["", "I would search more.", '{"answer": "Porto"}', '["a", "b"]',
                                  '{"evidence": ["cut', "}{", "{" * 5000])
def test_unusable_output_raises_prompt_parse_error(text: str) -> None:
    with pytest.raises(PromptParseError):
        parse_generation(text, {1})


def test_non_string_output_raises_prompt_parse_error() -> None:
    with pytest.raises(PromptParseError):
        parse_generation(None, {1})  # type: ignore[arg-type]
