"""End to end: a real Prometheus, moto in server mode and the fake Kubernetes API server.

Demand is what kube-state-metrics shows in Prometheus (GPUs of running and pending pods);
`gpuscale collect --once` brings it into the store and `gpuscale scale --apply --once`
acts: when demand rises the forecast rises, the Auto Scaling group's desired capacity is
raised in moto and placeholder pods hold the new GPUs; when it falls, surplus nodes are
cordoned and drained through the Eviction API and the group shrinks by exactly the nodes
that went, while a node whose pod a PodDisruptionBudget guards stays (uncordoned).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from fake_kube import FakeKube
from live_fixtures import (
    Asg,
    aws_config,
    aws_env,
    register_nodes,
    run_pod,
    scale_app,
    write_config,
)
from prometheus_fixture import GpuExporter, PrometheusServer, Values, labels
from typer.testing import CliRunner

from predictor.telemetry.config import pod_gpu_requests
from predictor.telemetry.kube_objects import KUBE_NAMES
from scaler.cli import app as gpuscale
from scaler.controller.journal import DecisionJournal

pytestmark = pytest.mark.integration

DEMAND = pod_gpu_requests("Running|Pending")


def demand_values(pods: int) -> Values:
    """kube-state-metrics: `pods` running training pods of 8 GPUs each."""
    requests = {}
    phases = {}
    for i in range(pods):
        key = labels(namespace="ml", pod=f"train-{i}", container="main")
        requests[(*key, ("resource", "nvidia_com_gpu"))] = 8.0
        phases[labels(namespace="ml", pod=f"train-{i}", phase="Running")] = 1.0
    return {"kube_pod_container_resource_requests": requests, "kube_pod_status_phase": phases}


def show_demand(prometheus: PrometheusServer, exporter: GpuExporter, pods: int) -> None:
    exporter.publish(demand_values(pods))
    expected = str(8 * pods)
    prometheus.wait_for(DEMAND, lambda r: bool(r) and r[0]["value"][1] == expected)


def collect(config: Path, state_dir: Path) -> None:
    time.sleep(1.0)  # a new grid second, so the sample is a new point
    args = ["collect", "--once", "--json", "--config", str(config), "--state-dir", str(state_dir)]
    result = CliRunner().invoke(gpuscale, args)
    assert result.exit_code == 0, result.output
    (sample,) = json.loads(result.stdout)["samples"]
    assert sample["error"] is None and sample["points"] == 1


def scale(config: Path, *args: str) -> dict[str, Any]:
    result = CliRunner().invoke(scale_app(), ["scale", "--config", str(config), "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_demand_up_scales_the_group_and_pre_positions_then_down_drains_and_shrinks(
    tmp_path: Path,
    moto: Any,
    prometheus: tuple[PrometheusServer, GpuExporter],
    fake: FakeKube,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from moto_fixture import session

    for key, value in aws_env().items():
        monkeypatch.setenv(key, value)
    server, exporter = prometheus
    state_dir = tmp_path / "state"
    asg = Asg.create(session(), moto.url, desired=2)
    nodes = register_nodes(fake, asg)
    first, second = (nodes[i] for i in asg.in_service())
    run_pod(fake, "train-0", first, gpus=8)  # real work: this node is never taken away
    fake.create(
        "poddisruptionbudgets",
        {
            "metadata": {"name": "serve-pdb", "namespace": "ml"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "serve"}}},
        },
    )
    run_pod(fake, "serve-0", second, labels={"app": "serve"})  # guarded: blocks its node

    collect_config = write_config(
        tmp_path / "collect.yaml",
        {
            "interval_s": 1,
            "retry": {"attempts": 1},
            "prometheus": {
                "url": server.url,
                "backfill_s": 0,
                "series": [
                    {"metric": "gpu_demand", "query": DEMAND, "unique_id": "a100", "labels": []}
                ],
            },
        },
    )
    live_config = aws_config(
        tmp_path / "live.yaml",
        moto.url,
        asg,
        state_dir,
        kubernetes={
            "host": fake.url,
            # All four surplus nodes in one pass (the default cap is 3).
            "drain": {"timeout_s": 0.3, "poll_s": 0.05, "unremovable_s": 600, "max_nodes": 4},
        },
        lease={"identity": "e2e", "duration_s": 5, "renew_deadline_s": 4, "retry_s": 1},
        placement={"mix": [{"num_gpu": 8}]},  # whole-node jobs: placeholders of 8 GPUs
    )

    # One training pod: the forecast sees 8 GPUs.
    show_demand(server, exporter, pods=1)
    collect(collect_config, state_dir)
    before = scale(live_config, "--once")  # a dry run changes nothing
    assert before["plan"]["needs"][0]["add_to"] == 8.0
    assert asg.desired == 2

    # Demand rises to five pods: the forecast rises, the group grows, placeholders hold it.
    show_demand(server, exporter, pods=5)
    collect(collect_config, state_dir)
    up = scale(live_config, "--apply", "--once")
    assert up["applied"] and up["errors"] == []
    assert up["plan"]["needs"][0]["add_to"] == 40.0
    assert up["plan"]["final_desired"] == {"a100": 5}
    assert asg.desired == 5 and len(asg.in_service()) == 5
    placeholders = fake.objects("pods", "gpuscale-system")
    assert len(placeholders) == 4  # the mix packed onto 5 nodes, train-0's aside
    for pod in placeholders:
        assert pod["spec"]["nodeSelector"] == {"gpuscale.io/pool": "a100"}
        assert pod["spec"]["priorityClassName"] == "gpuscale-placeholder"
        assert pod["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "8"
    assert fake.get("priorityclasses", "gpuscale-placeholder")["value"] < 0
    lease = fake.get("leases", "gpuscale-scaler", "gpuscale-system")
    assert lease["spec"]["holderIdentity"] is None  # held while acting, released on exit
    assert any(m == "PUT" and "/leases/" in p for m, p in fake.requests)

    old = {i for i, n in nodes.items()}
    nodes = register_nodes(fake, asg)  # the three new instances join the cluster
    newcomers = sorted(set(nodes) - old)
    run_pod(fake, "batch-0", nodes[newcomers[0]])  # unguarded: evicted by the drain

    # Demand falls back to one pod: everything but the busy node should go, but the budget
    # keeps serve-0's node.
    show_demand(server, exporter, pods=1)
    collect(collect_config, state_dir)
    down = scale(live_config, "--apply", "--once")
    assert down["plan"]["final_desired"] == {"a100": 1}
    removed = {a["node"] for a in down["actions"] if a["action"] == "remove_node"}
    assert removed == {i for i, n in nodes.items() if n != first}
    outcomes = {a["node"]: a for a in down["actions"] if a["action"] == "remove_node"}
    blocked = [i for i, a in outcomes.items() if a["status"] == "blocked"]
    gone = sorted(i for i, a in outcomes.items() if a["status"] == "done")
    assert [nodes[i] for i in blocked] == [second]
    (blocking,) = outcomes[blocked[0]]["blocking"]
    assert blocking["pod"] == "ml/serve-0" and blocking["budget"] == "serve-pdb"
    assert gone == newcomers

    # The group shrank by exactly the drained nodes: they, and only they, were terminated.
    assert asg.desired == 2
    assert set(asg.in_service()) == old
    launched = asg.launched()
    assert sorted(i for i, state in launched.items() if state != "running") == gone
    for instance in gone:  # cordoned, then drained, before the instance went
        node = fake.get("nodes", nodes[instance])
        assert node["spec"]["unschedulable"] is True
        assert KUBE_NAMES.removal_annotation in node["metadata"]["annotations"]
    evicted = [p.split("/")[-2] for m, p in fake.requests if p.endswith("/eviction")]
    assert "batch-0" in evicted and "serve-0" in evicted
    assert [p["metadata"]["name"] for p in fake.objects("pods", "ml")] == ["serve-0", "train-0"]
    guarded = fake.get("nodes", second)  # blocked: it serves again, not left cordoned
    assert not guarded["spec"].get("unschedulable")
    assert fake.objects("pods", "gpuscale-system") == []  # no headroom left to hold

    # Every decision is in the log with its inputs and outcome.
    log = DecisionJournal(state_dir)
    decisions = log.decisions()
    assert [d.applied for d in decisions] == [True, True, False]
    assert decisions[0].inputs["outlooks"][0]["observed"] == 8.0
    assert decisions[1].inputs["outlooks"][0]["observed"] == 40.0
    assert decisions[0].outcome is not None and decisions[0].outcome["actions"]
    assert not log.pending()

    # A pass right after changes nothing: the blocked node is left alone for a while.
    again = scale(live_config, "--apply", "--once")
    assert again["actions"] == [] and again["plan"]["removals"] == []
    assert asg.desired == 2
