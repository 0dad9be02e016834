"""Semantic XPath's execution (rmm.memory.xpath_exec) and its scorers: the App. A worked example,
each operator and every documented choice, a literal App. A reference evaluator agreeing with the
vectorised one on random trees and queries (hypothesis), determinism, and the cosine, reranker and
entailment scorers."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from fakes import BagOfWordsEncoder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rmm.errors import ModelNotFoundError
from rmm.memory.store import MemoryStore
from rmm.memory.tree import NodeEdit, TreeNode
from rmm.memory.xpath_exec import Execution, ScorerError, TreeView, execute
from rmm.memory.xpath_scorers import CosineScorer, EntailmentScorer, calibrate, entailment_index
from rmm.memory.xpath_syntax import (
    Aggregate,
    AggregateFunction,
    Axis,
    Complement,
    Index,
    Local,
    Maximum,
    Mean,
    Minimum,
    Product,
    Query,
    QuerySyntaxError,
    Relevance,
    Slice,
    Step,
)
from rmm.types import Memory


class TableScorer:
    """Relevance from a table {(query, text): score}; anything else scores `default`. Counts calls."""

    name = "table"

    def __init__(self, table: dict[tuple[str, str], float] | None = None, default: float = 0.0) -> None:
        self.table = table or {}
        self.default = default
        self.calls: list[tuple[str, int]] = []

    def score(self, query: str, texts: Sequence[str], vectors: np.ndarray | None = None) -> np.ndarray:
        self.calls.append((query, len(texts)))
        return np.array([self.table.get((query, t), self.default) for t in texts])


class HashScorer:
    """A deterministic pseudo-relevance in [0, 1] of any (query, text), a few exact 0s and 1s included."""

    name = "hash"

    def score(self, query: str, texts: Sequence[str], vectors: np.ndarray | None = None) -> np.ndarray:
        return np.array([_hash_score(query, t) for t in texts])


def _hash_score(query: str, text: str) -> float:
    value = int(hashlib.md5(f"{query}\x00{text}".encode()).hexdigest(), 16) % 23
    return min(1.0, max(0.0, (value - 1) / 20))  # 0 (twice as likely), steps of 0.05, 1 (twice as likely)


def itinerary() -> list[TreeNode]:
    """App. A's ACL trip: Itinerary → Version → 3 Days → POIs (Day 2 has three conference POIs)."""
    pois = {1: ["breakfast", "keynote talk", "city walk"], 2: ["poster session", "lunch", "oral session"],
            3: ["workshop", "museum", "dinner"]}
    nodes = [TreeNode("it", "Itinerary", attributes={"title": "ACL trip"}),
             TreeNode("v1", "Version", "it", attributes={"note": "initial plan"})]
    for day, names in pois.items():
        nodes.append(TreeNode(f"d{day}", "Day", "v1", attributes={"date": f"day {day}"}))
        nodes += [TreeNode(f"d{day}p{j}", "POI", f"d{day}", attributes={"name": n}) for j, n in enumerate(names)]
    return nodes


CONFERENCE = {("conference", "name: poster session"): 0.603, ("conference", "name: lunch"): 0.482,
              ("conference", "name: oral session"): 0.608, ("conference", "name: keynote talk"): 0.7,
              ("conference", "name: breakfast"): 0.1, ("conference", "name: city walk"): 0.05,
              ("conference", "name: workshop"): 0.5, ("conference", "name: museum"): 0.02,
              ("conference", "name: dinner"): 0.03}


def test_app_a_worked_example_day_two_is_packed_with_conference_sessions() -> None:
    view = TreeView.build(itinerary())
    result = execute('//Day[avg(/POI[node~="conference"])]', view, TableScorer(CONFERENCE))
    ranked = result.ranked()
    assert [node.id for node, _ in ranked] == ["d2", "d1", "d3"]  # type: ignore[union-attr]
    weight = ranked[0][1]
    assert weight == pytest.approx((0.603 + 0.482 + 0.608) / 3)
    assert abs(weight - 0.565) < 1e-3  # the paper's 0.565, from its unrounded POI scores


