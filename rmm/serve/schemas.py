"""The request and response bodies of the HTTP API (pydantic; they are the OpenAPI schema).

Requests are strict: unknown fields are refused (a typo is an error rather than a silently ignored
option) and every field takes exactly the JSON type its schema states (pydantic strict mode: `"5"`
is not an integer, `1` not a boolean). Every string of a request is valid Unicode without NUL
(PostgreSQL's text cannot hold one, so both stores refuse it alike, here at the edge); text that
must say something is refused when it holds nothing but whitespace, control or format characters
(zero-width spaces, a BOM): `is_blank` is the one definition of "empty". Ids, speakers and times
are bounded in size and lists in length, so no request can make the server store or echo an
unbounded name. Answers that are exactly a service record (`ShownMemory`, `RetrieveResult`,
`FeedbackResult` in `rmm.serve.records`) are not repeated here: FastAPI serves those dataclasses.

The server and `rmm.serve.client` share these models, so the client cannot drift from the API:
this module and everything it imports stay free of torch (an agent's process imports the client),
which `tests/test_serve_schema_shared.py` checks.
"""

from __future__ import annotations

import re
import unicodedata
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from rmm.serve.records import RetrieveResult, TreeNodeInfo
from rmm.serve.scoping import unscoped, unscoped_text
from rmm.types import MEMORY_KINDS

if TYPE_CHECKING:
    from rmm.serve.jobs import Job

__all__ = [
    "API_PREFIX", "AddMemoriesIn", "AddMemoriesOut", "AddSessionIn", "AddTurnsIn", "AddTurnsOut", "DeleteMemoryOut",
    "DeleteUserOut", "EndSessionIn", "FeedbackIn", "NeighboursIn", "HealthOut", "JobOut", "MemoriesOut", "MemoryIn", "MemoryOut",
    "QueryIn", "RetrieveIn", "RetrieveOut", "ShadowOut", "TurnIn", "UsersOut",
    "AddNodesIn", "EditNodesIn", "NodeEditIn", "NodeIn", "RemoveNodeOut", "TreeOut", "TreeWriteOut", "XPathIn",
]

API_PREFIX = "/v1"  # every route below it needs an API key; the client builds its paths on it
USER_PATTERN = r"^[^/\x00-\x1f]{1,256}$"
MAX_ID_CHARS = 256  # memory, turn, session, selection and job ids, speakers, kinds, times
MAX_LIST_ITEMS = 1000  # refs of a memory, speakers of a session
_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_unicode(value: str) -> str:
    """Refuse lone UTF-16 surrogates (JSON's `"\\ud800"`) and NUL: Python accepts both in a `str`,
    but a surrogate cannot be encoded or answered and PostgreSQL's text cannot hold a NUL, so
    either would fail deep inside (a 500 on one store, stored on the other) instead of here."""
    found = _SURROGATE.search(value)
    if found is not None:
        raise PydanticCustomError("string_unicode", "contains a lone UTF-16 surrogate (\\u{code}) at character "
                                  "{position}; send valid Unicode text",
                                  {"code": f"{ord(found.group()):04x}", "position": found.start()})
    nul = value.find("\x00")
    if nul >= 0:
        raise PydanticCustomError("string_nul", "contains a NUL character (\\u0000) at character {position}; "
                                  "text may not contain NUL", {"position": nul})
    return value


def is_blank(value: str) -> bool:
    """The one definition of empty text: nothing but whitespace, control characters and format
    characters (Unicode Cc / Cf: zero-width spaces and joiners, BOM, soft hyphen), i.e. nothing
    a reader or an encoder would see."""
    return all(c.isspace() or unicodedata.category(c) in ("Cc", "Cf") for c in value)


def not_blank(value: str) -> str:
    """Refuse empty text (`is_blank`): it would be encoded as if it said something."""
    if is_blank(value):
        raise PydanticCustomError("blank", "must contain some visible text (not only whitespace, zero-width or "
                                  "control characters)")
    return value


