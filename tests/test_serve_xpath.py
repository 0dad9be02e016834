"""Semantic XPath over HTTP (issue 30 item 7): the user's tree written and read, Σ for a client's LLM,
queries whose best leaves become a sampled, logged slate the user's reranker learns from through
`/v1/feedback`, parse errors in the error contract with their position, the tree in a user's export
and back, and the embedded API's same verbs; on both stores."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fakes import BagOfWordsEncoder, loopback_server
from fastapi.testclient import TestClient
from plackett_luce_helpers import naive_pl_logp
from test_serve_hardening import ALPHA, A, assert_error, cite_first_shown, make_app, store  # noqa: F401 - both stores

import rmm.serve.client as client_module
from rmm.data.jsonl import JsonlDataError, read_jsonl, write_jsonl
from rmm.embedded import AsyncMemory, Memory
from rmm.frontends.xpath import XPATH_FEATURE
from rmm.memory.tree import NodeEdit, TreeNode
from rmm.memory.xpath_exec import TreeView
from rmm.memory.xpath_syntax import QuerySyntaxError
from rmm.serve.app import create_app
from rmm.serve.client import AsyncRmmClient, RmmClient, RmmServerError
from rmm.serve.config import load_config
from rmm.serve.export import export_user, import_user
from rmm.serve.scoping import scoped
from rmm.serve.service import RetrievalService

ANA = scoped("alpha", "ana")
TURNS = {  # memory id -> (session, text)
    "t0": ("s1", "Ana flew to Lisbon for the summer trip"),
    "t1": ("s1", "Ana packed sunscreen and hiking boots for the trip"),
    "t2": ("s1", "Ana bought sourdough bread at the bakery"),
    "t3": ("s2", "Ana's golden retriever puppy learned to sit"),
    "t4": ("s2", "The puppy chewed a hiking boot"),
    "t5": ("s3", "Ana planned a train trip to Porto"),
}
QUERY = '//Session[max(/Turn[node~"summer trip"])]/Turn[node~"summer trip"]'


def service_of(client: TestClient) -> RetrievalService:
    return client.app.state.service  # type: ignore[attr-defined]


@pytest.fixture
def client(tmp_path: Path, store: str | None) -> Iterator[TestClient]:  # noqa: F811
    with TestClient(make_app(tmp_path, store, learner={"batch_size": 1}), raise_server_exceptions=False) as c:
        yield c


def tree_nodes() -> list[dict[str, Any]]:
    sessions = [{"id": s, "type": "Session", "attributes": {"date": f"2024-0{n + 5}-01"}}
                for n, s in enumerate(("s1", "s2", "s3"))]
    turns = [{"id": f"{session}/{memory_id}", "type": "Turn", "parent": session, "memory_id": memory_id,
              "attributes": {"speaker": "Ana"}} for memory_id, (session, _) in TURNS.items()]
    return turns[::-1] + sessions  # a parent may come after its children in one request


def build(client: TestClient, user: str = "ana") -> None:
    memories = [{"id": i, "text": text} for i, (_, text) in TURNS.items()]
    assert client.post(f"/v1/users/{user}/memories", json={"memories": memories}, headers=A).status_code == 201
    response = client.post(f"/v1/users/{user}/tree/nodes", json={"nodes": tree_nodes()}, headers=A)
    assert response.status_code == 201, response.text
    assert response.json()["node_ids"][-1] == "s3"


def xpath(client: TestClient, user: str = "ana", **body: Any):
    return client.post(f"/v1/users/{user}/xpath", json={"query": QUERY, **body}, headers=A)


# ---- Σ ------------------------------------------------------------------------------------------
def test_the_schema_is_read_from_the_stored_tree(client: TestClient) -> None:
    assert_error(client.get("/v1/users/ana/schema", headers=A), 404, code="unknown_user")
    assert client.post("/v1/users/bo/memories", json={"memories": [{"text": "Bo grows tomatoes"}]},
                       headers=A).status_code == 201
    empty = client.get("/v1/users/bo/schema", headers=A).json()  # a user without a tree: an empty Σ
    assert (empty["nodes"], empty["types"], empty["roots"]) == (0, {}, {})
    build(client)
    sigma = client.get("/v1/users/ana/schema", headers=A).json()
    assert sigma["user"] == "ana" and sigma["nodes"] == 9 and sigma["roots"] == {"Session": 3}
    assert sigma["types"] == {"Session": {"count": 3, "attributes": ["date"], "children": {"Turn": 6}},
                              "Turn": {"count": 6, "attributes": ["speaker"], "children": {}}}
    assert sigma["text"].splitlines() == ["(root) -> Session (3)", "Session (3) [date] -> Turn (6)",
                                          "Turn (6) [speaker]"]
    assert sigma["generation"] == service_of(client).bank.store.generation(ANA)


# ---- queries ------------------------------------------------------------------------------------
def test_query_results_are_deterministic_and_the_view_is_built_once_per_generation(client: TestClient,
                                                                                   monkeypatch) -> None:
    build(client)
    built: list[str] = []
    original = TreeView.from_store.__func__  # type: ignore[attr-defined]

    def counting(cls, store, user, as_of=None):  # noqa: ANN001
        built.append(user)
        return original(cls, store, user, as_of)

    monkeypatch.setattr(TreeView, "from_store", classmethod(counting))
    first = xpath(client, k=4, m=2, explore=False)
    assert first.status_code == 200, first.text
    answers = [xpath(client, k=4, m=2, explore=False).json() for _ in range(3)]
    assert built == [ANA]  # repeated queries reuse the user's view
    body = first.json()
    for again in answers:
        for field in ("nodes", "steps", "memories", "query", "question", "generation"):
            assert again[field] == body[field], field
    assert body["query"] == QUERY and body["question"] == "summer trip" and body["scorer"] == "cosine"
    assert [n["id"] for n in body["nodes"]][:1] == ["s1/t0"] and len(body["nodes"]) == 4
    weights = [n["weight"] for n in body["nodes"]]
    assert weights == sorted(weights, reverse=True) and all(0 <= w <= 1 for w in weights)
    first_step, second_step = body["steps"]
    assert first_step["step"] == '//Session[max(/Turn[node~"summer trip"])]' and first_step["reached"] == 9
    assert first_step["kept"] == 3 and first_step["top"][0]["id"] == "s1"
    assert second_step["reached"] == 6 and second_step["kept"] == 6
    assert not body["explore"] and body["candidates"] == 4 and len(body["memories"]) == 2
    shown = body["memories"]
    assert [m["score"] for m in shown] == sorted((m["score"] for m in shown), reverse=True)  # greedy: best first
    by_memory = {n["memory_id"]: n["weight"] for n in body["nodes"]}
    assert all(m["retriever_score"] == pytest.approx(by_memory[m["id"]], abs=1e-6) for m in shown)
    # a write moves the generation: the next query rebuilds the view, and reads the edit
    edit = client.patch("/v1/users/ana/tree/nodes", json={"edits": [{"id": "s1/t0", "parent": "s3"}]}, headers=A)
    assert edit.status_code == 200 and edit.json()["generation"] > body["generation"]
    moved = xpath(client, k=4, m=2, explore=False).json()
    assert built == [ANA, ANA] and moved["generation"] == edit.json()["generation"]
    assert next(n for n in moved["nodes"] if n["id"] == "s1/t0")["parent"] == "s3"
    # the reranker scorer: an untrained reranker scores exactly as the encoder's cosine
    reranked = xpath(client, k=4, m=2, explore=False, scorer="reranker").json()
    assert reranked["scorer"] == "reranker"
    assert [(n["id"], round(n["weight"], 6)) for n in reranked["nodes"]] == \
           [(n["id"], round(n["weight"], 6)) for n in moved["nodes"]]


def test_feedback_on_an_xpath_selection_trains_the_learner_as_sampled(client: TestClient) -> None:
    build(client)
    service = service_of(client)
    learner = service.learner("alpha")
    step, version = learner.stats.step, learner.reranker.version
    seen: set[tuple[str, ...]] = set()
    for _ in range(8):
        slate = xpath(client, k=5, m=2, explore=True).json()
        seen.add(tuple(m["id"] for m in slate["memories"]))
    assert len(seen) >= 2  # sampled, not always the same top-2
    slate = xpath(client, k=5, m=2, explore=True).json()
    assert slate["explore"] and slate["selection_id"] and slate["candidates"] == 5
    pending = cite_first_shown(client, slate["selection_id"], step)
    # stored as sampled: the best 5 leaves (their XPath weights, best first), μ of each pick; the
    # server's reranker weighs the hybrid candidate features, not `xpath_weight`: none are carried
    assert pending.explore and pending.version == version and pending.query == "summer trip"
    assert learner.reranker.feature_names and XPATH_FEATURE not in learner.reranker.feature_names
    assert pending.features is None and pending.feature_names == ()
    assert pending.memory_ids[0] == "t0" and len(pending.memory_ids) == 5
    expected = naive_pl_logp(pending.scores, torch.as_tensor(pending.chosen), pending.tau)  # pick by pick
    assert torch.allclose(pending.logp, expected, atol=1e-5)
    assert [pending.memory_ids[i] for i in pending.chosen] == [m["id"] for m in slate["memories"]]
    assert_error(client.post("/v1/feedback", json={"selection_id": slate["selection_id"], "cited": [0]}, headers=A),
                 409, code="selection_used")
    greedy = xpath(client, k=5, m=2, explore=False).json()  # stored, not learned
    unlearned = client.post("/v1/feedback", json={"selection_id": greedy["selection_id"], "no_cite": True},
                            headers=A).json()
    assert not greedy["explore"] and not unlearned["learned"] and "explore=false" in unlearned["reason"]


def test_a_reranker_without_features_gets_the_xpath_weight_as_one(tmp_path: Path) -> None:
    """As the `xpath` controller: a reranker weighing no candidate features keeps the XPath weight
    as the candidates' `xpath_weight` column in the logged selection (it ignores it when scoring)."""
    with TestClient(make_app(tmp_path, None, candidate_features=False)) as c:
        build(c)
        assert service_of(c).learner("alpha").reranker.feature_names == ()
        slate = xpath(c, k=5, m=2, explore=True).json()
        pending = service_of(c).selections.claim("alpha", slate["selection_id"], lambda _: {})
    assert pending.feature_names == (XPATH_FEATURE,) and pending.features is not None
    weights = {n["memory_id"]: n["weight"] for n in slate["nodes"]}
    assert pending.features[:, 0].tolist() == pytest.approx([weights[i] for i in pending.memory_ids], abs=1e-6)
    assert pending.features[:, 0].tolist() == sorted(pending.features[:, 0].tolist(), reverse=True)


