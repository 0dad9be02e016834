"""`rmm data`: benchmarks and rmm's own dataset format.

- `download NAME`: fetch a benchmark from its public source into the data folder;
- `validate PATH`: check a file (or folder) in rmm's format, every problem with its line and field;
- `convert NAME OUT.jsonl`: write a benchmark in rmm's format (the reference examples);
- `export --user U --bank DIR|--store URL OUT`: everything stored for one user, in that format plus a
  manifest (`rmm.serve.export`).
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
