"""CronJobs as known demand: Kubernetes' cron dialect (next run times, time zones, macros,
the day-of-month / day-of-week OR rule, errors that name the CronJob and the field), the
runs a CronJob fires in a window and what each asks, read through the real client from the
fake API server (which pages lists), the collector's `gpu_scheduled` series, and the live
loop holding a run's nodes when it fires within a boot."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from fake_kube import FakeKube
from kubernetes import client as k8s
from live_fixtures import fast_policy, pool

from predictor.telemetry.collector import Collector, build_sources
from predictor.telemetry.config import CollectorConfig, KubernetesSettings
from predictor.telemetry.cron import ScheduleError, parse_schedule
from predictor.telemetry.cronjobs import (
    ScheduledRun,
    gpu_models,
    pods_per_run,
    runs_due,
    scheduled_runs,
)
from predictor.telemetry.kube_objects import KubeNames
from predictor.telemetry.kubernetes import UNPOOLED, api_client
from predictor.telemetry.paging import paged
from predictor.telemetry.scheduled_jobs import METRIC, ScheduledJobsSource
from predictor.telemetry.sources import RetryPolicy, SourceError
from predictor.telemetry.store import TelemetryStore
from scaler.cluster.pools import NodePool
from scaler.controller.config import LiveConfig
from scaler.controller.reconcile import Reconciler
from scaler.controller.system import LiveSystem
from scaler.kube.cronjobs import read_scheduled, run_nodes, run_pool, scheduled_nodes
from scaler.kube.errors import Refusal
from scaler.planning.job_spare import ScheduledNodes

POOL = "gpuscale.io/pool"
MODEL = "nvidia.com/gpu.product"
ON_A100 = {POOL: "a100"}
MONDAY = datetime(2026, 3, 2, 0, 0, tzinfo=UTC)  # a Monday, midnight UTC


def fires(schedule: str, zone: str | None = None, *, after: datetime = MONDAY, n: int = 4):
    """The first `n` fire times after `after`, as ISO text in UTC."""
    times = parse_schedule(schedule, zone).fire_times(after, after + timedelta(days=400), n)
    return [t.strftime("%a %Y-%m-%d %H:%M") for t in times]


# ------------------------------------------------------------------ the cron dialect


def test_fields_take_values_ranges_steps_lists_and_names() -> None:
    assert fires("*/20 * * * *") == [
        "Mon 2026-03-02 00:20",  # strictly after the start: midnight itself has fired
        "Mon 2026-03-02 00:40",
        "Mon 2026-03-02 01:00",
        "Mon 2026-03-02 01:20",
    ]
    assert fires("5/20 1 * * *", n=3) == [  # robfig: N/step runs from N to the maximum
        "Mon 2026-03-02 01:05",
        "Mon 2026-03-02 01:25",
        "Mon 2026-03-02 01:45",
    ]
    assert fires("0 9,17 * * mon-FRI", n=3) == [
        "Mon 2026-03-02 09:00",
        "Mon 2026-03-02 17:00",
        "Tue 2026-03-03 09:00",
    ]
    assert fires("30 2 1-7/3 JAN,jun *", n=3) == [
        "Mon 2026-06-01 02:30",
        "Thu 2026-06-04 02:30",
        "Sun 2026-06-07 02:30",
    ]
    assert fires("0 0 ? * SUN", n=2) == ["Sun 2026-03-08 00:00", "Sun 2026-03-15 00:00"]


def test_macros_are_their_five_fields() -> None:
    assert fires("@hourly", n=2) == ["Mon 2026-03-02 01:00", "Mon 2026-03-02 02:00"]
    assert fires("@daily", n=2) == fires("@midnight", n=2) == fires("0 0 * * *", n=2)
    assert fires("@weekly", n=2) == ["Sun 2026-03-08 00:00", "Sun 2026-03-15 00:00"]
    assert fires("@monthly", n=2) == ["Wed 2026-04-01 00:00", "Fri 2026-05-01 00:00"]
    assert fires("@yearly", n=1) == fires("@annually", n=1) == ["Fri 2027-01-01 00:00"]


def test_day_of_month_and_day_of_week_are_ored_when_both_are_restricted() -> None:
    # Kubernetes (robfig/cron): the 15th of every month OR every Friday...
    assert fires("0 0 15 * FRI", n=4) == [
        "Fri 2026-03-06 00:00",
        "Fri 2026-03-13 00:00",
        "Sun 2026-03-15 00:00",
        "Fri 2026-03-20 00:00",
    ]
    # ... a step above 1 restricts the day of month: odd days OR Mondays.
    assert fires("0 0 */2 * 1", n=4) == [
        "Tue 2026-03-03 00:00",
        "Thu 2026-03-05 00:00",
        "Sat 2026-03-07 00:00",
        "Mon 2026-03-09 00:00",
    ]
    # ... while an unrestricted field (`*`, `?`, `*/1`) leaves the other alone: Fridays.
    for schedule in ("0 0 * * 5", "0 0 ? * 5", "0 0 */1 * 5"):
        assert fires(schedule, n=2) == ["Fri 2026-03-06 00:00", "Fri 2026-03-13 00:00"]
    assert fires("0 0 15 * *", n=2) == ["Sun 2026-03-15 00:00", "Wed 2026-04-15 00:00"]


def test_a_schedule_fires_in_its_time_zone() -> None:
    # Asia/Tokyo keeps no daylight saving: 09:00 there is 00:00 UTC all year.
    assert fires("0 9 * * *", "Asia/Tokyo", n=2) == [
        "Tue 2026-03-03 00:00",
        "Wed 2026-03-04 00:00",
    ]
    # Asia/Kolkata is UTC+05:30: 06:00 there is 00:30 UTC, the same Monday.
    assert fires("0 6 * * MON", "Asia/Kolkata", n=1) == ["Mon 2026-03-02 00:30"]
    # A CRON_TZ= prefix names the zone where spec.timeZone does not.
    assert fires("CRON_TZ=Asia/Tokyo 0 9 * * *", n=1) == ["Tue 2026-03-03 00:00"]
    # A schedule that never fires (the 30th of February) has no fire time.
    assert fires("0 0 30 2 *") == []


@pytest.mark.parametrize(
    ("schedule", "zone", "field", "says"),
    [
        ("61 * * * *", None, "spec.schedule", "minute field: 61 is outside 0-59"),
        ("0 24 * * *", None, "spec.schedule", "hour field: 24 is outside 0-23"),
        ("0 0 0 * *", None, "spec.schedule", "day of month field: 0 is outside 1-31"),
        ("0 0 * 13 *", None, "spec.schedule", "month field: 13 is outside 1-12"),
        ("0 0 * * 7", None, "spec.schedule", "day of week field: 7 is outside 0-6"),
        ("0 0 L * *", None, "spec.schedule", "day of month field: 'L' is not a number"),
        ("0 0 * * MON#2", None, "spec.schedule", "'MON#2' is not a value, range or step"),
        ("*/0 * * * *", None, "spec.schedule", "the step of '*/0' must be positive"),
        ("30-10 * * * *", None, "spec.schedule", "'30-10' starts after it ends"),
        ("0 0 * * * *", None, "spec.schedule", "6 fields, where Kubernetes reads 5"),
        ("@fortnightly", None, "spec.schedule", "unknown macro '@fortnightly'"),
        ("@every 1h", None, "spec.schedule", "@every counts from the controller's last run"),
        ("0 0 * * *", "Mars/Olympus", "spec.timeZone", "'Mars/Olympus' is not a time zone"),
        ("TZ=UTC 0 0 * * *", "UTC", "spec.schedule", "prefix cannot be used with spec.tim"),
    ],
)
def test_a_bad_schedule_is_an_error_naming_the_cron_job_and_the_field(
    schedule: str, zone: str | None, field: str, says: str
) -> None:
    cron_job = cron_job_object("nightly", schedule, time_zone=zone)
    with pytest.raises(ScheduleError) as caught:
        runs_due(cron_job, MONDAY, MONDAY + timedelta(days=1))
    error = caught.value
    assert (error.cron_job, error.field) == ("ml/nightly", field)
    assert str(error).startswith(f"CronJob ml/nightly: {field}: ")
    assert says in str(error)


# ------------------------------------------------------------------ a CronJob's runs


def pod_template(
    gpus: int = 8,
    *,
    selector: dict[str, str] | None = None,
    affinity: dict[str, Any] | None = None,
    share: int | None = None,
    mig: tuple[str, int] | None = None,
) -> dict[str, Any]:
    requests: dict[str, str] = {"cpu": "4", "memory": "16Gi"}
    if gpus:
        requests["nvidia.com/gpu"] = str(gpus)
    if mig is not None:
        requests[f"nvidia.com/mig-{mig[0]}"] = str(mig[1])
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [{"name": "main", "image": "trainer:1", "resources": {"requests": requests}}],
    }
    if selector:
        spec["nodeSelector"] = selector
    if affinity:
        spec["affinity"] = affinity
    meta = {"annotations": {"gpuscale.io/gpu-milli": str(share)}} if share else {}
    return {"metadata": meta, "spec": spec}


def cron_job_object(
    name: str,
    schedule: str,
    template: dict[str, Any] | None = None,
    *,
    namespace: str = "ml",
    time_zone: str | None = None,
    suspend: bool | None = None,
    parallelism: int | None = None,
    completions: int | None = None,
    policy: str | None = None,
) -> dict[str, Any]:
    job: dict[str, Any] = {"template": template or pod_template()}
    if parallelism is not None:
        job["parallelism"] = parallelism
    if completions is not None:
        job["completions"] = completions
    spec: dict[str, Any] = {"schedule": schedule, "jobTemplate": {"spec": job}}
    if time_zone is not None:
        spec["timeZone"] = time_zone
    if suspend is not None:
        spec["suspend"] = suspend
    if policy is not None:
        spec["concurrencyPolicy"] = policy
    return {"metadata": {"name": name, "namespace": namespace}, "spec": spec}


def test_a_run_asks_its_parallelism_of_its_templates_pods_in_the_pool_they_select() -> None:
    cron_job = cron_job_object(
        "train", "0 */6 * * *", pod_template(8, selector=ON_A100), parallelism=4
    )
    runs = runs_due(cron_job, MONDAY, MONDAY + timedelta(hours=13))
    assert runs == (
        ScheduledRun("ml/train", MONDAY + timedelta(hours=6), "a100", 4, 8.0, None),
        ScheduledRun("ml/train", MONDAY + timedelta(hours=12), "a100", 4, 8.0, None),
    )
    assert runs[0].gpus == 32.0


def test_pods_per_run_is_parallelism_capped_by_completions() -> None:
    assert pods_per_run({}) == 1
    assert pods_per_run({"parallelism": 4}) == 4
    assert pods_per_run({"parallelism": 4, "completions": 2}) == 2
    assert pods_per_run({"completions": 8}) == 1
    assert pods_per_run({"parallelism": 0}) == 0


def test_shared_and_mig_gpus_count_as_pending_pods_do() -> None:
    day = (MONDAY, MONDAY + timedelta(days=1))
    (shared,) = runs_due(cron_job_object("s", "0 3 * * *", pod_template(1, share=250)), *day)
    assert shared.gpus_per_pod == 0.25
    (mig,) = runs_due(cron_job_object("m", "0 3 * * *", pod_template(0, mig=("3g.40gb", 2))), *day)
    assert mig.gpus_per_pod == pytest.approx(6 / 7)


def test_what_fires_no_gpu_demand_has_no_runs() -> None:
    day = (MONDAY, MONDAY + timedelta(days=1))
    assert runs_due(cron_job_object("paused", "0 3 * * *", suspend=True), *day) == ()
    assert runs_due(cron_job_object("cpu", "0 3 * * *", pod_template(0)), *day) == ()
    assert runs_due(cron_job_object("none", "0 3 * * *", parallelism=0), *day) == ()
    # A suspended CronJob is not read at all: its schedule's error is not one.
    assert runs_due(cron_job_object("paused", "bad", suspend=True), *day) == ()


def test_serial_cron_jobs_count_their_next_run_only() -> None:
    window = (MONDAY, MONDAY + timedelta(hours=1))
    assert len(runs_due(cron_job_object("a", "*/10 * * * *"), *window)) == 6
    for policy in ("Forbid", "Replace"):
        (run,) = runs_due(cron_job_object("f", "*/10 * * * *", policy=policy), *window)
        assert run.at == MONDAY + timedelta(minutes=10)


def test_a_run_counts_only_until_it_fires() -> None:
    """Its pods are pending pods from then on: counted there, not twice."""
    cron_job = cron_job_object("nightly", "0 2 * * *")
    fired = MONDAY + timedelta(hours=2)
    assert [r.at for r in runs_due(cron_job, MONDAY, fired)] == [fired]
    assert runs_due(cron_job, fired, fired + timedelta(hours=1)) == ()


def test_the_gpu_models_a_template_allows() -> None:
    def required(*terms: tuple[str, list[str]]) -> dict[str, Any]:
        """Required node affinity, one term per (label, values), each an `In`."""
        expressions = [[{"key": k, "operator": "In", "values": v}] for k, v in terms]
        selector_terms = [{"matchExpressions": e} for e in expressions]
        return {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": selector_terms
                }
            }
        }

    assert gpu_models({"nodeSelector": {MODEL: "H100"}}) == {"H100"}
    assert gpu_models({"affinity": required((MODEL, ["A100", "H100"]))}) == {"A100", "H100"}
    assert gpu_models({"affinity": required((MODEL, ["A100"]), (MODEL, ["B200"]))}) == {
        "A100",
        "B200",
    }
    # A term that names no model lets the pod go to any (the terms are ORed).
    assert gpu_models({"affinity": required((MODEL, ["A100"]), (POOL, ["x"]))}) is None
    assert gpu_models({}) is None


def test_many_cron_jobs_read_in_time_order_with_bad_ones_left_out_and_said() -> None:
    read = scheduled_runs(
        [
            cron_job_object("late", "0 1 * * *", pod_template(8, selector=ON_A100)),
            cron_job_object("bad", "0 0 * * 8"),
            cron_job_object("early", "30 0 * * *", pod_template(4, selector={POOL: "h100"})),
            cron_job_object("week", "0 0 * * 0", pod_template(2, selector={POOL: "v100"})),
        ],
        MONDAY,
        timedelta(hours=2),
    )
    assert [(r.cron_job, r.at.strftime("%H:%M")) for r in read.runs] == [
        ("ml/early", "00:30"),
        ("ml/late", "01:00"),
    ]
    assert read.problems == (
        "CronJob ml/bad: spec.schedule: '0 0 * * 8': day of week field: 8 is outside 0-6;"
        " its runs are not planned for",
    )
    # A pool whose CronJobs fire nothing in the window reads 0, rather than nothing.
    assert read.gpus_by_pool() == {"a100": 8.0, "h100": 4.0, "v100": 0.0}


# ------------------------------------------------------------------ the scaler's nodes


def node_pool(name: str, model: str = "A100", gpus: int = 8, boot_s: float = 600) -> NodePool:
    return NodePool(
        name=name,
        gpu_model=model,
        gpus_per_node=gpus,
        price_per_hour=30.0,
        boot_seconds=boot_s,
        max_size=20,
    )


def run(pods: int, gpus: float, pool: str | None = "a100", **kw: Any) -> ScheduledRun:
    return ScheduledRun("ml/x", kw.get("at", MONDAY), pool, pods, gpus, kw.get("models"))


def test_a_runs_nodes_are_whole_nodes_per_pod_or_its_pods_packed() -> None:
    assert run_nodes(run(4, 8), 8) == 4  # a node each
    assert run_nodes(run(2, 16), 8) == 4  # more than a node: whole nodes each, as asked
    assert run_nodes(run(4, 4), 8) == 2  # two to a node
    assert run_nodes(run(3, 2), 8) == 1  # packed: 6 GPUs on one node
    assert run_nodes(run(5, 6), 8) == 5  # 6-GPU pods never share an 8-GPU node
    assert run_nodes(run(10, 0.25), 8) == 1  # shares pack by their GPUs
    assert run_nodes(run(0, 8), 8) == 0


def test_a_run_without_a_pool_goes_to_the_one_pool_of_its_gpu_model() -> None:
    a100, h100, t4 = node_pool("a100"), node_pool("h100", "H100"), node_pool("t4", "T4", 4)
    pools = [a100, h100, t4]
    assert run_pool(run(1, 8, "h100"), pools) is h100
    assert run_pool(run(1, 8, "elsewhere"), pools) is None  # not a pool configured here
    assert run_pool(run(1, 8, None, models=frozenset({"H100"})), pools) is h100
    assert run_pool(run(1, 2, None, models=frozenset({"A100", "T4"})), pools) is None
    # Any model, but only the 8-GPU pools hold an 8-GPU pod, and two of them do: neither.
    assert run_pool(run(1, 8, None), pools) is None
    assert run_pool(run(1, 8, None), [a100, t4]) is a100


def test_scheduled_nodes_are_the_runs_due_within_a_boot_and_a_step() -> None:
    a100 = node_pool("a100", boot_s=600)
    fast = node_pool("fast", "H100", boot_s=60)
    runs = [
        run(2, 8, at=MONDAY + timedelta(minutes=5)),
        run(1, 8, "fast", at=MONDAY + timedelta(minutes=5)),
        run(1, 8, at=MONDAY + timedelta(minutes=11)),  # a boot and a step (10 + 1) ahead
        run(3, 8, at=MONDAY + timedelta(minutes=12)),  # past them
        run(1, 8, at=MONDAY),  # has fired: its pods count as pods
    ]
    got = scheduled_nodes(runs, [a100, fast], MONDAY, step_seconds=60)
    assert got == {
        "a100": ScheduledNodes((5.0, 11.0), (2, 1)),
        "fast": ScheduledNodes(),  # due in 5 minutes, but booting takes 1: not yet
    }
    got = scheduled_nodes(runs, [a100, fast], MONDAY, step_seconds=120)
    assert got["a100"] == ScheduledNodes((5.0, 11.0, 12.0), (2, 1, 3))


# ------------------------------------------------------------------ against the API server


def cron_job_body(name: str, schedule: str, template: dict[str, Any], **spec: Any) -> Any:
    """A CronJob as the client sends it (its models), so the test goes through the client."""
    job = k8s.V1JobTemplateSpec(
        spec=k8s.V1JobSpec(
            template=k8s.V1PodTemplateSpec(
                metadata=template.get("metadata") or None, spec=template["spec"]
            ),
            parallelism=spec.pop("parallelism", None),
        )
    )
    return k8s.V1CronJob(
        metadata=k8s.V1ObjectMeta(name=name),
        spec=k8s.V1CronJobSpec(schedule=schedule, job_template=job, **spec),
    )


@pytest.fixture
def settings(fake: FakeKube, tmp_path: Path) -> KubernetesSettings:
    return KubernetesSettings(
        kubeconfig=fake.write_kubeconfig(tmp_path / "kubeconfig"),
        watch_timeout_s=30,
        request_timeout_s=5,
    )


@pytest.fixture
def batch(settings: KubernetesSettings) -> Iterator[k8s.BatchV1Api]:
    api = api_client(settings)
    yield k8s.BatchV1Api(api)
    api.close()


def test_the_fake_api_server_serves_cron_jobs_through_the_client(
    fake: FakeKube, batch: k8s.BatchV1Api
) -> None:
    made = batch.create_namespaced_cron_job("ml", cron_job_body("a", "0 3 * * *", pod_template()))
    assert made.spec.suspend is False and made.spec.concurrency_policy == "Allow"
    assert made.metadata.generation == 1
    read = batch.read_namespaced_cron_job("a", "ml")
    assert read.spec.schedule == "0 3 * * *"
    patched = batch.patch_namespaced_cron_job("a", "ml", {"spec": {"suspend": True}})
    assert patched.spec.suspend is True and patched.metadata.generation == 2
    listed = batch.list_cron_job_for_all_namespaces()
    assert [c.metadata.name for c in listed.items] == ["a"]
    assert [c.metadata.name for c in batch.list_namespaced_cron_job("other").items] == []
    with pytest.raises(k8s.ApiException) as refused:
        batch.create_namespaced_cron_job("ml", {"metadata": {"name": "b"}, "spec": {}})
    assert refused.value.status == 422
    batch.delete_namespaced_cron_job("a", "ml")
    assert fake.objects("cronjobs") == []


def test_lists_are_read_page_by_page(fake: FakeKube, batch: k8s.BatchV1Api) -> None:
    for i in range(5):
        fake.create("cronjobs", cron_job_object(f"c{i}", "0 3 * * *"), "ml")
    first = batch.list_cron_job_for_all_namespaces(limit=2)
    assert [c.metadata.name for c in first.items] == ["c0", "c1"]
    assert first.metadata._continue and first.metadata.remaining_item_count == 3
    listing = paged(batch.list_cron_job_for_all_namespaces, limit=2)()
    assert [c.metadata.name for c in listing.items] == [f"c{i}" for i in range(5)]
    assert listing.metadata._continue is None
    assert listing.metadata.resource_version == first.metadata.resource_version
    pages = [p for m, p in fake.requests if "limit=2" in p and "cronjobs" in p]
    assert len(pages) == 4  # one above, three by `paged`
    # A continue token from before a compaction can no longer be served: list again.
    fake.create("cronjobs", cron_job_object("c5", "0 3 * * *"), "ml")
    fake.compact()
    with pytest.raises(k8s.ApiException) as gone:
        batch.list_cron_job_for_all_namespaces(limit=2, _continue=first.metadata._continue)
    assert gone.value.status == 410


def test_the_loops_reader_lists_the_cron_jobs_and_reads_their_runs(
    fake: FakeKube, settings: KubernetesSettings, batch: k8s.BatchV1Api
) -> None:
    batch.create_namespaced_cron_job(
        "ml",
        cron_job_body("nightly", "0 2 * * *", pod_template(8, selector=ON_A100), parallelism=2),
    )
    batch.create_namespaced_cron_job(
        "ml", cron_job_body("tokyo", "0 9 * * *", pod_template(4), time_zone="Asia/Tokyo")
    )
    batch.create_namespaced_cron_job("ml", cron_job_body("broken", "0 0 * * 9", pod_template()))
    api = api_client(settings)
    try:
        found = read_scheduled(api, KubeNames(), MONDAY, timedelta(days=1))
        assert not isinstance(found, Refusal)
        assert [(r.cron_job, r.at, r.pool, r.pods, r.gpus_per_pod) for r in found.runs] == [
            ("ml/nightly", MONDAY + timedelta(hours=2), "a100", 2, 8.0),
            ("ml/tokyo", MONDAY + timedelta(days=1), None, 1, 4.0),  # 09:00 JST, Tuesday
        ]
        assert len(found.problems) == 1 and "CronJob ml/broken: spec.schedule" in found.problems[0]
        fake.refusals["cronjobs"] = 403
        refused = read_scheduled(api, KubeNames(), MONDAY, timedelta(days=1))
        assert isinstance(refused, Refusal) and refused.status == 403
        assert 'cannot list resource "cronjobs" in API group "batch"' in refused.message
    finally:
        api.close()


# ------------------------------------------------------------------ the collector


def scheduled_of(source: ScheduledJobsSource, at: pd.Timestamp) -> dict[str, float]:
    batches = source.sample(at)
    assert [b.metric for b in batches] in ([METRIC], [])
    return {
        uid: y for b in batches for uid, y in zip(b.points["unique_id"], b.points["y"], strict=True)
    }


AT = pd.Timestamp("2026-03-02 00:00:00")  # MONDAY, as the collector stamps it (naive UTC)


def seed_cron_jobs(fake: FakeKube) -> None:
    for obj in (
        # 2 x 8 GPUs at 00:30 and 01:30: one run within the hour.
        cron_job_object(
            "half-past", "30 * * * *", pod_template(8, selector=ON_A100), parallelism=2
        ),
        # 4 GPUs at 03:00: none within the hour, so the pool reads 0.
        cron_job_object("nightly", "0 3 * * *", pod_template(4, selector={POOL: "h100"})),
        # 1 GPU, no pool named, at 00:15.
        cron_job_object("anywhere", "15 0 * * *", pod_template(1)),
        # Suspended: nothing.
        cron_job_object("paused", "*/5 * * * *", pod_template(8, selector=ON_A100), suspend=True),
    ):
        fake.create("cronjobs", obj, "ml")


def test_the_collector_records_the_gpus_due_within_the_hour_per_pool(
    fake: FakeKube, settings: KubernetesSettings, tmp_path: Path
) -> None:
    seed_cron_jobs(fake)
    config = CollectorConfig(kubernetes=settings)
    sources = build_sources(config)
    assert [s.name for s in sources] == ["kubernetes", "cronjobs"]
    store = TelemetryStore(tmp_path / "state")
    collector = Collector(store, sources, pd.Timedelta("15s"), RetryPolicy(attempts=1))
    try:
        outcomes = collector.collect_once(AT)
        assert [(o.source, o.error) for o in outcomes] == [("kubernetes", None), ("cronjobs", None)]
        stored = store.query(METRIC)
        assert dict(zip(stored["unique_id"], stored["y"], strict=True)) == {
            "a100": 16.0,
            "h100": 0.0,
            UNPOOLED: 1.0,
        }
        # Half an hour on, the 00:30 run has fired (its pods are pods now) and 01:30 is due.
        assert scheduled_of(sources[1], AT + pd.Timedelta("31min")) == {
            "a100": 16.0,
            "h100": 0.0,
            UNPOOLED: 0.0,
        }
        assert scheduled_of(sources[1], AT + pd.Timedelta("150min")) == {
            "a100": 16.0,
            "h100": 4.0,
            UNPOOLED: 0.0,
        }
    finally:
        for source in sources:
            source.close()


def test_the_collector_watches_the_cron_jobs(fake: FakeKube, settings: KubernetesSettings) -> None:
    source = ScheduledJobsSource(settings)
    source.start()
    try:
        assert scheduled_of(source, AT) == {}
        fake.create("cronjobs", cron_job_object("new", "45 0 * * *"), "ml")
        deadline = time.monotonic() + 10
        while scheduled_of(source, AT) != {UNPOOLED: 8.0}:
            assert time.monotonic() < deadline, "the watch did not bring the new CronJob"
            time.sleep(0.05)
        assert fake.list_requests("cronjobs") == 1  # listed once, then watched
        fake.patch("cronjobs", "new", {"spec": {"suspend": True}}, "ml")
        while scheduled_of(source, AT) != {}:
            assert time.monotonic() < deadline, "the watch did not bring the suspension"
            time.sleep(0.05)
    finally:
        source.close()


def test_the_collectors_sources_share_one_watch_of_the_cron_jobs(
    fake: FakeKube, settings: KubernetesSettings
) -> None:
    """The Kubernetes source and the CronJob source of one `collect` read the process's
    one watched cache: the CronJobs are listed once and watched once, not once each."""
    seed_cron_jobs(fake)
    sources = build_sources(CollectorConfig(kubernetes=settings))
    try:
        for source in sources:
            source.start()
        assert scheduled_of(sources[1], AT)["a100"] == 16.0
        deadline = time.monotonic() + 10
        while fake.watch_requests("cronjobs") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert (fake.list_requests("cronjobs"), fake.watch_requests("cronjobs")) == (1, 1)
    finally:
        for source in sources:
            source.close()


def test_a_collector_not_allowed_to_read_cron_jobs_records_nothing_and_says_so_once(
    fake: FakeKube, settings: KubernetesSettings, caplog: pytest.LogCaptureFixture
) -> None:
    seed_cron_jobs(fake)
    fake.refusals["cronjobs"] = 403
    source = ScheduledJobsSource(settings)
    caplog.set_level(logging.WARNING, logger="predictor.telemetry.scheduled_jobs")
    try:
        source.start()
        assert scheduled_of(source, AT) == {}
        assert scheduled_of(source, AT) == {}
        said = [r.getMessage() for r in caplog.records if "CronJobs are not read" in r.getMessage()]
        assert len(said) == 1 and "HTTP 403" in said[0]
        # Granted later: taken up at the next sample, and watched from then on.
        del fake.refusals["cronjobs"]
        assert scheduled_of(source, AT)["a100"] == 16.0
        # An outage is no refusal: the sample fails (a gap), it is not an empty reading.
        fake.refusals["cronjobs"] = 500
        fake.expire_watches()
        deadline = time.monotonic() + 10
        while source.cron_jobs.error is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(SourceError):
            source.sample(AT)
    finally:
        source.close()


# ------------------------------------------------------------------ the live loop


NOW = datetime(2026, 3, 2, 12, 0, 0)  # naive UTC, as the loop's clock may give it


def node(name: str, pool_name: str, provider_id: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {POOL: pool_name, MODEL: "A100"}},
        "spec": {"providerID": provider_id},
        "status": {
            "allocatable": {"nvidia.com/gpu": "8", "cpu": "96", "memory": "1Ti"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def live_loop(fake: FakeKube, tmp_path: Path) -> Reconciler:
    """A pool of 8-GPU A100 nodes booting in 10 minutes, decided every minute, on a
    simulated cloud with one node; demand of one node's GPUs."""
    cfg = LiveConfig(
        state_dir=tmp_path / "state",
        pools=[pool("a100") | {"boot_seconds": 600}],
        provider={"kind": "simulated", "simulated": {"initial_sizes": {"a100": 1}}},
        kubernetes={"host": fake.url, "pre_position": "none"},
        model={"name": "persistence"},
        policy=fast_policy(60.0),
        lease={"enabled": False},
    )
    ds = pd.date_range(end=NOW, periods=6, freq="60s")
    TelemetryStore(cfg.state_dir).append(pd.DataFrame({"unique_id": "a100", "ds": ds, "y": 8.0}))
    loop = Reconciler(LiveSystem.build(cfg), clock=lambda: NOW)
    (group,) = loop.system.provider.node_groups()
    (first,) = [n.name for n in group.nodes()]
    fake.create("nodes", node(first, "a100", f"sim:///{first}"))
    return loop


