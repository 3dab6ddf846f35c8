"""What every telemetry source offers the collector, and how a failing one is retried.

A source samples the cluster at a moment and returns points in the long format the store
and the forecasters share (`unique_id`, `ds`, `y`, plus label columns), one batch per
metric. A source that cannot answer raises `SourceError`; the collector retries it with
exponential backoff and, if it stays down, records a gap. No source ever returns a value
it did not observe.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import pandas as pd

log = logging.getLogger(__name__)

T = TypeVar("T")

POINT_COLUMNS = ("unique_id", "ds", "y")


class SourceError(RuntimeError):
    """The source could not deliver this sample (unreachable, refused, malformed answer)."""


@dataclass(frozen=True, eq=False)
class MetricBatch:
    """Points of one metric: columns `unique_id`, `ds` (naive UTC), `y`, and any label
    columns, constant within a series."""

    metric: str
    points: pd.DataFrame

    def __len__(self) -> int:
        return len(self.points)


class Source(ABC):
    """A place telemetry comes from.

    `fixed_availability` says whether `available()` can change while the collector runs:
    hardware (NVML) either is there or is not, so a collector leaves an unavailable one out
    once; a network service that is down now may return, so it is sampled (and its
    outages recorded as gaps) all along.
    """

    name: str
    fixed_availability: bool = False

    @abstractmethod
    def available(self) -> bool:
        """Whether the source can be sampled now; never raises."""

    @abstractmethod
    def sample(self, at: pd.Timestamp) -> list[MetricBatch]:
        """Points observed at `at` (naive UTC); raises SourceError when it cannot."""

    def start(self) -> None:
        """Begin background work (watches) for a long-running collector; most sources
        have none."""
        return

    def close(self) -> None:
        """Release connections and stop background work; most sources hold none."""
        return


class BackfillSource(Source):
    """A source that keeps history and can deliver a past range on a regular grid."""

    # Grid points one `history` call may cover; the collector cuts longer ranges.
    chunk_steps: int

    @abstractmethod
    def history(
        self, start: pd.Timestamp, end: pd.Timestamp, step: pd.Timedelta
    ) -> list[MetricBatch]:
        """Points on the grid of `step` from `start` to `end` (both on the grid, at most
        `chunk_steps` points); raises SourceError when it cannot."""


def chunk_ranges(
    start: pd.Timestamp, end: pd.Timestamp, step: pd.Timedelta, chunk_steps: int
) -> list[tuple[pd.Timestamp, pd.Timestamp]]:
    """Grid points from start (rounded up to the grid) to end, in consecutive ranges of at
    most `chunk_steps` points."""
    ranges = []
    first = start.ceil(step)
    while first <= end:
        last = min(first + step * (chunk_steps - 1), end)
        ranges.append((first, last))
        first = last + step
    return ranges


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: attempt n waits base * factor**(n-1), capped at max_delay."""

    attempts: int = 3
    base_delay_s: float = 0.5
    factor: float = 2.0
    max_delay_s: float = 10.0

    def delays(self) -> Iterator[float]:
        for attempt in range(self.attempts - 1):
            yield min(self.base_delay_s * self.factor**attempt, self.max_delay_s)


def with_retries(
    action: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run `action`, retrying on SourceError per `policy`; the last error propagates."""
    for delay in policy.delays():
        try:
            return action()
        except SourceError as exc:
            log.warning("%s failed (%s); retrying in %.1f s", what, exc, delay)
            sleep(delay)
    return action()


def empty_points() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "unique_id": pd.Series(dtype=object),
            "ds": pd.Series(dtype="datetime64[ns]"),
            "y": pd.Series(dtype="float64"),
        }
    )
