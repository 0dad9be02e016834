"""The GOAL-MEM loop (rmm.frontends.goal) driven by a scripted LLM whose outputs are written here.

Every path of Algorithm 1 — early success, refinement success, exhausted depth → next breadth,
nothing new → next breadth, budget exhaustion, malformed output at each step — plus the paper's
call bound 1 + B_max(2 + 2·D_max), learning from subgoal queries, and the trace's JSON round trip.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from fakes import FILLER, BagOfWordsEncoder, Reply, ScriptedGoalLLM, add_story
from rich.console import Console

from rmm.frontends.agent import Agent
from rmm.frontends.goal import (
    GoalConfig,
    GoalFrontend,
    GoalFrontendError,
    ground_goal,
    retrieval_query,
)
from rmm.frontends.trace import GoalTrace, render_trace
from rmm.llm.base import LLM
from rmm.llm.simulated import SimulatedLLM
from rmm.memory.bank import MemoryBank
from rmm.policy.learner import LearnerConfig


@pytest.fixture
def bank(tmp_path: Path):
    with MemoryBank(tmp_path / "bank", BagOfWordsEncoder(), device="cpu") as b:
        add_story(b)
        yield b


def frontend(bank: MemoryBank, llm: LLM, *, learn: bool = False, **config) -> GoalFrontend:
    """Greedy (not learning) unless asked: the paths below should not depend on Gumbel draws."""
    agent = Agent(bank, llm, k=6, m=2, learn=learn, learner_config=LearnerConfig(batch_size=2), checkpoint_every=0)
    return GoalFrontend(agent, GoalConfig(**config))


# -- scripted outputs ----------------------------------------------------------------------------------
def decomposition(*subgoals: str, goal: str = "(Ana's sister) lives in (x:city).", variable: str = "x:city") -> str:
    rule = "IF " + " AND ".join(subgoals) + f" THEN {goal}"
    return (f"Goal: {goal}\nRule: {rule}\nVariables:\n- ({variable}): the answer\nSubgoals:\n"
            + "\n".join(f"- {s}" for s in subgoals))


def facts_in(prompt: str) -> dict[int, str]:
    return {int(n): text for n, text in re.findall(r"^(\d+)- (.*)$", prompt, re.MULTILINE)}


def unify_by_keyword(keywords: dict[str, str], bindings: str = "x / Porto") -> Callable[[str], str]:
    """Grounds each subgoal whose keyword appears in a shown fact (citing that fact); the rest stay unresolved."""
    def reply(prompt: str) -> str:
        active = re.search(r"Subgoals:\n(.*?)\nFacts:", prompt, re.DOTALL).group(1)
        facts = facts_in(prompt)
        grounded, unresolved = [], []
        for line in active.splitlines():
            subgoal = line.removeprefix("- ")
            number = next((n for n, text in facts.items() if keywords.get(subgoal, "\0") in text), None)
            if number is None:
                unresolved.append(f"- {subgoal} -- no fact states it")
            else:
                grounded.append(f"- {subgoal} <= Fact {number}; bindings: {bindings}")
        status = "satisfied" if not unresolved else "unsatisfied"
        return (f"Unification Status: {status}\nSubstitution: {{{bindings}}}\nGrounded Subgoals:\n"
                + ("\n".join(grounded) or "- none") + "\nUnresolved Subgoals:\n" + ("\n".join(unresolved) or "- none")
                + "\nFinal Answer: Porto\nKnown Info: none")
    return reply


def refinement(subgoal: str, query: str) -> str:
    return (f"Refinement Status: refine\nMissing Info: where Clara lives\nRelation Type: spatial\n"
            f"Refined Subgoals:\n- {subgoal}\nRetrieval Queries:\n- {query}\nRationale: needed.")


UNRESOLVED = ("Unification Status: unsatisfied\nSubstitution: {}\nGrounded Subgoals:\n- none\n"
              "Unresolved Subgoals:\n- everything -- nothing fits\nFinal Answer: I don't know\nKnown Info: none")
SISTER, CITY = "Ana has a sister who is getting married.", "Ana's sister lives in (x:city)."
KEYS = {SISTER: "married", CITY: "Porto", "Clara lives in (x:city).": "Porto"}


def cite_porto(prompt: str) -> str:
    number = next(int(n) for n, text in re.findall(r"Fact \[(\d+)\]: (.*)", prompt) if "Porto" in text)
    return f"Porto. [{number}]"


# -- the paths of Algorithm 1 -------------------------------------------------------------------------------
def test_early_success_grounds_at_depth_zero(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(decompose=[decomposition(SISTER, "Clara moved to (x:city).")],
                          unify=[unify_by_keyword({SISTER: "married", "Clara moved to (x:city).": "Porto"})],
                          answer=[cite_porto])
    response = frontend(bank, llm).respond("ana", "Which city does Ana's sister live in?")
    assert llm.kinds == ["decompose", "unify", "answer"]
    assert response.grounded and response.answer == "Porto."
    assert [m.id for m in response.cited] == ["porto"]
    assert {m.id for m in response.supporting} == {"sister", "porto"}
    trace = response.trace
    assert trace.outcome == "grounded" and trace.bindings == {"x": "Porto"}
    assert trace.grounded_goal == "(Ana's sister) lives in (Porto)."
    assert len(trace.breadths) == 1 and [s.depth for s in trace.breadths[0].steps] == [0]
    assert [q.query for q in trace.queries] == ["Ana has a sister who is getting married.", "Clara moved to city."]
    assert trace.usage.calls == 3 and trace.usage.prompt_tokens == 300
    # the answer is conditioned on the supporting facts only
    assert "Fact [0]" in llm.prompts[-1] and "cello" not in llm.prompts[-1]


def test_refinement_grounds_what_the_decomposition_could_not(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(decompose=[decomposition(SISTER, CITY)],
                          unify=[unify_by_keyword({SISTER: "married"}), unify_by_keyword(KEYS)],
                          refine=[refinement("Clara lives in (x:city).", "Clara moved Porto studies")],
                          answer=[cite_porto])
    response = frontend(bank, llm).respond("ana", "Which city does Ana's sister live in?")
    assert llm.kinds == ["decompose", "unify", "refine", "unify", "answer"]
    assert response.grounded and [m.id for m in response.cited] == ["porto"]
    steps = response.trace.breadths[0].steps
    assert [s.depth for s in steps] == [0, 1]
    assert steps[0].unresolved == [CITY] and steps[1].unresolved == []
    assert steps[1].refine is not None and steps[1].refine.relation_type == "spatial"
    assert steps[1].queries[0].query == "Clara moved Porto studies" and "porto" in steps[1].queries[0].memory_ids
    # the second unification skipped the subgoal already resolved and was told the bindings so far
    assert SISTER not in llm.prompts[3].split("Facts:")[0].split("Subgoals:")[1]


def test_exhausted_depth_moves_to_a_new_decomposition_told_the_failed_one(bank: MemoryBank) -> None:
    queries = iter(FILLER)
    llm = ScriptedGoalLLM(
        decompose=[decomposition(CITY), decomposition("Clara moved to (x:city).")],
        unify=[UNRESOLVED, UNRESOLVED, UNRESOLVED, unify_by_keyword({"Clara moved to (x:city).": "Porto"})],
        refine=[lambda prompt: refinement(f"Ana noted (y:{next(queries)}).", next(queries))],
        answer=[cite_porto])
    response = frontend(bank, llm, d_max=2).respond("ana", "Which city does Ana's sister live in?")
    assert llm.kinds == ["decompose", "unify", "refine", "unify", "refine", "unify", "decompose", "unify", "answer"]
    first, second = response.trace.breadths
    assert first.outcome == "depth-exhausted" and [s.depth for s in first.steps] == [0, 1, 2]
    assert second.outcome == "grounded" and response.grounded
    second_prompt = llm.prompts[llm.kinds.index("decompose", 1)]
    assert "Existing rules that failed" in second_prompt and CITY in second_prompt
    assert "Difference From Prior Decompositions" in second_prompt


def test_nothing_new_retrieved_ends_the_depth_loop(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(decompose=[decomposition(CITY)], unify=[UNRESOLVED],
                          refine=[refinement("Ana's sister lives in a city (x:city).", "Ana's sister lives in city")],
                          answer=["I don't know. [NO_CITE]"])
    response = frontend(bank, llm, b_max=1).respond("ana", "Which city does Ana's sister live in?")
    assert llm.kinds == ["decompose", "unify", "refine", "unify", "answer"]
    breadth = response.trace.breadths[0]
    assert breadth.outcome == "no-new-memory" and breadth.steps[1].new_memories == 0
    assert not response.grounded and response.trace.outcome == "fallback"


def test_budget_exhaustion_stops_the_search(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(decompose=[decomposition(CITY, SISTER, "Clara moved to (x:city).")], unify=[UNRESOLVED],
                          refine=[refinement("Ana noted (y:errand).", "errand apples")], answer=["No idea. [NO_CITE]"])
    response = frontend(bank, llm, budget=3, learn=True).respond("ana", "Which city does Ana's sister live in?")
    assert llm.kinds == ["decompose", "unify", "answer"]  # no refinement: no memory could be added
    trace = response.trace
    assert len(trace.retrieved) == 3 and "budget" in trace.stop_reason
    assert trace.breadths[0].outcome == "budget-spent"
    shown = [len(q.memory_ids) for q in trace.queries]
    assert sum(shown) <= 6 and min(shown) < 2  # the selection that crossed the budget was cut to a prefix
    assert all(len(s.chosen) == len(s.logp) for s in response.selections)


def test_fallback_answers_from_partial_groundings_first(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(decompose=[decomposition(SISTER, CITY)], unify=[unify_by_keyword({SISTER: "married"})],
                          refine=["Refinement Status: stop\nMissing Info: none"], answer=["Somewhere. [0]"])
    response = frontend(bank, llm, b_max=1).respond("ana", "Which city does Ana's sister live in?")
    assert not response.grounded and response.trace.outcome == "fallback"
    assert response.trace.breadths[0].outcome == "stopped"
    assert response.trace.answer_facts[0] == "sister" and [m.id for m in response.cited] == ["sister"]
    unknown = frontend(bank, ScriptedGoalLLM(decompose=["gibberish"]), fallback="unknown").respond("ana", "Where?")
    assert unknown.answer == "I don't know." and unknown.trace.usage.calls == 3  # three decompositions, no answer


# -- malformed output at each step --------------------------------------------------------------------------
def test_malformed_decomposition_is_retried_with_a_format_reminder(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(decompose=["Sure! Here is my plan: think hard.", decomposition("Clara moved to (x:city).")],
                          unify=[unify_by_keyword({"Clara moved to (x:city).": "Porto"})], answer=[cite_porto])
    response = frontend(bank, llm).respond("ana", "Which city does Ana's sister live in?")
    assert response.grounded and llm.kinds == ["decompose", "decompose", "unify", "answer"]
    first = response.trace.breadths[0]
    assert first.outcome == "malformed" and first.error and first.steps == []
    assert "did not follow the output format" in llm.prompts[1]
    assert response.trace.calls[0].error


def test_every_decomposition_malformed_falls_back(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(decompose=["???"], answer=["I cannot tell. [NO_CITE]"])
    response = frontend(bank, llm).respond("ana", "Which city does Ana's sister live in?")
    assert llm.kinds == ["decompose"] * 3 + ["answer"]
    trace = response.trace
    assert trace.outcome == "fallback" and trace.breadths[0].steps == []
    # nothing was retrieved by a decomposition: the fallback searched with the question itself
    assert [q.query for q in trace.queries] == ["Which city does Ana's sister live in?"]
    assert trace.answer_facts == trace.retrieved == trace.fallback_queries[0].memory_ids
    assert len(response.selections) == 1


def test_malformed_unification_grounds_nothing(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(decompose=[decomposition(SISTER)], unify=["The facts look relevant to me."],
                          refine=["Refinement Status: stop"], answer=["Maybe Porto."])
    agent_frontend = frontend(bank, llm, b_max=1, learn=True)
    response = agent_frontend.respond("ana", "Is Ana's sister getting married?")
    step = response.trace.breadths[0].steps[0]
    assert step.unify is not None and step.unify.error and step.unresolved == [SISTER]
    assert not response.grounded and response.answer == "Maybe Porto."
    # neither a readable unification nor a parseable citation: the selections teach nothing
    stats = agent_frontend.agent.learner("ana").stats
    assert stats.records == 0 and stats.skipped_no_citation == len(response.selections) > 0


def test_malformed_refinement_ends_the_depth_loop(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(decompose=[decomposition(CITY)], unify=[UNRESOLVED], refine=["I would search harder."],
                          answer=["No idea. [NO_CITE]"])
    response = frontend(bank, llm, b_max=1).respond("ana", "Which city does Ana's sister live in?")
    assert llm.kinds == ["decompose", "unify", "refine", "answer"]
    step = response.trace.breadths[0].steps[1]
    assert step.refine is not None and step.refine.error and response.trace.breadths[0].outcome == "stopped"


def test_answer_without_citation_keeps_its_text_and_learns_from_grounding(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(decompose=[decomposition("Clara moved to (x:city).")],
                          unify=[unify_by_keyword({"Clara moved to (x:city).": "Porto"})], answer=["It is Porto"])
    front = frontend(bank, llm, learn=True)
    response = front.respond("ana", "Which city does Ana's sister live in?")
    assert response.answer == "It is Porto" and response.cited == []
    assert response.trace.calls[-1].error == "no parseable citation"
    rewards = response.trace.queries[0].reward
    assert rewards is not None and rewards[response.trace.queries[0].memory_ids.index("porto")] == 1.0
    assert front.agent.learner("ana").stats.records == 1


def test_grounding_that_cites_an_unshown_fact_is_not_counted(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(decompose=[decomposition(SISTER)],
                          unify=[("Unification Status: satisfied\nSubstitution: {x / Porto}\nGrounded Subgoals:\n"
                                 f"- {SISTER} <= Fact 99; bindings: none\nUnresolved Subgoals:\n- none")],
                          refine=["Refinement Status: stop"], answer=["No. [NO_CITE]"])
    response = frontend(bank, llm, b_max=1).respond("ana", "Is Ana's sister getting married?")
    assert not response.grounded and response.trace.breadths[0].steps[0].unresolved == [SISTER]


def test_unbound_answer_variable_is_not_success(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(decompose=[decomposition(SISTER)], unify=[unify_by_keyword({SISTER: "married"}, bindings="")],
                          refine=["Refinement Status: stop"], answer=["Unknown. [NO_CITE]"])
    response = frontend(bank, llm, b_max=1).respond("ana", "Which city does Ana's sister live in?")
    assert not response.grounded
    step = response.trace.breadths[0].steps[0]
    goal = "(Ana's sister) lives in (x:city)."
    assert step.resolved == [SISTER] and step.unresolved == [goal]
    assert step.unify is not None and step.unify.unresolved[goal] == "answer variable x is not bound"


# -- the call bound -------------------------------------------------------------------------------------------
def _adversarial_scripts() -> dict[str, dict[str, list[Reply]]]:
    def fresh_refinement() -> Reply:
        words = iter(FILLER * 3)
        return lambda prompt: refinement(f"Ana noted (y:{next(words)}).", next(words))

    return {
        "never grounds, always new": {"decompose": [lambda p: decomposition(CITY, SISTER)], "unify": [UNRESOLVED],
                                      "refine": [fresh_refinement()]},
        "unreadable unify": {"decompose": [decomposition(CITY)], "unify": ["garbage"], "refine": [fresh_refinement()]},
        "unreadable everything": {"decompose": ["no"], "unify": ["no"], "refine": ["no"], "answer": ["no"]},
        "many subgoals": {"decompose": [decomposition(*(f"Ana noted (y:{w})." for w in FILLER[:12]))],
                          "unify": [UNRESOLVED], "refine": [fresh_refinement()]},
    }


@pytest.mark.parametrize("name", list(_adversarial_scripts()))
@pytest.mark.parametrize("b_max,d_max", [(3, 5), (2, 1), (1, 0)])
def test_llm_calls_never_exceed_the_papers_bound(bank: MemoryBank, name: str, b_max: int, d_max: int) -> None:
    llm = ScriptedGoalLLM(**_adversarial_scripts()[name])
    config = GoalConfig(b_max=b_max, d_max=d_max, budget=1000)
    front = frontend(bank, llm, b_max=b_max, d_max=d_max, budget=1000)
    response = front.respond("ana", "Which city does Ana's sister live in?")
    assert response.trace.usage.calls == len(llm.kinds) <= config.max_calls == 1 + b_max * (2 + 2 * d_max)
    if name == "never grounds, always new":
        assert len(llm.kinds) == config.max_calls  # the worst case is reached, and not exceeded
    assert len(response.trace.retrieved) == len(set(response.trace.retrieved))
    subgoals_per_step = [len(s.subgoals) for b in response.trace.breadths for s in b.steps]
    assert max(subgoals_per_step, default=0) <= config.max_subgoals


# -- learning -------------------------------------------------------------------------------------------------
def test_subgoal_selections_are_rewarded_and_reach_the_learner(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(decompose=[decomposition(SISTER, CITY)],
                          unify=[unify_by_keyword({SISTER: "married"}), unify_by_keyword(KEYS)],
                          refine=[refinement("Clara lives in (x:city).", "Clara moved Porto studies")],
                          answer=[cite_porto])
    front = frontend(bank, llm, learn=True, k=3, m=3)  # M = K: Gumbel sampling only orders the top-K
    response = front.respond("ana", "Which city does Ana's sister live in?")
    learner = front.agent.learner("ana")
    assert learner.stats.records == len(response.selections) == 3 and learner.stats.updates == 1
    used = {"sister", "porto"}
    for record in response.trace.queries:
        assert record.reward == [1.0 if i in used else -1.0 for i in record.memory_ids]
    assert any(r == 1.0 for q in response.trace.queries for r in q.reward or [])
    assert all(s.explore for s in response.selections)  # learning samples (Gumbel), as the agent does


def test_no_learning_is_greedy_and_records_nothing(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(decompose=[decomposition("Clara moved to (x:city).")],
                          unify=[unify_by_keyword({"Clara moved to (x:city).": "Porto"})], answer=[cite_porto])
    front = frontend(bank, llm, learn=False)
    response = front.respond("ana", "Which city does Ana's sister live in?")
    assert front.agent.learner("ana").stats.records == 0 and not any(s.explore for s in response.selections)
    assert all(q.reward is None for q in response.trace.queries)


def test_sessions_and_checkpoints_are_shared_with_the_agent(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(decompose=[decomposition("Clara moved to (x:city).")],
                          unify=[unify_by_keyword({"Clara moved to (x:city).": "Porto"})], answer=[cite_porto])
    agent = Agent(bank, llm, k=6, m=2, learner_config=LearnerConfig(batch_size=1), checkpoint_every=1, learn=True)
    front = GoalFrontend(agent)
    front.respond("ana", "Which city does Ana's sister live in?")
    assert [t.text for t in agent.sessions.current("ana").turns] == ["Which city does Ana's sister live in?", "Porto."]
    assert (Path(bank.path) / "reranker" / "meta.json").exists()
    front.respond("ana", "And again?", remember=False)
    assert len(agent.sessions.current("ana").turns) == 2
    agent.close()


# -- trace, helpers, bad input --------------------------------------------------------------------------------
def test_trace_round_trips_through_json_and_renders(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(decompose=[decomposition(SISTER, CITY)],
                          unify=[unify_by_keyword({SISTER: "married"}), unify_by_keyword(KEYS)],
                          refine=[refinement("Clara lives in (x:city).", "Clara moved Porto studies")],
                          answer=[cite_porto])
    trace = frontend(bank, llm).respond("ana", "Which city does Ana's sister live in?").trace
    data = json.loads(json.dumps(trace.to_json()))
    assert data["usage"]["calls"] == 5 and data["breadths"][0]["steps"][1]["refine"]["status"] == "refine"
    assert GoalTrace.from_json(data) == trace
    console = Console(record=True, width=200)
    console.print(render_trace(trace))
    text = console.export_text()
    for expected in ("breadth 1", "depth 1", "Clara moved Porto studies", "grounded goal", "answer: Porto.",
                     "5 LLM calls", "x / Porto"):
        assert expected in text


def test_user_without_memories_gets_an_answer_without_search(bank: MemoryBank) -> None:
    llm = ScriptedGoalLLM(answer=["Hello! [NO_CITE]"])
    response = frontend(bank, llm).respond("nobody", "hi there")
    assert llm.kinds == ["answer"] and response.answer == "Hello!" and response.trace.outcome == "no-memories"


def test_nl_logic_helpers() -> None:
    assert retrieval_query("(Caroline) is likely to pursue (x:career_field).") == \
        "Caroline is likely to pursue career field."
    assert retrieval_query("Alice visited (Momoco:cafe) last week") == "Alice visited Momoco last week"
    assert ground_goal("(x:drink) served at (z:cafe)", {"x": "Kyoto Latte"}) == "(Kyoto Latte) served at (z:cafe)"


def test_bad_input(bank: MemoryBank) -> None:
    agent = Agent(bank, SimulatedLLM(), k=6, m=2)
    with pytest.raises(GoalFrontendError, match="cannot decompose"):
        GoalFrontend(agent)
    for bad in ({"b_max": 0}, {"d_max": -1}, {"budget": 0}, {"fallback": "guess"}, {"k": 0}, {"max_subgoals": True}):
        with pytest.raises(ValueError):
            GoalConfig(**bad)
    with pytest.raises(ValueError):
        frontend(bank, ScriptedGoalLLM(), k=2, m=3)
    with pytest.raises(ValueError):
        frontend(bank, ScriptedGoalLLM()).respond("ana", "  ")
