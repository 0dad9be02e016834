"""CompassMem's event graph, LLM-free fallback: calibrate its thresholds, then time and describe a build.

    python -m rmm.bench.compass_build calibrate --retriever minilm [--json calib.json]
    python -m rmm.bench.compass_build build --retriever minilm --threads 1 [--conversations 10] [--json build.json]

`calibrate` picks the merge / δ / similar cosines for an encoder by quantile
(`rmm.reflection.events.CALIBRATION_QUANTILES`) over LoCoMo's **training** conversations only:
the users `rmm train` keeps with the same `--heldout` and `--seed` (defaults 0.3 and 0: conv-30,
conv-48 and conv-49 are held out and never read). Paste its record into
`rmm.reflection.events.CALIBRATED` (keyed by the encoder's fingerprint) with this command.

`build` builds each conversation's fallback event graph in a fresh bank (as `rmm eval
--granularity event` does, with the passage cache attached) and, for comparison, its fallback
topic bank (`--granularity topic`), timing both, and prints the graph's structure beside the
paper's: events per session (the paper asks its LLM for 6-10), turns per event, edges per event
(out-edges; degree is twice that), edges by label, topics, merges.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any


def _setup(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    from rmm.data import load_dataset
    from rmm.encoders import load_encoder

    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = load_dataset(args.dataset, download=False)
    encoder = load_encoder(args.retriever, device="cpu")
    return dataset, encoder


def calibrate(args: argparse.Namespace) -> int:
    from rmm.eval.benchmark_bank import passage_cache
    from rmm.reflection.events import calibrate_thresholds
    from rmm.training.splits import split_users_in_order

    dataset, encoder = _setup(args)
    users, held = split_users_in_order(dataset.users, args.heldout, args.seed)  # rmm train's split
    t0 = time.perf_counter()
    with passage_cache(encoder, args.cache_dir):
        found = calibrate_thresholds(dataset, users, encoder)
    record = {"encoder": encoder.name, "fingerprint": encoder.fingerprint, "dataset": dataset.name,
              "heldout_users": held, **found.to_json(), "seconds": round(time.perf_counter() - t0, 1)}
    t = found.thresholds
    print(f"{encoder.name} on {dataset.name}, training users {', '.join(users)} (held out, not read: {', '.join(held)})")
    print(f"merge {t.merge}  delta {t.topic}  similar {t.similar}")
    print(f"distributions: {json.dumps(found.distributions)}  samples: {json.dumps(found.samples)}")
    print(f"CALIBRATED[{encoder.fingerprint!r}] = Thresholds({t.merge}, {t.topic}, {t.similar}, {t.source!r})")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


def structure(store: Any, user: str, sessions: int) -> dict[str, Any]:
    """Events per session, turns per event, out-edges per event, labels, topics of one user's graph."""
    from rmm.reflection.events import current_topics

    events = [m for m in store.memories(user) if m.kind == "event"]
    labels: Counter[str] = Counter()
    for event in events:
        labels.update(e.label for e in store.neighbours(user, event.id, "out"))
    turns = [len(m.refs) for m in events]
    return {"sessions": sessions, "events": len(events), "edges": sum(labels.values()), "labels": dict(labels),
            "topics": len(current_topics(store, user)), "turns_per_event": turns}


