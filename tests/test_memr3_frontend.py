"""The MemR³ loop (rmm.frontends.memr3) driven by a scripted LLM whose JSON outputs are written here.

Every router override (iteration budget → answer, empty retrieval → reflect, reflect streak →
retrieve), the query q ⊕ Δq, the mask (no memory shown twice in a question), malformed output at
each step (never a crash, never an invented memory id), the call bound n_max + 1, rewards reaching
the learner, and the trace's JSON round trip and view.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fakes import BagOfWordsEncoder, Reply, ScriptedMemR3LLM, add_story
from rich.console import Console

from rmm.frontends.agent import Agent
from rmm.frontends.memr3 import (
    MemR3Config,
    MemR3Frontend,
    MemR3FrontendError,
    MemR3State,
    directive_for,
    route,
)
from rmm.frontends.memr3_trace import MemR3Trace, render_memr3_trace
from rmm.llm.base import LLM
from rmm.llm.simulated import SimulatedLLM
from rmm.memory.bank import MemoryBank
from rmm.policy.learner import LearnerConfig
from rmm.policy.retrieve import RerankedRetriever
from rmm.policy.sampling import plackett_luce_logp
from rmm.prompts.memr3_render import MEMR3_SCHEMA
from rmm.types import Memory

QUESTION = "Which city does Ana's sister live in?"  # the direct search misses Porto: only a refined one finds it
STUDIES = "Which city did Clara move to for her studies?"  # the direct search finds it


@pytest.fixture
def bank(tmp_path: Path):
    with MemoryBank(tmp_path / "bank", BagOfWordsEncoder(), device="cpu") as b:
        add_story(b, refs=False)
        b.add("tiny", [Memory(id=f"t{i}", user_id="tiny", kind="topic", text=f"Tim likes {w}")
                       for i, w in enumerate(("apples", "boats", "chess"))])
        yield b


def frontend(bank: MemoryBank, llm: LLM, *, learn: bool = False, batch_size: int = 64, **config) -> MemR3Frontend:
    """Greedy (not learning) unless asked, so the paths below do not depend on Gumbel draws."""
    agent = Agent(bank, llm, k=8, m=3, learn=learn, learner_config=LearnerConfig(batch_size=batch_size),
                  checkpoint_every=0)
    return MemR3Frontend(agent, MemR3Config(**{"n_chk": 3, **config}))


# -- scripted outputs ------------------------------------------------------------------------------------
def snippets_in(prompt: str) -> dict[int, str]:
    """Handle number → snippet text, from the prompt's `# Memory snippets` block."""
    block = prompt.split("# Memory snippets\n", 1)[1].split("\n\n# Reasoning", 1)[0]
    return {int(n): text for n, text in re.findall(r"^\[M(\d+)\] (.*)$", block, re.MULTILINE)}


def generation(decision: str, *, evidence: list[str] = (), gaps: list[str] = (), **payload: str) -> str:
    return json.dumps({"evidence": list(evidence), "gaps": list(gaps), "decision": decision, **payload})


def cite_keyword(keyword: str, decision: str = "answer", **payload: str) -> Callable[[str], str]:
    """Evidence citing the shown snippet that mentions `keyword` (none if it is not shown)."""
    def reply(prompt: str) -> str:
        found = [f"{text.split(' [spoken')[0]} [M{n}]" for n, text in snippets_in(prompt).items() if keyword in text]
        carried = re.findall(r"^- (.*\[M\d+(?:, M\d+)*\])$", prompt.split("# Evidence\n", 1)[1].split("\n\n")[0],
                             re.MULTILINE)
        return generation(decision, evidence=carried + found, gaps=[] if found else [f"where is {keyword}"], **payload)
    return reply


def retrieve(query: str) -> str:
    return generation("retrieve", gaps=["the city"], retrieval_query=query)


REFLECT = generation("reflect", gaps=["the city"], reasoning="Clara studies abroad; the city must be named somewhere.")


