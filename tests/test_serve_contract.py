"""The API's promises to its callers: learning isolated per tenant, one error shape on every route,
feedback that cannot be used leaves the selection open, and no internal (tenant-scoped) names."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fakes import BagOfWordsEncoder
from fastapi.testclient import TestClient

from rmm.errors import UnknownUserError
from rmm.serve.app import create_app
from rmm.serve.client import AsyncRmmClient, Query, Retrieval
from rmm.serve.config import load_config
from rmm.serve.records import RetrieveItem

ALPHA, BETA = "key-alpha-123", "key-beta-4567"
KEYS = {ALPHA: "alpha", BETA: "beta"}
A = {"Authorization": f"Bearer {ALPHA}"}
B = {"X-API-Key": BETA}
FACTS = ["Ana hikes mountain trails every weekend", "Ana bakes sourdough bread on Sundays",
         "Ana plays cello in a community orchestra", "Ana adopted a golden retriever puppy",
         "Ana works as a nurse at the city hospital", "Ana booked a summer trip to Lisbon"]


def make_client(tmp_path: Path, **overrides: Any) -> TestClient:
    config = load_config(None, {"bank": str(tmp_path / "bank"), "auth.keys": KEYS, "device": "cpu", **overrides},
                         environ={})
    return TestClient(create_app(config, encoder=BagOfWordsEncoder()))


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with make_client(tmp_path, learner={"batch_size": 2}) as c:
        for headers in (A, B):
            assert c.post("/v1/users/ana/memories", json={"memories": [{"text": t} for t in FACTS]},
                          headers=headers).status_code == 201
        yield c


def selection(client: TestClient, query: str, headers: dict[str, str] = A, **options: Any) -> str:
    response = client.post("/v1/retrieve", json={"queries": [{"user": "ana", "query": query, **options}]},
                           headers=headers)
    assert response.status_code == 200, response.json()
    return response.json()["results"][0]["selection_id"]


def assert_error_shape(response: httpx.Response, context: object = "") -> dict[str, Any]:
    """The contract: JSON `{detail: str, code: str}` (422 validation errors may add `errors`)."""
    assert response.headers["content-type"].startswith("application/json"), (context, response.text)
    body = response.json()
    assert isinstance(body, dict) and isinstance(body.get("detail"), str) and body["detail"], (context, body)
    assert isinstance(body.get("code"), str) and re.fullmatch(r"[a-z_]+", body["code"]), (context, body)
    assert set(body) <= {"detail", "code", "errors"}, (context, body)
    return body


# ---- 1. learning is isolated per tenant ---------------------------------------------------------
def test_learning_is_isolated_per_tenant_by_default(client: TestClient) -> None:
    service = client.app.state.service
    assert service.config.reranker_per == "tenant"
    before = service.learner("beta").reranker.W_q.weight.detach().clone()
    a1, a2 = selection(client, "hiking trails"), selection(client, "sourdough bread")
    first = client.post("/v1/feedback", json={"selection_id": a1, "cited": [0]}, headers=A).json()
    assert first["learner_records"] == 1
    assert client.post("/v1/feedback", json={"selection_id": a2, "cited": [1]}, headers=A).json()["updated"]
    beta = client.post("/v1/feedback", json={"selection_id": selection(client, "cello", B), "cited": [0]},
                       headers=B).json()
    # beta's own learner: one record, no step, untouched by alpha's update
    assert (beta["learner_records"], beta["learner_step"], beta["updated"]) == (1, 0, False)
    assert torch.equal(service.learner("beta").reranker.W_q.weight, before)
    assert not torch.equal(service.learner("alpha").reranker.W_q.weight, before)


def test_a_shared_reranker_is_an_explicit_choice(tmp_path: Path) -> None:
    with make_client(tmp_path, reranker_per="bank") as c:
        for headers in (A, B):
            c.post("/v1/users/ana/memories", json={"memories": [{"text": t} for t in FACTS]}, headers=headers)
        c.post("/v1/feedback", json={"selection_id": selection(c, "hiking"), "cited": [0]}, headers=A)
        shared = c.post("/v1/feedback", json={"selection_id": selection(c, "cello", B), "cited": [0]}, headers=B)
        assert shared.json()["learner_records"] == 2  # documented: one learner for every tenant


# ---- 2. one error contract, everywhere ----------------------------------------------------------
# a valid request for every route: the walk below refuses a route that is missing here
ROUTES: dict[tuple[str, str], tuple[str, dict[str, Any] | None]] = {
    ("GET", "/health"): ("/health", None),
    ("GET", "/metrics"): ("/metrics", None),
    ("GET", "/v1/users"): ("/v1/users", None),
    ("POST", "/v1/users/{user}/memories"): ("/v1/users/ana/memories", {"memories": [
        {"text": "Ana swims", "kind": "turn", "id": "swim", "refs": ["t1"], "source_text": "swims", "time": "2024"}]}),
    ("GET", "/v1/users/{user}/memories"): ("/v1/users/ana/memories", None),
    ("DELETE", "/v1/users/{user}/memories/{memory_id}"): ("/v1/users/ana/memories/nope", None),
    ("DELETE", "/v1/users/{user}"): ("/v1/users/nobody", None),
    ("POST", "/v1/users/{user}/turns"): ("/v1/users/ana/turns", {"turns": [
        {"speaker": "ana", "text": "I like tea", "time": "2024"}]}),
    ("POST", "/v1/users/{user}/sessions/end"): ("/v1/users/nobody/sessions/end",
                                                {"speakers": ["ana"], "store_turns": False}),
    ("POST", "/v1/users/{user}/sessions"): ("/v1/users/ana/sessions", {
        "turns": [{"speaker": "ana", "text": "I like tea", "time": "2024", "id": "t9"}], "session_id": "s1",
        "time": "2024", "speakers": ["ana"], "store_turns": False}),
    ("GET", "/v1/jobs/{job_id}"): ("/v1/jobs/nope", None),
    ("POST", "/v1/retrieve"): ("/v1/retrieve", {"queries": [{"user": "ana", "query": "hiking"}]}),
    ("POST", "/v1/feedback"): ("/v1/feedback", {"selection_id": "nope", "text": "Hiking [0]"}),
    ("GET", "/v1/ope"): ("/v1/ope", None),  # 403: no admin tenant here
    ("POST", "/v1/reranker/promote"): ("/v1/reranker/promote", None),
    ("POST", "/v1/users/{user}/events/{event_id}/neighbours"): ("/v1/users/ana/events/nope/neighbours", {
        "query": "hiking", "visited": ["a"], "label": "next"}),
    ("GET", "/v1/users/{user}/schema"): ("/v1/users/ana/schema", None),
    ("POST", "/v1/users/{user}/xpath"): ("/v1/users/ana/xpath", {"query": '//Turn[node~"hiking"]',
                                                                 "question": "where does Ana hike?"}),
    ("GET", "/v1/users/{user}/tree"): ("/v1/users/ana/tree", None),
    ("POST", "/v1/users/{user}/tree/nodes"): ("/v1/users/ana/tree/nodes", {"nodes": [
        {"id": "n1", "type": "Turn", "parent": "nope", "attributes": {"speaker": "ana"}, "memory_id": "swim"}]}),
    ("PATCH", "/v1/users/{user}/tree/nodes"): ("/v1/users/ana/tree/nodes", {"edits": [
        {"id": "n1", "parent": "nope", "attributes": {"speaker": "ana"}, "memory_id": "swim"}]}),
    ("DELETE", "/v1/users/{user}/tree/nodes/{node_id}"): ("/v1/users/ana/tree/nodes/nope", None),
}
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def api_routes(client: TestClient) -> list[tuple[str, str]]:
    """Every route the API documents (the OpenAPI schema lists them all)."""
    paths = client.get("/openapi.json").json()["paths"]
    return sorted((method.upper(), path) for path, operations in paths.items() for method in operations)


def strings(value: Any, where: str = "") -> Iterator[tuple[str, list[Any]]]:
    """Every string leaf of a JSON value as (dotted location, path of keys)."""
    if isinstance(value, str):
        yield where, []
    elif isinstance(value, dict):
        for key, item in value.items():
            for loc, path in strings(item, f"{where}.{key}" if where else key):
                yield loc, [key, *path]
    elif isinstance(value, list):
        for i, item in enumerate(value):
            for loc, path in strings(item, f"{where}.{i}" if where else str(i)):
                yield loc, [i, *path]


def replaced(value: Any, path: list[Any], new: str) -> Any:
    copy = json.loads(json.dumps(value))
    target = copy
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = new
    return copy


def test_every_route_answers_every_error_as_detail_and_code(client: TestClient) -> None:
    assert api_routes(client) == sorted(ROUTES), "add the new route to ROUTES"
    json_header = {**A, "content-type": "application/json"}
    for (method, template), (url, body) in ROUTES.items():
        # a method the route does not have: 405
        for other in METHODS:
            if (other, template) not in ROUTES:
                response = client.request(other, url, headers=A)
                if response.status_code == 405:
                    assert_error_shape(response, (other, url))
                else:  # a path another route also matches (e.g. DELETE /v1/users/{user})
                    assert response.status_code < 500, (other, url, response.text)
        response = client.request(method, url, content=b'{"x": "\xff\xfe"}', headers=json_header)
        if body is not None:  # a body that is not UTF-8: 422 saying so
            assert response.status_code == 422, (url, response.text)
            assert "UTF-8" in assert_error_shape(response, url)["detail"]
        elif response.status_code >= 400:
            assert_error_shape(response, url)
        if body is None:
            continue
        for loc, path in strings(body):
            raw = json.dumps(replaced(body, path, "bad \ud800 text"), ensure_ascii=True).encode()
            response = client.request(method, url, content=raw, headers=json_header)
            assert response.status_code == 422, (url, loc, response.text)
            detail = assert_error_shape(response, (url, loc))["detail"]
            assert detail.startswith(f"{loc}: ") and "surrogate" in detail, (loc, detail)
            assert "codec" not in detail and "position" not in detail, detail


def test_routing_errors_and_blank_queries_follow_the_contract(client: TestClient) -> None:
    traversal = client.post("/v1/users/..%2Fx/memories", json={"memories": [{"text": "x"}]}, headers=A)
    assert traversal.status_code == 404 and assert_error_shape(traversal)["code"] == "not_found"
    assert assert_error_shape(client.get("/v1/nothing-here", headers=A))["code"] == "not_found"
    assert assert_error_shape(client.get("/nothing-here"))["code"] == "not_found"
    put = client.put("/v1/retrieve", json={"queries": []}, headers=A)
    assert put.status_code == 405 and assert_error_shape(put)["code"] == "method_not_allowed"
    assert "POST" in put.headers["allow"]
    for query in ("", "   \t\n "):
        blank = client.post("/v1/retrieve", json={"queries": [{"user": "ana", "query": query}]}, headers=A)
        assert blank.status_code == 422, (query, blank.text)
        assert assert_error_shape(blank)["detail"].startswith("queries.0.query: ")
    spaces = client.post("/v1/users/ana/memories", json={"memories": [{"text": "  "}]}, headers=A)
    assert spaces.status_code == 422 and "memories.0.text" in assert_error_shape(spaces)["detail"]


def test_an_unexpected_failure_is_a_500_in_the_same_shape(tmp_path: Path) -> None:
    with make_client(tmp_path) as c:
        c.app.state.service.users = lambda _tenant: 1 / 0
        response = TestClient(c.app, raise_server_exceptions=False).get("/v1/users", headers=A)
    assert response.status_code == 500
    body = assert_error_shape(response)
    assert body["code"] == "internal" and "division" not in body["detail"]


# ---- 3. feedback that cannot be used leaves the selection open -------------------------------
def test_feedback_citing_only_out_of_range_indices_is_refused_and_the_selection_stays_open(
        client: TestClient) -> None:
    sid = selection(client, "sourdough bread", m=5)
    for refused in ({"text": "She bakes bread [7]"}, {"text": "Sure [5, 9]"},
                    {"text": '{"answer": "bread", "citations": [12]}', "structured": True}):
        response = client.post("/v1/feedback", json={"selection_id": sid, **refused}, headers=A)
        assert response.status_code == 422, (refused, response.text)
        detail = assert_error_shape(response)["detail"]
        assert "0..4" in detail and "5 memories" in detail and "still open" in detail, detail
    fixed = client.post("/v1/feedback", json={"selection_id": sid, "text": "She bakes bread [7, 1]"}, headers=A)
    assert fixed.status_code == 200 and fixed.json()["cited"] == [1] and fixed.json()["warnings"]
    # nothing cited at all is still "no parseable citation" (skipped), and no_cite still means "none used"
    unclear = client.post("/v1/feedback", json={"selection_id": selection(client, "cello"), "text": "Not sure."},
                          headers=A)
    assert unclear.status_code == 200 and unclear.json()["rewards"] is None
    none_used = client.post("/v1/feedback", json={"selection_id": selection(client, "puppy", m=2), "no_cite": True},
                            headers=A)
    assert none_used.json()["rewards"] == [-1.0, -1.0]


# ---- 4. no internal names --------------------------------------------------------------------
def test_no_response_or_message_shows_tenant_scoped_names(client: TestClient) -> None:
    seen: list[str] = []

    def call(method: str, url: str, **kwargs: Any) -> httpx.Response:
        response = client.request(method, url, headers=A, **kwargs)
        seen.append(response.text)
        return response

    turns = call("POST", "/v1/users/ana/turns", json={"turns": [{"speaker": "ana", "text": "I went rowing"}]}).json()
    assert not turns["session_id"].startswith("alpha:") and turns["turn_ids"][0].startswith(turns["session_id"])
    job = call("POST", "/v1/users/ana/sessions/end", json={"store_turns": True}).json()
    imported = call("POST", "/v1/users/kim/sessions", json={"turns": [{"speaker": "kim", "text": "I fix radios"}],
                                                            "store_turns": True}).json()
    for job_id in (job["job_id"], imported["job_id"]):
        while call("GET", f"/v1/jobs/{job_id}").json()["status"] in ("queued", "running"):
            pass
    call("GET", "/v1/users/ana/memories")
    call("GET", "/v1/users/kim/memories")
    call("POST", "/v1/retrieve", json={"queries": [{"user": "ana", "query": "rowing", "k": 10, "m": 7}]})
    assert call("POST", "/v1/users/ana/memories", json={"memories": [{"text": "x", "id": "m1"}]}).status_code == 201
    assert call("POST", "/v1/users/ana/memories", json={"memories": [{"text": "x", "id": "m1"}]}).status_code == 409
    assert call("POST", "/v1/users/ana/memories",
                json={"memories": [{"text": "y", "id": "m2"}, {"text": "z", "id": "m2"}]}).status_code == 409
    assert call("DELETE", "/v1/users/ana/memories/nope").status_code == 404
    assert call("DELETE", "/v1/users/zed").status_code == 404
    refs = [r for m in client.get("/v1/users/ana/memories", headers=A).json()["memories"] for r in m["refs"]]
    assert refs and all(r.startswith(turns["session_id"]) for r in refs)
    leaks = [text for text in seen if "alpha:" in text or "beta:" in text]
    assert not leaks, leaks


def test_errors_from_the_bank_are_told_in_the_callers_terms(client: TestClient) -> None:
    """A user deleted mid-batch: the store's message names the scoped id and other users."""
    service = client.app.state.service

    def gone(*_args: Any, **_kwargs: Any) -> None:
        raise UnknownUserError("unknown user 'alpha:ana' in /srv/bank/memories.sqlite; known users: ['beta:ana']")

    service.bank.search_embeddings = gone
    (result,) = service.retrieve_batch([RetrieveItem("alpha", "ana", "hiking", k=5, m=2, explore=False)])
    assert isinstance(result, UnknownUserError)
    assert str(result) == "unknown user 'ana' (no memories stored for this user)"


def test_metrics_show_the_learner_step_from_the_start_without_tenant_names(tmp_path: Path) -> None:
    with make_client(tmp_path) as c:
        text = c.get("/metrics").text
        assert re.search(r"^rmm_learner_step 0\.0$", text, re.MULTILINE), text
        assert "alpha" not in text and "beta" not in text


def test_the_client_retrieve_takes_plain_dicts(tmp_path: Path) -> None:
    config = load_config(None, {"bank": str(tmp_path / "bank"), "auth.keys": KEYS, "device": "cpu"}, environ={})
    app = create_app(config, encoder=BagOfWordsEncoder())

    async def main() -> list[Retrieval]:
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app), AsyncRmmClient("http://test", ALPHA, transport=transport) as rmm:
            await rmm.add_memories("ana", FACTS)
            with pytest.raises(TypeError, match="colour"):
                await rmm.retrieve([{"user": "ana", "query": "cello", "colour": "red"}])
            return await rmm.retrieve([{"user": "ana", "query": "cello", "m": 2}, Query("ana", "puppy", m=1)])

    results = asyncio.run(main())
    assert [len(r.memories) for r in results] == [2, 1] and "cello" in results[0].memories[0].text
