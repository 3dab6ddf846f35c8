"""`gpuscale defrag` against the fake API server, through the official client: the plan
on the live cluster, evictions that respect PodDisruptionBudgets, at most N moves per
window, nothing changed by a dry run, unmovable pods left alone, and the evicted pods'
successors steered by the extender onto the planned nodes so the plan's freed GPUs are
free."""

from __future__ import annotations

import copy
import json
import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fake_kube import FakeKube
from live_fixtures import pool, write_config
from typer.testing import CliRunner

from predictor.telemetry.kube_objects import KUBE_NAMES, SAFE_TO_EVICT_ANNOTATION, read_pod
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
SAFE_TO_EVICT = SAFE_TO_EVICT_ANNOTATION


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


def printed_defrag(tmp_path: Path, fake: FakeKube) -> str:
    """A dry run's output as people read it (wide enough for whole rows)."""
    path = write_config(tmp_path / "live.yaml", config_dict(tmp_path, fake))
    result = CliRunner().invoke(app, ["defrag", "--config", str(path)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    return result.output


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
    """Every planned eviction is asked as the API server's dry run, nothing else is written:
    e's budget refuses it, so the dry run says it would be refused and plans around it, as
    --apply would."""
    fragmented(fake)
    before = {kind: fake.objects(kind) for kind in ("nodes", "pods")}
    out = run_defrag(tmp_path, fake)
    plan = out["plan"]
    assert out["applied"] is False
    assert {kind: fake.objects(kind) for kind in ("nodes", "pods")} == before
    assert evictions(fake) == []
    written = [(m, path) for m, path in fake.requests if m in ("POST", "PATCH", "PUT", "DELETE")]
    assert written and all(m == "POST" and "/eviction?dryRun=All" in path for m, path in written)
    moved = {m["job"] for m in plan["moves"]}
    assert moved and moved <= {f"{NS}/a", f"{NS}/b", f"{NS}/c"}
    asked = {f"{NS}/{name}" for name in evictions(fake, dry=True)}
    assert moved | {f"{NS}/e"} <= asked <= {f"{NS}/a", f"{NS}/b", f"{NS}/c", f"{NS}/e"}
    (refused,) = out["results"]
    assert (refused["job"], refused["status"], refused["from"]) == (f"{NS}/e", "blocked", "n4")
    assert refused["result"].startswith(
        "would be refused: HTTP 429: Cannot evict pod as it would violate the pod's disruption"
    )
    assert refused["result"].endswith("(PodDisruptionBudget e-budget)")
    assert all(m["reason"] and m["unit"] for m in plan["moves"])
    assert plan["freed_nodes"] and plan["idle_gpus"]["after"] == plan["idle_gpus"]["before"]
    assert plan["idle_nodes"] == {"before": 0, "after": len(plan["freed_nodes"])}
    assert plan["largest_idle"]["after"] == 8
    assert plan["unmovable"] == {
        "not labelled gpuscale.io/movable=true nor of an allowed priority class": 1,
        "no controller would recreate it": 1,
        "its eviction was refused (a PodDisruptionBudget)": 1,
    }
    big = next(s for s in plan["shapes"] if s["label"].startswith(f"pending {NS}/big"))
    assert big["nodes_before"] == 0 and big["nodes_after"] >= 1
    # The dry run used nothing of the window and journaled no move.
    journal = DecisionJournal(tmp_path / "state")
    assert journal.load("defrag_window", []) == []
    assert [a for a in journal.actions() if a.kind == "defrag_move"] == []


def test_the_printed_plan_names_each_move_and_what_it_frees(tmp_path: Path, fake: FakeKube) -> None:
    fragmented(fake)
    out = printed_defrag(tmp_path, fake)
    assert "defragmentation plan (goal nodes, bestfit policy, dry run)" in out
    moved = [pod for pod in "abc" if f"{NS}/{pod} " in out]
    assert moved and "what it frees, per node" in out
    assert f"pending {NS}/big" in out and "(now placeable)" in out
    assert "left in place: 1 pod(s): no controller would recreate it" in out
    assert "moves made" not in out  # a dry run makes none
    assert "moves that would not be made" in out and "would be refused: HTTP 429" in out


@pytest.mark.parametrize("apply", [False, True], ids=["dry-run", "apply"])
def test_where_the_replans_run_out_the_plan_frees_only_what_its_moves_would(
    tmp_path: Path, fake: FakeKube, monkeypatch: pytest.MonkeyPatch, apply: bool
) -> None:
    """Where the plans made again run out (here at once), the unit of a move the dry-run
    eviction refused is not started: n4, the cheapest node to empty, keeps e (its budget),
    so n4 is not freed and n3 does not take e. The plan, its figures and the decision
    journaled are of n1's move alone: one node idle after, not two."""
    monkeypatch.setattr("scaler.controller.defrag.REPLANS", 0)
    fragmented(fake)
    out = run_defrag(tmp_path, fake, *(["--apply"] if apply else []))
    plan = out["plan"]
    refused = next(r for r in out["results"] if r["job"] == f"{NS}/e")
    assert (refused["status"], refused["unit"]) == ("blocked", "node n4")
    said = "not evicted" if apply else "would be refused"
    assert refused["result"].startswith(f"{said}: HTTP 429")
    assert plan["idle_nodes"] == {"before": 0, "after": 1}
    assert plan["freed_nodes"] == ["n1"]
    assert [(m["job"], m["frees"]) for m in plan["moves"]] == [(f"{NS}/a", "node n1")]
    assert plan["idle_gpus"] == {"before": 19, "after": 19}
    idle = {n["node"]: (n["idle_gpus_before"], n["idle_gpus_after"]) for n in plan["nodes"]}
    assert idle == {"n1": (6, 8), "n2": (5, 3)}
    shapes = {s["label"]: (s["nodes_before"], s["nodes_after"]) for s in plan["shapes"]}
    assert shapes["mix: 8 GPUs, 64 CPU, 256 GiB"] == (0, 1)
    assert plan["unmovable"]["its eviction was refused (a PodDisruptionBudget)"] == 1
    (decision,) = DecisionJournal(tmp_path / "state").decisions()
    assert decision.plan == plan
    assert evictions(fake) == (["a"] if apply else [])
    if not apply:
        printed = printed_defrag(tmp_path, fake)
        assert "dry run): 1 moves;" in printed
        assert "nodes with every GPU idle 0 -> 1" in printed


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
    assert value("gpuscale_defrag_refused_moves") == 1
    assert value("gpuscale_defrag_runs_total", result="ok") == 1
    assert value("gpuscale_defrag_planned_moves") == len(outcome.report.steps)
    assert value("gpuscale_defrag_window_moves") == outcome.count("done")
    assert value("gpuscale_defrag_last_run_timestamp_seconds") == 1000.0


def test_a_dry_run_counts_no_move_and_shows_what_a_budget_would_refuse(
    tmp_path: Path, fake: FakeKube
) -> None:
    # Each dry-run pass of `defrag --every` foresaw the same refusal and counted it again
    # among the moves blocked, though nothing was ever asked to move.
    from scaler.controller.defrag import Defragmenter
    from scaler.controller.metrics import DefragMetrics

    fragmented(fake)
    config = LiveConfig.model_validate(config_dict(tmp_path, fake))
    assert config.kubernetes is not None
    api = kube_client(config.kubernetes)
    metrics = DefragMetrics()
    for at in (1000.0, 1060.0):
        outcome = Defragmenter(config, api, DecisionJournal(config.state_dir)).run(apply=False)
        assert outcome.count("blocked") == 1
        metrics.observe(outcome, at=at)
    samples = {
        s.labels["status"]: s.value
        for family in metrics.registry.collect()
        if family.name == "gpuscale_defrag_moves"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert samples == {}
    assert metrics.registry.get_sample_value("gpuscale_defrag_refused_moves") == 1
    assert metrics.registry.get_sample_value("gpuscale_defrag_runs_total", {"result": "ok"}) == 2


# ---------------------------------------------------------------- MIG repartitions

SEVEN_1G = ",".join(f"1g.10gb@{s}" for s in range(7))
TWO_BY_1G = f"0={SEVEN_1G};1={SEVEN_1G}"  # two A100-80GB GPUs, seven 1g instances each
# A few configs as the GPU operator's mig-parted file writes them (`mig-configs`).
MIG_CONFIGS: dict[str, list[dict[str, Any]]] = {
    "all-1g.10gb": [{"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb": 7}}],
    "all-7g.80gb": [{"devices": "all", "mig-enabled": True, "mig-devices": {"7g.80gb": 1}}],
    "half-7g": [
        {"devices": [0], "mig-enabled": True, "mig-devices": {"1g.10gb": 7}},
        {"devices": [1], "mig-enabled": True, "mig-devices": {"7g.80gb": 1}},
    ],
    "all-balanced": [
        {"device-filter": ["0x233010DE"], "devices": "all", "mig-enabled": True,
         "mig-devices": {"1g.12gb": 2, "2g.24gb": 1, "3g.47gb": 1}},  # an H100 NVL's
        {"device-filter": ["0x20B510DE"], "devices": "all", "mig-enabled": True,
         "mig-devices": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}},
    ],
    "all-disabled": [{"devices": "all", "mig-enabled": False}],
}  # fmt: skip
MIG = {"configs": MIG_CONFIGS, "wait_s": 5, "poll_s": 0.01}
CONFIG_LABEL = "nvidia.com/mig.config"
STATE_LABEL = "nvidia.com/mig.config.state"


def mig_node_json(
    name: str, layout: str = TWO_BY_1G, config: str | None = "all-1g.10gb"
) -> dict[str, Any]:
    """A node of two MIG GPUs (no whole one) the MIG manager manages with `config`
    (None: one it does not manage), its instances in gpuscale's layout annotation."""
    labels = {
        "gpuscale.io/pool": "a100",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
        "nvidia.com/gpu.count": "2",
    }
    if config is not None:
        labels |= {CONFIG_LABEL: config, STATE_LABEL: "success"}
    return {
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {KUBE_NAMES.mig_layout_annotation: layout},
        },
        "spec": {"providerID": f"aws:///us-east-1a/i-{name}"},
        "status": {
            "allocatable": {
                "cpu": "96", "memory": "1Ti", "nvidia.com/gpu": "0", "nvidia.com/mig-1g.10gb": "14"
            },
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }  # fmt: skip


def mig_pod_json(
    name: str, profile: str, node: str | None, instance: int | None = None
) -> dict[str, Any]:
    """A pod of a ReplicaSet asking one `profile` instance, on `node` (None: pending); our
    bind's record of its instance where `instance` is given."""
    pod = pod_json(name, 0, node, owner=f"rs-{name}")
    requests = pod["spec"]["containers"][0]["resources"]["requests"]
    del requests["nvidia.com/gpu"]
    requests[f"nvidia.com/mig-{profile}"] = "1"
    if instance is not None:
        pod["metadata"]["annotations"] = {KUBE_NAMES.gpus_annotation: str(instance)}
    return pod


class FakeMigManager:
    """Plays the GPU operator's MIG manager: a node whose nvidia.com/mig.config was set
    with the state `pending` gets that config's instance counts as its allocatable and the
    state `answer` (at once, or when the test calls `finish`)."""

    def __init__(self, fake: FakeKube, answer: str = "success", at_once: bool = True) -> None:
        self.fake = fake
        self.answer = answer
        self.at_once = at_once
        self.applied: list[tuple[str, str]] = []  # (node, config)
        fake.on_write.append(self._react)

    def _react(self, type_: str, plural: str, obj: dict[str, Any]) -> None:
        if plural == "nodes" and type_ == "MODIFIED" and self.at_once:
            self.finish(obj["metadata"]["name"])

    def finish(self, name: str) -> None:
        node = self.fake.get("nodes", name)
        labels = node["metadata"].get("labels", {})
        if labels.get(STATE_LABEL) != "pending":
            return
        config = labels[CONFIG_LABEL]
        counts: dict[str, int] = {}
        for gpu in (0, 1):
            chosen = [e for e in MIG_CONFIGS[config] if e["devices"] in ("all", [gpu], [0, 1])]
            for profile, count in chosen[-1].get("mig-devices", {}).items():
                counts[profile] = counts.get(profile, 0) + count
        old = node["status"]["allocatable"]
        allocatable: dict[str, str | None] = {
            k: None for k in old if k.startswith("nvidia.com/mig-")
        }
        allocatable |= {f"nvidia.com/mig-{p}": str(c) for p, c in counts.items()}
        self.applied.append((name, config))
        self.fake.patch(
            "nodes",
            name,
            {
                "metadata": {"labels": {STATE_LABEL: self.answer}},
                "status": {"allocatable": allocatable},
            },
        )


def writes(fake: FakeKube) -> list[tuple[str, str]]:
    return [(m, p) for m, p in fake.requests if m in ("POST", "PATCH", "PUT", "DELETE")]


def test_a_repartition_is_planned_and_applied_on_an_empty_gpu(
    tmp_path: Path, fake: FakeKube
) -> None:
    """GPU 0 of m1 runs a 1g pod, GPU 1 is idle; a pod waits for a 7g, which no instance
    offers. The config that clears only GPU 1 is chosen (all-7g.80gb would clear GPU 0
    too, under the running pod), asked of the MIG manager, and the pod then goes there."""
    mig_manager = FakeMigManager(fake)
    fake.create("nodes", mig_node_json("m1"))
    fake.create("pods", mig_pod_json("small", "1g.10gb", "m1", instance=0))
    fake.create("pods", mig_pod_json("big", "7g.80gb", None))
    out = run_defrag(tmp_path, fake, "--apply", mig=MIG)
    (step,) = out["plan"]["repartitions"]
    assert step["node"] == "m1" and step["gpus"] == [1]
    assert (step["config_from"], step["config_to"]) == ("all-1g.10gb", "half-7g")
    assert step["layout_from"] == f"1={SEVEN_1G}" and step["layout_to"] == "1=7g.80gb@0"
    assert step["serves"] == [f"{NS}/big"] and "1 x 7g.80gb" in step["frees"]
    assert "GPU(s) 1 of m1 run no pod" in step["reason"]
    assert out["plan"]["mig_unserved"] == [] and out["plan"]["moves"] == []
    big = next(s for s in out["plan"]["shapes"] if s["label"].startswith(f"pending {NS}/big"))
    assert (big["nodes_before"], big["nodes_after"]) == (0, 1)
    (done,) = out["repartitions"]
    assert done["status"] == "done" and done["asked"] and "applied half-7g" in done["result"]
    # The label the MIG manager acts on, with the state this change then reports.
    assert mig_manager.applied == [("m1", "half-7g")]
    node = fake.get("nodes", "m1")
    assert node["metadata"]["labels"][CONFIG_LABEL] == "half-7g"
    assert node["metadata"]["labels"][STATE_LABEL] == "success"
    # gpuscale's layout annotation follows: GPU 0 as it was, GPU 1 as the config made it.
    layout = node["metadata"]["annotations"][KUBE_NAMES.mig_layout_annotation]
    assert layout == f"0={SEVEN_1G};1=7g.80gb"
    # The small pod was never asked to move; journaled, counted in the window.
    assert evictions(fake) == [] and evictions(fake, dry=True) == []
    journal = DecisionJournal(tmp_path / "state")
    (action,) = [a for a in journal.actions() if a.kind == "defrag_repartition"]
    assert (action.target, action.status, action.params["config_to"]) == ("m1", "done", "half-7g")
    assert len(journal.load("defrag_window", [])) == 1 and journal.pending() == []
    # The waiting pod now finds its instance, through the extender.
    config = LiveConfig.model_validate(config_dict(tmp_path, fake))
    with TestClient(create_app(config)) as client:
        node_name, _ = schedule(client, fake, fake.get("pods", "big", NS), full_nodes=False)
    assert node_name == "m1"
    assert read_pod(fake.get("pods", "big", NS)).gpu_indices == (7,)  # the 7g of GPU 1


def test_a_repartition_under_a_pod_is_refused_with_the_reason(
    tmp_path: Path, fake: FakeKube
) -> None:
    """m1: a 1g pod on each GPU. m2: a 1g pod bound without the extender (its instance
    unknown, so either GPU may be it). m3: not managed by the MIG manager. Every config
    that would make the 7g clears a GPU a pod may use: nothing is asked."""
    FakeMigManager(fake)
    fake.create("nodes", mig_node_json("m1"))
    fake.create("nodes", mig_node_json("m2"))
    fake.create("nodes", mig_node_json("m3", config=None))
    fake.create("pods", mig_pod_json("on-gpu0", "1g.10gb", "m1", instance=0))
    fake.create("pods", mig_pod_json("on-gpu1", "1g.10gb", "m1", instance=8))
    fake.create("pods", mig_pod_json("somewhere", "1g.10gb", "m2"))
    fake.create("pods", mig_pod_json("big", "7g.80gb", None))
    before = fake.objects("nodes")
    out = run_defrag(tmp_path, fake, "--apply", mig=MIG)
    plan = out["plan"]
    assert plan["repartitions"] == [] and out["repartitions"] == []
    refused = {r["node"]: r for r in plan["mig_refused"]}
    assert refused["m1"]["config"] == "half-7g" and refused["m1"]["would_serve"] == [f"{NS}/big"]
    assert refused["m1"]["why"].startswith(f"{NS}/on-gpu1 runs on 1g.10gb@1 of GPU 1")
    assert "only GPUs no pod uses are repartitioned" in refused["m1"]["why"]
    assert refused["m2"]["why"] == (
        f"{NS}/somewhere runs on a 1g.10gb instance of the node, not recorded which,"
        " which half-7g clears (only GPUs no pod uses are repartitioned)"
    )
    assert "not managed by the GPU operator's MIG manager" in refused["m3"]["why"]
    ((pod, why),) = [(u["pod"], u["why"]) for u in plan["mig_unserved"]]
    assert pod == f"{NS}/big" and "no free 7g.80gb instance" in why
    assert fake.objects("nodes") == before and writes(fake) == []
    assert DecisionJournal(tmp_path / "state").load("defrag_window", []) == []


def test_a_pod_bound_after_the_listing_stops_its_repartition(
    tmp_path: Path, fake: FakeKube
) -> None:
    """The plan saw GPU 1 idle; a pod lands on it before the change is asked. The node's
    pods are listed again just before: the change is not asked, nor counted."""
    from scaler.controller.defrag import Defragmenter

    mig_manager = FakeMigManager(fake)
    fake.create("nodes", mig_node_json("m1"))
    fake.create("pods", mig_pod_json("big", "7g.80gb", None))
    config = LiveConfig.model_validate(config_dict(tmp_path, fake, mig=MIG))
    assert config.kubernetes is not None

    def observe_then_bind(api: Any, names: Any) -> Any:
        seen = observe_cluster(api, names)
        fake.create("pods", mig_pod_json("late", "1g.10gb", "m1", instance=7))
        return seen

    api = kube_client(config.kubernetes)
    journal = DecisionJournal(config.state_dir)
    outcome = Defragmenter(config, api, journal, observe=observe_then_bind).run(apply=True)
    (step,) = outcome.report.repartitions
    assert step.gpus == (1,)
    (result,) = outcome.repartitions
    assert result.status == "blocked" and not result.asked
    assert f"{NS}/late runs on 1g.10gb@0 of GPU 1" in result.result
    assert mig_manager.applied == []
    assert fake.get("nodes", "m1")["metadata"]["labels"][CONFIG_LABEL] == "all-1g.10gb"
    assert journal.load("defrag_window", []) == []
    (action,) = [a for a in journal.actions() if a.kind == "defrag_repartition"]
    assert action.status == "blocked"


def test_repartitions_count_against_the_move_limit(tmp_path: Path, fake: FakeKube) -> None:
    """Three pods wait for a 7g on two idle nodes: one change (all-7g.80gb, two 7g) serves
    two; the third needs the other node, which one move a window does not allow."""
    mig_manager = FakeMigManager(fake)
    for name in ("m1", "m2"):
        fake.create("nodes", mig_node_json(name))
    for name in ("big-a", "big-b", "big-c"):
        fake.create("pods", mig_pod_json(name, "7g.80gb", None))
    first = run_defrag(tmp_path, fake, "--apply", "--max-moves", "1", mig=MIG)
    (step,) = first["plan"]["repartitions"]
    assert first["plan"]["budget"] == 1
    assert (step["node"], step["config_to"], step["gpus"]) == ("m1", "all-7g.80gb", [0, 1])
    assert len(step["serves"]) == 2
    ((_, why),) = [(u["pod"], u["why"]) for u in first["plan"]["mig_unserved"]]
    assert "within the 1 change(s) allowed" in why
    assert [r["status"] for r in first["repartitions"]] == ["done"]
    # The window is spent: the second pass plans none (two 7g pods now have free
    # instances; the third still waits).
    second = run_defrag(tmp_path, fake, "--apply", "--max-moves", "1", mig=MIG)
    assert second["plan"]["made_in_window"] == 1 and second["plan"]["budget"] == 0
    assert second["plan"]["repartitions"] == [] and second["repartitions"] == []
    assert len(second["plan"]["mig_unserved"]) == 1
    assert mig_manager.applied == [("m1", "all-7g.80gb")]
    asked = [p for m, p in writes(fake) if m == "PATCH" and "/nodes/" in p]
    assert len(asked) == 2  # the label, then the layout annotation: one node only
    # The window has passed: the other node is repartitioned, one GPU of it enough.
    journal = DecisionJournal(tmp_path / "state")
    journal.save("defrag_window", [t - 7200 for t in journal.load("defrag_window", [])])
    third = run_defrag(tmp_path, fake, "--apply", "--max-moves", "1", mig=MIG)
    assert [(r["node"], r["config_to"], r["status"]) for r in third["repartitions"]] == [
        ("m2", "half-7g", "done")
    ]


def test_a_dry_run_plans_repartitions_and_changes_nothing(tmp_path: Path, fake: FakeKube) -> None:
    mig_manager = FakeMigManager(fake)
    fake.create("nodes", mig_node_json("m1"))
    fake.create("pods", mig_pod_json("big", "7g.80gb", None))
    before = {kind: fake.objects(kind) for kind in ("nodes", "pods")}
    out = run_defrag(tmp_path, fake, mig=MIG)
    assert out["applied"] is False and out["repartitions"] == []
    (step,) = out["plan"]["repartitions"]
    assert step["node"] == "m1" and step["config_to"] in ("half-7g", "all-7g.80gb")
    assert step["gpus"] == [0] or step["gpus"] == [1]  # one idle GPU is enough
    assert {kind: fake.objects(kind) for kind in ("nodes", "pods")} == before
    assert writes(fake) == [] and mig_manager.applied == []
    journal = DecisionJournal(tmp_path / "state")
    assert journal.load("defrag_window", []) == []
    assert [a for a in journal.actions() if a.kind == "defrag_repartition"] == []
    # Without the cluster's configs, the waiting pod is named with what it would take.
    plain = run_defrag(tmp_path, fake)
    assert plain["plan"]["repartitions"] == []
    ((_, why),) = [(u["pod"], u["why"]) for u in plain["plan"]["mig_unserved"]]
    assert "defrag.mig.configs" in why


def test_a_failed_or_unfinished_repartition_is_reported_and_settled_later(
    tmp_path: Path, fake: FakeKube
) -> None:
    from scaler.controller.defrag import Defragmenter
    from scaler.controller.metrics import DefragMetrics

    mig_manager = FakeMigManager(fake, at_once=False)
    fake.create("nodes", mig_node_json("m1"))
    fake.create("nodes", mig_node_json("m2"))
    for name in ("big-a", "big-b", "big-c"):
        fake.create("pods", mig_pod_json(name, "7g.80gb", None))
    config = LiveConfig.model_validate(
        config_dict(tmp_path, fake, mig=MIG | {"wait_s": 0}, max_moves=1)
    )
    assert config.kubernetes is not None
    api = kube_client(config.kubernetes)
    journal = DecisionJournal(config.state_dir)
    # The MIG manager is slow: the pass stops waiting, the change stays journaled pending.
    outcome = Defragmenter(config, api, journal).run(apply=True)
    ((result,)) = outcome.repartitions
    node = result.step.node
    assert result.status == "requested" and "nvidia.com/mig.config.state=pending" in result.result
    assert outcome.errors == [] and [a.target for a in journal.pending()] == [node]
    metrics = DefragMetrics()
    metrics.observe(outcome, at=1.0)
    sample = metrics.registry.get_sample_value
    assert sample("gpuscale_defrag_repartitions_total", {"status": "requested"}) == 1
    assert sample("gpuscale_defrag_planned_repartitions", {}) == 1
    assert sample("gpuscale_defrag_window_moves", {}) == 1
    # The next pass settles it once the MIG manager has answered.
    mig_manager.finish(node)
    settled = Defragmenter(config, api, journal).run(apply=True).settled
    assert settled and settled[0]["node"] == node and settled[0]["status"] == "done"
    assert journal.pending() == []
    annotations = fake.get("nodes", node)["metadata"]["annotations"]
    assert annotations[KUBE_NAMES.mig_layout_annotation] == "0=7g.80gb;1=7g.80gb"
    # A change the MIG manager fails (the third pod's, on the other node) is an error, and
    # its node is left alone after.
    journal.save("defrag_window", [])
    mig_manager.answer, mig_manager.at_once = "failed", True
    failed = run_defrag_failing(tmp_path, fake, mig=MIG, max_moves=1)
    ((change,)) = failed["repartitions"]
    assert change["status"] == "failed" and "failed to apply half-7g" in change["result"]
    assert failed["errors"] == [change["result"]]
    again = run_defrag(tmp_path, fake, mig=MIG, max_moves=1)
    refused = {r["node"]: r["why"] for r in again["plan"]["mig_refused"]}
    assert (
        refused[change["node"]] == "its last MIG change failed (nvidia.com/mig.config.state=failed)"
    )


def run_defrag_failing(tmp_path: Path, fake: FakeKube, **defrag: Any) -> dict[str, Any]:
    """`gpuscale defrag --apply` that must exit 1 (an action failed), its JSON."""
    path = write_config(tmp_path / "live.yaml", config_dict(tmp_path, fake, **defrag))
    result = CliRunner().invoke(app, ["defrag", "--config", str(path), "--json", "--apply"])
    assert result.exit_code == 1, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def test_a_config_does_to_a_node_what_mig_parted_would() -> None:
    """Entries apply in order (the last selecting a GPU wins), a GPU already as asked is
    skipped, an entry of another GPU family (device-filter) does not apply, and a config
    that turns MIG on or off is no option."""
    from scaler.cluster.mig import parse_layout
    from scaler.cluster.mig_parted import MigConfigEntry, node_options, resolve

    def entries(name: str) -> list[MigConfigEntry]:
        return [MigConfigEntry.model_validate(e) for e in MIG_CONFIGS[name]]

    layout = parse_layout(f"0={SEVEN_1G};1=7g.80gb", "80GB")
    half = resolve("half-7g", entries("half-7g"), layout, whole=[])
    assert half == "half-7g changes no MIG GPU of the node"
    seven = resolve("all-7g.80gb", entries("all-7g.80gb"), layout, whole=[])
    assert not isinstance(seven, str) and seven.gpus == (0,)
    assert seven.layout.text() == "0=7g.80gb@0;1=7g.80gb@0"
    balanced = resolve("all-balanced", entries("all-balanced"), layout, whole=[])
    assert not isinstance(balanced, str) and balanced.gpus == (0, 1)  # the A100 entry only
    assert balanced.layout.text().startswith("0=2g.20gb@0,1g.10gb@2,1g.10gb@3,3g.40gb@4;")
    assert "turns MIG off on GPU 0" in str(resolve("all-disabled", entries("all-disabled"),
                                                   layout, whole=[]))  # fmt: skip
    # A mixed node (GPUs 0-5 whole, 6-7 MIG): `devices: all` would turn MIG on on GPU 0.
    mixed = parse_layout(f"6={SEVEN_1G};7={SEVEN_1G}", "80GB")
    assert "turns MIG on on GPU 0" in str(resolve("all-7g.80gb", entries("all-7g.80gb"),
                                                  mixed, whole=range(6)))  # fmt: skip
    configs = {name: entries(name) for name in MIG_CONFIGS}
    assert [o.name for o in node_options(configs, layout, whole_gpus=0)] == [
        "all-1g.10gb", "all-7g.80gb", "all-balanced"
    ]  # fmt: skip
    assert node_options(configs, mixed, whole_gpus=6) == []


# ---------------------------------------------------------------- a stale listing


def three_nodes(fake: FakeKube, b_gpus: int) -> None:
    """n1: a (2 GPUs); n2: b (`b_gpus`); n3: c (4); each of its own ReplicaSet, movable."""
    for name in ("n1", "n2", "n3"):
        fake.create("nodes", node_json(name))
    fake.create("pods", pod_json("a", 2, "n1", labels=MOVABLE))
    fake.create("pods", pod_json("b", b_gpus, "n2", labels=MOVABLE, owner="rs-b"))
    fake.create("pods", pod_json("c", 4, "n3", labels=MOVABLE, owner="rs-c"))


def test_each_pod_is_read_again_just_before_its_eviction(tmp_path: Path, fake: FakeKube) -> None:
    """Between the listing and the evictions (the dry runs, the wait for the service to
    list the notes, the earlier evictions) pods change: n1's `a` is annotated safe-to-evict
    "false" and n2's `b` is replaced by a pod of the same name on n3 (a StatefulSet's pod
    comes back under its name). Neither is evicted: each pod is read again just before, and
    the eviction names the uid read, so it never takes another pod of that name."""
    from scaler.controller.defrag import Defragmenter

    three_nodes(fake, b_gpus=1)
    config = LiveConfig.model_validate(
        config_dict(tmp_path, fake) | {"placement": {"sync_s": 1, "policy": "bestfit"}}
    )
    assert config.kubernetes is not None

    def meanwhile(_: float) -> None:  # the wait for the service: the cluster changes
        fake.patch("pods", "a", {"metadata": {"annotations": {SAFE_TO_EVICT: "false"}}}, NS)
        fake.delete("pods", "b", NS)
        fake.create("pods", pod_json("b", 1, "n3", labels=MOVABLE, owner="rs-b"))

    api = kube_client(config.kubernetes)
    journal = DecisionJournal(config.state_dir)
    outcome = Defragmenter(config, api, journal, sleep=meanwhile).run(apply=True)
    planned = {s.job for s in outcome.report.steps}
    assert {f"{NS}/a", f"{NS}/b"} <= planned
    assert evictions(fake) == []
    by_job = {r.step.job: r for r in outcome.results}
    assert by_job[f"{NS}/a"].status == "skipped"
    assert 'safe-to-evict "false"' in by_job[f"{NS}/a"].result
    assert by_job[f"{NS}/b"].status == "skipped"
    assert "now on n3, not n2" in by_job[f"{NS}/b"].result
    assert fake.get("pods", "a", NS)["spec"]["nodeName"] == "n1"
    assert fake.get("pods", "b", NS)["spec"]["nodeName"] == "n3"
    assert journal.load("defrag_window", []) == []  # nothing made, nothing counted
    assert journal.pending() == []
    # The notes of the moves not made are taken off their targets.
    assert all(
        not read_moves(n["metadata"].get("annotations") or {}) for n in fake.objects("nodes")
    )


def test_an_eviction_names_the_uid_it_read(tmp_path: Path, fake: FakeKube) -> None:
    """The Eviction API's precondition: a pod recreated under the name in between (a
    StatefulSet's) is not evicted by an eviction meant for the one read."""
    from scaler.kube.evictions import request_eviction

    fake.create("nodes", node_json("n1"))
    old = read_pod(fake.create("pods", pod_json("s-0", 1, "n1", labels=MOVABLE)))
    uid = fake.get("pods", "s-0", NS)["metadata"]["uid"]
    fake.delete("pods", "s-0", NS)
    fake.create("pods", pod_json("s-0", 1, "n1", labels=MOVABLE))
    config = LiveConfig.model_validate(config_dict(tmp_path, fake))
    assert config.kubernetes is not None
    api = kube_client(config.kubernetes)
    blocked = request_eviction(api, old, uid=uid)
    assert blocked is not None and "409" in blocked.reason
    assert fake.get("pods", "s-0", NS)  # the new pod stays


# ---------------------------------------------------------------- moves on their way


def test_a_later_pass_leaves_the_room_an_earlier_move_holds(tmp_path: Path, fake: FakeKube) -> None:
    """Pass 1 moves `a` onto n2; its successor is created but not bound yet (held while
    `a` terminates, or the scheduler has not got to it) when pass 2 runs, as `--every` does.
    Pass 2 sees n2's noted GPUs free: it must neither empty n2 (the successor is on its way
    there, so n2 would not be freed and `b` would be moved for nothing) nor plan a move
    onto the GPUs the successor is to get."""
    three_nodes(fake, b_gpus=4)
    pods = {p["metadata"]["name"]: p for p in fake.objects("pods", NS)}
    first = run_defrag(tmp_path, fake, "--apply")
    (moved,) = [r for r in first["results"] if r["status"] == "done"]
    assert moved["job"] == f"{NS}/a"
    successors(fake, pods)  # a-next: pending, steered to moved["to"]
    second = run_defrag(tmp_path, fake, "--apply")
    plan = second["plan"]
    assert all(m["from"] != moved["to"] for m in plan["moves"]), plan["moves"]
    for m in plan["moves"]:
        assert m["to"] != moved["to"] or not set(m["gpus"]) & set(moved["gpus"]), m
    assert f"node {moved['to']}" not in plan["freed_nodes"]
    assert evictions(fake) == ["a"]
    # Once the successor has landed on the noted GPUs, the room is its own: nothing awaited.
    from scaler.controller.defrag_plan import awaited

    gpus = ",".join(map(str, moved["gpus"]))
    annotations = {KUBE_NAMES.gpus_annotation: gpus}
    fake.patch(
        "pods",
        "a-next",
        {"metadata": {"annotations": annotations}, "spec": {"nodeName": moved["to"]}},
        NS,
    )
    fake.patch("pods", "a-next", {"status": {"phase": "Running"}}, NS)
    config = LiveConfig.model_validate(config_dict(tmp_path, fake))
    assert config.kubernetes is not None
    seen = observe_cluster(kube_client(config.kubernetes))
    assert seen.moves.get(moved["to"]) and awaited(seen, time.time()) == []


# ---------------------------------------------------------------- gangs


def test_gang_members_are_never_moved(tmp_path: Path, fake: FakeKube) -> None:
    """A two-pod JobSet (one member on n1, one on n2) and a pod of a Kueue pod set placed
    by topology, all labelled movable: evicting one member stops the whole job, and moves
    go one pod at a time, so none is planned, even with --apply; a lone pod still moves."""
    for name in ("n1", "n2", "n3"):
        fake.create("nodes", node_json(name))
    jobset = MOVABLE | {"jobset.sigs.k8s.io/jobset-name": "train"}
    fake.create("pods", pod_json("w-0", 2, "n1", labels=jobset, owner="job-train"))
    fake.create("pods", pod_json("w-1", 2, "n2", labels=jobset, owner="job-train"))
    tas = pod_json("t-0", 1, "n3", labels=MOVABLE, owner="job-tas")
    tas["metadata"]["annotations"] = {"kueue.x-k8s.io/podset-required-topology": "rack"}
    fake.create("pods", tas)
    fake.create("pods", pod_json("lone", 1, "n3", labels=MOVABLE, owner="rs-lone"))
    out = run_defrag(tmp_path, fake, "--apply")
    plan = out["plan"]
    moved = {m["job"] for m in plan["moves"]}
    assert not moved & {f"{NS}/w-0", f"{NS}/w-1", f"{NS}/t-0"}
    assert set(evictions(fake) + evictions(fake, dry=True)) <= {"lone"}
    unmovable = plan["unmovable"]
    assert (
        unmovable[
            "a gang member (jobset.sigs.k8s.io/jobset-name=train): its members are not moved one"
            " at a time"
        ]
        == 2
    )
    assert (
        unmovable[
            "a gang member (Kueue's podset topology): its members are not moved one at a time"
        ]
        == 1
    )
