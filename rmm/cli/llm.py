"""`rmm llm serve`: start `vllm serve` for a model on loopback and keep it up until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from types import FrameType
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


class _Terminated(Exception):
    """SIGTERM arrived: stop the server like Ctrl-C does."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def run(args: argparse.Namespace) -> int:
    """Start the server, wait until it answers, keep it up until Ctrl-C or SIGTERM.

    The server runs in its own process group (so its engine workers can be stopped together); a
    plain `kill` of this command would therefore leave it running — SIGTERM stops it first.
    """
    from rmm.llm.vllm_server import served_model_name, start_vllm_server, stop_server

    log_path = Path(args.log) if args.log else None
    name = served_model_name(args.model, args.vllm_args)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        console.print(f"starting vLLM for {args.model} on http://{args.host}:{args.port}/v1 …")
        proc = start_vllm_server(args.model, host=args.host, port=args.port, extra_args=args.vllm_args,
                                 python=args.python, timeout_s=args.timeout, log_path=log_path)
        console.print(f"ready — use --citer/--llm openai:http://{args.host}:{args.port}/v1@{name}  "
                      "(Ctrl-C stops it)")
        try:
            proc.wait()
        except (KeyboardInterrupt, _Terminated):
            pass
        finally:
            stop_server(proc)
    except _Terminated:  # while starting: start_vllm_server has already stopped the process
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
