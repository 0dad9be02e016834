"""The deployment examples stay true to the CLI: their commands must parse as `rmm` arguments."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from rmm.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def test_compose_example_runs_rmm_serve_beside_vllm_with_valid_arguments() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.example.yml").read_text())
    services = compose["services"]
    assert services["vllm"]["command"][0] == "serve" and services["rmm"]["depends_on"] == {
        "vllm": {"condition": "service_healthy"}}
    args = build_parser().parse_args(services["rmm"]["command"])
    assert args.command == "serve" and args.host == "0.0.0.0"
    assert args.llm.startswith("openai:http://vllm:8000/v1") and (ROOT / args.config).exists()


def test_dockerfile_entrypoint_is_the_rmm_cli_and_the_user_is_not_root() -> None:
    text = (ROOT / "Dockerfile.cuda").read_text()
    assert 'ENTRYPOINT ["rmm"]' in text and "\nUSER rmm\n" in text
    assert "vllm==${VLLM_VERSION}" in text and "ARG VLLM_VERSION=0.32.0" in text


def _interpolated(value: str) -> str:
    """`value` with compose's ${NAME}, ${NAME:-default} and ${NAME:?message} filled in as compose
    would with NAME unset (a default) or set to a sample value."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*)|:?\?[^}]*)?\}", lambda m: m.group(2) or f"sample-{m.group(1).lower()}",
                  value)


def test_replicas_compose_runs_two_rmm_replicas_on_postgresql_behind_a_round_robin_balancer() -> None:
    deploy = ROOT / "deploy"
    compose = yaml.safe_load((deploy / "docker-compose.replicas.yml").read_text())
    services = compose["services"]
    assert services["postgres"]["image"].startswith("pgvector/pgvector:")
    init = [v.split(":")[0] for v in services["postgres"]["volumes"] if "docker-entrypoint-initdb.d" in v]
    assert len(init) == 1
    init_sql = "\n".join(p.read_text() for p in sorted((deploy / init[0]).glob("*.sql")))
    assert "CREATE EXTENSION IF NOT EXISTS vector" in init_sql

    replicas = sorted(name for name, service in services.items() if service.get("command", [None])[0] == "serve")
    assert len(replicas) == 2
    stores = set()
    for name in replicas:
        service = services[name]
        args = build_parser().parse_args([_interpolated(str(a)) for a in service["command"]])
        assert args.command == "serve" and args.host == "0.0.0.0" and (ROOT / args.config).exists()
        assert args.store.startswith("postgresql://") and "@postgres:" in args.store
        assert service["depends_on"] == {"postgres": {"condition": "service_healthy"}}
        assert "PGPASSWORD" in service["environment"] and "RMM_API_KEYS" in service["environment"]
        stores.add(args.store)
    assert len(stores) == 1, "every replica serves the same bank"
    assert len({str(services[name]["volumes"]) for name in replicas}) == 2, "each replica has its own bank folder"

    balancer = services["lb"]
    config = [v.split(":")[0] for v in balancer["volumes"] if v.endswith("nginx.conf:ro")]
    assert len(config) == 1 and set(balancer["depends_on"]) == set(replicas)
    nginx = (deploy / config[0]).read_text()
    upstream = re.search(r"upstream\s+(\w+)\s*\{([^}]*)\}", nginx)
    assert upstream is not None and f"proxy_pass http://{upstream.group(1)};" in nginx
    servers = re.findall(r"^\s*server\s+([\w.-]+):8080\b", upstream.group(2), re.MULTILINE)
    assert sorted(servers) == replicas
    assert not re.search(r"^\s*(least_conn|ip_hash|hash|random)\b", upstream.group(2), re.MULTILINE), "round-robin"
