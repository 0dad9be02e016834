"""`rmm serve` under hostile input and failure, on both stores (SQLite folder, embedded PostgreSQL).

One rule for both stores: what one refuses the other refuses alike, at the edge (422), and no
input answers a 5xx. A failed request leaves its keep-alive connection usable, one session gives
one reflection job, a memory deleted during a retrieve drops out of it, and each query of a batch
is answered on its own.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fakes import BagOfWordsEncoder
from fastapi.testclient import TestClient

from rmm.serve.app import create_app
from rmm.serve.config import load_config

ALPHA = "key-alpha-123"
A = {"Authorization": f"Bearer {ALPHA}"}
FACTS = ["Ana hikes mountain trails every weekend", "Ana bakes sourdough bread on Sundays",
         "Ana plays cello in a community orchestra", "Ana adopted a golden retriever puppy",
         "Ana works as a nurse at the city hospital", "Ana booked a summer trip to Lisbon"]


def _truncate_server_tables(url: str) -> None:
    """The server's own tables of the module's bank schema, emptied (the bank itself is reset by `pg_url`)."""
    import psycopg

    from rmm.memory.pg_connect import parse_location

    location = parse_location(url)
    with psycopg.connect(location.conninfo, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_tables WHERE schemaname = %s AND tablename = 'jobs'",
                              (location.schema,)).fetchone()
        if exists:
            conn.execute(f"TRUNCATE {location.schema}.feedback, {location.schema}.selections, {location.schema}.jobs, "
                         f"{location.schema}.reranker_versions RESTART IDENTITY")


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest) -> str | None:
    """None for the SQLite folder, else the embedded PostgreSQL bank's URL."""
    if request.param == "sqlite":
        return None
    url = request.getfixturevalue("pg_url")
    _truncate_server_tables(url)
    return url


def make_app(tmp_path: Path, store: str | None, **overrides: Any):
    settings: dict[str, Any] = {"bank": str(tmp_path / "bank"), "auth.keys": {ALPHA: "alpha"}, "device": "cpu",
                                **overrides}
    if store:
        settings["store"] = store
    return create_app(load_config(None, settings, environ={}), encoder=BagOfWordsEncoder())


@pytest.fixture
def client(tmp_path: Path, store: str | None) -> Iterator[TestClient]:
    with TestClient(make_app(tmp_path, store), raise_server_exceptions=False) as c:
        assert c.post("/v1/users/ana/memories", json={"memories": [{"text": t} for t in FACTS]},
                      headers=A).status_code == 201
        yield c