def test_a_query_without_soft_matches_needs_a_question_for_its_slate(client: TestClient) -> None:
    build(client)
    positional = client.post("/v1/users/ana/xpath", json={"query": "//Turn[-2:-1]"}, headers=A).json()
    assert [n["id"] for n in positional["nodes"]] == ["s2/t3", "s3/t5"]  # tree order (t4 was placed first), weight 1
    assert positional["selection_id"] is None and "question" in positional["reason"]
    asked = client.post("/v1/users/ana/xpath", headers=A, json={
        "query": "//Turn[-2:-1]", "question": "Porto train", "m": 1, "explore": False}).json()
    assert asked["question"] == "Porto train" and [m["id"] for m in asked["memories"]] == ["t5"]
    none = client.post("/v1/users/ana/xpath", json={"query": "//Event"}, headers=A).json()
    assert none["nodes"] == [] and none["selection_id"] is None and "no memory" in none["reason"]


# ---- errors -------------------------------------------------------------------------------------
def test_a_parse_error_is_a_422_with_its_position(client: TestClient) -> None:
    build(client)
    bad = '//Session[max(/Turn[node~"trip"])]/Turn[node~'
    body = assert_error(xpath(client, query=bad), 422, code="query_syntax")
    assert set(body) == {"detail", "code", "errors"} and body["detail"].startswith("column 46: expected")
    (where,) = body["errors"]
    with pytest.raises(QuerySyntaxError) as parsed:
        from rmm.memory.xpath_syntax import parse

        parse(bad)
    assert where == {"loc": ["query"], "msg": str(parsed.value), "type": "query_syntax", "offset": 45,
                     "column": 46, "expected": parsed.value.expected, "found": "end of query"}
    assert "quoted string" in where["expected"]
    for query in ("Session", "//Turn[0]", "//Turn[node~\"x\"", "//Turn[[node~\"a\"]*1-[node~\"b\"]]", "/" * 5):
        detail = assert_error(xpath(client, query=query), 422, code="query_syntax")
        assert detail["errors"][0]["column"] >= 1
    assert_error(xpath(client, user="nobody"), 404, code="unknown_user")
    assert_error(xpath(client, user="nobody", query="((("), 422, code="query_syntax")  # the query, before the user
    for refused in ({"query": "   "}, {"k": 0}, {"k": 10_000}, {"m": 5, "k": 2}, {"scorer": "bm25"},
                    {"question": "\u200b"}, {"query": "//Turn[node~\"a\u0000\"]"}, {"explore": "yes"}, {"x": 1}):
        assert_error(xpath(client, **refused), 422)


