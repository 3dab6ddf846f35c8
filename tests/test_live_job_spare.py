"""The live loop's job-level spare, against the fake API server: each rise of a pool's
reactive demand between passes is a node request (a gang all at once), kept in the planner
state the loop persists; the planner sizes the pool's spare nodes on them, and the loop
holds that spare on top of what real and pending pods need, here as the CapacityBuffer's
replicas Cluster Autoscaler provisions. The requests survive a restart, and a state file
written before they were kept still loads."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pandas as pd
from fake_kube import FakeKube
from live_fixtures import fast_policy, pool, ready_gpu_node
from prometheus_client import generate_latest

from predictor.telemetry.store import TelemetryStore
from scaler.controller.config import LiveConfig
from scaler.controller.journal import DecisionJournal
from scaler.controller.metrics import LoopMetrics
from scaler.controller.reconcile import PLANNER_KEY, PassDecision, PlannerState, Reconciler
from scaler.controller.system import LiveSystem
from scaler.placement.estimator import ScaleUpEstimate
from scaler.planning.reactive import ReactiveDemand
from scaler.planning.request_log import MAX_RISES, RequestLog

START = datetime(2025, 3, 3, 14, 0, 0)  # a Monday afternoon
NAMESPACE = "gpuscale-system"
UNIT = {"num_gpu": 8, "cpu_milli": 8000, "memory_mib": 32768}  # whole-node jobs


def config(tmp_path: Path, fake: FakeKube) -> LiveConfig:
    """Cluster Autoscaler sizes one A100 pool (10-minute boot); gpuscale asks it for room
    through a CapacityBuffer. Steps of a minute, the spare sized after one of them."""
    booting = pool(min_size=1, max_size=12) | {"boot_seconds": 600}
    return LiveConfig(
        state_dir=tmp_path / "state",
        pools=[booting],
        provider={"kind": "autoscaler"},
        kubernetes={"host": fake.url, "pre_position": "capacity-buffer"},
        model={"name": "persistence"},
        policy=fast_policy(60.0) | {"tuning_min_steps": 1},
        placement={"mix": [UNIT]},
        lease={"enabled": False},
    )


def job(fake: FakeKube, name: str, on: str | None) -> None:
    """A whole-node (8-GPU) pod: running on `on`, or pending for the a100 pool."""
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "main",
                "resources": {"requests": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "8"}},
            }
        ]
    }
    if on is None:
        spec["nodeSelector"] = {"gpuscale.io/pool": "a100"}
    else:
        spec["nodeName"] = on
    fake.create(
        "pods",
        {
            "metadata": {"name": name, "namespace": "ml"},
            "spec": spec,
            "status": {"phase": "Running" if on else "Pending"},
        },
    )


def passes(cfg: LiveConfig, at: datetime, gpus: float, system: LiveSystem | None = None) -> Any:
    """One applied pass at `at`, demand `gpus` observed in the step ending then (a new
    process each time unless `system` is given)."""
    ds = pd.date_range(end=pd.Timestamp(at).floor("60s"), periods=3, freq="60s")
    store = TelemetryStore(cfg.state_dir)
    store.append(pd.DataFrame({"unique_id": "a100", "ds": ds, "y": [gpus] * 3}))
    return Reconciler(system or LiveSystem.build(cfg), clock=lambda: at).iterate(apply=True)


def spare_of(d: PassDecision) -> int:
    assert d.reactive is not None
    return d.reactive.reactive.spare.get("a100", 0)


def nodes(**per_pool: int) -> ReactiveDemand:
    return ReactiveDemand(per_pool, ScaleUpEstimate(pools={}))


def test_a_request_is_a_rise_between_observations_given_until_taken() -> None:
    log = RequestLog().observe(nodes(a100=1, t4=2), START)  # nothing to rise from yet
    assert log.rises == {} and log.seen == {"a100": 1, "t4": 2}
    log = log.observe(nodes(a100=5, t4=1), START + timedelta(minutes=2))  # a gang of 4
    log = log.observe(nodes(a100=6, t4=3), START + timedelta(minutes=3))
    at = START + timedelta(minutes=10)
    a100 = log.requests("a100", at)
    assert (a100.minutes_ago, a100.nodes) == ((8.0, 7.0), (4, 1))
    t4 = log.requests("t4", at)
    assert (t4.minutes_ago, t4.nodes) == ((7.0,), (2,))  # the fall asked for nothing
    assert log.requests("h100", at).nodes == ()
    taken = log.taken()
    assert taken.rises == {} and taken.seen == {"a100": 6, "t4": 3}
    assert taken.observe(nodes(a100=7, t4=3), at).requests("a100", at).nodes == (1,)
    # A caller whose planner never takes them keeps the newest, not all.
    for i in range(MAX_RISES + 5):
        log = log.observe(nodes(a100=0), at).observe(nodes(a100=1), at + timedelta(seconds=i))
    kept = log.requests("a100", at + timedelta(seconds=MAX_RISES + 4))
    assert len(kept.nodes) == MAX_RISES and kept.minutes_ago[-1] == 0.0


def gang_runs(fake: FakeKube, nodes: list[str]) -> None:
    """Cluster Autoscaler brought the gang's nodes up and it runs there."""
    for i, name in enumerate(nodes):
        fake.delete("pods", f"gang-{i}", "ml")
        job(fake, f"gang-{i}", ready_gpu_node(fake, name))