def assert_error(response: httpx.Response, status: int, *, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.text
    body = response.json()
    assert isinstance(body["detail"], str) and isinstance(body["code"], str), body
    if code is not None:
        assert body["code"] == code, body
    return body



def cite_first_shown(client: TestClient, selection_id: str, step: int) -> Any:
    """Feedback citing the first memory of an explored selection of tenant alpha, checked: +1 for it
    and −1 for the other shown, learned at once (on PostgreSQL the learner replica applies it later);
    returns the pending selection as stored, for the caller to check it was kept as sampled."""
    service = client.app.state.service
    result = client.post("/v1/feedback", json={"selection_id": selection_id, "cited": [0]}, headers=A).json()
    assert result["learned"] and result["rewards"] == [1.0, -1.0]
    deferred = service.feedback_learner.deferred  # PostgreSQL: the learner replica applies it
    assert result["updated"] != deferred
    if not deferred:
        assert service.learner("alpha").stats.step == step + 1
    (pending, _), = service.selections.rewarded("alpha", 0.0, 10)
    return pending

# ---- 1. NUL: refused at the edge by both stores -------------------------------------------------
NUL_REQUESTS = [
    ("POST", "/v1/users/ana/memories", {"memories": [{"text": "nul\u0000byte"}]}),
    ("POST", "/v1/users/ana/memories", {"memories": [{"text": "ok", "id": "a\u0000b"}]}),
    ("POST", "/v1/users/ana/memories", {"memories": [{"text": "ok", "source_text": "a\u0000b"}]}),
    ("POST", "/v1/users/ana/memories", {"memories": [{"text": "ok", "refs": ["a\u0000b"]}]}),
    ("POST", "/v1/users/ana/memories", {"memories": [{"text": "ok", "time": "a\u0000b"}]}),
    ("POST", "/v1/retrieve", {"queries": [{"user": "ana", "query": "tea\u0000"}]}),
    ("POST", "/v1/retrieve", {"queries": [{"user": "a\u0000na", "query": "tea"}]}),
    ("POST", "/v1/feedback", {"selection_id": "s\u0000", "cited": [0]}),
    ("POST", "/v1/feedback", {"selection_id": "s", "text": "cited [0]\u0000"}),
    ("POST", "/v1/users/ana/turns", {"turns": [{"speaker": "ana", "text": "I like\u0000 tea"}]}),
    ("POST", "/v1/users/ana/turns", {"turns": [{"speaker": "a\u0000na", "text": "I like tea"}]}),
    ("POST", "/v1/users/ana/sessions", {"turns": [{"speaker": "ana", "text": "tea"}], "session_id": "s\u0000"}),
    ("POST", "/v1/users/ana/sessions", {"turns": [{"speaker": "ana", "text": "tea", "id": "t\u0000"}]}),
    ("POST", "/v1/users/ana/sessions", {"turns": [{"speaker": "ana", "text": "tea"}], "speakers": ["a\u0000"]}),
    ("POST", "/v1/users/ana/sessions/end", {"speakers": ["a\u0000"]}),
    ("GET", "/v1/jobs/a%00b", None),
    ("DELETE", "/v1/users/ana/memories/a%00b", None),
    ("GET", "/v1/users/a%00b/memories", None),
]


def test_nul_anywhere_is_refused_with_422_on_both_stores_and_sessions_still_end(client: TestClient) -> None:
    for method, path, body in NUL_REQUESTS:
        response = client.request(method, path, json=body, headers=A)
        assert_error(response, 422)
        assert "NUL" in response.json()["detail"] or "pattern" in response.json()["detail"], (path, response.json())
    assert client.post("/v1/users/ana/turns", json={"turns": [{"speaker": "ana", "text": "I like tea"}]},
                       headers=A).status_code == 201
    ended = client.post("/v1/users/ana/sessions/end", headers=A)
    assert ended.status_code == 202
    job_id = ended.json()["job_id"]
    deadline = time.monotonic() + 30  # the reflection job runs in the background: wait for it to finish
    while (job := client.get(f"/v1/jobs/{job_id}", headers=A).json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.02)
    assert job["status"] == "done", job
    stored = client.get("/v1/users/ana/memories", headers=A).json()["memories"]
    assert not any("\x00" in m["text"] for m in stored)
    assert len([m for m in stored if m["kind"] != "topic"]) == len(FACTS)  # no NUL memory got in


# ---- 2. a 500 keeps the connection and the contract ---------------------------------------------
class _Server:
    """The app under uvicorn on a free local port, in a thread (a real keep-alive connection)."""

    def __init__(self, app: Any, **config: Any) -> None:
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical",
                                                    **config))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(20)


def _exchange(sock: socket.socket, request: bytes) -> tuple[int, bytes]:
    """Send one HTTP/1.1 request on an open socket and read its answer (status, body); (0, b"")
    when the server closed the connection instead."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split(b" ", 2)[1]), body


def test_an_unexpected_error_answers_the_contracts_500_and_keeps_the_connection(tmp_path: Path) -> None:
    app = make_app(tmp_path, None)

    def broken(tenant: str) -> list[str]:
        raise RuntimeError("a bug, with secrets in its message")

    app.state.service.users = broken
    request = f"GET /v1/users HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALPHA}\r\n\r\n".encode()
    with _Server(app) as base, socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=10) as sock:
        status, body = _exchange(sock, request)
        assert status == 500 and json.loads(body) == {"detail": "internal error: RuntimeError", "code": "internal"}
        # the next request on the same keep-alive connection is answered (the server closed it before)
        status, body = _exchange(sock, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200, body


def test_a_request_that_breaks_http_gets_the_contracts_json_too(tmp_path: Path) -> None:
    """uvicorn answers an unparseable request before the app sees it; rmm serve's protocol class
    (`rmm.serve.http_protocol`) makes that answer the contract's JSON."""
    from rmm.serve.http_protocol import MALFORMED_CODE, json_error_protocol

    request = b"POST /v1/users/ana/memories HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n"
    with _Server(make_app(tmp_path, None), http=json_error_protocol()) as base, \
            socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):  # the server closes the connection: the stream's framing is lost
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), head
    answer = json.loads(body)
    assert answer["code"] == MALFORMED_CODE and answer["detail"].startswith("malformed HTTP request: ")


