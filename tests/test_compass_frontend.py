"""CompassMem's search (rmm.frontends.compass) over a small event graph written with
`store.add_events`, driven by a scripted LLM: planner → localization → batched explorers →
refinement → responder; every prompt's malformed output (retry, then fallback, never a crash); the
reranker inside the search (the neighbour slate's mask against a brute-force Plackett–Luce
reference, rewards only to sampled, shown nodes); the heuristic and oracle policies; the trace's
Table 4 statistics and JSON round trip; the CLI wiring."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch
from fakes import BagOfWordsEncoder, ScriptedGoalLLM
from plackett_luce_helpers import naive_pl_logp
from rich.console import Console

from rmm.bench.compass import FIRST_WALK
from rmm.frontends.agent import Agent
from rmm.frontends.compass import CompassConfig, CompassFrontend, CompassFrontendError
from rmm.frontends.compass_trace import CompassTrace, table4
from rmm.frontends.controllers import CONTROLLERS, controller_name, open_controller
from rmm.llm.simulated import SimulatedLLM
from rmm.memory.bank import MemoryBank
from rmm.memory.graph import Edge, Event, Topic
from rmm.policy.learner import LearnerConfig
from rmm.prompts.compass_search_parse import (
    PromptParseError,
    parse_action,
    parse_node_choice,
    parse_refinement,
    parse_subgoals,
)
from rmm.types import Memory

QUESTION = "What instrument does the friend Melanie met at the pottery class play?"
STORY = {  # id → (text, turn ref, topic)
    "meet": ("Melanie joined a pottery class and met Jen there", "t:meet", "pottery"),
    "recital": ("Jen invited Melanie to her recital downtown", "t:recital", "music"),
    "cello": ("Jen performs cello sonatas in a string quartet", "t:cello", "music"),
    "bakery": ("Melanie opened a small bakery on Main street", "t:bakery", "work"),
    "hub": ("Melanie keeps a list of weekly errands", "t:hub", "errands"),
}
ERRANDS = [f"errand{i}" for i in range(10)]
PLAN = "Sub-goal 1: Who Melanie met at the pottery class\nSub-goal 2: Which instrument that friend plays"


class ScriptedCompassLLM(ScriptedGoalLLM):
    """Replies per CompassMem prompt kind (plan | start | explore | refine | answer); records each
    generate call's batch size."""

    def __init__(self, **script) -> None:
        super().__init__(**script)
        self.batches: list[tuple[str, int]] = []

    @staticmethod
    def kind(system: str) -> str:
        for start, kind in (("You are a strategic planning", "plan"), ("You are selecting", "start"),
                            ("You are an expert information evaluator", "explore"),
                            ("You are an assistant whose role is to generate a refined", "refine")):
            if system.startswith(start):
                return kind
        return "answer"

    def _generate(self, batch, **options):
        self.batches.append((self.kind(batch[0][0]["content"]), len(batch)))
        return super()._generate(batch, **options)


def write_graph(bank: MemoryBank, user: str = "melanie") -> None:
    """STORY plus a hub with ten errand neighbours: meet -friendship-> recital -next-> cello; hub -> errand*."""
    encoder = bank.encoder
    texts = {k: v[0] for k, v in STORY.items()}
    texts.update({e: f"Melanie errand {w} today" for e, w in zip(ERRANDS, (
        "apples", "plumber", "garage", "tickets", "passport", "laundry", "printer", "dentist", "library", "curtains"))})
    ids = list(texts)
    events = [Event(Memory(id=i, user_id=user, kind="event", text=texts[i], refs=[STORY[i][1] if i in STORY else f"t:{i}"],
                           time_span=("3 May 2023", None)), ("Melanie",)) for i in ids]
    edges = [Edge("meet", "recital", "friendship", ("t:meet",)), Edge("recital", "cello", "next")]
    edges += [Edge("hub", e, "part-of") for e in ERRANDS]
    topics = [Topic(t, t, tuple(i for i in STORY if STORY[i][2] == t)) for t in ("pottery", "music", "work", "errands")]
    topics[-1] = Topic("errands", "errands", ("hub", *ERRANDS))
    bank.store.add_events(user, events, edges, topics, embeddings=encoder.encode_passages([texts[i] for i in ids]))


@pytest.fixture
def bank(tmp_path: Path):
    with MemoryBank(tmp_path / "bank", BagOfWordsEncoder(), device="cpu") as b:
        write_graph(b)
        yield b