def cite_evidence(prompt: str) -> str:
    numbers = re.findall(r"Evidence \[(\d+)\]: .*Porto", prompt)
    return f"Porto. [{numbers[0]}]" if numbers else "I don't know. [NO_CITE]"


# -- the loop and its router ---------------------------------------------------------------------------
def test_answer_at_the_first_iteration(bank: MemoryBank) -> None:
    llm = ScriptedMemR3LLM(generate=[cite_keyword("Porto", detailed_answer="Clara lives in Porto.")],
                           answer=[cite_evidence])
    response = frontend(bank, llm).respond("ana", STUDIES)
    assert llm.kinds == ["generate", "answer"]
    assert response.answer == "Porto." and [m.id for m in response.cited] == ["porto"]
    trace = response.trace
    assert trace.outcome == "answered" and trace.start is not None and trace.start.query == STUDIES
    assert "porto" in trace.start.memory_ids and len(trace.start.memory_ids) == 3
    (it,) = trace.iterations
    assert (it.directive, it.decision, it.action, it.override) == ("default", "answer", "answer", "")
    assert [e.memories for e in it.evidence] == [["porto"]] and trace.draft == "Clara lives in Porto."
    # the paper's prompts: strict-JSON system prompt with the default directive, user prompt blocks
    assert 'Choose "reflect" if you need to think about the evidence and gaps' in llm.systems[0]
    for block in ("# Question\n" + STUDIES, "# Evidence\nNone", "# Gaps\nNone", "# Reasoning\nNone",
                  "# Prior Query\nNone"):
        assert block in llm.prompts[0]
    assert len(snippets_in(llm.prompts[0])) == 3 and llm.schemas == [MEMR3_SCHEMA, None]
    # the final answer sees the draft and the evidence, not the raw snippets
    assert "Draft answer: Clara lives in Porto." in llm.prompts[1] and "[M" not in llm.prompts[1]


def test_retrieve_searches_q_plus_delta_and_never_shows_a_memory_twice(bank: MemoryBank) -> None:
    llm = ScriptedMemR3LLM(generate=[retrieve("Clara moved Porto studies"), cite_keyword("Porto")],
                           answer=[cite_evidence])
    response = frontend(bank, llm).respond("ana", QUESTION)
    assert llm.kinds == ["generate", "generate", "answer"]
    first, second = response.trace.iterations
    assert first.action == "retrieve" and first.retrieval is not None
    assert first.retrieval.query == f"{QUESTION} Clara moved Porto studies"
    assert first.retrieval.subgoal == "Clara moved Porto studies"
    assert "# Prior Query\nClara moved Porto studies" in llm.prompts[1]
    assert sorted(snippets_in(llm.prompts[1])) == [4, 5, 6]  # the second retrieval's memories, new handles
    shown = [i for q in response.trace.queries for i in q.memory_ids]
    assert len(shown) == len(set(shown)) == 6 and shown == response.trace.retrieved
    assert second.action == "answer" and [m.id for m in response.cited] == ["porto"]


def test_iteration_budget_forces_the_answer(bank: MemoryBank) -> None:
    llm = ScriptedMemR3LLM(generate=[lambda p: retrieve(f"errand {len(snippets_in(p))}")], answer=["Unsure. [NO_CITE]"])
    response = frontend(bank, llm, n_max=3).respond("ana", QUESTION)
    assert llm.kinds == ["generate"] * 3 + ["answer"]
    iterations = response.trace.iterations
    assert [i.directive for i in iterations] == ["default", "default", "answer"]
    assert 'Choose "answer" (the iteration budget is used up' in llm.systems[2]
    assert [i.action for i in iterations] == ["retrieve", "retrieve", "answer"]
    assert iterations[-1].override == "iteration budget n_max=3 spent" and iterations[-1].retrieval is None
    assert response.trace.outcome == "budget" and len(response.trace.queries) == 3
    assert len(response.trace.retrieved) == 9  # n_max retrievals of n_chk unseen memories