# ---- 3. one session, one job --------------------------------------------------------------------
def test_concurrent_session_ends_queue_one_job_on_both_stores(client: TestClient) -> None:
    assert client.post("/v1/users/sam/turns", json={"turns": [{"speaker": "sam", "text": "I love green tea"}]},
                       headers=A).status_code == 201

    async def end_three() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=A) as http:
            return list(await asyncio.gather(*(http.post("/v1/users/sam/sessions/end") for _ in range(3))))

    responses = asyncio.run(end_three())
    accepted = [r.json()["job_id"] for r in responses if r.status_code == 202]
    assert len(set(accepted)) == 1, [r.json() for r in responses]
    for r in responses:
        if r.status_code != 202:
            assert_error(r, 404, code="no_open_session")
    counts = client.app.state.service.jobs.counts()  # read once: a worker may move the job meanwhile
    assert sum(counts.values()) == 1, counts


def test_the_database_allows_one_job_per_session_across_replicas(pg_url: str) -> None:
    from rmm.memory.pg_database import PgDatabase
    from rmm.serve.pg_jobs import PgJobQueue

    _truncate_server_tables(pg_url)
    one, two = PgDatabase(pg_url), PgDatabase(pg_url)
    try:
        payload = {"session": {"id": "sam:s1", "time": None, "turns": []}, "speakers": None, "store_turns": False}
        replicas = [PgJobQueue(db, lambda job, p: {}) for db in (one, two)]
        jobs = [queue.submit("alpha", "alpha:sam", "reflect", payload) for queue in replicas]
        assert jobs[0].id == jobs[1].id  # the second insert conflicts and answers the first job
        assert replicas[0].counts() == {"queued": 1}
        other = replicas[1].submit("alpha", "alpha:sam", "reflect", {**payload, "session": {"id": "sam:s2"}})
        assert other.id != jobs[0].id and replicas[0].counts() == {"queued": 2}
        replicas[0].cancel_user("alpha:sam")  # a cancelled job no longer holds its session
        again = replicas[0].submit("alpha", "alpha:sam", "reflect", payload)
        assert again.id not in (jobs[0].id, other.id)
    finally:
        one.close()
        two.close()


def test_a_whole_session_posted_twice_queues_one_job_on_sqlite_too(tmp_path: Path) -> None:
    """The SQLite queue enforces one job per session in the database, like PostgreSQL's migration
    0005; a queue file an older rmm left with duplicates keeps the oldest job of each session."""
    import sqlite3

    from rmm.serve.jobs import JobQueue

    payload = {"session": {"id": "sam:s1", "time": None, "turns": []}, "speakers": None, "store_turns": False}
    path = tmp_path / "jobs.sqlite"
    jobs = JobQueue(path, lambda job, p: {})
    first, second = (jobs.submit("alpha", "alpha:sam", "reflect", payload) for _ in range(2))
    assert first.id == second.id and jobs.counts() == {"queued": 1}
    other = jobs.submit("alpha", "alpha:sam", "reflect", {**payload, "session": {"id": "sam:s2"}})
    assert other.id != first.id and jobs.counts() == {"queued": 2}
    jobs.cancel_user("alpha:sam")  # a cancelled job no longer holds its session
    again = jobs.submit("alpha", "alpha:sam", "reflect", payload)
    assert again.id not in (first.id, other.id)
    jobs.close()
    # a file written before the index existed, holding two jobs of one session
    old = tmp_path / "old.sqlite"
    with sqlite3.connect(old) as conn:
        conn.executescript("CREATE TABLE jobs (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, user_id TEXT NOT NULL, "
                           "kind TEXT NOT NULL, payload TEXT NOT NULL, status TEXT NOT NULL, created_at REAL NOT NULL, "
                           "started_at REAL, finished_at REAL, result TEXT, error TEXT)")
        for job_id, created in (("older", 1.0), ("newer", 2.0)):
            conn.execute("INSERT INTO jobs VALUES (?, 'alpha', 'alpha:sam', 'reflect', ?, 'queued', ?, NULL, NULL, "
                         "NULL, NULL)", (job_id, json.dumps(payload), created))
    upgraded = JobQueue(old, lambda job, p: {})
    assert upgraded.get("alpha", "older").status == "queued" and upgraded.get("alpha", "newer").status == "cancelled"
    assert upgraded.submit("alpha", "alpha:sam", "reflect", payload).id == "older"
    upgraded.close()


