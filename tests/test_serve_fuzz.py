"""Fuzzing `rmm serve`: no JSON body and no path parameter answers a 5xx, on either store.

Every route and its body schema come from the app's own OpenAPI document, so a route or field
added later is fuzzed too. Half the bodies are plausible (the schema's shape, existing ids, plain
words, an enum's values), so they pass validation and reach the handlers and the database; half
are hostile (NUL, lone surrogates, zero-width text, huge integers, unknown keys, now and then a
value of the wrong JSON type). Path segments are existing ids (a user, a memory, a selection, a
job), any text percent-encoded, or escapes that are not UTF-8. Every error must be the contract's
JSON. A few dozen examples per store by default; `--slow` runs 1,500.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serve_hardening import A, client, store  # noqa: F401  (fixtures: both stores)

FAST_EXAMPLES, SLOW_EXAMPLES = 60, 1500

HOSTILE_TEXT = ["", " ", "\u0000", "a\u0000b", "\ud800", "\udfff x", "\u200b", "\ufeff", "%ff", "%00", "..", "/",
                "a/b", "\x01\x7f", "é", "🐘", "'; DROP TABLE memories; --", "[0]", "cited [0]", "9" * 25, "x" * 300]
BIG_INTS = [0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**30]


def _json_values() -> st.SearchStrategy[Any]:
    """Any JSON value (the wrong type anywhere)."""
    leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10)
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5),
                                                                                            inner, max_size=3),
                        max_leaves=8)


def _strings(known: list[str], hostile: bool) -> st.SearchStrategy[str]:
    """An existing id or plain words (which pass validation); `hostile`: also any text and nasty strings."""
    plain = st.one_of(st.sampled_from(known), st.text(alphabet="abcdefghij ABC0123", min_size=1, max_size=20))
    if not hostile:
        return plain
    return st.one_of(plain, plain, st.sampled_from(HOSTILE_TEXT), st.text(max_size=20))


def _from_schema(schema: dict[str, Any], spec: dict[str, Any], known: list[str], hostile: bool,
                 depth: int = 0) -> st.SearchStrategy[Any]:
    """Values shaped like `schema` (an OpenAPI / JSON schema). `hostile`: nasty leaves, unknown keys
    and now and then a value of the wrong JSON type; else plausible values that reach the handlers."""
    def inner(sub: dict[str, Any]) -> st.SearchStrategy[Any]:
        return _from_schema(sub, spec, known, hostile, depth + 1)

    if "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    kind = schema.get("type")
    if "anyOf" in schema:
        shaped = st.one_of(*(_from_schema(s, spec, known, hostile, depth) for s in schema["anyOf"]))
    elif kind == "object" and depth < 4:
        props, required = schema.get("properties", {}), set(schema.get("required", []))
        needed = {name: inner(s) for name, s in props.items() if name in required}
        optional = {name: inner(s) for name, s in props.items() if name not in required}
        shaped = st.fixed_dictionaries(needed, optional=optional)
        if optional:  # also exactly one optional field (as `feedback` wants one of cited / text / no_cite)
            one = st.sampled_from(sorted(optional)).flatmap(
                lambda name: st.fixed_dictionaries({**needed, name: optional[name]}))
            shaped = st.one_of(shaped, one)
        if hostile:  # sometimes a key the schema does not know
            extra = st.tuples(shaped, st.text(max_size=8), _json_values()).map(lambda t: {**t[0], t[1] or "x": t[2]})
            shaped = st.one_of(shaped, shaped, extra)
    elif kind == "array" and depth < 4:
        shaped = st.lists(inner(schema.get("items", {})), min_size=0 if hostile else 1, max_size=3)
    elif kind == "string":
        choices = re.search(r"one of (\[[^]]*\])", schema.get("description", ""))  # e.g. a memory's kind
        shaped = _strings(known, hostile)
        if choices:
            shaped = st.one_of(st.sampled_from(ast.literal_eval(choices.group(1))), shaped)
    elif kind == "integer":
        shaped = st.integers(0, 6) if not hostile else st.one_of(st.integers(0, 6), st.sampled_from(BIG_INTS),
                                                                 st.integers())
    elif kind == "number":
        shaped = st.floats(allow_nan=False)
    elif kind == "boolean":
        shaped = st.booleans()
    elif kind == "null":
        shaped = st.none()
    else:
        shaped = _json_values()
    return st.one_of(*[shaped] * 6, _json_values()) if hostile else shaped


def _segments(known: list[str]) -> st.SearchStrategy[str]:
    """A path segment: an existing id or any text, percent-encoded; or a raw, possibly non-UTF-8, escape."""
    # a lone surrogate quoted with surrogatepass is bytes that are not UTF-8
    encoded = _strings(known, hostile=True).map(lambda s: quote(s, safe="", errors="surrogatepass"))
    raw = st.sampled_from(["%ff", "%fe%ff", "%c3%28", "%00", "%2F", "%2e%2e", "a%20b", "%C3%A9lo"])
    return st.one_of(st.sampled_from(known), st.sampled_from(known), encoded, raw)


def _known_ids(client: TestClient) -> list[str]:  # noqa: F811  (the fixture's name)
    """Ids that exist: users, memories, open selections and a job, so fuzzed requests reach rows."""
    memories = [m["id"] for m in client.get("/v1/users/ana/memories", headers=A).json()["memories"]]
    queries = [{"user": "ana", "query": q} for q in ("cello", "tea", "trip")]
    shown = client.post("/v1/retrieve", json={"queries": queries}, headers=A)
    selections = [result["selection_id"] for result in shown.json()["results"]]
    assert client.post("/v1/users/ana/turns", json={"turns": [{"speaker": "ana", "text": "I like tea"}]},
                       headers=A).status_code == 201
    job = client.post("/v1/users/ana/sessions/end", headers=A).json()["job_id"]
    assert client.post("/v1/users/bo/memories", json={"memories": [{"text": "Bo grows tomatoes", "id": "bo-1"}]},
                       headers=A).status_code == 201
    return ["ana", "bo", "bo-1", "nobody", "cello", *selections, job, *memories[:3]]


def test_no_json_body_or_path_parameter_answers_a_5xx(client: TestClient,  # noqa: F811
                                                      request: pytest.FixtureRequest) -> None:
    spec = client.app.openapi()
    known = _known_ids(client)
    calls = []
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            params = {p["name"]: _segments(known) for p in operation.get("parameters", []) if p["in"] == "path"}
            content = operation.get("requestBody", {}).get("content", {}).get("application/json")
            body = (st.one_of(_from_schema(content["schema"], spec, known, hostile=False),
                              _from_schema(content["schema"], spec, known, hostile=True)) if content else st.none())
            calls.append(st.tuples(st.just(method.upper()), st.just(path), st.fixed_dictionaries(params), body))
    assert len(calls) >= 13  # every route of the API, from its own OpenAPI document

    @settings(max_examples=SLOW_EXAMPLES if request.config.getoption("--slow") else FAST_EXAMPLES,
              deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(call=st.one_of(*calls))
    def no_5xx(call: tuple[str, str, dict[str, str], Any]) -> None:
        method, template, params, body = call
        path = template.format(**params)
        content = None if body is None else json.dumps(body).encode()  # lone surrogates escaped, as a client would
        response = client.request(method, path, content=content, headers={**A, "Content-Type": "application/json"})
        assert response.status_code < 500, (method, path, body, response.status_code, response.text[:500])
        if response.status_code >= 400:
            assert response.headers["content-type"].startswith("application/json"), (path, response.text[:200])
            error = response.json()
            assert isinstance(error["detail"], str) and isinstance(error["code"], str), error

    no_5xx()
    assert client.get("/health").status_code == 200