def test_reflect_streak_forces_a_retrieval(bank: MemoryBank) -> None:
    llm = ScriptedMemR3LLM(generate=[REFLECT, REFLECT, REFLECT, cite_keyword("Porto")], answer=[cite_evidence])
    response = frontend(bank, llm, n_cap=2).respond("ana", QUESTION)
    iterations = response.trace.iterations
    assert [(i.directive, i.decision, i.action) for i in iterations] == [
        ("default", "reflect", "reflect"), ("default", "reflect", "reflect"), ("retrieve", "reflect", "retrieve"),
        ("default", "answer", "answer")]
    assert iterations[2].override == "reflect streak reached n_cap=2" and iterations[2].retrieval is not None
    assert iterations[2].retrieval.query == QUESTION  # forced without a query of its own: q alone
    assert "# Reasoning\nClara studies abroad" in llm.prompts[1]  # F is fed back after a reflect
    assert "# Reasoning\nNone" in llm.prompts[3]  # and dropped once a retrieval ran
    assert snippets_in(llm.prompts[1]) == snippets_in(llm.prompts[0])  # S stays until the next retrieval
    assert 'Choose "retrieve" (you have reflected enough' in llm.systems[2]


def test_default_reflect_cap_is_one(bank: MemoryBank) -> None:
    llm = ScriptedMemR3LLM(generate=[REFLECT, REFLECT, cite_keyword("Porto")], answer=[cite_evidence])
    response = frontend(bank, llm).respond("ana", QUESTION)
    assert MemR3Config().n_cap == 1
    assert [i.action for i in response.trace.iterations] == ["reflect", "retrieve", "answer"]


def test_empty_retrieval_turns_retrieve_into_reflect_but_keeps_an_answer(bank: MemoryBank) -> None:
    llm = ScriptedMemR3LLM(generate=[retrieve("Tim boats"), retrieve("Tim chess"), retrieve("Tim again"),
                                     generation("answer", evidence=["Tim likes apples [M1]"], detailed_answer="Apples")],
                           answer=["Apples. [0]"])
    response = frontend(bank, llm, n_chk=2).respond("tiny", "What does Tim like?")
    iterations = response.trace.iterations
    assert [len(q.memory_ids) for q in response.trace.queries] == [2, 1, 0]  # the bank ran out
    assert [(i.directive, i.decision, i.action) for i in iterations] == [
        ("default", "retrieve", "retrieve"), ("default", "retrieve", "retrieve"), ("reflect", "retrieve", "reflect"),
        ("reflect", "answer", "answer")]
    assert iterations[2].override == "the last retrieval found no unseen memory"
    assert 'no unseen memory is left to retrieve' in llm.systems[2]
    assert response.answer == "Apples." and response.trace.outcome == "answered"
    assert sorted(response.trace.retrieved) == ["t0", "t1", "t2"]


def test_router_and_directive_follow_algorithm_1_in_order() -> None:
    config = MemR3Config(n_max=5, n_cap=1)
    budget = MemR3State("q", iteration=5, exhausted=True, reflect_streak=3)
    assert route("retrieve", budget, config) == ("answer", "iteration budget n_max=5 spent")
    assert route("answer", budget, config) == ("answer", "")
    empty = MemR3State("q", iteration=2, exhausted=True, reflect_streak=3)
    assert route("retrieve", empty, config)[0] == route(None, empty, config)[0] == "reflect"
    assert route("answer", empty, config) == ("answer", "")
    streak = MemR3State("q", iteration=2, reflect_streak=1)
    assert route("reflect", streak, config)[0] == route("answer", streak, config)[0] == "retrieve"
    free = MemR3State("q", iteration=2)
    assert [route(d, free, config)[0] for d in ("retrieve", "reflect", "answer", None)] == [
        "retrieve", "reflect", "answer", "retrieve"]
    assert directive_for(MemR3State("q", iteration=4, exhausted=True), config) == "answer"
    assert directive_for(MemR3State("q", iteration=1, exhausted=True, reflect_streak=2), config) == "reflect"
    assert directive_for(MemR3State("q", iteration=1, reflect_streak=1), config) == "retrieve"
    assert directive_for(MemR3State("q", iteration=0), config) == "default"