def frontend(bank: MemoryBank, llm, *, learn: bool = False, **config) -> CompassFrontend:
    agent = Agent(bank, llm, k=8, m=3, learn=learn, learner_config=LearnerConfig(batch_size=64), checkpoint_every=0)
    return CompassFrontend(agent, CompassConfig(**{"pool": 15, **config}))


# -- scripted replies that read the prompt ------------------------------------------------------------
def handles(block: str) -> dict[str, int]:
    """Node text → handle number, from `[N3] text (…)` lines."""
    return {text: int(n) for n, text in re.findall(r"^\[N(\d+)\] (?:\([^)]*\) )?([^(]*?) \(", block, re.MULTILINE)}


def handle_of(block: str, word: str) -> int | None:
    return next((n for text, n in handles(block).items() if word in text), None)


def start_on(*words: str):
    def reply(prompt: str) -> str:
        found = [handle_of(prompt, w) for w in words]
        return "Selected Nodes: [" + ", ".join(f"N{n}" for n in found if n) + "]\nReasoning: relevant"
    return reply


def explore(prompt: str) -> str:
    """Keep the pottery meeting (→ the recital), the recital (→ the cello), answer at the cello."""
    current = prompt.split("CURRENT NODE INFORMATION: ", 1)[1].split("\n", 1)[0]
    neighbours = prompt.split("NEIGHBOR NODES (available for exploration):\n", 1)[1]
    if "pottery" in current:
        return f"ACTION: EXPAND\nNEXT_NODES: [N{handle_of(neighbours, 'recital')}]\nSATISFIED_SUBGOALS: [1]\nREASONING: Jen"
    if "recital" in current:
        return f"ACTION: EXPAND\nNEXT_NODES: [N{handle_of(neighbours, 'cello')}]\nSATISFIED_SUBGOALS: [1]\nREASONING: r"
    if "cello" in current:
        return "ACTION: ANSWER\nNEXT_NODES: NONE\nSATISFIED_SUBGOALS: [1, 2]\nREASONING: cello"
    return "ACTION: SKIP\nNEXT_NODES: NONE\nSATISFIED_SUBGOALS: []\nREASONING: unrelated"


def cite(word: str):
    def reply(prompt: str) -> str:
        found = re.findall(r"Memory \[(\d+)\]: ([^\n]*)", prompt.split("CONTEXT:", 2)[-1])
        hits = [n for n, text in found if word in text]
        return f"The cello. [{', '.join(hits)}]" if hits else "Unknown. [NO_CITE]"
    return reply


def story_llm(**overrides) -> ScriptedCompassLLM:
    script = {"plan": [PLAN], "start": [start_on("pottery", "errand")], "explore": [explore],
              "refine": ["New Query: Jen cello sonatas\nTarget Sub-goals: [2]"], "answer": [cite("cello")]}
    return ScriptedCompassLLM(**{**script, **overrides})


# -- the llm policy end to end --------------------------------------------------------------------------
def test_planner_explorers_and_responder_walk_the_graph_to_the_answer(bank: MemoryBank) -> None:
    llm = story_llm()
    response = frontend(bank, llm).respond("melanie", QUESTION)
    trace = response.trace
    assert trace.subgoals == ["Who Melanie met at the pottery class", "Which instrument that friend plays"]
    assert trace.outcome == "satisfied" and trace.satisfied == [True, True]
    assert trace.kept == ["meet", "recital", "cello"] == trace.retrieved  # the cello is not in the slate:
    assert "cello" not in trace.localizations[0].slate.memory_ids  # reached through the graph
    assert trace.localizations[0].start[0] == "meet" and len(trace.localizations[0].start) == 2
    assert response.answer == "The cello." and [m.id for m in response.cited] == ["cello"]
    assert [m.id for m in response.shown] == ["meet", "recital", "cello"]
    # one batched call per explorer batch: both start nodes decided together
    assert llm.batches[:3] == [("plan", 1), ("start", 1), ("explore", 2)] and llm.batches[-1] == ("answer", 1)
    assert [s.path_length for s in trace.steps if s.node in trace.kept] == [1, 2, 3]
    stats = trace.stats()
    assert stats["kept_nodes"] == 3 and stats["max_path_length"] == 3 and stats["refined"] is False
    assert stats["actions"] == {"EXPAND": 2, "SKIP": 1, "ANSWER": 1} and stats["paths"] == 2
    # the explorer saw the edge label and direction, and the kept information
    prompts = [p for p, k in zip(llm.prompts, llm.kinds) if k == "explore"]
    assert any("-friendship->" in p for p in prompts) and any("PREVIOUSLY KEPT INFORMATION: \n[N" in p for p in prompts)


