"""A problem said once while it lasts, for readings repeated every poll or pass."""

from __future__ import annotations

import logging
from collections.abc import Iterable


class ProblemLog:
    """Logs each problem when it first appears and not again while it lasts, so one that
    holds poll after poll (a Workload whose queue is unknown) is said once; one that goes
    away and comes back, or changes, is said again."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._said: frozenset[str] = frozenset()

    def report(self, problems: Iterable[str | None]) -> None:
        now = frozenset(p for p in problems if p)
        for problem in sorted(now - self._said):
            self._log.warning("%s", problem)
        self._said = now
