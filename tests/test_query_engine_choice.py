"""`query_precision: auto` means measured: the choice logic under injected timings (no real clock).

Stand-in engines advance a fake clock by what a call "costs" at each batch size, so the tests say
exactly which engine is fast where, as a CPU would: one engine slow at batch >= 8 (oneDNN's int8
kernel on an AMD EPYC), one that fails to build, one whose vectors drift from float32's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fakes import BagOfWordsEncoder, FakeClock

from rmm.encoders.query import choice as choice_module
from rmm.encoders.query.choice import PROBE_QUERIES, SLOW_FACTOR, choose_query_engine, probe_batch_sizes
from rmm.encoders.query.precision import QUERY_ENGINES
from rmm.errors import ConfigError

SIZES = (1, 16, 32)


class FakeTransformer(BagOfWordsEncoder):
    """What the chooser sees of a transformer encoder on the CPU: a `model` and a device."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(2, 2)
        self.device = torch.device("cpu")


class StandIn:
    """An engine over `encoder` whose call costs `cost(batch size)` seconds of the fake clock."""

    def __init__(self, encoder: FakeTransformer, clock: FakeClock, cost: Callable[[int], float], drift: float = 0.0):
        self.inner, self.clock, self.cost, self.drift = encoder, clock, cost, drift
        self.name, self.dim, self.fingerprint = encoder.name, encoder.dim, encoder.fingerprint
        self.calls: list[int] = []

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        self.calls.append(len(texts))
        self.clock.now += self.cost(len(texts))
        vectors = self.inner.encode_queries(texts)
        if self.drift:  # a different direction: cosine to float32 well below MIN_COSINE
            vectors = torch.nn.functional.normalize(vectors + self.drift * torch.ones_like(vectors), dim=-1)
        return vectors

    def encode_passages(self, texts: list[str]) -> torch.Tensor:
        return self.inner.encode_passages(texts)


# ms per query at each size: float32 2 ms; int8 1 ms; int8-onednn 0.5 ms alone but 1,500x float32 at
# batch >= 8; int8-padded 1.5 ms; int8-onnx fails to build (onnxruntime missing)
def per_query_costs(onednn_slow: bool = True) -> dict[str, Callable[[int], float]]:
    def onednn(n: int) -> float:
        return n * (3.0 if onednn_slow and n >= 8 else 0.0005)

    return {"float32": lambda n: n * 0.002, "int8": lambda n: n * 0.001, "int8-onednn": onednn,
            "int8-padded": lambda n: n * 0.0015}


class Builder:
    """`build` for `choose_query_engine`: stand-ins by name; records what it built."""

    def __init__(self, clock: FakeClock, costs: dict[str, Callable[[int], float]],
                 fail: dict[str, BaseException] | None = None, drift: dict[str, float] | None = None) -> None:
        self.clock, self.costs, self.fail, self.drift = clock, costs, fail or {}, drift or {}
        self.built: dict[str, StandIn] = {}

    def __call__(self, encoder: FakeTransformer, engine: str) -> StandIn:
        if engine in self.fail:
            raise self.fail[engine]
        if engine not in self.costs:
            raise ConfigError(f"query_precision: {engine}: no such engine in this test")
        self.built[engine] = StandIn(encoder, self.clock, self.costs[engine], self.drift.get(engine, 0.0))
        return self.built[engine]


def choose(precision: str = "auto", *, cache: Path | None = None, builder: Builder | None = None,
           clock: FakeClock | None = None):
    clock = clock or FakeClock()
    builder = builder or Builder(clock, per_query_costs())
    engine, choice = choose_query_engine(FakeTransformer(), precision, batch_sizes=SIZES, cache_dir=cache,
                                         clock=clock, build=builder)
    return engine, choice, builder


def test_auto_avoids_an_engine_that_is_fast_alone_and_slow_in_micro_batches() -> None:
    engine, choice, builder = choose()
    assert choice.engine == "int8" and engine is builder.built["int8"]
    onednn = choice.timing("int8-onednn")
    assert onednn is not None and onednn.skipped is not None and "slower than float32 at batch 16" in onednn.skipped
    # cut off after its first call at batch 16: never timed REPEATS more times at 3 s a query
    assert builder.built["int8-onednn"].calls.count(16) == 1 and 32 not in builder.built["int8-onednn"].calls
    assert choice.timing("int8").ms_per_query == pytest.approx({1: 1.0, 16: 1.0, 32: 1.0})
    assert choice.timing("float32").ms_per_query == pytest.approx({1: 2.0, 16: 2.0, 32: 2.0})


def test_auto_takes_the_fast_kernel_where_it_is_fast() -> None:
    clock = FakeClock()
    _, choice, _ = choose(builder=Builder(clock, per_query_costs(onednn_slow=False)), clock=clock)
    assert choice.engine == "int8-onednn" and choice.fastest == "int8-onednn"


def test_an_engine_that_fails_to_build_is_skipped_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    builder = Builder(clock, per_query_costs(), fail={
        "int8-onnx": ConfigError("query_precision: int8-onnx: onnxruntime is not installed"),
        "int8": ImportError("no module named 'quantized_kernels'")})
    with caplog.at_level(logging.INFO, logger="rmm.encoders.query.choice"):
        _, choice, _ = choose(builder=builder, clock=clock)
    assert choice.engine == "int8-padded"
    assert choice.timing("int8-onnx").skipped == "query_precision: int8-onnx: onnxruntime is not installed"
    assert choice.timing("int8").skipped == "ImportError: no module named 'quantized_kernels'"
    line = " ".join(r.getMessage() for r in caplog.records)
    assert "query engine int8-padded (asked: auto)" in line and "onnxruntime is not installed" in line


