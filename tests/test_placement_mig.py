"""MIG on hand-made nodes whose right answer is known: NVIDIA's placement rules, which free
instance a job takes, repartitioning idle GPUs, and MIG pods through the Kubernetes
readings, the service API and the extender filter."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from scaler.cluster.mig import (
    MigInstance,
    MigLayout,
    check_gpu,
    family_of,
    largest_placeable,
    layout_from_counts,
    pack,
    parse_layout,
    profiles,
)
from scaler.placement import (
    ClusterState,
    Job,
    NodeSpec,
    Placement,
    Unschedulable,
    apply_repartition,
    commit,
    make_policy,
    place,
    plan_repartition,
    preempt,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # starlette's note about httpx versions
    from fastapi.testclient import TestClient

POLICY = make_policy("bestfit")


def mig_node(name: str, layout: str, family: str = "80GB", cores: int = 64) -> NodeSpec:
    return NodeSpec(name, cores * 1000, 512 * 1024, mig=parse_layout(layout, family))


def mig_job(job_id: str, profile: str, count: int = 1, **extra: object) -> Job:
    return Job(job_id, 1000, 1024, mig_profile=profile, mig_count=count, **extra)  # type: ignore[arg-type]


def bound(state: ClusterState, job: Job) -> Placement:
    decision = place(state, job, POLICY)
    assert isinstance(decision, Placement), decision
    commit(state, job, decision)
    return decision


def instances(state: ClusterState, decision: Placement) -> list[MigInstance]:
    layout = state.mig[decision.node_index]
    return [layout.instances[k] for k in decision.gpus]


SEVEN_SMALL = ",".join(f"1g.10gb@{s}" for s in range(7))


# ---- NVIDIA's placement rules ---------------------------------------------------------------


def test_profiles_take_the_starts_the_mig_user_guide_lists() -> None:
    a100 = profiles("A100-40GB")
    assert a100["1g.5gb"].starts == (0, 1, 2, 3, 4, 5, 6) and a100["1g.5gb"].size == 1
    assert a100["2g.10gb"].starts == (0, 2, 4)
    assert a100["3g.20gb"].starts == (0, 4)
    assert a100["4g.20gb"].starts == (0,)
    assert a100["7g.40gb"].starts == (0,) and a100["7g.40gb"].size == 8
    # The same name is a different shape in another family.
    assert a100["1g.10gb"].size == 2 and profiles("80GB")["1g.10gb"].size == 1
    assert check_gpu("A100-40GB", [MigInstance(0, "3g.20gb", 2)]) == (
        "GPU 0: 3g.20gb may start at 0,4, not 2"
    )
    overlap = [MigInstance(0, "4g.20gb", 0), MigInstance(0, "2g.10gb", 2)]
    assert "overlaps" in str(check_gpu("A100-40GB", overlap))
    # 4g + 3g is the classic split; 4g + 4g is not (4g only at 0).
    assert pack("80GB", ["4g.40gb", "3g.40gb"]) == (0, 4)
    assert pack("80GB", ["4g.40gb", "4g.40gb"]) is None
    # all-balanced needs the 3g at slice 4 so that two 1g fit beside the 2g.
    assert pack("80GB", ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]) == (2, 3, 0, 4)


def test_a_layout_from_counts_is_the_operators_even_split_and_bad_layouts_are_named() -> None:
    layout = layout_from_counts({"1g.10gb": 16, "2g.20gb": 8, "3g.40gb": 8}, "80GB", 8)
    assert layout.gpus == tuple(range(8))
    assert [i.text for i in layout.instances if i.gpu == 3] == [
        "2g.20gb@0",
        "1g.10gb@2",
        "1g.10gb@3",
        "3g.40gb@4",
    ]
    fewest = layout_from_counts({"3g.40gb": 3}, "80GB", first_gpu=2)
    assert fewest.gpus == (2, 3)
    assert parse_layout("0=3g.40gb,3g.40gb;1=7g.80gb", "80GB").text() == (
        "0=3g.40gb@0,3g.40gb@4;1=7g.80gb@0"
    )
    for text, wanted in (
        ("0=3g.40gb@2", "may start at 0,4"),
        ("0=7g.80gb;0=1g.10gb", "names GPU 0 twice"),
        ("0=4g.40gb,4g.40gb", "does not fit one GPU"),
        ("x=1g.10gb", "is not GPU=profile"),
        ("0=5g.50gb", "has no '5g.50gb'"),
        ("64=1g.10gb", "a node holds at most 64"),
    ):
        with pytest.raises(ValueError, match=wanted):
            parse_layout(text, "80GB")
    assert family_of(["1g.10gb"], memory_mib=40960) == "A100-40GB"
    assert family_of(["3g.71gb"]) == "H200-141GB"
    assert largest_placeable("80GB", 1 << 6) == "4g.40gb"


def test_a_node_is_at_most_64_gpus_and_its_layout_is_searched_within_them() -> None:
    """Counts are what a node (or anyone calling the extender) says: the layout search is
    bounded by the largest node, and a full one is found, not searched for minutes."""
    full = layout_from_counts({"1g.10gb": 7 * 64}, "80GB")
    assert len(full.gpus) == 64 and len(full.instances) == 448
    with pytest.raises(ValueError, match="do not fit the 64 GPUs a node holds at most"):
        layout_from_counts({"1g.10gb": 7 * 64 + 1}, "80GB")
    with pytest.raises(ValueError, match="a node holds at most 64 GPUs and 512 instances"):
        layout_from_counts({"1g.10gb": 10**9}, "80GB")
    assert pack("80GB", ["1g.10gb"] * 8) is None  # one too many for a GPU: no search needed
    with pytest.raises(ValueError, match="node big: 65 GPUs; a node holds 0 to 64"):
        NodeSpec(name="big", cpu_milli=1, memory_mib=1, gpus=65)


# ---- placing MIG jobs -----------------------------------------------------------------------


def test_a_7g_job_never_goes_to_a_gpu_with_a_1g_in_use() -> None:
    # GPU 0: seven 1g (one in use); GPU 1: idle seven 1g; GPU 2: a free 7g.
    state = ClusterState.from_nodes([mig_node("n0", f"0={SEVEN_SMALL};1={SEVEN_SMALL};2=7g.80gb")])
    bound(state, mig_job("small", "1g.10gb"))
    big = bound(state, mig_job("big", "7g.80gb"))
    assert [i.gpu for i in instances(state, big)] == [2]
    # No free 7g left: unschedulable with the reason, and the repartition plan takes the
    # idle GPU 1, never GPU 0 where the 1g runs.
    another = mig_job("another", "7g.80gb")
    refused = place(state, another, POLICY)
    assert isinstance(refused, Unschedulable)
    assert "0 have 1 free MIG 7g.80gb instance(s)" in refused.reason
    plan = plan_repartition(state, [another], POLICY)
    assert [(c.node, c.gpu, c.after, c.serves) for c in plan.changes] == [
        ("n0", 1, "7g.80gb@0", ("another",))
    ]
    assert plan.changes[0].before == SEVEN_SMALL
    apply_repartition(state, plan)
    placed = bound(state, another)
    assert [i.gpu for i in instances(state, placed)] == [1]
    # A GPU in use is never repartitioned, whatever a plan says.
    with pytest.raises(ValueError, match="only idle GPUs"):
        state.set_mig_layout(0, parse_layout("0=7g.80gb;1=7g.80gb;2=7g.80gb", "80GB"))


def test_a_1g_goes_where_it_keeps_the_largest_profiles_placeable() -> None:
    state = ClusterState.from_nodes([mig_node("n0", f"0={SEVEN_SMALL};1={SEVEN_SMALL}")])
    # Slice 6 leaves the 4g (slices 0-3, its only start) and three 2g their room; slice 0
    # would leave a 3g at most.
    first = bound(state, mig_job("a", "1g.10gb"))
    assert instances(state, first) == [MigInstance(0, "1g.10gb", 6)]
    # The next one stays on the GPU already in use (GPU 1 keeps room for a 7g), within
    # slices 4-7 (the 4g keeps its room).
    second = bound(state, mig_job("b", "1g.10gb"))
    assert instances(state, second) == [MigInstance(0, "1g.10gb", 4)]
    assert largest_placeable("80GB", _used(state, 0)) == "4g.40gb"
    # Two at once: both there too, slice 5 first (the last 1g slice of 4-7) and then
    # one of 0-3, which a fourth 1g must break.
    pair = bound(state, mig_job("c", "1g.10gb", count=2))
    assert {i.gpu for i in instances(state, pair)} == {0}
    assert {i.start for i in instances(state, pair)} & {5} == {5}
    assert largest_placeable("80GB", _used(state, 1)) == "7g.80gb"
    state.release("c")
    assert len(state.mig_free(0, "1g.10gb")) == 12


def _used(state: ClusterState, gpu: int) -> int:
    """The slices taken on MIG GPU `gpu` of node 0, as bits."""
    layout = state.mig[0]
    masks = layout.masks()
    return sum(
        masks[k] for k in np.flatnonzero(state.mig_used[0]) if layout.instances[k].gpu == gpu
    )


def test_nodes_are_chosen_by_fragmentation_then_resources_are_checked() -> None:
    state = ClusterState.from_nodes(
        [
            mig_node("idle", "0=3g.40gb,3g.40gb"),
            mig_node("used", "0=3g.40gb,3g.40gb"),
            mig_node("tiny", "0=3g.40gb,3g.40gb", cores=1),
        ]
    )
    bound(state, Job("holder", 1000, 1024, mig_profile="3g.40gb", node_selector=()))
    holder = state.jobs["holder"]
    # The holder went somewhere; the next 3g joins it there rather than opening a GPU.
    nxt = bound(state, mig_job("next", "3g.40gb"))
    assert nxt.node == state.names[holder.node]
    too_big = Job("cpu", 2000, 1024, mig_profile="3g.40gb")
    decision = place(state, too_big, POLICY)
    assert isinstance(decision, Placement) and decision.node != "tiny"
    # Requests the cluster can never meet are named.
    for job, reason in (
        (mig_job("none", "7g.80gb"), "no node has MIG instances of profile 7g.80gb"),
        (mig_job("many", "3g.40gb", count=3), "a node has 2 at most"),
        (mig_job("odd", "9g.1gb"), "not of the form"),
        (Job("both", 1000, 1024, 1, 1000, mig_profile="1g.10gb"), "at once"),
    ):
        refused = place(state, job, POLICY)
        assert isinstance(refused, Unschedulable) and reason in refused.reason, refused


def test_mixed_nodes_keep_whole_gpus_and_instances_apart() -> None:
    node = NodeSpec(
        "n", 64_000, 512 * 1024, gpus=2, model="A100", mig=parse_layout("2=3g.40gb,3g.40gb", "80GB")
    )
    state = ClusterState.from_nodes([node])
    whole = bound(state, Job("whole", 1000, 1024, 2, 1000))
    part = bound(state, mig_job("part", "3g.40gb"))
    # The 3g takes slices 4-7: a 4g (slices 0-3 only) keeps its room.
    assert whole.gpus == (0, 1) and instances(state, part) == [MigInstance(2, "3g.40gb", 4)]
    assert state.full_free[0] == 0 and state.mig_free(0, "3g.40gb") == [0]
    state.release("whole")
    assert state.full_free[0] == 2 and state.jobs["part"].gpus == (1,)


def test_a_higher_priority_mig_job_preempts_for_an_instance() -> None:
    state = ClusterState.from_nodes([mig_node("n0", "0=7g.80gb")])
    bound(state, mig_job("low", "7g.80gb", priority=0))
    decision = preempt(state, mig_job("high", "7g.80gb", priority=10), POLICY)
    assert isinstance(decision, Placement) and decision.evict == ("low",)
    assert decision.gpus == (0,)


def test_a_repartition_serves_several_jobs_on_one_gpu_and_names_what_it_cannot() -> None:
    state = ClusterState.from_nodes([mig_node("n0", "0=7g.80gb;1=7g.80gb")])
    bound(state, mig_job("big", "7g.80gb"))
    pending = [mig_job("a", "3g.40gb"), mig_job("b", "3g.40gb"), mig_job("c", "4g.40gb")]
    plan = plan_repartition(state, pending, POLICY)
    assert [(c.gpu, c.after, c.serves) for c in plan.changes] == [
        (1, "3g.40gb@0,3g.40gb@4", ("a", "b"))
    ]
    assert plan.unserved and plan.unserved[0][0] == "c"
    assert "no idle MIG GPU offering 4g.40gb" in plan.unserved[0][1]
    # Applying it then placing gives both 3g jobs instances of GPU 1.
    apply_repartition(state, plan)
    for job in pending[:2]:
        assert instances(state, bound(state, job))[0].gpu == 1
    assert state.mig[0].instances[0] == MigInstance(0, "7g.80gb", 0)


def test_a_state_copy_does_not_share_mig_usage_or_layouts() -> None:
    state = ClusterState.from_nodes([mig_node("n0", f"0={SEVEN_SMALL}")])
    copy = state.copy()
    bound(copy, mig_job("a", "1g.10gb"))
    copy.set_mig_layout(0, MigLayout.of("80GB", [MigInstance(0, "1g.10gb", 6)]))
    assert not state.mig_used[0].any() and len(state.mig[0].instances) == 7
    assert np.count_nonzero(copy.mig_used[0]) == 1


# ---- Kubernetes objects, the service API and the extender ----------------------------------


def kube_node(name: str, allocatable: dict[str, str], **meta: dict[str, str]) -> dict:
    base = {"cpu": "96", "memory": "1024Gi"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, **meta},
        "status": {"allocatable": base | allocatable},
    }


def kube_pod(name: str, resources: dict[str, str], uid: str = "") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "uid": uid or f"uid-{name}"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": resources}}]},
    }


def test_mig_pods_and_nodes_read_from_their_kubernetes_json() -> None:
    from predictor.telemetry.kube_objects import read_node
    from scaler.kube.objects import pod_job, spec_of

    # The operator's all-balanced on two MIG GPUs of eight (six whole): 2 x 1g, a 2g and
    # a 3g on each, numbered after the whole ones.
    mig = {
        "nvidia.com/mig-1g.10gb": "4",
        "nvidia.com/mig-2g.20gb": "2",
        "nvidia.com/mig-3g.40gb": "2",
    }
    mixed = kube_node(
        "m1",
        {"nvidia.com/gpu": "6", **mig},
        labels={"nvidia.com/mig.strategy": "mixed", "nvidia.com/gpu.count": "8"},
    )
    spec = spec_of(read_node(mixed))
    assert spec.gpus == 6 and spec.mig is not None and spec.mig.family == "80GB"
    assert spec.mig.text() == (
        "6=2g.20gb@0,1g.10gb@2,1g.10gb@3,3g.40gb@4;7=2g.20gb@0,1g.10gb@2,1g.10gb@3,3g.40gb@4"
    )
    impossible = kube_node("m0", {"nvidia.com/mig-3g.40gb": "4", "nvidia.com/mig-1g.10gb": "4"},
                           labels={"nvidia.com/gpu.count": "2"})  # fmt: skip
    with pytest.raises(ValueError, match=r"node m0: MIG layout: MIG instances .* do not fit 2"):
        spec_of(read_node(impossible))
    annotated = kube_node(
        "m2",
        {"nvidia.com/mig-3g.20gb": "2"},
        labels={"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"},
        annotations={"gpuscale.io/mig-layout": "0=3g.20gb@0,3g.20gb@4"},
    )
    layout = spec_of(read_node(annotated)).mig
    assert (
        layout is not None
        and layout.family == "A100-40GB"
        and layout.text() == ("0=3g.20gb@0,3g.20gb@4")
    )
    bad = kube_node("m3", {}, annotations={"gpuscale.io/mig-layout": "0=3g.40gb@2"})
    with pytest.raises(ValueError, match=r"node m3: MIG layout: GPU 0: 3g\.40gb may start at 0,4"):
        spec_of(read_node(bad))
    job = pod_job(kube_pod("p", {"nvidia.com/mig-1g.10gb": "2", "cpu": "2"}))
    assert (job.mig_profile, job.mig_count, job.num_gpu, job.cpu_milli) == ("1g.10gb", 2, 0, 2000)
    with pytest.raises(ValueError, match="several profiles"):
        pod_job(kube_pod("q", {"nvidia.com/mig-1g.10gb": "1", "nvidia.com/mig-3g.40gb": "1"}))


@pytest.fixture
def mig_service(tmp_path: Path) -> Iterator[TestClient]:
    """The service over a fixed cluster: a mixed node (4 whole GPUs, 2 MIG GPUs of 3g) and
    a plain one; no Kubernetes."""
    from live_fixtures import pool

    from scaler.controller.config import LiveConfig
    from scaler.service import create_app

    nodes = [
        {"name": "mig-1", "gpus": 4, "gpu_model": "A100-80GB", "cpu_milli": 96_000,
         "memory_mib": 1_048_576, "mig_layout": "4=3g.40gb,3g.40gb;5=7g.80gb"},
        {"name": "plain", "gpus": 8, "gpu_model": "A100-80GB", "cpu_milli": 96_000,
         "memory_mib": 1_048_576},
    ]  # fmt: skip
    config = LiveConfig(
        state_dir=tmp_path / "state",
        pools=[pool(min_size=2, max_size=6)],
        model={"name": "persistence"},
        service={"token": TOKEN},
        placement={"nodes": nodes},
    )
    with TestClient(create_app(config)) as client:
        yield client


TOKEN = "mig-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_mig_jobs_through_the_service_api(mig_service: TestClient) -> None:
    client = mig_service
    ask = {"id": "a", "cpu_milli": 4000, "mig_profile": "3g.40gb"}
    first = client.post("/v1/placements", json=ask, headers=AUTH)
    assert first.status_code == 201, first.text
    body = first.json()
    assert (body["node"], body["gpus"]) == ("mig-1", [4])
    assert body["mig_instances"] == [{"index": 1, "gpu": 4, "profile": "3g.40gb", "start": 4}]
    second = client.post("/v1/placements", json=ask | {"id": "b"}, headers=AUTH).json()
    assert second["mig_instances"][0]["start"] == 0
    full = client.post("/v1/placements", json=ask | {"id": "c"}, headers=AUTH)
    assert full.status_code == 409
    assert "0 have 1 free MIG 3g.40gb instance(s)" in full.json()["detail"]["reason"]
    # A whole-GPU job on the same node is untouched by the instances.
    whole = client.post("/v1/placements", json={"id": "w", "num_gpu": 4}, headers=AUTH).json()
    assert whole["gpus"] in ([0, 1, 2, 3],) and whole["mig_instances"] == []
    released = client.delete("/v1/placements/a", headers=AUTH)
    # The GPUs the placement named (its instances' GPU), not the instances' indices.
    assert released.status_code == 200 and released.json()["gpus"] == body["gpus"] == [4]
    again = client.post("/v1/placements", json=ask | {"id": "c"}, headers=AUTH)
    assert again.status_code == 201
    for bad, field in (
        ({"id": "x", "mig_profile": "9g.1gb"}, "mig_profile"),
        ({"id": "x", "mig_profile": "3g.40gb", "num_gpu": 1}, "mig_profile"),
        ({"id": "x", "mig_profile": "3g.40gb", "mig_count": 0}, "mig_count"),
    ):
        refused = client.post("/v1/placements", json=bad, headers=AUTH)
        assert refused.status_code == 422, bad
        assert field in refused.text


def test_the_extender_filters_and_binds_mig_pods(mig_service: TestClient) -> None:
    client = mig_service
    mixed = kube_node(
        "k-mig",
        {"nvidia.com/gpu": "0", "nvidia.com/mig-1g.10gb": "7"},
        labels={"nvidia.com/mig.strategy": "mixed", "nvidia.com/gpu.count": "1"},
    )
    plain = kube_node("k-plain", {"nvidia.com/gpu": "8"})
    pod = kube_pod("infer", {"nvidia.com/mig-1g.10gb": "1", "cpu": "1"})
    args = {"Pod": pod, "Nodes": {"items": [mixed, plain]}}
    result = client.post("/v1/extender/filter", json=args).json()
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["k-mig"]
    assert result["FailedAndUnresolvableNodes"] == {
        "k-plain": "node has 0 MIG 1g.10gb instances, job needs 1"
    }
    scores = client.post("/v1/extender/prioritize", json=args).json()
    assert {s["Host"]: s["Score"] for s in scores} == {"k-mig": 10, "k-plain": 0}
    bind = {"PodName": "infer", "PodNamespace": "ml", "PodUID": "uid-infer", "Node": "k-mig"}
    assert client.post("/v1/extender/bind", json=bind, headers=AUTH).json() == {"Error": ""}
    # Seven instances, one now bound: a pod asking seven fails there for now only.
    seven = kube_pod("batch", {"nvidia.com/mig-1g.10gb": "7", "cpu": "1"})
    later = client.post("/v1/extender/filter", json={"Pod": seven, "Nodes": {"items": [mixed]}})
    assert later.json()["FailedNodes"] == {"k-mig": "6 free MIG 1g.10gb instances, job needs 7"}


def test_defragmentation_moves_mig_jobs_onto_instances_and_leaves_them_out_of_gpu_goals() -> None:
    from scaler.placement import apply_plan, plan_defrag

    state = ClusterState.from_nodes(
        [mig_node("n0", "0=3g.40gb,3g.40gb"), mig_node("n1", "0=3g.40gb,3g.40gb")]
    )
    state.bind(mig_job("a", "3g.40gb"), 0, (0,))
    state.bind(mig_job("b", "3g.40gb"), 1, (0,))
    plan = plan_defrag(state, POLICY, goal="nodes")
    assert len(plan.moves) == 1 and plan.freed_nodes
    move = plan.moves[0]
    assert move.target_gpus in ((0,), (1,))
    apply_plan(state, plan)
    assert sum(state.is_empty(n) for n in range(2)) == 1
    # Whole-GPU goals never count a MIG job's instance index as a GPU.
    mixed = NodeSpec("m", 64_000, 512 * 1024, 2, "A100", mig=parse_layout("2=7g.80gb", "80GB"))
    other = ClusterState.from_nodes([mixed])
    other.bind(mig_job("c", "7g.80gb"), 0, (0,))
    other.bind(Job("s", 1000, 1024, 1, 500), 0, (0,))
    assert plan_defrag(other, POLICY, goal="gpus").moves == ()
