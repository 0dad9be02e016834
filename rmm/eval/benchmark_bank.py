"""A benchmark's dialogue as a searchable memory bank, one user per retrieval scope.

Encoding a benchmark is the slow part of every evaluation and training run, so the bank is kept
in the cache directory, keyed by dataset content, encoder and granularity (and, for topic
memories built by prospective reflection, the reflector's settings), and reused. While a dense
bank is built, its passage vectors also go to a per-encoder `PassageCache` (`<cache>/passages/`),
so the turn vectors a turn bank computed serve a topic bank's segmentation, and a topic bank
rebuilt with other reflector settings encodes only the topics that came out different.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from rmm.encoders import Encoder, load_encoder
from rmm.encoders.passage_cache import PassageCache, attach_cache
from rmm.errors import RmmError
from rmm.memory.bank import MemoryBank
from rmm.memory.bm25 import BM25Retriever
from rmm.memory.hybrid import OVER_DENSE, Fusion, HybridRetriever
from rmm.memory.storage import MemoryStorage, open_store
from rmm.memory.store import MemoryStore
from rmm.paths import cache_dir
from rmm.types import Dataset, Memory, Retriever

if TYPE_CHECKING:
    from rmm.llm.base import LLM
    from rmm.reflection import ProspectiveReflector
    from rmm.reflection.events import EventGraphBuilder

log = logging.getLogger(__name__)

GRANULARITIES = ("turn", "session", "topic", "event")
STATIC_GRANULARITIES = ("turn", "session")  # topic memories come from prospective reflection, events from
# CompassMem's construction (rmm.reflection.events: here its LLM-free fallback graph)
LEXICAL_RETRIEVERS = ("bm25",)
HYBRID = "hybrid"
DEFAULT_HYBRID_DENSE = "minilm"


@dataclass(frozen=True)
class RetrieverName:
    """A `--retriever` name read once: the encoder whose bank is searched (None: plain text-only
    BM25) and, for a first stage over that bank, the `HybridRetriever` fusion (None: the bank's
    own dense search)."""

    dense: str | None
    fusion: Fusion | None = None


def parse_retriever(name: str) -> RetrieverName:
    """`bm25` (text only), an encoder preset or folder, `hybrid[:DENSE]` (BM25 + DENSE fused) or
    `bm25:DENSE` (BM25's ranking over DENSE's bank, rerankable); a malformed name is an RmmError."""
    if not name:
        raise RmmError("--retriever needs a name: bm25, an encoder preset or folder, hybrid[:DENSE] or bm25:DENSE")
    if name in LEXICAL_RETRIEVERS:
        return RetrieverName(None)
    if name == HYBRID:
        return RetrieverName(DEFAULT_HYBRID_DENSE, OVER_DENSE[HYBRID])
    prefix, colon, dense = name.partition(":")
    if colon and prefix in OVER_DENSE:
        if not dense or dense in LEXICAL_RETRIEVERS or parse_retriever(dense).fusion is not None:
            raise RmmError(f"{prefix}:DENSE needs a dense encoder preset or folder after the colon, got {name!r}")
        return RetrieverName(dense, OVER_DENSE[prefix])
    return RetrieverName(name)


def documents(dataset: Dataset, user: str, granularity: str) -> list[Memory]:
    """One memory per turn or per session, each carrying refs to the turns it holds.

    Topic memories are not a fixed function of the dialogue: `fill_topics` builds them.
    """
    if granularity == "turn":
        return [
            Memory(id=t.id, user_id=user, kind="turn", text=f"{t.speaker}: {t.text}", refs=[t.id],
                   source_text=t.text, time_span=(s.time, s.time))
            for s in dataset.sessions[user] for t in s.turns
        ]
    if granularity == "session":
        return [
            Memory(id=s.id, user_id=user, kind="session", text=s.text(), refs=[t.id for t in s.turns],
                   source_text=s.text(), time_span=(s.time, s.time))
            for s in dataset.sessions[user] if s.turns
        ]
    if granularity == "topic":
        raise ValueError("topic memories are built by prospective reflection: use fill_topics / open_retriever")
    if granularity == "event":
        raise ValueError("event memories are built by the event-graph builder: use fill_events / open_retriever")
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def dataset_digest(dataset: Dataset, granularity: str) -> str:
    """A short content hash: a changed dataset never reuses a stale cached bank."""
    h = hashlib.sha256(f"{dataset.name}|{granularity}".encode())
    for user, sessions in dataset.sessions.items():
        h.update(user.encode())
        for s in sessions:
            for t in s.turns:
                h.update(f"{t.id}\x1f{t.speaker}\x1f{t.text}\x1e".encode())
    return h.hexdigest()[:16]


def fill(bank_or_store: MemoryBank | MemoryStorage, dataset: Dataset, granularity: str,
         progress: bool = True) -> None:
    """Add every user's documents that are not there yet (an interrupted build resumes)."""
    store = bank_or_store.store if isinstance(bank_or_store, MemoryBank) else bank_or_store
    for user in tqdm(dataset.users, desc=f"building {granularity} bank", unit="user", disable=not progress):
        docs = documents(dataset, user, granularity)
        if store.has_user(user):
            if store.count(user) == len(docs):
                continue
            bank_or_store.delete_user(user)  # partial from an interrupted build: redo it whole
        if isinstance(bank_or_store, MemoryBank):
            bank_or_store.add(user, docs)
        else:
            bank_or_store.add(docs)


