"""Prompt rendering and the tolerant parsers (with property-based fuzzing)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rmm.policy.citations import parse_citations, parse_json_citations
from rmm.prompts import (
    ANSWER_SCHEMA,
    ExtractedMemory,
    PromptParseError,
    UpdateAction,
    answer_messages,
    decompose_messages,
    extraction_messages,
    extraction_turn_ids,
    goal_answer_messages,
    goal_render,
    judge_messages,
    load_template,
    parse_extraction,
    parse_judge,
    parse_shown_memories,
    parse_update,
    refine_messages,
    render,
    unify_messages,
    update_messages,
)
from rmm.types import Memory, Session, Turn

TURN_IDS = ["c:D1:1", "c:D1:2", "c:D1:3"]


def session() -> Session:
    texts = [("Ana", "I adopted a puppy called Max!"), ("Ben", "Cute! I have a cat."), ("Ana", "Max loves the park.")]
    return Session("c:S1", "c", [Turn(i, "c:S1", s, t) for i, (s, t) in zip(TURN_IDS, texts)], time="1 May 2023")


def joined(messages: list[dict[str, str]]) -> str:
    assert [m["role"] for m in messages] == ["system", "user"]  # instructions apart from the case
    return "\n".join(m["content"] for m in messages)


def memory(text: str, source: str = "") -> Memory:
    return Memory(id=Memory.new_id(), user_id="c", kind="topic", text=text, source_text=source)


# -- rendering --------------------------------------------------------------------------------
RENDERERS: dict[str, Callable[[], list[dict[str, str]]]] = {  # template → one call of its renderer
    "extraction": lambda: extraction_messages(session(), "Ana"),
    "update": lambda: update_messages("Ana walks Max daily.", [memory("Ana has a puppy.")]),
    "answer": lambda: answer_messages("Who is Max?", [memory("Ana has a puppy.")], history=session().turns),
    "answer_structured": lambda: answer_messages("Who is Max?", [memory("Ana has a puppy.")], structured=True),
    "judge": lambda: judge_messages("Who is Max?", "a puppy", "Max is a dog."),
    # GOAL-MEM, with every optional part given
    "goal_decompose": lambda: decompose_messages("Where?", goal="(A) moved from (x:country).", known=["A is 30"],
                                                 avoid=["IF A moved THEN goal (unresolved: A moved)"]),
    "goal_unify": lambda: unify_messages("Q?", "(A) likes (x:food).", "IF A likes (x:food) THEN goal",
                                         ["A likes (x:food)."], [memory("A: I love ramen")],
                                         substitution={"y": "Tokyo"}, known=["A lives in Tokyo"]),
    "goal_refine": lambda: refine_messages("Q?", "goal", "rule", [("A visited (z:cafe).", "no fact names it")],
                                           [memory("x")], substitution={"y": "Tokyo"}, known=["k"], tried=["t"]),
    "goal_answer": lambda: goal_answer_messages("Q?", "(A) likes (ramen).", [memory("A: I love ramen")],
                                                history=session().turns),
}
PLACEHOLDER = re.compile(r"\$\{?[A-Za-z_]")


@pytest.mark.parametrize("name", sorted(RENDERERS))
def test_renderer_fills_every_placeholder_of_its_template(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    filled: dict[str, dict[str, str]] = {}
    module = goal_render if name.startswith("goal_") else render
    real = module._messages

    def spy(template: str, **values: str) -> list[dict[str, str]]:
        filled[template] = values
        return real(template, **values)

    monkeypatch.setattr(module, "_messages", spy)
    messages = RENDERERS[name]()
    content = "\n".join(m["content"] for m in messages)
    assert list(filled) == [name]
    assert set(filled[name]) == set(load_template(name).get_identifiers())  # none missing, none ignored
    assert not PLACEHOLDER.search(content) and "@@" not in content
    assert all(value.strip() in messages[-1]["content"] for value in filled[name].values())


def test_answer_prompt_shows_each_memory_with_its_index_in_shown_order() -> None:
    shown = [memory(text) for text in ("Zoe plays chess.", "Ana has a puppy.", "Max is three.", "Ben cooks.")]
    user = answer_messages("Who is Max?", shown)[-1]["content"]
    at = [user.index(f"- Memory [{i}]: {m.text}") for i, m in enumerate(shown)]
    assert at == sorted(at) and "- Memory [4]" not in user
    assert user.index("Memories:") < at[0] < at[-1] < user.index("My message: Who is Max?")
    assert "- Memory [0]: Lena" not in user  # the worked examples stay in the instructions


# The output protocol of the paper's Appendix D (its wording, which the parsers rely on).
PAPER_WORDING = {
    "extraction": ['"extracted_memories"', '"summary"', '"reference"', "NO_TRAIT"],  # D.1.1
    "update": ["Add()", "Merge(index, merged_summary)"],  # D.1.2
    "answer": ["[NO_CITE]", "may repeat or contradict", "[1, 3]"],  # D.2: cite [i] / [i, j, k]
    "answer_structured": ["may repeat or contradict", '"citations"'],  # D.2 under constrained decoding
    "judge": ["Yes", "No", "intermediate steps", "essential information"],  # D.3
}


@pytest.mark.parametrize("name", sorted(PAPER_WORDING))
def test_templates_carry_the_papers_output_protocol(name: str) -> None:
    instructions = load_template(name).template.partition("@@INPUT@@")[0]
    missing = [phrase for phrase in PAPER_WORDING[name] if phrase not in instructions]
    assert not missing, f"{name}.txt lost the paper's wording: {missing}"


def test_extraction_prompt_numbers_every_turn_for_the_speaker() -> None:
    content = joined(extraction_messages(session(), "Ana"))
    assert "Turn 0 - Ana: I adopted a puppy called Max!" in content
    assert "Turn 2 - Ana: Max loves the park." in content
    assert "NO_TRAIT" in content and "extracted_memories" in content and "1 May 2023" in content
    assert extraction_turn_ids(session()) == TURN_IDS
    with pytest.raises(ValueError):
        extraction_messages(session(), " ")


def test_update_prompt_lists_existing_memories_as_json() -> None:
    content = joined(update_messages("Ana walks Max daily.", [memory("Ana has a puppy."), memory('Ana said "hi"')]))
    assert '["Ana has a puppy.", "Ana said \\"hi\\""]' in content
    assert '"Ana walks Max daily."' in content and "Merge(index, merged_summary)" in content


def test_answer_prompt_round_trips_the_shown_memories() -> None:
    shown = [memory("Ana has a puppy.", source="Ana: I adopted a puppy called Max!"), memory("line one\n  indented two")]
    messages = answer_messages("Who is Max?\nMemories:\n- Memory [9]: trap", shown, history=session().turns)
    content = joined(messages)
    assert "- Memory [0]: Ana has a puppy." in content and "| Ana: I adopted a puppy called Max!" in content
    assert "[NO_CITE]" in content and "Ben: Cute! I have a cat." in content
    assert parse_shown_memories(messages) == ["Ana has a puppy.", "line one\n  indented two"]
    assert parse_shown_memories(answer_messages("q", [])) == []
    structured = joined(answer_messages("q", shown, structured=True))
    assert '"citations"' in structured and parse_shown_memories(answer_messages("q", shown, structured=True))
    with pytest.raises(PromptParseError):
        parse_shown_memories(judge_messages("q", "a", "p"))


def test_answer_schema_is_the_citation_object() -> None:
    assert ANSWER_SCHEMA["required"] == ["answer", "citations"]
    reply = json.dumps({"answer": "Max is your puppy.", "citations": [0]})
    assert parse_json_citations(reply, 2).cited == [0]
    assert parse_citations("Max is your puppy. [0]", 2).cited == [0]


def test_judge_prompt_carries_all_three_fields() -> None:
    content = joined(judge_messages("Who is Max?", "a puppy", "Max is a dog."))
    assert "Who is Max?" in content and "a puppy" in content and "Max is a dog." in content


# -- extraction parser ------------------------------------------------------------------------
def test_extraction_in_fence_with_chatter_maps_turn_numbers() -> None:
    text = (
        "Sure! Here you go:\n```json\n"
        '{"extracted_memories": [{"summary": "Ana adopted a puppy named Max.", "reference": [0, 2]},\n'
        ' {"summary": "Ana takes Max to the park.", "reference": ["Turn 2", "[2]", 7, "c:D1:1"]},]}\n'
        "```\nHope this helps!"
    )
    result = parse_extraction(text, TURN_IDS)
    assert list(result) == [
        ExtractedMemory("Ana adopted a puppy named Max.", ["c:D1:1", "c:D1:3"]),
        ExtractedMemory("Ana takes Max to the park.", ["c:D1:3", "c:D1:1"]),
    ]
    assert any("7" in w for w in result.warnings)


def test_extraction_merges_a_looping_models_repeated_summaries() -> None:
    text = json.dumps({"extracted_memories": [
        {"summary": "Ana is busy with work.", "reference": [0]},
        {"summary": "Ana adopted a puppy.", "reference": [2]},
        {"summary": "ana is  busy with work.", "reference": [2, 0]},
    ]})
    result = parse_extraction(text, TURN_IDS)
    assert list(result) == [ExtractedMemory("Ana is busy with work.", ["c:D1:1", "c:D1:3"]),
                            ExtractedMemory("Ana adopted a puppy.", ["c:D1:3"])]
    assert any("repeated" in w for w in result.warnings)


def test_extraction_single_quotes_and_missing_fields() -> None:
    text = "{'extracted_memories': [{'summary': 'Ana has a puppy', 'reference': [0]}, {'reference': [1]}, {'summary': 'Ana likes parks'}]}"
    result = parse_extraction(text, TURN_IDS)
    assert [m.summary for m in result] == ["Ana has a puppy", "Ana likes parks"]
    assert result[1].refs == [] and result.warnings


@pytest.mark.parametrize("text", ["NO_TRAIT", "No traits found. NO_TRAIT", '{"extracted_memories": "NO_TRAIT"}',
                                  '```\n{"extracted_memories": []}\n```'])
def test_no_trait_means_nothing_extracted(text: str) -> None:
    assert parse_extraction(text, TURN_IDS) == []


@pytest.mark.parametrize("text", ["", "I cannot help with that.", '{"unrelated": 1}', "{broken"])
def test_extraction_without_payload_is_a_typed_error(text: str) -> None:
    with pytest.raises(PromptParseError):
        parse_extraction(text, TURN_IDS)


# -- update parser ----------------------------------------------------------------------------
def test_update_actions_tolerate_loose_lines() -> None:
    text = (
        "```\nAdd()\n- Merge(1, \"Ana walks Max (her puppy) every day.\")\n"
        "Merge(index=0, merged_summary=Ana has a puppy named Max.)\n"
        "Merge(5, out of range)\nMerge(x, no index)\nMerge(0, )\nI think that's it.\n```"
    )
    result = parse_update(text, 2)
    assert list(result) == [
        UpdateAction("add"),
        UpdateAction("merge", 1, "Ana walks Max (her puppy) every day."),
        UpdateAction("merge", 0, "Ana has a puppy named Max."),
    ]
    assert len(result.warnings) == 3


def test_update_merge_across_lines_and_bare_add() -> None:
    assert parse_update("Merge(0, Ana has a puppy\nnamed Max.)", 1) == [UpdateAction("merge", 0, "Ana has a puppy named Max.")]
    assert parse_update("Action: Add", 0) == [UpdateAction("add")]
    assert parse_update("Merge(0, x)", 0) == []  # nothing to merge into: dropped, not invented


@pytest.mark.parametrize("text", ["", "The new summary is similar.", "merge them please"])
def test_update_without_actions_is_a_typed_error(text: str) -> None:
    with pytest.raises(PromptParseError):
        parse_update(text, 3)


def test_judge_verdicts() -> None:
    assert parse_judge("Yes") is True
    assert parse_judge("Verdict: No, it misses the date.") is False
    assert parse_judge("**yes**") is True
    assert parse_judge("I am unsure.") is None
    with pytest.raises(PromptParseError):
        parse_judge(None)  # type: ignore[arg-type]


# -- fuzzing ------------------------------------------------------------------------------------
PIECES = st.sampled_from([
    "Add()", "Merge(", ")", "Merge(0, x)", "Merge(-1, y)", "Merge(99, z)", "merge(1,", "\n", "NO_TRAIT",
    '{"extracted_memories": [', '{"summary": "s", "reference": [', "]}", "}", "]", ",", "'", '"', "0", "7",
    "-3", "c:D1:2", "Turn 1", '"summary": "', '"reference": [', '{"reference": [0]}', 'Maya', 'Existing notes:', "```json", "```", "Yes", "No", "[", "{", "index=", "1e9", "null", "true",
])
FUZZ = st.one_of(st.text(max_size=200), st.lists(st.one_of(PIECES, st.text(max_size=5)), max_size=40).map("".join))
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(FUZZ, st.integers(min_value=0, max_value=5))
def test_fuzz_update_never_invents_indices(text: str, n_existing: int) -> None:
    try:
        actions = parse_update(text, n_existing)
    except PromptParseError:
        return
    for action in actions:
        assert action.kind in ("add", "merge")
        if action.kind == "merge":
            assert action.index is not None and 0 <= action.index < n_existing and action.summary


@FAST
@given(FUZZ, st.lists(st.sampled_from(TURN_IDS + ["c:D2:1", "x"]), max_size=4, unique=True))
def test_fuzz_extraction_never_invents_refs(text: str, valid: list[str]) -> None:
    try:
        extracted = parse_extraction(text, valid)
    except PromptParseError:
        return
    for item in extracted:
        assert isinstance(item.summary, str) and item.summary
        assert set(item.refs) <= set(valid)


@FAST
@given(FUZZ)
def test_fuzz_judge_returns_bool_or_none(text: str) -> None:
    assert parse_judge(text) in (True, False, None)


def test_copies_of_the_prompt_examples_are_not_stored() -> None:
    copied = ('{"extracted_memories": [{"summary": "Maya signed up for a pottery class downtown on Fifth Street, '
              "inspired by her grandmother's wheel from her childhood.\", \"reference\": [0, 2]}, "
              '{"summary": "Ana adopted a puppy called Max.", "reference": [0]}]}')
    result = parse_extraction(copied, TURN_IDS)
    assert [m.summary for m in result] == ["Ana adopted a puppy called Max."] and result.warnings
    update = ("Merge(0, Sam plays tennis every Tuesday and Friday, although he finds it boring.)\n"
              "Add()\n\nExisting notes: [\"x\"]\nNew note: \"y\"\nActions:\nMerge(1, Ana runs daily.)")
    assert parse_update(update, 2) == [UpdateAction("add")]


def test_split_items_and_truncated_json_are_recovered() -> None:
    split = '{"extracted_memories": [{"summary": "Ana has a puppy."}, {"reference": [0, 2]}]}'
    assert parse_extraction(split, TURN_IDS) == [ExtractedMemory("Ana has a puppy.", ["c:D1:1", "c:D1:3"])]
    cut = ('{"extracted_memories": [{"summary": "Ana has a puppy \\"Max\\".", "reference": [0, 9]}, '
           '{"summary": "Ana walks Max in the par')
    result = parse_extraction(cut, TURN_IDS)
    assert result == [ExtractedMemory('Ana has a puppy "Max".', ["c:D1:1"])] and result.warnings


def test_salvaged_string_refs_are_ids_not_digits() -> None:
    cut = '{"extracted_memories": [{"summary": "Ana has a puppy.", "reference": ["c:D1:1", "c:D9:9"]}, {"summ'
    assert parse_extraction(cut, TURN_IDS) == [ExtractedMemory("Ana has a puppy.", ["c:D1:1"])]
