"""The query-side front ends (GOAL-MEM, MemR³, CompassMem) as `chat`, `eval-qa` and `eval-controller` share
them: the `--frontend` choice, each front end's options (checked at parse time), its config from
them, the refusal of an LLM that cannot write text, and the JSON-lines trace file.

Each front end's options default to None on the parser and take the config's defaults (the
papers') when absent, so that an option given for a front end that is not chosen (`--n-max` with
`--frontend goal`) is refused as one `error:` line rather than silently ignored.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rmm.cli.arguments import _number, add_check, non_negative_int, positive_int
from rmm.errors import RmmError

__all__ = ["FRONTEND_OPTIONS", "add_frontend_options", "append_trace", "frontend_config", "refuse_simulated",
           "text_llm_note"]

_LABELS = {"goal": "GOAL-MEM", "memr3": "MemR³", "compass": "CompassMem", "xpath": "Semantic XPath"}
_CANNOT = {"goal": "decompose", "memr3": "write evidence, gaps or decisions",
           "compass": "plan sub-goals or choose graph actions (--policy heuristic or oracle need no LLM)",
           "xpath": "write queries (--query-policy template needs no LLM)"}
_COMPASS_POLICIES = ("llm", "heuristic", "oracle")
_XPATH_POLICIES = ("llm", "template")
_XPATH_SCORERS = ("cosine", "reranker")


OFF = "off"  # an option's value that sets its config field to None (not the same as leaving it out)


def _mmr_weight(text: str) -> float | str:
    """A finite weight, or `off` (the config's None: the kept nodes in the order kept)."""
    return OFF if text.strip().lower() == OFF else finite_float(text)


def compass_policy(text: str) -> str:
    """An argparse type: one of the CompassMem search policies."""
    if text not in _COMPASS_POLICIES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(_COMPASS_POLICIES)}, got {text!r}")
    return text