def fill_topics(bank: MemoryBank, dataset: Dataset, reflector: ProspectiveReflector, progress: bool = True) -> None:
    """Each user's topic bank: prospective reflection over their sessions, in order.

    A user is marked done in the store's metadata only when every session was reflected, so an
    interrupted build is redone for that user rather than left half-merged.
    """
    for user in tqdm(dataset.users, desc="building topic bank", unit="user", disable=not progress):
        if bank.store.get_meta(f"topics-done:{user}") == "1" and bank.store.has_user(user):
            continue
        if bank.store.has_user(user):
            bank.delete_user(user)
        reflector.reflect_many(dataset.sessions[user])  # same memories as reflect() per session, fewer encodes
        bank.store.set_meta(f"topics-done:{user}", "1")
    log.info("prospective reflection stats: %s", reflector.stats)


def fill_events(bank: MemoryBank, dataset: Dataset, builder: EventGraphBuilder, progress: bool = True) -> None:
    """Each user's event graph (`rmm.reflection.events`), sessions in order; a user is marked done only
    when every session was built, so an interrupted build is redone for that user."""
    for user in tqdm(dataset.users, desc="building event graph", unit="user", disable=not progress):
        if bank.store.get_meta(f"events-done:{user}") == "1" and bank.store.has_user(user):
            continue
        if bank.store.has_user(user):
            bank.delete_user(user)
            bank.store.set_meta(f"event-graph:{user}", "{}")  # the builder's record of built sessions
        builder.build(user, dataset.sessions[user])
        bank.store.set_meta(f"events-done:{user}", "1")
    log.info("event graph build: %s", builder.report.to_json())


@dataclass
class DatasetRetriever:
    """A retriever over a dataset plus what built it (for reports and reuse)."""

    name: str
    retriever: Retriever
    encoder: Encoder | None
    path: Path | None