def test_explorer_batches_are_bounded_by_the_number_of_explorers(bank: MemoryBank) -> None:
    llm = story_llm(start=[start_on("pottery", "errand2", "errand9", "errand6")],
                    explore=["ACTION: SKIP\nNEXT_NODES: NONE\nSATISFIED_SUBGOALS: []"])
    response = frontend(bank, llm, explorers=3, refinements=0).respond("melanie", QUESTION)
    sizes = [n for kind, n in llm.batches if kind == "explore"]
    assert max(sizes) <= 3 and sum(sizes) == len(response.trace.steps) and response.trace.outcome == "exhausted"
    assert response.trace.fallback and response.trace.retrieved == response.trace.localizations[0].slate.memory_ids


def test_one_refinement_round_when_the_queue_empties_with_subgoals_open(bank: MemoryBank) -> None:
    skip = "ACTION: SKIP\nNEXT_NODES: NONE\nSATISFIED_SUBGOALS: []"
    llm = story_llm(start=[start_on("pottery"), start_on("cello")], explore=[skip, explore])
    trace = frontend(bank, llm).respond("melanie", QUESTION).trace
    assert [k for k in llm.kinds if k in ("refine", "start")] == ["start", "refine", "start"]
    assert trace.refined_query == "Jen cello sonatas" and [loc.round for loc in trace.localizations] == [0, 1]
    assert trace.localizations[1].query == "Jen cello sonatas" and trace.stats()["refined"] is True
    assert "meet" in trace.localizations[0].slate.memory_ids  # visited in the first round,
    assert "meet" not in trace.localizations[1].slate.memory_ids  # masked from the second slate
    assert trace.outcome == "satisfied" and trace.kept == ["cello"]
    prompt = llm.prompts[llm.kinds.index("refine")]
    assert "Unsatisfied sub-goals: 1. Who Melanie met" in prompt


def test_a_single_refinement_at_most(bank: MemoryBank) -> None:
    skip = "ACTION: SKIP\nNEXT_NODES: NONE\nSATISFIED_SUBGOALS: []"
    llm = story_llm(start=[start_on("pottery")], explore=[skip])
    trace = frontend(bank, llm, refinements=1).respond("melanie", QUESTION).trace
    assert llm.kinds.count("refine") == 1 and trace.outcome == "exhausted" and trace.kept == []


# -- malformed output: retry once, then fall back ------------------------------------------------------------
GARBAGE = "I am not sure what you mean."


@pytest.mark.parametrize("kind", ["plan", "start", "explore", "refine"])
def test_malformed_output_is_asked_again_once(bank: MemoryBank, kind: str) -> None:
    good = story_llm().script[kind][0]
    skip = "ACTION: SKIP\nNEXT_NODES: NONE\nSATISFIED_SUBGOALS: []"
    script = {kind: [GARBAGE + "\n" + GARBAGE, good, good, good]}
    if kind == "refine":  # reached only when the first round leaves sub-goals open
        script.update(start=[start_on("pottery"), start_on("cello")], explore=[skip, explore])
    llm = story_llm(**script)
    response = frontend(bank, llm).respond("melanie", QUESTION)
    assert f"{kind}-retry" in [c.step for c in response.trace.calls]
    assert response.trace.outcome == "satisfied" and "cello" in response.trace.kept
    assert response.trace.plan_error is None and all(s.error is None for s in response.trace.steps)


def test_unreadable_plan_falls_back_to_the_question(bank: MemoryBank) -> None:
    llm = story_llm(plan=[GARBAGE])
    trace = frontend(bank, llm).respond("melanie", QUESTION).trace
    assert trace.subgoals == [QUESTION] and "no sub-goal found" in trace.plan_error
    assert [c.step for c in trace.calls][:2] == ["plan", "plan-retry"]


def test_unreadable_start_selection_falls_back_to_the_slates_best(bank: MemoryBank) -> None:
    llm = story_llm(start=["Selected Nodes: [N99]"], explore=["ACTION: SKIP\nNEXT_NODES: NONE"])
    trace = frontend(bank, llm, refinements=0, explorers=2).respond("melanie", QUESTION).trace
    location = trace.localizations[0]
    assert "names no shown node" in location.error and location.start == location.slate.memory_ids[:2]


