"""The query-side controllers by name: the front ends that decide what to retrieve before the
agent's retriever → reranker (GOAL-MEM, MemR³, CompassMem), for the commands and evaluations that take
`--frontend NAME` — one place that knows which config goes with which front end.

A controller runs over an `Agent` (its bank, learners, sessions, checkpoints), answers with
`respond(user, query, remember=...)` and returns a response with `answer`, `cited`, `shown`,
`selections` and a `trace` (a `rmm.frontends.trace.FrontendTrace`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rmm.frontends.compass import CompassConfig, CompassFrontend, CompassResponse
from rmm.frontends.goal import GoalConfig, GoalFrontend, GoalResponse
from rmm.frontends.memr3 import MemR3Config, MemR3Frontend, MemR3Response
from rmm.frontends.xpath import XPathConfig, XPathFrontend, XPathResponse

if TYPE_CHECKING:
    from rmm.frontends.agent import Agent

__all__ = ["CONTROLLERS", "Controller", "ControllerConfig", "ControllerResponse", "controller_name",
           "open_controller"]

ControllerConfig = GoalConfig | MemR3Config | CompassConfig | XPathConfig
ControllerResponse = GoalResponse | MemR3Response | CompassResponse | XPathResponse


@dataclass(frozen=True)
class Controller:
    name: str  # the --frontend choice
    label: str  # how reports name it
    config: type[GoalConfig] | type[MemR3Config] | type[CompassConfig] | type[XPathConfig]
    settled: str  # the trace outcome that means the controller's search ended on its own terms


CONTROLLERS: dict[str, Controller] = {
    "goal": Controller("goal", "GOAL-MEM", GoalConfig, "grounded"),
    "memr3": Controller("memr3", "MemR³", MemR3Config, "answered"),
    "compass": Controller("compass", "CompassMem", CompassConfig, "satisfied"),
    "xpath": Controller("xpath", "Semantic XPath", XPathConfig, "queried"),
}


def controller_name(config: ControllerConfig) -> str:
    """The name of the controller a config belongs to."""
    if isinstance(config, CompassConfig):
        return "compass"
    if isinstance(config, XPathConfig):
        return "xpath"
    return "memr3" if isinstance(config, MemR3Config) else "goal"


def open_controller(agent: Agent, config: ControllerConfig) -> GoalFrontend | MemR3Frontend | CompassFrontend | XPathFrontend:
    """The controller `config` configures, over `agent` (its checks raise typed one-line errors)."""
    if isinstance(config, CompassConfig):
        return CompassFrontend(agent, config)
    if isinstance(config, XPathConfig):
        return XPathFrontend(agent, config)
    if isinstance(config, MemR3Config):
        return MemR3Frontend(agent, config)
    return GoalFrontend(agent, config)