# ---- 4. a memory deleted during a retrieve ------------------------------------------------------
def test_a_memory_deleted_during_a_retrieve_is_dropped_not_an_error(client: TestClient) -> None:
    service = client.app.state.service
    bank = service.bank
    real_get = bank.get
    deleted: list[str] = []

    def get_after_a_delete(user: str, ids: list[str]):
        if not deleted:  # another request deletes one of the shown memories between search and read
            victim = ids[0]
            service.delete_memory("alpha", "ana", victim)
            deleted.append(victim)
        return real_get(user, ids)

    bank.get = get_after_a_delete
    try:
        response = client.post("/v1/retrieve", json={"queries": [{"user": "ana", "query": "trails hiking cello",
                                                                   "k": 6, "m": 3}]}, headers=A)
    finally:
        bank.get = real_get
    assert response.status_code == 200, response.json()
    (result,) = response.json()["results"]
    assert deleted and deleted[0] not in [m["id"] for m in result["memories"]]
    if result["memories"]:  # the picks before the deleted one are shown, and their feedback learns
        feedback = client.post("/v1/feedback", json={"selection_id": result["selection_id"], "cited": [0]},
                               headers=A)
        assert feedback.status_code == 200, feedback.json()


# ---- 5. one bad query of a batch ----------------------------------------------------------------
def test_each_query_of_a_batch_gets_its_own_result_or_error(client: TestClient) -> None:
    response = client.post("/v1/retrieve", json={"queries": [{"user": "ana", "query": "tea"},
                                                             {"user": "nobody", "query": "tea"},
                                                             {"user": "ana", "query": "cello"}]}, headers=A)
    assert response.status_code == 200, response.json()
    good, bad, third = response.json()["results"]
    assert good["error"] is None and good["memories"] and good["selection_id"]
    assert third["error"] is None and third["memories"]
    assert bad["memories"] == [] and bad["selection_id"] is None and bad["user"] == "nobody"
    assert bad["error"]["status"] == 404 and bad["error"]["code"] == "unknown_user"
    assert "nobody" in bad["error"]["detail"]
    # a request whose every query fails answers as before: the (first) error as a whole
    alone = client.post("/v1/retrieve", json={"queries": [{"user": "nobody", "query": "tea"}]}, headers=A)
    assert_error(alone, 404, code="unknown_user")


# ---- 7. ids that are not what they seem ---------------------------------------------------------
def test_non_utf8_paths_and_trailing_slashes_get_json_errors_not_redirects(client: TestClient) -> None:
    for method, path in [("POST", "/v1/users/%ff/memories"), ("GET", "/v1/users/%fe/memories"),
                         ("DELETE", "/v1/users/ana/memories/%c3%28"), ("GET", "/v1/jobs/%80")]:
        body = {"memories": [{"text": "x"}]} if method == "POST" else None
        assert "UTF-8" in assert_error(client.request(method, path, json=body, headers=A), 422)["detail"]
    assert client.get("/v1/users", headers=A).json()["users"] == ["ana"]
    for path in ("/v1/users/zzz/", "/v1/users/", "/v1/retrieve/"):
        response = client.request("DELETE" if path.count("/") == 4 else "POST", path,
                                  headers={**A, "Host": "evil.example"}, follow_redirects=False)
        assert response.status_code in (404, 405) and "location" not in response.headers
        assert_error(response, response.status_code)
    # a UTF-8 id percent-encoded is one user, as written
    assert client.post("/v1/users/%C3%A9lo/memories", json={"memories": [{"text": "tea"}]}, headers=A).json()["user"] == "élo"