# Every string of a request is one of these, so a bad character is refused naming its field.
Text = Annotated[str, AfterValidator(valid_unicode)]
NonBlank = Annotated[str, Field(min_length=1), AfterValidator(valid_unicode), AfterValidator(not_blank)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS), AfterValidator(valid_unicode)]
ShortText = Annotated[str, Field(max_length=MAX_ID_CHARS), AfterValidator(valid_unicode)]
UserId = Annotated[str, Field(pattern=USER_PATTERN, description="a user id of your tenant (1-256 chars, no '/')"),
                   AfterValidator(valid_unicode)]
# a memory or job id in a path: no NUL or other control character, at most 256 characters
ID_PATTERN = r"^[^\x00-\x1f]{1,256}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ---- memories -----------------------------------------------------------------------------------
class MemoryIn(_Strict):
    text: NonBlank = Field(description="what is embedded and shown to the LLM")
    kind: ShortText = Field("turn", description=f"one of {list(MEMORY_KINDS)}")
    id: Name | None = Field(None, description="default: a new random id")
    refs: list[Name] = Field(default_factory=list, max_length=MAX_LIST_ITEMS,
                             description="dialogue turn ids this memory came from")
    source_text: Text = ""
    time: ShortText | None = None
    participants: list[Name] = Field(default_factory=list, max_length=MAX_LIST_ITEMS,
                                     description="kind event only: who took part (at most 3); an event also "
                                                 "needs `refs` and `time`")


class AddMemoriesIn(_Strict):
    memories: list[MemoryIn] = Field(min_length=1)


class AddMemoriesOut(BaseModel):
    user: str
    ids: list[str]


class MemoryOut(BaseModel):
    """A stored memory as its owner sees it (no embedding, no tenant-scoped user id)."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    kind: str
    text: str
    refs: list[str]
    source_text: str
    created_at: float
    updated_at: float
    time_span: tuple[str | None, str | None] | None


class MemoriesOut(BaseModel):
    user: str
    memories: list[MemoryOut]


class UsersOut(BaseModel):
    users: list[str]


class DeleteMemoryOut(BaseModel):
    user: str
    memory_id: str
    selections_dropped: int = Field(description="always 0: pending selections keep the embeddings they were "
                                    "scored with, so their feedback is still learned (kept for old clients)",
                                    deprecated=True)


class DeleteUserOut(BaseModel):
    """How much of the user was deleted, by kind."""

    user: str
    memories: int
    selections: int
    session_turns: int
    jobs_cancelled: int


# ---- sessions and reflection jobs ---------------------------------------------------------------
class TurnIn(_Strict):
    speaker: NonBlank = Field(max_length=MAX_ID_CHARS)
    text: NonBlank
    time: ShortText | None = None
    id: Name | None = Field(None, description="for whole sessions only; default: <session id>:<position>")


class AddTurnsIn(_Strict):
    """Turns appended to the user's open session."""

    turns: list[TurnIn] = Field(min_length=1)


class AddTurnsOut(BaseModel):
    user: str
    session_id: str
    turn_ids: list[str]


class EndSessionIn(_Strict):
    speakers: list[Name] | None = Field(None, max_length=MAX_LIST_ITEMS,
                                        description="whose facts to extract (default: every speaker except the "
                                                    "configured assistant names)")
    store_turns: bool = Field(False, description="also store each raw turn as a turn memory")


class AddSessionIn(EndSessionIn):
    turns: list[TurnIn] = Field(min_length=1)
    session_id: Name | None = Field(None, description="default: a new id")
    time: ShortText | None = None