def build_both(dataset: Any, user: str, encoder: Any, folder: Path) -> dict[str, Any]:
    """One conversation's fallback event graph and fallback topic bank, each built in a fresh bank
    under `folder`: wall seconds of both, the graph's structure, merges and each event's word count."""
    from rmm.eval.benchmark_bank import fill_events, fill_topics
    from rmm.memory.bank import MemoryBank
    from rmm.reflection import ProspectiveReflector
    from rmm.reflection.events import EventGraphBuilder
    from rmm.types import Dataset

    one = Dataset(dataset.name, {user: dataset.sessions[user]}, [])
    with MemoryBank(folder / f"events-{user}", encoder, device="cpu") as bank:
        builder = EventGraphBuilder(bank)
        t0 = time.perf_counter()
        fill_events(bank, one, builder, progress=False)
        event_seconds = time.perf_counter() - t0
        stats = structure(bank.store, user, builder.report.sessions)
        words = [len(m.text.split()) for m in bank.store.memories(user) if m.kind == "event"]
    with MemoryBank(folder / f"topics-{user}", encoder, device="cpu") as bank:
        t0 = time.perf_counter()
        fill_topics(bank, one, ProspectiveReflector(bank, None), progress=False)
        topic_seconds = time.perf_counter() - t0
    return {"conversation": user, **stats, "merged": builder.report.events_merged, "event_seconds": event_seconds,
            "topic_seconds": topic_seconds, "thresholds": builder.thresholds.source, "event_words": words}


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The conversations' `build_both` rows summed: structure per session and per event, topics,
    merges and build seconds of both banks."""
    sessions = sum(r["sessions"] for r in rows)
    events = sum(r["events"] for r in rows)
    turns = [t for r in rows for t in r["turns_per_event"]]
    labels: Counter[str] = Counter()
    for r in rows:
        labels.update(r["labels"])
    return {"conversations": len(rows), "sessions": sessions, "events": events,
            "events_per_session": events / sessions, "turns_per_event": statistics.mean(turns),
            "turns_per_event_median": statistics.median(turns), "edges_per_event": sum(labels.values()) / events,
            "labels": dict(labels), "topics": sum(r["topics"] for r in rows),
            "merged": sum(r["merged"] for r in rows),
            "event_seconds": sum(r["event_seconds"] for r in rows),
            "topic_seconds": sum(r["topic_seconds"] for r in rows),
            "thresholds": rows[0]["thresholds"] if rows else ""}


def build(args: argparse.Namespace) -> int:
    from rmm.eval.benchmark_bank import passage_cache

    dataset, encoder = _setup(args)
    users = list(dataset.users)[: args.conversations]
    rows = []
    print(f"{'conv':<9}{'sessions':>9}{'events':>8}{'ev/sess':>8}{'turns/ev':>9}{'edges/ev':>9}{'topics':>7}"
          f"{'merged':>7}{'event s':>9}{'topic s':>9}")
    with tempfile.TemporaryDirectory() as tmp, passage_cache(encoder, args.cache_dir):
        for user in users:
            row = build_both(dataset, user, encoder, Path(tmp))
            row.pop("event_words")
            rows.append(row)
            turns = row["turns_per_event"]
            event_seconds, topic_seconds = row["event_seconds"], row["topic_seconds"]
            print(f"{user:<9}{row['sessions']:>9}{row['events']:>8}{row['events'] / row['sessions']:>8.1f}"
                  f"{statistics.mean(turns):>9.1f}{row['edges'] / max(row['events'], 1):>9.2f}{row['topics']:>7}"
                  f"{row['merged']:>7}{event_seconds:>9.1f}{topic_seconds:>9.1f}", flush=True)
    total = {**totals(rows), "threads": args.threads}
    sessions, events, labels = total["sessions"], total["events"], total["labels"]
    print(f"total: {events} events over {sessions} sessions = {total['events_per_session']:.1f} per session "
          f"(paper: 6-10 asked); {total['turns_per_event']:.1f} turns per event (median "
          f"{total['turns_per_event_median']:g}); {total['edges_per_event']:.2f} out-edges per event {labels}; "
          f"{total['topics']} topics; {total['merged']} merges; build {total['event_seconds']:.1f} s "
          f"vs topic bank {total['topic_seconds']:.1f} s")
    print(f"thresholds: {total['thresholds']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "total": total}, indent=2) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("calibrate", "build"):
        p = sub.add_parser(name)
        p.add_argument("--dataset", default="locomo")
        p.add_argument("--retriever", default="minilm", help="the encoder (a preset or folder)")
        p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
        p.add_argument("--cache-dir", help="rmm's cache folder (passage vectors)")
        p.add_argument("--json", help="write the record as JSON")
        if name == "calibrate":
            p.add_argument("--heldout", type=float, default=0.3, help="rmm train's --heldout (users held out)")
            p.add_argument("--seed", type=int, default=0, help="rmm train's --seed")
        else:
            p.add_argument("--conversations", type=int, default=10, help="how many conversations, from the first")
    args = parser.parse_args()
    return calibrate(args) if args.command == "calibrate" else build(args)


if __name__ == "__main__":
    raise SystemExit(main())
