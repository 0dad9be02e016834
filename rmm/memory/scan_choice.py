"""Which precision the torch index scans here: measured on this machine, not assumed from the developer's.

A CPU kernel can be orders of magnitude apart between CPU families (oneDNN's int8 kernel: 1.2x
faster on an Intel Xeon with AMX, ~1,500x slower on an AMD EPYC without it), so a smaller scan
(`rmm.memory.scans`) never runs unmeasured. At an index's first search the chooser builds a probe
bank of the index's dimension and `probe_rows` rows (at least `PROBE_MIN_ROWS`: the speed of a
scan depends on the bytes it streams), scans it at every precision this machine has, one query at
a time as a server searches and `PROBE_BATCH` at a time as a batch of one user's queries does (a
kernel fast for one query can be slower than float32's matrix product for many: faiss's 8-bit scan
here), and keeps a precision only when its top-`PROBE_K` equals float32's on every probe query
(the shortlist re-score's guarantee) and its kernel did not raise. Then, for each batch size (a
search of B queries follows the measured size nearest B):

* `auto` scans the fastest;
* an explicit precision measured slower than float32 (or that failed) scans float32 instead, with
  one warning naming both timings (or the failure): `index_precision` asks for speed, and a
  smaller scan's answers are float32's anyway, so falling back changes nothing but the time.

Choices are cached per process by a fingerprint of what the timings depend on (dimension, probe
rows, device, torch and faiss versions, their thread counts, the CPU's model and flags): a second
index reuses the measurement, a changed fingerprint (say, `torch.set_num_threads`) measures again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rmm.device import cpu_fingerprint
from rmm.memory.scans import PRECISIONS, Scan, make_scan, unavailable

__all__ = ["AUTO", "BATCH_SIZES", "ScanChoice", "ScanChooser", "ScanTiming", "default_chooser", "measured_batch",
           "probe_rows", "scan_environment"]

log = logging.getLogger(__name__)

AUTO = "auto"
PROBE_MIN_ROWS = 4096  # a bank this small scans in well under a millisecond at any precision
PROBE_MAX_ROWS = 65536  # past this every scan streams memory; the ranking of precisions stays
PROBE_QUERIES = 24  # timed one at a time (the fastest counts: the least disturbed by other work)
PROBE_BATCH = 16  # and in batches of this many (the fastest of `PROBE_QUERIES // 2`); at most PROBE_QUERIES
BATCH_SIZES = (1, PROBE_BATCH)
WARMUP = 3  # untimed one-query searches first
PROBE_K = 20  # the recall check's k (the server's default)


def measured_batch(queries: int) -> int:
    """The measured batch size whose timings a search of `queries` queries follows (nearest in ratio)."""
    return min(BATCH_SIZES, key=lambda size: abs(math.log(max(queries, 1) / size)))


def probe_rows(rows: int) -> int:
    """The probe bank's size for an index of `rows`: the next power of two, within the bounds (so
    one measurement serves every bank of about that size)."""
    return min(PROBE_MAX_ROWS, max(PROBE_MIN_ROWS, 1 << max(0, rows - 1).bit_length()))


def scan_environment() -> dict[str, Any]:
    """What a scan's timing depends on besides the bank: the CPU (model, flags), the libraries and
    their thread counts."""
    try:
        import faiss

        faiss_version, faiss_threads = faiss.__version__, faiss.omp_get_max_threads()
    except ImportError:
        faiss_version, faiss_threads = None, None
    return {**cpu_fingerprint(), "faiss": faiss_version, "faiss_threads": faiss_threads}


@dataclass(frozen=True)
class ScanTiming:
    """One precision's measurement: milliseconds a query of its fastest search of the probe bank at
    each batch size, or why it was left out."""

    precision: str
    ms: dict[int, float] | None = None
    skipped: str | None = None


@dataclass(frozen=True)
class ScanChoice:
    """The measurement on one fingerprint and what `auto` takes from it."""

    dim: int
    rows: int
    timings: tuple[ScanTiming, ...]
    fingerprint: str

    def ms(self, precision: str, batch: int) -> float:
        timing = next((t for t in self.timings if t.precision == precision), None)
        return math.inf if timing is None or timing.ms is None else timing.ms[batch]

    def fastest(self, batch: int) -> str:
        """The fastest precision at `batch` that kept float32's answers (float32 when nothing did)."""
        return min(PRECISIONS, key=lambda precision: (self.ms(precision, batch), precision != "float32"))

    def resolve(self, requested: str, batch: int) -> tuple[str, str | None]:
        """(the precision to scan for `requested` at `batch` queries a search, the warning when that is
        not what was asked)."""
        if requested == AUTO:
            return self.fastest(batch), None
        if requested == "float32":
            return "float32", None
        timing = next((t for t in self.timings if t.precision == requested), None)
        if timing is None or timing.ms is None:
            why = timing.skipped if timing is not None else "not measured"
            return "float32", f"index_precision {requested!r} cannot scan here ({why}); scanning float32"
        if timing.ms[batch] > self.ms("float32", batch):
            return "float32", (f"index_precision {requested!r} measured {timing.ms[batch]:.3f} ms a query against "
                               f"float32's {self.ms('float32', batch):.3f} at {batch} queries a search over "
                               f"{self.rows} {self.dim}-d rows on this machine; scanning float32 for such searches")
        return requested, None

    def summary(self) -> str:
        """The one log line: each precision's ms a query at each batch size or why it was left out,
        and the fastest."""
        sizes = "/".join(str(size) for size in BATCH_SIZES)
        parts = [f"{t.precision} " + "/".join(f"{t.ms[size]:.3f}" for size in BATCH_SIZES) if t.ms is not None
                 else f"{t.precision} skipped ({t.skipped})" for t in self.timings]
        fastest = "/".join(self.fastest(size) for size in BATCH_SIZES)
        return (f"index scan measured over {self.rows} {self.dim}-d rows, ms a query at {sizes} queries a search: "
                + "; ".join(parts) + f"; fastest {fastest}")


