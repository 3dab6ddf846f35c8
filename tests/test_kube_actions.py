"""Kubernetes actions through the real client against the fake API server: cordon, drain
with PodDisruptionBudgets, the removal flow down to the provider, and placeholder pods
reconciled idempotently across a restart."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
from fake_kube import FakeKube
from kubernetes import client as k8s

from predictor.telemetry.kube_objects import KUBE_NAMES
from scaler.cluster.pools import NodePool
from scaler.kube.drainability import DrainRules
from scaler.kube.errors import KubeError
from scaler.kube.nodes import (
    DrainSettings,
    NodeRemoval,
    RemovalStatus,
)
from scaler.kube.placeholders import (
    PLACEHOLDER_SELECTOR,
    SPEC_HASH,
    PlaceholderDemand,
    Placeholders,
    PlaceholderSettings,
    placeholder_name,
)
from scaler.providers.simulated import SimulatedCloud

FAST = DrainSettings(timeout_s=0.3, poll_s=0.02)
SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"
POOL = NodePool(
    name="a100",
    gpu_model="A100",
    gpus_per_node=8,
    price_per_hour=32.0,
    boot_seconds=60,
    min_size=1,
    max_size=6,
)


def client_for(fake: FakeKube) -> k8s.ApiClient:
    """The real client, configured as for any API server."""
    return k8s.ApiClient(k8s.Configuration(host=fake.url))


@dataclass
class Cluster:
    fake: FakeKube
    cloud: SimulatedCloud
    nodes: dict[str, str]  # Kubernetes node name -> the cloud's node name

    def removal(self, settings: DrainSettings = FAST) -> NodeRemoval:
        return NodeRemoval(client_for(self.fake), self.cloud, settings)

    def pods(self, node: str | None = None) -> list[str]:
        return sorted(
            p["metadata"]["name"]
            for p in self.fake.objects("pods")
            if node is None or p["spec"].get("nodeName") == node
        )


def pod(
    name: str,
    node: str | None,
    *,
    namespace: str = "ml",
    owner: str | None = "ReplicaSet",
    **extra: Any,
) -> dict:
    """A pod its `owner` controls (None: a bare pod, nothing recreates it)."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    meta.update({k: v for k, v in extra.items() if k in ("labels", "annotations")})
    if owner is not None:
        meta["ownerReferences"] = [
            {"kind": owner, "name": "x", "apiVersion": "v1", "uid": "u", "controller": True}
        ]
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "busybox"}]}
    if node is not None:
        spec["nodeName"] = node
    if "volumes" in extra:
        spec["volumes"] = extra["volumes"]
    return {"metadata": meta, "spec": spec, "status": {"phase": extra.get("phase", "Running")}}


def budget(name: str, app: str, min_available: int | str, namespace: str = "ml") -> dict:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"minAvailable": min_available, "selector": {"matchLabels": {"app": app}}},
    }


@pytest.fixture
def cluster(fake: FakeKube) -> Cluster:
    """Three ready nodes of pool a100; Kubernetes knows them by name and providerID."""
    cloud = SimulatedCloud([POOL])
    (group,) = cloud.node_groups()
    group.increase_size(3)
    cloud.advance(61)
    nodes = {}
    for i, cloud_node in enumerate(sorted(n.name for n in group.nodes())):
        name = f"ip-10-0-0-{i}.ec2.internal"
        nodes[name] = cloud_node
        fake.create(
            "nodes",
            {
                "metadata": {"name": name, "labels": {"gpuscale.io/pool": "a100"}},
                "spec": {"providerID": f"aws:///us-east-1a/{cloud_node}"},
            },
        )
    return Cluster(fake, cloud, nodes)


def evictions(fake: FakeKube) -> list[str]:
    return [path.split("/")[-2] for method, path in fake.requests if path.endswith("/eviction")]


