"""Deprecated path: `rmm eval-goal` is `rmm eval-controller` (`rmm.cli.eval_controller`), which
compares GOAL-MEM or MemR³ with a direct query; `goal_figures` imports from here, with a
DeprecationWarning, until rmm 0.3."""

from __future__ import annotations

import warnings

from rmm.cli.eval_controller import controller_figures as goal_figures

__all__ = ["goal_figures"]

warnings.warn("rmm.cli.eval_goal moved to rmm.cli.eval_controller (goal_figures → controller_figures); "
              "the old path will be removed in rmm 0.3", DeprecationWarning, stacklevel=2)
