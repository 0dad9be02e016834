"""`rmm pretrain --config PATH [key=value ...]`: offline contrastive pretraining of a retriever.

The recipe and its overrides are checked right after parsing (a bad value is the parser's one
`error:` line); Lightning is imported only when the command runs, so `rmm --help` stays fast and
works without the `train` extra.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from rmm.cli.arguments import add_check
from rmm.cli.common import add_verbose

__all__ = ["register", "run"]


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "pretrain", help="offline contrastive pretraining of a retriever on a benchmark's gold evidence (Lightning)",
        description="Train an encoder with InfoNCE on (question, gold turn) pairs, split by conversation, and "
                    "report held-out recall before/after. Options come from a YAML recipe "
                    "(configs/pretrain/*.yaml) and key=value overrides, e.g. epochs=1 hard_negatives=2.",
    )
    p.add_argument("--config", default=None, help="YAML recipe (default: built-in defaults)")
    p.add_argument("--json", default=None, help="also write the report as JSON to this path")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override recipe options")
    add_verbose(p)
    add_check(p, _recipe_problem)
    p.set_defaults(func=run)
    return p


def _recipe_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the recipe and its overrides, if anything (unknown keys, bad values)."""
    from rmm.errors import ConfigError
    from rmm.training.pretrain_config import load_config

    try:
        load_config(args.config, args.overrides)
    except ConfigError as error:
        return str(error)
    return None


def _fmt(value: Any) -> str:
    if value is None:  # e.g. no validation users: no val loss
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _resume_command(args: argparse.Namespace) -> str:
    """The command line that continues an interrupted run from its own last checkpoint."""
    parts = ["rmm", "pretrain"] + (["--config", args.config] if args.config else [])
    parts += [o for o in args.overrides if not o.lstrip("-").replace("-", "_").startswith("resume_from=")]
    return shlex.join([*parts, "resume_from=last"])


def run(args: argparse.Namespace) -> int:
    from rmm.training.pretrain import PretrainInterrupted, run_pretrain
    from rmm.training.pretrain_config import load_config

    cfg = load_config(args.config, args.overrides)
    try:
        report = run_pretrain(cfg)
    except PretrainInterrupted as interrupted:  # Ctrl-C: say where the run can pick up, exit 130 as shells expect
        if interrupted.checkpoint is None:
            print(interrupted, file=sys.stderr)
        else:
            print(f"interrupted — last checkpoint at {interrupted.checkpoint}\n"
                  f"resume with: {_resume_command(args)}", file=sys.stderr)
        return 130
    if report.rank != 0:  # DDP: the launching rank reports (and writes --json) for all of them
        return 0
    print(report.split)
    print(f"pairs {report.n_pairs}; {report.steps} steps, {report.pairs_per_second:.1f} pairs/s; "
          f"final train loss {_fmt(report.final_train_loss)}, val loss {_fmt(report.final_val_loss)}")
    print(f"encoder folder: {report.output}  (use --retriever {report.output}; it records the users it was "
          f"trained on, and rmm train --heldout {cfg.test_fraction:g} --seed {cfg.seed} holds out the others)")
    for k in cfg.eval_ks:
        key = f"recall@{k}"
        print(f"held-out {key}: before {_fmt(report.before.get(key, '-'))}  after {_fmt(report.after.get(key, '-'))}")
    if report.rerank_after:
        k = report.rerank_after["eval_k"]
        key = f"recall@{k}"
        print(f"held-out {key} with the online reranker (simulated citations): "
              f"base+RR {_fmt(report.rerank_before.get('reranker_heldout', {}).get(key, '-'))}  "
              f"pretrained+RR {_fmt(report.rerank_after['reranker_heldout'].get(key, '-'))}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report.to_json(), handle, indent=2, default=str)
    return 0
