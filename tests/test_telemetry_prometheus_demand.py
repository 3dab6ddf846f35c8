"""Integration: the Prometheus source's default demand queries, answered by a real
Prometheus scraping kube-state-metrics-shaped series, count the GPUs the Kubernetes source
counts for the same pods (but for shared GPUs, which PromQL cannot read and counts whole)."""

from __future__ import annotations

import re
from itertools import count
from typing import Any

import pytest
from prometheus_fixture import GpuExporter, PrometheusServer, Values, labels

from predictor.telemetry.config import DEFAULT_SERIES
from predictor.telemetry.kube_objects import KUBE_NAMES
from predictor.telemetry.kubernetes import parse_pod, pool_demand

pytestmark = pytest.mark.integration

QUERIES = {
    s.metric: s.query for s in DEFAULT_SERIES if s.metric in ("gpu_demand", "running", "pending")
}
PHASES = ("Pending", "Running", "Succeeded", "Failed", "Unknown")
PLACEHOLDER = dict(KUBE_NAMES.placeholder_labels)
# The label keys a kube-state-metrics --metric-labels-allowlist would name for pods.
ALLOWLISTED = (*PLACEHOLDER, "team")


def pod(
    name: str,
    phase: str,
    containers: list[dict[str, Any]],
    init: list[dict[str, Any]] | None = None,
    namespace: str = "ml",
    pod_labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    def spec(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            {"name": f"c{i}", "resources": {"requests": r, "limits": r}}
            for i, r in enumerate(requests)
        ]

    return {
        "metadata": {"name": name, "namespace": namespace, "labels": pod_labels or {}},
        "spec": {"containers": spec(containers), "initContainers": spec(init or [])},
        "status": {"phase": phase},
    }


MIG_3G, MIG_2G, MIG_1G, MIG_7G = (
    f"{KUBE_NAMES.mig_resource_prefix}{p}" for p in ("3g.40gb", "2g.20gb", "1g.10gb", "7g.80gb")
)
GPU = KUBE_NAMES.gpu_resource
PODS = [
    pod("train", "Running", [{GPU: 2, "cpu": 4}, {GPU: 1}]),
    # Its first init container asks more than its containers together: the pod holds 4.
    pod("init-heavy", "Pending", [{GPU: 1}], init=[{GPU: 4}, {GPU: 2}]),
    # Per resource: 3g and 1g from its containers, 2g (3 x 2/7) from its init container.
    pod("mig", "Running", [{MIG_3G: 1, MIG_1G: 1}], init=[{MIG_2G: 3}]),
    pod("mig-pending", "Pending", [{MIG_7G: 1}]),
    pod("headroom", "Running", [{GPU: 8}], namespace="gpuscale-system", pod_labels=PLACEHOLDER),
    # A placeholder outside the placeholders' namespace: only its labels tell.
    pod("headroom-elsewhere", "Pending", [{GPU: 8}], pod_labels=PLACEHOLDER),
    # One placeholder label of two is not a placeholder.
    pod(
        "worker",
        "Running",
        [{GPU: 1}],
        pod_labels={**dict(KUBE_NAMES.placeholder_labels[:1]), "team": "a"},
    ),
    pod("finished", "Succeeded", [{GPU: 4}]),
    pod("cpu-only", "Running", [{"cpu": 2}]),
]


def ksm_name(name: str) -> str:
    """kube-state-metrics' spelling of a resource or a label key in a label."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def kube_state_metrics(pods: list[dict[str, Any]], with_labels: bool = True) -> Values:
    """The series kube-state-metrics exports for `pods`, the way it names them."""
    out: Values = {
        "kube_pod_container_resource_requests": {},
        "kube_pod_init_container_resource_requests": {},
        "kube_pod_status_phase": {},
    }
    if with_labels:
        out["kube_pod_labels"] = {}
    for p in pods:
        meta = p["metadata"]
        own = {"namespace": meta["namespace"], "pod": meta["name"], "uid": f"uid-{meta['name']}"}
        for family, part in (
            ("kube_pod_container_resource_requests", "containers"),
            ("kube_pod_init_container_resource_requests", "initContainers"),
        ):
            for c in p["spec"][part]:
                for resource, amount in c["resources"]["requests"].items():
                    unit = "core" if resource == "cpu" else "integer"
                    key = labels(
                        **own,
                        container=c["name"],
                        node="node-a",
                        resource=ksm_name(resource),
                        unit=unit,
                    )
                    out[family][key] = float(amount)
        for phase in PHASES:
            out["kube_pod_status_phase"][labels(**own, phase=phase)] = float(
                phase == p["status"]["phase"]
            )
        if with_labels:
            exported = {
                f"label_{ksm_name(k)}": v for k, v in meta["labels"].items() if k in ALLOWLISTED
            }
            out["kube_pod_labels"][labels(**own, **exported)] = 1.0
    return out


def kubernetes_counts(pods: list[dict[str, Any]]) -> dict[str, float]:
    """What the Kubernetes source stores for `pods`, summed over its pools."""
    pools = pool_demand([], [parse_pod(p, KUBE_NAMES) for p in pods])
    return {
        "gpu_demand": sum(p.demand for p in pools),
        "running": sum(p.running for p in pools),
        "pending": sum(p.pending for p in pools),
    }


_generation = count(1)


def answers(prometheus: tuple[PrometheusServer, GpuExporter], values: Values) -> dict[str, Any]:
    """Publish `values`, wait until Prometheus has scraped them, then each demand query's
    answer: its one value, or None for an empty answer."""
    server, exporter = prometheus
    # A marker scraped with the values: once it is seen, so is everything published with it
    # (and whatever an earlier publish had but this one has not is stale).
    generation = next(_generation)
    exporter.publish({**values, "fixture_generation": {(): float(generation)}})
    server.wait_for("fixture_generation", lambda r: bool(r) and r[0]["value"][1] == str(generation))
    out: dict[str, Any] = {}
    for metric, query in QUERIES.items():
        result = server.query(query)
        assert len(result) <= 1, result
        out[metric] = float(result[0]["value"][1]) if result else None
    return out


def test_demand_queries_count_pods_as_the_kubernetes_source_does(prometheus) -> None:
    expected = kubernetes_counts(PODS)
    # train 3 + mig (3 + 1 + 6)/7 + worker 1; init-heavy 4 + mig-pending 1.
    assert expected == pytest.approx(
        {"running": 4 + 10 / 7, "pending": 5.0, "gpu_demand": 9 + 10 / 7}, rel=1e-12
    )
    got = answers(prometheus, kube_state_metrics(PODS))
    assert got == pytest.approx(expected, rel=1e-12)


def test_without_kube_pod_labels_only_the_placeholders_namespace_is_left_out(prometheus) -> None:
    """Where kube-state-metrics exports no pod labels, a placeholder outside its namespace
    cannot be told from demand and is counted; nothing else is dropped. The one in the
    placeholders' namespace (headroom, Running) is left out by its namespace alone."""
    got = answers(prometheus, kube_state_metrics(PODS, with_labels=False))
    k8s = kubernetes_counts(PODS)
    unseen = 8.0  # headroom-elsewhere, Pending
    assert got == pytest.approx(
        {
            "running": k8s["running"],
            "pending": k8s["pending"] + unseen,
            "gpu_demand": k8s["gpu_demand"] + unseen,
        },
        rel=1e-12,
    )


def test_kube_pod_labels_without_the_placeholder_keys_drop_nothing(prometheus) -> None:
    """An allowlist that names other keys (or none): kube_pod_labels has no label_ keys of
    the placeholders', and demand is all there."""
    values = kube_state_metrics(PODS)
    values["kube_pod_labels"] = {
        tuple((k, v) for k, v in key if not k.startswith("label_app_")): 1.0
        for key in values["kube_pod_labels"]
    }
    got = answers(prometheus, values)
    assert got["pending"] == pytest.approx(kubernetes_counts(PODS)["pending"] + 8.0, rel=1e-12)


def test_no_gpu_pods_is_zero_and_no_kube_state_metrics_is_a_gap(prometheus) -> None:
    idle = [p for p in PODS if p["metadata"]["name"] in ("finished", "cpu-only", "headroom")]
    assert answers(prometheus, kube_state_metrics(idle)) == dict.fromkeys(QUERIES, 0.0)
    # An outage of kube-state-metrics: none of its series, so no answer rather than a 0.
    assert answers(prometheus, {}) == dict.fromkeys(QUERIES)


def test_two_kube_state_metrics_replicas_count_each_pod_once(prometheus) -> None:
    """Unsharded kube-state-metrics replicas (two for availability) each export every
    series; the copies differ only in the target they were scraped from. Summed as they
    came, every container's GPUs counted twice."""
    single = kube_state_metrics(PODS)
    doubled: Values = {
        family: {
            tuple(sorted((*key, ("replica", replica)))): value
            for key, value in series.items()
            for replica in ("a", "b")
        }
        for family, series in single.items()
    }
    assert answers(prometheus, doubled) == pytest.approx(kubernetes_counts(PODS), rel=1e-12)
