"""Forecasts, the plan and the node pools as the service shows them: the reconcile loop's
own dry-run decision (the same reading, forecast and planner), reused for a few seconds so
a dashboard polling it does not refit or re-describe the cloud on every call. It reads the
cluster through `observe`: in `serve`, the listing the placement state reads too."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from scaler.controller.reconcile import PassDecision, Reconciler
from scaler.controller.system import LiveSystem
from scaler.kube.observed import ObserveCluster, observe_cluster
from scaler.providers.base import NodeStatus
from scaler.service.models import (
    ForecastResponse,
    NodePoolNode,
    NodePoolResponse,
    PlanResponse,
    PoolPlan,
    SeriesForecast,
)


class PlanDesk:
    def __init__(
        self,
        system: LiveSystem,
        clock: Callable[[], float] = time.monotonic,
        observe: ObserveCluster = observe_cluster,
    ) -> None:
        self.system = system
        self.reconciler = Reconciler(system, observe=observe)
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: tuple[float, PassDecision] | None = None

    def decision(self) -> PassDecision:
        ttl = self.system.config.service.plan_cache_s
        with self._lock:
            now = self._clock()
            if self._cached is None or now - self._cached[0] >= ttl:
                self._cached = (now, self.reconciler.decide())
            return self._cached[1]

    def forecasts(self) -> ForecastResponse:
        d = self.decision()
        frame = d.outlook.forecast
        observed = d.reading.observed()
        models = {o.group: o.gpu_models for o in d.outlook.outlooks}
        levels = [c for c in frame.columns if c.startswith("q")]
        series = []
        for status in d.reading.status:
            rows = frame[frame["unique_id"] == status.unique_id].sort_values("horizon")
            chosen = models.get(status.unique_id)
            series.append(
                SeriesForecast(
                    series=status.unique_id,
                    observed=observed.get(status.unique_id),
                    newest=None if status.newest is None else status.newest.isoformat(),
                    age_s=status.age_s,
                    problem=status.problem,
                    gpu_models=None if chosen is None else sorted(chosen),
                    horizons=[
                        {"horizon": int(r["horizon"]), "ds": str(r["ds"])}
                        | {c: float(r[c]) for c in levels}
                        for _, r in rows.iterrows()
                    ],
                )
            )
        return ForecastResponse(
            at=d.at.isoformat(),
            model=d.forecast_source,
            step_seconds=self.system.config.policy.step_seconds,
            problems=d.problems,
            series=series,
        )

    def plan(self) -> PlanResponse:
        d = self.decision()
        pools = [
            PoolPlan(
                pool=p.pool,
                current=p.current,
                target=d.fleet.targets.get(p.pool, 0),
                desired=d.desired[p.pool],
                action="hold" if p.pool in d.held else p.action,
                reason=p.reason,
                held=d.held.get(p.pool),
            )
            for p in d.plan.decisions
        ]
        plan = d.plan.to_dict()
        return PlanResponse(
            at=d.at.isoformat(),
            mode=d.plan.mode,
            step=d.step,
            problems=d.problems,
            pools=pools,
            removals=[r.to_dict() for r in d.removals],
            placeholders=[p.model_dump() for p in d.placeholders],
            capacity_buffers=[b.model_dump() for b in d.buffers],
            needs=plan["needs"],  # type: ignore[arg-type]
            sizing=d.sizing(),
            warm_start=None if d.warm_start is None else d.warm_start.to_dict(),
        )

    def nodepools(self) -> list[NodePoolResponse]:
        provider = self.system.provider
        provider.refresh()
        out = []
        for group in provider.node_groups():
            pool = group.template()
            nodes = group.nodes()
            ready = sum(n.status is NodeStatus.READY for n in nodes)
            out.append(
                NodePoolResponse(
                    name=pool.name,
                    gpu_model=pool.gpu_model,
                    gpus_per_node=pool.gpus_per_node,
                    price_per_hour=pool.price_per_hour,
                    capacity_type=pool.capacity_type,
                    boot_seconds=pool.boot_seconds,
                    min_size=group.min_size(),
                    max_size=group.max_size(),
                    target_size=group.target_size(),
                    ready=ready,
                    booting=len(nodes) - ready,
                    nodes=[
                        NodePoolNode(
                            name=n.name, status=str(n.status), launched_at=n.launched_at.isoformat()
                        )
                        for n in nodes
                    ],
                )
            )
        return out
