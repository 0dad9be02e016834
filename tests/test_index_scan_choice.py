"""Which precision the torch index scans, chosen by measurement — tested without timing anything:
stand-in scans (float32's answers) advance a fake clock by what each precision costs, or raise."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from fakes import FakeClock

from rmm.memory.index import TorchIndex
from rmm.memory.scan_choice import BATCH_SIZES, PROBE_MAX_ROWS, PROBE_MIN_ROWS, ScanChooser, measured_batch, probe_rows
from rmm.memory.scans import ExactScan, Scan

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """The probes' small products on one thread: two threads on a busy 2-core machine spend most of
    their time waiting for each other (nothing here is timed by a real clock)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class StandInScan(ExactScan):
    """float32's search under another precision's name, costing `cost` ms a query of the fake clock
    (a number, or a function of the rows and the queries a search), or raising."""

    def __init__(self, precision: str, clock: FakeClock, cost: Any, error: str | None, wrong: bool) -> None:
        super().__init__(64, CPU)
        self.precision = precision  # type: ignore[misc]
        self.clock, self.cost, self.error, self.wrong = clock, cost, error, wrong

    def search(self, q: torch.Tensor, matrix: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.error:
            raise RuntimeError(self.error)
        per_query = self.cost(n, q.shape[0]) if callable(self.cost) else self.cost
        self.clock.now += per_query * q.shape[0] / 1e3
        values, rows = super().search(q, matrix, n, k)
        return values, (rows + 1) % n if self.wrong else rows


class Bench:
    """A chooser over stand-in scans: `ms[precision]` a query (a number, or a function of the probe
    rows and the batch), `errors[precision]` raised by its kernel, `wrong` precisions that miss
    float32's top-k."""

    def __init__(self, ms: dict[str, Any], errors: dict[str, str] | None = None, wrong: tuple[str, ...] = ()) -> None:
        self.ms, self.errors, self.wrong = ms, errors or {}, wrong
        self.clock = FakeClock()
        self.environment = {"cpu": "Stand-in CPU", "threads": 2}
        self.built: list[tuple[str, int]] = []
        self.chooser = ScanChooser(clock=self.clock, make=self.make, environment=lambda: dict(self.environment))

    def make(self, precision: str, dim: int, device: torch.device) -> Scan:
        bench = self

        class Counted(StandInScan):
            def write(self, matrix: torch.Tensor, start: int, stop: int) -> None:
                bench.built.append((precision, stop))

        return Counted(precision, self.clock, self.ms[precision], self.errors.get(precision), precision in self.wrong)

    def measurements(self) -> int:
        return sum(precision == "float32" for precision, _ in self.built)


FAST_INT4 = {"float32": 1.0, "bfloat16": 0.8, "float16": 0.9, "int8": 0.6, "int4": 0.4}


def test_auto_takes_the_fastest_and_a_slow_explicit_precision_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    """int8 slow, as oneDNN's int8 kernel was on an AMD EPYC: `auto` never takes it and an explicit
    `int8` scans float32, with one warning naming both timings."""
    bench = Bench({**FAST_INT4, "int8": 1500.0})
    with caplog.at_level(logging.INFO, logger="rmm.memory.scan_choice"):
        assert bench.chooser.resolve("auto", 64, 1000, CPU) == {1: "int4", 16: "int4"}
        assert bench.chooser.resolve("int8", 64, 1000, CPU) == {1: "float32", 16: "float32"}
        assert bench.chooser.resolve("int8", 64, 1000, CPU) == {1: "float32", 16: "float32"}
        assert bench.chooser.resolve("bfloat16", 64, 1000, CPU) == {1: "bfloat16", 16: "bfloat16"}  # as asked
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"index_precision 'int8' measured 1500.000 ms a query against float32's 1.000 at {batch} "
                        f"queries a search over {PROBE_MIN_ROWS} 64-d rows on this machine; scanning float32 for such "
                        "searches" for batch in BATCH_SIZES]  # once for each, not once per index
    assert "fastest int4/int4" in caplog.text and "int8 1500.000/1500.000" in caplog.text
    bench = Bench({precision: 2.0 for precision in FAST_INT4} | {"float32": 1.0})
    assert bench.chooser.resolve("auto", 64, 1000, CPU) == {1: "float32", 16: "float32"}  # nothing beats it