class ScanChooser:
    """Measures scan precisions and caches the result per fingerprint (one per process:
    `default_chooser`). `clock`, `make` and `environment` are the measurement's inputs, replaceable
    so the choice can be tested without timing anything."""

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter,
                 make: Callable[[str, int, torch.device], Scan] = make_scan,
                 environment: Callable[[], dict[str, Any]] = scan_environment, seed: int = 0) -> None:
        self.clock, self.make, self.environment, self.seed = clock, make, environment, seed
        self._choices: dict[str, ScanChoice] = {}
        self._warned: set[tuple[str, str]] = set()

    def choice(self, dim: int, rows: int, device: torch.device) -> ScanChoice:
        """The measurement for an index of `rows` `dim`-d rows on `device`: cached, or made now."""
        size = probe_rows(rows)
        payload = {"dim": dim, "rows": size, "device": str(device), "precisions": list(PRECISIONS),
                   "probe": [PROBE_QUERIES, BATCH_SIZES, WARMUP, PROBE_K, self.seed], **self.environment()}
        fingerprint = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]
        cached = self._choices.get(fingerprint)
        if cached is None:
            cached = self._choices[fingerprint] = self._measure(dim, size, device, fingerprint)
            log.info("%s", cached.summary())
        return cached

    def resolve(self, requested: str, dim: int, rows: int, device: torch.device) -> dict[int, str]:
        """The precision an index asking for `requested` scans at each measured batch size (each
        warning, when it is not the one asked for, once per fingerprint)."""
        choice = self.choice(dim, rows, device)
        plan = {}
        for batch in BATCH_SIZES:
            plan[batch], warning = choice.resolve(requested, batch)
            if warning is not None and (choice.fingerprint, warning) not in self._warned:
                self._warned.add((choice.fingerprint, warning))
                log.warning("%s", warning)
        return plan

    def _measure(self, dim: int, rows: int, device: torch.device, fingerprint: str) -> ScanChoice:
        generator = torch.Generator().manual_seed(self.seed)
        matrix = torch.nn.functional.normalize(torch.randn(rows, dim, generator=generator), dim=1).to(device)
        queries = torch.nn.functional.normalize(torch.randn(PROBE_QUERIES + WARMUP, dim, generator=generator),
                                                dim=1).to(device)
        k = min(PROBE_K, rows)
        truth: list[set[int]] | None = None
        timings = []
        for precision in PRECISIONS:  # float32 first: the reference
            reason = unavailable(precision, dim, device)
            if reason is None:
                try:
                    scan = self.make(precision, dim, device)
                    scan.write(matrix, 0, rows)
                    found = [set(row) for row in scan.search(queries, matrix, rows, k)[1].tolist()]
                    if truth is None:
                        truth = found
                    missed = sum(a != b for a, b in zip(truth, found))
                    if missed:
                        reason = f"its top-{k} differs from float32's on {missed}/{len(found)} probe queries"
                    else:
                        timings.append(ScanTiming(precision, ms=self._time(scan, queries, matrix, rows, k)))
                except Exception as exc:  # a kernel this torch or CPU cannot run: skipped, the reason kept
                    reason = f"{type(exc).__name__}: {exc}"
            if reason is not None:
                log.info("index scan %s skipped: %s", precision, reason)
                timings.append(ScanTiming(precision, skipped=reason))
        return ScanChoice(dim, rows, tuple(timings), fingerprint)

    def _time(self, scan: Scan, queries: torch.Tensor, matrix: torch.Tensor, rows: int, k: int) -> dict[int, float]:
        """Milliseconds a query of the fastest search at each batch size, after `WARMUP` untimed
        single queries (on a shared machine the median measures the neighbours as much as the kernel)."""
        for i in range(WARMUP):
            scan.search(queries[i:i + 1], matrix, rows, k)
        timed = queries[WARMUP:]
        out = {}
        for size in BATCH_SIZES:
            seconds = []
            for turn in range(PROBE_QUERIES if size == 1 else max(1, PROBE_QUERIES // 2)):
                batch = timed.roll(-turn * size, 0)[:size]  # round the probe queries
                began = self.clock()
                scan.search(batch, matrix, rows, k)
                seconds.append((self.clock() - began) / size)
            out[size] = 1e3 * min(seconds)
        return out


_DEFAULT = ScanChooser()


def default_chooser() -> ScanChooser:
    """The process's chooser: every index of the process shares its measurements."""
    return _DEFAULT
