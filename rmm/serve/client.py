"""Python clients for `rmm serve`, for agents: `RmmClient` (sync) and `AsyncRmmClient` (asyncio).

The loop an agent runs::

    with RmmClient("http://127.0.0.1:8080", api_key=KEY) as rmm:
        (hit,) = rmm.retrieve([Query("alice", "where did I go hiking?")])
        reply = my_llm(prompt_with(hit.memories))          # cite memories by their `index`
        rmm.feedback(hit.selection_id, text=reply)          # the reranker learns from the citations

Both clients share the request building and response parsing below; only the transport differs.
Every non-2xx answer raises `RmmServerError` carrying the status code and the server's message.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Self

import httpx

from rmm.errors import RmmError

__all__ = [
    "AsyncRmmClient",
    "DeleteUserResult",
    "Feedback",
    "JobInfo",
    "MemoryInfo",
    "Query",
    "Retrieval",
    "RetrievedMemory",
    "RmmClient",
    "RmmServerError",
]


class RmmServerError(RmmError):
    """A request the server refused or failed: `status` (HTTP code), `code` (short name), message."""

    def __init__(self, status: int, message: str, code: str = "") -> None:
        super().__init__(f"HTTP {status}{f' {code}' if code else ''}: {message}")
        self.status, self.message, self.code = status, message, code


# ---- typed results ------------------------------------------------------------------------------
@dataclass
class Query:
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


@dataclass
class RetrievedMemory:
    index: int  # what the LLM cites it by
    id: str
    text: str
    kind: str
    refs: list[str]
    score: float
    retriever_score: float
    time_span: tuple[str | None, str | None] | None = None


@dataclass
class Retrieval:
    user: str
    query: str
    selection_id: str | None
    explore: bool
    expires_at: float | None
    memories: list[RetrievedMemory]


@dataclass
class Feedback:
    selection_id: str
    rewards: list[float] | None
    cited: list[int] | None
    no_cite: bool
    warnings: list[str]
    updated: bool
    loss: float | None
    learner_step: int
    learner_records: int
    learned: bool = True  # False: stored only (greedy selection, or no parseable citation); see `reason`
    reason: str | None = None


@dataclass
class MemoryInfo:
    id: str
    kind: str
    text: str
    refs: list[str] = field(default_factory=list)
    source_text: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0
    time_span: tuple[str | None, str | None] | None = None


@dataclass
class JobInfo:
    job_id: str
    user: str
    kind: str
    status: str  # queued | running | done | failed | cancelled
    created_at: float
    started_at: float | None
    finished_at: float | None
    result: dict[str, Any]
    error: str | None

    @property
    def finished(self) -> bool:
        return self.status in ("done", "failed", "cancelled")


@dataclass
class DeleteUserResult:
    user: str
    memories: int
    selections: int
    session_turns: int
    jobs_cancelled: int


# ---- shared request building / response parsing ---------------------------------------------
def _span(value: Any) -> tuple[str | None, str | None] | None:
    return None if value is None else (value[0], value[1])


def _retrievals(payload: dict[str, Any]) -> list[Retrieval]:
    return [Retrieval(user=r["user"], query=r["query"], selection_id=r["selection_id"], explore=r["explore"],
                      expires_at=r["expires_at"],
                      memories=[RetrievedMemory(**{**m, "time_span": _span(m.get("time_span"))}) for m in r["memories"]])
            for r in payload["results"]]


def _query_json(query: Query | dict[str, Any]) -> dict[str, Any]:
    """A query as the API takes it: a `Query`, or a plain dict with the same fields."""
    if isinstance(query, Query):
        return query.to_json()
    if isinstance(query, dict):
        return Query(**query).to_json()  # a misspelt field is a TypeError here, not a 422 later
    raise TypeError(f"a query is a Query or a dict of its fields, got {type(query).__name__}")


def _memory_json(memory: str | dict[str, Any]) -> dict[str, Any]:
    return {"text": memory} if isinstance(memory, str) else dict(memory)


def _turn_json(turn: tuple[str, str] | dict[str, Any]) -> dict[str, Any]:
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


def _job(payload: dict[str, Any]) -> JobInfo:
    return JobInfo(**payload)


def _memories(payload: dict[str, Any]) -> list[MemoryInfo]:
    return [MemoryInfo(**{**m, "time_span": _span(m.get("time_span"))}) for m in payload["memories"]]


def _check(response: httpx.Response) -> Any:
    if response.is_success:
        return response.json()
    try:
        body = response.json()
        message, code = str(body.get("detail", body)), str(body.get("code", ""))
    except ValueError:
        message, code = response.text or response.reason_phrase, ""
    raise RmmServerError(response.status_code, message, code)


def _headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


def _path(user: str) -> str:
    from urllib.parse import quote

    return quote(user, safe="")


# ---- the clients --------------------------------------------------------------------------------
class RmmClient:
    """Blocking client; thread-safe (httpx connection pool). Use as a context manager or `close()`."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self._http = httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=timeout, transport=transport)

    def _call(self, method: str, url: str, body: Any = None) -> Any:
        try:
            response = self._http.request(method, url, json=body)
        except httpx.TransportError as exc:
            raise RmmServerError(0, f"cannot reach the rmm server at {self._http.base_url}: {exc}", "unreachable") from exc
        return _check(response)

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health")

    def users(self) -> list[str]:
        return self._call("GET", "/v1/users")["users"]

    def add_memories(self, user: str, memories: list[str | dict[str, Any]]) -> list[str]:
        """Store memories (text, or dicts with text/kind/id/refs/source_text/time); returns their ids."""
        return self._call("POST", f"/v1/users/{_path(user)}/memories",
                          {"memories": [_memory_json(m) for m in memories]})["ids"]

    def memories(self, user: str) -> list[MemoryInfo]:
        return _memories(self._call("GET", f"/v1/users/{_path(user)}/memories"))

    def delete_memory(self, user: str, memory_id: str) -> int:
        """Returns how many pending selections that showed it were dropped."""
        return self._call("DELETE", f"/v1/users/{_path(user)}/memories/{_path(memory_id)}")["selections_dropped"]

    def delete_user(self, user: str) -> DeleteUserResult:
        return DeleteUserResult(**self._call("DELETE", f"/v1/users/{_path(user)}"))

    def add_turns(self, user: str, turns: list[tuple[str, str] | dict[str, Any]]) -> list[str]:
        """Append `(speaker, text)` turns to the user's open session; returns the turn ids."""
        return self._call("POST", f"/v1/users/{_path(user)}/turns", {"turns": [_turn_json(t) for t in turns]})["turn_ids"]

    def end_session(self, user: str, *, speakers: list[str] | None = None, store_turns: bool = False) -> JobInfo:
        return _job(self._call("POST", f"/v1/users/{_path(user)}/sessions/end",
                               {"speakers": speakers, "store_turns": store_turns}))

    def add_session(self, user: str, turns: list[tuple[str, str] | dict[str, Any]], *, session_id: str | None = None,
                    time: str | None = None, speakers: list[str] | None = None, store_turns: bool = False) -> JobInfo:
        return _job(self._call("POST", f"/v1/users/{_path(user)}/sessions", {
            "turns": [_turn_json(t) for t in turns], "session_id": session_id, "time": time, "speakers": speakers,
            "store_turns": store_turns}))

    def job(self, job_id: str) -> JobInfo:
        return _job(self._call("GET", f"/v1/jobs/{_path(job_id)}"))

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

    def retrieve(self, queries: list[Query | dict[str, Any]]) -> list[Retrieval]:
        """Memories for each query (`Query` objects or dicts `{user, query, k?, m?, explore?}`)."""
        return _retrievals(self._call("POST", "/v1/retrieve", {"queries": [_query_json(q) for q in queries]}))

    def retrieve_one(self, user: str, query: str, **options: Any) -> Retrieval:
        (result,) = self.retrieve([Query(user, query, **options)])
        return result

    def feedback(self, selection_id: str, *, cited: list[int] | None = None, text: str | None = None,
                 no_cite: bool = False, structured: bool = False) -> Feedback:
        """Exactly one of: `cited` indices, the LLM's raw reply `text`, or `no_cite=True`."""
        return Feedback(**self._call("POST", "/v1/feedback", _feedback_json(selection_id, cited, text, no_cite, structured)))

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

    async def _call(self, method: str, url: str, body: Any = None) -> Any:
        try:
            response = await self._http.request(method, url, json=body)
        except httpx.TransportError as exc:
            raise RmmServerError(0, f"cannot reach the rmm server at {self._http.base_url}: {exc}", "unreachable") from exc
        return _check(response)

    async def health(self) -> dict[str, Any]:
        return await self._call("GET", "/health")

    async def users(self) -> list[str]:
        return (await self._call("GET", "/v1/users"))["users"]

    async def add_memories(self, user: str, memories: list[str | dict[str, Any]]) -> list[str]:
        return (await self._call("POST", f"/v1/users/{_path(user)}/memories",
                                 {"memories": [_memory_json(m) for m in memories]}))["ids"]

    async def memories(self, user: str) -> list[MemoryInfo]:
        return _memories(await self._call("GET", f"/v1/users/{_path(user)}/memories"))

    async def delete_memory(self, user: str, memory_id: str) -> int:
        return (await self._call("DELETE", f"/v1/users/{_path(user)}/memories/{_path(memory_id)}"))["selections_dropped"]

    async def delete_user(self, user: str) -> DeleteUserResult:
        return DeleteUserResult(**await self._call("DELETE", f"/v1/users/{_path(user)}"))

    async def add_turns(self, user: str, turns: list[tuple[str, str] | dict[str, Any]]) -> list[str]:
        return (await self._call("POST", f"/v1/users/{_path(user)}/turns",
                                 {"turns": [_turn_json(t) for t in turns]}))["turn_ids"]

    async def end_session(self, user: str, *, speakers: list[str] | None = None, store_turns: bool = False) -> JobInfo:
        return _job(await self._call("POST", f"/v1/users/{_path(user)}/sessions/end",
                                     {"speakers": speakers, "store_turns": store_turns}))

    async def add_session(self, user: str, turns: list[tuple[str, str] | dict[str, Any]], *,
                          session_id: str | None = None, time: str | None = None, speakers: list[str] | None = None,
                          store_turns: bool = False) -> JobInfo:
        return _job(await self._call("POST", f"/v1/users/{_path(user)}/sessions", {
            "turns": [_turn_json(t) for t in turns], "session_id": session_id, "time": time, "speakers": speakers,
            "store_turns": store_turns}))

    async def job(self, job_id: str) -> JobInfo:
        return _job(await self._call("GET", f"/v1/jobs/{_path(job_id)}"))

    async def wait_job(self, job_id: str, timeout: float = 120.0, poll: float = 0.1) -> JobInfo:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            info = await self.job(job_id)
            if info.finished:
                return info
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"job {job_id} still {info.status} after {timeout} s")
            await asyncio.sleep(poll)

    async def retrieve(self, queries: list[Query | dict[str, Any]]) -> list[Retrieval]:
        return _retrievals(await self._call("POST", "/v1/retrieve", {"queries": [_query_json(q) for q in queries]}))

    async def retrieve_one(self, user: str, query: str, **options: Any) -> Retrieval:
        (result,) = await self.retrieve([Query(user, query, **options)])
        return result

    async def feedback(self, selection_id: str, *, cited: list[int] | None = None, text: str | None = None,
                       no_cite: bool = False, structured: bool = False) -> Feedback:
        return Feedback(**await self._call("POST", "/v1/feedback",
                                           _feedback_json(selection_id, cited, text, no_cite, structured)))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
