"""Warm start of the live loop: a missing or stale planner state is rebuilt from the store.

Cluster Autoscaler and Karpenter rebuild everything from the cluster when they start; the
loop's planner has a memory (demand in nodes, the forecast bounds it issued, the tuned
rule) that a cluster cannot give back, but the telemetry store can. So where the pass
finds no planner state (a fresh state directory, a replica that has just taken the Lease
and starts its state afresh) or one from before a gap of more than one demand step (a
restart after an outage), or for other demand groups than the store's, it replays the
planner over the history the pass reads (`planning.warm_start.replay_memory`), with the
forecasts the loop's own forecaster makes on each past step from the data before it
(`Forecaster.rolling`, one vectorised call per horizon). The pass then plans from that
memory what a replay of the same history by the same planner plans at this step.

Where the loop sees the jobs, the job-level spare's replay is rebuilt too, on the rises of
each pool's demand in whole nodes step by step (`job_requests`). A step whose series has
no observation yet leaves that group out of it (the live loop would have had no outlook
for it either); a gap within a series repeats its last value, and a forecast missing for
a step (the model's warm-up) stands in with the demand then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from predictor.foundation.errors import InputError
from predictor.models.forecast import Forecaster, quantile_column
from scaler.cluster.pools import NodePool
from scaler.planning.demand import DemandReading
from scaler.planning.job_spare import NodeRequests
from scaler.planning.planner import DemandOutlook, PlannerMemory, PlannerPolicy
from scaler.planning.warm_start import HistoryStep, ReplayedMemory, replay_memory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmStart:
    """How a pass rebuilt the planner's memory: why, over which past steps (`first` to
    `last`, `steps` of them), with which forecasts, in how many seconds."""

    why: str
    steps: int
    first: str | None
    last: str | None
    forecasts: str
    seconds: float

    def to_dict(self) -> dict[str, object]:
        return {
            "why": self.why,
            "steps": self.steps,
            "first": self.first,
            "last": self.last,
            "forecasts": self.forecasts,
            "seconds": round(self.seconds, 3),
        }


def stale_state(
    state_step: str | None,
    memory: PlannerMemory | None,
    step: str,
    groups: Sequence[str],
    step_seconds: float,
) -> str | None:
    """Why a planner state saved at demand step `state_step` cannot serve a pass at `step`
    (None: it can): none saved, saved more than one step ago (the steps between are
    missing from it) or ahead of the store, or kept for other demand groups."""
    if state_step is None or memory is None:
        return "no planner state (a fresh state directory, or the Lease taken afresh)"
    behind = (pd.Timestamp(step) - pd.Timestamp(state_step)) / pd.Timedelta(seconds=step_seconds)
    if behind > 1 or behind < 0:
        return f"planner state from step {state_step}, {behind:g} steps from the store's {step}"
    if set(memory.groups) != set(groups):
        return (
            f"planner state kept for groups {sorted(memory.groups)}, the store has {sorted(groups)}"
        )
    return None


def history_steps(
    reading: DemandReading,
    forecaster: Forecaster | None,
    live: Sequence[DemandOutlook],
    pools: Sequence[NodePool],
    step_seconds: float,
) -> tuple[list[HistoryStep], str]:
    """The past steps of the reading (all but its last, the step this pass decides), each
    with the outlooks of the groups of `live` (this pass's outlooks: their levels, rows
    and GPU models), and what forecast them. A group whose outlook carries node requests
    (the loop sees the jobs) gets each step's requests as the rise of its demand in whole
    nodes of its pool since the step before (`job_requests`)."""
    if not live or reading.history.empty:
        return [], "none"
    step = pd.Timedelta(seconds=step_seconds)
    history = reading.history
    wide = history.pivot_table(index="ds", columns="unique_id", values="y", aggfunc="max")
    grid = pd.date_range(wide.index.min(), wide.index.max(), freq=step)
    wide = wide.reindex(grid).ffill()
    levels = live[0].levels
    rows = live[0].values.shape[0]
    groups = [o.group for o in live if o.group in wide.columns]
    values = {g: np.full((grid.size, rows, len(levels)), np.nan) for g in groups}
    source = "persistence (no model to roll)"
    if forecaster is not None:
        try:
            for k in range(1, rows + 1):
                frame = forecaster.rolling(history, k, grid[0], levels).frame
                cols = [quantile_column(q) for q in levels]
                for g in groups:
                    part = frame[frame["unique_id"] == g]
                    decided = grid.get_indexer(pd.DatetimeIndex(part["ds"])) - k
                    ok = decided >= 0
                    values[g][decided[ok], k - 1, :] = part[cols].to_numpy(dtype=float)[ok]
            source = f"{forecaster.name} rolling over the history"
        except (InputError, ValueError) as exc:
            log.warning("warm start: rolling forecast failed (%s); persistence stands in", exc)
            source = f"persistence (rolling forecast failed: {exc})"
    out = []
    by_group = {o.group: o for o in live}
    for g in groups:
        v = values[g]
        for k in range(1, rows):  # a target past the data: the nearest shorter horizon's
            gap = np.isnan(v[:, k, :])
            v[:, k, :][gap] = v[:, k - 1, :][gap]
        seen = wide[g].to_numpy(dtype=float)
        missing = np.isnan(v)
        v[missing] = np.broadcast_to(seen[:, None, None], v.shape)[missing]
        values[g] = np.maximum(v, 0.0)
    gpus = {p.name: p.gpus_per_node for p in pools}
    asked = {
        g: job_requests(wide[g].to_numpy(dtype=float), gpus[g])
        for g in groups
        if by_group[g].requests is not None and g in gpus
    }
    for i, at in enumerate(grid[:-1]):
        found = []
        for g in groups:
            seen = float(wide[g].iat[i])
            if np.isnan(seen):
                continue
            o = by_group[g]
            requests = asked[g][i] if g in asked else None
            found.append(DemandOutlook(g, seen, levels, values[g][i], o.gpu_models, requests))
        out.append(HistoryStep(at.to_pydatetime(), tuple(found)))
    return out, source


def job_requests(demand: np.ndarray, gpus_per_node: int) -> list[NodeRequests]:
    """Per step, the node request the store's demand shows: the rise of the demand in whole
    nodes since the step before, asked at the step (none for a fall, a gap or the first).
    The loop itself sees each rise of a pass, a gang at once; the store keeps the step's
    peak, so rises within a step that fell back before its end are not among these."""
    nodes = np.ceil(np.maximum(demand, 0.0) / gpus_per_node - 1e-9)
    rises = np.diff(nodes, prepend=np.nan)
    return [NodeRequests((0.0,), (int(r),)) if r >= 1 else NodeRequests() for r in rises]


def rebuild(
    reading: DemandReading,
    forecaster: Forecaster | None,
    live: Sequence[DemandOutlook],
    pools: Sequence[NodePool],
    policy: PlannerPolicy,
    why: str,
) -> tuple[ReplayedMemory, WarmStart]:
    """The planner's memory at the start of the reading's last step, replayed over the
    steps before it (`history_steps`), and the account of it."""
    began = time.perf_counter()
    steps, source = history_steps(reading, forecaster, live, pools, policy.step_seconds)
    replayed = replay_memory(steps, pools, policy)
    warm = WarmStart(
        why=why,
        steps=len(steps),
        first=str(pd.Timestamp(steps[0].at)) if steps else None,
        last=str(pd.Timestamp(steps[-1].at)) if steps else None,
        forecasts=source,
        seconds=time.perf_counter() - began,
    )
    log.info(
        "warm start (%s): planner memory rebuilt over %d steps of the store's history in %.1f s",
        why,
        warm.steps,
        warm.seconds,
    )
    return replayed, warm