# -- malformed output --------------------------------------------------------------------------------
MALFORMED = {
    "prose": "I think we should look for Clara's city next.",
    "empty": "",
    "no schema keys": '{"answer": "Porto", "confidence": 0.3}',
    "cut off": '{"evidence": ["Ana has a sister called Clara [M2]", "Clara moved to Po',
    "wrong types": '{"evidence": {"a": 3}, "gaps": 7, "decision": ["maybe"], "retrieval_query": {"q": 1}}',
    "invented ids": generation("retrieve", evidence=["Clara lives in Lisbon [M99]", "Ana is a nurse [M0, M42]"],
                               retrieval_query="Clara city"),
}


@pytest.mark.parametrize("bad", list(MALFORMED))
@pytest.mark.parametrize("step", [1, 2, 3])
def test_malformed_generate_output_at_each_step_never_crashes_or_invents(bank: MemoryBank, bad: str, step: int) -> None:
    script: list[Reply] = [retrieve("Clara married June"), cite_keyword("married", "retrieve", retrieval_query="x"),
                           cite_keyword("Porto")]
    script[step - 1] = MALFORMED[bad]
    llm = ScriptedMemR3LLM(generate=script + [cite_keyword("Porto")], answer=[cite_evidence])
    response = frontend(bank, llm, learn=True).respond("ana", QUESTION)
    trace = response.trace
    assert len(llm.kinds) <= MemR3Config().max_calls and llm.kinds[-1] == "answer"
    broken = trace.iterations[step - 1]
    if bad in ("prose", "empty", "no schema keys"):
        assert broken.error and trace.calls[step - 1].error and broken.decision is None
        assert broken.action == "retrieve" and broken.override == "no readable decision: retrieve more"
        assert broken.retrieval is not None and broken.retrieval.query == QUESTION  # q alone: no Δq was read
    else:
        assert broken.error is None and broken.warnings
    # every memory any bullet points at was retrieved for this question and shown in that prompt
    for it, prompt in zip(trace.iterations, [p for p, k in zip(llm.prompts, llm.kinds) if k == "generate"]):
        visible = set(snippets_in(prompt)) | {int(n) for n in re.findall(r"\[M(\d+)", prompt.split("# Gaps")[0])}
        for e in it.evidence:
            assert {trace.retrieved.index(i) + 1 for i in e.memories} <= visible
    shown = [i for q in trace.queries for i in q.memory_ids]
    assert len(shown) == len(set(shown))


def test_unreadable_generation_keeps_evidence_and_gaps(bank: MemoryBank) -> None:
    llm = ScriptedMemR3LLM(generate=[cite_keyword("married", "retrieve", retrieval_query="Clara city"), "nonsense",
                                     cite_keyword("Porto")], answer=[cite_evidence])
    response = frontend(bank, llm).respond("ana", QUESTION)
    carried = re.compile(r"# Evidence\n- Ana's sister Clara is getting married in June \[M\d\]\n\n# Gaps\nNone")
    assert carried.search(llm.prompts[1]) and carried.search(llm.prompts[2])  # kept through the unreadable call
    assert response.trace.iterations[1].error and response.trace.iterations[1].evidence == []