def test_tree_writes_are_checked_and_all_or_nothing(client: TestClient) -> None:
    def post(nodes: list[dict[str, Any]], user: str = "ana"):
        return client.post(f"/v1/users/{user}/tree/nodes", json={"nodes": nodes}, headers=A)

    assert_error(post([{"id": "s", "type": "Session"}], user="nobody"), 404, code="unknown_user")
    build(client)
    before = client.get("/v1/users/ana/tree", headers=A).json()
    missing = assert_error(post([{"id": "x", "type": "Turn", "parent": "nope"}]), 404, code="unknown_node")
    assert ANA not in missing["detail"] and "nope" in missing["detail"]
    assert_error(post([{"id": "x", "type": "Turn", "memory_id": "nope"}]), 404, code="unknown_memory")
    assert "already in the tree" in assert_error(post([{"id": "s1", "type": "Session"}]), 422)["detail"]
    for bad in ({"id": "x", "type": "9lives"}, {"id": "x", "type": "Turn", "attributes": {"node": "a"}},
                {"id": "x", "type": "Turn", "attributes": {"bad name": "a"}},
                {"id": "x", "type": "Turn", "parent": "x"},
                {"id": "a\u0000b", "type": "Turn"}, {"id": "x", "type": "Turn", "attributes": {"speaker": "a\u0000"}},
                {"id": "x", "type": "Turn", "position": -1}, {"id": "x", "type": "Turn", "position": 2**31},
                {"id": "x" * 300, "type": "Turn"}, {"id": "x", "type": "Turn", "colour": "red"},
                {"id": "x", "type": "Turn", "attributes": {"speaker": 3}}):
        assert_error(post([{"id": "ok", "type": "Session"}, bad]), 422)
    assert_error(client.post("/v1/users/ana/tree/nodes", json={"nodes": []}, headers=A), 422)
    assert client.get("/v1/users/ana/tree", headers=A).json()["nodes"] == before["nodes"]  # nothing was written
    # an edit is the node's next version; the old tree stays readable as of its generation
    edit = {"id": "s2/t4", "parent": "s1", "attributes": {"speaker": "Bo"}}
    changed = client.patch("/v1/users/ana/tree/nodes", json={"edits": [edit]}, headers=A)
    assert changed.status_code == 200, changed.text
    latest = {n["id"]: n for n in client.get("/v1/users/ana/tree", headers=A).json()["nodes"]}
    assert (latest["s2/t4"]["parent"], latest["s2/t4"]["version"], latest["s2/t4"]["attributes"]) == \
           ("s1", 2, {"speaker": "Bo"})
    old = client.get(f"/v1/users/ana/tree?as_of={before['generation']}", headers=A).json()
    assert old["nodes"] == before["nodes"] and old["as_of"] == before["generation"]
    for refused in ({"id": "s2/t4"}, {"id": "nope", "parent": None}, {"id": "s1", "parent": "s2/t4"}):
        assert_error(client.patch("/v1/users/ana/tree/nodes", json={"edits": [refused]}, headers=A),
                     404 if refused["id"] == "nope" else 422)
    detached = client.patch("/v1/users/ana/tree/nodes", json={"edits": [{"id": "s2/t4", "memory_id": None}]},
                            headers=A)
    assert detached.status_code == 200
    nodes = {n["id"]: n for n in client.get("/v1/users/ana/tree", headers=A).json()["nodes"]}
    assert nodes["s2/t4"]["memory_id"] is None
    removed = client.delete("/v1/users/ana/tree/nodes/s1", headers=A)
    assert removed.status_code == 200 and removed.json()["node_id"] == "s1"
    left = {n["id"] for n in client.get("/v1/users/ana/tree", headers=A).json()["nodes"]}
    assert left == {"s2", "s2/t3", "s3", "s3/t5"}
    assert_error(client.delete("/v1/users/ana/tree/nodes/s1", headers=A), 404, code="unknown_node")
    assert len(client.get("/v1/users/ana/memories", headers=A).json()["memories"]) == 6  # memories stay
    assert_error(client.get("/v1/users/ana/tree?as_of=-1", headers=A), 422)