@pytest.mark.parametrize("text", ["   ", "\u200b", "\ufeff", "\u200b\u200c\u200d\u2060", " \ufeff\t\u00ad ", "\x01\x02"])
def test_one_definition_of_empty_text(client: TestClient, text: str) -> None:
    for method, path, body in [
        ("POST", "/v1/users/ana/memories", {"memories": [{"text": text}]}),
        ("POST", "/v1/retrieve", {"queries": [{"user": "ana", "query": text}]}),
        ("POST", "/v1/users/ana/turns", {"turns": [{"speaker": "ana", "text": text}]}),
        ("POST", "/v1/users/ana/turns", {"turns": [{"speaker": text, "text": "tea"}]}),
    ]:
        assert "visible text" in assert_error(client.request(method, path, json=body, headers=A), 422)["detail"]
    assert client.post("/v1/users/ana/memories", json={"memories": [{"text": "\u200bcafé\ufeff"}]},
                       headers=A).status_code == 201


def test_a_turn_id_sent_to_turns_is_refused_not_ignored(client: TestClient) -> None:
    refused = client.post("/v1/users/ana/turns", json={"turns": [{"speaker": "ana", "text": "tea", "id": "mine"}]},
                          headers=A)
    assert "turns[0].id" in assert_error(refused, 422)["detail"]
    job = client.post("/v1/users/ana/sessions", json={"turns": [{"speaker": "ana", "text": "tea", "id": "mine"}]},
                      headers=A)
    assert job.status_code == 202  # a whole session keeps the ids it names


# ---- 8. strict, bounded input -------------------------------------------------------------------
@pytest.mark.parametrize("query", [{"k": "5"}, {"k": True}, {"k": 5.0}, {"m": "3"}, {"explore": "yes"},
                                   {"explore": 1}, {"query": 5}, {"user": 7}])
def test_request_fields_take_exactly_their_json_type(client: TestClient, query: dict[str, Any]) -> None:
    body = {"queries": [{"user": "ana", "query": "tea", **query}]}
    assert_error(client.post("/v1/retrieve", json=body, headers=A), 422, code="invalid_request")


def test_coerced_citations_and_flags_are_refused(client: TestClient) -> None:
    selection = client.post("/v1/retrieve", json={"queries": [{"user": "ana", "query": "cello"}]},
                            headers=A).json()["results"][0]["selection_id"]
    for body in ({"cited": ["0"]}, {"cited": [0.0]}, {"no_cite": "true"}, {"text": "[0]", "structured": 0}):
        assert_error(client.post("/v1/feedback", json={"selection_id": selection, **body}, headers=A), 422)
    assert client.post("/v1/feedback", json={"selection_id": selection, "cited": [0]}, headers=A).status_code == 200


def test_sizes_are_bounded_and_errors_never_echo_a_huge_input(client: TestClient) -> None:
    huge = "x" * 100_000
    for method, path, body in [
        ("POST", "/v1/feedback", {"selection_id": huge, "cited": [0]}),
        ("POST", "/v1/users/ana/sessions", {"turns": [{"speaker": "ana", "text": "tea"}], "session_id": huge}),
        ("POST", "/v1/users/ana/sessions", {"turns": [{"speaker": "ana", "text": "tea"}],
                                            "speakers": [f"s{i}" for i in range(10_000)]}),
        ("POST", "/v1/users/ana/turns", {"turns": [{"speaker": huge, "text": "tea"}]}),
        ("POST", "/v1/users/ana/memories", {"memories": [{"text": "tea", "id": huge}]}),
    ]:
        response = client.request(method, path, json=body, headers=A)
        assert response.status_code in (413, 422), (path, response.status_code)
        assert len(response.text) < 5_000, (path, len(response.text))
    # a long id that is within bounds but unknown is echoed shortened at most
    long_id = "y" * 256
    unknown = client.get(f"/v1/jobs/{long_id}", headers=A)
    assert_error(unknown, 404) and len(unknown.text) < 2_000