def test_a_kernel_slow_for_batches_scans_only_single_queries() -> None:
    """int8 fast for one query and slow for 8+ (as faiss's 8-bit scan and oneDNN's int8 kernel are):
    one query scans int8, a batch float32 — in the chooser and in an index."""
    bench = Bench({**FAST_INT4, "int4": 5.0, "int8": lambda rows, batch: 0.5 if batch < 8 else 4.0})
    assert bench.chooser.resolve("auto", 64, 1000, CPU) == {1: "int8", 16: "bfloat16"}
    assert bench.chooser.resolve("int8", 64, 1000, CPU) == {1: "int8", 16: "float32"}
    assert [measured_batch(b) for b in (1, 2, 3, 4, 5, 16, 64)] == [1, 1, 1, 1, 16, 16, 16]
    generator = torch.Generator().manual_seed(1)
    vectors = torch.nn.functional.normalize(torch.randn(300, 64, generator=generator), dim=1)
    queries = torch.nn.functional.normalize(torch.randn(16, 64, generator=generator), dim=1)
    index, exact = TorchIndex(64, device="cpu", precision="int8", chooser=bench.chooser), TorchIndex(64, device="cpu")
    for target in (index, exact):
        target.add([f"m{i}" for i in range(300)], vectors)
    assert [index.search(queries[i:i + 1], 5)[1] for i in range(3)] == [exact.search(queries[i:i + 1], 5)[1]
                                                                         for i in range(3)]
    assert set(index._scans) == {"int8"}
    assert index.search(queries, 5)[1] == exact.search(queries, 5)[1]
    assert set(index._scans) == {"int8", "float32"} and index.scan_plan == {1: "int8", 16: "float32"}


def test_a_failing_or_inexact_kernel_is_skipped_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    bench = Bench(FAST_INT4, errors={"int4": "Could not run '_weight_int4pack_mm_for_cpu'"}, wrong=("int8",))
    with caplog.at_level(logging.INFO, logger="rmm.memory.scan_choice"):
        choice = bench.chooser.choice(64, 1000, CPU)
        assert bench.chooser.resolve("int4", 64, 1000, CPU) == {1: "float32", 16: "float32"}
    skipped = {t.precision: t.skipped for t in choice.timings if t.skipped}
    assert skipped == {"int4": "RuntimeError: Could not run '_weight_int4pack_mm_for_cpu'",
                       "int8": f"its top-20 differs from float32's on {24 + 3}/{24 + 3} probe queries"}
    assert choice.fastest(1) == "bfloat16"  # the fastest of those that ran and kept float32's answers
    assert "index scan int4 skipped: RuntimeError: Could not run" in caplog.text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["index_precision 'int4' cannot scan here (RuntimeError: Could not run "
                        "'_weight_int4pack_mm_for_cpu'); scanning float32"]  # one line, not one per batch size


def test_the_measurement_is_cached_by_fingerprint() -> None:
    bench = Bench(FAST_INT4)
    bench.chooser.resolve("auto", 64, 1000, CPU)
    bench.chooser.resolve("int4", 64, 3000, CPU)  # same probe size: the same measurement
    assert bench.measurements() == 1
    bench.chooser.resolve("auto", 64, 5000, CPU)  # another probe size
    bench.chooser.resolve("auto", 32, 1000, CPU)  # another dimension
    assert bench.measurements() == 3
    bench.environment["threads"] = 1  # e.g. torch.set_num_threads: timings no longer apply
    bench.chooser.resolve("auto", 64, 1000, CPU)
    assert bench.measurements() == 4
    bench.chooser.resolve("auto", 64, 1000, CPU)
    assert bench.measurements() == 4


def test_probe_rows_cover_the_bank_within_bounds() -> None:
    assert probe_rows(0) == probe_rows(300) == probe_rows(PROBE_MIN_ROWS) == PROBE_MIN_ROWS
    assert probe_rows(PROBE_MIN_ROWS + 1) == 2 * PROBE_MIN_ROWS
    assert probe_rows(10_000) == 16_384
    assert probe_rows(10 ** 7) == PROBE_MAX_ROWS


def test_an_index_scans_what_was_measured_for_its_size() -> None:
    """int4 slower than float32 on small probes and faster on large ones: an index asking for int4
    scans float32 while small and int4 once it grows into a larger probe size — same answers."""
    bench = Bench({**FAST_INT4, "int4": lambda rows, batch: 0.4 if rows > PROBE_MIN_ROWS else 3.0})
    generator = torch.Generator().manual_seed(0)
    vectors = torch.nn.functional.normalize(torch.randn(PROBE_MIN_ROWS + 100, 64, generator=generator), dim=1)
    queries = torch.nn.functional.normalize(torch.randn(5, 64, generator=generator), dim=1)
    ids = [f"m{i}" for i in range(len(vectors))]
    index = TorchIndex(64, device="cpu", precision="int4", chooser=bench.chooser)
    exact, auto = TorchIndex(64, device="cpu"), TorchIndex(64, device="cpu", precision="auto", chooser=bench.chooser)
    for target in (index, exact, auto):
        target.add(ids[:500], vectors[:500])
    assert index.scan_precision is None  # nothing chosen before the first search
    assert index.search(queries, 10)[1] == exact.search(queries, 10)[1]
    assert (index.scan_precision, auto.search(queries, 10)[1] and auto.scan_precision) == ("float32", "int8")
    for target in (index, exact):
        target.add(ids[500:], vectors[500:])  # now past PROBE_MIN_ROWS rows
    assert index.search(queries, 10)[1] == exact.search(queries, 10)[1]
    assert index.scan_precision == "int4"
    assert bench.measurements() == 2
    assert exact.scan_precision == "float32" and bench.measurements() == 2  # float32 is never measured
