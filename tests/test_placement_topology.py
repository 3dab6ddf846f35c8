"""Topology on hand-made clusters whose right answer is known: NVLink / NVSwitch domains
inside a node, gangs within one rack (required or preferred, as Kueue asks), and packing
that keeps whole domains and racks free."""

from __future__ import annotations

import pytest

from predictor.telemetry.kube_objects import read_node
from scaler.cluster.topology import parse_gpu_domains
from scaler.kube.objects import pod_job, spec_of
from scaler.placement import (
    ClusterState,
    GangPlacement,
    Job,
    NodeSpec,
    Placement,
    Unschedulable,
    commit,
    commit_gang,
    make_policy,
    place,
    place_gang,
)

RACK = "cloud.provider.com/topology-rack"
HOST = "kubernetes.io/hostname"


def node(
    name: str, gpus: int = 8, domains: str = "", rack: str | None = None, cores: int = 96
) -> NodeSpec:
    labels = ((RACK, rack),) if rack else ()
    return NodeSpec(
        name,
        cores * 1000,
        768 * 1024,
        gpus,
        "H100",
        labels=labels,
        gpu_domains=parse_gpu_domains(domains, gpus) if domains else (),
        rack=rack,
    )


def gpu_job(job_id: str, gpus: int, cores: int = 4, **extra: object) -> Job:
    return Job(job_id, cores * 1000, 4096, gpus, 1000, **extra)  # type: ignore[arg-type]


def hold(state: ClusterState, node_name: str, gpus: tuple[int, ...], job_id: str) -> None:
    """Bind a job to the given GPUs of a node (what already runs there)."""
    state.bind(gpu_job(job_id, len(gpus)), state.node_index(node_name), gpus)


def placed(state: ClusterState, job: Job, policy: str = "gpuscale") -> Placement:
    decision = place(state, job, make_policy(policy, mix=MIX))
    assert isinstance(decision, Placement), decision
    commit(state, job, decision)
    return decision


def gang(name: str, size: int, gpus: int, **extra: object) -> list[Job]:
    return [gpu_job(f"{name}-{i}", gpus, gang=name, **extra) for i in range(size)]


def gang_nodes(state: ClusterState, members: list[Job], policy: str = "gpuscale") -> set[str]:
    decided = place_gang(state, members, make_policy(policy, mix=MIX))
    assert isinstance(decided, GangPlacement), decided
    commit_gang(state, members, decided)
    return {p.node for p in decided.placements}


def _mix() -> object:
    from scaler.placement import WorkloadMix

    return WorkloadMix.from_jobs([gpu_job(f"m{k}", k) for k in (1, 2, 4, 8) for _ in range(3)])


MIX = _mix()


# ---- NVLink domains inside a node ----------------------------------------------------------


def test_a_4_gpu_job_stays_within_one_nvlink_group_when_one_has_room() -> None:
    state = ClusterState.from_nodes([node("n", domains="0-3_4-7")])
    two = placed(state, gpu_job("two", 2))
    assert two.gpus == (0, 1)  # best fit: a domain, not one GPU from each
    four = placed(state, gpu_job("four", 4))
    assert four.gpus == (4, 5, 6, 7)  # not 2, 3, 4, 5 across the two groups
    one = placed(state, gpu_job("one", 1))
    assert one.gpus == (2,)  # into the group already in use


def test_a_multi_gpu_job_goes_to_the_node_that_holds_it_in_one_domain() -> None:
    def cluster(domains: str) -> ClusterState:
        state = ClusterState.from_nodes(
            [node("split", domains=domains), node("open", domains=domains)]
        )
        hold(state, "split", (0, 1, 4, 5), "busy")  # 4 idle GPUs, 2 in each group
        return state

    # Without domains the tight node is the policy's choice...
    assert placed(cluster(""), gpu_job("j", 4)).node == "split"
    # ...with them, the node whose group holds all four.
    decision = placed(cluster("0-3_4-7"), gpu_job("j", 4))
    assert (decision.node, decision.gpus) == ("open", (0, 1, 2, 3))