# ---- the bank's tree kept current by reflection ------------------------------------------------------
def test_with_reflection_tree_each_job_keeps_the_users_bank_tree_current(tmp_path: Path,
                                                                         store: str | None) -> None:  # noqa: F811
    from test_serve_events import SESSION, wait_jobs

    with TestClient(make_app(tmp_path, store, reflection_tree=True, reflection_events=True)) as c:
        body = {"session_id": "ana-s1", "time": "2024-06-01", "store_turns": True,
                "turns": [{"speaker": s, "text": t} for s, t in SESSION]}
        job = c.post("/v1/users/ana/sessions", json=body, headers=A).json()
        reflect, events = wait_jobs(c, job["job_id"], job["events_job_id"])
        assert reflect["status"] == "done" and reflect["result"]["tree"]["failures"] == 0
        assert reflect["result"]["tree"]["nodes_added"] > 0 and events["result"]["tree"]["nodes_added"] > 0
        sigma = c.get("/v1/users/ana/schema", headers=A).json()
        assert sigma["roots"] == {"User": 1} and {"Session", "Turn", "Event"} <= set(sigma["types"])
        shown = {n["memory_id"] for n in c.get("/v1/users/ana/tree", headers=A).json()["nodes"]}
        stored = {m["id"] for m in c.get("/v1/users/ana/memories", headers=A).json()["memories"]}
        assert stored <= shown  # every memory (topics, the stored turns, the events) has its node
        hit = c.post("/v1/users/ana/xpath", json={"query": '//Session/*[node~"puppy obedience"]', "m": 1,
                                                  "explore": False}, headers=A).json()
        assert hit["selection_id"] and "puppy" in hit["memories"][0]["text"].lower()