def test_app_a_second_example_position_then_complement() -> None:
    view = TreeView.build(itinerary())
    scorer = TableScorer({("workshop", "name: workshop"): 0.9, ("workshop", "name: museum"): 0.2})
    result = execute('//Day[3]/POI[1-[node~"workshop"]]', view, scorer)
    assert [(n.id, round(w, 6)) for n, w in result.ranked()] == [("d3p2", 1.0), ("d3p1", 0.8), ("d3p0", 0.1)]  # type: ignore[union-attr]
    assert scorer.calls == [("workshop", 3)]  # only the third day's POIs were scored


def conversation_view() -> TreeView:
    """User → Sessions s1 (turns a, b, c), s2 (turns d, e), s3 (no turns)."""
    nodes = [TreeNode("u", "User"), TreeNode("s1", "Session", "u", attributes={"date": "may"}),
             TreeNode("s2", "Session", "u", attributes={"date": "june"}), TreeNode("s3", "Session", "u")]
    for session, turns in (("s1", "abc"), ("s2", "de")):
        nodes += [TreeNode(t, "Turn", session, attributes={"speaker": "Ana" if t in "ad" else "Bo", "said": t})
                  for t in turns]
    return TreeView.build(list(reversed(nodes)))  # any input order: the view puts it in tree order


def ids(result: Execution) -> list[str]:
    return [result.view.nodes[int(i)].id for i in result.indices]  # type: ignore[union-attr]


def test_axes_node_types_wildcard_and_the_empty_query() -> None:
    view, scorer = conversation_view(), TableScorer()
    assert ids(execute("/User/Session", view, scorer)) == ["s1", "s2", "s3"]
    assert ids(execute("//Turn", view, scorer)) == ["a", "b", "c", "d", "e"]
    assert ids(execute("/*/*", view, scorer)) == ["s1", "s2", "s3"]
    assert ids(execute("//Session//*", view, scorer)) == ["a", "b", "c", "d", "e"]
    assert ids(execute("/Session", view, scorer)) == [] and ids(execute("//Nope", view, scorer)) == []
    root = execute("", view, scorer)
    assert root.ranked() == [(None, 1.0)] and root.steps == ()
    assert [s.reached for s in execute("//Session/Turn", view, scorer).steps] == [9, 5]


@pytest.mark.parametrize(("query", "expected"), [
    ("//Turn[1]", ["a"]), ("//Turn[-1]", ["e"]), ("//Turn[2:3]", ["b", "c"]), ("//Turn[-2:-1]", ["d", "e"]),
    ("//Turn[2:-2]", ["b", "c", "d"]), ("//Turn[6]", []), ("//Turn[-6]", []), ("//Turn[4:9]", ["d", "e"]),
    ("//Turn[-9:2]", ["a", "b"]), ("//Turn[-1:1]", []), ("/User/Session[2]/Turn[1]", ["d"]),
    ("//Session/Turn[-1]", ["e"]),  # over the whole working set, not per parent
])
def test_positions_are_one_based_over_the_working_set_in_tree_order(query: str, expected: list[str]) -> None:
    assert ids(execute(query, conversation_view(), TableScorer())) == expected


def test_positions_inside_an_aggregate_count_per_node() -> None:
    scorer = TableScorer({("x", "speaker: Bo\nsaid: c"): 0.9, ("x", "speaker: Ana\nsaid: d"): 0.4})
    result = execute('//Session[max(/Turn[-1][node~"x"])]', conversation_view(), scorer)
    assert [(n.id, w) for n, w in result.ranked()] == [("s1", 0.9), ("s2", 0.0), ("s3", 0.0)]  # type: ignore[union-attr]


def turn_scores(**scores: float) -> TableScorer:
    table = {}
    for turn, score in scores.items():
        speaker = "Ana" if turn in "ad" else "Bo"
        table[("p", f"speaker: {speaker}\nsaid: {turn}")] = score
        table[("q", f"speaker: {speaker}\nsaid: {turn}")] = 1 - score / 2
    return TableScorer(table)