def test_unreadable_explorer_decisions_fall_back_to_skip(bank: MemoryBank) -> None:
    llm = story_llm(explore=["ACTION: MAYBE", "{}"], answer=[GARBAGE])
    response = frontend(bank, llm, refinements=0).respond("melanie", QUESTION)
    steps = response.trace.steps
    assert steps and all(s.action == "SKIP" and s.error and not s.next_nodes for s in steps)
    assert response.trace.kept == [] and response.trace.fallback
    assert response.answer == GARBAGE and response.cited == []  # no citation: none credited
    assert response.trace.calls[-1].error == "no parseable citation"


def test_unreadable_refinement_falls_back_to_the_open_subgoals(bank: MemoryBank) -> None:
    llm = story_llm(start=[start_on("pottery")], explore=["ACTION: SKIP\nNEXT_NODES: NONE"], refine=["", "???"])
    trace = frontend(bank, llm).respond("melanie", QUESTION).trace
    assert trace.refine_error and trace.refined_query == f"{QUESTION} Who Melanie met at the pottery class " \
                                                         "Which instrument that friend plays"


def test_parsers_read_loose_output_and_refuse_nothing_usable() -> None:
    assert parse_subgoals("**Sub-goal 1:** who\nSub goal 2 - what\n").subgoals == ["who", "what"]
    assert parse_subgoals("1. a\n2. b\n3. c\n4. d\n5. e\n6. f").subgoals == ["a", "b", "c", "d", "e"]
    assert parse_node_choice("Selected Nodes: N2, N7\nReason: x", {2, 3}, 5).handles == [2]
    assert parse_node_choice("**Selected Nodes:** NONE", {2}, 5).handles == []
    assert parse_node_choice("Selected Nodes: [N1, N2, N3]", {1, 2, 3}, 2).handles == [1, 2]
    step = parse_action("**ACTION:** expand\nNEXT_NODES: [N4, N5, N6, N7, N9]\nSATISFIED_SUBGOALS: [2, 8]", {4, 5, 6, 7}, 2)
    assert (step.action, step.next_nodes, step.satisfied) == ("EXPAND", [4, 5, 6], [2]) and len(step.warnings) == 3
    assert parse_action("ACTION: SKIP\nNEXT_NODES: [N4]\nSATISFIED_SUBGOALS: [1]", {4}, 2).satisfied == []
    # SmolLM2's habit: the choice first, then musing on the other actions (every action word named)
    musing = "1. EXPAND\nNEXT_NODES: [N4]\nI could SKIP it, or ANSWER now, but EXPAND is better."
    assert parse_action(musing, {4}, 2).action == "EXPAND" and parse_action(musing, {4}, 2).next_nodes == [4]
    with pytest.raises(PromptParseError):  # no action on the first line and several later: nothing to trust
        parse_action("Let me think.\nSKIP or EXPAND or ANSWER?", {4}, 2)
    assert parse_refinement("New Query: Jen's instrument\nTarget Sub-goals: [2, 9]", 2).targets == [2]
    for parse in (parse_subgoals, lambda t: parse_node_choice(t, {1}, 3), lambda t: parse_action(t, {1}, 2),
                  lambda t: parse_refinement(t, 2)):
        for bad in ("", GARBAGE + "\n" + GARBAGE, "ACTION: SKIP or EXPAND" if parse is parse_subgoals else "   "):
            with pytest.raises(PromptParseError):
                parse(bad)


# -- the reranker inside the search -----------------------------------------------------------------
def hub_llm() -> ScriptedCompassLLM:
    """Starts on the hub and two errands (decided in one batch, so those errands are visited when the hub's
    neighbours are drawn); keeps the errands, skips everything else."""
    def start(prompt: str) -> str:
        errands = [n for text, n in handles(prompt).items() if "errand" in text and "list" not in text][:2]
        return f"Selected Nodes: [N{handle_of(prompt, 'list')}, " + ", ".join(f"N{n}" for n in errands) + "]"

    def decide(prompt: str) -> str:
        current = prompt.split("CURRENT NODE INFORMATION: ", 1)[1].split("\n", 1)[0]
        if "errand" in current and "list" not in current:
            return "ACTION: EXPAND\nNEXT_NODES: NONE\nSATISFIED_SUBGOALS: []"
        return "ACTION: SKIP\nNEXT_NODES: NONE\nSATISFIED_SUBGOALS: []"
    return ScriptedCompassLLM(plan=["Sub-goal 1: errands\nSub-goal 2: weekly list"], start=[start], explore=[decide],
                              refine=["New Query: errands"], answer=["Errands. [0]"])