class JobOut(BaseModel):
    """A reflection job; poll it until `status` is done, failed or cancelled."""

    job_id: str
    user: str
    kind: str
    status: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    result: dict[str, Any]
    error: str | None
    events_job_id: str | None = Field(None, description="the session's `events` job (event graph), when the server "
                                                        "builds graphs; set in the answer that queued it")

    @property
    def finished(self) -> bool:
        """The job will not change any more (done, failed or cancelled)."""
        return self.status in ("done", "failed", "cancelled")

    @classmethod
    def of(cls, job: Job) -> JobOut:
        return cls(job_id=job.id, user=unscoped(job.user_id), kind=job.kind, status=job.status,
                   created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
                   result=job.result, error=None if job.error is None else unscoped_text(job.tenant, job.error),
                   events_job_id=job.events_job_id)


# ---- retrieval and feedback ---------------------------------------------------------------------
class QueryIn(_Strict):
    user: UserId
    query: NonBlank
    k: int | None = Field(None, ge=1, description="candidates retrieved (default: the server's k)")
    m: int | None = Field(None, ge=1, description="memories shown (default: the server's m)")
    explore: bool | None = Field(None, description="Gumbel-sample the M (learning) or take the top-M")


class RetrieveIn(_Strict):
    """Many queries at once (of one or several users); each is answered on its own."""

    queries: list[QueryIn] = Field(min_length=1)


class RetrieveOut(BaseModel):
    results: list[RetrieveResult]


class FeedbackIn(_Strict):
    selection_id: Name
    cited: list[int] | None = Field(None, description="indices (0-based, as shown) of the memories the answer used")
    text: Text | None = Field(None, description="the LLM's raw reply; citations are parsed from it")
    no_cite: bool = Field(False, description="the answer used none of the shown memories")
    structured: bool = Field(False, description="`text` is the JSON {answer, citations} form")


class NeighboursIn(_Strict):
    """A slate of an event's neighbours for a query: a client-side explorer's step."""

    query: NonBlank
    m: int | None = Field(None, ge=1, description="neighbours shown (default: the server's m)")
    visited: list[Name] = Field(default_factory=list, max_length=MAX_LIST_ITEMS,
                                description="event ids already visited: masked before the draw, never shown")
    explore: bool | None = Field(None, description="Gumbel-sample the M when more are unvisited (default: the "
                                                   "server's explore)")
    direction: Literal["out", "in", "both"] = Field("both", description="edges leaving, entering or touching the node")
    label: Name | None = Field(None, description="only edges of this label")


# ---- Semantic XPath: the user's tree and queries over it ------------------------------------------
MAX_POSITION = 2**31 - 1  # a node's position is a 32-bit integer in both stores
MAX_ATTRIBUTES = 100  # attributes of one node


class XPathIn(_Strict):
    """A Semantic XPath query over the user's tree (grammar: `rmm.memory.xpath_syntax`)."""

    query: NonBlank = Field(description='e.g. //Session[max(/Turn[node~"trip"])]/Turn[node~"trip"]')
    question: NonBlank | None = Field(None, description="what the best leaves' memories are reranked for (default: "
                                                        "the query's soft-match texts, outside any 1-P)")
    k: int | None = Field(None, ge=1, description="best nodes returned, and best memories the reranker sees "
                                                  "(default: the server's k)")
    m: int | None = Field(None, ge=1, description="memories shown (default: the server's m, at most k)")
    explore: bool | None = Field(None, description="Gumbel-sample the M (default: the server's explore)")
    scorer: Literal["cosine", "reranker"] = Field("cosine", description="the soft matches' scorer: the encoder's "
                                                                       "cosine or the user's learned reranker")


class NodeIn(_Strict):
    """A new node of the user's tree (`rmm.memory.tree.TreeNode`)."""

    id: Name
    type: Name = Field(description="an identifier (letters, digits, _; not starting with a digit): queries name it")
    parent: Name | None = Field(None, description="a node of the tree or of this request (null: under the root)")
    position: int | None = Field(None, ge=0, le=MAX_POSITION, description="among its siblings (null: after the last)")
    attributes: dict[Name, Text] = Field(default_factory=dict, max_length=MAX_ATTRIBUTES,
                                         description="identifier -> text (not 'node')")
    memory_id: Name | None = Field(None, description="a stored memory of the user that the node shows")