@pytest.mark.parametrize(("predicate", "expect"), [
    ('[node~"p"]', lambda p, q: p), ('[1-[node~"p"]]', lambda p, q: 1 - p),
    ('[[node~"p"]*[node~"q"]]', lambda p, q: p * q), ('[([node~"p"]+[node~"q"])/2]', lambda p, q: (p + q) / 2),
    ('[min([node~"p"],[node~"q"])]', lambda p, q: min(p, q)), ('[max([node~"p"],[node~"q"])]', lambda p, q: max(p, q)),
    ('[1-[node~"p"]*[node~"q"]]', lambda p, q: 1 - p * q),
])
def test_compositional_operators(predicate: str, expect) -> None:
    p = {"a": 0.2, "b": 0.9, "c": 0.0, "d": 1.0, "e": 0.5}
    result = execute(f"//Turn{predicate}", conversation_view(), turn_scores(**p))
    got = dict(zip(ids(result), result.weights))
    for turn, score in p.items():
        assert got[turn] == pytest.approx(expect(score, 1 - score / 2))


@pytest.mark.parametrize(("function", "s1", "s2"), [
    ("avg", (0.2 + 0.9 + 0.0) / 3, 0.75), ("min", 0.0, 0.5), ("max", 0.9, 1.0),
    ("gmean", 0.0, math.sqrt(0.5)),  # a zero makes gmean zero
])
def test_aggregates_and_an_empty_aggregate_is_zero(function: str, s1: float, s2: float) -> None:
    scorer = turn_scores(a=0.2, b=0.9, c=0.0, d=1.0, e=0.5)
    result = execute(f'/User/Session[{function}(/Turn[node~"p"])]', conversation_view(), scorer)
    got = {n.id: w for n, w in result.ranked()}  # type: ignore[union-attr]
    assert got == pytest.approx({"s1": s1, "s2": s2, "s3": 0.0})


def test_weights_multiply_along_the_steps_and_a_node_reached_twice_keeps_its_larger_weight() -> None:
    view = conversation_view()
    scorer = TableScorer({("w", ""): 0.2, ("w", "date: may"): 0.9, ("w", "date: june"): 0.5}, default=1.0)
    result = execute('//*[node~"w"]//Turn', view, scorer)  # u (0.2) and its session (0.9 / 0.5) both reach a turn
    assert dict(zip(ids(result), result.weights)) == pytest.approx({"a": 0.9, "b": 0.9, "c": 0.9, "d": 0.5, "e": 0.5})
    chained = execute('/User[node~"w"]/Session[node~"w"]', view, scorer)
    assert list(chained.weights) == pytest.approx([0.2 * 0.9, 0.2 * 0.5, 0.2 * 0.2])
    assert ids(execute('//Turn[node~"zzz"]', view, TableScorer())) == ["a", "b", "c", "d", "e"]  # weight 0 stays


def test_attribute_matches_and_a_missing_attribute_scores_zero() -> None:
    scorer = TableScorer({("Ana", "Ana"): 1.0, ("Ana", "Bo"): 0.1, ("may", "may"): 0.8})
    result = execute('//Turn[speaker~"Ana"]', conversation_view(), scorer)
    assert dict(zip(ids(result), result.weights)) == pytest.approx({"a": 1.0, "b": 0.1, "c": 0.1, "d": 1.0, "e": 0.1})
    sessions = execute('//Session[date~"may"]', conversation_view(), scorer)
    assert list(sessions.weights) == pytest.approx([0.8, 0.0, 0.0])  # s3 has no date


def test_a_repeated_local_match_is_scored_once_per_node() -> None:
    scorer = turn_scores(a=0.2, b=0.9, c=0.0, d=1.0, e=0.5)
    result = execute('//Session[max(/Turn[node~"p"])]/Turn[node~"p"]', conversation_view(), scorer)
    assert sum(n for _, n in scorer.calls) == 5
    assert [(n.id, w) for n, w in result.ranked(2)] == [("d", 1.0), ("b", pytest.approx(0.81))]  # type: ignore[union-attr]


