"""`rmm data`: benchmarks and rmm's own dataset format.

- `download NAME`: fetch a benchmark from its public source into the data folder;
- `validate PATH`: check a file (or folder) in rmm's format, every problem with its line and field;
- `convert NAME OUT.jsonl`: write a benchmark in rmm's format (the reference examples);
- `export --user U --bank DIR|--store URL OUT`: everything stored for one user, in that format plus a
  manifest (`rmm.serve.export`);
- `import PATH --bank DIR|--store URL`: a dataset's users, sessions and turns (and an export's
  memories) into a live bank, `--reflect` for topic memories; a rerun after a kill writes exactly
  what is missing (`rmm.serve.importer`).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from typing import Any

from rmm.cli.common import add_dedup_option, add_verbose, console

__all__ = ["register", "run"]

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("data", help="benchmark data and rmm's own dataset format")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    d = data_sub.add_parser("download", help="download a benchmark from its public source")
    d.add_argument("name", choices=("locomo", "longmemeval"))
    d.add_argument("--data-dir", help="benchmark data folder (default: $RMM_DATA_DIR, else the user data dir)")
    add_verbose(d)
    d.set_defaults(func=run)

    v = data_sub.add_parser("validate", help="check a dataset in rmm's JSONL format (docs/dataset-format.md)")
    v.add_argument("path", help="a .jsonl file, or a folder of them")
    add_verbose(v)
    v.set_defaults(func=run_validate)

    c = data_sub.add_parser("convert", help="write a benchmark in rmm's JSONL format")
    c.add_argument("name", help="locomo | msc | longmemeval (any name --dataset takes, e.g. msc:test, "
                                "longmemeval:oracle, NAME:PATH)")
    c.add_argument("out", help="the .jsonl file to write")
    c.add_argument("--data-dir", help="benchmark data folder (default: $RMM_DATA_DIR, else the user data dir)")
    add_dedup_option(c)
    add_verbose(c)
    c.set_defaults(func=run_convert)

    e = data_sub.add_parser("export", help="everything stored for one user: rmm's JSONL format + a manifest")
    e.add_argument("out", help="a new (or empty) folder to write data.jsonl, manifest.json (and reranker/) into")
    e.add_argument("--user", required=True, help="the user, as the agent named them")
    where = e.add_mutually_exclusive_group(required=True)
    where.add_argument("--bank", help="the bank folder (SQLite)")
    where.add_argument("--store", help="a postgresql:// bank (open sessions live in the server's folder: "
                                       "give it with --sessions-folder to include them)")
    e.add_argument("--sessions-folder", help="with --store: the server's bank folder (its open sessions)")
    e.add_argument("--config", help="the server config the bank is served with (encoder, reranker_per, …)")
    e.add_argument("--tenant", default="local",
                   help="whose user: the API key's tenant for a served bank (default: local, the embedded API's)")
    add_verbose(e)
    e.set_defaults(func=run_export)

    i = data_sub.add_parser("import", help="load a dataset in rmm's JSONL format into a live bank (resumable)")
    i.add_argument("path", help="a .jsonl file, or a folder of them (checked whole before anything is written)")
    where_to = i.add_mutually_exclusive_group(required=True)
    where_to.add_argument("--bank", help="the bank folder (SQLite; created if new)")
    where_to.add_argument("--store", help="a postgresql:// bank (open sessions and the job queue's folder: "
                                          "--sessions-folder, or `bank:` in --config)")
    i.add_argument("--sessions-folder", help="with --store: the server's bank folder")
    i.add_argument("--config", help="the server config the bank is served with (encoder, llm for --reflect, …)")
    i.add_argument("--tenant", default="local",
                   help="whose users: an API key's tenant for a served bank (default: local, the embedded API's)")
    i.add_argument("--reflect", action="store_true",
                   help="also hand every session to the server's reflection (topic memories; the config's llm, "
                        "else the non-LLM fallback segmenter)")
    i.add_argument("--no-turns", action="store_true", help="do not store turns as `turn` memories (with --reflect)")
    i.add_argument("--batch-size", type=int, default=256, help="memories per transaction (default: 256)")
    i.add_argument("--no-progress", action="store_true", help="no progress bar (none either when not a terminal)")
    add_verbose(i)
    i.set_defaults(func=run_import)


def run(args: argparse.Namespace) -> int:
    from rmm.data.download import download
    from rmm.paths import data_dir

    path = download(args.name, data_dir(args.data_dir))
    console.print(f"{args.name}: {path}")
    return 0


def run_validate(args: argparse.Namespace) -> int:
    """Exit 0 and a summary when the data is sound; exit 1 and every problem otherwise."""
    from rmm.data.jsonl import JsonlDataError, read_jsonl

    try:
        content = read_jsonl(args.path)
    except JsonlDataError as error:
        for problem in error.problems:
            console.print(str(problem), markup=False, highlight=False, soft_wrap=True)
        console.print(f"{len(error.problems)} problem(s); nothing would be loaded", markup=False, style="red")
        return 1
    dataset = content.dataset
    sessions = sum(len(s) for s in dataset.sessions.values())
    turns = sum(len(dataset.turns(u)) for u in dataset.users)
    gold = sum(1 for q in dataset.questions if q.evidence_turns)
    console.print(f"{args.path}: ok — dataset {dataset.name!r}: {len(dataset.users)} users, {sessions} sessions, "
                  f"{turns} turns, {len(dataset.questions)} questions ({gold} with gold turns), "
                  f"{len(content.memories)} memories, {len(content.feedback)} feedback", markup=False, soft_wrap=True)
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from rmm.data import load_dataset
    from rmm.data.jsonl import dataset_records, write_jsonl

    dataset = load_dataset(args.name, args.data_dir, dedup=not args.no_dedup)
    count = write_jsonl(dataset_records(dataset), args.out)
    console.print(f"{args.name}: {count} records ({len(dataset.users)} users, {len(dataset.questions)} questions) "
                  f"→ {args.out}", markup=False)
    return 0


def run_export(args: argparse.Namespace) -> int:
    from rmm.embedded import Memory

    from rmm.config import read_yaml

    with tempfile.TemporaryDirectory(prefix="rmm-export-") as scratch:
        if args.store:
            folder = args.sessions_folder
            if folder is None and not (args.config and read_yaml(args.config, "server config").get("bank")):
                log.warning("no --sessions-folder: the user's open session (turns not yet ended) is not exported")
                folder = scratch
            memory = Memory.open(args.store, config=args.config, tenant=args.tenant, folder=folder)
        else:
            memory = Memory.open(args.bank, config=args.config, tenant=args.tenant)
        with memory:
            manifest = memory.export_user(args.user, args.out)
    console.print(json.dumps(manifest["counts"]), markup=False)
    console.print(f"{args.user}: exported to {args.out}", markup=False)
    return 0


def run_import(args: argparse.Namespace) -> int:
    """Check the whole file first (exit 1 and every problem, nothing written), then write what the
    bank lacks with a progress bar; exit 1 when a session's reflection failed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from rmm.data.jsonl import JsonlDataError, read_jsonl
    from rmm.embedded import Memory
    from rmm.errors import ConfigError
    from rmm.serve.importer import plan_import, run_import as write

    if args.no_turns and not args.reflect:
        raise ConfigError("--no-turns without --reflect would store nothing")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    try:
        content = read_jsonl(args.path)
    except JsonlDataError as error:
        for problem in error.problems:
            console.print(str(problem), markup=False, highlight=False, soft_wrap=True)
        console.print(f"{len(error.problems)} problem(s); nothing was imported", markup=False, style="red")
        return 1
    options = {"tenant": args.tenant, "config": args.config}
    memory = (Memory.open(args.store, folder=args.sessions_folder, **options) if args.store
              else Memory.open(args.bank, **options))
    with memory:
        plan = plan_import(memory.service, memory.tenant, content, turns=not args.no_turns, reflect=args.reflect)
        if plan.present:
            console.print(f"{plan.present} memories of the file are in the bank already (an earlier run): skipped",
                          markup=False)
        shown = not args.no_progress and console.is_terminal
        columns = (TextColumn("importing"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console, disable=not shown) as bar:
            task = bar.add_task("import", total=plan.total)
            report = write(memory.service, memory.tenant, plan, batch_size=args.batch_size,
                           progress=lambda n: bar.advance(task, n))
    console.print(f"{args.path}: {report.users} users, {report.turn_memories} turn memories and {report.memories} "
                  f"memories written, {report.already_present} already there"
                  + (f", {report.sessions_reflected} sessions reflected ({report.topic_memories} topic memories)"
                     if args.reflect else "")
                  + (f"; {len(plan.empty_users)} users with nothing to store" if plan.empty_users else ""),
                  markup=False, soft_wrap=True)
    questions = len(content.dataset.questions)
    if questions or content.feedback:
        console.print(f"not stored: {questions} questions (evaluation data: rmm eval --dataset jsonl:PATH), "
                      f"{len(content.feedback)} feedback records", markup=False)
    if report.failed_sessions:
        console.print(f"{len(report.failed_sessions)} session(s) failed reflection: {report.failed_sessions[:10]}",
                      markup=False, style="red")
        return 1
    return 0