def test_cordon_is_idempotent_and_marks_who_did_it(cluster: Cluster) -> None:
    node = next(iter(cluster.nodes))
    removal = cluster.removal()
    removal.cordon(node)
    first = cluster.fake.get("nodes", node)
    patches = sum(method == "PATCH" for method, _ in cluster.fake.requests)
    removal.cordon(node)
    again = cluster.fake.get("nodes", node)
    assert first["spec"]["unschedulable"] is True
    assert again["metadata"]["annotations"] == first["metadata"]["annotations"]
    assert sum(method == "PATCH" for method, _ in cluster.fake.requests) == patches
    removal.uncordon(node)
    cleared = cluster.fake.get("nodes", node)
    assert not cleared["spec"].get("unschedulable")
    assert KUBE_NAMES.removal_annotation not in (cleared["metadata"].get("annotations") or {})


def test_a_node_someone_else_cordoned_is_never_taken_over(cluster: Cluster) -> None:
    """An operator's `kubectl cordon` (maintenance): gpuscale does not mark the node its
    own, so its uncordon leaves it cordoned, and a removal refuses it untouched."""
    node = next(iter(cluster.nodes))
    cluster.fake.patch("nodes", node, {"spec": {"unschedulable": True}})
    cluster.fake.create("pods", pod("batch-1", node))
    removal = cluster.removal()
    assert removal.cordon(node) is False
    removal.uncordon(node)
    after = cluster.fake.get("nodes", node)
    assert after["spec"]["unschedulable"] is True
    assert KUBE_NAMES.removal_annotation not in (after["metadata"].get("annotations") or {})

    outcome = removal.remove(node)
    assert outcome.status is RemovalStatus.REFUSED and "someone else" in outcome.reason
    assert evictions(cluster.fake) == [] and cluster.pods(node) == ["batch-1"]
    (group,) = cluster.cloud.node_groups()
    assert group.target_size() == 3
    assert cluster.fake.get("nodes", node)["spec"]["unschedulable"] is True


def writes_after_each_read(removal: NodeRemoval, write: Callable[[], None]) -> None:
    """Another writer changes the node right after every read gpuscale makes of it, before
    gpuscale writes: the race a cordon must not lose."""
    core = removal._core
    read = core.read_node

    def read_then_write(name: str, **kw: Any) -> Any:
        found = read(name, **kw)
        write()
        return found

    core.read_node = read_then_write  # type: ignore[method-assign]


def test_a_cordon_made_by_someone_else_between_read_and_write_stays_theirs(
    cluster: Cluster,
) -> None:
    """An operator cordons the node just after gpuscale read it as schedulable: the cordon
    patch carries the version read, so the API server refuses it (409) and gpuscale, having
    read the node again, leaves the cordon to its owner: not marked, never uncordoned."""
    node = next(iter(cluster.nodes))
    removal = cluster.removal()
    writes_after_each_read(
        removal, lambda: cluster.fake.patch("nodes", node, {"spec": {"unschedulable": True}})
    )
    assert removal.cordon(node) is False
    removal.uncordon(node)
    after = cluster.fake.get("nodes", node)
    assert after["spec"]["unschedulable"] is True
    assert KUBE_NAMES.removal_annotation not in (after["metadata"].get("annotations") or {})


def test_a_cordon_retries_once_past_an_unrelated_write_then_gives_up(cluster: Cluster) -> None:
    node, other = list(cluster.nodes)[:2]

    def relabel(name: str, times: int) -> Callable[[], None]:
        """Someone relabels the node, the first `times` times gpuscale reads it."""
        done = []

        def write() -> None:
            if len(done) < times:
                done.append(name)
                labels = {"relabelled": str(len(done))}
                cluster.fake.patch("nodes", name, {"metadata": {"labels": labels}})

        return write

    # One write by someone else between read and patch: read again, and cordoned then.
    removal = cluster.removal()
    writes_after_each_read(removal, relabel(node, times=1))
    assert removal.cordon(node) is True
    after = cluster.fake.get("nodes", node)
    assert after["spec"]["unschedulable"] is True
    assert KUBE_NAMES.removal_annotation in after["metadata"]["annotations"]
    assert after["metadata"]["labels"]["relabelled"] == "1"  # their write stands

    # A node that changes after every read: refused after the second try, left as it was.
    again = cluster.removal()
    writes_after_each_read(again, relabel(other, times=10))
    with pytest.raises(KubeError, match="409"):
        again.cordon(other)
    assert not cluster.fake.get("nodes", other)["spec"].get("unschedulable")


