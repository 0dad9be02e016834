"""`rmm data download`: fetch a benchmark from its public source into the data folder."""

from __future__ import annotations

import argparse
from typing import Any

from rmm.cli.common import add_verbose, console

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("data", help="benchmark data")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    d = data_sub.add_parser("download", help="download a benchmark from its public source")
    d.add_argument("name", choices=("locomo", "longmemeval"))
    d.add_argument("--data-dir", help="benchmark data folder (default: $RMM_DATA_DIR, else the user data dir)")
    add_verbose(d)
    d.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rmm.data.download import download
    from rmm.paths import data_dir

    path = download(args.name, data_dir(args.data_dir))
    console.print(f"{args.name}: {path}")
    return 0
