"""The retrieval service without HTTP: one facade over the server's parts.

`RetrievalService` builds the parts from a `ServeConfig` and answers for them, so the routes, the
tests and embedding code see one object:

- tenants and API keys: `rmm.serve.tenants` (every user id is stored tenant-scoped);
- users and memories: `rmm.serve.memories.UserMemories` (durable writes, batched encodes);
- batched retrieval: `rmm.serve.retrieval.BatchRetriever` (what the micro-batcher calls);
- feedback → learner: `rmm.serve.feedback.FeedbackLearner`;
- the event graph's neighbour slates, learned from like retrieves: `rmm.serve.neighbours.NeighbourSlates`;
- Semantic XPath: the user's tree, its schema Σ, tree writes and queries whose slates are learned
  from like retrieves: `rmm.serve.xpath.TreeQueries`;
- sessions and reflection jobs: `rmm.serve.reflection_jobs.SessionReflection` (with
  `reflection_events`, each session's `events` job too: `rmm.serve.event_jobs`);
- shadow scoring and guarded promotion of candidate weights: `rmm.serve.shadow.ShadowScorer`;
- rerankers: one `rmm.policy.registry.LearnerRegistry`, a learner per tenant by default (one
  tenant's feedback never moves another's ranking), per user, or one shared by the whole bank
  when `reranker_per: bank` says so; checkpointed every `checkpoint_interval_s` by
  `rmm.serve.maintenance` and at `close()`.

The store location picks where the server's own state lives. A bank folder (the default): SQLite
files beside it (`selections.sqlite`, `jobs.sqlite`) and checkpoint folders, the learner in this
process. A `postgresql://` store: the same interfaces over the bank's database (tables
`selections`, `feedback`, `jobs`, `reranker_versions`), so any number of replicas serve one bank;
`rmm.serve.learner_lease.SharedLearning` makes exactly one of them the learner and keeps every
replica on the newest reranker version. Open sessions (turns not yet ended) stay in the folder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rmm.encoders.protocol import EncoderLike
from rmm.encoders.query.choice import EngineChoice, choose_query_engine, probe_batch_sizes
from rmm.encoders.query.locked import LockedEncoder
from rmm.encoders.query.process import ProcessQueryEncoder, QueryProcessSpec
from rmm.errors import ConfigError
from rmm.memory.bank import MemoryBank
from rmm.memory.index import CPU_PRECISIONS
from rmm.memory.sessions import SessionLog
from rmm.memory.tree import NodeEdit, TreeNode
from rmm.paths import cache_dir
from rmm.policy.learner import Learner, is_normalized_encoder
from rmm.policy.registry import SHARED, LearnerRegistry, checkpoint_exists
from rmm.serve.config import ServeConfig
from rmm.serve.feedback import FeedbackLearner
from rmm.serve.jobs import Handler, Job, Jobs
from rmm.serve.maintenance import Maintenance
from rmm.serve.memories import UserMemories
from rmm.serve.neighbours import NeighbourRequest, NeighbourSlates
from rmm.serve.pending import Selections, SelectionStore
from rmm.serve.records import (
    FeedbackResult,
    NeighboursResult,
    NewMemory,
    RetrieveItem,
    RetrieveResult,
    ShownMemory,
    TreeNodeInfo,
    TreeSchema,
    WriteItem,
    XPathResult,
)
from rmm.serve.reflection_jobs import SessionReflection
from rmm.serve.shadow import ShadowScorer
from rmm.serve.retrieval import BatchRetriever, EncodedBatch
from rmm.serve.tenants import ApiKeys, scoped, unscoped
from rmm.serve.xpath import TreeQueries, XPathRequest
from rmm.types import Memory, Turn

if TYPE_CHECKING:
    from rmm.llm.base import LLM
    from rmm.memory.pg_database import PgDatabase
    from rmm.serve.learner_lease import SharedLearning

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


class RetrievalService:
    """Thread-safe core of `rmm serve`; `start()` launches its background threads."""

    def __init__(self, config: ServeConfig, *, encoder: EncoderLike | None = None, llm: LLM | None = None) -> None:
        self.config = config.validate()
        self.api_keys = ApiKeys(config.auth)
        if config.torch_threads is not None:  # process-wide: the server owns its process
            torch.set_num_threads(config.torch_threads)
        loads_encoder = encoder is None
        if encoder is None:
            from rmm.encoders import load_encoder

            encoder = load_encoder(config.encoder, device=config.device)
        multiple = CPU_PRECISIONS.get(config.index_precision)
        if multiple and int(encoder.dim) % multiple:
            raise ConfigError(f"index_precision {config.index_precision!r} needs an embedding size divisible by "
                              f"{multiple}; {encoder.name} has {encoder.dim} (use float16)")
        self.query_process: ProcessQueryEncoder | None = None
        # the query engine is timed on the micro-batch sizes this server's batcher makes (rmm.encoders.query.choice)
        sizes = probe_batch_sizes(config.batching.enabled, config.batching.max_batch)
        on_cpu = getattr(encoder, "device", torch.device("cpu")).type == "cpu"
        if config.query_process == "on" or (config.query_process == "auto" and loads_encoder and on_cpu):
            if not loads_encoder or not on_cpu:
                raise ConfigError("query_process: on needs the server to load its encoder (`encoder:`) onto the CPU")
            # the child builds the query path (`query_precision`); this process keeps the float
            # encoder for passages
            self.query_process = ProcessQueryEncoder(encoder, QueryProcessSpec(
                config.encoder, config.query_precision, config.torch_threads, sizes, str(cache_dir())))
            assert self.query_process.choice is not None  # set by a started child
            self._query_engine: EngineChoice = self.query_process.choice
            self.encoder = LockedEncoder(self.query_process)
        else:
            query_path, self._query_engine = choose_query_engine(encoder, config.query_precision, batch_sizes=sizes,
                                                                cache_dir=cache_dir())
            self.encoder = LockedEncoder(query_path)
        try:
            self._build(config, encoder, llm)
        except BaseException:  # nothing half-built may outlive the failure: above all not the child process
            if self.query_process is not None:
                self.query_process.close()
            raise

    def _build(self, config: ServeConfig, encoder: EncoderLike, llm: LLM | None) -> None:
        """The bank, the server's state and the parts over them (`__init__`, once the encoder is up)."""
        path = config.bank_path
        self.bank = MemoryBank(config.store or path, self.encoder, index_backend=config.index_backend,
                               index_options=config.index_options, device=config.device)
        self.learner_config = config.learner_config(is_normalized_encoder(encoder))
        if llm is None and config.llm:
            from rmm.llm import load_llm

            llm = load_llm(config.llm)
        self.llm = llm
        self.db: PgDatabase | None = None
        self.shared_learning: SharedLearning | None = None
        jobs: Callable[[Handler], Jobs] | None = None
        versions = None
        if config.store:  # the server's state in the bank's database, shared by every replica
            from rmm.memory.pg_store import PostgresStore
            from rmm.policy.pg_versions import RerankerVersions
            from rmm.serve.pg_jobs import PgJobQueue
            from rmm.serve.pg_pending import PgSelectionStore

            store = self.bank.store
            if not isinstance(store, PostgresStore):  # a postgresql:// bank opens one; never run without it
                self.bank.close()
                raise ConfigError(f"the postgresql:// store opened as {type(store).__name__}, not a PostgresStore: "
                                  "the server's shared state (selections, feedback, jobs, versions) needs one")
            # the store's handle: one migration and one pool (sized by `database:`) for memories and
            # server state; the bank closes it
            db = self.db = store.database
            self.selections: Selections = PgSelectionStore(db, config.selection_ttl_s)
            versions = RerankerVersions(db)
            jobs = lambda handler: PgJobQueue(db, handler, lease_s=config.job_lease_s)
        else:
            self.selections = SelectionStore(path / SELECTIONS_FILE, config.selection_ttl_s)
        self.selections.upgrade_legacy(self.bank.embeddings)
        self.sessions = SessionLog(path / SESSIONS_FILE)
        self.learners = LearnerRegistry(self.bank.dim, self.learner_config, encoder_name=self.encoder.fingerprint,
                                        device=self.bank.device, root=None if config.store else path / CHECKPOINT_DIR,
                                        subdir="users" if config.reranker_per == "user" else "tenants",
                                        versions=versions)
        if self.db is not None and versions is not None:
            from rmm.serve.learner_lease import SharedLearning

            self.shared_learning = SharedLearning(self.db, self.learners, versions,
                                                  reload_interval_s=config.reload_interval_s)
        self.reflection = SessionReflection(self.bank, self.sessions, path / JOBS_FILE, llm,
                                            speakers_exclude=config.reflection_speakers_exclude, jobs=jobs,
                                            events=config.reflection_events, tree=config.reflection_tree)
        self.jobs = self.reflection.jobs
        self.user_memories = UserMemories(self.bank, self.encoder, selections=self.selections, sessions=self.sessions,
                                          jobs=self.jobs, learners=self.learners,
                                          per_user_rerankers=config.reranker_per == "user")
        self.retriever = BatchRetriever(config, self.bank, self.encoder, self.learners,
                                        self.selections,  # type: ignore[arg-type]  # any Selections
                                        tau=self.learner_config.tau)
        self.neighbour_slates = NeighbourSlates(config, self.bank, self.encoder, self.learners, self.selections,
                                                tau=self.learner_config.tau)
        self.tree_queries = TreeQueries(config, self.bank, self.encoder, self.learners, self.selections,
                                        tau=self.learner_config.tau)
        self.feedback_learner = FeedbackLearner(self.selections, self.learners)
        self.shadow: ShadowScorer | None = None
        if config.shadow.checkpoint:
            self.shadow = ShadowScorer(config.shadow, self.learners, self.selections,
                                       key=SHARED if config.shadow.key is None else config.shadow.key,
                                       tau=self.learner_config.tau, root=path / CHECKPOINT_DIR, seed=config.seed,
                                       shared=self.shared_learning)
            self.feedback_learner.observers.append(self.shadow.observe)
        self.maintenance = Maintenance(sweep=self.selections.sweep, checkpoint=self.checkpoint,
                                       checkpoint_interval_s=config.checkpoint_interval_s,
                                       selection_ttl_s=config.selection_ttl_s)
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Load the configured tenants' rerankers (so `/metrics` shows their learning from the
        start), then start the reflection worker (queued jobs resume) and the maintenance thread."""
        self._load_rerankers()
        self.feedback_learner.replay()  # feedback stored after the last checkpoint (a crash), SQLite only
        if self.shadow is not None:
            self.shadow.resume()
        self.jobs.start()
        self.maintenance.start()
        if self.shared_learning is not None:
            self.shared_learning.start()

    def _load_rerankers(self) -> None:
        per = self.config.reranker_per
        keys = [SHARED] if per == "bank" else self.api_keys.tenants() if per == "tenant" else []
        for key in keys:
            self.learners.get(key)
        shared = self.config.bank_path / CHECKPOINT_DIR
        if per != "bank" and not self.config.store and checkpoint_exists(shared):
            log.warning("%s holds a reranker shared by the whole bank, which reranker_per: %s does not use (each "
                        "%s learns its own); set reranker_per: bank to keep ranking with it", shared, per, per)

    def close(self) -> None:
        """Stop background work, checkpoint every reranker, close the databases."""
        if self._closed:
            return
        self._closed = True
        if self.shared_learning is not None:
            self.shared_learning.stop()
        self.maintenance.stop()
        self.jobs.close()
        try:
            self.checkpoint()
        finally:
            if self.query_process is not None:
                self.query_process.close()
            self.selections.close()
            self.sessions.close()
            self.bank.close()  # with a PostgreSQL store, also `self.db` (the store's handle)

    # ---- auth and rerankers ----------------------------------------------------------------
    def tenant_for_key(self, key: str | None) -> str | None:
        return self.api_keys.tenant_for(key)

    def learner(self, key: str) -> Learner:
        """The learner of a reranker key, loaded from its checkpoint when one was saved."""
        return self.learners.get(key)

    def checkpoint(self) -> int:
        """Save every reranker that learned something since its last save; returns how many
        (the feedback they hold is marked, so a restart replays only what came after)."""
        return self.feedback_learner.checkpoint(self.learners.save)

    # ---- users and memories ----------------------------------------------------------------
    def require_user(self, tenant: str, user: str) -> str:
        return self.user_memories.require_user(tenant, user)

    def users(self, tenant: str) -> list[str]:
        return self.user_memories.users(tenant)

    def add_memories(self, tenant: str, user: str, memories: list[NewMemory]) -> list[str]:
        return self.user_memories.add(tenant, user, memories)

    def add_memories_batch(self, items: list[WriteItem]) -> list[list[str] | Exception]:
        return self.user_memories.add_batch(items)

    def memories(self, tenant: str, user: str) -> list[Memory]:
        return self.user_memories.memories(tenant, user)

    def delete_memory(self, tenant: str, user: str, memory_id: str) -> int:
        return self.user_memories.delete_memory(tenant, user, memory_id)

    def delete_user(self, tenant: str, user: str) -> dict[str, int]:
        return self.user_memories.delete_user(tenant, user)

    # ---- retrieval and feedback ------------------------------------------------------------
    def retrieve_batch(self, items: list[RetrieveItem]) -> list[RetrieveResult | Exception]:
        return self.retriever.retrieve_batch(items)

    def encode_retrievals(self, items: list[RetrieveItem]) -> EncodedBatch:
        """A batch's first stage (`BatchRetriever.encode_batch`), for the pipelined batcher."""
        return self.retriever.encode_batch(items)

    def finish_retrievals(self, items: list[RetrieveItem], encoded: EncodedBatch) -> list[RetrieveResult | Exception]:
        """A batch's second stage (`BatchRetriever.finish_batch`)."""
        return self.retriever.finish_batch(items, encoded)

    def neighbours(self, request: NeighbourRequest) -> NeighboursResult:
        """A slate of an event's unvisited neighbours (`rmm.serve.neighbours`), learned from by feedback."""
        return self.neighbour_slates.slate(request)

    def schema(self, tenant: str, user: str) -> TreeSchema:
        """Σ of the user's tree (`rmm.serve.xpath`)."""
        return self.tree_queries.schema(tenant, user)

    def xpath(self, request: XPathRequest) -> XPathResult:
        """A Semantic XPath query over the user's tree and a slate of its best leaves, learned from by feedback."""
        return self.tree_queries.query(request)

    def tree(self, tenant: str, user: str, as_of: int | None = None) -> tuple[int, list[TreeNodeInfo]]:
        return self.tree_queries.tree(tenant, user, as_of)

    def add_nodes(self, tenant: str, user: str, nodes: list[TreeNode]) -> int:
        return self.tree_queries.add_nodes(tenant, user, nodes)

    def edit_nodes(self, tenant: str, user: str, edits: list[NodeEdit]) -> int:
        return self.tree_queries.edit_nodes(tenant, user, edits)

    def remove_node(self, tenant: str, user: str, node_id: str) -> int:
        return self.tree_queries.remove_node(tenant, user, node_id)

    def feedback(self, tenant: str, selection_id: str, *, cited: list[int] | None = None, text: str | None = None,
                 no_cite: bool = False, structured: bool = False) -> FeedbackResult:
        return self.feedback_learner.feedback(tenant, selection_id, cited=cited, text=text, no_cite=no_cite,
                                              structured=structured)

    @property
    def learner_updates(self) -> int:
        """Optimizer steps taken from feedback since the server started."""
        return self.feedback_learner.updates

    # ---- sessions and reflection -----------------------------------------------------------
    def append_turns(self, tenant: str, user: str, turns: list[tuple[str, str]]) -> list[Turn]:
        return self.reflection.append_turns(tenant, user, turns)

    def end_session(self, tenant: str, user: str, *, speakers: list[str] | None = None,
                    store_turns: bool = False) -> Job:
        return self.reflection.end_session(tenant, user, speakers=speakers, store_turns=store_turns)

    def add_session(self, tenant: str, user: str, turns: list[Turn], *, session_id: str | None = None,
                    time_: str | None = None, speakers: list[str] | None = None, store_turns: bool = False,
                    events: bool | None = None) -> Job:
        return self.reflection.add_session(tenant, user, turns, session_id=session_id, time_=time_,
                                           speakers=speakers, store_turns=store_turns, events=events)

    def job(self, tenant: str, job_id: str) -> Job:
        return self.reflection.job(tenant, job_id)

    # ---- introspection ---------------------------------------------------------------------
    @property
    def query_engine(self) -> EngineChoice:
        """The query engine serving now and the measurement that chose it (with a query process:
        its current child's)."""
        if self.query_process is not None and self.query_process.choice is not None:
            return self.query_process.choice
        return self._query_engine

    def stats(self) -> dict[str, Any]:
        """What `/metrics` reports at scrape time (pending selections, jobs, learners).

        Learner figures are totals over the loaded rerankers: `/metrics` needs no key, so it names
        no tenant and shows no tenant's own activity (each tenant sees its own in feedback answers).
        """
        with self.learners.lock:
            learners = [learner for _, learner in self.learners.items()]
            steps = sum(learner.stats.step for learner in learners)
            records = sum(learner.stats.records for learner in learners)
        return {
            "pending_selections": self.selections.count_pending(),
            "jobs": self.jobs.counts(),
            "rerankers": len(learners),
            "learner_step": steps,
            "learner_records": records,
            "learner_updates": self.learner_updates,
            "encoder_query_calls": self.encoder.query_calls,
            **self._shared_stats(),
            **(self.shadow.stats() if self.shadow is not None else {}),
        }

    def _shared_stats(self) -> dict[str, Any]:
        """With a PostgreSQL store: whether this replica is the learner, and its work."""
        if self.shared_learning is None:
            return {}
        lease = self.shared_learning.stats
        return {"is_learner": int(lease.is_learner), "learner_acquisitions": lease.acquisitions,
                "feedback_applied": lease.applied, "reranker_versions_written": lease.versions_written,
                "reranker_reloads": lease.reloads}
