"""Which query engine runs here: measured on this machine, not assumed from the developer's.

A CPU fast path can be orders of magnitude apart between CPU families: oneDNN's int8 kernel made a
micro-batch of queries 1.2x faster on an Intel Xeon with AMX and ~1,500x slower on an AMD EPYC
without it. So at start-up every available engine (`rmm.encoders.query.precision.QUERY_ENGINES`)
is built over the server's encoder, its vectors are checked against float32's on probe queries
(cosine >= `MIN_COSINE`: int8 rounds, it must not change what a query means), and it is timed on
probe micro-batches of the sizes the server's batcher produces. `auto` takes the fastest; an
explicit precision is obeyed, with a warning when it measured more than `WARN_FACTOR` times slower
than the best. An engine that fails to build (onnxruntime missing, an export error, a kernel this
torch lacks) is skipped with its reason; one more than `SLOW_FACTOR` times slower than float32 on
its first probe call is not timed further.

The timings are cached in a JSON file keyed by a fingerprint of everything they depend on (the
encoder, the engines and probe sizes, torch's and onnxruntime's versions, the thread count, the
CPU's model and flags), so a restart does not measure again and a changed fingerprint does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rmm.device import cpu_fingerprint
from rmm.encoders.protocol import EncoderLike
from rmm.encoders.query.precision import QUERY_ENGINES, QUERY_PRECISIONS, build_engine
from rmm.errors import ConfigError

__all__ = ["EngineChoice", "EngineTiming", "choose_query_engine", "probe_batch_sizes", "slowdown"]

log = logging.getLogger(__name__)

MIN_COSINE = 0.95  # an engine's vectors vs float32's, each probe query (int8 on MiniLM/LoCoMo: > 0.98)
SLOW_FACTOR = 10.0  # slower than float32 by this much on a first call: not timed further
WARN_FACTOR = 2.0  # an explicit precision this much slower than the best is named in a warning
REPEATS = 3  # timed calls per probe batch after one warm-up call; the best counts
CACHE_FORMAT = 1

# Questions of the length and shape a dialogue agent asks (not taken from any benchmark).
PROBE_QUERIES = (
    "What did she say about her new job?",
    "Where did they go hiking last summer?",
    "Which book was he reading when we last talked?",
    "When is her sister's wedding?",
    "What kind of dog does the user have, and how old is it?",
    "Did he ever mention learning to play the guitar or any other instrument?",
    "How does she usually spend her weekends?",
    "What was the name of the restaurant they liked in Lisbon?",
    "Why did he decide to move to a different city?",
    "Who helped her prepare for the marathon?",
    "What allergies did the user tell me about?",
    "Which programming language is he learning at the moment?",
    "Has she been to Japan before?",
    "What gift did they buy for their mother's birthday?",
    "How many children does he have?",
    "What does she think about working from home versus going to the office every day?",
    "Hi",
    "Any news about the apartment?",
    "What happened at the concert on Friday night after the band finished playing?",
    "Which sports team does he support?",
    "What were her plans for the holidays?",
    "Did the user mention a favourite movie?",
    "What car does he drive?",
    "How did the job interview go?",
    "What is the user's preferred way to be contacted?",
    "When did she start painting, and what does she paint?",
    "What medication is he taking?",
    "Where does her best friend live?",
    "What did we talk about last time regarding the garden?",
    "Which languages does she speak?",
    "What is his daughter studying at university?",
    "Tell me again what she said about the trip to the mountains with her cousins last year.",
)


@dataclass(frozen=True)
class EngineTiming:
    """One engine's measurement: milliseconds per query at each probe batch size (best of
    `REPEATS`), the smallest cosine of its probe vectors to float32's, or why it was left out."""

    engine: str
    ms_per_query: dict[int, float] = field(default_factory=dict)
    min_cosine: float | None = None
    skipped: str | None = None  # a reason: it could not be built, disagreed with float32, or was too slow

    def round_ms(self, sizes: Sequence[int]) -> float:
        """Milliseconds for one query of each probe size's batch (the quantity `auto` minimises)."""
        if self.skipped is not None or any(size not in self.ms_per_query for size in sizes):
            return math.inf
        return sum(self.ms_per_query[size] * size for size in sizes) / sum(sizes)


