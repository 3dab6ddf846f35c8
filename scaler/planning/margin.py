"""The safety margin on top of a forecast quantile, learned online from the forecast's errors.

Split conformal prediction on a sliding window: each revealed observation y is scored
against the forecast made for it, s = (y - q_base) / spread, where q_base is the forecast
quantile the planner starts from and spread = q_base - q_median is the forecast's own
uncertainty (so the margin widens when the model is unsure and narrows when it is sure).
The upper bound for a new step is q_base + Q(1 - alpha) * spread, with Q the empirical
quantile of the window's scores: at most a share alpha of steps should land above it if
errors are exchangeable over the window. Adaptive conformal inference (Gibbs and Candes,
2021) then nudges alpha after every step, down after a miss and up after a hit, so that
the realised miss rate tracks the target even when errors drift.

An observation that capacity held for another reason already served (the planner's hold
after a sudden fall, which catches the refill that often follows) needs no margin: scoring
it as a jump would make every other step pay for the refills too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

EMPTY = np.empty(0)


@dataclass(frozen=True, slots=True)
class ConformalMargin:
    """Scores of one demand series at one horizon; immutable, `observe` returns a new one."""

    target: float  # the share of steps allowed above the bound (the service-level knob)
    window: int
    min_scores: int = 30
    step_size: float = 0.0  # ACI learning rate; 0 keeps alpha at the target
    alpha: float = math.nan  # current working alpha (starts at the target)
    scores: np.ndarray = field(default_factory=lambda: EMPTY)
    misses: int = 0
    seen: int = 0

    def __post_init__(self) -> None:
        if math.isnan(self.alpha):
            object.__setattr__(self, "alpha", self.target)

    def quantile(self) -> float | None:
        """The score quantile the bound uses; None until enough scores are in."""
        n = self.scores.size
        if n < self.min_scores:
            return None
        # Finite-sample conformal rank: the ceil((n + 1)(1 - alpha))-th smallest score.
        rank = math.ceil((n + 1) * (1.0 - min(max(self.alpha, 0.0), 1.0)))
        if rank > n:
            return float(self.scores.max())
        return float(np.partition(self.scores, rank - 1)[rank - 1])

    def bound(self, q_base: float, spread: float) -> float:
        """Upper bound on demand for a forecast (q_base, spread)."""
        quantile = self.quantile()
        if quantile is None:
            return q_base
        return q_base + quantile * spread

    def observe(
        self, actual: float, q_base: float, spread: float, covered: bool = False
    ) -> ConformalMargin:
        """Score an observation against the forecast made for it. `covered`: capacity held
        for another reason (a hold after a sudden fall) served it, so no margin was needed
        for it and its score counts as no more than the bare quantile's."""
        missed = actual > self.bound(q_base, spread) and not covered
        score = (actual - q_base) / spread
        if covered:
            score = min(score, 0.0)
        scores = np.append(self.scores, score)
        if scores.size > self.window:
            scores = scores[scores.size - self.window :]
        alpha = self.alpha + self.step_size * (self.target - float(missed))
        return replace(
            self,
            scores=scores,
            alpha=alpha,
            misses=self.misses + int(missed),
            seen=self.seen + 1,
        )
