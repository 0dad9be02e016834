"""`rmm serve`: the retrieval server from the command line (uvicorn; SIGINT/SIGTERM shut it down
gracefully: queued retrievals finish, the rerankers are checkpointed).

Imports nothing heavy at module level: `rmm --help` must stay fast.
"""

from __future__ import annotations

import argparse
import logging
import secrets
from typing import Any

from rmm.cli.arguments import (
    device,
    index_backend,
    non_negative_float,
    port,
    positive_int,
    store_url,
)
from rmm.cli.common import add_verbose

__all__ = ["register", "run"]

log = logging.getLogger("rmm.serve")


def serve_retriever(text: str) -> str:
    """A `retriever:` name the server knows (`rmm.serve.config.RETRIEVER_FUSIONS`), checked at parse
    time; the names are imported then, not at `rmm --help` (the config module loads torch)."""
    from rmm.serve.config import RETRIEVER_FUSIONS

    if text not in RETRIEVER_FUSIONS:
        raise argparse.ArgumentTypeError(f"unknown retriever {text!r}; use one of {', '.join(RETRIEVER_FUSIONS)}")
    return text


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to `rmm`'s parser."""
    p = subparsers.add_parser("serve", help="batched retrieval server: memories, feedback → online reranker, auth",
                              description="Serve a memory bank over HTTP (OpenAPI docs at /docs). Settings come "
                                          "from --config (see configs/serve.yaml); flags override them.")
    p.add_argument("--bank", help="bank folder (created if absent)")
    p.add_argument("--config", help="YAML settings file (default: built-in defaults)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=port, help="listen port (default 8080)")
    p.add_argument("--encoder", help="encoder preset or folder (must match the bank)")
    p.add_argument("--index", dest="index_backend", type=index_backend,
                   help="torch | faiss-flat | faiss-ivf | faiss-hnsw")
    p.add_argument("--device", type=device, help="auto | cpu | cuda[:N]")
    p.add_argument("--llm", help="LLM spec for prospective reflection (default: the non-LLM fallback)")
    p.add_argument("--max-batch", type=positive_int, help="queries per batched retrieval call")
    p.add_argument("--max-wait-ms", type=non_negative_float, help="how long a query may wait for its batch to fill")
    p.add_argument("--no-batching", action="store_true", help="handle every request on its own (baseline)")
    p.add_argument("--key-file", help="file of 'KEY TENANT' lines (API keys)")
    p.add_argument("--dev-key", action="store_true",
                   help="when no API key is configured, generate one for tenant 'default' and log it")
    p.add_argument("--retriever", type=serve_retriever,
                   help="first stage: dense (default), hybrid = BM25 + dense fused by reciprocal rank, or bm25 = "
                        "BM25's ranking alone over the bank's memories; with hybrid and bm25 the reranker gets a "
                        "lexical feature: BM25's score min-max scaled to [0, 1] over BM25's top 50 (top k when k is larger)")
    p.add_argument("--no-candidate-features", dest="candidate_features", action="store_false", default=None,
                   help="hybrid / bm25: give the reranker only the lexical feature, not the candidate features "
                        "(ranks, scores, length, query overlap) it otherwise weighs (`candidate_features: false`)")
    p.add_argument("--store", type=store_url,
                   help="postgresql://user@host/db[?schema=NAME]: memories, search, pending selections, feedback, "
                        "reflection jobs and reranker versions in PostgreSQL + pgvector, shared by every replica "
                        "(the bank folder keeps open sessions); default: the folder's SQLite")
    add_verbose(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Load the config, build the app, serve until interrupted."""
    import uvicorn

    from rmm.serve.app import create_app
    from rmm.serve.config import ConfigError, load_config

    overrides = {
        "bank": args.bank, "host": args.host, "port": args.port, "encoder": args.encoder,
        "index_backend": args.index_backend, "device": args.device, "llm": args.llm,
        "batching.max_batch": args.max_batch, "batching.max_wait_ms": args.max_wait_ms,
        "batching.enabled": False if args.no_batching else None, "auth.key_file": args.key_file,
        "store": args.store, "retriever": args.retriever, "candidate_features": args.candidate_features,
    }
    config = load_config(args.config, overrides)
    if not config.auth.resolve():
        if not args.dev_key:
            raise ConfigError(
                "no API keys configured: add `auth.keys: {KEY: TENANT}` to the config, set "
                f"${config.auth.keys_env}=KEY=TENANT, pass --key-file FILE, or use --dev-key for a throwaway key"
            )
        key = secrets.token_urlsafe(24)
        config.auth.keys[key] = "default"
        log.warning("no API keys configured; this run accepts the generated key %s (tenant 'default')", key)
    from rmm.serve.http_protocol import json_error_protocol

    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                          timeout_graceful_shutdown=30, access_log=bool(args.verbose),
                                          http=json_error_protocol()))  # unparseable requests: JSON 400s too
    server.run()
    return 0