def test_neighbour_slate_masks_visited_nodes_and_logs_exact_plackett_luce_logps(bank: MemoryBank) -> None:
    front = frontend(bank, hub_llm(), learn=True, start_k=5, slate=5, refinements=0)
    recorded = []
    learner = front.agent.learner("melanie")
    learner.record = lambda selection, rewards: recorded.append((selection, rewards))  # type: ignore[method-assign]
    response = front.respond("melanie", "Which errands are on Melanie's weekly list?")
    trace = response.trace
    (hub_step,) = [s for s in trace.steps if s.node == "hub"]
    visited_before = {s.node for s in trace.steps if s.batch == hub_step.batch}
    slate = hub_step.neighbours
    assert slate is not None and slate.sampled and len(slate.memory_ids) == 5
    masked = visited_before & set(ERRANDS)
    assert len(masked) == 2 and not masked & set(slate.memory_ids) and slate.candidates == 8
    (selection,) = [s for s in response.selections if set(s.memory_ids) == set(slate.memory_ids)]
    assert len(selection.candidates) == 8 and not masked & set(selection.candidates.memory_ids)
    # brute force over all ten neighbours, the masked ones excluded from every normaliser
    full = front._candidates(front_question(front, trace), ERRANDS)
    reranker = learner.reranker
    scores = reranker.fast_scores(full.query_embedding[None], full.embeddings[None])[0]
    chosen = torch.tensor([[ERRANDS.index(i) for i in selection.memory_ids]])
    mask = torch.tensor([[e not in masked for e in ERRANDS]])
    expected = naive_pl_logp(scores[None], chosen, selection.tau, mask)[0]
    assert torch.allclose(selection.logp, expected, atol=1e-5)
    # rewards: only sampled slates reach the learner, one reward per shown node, +1 exactly for the kept
    assert recorded and all(s.explore for s, _ in recorded)
    kept = set(trace.kept) | {m.id for m in response.cited}
    for s, rewards in recorded:
        assert rewards.tolist() == [1.0 if i in kept else -1.0 for i in s.memory_ids]
    assert len(recorded) == len(response.selections) == sum(1 for x in trace.slates if x.sampled)


def front_question(front: CompassFrontend, trace: CompassTrace):
    """A question state carrying the query vector the search scored the hub's neighbours against."""
    from rmm.frontends.compass import _Question

    q = _Question("melanie", trace.question, [], trace, None)
    (pool,) = front.agent.retriever("melanie", k=15, m=5).candidates([trace.question], "melanie", 15)
    q.query_vector = pool.query_embedding
    return q


def test_masked_slate_draws_follow_plackett_luce(bank: MemoryBank) -> None:
    """The first pick of many masked neighbour draws matches softmax(s/τ) over the unmasked ones."""
    front = frontend(bank, SimulatedLLM(), learn=True, policy="heuristic")
    q = front_question(front, CompassTrace(question="Melanie errand apples plumber garage", user="melanie"))
    candidates = front._candidates(q, ERRANDS)
    masked = {"errand0", "errand3"}
    counts = dict.fromkeys(ERRANDS, 0)
    front.agent.generator.manual_seed(7)
    draws = 3000
    for _ in range(draws):
        ids, record = front._slate(q, candidates, masked, 3, "neighbours", "hub")
        counts[ids[0]] += 1
    assert counts["errand0"] == counts["errand3"] == 0 and record.sampled
    scores = front.agent.learner("melanie").reranker.fast_scores(candidates.query_embedding[None],
                                                                 candidates.embeddings[None])[0]
    logits = (scores / front.agent.tau).masked_fill(torch.tensor([e in masked for e in ERRANDS]), float("-inf"))
    expected = torch.softmax(logits, 0)
    for i, e in enumerate(ERRANDS):
        assert abs(counts[e] / draws - float(expected[i])) < 0.035