class AddNodesIn(_Strict):
    nodes: list[NodeIn] = Field(min_length=1)


class NodeEditIn(_Strict):
    """A change to one node, written as its next version: only the fields sent change. `parent: null`
    moves it under the root, `memory_id: null` detaches it; `attributes` replaces them all."""

    id: Name
    parent: Name | None = None
    position: int = Field(0, ge=0, le=MAX_POSITION)
    attributes: dict[Name, Text] = Field(default_factory=dict, max_length=MAX_ATTRIBUTES)
    memory_id: Name | None = None


class EditNodesIn(_Strict):
    edits: list[NodeEditIn] = Field(min_length=1)


class TreeWriteOut(BaseModel):
    user: str
    node_ids: list[str]
    generation: int = Field(description="the user's generation after the write: `GET .../tree?as_of=` reads it back")


class RemoveNodeOut(BaseModel):
    user: str
    node_id: str
    generation: int


class TreeOut(BaseModel):
    """A user's tree in tree order (pre-order, siblings by position)."""

    user: str
    generation: int = Field(description="the user's generation now")
    as_of: int | None
    nodes: list[TreeNodeInfo]


# ---- shadow scoring and promotion (admin) -------------------------------------------------------
class ShadowOut(BaseModel):
    """The shadow reranker against the live one on the serving policy's logged traffic
    (`rmm.serve.shadow`): an off-policy estimate, never the shadow's own selections."""

    status: str = Field(description='"promote" (the evidence clears the bar), "keep" (it does not) or '
                                    '"insufficient" (too few selections, no overlap or too small an ESS: no decision)')
    reason: str
    shadow: str = Field(description="the shadow's checkpoint folder (after a promotion: the previous live weights)")
    key: str = Field(description="the reranker key it is judged on")
    selections: int = Field(description="rewarded, sampled selections in the window")
    estimator: str
    estimate: float | None = Field(None, description="the shadow's reward per shown memory")
    low: float | None = Field(None, description="the lower bound of its interval at `level`")
    high: float | None = None
    ess: float | None = Field(None, description="effective sample size (shown memories)")
    live_value: float | None = Field(None, description="the serving policy's logged reward per shown memory")
    margin: float
    level: float
    estimates: dict[str, dict[str, float]] = Field(default_factory=dict, description="every estimator's figures")
    promoted: bool = Field(False, description="this call swapped the live weights for the shadow's")
    previous: str | None = Field(None, description="where the replaced live checkpoint is kept")


# ---- operations ---------------------------------------------------------------------------------
class QueryEngineOut(BaseModel):
    engine: str = Field(description="the query engine serving (rmm.encoders.query.precision.QUERY_ENGINES)")
    requested: str = Field(description="query_precision as configured (auto: the fastest measured here)")
    cached: bool = Field(description="the timings came from the cache of an earlier start on this machine")
    batch_sizes: list[int] = Field(description="the probe micro-batch sizes")
    ms_per_query: dict[str, dict[str, float]] = Field(description="engine -> batch size -> ms per query")
    skipped: dict[str, str] = Field(description="engine -> why it was not timed (or not fully)")
    note: str = ""


class HealthOut(BaseModel):
    status: str = Field(description='"ok", or "unavailable" (answered 503) while the store is unreachable')
    store: str = Field(description='"ok", "busy" (every database connection in use) or "unavailable"')
    encoder: str
    dim: int
    batching: bool
    max_batch: int
    max_wait_ms: float
    torch_threads: int = Field(description="intra-op CPU threads the server computes with")
    query_engine: QueryEngineOut = Field(description="the query engine and the start-up measurement that chose it")