# ---- export and import ----------------------------------------------------------------------------
def test_export_then_import_keeps_the_tree(client: TestClient, tmp_path: Path) -> None:
    build(client)
    assert client.patch("/v1/users/ana/tree/nodes", json={"edits": [{"id": "s2/t4", "parent": "s1", "position": 7}]},
                        headers=A).status_code == 200
    service = service_of(client)
    manifest = export_user(service, "alpha", "ana", tmp_path / "out")
    assert (manifest["counts"]["tree_nodes"], manifest["counts"]["tree_versions"]) == (9, 10)
    records = [json.loads(line) for line in (tmp_path / "out" / "data.jsonl").read_text().splitlines()]
    versions = [r for r in records if r["type"] == "node" and r["id"] == "s2/t4"]
    assert [(r["version"], r["parent"], r["position"]) for r in versions] == [(1, "s2", 0), (2, "s1", 7)]
    assert versions[0]["text"] == TURNS["t4"][1] and versions[0]["memory"] == "t4"
    original = [(n.id, n.type, n.parent, n.position, dict(n.attributes), n.memory_id)
                for n in service.bank.store.tree(ANA)]
    before = xpath(client, k=9, m=2, explore=False).json()
    with TestClient(make_app(tmp_path / "elsewhere", None)) as other:
        restored = import_user(service_of(other), "alpha", tmp_path / "out", user="ana2")
        assert restored["tree_nodes"] == 9 and restored["memories"] == 6
        copy = service_of(other).bank.store.tree(scoped("alpha", "ana2"))
        assert [(n.id, n.type, n.parent, n.position, dict(n.attributes), n.memory_id) for n in copy] == original
        after = other.post("/v1/users/ana2/xpath", json={"query": QUERY, "k": 9, "m": 2, "explore": False},
                           headers=A).json()
        assert [(n["id"], n["weight"]) for n in after["nodes"]] == [(n["id"], n["weight"]) for n in before["nodes"]]
        assert after["memories"] == before["memories"]
        # a dataset import of the same file adds the tree once: a rerun adds nothing
        from rmm.serve.importer import plan_import, run_import

        content = read_jsonl(tmp_path / "out" / "data.jsonl")
        for expected in (9, 0):
            report = run_import(service_of(other), "alpha", plan_import(service_of(other), "alpha", content))
            assert report.tree_nodes == expected
        assert len(service_of(other).bank.store.tree(scoped("alpha", "ana"))) == 9


