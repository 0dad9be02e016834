"""The HTTP API: auth, tenant isolation, error codes and messages, limits, micro-batching, metrics."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from fakes import BagOfWordsEncoder
from fastapi.testclient import TestClient

from rmm.serve.app import create_app
from rmm.serve.batcher import MIN_SPLIT
from rmm.serve.config import load_config
from rmm.serve.records import NewMemory

ALPHA, BETA = "key-alpha-123", "key-beta-4567"
KEYS = {ALPHA: "alpha", BETA: "beta"}
A = {"Authorization": f"Bearer {ALPHA}"}
B = {"X-API-Key": BETA}
FACTS = ["Ana hikes mountain trails every weekend", "Ana bakes sourdough bread on Sundays",
         "Ana plays cello in a community orchestra", "Ana adopted a golden retriever puppy",
         "Ana works as a nurse at the city hospital", "Ana booked a summer trip to Lisbon"]


def make_app(tmp_path: Path, **overrides):
    config = load_config(None, {"bank": str(tmp_path / "bank"), "auth.keys": KEYS, "device": "cpu", **overrides},
                         environ={})
    return create_app(config, encoder=BagOfWordsEncoder())


@pytest.fixture
def client(tmp_path: Path):
    with TestClient(make_app(tmp_path, learner={"batch_size": 2}, limits={"max_request_bytes": 20_000,
                                                                                   "max_queries": 8})) as c:
        assert c.post("/v1/users/ana/memories", json={"memories": [{"text": t} for t in FACTS]},
                      headers=A).status_code == 201
        yield c


def retrieve(client: TestClient, user: str, query: str, headers=A, **options) -> httpx.Response:
    return client.post("/v1/retrieve", json={"queries": [{"user": user, "query": query, **options}]}, headers=headers)


# ---- auth ---------------------------------------------------------------------------------------
def test_requests_without_a_valid_key_are_refused(client: TestClient) -> None:
    missing = retrieve(client, "ana", "hiking", headers={})
    assert missing.status_code == 401 and "missing API key" in missing.json()["detail"]
    assert missing.headers["www-authenticate"] == "Bearer"
    assert retrieve(client, "ana", "hiking", headers={"Authorization": "Bearer nope-nope-nope"}).status_code == 401
    assert retrieve(client, "ana", "hiking", headers={"X-API-Key": "wrong-key-123"}).json()["code"] == "invalid_api_key"
    assert retrieve(client, "ana", "hiking", headers={"Authorization": f"Basic {ALPHA}"}).status_code == 401
    # refused before the body is read: a malformed body from a stranger still gets 401
    assert client.post("/v1/retrieve", content=b"{not json", headers={"content-type": "application/json"}).status_code == 401
    assert client.get("/v1/users").status_code == 401
    assert retrieve(client, "ana", "hiking", headers={"X-API-Key": ALPHA}).status_code == 200
    assert client.get("/health").status_code == 200  # health and metrics need no key
    assert client.get("/metrics").status_code == 200


def test_a_tenant_cannot_touch_another_tenants_users_or_selections(client: TestClient) -> None:
    selection = retrieve(client, "ana", "sourdough bread").json()["results"][0]["selection_id"]
    memory_id = client.get("/v1/users/ana/memories", headers=A).json()["memories"][0]["id"]
    assert client.get("/v1/users", headers=B).json() == {"users": []}
    for response in (
        retrieve(client, "ana", "sourdough bread", headers=B),
        client.get("/v1/users/ana/memories", headers=B),
        client.delete(f"/v1/users/ana/memories/{memory_id}", headers=B),
        client.delete("/v1/users/ana", headers=B),
        client.post("/v1/feedback", json={"selection_id": selection, "cited": [0]}, headers=B),
    ):
        assert response.status_code == 404, response.json()  # 404, not 403: existence is not leaked
    job = client.post("/v1/users/sam/sessions", json={"turns": [{"speaker": "sam", "text": "I love tea"}]},
                      headers=A).json()
    assert client.get(f"/v1/jobs/{job['job_id']}", headers=B).status_code == 404
    # beta's own "ana" is a different user
    client.post("/v1/users/ana/memories", json={"memories": [{"text": "Beta Ana sails"}]}, headers=B)
    texts = [m["text"] for m in client.get("/v1/users/ana/memories", headers=B).json()["memories"]]
    assert texts == ["Beta Ana sails"]
    assert client.post("/v1/feedback", json={"selection_id": selection, "cited": [0]}, headers=A).status_code == 200
    assert len(client.get("/v1/users/ana/memories", headers=A).json()["memories"]) == len(FACTS)


# ---- bad requests -------------------------------------------------------------------------------
def test_malformed_bodies_get_422_with_messages_that_say_what_is_wrong(client: TestClient) -> None:
    cases = [
        (client.post("/v1/retrieve", content=b"{oops", headers={**A, "content-type": "application/json"}),
         "not valid JSON"),
        (client.post("/v1/retrieve", json={"queries": [{"user": "ana"}]}, headers=A), "queries.0.query: Field required"),
        (client.post("/v1/retrieve", json={"queries": []}, headers=A), "queries: List should have at least 1 item"),
        (client.post("/v1/retrieve", json={"queries": [{"user": "ana", "query": "x", "k": 0}]}, headers=A),
         "queries.0.k"),
        (retrieve(client, "ana", "x", k=2, m=3), "cannot show m=3 memories out of k=2"),
        (retrieve(client, "ana", "x", k=100_000), "exceeds the limit"),
        (client.post("/v1/retrieve", json={"queries": [{"user": "ana", "query": "x", "color": "red"}]}, headers=A),
         "queries.0.color: Extra inputs are not permitted"),
        (client.post("/v1/users/ana/memories", json={"memories": [{"text": "x", "kind": "poem"}]}, headers=A),
         "must be one of"),
        (client.post("/v1/feedback", json={"selection_id": "s"}, headers=A), "exactly one of"),
    ]
    for response, message in cases:
        assert response.status_code == 422, (message, response.json())
        assert message in response.json()["detail"], (message, response.json())


def test_size_limits(client: TestClient) -> None:
    too_many = client.post("/v1/retrieve", json={"queries": [{"user": "ana", "query": "x"}] * 9}, headers=A)
    assert too_many.status_code == 422 and "too many queries: 9 in one request, the limit is 8" in too_many.json()["detail"]
    huge = client.post("/v1/users/ana/memories", json={"memories": [{"text": "x" * 30_000}]}, headers=A)
    assert huge.status_code == 413 and "exceeds the limit of 20000 bytes" in huge.json()["detail"]

    def chunks():  # no content-length: the limit is enforced while streaming
        for _ in range(30):
            yield b" " * 1000

    streamed = client.post("/v1/retrieve", content=chunks(), headers={**A, "content-type": "application/json"})
    assert streamed.status_code == 413
    assert len(client.get("/v1/users/ana/memories", headers=A).json()["memories"]) == len(FACTS)


def test_unknown_ids_get_404_and_used_or_expired_selections_say_so(tmp_path: Path) -> None:
    with TestClient(make_app(tmp_path, selection_ttl_s=0.3)) as client:
        client.post("/v1/users/ana/memories", json={"memories": [{"text": t} for t in FACTS]}, headers=A)
        unknown = retrieve(client, "nobody", "hiking")
        assert unknown.status_code == 404 and "unknown user 'nobody'" in unknown.json()["detail"]
        assert client.delete("/v1/users/ana/memories/nope", headers=A).status_code == 404
        assert client.get("/v1/jobs/nope", headers=A).status_code == 404
        missing = client.post("/v1/feedback", json={"selection_id": "nope", "cited": [0]}, headers=A)
        assert missing.status_code == 404 and missing.json()["code"] == "unknown_selection"
        assert client.post("/v1/users/ana/sessions/end", headers=A).status_code == 404
        first, second = (retrieve(client, "ana", q).json()["results"][0]["selection_id"] for q in ("cello", "puppy"))
        assert client.post("/v1/feedback", json={"selection_id": first, "cited": [0]}, headers=A).status_code == 200
        used = client.post("/v1/feedback", json={"selection_id": first, "cited": [0]}, headers=A)
        assert used.status_code == 409 and "already received feedback" in used.json()["detail"]
        time.sleep(0.4)
        expired = client.post("/v1/feedback", json={"selection_id": second, "cited": [0]}, headers=A)
        assert expired.status_code == 410 and "expired" in expired.json()["detail"]
        dup = client.post("/v1/users/ana/memories", json={"memories": [{"text": "a", "id": "m1"}, {"text": "b", "id": "m1"}]},
                          headers=A)
        assert dup.status_code == 409


# ---- the main loop ------------------------------------------------------------------------------
def test_feedback_through_the_api_updates_the_reranker(client: TestClient) -> None:
    service = client.app.state.service
    before = service.learner("alpha").reranker.W_m.weight.detach().clone()
    results = client.post("/v1/retrieve", json={"queries": [{"user": "ana", "query": "sourdough bread"},
                                                            {"user": "ana", "query": "golden retriever puppy"}]},
                          headers=A).json()["results"]
    assert [len(r["memories"]) for r in results] == [5, 5]
    first = client.post("/v1/feedback", json={"selection_id": results[0]["selection_id"],
                                              "text": "She bakes sourdough [0]"}, headers=A).json()
    assert first["cited"] == [0] and first["rewards"][0] == 1.0 and not first["updated"]
    second = client.post("/v1/feedback", json={"selection_id": results[1]["selection_id"],
                                               "text": '{"answer": "Max", "citations": [1]}', "structured": True},
                         headers=A).json()
    assert second["cited"] == [1] and second["updated"] and second["learner_step"] == 1
    assert not service.learner("alpha").reranker.W_m.weight.equal(before)
    metrics = client.get("/metrics").text
    assert "rmm_learner_updates_total 1.0" in metrics
    assert 'rmm_feedback_total{outcome="learned"} 2.0' in metrics
    assert 'rmm_http_requests_total{method="POST",route="/v1/retrieve",status="200"}' in metrics
    assert "rmm_batch_size_bucket" in metrics and "rmm_learner_step" in metrics


def test_delete_user_and_sessions_over_http(client: TestClient) -> None:
    selection = retrieve(client, "ana", "cello").json()["results"][0]["selection_id"]
    turns = client.post("/v1/users/ana/turns", json={"turns": [{"speaker": "ana", "text": "I went hiking in the Alps"},
                                                               {"speaker": "assistant", "text": "Nice"}]}, headers=A)
    assert turns.status_code == 201 and len(turns.json()["turn_ids"]) == 2
    job = client.post("/v1/users/ana/sessions/end", json={"store_turns": False}, headers=A)
    assert job.status_code == 202
    deadline = time.monotonic() + 10
    while (status := client.get(f"/v1/jobs/{job.json()['job_id']}", headers=A).json())["status"] not in ("done", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert status["status"] == "done" and status["result"]["memories"]
    deleted = client.delete("/v1/users/ana", headers=A).json()
    assert deleted["memories"] == len(FACTS) + len(status["result"]["memories"]) and deleted["selections"] == 1
    assert client.post("/v1/feedback", json={"selection_id": selection, "cited": [0]}, headers=A).status_code == 404
    assert retrieve(client, "ana", "cello").status_code == 404


def test_a_memory_id_with_a_slash_can_be_deleted(client: TestClient) -> None:
    added = client.post("/v1/users/ana/memories", json={"memories": [{"id": "notes/2024/cello", "text": "Ana tunes her cello"}]},
                        headers=A)
    assert added.status_code == 201
    gone = client.delete("/v1/users/ana/memories/notes%2F2024%2Fcello", headers=A)
    assert gone.status_code == 200 and gone.json()["memory_id"] == "notes/2024/cello"
    assert "notes/2024/cello" not in [m["id"] for m in client.get("/v1/users/ana/memories", headers=A).json()["memories"]]
    assert client.delete("/v1/users/ana/memories/notes%2F2024%2Fcello", headers=A).status_code == 404


def test_openapi_documents_the_endpoints_and_auth(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert {"/v1/retrieve", "/v1/feedback", "/v1/users/{user}", "/health", "/metrics"} <= set(schema["paths"])
    assert {"HTTPBearer", "APIKeyHeader"} <= set(schema["components"]["securitySchemes"])
    assert client.get("/docs").status_code == 200


# ---- micro-batching -----------------------------------------------------------------------------
async def _fire(app, n: int) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=A) as http:
        return list(await asyncio.gather(*(
            http.post("/v1/retrieve", json={"queries": [{"user": "ana", "query": f"{FACTS[i % 6]} {i}"}]})
            for i in range(n))))


@pytest.mark.parametrize(("enabled", "requests", "calls"), [
    (True, 2 * MIN_SPLIT - 1, 1),  # one batch, one encoder call
    (True, 4 * MIN_SPLIT, 2),  # a backlog is split in halves so the two stages overlap: two calls
    (False, 2 * MIN_SPLIT - 1, 2 * MIN_SPLIT - 1),  # one call per request
])
def test_concurrent_requests_share_encoder_calls(tmp_path: Path, enabled: bool, requests: int, calls: int) -> None:
    app = make_app(tmp_path, batching={"enabled": enabled, "max_batch": 64, "max_wait_ms": 200})
    service = app.state.service

    async def main() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            service.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
            before = service.encoder.query_calls
            responses = await _fire(app, requests)
            main.calls = service.encoder.query_calls - before  # type: ignore[attr-defined]
            return responses

    responses = asyncio.run(main())
    assert all(r.status_code == 200 for r in responses)
    assert {r.json()["results"][0]["query"] for r in responses} == {f"{FACTS[i % 6]} {i}" for i in range(requests)}
    assert main.calls == calls  # type: ignore[attr-defined]


def test_concurrent_writes_share_one_encoder_call_and_fail_alone(tmp_path: Path) -> None:
    app = make_app(tmp_path, batching={"enabled": True, "max_batch": 64, "max_wait_ms": 200})
    service = app.state.service

    async def main() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            service.add_memories("alpha", "ana", [NewMemory(text="Ana owns a red kayak", id="taken")])
            calls = service.encoder.passage_calls
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=A) as http:
                responses = list(await asyncio.gather(*(
                    http.post(f"/v1/users/u{i % 3}/memories",
                              json={"memories": [{"text": f"fact number {i} about rowing", "id": f"m{i}"}]})
                    for i in range(12)), http.post("/v1/users/ana/memories",
                                                   json={"memories": [{"text": "again", "id": "taken"}]})))
            main.calls = service.encoder.passage_calls - calls  # type: ignore[attr-defined]
            main.stored = {m.id for u in ("u0", "u1", "u2") for m in service.memories("alpha", u)}  # type: ignore[attr-defined]
            return responses

    *written, duplicate = asyncio.run(main())
    assert all(r.status_code == 201 for r in written) and duplicate.status_code == 409
    assert main.calls == 1  # type: ignore[attr-defined]
    assert main.stored == {f"m{i}" for i in range(12)}  # type: ignore[attr-defined]


def test_requests_after_shutdown_began_get_503(tmp_path: Path) -> None:
    app = make_app(tmp_path)

    async def main() -> httpx.Response:
        async with app.router.lifespan_context(app):
            app.state.service.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
            await app.state.batcher.close()  # what the lifespan does first at shutdown
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=A) as http:
                return await http.post("/v1/retrieve", json={"queries": [{"user": "ana", "query": "cello"}]})

    response = asyncio.run(main())
    assert response.status_code == 503 and response.json()["code"] == "shutting_down"


def test_the_tenant_dependency_refuses_on_its_own_without_the_gate(tmp_path: Path) -> None:
    from fastapi import FastAPI

    from rmm.serve.deps import api_key
    from rmm.serve.http_errors import install_error_handlers
    from rmm.serve.routes import memories

    assert api_key({"authorization": "Bearer  key-1 "}) == "key-1"
    assert api_key({"authorization": "Basic key-1", "x-api-key": " key-2"}) == "key-2"
    assert api_key({"authorization": "Bearer ", "x-api-key": " "}) is None
    service = make_app(tmp_path).state.service
    bare = FastAPI()  # the routes and their dependencies only: no gate in front
    bare.state.service = service
    install_error_handlers(bare)
    bare.include_router(memories.router)
    try:
        with TestClient(bare) as client:
            missing = client.get("/v1/users")
            assert missing.status_code == 401 and missing.json()["code"] == "missing_api_key"
            assert missing.headers["www-authenticate"] == "Bearer"
            assert client.get("/v1/users", headers={"Authorization": "Bearer wrong-key-123"}).json()["code"] == \
                "invalid_api_key"
            assert client.get("/v1/users", headers=B).json() == {"users": []}
    finally:
        service.close()


def test_start_up_objects_are_kept_out_of_the_collectors_full_passes(tmp_path: Path) -> None:
    """A full collection walking the ~400k start-up objects paused every thread for ~200 ms under
    load; the server freezes them once started and thaws them at shutdown."""
    import gc

    app = make_app(tmp_path)

    async def main() -> int:
        async with app.router.lifespan_context(app):
            return gc.get_freeze_count()

    assert asyncio.run(main()) > 1000
    assert gc.get_freeze_count() == 0

    first, second = make_app(tmp_path / "one"), make_app(tmp_path / "two")  # two apps in one process

    async def both() -> tuple[int, int]:
        async with first.router.lifespan_context(first):
            async with second.router.lifespan_context(second):
                pass
            after_second = gc.get_freeze_count()  # the first still runs: nothing thawed under it
        return after_second, gc.get_freeze_count()

    still_frozen, after = asyncio.run(both())
    assert still_frozen > 1000 and after == 0