@dataclass(frozen=True)
class EngineChoice:
    """What runs, what was asked for, and the measurement that decided it."""

    requested: str
    engine: str
    batch_sizes: tuple[int, ...]
    timings: tuple[EngineTiming, ...]
    fingerprint: str  # the cache key ("" when nothing was measured)
    cached: bool = False
    note: str = ""  # why nothing was measured, when nothing was

    @property
    def fastest(self) -> str | None:
        """The engine `auto` picks: the lowest `round_ms` (None when nothing was measured)."""
        best = min(self.timings, key=lambda t: t.round_ms(self.batch_sizes), default=None)
        return None if best is None or math.isinf(best.round_ms(self.batch_sizes)) else best.engine

    def timing(self, engine: str) -> EngineTiming | None:
        return next((t for t in self.timings if t.engine == engine), None)

    def summary(self) -> str:
        """The one log line: the choice, then each engine's ms/query per batch size or its reason."""
        if not self.timings:
            return f"query engine {self.engine} (asked: {self.requested}); nothing measured: {self.note}"
        parts = []
        for t in self.timings:
            if t.skipped is not None:
                parts.append(f"{t.engine} skipped ({t.skipped})")
            else:
                parts.append(f"{t.engine} " + "/".join(f"{t.ms_per_query[s]:.2f}" for s in self.batch_sizes)
                             + f" (cos {t.min_cosine:.3f})")
        sizes = "/".join(str(s) for s in self.batch_sizes)
        source = "cached" if self.cached else "measured"
        return (f"query engine {self.engine} (asked: {self.requested}); {source} ms/query at batch {sizes}: "
                + "; ".join(parts))

    def to_json(self) -> dict[str, Any]:
        return {"requested": self.requested, "engine": self.engine, "fastest": self.fastest,
                "batch_sizes": list(self.batch_sizes), "fingerprint": self.fingerprint, "cached": self.cached, "note": self.note,
                "timings": [{**asdict(t), "ms_per_query": {str(k): v for k, v in t.ms_per_query.items()}}
                            for t in self.timings]}

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> EngineChoice:
        timings = tuple(EngineTiming(t["engine"], {int(k): float(v) for k, v in t["ms_per_query"].items()},
                                     t["min_cosine"], t["skipped"]) for t in payload["timings"])
        return cls(payload["requested"], payload["engine"], tuple(payload["batch_sizes"]), timings,
                   payload["fingerprint"], bool(payload.get("cached", False)), str(payload.get("note", "")))


def probe_batch_sizes(batching: bool, max_batch: int) -> tuple[int, ...]:
    """The micro-batch sizes to time: a query alone, and with batching the sizes the batcher makes
    under load (it splits a backlog in halves, so 16 with 32 clients), capped at `max_batch`."""
    if not batching:
        return (1,)
    return tuple(sorted({1, min(16, max_batch), min(32, max_batch)}))