def test_greedy_choices_are_not_learned_from(bank: MemoryBank) -> None:
    front = frontend(bank, story_llm(), learn=False)
    recorded = []
    front.agent.learner("melanie").record = lambda s, r: recorded.append(s)  # type: ignore[method-assign]
    response = front.respond("melanie", QUESTION)
    assert recorded == [] and response.selections == [] and not any(s.sampled for s in response.trace.slates)
    # learning: the story's start slate is sampled (more than start_k in the pool), its small neighbourhoods are not
    learning = frontend(bank, story_llm(), learn=True)
    got = learning.respond("melanie", QUESTION)
    assert [s.kind for s in got.trace.slates if s.sampled] == ["start"]
    assert learning.agent.learner("melanie").stats.records == 1


# -- the heuristic and oracle policies ----------------------------------------------------------------
def test_heuristic_policy_expands_best_first_while_the_score_clears_the_threshold(bank: MemoryBank) -> None:
    """The walk as first written (FIRST_WALK: the reranker's score alone, keep order); the walk score,
    look-ahead, seeds and diversified order are tests/test_compass_heuristic.py's."""
    llm = SimulatedLLM()
    front = frontend(bank, llm, policy="heuristic", threshold=0.25, answer=False, **FIRST_WALK)
    trace = front.respond("melanie", "Jen recital cello sonatas Melanie", remember=False).trace
    assert llm.usage.calls == 0 and trace.calls == []
    scores = front._scores(front_question(front, trace), [s.node for s in trace.steps])
    assert all(s.priority == pytest.approx(scores[s.node], abs=1e-5) for s in trace.steps)  # the reranker's score
    assert all((s.action == "EXPAND") == (s.priority >= 0.25) for s in trace.steps)
    assert trace.kept == [s.node for s in trace.steps if s.action == "EXPAND"] and "cello" in trace.kept
    starts = [s.priority for s in trace.steps if s.path_length == 1]
    assert len(starts) == len(trace.localizations[0].start) and starts == sorted(starts, reverse=True)  # best first
    assert any(s.path_length == 2 for s in trace.steps)  # and on through the graph
    assert frontend(bank, llm, policy="heuristic", threshold=0.25, node_budget=1, answer=False, **FIRST_WALK).respond(
        "melanie", "Jen recital cello sonatas Melanie").trace.stats()["kept_nodes"] == 1
    assert frontend(bank, llm, policy="heuristic", threshold=2.0, answer=False, **FIRST_WALK).respond(
        "melanie", "Jen recital cello sonatas Melanie").trace.kept == []


def test_oracle_policy_keeps_exactly_the_gold_nodes_it_reaches(bank: MemoryBank) -> None:
    front = frontend(bank, SimulatedLLM(), policy="oracle", answer=False)
    trace = front.respond("melanie", QUESTION, gold={"t:cello", "t:meet"}).trace
    assert sorted(trace.kept) == ["cello", "meet"] and trace.outcome == "satisfied"
    assert "cello" not in trace.localizations[0].slate.memory_ids  # reached through meet → recital → cello
    assert all((s.action != "SKIP") == (s.node in ("meet", "cello")) for s in trace.steps)
    with pytest.raises(CompassFrontendError, match="gold turn ids"):
        front.respond("melanie", QUESTION)


def test_the_llm_policy_refuses_the_simulated_llm_and_no_memories_is_answered(bank: MemoryBank) -> None:
    with pytest.raises(CompassFrontendError, match="simulated LLM cannot plan"):
        frontend(bank, SimulatedLLM())
    response = frontend(bank, story_llm(answer=["I don't know. [NO_CITE]"])).respond("nobody", QUESTION)
    assert response.trace.outcome == "no-memories" and response.shown == []


@pytest.mark.parametrize("bad", [dict(policy="greedy"), dict(pool=0), dict(start_k=60), dict(refinements=-1),
                                 dict(threshold=float("nan"))])
def test_config_is_checked(bad: dict) -> None:
    with pytest.raises(ValueError):
        CompassConfig(**bad)


# -- trace ----------------------------------------------------------------------------------------------
def test_trace_round_trips_renders_and_sums_up_as_table_4(bank: MemoryBank) -> None:
    trace = frontend(bank, story_llm(), learn=True).respond("melanie", QUESTION).trace
    data = json.loads(json.dumps(trace.to_json()))
    again = CompassTrace.from_json(data)
    assert again == trace and again.stats() == trace.stats()
    out = io.StringIO()
    Console(file=out, width=120).print(trace.render())
    text = out.getvalue()
    assert "localize" in text and "step 1" in text and "answer: The cello." in text and "reward" in text
    row = table4([trace, again])
    assert row["kept_nodes"] == 3 and row["refinement_rate"] == 0 and row["questions"] == 2
    assert row["action_expand"] + row["action_skip"] + row["action_answer"] == pytest.approx(1.0)


