"""Prometheus metrics of the server (served at `/metrics`, text format, no key needed).

Counters and histograms are updated as requests and batches happen; the gauges (pending
selections, jobs, learner steps) are read from the service at scrape time, so they can never
drift from its state. The endpoint needs no key, so learner figures are totals with no tenant
label. One registry per app, so several apps (tests) never share counters.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rmm.serve.service import RetrievalService

__all__ = ["Metrics", "RequestMetrics"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    """The app's registry and the counters the routes and batchers update."""

    def __init__(self, service: RetrievalService) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rmm_http_requests", "HTTP requests", ["method", "route", "status"], registry=r)
        self.latency = Histogram("rmm_http_request_seconds", "HTTP request latency", ["route"], registry=r,
                                 buckets=LATENCY_BUCKETS)
        self.promotions = Counter("rmm_reranker_promotions", "guarded promotions of the shadow reranker asked for, "
                                  "by outcome", ["outcome"], registry=r)
        self.batch_size = Histogram("rmm_batch_size", "queries per batched retrieval call", registry=r,
                                    buckets=BATCH_SIZE_BUCKETS)
        self.batch_seconds = Histogram("rmm_batch_seconds", "work of one batched retrieval call (both stages, "
                                       "not the wait between them)", registry=r, buckets=LATENCY_BUCKETS[:-2])
        self.stage_seconds = Histogram("rmm_batch_stage_seconds", "work of one stage of a batched retrieval call "
                                       "(prepare: encode the queries; finish: search, rerank, store)", ["stage"],
                                       registry=r, buckets=LATENCY_BUCKETS[:-2])
        self.queries = Counter("rmm_retrieve_queries", "retrieve queries answered", registry=r)
        self.feedback = Counter("rmm_feedback", "feedback received", ["outcome"], registry=r)
        self.updates = Counter("rmm_learner_updates", "reranker optimizer steps from feedback", registry=r)
        self.memories = Counter("rmm_memories_added", "memories stored through the API", registry=r)
        r.register(ServiceCollector(service))

    def on_batch(self, size: int, seconds: float) -> None:
        """The retrieve batcher's report of one batched call."""
        self.batch_size.observe(size)
        self.batch_seconds.observe(seconds)

    def on_stage(self, stage: str, seconds: float) -> None:
        """One stage's work for one batch (its sum over time / wall time = how busy that stage is)."""
        self.stage_seconds.labels(stage=stage).observe(seconds)


class ServiceCollector:
    """Gauges read at scrape time from the service's own state."""

    def __init__(self, service: RetrievalService) -> None:
        self.service = service

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self.service.stats()
        pending = GaugeMetricFamily("rmm_pending_selections", "selections waiting for feedback")
        pending.add_metric([], stats["pending_selections"])
        yield pending
        jobs = GaugeMetricFamily("rmm_jobs", "reflection jobs by status", labels=["status"])
        for state, n in stats["jobs"].items():
            jobs.add_metric([state], n)
        yield jobs
        # totals, not per reranker: /metrics needs no key, so it must not name tenants or show one's activity
        for name, help_text, key in (
                ("rmm_learner_step", "optimizer steps of the loaded rerankers, summed", "learner_step"),
                ("rmm_learner_records", "rewarded selections the loaded rerankers recorded, summed", "learner_records"),
                ("rmm_rerankers", "rerankers loaded (one per tenant by default)", "rerankers")):
            gauge = GaugeMetricFamily(name, help_text)
            gauge.add_metric([], stats[key])
            yield gauge
        # the query engine serving (chosen by measurement at start-up) and each engine's probe timings
        choice = self.service.query_engine
        info = GaugeMetricFamily("rmm_query_engine_info", "1 for the query engine serving; labels: what was "
                                 "asked for and whether its timings came from the cache",
                                 labels=["engine", "requested", "cached"])
        info.add_metric([choice.engine, choice.requested, str(choice.cached).lower()], 1)
        yield info
        probe = GaugeMetricFamily("rmm_query_engine_probe_ms", "milliseconds per query of each query engine on "
                                  "the start-up probe, by micro-batch size", labels=["engine", "batch"])
        for timing in choice.timings:
            for size, ms in timing.ms_per_query.items():
                probe.add_metric([timing.engine, str(size)], ms)
        yield probe
        # shadow scoring (rmm.serve.shadow): the window and the last estimate computed (a scrape computes none)
        for name, help_text, key in (
                ("rmm_shadow_selections", "rewarded sampled selections the shadow is judged on", "shadow_selections"),
                ("rmm_shadow_estimate", "the shadow's estimated reward per shown memory", "shadow_estimate"),
                ("rmm_shadow_estimate_low", "the lower bound of the shadow's estimate", "shadow_low"),
                ("rmm_shadow_live_value", "the live policy's logged reward per shown memory", "shadow_live_value"),
                ("rmm_shadow_ess", "effective sample size of the shadow's estimate", "shadow_ess")):
            if key in stats:
                gauge = GaugeMetricFamily(name, help_text)
                gauge.add_metric([], stats[key])
                yield gauge
        # replicas over PostgreSQL: which one is the learner, and what the shared learning did here
        for name, help_text, key in (
                ("rmm_is_learner", "1 while this replica holds the learner's advisory lock", "is_learner"),
                ("rmm_learner_acquisitions", "times this replica took the learner's lock", "learner_acquisitions"),
                ("rmm_feedback_applied", "feedback rows this replica applied as the learner", "feedback_applied"),
                ("rmm_reranker_versions_written", "reranker versions this replica wrote", "reranker_versions_written"),
                ("rmm_reranker_reloads", "newer reranker versions this replica loaded", "reranker_reloads")):
            if key in stats:
                gauge = GaugeMetricFamily(name, help_text)
                gauge.add_metric([], stats[key])
                yield gauge


class RequestMetrics:
    """ASGI middleware counting every HTTP request by method, route template and status, and timing
    it; outermost, so requests refused before routing (401, 413, unknown paths) count too."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the client sees if the app fails before answering

        async def send_recording(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_recording)
        finally:
            route: Any = scope.get("route")  # set by the router on a match: the template, not the raw path
            label = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(scope.get("method", ""), label, str(status)).inc()
            self.metrics.latency.labels(label).observe(time.perf_counter() - started)