def test_a_scorer_breaking_its_contract_is_an_error_and_scores_are_clipped() -> None:
    class Bad:
        name = "bad"

        def __init__(self, out) -> None:
            self.out = out

        def score(self, query, texts, vectors=None):
            return self.out(len(texts))

    view = conversation_view()
    with pytest.raises(ScorerError, match="NaN"):
        execute('//Turn[node~"x"]', view, Bad(lambda n: np.full(n, np.nan)))
    with pytest.raises(ScorerError, match="returned 1 scores for 5"):
        execute('//Turn[node~"x"]', view, Bad(lambda n: np.zeros(1)))
    assert set(execute('//Turn[node~"x"]', view, Bad(lambda n: np.full(n, 1.0000001))).weights) == {1.0}
    with pytest.raises(QuerySyntaxError):
        execute("//Turn[", view, TableScorer())


def test_memory_ids_of_the_best_nodes() -> None:
    nodes = [TreeNode("s", "Session", memory_id="ms"), TreeNode("t1", "Turn", "s", memory_id="m1", text="one"),
             TreeNode("t2", "Turn", "s", memory_id="m2", text="two"), TreeNode("t3", "Turn", "s", text=None)]
    scorer = TableScorer({("q", "one"): 0.3, ("q", "two"): 0.6})
    result = execute('//*[node~"q"]', TreeView.build(nodes), scorer)
    assert result.memory_ids() == ["m2", "m1", "ms"] and result.memory_ids(1) == ["m2"]


# -- scorers over a stored tree -------------------------------------------------------------------


def stored_tree(tmp_path: Path) -> MemoryStore:
    store = MemoryStore(tmp_path / "bank.sqlite")
    texts = {"t1": "we went hiking in the mountains", "t2": "my sister loves painting lighthouses",
             "t3": "hiking boots were expensive", "t4": "the puppy chewed the painting"}
    memories = [Memory(id=i, user_id="alice", kind="turn", text=t) for i, t in texts.items()]
    encoder = BagOfWordsEncoder()
    nodes = [TreeNode("s1", "Session", attributes={"topic": "mountains hiking"}),
             TreeNode("s2", "Session", attributes={"topic": "painting"}),
             TreeNode("n1", "Turn", "s1", memory_id="t1"), TreeNode("n2", "Turn", "s1", memory_id="t2"),
             TreeNode("n3", "Turn", "s2", memory_id="t3"), TreeNode("n4", "Turn", "s2", memory_id="t4")]
    store.add_nodes("alice", nodes, memories, embeddings=encoder.encode_passages(list(texts.values())))
    return store


class CountingEncoder(BagOfWordsEncoder):
    def __init__(self) -> None:
        self.passages: list[str] = []

    def encode_passages(self, texts: list[str]) -> torch.Tensor:
        self.passages += texts
        return self.encode_queries(texts)


def test_cosine_scorer_uses_the_stored_vectors_and_calibrates(tmp_path: Path) -> None:
    with stored_tree(tmp_path) as store:
        view = TreeView.from_store(store, "alice")
        encoder = CountingEncoder()
        scorer = CosineScorer(encoder)
        result = execute('//Turn[node~"hiking mountains"]', view, scorer)
        assert encoder.passages == []  # every turn has a stored embedding
        q = encoder.encode_queries(["hiking mountains"])[0].numpy()
        _, vectors = store.embeddings("alice")
        expected = np.clip(vectors.numpy() @ q, 0, 1)
        assert list(result.weights) == pytest.approx(list(expected), abs=1e-6)
        assert result.memory_ids(1) == ["t1"]
        execute('//Session[topic~"painting"]', view, scorer)  # attributes have no vector: encoded once
        execute('//Session[topic~"painting"]', view, scorer)
        assert encoder.passages == ["mountains hiking", "painting"]
    assert list(calibrate(np.array([-0.5, 0.25, 1.2]))) == [0.0, 0.25, 1.0]
    assert list(calibrate(np.array([-1.0, 0.0, 1.0]), "affine")) == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="calibration"):
        CosineScorer(BagOfWordsEncoder(), "sigmoid")  # type: ignore[arg-type]