def buffer_replicas(fake: FakeKube) -> int:
    return int(fake.get("capacitybuffers", "gpuscale-a100", NAMESPACE)["spec"]["replicas"])


def test_a_gang_seen_on_one_pass_keeps_spare_nodes_on_later_ones(
    tmp_path: Path, fake: FakeKube
) -> None:
    cfg = config(tmp_path, fake)
    job(fake, "train-0", ready_gpu_node(fake, "gpu-0"))
    calm = passes(cfg, START, 8.0).decision
    # A first pass has no requests to size a spare on: the forecast sizes the pool.
    assert calm.job_spare == {} and calm.desired == {"a100": 1}
    (outlook,) = calm.outlook.outlooks
    assert outlook.requests is not None and outlook.requests.nodes == ()

    # A gang of four whole-node pods arrives between two passes: one request of 4 nodes.
    for i in range(4):
        job(fake, f"gang-{i}", None)
    came = passes(cfg, START + timedelta(minutes=1), 8.0)
    d = came.decision
    (outlook,) = d.outlook.outlooks
    assert outlook.requests is not None
    assert (outlook.requests.nodes, outlook.requests.minutes_ago) == ((4,), (0.0,))
    assert d.reactive is not None and d.reactive.demand.nodes == {"a100": 5}
    spare = d.job_spare["a100"]
    assert spare > 0
    (need,) = d.plan.needs
    assert need.spare_nodes == spare and need.reason.startswith("job-level spare")
    # The spare rides on the five nodes the pods need, and the buffer asks for it.
    assert d.reactive.floor == {"a100": 5 + spare} and d.desired == {"a100": 5 + spare}
    assert came.to_dict()["plan"]["reactive"]["spare_nodes"] == {"a100": spare}
    assert buffer_replicas(fake) == spare
    (logged, _) = DecisionJournal(cfg.state_dir).decisions()  # newest first
    assert logged.inputs["outlooks"][0]["requests"] == {"minutes_ago": [0.0], "nodes": [4]}
    assert logged.plan["reactive"]["spare_nodes"] == {"a100": spare}
    assert f"({spare} of them job-level spare)" in logged.plan["capacity_buffers"][0]["reason"]

    # The autoscaler brings the gang's nodes and the spare up; the gang runs. No new
    # request, and the spare stays: the buffer still asks for it, nothing is left to go.
    gang_runs(fake, [f"gpu-{i}" for i in range(1, 5)])
    spares = [ready_gpu_node(fake, f"gpu-{i}") for i in range(5, 5 + spare)]
    for minute in (2, 3):
        later = passes(cfg, START + timedelta(minutes=minute), 40.0).decision
        (outlook,) = later.outlook.outlooks
        assert outlook.requests is not None and outlook.requests.nodes == ()
        assert later.job_spare == {"a100": spare}
        assert later.desired == {"a100": 5 + spare} and later.left_to_autoscaler == ()
        assert buffer_replicas(fake) == spare

    # Two more idle nodes than the spare, and telemetry that still shows one node's worth:
    # the two are left to the autoscaler's scale-down; the spare on top of what the pods
    # hold, and every node that runs work, are not.
    extra = [ready_gpu_node(fake, f"gpu-{i}") for i in range(5 + spare, 7 + spare)]
    over = passes(cfg, START + timedelta(minutes=4), 8.0).decision
    assert over.plan.desired["a100"] < 5 + spare  # the telemetry alone would let them go
    assert over.job_spare == {"a100": spare} and over.desired == {"a100": 5 + spare}
    left = {r.kube_name for r in over.left_to_autoscaler}
    assert len(left) == 2 and left <= set(spares + extra)


def test_the_metrics_show_the_spare(tmp_path: Path, fake: FakeKube) -> None:
    cfg = config(tmp_path, fake)
    job(fake, "train-0", ready_gpu_node(fake, "gpu-0"))
    metrics = LoopMetrics()
    metrics.observe(passes(cfg, START, 8.0), {"a100": 8})
    assert 'gpuscale_scaler_job_spare_nodes{pool="a100"} 0.0' in shown(metrics)
    for i in range(4):
        job(fake, f"gang-{i}", None)
    came = passes(cfg, START + timedelta(minutes=1), 8.0)
    metrics.observe(came, {"a100": 8})
    spare = came.decision.job_spare["a100"]
    assert spare > 0
    assert f'gpuscale_scaler_job_spare_nodes{{pool="a100"}} {float(spare)}' in shown(metrics)


