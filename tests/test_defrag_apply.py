"""`gpuscale defrag` against the fake API server, through the official client: the plan
on the live cluster, evictions that respect PodDisruptionBudgets, at most N moves per
window, nothing changed by a dry run, unmovable pods left alone, and the evicted pods'
successors steered by the extender onto the planned nodes so the plan's freed GPUs are
free."""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fake_kube import FakeKube
from live_fixtures import pool, write_config
from typer.testing import CliRunner

from predictor.telemetry.kube_objects import KUBE_NAMES, read_pod
from scaler.cli import app
from scaler.controller.config import LiveConfig
from scaler.controller.journal import DecisionJournal
from scaler.controller.system import kube_client
from scaler.kube.moves import PlannedMove, read_moves
from scaler.kube.observed import observe_cluster
from scaler.placement import Job
from scaler.service import create_app
from scaler.service.scheduling import FilterResult
from scaler.service.steering import Steer, Steering, steer_filter, steer_scores

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # starlette's note about httpx versions
    from fastapi.testclient import TestClient

TOKEN = "defrag-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NS = "ml"
MOVABLE = {KUBE_NAMES.movable_label: "true"}


def node_json(name: str, gpus: int = 8) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {"gpuscale.io/pool": "a100", "nvidia.com/gpu.product": "A100"},
        },
        "spec": {"providerID": f"aws:///us-east-1a/i-{name}"},
        "status": {
            "allocatable": {"cpu": "96", "memory": "1Ti", "nvidia.com/gpu": str(gpus)},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def pod_json(
    name: str,
    gpus: int,
    node: str | None,
    *,
    labels: dict[str, str] | None = None,
    owner: str | None = "rs",
    share: int | None = None,
    priority_class: str | None = None,
) -> dict[str, Any]:
    """A pod of ReplicaSet `owner` (None: a bare pod), running on `node` (None: pending)."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": NS,
        "labels": {"app": name, **(labels or {})},
    }
    if owner is not None:
        meta["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": owner, "uid": f"uid-{owner}",
             "controller": True}
        ]  # fmt: skip
    if share is not None:
        meta["annotations"] = {KUBE_NAMES.gpu_milli_annotation: str(share)}
    spec: dict[str, Any] = {
        "containers": [
            {"name": "main", "resources": {"requests": {"cpu": "4", "memory": "16Gi",
                                                        "nvidia.com/gpu": str(gpus)}}}
        ],
    }  # fmt: skip
    if node is not None:
        spec["nodeName"] = node
    if priority_class is not None:
        spec["priorityClassName"] = priority_class
    phase = "Running" if node else "Pending"
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


def budget(name: str, app_label: str, min_available: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": NS},
        "spec": {"minAvailable": min_available, "selector": {"matchLabels": {"app": app_label}}},
    }


def config_dict(tmp_path: Path, fake: FakeKube, **defrag: Any) -> dict[str, Any]:
    return {
        "state_dir": str(tmp_path / "state"),
        "pools": [pool(min_size=1, max_size=8)],
        "model": {"name": "persistence"},
        "kubernetes": {"host": fake.url, "pre_position": False},
        "placement": {"sync_s": 0, "policy": "bestfit"},
        "service": {"token": TOKEN},
        "defrag": {"max_moves": 10, "priority_classes": ["batch-movable"], **defrag},
    }


def run_defrag(tmp_path: Path, fake: FakeKube, *args: str, **defrag: Any) -> dict[str, Any]:
    path = write_config(tmp_path / "live.yaml", config_dict(tmp_path, fake, **defrag))
    result = CliRunner().invoke(app, ["defrag", "--config", str(path), "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def evictions(fake: FakeKube, dry: bool = False) -> list[str]:
    """Pods whose eviction was asked (real ones, or dry runs)."""
    out = []
    for method, path in fake.requests:
        if method == "POST" and "/eviction" in path and (("dryRun=All" in path) == dry):
            out.append(path.split("/pods/")[1].split("/")[0])
    return out


def successors(fake: FakeKube, before: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Play the ReplicaSet controller: a new pod (new name and uid, same template and
    owner) for every pod of `before` that has gone."""
    present = {p["metadata"]["name"] for p in fake.objects("pods", NS)}
    made = []
    for name, pod in sorted(before.items()):
        if name in present:
            continue
        new = copy.deepcopy(pod)
        kept = ("labels", "annotations", "ownerReferences")
        new["metadata"] = {k: v for k, v in pod["metadata"].items() if k in kept}
        new["metadata"] |= {"name": f"{name}-next", "namespace": NS}
        new["metadata"].get("annotations", {}).pop(KUBE_NAMES.gpus_annotation, None)
        new["spec"].pop("nodeName", None)
        new["status"] = {"phase": "Pending"}
        made.append(fake.create("pods", new))
    return made


def schedule(
    client: TestClient, fake: FakeKube, pod: dict[str, Any], full_nodes: bool
) -> tuple[str, list[str]]:
    """Play kube-scheduler with the extender: filter, prioritize, bind to the top node.
    The node, and the nodes the filter passed."""
    nodes = fake.objects("nodes")
    names = [n["metadata"]["name"] for n in nodes]
    if full_nodes:  # nodeCacheCapable false: the nodes as they are, annotations included
        args: dict[str, Any] = {"Pod": pod, "Nodes": {"items": nodes}}
    else:
        args = {"Pod": pod, "NodeNames": names}
    found = client.post("/v1/extender/filter", json=args).json()
    passing = (
        [n["metadata"]["name"] for n in found["Nodes"]["items"]]
        if full_nodes
        else found["NodeNames"]
    )
    assert passing, found
    scores = client.post("/v1/extender/prioritize", json=args).json()
    best = max((s for s in scores if s["Host"] in passing), key=lambda s: s["Score"])["Host"]
    meta = pod["metadata"]
    binding = {"PodName": meta["name"], "PodNamespace": NS, "PodUID": meta["uid"], "Node": best}
    answer = client.post("/v1/extender/bind", json=binding, headers=AUTH)
    assert answer.json() == {"Error": ""}
    return best, passing


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    from fake_kube import disruption_budget_policy

    kube = FakeKube().start()
    kube.eviction_policy = disruption_budget_policy(kube)
    yield kube
    kube.stop()


def fragmented(fake: FakeKube) -> None:
    """Four 8-GPU nodes, 13 GPUs used, no node free; an 8-GPU pod waits.

    n1: a (2 GPUs). n2: b (1) and c (2). n3: d (6, not movable) and f (1, a bare pod:
    nothing would recreate it). n4: e (1, its budget allows no disruption): the cheapest
    node to empty, but its move is refused.
    """
    for name in ("n1", "n2", "n3", "n4"):
        fake.create("nodes", node_json(name))
    fake.create("pods", pod_json("a", 2, "n1", labels=MOVABLE))
    fake.create("pods", pod_json("b", 1, "n2", labels=MOVABLE))
    fake.create("pods", pod_json("c", 2, "n2", priority_class="batch-movable"))
    fake.create("pods", pod_json("d", 6, "n3"))
    fake.create("pods", pod_json("f", 1, "n3", labels=MOVABLE, owner=None))
    fake.create("pods", pod_json("e", 1, "n4", labels=MOVABLE, owner="rs-e"))
    fake.create("poddisruptionbudgets", budget("e-budget", "e", 1))
    fake.create("pods", pod_json("big", 8, None, owner="big"))


def test_dry_run_plans_with_reasons_and_changes_nothing(tmp_path: Path, fake: FakeKube) -> None:
    fragmented(fake)
    before = {kind: fake.objects(kind) for kind in ("nodes", "pods")}
    out = run_defrag(tmp_path, fake)
    plan = out["plan"]
    assert out["applied"] is False and out["results"] == []
    assert {kind: fake.objects(kind) for kind in ("nodes", "pods")} == before
    assert evictions(fake) == [] and evictions(fake, dry=True) == []
    assert not [m for m, _ in fake.requests if m in ("POST", "PATCH", "PUT", "DELETE")]
    moved = {m["job"] for m in plan["moves"]}
    assert moved and moved <= {f"{NS}/a", f"{NS}/b", f"{NS}/c", f"{NS}/e"}
    assert all(m["reason"] and m["unit"] for m in plan["moves"])
    assert plan["freed_nodes"] and plan["idle_gpus"]["after"] == plan["idle_gpus"]["before"]
    assert plan["idle_nodes"] == {"before": 0, "after": len(plan["freed_nodes"])}
    assert plan["largest_idle"]["after"] == 8
    assert plan["unmovable"] == {
        "not labelled gpuscale.io/movable=true nor of an allowed priority class": 1,
        "no controller would recreate it": 1,
    }
    big = next(s for s in plan["shapes"] if s["label"].startswith(f"pending {NS}/big"))
    assert big["nodes_before"] == 0 and big["nodes_after"] >= 1
    # The dry run used nothing of the window.
    assert DecisionJournal(tmp_path / "state").load("defrag_window", []) == []


def test_apply_skips_what_a_budget_blocks_and_frees_what_the_plan_said(
    tmp_path: Path, fake: FakeKube
) -> None:
    fragmented(fake)
    pods = {p["metadata"]["name"]: p for p in fake.objects("pods", NS)}
    out = run_defrag(tmp_path, fake, "--apply")
    plan, results = out["plan"], out["results"]
    by_job = {r["job"]: r for r in results}
    # e's budget refuses: its move is blocked with the reason and planned around.
    blocked = by_job[f"{NS}/e"]
    assert blocked["status"] == "blocked" and blocked["from"] == "n4"
    assert "429" in blocked["result"] and "PodDisruptionBudget e-budget" in blocked["result"]
    assert "e" in evictions(fake, dry=True) and "e" not in evictions(fake)
    assert fake.get("pods", "e", NS)["spec"]["nodeName"] == "n4"
    assert f"{NS}/e" not in {m["job"] for m in plan["moves"]}
    assert plan["unmovable"]["its eviction was refused (a PodDisruptionBudget)"] == 1
    # Unmovable pods are never asked to leave, not even as a dry run.
    for name in ("d", "f"):
        assert name not in evictions(fake) + evictions(fake, dry=True)
    done = [r for r in results if r["status"] == "done"]
    assert done and {r["job"].split("/")[1] for r in done} == set(evictions(fake))
    # Each target node carries the note the extender steers by.
    for r in done:
        notes = read_moves(fake.get("nodes", r["to"])["metadata"].get("annotations", {}))
        assert any(m.id.startswith(r["job"] + "@") and m.gpus == tuple(r["gpus"]) for m in notes)
    # Journaled like the scale actions: the decision, and each move tried with its status.
    journal = DecisionJournal(tmp_path / "state")
    (decision,) = journal.decisions()
    assert decision.applied and decision.outcome and decision.id == out["decision_id"]
    tried = {a.target: a.status for a in journal.actions() if a.kind == "defrag_move"}
    assert tried == {r["job"]: r["status"] for r in results if r["status"] != "skipped"}
    assert journal.pending() == []
    assert len(journal.load("defrag_window", [])) == len(done)

    # The controller recreates the evicted pods; the scheduler asks the extender.
    config = LiveConfig.model_validate(config_dict(tmp_path, fake))
    with TestClient(create_app(config)) as client:
        for pod in successors(fake, pods):  # nodeCacheCapable false (the listing: below)
            node, passing = schedule(client, fake, pod, full_nodes=True)
            name = pod["metadata"]["name"].removesuffix("-next")
            planned = next(r for r in done if r["job"] == f"{NS}/{name}")
            assert node == planned["to"] and passing == [node]  # steered, not chosen
            bound = read_pod(fake.get("pods", pod["metadata"]["name"], NS))
            assert bound.gpu_indices == tuple(planned["gpus"])
        # What the plan said is free is free (every unit whose moves were all made).
        seen = observe_cluster(kube_client(config.kubernetes))
        assert seen.state is not None and not seen.unbound
        completed = [r["unit"] for r in results if r["frees"] and r["status"] == "done"]
        assert completed and set(completed) <= {f"node {n}" for n in plan["freed_nodes"]}
        for unit in completed:
            assert seen.state.is_empty(seen.state.node_index(unit.removeprefix("node ")))
        # The pod the room was made for goes there.
        node, _ = schedule(client, fake, fake.get("pods", "big", NS), full_nodes=False)
        assert f"node {node}" in completed


def test_no_more_than_max_moves_per_window(tmp_path: Path, fake: FakeKube) -> None:
    for name in ("n1", "n2", "n3"):
        fake.create("nodes", node_json(name))
    for i in range(6):  # six 1-GPU pods over three nodes: much to pack
        fake.create("pods", pod_json(f"p{i}", 1, f"n{i % 3 + 1}", labels=MOVABLE))
    first = run_defrag(tmp_path, fake, "--apply", "--max-moves", "3")
    assert len(evictions(fake)) <= 3
    assert first["plan"]["budget"] == 3 and len(first["plan"]["moves"]) <= 3
    made = len(evictions(fake))
    assert made == sum(r["status"] == "done" for r in first["results"]) > 0
    # Put the pods back elsewhere (as their controller would): more to pack, no budget.
    for i in range(6):
        if f"p{i}" in {p["metadata"]["name"] for p in fake.objects("pods", NS)}:
            continue
        fake.create("pods", pod_json(f"p{i}", 1, "n3", labels=MOVABLE))
    second = run_defrag(tmp_path, fake, "--apply", "--max-moves", "3")
    assert second["plan"]["made_in_window"] == made
    assert len(second["plan"]["moves"]) <= 3 - made
    assert len(evictions(fake)) <= 3
    # The window has passed: moves are allowed again.
    journal = DecisionJournal(tmp_path / "state")
    journal.save("defrag_window", [t - 7200 for t in journal.load("defrag_window", [])])
    third = run_defrag(tmp_path, fake, "--max-moves", "3")
    assert third["plan"]["made_in_window"] == 0 and third["plan"]["budget"] == 3


def test_gpu_goal_moves_shares_onto_the_planned_gpu(tmp_path: Path, fake: FakeKube) -> None:
    fake.create("nodes", node_json("n1", gpus=2))
    fake.create("pods", pod_json("s1", 1, "n1", labels=MOVABLE, share=300))
    fake.create("pods", pod_json("s2", 1, "n1", labels=MOVABLE, share=300, owner="rs2"))
    # Record the GPUs the scheduler gave them (as our bind does).
    fake.patch("pods", "s1", {"metadata": {"annotations": {KUBE_NAMES.gpus_annotation: "0"}}}, NS)
    fake.patch("pods", "s2", {"metadata": {"annotations": {KUBE_NAMES.gpus_annotation: "1"}}}, NS)
    pods = {p["metadata"]["name"]: p for p in fake.objects("pods", NS)}
    out = run_defrag(tmp_path, fake, "--apply", "--goal", "gpus")
    (move,) = out["plan"]["moves"]
    assert out["results"][0]["status"] == "done"
    config = LiveConfig.model_validate(config_dict(tmp_path, fake))
    with TestClient(create_app(config)) as client:
        (pod,) = successors(fake, pods)
        assert schedule(client, fake, pod, full_nodes=False) == ("n1", ["n1"])
    bound = read_pod(fake.get("pods", pod["metadata"]["name"], NS))
    assert bound.gpu_indices == tuple(move["gpus"])
    seen = observe_cluster(kube_client(config.kubernetes))
    assert seen.state is not None
    freed = int(out["plan"]["freed_gpus"][0].split()[1])
    assert seen.state.gpu_free[0, freed] == 1000


# ---------------------------------------------------------------- steering, on its own

SHAPE = (4000, 16384, 2, 1000)


def move(move_id: str, at: float = 100.0, uid: str = "uid-rs") -> PlannedMove:
    return PlannedMove(move_id, NS, uid, "ReplicaSet/rs", SHAPE, (0, 1), at, at + 600)


def successor(name: str, uid: str = "uid-rs") -> tuple[Any, Job]:
    pod = replace(read_pod(pod_json(name, 2, None)), controller_uid=uid)
    return pod, Job(f"{NS}/{name}", 4000, 16384, 2, 1000)


def test_each_move_steers_one_successor_and_a_retried_pod_keeps_its_move() -> None:
    steering = Steering(clock=lambda: 120.0)
    moves = {"n2": [move("m1", at=100.0)], "n3": [move("m2", at=101.0)]}
    first, second, third = successor("x"), successor("y"), successor("z")
    assert steering.steer(*first, moves, "uid-x") == Steer("n2", moves["n2"][0])
    assert steering.steer(*second, moves, "uid-y") == Steer("n3", moves["n3"][0])
    assert steering.steer(*first, moves, "uid-x") == Steer("n2", moves["n2"][0])
    assert steering.steer(*first, {}, "uid-x") == Steer("n2", moves["n2"][0])  # not listed yet
    assert steering.steer(*third, moves, "uid-z") is None  # both moves are taken
    other = successor("w", uid="uid-other")
    assert steering.steer(*other, moves, "uid-w") is None  # another controller's pod
    late = Steering(clock=lambda: 100.0 + 601)
    assert late.steer(*first, moves, "uid-x") is None  # expired


def test_filter_narrows_to_the_planned_node_or_holds_the_pod_a_while() -> None:
    steer = Steer("n2", move("m1", at=100.0))
    found = FilterResult(["n1", "n2"], {"n3": "full"}, {})
    narrowed = steer_filter(found, steer, now=110.0, hold_s=60)
    assert narrowed.passing == ["n2"] and "n2" in narrowed.failed["n1"]
    busy = FilterResult(["n1"], {"n2": "1 idle GPUs, job needs 2"}, {})
    held = steer_filter(busy, steer, now=110.0, hold_s=60)
    assert held.passing == [] and "cannot take it yet" in held.failed["n1"]
    assert steer_filter(busy, steer, now=200.0, hold_s=60) == busy  # held long enough
    never = FilterResult(["n1"], {}, {"n2": "node selector"})
    assert steer_filter(never, steer, now=110.0, hold_s=60) == never
    assert steer_scores([("n1", 10), ("n2", 9), ("n3", 0)], steer) == [
        ("n1", 9), ("n2", 10), ("n3", 0),
    ]  # fmt: skip
    assert steer_scores([("n1", 10), ("n2", 0)], steer) == [("n1", 10), ("n2", 0)]


def test_metrics_count_the_moves_like_the_scale_actions(tmp_path: Path, fake: FakeKube) -> None:
    from scaler.controller.defrag import Defragmenter
    from scaler.controller.metrics import DefragMetrics

    fragmented(fake)
    config = LiveConfig.model_validate(config_dict(tmp_path, fake))
    assert config.kubernetes is not None
    api = kube_client(config.kubernetes)
    outcome = Defragmenter(config, api, DecisionJournal(config.state_dir)).run(apply=True)
    metrics = DefragMetrics()
    metrics.observe(outcome, at=1000.0)

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    assert value("gpuscale_defrag_moves_total", status="done") == outcome.count("done") >= 1
    assert value("gpuscale_defrag_moves_total", status="blocked") == 1
    assert value("gpuscale_defrag_runs_total", result="ok") == 1
    assert value("gpuscale_defrag_planned_moves") == len(outcome.report.steps)
    assert value("gpuscale_defrag_window_moves") == outcome.count("done")
    assert value("gpuscale_defrag_last_run_timestamp_seconds") == 1000.0