def open_retriever(name: str, dataset: Dataset, granularity: str, *, cache: str | Path | None = None,
                   device: str = "auto", index_backend: str = "torch", batch_size: int = 64,
                   progress: bool = True, llm: LLM | None = None,
                   reflector_options: dict[str, Any] | None = None, store: str | None = None,
                   candidate_features: bool = False) -> DatasetRetriever:
    """`bm25`, an encoder preset, an encoder folder, `hybrid[:DENSE]` or `bm25:DENSE` → a filled,
    cached retriever.

    `hybrid[:DENSE]` (default DENSE: minilm) is BM25 over the dense bank's own store fused with the
    bank's search (`rmm.memory.hybrid`, reciprocal-rank fusion); `bm25:DENSE` is BM25's ranking
    alone over that store. Both carry bank embeddings on their candidates, so the reranker and
    `rmm train` take them like a dense bank; plain `bm25` keeps a text-only store (no encoder).

    Topic granularity builds the bank by prospective reflection (with `llm`, else the labelled
    non-LLM fallback); the cache key includes the reflector's settings. Event granularity builds
    CompassMem's event graph with its LLM-free fallback (`rmm.reflection.events`), keyed by the
    builder's settings (thresholds included). With `store` (a
    ``postgresql://`` URL) the bank is kept in that database, one schema per cache key, instead of
    the cache folder. `candidate_features` makes a hybrid or `bm25:DENSE` first stage compute the
    reranker's per-candidate features (`rmm.memory.features`); other retrievers have none to compute.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    parsed = parse_retriever(name)
    if parsed.fusion is not None:
        assert parsed.dense is not None
        inner = open_retriever(parsed.dense, dataset, granularity, cache=cache, device=device,
                               index_backend=index_backend, batch_size=batch_size, progress=progress, llm=llm,
                               reflector_options=reflector_options, store=store)
        first_stage = HybridRetriever(inner.retriever, fusion=parsed.fusion,  # type: ignore[arg-type]
                                      candidate_features=candidate_features)
        return DatasetRetriever(name, first_stage, inner.encoder, inner.path)
    digest = dataset_digest(dataset, granularity)
    root = cache_dir(cache) / "banks"
    if granularity == "topic":
        if name in LEXICAL_RETRIEVERS:
            raise RmmError("topic memories are built with embeddings: for BM25 over them use bm25:DENSE "
                           "(e.g. bm25:minilm), not bm25")
        return _open_topic_bank(name, dataset, root, digest, device=device, index_backend=index_backend,
                                batch_size=batch_size, progress=progress, llm=llm, options=reflector_options or {},
                                store=store, cache=cache)
    if granularity == "event":
        if name in LEXICAL_RETRIEVERS:
            raise RmmError("event memories are built with embeddings: for BM25 over them use bm25:DENSE "
                           "(e.g. bm25:minilm), not bm25")
        return _open_event_bank(name, dataset, root, digest, device=device, index_backend=index_backend,
                                batch_size=batch_size, progress=progress, store=store, cache=cache)
    if name in LEXICAL_RETRIEVERS:
        path = root / f"{dataset.name}-{granularity}-{digest}-bm25.sqlite"
        with building(path):
            texts = MemoryStore(path) if store is None else open_store(_in_database(path, store))
            fill(texts, dataset, granularity, progress)
        return DatasetRetriever(name, BM25Retriever(texts), None, path if store is None else None)
    encoder = load_encoder(name, device=device, batch_size=batch_size)
    enc_key = hashlib.sha256(encoder.fingerprint.encode()).hexdigest()[:12]
    path = root / f"{dataset.name}-{granularity}-{digest}-{enc_key}"
    with building(path), passage_cache(encoder, cache):
        bank = MemoryBank(_in_database(path, store), encoder, index_backend=index_backend, device=device)
        fill(bank, dataset, granularity, progress)
    log.info("bank for %s/%s with %s at %s", dataset.name, granularity, encoder.name, bank.location)
    return DatasetRetriever(name, bank, encoder, bank.path)


@contextmanager
def building(path: Path) -> Iterator[None]:
    """Hold the cached bank at `path` while this process opens and fills it (a file lock in
    `.locks/` beside it). Two runs over one cache folder otherwise race: the second deletes a user the first is
    still adding, or opens an index before the first has finished, and both report figures of a bank
    neither meant. A second run waits here, then finds the bank complete."""
    from filelock import FileLock, Timeout

    locks = path.parent / ".locks"  # beside the banks, not among them
    locks.mkdir(parents=True, exist_ok=True)
    lock = FileLock(locks / f"{path.name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process building %s", path.name)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextmanager
def passage_cache(encoder: Encoder, cache: str | Path | None = None) -> Iterator[PassageCache | None]:
    """`encoder` answers passages from its cache under `<cache>/passages/` for the duration (a bank
    build); the encoder is left without it afterwards, as it was loaded. An encoder without the hook
    (any object with `encode_passages`, e.g. a user's own) builds uncached."""
    previous = getattr(encoder, "passage_cache", None)
    opened = attach_cache(encoder, cache)
    if opened is None:
        yield None
        return
    try:
        yield opened
    finally:
        encoder.passage_cache = previous
        if opened.hits or opened.misses:
            log.info("passage cache %s: %d hits, %d encoded", opened.path, opened.hits, opened.misses)
        opened.close()


def _in_database(path: Path, store: str | None) -> str | Path:
    """The cached bank's folder, or — with a database `store` — a schema there named after it."""
    if store is None:
        return path
    from rmm.memory.pg_connect import schema_name, with_schema

    return with_schema(store, schema_name(path.name.removesuffix(".sqlite")))


def _open_topic_bank(name: str, dataset: Dataset, root: Path, digest: str, *, device: str, index_backend: str,
                     batch_size: int, progress: bool, llm: LLM | None, options: dict[str, Any],
                     store: str | None = None, cache: str | Path | None = None) -> DatasetRetriever:
    from rmm.reflection import ProspectiveReflector, SegmenterConfig

    encoder = load_encoder(name, device=device, batch_size=batch_size)
    enc_key = hashlib.sha256(encoder.fingerprint.encode()).hexdigest()[:12]
    options = dict(options)
    segmenter = SegmenterConfig(**options.pop("segmenter", {}))
    probe = ProspectiveReflector(_KeyOnly(encoder), llm, segmenter=segmenter, **options)  # type: ignore[arg-type]
    settings = hashlib.sha256(probe.settings_key.encode()).hexdigest()[:10]
    path = root / f"{dataset.name}-topic-{digest}-{enc_key}-{settings}"
    with building(path), passage_cache(encoder, cache):
        bank = MemoryBank(_in_database(path, store), encoder, index_backend=index_backend, device=device)
        reflector = ProspectiveReflector(bank, llm, segmenter=segmenter, **options)
        fill_topics(bank, dataset, reflector, progress)
    log.info("topic bank for %s with %s (%s) at %s", dataset.name, encoder.name, probe.settings_key, bank.location)
    return DatasetRetriever(name, bank, encoder, bank.path)


def _open_event_bank(name: str, dataset: Dataset, root: Path, digest: str, *, device: str, index_backend: str,
                     batch_size: int, progress: bool, store: str | None = None,
                     cache: str | Path | None = None) -> DatasetRetriever:
    """The fallback event graph (LLM-free, so it builds on any CPU), keyed by the builder's settings."""
    from rmm.reflection.events import EventGraphBuilder

    encoder = load_encoder(name, device=device, batch_size=batch_size)
    enc_key = hashlib.sha256(encoder.fingerprint.encode()).hexdigest()[:12]
    probe = EventGraphBuilder(_KeyOnly(encoder))  # type: ignore[arg-type]
    settings = hashlib.sha256(probe.settings_key.encode()).hexdigest()[:10]
    path = root / f"{dataset.name}-event-{digest}-{enc_key}-{settings}"
    with building(path), passage_cache(encoder, cache):
        bank = MemoryBank(_in_database(path, store), encoder, index_backend=index_backend, device=device)
        builder = EventGraphBuilder(bank)
        fill_events(bank, dataset, builder, progress)
    log.info("event bank for %s with %s (%s) at %s", dataset.name, encoder.name, probe.settings_key, bank.location)
    return DatasetRetriever(name, bank, encoder, bank.path)


@dataclass
class _KeyOnly:
    """Just enough of a bank to ask a reflector for its settings key before the bank exists."""

    encoder: Encoder
