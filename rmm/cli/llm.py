"""`rmm llm serve`: start `vllm serve` for a model on loopback and keep it up until Ctrl-C."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rmm.cli.arguments import port, positive_float
from rmm.cli.common import add_verbose, console

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("llm", help="LLM helpers")
    llm_sub = p.add_subparsers(dest="llm_command", required=True)
    d = llm_sub.add_parser("serve", help="start `vllm serve` for a model and wait until it is ready",
                           usage="rmm llm serve [options] MODEL [-- VLLM_ARGS ...]", passthrough="vllm_args",
                           epilog="Everything after `--` is passed to vLLM as it is.")
    d.add_argument("model", help="model folder or Hugging Face id known to the local cache")
    d.add_argument("--host", default="127.0.0.1")
    d.add_argument("--port", type=port, default=8000)
    d.add_argument("--python", help="python of the virtualenv that has vLLM (default: this one)")
    d.add_argument("--timeout", type=positive_float, default=600, help="seconds to wait for readiness")
    d.add_argument("--log", help="write the server's output here")
    add_verbose(d)
    d.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Start the server, wait until it answers, keep it up until Ctrl-C."""
    from rmm.llm.vllm_server import start_vllm_server, stop_server

    log_path = Path(args.log) if args.log else None
    console.print(f"starting vLLM for {args.model} on http://{args.host}:{args.port}/v1 …")
    proc = start_vllm_server(args.model, host=args.host, port=args.port, extra_args=args.vllm_args,
                             python=args.python, timeout_s=args.timeout, log_path=log_path)
    console.print(f"ready — use --llm openai:http://{args.host}:{args.port}/v1@{args.model}  (Ctrl-C stops it)")
    try:
        proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop_server(proc)
    return 0