def scheduled_in(loop: Reconciler) -> tuple[Any, ScheduledNodes | None]:
    decision = loop.iterate(apply=False).decision
    (outlook,) = [o for o in decision.outlook.outlooks if o.group == "a100"]
    return decision, outlook.scheduled


def test_the_loop_holds_a_cron_jobs_nodes_when_it_fires_within_a_boot(
    fake: FakeKube, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loop = live_loop(fake, tmp_path)
    # 2 x 8 GPUs at 12:05, within the boot (10 min) and a step (1 min): 2 nodes.
    fake.create(
        "cronjobs",
        cron_job_object("soon", "5 12 * * *", pod_template(8, selector=ON_A100), parallelism=2),
        "ml",
    )
    # Later than a boot and a step: not yet the pool's to hold.
    fake.create("cronjobs", cron_job_object("later", "30 12 * * *", pod_template(8)), "ml")
    # No pool named, but an A100 model that only this pool has: 4 GPUs, packed on 1 node.
    fake.create(
        "cronjobs",
        cron_job_object("by-model", "8 12 * * *", pod_template(4, selector={MODEL: "A100"})),
        "ml",
    )
    # Suspended, and one whose schedule cannot be read: neither counts, the pass goes on.
    fake.create(
        "cronjobs", cron_job_object("paused", "1 12 * * *", pod_template(8), suspend=True), "ml"
    )
    fake.create("cronjobs", cron_job_object("broken", "1 12 * * * *", pod_template(8)), "ml")
    caplog.set_level(logging.WARNING, logger="scaler.controller.reconcile")
    decision, scheduled = scheduled_in(loop)
    assert scheduled == ScheduledNodes((5.0, 8.0), (2, 1))
    assert decision.problems == []  # a bad schedule leaves its CronJob out, holding nothing
    recorded = decision.inputs()["outlooks"][0]["scheduled"]
    assert recorded == {"minutes_ahead": [5.0, 8.0], "nodes": [2, 1]}
    said = [r.getMessage() for r in caplog.records if "ml/broken" in r.getMessage()]
    assert said == [
        "CronJob ml/broken: spec.schedule: '1 12 * * * *': 6 fields, where Kubernetes reads 5;"
        " its runs are not planned for"
    ]
    scheduled_in(loop)  # said once while it lasts
    assert len([r for r in caplog.records if "ml/broken" in r.getMessage()]) == 1


def test_the_loop_holds_nothing_for_a_cron_job_firing_later(fake: FakeKube, tmp_path: Path) -> None:
    loop = live_loop(fake, tmp_path)
    fake.create("cronjobs", cron_job_object("later", "30 12 * * *", pod_template(8)), "ml")
    fake.create("cronjobs", cron_job_object("fired", "0 12 * * *", pod_template(8)), "ml")
    decision, scheduled = scheduled_in(loop)
    assert scheduled == ScheduledNodes()  # read, and nothing is due
    assert decision.inputs()["outlooks"][0]["scheduled"] == {"minutes_ahead": [], "nodes": []}


def test_the_loop_plans_without_cron_jobs_its_rbac_does_not_let_it_read(
    fake: FakeKube, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loop = live_loop(fake, tmp_path)
    fake.create("cronjobs", cron_job_object("soon", "5 12 * * *", pod_template(8)), "ml")
    fake.refusals["cronjobs"] = 403
    caplog.set_level(logging.WARNING, logger="scaler.controller.reconcile")
    decision, scheduled = scheduled_in(loop)
    assert scheduled is None and decision.problems == []
    said = [r.getMessage() for r in caplog.records if "CronJobs are not read" in r.getMessage()]
    assert len(said) == 1 and "HTTP 403" in said[0]
    # An API server that fails to answer is missing input: scale-downs are held.
    fake.refusals["cronjobs"] = 500
    decision, scheduled = scheduled_in(loop)
    assert scheduled is None
    assert [p for p in decision.problems if p.startswith("scheduled jobs unknown: read CronJobs")]
