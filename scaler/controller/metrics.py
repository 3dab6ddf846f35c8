"""The reconcile loop's Prometheus metrics, and defragmentation's, each in a registry of
their own (no process globals).

`gpuscale scale --metrics-port` and `gpuscale defrag --metrics-port` serve them; the
Grafana dashboard (deploy/grafana/gpuscale-dashboard.json) and the alert rules
(deploy/prometheus/alerts.yaml) read the loop's. Gauges hold what the last pass saw and
decided; counters count passes and actions. Of replicas electing a leader, only the one
that leads exports what it decided (`gpuscale_scaler_leader` says which one leads): a
replica standing by exports its counters and its last pass's time, never the demand,
fleet and decisions of its last turn, which would otherwise stay in every max() across
replicas for as long as it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.metrics_core import Metric

from scaler.controller.defrag import DefragOutcome
from scaler.controller.reconcile import PassOutcome


class LoopMetrics:
    """`leading` says whether this replica leads now (LeaderElector.is_leader); None: it
    decides alone, with no election (a dry run, or no lease)."""

    def __init__(self, leading: Callable[[], bool] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._leading = leading or (lambda: True)
        self.passes = Counter(
            "gpuscale_scaler_passes",
            "Reconcile passes by result (ok, action_failed, failed: nothing could be read)",
            ["result"],
            registry=r,
        )
        self.actions = Counter(
            "gpuscale_scaler_actions",
            "Scale actions by kind and status (done, failed, blocked, superseded)",
            ["action", "status"],
            registry=r,
        )
        self.last_pass = Gauge(
            "gpuscale_scaler_last_pass_timestamp_seconds",
            "Unix time of the last pass that decided",
            registry=r,
        )
        self.leader = Gauge(
            "gpuscale_scaler_leader",
            "1 while this replica's decisions are the ones made: it holds the Lease, or it"
            " decides without election (a dry run); 0 while it stands by",
            registry=r,
        )
        # Read at each scrape: a leader whose lease lapsed in the middle of a long pass
        # says 0 at once, not after the pass.
        self.leader.set_function(lambda: float(self._leading()))
        # What a pass decided, in a registry of its own that the scrape reads only while
        # this replica leads and has decided since it last stood by (_Decided).
        r = self._decided = CollectorRegistry()
        self._deciding = False
        self.problems = Gauge(
            "gpuscale_scaler_input_problems",
            "Telemetry or forecast problems in the last pass (scale-downs are held while > 0)",
            registry=r,
        )
        self.demand = Gauge(
            "gpuscale_scaler_demand_gpus",
            "Observed GPU demand of the last step, per demand group",
            ["group"],
            registry=r,
        )
        self.forecast = Gauge(
            "gpuscale_scaler_forecast_gpus",
            "Forecast GPU demand of the step being decided, per group and quantile",
            ["group", "quantile"],
            registry=r,
        )
        self.need = Gauge(
            "gpuscale_scaler_needed_gpus",
            "GPUs the planner wants requested at the lead time, per demand group",
            ["group"],
            registry=r,
        )
        self.nodes = Gauge(
            "gpuscale_scaler_pool_nodes",
            "Nodes per pool: current (provider target) and desired (after held scale-downs)",
            ["pool", "kind"],
            registry=r,
        )
        self.spare = Gauge(
            "gpuscale_scaler_job_spare_nodes",
            "Spare nodes per pool held on top of real and pending pods, sized on the whole"
            " nodes jobs asked for",
            ["pool"],
            registry=r,
        )
        self.used = Gauge(
            "gpuscale_scaler_pool_used_gpus",
            "GPUs requested by real pods per pool",
            ["pool"],
            registry=r,
        )
        self.capacity = Gauge(
            "gpuscale_scaler_pool_capacity_gpus",
            "GPUs of the pool's current nodes",
            ["pool"],
            registry=r,
        )
        self.decision = Gauge(
            "gpuscale_scaler_decision",
            "The last decision per pool (value: desired - current), labelled with its reason",
            ["pool", "action", "reason"],
            registry=r,
        )
        self.sizing = Gauge(
            "gpuscale_scaler_group_sizing",
            "How each demand group's need is sized (1 for the one that applies): tuned,"
            " job-level-spare, forecast-bound, reactive-fallback (too little history to"
            " tune on) or reactive",
            ["group", "sizing"],
            registry=r,
        )
        self.warm_start = Gauge(
            "gpuscale_scaler_warm_start_steps",
            "Steps of the store's history the planner's memory was last rebuilt over (a"
            " fresh state directory, a Lease taken afresh, a state from before a gap)",
            registry=r,
        )
        self._decision_labels: dict[str, tuple[str, str, str]] = {}
        self.registry.register(_Decided(self))

    def failed_pass(self) -> None:
        self.passes.labels("failed").inc()

    def observe(self, outcome: PassOutcome, gpus_per_node: dict[str, int]) -> None:
        d = outcome.decision
        self.passes.labels("action_failed" if outcome.errors else "ok").inc()
        for action in outcome.actions:
            self.actions.labels(action["action"], action["status"]).inc()
        self.last_pass.set(d.at.timestamp())
        self.problems.set(len(d.problems))
        for o in d.outlook.outlooks:
            self.demand.labels(o.group).set(o.observed)
            if o.values.size:
                for j, level in enumerate(o.levels):
                    self.forecast.labels(o.group, f"{level:g}").set(float(o.values[0, j]))
        self.sizing.clear()  # one series per group: the kind that applies now
        for need in d.plan.needs:
            self.need.labels(need.group).set(need.add_to)
            self.sizing.labels(need.group, need.sizing).set(1)
        if d.warm_start is not None:
            self.warm_start.set(d.warm_start.steps)
        for pool, target in d.fleet.targets.items():
            self.nodes.labels(pool, "current").set(target)
            self.nodes.labels(pool, "desired").set(d.desired.get(pool, target))
            self.capacity.labels(pool).set(target * gpus_per_node.get(pool, 0))
            self.spare.labels(pool).set(d.job_spare.get(pool, 0))
        for pool, used in d.fleet.used_gpus.items():
            self.used.labels(pool).set(used)
        for decision in d.plan.decisions:
            reason = d.held.get(decision.pool, decision.reason)
            labels = (decision.pool, decision.action, reason[:200])
            # One series per pool: the previous reason's series goes away.
            old = self._decision_labels.get(decision.pool)
            if old is not None and old != labels:
                self.decision.remove(*old)
            self._decision_labels[decision.pool] = labels
            self.decision.labels(*labels).set(d.desired.get(decision.pool, 0) - decision.current)
        self._deciding = True

    def stand_by(self) -> None:
        """This replica no longer leads: drop what it decided, so that none of it is
        exported again, not even once it leads anew and before its first pass then."""
        self._deciding = False
        for gauge in (
            self.demand,
            self.forecast,
            self.need,
            self.nodes,
            self.spare,
            self.used,
            self.capacity,
            self.decision,
            self.sizing,
        ):
            gauge.clear()
        self._decision_labels.clear()

    def serve(self, port: int, addr: str = "0.0.0.0") -> Callable[[], None]:  # nosec B104
        return serve_registry(self.registry, port, addr)


class _Decided:
    """The scrape's view of LoopMetrics' decision gauges: all of them while the replica
    leads and has decided since it last stood by, none otherwise."""

    def __init__(self, metrics: LoopMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        if m._deciding and m._leading():
            yield from m._decided.collect()


class DefragMetrics:
    """What `gpuscale defrag` planned and did, pass by pass."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.runs = Counter(
            "gpuscale_defrag_runs",
            "Defragmentation passes by result (ok, move_failed, failed: nothing could be read)",
            ["result"],
            registry=r,
        )
        self.moves = Counter(
            "gpuscale_defrag_moves",
            "Moves of applied passes by status (done; blocked: a PodDisruptionBudget refused"
            " it; skipped: the node or GPU it was to free could not be; failed)",
            ["status"],
            registry=r,
        )
        # A dry run moves nothing: counting the refusals it foresees would add the same
        # ones again every pass.
        self.refused = Gauge(
            "gpuscale_defrag_refused_moves",
            "Planned moves the last pass found refused by a PodDisruptionBudget (a dry run"
            " asks the API server's dry-run eviction)",
            registry=r,
        )
        self.planned = Gauge(
            "gpuscale_defrag_planned_moves", "Moves the last pass planned", registry=r
        )
        self.repartitions = Counter(
            "gpuscale_defrag_repartitions",
            "MIG repartitions asked of the GPU operator's MIG manager, by status (done;"
            " requested: still under way when the pass stopped waiting; blocked: a pod held"
            " one of its GPUs; superseded; failed)",
            ["status"],
            registry=r,
        )
        self.planned_repartitions = Gauge(
            "gpuscale_defrag_planned_repartitions",
            "MIG repartitions the last pass planned",
            registry=r,
        )
        self.idle = Gauge(
            "gpuscale_defrag_idle_gpus",
            "Idle GPUs in the cluster as the last pass found them (now) and as its plan leaves"
            " them (planned)",
            ["when"],
            registry=r,
        )
        self.window = Gauge(
            "gpuscale_defrag_window_moves",
            "Moves made and repartitions asked in the current window (at most defrag.max_moves)",
            registry=r,
        )
        self.last_run = Gauge(
            "gpuscale_defrag_last_run_timestamp_seconds",
            "Unix time of the last pass that planned",
            registry=r,
        )

    def failed_run(self) -> None:
        self.runs.labels("failed").inc()

    def observe(self, outcome: DefragOutcome, at: float) -> None:
        report = outcome.report
        self.runs.labels("move_failed" if outcome.errors else "ok").inc()
        if outcome.applied:
            for result in outcome.results:
                self.moves.labels(result.status).inc()
        self.refused.set(outcome.count("blocked"))
        for change in outcome.repartitions:
            self.repartitions.labels(change.status).inc()
        self.planned.set(len(report.steps))
        self.planned_repartitions.set(len(report.repartitions))
        self.idle.labels("now").set(report.idle_gpus_before)
        self.idle.labels("planned").set(report.idle_gpus_after)
        self.window.set(report.made_in_window + outcome.window_used())
        self.last_run.set(at)

    def serve(self, port: int, addr: str = "0.0.0.0") -> Callable[[], None]:  # nosec B104
        return serve_registry(self.registry, port, addr)


def serve_registry(
    registry: CollectorRegistry,
    port: int,
    addr: str = "0.0.0.0",  # nosec B104
) -> Callable[[], None]:
    """Serve /metrics over HTTP (all interfaces by default: Prometheus scrapes the pod
    IP); returns the function that stops it."""
    server, thread = start_http_server(port, addr=addr, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop
