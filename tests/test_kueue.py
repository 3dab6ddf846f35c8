"""Kueue's queue as demand: a pending Workload's pod sets count for the pools they target
before any pod exists, in the collector (watched) and in the live loop's scale-up estimate;
once admitted and its pods run, they are counted once, as pods."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from fake_kube import KUEUE_V1BETA1, KUEUE_V1BETA2, FakeKube
from kubernetes.client import ApiException
from live_fixtures import fast_policy, pool

from predictor.telemetry.config import KubernetesSettings
from predictor.telemetry.kube_objects import KUBE_NAMES
from predictor.telemetry.kubernetes import UNPOOLED, KubernetesSource, api_client
from predictor.telemetry.kueue import (
    QUEUE_KINDS,
    WORKLOADS,
    list_call,
    queued_pod_sets,
    read_queues,
)
from predictor.telemetry.sources import SourceError
from predictor.telemetry.store import TelemetryStore
from scaler.controller.config import LiveConfig
from scaler.controller.reconcile import Reconciler
from scaler.controller.system import LiveSystem
from scaler.kube.kueue import queued_jobs, read_queue, with_queue
from scaler.kube.observed import observe_cluster

POOL = "gpuscale.io/pool"
MODEL = "nvidia.com/gpu.product"
AT = pd.Timestamp("2026-01-01 00:00:00")
NOW = datetime(2025, 3, 1, 12, 0, 0)
FLAVORS = [
    {"metadata": {"name": "a100-flavor"}, "spec": {"nodeLabels": {POOL: "a100"}}},
    {
        "metadata": {"name": "h100-flavor"},
        "spec": {
            "nodeLabels": {POOL: "h100"},
            "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        },
    },
]


def template(gpus: int, *, selector: dict[str, str] | None = None, share: int | None = None):
    requests = {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": str(gpus)}
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "image": "trainer:1", "resources": {"requests": requests}}]
    }
    if selector:
        spec["nodeSelector"] = selector
    meta = {"annotations": {"gpuscale.io/gpu-milli": str(share)}} if share else {}
    return {"metadata": meta, "spec": spec}


def mig_template(profile: str, instances: int, *, selector: dict[str, str] | None = None):
    """A pod template asking `instances` MIG instances of `profile` (as a limit only)."""
    made = template(0, selector=selector)
    made["spec"]["containers"][0]["resources"] = {
        "limits": {f"nvidia.com/mig-{profile}": str(instances)}
    }
    return made


def workload(
    name: str,
    pod_sets: list[tuple[str, int, dict]],
    *,
    flavor: str | None = None,
    conditions: tuple[str, ...] = (),
    queue: str = "team-a",
    **spec: Any,
) -> dict:
    """A Workload of (name, count, template) pod sets submitted to LocalQueue `queue`;
    `flavor`: its quota is reserved on that flavor (status.admission, QuotaReserved);
    `conditions`: those that hold."""
    if flavor is not None:
        conditions = ("QuotaReserved", *conditions)
    status: dict[str, Any] = {
        "conditions": [{"type": c, "status": "True", "reason": c} for c in conditions]
    }
    if flavor is not None:
        status["admission"] = {
            "clusterQueue": "gpus",
            "podSetAssignments": [
                {"name": n, "flavors": {"nvidia.com/gpu": flavor, "cpu": "default"}, "count": c}
                for n, c, _ in pod_sets
            ],
        }
    return {
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {
            "queueName": queue,
            "podSets": [{"name": n, "count": c, "template": t} for n, c, t in pod_sets],
        }
        | spec,
        "status": status,
    }


def test_a_pending_workload_targets_its_flavors_pools_and_an_admitted_one_is_left_out() -> None:
    flavors = read_queues(FLAVORS)
    reserved = workload("train", [("workers", 2, template(8))], flavor="a100-flavor")
    (pod_set,) = queued_pod_sets(reserved, flavors)
    assert (pod_set.workload, pod_set.name, pod_set.count, pod_set.gpus) == (
        "ml/train",
        "workers",
        2,
        16.0,
    )
    assert pod_set.pod.wanted_pool == "a100" and pod_set.pod.node_selector == ((POOL, "a100"),)
    assert pod_set.queue_problem is None
    # Waiting for quota, no flavor yet, and its LocalQueue unknown: the pool its template
    # selects, else any, and why.
    selected = workload("a", [("main", 1, template(4, selector={POOL: "h100"}))])
    anywhere = workload("b", [("main", 3, template(1, share=250))])
    (by_selector,) = queued_pod_sets(selected, flavors)
    assert by_selector.pod.wanted_pool == "h100"
    assert by_selector.queue_problem == (
        "Kueue Workload ml/a: LocalQueue ml/team-a not found; its pods count in the pool"
        " their template selects (h100)"
    )
    (shared,) = queued_pod_sets(anywhere, flavors)
    assert shared.pod.wanted_pool is None and shared.gpus == 0.75
    # The flavor's taints are tolerated as Kueue makes the pods tolerate them.
    on_h100 = workload("c", [("main", 1, template(8))], flavor="h100-flavor")
    (tolerant,) = queued_pod_sets(on_h100, flavors)
    assert [t.key for t in tolerant.pod.tolerations] == ["dedicated"]
    for done in (
        workload("d", [("main", 1, template(8))], flavor="a100-flavor", conditions=("Admitted",)),
        workload("e", [("main", 1, template(8))], conditions=("Finished",)),
        workload("f", [("main", 1, template(8))], active=False),
    ):
        assert queued_pod_sets(done, flavors) == ()


def test_a_partially_admitted_pod_set_counts_the_pods_its_quota_holds() -> None:
    """Partial admission: 4 workers asked, at least 2 (minCount); the quota reserved holds
    2 (podSetAssignments[].count), so the job will run 2 pods, not 4."""
    partial = workload("train", [("workers", 4, template(8))], flavor="a100-flavor")
    partial["spec"]["podSets"][0]["minCount"] = 2
    partial["status"]["admission"]["podSetAssignments"][0]["count"] = 2
    (pod_set,) = queued_pod_sets(partial, read_queues(FLAVORS))
    assert (pod_set.count, pod_set.gpus) == (2, 16.0)
    # Waiting for quota, the whole count is asked first.
    waiting = workload("wait", [("workers", 4, template(8))])
    waiting["spec"]["podSets"][0]["minCount"] = 2
    assert queued_pod_sets(waiting, read_queues(FLAVORS))[0].count == 4


def test_a_workload_is_one_gang_of_its_pods_jobs() -> None:
    pending = workload(
        "llm",
        [("launcher", 1, template(1)), ("workers", 2, template(8))],
        flavor="a100-flavor",
    )
    pending["spec"]["podSets"][1]["topologyRequest"] = {
        "required": "cloud.provider.com/topology-rack"
    }
    jobs = queued_jobs(queued_pod_sets(pending, read_queues(FLAVORS)), KUBE_NAMES)
    assert [(j.id, j.num_gpu, j.gang) for j in jobs] == [
        ("ml/llm/launcher-0", 1, "ml/llm"),
        ("ml/llm/workers-0", 8, "ml/llm"),
        ("ml/llm/workers-1", 8, "ml/llm"),
    ]
    assert jobs[1].topology_key == "cloud.provider.com/topology-rack" and jobs[1].topology_required


# ---- quota-waiting Workloads, through their queue ------------------------------------------


def local_queue(name: str, cluster_queue: str, namespace: str = "ml") -> dict:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterQueue": cluster_queue},
    }


def cluster_queue(name: str, *groups: tuple[list[str], list[tuple[str, list[str]]]]) -> dict:
    """A ClusterQueue of resource groups (covered resources, [(flavor, nominal quotas in
    the covered resources' order)])."""
    return {
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {},
            "resourceGroups": [
                {
                    "coveredResources": covered,
                    "flavors": [
                        {
                            "name": flavor,
                            "resources": [
                                {"name": r, "nominalQuota": q}
                                for r, q in zip(covered, quotas, strict=True)
                            ],
                        }
                        for flavor, quotas in flavors
                    ],
                }
                for covered, flavors in groups
            ],
        },
    }


GPU_GROUP = ["cpu", "memory", "nvidia.com/gpu"]
QUEUE_FLAVORS = [
    *FLAVORS,
    {"metadata": {"name": "default"}, "spec": {}},  # CPU nodes: no pool
    {"metadata": {"name": "on-prem"}, "spec": {"nodeLabels": {"site": "lab"}}},  # no pool
]


def test_a_quota_waiting_workload_goes_to_the_first_flavor_of_its_queue_that_fits() -> None:
    """LocalQueue ml/team-a -> ClusterQueue gpus, whose GPU group lists a CPU flavor with
    no GPU quota (nominal 0), a flavor whose nodes are no pool, then h100 and a100: a pod
    set waiting for quota goes to h100, the first that can hold its GPUs and names a pool,
    tolerating h100's taints; one whose template selects a100 goes to a100, the first
    flavor its selector agrees with; a MIG pod set to the flavor with quota of its MIG
    resource."""
    queues = read_queues(
        QUEUE_FLAVORS,
        [local_queue("team-a", "gpus"), local_queue("team-a", "elsewhere", namespace="other")],
        [
            cluster_queue(
                "gpus",
                (
                    GPU_GROUP,
                    [
                        ("default", ["96", "1Ti", "0"]),
                        ("on-prem", ["96", "1Ti", "8"]),
                        ("h100-flavor", ["96", "1Ti", "32"]),
                        ("a100-flavor", ["96", "1Ti", "64"]),
                    ],
                ),
                (["nvidia.com/mig-3g.40gb"], [("h100-flavor", ["0"]), ("a100-flavor", ["14"])]),
            )
        ],
    )
    waiting = workload("train", [("workers", 2, template(8))])
    (pod_set,) = queued_pod_sets(waiting, queues)
    assert pod_set.pod.wanted_pool == "h100" and pod_set.gpus == 16.0
    assert [t.key for t in pod_set.pod.tolerations] == ["dedicated"]
    assert pod_set.queue_problem is None
    pinned = workload("pinned", [("main", 1, template(8, selector={POOL: "a100"}))])
    assert queued_pod_sets(pinned, queues)[0].pod.wanted_pool == "a100"
    (mig,) = queued_pod_sets(workload("tune", [("main", 2, mig_template("3g.40gb", 1))]), queues)
    assert mig.pod.wanted_pool == "a100" and mig.gpus == pytest.approx(6 / 7)
    # No flavor with GPU quota agrees with the template: its selector, and why.
    elsewhere = workload("b200", [("main", 1, template(8, selector={POOL: "b200"}))])
    (fallback,) = queued_pod_sets(elsewhere, queues)
    assert fallback.pod.wanted_pool == "b200"
    assert fallback.queue_problem == (
        "Kueue Workload ml/b200: no flavor of ClusterQueue gpus with quota of nvidia.com/gpu"
        " names a pool (gpuscale.io/pool) its template allows; its pods count in the pool"
        " their template selects (b200)"
    )
    # A queue of another namespace is not this one's; a ClusterQueue that is not there.
    other = workload("x", [("main", 1, template(8))])
    other["metadata"]["namespace"] = "other"
    assert queued_pod_sets(other, queues)[0].queue_problem == (
        "Kueue Workload other/x: ClusterQueue elsewhere (of LocalQueue other/team-a) not"
        " found; its pods count in the pool their template selects (any)"
    )
    # A pod set asking no GPU has nothing to target through the queue.
    (cpu,) = queued_pod_sets(workload("cpu", [("main", 1, template(0))]), queues)
    assert cpu.pod.wanted_pool is None and cpu.queue_problem is None


def test_a_flavor_whose_node_taints_the_pod_set_does_not_tolerate_is_passed_over() -> None:
    """Kueue's flavor assigner skips a flavor with a NoSchedule or NoExecute nodeTaint that
    neither the template nor the flavor's tolerations tolerate: a pod set without the
    toleration goes on to a100; one tolerating it, or a flavor tolerating its own taint,
    stays on h100. A PreferNoSchedule taint keeps no one out."""
    taint = {"key": "reserved", "value": "research", "effect": "NoSchedule"}
    tainted = {"metadata": {"name": "h100-flavor"}, "spec": {"nodeLabels": {POOL: "h100"}}}

    def queues(taints: list[dict], tolerations: tuple[dict, ...] = ()) -> Any:
        flavor = copy.deepcopy(tainted)
        flavor["spec"] |= {"nodeTaints": taints, "tolerations": list(tolerations)}
        group = (
            GPU_GROUP,
            [("h100-flavor", ["96", "1Ti", "32"]), ("a100-flavor", ["96", "1Ti", "64"])],
        )
        return read_queues(
            [flavor, FLAVORS[0]], [local_queue("team-a", "gpus")], [cluster_queue("gpus", group)]
        )

    def pool_of(made: Any, spec: dict) -> str | None:
        return queued_pod_sets(workload("w", [("main", 1, spec)]), made)[0].pod.wanted_pool

    plain = template(8)
    tolerant = template(8)
    tolerant["spec"]["tolerations"] = [{"key": "reserved", "operator": "Exists"}]
    assert pool_of(queues([taint]), plain) == "a100"
    assert pool_of(queues([taint]), tolerant) == "h100"
    assert pool_of(queues([taint], ({"key": "reserved", "operator": "Exists"},)), plain) == "h100"
    assert pool_of(queues([taint | {"effect": "PreferNoSchedule"}]), plain) == "h100"


def test_a_flavor_whose_labels_the_required_node_affinity_excludes_is_passed_over() -> None:
    """Kueue's flavor assigner matches the template's required node affinity against the
    flavor's nodeLabels, on the keys the flavor sets only: h100's labels fail NotIn on the
    pool, Gt on its GPU memory, or terms that name other pools, so the pod set goes on to
    a100, which sets no memory label (that expression is not its to match); a term with no
    expression on h100's keys lets every flavor through, so the pod set stays on h100."""
    h100 = {
        "metadata": {"name": "h100-flavor"},
        "spec": {"nodeLabels": {POOL: "h100", "gpu.memory-gb": "80"}},
    }
    group = (
        GPU_GROUP,
        [("h100-flavor", ["96", "1Ti", "32"]), ("a100-flavor", ["96", "1Ti", "64"])],
    )
    queues = read_queues(
        [h100, FLAVORS[0]], [local_queue("team-a", "gpus")], [cluster_queue("gpus", group)]
    )

    def pool_of(*terms: list[tuple[str, str, list[str]]]) -> str | None:
        spec = template(8)
        required = {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": k, "operator": o, "values": v} for k, o, v in t]}
                for t in terms
            ]
        }
        spec["spec"]["affinity"] = {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}
        }
        return queued_pod_sets(workload("w", [("main", 1, spec)]), queues)[0].pod.wanted_pool

    assert pool_of([(POOL, "NotIn", ["h100"])]) == "a100"
    assert pool_of([("gpu.memory-gb", "Gt", ["100"])]) == "a100"
    assert pool_of([(POOL, "In", ["b200"])], [(POOL, "In", ["a100"])]) == "a100"
    assert pool_of([("gpu.memory-gb", "Lt", ["100"]), (POOL, "Exists", [])]) == "h100"
    assert pool_of([("zone", "In", ["z1"])], [(POOL, "In", ["a100"])]) == "h100"


