"""Deprecated path: the comparison now covers every controller (GOAL-MEM, MemR³) and lives in
`rmm.eval.controller_recall`; these names import from here, with a DeprecationWarning, until rmm 0.3."""

from __future__ import annotations

import warnings

from rmm.eval.controller_recall import ControllerRecallReport as GoalRecallReport
from rmm.eval.controller_recall import evaluate_controller_recall as evaluate_goal_recall

__all__ = ["GoalRecallReport", "evaluate_goal_recall"]

warnings.warn("rmm.eval.goal_recall moved to rmm.eval.controller_recall (GoalRecallReport → ControllerRecallReport, "
              "evaluate_goal_recall → evaluate_controller_recall); the old path will be removed in rmm 0.3",
              DeprecationWarning, stacklevel=2)
