"""The goal front end (GOAL-MEM) as `chat`, `eval-qa` and `eval-goal` share it: its options, its
config from them, and the JSON-lines trace file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rmm.cli.arguments import non_negative_int, positive_int
from rmm.errors import RmmError

__all__ = ["GOAL_LLM_NOTE", "add_goal_options", "append_trace", "goal_config"]

GOAL_LLM_NOTE = ("the goal front end needs an LLM that writes text (hf:PATH, openai:URL@MODEL, vllm:PATH); "
                 "the simulated LLM only cites and cannot decompose")


def add_goal_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--b-max", type=positive_int, default=3, help="goal front end: decompositions tried (paper: 3)")
    p.add_argument("--d-max", type=non_negative_int, default=5, help="goal front end: refinement depth (paper: 5)")
    p.add_argument("--budget", type=positive_int, default=60,
                   help="goal front end: distinct memories per question (paper: 60)")
    p.add_argument("--trace-json", help="goal front end: append each question's trace to this JSON-lines file")
    p.add_argument("--llm-threads", type=positive_int,
                   help="CPU threads for an hf: model (1 is fastest on a busy machine)")


def goal_config(args: argparse.Namespace, **overrides: Any) -> Any:
    """A `GoalConfig` from the options (its own checks, as one-line errors)."""
    from rmm.frontends.goal import GoalConfig

    try:
        return GoalConfig(b_max=args.b_max, d_max=args.d_max, budget=args.budget, **overrides)
    except ValueError as error:
        raise RmmError(f"goal front end: {error}") from error


def append_trace(path: str | None, trace: dict[str, Any]) -> None:
    """Append one question's trace to the JSON-lines file `path` (if given)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(trace) + "\n")