def shown(metrics: LoopMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_the_requests_of_a_step_survive_a_restart(tmp_path: Path, fake: FakeKube) -> None:
    cfg = config(tmp_path, fake)
    job(fake, "train-0", ready_gpu_node(fake, "gpu-0"))
    passes(cfg, START, 8.0)
    for i in range(4):
        job(fake, f"gang-{i}", None)
    came = passes(cfg, START + timedelta(minutes=1), 8.0).decision
    state: PlannerState = DecisionJournal(cfg.state_dir).load(PLANNER_KEY)
    assert state.requests is not None
    assert state.requests.rises == {"a100": ((START + timedelta(minutes=1), 4),)}
    assert state.requests.seen == {"a100": 5}

    # A new process half a minute later, in the same demand step: it plans again from the
    # memory at the step's start, which has not seen the gang, with the gang's request
    # from the state file, so it holds the same spare (with no rise of its own).
    again = passes(cfg, START + timedelta(minutes=1, seconds=30), 8.0).decision
    assert again.step == came.step
    (outlook,) = again.outlook.outlooks
    assert outlook.requests is not None
    assert (outlook.requests.nodes, outlook.requests.minutes_ago) == ((4,), (0.5,))
    assert again.job_spare == came.job_spare and again.job_spare["a100"] > 0
    assert again.desired == came.desired

    # The next step's memory has taken the request in: it is not given twice.
    gang_runs(fake, [f"gpu-{i}" for i in range(1, 5)])
    after = passes(cfg, START + timedelta(minutes=2), 40.0).decision
    (outlook,) = after.outlook.outlooks
    assert outlook.requests is not None and outlook.requests.nodes == ()
    assert after.job_spare == came.job_spare


def test_a_state_file_written_before_requests_were_kept_loads(
    tmp_path: Path, fake: FakeKube
) -> None:
    cfg = config(tmp_path, fake)
    job(fake, "train-0", ready_gpu_node(fake, "gpu-0"))
    first = passes(cfg, START, 8.0).decision
    # What the previous version pickled: the same state without the `requests` field.
    journal = DecisionJournal(cfg.state_dir)
    old: PlannerState = journal.load(PLANNER_KEY)
    del old.__dict__["requests"]
    journal.save(PLANNER_KEY, old)
    assert "requests" not in vars(DecisionJournal(cfg.state_dir).load(PLANNER_KEY))

    for i in range(4):
        job(fake, f"gang-{i}", None)
    upgraded = passes(cfg, START + timedelta(minutes=1), 8.0).decision
    # Planned from the old memory; the gang is not a request yet (no pass's demand to
    # tell a rise from), and the demand seen is kept from here on.
    assert upgraded.warm_start is None
    assert upgraded.plan.memory.step == first.plan.memory.step + 1
    assert upgraded.desired == {"a100": 5}
    state: PlannerState = DecisionJournal(cfg.state_dir).load(PLANNER_KEY)
    assert state.requests is not None and state.requests.seen == {"a100": 5}


def test_the_served_request_model_gives_the_pass_its_request_rate(
    tmp_path: Path, fake: FakeKube
) -> None:
    """With a request model served by the registry, the pass's a100 outlook carries the
    model's forecast of the hour a boot ahead (from the store's last days of requests),
    and the decision says which version."""
    from test_request_forecast import bursty

    from predictor.lifecycle.registry import ModelRegistry
    from predictor.models.requests import RequestForecaster

    cfg = config(tmp_path, fake)
    cfg = cfg.model_copy(
        update={"model": cfg.model.model_copy(update={"registry": tmp_path / "models"})}
    )
    ready_gpu_node(fake, "a100-0")
    model = RequestForecaster.fit({"a100": (bursty(12), 10.0)})
    ModelRegistry(tmp_path / "models").save("requests", model, {"model": "requests"})
    ds = pd.date_range(end=pd.Timestamp(START) - pd.Timedelta("3min"), periods=2 * 1440, freq="min")
    gpus = 8.0 * (1 + (ds.hour >= 13))  # a node asked for every afternoon
    TelemetryStore(cfg.state_dir).append(pd.DataFrame({"unique_id": "a100", "ds": ds, "y": gpus}))
    decision = passes(cfg, START, 8.0).decision
    (a100,) = [o for o in decision.outlook.outlooks if o.group == "a100"]
    assert a100.request_rate is not None and a100.request_rate.ahead > 0
    assert a100.request_rate.by_bucket is not None  # the served model's daily profile
    assert decision.request_source == "requests:1"
    assert decision.to_dict()["request_source"] == "requests:1"