def test_a_workload_in_a_stopped_queue_is_not_demand() -> None:
    """A ClusterQueue or LocalQueue with stopPolicy Hold or HoldAndDrain reserves no quota
    and cancels reservations not yet admitted: its Workloads, waiting or reserved, are
    not pending demand; a queue with stopPolicy None is."""
    group = (GPU_GROUP, [("a100-flavor", ["96", "1Ti", "64"])])
    running, held = cluster_queue("gpus", group), cluster_queue("held", group)
    running["spec"]["stopPolicy"] = "None"  # the CRD's default
    held["spec"]["stopPolicy"] = "Hold"
    drained = local_queue("drained", "gpus")
    drained["spec"]["stopPolicy"] = "HoldAndDrain"
    queues = read_queues(
        FLAVORS,
        [local_queue("team-a", "gpus"), local_queue("team-h", "held"), drained],
        [running, held],
    )
    assert queued_pod_sets(workload("go", [("main", 1, template(8))]), queues)[0].gpus == 8.0
    for stopped in (
        workload("a", [("main", 1, template(8))], queue="team-h"),
        workload("b", [("main", 1, template(8))], queue="drained"),
        workload("c", [("main", 1, template(8))], queue="team-h", flavor="a100-flavor"),
    ):
        if "admission" in stopped["status"]:
            stopped["status"]["admission"]["clusterQueue"] = "held"
        assert queued_pod_sets(stopped, queues) == ()