def test_registered_as_the_compass_controller(bank: MemoryBank) -> None:
    assert CONTROLLERS["compass"].config is CompassConfig and controller_name(CompassConfig()) == "compass"
    agent = Agent(bank, SimulatedLLM(), learn=False, checkpoint_every=0)
    assert isinstance(open_controller(agent, CompassConfig(policy="heuristic")), CompassFrontend)


# -- the commands ----------------------------------------------------------------------------------
@pytest.fixture
def commands(tmp_path, monkeypatch) -> list[ScriptedCompassLLM]:
    """`load_llm` gives the scripted story LLM (simulated for `simulated`), encoders are bags of words,
    benchmark banks live in a fresh cache."""
    import rmm.encoders
    import rmm.eval.benchmark_bank
    import rmm.llm

    made: list[ScriptedCompassLLM] = []

    def load_llm(spec: str, **options):
        if spec == "simulated":
            return SimulatedLLM()
        made.append(story_llm())
        return made[-1]

    monkeypatch.setattr(rmm.llm, "load_llm", load_llm)
    monkeypatch.setattr(rmm.encoders, "load_encoder", lambda name, **kw: BagOfWordsEncoder())
    monkeypatch.setattr(rmm.eval.benchmark_bank, "load_encoder", lambda name, **kw: BagOfWordsEncoder())
    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))
    return made


def test_eval_controller_runs_the_heuristic_search_on_the_built_event_graph(tiny_data_dir, tmp_path, capsys,
                                                                           commands) -> None:
    """Through the event-graph builder (`rmm.reflection.events`, its LLM-free fallback): no LLM call."""
    from rmm.cli import main

    out, traces = tmp_path / "compass.json", tmp_path / "traces.jsonl"
    assert main(["eval-controller", "--frontend", "compass", "--policy", "heuristic", "--threshold", "0.0",
                 "--data-dir", str(tiny_data_dir), "--llm", "simulated", "--category", "1", "--k", "4", "--m", "2",
                 "--start-k", "2", "--pool", "6", "--device", "cpu", "--json", str(out),
                 "--trace-json", str(traces)]) == 0
    printed = capsys.readouterr().out
    assert "CompassMem" in printed and "R@15t" in printed
    report = json.loads(out.read_text())
    assert report["frontend"] == "compass" and report["n"] > 0 and report["config"]["policy"] == "heuristic"
    assert report["llm_calls"] == 0 and report["config"]["start_k"] == 2 and "recall_compass" in report
    for row in report["rows"]:
        trace = CompassTrace.from_json(row["trace"])
        assert row["compass_ids"] == trace.retrieved and trace.calls == []
        assert trace.localizations[0].pool <= 6 and len(trace.localizations[0].slate.memory_ids) <= 2
    assert len(traces.read_text().splitlines()) == report["n"]


def test_eval_controller_oracle_keeps_only_gold_nodes(tiny_data_dir, tmp_path, commands) -> None:
    from rmm.cli import main

    out = tmp_path / "oracle.json"
    assert main(["eval-controller", "--frontend", "compass", "--policy", "oracle", "--data-dir", str(tiny_data_dir),
                 "--llm", "simulated", "--category", "1", "--device", "cpu", "--json", str(out)]) == 0
    for row in json.loads(out.read_text())["rows"]:
        trace = row["trace"]
        assert all(step["action"] != "SKIP" for step in trace["steps"] if step["node"] in trace["kept"])
        if trace["kept"]:
            assert row["recall_compass"] > 0


