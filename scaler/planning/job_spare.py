"""Spare nodes sized on the whole nodes jobs ask for: the planner's job-level input.

What a job waits for is a whole node. One that fits the free GPUs of nodes in use starts at
once; one that needs new nodes (an 8-GPU job, a gang of several nodes, a small job the
fragments no longer hold) waits a boot unless that many spare nodes are free when it comes,
and a gang of n nodes gains nothing from fewer than n. Measured on the synthetic workload
(`simulate --synthetic`, validation seeds), gangs of 4 and 8 nodes wait most of the
GPU-minutes; they come one by one, and the forecast of a pool's GPU demand does not see
them coming (its spread does not follow their rate). A step-level rule ("last demand plus
k nodes", tuned on the share of short steps) counts a step short by one node and a gang
waiting for eight alike, and its spare, renewed once a step, is gone for the rest of it.

So where the loop sees its jobs (the job simulator; a live loop with the pending pods), the
planner sizes each group's spare from the node requests it observed:

- a request is a rise of the group's node demand (nodes running real work plus the new
  nodes the pending jobs pack onto, `planning.reactive`) between two observations, a gang
  all at once;
- for every spare level k it replays Cluster Autoscaler plus k spare nodes over those
  requests as they come (`SpareReplay.observe`): a spare node taken is replaced one boot
  later, a request larger than the free spare waits until enough nodes are back (its own,
  at the latest, a boot after it came), and each level's GPU-minutes waited are kept,
  decayed with a week's half-life. Nodes that finished jobs free are left out, as is any
  forecast of them: refilling the spare with them, or an oracle lowering the spare by the
  nodes about to free, cost 0.2 % more GPU-hours at the same waiting on validation
  seeds (docs/benchmarks.md);
- the requests' rate by hour of the week (weekday and weekend hours apart) scales those
  waits to the hour a boot ahead, when nodes asked for now are ready: the busy afternoon
  wants more spare than the night. Where the group has a request forecast, its rate for
  that hour and its shape over the week stand in for the requests' own table;
- one price of a waiting GPU-minute, the same for every group, sets each group's level (the
  cheapest in GPU-hours plus waits at that price), and the price is the highest at which
  the replayed waits stay within the knob. At job level the knob is the share of the boot
  time that requested GPUs wait: GPU-minutes waited over GPUs requested times the boot (a
  purely reactive autoscaler makes every request wait about one boot, 1.0).

Everything here is a pure function of its inputs; the memory is immutable.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

import numpy as np

from predictor.models.requests import BUCKETS, PRIOR_HOURS, RequestRateForecast, hour_bucket

# Spare levels replayed: up to two of the largest gangs of the synthetic workload (8 nodes).
LEVELS = 17
HALF_LIFE_MINUTES = 7 * 24 * 60.0  # a week: every hour of the week seen, a drift forgotten
# An hour's request rate is shrunk toward the week's mean as if this many hours at the
# mean had been seen too: an hour seen on one day only is not taken at its word.
RATE_PRIOR_HOURS = PRIOR_HOURS


@dataclass(frozen=True, slots=True)
class NodeRequests:
    """A group's job-level input: the whole nodes its jobs asked for since the previous
    call, as rises of its node demand, each `minutes_ago` before this call."""

    minutes_ago: tuple[float, ...] = ()
    nodes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.minutes_ago) != len(self.nodes):
            raise ValueError("node requests need one time per request")
        if any(n <= 0 for n in self.nodes):
            raise ValueError("a node request asks for at least one node")


@dataclass(frozen=True, slots=True)
class ScheduledNodes:
    """A group's known demand ahead: whole nodes that scheduled jobs (CronJobs) will ask
    for, each `minutes_ahead` after this call. Their nodes are held as spare from a boot
    before they fire, on top of the spare sized for the requests nobody announced."""

    minutes_ahead: tuple[float, ...] = ()
    nodes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.minutes_ahead) != len(self.nodes):
            raise ValueError("scheduled nodes need one time per run")
        if any(n <= 0 for n in self.nodes):
            raise ValueError("a scheduled run asks for at least one node")

    def due(self, within_minutes: float) -> int:
        """Nodes of the runs firing from now to `within_minutes` ahead."""
        return sum(
            n
            for m, n in zip(self.minutes_ahead, self.nodes, strict=True)
            if 0 <= m <= within_minutes
        )


@dataclass(frozen=True, slots=True)
class SpareReplay:
    """One group's replay of every spare level (index = spare nodes), as of `minute` (the
    planner's clock: minutes since its first call)."""

    free: tuple[int, ...]  # spare nodes free now
    coming: tuple[tuple[float, ...], ...]  # minutes the nodes on the way are ready, sorted
    waited: np.ndarray  # GPU-minutes requests would have waited (decayed)
    requested: np.ndarray  # per hour bucket: GPUs requested (decayed)
    hours: np.ndarray  # per hour bucket: hours observed (decayed)
    minute: float

    @classmethod
    def start(cls, minute: float) -> SpareReplay:
        return cls(
            free=tuple(range(LEVELS)),
            coming=((),) * LEVELS,
            waited=np.zeros(LEVELS),
            requested=np.zeros(BUCKETS),
            hours=np.zeros(BUCKETS),
            minute=minute,
        )

    def observe(
        self,
        requests: NodeRequests,
        minute: float,
        at: datetime,
        gpus_per_node: int,
        boot_minutes: float,
    ) -> SpareReplay:
        """This replay once the requests of the call at `minute` (wall clock `at`) are in."""
        decay = 0.5 ** (max(minute - self.minute, 0.0) / HALF_LIFE_MINUTES)
        waited = self.waited * decay
        requested = self.requested * decay
        hours = self.hours * decay
        elapsed = max(minute - self.minute, 0.0)
        hours[hour_bucket(at - timedelta(minutes=elapsed / 2))] += elapsed / 60
        free = list(self.free)
        coming = [list(c) for c in self.coming]
        for ago, nodes in sorted(
            zip(requests.minutes_ago, requests.nodes, strict=True), key=lambda r: -r[0]
        ):
            t = minute - ago
            requested[hour_bucket(at - timedelta(minutes=ago))] += nodes * gpus_per_node
            for level in range(LEVELS):
                waited[level] += (
                    nodes * gpus_per_node * _take(free, coming, level, t, nodes, boot_minutes)
                )
        return SpareReplay(
            tuple(free), tuple(tuple(c) for c in coming), waited, requested, hours, minute
        )


