"""Python clients for `rmm serve`, for agents: `RmmClient` (sync) and `AsyncRmmClient` (asyncio).

The loop an agent runs::

    with RmmClient("http://127.0.0.1:8080", api_key=KEY) as rmm:
        (hit,) = rmm.retrieve([Query("alice", "where did I go hiking?")])
        reply = my_llm(prompt_with(hit.memories))          # cite memories by their `index`
        rmm.feedback(hit.selection_id, text=reply)          # the reranker learns from the citations

The answers are the server's own response models (`rmm.serve.schemas`, `rmm.serve.records`), parsed
from the JSON by pydantic: one definition for both sides, so the client cannot drift from the API
(`ROUTES` names, per method, the route it calls and the models it sends and parses;
`tests/test_serve_schema_shared.py` checks them against the app's OpenAPI). Those modules import
no torch, so an agent's process stays light. Both clients share the request building and response
parsing below; only the transport differs. Every non-2xx answer raises `RmmServerError` carrying
the status code and the server's message.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Self
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter

from rmm.errors import RmmError
from rmm.serve.records import (
    FeedbackResult,
    NeighboursResult,
    RetrieveResult,
    ShownMemory,
    ShownNeighbour,
    TreeSchema,
    XPathResult,
)
from rmm.serve.schemas import (
    API_PREFIX,
    AddMemoriesIn,
    AddMemoriesOut,
    AddNodesIn,
    AddSessionIn,
    AddTurnsIn,
    AddTurnsOut,
    DeleteMemoryOut,
    DeleteUserOut,
    EditNodesIn,
    EndSessionIn,
    FeedbackIn,
    HealthOut,
    JobOut,
    MemoriesOut,
    MemoryIn,
    MemoryOut,
    NeighboursIn,
    NodeEditIn,
    NodeIn,
    QueryIn,
    RemoveNodeOut,
    RetrieveIn,
    RetrieveOut,
    ShadowOut,
    TreeOut,
    TreeWriteOut,
    TurnIn,
    UsersOut,
    XPathIn,
)

__all__ = [
    "ROUTES",
    "AsyncRmmClient",
    "DeleteUserResult",
    "Feedback",
    "Health",
    "JobInfo",
    "MemoryInfo",
    "Neighbour",
    "Neighbours",
    "Schema",
    "XPath",
    "Query",
    "Retrieval",
    "RetrievedMemory",
    "RmmClient",
    "RmmServerError",
    "Route",
]

# The client's names for the server's answers: the same classes, not copies.
Retrieval = RetrieveResult  # .memories, .selection_id, .error (one query of a batch that failed)
RetrievedMemory = ShownMemory  # .index (what the LLM cites it by), .id, .text, .score, ...
Feedback = FeedbackResult
MemoryInfo = MemoryOut
JobInfo = JobOut  # .job_id, .status, .finished, .result
DeleteUserResult = DeleteUserOut
Health = HealthOut
Neighbours = NeighboursResult  # .memories (each a Neighbour), .selection_id, .explore, .unvisited
Neighbour = ShownNeighbour  # .index, .id, .text, .score, .edges (label, direction, evidence), .participants
Schema = TreeSchema  # .types (count, attributes, children), .roots, .nodes, .text (for a prompt)
XPath = XPathResult  # .nodes (with .weight), .steps, .memories (each a RetrievedMemory), .selection_id


class RmmServerError(RmmError):
    """A request the server refused or failed: `status` (HTTP code), `code` (short name), message, and
    `errors` (the answer's details: a validation error's fields, a query's syntax error position)."""

    def __init__(self, status: int, message: str, code: str = "", errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(f"HTTP {status}{f' {code}' if code else ''}: {message}")
        self.status, self.message, self.code = status, message, code
        self.errors: list[dict[str, Any]] = list(errors or [])


# ---- the routes the client calls ----------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    """One route as the client calls it: method, path template, the model its body must satisfy
    (None: no body) and the model its answer is parsed into."""

    method: str
    path: str
    body: type[BaseModel] | None
    answer: type

    @cached_property
    def _adapter(self) -> TypeAdapter[Any]:
        return TypeAdapter(self.answer)  # built on first use: agents pay only for the routes they call

    def url(self, **params: str) -> str:
        """The path with each parameter percent-encoded (a user id may hold any character but '/')."""
        return self.path.format(**{name: quote(value, safe="") for name, value in params.items()})

    def parse(self, content: bytes) -> Any:
        """The answer's JSON as `answer` (pydantic validation: a field the client does not know is
        ignored, a missing or mistyped one is an error rather than a silent default)."""
        return self._adapter.validate_json(content)


USER = f"{API_PREFIX}/users/{{user}}"
ROUTES: dict[str, Route] = {
    "health": Route("GET", "/health", None, HealthOut),
    "users": Route("GET", f"{API_PREFIX}/users", None, UsersOut),
    "add_memories": Route("POST", f"{USER}/memories", AddMemoriesIn, AddMemoriesOut),
    "memories": Route("GET", f"{USER}/memories", None, MemoriesOut),
    "delete_memory": Route("DELETE", f"{USER}/memories/{{memory_id}}", None, DeleteMemoryOut),
    "delete_user": Route("DELETE", USER, None, DeleteUserOut),
    "add_turns": Route("POST", f"{USER}/turns", AddTurnsIn, AddTurnsOut),
    "end_session": Route("POST", f"{USER}/sessions/end", EndSessionIn, JobOut),
    "add_session": Route("POST", f"{USER}/sessions", AddSessionIn, JobOut),
    "job": Route("GET", f"{API_PREFIX}/jobs/{{job_id}}", None, JobOut),
    "retrieve": Route("POST", f"{API_PREFIX}/retrieve", RetrieveIn, RetrieveOut),
    "feedback": Route("POST", f"{API_PREFIX}/feedback", FeedbackIn, FeedbackResult),
    "neighbours": Route("POST", f"{USER}/events/{{event_id}}/neighbours", NeighboursIn, NeighboursResult),
    "schema": Route("GET", f"{USER}/schema", None, TreeSchema),
    "xpath": Route("POST", f"{USER}/xpath", XPathIn, XPathResult),
    "tree": Route("GET", f"{USER}/tree", None, TreeOut),
    "add_nodes": Route("POST", f"{USER}/tree/nodes", AddNodesIn, TreeWriteOut),
    "edit_nodes": Route("PATCH", f"{USER}/tree/nodes", EditNodesIn, TreeWriteOut),
    "remove_node": Route("DELETE", f"{USER}/tree/nodes/{{node_id}}", None, RemoveNodeOut),
    "ope": Route("GET", f"{API_PREFIX}/ope", None, ShadowOut),
    "promote": Route("POST", f"{API_PREFIX}/reranker/promote", None, ShadowOut),
}


# ---- shared request building --------------------------------------------------------------------
@dataclass
class Query:
    """One query of `retrieve`, positional for brevity (`Query("alice", "hiking?", m=3)`); its
    fields are `QueryIn`'s."""

    user: str
    query: str
    k: int | None = None
    m: int | None = None
    explore: bool | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"user": self.user, "query": self.query}
        for name in ("k", "m", "explore"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def _given(model: BaseModel) -> dict[str, Any]:
    """A request model as JSON, with only the fields the caller set (the server fills defaults)."""
    return model.model_dump(mode="json", exclude_unset=True)


def _query_json(query: Query | QueryIn | dict[str, Any]) -> dict[str, Any]:
    """A query as the API takes it: a `Query`, a `QueryIn`, or a plain dict with the same fields.
    Values are not checked here: the server refuses a bad one with its 422 message."""
    if isinstance(query, Query):
        return query.to_json()
    if isinstance(query, QueryIn):
        return _given(query)
    if isinstance(query, dict):
        return Query(**query).to_json()  # a misspelt field is a TypeError here, not a 422 later
    raise TypeError(f"a query is a Query, a QueryIn or a dict of its fields, got {type(query).__name__}")


def _memory_json(memory: str | MemoryIn | dict[str, Any]) -> dict[str, Any]:
    if isinstance(memory, str):
        return {"text": memory}
    return _given(memory) if isinstance(memory, MemoryIn) else dict(memory)


def _turn_json(turn: tuple[str, str] | TurnIn | dict[str, Any]) -> dict[str, Any]:
    if isinstance(turn, TurnIn):
        return _given(turn)
    if isinstance(turn, dict):
        return dict(turn)
    speaker, text = turn
    return {"speaker": speaker, "text": text}


def _feedback_json(selection_id: str, cited: list[int] | None, text: str | None, no_cite: bool,
                   structured: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"selection_id": selection_id, "no_cite": no_cite, "structured": structured}
    if cited is not None:
        body["cited"] = list(cited)
    if text is not None:
        body["text"] = text
    return body


def _neighbours_json(query: str, m: int | None, visited: list[str] | None, explore: bool | None,
                    direction: str | None, label: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"query": query}
    for name, value in (("m", m), ("visited", None if visited is None else list(visited)), ("explore", explore),
                        ("direction", direction), ("label", label)):
        if value is not None:
            body[name] = value
    return body


def _xpath_json(query: str, question: str | None, k: int | None, m: int | None, explore: bool | None,
                scorer: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"query": query}
    for name, value in (("question", question), ("k", k), ("m", m), ("explore", explore), ("scorer", scorer)):
        if value is not None:
            body[name] = value
    return body


def _nodes_json(nodes: list[NodeIn | dict[str, Any]]) -> dict[str, Any]:
    return {"nodes": [_given(n) if isinstance(n, NodeIn) else dict(n) for n in nodes]}


def _edits_json(edits: list[NodeEditIn | dict[str, Any]]) -> dict[str, Any]:
    """Only the fields each edit sets: a field sent changes (`parent: None` moves the node under the root)."""
    return {"edits": [_given(e) if isinstance(e, NodeEditIn) else dict(e) for e in edits]}


def _as_of(as_of: int | None) -> dict[str, Any] | None:
    return None if as_of is None else {"as_of": as_of}


def _session_json(turns: list[tuple[str, str] | TurnIn | dict[str, Any]], session_id: str | None, time: str | None,
                  speakers: list[str] | None, store_turns: bool) -> dict[str, Any]:
    return {"turns": [_turn_json(t) for t in turns], "session_id": session_id, "time": time, "speakers": speakers,
            "store_turns": store_turns}


def _check(response: httpx.Response) -> None:
    if response.is_success:
        return
    errors: list[dict[str, Any]] = []
    try:
        body = response.json()
        message, code = str(body.get("detail", body)), str(body.get("code", ""))
        if isinstance(body.get("errors"), list):
            errors = [e for e in body["errors"] if isinstance(e, dict)]
    except (ValueError, AttributeError):
        message, code = response.text or response.reason_phrase, ""
    raise RmmServerError(response.status_code, message, code, errors)


def _headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


def _unreachable(base_url: object, exc: httpx.TransportError) -> RmmServerError:
    return RmmServerError(0, f"cannot reach the rmm server at {base_url}: {exc}", "unreachable")


# ---- the clients --------------------------------------------------------------------------------
Memories = list[str | MemoryIn | dict[str, Any]]
Turns = list[tuple[str, str] | TurnIn | dict[str, Any]]
Queries = list[Query | QueryIn | dict[str, Any]]


class RmmClient:
    """Blocking client; thread-safe (httpx connection pool). Use as a context manager or `close()`."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self._http = httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=timeout, transport=transport)

    def _call(self, name: str, body: dict[str, Any] | None = None, *, query: dict[str, Any] | None = None,
              **params: str) -> Any:
        route = ROUTES[name]
        try:
            response = self._http.request(route.method, route.url(**params), json=body, params=query)
        except httpx.TransportError as exc:
            raise _unreachable(self._http.base_url, exc) from exc
        _check(response)
        return route.parse(response.content)

    def health(self) -> Health:
        return self._call("health")

    def users(self) -> list[str]:
        return self._call("users").users

    def add_memories(self, user: str, memories: Memories) -> list[str]:
        """Store memories (text, `MemoryIn`, or dicts with text/kind/id/refs/source_text/time); returns their ids."""
        return self._call("add_memories", {"memories": [_memory_json(m) for m in memories]}, user=user).ids

    def memories(self, user: str) -> list[MemoryInfo]:
        return self._call("memories", user=user).memories

    def delete_memory(self, user: str, memory_id: str) -> int:
        """Returns how many pending selections that showed it were dropped (always 0: they keep their vectors)."""
        return self._call("delete_memory", user=user, memory_id=memory_id).selections_dropped

    def delete_user(self, user: str) -> DeleteUserResult:
        return self._call("delete_user", user=user)

    def add_turns(self, user: str, turns: Turns) -> list[str]:
        """Append `(speaker, text)` turns to the user's open session; returns the turn ids."""
        return self._call("add_turns", {"turns": [_turn_json(t) for t in turns]}, user=user).turn_ids

    def end_session(self, user: str, *, speakers: list[str] | None = None, store_turns: bool = False) -> JobInfo:
        return self._call("end_session", {"speakers": speakers, "store_turns": store_turns}, user=user)

    def add_session(self, user: str, turns: Turns, *, session_id: str | None = None, time: str | None = None,
                    speakers: list[str] | None = None, store_turns: bool = False) -> JobInfo:
        return self._call("add_session", _session_json(turns, session_id, time, speakers, store_turns), user=user)

    def job(self, job_id: str) -> JobInfo:
        return self._call("job", job_id=job_id)

    def wait_job(self, job_id: str, timeout: float = 120.0, poll: float = 0.1) -> JobInfo:
        """Poll until the job is done, failed or cancelled (TimeoutError after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.finished:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.status} after {timeout} s")
            time.sleep(poll)

    def retrieve(self, queries: Queries) -> list[Retrieval]:
        """Memories for each query (`Query`, `QueryIn` or dicts `{user, query, k?, m?, explore?}`)."""
        return self._call("retrieve", {"queries": [_query_json(q) for q in queries]}).results

    def retrieve_one(self, user: str, query: str, **options: Any) -> Retrieval:
        (result,) = self.retrieve([Query(user, query, **options)])
        return result

    def feedback(self, selection_id: str, *, cited: list[int] | None = None, text: str | None = None,
                 no_cite: bool = False, structured: bool = False) -> Feedback:
        """Exactly one of: `cited` indices, the LLM's raw reply `text`, or `no_cite=True`."""
        return self._call("feedback", _feedback_json(selection_id, cited, text, no_cite, structured))

    def neighbours(self, user: str, event_id: str, query: str, *, m: int | None = None,
                   visited: list[str] | None = None, explore: bool | None = None, direction: str | None = None,
                   label: str | None = None) -> Neighbours:
        """A slate of the event's unvisited neighbours for `query` (a Gumbel top-`m` when more are
        left); send what your explorer kept to `feedback(result.selection_id, cited=[...])`."""
        return self._call("neighbours", _neighbours_json(query, m, visited, explore, direction, label), user=user,
                          event_id=event_id)

    def schema(self, user: str) -> Schema:
        """Σ of the user's tree: node types, attributes, parent → child pairs, counts (`.text` for a prompt)."""
        return self._call("schema", user=user)

    def xpath(self, user: str, query: str, *, question: str | None = None, k: int | None = None,
              m: int | None = None, explore: bool | None = None, scorer: str | None = None) -> XPath:
        """Execute a Semantic XPath query over the user's tree: the best nodes, each step's scores, and
        a slate of the best leaves' memories; send its citations to `feedback(result.selection_id, ...)`."""
        return self._call("xpath", _xpath_json(query, question, k, m, explore, scorer), user=user)

    def tree(self, user: str, *, as_of: int | None = None) -> TreeOut:
        """The user's tree (latest versions, or as of a generation)."""
        return self._call("tree", query=_as_of(as_of), user=user)

    def add_nodes(self, user: str, nodes: list[NodeIn | dict[str, Any]]) -> TreeWriteOut:
        """Add tree nodes (`NodeIn` or dicts of its fields), all or nothing."""
        return self._call("add_nodes", _nodes_json(nodes), user=user)

    def edit_nodes(self, user: str, edits: list[NodeEditIn | dict[str, Any]]) -> TreeWriteOut:
        """Write each node's next version with the fields given (`NodeEditIn` or dicts)."""
        return self._call("edit_nodes", _edits_json(edits), user=user)

    def remove_node(self, user: str, node_id: str) -> RemoveNodeOut:
        """Remove a node and its subtree from the latest tree (history kept)."""
        return self._call("remove_node", user=user, node_id=node_id)

    def ope(self) -> ShadowOut:
        """The shadow reranker's off-policy estimate against the live one (an admin tenant's key)."""
        return self._call("ope")

    def promote(self) -> ShadowOut:
        """Serve the shadow's weights if the evidence clears the bar; a refusal raises (409, both figures)."""
        return self._call("promote")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRmmClient:
    """The same API for asyncio agents: every method is a coroutine."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None, max_connections: int = 100) -> None:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(base_url=base_url, headers=_headers(api_key), timeout=timeout,
                                       transport=transport, limits=limits)

    async def _call(self, name: str, body: dict[str, Any] | None = None, *, query: dict[str, Any] | None = None,
                    **params: str) -> Any:
        route = ROUTES[name]
        try:
            response = await self._http.request(route.method, route.url(**params), json=body, params=query)
        except httpx.TransportError as exc:
            raise _unreachable(self._http.base_url, exc) from exc
        _check(response)
        return route.parse(response.content)

    async def health(self) -> Health:
        return await self._call("health")

    async def users(self) -> list[str]:
        return (await self._call("users")).users

    async def add_memories(self, user: str, memories: Memories) -> list[str]:
        return (await self._call("add_memories", {"memories": [_memory_json(m) for m in memories]}, user=user)).ids

    async def memories(self, user: str) -> list[MemoryInfo]:
        return (await self._call("memories", user=user)).memories

    async def delete_memory(self, user: str, memory_id: str) -> int:
        return (await self._call("delete_memory", user=user, memory_id=memory_id)).selections_dropped

    async def delete_user(self, user: str) -> DeleteUserResult:
        return await self._call("delete_user", user=user)

    async def add_turns(self, user: str, turns: Turns) -> list[str]:
        return (await self._call("add_turns", {"turns": [_turn_json(t) for t in turns]}, user=user)).turn_ids

    async def end_session(self, user: str, *, speakers: list[str] | None = None, store_turns: bool = False) -> JobInfo:
        return await self._call("end_session", {"speakers": speakers, "store_turns": store_turns}, user=user)

    async def add_session(self, user: str, turns: Turns, *, session_id: str | None = None, time: str | None = None,
                          speakers: list[str] | None = None, store_turns: bool = False) -> JobInfo:
        return await self._call("add_session", _session_json(turns, session_id, time, speakers, store_turns),
                                user=user)

    async def job(self, job_id: str) -> JobInfo:
        return await self._call("job", job_id=job_id)

    async def wait_job(self, job_id: str, timeout: float = 120.0, poll: float = 0.1) -> JobInfo:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            info = await self.job(job_id)
            if info.finished:
                return info
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"job {job_id} still {info.status} after {timeout} s")
            await asyncio.sleep(poll)

    async def retrieve(self, queries: Queries) -> list[Retrieval]:
        return (await self._call("retrieve", {"queries": [_query_json(q) for q in queries]})).results

    async def retrieve_one(self, user: str, query: str, **options: Any) -> Retrieval:
        (result,) = await self.retrieve([Query(user, query, **options)])
        return result

    async def feedback(self, selection_id: str, *, cited: list[int] | None = None, text: str | None = None,
                       no_cite: bool = False, structured: bool = False) -> Feedback:
        return await self._call("feedback", _feedback_json(selection_id, cited, text, no_cite, structured))

    async def neighbours(self, user: str, event_id: str, query: str, *, m: int | None = None,
                         visited: list[str] | None = None, explore: bool | None = None,
                         direction: str | None = None, label: str | None = None) -> Neighbours:
        return await self._call("neighbours", _neighbours_json(query, m, visited, explore, direction, label),
                                user=user, event_id=event_id)

    async def schema(self, user: str) -> Schema:
        return await self._call("schema", user=user)

    async def xpath(self, user: str, query: str, *, question: str | None = None, k: int | None = None,
                    m: int | None = None, explore: bool | None = None, scorer: str | None = None) -> XPath:
        return await self._call("xpath", _xpath_json(query, question, k, m, explore, scorer), user=user)

    async def tree(self, user: str, *, as_of: int | None = None) -> TreeOut:
        return await self._call("tree", query=_as_of(as_of), user=user)

    async def add_nodes(self, user: str, nodes: list[NodeIn | dict[str, Any]]) -> TreeWriteOut:
        return await self._call("add_nodes", _nodes_json(nodes), user=user)

    async def edit_nodes(self, user: str, edits: list[NodeEditIn | dict[str, Any]]) -> TreeWriteOut:
        return await self._call("edit_nodes", _edits_json(edits), user=user)

    async def remove_node(self, user: str, node_id: str) -> RemoveNodeOut:
        return await self._call("remove_node", user=user, node_id=node_id)

    async def ope(self) -> ShadowOut:
        return await self._call("ope")

    async def promote(self) -> ShadowOut:
        return await self._call("promote")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