def test_an_8_gpu_job_takes_one_nvswitch_node_rather_than_two_half_free_domains() -> None:
    def cluster(domains: str) -> ClusterState:
        state = ClusterState.from_nodes(
            [
                node("halves", gpus=16, domains=domains and "0-7_8-15", cores=64),
                node("nvswitch", gpus=8, domains=domains and "nvswitch"),
            ]
        )
        hold(state, "halves", (0, 1, 2, 3, 8, 9, 10, 11), "busy")
        return state

    assert placed(cluster(""), gpu_job("big", 8), "bestfit").node == "halves"
    assert placed(cluster("yes"), gpu_job("big", 8), "bestfit").node == "nvswitch"


def test_a_gang_preferring_one_node_takes_a_whole_nvswitch_node() -> None:
    def cluster() -> ClusterState:
        state = ClusterState.from_nodes(
            [
                node("half1", domains="nvswitch"),
                node("half2", domains="nvswitch"),
                node("whole", domains="nvswitch"),
            ]
        )
        hold(state, "half1", (0, 1, 2, 3), "a")
        hold(state, "half2", (0, 1, 2, 3), "b")
        return state

    # Asking nothing, the gang fills the two half-free nodes (the packing keeps "whole").
    assert gang_nodes(cluster(), gang("plain", 2, 4)) == {"half1", "half2"}
    # Preferring one host (Kueue's podset-preferred-topology: kubernetes.io/hostname), it
    # gets one NVSwitch node.
    members = gang("local", 2, 4, topology_key=HOST)
    assert gang_nodes(cluster(), members) == {"whole"}


# ---- racks ---------------------------------------------------------------------------------


def racked() -> ClusterState:
    state = ClusterState.from_nodes(
        [node("a1", rack="r1"), node("a2", rack="r1"), node("b1", rack="r2"), node("b2", rack="r2")]
    )
    hold(state, "a1", (0, 1, 2), "x")  # r1: 13 idle GPUs, r2: 16
    hold(state, "a2", (0, 1, 2), "y")
    return state


def test_a_rack_required_gang_lands_in_one_rack_or_is_refused_with_the_reason() -> None:
    state = racked()
    # 3 x 5 GPUs: r1 has 10 idle in nodes of 5 each, so r1 fits; it is the tighter rack.
    assert gang_nodes(state, gang("g1", 2, 5, topology_key=RACK, topology_required=True)) == {
        "a1",
        "a2",
    }
    # 4 x 4 GPUs: only r2 (16 idle) holds them.
    assert gang_nodes(state, gang("g2", 4, 4, topology_key=RACK, topology_required=True)) == {
        "b1",
        "b2",
    }
    # Nothing is left for 2 x 4 in one rack: refused, with why, and nothing placed.
    before = dict(state.jobs)
    members = gang("g3", 2, 4, topology_key=RACK, topology_required=True)
    refused = place_gang(state, members, make_policy("gpuscale", mix=MIX))
    assert isinstance(refused, Unschedulable)
    assert refused.reason == (
        f"gang g3 requires one {RACK}: none of its 2 {RACK} values has the free GPU, CPU and"
        " memory in all; nothing was placed"
    )
    assert state.jobs == before