@pytest.mark.parametrize("reply", ["see [123456789]", "see [12345678901234567890]", "see [99999999999999999999999]"])
def test_one_rule_for_free_text_citation_numbers(client: TestClient, reply: str) -> None:
    """An index never shown — whatever its number of digits — is refused and leaves the selection open."""
    selection = client.post("/v1/retrieve", json={"queries": [{"user": "ana", "query": "cello"}]},
                            headers=A).json()["results"][0]["selection_id"]
    refused = client.post("/v1/feedback", json={"selection_id": selection, "text": reply}, headers=A)
    assert "only" in assert_error(refused, 422, code="bad_request")["detail"]
    assert client.post("/v1/feedback", json={"selection_id": selection, "cited": [0]}, headers=A).status_code == 200


# ---- 9. the SQLite learner replays what its checkpoint misses -----------------------------------
def test_feedback_after_the_last_checkpoint_is_replayed_after_a_crash(tmp_path: Path) -> None:
    from rmm.serve.records import NewMemory, RetrieveItem
    from rmm.serve.service import RetrievalService

    config = load_config(None, {"bank": str(tmp_path / "bank"), "auth.keys": {ALPHA: "alpha"}, "device": "cpu",
                                "learner": {"batch_size": 2}, "checkpoint_interval_s": 0}, environ={})

    def feedback(service: RetrievalService, queries: list[str]) -> None:
        items = [RetrieveItem(tenant="alpha", user="ana", query=q, k=6, m=3, explore=True) for q in queries]
        for n, result in enumerate(service.retrieve_batch(items)):
            service.feedback("alpha", result.selection_id, cited=[n % 3])

    crashed = RetrievalService(config, encoder=BagOfWordsEncoder())
    crashed.start()
    crashed.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
    feedback(crashed, ["hiking", "bread", "cello"])
    assert crashed.checkpoint() == 1  # a checkpoint holds these three
    feedback(crashed, ["puppy", "nurse", "Lisbon", "trails", "sourdough"])
    learner = crashed.learner("alpha")
    before = (learner.stats.step, learner.stats.records, learner.pending)
    weights = [p.detach().clone() for p in learner.reranker.parameters()]
    assert before == (4, 8, 0)
    crashed.maintenance.stop()  # kill -9: no shutdown checkpoint; the files stay as they are
    crashed.jobs.close()

    restarted = RetrievalService(config, encoder=BagOfWordsEncoder())
    restarted.start()
    try:
        again = restarted.learner("alpha")
        assert (again.stats.step, again.stats.records, again.pending) == before
        for old, new in zip(weights, again.reranker.parameters()):
            assert torch.allclose(old, new, atol=1e-6)
        restarted.checkpoint()
        assert restarted.selections.unsaved_feedback() == []  # replayed once, then held by the checkpoint
    finally:
        restarted.close()


# ---- 6. the store's outage: readiness, and answers that name no database ------------------------
def test_health_reports_an_unreachable_store_and_503s_name_no_database(client: TestClient, store: str | None) -> None:
    from rmm.memory.pg_connect import DatabaseUnavailableError

    health = client.get("/health")
    assert health.status_code == 200 and health.json()["store"] == "ok" and health.json()["status"] == "ok"
    if store is None:
        return  # a SQLite bank is a local file: nothing to be unreachable
    service = client.app.state.service
    secret = f"PostgreSQL at {store} is unreachable: connection refused"

    class Down:
        def tx(self, *args: Any, **kwargs: Any) -> Any:
            raise DatabaseUnavailableError(secret)

    real_db, real_users = service.db, service.users
    service.db = Down()
    service.users = lambda tenant: Down().tx()
    try:
        down = client.get("/health")
        assert down.status_code == 503 and down.json()["store"] == "unavailable"
        refused = client.get("/v1/users", headers=A)
        body = assert_error(refused, 503, code="database_unavailable")
        assert "postgresql://" not in refused.text and "schema" not in body["detail"] and "retry" in body["detail"]
    finally:
        service.db, service.users = real_db, real_users
    assert client.get("/health").status_code == 200
