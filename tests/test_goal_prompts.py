"""GOAL-MEM prompts: rendering, the tolerant parsers, and property-based fuzzing of the parsers."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rmm.prompts import (
    Decomposition,
    PromptParseError,
    Refinement,
    Unification,
    decompose_messages,
    format_bindings,
    goal_answer_messages,
    parse_bindings,
    parse_decomposition,
    parse_refinement,
    parse_unification,
    refine_messages,
    render_fact,
    unify_messages,
)
from rmm.types import Memory, Turn


def fact(text: str, when: str | None = "7 May 2023") -> Memory:
    return Memory(id=Memory.new_id(), user_id="u", kind="turn", text=text, time_span=(when, when) if when else None)


# -- rendering -----------------------------------------------------------------------------------------
def test_decompose_prompt_is_one_call_and_tells_failed_rules() -> None:
    first = decompose_messages("Where did  Caroline\nmove from?")
    assert [m["role"] for m in first] == ["system", "user", "assistant", "user"]  # the example is an exchange
    assert "Goal:" in first[0]["content"] and "Subgoals:" in first[0]["content"]
    assert first[2]["content"].startswith("Goal: (Maria)") and "@@" not in "".join(m["content"] for m in first)
    assert first[-1]["content"] == "Question: Where did Caroline move from?\n"
    again = decompose_messages("Where?", goal="(Caroline) moved from (x:country).",
                               avoid=["IF Caroline moved AND … THEN … (unresolved: Caroline moved)"])
    user = again[-1]["content"]
    assert "Goal: (Caroline) moved from (x:country)." in user and "Existing rules that failed" in user
    assert "Difference From Prior Decompositions" in user


def test_unify_prompt_numbers_facts_from_one_with_time() -> None:
    messages = unify_messages("Q?", "(A) likes (x:food).", "IF A likes (x:food) THEN goal", ["A likes (x:food)."],
                              [fact("A: I love ramen"), fact("A: sushi too", None)], substitution={"y": "Tokyo"},
                              known=["A lives in Tokyo"])
    user = messages[-1]["content"]
    assert "1- A: I love ramen [spoken at: 7 May 2023]" in user and "\n2- A: sushi too" in user
    assert "Current Substitution: {y / Tokyo}" in user and "Known Info: A lives in Tokyo" in user
    assert "Subgoals:\n- A likes (x:food)." in user


def test_refine_and_answer_prompts() -> None:
    refine = refine_messages("Q?", "goal", "rule", [("A visited (z:cafe).", "no fact names the cafe")], [fact("x")],
                             tried=["A went out"])[-1]["content"]
    assert "- A visited (z:cafe). -- no fact names the cafe" in refine and "Already tried" in refine
    answer = goal_answer_messages("Q?", "(A) likes (ramen).", [fact("A: I love ramen")],
                                  history=[Turn("t", "s", "A", "hi")])[-1]["content"]
    assert "- Fact [0]: A: I love ramen [spoken at: 7 May 2023]" in answer
    assert "Grounded goal: (A) likes (ramen)." in answer and "A: hi" in answer
    assert render_fact(fact("a\nb", None)) == "a b" and format_bindings({}) == "{}"


# -- decomposition ---------------------------------------------------------------------------------------
PAPER_DECOMPOSITION = """Goal: (Caroline) is likely to pursue (x:career_field) in her education.
Rule: IF Caroline is actively exploring (x:career_field) AND Caroline finds work in (x:career_field) meaningful,
THEN Caroline is likely to pursue (x:career_field) in her education.
Variables:
- (x:career_field): the education or career field Caroline is likely to pursue
Subgoals:
- Caroline is actively exploring (x:career_field).
- Caroline finds work in (x:career_field) meaningful.
Premises:
- Caroline is actively exploring (x:career_field).
- Caroline finds work in (x:career_field) meaningful.
Difference From Prior Decompositions: uses sustained interest instead of course work."""


def test_decomposition_in_the_papers_format() -> None:
    d = parse_decomposition(PAPER_DECOMPOSITION)
    assert d.goal == "(Caroline) is likely to pursue (x:career_field) in her education."
    assert d.rule.startswith("IF Caroline") and d.rule.endswith("in her education.")
    assert [(v.name, v.type) for v in d.variables] == [("x", "career_field")]
    assert d.subgoals == ["Caroline is actively exploring (x:career_field).",
                          "Caroline finds work in (x:career_field) meaningful."]
    assert d.difference.startswith("uses sustained")


def test_decomposition_is_tolerant() -> None:
    messy = ("Sure! Here it is.\n**Goal:** (Mel) attends a race.\n**Rule:** IF Mel runs AND Mel trains THEN goal\n"
             "**Variables:**\n- none: yes/no question\n**Subgoals:**\n1. Mel runs in the park.\n2) Mel runs in the park."
             "\n* Mel trains for a marathon.\n\nQuestion: Another question?\nGoal: copied\nSubgoals:\n- copied")
    d = parse_decomposition(messy)
    assert d.goal == "(Mel) attends a race." and d.variables == []
    assert d.subgoals == ["Mel runs in the park.", "Mel trains for a marathon."]
    assert any("echoed" in w for w in d.warnings)
    from_rule = parse_decomposition("Goal: (A) likes (x:food)\nRule: IF A cooks (x:food) AND A orders (x:food), THEN ok")
    assert from_rule.subgoals == ["A cooks (x:food)", "A orders (x:food)"]
    assert [v.name for v in from_rule.variables] == ["x"]  # no Variables section: the goal's variables
    premises = parse_decomposition("Premises:\n- A swims.\n- none")
    assert premises.subgoals == ["A swims."]


def test_decomposition_copied_from_the_example_is_rejected() -> None:
    copied = ("Goal: (Maria) moved to (x:city) after her sister's wedding.\nSubgoals:\n"
              "- Maria's sister had a wedding.\n- Maria moved to (x:city) after the wedding.")
    with pytest.raises(PromptParseError):
        parse_decomposition(copied, question="Where does Jon work?")
    assert len(parse_decomposition(copied, question="Where did Maria move?").subgoals) == 2


@pytest.mark.parametrize("text", ["", "I don't know.", "Goal: only a goal", "Subgoals:\n- none\n- n/a"])
def test_decomposition_without_subgoals_raises(text: str) -> None:
    with pytest.raises(PromptParseError):
        parse_decomposition(text)


# -- unification -------------------------------------------------------------------------------------------
PAPER_UNIFICATION = """Unification Status: unsatisfied
Substitution: {}
Grounded Subgoals:
- Melanie has a dog. <= Fact 1; bindings: none
Unresolved Subgoals:
- Melanie's dog has name (x:person_or_pet_name). -- no fact states the dog's name
Reasoning: Facts 1 and 2 confirm that Melanie has a dog. Used 1 fact and 1 general rule.
Final Answer: I don't know
Known Info: Melanie has a dog; Melanie enjoys walking her dog in the park"""


def test_unification_in_the_papers_format() -> None:
    u = parse_unification(PAPER_UNIFICATION, n_facts=2)
    assert u.status == "unsatisfied" and u.substitution == {}
    assert [(g.subgoal, g.facts, g.bindings) for g in u.grounded] == [("Melanie has a dog.", [0], {})]
    assert [(r.subgoal, r.why) for r in u.unresolved] == [
        ("Melanie's dog has name (x:person_or_pet_name).", "no fact states the dog's name")]
    assert u.final_answer == "I don't know" and u.known_info == ["Melanie has a dog",
                                                                  "Melanie enjoys walking her dog in the park"]


def test_unification_bindings_and_fact_references() -> None:
    text = ("Unification Status: Satisfied.\nSubstitution: {x / counseling and mental health, y = Tokyo}\n"
            "Grounded Subgoals:\n- A explores (x:field). <= Facts 1 and 3; bindings: x / counseling\n"
            "- A lives in (y:city) (Fact 2)\n- A is happy. <= Known Info\n- A is rich. <= Fact 7\n"
            "- A paints. <= the memory from 7 May 2023\nUnresolved Subgoals:\n- none")
    u = parse_unification(text, n_facts=3)
    assert u.status == "satisfied"
    assert u.substitution == {"x": "counseling and mental health", "y": "Tokyo"}
    assert [(g.subgoal, g.facts, g.known_info) for g in u.grounded] == [
        ("A explores (x:field).", [0, 2], False), ("A lives in (y:city)", [1], False), ("A is happy.", [], True)]
    assert u.grounded[0].bindings == {"x": "counseling"} and u.unresolved == []
    assert any("fact 7" in w for w in u.warnings)  # never invented: an unshown fact is dropped


def test_parse_bindings_forms() -> None:
    assert parse_bindings("{x / Kyoto Latte, y / Matcha Powder}") == {"x": "Kyoto Latte", "y": "Matcha Powder"}
    assert parse_bindings("(x:drink) / (Kyoto Latte)") == {"x": "Kyoto Latte"}
    assert parse_bindings("x: Paris; x: Rome") == {"x": "Paris"}
    assert parse_bindings("{x / a cafe (Momoco, Tokyo)}") == {"x": "a cafe (Momoco, Tokyo)"}
    for empty in ("{}", "none", '"none"', "", "nothing bound yet"):
        assert parse_bindings(empty) == {}


@pytest.mark.parametrize("text", ["", "The facts say Melanie has a dog.", "Final verdict: unclear"])
def test_unification_without_the_format_raises(text: str) -> None:
    with pytest.raises(PromptParseError):
        parse_unification(text, 3)
    with pytest.raises(PromptParseError):
        parse_unification("Unification Status: satisfied", -1)


# -- refinement --------------------------------------------------------------------------------------------
def test_refinement_formats() -> None:
    r = parse_refinement("Refinement Status: refine\nMissing Info: the cafe\nRelation Type: Spatial\n"
                         "Refined Subgoals:\n- Alice visited (z:cafe) last week.\nRetrieval Queries:\n"
                         "- Alice visited cafe last week which cafe\nRationale: needed")
    assert (r.status, r.relation_type, r.subgoals, r.queries) == (
        "refine", "spatial", ["Alice visited (z:cafe) last week."], ["Alice visited cafe last week which cafe"])
    stop = parse_refinement("Refinement Status: stop\nMissing Info: nothing new to search")
    assert stop.status == "stop" and stop.subgoals == []
    implied = parse_refinement("Retrieval Queries:\n- dog name Melanie")
    assert implied.status == "refine" and implied.queries == ["dog name Melanie"] and implied.warnings
    with pytest.raises(PromptParseError):
        parse_refinement("I think we should look harder.")


# -- fuzzing: a result or PromptParseError, never anything else, never an unshown fact ------------------------
FRAGMENTS = st.sampled_from([
    "Goal:", "Rule: IF ", " AND ", " THEN ", "Variables:\n", "- (x:city): the city", "- none", "Subgoals:\n",
    "Premises:\n", "- A went (x:place).", "Unification Status: ", "satisfied", "conflict", "Substitution: {",
    "x / Paris", "}", "Grounded Subgoals:\n", "<= Fact ", "Facts 1 and 2", "; bindings: ", "Unresolved Subgoals:\n",
    " -- ", "Final Answer: ", "Known Info: ", "Refinement Status: ", "refine", "stop", "Refined Subgoals:\n",
    "Retrieval Queries:\n", "Relation Type: temporal", "Question:", "**", "\n", "1.", "99", "0", "-3", "(", ")",
    "```", "#", "⇐", "—", "Fact 4294967296",
])
FUZZ = st.one_of(st.text(max_size=300), st.lists(st.one_of(FRAGMENTS, st.text(max_size=12)), max_size=40).map("".join))
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(FUZZ)
def test_fuzz_parse_decomposition(text: str) -> None:
    try:
        d = parse_decomposition(text)
    except PromptParseError:
        return
    assert isinstance(d, Decomposition) and d.subgoals and all(isinstance(s, str) and s for s in d.subgoals)


@FAST
@given(FUZZ, st.integers(min_value=0, max_value=5))
def test_fuzz_parse_unification(text: str, n_facts: int) -> None:
    try:
        u = parse_unification(text, n_facts)
    except PromptParseError:
        return
    assert isinstance(u, Unification)
    assert u.status in (None, "satisfied", "unsatisfied", "conflict")
    for g in u.grounded:
        assert all(0 <= i < n_facts for i in g.facts) and (g.facts or g.known_info)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in g.bindings.items())


@FAST
@given(FUZZ)
def test_fuzz_parse_refinement(text: str) -> None:
    try:
        r = parse_refinement(text)
    except PromptParseError:
        return
    assert isinstance(r, Refinement) and r.status in ("refine", "stop")
    assert r.relation_type in ("", "temporal", "causal", "semantic", "spatial")


@FAST
@given(st.text(max_size=200))
def test_fuzz_parse_bindings(text: str) -> None:
    bindings = parse_bindings(text)
    assert all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in bindings.items())


@pytest.mark.parametrize("parser", [parse_decomposition, parse_refinement, lambda t: parse_unification(t, 2)])
def test_parsers_reject_non_text(parser) -> None:
    with pytest.raises(PromptParseError):
        parser(None)  # type: ignore[arg-type]