# ---- the collector ------------------------------------------------------------------------


def node(name: str, pool: str, gpus: int = 8, provider_id: str | None = None) -> dict:
    return {
        "metadata": {"name": name, "labels": {POOL: pool, MODEL: "A100"}},
        "spec": {"providerID": provider_id} if provider_id else {},
        "status": {
            "allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "96", "memory": "1Ti"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def running_pod(name: str, node_name: str, gpus: int) -> dict:
    requests = {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": str(gpus)}
    return {
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": "main", "image": "t", "resources": {"requests": requests}}],
        },
        "status": {"phase": "Running"},
    }


@pytest.fixture
def kueue_cluster(fake: FakeKube, tmp_path: Path) -> Iterator[KubernetesSettings]:
    fake.create("nodes", node("a100-1", "a100"))
    fake.create("pods", running_pod("serve", "a100-1", 8))
    for flavor in FLAVORS:
        fake.create("resourceflavors", flavor)
    yield KubernetesSettings(
        kubeconfig=fake.write_kubeconfig(tmp_path / "kubeconfig"),
        kueue=True,
        watch_timeout_s=30,
        request_timeout_s=5,
    )


def demand_of(source: KubernetesSource) -> dict[str, dict[str, float]]:
    return {
        batch.metric: dict(zip(batch.points["unique_id"], batch.points["y"], strict=True))
        for batch in source.sample(AT)
    }


def admit_and_run(fake: FakeKube, name: str, nodes: list[str]) -> None:
    """Kueue admits the Workload, the job's pods are made and start."""
    current = fake.get("workloads", name, "ml")
    conditions = [*current["status"]["conditions"], {"type": "Admitted", "status": "True"}]
    fake.patch("workloads", name, {"status": {"conditions": conditions}}, "ml")
    for i, node_name in enumerate(nodes):
        fake.create("pods", running_pod(f"{name}-workers-{i}", node_name, 8))


def test_the_collector_counts_the_queue_once(fake: FakeKube, kueue_cluster) -> None:
    source = KubernetesSource(kueue_cluster)
    try:
        before = demand_of(source)
        assert before["pending"] == {"a100": 0.0} and before["queued"] == {"a100": 0.0}
        fake.create(
            "workloads", workload("train", [("workers", 2, template(8))], flavor="a100-flavor")
        )
        got = demand_of(source)
        assert got["pending"] == {"a100": 16.0} and got["queued"] == {"a100": 16.0}
        assert got["gpu_demand"] == {"a100": 24.0} and got["running"] == {"a100": 8.0}

        fake.create("nodes", node("a100-2", "a100"))
        fake.create("nodes", node("a100-3", "a100"))
        admit_and_run(fake, "train", ["a100-2", "a100-3"])
        after = demand_of(source)
        assert after["queued"] == {"a100": 0.0} and after["pending"] == {"a100": 0.0}
        assert after["running"] == {"a100": 24.0} and after["gpu_demand"] == {"a100": 24.0}
    finally:
        source.close()


@pytest.mark.parametrize(
    ("unserved", "served"),
    [(KUEUE_V1BETA1, KUEUE_V1BETA2), (KUEUE_V1BETA2, KUEUE_V1BETA1)],
    ids=["kueue-past-v1beta1", "kueue-before-0.15"],
)
def test_the_queue_is_read_at_the_version_kueue_serves(
    fake: FakeKube, kueue_cluster, unserved: str, served: str
) -> None:
    # gpuscale read v1beta1 only: a Kueue that stops serving it (v1beta2 is its storage
    # version from 0.16) answered 404 to every list, and the queue was never demand.
    fake.unserved.add(unserved)
    fake.create("workloads", workload("train", [("workers", 2, template(8))], flavor="a100-flavor"))
    source = KubernetesSource(kueue_cluster)
    try:
        assert demand_of(source)["queued"] == {"a100": 16.0}
    finally:
        source.close()
    pod_sets = read_queue(api_client(kueue_cluster), KUBE_NAMES)  # the live loop's pass
    assert [(p.workload, p.count, p.pod.wanted_pool) for p in pod_sets] == [("ml/train", 2, "a100")]
    kueue_paths = [p for _, p in fake.requests if p.startswith("/apis/kueue.x-k8s.io/")]
    assert any(p.startswith(f"{served}/workloads") for p in kueue_paths)
    assert not any(p.startswith(f"{unserved}/workloads") for p in kueue_paths)


def test_an_upgrade_of_kueue_past_the_version_read_is_followed(
    fake: FakeKube, kueue_cluster
) -> None:
    fake.unserved.add(KUEUE_V1BETA2)  # Kueue before 0.15
    fake.create("workloads", workload("train", [("workers", 2, template(8))], flavor="a100-flavor"))
    workloads = list_call(api_client(kueue_cluster), WORKLOADS)
    assert len(workloads()["items"]) == 1 and workloads.version == "v1beta1"
    fake.unserved = {KUEUE_V1BETA1}  # upgraded to a Kueue that serves v1beta2 only
    with pytest.raises(ApiException) as gone:
        workloads()
    assert gone.value.status == 404 and workloads.version is None  # asked again next time
    assert len(workloads()["items"]) == 1 and workloads.version == "v1beta2"


def test_a_quota_waiting_workload_counts_for_its_queues_flavor(
    fake: FakeKube, kueue_cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A Workload waiting for quota, its template selecting no node: LocalQueue ml/team-a
    -> ClusterQueue gpus -> a100-flavor makes it a100's pending demand, in the collector
    and in the live loop. One whose LocalQueue is unknown counts in the pool its template
    selects, and why is logged once, not at every sample, until it goes away."""
    fake.create("localqueues", local_queue("team-a", "gpus"))
    fake.create(
        "clusterqueues",
        cluster_queue("gpus", (GPU_GROUP, [("a100-flavor", ["96", "1Ti", "16"])])),
    )
    fake.create("workloads", workload("train", [("workers", 2, template(8))]))
    lost = workload("lost", [("main", 1, template(4, selector={POOL: "h100"}))], queue="nowhere")
    fake.create("workloads", lost)
    source = KubernetesSource(kueue_cluster)
    try:
        with caplog.at_level(logging.WARNING, logger="predictor.telemetry.kubernetes"):
            got = demand_of(source)
            assert got["queued"] == {"a100": 16.0, "h100": 4.0}
            assert got["pending"] == {"a100": 16.0, "h100": 4.0}
            for _ in range(2):
                assert demand_of(source)["queued"] == got["queued"]
            said = [r.getMessage() for r in caplog.records]
            assert said == [
                "Kueue Workload ml/lost: LocalQueue ml/nowhere not found; its pods count in"
                " the pool their template selects (h100)"
            ]
            # The queue is made: the problem is gone and nothing more is said.
            fake.create(
                "clusterqueues",
                cluster_queue("h100s", (GPU_GROUP, [("h100-flavor", ["96", "1Ti", "8"])])),
            )
            fake.create("localqueues", local_queue("nowhere", "h100s"))
            assert demand_of(source)["queued"] == {"a100": 16.0, "h100": 4.0}
            assert len(caplog.records) == 1
    finally:
        source.close()
    assert fake.list_requests("localqueues") >= 1 and fake.list_requests("clusterqueues") >= 1
    with api_client(kueue_cluster) as api:
        observed = with_queue(observe_cluster)(api, KUBE_NAMES)
    assert observed.queued_gpus == {"a100": 16.0, "h100": 4.0}
    assert observed.queued_pools["ml/train/workers-1"] == "a100"


def test_a_workload_whose_admission_is_gated_is_not_demand_until_the_gate_is_removed(
    fake: FakeKube, kueue_cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Kueue queues no Workload that carries a non-empty kueue.x-k8s.io/admission-gated-by
    annotation (workload.IsAdmissible): it is left out, why is logged once, and once its
    controllers remove the gate it counts as any waiting Workload; an empty value gates
    nothing."""
    gate = "kueue.x-k8s.io/admission-gated-by"
    gated = workload("gated", [("workers", 2, template(8))])
    gated["metadata"]["annotations"] = {gate: "example.com/quota-broker,example.com/check"}
    empty = workload("empty", [("main", 1, template(4))])
    empty["metadata"]["annotations"] = {gate: ""}
    fake.create("localqueues", local_queue("team-a", "gpus"))
    fake.create(
        "clusterqueues",
        cluster_queue("gpus", (GPU_GROUP, [("a100-flavor", ["96", "1Ti", "32"])])),
    )
    fake.create("workloads", gated)
    fake.create("workloads", empty)
    source = KubernetesSource(kueue_cluster)
    try:
        with caplog.at_level(logging.WARNING, logger="predictor.telemetry.kubernetes"):
            for _ in range(2):
                assert demand_of(source)["queued"] == {"a100": 4.0}
            assert [r.getMessage() for r in caplog.records] == [
                "Kueue Workload ml/gated: admission gated by"
                " example.com/quota-broker,example.com/check"
                f" ({gate}); not counted as demand until the gate is removed"
            ]
            with api_client(kueue_cluster) as api:
                assert with_queue(observe_cluster)(api, KUBE_NAMES).queued_gpus == {"a100": 4.0}
            fake.patch("workloads", "gated", {"metadata": {"annotations": {gate: None}}}, "ml")
            assert demand_of(source)["queued"] == {"a100": 20.0}
            assert len(caplog.records) == 1
    finally:
        source.close()


def test_the_collector_watches_the_queue(fake: FakeKube, kueue_cluster) -> None:
    source = KubernetesSource(kueue_cluster)
    source.start()

    def queued() -> dict[str, float]:
        try:
            return demand_of(source)["queued"]
        except SourceError:
            return {}

    def wait(want: dict[str, float]) -> None:
        deadline = time.monotonic() + 10
        while queued() != want:
            assert time.monotonic() < deadline, f"queued {queued()}, wanted {want}"
            time.sleep(0.05)

    try:
        wait({"a100": 0.0})
        listed = fake.list_requests("workloads")
        fake.create("workloads", workload("a", [("main", 1, template(4, selector={POOL: "h100"}))]))
        wait({"a100": 0.0, "h100": 4.0})
        fake.create(
            "resourceflavors", {"metadata": {"name": "b"}, "spec": {"nodeLabels": {POOL: "b200"}}}
        )
        fake.create("workloads", workload("b", [("main", 2, template(8))], flavor="b"))
        wait({"a100": 0.0, "h100": 4.0, "b200": 16.0})
        fake.patch("workloads", "a", {"spec": {"active": False}}, "ml")  # deactivated
        wait({"a100": 0.0, "b200": 16.0})
        # A Workload waiting for quota, then its queue made: LocalQueue and ClusterQueue
        # are watched too.
        fake.create("workloads", workload("c", [("main", 1, template(8))], queue="team-c"))
        wait({"a100": 0.0, "b200": 16.0, UNPOOLED: 8.0})
        fake.create("clusterqueues", cluster_queue("c", (GPU_GROUP, [("b", ["96", "1Ti", "64"])])))
        fake.create("localqueues", local_queue("team-c", "c"))
        wait({"a100": 0.0, "b200": 24.0})
        assert fake.list_requests("workloads") == listed  # watched, not polled
        for plural in ("workloads", "resourceflavors", "localqueues", "clusterqueues"):
            assert fake.watch_requests(plural) >= 1, plural
    finally:
        source.close()


def test_a_pending_mig_workload_counts_in_gpu_equivalents(fake: FakeKube, kueue_cluster) -> None:
    """A Workload of 2 pods x one `3g.40gb` instance waits for quota on the a100 flavor:
    the collector's pending demand and the live loop's queued GPUs both grow by 6/7 of a
    GPU (each 3g holds 3 of a GPU's 7 compute slices), as the two pods would count."""
    mig = workload("tune", [("workers", 2, mig_template("3g.40gb", 1))])
    mig["status"]["conditions"] = [{"type": "QuotaReserved", "status": "True", "reason": "R"}]
    mig["status"]["admission"] = {
        "clusterQueue": "gpus",
        "podSetAssignments": [{"name": "workers", "flavors": {"nvidia.com/mig-3g.40gb":
                                                              "a100-flavor"}, "count": 2}],
    }  # fmt: skip
    fake.create("workloads", mig)
    source = KubernetesSource(kueue_cluster)
    try:
        got = demand_of(source)
    finally:
        source.close()
    assert got["queued"] == pytest.approx({"a100": 6 / 7})
    assert got["pending"] == pytest.approx({"a100": 6 / 7})
    assert got["gpu_demand"] == pytest.approx({"a100": 8 + 6 / 7})
    with api_client(kueue_cluster) as api:
        observed = with_queue(observe_cluster)(api, KUBE_NAMES)
    assert observed.queued_gpus == pytest.approx({"a100": 6 / 7})
    assert [(j.id, j.mig_profile, j.mig_count) for j in observed.queued] == [
        ("ml/tune/workers-0", "3g.40gb", 1),
        ("ml/tune/workers-1", "3g.40gb", 1),
    ]


# ---- the live loop ------------------------------------------------------------------------


def queued_pool(tmp_path: Path, fake: FakeKube) -> LiveConfig:
    """One simulated a100 node, Kueue read, and six minutes of one node's worth of demand
    in the store."""
    cfg = LiveConfig(
        state_dir=tmp_path / "state",
        pools=[pool("a100")],
        provider={"kind": "simulated", "simulated": {"initial_sizes": {"a100": 1}}},
        kubernetes={"host": fake.url, "pre_position": "none", "kueue": True},
        model={"name": "persistence"},
        policy=fast_policy(60.0),
        lease={"enabled": False},
    )
    ds = pd.date_range(end=NOW, periods=6, freq="60s")
    TelemetryStore(cfg.state_dir).append(pd.DataFrame({"unique_id": "a100", "ds": ds, "y": 8.0}))
    return cfg


def test_a_pending_workload_scales_the_live_loop_up_before_any_pod_exists(
    tmp_path: Path, fake: FakeKube
) -> None:
    """The forecast sees one node's worth; a Workload of 2 x 8 GPUs waits on the a100
    flavor with no pod yet: its gang needs two more nodes, the loop adds them. Once
    admitted, its pods run there and are counted once: no more nodes."""
    cfg = queued_pool(tmp_path, fake)
    loop = Reconciler(LiveSystem.build(cfg), clock=lambda: NOW)
    (group,) = loop.system.provider.node_groups()
    (first,) = [n.name for n in group.nodes()]
    fake.create("nodes", node(first, "a100", provider_id=f"sim:///{first}"))
    fake.create("pods", running_pod("serve", first, 8))
    for flavor in FLAVORS:
        fake.create("resourceflavors", flavor)
    assert loop.iterate(apply=False).decision.desired == {"a100": 1}

    fake.create("workloads", workload("train", [("workers", 2, template(8))], flavor="a100-flavor"))
    assert [p for p in fake.objects("pods") if p["metadata"]["name"].startswith("train")] == []
    outcome = loop.iterate(apply=True)
    d = outcome.decision
    assert d.plan.desired == {"a100": 1}  # the forecast alone would not grow
    assert d.reactive is not None and (d.reactive.pending, d.reactive.queued) == (0, 2)
    assert d.fleet.cluster is not None and d.fleet.cluster.queued_gpus == {"a100": 16.0}
    assert d.fleet.used_gpus == {"a100": 24.0}
    assert d.reactive.floor == {"a100": 3} and d.desired == {"a100": 3}
    assert [(a["action"], a["result"]) for a in outcome.actions] == [
        ("set_target", "target 1 -> 3")
    ]

    # Kueue admits it; its pods start on the two new nodes: counted once, as pods.
    new = sorted(n.name for n in group.nodes() if n.name != first)
    for name in new:
        fake.create("nodes", node(name, "a100", provider_id=f"sim:///{name}"))
    admit_and_run(fake, "train", new)
    after = loop.iterate(apply=True)
    d = after.decision
    assert d.reactive is not None and (d.reactive.pending, d.reactive.queued) == (0, 0)
    assert d.fleet.used_gpus == {"a100": 24.0}
    assert after.actions == [] and group.target_size() == 3


def test_the_loop_reads_the_queue_from_the_watched_cache(tmp_path: Path, fake: FakeKube) -> None:
    """`gpuscale scale` reads Kueue's kinds from the process's watched cluster cache: its
    first pass lists each once, later passes list none of them and still see a Workload
    and a ResourceFlavor made between two passes (the watch delivered them); a watch that
    answers 410 Gone lists again and the pass sees what changed meanwhile."""
    from scaler.cli.live import _watched
    from scaler.kube.watched import forget_watched

    cfg = queued_pool(tmp_path, fake)
    fake.create("nodes", node("a100-1", "a100"))
    for flavor in FLAVORS:
        fake.create("resourceflavors", flavor)
    system = LiveSystem.build(cfg)
    watched = _watched(system)
    assert watched is not None
    try:
        loop = Reconciler(system, observe=watched, clock=lambda: NOW)

        def queued() -> dict[str | None, float]:
            cluster = loop.decide().fleet.cluster
            assert cluster is not None
            return cluster.queued_gpus

        assert queued() == {}
        lists = {plural: fake.list_requests(plural) for plural in QUEUE_KINDS}
        assert lists["workloads"] == 1 and all(lists.values()), lists
        assert queued() == {}
        fake.create(
            "workloads", workload("train", [("workers", 2, template(8))], flavor="a100-flavor")
        )

        def wait(want: dict[str | None, float]) -> None:
            deadline = time.monotonic() + 10
            while queued() != want:
                assert time.monotonic() < deadline, queued()
                time.sleep(0.05)

        wait({"a100": 16.0})
        fake.create(
            "resourceflavors", {"metadata": {"name": "b"}, "spec": {"nodeLabels": {POOL: "b200"}}}
        )
        fake.create("workloads", workload("b", [("main", 1, template(8))], flavor="b"))
        wait({"a100": 16.0, "b200": 8.0})
        assert {plural: fake.list_requests(plural) for plural in QUEUE_KINDS} == lists
        for plural in QUEUE_KINDS:
            assert fake.watch_requests(plural) >= 1, plural

        fake.expire_watches()  # every version handed out is too old: 410 Gone
        fake.delete("workloads", "b", "ml")
        wait({"a100": 16.0})
        assert fake.list_requests("workloads") > lists["workloads"]
    finally:
        forget_watched(watched)
        system.close()