def test_chat_through_compass_prints_the_trace(tmp_path: Path, monkeypatch, capsys, commands) -> None:
    from fakes import drive

    from rmm.cli import main

    with MemoryBank(tmp_path / "bank", BagOfWordsEncoder(), device="cpu") as b:
        write_graph(b)
    drive(monkeypatch, [QUESTION, "/quit"])
    assert main(["chat", "--bank", str(tmp_path / "bank"), "--user", "melanie", "--llm", "hf:x", "--device", "cpu",
                 "--frontend", "compass", "--pool", "15", "-v"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "assistant> The cello." in out and "localize" in out and "policy llm" in out
    assert commands[0].kinds[0] == "plan" and commands[0].kinds[-1] == "answer"


def test_eval_qa_through_the_heuristic_search(tiny_data_dir, tmp_path, commands) -> None:
    from rmm.cli import main

    out = tmp_path / "qa.json"
    assert main(["eval-qa", "--frontend", "compass", "--policy", "heuristic", "--granularity", "event",
                 "--data-dir", str(tiny_data_dir), "--llm", "simulated", "--limit", "3", "--device", "cpu",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["frontend"] == "compass" and report["granularity"] == "event" and report["overall"]["n"] == 3
    assert all(row["trace"]["policy"] == "heuristic" for row in report["rows"])


def test_compass_options_reach_its_config_and_are_checked_at_parse_time(capsys) -> None:
    from rmm.cli import build_parser, main
    from rmm.cli.frontend_options import frontend_config, refuse_simulated

    parser = build_parser()
    args = parser.parse_args(["eval-controller", "--llm", "x", "--frontend", "compass", "--policy", "heuristic",
                              "--threshold", "-0.5", "--pool", "30", "--slate", "4", "--refinements", "0"])
    assert frontend_config(args) == CompassConfig(policy="heuristic", threshold=-0.5, pool=30, slate=4, refinements=0)
    walk = parser.parse_args(["eval-controller", "--llm", "x", "--frontend", "compass", "--policy", "heuristic",
                              "--seeds", "3", "--lookahead", "0", "--opener", "0.1", "--diversity", "off"])
    assert frontend_config(walk) == CompassConfig(policy="heuristic", seeds=3, lookahead=0.0, opener=0.1,
                                                  diversity=None)
    mmr = parser.parse_args(["eval-controller", "--llm", "x", "--frontend", "compass", "--diversity", "0.5"])
    assert frontend_config(mmr).diversity == 0.5 and frontend_config(args).diversity == CompassConfig().diversity
    refuse_simulated(args, SimulatedLLM())  # the heuristic needs no LLM
    llm_args = parser.parse_args(["eval-qa", "--llm", "x", "--frontend", "compass"])
    from rmm.errors import RmmError

    with pytest.raises(RmmError, match="cannot plan sub-goals"):
        refuse_simulated(llm_args, SimulatedLLM())
    with pytest.raises(RmmError, match="compass front end: cannot show start_k=9"):
        frontend_config(parser.parse_args(["eval-qa", "--llm", "x", "--frontend", "compass", "--pool", "5",
                                           "--start-k", "9"]))
    for argv, named in ((["eval-qa", "--policy", "heuristic"], "--policy is a CompassMem option"),
                        (["eval-controller", "--frontend", "compass", "--policy", "greedy"], "--policy"),
                        (["eval-controller", "--frontend", "compass", "--threshold", "nan"], "--threshold"),
                        (["eval-controller", "--frontend", "compass", "--diversity", "lots"], "--diversity"),
                        (["chat", "--bank", "b", "--user", "u", "--frontend", "memr3", "--slate", "3"],
                         "--slate is a CompassMem option")):
        with pytest.raises(SystemExit) as exited:
            main([*argv, "--llm", "x"])
        assert exited.value.code == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and named in errors[0]


def test_hybrid_first_stage_slates_are_learned_from(bank: MemoryBank) -> None:
    """Over BM25 + dense candidates with features, the sampled slates (pool: with lexical feature and
    candidate features; neighbours: without, counted as zeros) are recorded and updated from."""
    from rmm.memory.hybrid import HybridRetriever

    agent = Agent(bank, hub_llm(), first_stage=HybridRetriever(bank, candidate_features=True), k=8, m=3, learn=True,
                  learner_config=LearnerConfig(batch_size=2), checkpoint_every=0)
    front = CompassFrontend(agent, CompassConfig(pool=15, refinements=0))
    response = front.respond("melanie", "Which errands are on Melanie's weekly list?")
    kinds = [s.kind for s in response.trace.slates if s.sampled]
    assert kinds == ["start", "neighbours"] and response.selections[0].candidates.lexical is not None
    assert response.selections[1].candidates.lexical is None
    stats = agent.learner("melanie").stats
    assert stats.records == 2 and stats.step == 1 and stats.skipped_nonfinite == 0
