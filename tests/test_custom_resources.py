"""The fake API server serves custom resources as a CRD's objects are served, through the
official client's CustomObjectsApi: namespaced and cluster-scoped, list/get/create/patch/
replace/delete, watches, the CRDs' defaults and validation rules, the status subresource."""

from __future__ import annotations

from typing import Any

import pytest
from fake_kube import FakeKube
from kubernetes import client as k8s
from kubernetes import watch as k8s_watch

BUFFERS = ("autoscaling.x-k8s.io", "v1beta1", "capacitybuffers")
NODE_POOLS = ("karpenter.sh", "v1", "nodepools")
WORKLOADS = ("kueue.x-k8s.io", "v1beta1", "workloads")


@pytest.fixture
def custom(fake: FakeKube) -> k8s.CustomObjectsApi:
    return k8s.CustomObjectsApi(k8s.ApiClient(k8s.Configuration(host=fake.url)))


def buffer(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling.x-k8s.io/v1beta1",
        "kind": "CapacityBuffer",
        "metadata": {"name": name, "labels": {"team": "ml"}},
        "spec": {"podTemplateRef": {"name": "unit"}, **spec},
    }


def test_namespaced_custom_objects_round_trip(custom: k8s.CustomObjectsApi) -> None:
    made = custom.create_namespaced_custom_object(
        *BUFFERS[:2], "ml", BUFFERS[2], buffer("b", replicas=2)
    )
    assert made["spec"]["provisioningStrategy"] == "buffer.x-k8s.io/active-capacity"  # default
    assert made["metadata"]["generation"] == 1
    got = custom.get_namespaced_custom_object(*BUFFERS[:2], "ml", BUFFERS[2], "b")
    assert got["spec"]["replicas"] == 2 and got["metadata"]["namespace"] == "ml"
    patched = custom.patch_namespaced_custom_object(
        *BUFFERS[:2], "ml", BUFFERS[2], "b", {"spec": {"replicas": 5}}
    )
    assert patched["spec"]["replicas"] == 5 and patched["metadata"]["generation"] == 2
    labelled = custom.patch_namespaced_custom_object(
        *BUFFERS[:2], "ml", BUFFERS[2], "b", {"metadata": {"labels": {"x": "y"}}}
    )
    assert labelled["metadata"]["generation"] == 2  # metadata is not what it asks
    listed = custom.list_namespaced_custom_object(
        *BUFFERS[:2], "ml", BUFFERS[2], label_selector="team=ml"
    )
    assert [o["metadata"]["name"] for o in listed["items"]] == ["b"]
    assert custom.list_namespaced_custom_object(*BUFFERS[:2], "other", BUFFERS[2])["items"] == []
    replaced = custom.replace_namespaced_custom_object(
        *BUFFERS[:2], "ml", BUFFERS[2], "b", {**labelled, "spec": {**got["spec"], "replicas": 1}}
    )
    assert replaced["spec"]["replicas"] == 1
    custom.delete_namespaced_custom_object(*BUFFERS[:2], "ml", BUFFERS[2], "b")
    with pytest.raises(k8s.ApiException) as gone:
        custom.get_namespaced_custom_object(*BUFFERS[:2], "ml", BUFFERS[2], "b")
    assert gone.value.status == 404


def test_a_stale_replace_conflicts(custom: k8s.CustomObjectsApi) -> None:
    made = custom.create_namespaced_custom_object(
        *BUFFERS[:2], "ml", BUFFERS[2], buffer("b", replicas=2)
    )
    custom.patch_namespaced_custom_object(
        *BUFFERS[:2], "ml", BUFFERS[2], "b", {"spec": {"replicas": 3}}
    )
    with pytest.raises(k8s.ApiException) as stale:
        custom.replace_namespaced_custom_object(*BUFFERS[:2], "ml", BUFFERS[2], "b", made)
    assert stale.value.status == 409


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({}, "needs replicas or limits"),
        ({"replicas": -1}, "spec.replicas"),
        ({"replicas": 1, "scalableRef": {"kind": "Deployment", "name": "d"}}, "exactly one"),
    ],
)
def test_a_capacity_buffer_against_its_crd_rules_is_refused(
    custom: k8s.CustomObjectsApi, spec: dict[str, Any], says: str
) -> None:
    with pytest.raises(k8s.ApiException) as refused:
        custom.create_namespaced_custom_object(*BUFFERS[:2], "ml", BUFFERS[2], buffer("b", **spec))
    assert refused.value.status == 422 and says in refused.value.body


def node_pool(name: str, **spec: Any) -> dict[str, Any]:
    template = {
        "spec": {
            "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "gpu"}
        }
    }
    return {"metadata": {"name": name}, "spec": {"template": template, **spec}}


def test_cluster_scoped_custom_objects_and_their_status(
    fake: FakeKube, custom: k8s.CustomObjectsApi
) -> None:
    custom.create_cluster_custom_object(
        *NODE_POOLS, node_pool("gpu", replicas=2) | {"status": {"nodes": 9}}
    )
    got = custom.get_cluster_custom_object(*NODE_POOLS, "gpu")
    assert got["spec"]["replicas"] == 2 and "status" not in got  # status only through /status
    fake.patch("nodepools", "gpu", {"status": {"nodes": 2}})  # Karpenter reports
    custom.patch_cluster_custom_object(
        *NODE_POOLS, "gpu", {"spec": {"replicas": 3}, "status": {"nodes": 0}}
    )
    got = custom.get_cluster_custom_object(*NODE_POOLS, "gpu")
    assert (got["spec"]["replicas"], got["status"]["nodes"]) == (3, 2)
    custom.patch_cluster_custom_object_status(
        *NODE_POOLS, "gpu", {"status": {"nodes": 3}, "spec": {"replicas": 0}}
    )
    got = custom.get_cluster_custom_object(*NODE_POOLS, "gpu")
    assert (got["spec"]["replicas"], got["status"]["nodes"]) == (3, 3)
    assert [
        o["metadata"]["name"] for o in custom.list_cluster_custom_object(*NODE_POOLS)["items"]
    ] == ["gpu"]
    with pytest.raises(k8s.ApiException) as turned:  # a static NodePool stays static
        custom.replace_cluster_custom_object(*NODE_POOLS, "gpu", {**got, "spec": {"template": {}}})
    assert turned.value.status == 422 and "static" in turned.value.body
    custom.delete_cluster_custom_object(*NODE_POOLS, "gpu")
    assert fake.objects("nodepools") == []


def test_custom_objects_are_watched_from_a_list(
    fake: FakeKube, custom: k8s.CustomObjectsApi
) -> None:
    workload = {
        "metadata": {"name": "job-a", "namespace": "ml"},
        "spec": {"podSets": [{"template": {"spec": {"containers": []}}}]},
    }
    fake.create("resourceflavors", {"metadata": {"name": "a100"}})  # versions start past 0
    listing = custom.list_cluster_custom_object(*WORKLOADS)
    made = fake.create("workloads", workload)
    assert made["spec"]["podSets"][0] == {
        "name": "main",
        "count": 1,
        "template": {"spec": {"containers": []}},
    }
    fake.patch("workloads", "job-a", {"spec": {"active": False}}, "ml")
    stream = k8s_watch.Watch().stream(
        custom.list_cluster_custom_object,
        *WORKLOADS,
        resource_version=listing["metadata"]["resourceVersion"],
        timeout_seconds=1,
    )
    seen = [(e["type"], e["object"]["spec"].get("active")) for e in stream]
    assert seen == [("ADDED", None), ("MODIFIED", False)]
