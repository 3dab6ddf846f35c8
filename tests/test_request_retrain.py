"""The request-rate model's lifecycle: its history read off the store, the retraining gate
(promoted only over the seasonal table and the served model), the CLI, and the loop
serving it to the planner."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd
from typer.testing import CliRunner

from predictor.lifecycle.registry import REJECTED_SUFFIX, ModelRegistry
from predictor.lifecycle.request_training import PoolShape, retrain_requests, store_histories
from predictor.models.requests import RequestParams
from predictor.telemetry.store import TelemetryStore
from scaler.cli import app
from scaler.controller.config import ModelSection, load_live_config
from scaler.controller.reconcile import with_request_rates
from scaler.controller.request_model import ServedRequestModel
from scaler.planning.planner import DemandOutlook

MONDAY = datetime(2024, 1, 1)
SHAPES = {"a100": PoolShape(8, 10.0), "t4": PoolShape(4, 5.0)}
# Trees that memorise noise: a candidate the gate must refuse.
OVERFIT = RequestParams(n_estimators=300, learning_rate=1.0, num_leaves=63, min_child_samples=2)


def demand(days: int, seed: int, bursts: bool) -> np.ndarray:
    """A pool's GPU demand per minute: 1-node jobs of 30 minutes arriving at a rate that
    doubles in the afternoon and, with `bursts`, quintuples from 06:00 to 12:00 every
    other day (what only the recent requests reveal; the hour-of-week table cannot)."""
    rng = np.random.default_rng(seed)
    minutes = np.arange(days * 1440)
    hour = (minutes % 1440) / 60
    rate = 0.03 * np.where((hour >= 13) & (hour < 18), 2.0, 1.0)
    if bursts:
        rate = rate * np.where(((minutes // 1440) % 2 == 1) & (hour >= 6) & (hour < 12), 5, 1)
    arrivals = rng.poisson(rate)
    running = np.cumsum(arrivals) - np.concatenate([np.zeros(30), np.cumsum(arrivals)[:-30]])
    return running.astype(float)


def live_config(tmp_path: Path, state_dir: Path) -> Path:
    pools = [
        {
            "name": name,
            "gpu_model": name.upper(),
            "gpus_per_node": shape.gpus_per_node,
            "boot_seconds": shape.boot_minutes * 60,
            "price_per_hour": 10.0,
            "max_size": 20,
        }
        for name, shape in SHAPES.items()
    ]
    config = {
        "state_dir": str(state_dir),
        "pools": pools,
        "provider": {"kind": "simulated"},
        "model": {"name": "gpuscale"},
    }
    path = tmp_path / "scale.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def store_of(path: Path, days: int = 16, bursts: bool = True) -> TelemetryStore:
    store = TelemetryStore(path)
    ds = pd.date_range(MONDAY, periods=days * 1440, freq="min")
    for seed, (pool, shape) in enumerate(SHAPES.items()):
        nodes = demand(days, seed, bursts)
        frame = pd.DataFrame({"unique_id": pool, "ds": ds, "y": nodes * shape.gpus_per_node})
        store.append(frame, metric="gpu_demand", source="test")
        store.append(frame.assign(y=0.0), metric="pending", source="test")
    return store


def test_the_requests_are_the_rises_of_the_demand_in_whole_nodes(tmp_path: Path) -> None:
    store = TelemetryStore(tmp_path)
    ds = pd.date_range(MONDAY, periods=6, freq="min")
    gpus = [8.0, 8.0, 20.0, 12.0, 12.0, 30.0]  # nodes of 8: 1, 1, 3, 2, 2, 4
    store.append(pd.DataFrame({"unique_id": "a100", "ds": ds, "y": gpus}), source="test")
    history = store_histories(store, {"a100": PoolShape(8, 10.0)})["a100"]
    assert history.requested == [0.0, 0.0, 16.0, 0.0, 0.0, 16.0]
    assert history.pending == [0.0] * 6  # no pending series: nothing waits


def test_a_model_that_beats_the_table_is_promoted_and_one_worse_is_refused(
    tmp_path: Path,
) -> None:
    store = store_of(tmp_path / "state")
    registry = ModelRegistry(tmp_path / "models")
    first = retrain_requests(store, registry, SHAPES)
    assert first.promoted, first.reason
    assert sum(first.candidate.values()) < sum(first.seasonal.values())
    assert (first.record.name, first.record.version) == ("requests", 1)
    # The same history with trees that memorise it: worse than what is served.
    second = retrain_requests(store, registry, SHAPES, params=OVERFIT)
    assert not second.promoted
    assert second.served is not None and "does not beat" in second.reason
    assert second.record.name == "requests" + REJECTED_SUFFIX
    assert registry.served("requests").version == 1


def test_the_gate_refuses_a_model_worse_than_the_seasonal_table(tmp_path: Path) -> None:
    """No burst, nothing but the hour of the week: the table is all there is to know, and
    a model that memorises noise backtests worse than it; with nothing served it is still
    refused (a deploy never plans on a model worse than the table)."""
    store = store_of(tmp_path / "state", bursts=False)
    registry = ModelRegistry(tmp_path / "models")
    outcome = retrain_requests(store, registry, SHAPES, params=OVERFIT)
    assert not outcome.promoted
    assert outcome.reason.startswith("does not beat the seasonal table")
    assert sum(outcome.candidate.values()) > sum(outcome.seasonal.values())
    assert registry.served("requests") is None
    assert outcome.record.name == "requests" + REJECTED_SUFFIX


def test_the_loop_serves_the_promoted_model_as_the_outlooks_request_rate(tmp_path: Path) -> None:
    store = store_of(tmp_path / "state")
    served = ServedRequestModel(ModelSection(registry=tmp_path / "models"))
    pools = load_live_config(live_config(tmp_path, tmp_path / "state")).pools
    now = MONDAY + pd.Timedelta(days=15, hours=9)  # day 15 (odd): a burst is under way
    assert served.rates(store, pools, now, "s1") == {}
    assert served.source.startswith("seasonal table (the registry serves no")
    retrain_requests(store, ModelRegistry(tmp_path / "models"), SHAPES)
    served = ServedRequestModel(ModelSection(registry=tmp_path / "models"))
    rates = served.rates(store, pools, now, "s1")
    assert served.source == "requests:1"  # what each decision records as its request_source
    assert set(rates) <= {"a100", "t4"} and rates
    quiet = served.rates(store, pools, now - pd.Timedelta(days=1), "s0")  # no burst that day
    for pool in rates:
        assert rates[pool].ahead > quiet[pool].ahead
    outlook = DemandOutlook("a100", 8.0, (0.99,), np.array([[8.0]]))
    (given,) = with_request_rates([outlook], rates)
    assert given.request_rate == rates.get("a100")


def test_retrain_requests_cli_reports_the_gate(tmp_path: Path) -> None:
    store_of(tmp_path / "state")
    config = live_config(tmp_path, state_dir=tmp_path / "state")
    result = CliRunner().invoke(
        app, ["retrain-requests", "--config", str(config), "--registry", str(tmp_path / "m")]
    )
    assert result.exit_code == 0, result.output
    assert result.output.startswith("PROMOTED: beats the table")
    result = CliRunner().invoke(
        app,
        ["retrain-requests", "--config", str(config), "--registry", str(tmp_path / "m"), "--json"],
    )
    document = json.loads(result.output)
    assert document["stored_as"] in ("requests:2", "requests.rejected:1")
    assert set(document["deviance"]["candidate"]) <= {"a100", "t4"}
    assert document["deviance"]["served"] is not None


def test_without_a_registry_retrain_requests_says_so(tmp_path: Path) -> None:
    store_of(tmp_path / "state", days=2)
    config = live_config(tmp_path, state_dir=tmp_path / "state")
    done = subprocess.run(
        [sys.executable, "-m", "scaler", "retrain-requests", "--config", str(config)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.strip().endswith("no registry: pass --registry or set model.registry")
