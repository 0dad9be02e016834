"""The retrieval service without HTTP: tenants, batched retrieval, feedback, sessions, durability.

Tenants are kept apart by construction: every user id a tenant names is stored as
`"<tenant>:<user>"` (tenant names cannot contain `:`), so two tenants' users can never collide
and no code path can reach another tenant's rows by name. Selections and jobs also record their
tenant and answer "unknown" to anyone else.

`retrieve_batch` is what the micro-batcher calls: every query of the batch is encoded in one
encoder call, each user's queries are searched in one index call, and each reranker scores its
queries in one call (Gumbel top-M when exploring, plain top-M otherwise). The selections are
persisted in one transaction before the results are returned, so feedback works even after a
restart. Feedback turns citations into rewards for the learner (paper §6); the reranker is
checkpointed every `checkpoint_interval_s` and at `close()` (atomically, see `Learner.save`).

Writes go straight to the bank, whose store commits with `synchronous=FULL` before returning:
an acknowledged memory survives `kill -9` (the per-user index is rebuilt from the store).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rmm.errors import UnknownMemoryError, UnknownUserError
from rmm.memory.bank import EncoderLike, MemoryBank
from rmm.memory.sessions import SessionLog
from rmm.policy.citations import parse_citations, parse_json_citations
from rmm.policy.learner import Learner, is_normalized_encoder, rewards_from_citations
from rmm.policy.reranker import ResidualLinearReranker
from rmm.serve.config import ServeConfig, key_digest
from rmm.serve.errors import BadRequestError, NoOpenSessionError
from rmm.serve.jobs import Job, JobQueue
from rmm.serve.pending import PendingSelection, SelectionStore
from rmm.types import Candidates, Memory, Selection, Session, Turn

if TYPE_CHECKING:
    from rmm.llm.base import LLM
    from rmm.reflection import ProspectiveReflector

__all__ = [
    "FeedbackResult",
    "NewMemory",
    "RetrievalService",
    "RetrieveItem",
    "RetrieveResult",
    "ShownMemory",
    "WriteItem",
    "scoped",
    "unscoped",
]

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "reranker"  # the same folder `rmm chat` uses, so a bank's reranker is shared
SESSIONS_FILE = "sessions.sqlite"
SELECTIONS_FILE = "selections.sqlite"
JOBS_FILE = "jobs.sqlite"
_SWEEP_EVERY_S = 60.0


def scoped(tenant: str, user: str) -> str:
    """The store's user id for a tenant's user (tenant names never contain ':')."""
    return f"{tenant}:{user}"


def unscoped(user_id: str) -> str:
    return user_id.split(":", 1)[1]


# ---- records ------------------------------------------------------------------------------------
@dataclass
class RetrieveItem:
    tenant: str
    user: str
    query: str
    k: int
    m: int
    explore: bool


@dataclass
class ShownMemory:
    """One memory shown for a query; `index` is what the LLM cites it by."""

    index: int
    id: str
    text: str
    kind: str
    refs: list[str]
    score: float  # reranker score
    retriever_score: float
    time_span: tuple[str | None, str | None] | None


@dataclass
class RetrieveResult:
    user: str
    query: str
    selection_id: str | None  # None when nothing was shown (the user has no memories)
    explore: bool
    memories: list[ShownMemory]
    expires_at: float | None


@dataclass
class NewMemory:
    text: str
    kind: str = "turn"
    id: str | None = None
    refs: list[str] = field(default_factory=list)
    source_text: str = ""
    time: str | None = None


@dataclass
class WriteItem:
    """One add-memories request: what the write micro-batcher coalesces."""

    tenant: str
    user: str
    memories: list[NewMemory]


@dataclass
class FeedbackResult:
    selection_id: str
    rewards: list[float] | None  # per shown memory; None = nothing learned (no parseable citation)
    cited: list[int] | None
    no_cite: bool
    warnings: list[str]
    updated: bool  # this feedback completed a batch and the reranker took a step
    loss: float | None
    learner_step: int
    learner_records: int


class _LockedEncoder:
    """The encoder behind one lock: retrieval batches and reflection jobs run in different threads,
    and Hugging Face tokenizers are not safe to call concurrently. Counts calls (tests, metrics)."""

    def __init__(self, encoder: EncoderLike) -> None:
        self.inner = encoder
        self.name, self.dim, self.fingerprint = encoder.name, int(encoder.dim), encoder.fingerprint
        self._lock = threading.Lock()
        self.query_calls = 0
        self.passage_calls = 0

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        with self._lock:
            self.query_calls += 1
            return torch.as_tensor(self.inner.encode_queries(texts)).detach().float().cpu()

    def encode_passages(self, texts: list[str]) -> torch.Tensor:
        with self._lock:
            self.passage_calls += 1
            return torch.as_tensor(self.inner.encode_passages(texts)).detach().float().cpu()


# ---- the service --------------------------------------------------------------------------------
class RetrievalService:
    """Thread-safe core of `rmm serve`; `start()` launches its background threads."""

    def __init__(self, config: ServeConfig, *, encoder: EncoderLike | None = None, llm: LLM | None = None) -> None:
        self.config = config.validate()
        self.keys = {key_digest(key): tenant for key, tenant in config.auth.resolve().items()}
        if config.torch_threads is not None:  # process-wide: the server owns its process
            torch.set_num_threads(config.torch_threads)
        if encoder is None:
            from rmm.encoders import load_encoder

            encoder = load_encoder(config.encoder, device=config.device)
        self.encoder = _LockedEncoder(encoder)
        path = config.bank_path
        self.bank = MemoryBank(path, self.encoder, index_backend=config.index_backend, device=config.device)
        self.learner_config = config.learner_config(is_normalized_encoder(encoder))
        if llm is None and config.llm:
            from rmm.llm import load_llm

            llm = load_llm(config.llm)
        self.llm = llm
        self.selections = SelectionStore(path / SELECTIONS_FILE, config.selection_ttl_s)
        self.sessions = SessionLog(path / SESSIONS_FILE)
        self.jobs = JobQueue(path / JOBS_FILE, self._run_job)
        self.checkpoint_dir = path / CHECKPOINT_DIR
        self._reflector: ProspectiveReflector | None = None
        self._learners: dict[str, Learner] = {}
        self._saved: dict[str, tuple[int, int]] = {}
        self._learn_lock = threading.RLock()  # reranker weights: read by select, written by updates
        self._generator = torch.Generator().manual_seed(config.seed)
        self._stop = threading.Event()
        self._maintenance: threading.Thread | None = None
        self._closed = False
        self.learner_updates = 0

    # ---- auth --------------------------------------------------------------------------
    def tenant_for_key(self, key: str | None) -> str | None:
        return self.keys.get(key_digest(key)) if key else None

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self.jobs.start()
        if self._maintenance is None:
            self._maintenance = threading.Thread(target=self._maintain, name="rmm-maintenance", daemon=True)
            self._maintenance.start()

    def _maintain(self) -> None:
        interval = self.config.checkpoint_interval_s
        sweep_every = min(_SWEEP_EVERY_S, self.config.selection_ttl_s)
        next_checkpoint = time.monotonic() + interval if interval else float("inf")
        next_sweep = time.monotonic() + sweep_every
        while not self._stop.wait(max(0.05, min(next_checkpoint, next_sweep) - time.monotonic())):
            now = time.monotonic()
            try:
                if now >= next_sweep:
                    self.selections.sweep()
                    next_sweep = now + sweep_every
                if now >= next_checkpoint:
                    self.checkpoint()
                    next_checkpoint = now + interval
            except Exception:  # keep maintaining; the next round may succeed
                log.exception("background maintenance failed")

    def close(self) -> None:
        """Stop background work, checkpoint every reranker, close the databases."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._maintenance is not None:
            self._maintenance.join(timeout=30)
        self.jobs.close()
        try:
            self.checkpoint()
        finally:
            self.selections.close()
            self.sessions.close()
            self.bank.close()

    # ---- rerankers and checkpoints -------------------------------------------------------
    def _reranker_key(self, tenant: str, user_id: str) -> str:
        per = self.config.reranker_per
        return "" if per == "bank" else tenant if per == "tenant" else user_id

    def _checkpoint_path(self, key: str) -> Path:
        if not key:
            return self.checkpoint_dir
        sub = "users" if self.config.reranker_per == "user" else "tenants"
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", key)[:48]
        return self.checkpoint_dir / sub / f"{safe}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"

    def learner(self, key: str) -> Learner:
        """The learner of a reranker key, loaded from its checkpoint when one was saved."""
        with self._learn_lock:
            if key not in self._learners:
                path = self._checkpoint_path(key)
                if (path / "meta.json").exists() or path.with_name(f".{path.name}.old").exists():
                    learner = Learner.load(path, encoder_name=self.bank.encoder.fingerprint, dim=self.bank.dim,
                                           device=self.bank.device)
                    log.info("loaded reranker checkpoint %s (step %d)", path, learner.stats.step)
                else:
                    learner = Learner(ResidualLinearReranker(self.bank.dim), self.learner_config,
                                      encoder_name=self.bank.encoder.fingerprint, device=self.bank.device)
                self._learners[key] = learner
                self._saved[key] = _progress(learner)
            return self._learners[key]

    def checkpoint(self) -> int:
        """Save every reranker that learned something since its last save; returns how many."""
        saved = 0
        with self._learn_lock:
            for key, learner in self._learners.items():
                if _progress(learner) != self._saved.get(key):
                    learner.save(self._checkpoint_path(key))
                    self._saved[key] = _progress(learner)
                    saved += 1
        return saved

    # ---- users and memories --------------------------------------------------------------
    def require_user(self, tenant: str, user: str) -> str:
        user_id = scoped(tenant, user)
        if not self.bank.store.has_user(user_id):
            raise UnknownUserError(f"unknown user {user!r} (no memories stored for this user)")
        return user_id

    def users(self, tenant: str) -> list[str]:
        prefix = scoped(tenant, "")
        return [unscoped(u) for u in self.bank.users() if u.startswith(prefix)]

    def add_memories(self, tenant: str, user: str, memories: list[NewMemory]) -> list[str]:
        """Store and index; returns once committed (an acknowledged memory survives a crash)."""
        (result,) = self.add_memories_batch([WriteItem(tenant, user, memories)])
        if isinstance(result, Exception):
            raise result
        return result

    def add_memories_batch(self, items: list[WriteItem]) -> list[list[str] | Exception]:
        """Every request's memories in one encode; then each request commits on its own, so one
        request's failure (e.g. a duplicate id) never loses or blocks another's write."""
        records = [[
            Memory(id=m.id or Memory.new_id(), user_id=scoped(item.tenant, item.user), kind=m.kind,  # type: ignore[arg-type]
                   text=m.text, refs=list(m.refs), source_text=m.source_text,
                   time_span=None if m.time is None else (m.time, m.time))
            for m in item.memories] for item in items]
        texts = [m.text for batch in records for m in batch]
        vectors = self.encoder.encode_passages(texts) if texts else torch.empty(0, self.encoder.dim)
        results: list[list[str] | Exception] = []
        start = 0
        for batch in records:
            rows = vectors[start:start + len(batch)]
            start += len(batch)
            try:
                results.append(self.bank.add(batch[0].user_id, batch, embeddings=rows) if batch else [])
            except Exception as error:  # noqa: BLE001 - handed back to this request only
                results.append(error)
        return results

    def memories(self, tenant: str, user: str) -> list[Memory]:
        return self.bank.memories(self.require_user(tenant, user))

    def delete_memory(self, tenant: str, user: str, memory_id: str) -> int:
        """Delete from store and index; returns how many pending selections it invalidated."""
        user_id = self.require_user(tenant, user)
        self.bank.delete(user_id, [memory_id])
        return self.selections.delete_memory(user_id, memory_id)

    def delete_user(self, tenant: str, user: str) -> dict[str, int]:
        """Memories, index rows, pending selections, open session, queued jobs — and the user's
        own reranker when there is one per user."""
        user_id = scoped(tenant, user)
        open_turns = len(self.sessions.current(user_id).turns)
        if not self.bank.store.has_user(user_id) and not open_turns:
            raise UnknownUserError(f"unknown user {user!r}")
        counts = {"memories": 0, "selections": 0, "session_turns": open_turns, "jobs_cancelled": 0}
        counts["jobs_cancelled"] = self.jobs.cancel_user(user_id)
        if self.bank.store.has_user(user_id):
            counts["memories"] = self.bank.store.count(user_id)
            self.bank.delete_user(user_id)
        counts["selections"] = self.selections.delete_user(user_id)
        self.sessions.clear(user_id)
        if self.config.reranker_per == "user":
            with self._learn_lock:
                self._learners.pop(user_id, None)
                self._saved.pop(user_id, None)
                path = self._checkpoint_path(user_id)
                if path.exists():
                    import shutil

                    shutil.rmtree(path, ignore_errors=True)
        return counts

    # ---- retrieval (the batched call) ----------------------------------------------------
    def retrieve_batch(self, items: list[RetrieveItem]) -> list[RetrieveResult | Exception]:
        """Every query of the batch in one encode; per user one search; per reranker one select."""
        results: list[RetrieveResult | Exception | None] = [None] * len(items)
        live = []
        for i, item in enumerate(items):
            if self.bank.store.has_user(scoped(item.tenant, item.user)):
                live.append(i)
            else:
                results[i] = UnknownUserError(f"unknown user {item.user!r} (no memories stored for this user)")
        if live:
            vectors = self.encoder.encode_queries([items[i].query for i in live])
            query_vec = dict(zip(live, vectors))
            candidates = self._search(items, live, query_vec, results)
            self._select_and_store(items, candidates, results)
        return [r if r is not None else RuntimeError("query was not processed") for r in results]

    def _search(self, items: list[RetrieveItem], live: list[int], query_vec: dict[int, torch.Tensor],
                results: list[Any]) -> dict[int, Candidates]:
        by_user: dict[str, list[int]] = defaultdict(list)
        for i in live:
            by_user[scoped(items[i].tenant, items[i].user)].append(i)
        found: dict[int, Candidates] = {}
        for user_id, positions in by_user.items():
            q = torch.stack([query_vec[i] for i in positions])
            search_q = q
            if self.config.scope == "bank":  # search the whole bank with the learned query q·A
                key = self._reranker_key(items[positions[0]].tenant, user_id)
                with self._learn_lock:
                    search_q = self.learner(key).reranker.transform_queries(q.to(self.bank.device)).cpu()
            k_max = max(items[i].k for i in positions)
            try:
                rows = self.bank.search_embeddings(search_q, user_id, k_max, queries=[items[i].query for i in positions])
            except UnknownUserError as exc:  # deleted since the batch began
                for i in positions:
                    results[i] = exc
                continue
            for i, row, vec in zip(positions, rows, q):
                k = items[i].k
                found[i] = Candidates(query=row.query, memory_ids=row.memory_ids[:k],
                                      retriever_scores=row.retriever_scores[:k], embeddings=row.embeddings[:k],
                                      query_embedding=vec, user_id=user_id)
        return found

    def _select_and_store(self, items: list[RetrieveItem], candidates: dict[int, Candidates],
                          results: list[Any]) -> None:
        groups: dict[tuple[str, bool], list[int]] = defaultdict(list)
        for i in candidates:
            user_id = scoped(items[i].tenant, items[i].user)
            groups[(self._reranker_key(items[i].tenant, user_id), items[i].explore)].append(i)
        selections: dict[int, Selection] = {}
        keys: dict[int, str] = {}
        for (key, explore), positions in groups.items():
            m_max = max(items[i].m for i in positions)
            with self._learn_lock:
                reranker = self.learner(key).reranker
                picked = reranker.select([candidates[i] for i in positions], m_max, tau=self.learner_config.tau,
                                         explore=explore, generator=self._generator)
            for i, selection in zip(positions, picked):
                # A Gumbel top-m is the first m picks of the top-M_max (same noise): truncation is exact.
                m = items[i].m
                selection.chosen = selection.chosen[:m]
                if selection.logp is not None:
                    selection.logp = selection.logp[:m]
                selections[i] = selection
                keys[i] = key
        now = time.time()
        expires = now + self.config.selection_ttl_s
        pending: list[PendingSelection] = []
        memories: dict[str, dict[str, Memory]] = {}
        by_user: dict[str, set[str]] = defaultdict(set)
        for i, selection in selections.items():
            by_user[selection.candidates.user_id].update(selection.memory_ids)
        for user_id, ids in by_user.items():
            try:
                memories[user_id] = {m.id: m for m in self.bank.get(user_id, sorted(ids))} if ids else {}
            except (UnknownUserError, UnknownMemoryError) as exc:  # deleted between search and now
                for i, selection in list(selections.items()):
                    if selection.candidates.user_id == user_id:
                        results[i] = exc
                        del selections[i]
        for i, selection in selections.items():
            item, c = items[i], selection.candidates
            shown = [
                ShownMemory(index=j, id=c.memory_ids[idx], text=memories[c.user_id][c.memory_ids[idx]].text,
                            kind=memories[c.user_id][c.memory_ids[idx]].kind,
                            refs=list(memories[c.user_id][c.memory_ids[idx]].refs),
                            score=float(selection.scores[idx]), retriever_score=float(c.retriever_scores[idx]),
                            time_span=memories[c.user_id][c.memory_ids[idx]].time_span)
                for j, idx in enumerate(selection.chosen)
            ]
            has_pick = bool(selection.chosen)
            if has_pick:
                pending.append(PendingSelection(
                    id=selection.id, tenant=item.tenant, user_id=c.user_id, reranker_key=keys[i], query=item.query,
                    memory_ids=list(c.memory_ids), chosen=list(selection.chosen), explore=selection.explore,
                    query_embedding=c.query_embedding, scores=selection.scores, logp=selection.logp,
                    noise=selection.noise, created_at=now, expires_at=expires))
            results[i] = RetrieveResult(user=item.user, query=item.query,
                                        selection_id=selection.id if has_pick else None, explore=selection.explore,
                                        memories=shown, expires_at=expires if has_pick else None)
        try:
            self.selections.put_many(pending)
        except Exception as exc:  # no result may carry a selection id that feedback cannot find
            log.exception("could not persist %d selections", len(pending))
            for i in selections:
                results[i] = exc

    # ---- feedback -------------------------------------------------------------------------
    def feedback(self, tenant: str, selection_id: str, *, cited: list[int] | None = None, text: str | None = None,
                 no_cite: bool = False, structured: bool = False) -> FeedbackResult:
        """Rewards from explicit indices, `[NO_CITE]`, or the LLM's raw reply, into the learner."""
        given = sum(x for x in (cited is not None, text is not None, no_cite))
        if given != 1:
            raise BadRequestError("give exactly one of `cited` (indices of the shown memories the answer used), "
                                  "`text` (the LLM's raw reply, citations parsed from it) or `no_cite: true`")
        outcome: dict[str, Any] = {}

        def check(pending: PendingSelection) -> None:
            n = len(pending.chosen)
            if cited is not None:
                bad = [i for i in cited if not 0 <= i < n]
                if bad:
                    raise BadRequestError(f"cited indices {bad} are outside the {n} memories shown (0..{n - 1})")
                if len(set(cited)) != len(cited):
                    raise BadRequestError(f"cited indices {cited} repeat an index")
                outcome.update(cited=list(cited), no_cite=not cited, warnings=[])
            elif no_cite:
                outcome.update(cited=[], no_cite=True, warnings=[])
            else:
                assert text is not None
                citation = (parse_json_citations if structured else parse_citations)(text, n)
                outcome.update(cited=citation.cited, no_cite=citation.no_cite, warnings=list(citation.warnings))

        pending = self.selections.claim(tenant, selection_id, check)
        rewards = rewards_from_citations(len(pending.chosen), outcome["cited"], outcome["no_cite"])
        selection = self._rebuild(pending)
        with self._learn_lock:
            learner = self.learner(pending.reranker_key)
            step_before = learner.stats.step
            loss = learner.record(selection, rewards)
            updated = learner.stats.step > step_before
            if updated:
                self.learner_updates += 1
            return FeedbackResult(selection_id=selection_id, rewards=None if rewards is None else rewards.tolist(),
                                  cited=outcome["cited"], no_cite=outcome["no_cite"], warnings=outcome["warnings"],
                                  updated=updated, loss=loss, learner_step=learner.stats.step,
                                  learner_records=learner.stats.records)

    def _rebuild(self, pending: PendingSelection) -> Selection:
        """The `Selection` the learner needs, candidate embeddings read back from the store."""
        embeddings = self.bank.embeddings(pending.user_id, pending.memory_ids)
        candidates = Candidates(query=pending.query, memory_ids=pending.memory_ids, retriever_scores=pending.scores,
                                embeddings=embeddings, query_embedding=pending.query_embedding,
                                user_id=pending.user_id)
        return Selection(candidates=candidates, chosen=pending.chosen, scores=pending.scores, logp=pending.logp,
                         noise=pending.noise, explore=pending.explore, id=pending.id)

    # ---- sessions and prospective reflection ---------------------------------------------
    def append_turns(self, tenant: str, user: str, turns: list[tuple[str, str]]) -> list[Turn]:
        """Append to the user's open session (committed before returning)."""
        return self.sessions.append(scoped(tenant, user), turns)

    def end_session(self, tenant: str, user: str, *, speakers: list[str] | None = None,
                    store_turns: bool = False) -> Job:
        """Hand the open session to a reflection job; the user's next turns open a new session."""
        user_id = scoped(tenant, user)
        session = self.sessions.current(user_id)
        if not session.turns:
            raise NoOpenSessionError(f"user {user!r} has no open session: post turns first")
        job = self._submit_session(tenant, session, speakers, store_turns)
        self.sessions.clear(user_id)  # after the job is committed: a crash between keeps both (no loss)
        return job

    def add_session(self, tenant: str, user: str, turns: list[Turn], *, session_id: str | None = None,
                    time_: str | None = None, speakers: list[str] | None = None, store_turns: bool = False) -> Job:
        """A whole finished session at once (e.g. importing history): reflected in the background."""
        user_id = scoped(tenant, user)
        sid = session_id or f"{user_id}:session-{Memory.new_id()[:12]}"
        fixed = [Turn(id=t.id or f"{sid}:{n}", session_id=sid, speaker=t.speaker, text=t.text, time=t.time)
                 for n, t in enumerate(turns)]
        return self._submit_session(tenant, Session(id=sid, user_id=user_id, turns=fixed, time=time_), speakers,
                                    store_turns)

    def _submit_session(self, tenant: str, session: Session, speakers: list[str] | None, store_turns: bool) -> Job:
        payload = {
            "session": {"id": session.id, "time": session.time,
                        "turns": [{"id": t.id, "speaker": t.speaker, "text": t.text, "time": t.time}
                                  for t in session.turns]},
            "speakers": speakers,
            "store_turns": store_turns,
        }
        return self.jobs.submit(tenant, session.user_id, "reflect", payload)

    def job(self, tenant: str, job_id: str) -> Job:
        return self.jobs.get(tenant, job_id)

    @property
    def reflector(self) -> ProspectiveReflector:
        if self._reflector is None:
            from rmm.reflection import ProspectiveReflector

            self._reflector = ProspectiveReflector(self.bank, self.llm)
        return self._reflector

    def _run_job(self, job: Job, payload: dict[str, Any]) -> dict[str, Any]:
        raw = payload["session"]
        session = Session(id=raw["id"], user_id=job.user_id, time=raw.get("time"),
                          turns=[Turn(id=t["id"], session_id=raw["id"], speaker=t["speaker"], text=t["text"],
                                      time=t.get("time")) for t in raw["turns"]])
        speakers = payload.get("speakers") or [s for s in dict.fromkeys(t.speaker for t in session.turns)
                                               if s not in self.config.reflection_speakers_exclude]
        touched = self.reflector.reflect(session, speakers=speakers) if speakers else []
        stored_turns: list[str] = []
        if payload.get("store_turns"):
            turns = [Memory(id=t.id, user_id=job.user_id, kind="turn", text=f"{t.speaker}: {t.text}", refs=[t.id],
                            source_text=t.text, time_span=(t.time, t.time)) for t in session.turns]
            stored_turns = self.bank.add(job.user_id, turns)
        return {"memories": [m.id for m in touched], "turn_memories": stored_turns,
                "method": "llm" if self.llm is not None else "fallback (non-LLM topic segmentation)",
                "speakers": speakers}

    # ---- introspection --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._learn_lock:
            learners = {key or "bank": {"step": lr.stats.step, "records": lr.stats.records, "pending": lr.pending}
                        for key, lr in self._learners.items()}
        return {
            "pending_selections": self.selections.count_pending(),
            "jobs": self.jobs.counts(),
            "learners": learners,
            "learner_updates": self.learner_updates,
            "encoder_query_calls": self.encoder.query_calls,
        }


def _progress(learner: Learner) -> tuple[int, int]:
    """What a checkpoint must reflect: records taken and buffered (both change state)."""
    return learner.stats.records + learner.stats.skipped_no_citation, learner.pending
