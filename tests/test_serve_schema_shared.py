"""One schema for client and server: the client parses the server's own response models, calls
only routes the app serves with the bodies those routes take, and imports neither torch nor FastAPI.

`rmm.serve.client.ROUTES` is the client's whole view of the API (method, path, body model, answer
model per client method); these tests hold it against the app's OpenAPI, so a route or model that
changes on one side only fails here instead of in an agent.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fakes import BagOfWordsEncoder
from fastapi import FastAPI
from pydantic import ValidationError

from rmm.serve import client, records, schemas
from rmm.serve.app import create_app
from rmm.serve.client import ROUTES, AsyncRmmClient, Query, RmmClient, Route
from rmm.serve.config import load_config

KEY = "shared-key-123"
NOT_FOR_AGENTS = {("/metrics", "GET")}  # Prometheus scrapes it (text, no key); no client method calls it


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    bank = tmp_path_factory.mktemp("shared") / "bank"
    config = load_config(None, {"bank": str(bank), "auth.keys": {KEY: "acme"}, "device": "cpu"}, environ={})
    return create_app(config, encoder=BagOfWordsEncoder())


def _path_parameters(path: str) -> list[str]:
    return re.findall(r"\{(\w+)\}", path)


def _client_openapi() -> dict[str, Any]:
    """The OpenAPI FastAPI writes for the client's table alone: its paths and the models it sends
    and parses, nothing of the app."""
    probe = FastAPI()
    for name, route in ROUTES.items():
        kind = inspect.Parameter.KEYWORD_ONLY
        params = [inspect.Parameter(p, kind, annotation=str) for p in _path_parameters(route.path)]
        if route.body is not None:
            params.append(inspect.Parameter("body", kind, annotation=route.body))

        def endpoint(**_: Any) -> None:
            return None

        endpoint.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        probe.add_api_route(route.path, endpoint, methods=[route.method], response_model=route.answer, name=name)
    return probe.openapi()


def _refs(node: Any) -> set[str]:
    """Every `$ref` under an OpenAPI node (a body may be `anyOf` the model and null)."""
    if isinstance(node, dict):
        return {node["$ref"]} if "$ref" in node else set().union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def _success(operation: dict[str, Any]) -> dict[str, Any]:
    (code,) = [code for code in operation["responses"] if code.startswith("2")]
    return operation["responses"][code]


def test_the_client_and_its_schemas_import_neither_torch_nor_fastapi() -> None:
    """Agents import the client in their own process; `import rmm` must not pull torch in either."""
    code = ("import sys, rmm, rmm.serve.client, rmm.serve.schemas, rmm.serve.records; "
            "heavy = [m for m in ('torch', 'fastapi', 'starlette') if m in sys.modules]; "
            "assert not heavy, f'imported {heavy}'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_client_answers_with_the_server_models_not_copies() -> None:
    assert client.Retrieval is records.RetrieveResult and client.RetrievedMemory is records.ShownMemory
    assert client.Feedback is records.FeedbackResult and client.JobInfo is schemas.JobOut
    assert client.MemoryInfo is schemas.MemoryOut and client.DeleteUserResult is schemas.DeleteUserOut
    assert client.Health is schemas.HealthOut
    assert {f for f in inspect.signature(Query).parameters} == set(schemas.QueryIn.model_fields)


def test_every_client_route_is_served_with_the_models_the_client_uses(app: FastAPI) -> None:
    served, mine = app.openapi(), _client_openapi()
    for path, operations in mine["paths"].items():
        for method, operation in operations.items():
            assert method in served["paths"].get(path, {}), f"the client calls {method.upper()} {path}; not served"
            theirs = served["paths"][path][method]
            assert _refs(_success(theirs)) == _refs(_success(operation)), (method, path)
            assert _refs(theirs.get("requestBody")) == _refs(operation.get("requestBody")), (method, path)
            served_params = {p["name"] for p in theirs.get("parameters", []) if p["in"] == "path"}
            assert served_params == set(_path_parameters(path)), (method, path)
    shared = mine["components"]["schemas"]
    assert {"RetrieveResult", "ShownMemory", "FeedbackResult", "JobOut", "HealthOut", "RetrieveIn"} <= set(shared)
    for name, schema in shared.items():  # the models themselves, field by field, as the OpenAPI states them
        assert served["components"]["schemas"].get(name) == schema, name


def test_every_route_an_agent_needs_has_a_client_method(app: FastAPI) -> None:
    served = {(path, method.upper()) for path, operations in app.openapi()["paths"].items() for method in operations}
    called = {(route.path, route.method) for route in ROUTES.values()}
    assert served - called == NOT_FOR_AGENTS
    public = {name for name in dir(RmmClient) if not name.startswith("_")}
    assert public == ({name for name in dir(AsyncRmmClient) if not name.startswith("_")} - {"aclose"}) | {"close"}
    assert set(ROUTES) <= public


def test_an_answer_that_drifted_is_an_error_and_a_new_field_is_ignored() -> None:
    users = ROUTES["users"]
    assert users.parse(b'{"users": ["ana"], "added_later": 1}').users == ["ana"]  # an older client keeps working
    with pytest.raises(ValidationError):
        users.parse(b'{"users": "ana"}')
    with pytest.raises(ValidationError):
        ROUTES["job"].parse(b'{"job_id": "j", "user": "ana", "kind": "end_session", "status": "done"}')
    assert Route("GET", "/v1/users/{user}", None, dict).url(user="a b/c") == "/v1/users/a%20b%2Fc"


class _Recorder(httpx.AsyncBaseTransport):
    """The app over ASGI, remembering which route each request went to."""

    def __init__(self, app: FastAPI) -> None:
        self.inner, self.seen = httpx.ASGITransport(app=app), []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.raw_path.decode().split("?")[0]
        self.seen += [name for name, r in ROUTES.items() if r.method == request.method
                      and re.fullmatch(re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(r.path)), path)]
        return await self.inner.handle_async_request(request)


def test_every_client_method_against_the_app(app: FastAPI) -> None:
    """Each method calls the route of its own name, the app accepts what it sends (strings, dicts or
    the request models themselves) and what the app answers parses into the shared models."""
    recorder = _Recorder(app)

    async def main() -> None:
        async with app.router.lifespan_context(app), AsyncRmmClient("http://test", KEY, transport=recorder) as rmm:
            async def call(name: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
                recorder.seen.clear()
                result = await method(*args, **kwargs)
                assert recorder.seen[-1] == name, (name, recorder.seen)
                return result

            assert isinstance(await call("health", rmm.health), schemas.HealthOut)
            ids = await call("add_memories", rmm.add_memories, "ana b", [
                "Ana hikes mountain trails", {"text": "Ana bakes sourdough bread", "id": "bread"},
                schemas.MemoryIn(text="Ana plays the cello", kind="topic", refs=["t1"])])
            assert len(ids) == 3 and ids[1] == "bread"
            assert await call("users", rmm.users) == ["ana b"]
            stored = await call("memories", rmm.memories, "ana b")
            assert all(isinstance(m, schemas.MemoryOut) for m in stored)
            assert {m.kind for m in stored} == {"turn", "topic"}
            hits = await call("retrieve", rmm.retrieve, [Query("ana b", "cello", m=2),
                                                          schemas.QueryIn(user="ana b", query="bread", m=1)])
            assert all(isinstance(h, records.RetrieveResult) for h in hits) and [len(h.memories) for h in hits] == [2, 1]
            assert isinstance(hits[0].memories[0], records.ShownMemory) and hits[0].error is None
            fb = await call("feedback", rmm.feedback, hits[0].selection_id, cited=[hits[0].memories[0].index])
            assert isinstance(fb, records.FeedbackResult) and fb.cited == [0]
            assert await call("delete_memory", rmm.delete_memory, "ana b", "bread") == 0
            turn_ids = await call("add_turns", rmm.add_turns, "bo", [
                ("bo", "I restore sailing boats"), schemas.TurnIn(speaker="assistant", text="Nice!")])
            assert len(turn_ids) == 2
            ended = await call("end_session", rmm.end_session, "bo")
            assert isinstance(ended, schemas.JobOut)
            job = await call("job", rmm.job, ended.job_id)
            assert job.job_id == ended.job_id
            posted = await call("add_session", rmm.add_session, "kai", [("kai", "I teach chemistry")])
            assert (await rmm.wait_job(posted.job_id, timeout=20)).finished
            await rmm.wait_job(ended.job_id, timeout=20)
            gone = await call("delete_user", rmm.delete_user, "ana b")
            assert isinstance(gone, schemas.DeleteUserOut) and gone.memories == 2

    asyncio.run(main())


def test_the_sync_client_calls_the_same_routes() -> None:
    """The blocking client shares the table: each method sends its route's request and parses its answer."""
    answers = {"users": b'{"users": ["ana"]}', "delete_memory": b'{"user": "ana", "memory_id": "m", '
                                                               b'"selections_dropped": 0}'}
    seen: list[tuple[str, str, bytes]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.raw_path.decode(), request.content))
        name = "users" if request.url.path.endswith("/users") else "delete_memory"
        return httpx.Response(200, content=answers[name], headers={"content-type": "application/json"})

    with RmmClient("http://test", KEY, transport=httpx.MockTransport(handler)) as rmm:
        assert rmm.users() == ["ana"]
        assert rmm.delete_memory("ana", "m/1") == 0
    assert seen == [("GET", "/v1/users", b""), ("DELETE", "/v1/users/ana/memories/m%2F1", b"")]
