"""A simulated day of shadow mode: gpuscale beside a cluster that scales reactively.

The synthetic workload (`scaler.evaluation.synthetic`) gives the demand of each pool. Its
first `history_days` go into the telemetry store (what a team would have collected); the
next day is played a demand step (10 minutes) at a time against a simulated cloud whose
pools the cluster's own autoscaler sizes as Cluster Autoscaler does (each pool grows to
the nodes the demand of the step needs now, booting for the pool's boot time, and sheds
the nodes beyond them once they have been unneeded for its 10 minutes). At each step the
demand point is written to the store, the autoscaler acts, and then the loop takes one
dry-run pass on that cloud, recorded as `gpuscale scale --shadow` records it
(`Reconciler.iterate(apply=False)`, then `ShadowLog.record`). `gpuscale report` reads the
result.

The pods are not simulated: the shadow passes record the GPUs demand asks beyond the ready
nodes as the GPUs waiting (as `scale --shadow` does without a cluster to read).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pandas as pd

from predictor.telemetry.store import TelemetryStore
from scaler.cluster.pools import NodePool, whole_nodes
from scaler.controller.config import LiveConfig
from scaler.controller.journal import DecisionJournal
from scaler.controller.reconcile import Reconciler
from scaler.controller.shadow import ShadowLog
from scaler.controller.system import LiveSystem
from scaler.evaluation.synthetic import generate, load_config
from scaler.planning.demand import ForecastModel
from scaler.providers.base import NodeStatus
from scaler.providers.simulated import SimulatedCloud, SimulatedCloudConfig


@dataclass(frozen=True)
class ShadowDay:
    state_dir: Path
    passes: int
    first: datetime
    last: datetime


def stepped_demand(config_path: Path | None, seed: int, days: float, step_s: float) -> pd.DataFrame:
    """The workload's demand per pool (GPUs), the peak of each step."""
    workload = generate(load_config(config_path), seed, days=days)
    frame = workload.demand.copy()
    frame["ds"] = pd.to_datetime(frame["ds"]).dt.floor(f"{step_s:g}s")
    return frame.groupby(["unique_id", "ds"], as_index=False)["y"].max()


def reactive_autoscaler(
    cloud: SimulatedCloud, pools: list[NodePool], demand: dict[str, float]
) -> None:
    """Cluster Autoscaler on one step: each pool to the nodes its demand needs now (within
    its min and max); the nodes beyond them go, booting ones first, then the newest."""
    for pool in pools:
        group = next(g for g in cloud.node_groups() if g.id() == pool.name)
        want = min(max(whole_nodes(demand.get(pool.name, 0.0) / pool.gpus_per_node), pool.min_size),
                   pool.max_size)  # fmt: skip
        have = group.target_size()
        if want > have:
            group.increase_size(want - have)
        elif want < have:
            nodes = sorted(
                group.nodes(),
                key=lambda n: (n.status is NodeStatus.READY, -n.launched_at.timestamp()),
            )
            group.delete_nodes([n.name for n in nodes[: have - want]])


def shadow_day(
    live: LiveConfig,
    state_dir: Path,
    *,
    seed: int = 0,
    history_days: float = 14.0,
    steps: int = 144,
    workload: Path | None = None,
) -> ShadowDay:
    """Play `steps` demand steps after `history_days` of history (see the module
    docstring) into `state_dir`; the passes are in its shadow.sqlite."""
    cfg = live.model_copy(update={"state_dir": state_dir})
    step_s = cfg.policy.step_seconds
    days = history_days + steps * step_s / 86400
    demand = stepped_demand(workload, seed, days, step_s)
    start = pd.Timestamp(demand["ds"].min()) + pd.Timedelta(days=history_days)
    store = TelemetryStore(state_dir)
    store.append(demand[demand["ds"] < start])
    played = demand[demand["ds"] >= start].sort_values("ds")
    # The cluster was running: its nodes for the step before are up when the day starts.
    boot = max(p.boot_seconds for p in cfg.pools)
    began = (start - pd.Timedelta(seconds=boot)).to_pydatetime()
    cloud = SimulatedCloud(cfg.pools, SimulatedCloudConfig(seed=seed), start=began)
    last = demand[demand["ds"] == start - pd.Timedelta(seconds=step_s)]
    reactive_autoscaler(cloud, list(cfg.pools), _by_pool(last))
    cloud.advance(boot)
    system = LiveSystem(
        config=cfg,
        provider=cloud,
        kube=None,
        store=store,
        log=DecisionJournal(state_dir),
        model=ForecastModel.from_settings(cfg.model),
    )
    clock = {"now": start.to_pydatetime()}
    loop = Reconciler(system, clock=lambda: clock["now"])
    log = ShadowLog(state_dir)
    first = None
    count = 0
    for ds, rows in played.groupby("ds", sort=True):
        if count == steps:
            break
        at = pd.Timestamp(ds)
        # The step's demand arrives (the collector), and the cluster's autoscaler acts on
        # it before gpuscale's pass looks: the cloud is a little ahead of the plan's eye.
        store.append(rows)
        cloud.advance(max((at.to_pydatetime() - cloud.now).total_seconds(), 0.0))
        reactive_autoscaler(cloud, list(cfg.pools), _by_pool(rows))
        clock["now"] = at.to_pydatetime()
        outcome = loop.iterate(apply=False)
        log.record(outcome.decision, cfg.pools)
        first = first or outcome.decision.at
        count += 1
    assert first is not None
    return ShadowDay(state_dir, count, first, clock["now"])


def _by_pool(rows: pd.DataFrame) -> dict[str, float]:
    return {str(k): float(v) for k, v in zip(rows["unique_id"], rows["y"], strict=True)}
