"""Synthetic workload generator: deterministic, the right shape, realistic magnitudes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from predictor.foundation.errors import InputError
from scaler.cluster.pools import NodePool
from scaler.evaluation.synthetic import (
    ScheduledConfig,
    WorkloadConfig,
    default_config_path,
    generate,
    load_config,
    with_boot,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def week():  # one generated week shared by the shape tests
    return generate(load_config(), seed=7, days=7)


def test_default_config_is_shipped_once() -> None:
    assert default_config_path().is_file()
    linked = REPO / "data" / "synthetic" / "default.yaml"
    assert linked.resolve() == default_config_path().resolve()


def test_same_seed_same_workload() -> None:
    config = load_config()
    one, two = generate(config, seed=3, days=2), generate(config, seed=3, days=2)
    pd.testing.assert_frame_equal(one.jobs, two.jobs)
    pd.testing.assert_frame_equal(one.demand, two.demand)
    other = generate(config, seed=4, days=2)
    assert not other.demand["y"].equals(one.demand["y"])


def test_shape(week) -> None:
    assert [p.name for p in week.pools] == ["a100", "h100", "t4"]
    assert all(isinstance(p, NodePool) for p in week.pools)
    jobs = week.jobs
    assert list(jobs.columns) == [
        "job_id", "stream", "kind", "pool", "submit", "gpus", "gpu_milli", "cpu_milli",
        "memory_mib", "duration_min", "priority", "scheduled",
    ]  # fmt: skip
    assert not jobs["scheduled"].any()  # the default workload has no CronJob
    assert jobs["job_id"].is_unique and jobs["submit"].is_monotonic_increasing
    assert set(jobs["kind"]) == {"training", "inference"}
    assert (jobs["submit"] < week.end).all()
    # warm-up jobs are kept only while they still run in the window
    ends = jobs["submit"].dt.floor("min") + pd.to_timedelta(jobs["duration_min"], unit="min")
    assert (ends > week.start).all()
    demand = week.demand
    assert list(demand.columns) == ["unique_id", "ds", "y"]
    assert len(demand) == 3 * 7 * 1440
    assert (demand["y"] >= 0).all()


def test_job_mix_is_heavy_tailed(week) -> None:
    jobs = week.jobs
    sizes = jobs.loc[jobs["kind"] == "training", "gpus"].value_counts(normalize=True)
    assert sizes[1] > 0.35 and sizes.index.max() >= 32
    shared = jobs[jobs["gpu_milli"] < 1000]
    assert len(shared) > 0 and (shared["gpus"] == 1).all() and (shared["pool"] == "t4").all()
    durations = jobs.loc[jobs["kind"] == "training", "duration_min"]
    assert durations.mean() > 2 * durations.median()  # log-normal tail


def test_demand_matches_jobs_and_magnitudes(week) -> None:
    # recompute one minute by hand from the job list
    moment = week.start + pd.Timedelta("3D14h")
    jobs = week.jobs
    begin = jobs["submit"].dt.floor("min")
    running = jobs[
        (begin <= moment) & (begin + pd.to_timedelta(jobs["duration_min"], "min") > moment)
    ]
    expected = (running["gpus"] * running["gpu_milli"] / 1000).groupby(running["pool"]).sum()
    at = week.demand[week.demand["ds"] == moment].set_index("unique_id")["y"]
    assert np.allclose(at.reindex(expected.index), expected)
    means = week.demand.groupby("unique_id")["y"].mean()
    assert ((means > 10) & (means < 500)).all()
    # daily cycle: the afternoon is busier than the small hours on the training pools
    a100 = week.demand[week.demand["unique_id"] == "a100"]
    by_hour = a100.groupby(a100["ds"].dt.hour)["y"].mean()
    assert by_hour.loc[13:18].mean() > by_hour.loc[2:7].mean()


def test_trace_of_the_workload(week) -> None:
    trace = week.trace()
    assert trace.unit == "gpus" and trace.series_ids == ["a100", "h100", "t4"]
    assert week.start < trace.test_start < trace.test_end < week.end


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda c: c["pools"][0].update(max_size=-1), "pools.0.max_size"),
        (lambda c: c["pools"][1].update(min_size=99), "pools.1"),
        (lambda c: c["streams"][0].update(pools={"v100": 1.0}), "streams.0.pools"),
        (lambda c: c["streams"][1].update(gpus={6: 1.0}), "streams.1.gpus"),
        (lambda c: c["streams"][1]["duration"].pop("median_minutes"), "streams.1.duration"),
        (lambda c: c.update(colour="blue"), "colour"),
        # inf and rates past what is held in memory reached numpy ("lam value too large")
        (lambda c: c["streams"][0].update(jobs_per_hour=float("inf")), "streams.0.jobs_per_hour"),
        (lambda c: c["streams"][0].update(jobs_per_hour=1e12), "streams.0.jobs_per_hour"),
        (lambda c: c["streams"][0]["bursts"].update(factor=1e300), "streams.0.bursts.factor"),
        (lambda c: c["streams"][0]["bursts"].update(per_week=1e12), "streams.0.bursts.per_week"),
        (lambda c: c.update(days=0.0001), "days"),  # under a minute: no demand at all
        (lambda c: c.update(days=float("nan")), "days"),
    ],
)
def test_bad_config_names_the_field(tmp_path: Path, change, field: str) -> None:
    config = yaml.safe_load(default_config_path().read_text())
    change(config)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(InputError) as caught:
        load_config(path)
    assert caught.value.path == str(path)
    assert caught.value.column is not None and caught.value.column.startswith(field)


def test_unreadable_config(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="file not found"):
        load_config(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("pools: [\n  - name: a\n days: 3\n")
    with pytest.raises(InputError, match="YAML") as caught:
        load_config(broken)
    assert caught.value.line is not None


def test_scheduled_runs_fire_at_their_cron_times_and_stay_out_of_the_intensity() -> None:
    config = load_config().model_copy(
        update={
            "scheduled": [
                ScheduledConfig(
                    name="nightly-eval", pool="a100", cron="30 2 * * *", gpus=32,
                    duration_minutes=90,
                )
            ]
        }
    )  # fmt: skip
    plain = generate(load_config(), seed=3, days=4)
    with_runs = generate(config, seed=3, days=4)
    runs = with_runs.jobs[with_runs.jobs["scheduled"]]
    # The warm-up's runs (3 days) still running at the start are gone: one run a night.
    assert list(runs["submit"]) == [
        pd.Timestamp("2024-01-01 02:30") + pd.Timedelta(days=d) for d in range(4)
    ]
    assert set(runs["gpus"]) == {32} and set(runs["duration_min"]) == {90}
    # The random streams are drawn as before, and their true intensity ignores the runs.
    rest = with_runs.jobs[~with_runs.jobs["scheduled"]].drop(columns="job_id")
    assert rest.reset_index(drop=True).equals(plain.jobs.drop(columns="job_id"))
    assert with_runs.intensity.equals(plain.intensity)
    assert with_runs.demand["y"].sum() > plain.demand["y"].sum()


def test_intensity_is_the_expected_gpus_a_minute_of_the_random_streams(week) -> None:
    intensity = week.intensity
    assert list(intensity.columns) == ["unique_id", "ds", "y"]
    assert len(intensity) == len(week.demand)
    asked = week.jobs[week.jobs["submit"] >= week.start]
    for pool, rows in intensity.groupby("unique_id"):
        mine = asked[asked["pool"] == pool]
        drawn = float((mine["gpus"] * mine["gpu_milli"] / 1000).sum())
        # A week of Poisson draws lands near its expectation.
        assert drawn == pytest.approx(rows["y"].sum(), rel=0.15)


def test_a_scheduled_run_names_a_known_pool_and_a_cron_expression() -> None:
    base = load_config().model_dump()
    bad_pool = {**base, "scheduled": [{"name": "x", "pool": "v100", "cron": "0 * * * *",
                                       "gpus": 8, "duration_minutes": 10}]}  # fmt: skip
    with pytest.raises(ValueError, match="unknown pool 'v100'"):
        WorkloadConfig.model_validate(bad_pool)
    bad_cron = {**bad_pool, "scheduled": [{**bad_pool["scheduled"][0], "pool": "a100",
                                           "cron": "every night"}]}  # fmt: skip
    with pytest.raises(ValueError, match="cron: "):
        WorkloadConfig.model_validate(bad_cron)
    ragged = {**bad_pool, "scheduled": [{**bad_pool["scheduled"][0], "pool": "a100",
                                         "gpus": 12}]}  # fmt: skip
    with pytest.raises(ValueError, match="whole nodes"):
        WorkloadConfig.model_validate(ragged)


def test_a_pinned_boot_outlives_the_runs_boot_time() -> None:
    config = load_config(REPO / "data" / "synthetic" / "scheduled.yaml")
    generated = generate(config, seed=0, days=2)
    boots = {p.name: p.boot_seconds for p in with_boot(generated.pools, 10, generated.pinned_boot)}
    assert boots == {"a100": 600, "h100": 600, "t4": 600, "l40s": 1500}
    assert set(generated.jobs["pool"]) == {"a100", "h100", "t4", "l40s"}
    unknown = {**config.model_dump(), "boot_minutes": {"v100": 25}}
    with pytest.raises(ValueError, match="unknown pool 'v100'"):
        WorkloadConfig.model_validate(unknown)
