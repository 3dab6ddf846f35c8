"""The service's own Prometheus metrics, in a registry of their own (no process globals)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "gpuscale_service_requests",
            "HTTP requests answered, by route template and status code",
            ["method", "route", "code"],
            registry=r,
        )
        self.latency = Histogram(
            "gpuscale_service_request_seconds",
            "Time to answer a request",
            ["route"],
            registry=r,
        )
        self.placements = Counter(
            "gpuscale_service_placements",
            "Placement answers by outcome (placed, dry_run, unschedulable)",
            ["outcome"],
            registry=r,
        )
        self.extender = Counter(
            "gpuscale_service_extender_calls",
            "kube-scheduler extender calls by verb and outcome",
            ["verb", "outcome"],
            registry=r,
        )
        self.nodes = Gauge("gpuscale_service_nodes", "Nodes in the placement state", registry=r)
        self.gpu_allocated = Gauge(
            "gpuscale_service_gpu_allocated_ratio",
            "Share of the cluster's GPUs allocated in the placement state",
            registry=r,
        )

    def watch_cluster(self, nodes: Callable[[], float], allocated: Callable[[], float]) -> None:
        """Gauges read at scrape time."""
        self.nodes.set_function(nodes)
        self.gpu_allocated.set_function(allocated)
