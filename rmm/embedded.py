"""`from rmm import Memory`: the retrieval server's verbs inside your own process, no HTTP.

`Memory` is a thin face over `rmm.serve.service.RetrievalService`, the very object `rmm serve`
answers with: the same config file (`Memory.open(folder, config="serve.yaml")`, read by
`rmm.serve.config.load_config`), the same stores (a folder: SQLite, the default; a
`postgresql://` URL), the same records back (`rmm.serve.records.RetrieveResult`,
`FeedbackResult`, `rmm.types.Memory`) and the same typed errors (`rmm.errors`,
`rmm.serve.errors`), so a bank built embedded can be served later, and the other way round.

    with Memory.open("bank/") as memory:
        hit = memory.retrieve_one("ana", "where does Ana hike?")
        reply = my_llm(hit.memories)                      # cite memories by their `index`
        memory.feedback(hit.selection_id, text=reply)     # the reranker learns from the citations

Users live under one tenant (`tenant`, default "local"): a folder served by `rmm serve` keeps
each API key's users under its tenant, so open it with that tenant's name to see them.

What differs from the server, on purpose: queries are encoded in this process unless the config
file says otherwise (`query_process: off` by default here; the server's default `auto` starts a
child process on the CPU, which a library imported into someone else's program must not do by
surprise: it outlives a crash of the caller's thread, holds memory, and fights the caller's own
workers for cores). No micro-batcher either: `retrieve` takes many queries at once instead.

`AsyncMemory` runs each call in a worker thread (`asyncio.to_thread`), so an asyncio agent's event
loop keeps running while the encoder and the store work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar

from rmm.errors import ConfigError
from rmm.memory.storage import is_database_url
from rmm.serve.errors import BadRequestError
from rmm.serve.records import (
    FeedbackResult,
    NeighboursResult,
    NewMemory,
    RetrieveItem,
    RetrieveResult,
    TreeNodeInfo,
    TreeSchema,
    XPathResult,
)
from rmm.types import MEMORY_KINDS, Turn
from rmm.types import Memory as MemoryRecord

if TYPE_CHECKING:
    from rmm.encoders.protocol import EncoderLike
    from rmm.memory.tree import NodeEdit, TreeNode
    from rmm.llm.base import LLM
    from rmm.serve.jobs import Job
    from rmm.serve.service import RetrievalService

__all__ = ["DEFAULT_TENANT", "AsyncMemory", "Memory"]

log = logging.getLogger(__name__)

DEFAULT_TENANT = "local"
_T = TypeVar("_T")


class Memory:
    """A memory bank opened in this process; thread-safe like the server. Close it (or use `with`)
    so rerankers are checkpointed and background threads stop."""

    def __init__(self, service: RetrievalService, *, tenant: str = DEFAULT_TENANT) -> None:
        """Wrap a built service (`Memory.open` builds one); `start()` is called here."""
        from rmm.serve.config import valid_tenant

        if not valid_tenant(tenant):
            raise ConfigError(f"tenant {tenant!r} must be 1-64 characters of letters, digits, '_', '.', '-'")
        self.service, self.tenant = service, tenant
        service.start()

    @classmethod
    def open(cls, location: str | Path, *, config: str | Path | None = None, tenant: str = DEFAULT_TENANT,
             folder: str | Path | None = None, encoder: EncoderLike | None = None, llm: LLM | None = None,
             **settings: Any) -> Memory:
        """Open (or create) a bank: a folder (SQLite) or a `postgresql://` URL.

        `config` is a server config file (`rmm serve --config`); `settings` override it by key
        (`k=10`, `llm="openai:…"`, `learner={"batch_size": 8}`, or dotted `"batching.max_batch"` via
        a dict). A URL keeps open sessions in a local `folder` (or the config's `bank:`).
        `encoder` / `llm` pass built objects instead of names (tests, a shared model)."""
        from rmm.config import read_yaml
        from rmm.serve.config import load_config
        from rmm.serve.service import RetrievalService

        file_keys = read_yaml(config, "server config") if config is not None else {}
        overrides: dict[str, Any] = dict(settings)
        place = str(location)
        if is_database_url(place):  # raises for another scheme:// (a typo must not become a folder)
            overrides["store"] = place
            bank = folder if folder is not None else file_keys.get("bank")
            if not bank:
                raise ConfigError("a postgresql:// store keeps open sessions in a local folder: pass folder=PATH "
                                  "(or `bank:` in the config)")
            overrides["bank"] = str(bank)
        else:
            if folder is not None:
                raise ConfigError("folder= is for a postgresql:// store (where its open sessions live); a bank "
                                  "folder keeps them itself")
            overrides["bank"] = place
        if "query_process" not in overrides and "query_process" not in file_keys:
            overrides["query_process"] = "off"  # no child process by surprise (module docstring)
        service = RetrievalService(load_config(config, overrides), encoder=encoder, llm=llm)
        try:
            return cls(service, tenant=tenant)
        except BaseException:
            service.close()
            raise

    # ---- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Checkpoint every reranker, stop the background threads, close the stores (idempotent)."""
        self.service.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def checkpoint(self) -> int:
        """Save the rerankers that learned since their last save now; returns how many."""
        return self.service.checkpoint()

    # ---- users and memories --------------------------------------------------------------------
    def users(self) -> list[str]:
        return self.service.users(self.tenant)

    def add_memories(self, user: str, memories: Sequence[str | NewMemory | dict[str, Any]]) -> list[str]:
        """Store memories (texts, `NewMemory`s, or dicts of its fields); returns their ids once durable."""
        records = [_new_memory(m, i) for i, m in enumerate(memories)]
        return self.service.add_memories(self.tenant, user, records)

    def memories(self, user: str) -> list[MemoryRecord]:
        """The user's memories (`rmm.types.Memory`, `user_id` as you named the user)."""
        return [dataclasses.replace(m, user_id=user) for m in self.service.memories(self.tenant, user)]

    def delete_memory(self, user: str, memory_id: str) -> int:
        """Delete one memory (pending selections that showed it stay learnable); returns 0."""
        return self.service.delete_memory(self.tenant, user, memory_id)

    def delete_user(self, user: str) -> dict[str, int]:
        """Erase everything stored for the user (memories, selections and feedback, open session,
        reflection jobs, a per-user reranker), then checkpoint the SQLite files' write-ahead logs so
        the erased text is gone from the bank folder's bytes, not just unreachable. Returns counts."""
        counts = self.service.delete_user(self.tenant, user)
        self._truncate_logs()
        return counts

    def _truncate_logs(self) -> None:
        """Fold every SQLite write-ahead log of the bank folder into its database and truncate it:
        deleted rows are zeroed (`secure_delete`) in the pages, but older log frames still hold them."""
        folder = self.service.config.bank_path
        for db in sorted(folder.glob("*.sqlite")):
            conn = sqlite3.connect(str(db), timeout=30.0)
            try:
                busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                if busy:
                    log.warning("%s: its write-ahead log is in use; erased rows leave it at the next checkpoint", db)
            finally:
                conn.close()

    # ---- sessions and reflection ---------------------------------------------------------------
    def add_turns(self, user: str, turns: Sequence[tuple[str, str] | dict[str, Any]]) -> list[str]:
        """Append `(speaker, text)` turns to the user's open session; returns the turn ids."""
        pairs = [_turn_pair(t, i) for i, t in enumerate(turns)]
        return [t.id for t in self.service.append_turns(self.tenant, user, pairs)]

    def end_session(self, user: str, *, speakers: list[str] | None = None, store_turns: bool = False,
                    wait: bool | float = False) -> Job:
        """Reflect the open session into topic memories (a background job; `wait=True` or a number
        of seconds blocks until it finished). NoOpenSessionError without turns."""
        job = self.service.end_session(self.tenant, user, speakers=speakers, store_turns=store_turns)
        return self._finish(job, wait)

    def add_session(self, user: str, turns: Sequence[tuple[str, str] | dict[str, Any] | Turn], *,
                    session_id: str | None = None, time: str | None = None, speakers: list[str] | None = None,
                    store_turns: bool = False, wait: bool | float = False) -> Job:
        """A whole finished session at once (turns with optional ids and times), reflected in the background."""
        records = [_turn(t, i) for i, t in enumerate(turns)]
        job = self.service.add_session(self.tenant, user, records, session_id=session_id, time_=time,
                                       speakers=speakers, store_turns=store_turns)
        return self._finish(job, wait)

    def job(self, job_id: str) -> Job:
        return _callers_job(self.service.job(self.tenant, job_id))

    def wait_job(self, job_id: str, timeout: float = 120.0, poll: float = 0.05) -> Job:
        """Block until the job is done, failed or cancelled (TimeoutError after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job.status in ("done", "failed", "cancelled"):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.status} after {timeout} s")
            time.sleep(poll)

    def _finish(self, job: Job, wait: bool | float) -> Job:
        if wait is False:
            return _callers_job(job)
        return self.wait_job(job.id, timeout=120.0 if wait is True else float(wait))

    # ---- retrieval and feedback ----------------------------------------------------------------
    def retrieve(self, queries: Sequence[tuple[str, str] | dict[str, Any]]) -> list[RetrieveResult]:
        """Memories for many queries (`(user, query)` or `{user, query, k?, m?, explore?}`), in one
        batch. Like the server, a query that fails while others succeed gets a result with `error`;
        when every query fails, the first one's typed error is raised."""
        items = [self._item(q, i) for i, q in enumerate(queries)]
        if not items:
            return []
        from rmm.serve.http_errors import per_query_results

        return per_query_results(items, self.service.retrieve_batch(items))

    def retrieve_one(self, user: str, query: str, *, k: int | None = None, m: int | None = None,
                     explore: bool | None = None) -> RetrieveResult:
        """The memories shown for one query and the `selection_id` its feedback names; raises the
        typed error (e.g. `UnknownUserError`) when it fails."""
        (result,) = self.service.retrieve_batch([self._item({"user": user, "query": query, "k": k, "m": m,
                                                             "explore": explore}, 0)])
        if isinstance(result, BaseException):
            raise result
        return result

    def _item(self, query: tuple[str, str] | dict[str, Any], i: int) -> RetrieveItem:
        if isinstance(query, tuple):
            query = {"user": query[0], "query": query[1]}
        if not isinstance(query, dict):
            raise TypeError(f"queries[{i}]: a query is (user, query) or a dict, got {type(query).__name__}")
        unknown = sorted(set(query) - {"user", "query", "k", "m", "explore"})
        if unknown:
            raise BadRequestError(f"queries[{i}]: unknown field(s) {unknown}")
        config = self.service.config
        k = query.get("k") if query.get("k") is not None else config.k
        m = query.get("m") if query.get("m") is not None else min(config.m, k)
        if not 1 <= k <= config.limits.max_k:
            raise BadRequestError(f"queries[{i}].k: must be between 1 and {config.limits.max_k}, got {k}")
        if not 1 <= m <= k:
            raise BadRequestError(f"queries[{i}]: cannot show m={m} memories out of k={k} candidates")
        explore = config.explore if query.get("explore") is None else bool(query["explore"])
        return RetrieveItem(tenant=self.tenant, user=str(query["user"]), query=str(query["query"]), k=k, m=m,
                            explore=explore)

    def feedback(self, selection_id: str, *, cited: list[int] | None = None, text: str | None = None,
                 no_cite: bool = False, structured: bool = False) -> FeedbackResult:
        """Exactly one of: the `cited` indices, the LLM's raw reply `text` (citations parsed from
        it), or `no_cite=True`. The reranker learns from it (explored selections only)."""
        return self.service.feedback(self.tenant, selection_id, cited=cited, text=text, no_cite=no_cite,
                                     structured=structured)

    # ---- the event graph and the tree -----------------------------------------------------------
    def neighbours(self, user: str, event_id: str, query: str, *, m: int | None = None,
                   visited: Sequence[str] = (), explore: bool | None = None, direction: str = "both",
                   label: str | None = None) -> NeighboursResult:
        """A slate of the event's unvisited neighbours reranked for `query` (a Gumbel top-`m` when more
        are unvisited), as `POST /v1/users/{user}/events/{id}/neighbours`; send what your explorer
        kept to `feedback(result.selection_id, cited=[...])`."""
        from rmm.serve.neighbours import NeighbourRequest

        config = self.service.config
        m = config.m if m is None else m
        if not 1 <= m <= config.limits.max_k:
            raise BadRequestError(f"m: must be between 1 and {config.limits.max_k}, got {m}")
        if direction not in ("out", "in", "both"):
            raise BadRequestError(f"direction: must be 'out', 'in' or 'both', got {direction!r}")
        _require_text(query, "query")
        return self.service.neighbours(NeighbourRequest(
            tenant=self.tenant, user=user, event_id=event_id, query=query, m=m,
            explore=config.explore if explore is None else bool(explore), visited=list(visited), direction=direction,
            label=label))

    def schema(self, user: str) -> TreeSchema:
        """Σ of the user's Semantic XPath tree (`GET /v1/users/{user}/schema`): node types, attribute
        names, parent → child type pairs with counts, and `.text` for an LLM prompt."""
        return self.service.schema(self.tenant, user)

    def xpath(self, user: str, query: str, *, question: str | None = None, k: int | None = None,
              m: int | None = None, explore: bool | None = None, scorer: str = "cosine") -> XPathResult:
        """Execute a Semantic XPath query over the user's tree (`POST /v1/users/{user}/xpath`): the best
        nodes, each step's scores and a slate of the best leaves' memories whose `selection_id`
        `feedback` takes. A malformed query raises `QuerySyntaxError` (`.column`, `.expected`)."""
        from rmm.serve.xpath import XPathRequest

        config = self.service.config
        k = config.k if k is None else k
        m = min(config.m, k) if m is None else m
        if not 1 <= k <= config.limits.max_k:
            raise BadRequestError(f"k: must be between 1 and {config.limits.max_k}, got {k}")
        if not 1 <= m <= k:
            raise BadRequestError(f"cannot show m={m} memories out of k={k} candidates")
        if scorer not in ("cosine", "reranker"):
            raise BadRequestError(f"scorer: must be 'cosine' or 'reranker', got {scorer!r}")
        _require_text(query, "query")
        if question is not None:
            _require_text(question, "question")
        return self.service.xpath(XPathRequest(tenant=self.tenant, user=user, query=query, k=k, m=m,
                                               explore=config.explore if explore is None else bool(explore),
                                               scorer=scorer, question=question))

    def tree(self, user: str, *, as_of: int | None = None) -> list[TreeNodeInfo]:
        """The user's tree in tree order: latest versions, or as it was after generation `as_of`."""
        return self.service.tree(self.tenant, user, as_of)[1]

    def add_nodes(self, user: str, nodes: Sequence[TreeNode]) -> int:
        """Add tree nodes (`rmm.memory.tree.TreeNode`), all or nothing; returns the user's new generation."""
        return self.service.add_nodes(self.tenant, user, list(nodes))

    def edit_nodes(self, user: str, edits: Sequence[NodeEdit]) -> int:
        """Write each node's next version (`rmm.memory.tree.NodeEdit`); returns the new generation."""
        return self.service.edit_nodes(self.tenant, user, list(edits))

    def remove_node(self, user: str, node_id: str) -> int:
        """Remove a node and its subtree from the latest tree (history kept); returns the new generation."""
        return self.service.remove_node(self.tenant, user, node_id)

    # ---- export and import ---------------------------------------------------------------------
    def export_user(self, user: str, out: str | Path) -> dict[str, Any]:
        """Write everything stored for the user into the folder `out`: `data.jsonl` in rmm's dataset
        format (docs/dataset-format.md: the user, the sessions handed to reflection and the open
        one with their turns, every memory, the event graph, every version of each tree node, every
        selection with its feedback), the user's own
        reranker checkpoint when rerankers are per user (`reranker/`), and `manifest.json`
        (counts, checksums, where it came from). Returns the manifest."""
        from rmm.serve.export import export_user

        self.service.checkpoint()  # the per-user reranker as it is now
        return export_user(self.service, self.tenant, user, Path(out))

    def import_user(self, path: str | Path, *, user: str | None = None, reflect: bool = False) -> dict[str, int]:
        """Restore an export (its folder or its `data.jsonl`) as `user` (default: the exported
        user): its memories with their ids, times and provenance, and its per-user reranker; with
        `reflect`, its sessions are reflected again (topic memories built anew). Stored feedback
        is not replayed (the candidates' embeddings it was learned from are not exported)."""
        from rmm.serve.export import import_user

        return import_user(self.service, self.tenant, Path(path), user=user, reflect=reflect)


class AsyncMemory:
    """`Memory` for asyncio: the same verbs as coroutines, each run in a worker thread."""

    def __init__(self, memory: Memory) -> None:
        self.sync = memory

    @classmethod
    async def open(cls, location: str | Path, **options: Any) -> AsyncMemory:
        """`Memory.open` in a worker thread (loading the encoder takes seconds)."""
        return cls(await asyncio.to_thread(Memory.open, location, **options))

    async def _run(self, call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        return await asyncio.to_thread(call, *args, **kwargs)

    async def close(self) -> None:
        await self._run(self.sync.close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def users(self) -> list[str]:
        return await self._run(self.sync.users)

    async def add_memories(self, user: str, memories: Sequence[str | NewMemory | dict[str, Any]]) -> list[str]:
        return await self._run(self.sync.add_memories, user, memories)

    async def memories(self, user: str) -> list[MemoryRecord]:
        return await self._run(self.sync.memories, user)

    async def delete_memory(self, user: str, memory_id: str) -> int:
        return await self._run(self.sync.delete_memory, user, memory_id)

    async def delete_user(self, user: str) -> dict[str, int]:
        return await self._run(self.sync.delete_user, user)

    async def add_turns(self, user: str, turns: Sequence[tuple[str, str] | dict[str, Any]]) -> list[str]:
        return await self._run(self.sync.add_turns, user, turns)

    async def end_session(self, user: str, **options: Any) -> Job:
        return await self._run(self.sync.end_session, user, **options)

    async def add_session(self, user: str, turns: Sequence[tuple[str, str] | dict[str, Any] | Turn],
                          **options: Any) -> Job:
        return await self._run(self.sync.add_session, user, turns, **options)

    async def job(self, job_id: str) -> Job:
        return await self._run(self.sync.job, job_id)

    async def wait_job(self, job_id: str, timeout: float = 120.0) -> Job:
        return await self._run(self.sync.wait_job, job_id, timeout)

    async def retrieve(self, queries: Sequence[tuple[str, str] | dict[str, Any]]) -> list[RetrieveResult]:
        return await self._run(self.sync.retrieve, queries)

    async def retrieve_one(self, user: str, query: str, **options: Any) -> RetrieveResult:
        return await self._run(self.sync.retrieve_one, user, query, **options)

    async def feedback(self, selection_id: str, **options: Any) -> FeedbackResult:
        return await self._run(self.sync.feedback, selection_id, **options)

    async def neighbours(self, user: str, event_id: str, query: str, **options: Any) -> NeighboursResult:
        return await self._run(self.sync.neighbours, user, event_id, query, **options)

    async def schema(self, user: str) -> TreeSchema:
        return await self._run(self.sync.schema, user)

    async def xpath(self, user: str, query: str, **options: Any) -> XPathResult:
        return await self._run(self.sync.xpath, user, query, **options)

    async def tree(self, user: str, **options: Any) -> list[TreeNodeInfo]:
        return await self._run(self.sync.tree, user, **options)

    async def add_nodes(self, user: str, nodes: Sequence[TreeNode]) -> int:
        return await self._run(self.sync.add_nodes, user, nodes)

    async def edit_nodes(self, user: str, edits: Sequence[NodeEdit]) -> int:
        return await self._run(self.sync.edit_nodes, user, edits)

    async def remove_node(self, user: str, node_id: str) -> int:
        return await self._run(self.sync.remove_node, user, node_id)

    async def export_user(self, user: str, out: str | Path) -> dict[str, Any]:
        return await self._run(self.sync.export_user, user, out)

    async def import_user(self, path: str | Path, **options: Any) -> dict[str, int]:
        return await self._run(self.sync.import_user, path, **options)


# ---- argument shapes --------------------------------------------------------------------------------
def _new_memory(memory: str | NewMemory | dict[str, Any], i: int) -> NewMemory:
    if isinstance(memory, str):
        record = NewMemory(text=memory)
    elif isinstance(memory, NewMemory):
        record = memory
    elif isinstance(memory, dict):
        try:
            record = NewMemory(**memory)
        except TypeError as exc:
            raise BadRequestError(f"memories[{i}]: {exc}") from exc
    else:
        raise TypeError(f"memories[{i}]: a memory is a text, a NewMemory or a dict, got {type(memory).__name__}")
    if record.kind not in MEMORY_KINDS:
        raise BadRequestError(f"memories[{i}].kind: must be one of {list(MEMORY_KINDS)}, got {record.kind!r}")
    if not isinstance(record.text, str) or not record.text.strip():
        raise BadRequestError(f"memories[{i}].text: must be a non-empty string")
    return record


def _turn_pair(turn: tuple[str, str] | dict[str, Any], i: int) -> tuple[str, str]:
    if isinstance(turn, dict):
        if "id" in turn:
            raise BadRequestError(f"turns[{i}].id: appended turns are numbered by rmm (<session id>:<position>); "
                                  "give turn ids only with a whole session (add_session)")
        unknown = sorted(set(turn) - {"speaker", "text"})
        if unknown:
            raise BadRequestError(f"turns[{i}]: unknown field(s) {unknown}")
        turn = (turn.get("speaker", ""), turn.get("text", ""))
    speaker, text = turn
    if not isinstance(speaker, str) or not speaker or not isinstance(text, str) or not text.strip():
        raise BadRequestError(f"turns[{i}]: a turn needs a speaker and a non-empty text")
    return speaker, text


def _turn(turn: tuple[str, str] | dict[str, Any] | Turn, i: int) -> Turn:
    if isinstance(turn, Turn):
        return Turn(id=turn.id, session_id="", speaker=turn.speaker, text=turn.text, time=turn.time)
    if isinstance(turn, dict):
        unknown = sorted(set(turn) - {"id", "speaker", "text", "time"})
        if unknown:
            raise BadRequestError(f"turns[{i}]: unknown field(s) {unknown}")
        speaker, text = _turn_pair({"speaker": turn.get("speaker", ""), "text": turn.get("text", "")}, i)
        return Turn(id=turn.get("id") or "", session_id="", speaker=speaker, text=text, time=turn.get("time"))
    speaker, text = _turn_pair(turn, i)
    return Turn(id="", session_id="", speaker=speaker, text=text)


def _require_text(text: object, what: str) -> None:
    if not isinstance(text, str) or not text.strip():
        raise BadRequestError(f"{what}: must be a non-empty string")


def _callers_job(job: Job) -> Job:
    """The job with its user as the caller named it (the service stores tenant-scoped ids)."""
    from rmm.serve.tenants import unscoped

    return dataclasses.replace(job, user_id=unscoped(job.user_id))