def test_a_view_as_of_an_older_generation_scores_the_old_text(tmp_path: Path) -> None:
    with stored_tree(tmp_path) as store:
        before = store.generation("alice")
        encoder = BagOfWordsEncoder()
        store.update(Memory(id="t1", user_id="alice", kind="turn", text="a quiet day reading novels"),
                     encoder.encode_passages(["a quiet day reading novels"])[0])
        scorer = CosineScorer(encoder)
        now = execute('//Turn[node~"hiking mountains"]', TreeView.from_store(store, "alice"), scorer)
        then = execute('//Turn[node~"hiking mountains"]', TreeView.from_store(store, "alice", as_of=before), scorer)
        assert now.memory_ids(1) == ["t3"] and then.memory_ids(1) == ["t1"]
        assert then.view.has_vector.sum() == 3  # t1's vector is the new text's: the old text is encoded


def test_the_view_cache_rebuilds_when_the_user_generation_moves(tmp_path: Path) -> None:
    from rmm.memory.xpath_exec import ViewCache

    with stored_tree(tmp_path) as store:
        cache = ViewCache(store)
        first = cache.get("alice")
        assert cache.get("alice") is first
        store.edit_nodes("alice", [NodeEdit("s2", attributes={"topic": "dogs"})])
        second = cache.get("alice")
        assert second is not first and second.nodes[4].attributes == {"topic": "dogs"}  # type: ignore[union-attr]