def _choice(name: str, choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text

    parse.__name__ = name
    return parse


finite_float = _number(float, "a finite number", lambda v: True, "finite_float")
# option → (front end, config field, argparse type, help)
FRONTEND_OPTIONS: dict[str, tuple[str, str, Any, str]] = {
    "--b-max": ("goal", "b_max", positive_int, "decompositions tried (paper: 3)"),
    "--d-max": ("goal", "d_max", non_negative_int, "refinement depth (paper: 5)"),
    "--budget": ("goal", "budget", positive_int, "distinct memories per question (paper: 60)"),
    "--n-max": ("memr3", "n_max", positive_int, "generate calls per question, the iteration budget (paper: 5)"),
    "--n-chk": ("memr3", "n_chk", positive_int, "memories shown per retrieval (paper: 5)"),
    "--n-cap": ("memr3", "n_cap", positive_int,
                "reflects in a row before a retrieval is forced (default 1, as the authors' code)"),
    "--policy": ("compass", "policy", compass_policy,
                 "llm (the paper's planner and explorers), heuristic (no LLM: expand while the reranker's score "
                 "clears --threshold) or oracle (keeps the nodes holding gold turns: the graph's ceiling; eval only)"),
    "--pool": ("compass", "pool", positive_int, "first-stage events per localization (paper: 50)"),
    "--start-k": ("compass", "start_k", positive_int,
                  "localization slate: the reranker's top-k of the pool (paper and llm/oracle policies: 5; heuristic: 20)"),
    "--topics": ("compass", "topics", positive_int,
                 "the first p distinct topics the pool is diversified over (paper and llm/oracle: 5; heuristic: the pool)"),
    "--slate": ("compass", "slate", positive_int, "neighbours shown per node, a Gumbel top-M when more (default 5)"),
    "--explorers": ("compass", "explorers", positive_int, "explorers per batched generate call (paper: 3)"),
    "--max-steps": ("compass", "max_steps", positive_int, "node visits per question (default 24)"),
    "--node-budget": ("compass", "node_budget", positive_int, "kept nodes per question (default 15)"),
    "--refinements": ("compass", "refinements", non_negative_int, "refinement rounds (paper: 1)"),
    "--threshold": ("compass", "threshold", finite_float,
                    "heuristic policy: the reranker score a node must clear to be kept and expanded (default 0.3)"),
    "--seeds": ("compass", "seeds", positive_int, "heuristic policy: the slate's best nodes that start the walk (default 10)"),
    "--lookahead": ("compass", "lookahead", finite_float,
                    "heuristic policy: priority = walk score + this × the best neighbour's walk score (default 0.3)"),
    "--opener": ("compass", "opener", finite_float,
                 "heuristic policy: walk-score bonus of an event that opens its session (default 0)"),
    "--diversity": ("compass", "diversity", _mmr_weight,
                    "heuristic policy: MMR weight ordering the kept nodes (default 0.2; off: the order kept)"),
    "--query-policy": ("xpath", "query_policy", _choice("query_policy", _XPATH_POLICIES),
                       "llm (the LLM writes a query from the question and the tree's schema; one retry, then the "
                       "template) or template (no LLM: //Session[max(/Turn[node~Q])]/Turn[node~Q]); default llm"),
    "--scorer": ("xpath", "scorer", _choice("xpath_scorer", _XPATH_SCORERS),
                 "cosine (the encoder's, default) or reranker (the learned reranker's, calibrated)"),
    "--leaves": ("xpath", "leaves", positive_int, "the query's best memories handed to the reranker (default 10)"),
}


def text_llm_note(frontend: str) -> str:
    """Why the simulated LLM cannot drive `frontend`."""
    return (f"the {_LABELS[frontend]} front end needs an LLM that writes text (hf:PATH, openai:URL@MODEL, vllm:PATH); "
            f"the simulated LLM only cites and cannot {_CANNOT[frontend]}")


def add_frontend_options(p: argparse.ArgumentParser, *, direct: bool = True) -> None:
    """--frontend (direct too, unless `direct=False`: then goal by default), every front end's options,
    --trace-json and --llm-threads; an option of a front end not chosen is a parse error."""
    if direct:
        p.add_argument("--frontend", default="direct", choices=("direct", *_LABELS),
                       help="direct = the message as one query; goal = GOAL-MEM goal decomposition, one query per "
                            "subgoal; memr3 = MemR³ retrieve / reflect / answer loop over evidence and gaps; "
                            "compass = CompassMem planner + explorers over the event graph; "
                            "xpath = a Semantic XPath query over the memory tree "
                            "(goal, memr3, compass's llm policy and xpath's need an LLM that writes text)")
    else:
        p.add_argument("--frontend", default="goal", choices=tuple(_LABELS),
                       help="goal = GOAL-MEM goal decomposition; memr3 = MemR³ retrieve / reflect / answer loop; "
                            "compass = CompassMem graph search over events; xpath = Semantic XPath query over the "
                            "memory tree (default: goal)")
    for option, (frontend, _, kind, text) in FRONTEND_OPTIONS.items():
        p.add_argument(option, type=kind, help=f"{frontend} front end: {text}")
    p.add_argument("--trace-json", help="goal / memr3 / compass front end: append each question's trace to this JSON-lines file")
    p.add_argument("--llm-threads", type=positive_int,
                   help="CPU threads for an hf: model (1 is fastest on a busy machine)")
    add_check(p, _options_match_frontend)


def _options_match_frontend(args: argparse.Namespace) -> str | None:
    for option, (frontend, name, _, _) in FRONTEND_OPTIONS.items():
        if getattr(args, name) is not None and args.frontend != frontend:
            return f"{option} is a {_LABELS[frontend]} option: it needs --frontend {frontend} (got {args.frontend})"
    for option in ("trace_json", "show_trace"):
        if getattr(args, option, None) and args.frontend == "direct":
            return (f"--{option.replace('_', '-')} shows the goal or memr3 front end's traces (or compass's): "
                    "add --frontend goal, memr3 or compass")
    return None


def frontend_config(args: argparse.Namespace, **overrides: Any) -> Any:
    """The chosen front end's config (`GoalConfig` or `MemR3Config`) from the options, None for direct;
    the config's own checks become one-line errors."""
    if args.frontend == "direct":
        return None
    from rmm.frontends.controllers import CONTROLLERS

    given = {name: None if getattr(args, name) == OFF else getattr(args, name)
             for frontend, name, _, _ in FRONTEND_OPTIONS.values()
             if frontend == args.frontend and getattr(args, name) is not None}
    try:
        return CONTROLLERS[args.frontend].config(**given, **overrides)
    except ValueError as error:
        raise RmmError(f"{args.frontend} front end: {error}") from error


def refuse_simulated(args: argparse.Namespace, llm: Any) -> None:
    """The simulated LLM only cites: it cannot drive the goal or MemR³ front end, nor CompassMem's llm
    policy (the heuristic and oracle policies search without one)."""
    if args.frontend == "compass" and getattr(args, "policy", None) in ("heuristic", "oracle"):
        return
    if args.frontend == "xpath" and getattr(args, "query_policy", None) == "template":
        return
    if args.frontend != "direct" and llm.name.startswith("simulated"):
        raise RmmError(text_llm_note(args.frontend))


def append_trace(path: str | None, trace: dict[str, Any]) -> None:
    """Append one question's trace to the JSON-lines file `path` (if given)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(trace) + "\n")