def _take(
    free: list[int], coming: list[list[float]], level: int, t: float, nodes: int, boot: float
) -> float:
    """Serve a request of `nodes` at minute `t` from level `level`'s spare (in place): the
    nodes on the way by then join the free ones, the request orders its own `nodes` (the
    spare is kept on top of what waits), takes free ones if enough are, else waits for
    the earliest on the way. Returns its wait (minutes)."""
    queue = coming[level]
    ready = bisect.bisect_right(queue, t)
    free[level] += ready
    del queue[:ready]
    queue.extend([t + boot] * nodes)  # every entry already there is ready by t + boot
    if free[level] >= nodes:
        free[level] -= nodes
        return 0.0
    need = nodes - free[level]
    free[level] = 0
    wait = queue[need - 1] - t
    del queue[:need]
    return wait


RateModel = Literal["forecast", "seasonal", "flat"]


@dataclass(frozen=True, slots=True)
class GroupSpare:
    """What one group's spare is chosen from: its replay, its unit and boot, its cap, and
    the forecast of its request rate (None: the replay's own seasonal table)."""

    replay: SpareReplay
    gpus_per_node: int
    boot_minutes: float
    most: int  # the most spare nodes it may hold
    forecast: RequestRateForecast | None = None


@dataclass(frozen=True, slots=True)
class SpareChoice:
    nodes: Mapping[str, int]  # spare nodes per group for the hour ahead
    price: float  # GPU-minutes waited one GPU-hour is worth
    share: float  # replayed share of the requested GPUs' boot time waited at that price