def _fingerprint(encoder: EncoderLike, engines: Sequence[str], sizes: Sequence[int]) -> str:
    payload = {"format": CACHE_FORMAT, "encoder": str(encoder.fingerprint), "engines": list(engines),
               "batch_sizes": list(sizes), "probe": hashlib.sha256("\n".join(PROBE_QUERIES).encode()).hexdigest()[:16],
               **cpu_fingerprint()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def _batch(size: int) -> list[str]:
    return [PROBE_QUERIES[i % len(PROBE_QUERIES)] for i in range(size)]


def _measure(engines: dict[str, EncoderLike], failures: dict[str, str], sizes: Sequence[int],
             clock: Callable[[], float]) -> tuple[EngineTiming, ...]:
    """Time each built engine, float32 first: its vectors are the reference each engine's warm-up
    call is checked against, and its times the bar for the slow cut-off (checked on the warm-up
    call, so an engine 1,000x slower costs one call per engine, not `REPEATS` more)."""
    vectors: dict[int, torch.Tensor] = {}
    seconds: dict[int, float] = {}
    timings = []
    for name in QUERY_ENGINES:
        if name in failures or name not in engines:
            if name in failures:
                timings.append(EngineTiming(name, skipped=failures[name]))
            continue
        encode = engines[name].encode_queries
        per_query: dict[int, float] = {}
        cosine, skipped = 1.0, None
        try:
            for size in sizes:
                texts = _batch(size)
                started = clock()
                with torch.inference_mode():
                    out = torch.as_tensor(encode(texts)).float()  # warm-up: a first call at a size may build kernels
                first = clock() - started
                if name == "float32":
                    vectors[size] = out
                else:
                    cosine = min(cosine, float(nn.functional.cosine_similarity(vectors[size], out).min()))
                    if cosine < MIN_COSINE:
                        skipped = f"min cosine to float32 {cosine:.3f} < {MIN_COSINE}"
                        break
                    if first > SLOW_FACTOR * seconds[size]:
                        per_query[size] = 1000 * first / size
                        skipped = f"{first / seconds[size]:.0f}x slower than float32 at batch {size}"
                        break
                best = math.inf
                for _ in range(REPEATS):
                    started = clock()
                    encode(texts)
                    best = min(best, clock() - started)
                per_query[size] = 1000 * best / size
                if name == "float32":
                    seconds[size] = best
        except Exception as err:  # noqa: BLE001 - an engine that fails at run time is skipped, with its reason
            timings.append(EngineTiming(name, skipped=f"failed on the probe queries: {type(err).__name__}: {err}"))
            continue
        timings.append(EngineTiming(name, per_query, cosine, skipped))
    return tuple(timings)


def _read_cache(path: Path | None, fingerprint: str) -> EngineChoice | None:
    if path is None or not path.is_file():
        return None
    try:
        choice = EngineChoice.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("ignoring the unreadable query-engine cache %s (%s): measuring again", path, err)
        return None
    return choice if choice.fingerprint == fingerprint else None


def _write_cache(path: Path | None, choice: EngineChoice) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(choice.to_json(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:  # a read-only cache costs a measurement at the next start, nothing else
        log.warning("could not cache the query-engine timings at %s: %s", path, err)


def slowdown(mine: EngineTiming, best: EngineTiming) -> float:
    """How many times slower `mine` ran than `best` over the probe sizes both were timed at (an
    engine cut off as too slow was timed at its first size only)."""
    sizes = [s for s in mine.ms_per_query if s in best.ms_per_query]
    if not sizes:
        return math.nan
    return sum(mine.ms_per_query[s] * s for s in sizes) / sum(best.ms_per_query[s] * s for s in sizes)


def _warn_if_slow(choice: EngineChoice) -> None:
    best = choice.fastest
    mine, fastest = choice.timing(choice.engine), choice.timing(best) if best else None
    if mine is None or fastest is None or best == choice.engine:
        return
    ratio = slowdown(mine, fastest)
    if ratio > WARN_FACTOR:
        log.warning("query_precision %s measured %.1fx slower than %s on this machine%s; query_precision: auto "
                    "would take %s", choice.engine, ratio, best, f" ({mine.skipped})" if mine.skipped else "", best)


def choose_query_engine(encoder: EncoderLike, precision: str = "auto", *, batch_sizes: Sequence[int] = (1, 16, 32),
                        cache_dir: Path | None = None, clock: Callable[[], float] | None = None,
                        build: Callable[[EncoderLike, str], EncoderLike] = build_engine,
                        ) -> tuple[EncoderLike, EngineChoice]:
    """The query encoder to serve with and the measurement behind it.

    `precision`: `auto` (the fastest engine measured here) or one of `QUERY_ENGINES` (obeyed; a
    `ConfigError` when it cannot run here). An encoder that is not a transformer on the CPU has one
    engine, float32, and nothing is measured. `cache_dir`: where the timings are kept across
    restarts (None: not kept). `clock`: by default this process's CPU time when it computes on one
    thread (the work an engine does, whatever else the machine runs), else wall time (threads
    working in parallel shorten a call, not its CPU time). `clock` and `build` are injectable for
    tests."""
    if precision not in QUERY_PRECISIONS:
        raise ConfigError(f"query_precision must be one of {list(QUERY_PRECISIONS)}, got {precision!r}")
    sizes = tuple(sorted(set(batch_sizes)))
    transformer = isinstance(getattr(encoder, "model", None), nn.Module)
    on_cpu = getattr(encoder, "device", torch.device("cpu")).type == "cpu"
    if not (transformer and on_cpu):
        if precision not in ("auto", "float32"):
            build(encoder, precision)  # raises the reason (not a transformer, not on the CPU)
        why = "not a transformer" if not transformer else f"on {encoder.device}"  # type: ignore[attr-defined]
        return encoder, EngineChoice(precision, "float32", sizes, (), "", note=f"{encoder.name} is {why}")
    fingerprint = _fingerprint(encoder, QUERY_ENGINES, sizes)
    path = None if cache_dir is None else Path(cache_dir) / "query-engines" / f"{fingerprint}.json"
    cached = _read_cache(path, fingerprint)
    built: dict[str, EncoderLike] = {}
    if cached is not None:
        timings = cached.timings
    else:
        failures: dict[str, str] = {}
        for name in QUERY_ENGINES:
            try:
                built[name] = build(encoder, name)
            except Exception as err:  # noqa: BLE001 - any engine may fail to build here; float32 cannot
                if name == "float32":
                    raise
                failures[name] = str(err) if isinstance(err, ConfigError) else f"{type(err).__name__}: {err}"
        if clock is None:
            clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
        timings = _measure(built, failures, sizes, clock)
    measured = EngineChoice(precision, "float32", sizes, timings, fingerprint, cached=cached is not None)
    engine = (measured.fastest or "float32") if precision == "auto" else precision
    choice = EngineChoice(precision, engine, sizes, timings, fingerprint, cached=cached is not None)
    if cached is None:
        _write_cache(path, choice)
    if precision != "auto":
        _warn_if_slow(choice)
    log.info("%s", choice.summary())
    return built.get(engine) or build(encoder, engine), choice
