"""One reading of Kubernetes pods and nodes (predictor.telemetry.kube_objects) and one
translation into the engine's jobs and nodes (scaler.kube.objects): shared GPUs, pools,
model selectors, tolerations, placeholders; the same answer from the pod's JSON, from the
client's model of it and from the service's pydantic model."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client as k8s

from predictor.telemetry.kube_objects import KUBE_NAMES, KubeNames, read_node, read_pod
from scaler.cluster.job import Job
from scaler.kube.objects import gpus_of, node_spec, parse_taint, pod_job, taint_text
from scaler.kube.placeholders import PlaceholderSettings, placeholder_pod
from scaler.service.models import KubeNode, KubePod


def shared_pod(share: str = "250", **spec: Any) -> dict:
    return {
        "metadata": {
            "name": "notebook",
            "namespace": "ml",
            "annotations": {"gpuscale.io/gpu-milli": share, "gpuscale.io/gpus": "3"},
        },
        "spec": {
            "priority": 100,
            "nodeSelector": {"gpuscale.io/pool": "t4", "nvidia.com/gpu.product": "T4"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "containers": [
                {
                    "name": "main",
                    "resources": {
                        "requests": {"cpu": "1500m", "memory": "2Gi"},
                        "limits": {"nvidia.com/gpu": "1"},
                    },
                }
            ],
            **spec,
        },
        "status": {"phase": "Pending"},
    }


GPU_TAINT = parse_taint("nvidia.com/gpu=present:NoSchedule")
OTHER_TAINT = parse_taint("dedicated=infra:NoSchedule")


def test_a_pod_sharing_a_gpu_is_a_job_of_one_gpu_at_its_share() -> None:
    job = pod_job(shared_pod(), KUBE_NAMES, [GPU_TAINT, OTHER_TAINT])
    assert job == Job(
        id="ml/notebook",
        cpu_milli=1500,
        memory_mib=2048,
        num_gpu=1,
        gpu_milli=250,
        gpu_models=frozenset({"T4"}),
        priority=100,
        node_selector=(("gpuscale.io/pool", "t4"),),
        tolerations=frozenset({"nvidia.com/gpu=present:NoSchedule"}),
    )
    assert job.is_sharing and job.gpu_request_milli == 250
    request = read_pod(shared_pod())
    assert (request.gpus, request.gpu_milli, request.gpu_demand) == (1, 250, 0.25)
    assert request.wanted_pool == "t4" and not request.placeholder
    assert gpus_of(shared_pod()) == (3,)


def test_the_json_the_client_model_and_the_service_model_read_alike() -> None:
    raw = shared_pod()

    class Body:
        data = json.dumps(raw)

    api = k8s.ApiClient()
    from_client = api.sanitize_for_serialization(api.deserialize(Body(), "V1Pod"))
    from_service = KubePod.model_validate(raw)
    jobs = {pod_job(p, KUBE_NAMES, [GPU_TAINT]) for p in (raw, from_client, from_service)}
    assert len(jobs) == 1


def test_a_share_annotation_that_is_no_share_is_refused_but_read_as_a_whole_gpu() -> None:
    for bad in ("half", "0", "2000"):
        with pytest.raises(ValueError, match=f"gpuscale.io/gpu-milli must be 1..1000, got '{bad}'"):
            pod_job(shared_pod(bad))
        request = read_pod(shared_pod(bad))
        assert (request.gpu_milli, request.gpu_demand) == (1000, 1.0)
        assert request.share_problem is not None
    # Several GPUs are whole GPUs: the annotation is for a pod of one.
    four = shared_pod()
    four["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "4"
    assert (pod_job(four).num_gpu, pod_job(four).gpu_milli) == (4, 1000)


def test_required_affinity_to_one_pool_is_a_pool_selector() -> None:
    def affinity(*terms: list[str]) -> dict:
        exprs = [{"key": "gpuscale.io/pool", "operator": "In", "values": t} for t in terms]
        required = {"nodeSelectorTerms": [{"matchExpressions": [e]} for e in exprs]}
        return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}

    def pod(aff: dict) -> dict:
        made = shared_pod(affinity=aff)
        made["spec"]["nodeSelector"] = {}
        return made

    one = pod(affinity(["a100"]))
    assert pod_job(one).node_selector == (("gpuscale.io/pool", "a100"),)
    assert read_pod(one).wanted_pool == "a100"
    two = pod(affinity(["a100", "h100"]))
    assert pod_job(two).node_selector == ()  # either pool will do
    assert read_pod(two).wanted_pool == "a100"  # demand is counted once, in the first


def test_placeholders_daemonsets_and_mirror_pods_are_told_apart() -> None:
    held = read_pod(placeholder_pod(PlaceholderSettings(), "a100", 0, 8))
    assert held.placeholder and held.gpus == 8 and held.wanted_pool == "a100"
    assert pod_job(placeholder_pod(PlaceholderSettings(), "a100", 0, 8)).placeholder
    daemon = shared_pod()
    daemon["metadata"]["ownerReferences"] = [{"kind": "DaemonSet", "name": "dcgm"}]
    mirror = shared_pod()
    mirror["metadata"]["annotations"]["kubernetes.io/config.mirror"] = "x"
    assert read_pod(daemon).goes_with_node and read_pod(mirror).goes_with_node
    assert not read_pod(shared_pod()).goes_with_node
    done = shared_pod()
    done["status"]["phase"] = "Succeeded"
    assert read_pod(done).finished


def test_what_a_drain_needs_of_a_pod_is_read_with_the_rest() -> None:
    plain = read_pod(shared_pod())
    assert plain.safe_to_evict and not plain.deleting and plain.labels == ()
    guarded = shared_pod()
    guarded["metadata"]["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] = "false"
    guarded["metadata"]["labels"] = {"app": "trainer"}
    guarded["metadata"]["deletionTimestamp"] = "2025-03-01T00:00:00Z"
    read = read_pod(guarded)
    assert not read.safe_to_evict and read.deleting and read.labels == (("app", "trainer"),)
    held = read_pod(placeholder_pod(PlaceholderSettings(), "a100", 0, 8))
    assert held.safe_to_evict  # placeholders say so: nothing guards them


def test_a_node_is_its_allocatable_resources_labels_scheduling_taints_and_cordon() -> None:
    node = {
        "metadata": {
            "name": "gpu-1",
            "labels": {"gpuscale.io/pool": "a100", "nvidia.com/gpu.product": "A100"},
        },
        "spec": {
            "unschedulable": True,
            "providerID": "aws:///us-east-1a/i-0abc",
            "taints": [
                {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                {"key": "soft", "effect": "PreferNoSchedule"},
            ],
        },
        "status": {
            "allocatable": {"cpu": "95500m", "memory": "1Ti", "nvidia.com/gpu": "8"},
            "capacity": {"cpu": "96", "memory": "2Ti", "nvidia.com/gpu": "8"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    spec = node_spec(node)
    assert (spec.cpu_milli, spec.memory_mib, spec.gpus, spec.model) == (95500, 2**20, 8, "A100")
    assert spec.taints == frozenset({"nvidia.com/gpu=present:NoSchedule"})
    assert spec.cordoned and spec.label("gpuscale.io/pool") == "a100"
    assert node_spec(KubeNode.model_validate(node)) == spec
    facts = read_node(node)
    assert facts.ready and facts.pool == "a100" and facts.provider_id.endswith("i-0abc")
    assert facts.cloud_name == "i-0abc"
    assert read_node({"metadata": {"name": "kind-worker"}}).cloud_name == "kind-worker"
    assert taint_text(parse_taint("a=:NoExecute")) == "a=:NoExecute"


def test_the_names_are_configurable_in_one_place() -> None:
    names = KubeNames(gpu_resource="amd.com/gpu", pool_label="karpenter.sh/nodepool")
    pod = shared_pod()
    pod["spec"]["nodeSelector"] = {"karpenter.sh/nodepool": "mi300"}
    pod["spec"]["containers"][0]["resources"]["limits"] = {"amd.com/gpu": "2"}
    job = pod_job(pod, names)
    assert (job.num_gpu, job.node_selector) == (2, (("karpenter.sh/nodepool", "mi300"),))
    assert read_pod(pod, names).wanted_pool == "mi300"


def test_the_collector_and_the_scaler_read_the_same_names() -> None:
    """A renamed convention in the scaler's kubernetes section reaches the collector's
    reading too (the section is the collector's settings plus the bind's annotation)."""
    from predictor.telemetry.config import KubernetesSettings
    from predictor.telemetry.kubernetes import kube_names as collector_names
    from scaler.controller.config import KubernetesSection

    assert collector_names(KubernetesSettings()) == KUBE_NAMES
    renamed = {"gpu_milli_annotation": "example.com/share", "pool_label": "example.com/pool"}
    section = KubernetesSection(**renamed, gpus_annotation="example.com/gpus")
    names = section.names()
    assert names == KubeNames(**renamed, gpus_annotation="example.com/gpus")
    assert collector_names(KubernetesSettings(**renamed)) == KubeNames(**renamed)
    pod = shared_pod()
    pod["metadata"]["annotations"] = {"example.com/share": "300"}
    assert read_pod(pod, collector_names(KubernetesSettings(**renamed))).gpu_demand == 0.3


# ---- the one cluster listing ------------------------------------------------------------


def test_the_cluster_listing_is_one_snapshot_of_nodes_bound_and_pending_pods(fake) -> None:
    from scaler.kube.observed import observe_cluster

    def node(name: str, **spec: Any) -> dict:
        return {
            "metadata": {"name": name, "labels": {"gpuscale.io/pool": "a100"}},
            "spec": {"providerID": f"aws:///us-east-1a/i-{name}", **spec},
            "status": {"allocatable": {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "4"}},
        }

    def pod(name: str, node: str | None, gpus: int = 0, **meta: Any) -> dict:
        limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
        resources = {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": limits}
        spec: dict[str, Any] = {"containers": [{"name": "c", "resources": resources}]}
        if node:
            spec["nodeName"] = node
        return {"metadata": {"name": name, "namespace": "ml", **meta}, "spec": spec}

    fake.create("nodes", node("n0"))
    daemon_set = {"kind": "DaemonSet", "name": "d", "apiVersion": "apps/v1", "uid": "u"}
    fake.create("nodes", node("n1", unschedulable=True))
    draining = node("n2", unschedulable=True)
    draining["metadata"]["annotations"] = {"gpuscale.io/removal-started": "2026-01-01T00:00:00Z"}
    fake.create("nodes", draining)
    for obj in (
        pod("pinned", "n0", 2, annotations={"gpuscale.io/gpus": "2,3"}),
        pod("guessed", "n0", 2),
        pod("shared", "n1", 1, annotations={"gpuscale.io/gpu-milli": "300"}),
        pod("agent", "n1", 0, ownerReferences=[daemon_set]),
        pod("web", "n2"),
        pod("waiting", None, 1, annotations={"gpuscale.io/gpu-milli": "250"}),
        pod("held", None, 4, labels=dict(KUBE_NAMES.placeholder_labels)),
        pod("ghost", "gone", 1),
    ):
        fake.create("pods", obj)
    fake.patch("pods", "web", {"status": {"phase": "Succeeded"}}, "ml")

    seen = observe_cluster(k8s.ApiClient(k8s.Configuration(host=fake.url)))
    state = seen.state
    assert state is not None and state.names == ["n0", "n1", "n2"]
    assert state.cordoned.tolist() == [False, True, True]
    assert state.draining.tolist() == [False, False, True]
    # The recorded indices are kept; the other pod gets the GPUs left, not the same ones.
    assert state.jobs["ml/pinned"].gpus == (2, 3) and state.jobs["ml/guessed"].gpus == (0, 1)
    assert state.jobs["ml/shared"].job.gpu_milli == 300
    assert "ml/agent" not in state.jobs  # a DaemonSet pod is the node's overhead
    assert seen.specs["n1"].cpu_milli == 14_000 and int(state.cpu_free[1]) == 12_000
    assert "ml/web" not in state.jobs and "ml/ghost" not in state.jobs
    assert [j.id for j in seen.real_pending] == ["ml/waiting"]
    assert {j.id for j in seen.pending} == {"ml/waiting", "ml/held"}
    assert seen.pending_gpus == {None: 0.25}
    n0, n1, n2 = (seen.nodes[n] for n in ("n0", "n1", "n2"))
    assert (n0.cloud_name, n0.busy, n0.movable_pods, n0.gpus_used) == ("i-n0", True, 2, 4.0)
    assert (n1.busy, n1.movable_pods, n1.gpus_used) == (True, 1, 0.3)  # the agent stays
    assert (n2.draining, n2.busy, n2.movable_pods) == (True, False, 0)