def choose_spares(
    groups: Mapping[str, GroupSpare], knob: float, at: datetime, rates: RateModel = "forecast"
) -> SpareChoice:
    """Each group's spare as asked for at `at` (see the module docstring): at one price of
    waiting for all groups, the cheapest level in GPU-hours plus priced waits, each hour's
    waits scaled by its request rate; the price the highest (least spare) whose replayed
    waits, over the hours seen, stay within `knob` of the requested GPUs' boot time.

    The level held is the one for the hour a boot after `at`, when nodes asked for now are
    ready, at that hour's rate: by `rates`, the group's forecast (`GroupSpare.forecast`:
    its rate ahead, and its shape over the week where the price is set; the seasonal
    table where it has none), the seasonal table alone, or `flat` (the week's mean rate
    every hour: no rate model at all)."""
    tables = {name: _table(g, rates) for name, g in groups.items() if g.replay.hours.sum() > 0}
    requested = sum(
        groups[name].boot_minutes * float(groups[name].replay.requested.sum()) for name in tables
    )

    def levels(price: float) -> tuple[dict[str, np.ndarray], float]:
        chosen, waited = {}, 0.0
        for name, (cost, waits, weight) in tables.items():
            pick = np.argmin(cost[:, None] + waits / price, axis=0)
            chosen[name] = pick
            waited += float((weight * waits[pick, np.arange(BUCKETS)]).sum())
        return chosen, waited / requested if requested > 0 else 0.0

    low, high = 1e-3, 1e6  # GPU-minutes per GPU-hour
    for _ in range(48):
        mid = math.sqrt(low * high)
        if levels(mid)[1] <= knob:
            low = mid
        else:
            high = mid
    nodes = {name: 0 for name in groups}
    for name, (cost, waits, _) in tables.items():
        group = groups[name]
        # A spare node asked for now is ready a boot later: it serves the hour then.
        ready = hour_bucket(at + timedelta(minutes=group.boot_minutes))
        ahead = waits[:, ready]
        if rates == "forecast" and group.forecast is not None:
            ahead = _per_hour(group.replay) * (group.forecast.ahead / _mean_rate(group.replay))
        nodes[name] = min(int(np.argmin(cost + ahead / low)), group.most)
    return SpareChoice(nodes, low, levels(low)[1])


def _mean_rate(replay: SpareReplay) -> float:
    """GPUs requested per hour over the hours seen (decayed alike)."""
    return max(float(replay.requested.sum()) / float(replay.hours.sum()), 1e-9)


def _per_hour(replay: SpareReplay) -> np.ndarray:
    """Per level, the GPU-minutes an hour at the mean rate waited."""
    return replay.waited / float(replay.hours.sum())


def _table(group: GroupSpare, rates: RateModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per level the GPU-hours an hour of spare costs, per level and hour bucket the
    GPU-minutes an hour there would wait (the level's average scaled by the bucket's
    request rate: the forecast's shape where `rates` is `forecast` and it has one, else
    the requests' own table; `flat`: unscaled), and per bucket the hours it weighs.

    The forecast's shape sets the price because it is what then sizes the spare held:
    priced on the table's noisier shape, the price answers for hours the spare is not
    sized by. Validation seeds 10-14 of `simulate --synthetic`, GPU-hours saved against
    the buffers at knobs 0.05 / 0.1 / 0.2: 5.8 / 6.8 / 2.6 % on average, against 5.9 /
    6.0 / 3.0 % priced on the table. The waits scale in proportion to the rate: scaled
    faster at the higher levels (a spare empties more often when requests come faster; an
    exponent per level fitted on the replay's waits by hour bucket) they cost 0.5 % more
    GPU-hours at the same waiting on those seeds."""
    replay = group.replay
    hours = replay.hours
    total = float(hours.sum())
    mean_rate = float(replay.requested.sum()) / total
    rate = (replay.requested + RATE_PRIOR_HOURS * mean_rate) / (hours + RATE_PRIOR_HOURS)
    shape = None if group.forecast is None else group.forecast.by_bucket
    if rates == "forecast" and shape is not None:
        rate = np.asarray(shape, dtype=float)
    # Relative to the hours' mean, so that the hours seen add up to the waits replayed.
    seen = float((hours * rate).sum())
    relative = rate * total / seen if seen > 0 and rates != "flat" else np.ones(BUCKETS)
    cost = np.arange(LEVELS, dtype=float) * group.gpus_per_node
    return cost, _per_hour(replay)[:, None] * relative[None, :], hours