def test_a_preferred_rack_falls_back_and_a_required_one_says_which_rack_came_closest() -> None:
    nodes = [node("a1", 4, rack="r1"), node("a2", 4, rack="r1"), node("b1", 4, rack="r2")]
    state = ClusterState.from_nodes([*nodes, node("loose", 4)])  # "loose" names no rack
    for name in ("a1", "a2", "b1"):
        hold(state, name, (0, 1), f"on-{name}")
    # r1 has 4 idle GPUs in all, but 2 per node: a 4-GPU member fits no node of it.
    required = gang("req", 1, 4, topology_key=RACK, topology_required=True)
    refused = place_gang(state, required, make_policy("gpuscale", mix=MIX))
    assert isinstance(refused, Unschedulable)
    assert refused.reason.startswith(
        f"gang req requires one {RACK}: of its 2 {RACK} values, 1 have the room in all but"
        f" none holds every member (tightest, {RACK}=r1: member req-0 does not fit once 0 of 1"
        " are placed (no node fits now:"
    )
    # Preferred, it goes where it fits: the node of no rack.
    assert gang_nodes(state, gang("pref", 1, 4, topology_key=RACK)) == {"loose"}
    # Asking for a label no node has is a reason too.
    zone = gang("zone", 1, 1, topology_key="topology.kubernetes.io/zone", topology_required=True)
    missing = place_gang(state, zone, make_policy("gpuscale", mix=MIX))
    assert isinstance(missing, Unschedulable)
    assert "no node has the label topology.kubernetes.io/zone" in missing.reason


def test_the_packing_fills_racks_in_use_and_keeps_idle_racks_whole() -> None:
    state = ClusterState.from_nodes(
        [node(f"{r}{i}", rack=r) for r in ("r1", "r2", "r3") for i in range(2)]
    )
    nodes = [placed(state, gpu_job(f"j{k}", 2)).node for k in range(8)]
    racks = {n[:2] for n in nodes}
    assert len(racks) == 1  # 16 GPUs of work in the one rack in use, two racks left whole
    assert state.rack_jobs is not None and sorted(state.rack_jobs.tolist()) == [0, 0, 8]
    state.release("j0")
    assert sorted(state.rack_jobs.tolist()) == [0, 0, 7]


def test_unlabelled_clusters_place_as_before() -> None:
    plain = ClusterState.from_nodes([node(f"n{i}") for i in range(3)])
    assert plain.gpu_domain is None and plain.rack_id is None


# ---- reading Kubernetes objects ------------------------------------------------------------


def test_node_labels_give_domains_and_rack_and_kueue_annotations_give_the_topology() -> None:
    kube_node = {
        "metadata": {
            "name": "n1",
            "labels": {
                "nvidia.com/gpu.product": "H100",
                "gpuscale.io/gpu-domains": "0-3_4-7",
                RACK: "r7",
            },
        },
        "status": {"allocatable": {"cpu": "96", "memory": "768Gi", "nvidia.com/gpu": "8"}},
    }
    spec = spec_of(read_node(kube_node))
    assert spec.gpu_domains == ((0, 1, 2, 3), (4, 5, 6, 7)) and spec.rack == "r7"
    kube_node["metadata"]["labels"]["gpuscale.io/gpu-domains"] = "0-3_4-9"  # type: ignore[index]
    with pytest.raises(ValueError, match="node n1: GPU domains '0-3_4-9'"):
        spec_of(read_node(kube_node))
    pod = {
        "metadata": {
            "name": "w0",
            "annotations": {"kueue.x-k8s.io/podset-required-topology": RACK},
        },
        "spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "4"}}}]},
    }
    job = pod_job(pod)
    assert (job.num_gpu, job.topology_key, job.topology_required) == (4, RACK, True)
    pod["metadata"]["annotations"] = {"kueue.x-k8s.io/podset-preferred-topology": HOST}
    assert (pod_job(pod).topology_key, pod_job(pod).topology_required) == (HOST, False)


def test_gpu_domains_are_written_several_ways() -> None:
    assert parse_gpu_domains("0-3,4-7", 8) == parse_gpu_domains("0,1,2,3;4,5,6,7", 8)
    assert parse_gpu_domains("nvswitch", 4) == ((0, 1, 2, 3),)
    for bad, wanted in (("0-3_3-7", "twice"), ("x", "not an index"), ("3-1", "backwards")):
        with pytest.raises(ValueError, match=wanted):
            parse_gpu_domains(bad, 8)