def test_removal_drains_placeholders_first_then_the_provider_deletes_that_node(
    cluster: Cluster,
) -> None:
    node, other = list(cluster.nodes)[:2]
    placeholder_labels = {
        "app.kubernetes.io/managed-by": "gpuscale",
        "app.kubernetes.io/component": "placeholder",
    }
    for obj in (
        pod("train-1", node, labels={"app": "train"}),
        pod("zz-placeholder", node, namespace="gpuscale-system", labels=placeholder_labels),
        pod("logger", node, owner="DaemonSet"),
        pod(
            "kube-proxy",
            node,
            namespace="kube-system",
            annotations={"kubernetes.io/config.mirror": "x"},
        ),
        pod("done", node, phase="Succeeded"),
        pod("elsewhere", other),
    ):
        cluster.fake.create("pods", obj)
    (group,) = cluster.cloud.node_groups()

    outcome = cluster.removal().remove(node)

    assert outcome.status is RemovalStatus.REMOVED, outcome.reason
    assert outcome.cloud_node == cluster.nodes[node]
    assert evictions(cluster.fake) == ["zz-placeholder", "train-1"]
    assert cluster.pods(node) == ["done", "kube-proxy", "logger"]  # they go with the node
    assert cluster.pods(other) == ["elsewhere"]
    assert group.target_size() == 2
    assert cluster.nodes[node] not in {n.name for n in group.nodes()}
    assert cluster.fake.get("nodes", node)["spec"]["unschedulable"] is True


def test_a_pod_guarded_by_a_disruption_budget_blocks_removal_until_it_can_go(
    cluster: Cluster,
) -> None:
    node, other = list(cluster.nodes)[:2]
    cluster.fake.create("poddisruptionbudgets", budget("serve-pdb", "serve", 1))
    cluster.fake.create("pods", pod("serve-1", node, labels={"app": "serve"}))
    cluster.fake.create("pods", pod("batch-1", node, labels={"app": "batch"}))
    (group,) = cluster.cloud.node_groups()

    outcome = cluster.removal().remove(node)

    assert outcome.status is RemovalStatus.BLOCKED
    (blocking,) = outcome.blocking
    assert (blocking.namespace, blocking.name, blocking.budget) == ("ml", "serve-1", "serve-pdb")
    assert "disruption budget" in blocking.reason
    assert cluster.pods(node) == ["serve-1"]  # the unguarded pod was evicted
    assert cluster.fake.get("nodes", node)["spec"]["unschedulable"] is True  # left cordoned
    assert group.target_size() == 3 and len(group.nodes()) == 3  # the provider was not asked
    assert evictions(cluster.fake).count("serve-1") >= 2  # retried until the timeout

    # A second replica becomes healthy elsewhere: the budget allows one eviction now, and
    # the removal resumes where it stopped.
    cluster.fake.create("pods", pod("serve-2", other, labels={"app": "serve"}))
    resumed = cluster.removal().remove(node)
    assert resumed.status is RemovalStatus.REMOVED, resumed.reason
    assert cluster.pods(node) == [] and group.target_size() == 2