def test_an_engine_failing_on_the_probe_or_drifting_from_float32_is_skipped() -> None:
    clock = FakeClock()
    costs = per_query_costs(onednn_slow=False)

    def broken(n: int) -> float:
        raise RuntimeError("kernel crashed")

    builder = Builder(clock, {**costs, "int8-padded": broken}, drift={"int8-onednn": 5.0})
    _, choice, _ = choose(builder=builder, clock=clock)
    assert choice.engine == "int8"  # the fastest (int8-onednn) points elsewhere: not chosen
    assert "min cosine to float32" in choice.timing("int8-onednn").skipped
    assert "RuntimeError: kernel crashed" in choice.timing("int8-padded").skipped


def test_the_cache_is_reused_and_a_changed_fingerprint_measures_again(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _, first, builder = choose(cache=tmp_path)
    assert not first.cached and len(builder.built) == 4  # every engine built and measured
    assert len(list((tmp_path / "query-engines").glob("*.json"))) == 1
    engine, second, builder = choose(cache=tmp_path)
    assert second.cached and second.engine == "int8" and second.timings == first.timings
    assert list(builder.built) == ["int8"] and builder.built["int8"].calls == []  # built to serve, never timed
    # an explicit precision reads the same cached timings
    _, explicit, builder = choose("float32", cache=tmp_path)
    assert explicit.cached and explicit.engine == "float32" and list(builder.built) == ["float32"]
    real = choice_module.cpu_fingerprint  # rmm.device's, as the chooser imported it
    monkeypatch.setattr(choice_module, "cpu_fingerprint", lambda: {**real(), "threads": 99})
    _, third, builder = choose(cache=tmp_path)
    assert not third.cached and len(builder.built) == 4
    assert len(list((tmp_path / "query-engines").glob("*.json"))) == 2


def test_an_unreadable_cache_is_measured_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, first, _ = choose(cache=tmp_path)
    (path,) = (tmp_path / "query-engines").glob("*.json")
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        _, again, builder = choose(cache=tmp_path)
    assert not again.cached and again.engine == first.engine and len(builder.built) == 4
    assert "unreadable query-engine cache" in caplog.text


def test_an_explicit_precision_is_obeyed_and_warned_about_when_slow(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        engine, choice, builder = choose("int8-onednn")
    assert choice.engine == "int8-onednn" and engine is builder.built["int8-onednn"]
    assert "query_precision int8-onednn measured" in caplog.text and "auto would take int8" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _, choice, _ = choose("int8-padded")  # 1.5x slower than int8: under the 2x threshold, no warning
    assert choice.engine == "int8-padded" and not caplog.records
    with caplog.at_level(logging.WARNING):
        choose("float32")  # 2x slower: not more than 2x
    assert not caplog.records


def test_an_explicit_engine_that_cannot_run_here_is_a_config_error() -> None:
    clock = FakeClock()
    builder = Builder(clock, per_query_costs(), fail={"int8-onnx": ConfigError("query_precision: int8-onnx: no onnxruntime")})
    with pytest.raises(ConfigError, match="no onnxruntime"):
        choose("int8-onnx", builder=builder, clock=clock)
    with pytest.raises(ConfigError, match="query_precision must be one of"):
        choose("int4")


def test_an_encoder_that_is_not_a_transformer_on_the_cpu_is_served_in_float32_unmeasured() -> None:
    bow = BagOfWordsEncoder()
    engine, choice = choose_query_engine(bow, "auto", cache_dir=None)
    assert engine is bow and choice.engine == "float32" and choice.timings == () and "not a transformer" in choice.note
    with pytest.raises(ConfigError, match="needs a transformer encoder"):
        choose_query_engine(bow, "int8")


def test_probe_sizes_follow_the_batcher() -> None:
    assert probe_batch_sizes(False, 64) == (1,)
    assert probe_batch_sizes(True, 64) == (1, 16, 32)
    assert probe_batch_sizes(True, 8) == (1, 8)
    assert len(PROBE_QUERIES) >= 32 and SLOW_FACTOR == 10.0 and QUERY_ENGINES[0] == "float32"


def test_a_real_encoder_is_measured_and_the_server_reports_the_choice(tmp_path: Path, minilm_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end on a tiny random BERT: every torch engine is timed for real, the server serves the
    chosen one and names it in /health and /metrics."""
    from fakes import write_tiny_bert
    from fastapi.testclient import TestClient

    from rmm.serve.app import create_app
    from rmm.serve.config import load_config

    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))
    folder = write_tiny_bert(tmp_path / "tiny", minilm_path)
    config = load_config(None, {"bank": str(tmp_path / "bank"), "encoder": str(folder), "query_process": "off",
                                "batching": {"max_batch": 8}, "auth": {"keys": {"k" * 16: "acme"}}}, environ={})
    with TestClient(create_app(config)) as client:
        health = client.get("/health").json()["query_engine"]
        metrics = client.get("/metrics").text
    assert health["requested"] == "auto" and health["batch_sizes"] == [1, 8]
    assert health["engine"] in QUERY_ENGINES and set(health["ms_per_query"]["float32"]) == {"1", "8"}
    measured = {e: sum(ms[s] * int(s) for s in ms) for e, ms in health["ms_per_query"].items()
                if e not in health["skipped"]}
    assert health["engine"] == min(measured, key=measured.get)
    assert f'rmm_query_engine_info{{cached="false",engine="{health["engine"]}",requested="auto"}} 1.0' in metrics
    assert 'rmm_query_engine_probe_ms{batch="8",engine="float32"}' in metrics
    assert list((tmp_path / "cache" / "query-engines").glob("*.json"))