def test_the_dataset_format_refuses_tree_records_it_cannot_store(tmp_path: Path) -> None:
    base = [{"type": "user", "id": "ana"}, {"type": "memory", "id": "m1", "user": "ana", "kind": "turn", "text": "x"},
            {"type": "node", "id": "s", "user": "ana", "node_type": "Session"},
            {"type": "node", "id": "t", "user": "ana", "node_type": "Turn", "parent": "s", "memory": "m1"}]
    write_jsonl(base, tmp_path / "good.jsonl")
    assert [n["id"] for n in read_jsonl(tmp_path / "good.jsonl").nodes] == ["s", "t"]
    bad = base + [{"type": "node", "id": "u", "user": "ana", "node_type": "Turn", "parent": "nope"},
                  {"type": "node", "id": "v", "user": "ana", "node_type": "9x"},
                  {"type": "node", "id": "w", "user": "ana", "node_type": "Turn", "memory": "m9"},
                  {"type": "node", "id": "t", "user": "ana", "node_type": "Turn", "parent": "s", "memory": "m1"},
                  {"type": "node", "id": "a", "user": "ana", "node_type": "A", "parent": "b"},
                  {"type": "node", "id": "b", "user": "ana", "node_type": "A", "parent": "a"},
                  {"type": "node", "id": "c", "user": "ana", "node_type": "A", "attributes": {"node": "x"}},
                  {"type": "node", "id": "d", "user": "bo", "node_type": "A"}]
    write_jsonl(bad, tmp_path / "bad.jsonl")
    with pytest.raises(JsonlDataError) as caught:
        read_jsonl(tmp_path / "bad.jsonl")
    problems = {(p.line, p.field) for p in caught.value.problems}
    assert problems == {(5, "parent"), (6, "node_type"), (7, "memory"), (8, "version"), (9, "parent"),
                        (10, "parent"), (11, "attributes"), (12, "user")}


# ---- the embedded API ---------------------------------------------------------------------------------
def test_the_embedded_api_has_the_servers_tree_verbs(tmp_path: Path) -> None:
    from rmm.memory.graph import Edge

    with Memory.open(tmp_path / "bank", encoder=BagOfWordsEncoder(), learner={"batch_size": 1}) as memory:
        memory.add_memories("ana", [{"id": i, "text": text} for i, (_, text) in TURNS.items()])
        generation = memory.add_nodes("ana", [TreeNode(**{**n, "attributes": n.get("attributes", {})})
                                              for n in tree_nodes()])
        sigma = memory.schema("ana")
        assert sigma.generation == generation and sigma.types["Session"].children == {"Turn": 6}
        hit = memory.xpath("ana", QUERY, k=5, m=2, explore=True)
        assert hit.selection_id and hit.nodes[0].id == "s1/t0" and len(hit.memories) == 2
        assert memory.feedback(hit.selection_id, cited=[0]).learned
        with pytest.raises(QuerySyntaxError) as caught:
            memory.xpath("ana", "//Turn[")
        assert caught.value.column == 8
        assert memory.edit_nodes("ana", [NodeEdit("s3/t5", parent="s1")]) > generation
        assert [n.version for n in memory.tree("ana") if n.id == "s3/t5"] == [2]
        assert [n.id for n in memory.tree("ana", as_of=generation)][-2:] == ["s3", "s3/t5"]
        memory.remove_node("ana", "s3")
        memory.add_memories("ana", [{"id": "e1", "kind": "event", "text": "Ana flew to Lisbon", "refs": ["x"],
                                     "time": "2024"},
                                    {"id": "e2", "kind": "event", "text": "Ana rented a flat in Lisbon", "refs": ["y"],
                                     "time": "2024"}])
        memory.service.bank.store.add_events(scoped("local", "ana"), [], [Edge("e1", "e2", "next")])
        slate = memory.neighbours("ana", "e1", "Lisbon flat")
        assert [n.id for n in slate.memories] == ["e2"] and slate.memories[0].edges[0].label == "next"

        async def main() -> None:
            wrapped = AsyncMemory(memory)
            assert (await wrapped.schema("ana")).nodes == 8  # s3 removed; s3/t5 had moved
            puppy = await wrapped.xpath("ana", '//Turn[node~"puppy"]', m=1, explore=False)
            assert puppy.memories[0].id in {"t3", "t4"}
            assert (await wrapped.neighbours("ana", "e2", "Lisbon", direction="in")).memories[0].id == "e1"
            assert len(await wrapped.tree("ana")) == 8

        asyncio.run(main())


