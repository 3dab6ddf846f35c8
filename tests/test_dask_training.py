"""Training on a Dask LocalCluster: 200 generated series, shards fitted on two workers,
the same shard models as in one process, and backtest quality within 2% of one global
model trained in one process."""

from __future__ import annotations

import json
import time

import numpy as np
import pandas as pd
import pytest

from predictor.evaluation.backtest import pinball
from predictor.models import BoostParams, build
from predictor.models.forecast import quantile_column

SERIES = 200
STEPS = 6 * 24 * 3  # three days of 10-minute steps
SMALL = {"horizons": (3,), "params": BoostParams(n_estimators=30, min_child_samples=100)}


def generated(seed: int = 11) -> pd.DataFrame:
    """Whole-GPU demand of `SERIES` pools: a daily cycle, a random walk and jumps."""
    rng = np.random.default_rng(seed)
    ds = pd.date_range("2026-01-05", periods=STEPS, freq="10min")
    day = np.sin(2 * np.pi * np.arange(STEPS) / 144)
    frames = []
    for i in range(SERIES):
        size = rng.choice([8, 32, 128])
        walk = np.cumsum(rng.normal(0, 0.02 * size, STEPS))
        jumps = np.cumsum(rng.binomial(1, 0.01, STEPS) * rng.normal(0, 0.2 * size, STEPS))
        y = np.clip(np.round(size * (0.5 + 0.25 * day) + walk + jumps), 0, None)
        frames.append(pd.DataFrame({"unique_id": f"pool-{i:03d}", "ds": ds, "y": y}))
    return pd.concat(frames, ignore_index=True)


def mean_pinball(model, history: pd.DataFrame, start: pd.Timestamp) -> float:
    out = model.rolling(history, 3, start, (0.9, 0.99)).frame
    assert out["unique_id"].nunique() == history["unique_id"].nunique()
    actual = history.set_index(["unique_id", "ds"])["y"]
    y = actual.reindex(pd.MultiIndex.from_frame(out[["unique_id", "ds"]])).to_numpy()
    return float(np.mean([pinball(y, out[quantile_column(q)].to_numpy(), q) for q in (0.9, 0.99)]))


@pytest.fixture(scope="module")
def cluster():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None
    ) as local:
        yield local


def test_sharded_training_on_two_workers_matches_one_process(cluster) -> None:
    history = generated()
    start = history["ds"].max() - pd.Timedelta("12h")
    train = history[history["ds"] < start]

    began = time.perf_counter()
    on_dask = build(
        "sharded", model="lightgbm", shards=4, scheduler=cluster.scheduler_address, params=SMALL
    ).fit(train)
    dask_seconds = time.perf_counter() - began
    began = time.perf_counter()
    local = build("sharded", model="lightgbm", shards=4, params=SMALL).fit(train)
    sharded_seconds = time.perf_counter() - began
    began = time.perf_counter()
    whole = build("lightgbm", **SMALL).fit(train)
    global_seconds = time.perf_counter() - began
    print(
        f"\nfit of {SERIES} series: dask 2 workers {dask_seconds:.2f} s, shards in one process"
        f" {sharded_seconds:.2f} s, one global model {global_seconds:.2f} s"
    )

    assert len(on_dask.models) == 4
    few = history[history["unique_id"].isin([f"pool-{i:03d}" for i in range(0, SERIES, 25)])]
    # the same shard models wherever they were fitted
    assert mean_pinball(on_dask, few, start) == mean_pinball(local, few, start)
    dask_loss = mean_pinball(on_dask, history, start)
    global_loss = mean_pinball(whole, history, start)
    print(f"mean pinball p90/p99 at 30 min: dask {dask_loss:.4f}, one process {global_loss:.4f}")
    assert abs(dask_loss - global_loss) <= 0.02 * global_loss


def test_train_command_fits_on_the_dask_scheduler(cluster, tmp_path) -> None:
    from typer.testing import CliRunner

    from scaler.cli import app

    path = tmp_path / "pools.csv"
    pools = generated().query("unique_id < 'pool-006'")
    pools.set_axis(["series_id", "timestamp", "value"], axis=1).to_csv(path, index=False)
    registry = tmp_path / "models"
    result = CliRunner().invoke(
        app,
        ["train", "--trace", f"series:{path}", "--model", "empirical", "--name", "pools",
         "--registry", str(registry), "--dask-scheduler", cluster.scheduler_address,
         "--shards", "2", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    meta = json.loads(result.output)
    assert meta["dask"] == {"scheduler": cluster.scheduler_address, "shards": 2}
    assert meta["settings"]["model"] == "empirical" and len(meta["series"]) == 6
    shown = CliRunner().invoke(app, ["forecast", "--model", "pools", "--trace", f"series:{path}",
                                     "--registry", str(registry), "--json"])  # fmt: skip
    assert shown.exit_code == 0, shown.output


@pytest.mark.parametrize(
    ("address", "says"),
    [("notaurl", "not a Dask scheduler address"), ("tcp://host:port", "not a Dask")],
)
def test_a_malformed_scheduler_address_is_an_input_error(address: str, says: str) -> None:
    pytest.importorskip("distributed")
    from predictor.foundation.errors import InputError
    from predictor.models.sharded import dask_client

    began = time.perf_counter()
    with pytest.raises(InputError, match=says):
        dask_client(address)
    assert time.perf_counter() - began < 5
