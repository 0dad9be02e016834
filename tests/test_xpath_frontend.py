"""Semantic XPath's builders (rmm.reflection.xpath_tree), its controller (rmm.frontends.xpath) with a
scripted LLM, and the reranker learning through it.

Builders on the tiny LoCoMo fixture: the native Conversation → Session → Turn tree (turn memories
reused, session vectors the mean of their turns'), a bank's User → Session → Topic → Turn tree kept
current by the reflector (adds, merges as versions, a failed tree write losing nothing). The
controller: a malformed query is retried once with the parser's message, a second failure (or a
query selecting nothing) runs the template; the XPath weight feature at weight 0 leaves the
reranker's order as it was; only sampled selections are learned from, with μ recorded as sampled.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_tiny_locomo
from fakes import BagOfWordsEncoder, ScriptedGoalLLM
from rich.console import Console

from rmm.cli.arguments import CheckedParser
from rmm.cli.frontend_options import add_frontend_options, frontend_config
from rmm.data.locomo import load_locomo
from rmm.errors import RmmError
from rmm.frontends.agent import Agent
from rmm.frontends.controllers import controller_name, open_controller
from rmm.frontends.xpath import (
    XPATH_FEATURE,
    XPathConfig,
    XPathFrontend,
    XPathFrontendError,
    best_memories,
    leaf_types,
    template_query,
    xpath_candidates,
)
from rmm.frontends.xpath_trace import XPathTrace
from rmm.llm.simulated import SimulatedLLM
from rmm.memory.bank import MemoryBank
from rmm.memory.tree import induce_schema
from rmm.memory.xpath_exec import TreeView, execute
from rmm.memory.xpath_scorers import CosineScorer
from rmm.policy.learner import Learner, LearnerConfig
from rmm.policy.reranker import ResidualLinearReranker
from rmm.policy.sampling import plackett_luce_logp
from rmm.prompts.parse import PromptParseError
from rmm.prompts.xpath_query import parse_query_reply
from rmm.reflection import ProspectiveReflector
from rmm.reflection.xpath_tree import BankTree, build_locomo_tree, session_node_id
from rmm.types import Dataset


class ScriptedXPathLLM(ScriptedGoalLLM):
    """Replies per call kind (query | answer); records every conversation it was sent."""

    def __init__(self, **script) -> None:
        super().__init__(**script)
        self.conversations: list[list[dict]] = []

    @staticmethod
    def kind(system: str) -> str:
        return "query" if system.startswith("You write one Semantic XPath query") else "answer"

    def _generate(self, batch, *, json_schema=None, max_tokens=512, temperature=0.0):
        self.conversations += [list(c) for c in batch]
        return super()._generate(batch, json_schema=json_schema, max_tokens=max_tokens, temperature=temperature)


@pytest.fixture
def dataset(tmp_path: Path) -> Dataset:
    return load_locomo(write_tiny_locomo(tmp_path / "locomo10.json"))


@pytest.fixture
def bank(tmp_path: Path, dataset: Dataset):
    with MemoryBank(tmp_path / "bank", BagOfWordsEncoder(), device="cpu") as b:
        build_locomo_tree(b, dataset.users[0], dataset.sessions[dataset.users[0]])
        yield b


def novel_question(dataset: Dataset):
    user = dataset.users[0]
    return next(q for q in dataset.questions if q.user_id == user and "novel" in q.text.lower())


def agent_over(bank: MemoryBank, llm, *, learn: bool = False, learner: Learner | None = None, m: int = 3) -> Agent:
    return Agent(bank, llm, k=10, m=m, learn=learn, learner=learner, checkpoint_every=0,
                 learner_config=LearnerConfig(batch_size=64))


# -- builders --------------------------------------------------------------------------------------
def test_locomo_tree_is_conversation_session_turn(bank: MemoryBank, dataset: Dataset) -> None:
    user = dataset.users[0]
    nodes = bank.store.tree(user)
    schema = induce_schema(nodes)
    n_turns = sum(len(s.turns) for s in dataset.sessions[user])
    assert dict(schema.types) == {"Conversation": 1, "Session": 2, "Turn": n_turns}
    assert schema.allows(None, "Conversation") and schema.allows("Conversation", "Session")
    assert schema.allows("Session", "Turn") and not schema.allows("Conversation", "Turn")
    turns = [n for n in nodes if n.type == "Turn"]
    assert [n.memory_id for n in turns] == [t.id for s in dataset.sessions[user] for t in s.turns]  # tree order
    first = dataset.sessions[user][0]
    session = next(n for n in nodes if n.id == session_node_id(first.id))
    assert session.attributes == {"session": first.id, "date": first.time}
    # the session's vector is the unit mean of its turns' vectors
    ids = [t.id for t in first.turns]
    mean = torch.nn.functional.normalize(bank.embeddings(user, ids).mean(0), dim=-1)
    assert torch.allclose(bank.embeddings(user, [session.memory_id])[0], mean, atol=1e-6)
    # a second build adds nothing
    before = bank.store.generation(user)
    assert build_locomo_tree(bank, user, dataset.sessions[user]).nodes_added == 0
    assert bank.store.generation(user) == before


def test_locomo_tree_reuses_a_turn_banks_memories(tmp_path: Path, dataset: Dataset) -> None:
    from rmm.eval.benchmark_bank import documents

    user = dataset.users[1]
    with MemoryBank(tmp_path / "turns", BagOfWordsEncoder(), device="cpu") as bank:
        turns = documents(dataset, user, "turn")
        bank.add(user, turns)
        report = build_locomo_tree(bank, user, dataset.sessions[user], session_memories=False)
        assert report.memories_added == 0 and report.nodes_added == 1 + 2 + len(turns)
        assert len(bank.memories(user)) == len(turns)
        assert all(n.memory_id is None for n in bank.store.tree(user) if n.type == "Session")
        # another shape of tree is refused rather than mixed in
        other = dataset.users[2]
        bank.add(other, documents(dataset, other, "turn"))
        BankTree(bank).sync(other)
        with pytest.raises(RmmError, match="another shape"):
            build_locomo_tree(bank, other, dataset.sessions[other])


def test_bank_tree_follows_prospective_reflection(tmp_path: Path, dataset: Dataset) -> None:
    user = dataset.users[1]
    with MemoryBank(tmp_path / "bank", BagOfWordsEncoder(), device="cpu") as bank:
        reflector = ProspectiveReflector(bank)
        tree = BankTree(bank)
        tree.attach(reflector)
        tree.attach(reflector)  # once only
        assert len(reflector.listeners) == 1
        first, second = dataset.sessions[user]
        touched = reflector.reflect(first)
        nodes = bank.store.tree(user)
        topics = [n for n in nodes if n.type == "Topic"]
        assert {n.memory_id for n in topics} == {m.id for m in touched}
        assert all(n.parent == session_node_id(first.id) for n in topics)
        refs = [n for n in nodes if n.type == "Turn"]
        assert {n.attributes["ref"] for n in refs} == {r for m in touched for r in m.refs}
        assert all(n.attributes["text"] for n in refs)
        assert reflector.reflect_many([second])  # the batched path notifies too
        assert {n.parent for n in bank.store.tree(user) if n.type == "Topic"} == {
            session_node_id(first.id), session_node_id(second.id)}
        # the same session again merges into existing topics: their nodes gain versions, no new Topic node
        n_topics = sum(n.type == "Topic" for n in bank.store.tree(user))
        merged = reflector.reflect(first)
        after = {n.memory_id: n for n in bank.store.tree(user) if n.type == "Topic"}
        assert sum(1 for _ in after) == n_topics
        changed = [m for m in merged if m.id in after and after[m.id].version > 1]
        assert changed, "a merge keeps the memory's node and versions it"
        history = bank.store.node_history(user, after[changed[0].id].id)
        assert history[-1].text == changed[0].text and history[0].text != history[-1].text
        assert tree.report.failures == 0


def test_a_failed_tree_write_loses_no_memory_and_sync_repairs_it(tmp_path: Path, dataset: Dataset,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    user = dataset.users[1]
    with MemoryBank(tmp_path / "bank", BagOfWordsEncoder(), device="cpu") as bank:
        reflector = ProspectiveReflector(bank)
        tree = BankTree(bank)
        tree.attach(reflector)

        def broken(*args, **kwargs):
            raise RmmError("disk full")

        monkeypatch.setattr(bank.store, "add_nodes", broken)
        touched = reflector.reflect(dataset.sessions[user][0])
        assert touched and tree.report.failures == 1 and "disk full" in tree.report.errors[0]
        assert {m.id for m in bank.memories(user)} == {m.id for m in touched}
        monkeypatch.undo()
        assert bank.store.tree(user) == []
        report = tree.sync(user)
        assert report.nodes_added > 0
        shown = {n.memory_id for n in bank.store.tree(user)}
        assert {m.id for m in touched} <= shown
        assert tree.sync(user).nodes_added == 0  # nothing left to place


# -- the query prompt's reader ------------------------------------------------------------------------
@pytest.mark.parametrize("reply, query", [
    ('Query: //Turn[node~"x"]', '//Turn[node~"x"]'),
    ('Sure!\n**Query:** `//Session[-1]/Turn[node~"x"]`', '//Session[-1]/Turn[node~"x"]'),
    ('```\n//Turn[node~"x"]\n```', '//Turn[node~"x"]'),
    ('Here it is:\n"//Turn[node~"x"]"', '//Turn[node~"x"]'),
    ('query: //Turn[node~"a"]\nQuery: //Turn[node~"b"]', '//Turn[node~"a"]'),
])
def test_the_reply_reader_takes_the_query_out(reply: str, query: str) -> None:
    assert parse_query_reply(reply) == query


@pytest.mark.parametrize("reply", ["", "I do not know.", "Query:", "Query: " + "/" * 3000])
def test_a_reply_without_a_query_is_a_parse_error(reply: str) -> None:
    with pytest.raises(PromptParseError):
        parse_query_reply(reply)


# -- the controller -------------------------------------------------------------------------------
def test_a_malformed_query_is_retried_with_the_parsers_message(bank: MemoryBank, dataset: Dataset) -> None:
    q = novel_question(dataset)
    llm = ScriptedXPathLLM(query=['Query: //Turn[node~"novel"', 'Query: //Turn[node~"reading a novel"]'],
                           answer=["They read it. [0]"])
    response = XPathFrontend(agent_over(bank, llm)).respond(q.user_id, q.text, remember=False)
    trace = response.trace
    assert [a.source for a in trace.attempts] == ["llm", "retry"]
    assert "column" in trace.attempts[0].error and trace.attempts[1].error is None
    retry = llm.conversations[1]
    assert retry[-2] == {"role": "assistant", "content": 'Query: //Turn[node~"novel"'}
    assert trace.attempts[0].error in retry[-1]["content"]
    assert trace.outcome == "queried" and trace.fallback == "retry"
    assert trace.query == '//Turn[node~"reading a novel"]'
    assert [s.step for s in trace.steps] == ['//Turn[node~"reading a novel"]']
    assert response.shown and response.cited == response.shown[:1]
    assert llm.kinds == ["query", "query", "answer"]
    # the prompt gave Σ with counts and example queries for this tree's own types
    first = llm.conversations[0][-1]["content"]
    assert "Session (2) [date, session] -> Turn (" in first and "//Session[max(/Turn[node~" in first


def test_two_malformed_queries_fall_back_to_the_template(bank: MemoryBank, dataset: Dataset) -> None:
    q = novel_question(dataset)
    llm = ScriptedXPathLLM(query=["I would look in the sessions.", "//Turn[node=novel]"], answer=["No idea. [NO_CITE]"])
    response = XPathFrontend(agent_over(bank, llm)).respond(q.user_id, q.text, remember=False)
    trace = response.trace
    assert [a.source for a in trace.attempts] == ["llm", "retry", "template"]
    assert "Query:" in trace.attempts[0].error and "column 12" in trace.attempts[1].error
    assert trace.outcome == "fallback" and trace.fallback == "template"
    assert trace.query == str(template_query(q.text, "Turn", "Session"))
    assert [s.step.split("[")[0] for s in trace.steps] == ["//Session", "/Turn"]
    assert trace.steps[0].kept == 2 and len(trace.candidates) == 10


def test_a_query_that_selects_nothing_falls_back_without_a_retry(bank: MemoryBank, dataset: Dataset) -> None:
    q = novel_question(dataset)
    llm = ScriptedXPathLLM(query=['Query: //Day[node~"novel"]'], answer=["x [0]"])
    trace = XPathFrontend(agent_over(bank, llm)).respond(q.user_id, q.text, remember=False).trace
    assert [(a.source, a.error) for a in trace.attempts] == [("llm", "the query selected no memory"), ("template", None)]
    assert llm.kinds == ["query", "answer"]


def test_the_template_policy_needs_no_llm(bank: MemoryBank, dataset: Dataset) -> None:
    q = novel_question(dataset)
    llm = SimulatedLLM()
    llm.oracle = lambda memories: [q.evidence_turns[0] in m.refs for m in memories]
    with pytest.raises(XPathFrontendError, match="cannot write queries"):
        XPathFrontend(agent_over(bank, llm))
    frontend = open_controller(agent_over(bank, llm), XPathConfig(query_policy="template"))
    response = frontend.respond(q.user_id, q.text, remember=False)
    assert response.trace.attempts[0].source == "template" and not llm.usage.calls - 1
    assert response.trace.stop_reason == "template query (policy template)"
    assert controller_name(XPathConfig()) == "xpath"


def test_a_user_without_memories_is_answered_without_a_query(bank: MemoryBank) -> None:
    llm = ScriptedXPathLLM(answer=["I don't know. [NO_CITE]"])
    response = XPathFrontend(agent_over(bank, llm)).respond("nobody", "What is my name?", remember=False)
    assert response.trace.outcome == "no-memories" and response.shown == [] and llm.kinds == ["answer"]


def test_the_trace_round_trips_and_renders(bank: MemoryBank, dataset: Dataset) -> None:
    q = novel_question(dataset)
    llm = ScriptedXPathLLM(query=['Query: //Session[max(/Turn[node~"novel"])]/Turn[node~"novel"]'], answer=["a [1]"])
    trace = XPathFrontend(agent_over(bank, llm)).respond(q.user_id, q.text, remember=False).trace
    again = XPathTrace.from_json(json.loads(json.dumps(trace.to_json())))
    assert again == trace
    console = Console(record=True, width=160)
    console.print(trace.render())
    text = console.export_text()
    assert "query attempts" in text and "reached" in text and trace.shown[0] in text


# -- the reranker learning through XPath --------------------------------------------------------------
def _execution(bank: MemoryBank, user: str, query):
    return execute(query, TreeView.from_store(bank.store, user), CosineScorer(bank.encoder))


def _candidates(bank: MemoryBank, user: str, execution, question: str, names: tuple[str, ...], k: int = 8):
    ids, _ = best_memories(execution, k)
    q = bank.encoder.encode_queries([question])[0]
    return xpath_candidates(execution, k, question, user, bank.embeddings(user, ids), q, names)


def test_the_xpath_feature_at_weight_zero_changes_no_order(bank: MemoryBank, dataset: Dataset) -> None:
    q = novel_question(dataset)
    user = q.user_id
    nodes = bank.store.tree(user)
    assert leaf_types(nodes) == ("Turn", "Session")
    featured = ResidualLinearReranker(bank.dim, feature_names=(XPATH_FEATURE,))
    plain = ResidualLinearReranker(bank.dim)
    # the leaves' own cosine: the tree's order, and the untrained reranker keeps it
    flat = _execution(bank, user, template_query(q.text, "Turn", None))
    cands = _candidates(bank, user, flat, q.text, featured.feature_names)
    assert cands.feature_names == (XPATH_FEATURE,) and torch.equal(cands.features[:, 0], cands.retriever_scores)
    (sel,) = featured.select([cands], 8)
    assert sel.chosen == list(range(8)) or torch.equal(  # ties may swap: then the weights tie too
        cands.retriever_scores[sel.chosen], cands.retriever_scores)
    # the template's (session × turn) order: weight 0 leaves the reranker's order exactly as without the feature
    tree = _execution(bank, user, template_query(q.text, "Turn", "Session"))
    cands = _candidates(bank, user, tree, q.text, featured.feature_names)
    assert featured.select([cands], 5)[0].chosen == plain.select([cands], 5)[0].chosen
    assert torch.allclose(featured.select([cands], 5)[0].scores, plain.select([cands], 5)[0].scores)
    # once learned, the weight moves the order toward the tree's
    with torch.no_grad():
        featured.feature_weight.fill_(100.0)
    featured.invalidate()
    (sel,) = featured.select([cands], 5)
    weights = cands.retriever_scores[sel.chosen]
    assert torch.all(weights[:-1] >= weights[1:])
    # a reranker weighing other features gets no column it could misread
    other = _candidates(bank, user, tree, q.text, ("bm25_rank", "dense_rank"))
    assert other.features is None


def test_rewards_reach_the_learner_only_for_sampled_selections(bank: MemoryBank, dataset: Dataset) -> None:
    q = novel_question(dataset)
    config = LearnerConfig(batch_size=64, tau=0.5)
    learner = Learner(ResidualLinearReranker(bank.dim, feature_names=(XPATH_FEATURE,)), config)
    llm = ScriptedXPathLLM(query=['Query: //Session[max(/Turn[node~"novel"])]/Turn[node~"novel"]'],
                           answer=["They read it. [0]"])
    agent = agent_over(bank, llm, learn=True, learner=learner, m=3)
    agent.tau = 0.5
    response = XPathFrontend(agent).respond(q.user_id, q.text, remember=False)
    (selection,) = response.selections
    assert selection.explore and selection.logp is not None and len(selection.chosen) == 3
    # μ as sampled: the Plackett–Luce log-probability of the picks under the scores it recorded
    expected = plackett_luce_logp(selection.scores.unsqueeze(0), torch.tensor([selection.chosen]), 0.5)[0]
    assert torch.allclose(selection.logp, expected, atol=1e-5)
    assert selection.candidates.feature_names == (XPATH_FEATURE,)
    assert learner.stats.records == 1 and response.trace.reward == [1.0, -1.0, -1.0] and response.trace.sampled
    # greedy (not learning): nothing recorded, no reward in the trace
    greedy = agent_over(bank, llm, learn=False, learner=learner)
    llm.script["answer"] = ["They read it. [0]"]
    response = XPathFrontend(greedy).respond(q.user_id, q.text, remember=False)
    assert not response.selections[0].explore and response.trace.reward is None
    assert learner.stats.records == 1 and learner.stats.skipped_greedy == 0


def test_the_reranker_scorer_reads_the_agents_reranker(bank: MemoryBank, dataset: Dataset) -> None:
    q = novel_question(dataset)
    llm = ScriptedXPathLLM(answer=["x [0]"])
    frontend = XPathFrontend(agent_over(bank, llm), XPathConfig(query_policy="template", scorer="reranker"))
    trace = frontend.respond(q.user_id, q.text, remember=False).trace
    cosine = XPathFrontend(agent_over(bank, llm), XPathConfig(query_policy="template"))
    other = cosine.respond(q.user_id, q.text, remember=False).trace
    assert trace.scorer == "reranker" and other.scorer == "cosine"
    # an untrained reranker scores exactly as the encoder's cosine
    assert [c[0] for c in trace.candidates] == [c[0] for c in other.candidates]
    assert np.allclose([c[1] for c in trace.candidates], [c[1] for c in other.candidates])


# -- command-line options --------------------------------------------------------------------------
def _args(*argv: str) -> argparse.Namespace:
    parser = CheckedParser()
    add_frontend_options(parser)
    return parser.parse_args(list(argv))


def test_the_command_line_options_configure_the_controller() -> None:
    config = frontend_config(_args("--frontend", "xpath", "--query-policy", "template", "--scorer", "reranker",
                                   "--leaves", "7"))
    assert config == XPathConfig(query_policy="template", scorer="reranker", leaves=7)
    with pytest.raises(SystemExit):
        _args("--frontend", "goal", "--leaves", "7")
    with pytest.raises(SystemExit):
        _args("--frontend", "xpath", "--scorer", "bm25")


# -- the recall benchmark (python -m rmm.bench.xpath_recall) on the tiny fixture ---------------------------
def test_the_recall_benchmark_scores_flat_and_template_rankings(dataset: Dataset) -> None:
    from rmm.bench.xpath_recall import HEADLINE_NAME, measure, templates
    from rmm.eval.metrics import recall_at_k

    encoder = BagOfWordsEncoder()
    users = dataset.users[:2]
    untrained = ResidualLinearReranker(encoder.dim)
    measured = measure(dataset, users, encoder, reranker=untrained, ks=(1, 3), depth=4)
    # flat: each question's recall of its turns ranked by cosine, computed here independently
    expected = []
    for user in users:
        turns = [t for s in dataset.sessions[user] for t in s.turns]
        vectors = torch.nn.functional.normalize(encoder.encode_passages([f"{t.speaker}: {t.text}" for t in turns]), dim=-1)
        for q in dataset.questions:
            if q.user_id == user and q.evidence_turns and q.category in (1, 2, 3, 4):
                order = torch.argsort(-(vectors @ torch.nn.functional.normalize(encoder.encode_queries([q.text])[0], dim=-1)),
                                      stable=True)
                expected.append(recall_at_k([[turns[i].id] for i in order.tolist()], q.evidence_turns, 3))
    assert measured.recalls[("flat turns · cosine", HEADLINE_NAME)][3] == pytest.approx(expected)
    # an untrained reranker is the cosine: its rows equal the cosine rows
    for k in (1, 3):
        assert measured.mean("flat turns · reranker (whole bank)", HEADLINE_NAME, k) == pytest.approx(
            measured.mean("flat turns · cosine", HEADLINE_NAME, k))
        for name in templates("q"):
            assert measured.mean(f"{name} · reranker", HEADLINE_NAME, k) == pytest.approx(
                measured.mean(f"{name} · cosine", HEADLINE_NAME, k))
    assert set(measured.seconds) == {f"{name} · {s}" for name in templates("q") for s in ("cosine", "reranker")}
    assert all(len(v) == len(expected) + sum(q.category == 5 for q in dataset.questions if q.user_id in users)
               for v in measured.seconds.values())


def test_the_recall_benchmark_counts_how_an_llm_wrote_its_queries(dataset: Dataset) -> None:
    from rmm.bench.xpath_recall import llm_queries

    llm = ScriptedXPathLLM(query=["nonsense", 'Query: //Turn[node~"novel"]', 'Query: //Turn[node~"trip"]',
                                  'Query: //Nope[node~"x"]'])
    writing = llm_queries(dataset, dataset.users[:1], BagOfWordsEncoder(), llm, limit=3, ks=(5,))
    assert (writing.questions, writing.first, writing.retried, writing.fallback) == (3, 1, 1, 1)
    assert llm.kinds == ["query"] * 4  # no answer calls: the query step only
    assert "Query:" in writing.errors[0] and writing.errors[1] == "the query selected no memory"
    assert len(writing.ran[5]) == len(writing.template[5]) == 3
    assert writing.ran[5][2] == writing.template[5][2]  # the fallback ran the template itself