def test_the_benchmark_runs_and_reports_the_budget(tmp_path: Path, capsys) -> None:
    from rmm.bench import xpath

    assert xpath.main(["--sessions", "3", "--turns", "4", "--dim", "8", "--repeats", "3", "--questions", "2",
                       "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "3 sessions x 4 turns (16 nodes)" in out and "budget" in out
    import json

    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert set(xpath.TEMPLATES) < set(rows) and all(r["median_ms"] > 0 for r in rows.values())


def test_reranker_scorer_untrained_equals_cosine_and_trained_keeps_the_reranker_order(tmp_path: Path) -> None:
    from rmm.policy.reranker import ResidualLinearReranker
    from rmm.policy.xpath_scorer import RerankerScorer

    encoder = BagOfWordsEncoder()
    reranker = ResidualLinearReranker(encoder.dim)
    with stored_tree(tmp_path) as store:
        view = TreeView.from_store(store, "alice")
        query = '//Turn[node~"painting hiking"]'
        cosine = execute(query, view, CosineScorer(encoder)).weights
        assert list(execute(query, view, RerankerScorer(reranker, encoder)).weights) == pytest.approx(list(cosine), abs=1e-6)
        torch.manual_seed(0)
        with torch.no_grad():
            reranker.W_q.weight.normal_(0, 0.3)
            reranker.W_m.weight.normal_(0, 0.3)
        scorer = RerankerScorer(reranker, encoder, calibration="affine")
        weights = execute(query, view, scorer).weights
        assert ((weights >= 0) & (weights <= 1)).all()
        _, vectors = store.embeddings("alice")
        raw = reranker.fast_scores(encoder.encode_queries(["painting hiking"]), vectors.unsqueeze(0))[0].numpy()
        assert list(np.argsort(-weights, kind="stable")) == list(np.argsort(-raw, kind="stable"))
    with pytest.raises(ValueError, match="dimension"):
        RerankerScorer(ResidualLinearReranker(8), encoder)


def tiny_nli(folder: Path, labels: dict[int, str]) -> Path:
    """A random-weight BERT sequence classifier with a small word-piece vocabulary: no download."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    words = "the a we went hiking in mountains my sister loves painting this text is about . conference poster".split()
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=5 + len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64, num_labels=len(labels),
                        id2label=labels, label2id={v: k for k, v in labels.items()})
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def test_entailment_scorer_is_the_entailment_probability(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = tiny_nli(tmp_path / "nli", {0: "CONTRADICTION", 1: "NEUTRAL", 2: "ENTAILMENT"})
    scorer = EntailmentScorer(folder, batch_size=2)
    texts = ["we went hiking in the mountains", "my sister loves painting", "we went hiking in the mountains"]
    scores = scorer.score("hiking", texts)
    model, tokenizer = AutoModelForSequenceClassification.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        inputs = tokenizer(texts, ["This text is about hiking."] * 3, padding=True, return_tensors="pt")
        expected = torch.softmax(model(**inputs).logits, -1)[:, 2].numpy()
    assert list(scores) == pytest.approx(list(expected), abs=1e-5) and scores[0] == scores[2]
    assert ((scores > 0) & (scores < 1)).all()
    nodes = [TreeNode("d", "Day"), TreeNode("p", "POI", "d", text=texts[0], memory_id="m")]
    assert execute('//POI[node~"hiking"]', TreeView.build(nodes), scorer).weights[0] == pytest.approx(scores[0])
    assert entailment_index({"0": "entailment", "1": "not_entailment"}) == 0
    with pytest.raises(ScorerError, match="entailment"):
        EntailmentScorer(tiny_nli(tmp_path / "sentiment", {0: "NEGATIVE", 1: "POSITIVE"}))
    with pytest.raises(ModelNotFoundError):
        EntailmentScorer(tmp_path / "missing")
    with pytest.raises(ValueError, match="hypothesis"):
        EntailmentScorer(folder, hypothesis="no slot")


# -- properties: a literal App. A evaluator, determinism, any string ---------------------------------

_TYPES = ["A", "B", "C"]


@st.composite
def trees(draw: st.DrawFn) -> list[TreeNode]:
    n = draw(st.integers(3, 16))
    nodes: list[TreeNode] = []
    for i in range(n):
        parent = draw(st.sampled_from([None, *(f"n{j}" for j in range(i)), *(f"n{j}" for j in range(max(0, i - 3), i))]))
        attributes = draw(st.dictionaries(st.sampled_from(["x", "y"]), st.sampled_from(["p", "q", "r"]), max_size=2))
        nodes.append(TreeNode(f"n{i}", draw(st.sampled_from(_TYPES)), parent, draw(st.integers(0, 3)), attributes))
    return nodes


_POSITIONS = st.one_of(st.none(), st.none(), st.none(), st.builds(Index, st.integers(-4, 4).filter(bool)),
                       st.tuples(st.integers(-4, 4).filter(bool), st.integers(-4, 4).filter(bool))
                       .filter(lambda p: not ((p[0] > 0) == (p[1] > 0) and p[0] > p[1])).map(lambda p: Slice(*p)))
_LOCALS = st.builds(Local, st.sampled_from([None, None, "x", "y"]), st.sampled_from(["p", "q", "r s"]))


def _steps(predicates: st.SearchStrategy) -> st.SearchStrategy[Step]:
    return st.builds(Step, st.sampled_from(list(Axis)), st.sampled_from([None, *_TYPES]), _POSITIONS, predicates)


def _extend(children: st.SearchStrategy[Relevance]) -> st.SearchStrategy[Relevance]:
    return st.one_of(st.builds(Complement, children),
                     *(st.builds(kind, children, children) for kind in (Product, Mean, Minimum, Maximum)),
                     st.builds(Aggregate, st.sampled_from(list(AggregateFunction)), _steps(children)))


_QUERIES = st.builds(Query, st.lists(_steps(st.one_of(st.recursive(_LOCALS, _extend, max_leaves=5), st.none())),
                                     min_size=1, max_size=3).map(tuple))


def reference(query: Query, nodes: list[TreeNode]) -> dict[str, float]:
    """App. A read literally, with dicts and Python sets (the root is ""): the oracle."""
    from rmm.memory.tree import tree_order

    ordered = tree_order(nodes)
    order = {"": -1, **{n.id: i for i, n in enumerate(ordered)}}
    by_id = {n.id: n for n in ordered}
    kids: dict[str, list[str]] = {"": []}
    for node in ordered:
        kids.setdefault(node.parent or "", []).append(node.id)

    def descendants(v: str) -> list[str]:
        out = []
        for c in kids.get(v, []):
            out += [c, *descendants(c)]
        return out

    def structural(step: Step, w: dict[str, float]) -> dict[str, float]:
        reached: dict[str, float] = {}
        for v, weight in w.items():
            for u in (kids.get(v, []) if step.axis is Axis.CHILD else descendants(v)):
                reached[u] = max(reached.get(u, -1.0), weight)
        kept = sorted((u for u in reached if step.node_type in (None, by_id[u].type)), key=order.__getitem__)
        if isinstance(step.position, Index):
            i = step.position.index
            kept = kept[i - 1 : i] if i > 0 else kept[len(kept) + i : len(kept) + i + 1] if -i <= len(kept) else []
        elif isinstance(step.position, Slice):
            n = len(kept)
            a = step.position.start - 1 if step.position.start > 0 else n + step.position.start
            b = step.position.stop if step.position.stop > 0 else n + step.position.stop + 1
            kept = kept[max(a, 0) : max(min(b, n), 0)] if max(a, 0) < min(b, n) else []
        return {u: reached[u] for u in kept}

    def rel(u: str, p: Relevance) -> float:
        if isinstance(p, Local):
            node = by_id[u]
            if p.attribute is None:
                return _hash_score(p.text, node.content)
            value = node.attributes.get(p.attribute)
            return 0.0 if value is None else _hash_score(p.text, value)
        if isinstance(p, Complement):
            return 1 - rel(u, p.operand)
        if isinstance(p, Product):
            return rel(u, p.left) * rel(u, p.right)
        if isinstance(p, Mean):
            return (rel(u, p.left) + rel(u, p.right)) / 2
        if isinstance(p, Minimum):
            return min(rel(u, p.left), rel(u, p.right))
        if isinstance(p, Maximum):
            return max(rel(u, p.left), rel(u, p.right))
        assert isinstance(p, Aggregate) and p.step.predicate is not None
        scores = [rel(x, p.step.predicate) for x in structural(p.step, {u: 1.0})]
        if not scores:
            return 0.0
        if p.function is AggregateFunction.AVG:
            return sum(scores) / len(scores)
        if p.function is AggregateFunction.MIN:
            return min(scores)
        if p.function is AggregateFunction.MAX:
            return max(scores)
        return 0.0 if min(scores) == 0 else math.exp(sum(math.log(s) for s in scores) / len(scores))

    w = {"": 1.0}
    for step in query.steps:
        w = structural(step, w)
        if step.predicate is not None:
            w = {u: weight * rel(u, step.predicate) for u, weight in w.items()}
    return w


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=trees(), query=_QUERIES)
def test_execution_agrees_with_a_literal_reading_of_app_a_and_is_deterministic(nodes: list[TreeNode], query: Query) -> None:
    view = TreeView.build(nodes)
    first = execute(query, view, HashScorer())
    again = execute(str(query), TreeView.build(list(reversed(nodes))), HashScorer())
    assert np.array_equal(first.indices, again.indices) and np.array_equal(first.weights, again.weights)
    assert first.ranked() == again.ranked()
    assert list(first.indices) == sorted(set(first.indices.tolist()))
    assert ((first.weights >= 0) & (first.weights <= 1)).all()
    got = {("" if view.nodes[int(i)] is None else view.nodes[int(i)].id): float(w)  # type: ignore[union-attr]
           for i, w in zip(first.indices, first.weights)}
    expected = reference(query, nodes)
    assert got.keys() == expected.keys()
    for key, weight in expected.items():
        assert got[key] == pytest.approx(weight, abs=1e-9), (str(query), key)


_ALPHABET = st.sampled_from(list("/*[]()~=:,+-−·12 0\"'\\") + ["node", "avg", "gmean", "A", "B", "x", '"p"'])


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.text(max_size=40), st.lists(_ALPHABET, max_size=30).map("".join)))
def test_any_string_executes_or_is_a_query_syntax_error(text: str) -> None:
    view = TreeView.build([TreeNode("a", "A", attributes={"x": "p"}), TreeNode("b", "B", "a"), TreeNode("c", "A", "b")])
    try:
        result = execute(text, view, HashScorer())
    except QuerySyntaxError as error:
        assert 1 <= error.column <= len(text) + 1
    else:
        assert ((result.weights >= 0) & (result.weights <= 1)).all()
        again = execute(text, view, HashScorer())
        assert np.array_equal(result.weights, again.weights) and np.array_equal(result.indices, again.indices)