class PassClock:
    """A drain's clock that moves only when the drain waits."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits = 0

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.waits += 1


def test_a_pass_drains_its_nodes_together(cluster: Cluster) -> None:
    """Two nodes whose serving pods a budget holds back and a third whose pod may go: the
    third is deleted once its pod has left (the next round), the held ones both wait out
    one timeout together (10 polls of 1 s, not 10 per node), each reported as it ends.
    When the budget lets one pod go, its node is deleted while the other still waits."""
    a, b, c = cluster.nodes
    cluster.fake.create("poddisruptionbudgets", budget("serve-pdb", "serve", 2))
    for name, node in (("serve-1", a), ("serve-2", b)):
        cluster.fake.create("pods", pod(name, node, labels={"app": "serve"}))
    cluster.fake.create("pods", pod("batch-1", c))
    clock = PassClock()
    removal = NodeRemoval(
        client_for(cluster.fake),
        cluster.cloud,
        DrainSettings(timeout_s=10, poll_s=1),
        clock=lambda: clock.now,
        sleep=clock.sleep,
    )
    (group,) = cluster.cloud.node_groups()
    group.increase_size(1)  # min size 1: room to take three out
    cluster.cloud.advance(61)
    assert all(removal.prepare(n) is None for n in (a, b, c))

    ended = [
        (n, o.status, clock.now) for n, o in removal.finish_all([(a, None), (b, None), (c, None)])
    ]
    assert ended == [
        (c, RemovalStatus.REMOVED, 1.0),  # evicted, then found empty
        (a, RemovalStatus.BLOCKED, 10.0),
        (b, RemovalStatus.BLOCKED, 10.0),
    ]
    assert clock.waits == 10

    cluster.fake.delete("poddisruptionbudgets", "serve-pdb", "ml")
    cluster.fake.create("poddisruptionbudgets", budget("serve-pdb", "serve", 1))
    clock.waits = 0
    ended = [(n, o.status) for n, o in removal.finish_all([(a, None), (b, None)])]
    assert ended == [(a, RemovalStatus.REMOVED), (b, RemovalStatus.BLOCKED)]
    assert clock.waits == 10 and cluster.pods(a) == [] and cluster.pods(b) == ["serve-2"]


def test_budgets_by_max_unavailable_and_overlapping_budgets(cluster: Cluster) -> None:
    node, other = list(cluster.nodes)[:2]
    cluster.fake.create(
        "poddisruptionbudgets",
        {
            "metadata": {"name": "web-pdb", "namespace": "ml"},
            "spec": {"maxUnavailable": "50%", "selector": {"matchLabels": {"app": "web"}}},
        },
    )
    cluster.fake.create("pods", pod("web-1", node, labels={"app": "web"}))
    cluster.fake.create("pods", pod("web-2", other, labels={"app": "web"}))
    cluster.fake.create("pods", pod("web-3", None, labels={"app": "web"}, phase="Pending"))
    # 3 covered, 50% may be unavailable (rounds up: 2), so 1 must stay healthy: 2 are.
    assert cluster.removal().remove(node).status is RemovalStatus.REMOVED

    cluster.fake.create("poddisruptionbudgets", budget("a-pdb", "db", 1))
    cluster.fake.create("poddisruptionbudgets", budget("b-pdb", "db", 0))
    cluster.fake.create("pods", pod("db-1", other, labels={"app": "db"}))
    drain = cluster.removal(DrainSettings(timeout_s=0.05, poll_s=0.01)).remove(other)
    assert drain.status is RemovalStatus.BLOCKED
    blocking = {b.name: b for b in drain.blocking}
    assert sorted(blocking) == ["db-1", "web-2"]
    assert blocking["db-1"].budget == "a-pdb, b-pdb"
    assert "more than one PodDisruptionBudget" in blocking["db-1"].reason
    # web-1 is gone: of the 2 covered, 1 may be unavailable, and web-3 already is.
    assert blocking["web-2"].budget == "web-pdb"


@pytest.mark.parametrize(
    ("owner", "annotations", "why"),
    [
        ("ReplicaSet", {SAFE_TO_EVICT: "false"}, f'annotated {SAFE_TO_EVICT}: "false"'),
        (None, {}, "no controller to recreate it"),
    ],
)
def test_a_pod_no_drain_may_take_blocks_before_anything_is_evicted(
    cluster: Cluster, owner: str | None, annotations: dict[str, str], why: str
) -> None:
    """A pod marked not safe to evict, or a bare one (evicted, it is lost for good), keeps
    its node as in Cluster Autoscaler: the drain stops at once, the pods beside it keep
    running, and the provider is not asked."""
    node = next(iter(cluster.nodes))
    cluster.fake.create("pods", pod("notebook", node, owner=owner, annotations=annotations))
    cluster.fake.create("pods", pod("batch-1", node))
    (group,) = cluster.cloud.node_groups()
    outcome = cluster.removal().remove(node)
    assert outcome.status is RemovalStatus.BLOCKED
    (blocking,) = outcome.blocking
    assert blocking.name == "notebook" and why in blocking.reason
    assert evictions(cluster.fake) == []
    assert cluster.pods(node) == ["batch-1", "notebook"]
    assert group.target_size() == 3


def test_a_bare_pod_its_owner_lets_go_is_evicted(cluster: Cluster) -> None:
    node = next(iter(cluster.nodes))
    scratch = pod("scratch", node, owner=None, annotations={SAFE_TO_EVICT: "true"})
    cluster.fake.create("pods", scratch)
    assert cluster.removal().remove(node).status is RemovalStatus.REMOVED
    assert evictions(cluster.fake) == ["scratch"]


def test_a_kube_system_pod_no_budget_covers_keeps_its_node(cluster: Cluster) -> None:
    """Cluster Autoscaler's --skip-nodes-with-system-pods: a kube-system pod that is no
    DaemonSet or mirror pod moves only under a PodDisruptionBudget of kube-system (one
    elsewhere selecting the same labels does not count)."""
    node = next(iter(cluster.nodes))
    system = {"namespace": "kube-system", "labels": {"app": "metrics"}}
    cluster.fake.create("pods", pod("metrics-server", node, **system))
    cluster.fake.create("pods", pod("aws-node", node, owner="DaemonSet", **system))
    cluster.fake.create("pods", pod("batch-1", node))
    cluster.fake.create("poddisruptionbudgets", budget("metrics-pdb", "metrics", 0))

    outcome = cluster.removal().remove(node)
    assert outcome.status is RemovalStatus.BLOCKED
    (blocking,) = outcome.blocking
    assert (blocking.namespace, blocking.name) == ("kube-system", "metrics-server")
    assert blocking.reason == (
        "pod kube-system/metrics-server is a kube-system pod no PodDisruptionBudget covers"
    )
    assert evictions(cluster.fake) == []

    cluster.fake.create(
        "poddisruptionbudgets", budget("metrics-pdb", "metrics", 0, namespace="kube-system")
    )
    assert cluster.removal().remove(node).status is RemovalStatus.REMOVED
    assert evictions(cluster.fake) == ["metrics-server", "batch-1"]
    assert cluster.pods(node) == ["aws-node"]  # goes with the node


EMPTY_DIR = {"name": "scratch", "emptyDir": {}}
HOST_PATH = {"name": "models", "hostPath": {"path": "/mnt/nvme/models"}}
SHM = {"name": "shm", "emptyDir": {"medium": "Memory"}}
CONFIG = {"name": "config", "configMap": {"name": "train-config"}}
LOCAL_VOLUMES = "cluster-autoscaler.kubernetes.io/safe-to-evict-local-volumes"


@pytest.mark.parametrize(
    ("volumes", "annotations", "kept"),
    [
        ([EMPTY_DIR, SHM, CONFIG], {}, "scratch"),
        ([SHM, HOST_PATH], {}, "models"),
        ([EMPTY_DIR, HOST_PATH], {LOCAL_VOLUMES: "scratch"}, "models"),
        ([EMPTY_DIR, HOST_PATH], {LOCAL_VOLUMES: "scratch, models"}, "models"),  # as written
        ([EMPTY_DIR, HOST_PATH], {LOCAL_VOLUMES: "scratch,models"}, None),
        ([EMPTY_DIR, HOST_PATH], {SAFE_TO_EVICT: "true"}, None),
        ([SHM, CONFIG], {}, None),
    ],
)
def test_a_pod_with_local_storage_keeps_its_node_unless_let_go(
    cluster: Cluster, volumes: list[dict], annotations: dict[str, str], kept: str | None
) -> None:
    """Cluster Autoscaler's --skip-nodes-with-local-storage: a hostPath or an emptyDir not
    in memory is lost with the pod, so the pod keeps its node unless annotated safe to
    evict or its safe-to-evict-local-volumes annotation names every such volume."""
    node = next(iter(cluster.nodes))
    cluster.fake.create("pods", pod("train", node, volumes=volumes, annotations=annotations))
    outcome = cluster.removal().remove(node)
    if kept is None:
        assert outcome.status is RemovalStatus.REMOVED, outcome.reason
        assert evictions(cluster.fake) == ["train"]
        return
    assert outcome.status is RemovalStatus.BLOCKED
    (blocking,) = outcome.blocking
    assert blocking.reason == (
        f"pod ml/train has local storage ({kept}) not named in {LOCAL_VOLUMES}"
    )
    assert evictions(cluster.fake) == [] and cluster.pods(node) == ["train"]


def test_the_system_pod_and_local_storage_rules_can_be_turned_off(cluster: Cluster) -> None:
    node = next(iter(cluster.nodes))
    cluster.fake.create("pods", pod("coredns", node, namespace="kube-system"))
    cluster.fake.create("pods", pod("train", node, volumes=[EMPTY_DIR, HOST_PATH]))
    neither = DrainRules(system_pods=False, local_storage=False)
    outcome = cluster.removal(replace(FAST, rules=neither)).remove(node)
    assert outcome.status is RemovalStatus.REMOVED, outcome.reason
    assert evictions(cluster.fake) == ["coredns", "train"]


def test_removal_resumes_after_a_crash_past_the_provider(cluster: Cluster) -> None:
    node = next(iter(cluster.nodes))
    removal = cluster.removal()
    removal.cordon(node)
    (group,) = cluster.cloud.node_groups()
    group.delete_nodes([cluster.nodes[node]])  # the crash came after this
    outcome = cluster.removal().remove(node)
    assert outcome.status is RemovalStatus.REMOVED
    assert group.target_size() == 2


def test_nodes_outside_any_group_or_at_min_size_are_not_touched(cluster: Cluster) -> None:
    cluster.fake.create("nodes", {"metadata": {"name": "control-plane"}, "spec": {}})
    outcome = cluster.removal().remove("control-plane")
    assert outcome.status is RemovalStatus.REFUSED
    assert not cluster.fake.get("nodes", "control-plane")["spec"].get("unschedulable")

    names = list(cluster.nodes)
    removal = cluster.removal()
    assert [removal.remove(n).status for n in names[:2]] == [RemovalStatus.REMOVED] * 2
    last = removal.remove(names[2])
    assert last.status is RemovalStatus.REFUSED and "min size 1" in last.reason
    assert not cluster.fake.get("nodes", names[2])["spec"].get("unschedulable")

    assert cluster.removal().remove("no-such-node").status is RemovalStatus.REMOVED


# ---- placeholders -------------------------------------------------------------------------
SETTINGS = PlaceholderSettings(namespace="gpuscale-system")


def placeholder_pods(fake: FakeKube) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in fake.objects("pods", "gpuscale-system")}


def test_placeholders_are_created_with_low_priority_and_gpu_requests(fake: FakeKube) -> None:
    changes = Placeholders(client_for(fake), SETTINGS).reconcile(
        [
            PlaceholderDemand(pool="a100", count=2, gpus=8),
            PlaceholderDemand(pool="h100", count=1, gpus=4),
        ]
    )
    assert changes.created == (
        "gpuscale-placeholder-a100-0",
        "gpuscale-placeholder-a100-1",
        "gpuscale-placeholder-h100-0",
    )
    (priority,) = fake.objects("priorityclasses")
    assert priority["metadata"]["name"] == "gpuscale-placeholder"
    assert priority["value"] == -10 and priority["preemptionPolicy"] == "Never"
    made = placeholder_pods(fake)["gpuscale-placeholder-h100-0"]
    assert made["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "gpuscale"
    assert made["spec"]["priorityClassName"] == "gpuscale-placeholder"
    assert made["spec"]["nodeSelector"] == {"gpuscale.io/pool": "h100"}
    (container,) = made["spec"]["containers"]
    assert container["image"].startswith("registry.k8s.io/pause")
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"


def test_placeholders_reconcile_idempotently_across_a_restart(fake: FakeKube) -> None:
    desired = [PlaceholderDemand(pool="a100", count=3, gpus=8)]
    Placeholders(client_for(fake), SETTINGS).reconcile(desired)
    before = placeholder_pods(fake)
    writes = sum(m != "GET" for m, _ in fake.requests)

    restarted = Placeholders(client_for(fake), SETTINGS)  # a new process, a new client
    assert restarted.reconcile(desired).empty
    assert restarted.reconcile(desired).empty
    assert sum(m != "GET" for m, _ in fake.requests) == writes  # nothing written at all
    after = placeholder_pods(fake)
    assert {n: p["metadata"]["uid"] for n, p in after.items()} == {
        n: p["metadata"]["uid"] for n, p in before.items()
    }


def test_placeholders_follow_the_spec_preemption_resize_and_shrink(fake: FakeKube) -> None:
    placeholders = Placeholders(client_for(fake), SETTINGS)
    placeholders.reconcile([PlaceholderDemand(pool="a100", count=3, gpus=8)])

    # A real job preempted one, and the kubelet failed another: both come back, same names.
    fake.delete("pods", placeholder_name("a100", 1), "gpuscale-system")
    fake.patch(
        "pods", placeholder_name("a100", 2), {"status": {"phase": "Failed"}}, "gpuscale-system"
    )
    changes = placeholders.reconcile([PlaceholderDemand(pool="a100", count=3, gpus=8)])
    assert changes.created == (placeholder_name("a100", 1),)
    assert changes.replaced == (placeholder_name("a100", 2),)

    # Smaller placeholders: replaced in place, same names; fewer: the highest indices go.
    changes = placeholders.reconcile([PlaceholderDemand(pool="a100", count=2, gpus=4)])
    assert changes.deleted == (placeholder_name("a100", 2),)
    assert changes.replaced == (placeholder_name("a100", 0), placeholder_name("a100", 1))
    pods = placeholder_pods(fake)
    assert sorted(pods) == [placeholder_name("a100", 0), placeholder_name("a100", 1)]
    gpus = {
        p["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] for p in pods.values()
    }
    assert gpus == {"4"}
    assert len({p["metadata"]["labels"][SPEC_HASH] for p in pods.values()}) == 1

    # A pool dropped from the spec loses its placeholders; pods gpuscale did not make stay.
    fake.create("pods", pod("someone-elses", None, namespace="gpuscale-system"))
    changes = placeholders.reconcile([])
    assert changes.deleted == (placeholder_name("a100", 0), placeholder_name("a100", 1))
    assert list(placeholder_pods(fake)) == ["someone-elses"]
    listed = [p for m, p in fake.requests if m == "GET" and "labelSelector" in p]
    assert listed and all("placeholder" in p for p in listed)
    assert PLACEHOLDER_SELECTOR.startswith("app.kubernetes.io/managed-by=gpuscale")


def test_a_placeholder_still_terminating_is_waited_for(fake: FakeKube) -> None:
    placeholders = Placeholders(client_for(fake), SETTINGS)
    placeholders.reconcile([PlaceholderDemand(pool="a100", count=1, gpus=8)])
    name = placeholder_name("a100", 0)
    fake.patch(
        "pods", name, {"metadata": {"deletionTimestamp": "2024-01-01T00:00:00Z"}}, "gpuscale-system"
    )
    changes = placeholders.reconcile([PlaceholderDemand(pool="a100", count=1, gpus=4)])
    assert changes.waiting == (name,) and not (changes.created or changes.replaced)


def test_a_pool_named_twice_or_badly_is_refused(fake: FakeKube) -> None:
    with pytest.raises(ValueError):
        PlaceholderDemand(pool="A100_bad", count=1, gpus=1)
    twice = [PlaceholderDemand(pool="a100", count=1, gpus=8)] * 2
    with pytest.raises(KubeError, match="twice"):
        Placeholders(client_for(fake), SETTINGS).reconcile(twice)
    assert placeholder_pods(fake) == {}


def test_a_pool_holds_placeholders_of_several_sizes_largest_first(fake: FakeKube) -> None:
    placeholders = Placeholders(client_for(fake), SETTINGS)
    desired = [
        PlaceholderDemand(pool="a100", count=2, gpus=1),
        PlaceholderDemand(pool="a100", count=1, gpus=4),
    ]
    changes = placeholders.reconcile(desired)
    assert changes.created == tuple(placeholder_name("a100", i) for i in range(3))
    gpus = {
        name: p["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"]
        for name, p in placeholder_pods(fake).items()
    }
    assert gpus == {
        placeholder_name("a100", 0): "4",
        placeholder_name("a100", 1): "1",
        placeholder_name("a100", 2): "1",
    }
    assert placeholders.reconcile(list(reversed(desired))).empty  # the order given is no matter
