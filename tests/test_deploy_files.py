"""The deployment examples stay true to the CLI: their commands must parse as `rmm` arguments."""

from __future__ import annotations

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