def test_malformed_answer_keeps_its_text_and_learns_from_the_evidence(bank: MemoryBank) -> None:
    llm = ScriptedMemR3LLM(generate=[cite_keyword("Porto")], answer=["It is Porto, I believe"])
    front = frontend(bank, llm, learn=True, k=3)
    response = front.respond("ana", STUDIES)
    assert response.answer == "It is Porto, I believe" and response.cited == []
    assert response.trace.calls[-1].error == "no parseable citation"
    start = response.trace.start
    assert start is not None and start.reward == [1.0 if i == "porto" else -1.0 for i in start.memory_ids]
    assert front.agent.learner("ana").stats.records == 1


def test_unattributed_evidence_and_unreadable_answer_teach_nothing(bank: MemoryBank) -> None:
    llm = ScriptedMemR3LLM(generate=[generation("answer", evidence=["Clara lives in Porto"])], answer=["Porto"])
    front = frontend(bank, llm, learn=True)
    response = front.respond("ana", QUESTION)
    stats = front.agent.learner("ana").stats
    assert stats.records == 0 and stats.skipped_no_citation == len(response.selections) == 1
    assert response.trace.start is not None and response.trace.start.reward is None


# -- the call bound ----------------------------------------------------------------------------------
ADVERSARIAL: dict[str, list[Reply]] = {
    "always retrieve": [lambda p: retrieve(f"search {len(p)}")],
    "always reflect": [REFLECT],
    "never readable": ["no"],
    "cut off": [MALFORMED["cut off"]],
    "alternating": [REFLECT, retrieve("Clara city"), REFLECT, retrieve("Porto studies")],
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
@pytest.mark.parametrize("n_max,n_cap,user", [(5, 1, "ana"), (3, 2, "ana"), (1, 1, "ana"), (5, 1, "tiny")])
def test_llm_calls_never_exceed_n_max_plus_one(bank: MemoryBank, name: str, n_max: int, n_cap: int, user: str) -> None:
    llm = ScriptedMemR3LLM(generate=list(ADVERSARIAL[name]), answer=["no"])
    config = MemR3Config(n_chk=3, n_max=n_max, n_cap=n_cap)
    response = frontend(bank, llm, n_max=n_max, n_cap=n_cap).respond(user, QUESTION)
    assert response.trace.usage.calls == len(llm.kinds) <= config.max_calls == n_max + 1
    if name in ("always retrieve", "never readable"):
        assert len(llm.kinds) == config.max_calls  # the worst case is reached, and not exceeded
    retrieved = response.trace.retrieved
    assert len(retrieved) == len(set(retrieved)) <= n_max * config.n_chk
    assert len(response.trace.queries) <= n_max


# -- learning ----------------------------------------------------------------------------------------
def test_each_retrieval_is_a_selection_rewarded_by_evidence_and_answer(bank: MemoryBank) -> None:
    llm = ScriptedMemR3LLM(generate=[cite_keyword("married", "retrieve", retrieval_query="Clara moved Porto studies"),
                                     cite_keyword("Porto")], answer=[cite_evidence])
    front = frontend(bank, llm, learn=True, batch_size=2, k=3)  # K = n_chk: sampling only orders the unseen top-3
    response = front.respond("ana", QUESTION)
    learner = front.agent.learner("ana")
    assert len(response.selections) == 2 and learner.stats.records == 2 and learner.stats.updates == 1
    used = {"sister", "porto"}
    assert used <= set(response.trace.retrieved)
    for record in response.trace.queries:
        assert record.reward == [1.0 if i in used else -1.0 for i in record.memory_ids]
    first, second = response.selections
    assert first.explore and second.explore  # learning samples (Gumbel), as the agent does
    # the second selection was drawn from what the first had not shown, and its log π is over that set
    assert not set(second.candidates.memory_ids) & set(first.memory_ids)
    expected = plackett_luce_logp(second.scores[None], torch.tensor([second.chosen]), front.agent.tau)[0]
    torch.testing.assert_close(second.logp, expected)


def test_no_learning_is_greedy_and_records_nothing(bank: MemoryBank) -> None:
    llm = ScriptedMemR3LLM(generate=[cite_keyword("Porto")], answer=[cite_evidence])
    front = frontend(bank, llm)
    response = front.respond("ana", QUESTION)
    assert front.agent.learner("ana").stats.records == 0 and not any(s.explore for s in response.selections)
    assert all(q.reward is None for q in response.trace.queries)


def test_sessions_and_checkpoints_are_shared_with_the_agent(bank: MemoryBank) -> None:
    llm = ScriptedMemR3LLM(generate=[cite_keyword("Porto")], answer=[cite_evidence])
    agent = Agent(bank, llm, k=8, m=3, learner_config=LearnerConfig(batch_size=1), checkpoint_every=1, learn=True)
    front = MemR3Frontend(agent)
    front.respond("ana", STUDIES)
    assert [t.text for t in agent.sessions.current("ana").turns] == [STUDIES, "Porto."]
    assert (Path(bank.path) / "reranker" / "meta.json").exists()
    front.respond("ana", "And again?", remember=False)
    assert len(agent.sessions.current("ana").turns) == 2
    agent.close()


def test_reranked_retriever_exclude_keeps_k_unseen_candidates(bank: MemoryBank) -> None:
    agent = Agent(bank, SimulatedLLM(), k=5, m=3, learn=False)
    retriever = RerankedRetriever(bank, agent.learner("ana").reranker, k=5, m=3)
    (plain,) = retriever.select([QUESTION], "ana")
    seen = set(plain.candidates.memory_ids[:4])
    (masked,) = retriever.select([QUESTION], "ana", exclude=[seen])
    assert len(masked.candidates) == 5 and not set(masked.candidates.memory_ids) & seen
    assert not set(masked.memory_ids) & seen and len(masked.chosen) == 3
    with pytest.raises(ValueError, match="per query"):
        retriever.select([QUESTION], "ana", exclude=[seen, seen])


# -- trace, bad input ----------------------------------------------------------------------------------
def test_trace_round_trips_through_json_and_renders(bank: MemoryBank) -> None:
    think = cite_keyword("Porto", "reflect", reasoning="Clara studies in Porto, so that is where she lives.")
    llm = ScriptedMemR3LLM(generate=[think, think, cite_keyword("Porto", detailed_answer="Porto")],
                           answer=[cite_evidence])
    trace = frontend(bank, llm, learn=True, k=3).respond("ana", STUDIES).trace
    data = json.loads(json.dumps(trace.to_json()))
    assert data["usage"]["calls"] == 4 and data["iterations"][1]["override"] == "reflect streak reached n_cap=1"
    assert MemR3Trace.from_json(data) == trace
    console = Console(record=True, width=200)
    console.print(render_memr3_trace(trace))
    text = console.export_text()
    for expected in ("iteration 1", "LLM reflect → reflect", "router: reflect streak", "reasoning: Clara studies",
                     "answer: Porto.", "4 LLM calls", "cited evidence [", "reward"):
        assert expected in text, expected


def test_user_without_memories_gets_an_answer_without_search(bank: MemoryBank) -> None:
    llm = ScriptedMemR3LLM(answer=["Hello! [NO_CITE]"])
    response = frontend(bank, llm).respond("nobody", "hi there")
    assert llm.kinds == ["answer"] and response.answer == "Hello!" and response.trace.outcome == "no-memories"


def test_bad_input(bank: MemoryBank) -> None:
    with pytest.raises(MemR3FrontendError, match="cannot write evidence"):
        MemR3Frontend(Agent(bank, SimulatedLLM(), k=6, m=2))
    for bad in ({"n_max": 0}, {"n_chk": 0}, {"n_cap": True}, {"k": 2, "n_chk": 3}, {"answer_tokens": 1.5}):
        with pytest.raises(ValueError):
            MemR3Config(**bad)
    with pytest.raises(ValueError):
        frontend(bank, ScriptedMemR3LLM()).respond("ana", "  ")