# ---- the README's worked example ---------------------------------------------------------------------
README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    section = re.split(r"\n##+ ", README.read_text(encoding="utf-8").split("### Semantic XPath over HTTP", 1)[1])[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


def test_the_readme_example_runs_as_printed(tmp_path: Path, monkeypatch, capsys) -> None:
    """schema → query (a bad one first) → feedback with the sync client against a real server."""
    config = load_config(None, {"bank": str(tmp_path / "bank"), "auth.keys": {ALPHA: "alpha"}, "device": "cpu",
                                "learner": {"batch_size": 1}}, environ={})
    app = create_app(config, encoder=BagOfWordsEncoder())
    with loopback_server(app) as url:
        real = client_module.RmmClient
        # the example's address and key are the README's; the server is this one
        monkeypatch.setattr(client_module, "RmmClient", lambda _url, api_key: real(url, ALPHA))
        exec(compile(readme_example(), str(README), "exec"), {"__name__": "readme"})
        printed = capsys.readouterr().out.splitlines()
        assert printed[:3] == ["(root) -> Session (2)", "Session (2) [date] -> Turn (3)", "Turn (3)"]
        assert printed[3] == "query_syntax 46 a quoted string after '~'"
        assert printed[4].startswith('//Session[max(/Turn[node~"trip"])] [(\'s')
        assert printed[5].startswith('/Turn[node~"trip"] [(')
        assert printed[6] in ("[1.0, -1.0]", "[-1.0, 1.0]")
        learner = app.state.service.learner("alpha")
        assert learner.stats.records == 1 and learner.stats.step == 1  # the slate was a sample, learned from

        async def async_client() -> None:
            async with AsyncRmmClient(url, ALPHA) as rmm:
                assert (await rmm.schema("alice")).nodes == 5
                hit = await rmm.xpath("alice", '//Turn[node~"cat plant"]', m=1, explore=False)
                assert [m.id for m in hit.memories] == ["t2"] and hit.selection_id
                assert [n.id for n in (await rmm.tree("alice")).nodes][:2] == ["s1", "s1/t1"]
                written = await rmm.edit_nodes("alice", [{"id": "s2/t3", "parent": "s1"}])
                assert written.node_ids == ["s2/t3"]
                assert len((await rmm.tree("alice", as_of=written.generation - 1)).nodes) == 5
                assert (await rmm.remove_node("alice", "s2")).node_id == "s2"
                assert (await rmm.add_nodes("alice", [{"id": "s9", "type": "Session"}])).node_ids == ["s9"]
                with pytest.raises(RmmServerError) as caught:
                    await rmm.add_nodes("alice", [{"id": "x", "type": "Turn", "parent": "gone"}])
                assert caught.value.status == 404 and caught.value.code == "unknown_node"

        asyncio.run(async_client())
        with RmmClient(url, ALPHA) as rmm:
            assert [n.id for n in rmm.tree("alice").nodes] == ["s1", "s1/t1", "s1/t2", "s2/t3", "s9"]
