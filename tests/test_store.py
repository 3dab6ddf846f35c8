"""Telemetry store: round trips, idempotent upserts, gaps, and all-or-nothing batches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from predictor.data.loaders import load_trace
from predictor.foundation.errors import InputError
from predictor.telemetry.store import TelemetryStore

# A child process that writes one small batch, then one big one (about a second of work).
WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import pandas as pd
    from predictor.telemetry.store import TelemetryStore

    store = TelemetryStore(sys.argv[1])
    n = int(sys.argv[2])
    small = pd.DataFrame({"unique_id": "s", "ds": pd.date_range("2024-01-01", periods=10,
                          freq="min"), "y": 1.0})
    store.append(small, metric="small")
    print("ready", flush=True)
    big = pd.DataFrame({"unique_id": "b", "ds": pd.date_range("2024-01-01", periods=n,
                        freq="min"), "y": np.arange(n, dtype=float)})
    store.append(big, metric="big")
    print("done", flush=True)
    """
)
BIG = 300_000


def start_writer(state: Path) -> subprocess.Popen[str]:
    root = Path(__file__).resolve().parents[1]
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(state), str(BIG)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )


def points(uid: str, start: str, n: int, value: float = 1.0) -> pd.DataFrame:
    ds = pd.date_range(start, periods=n, freq="10min")
    return pd.DataFrame({"unique_id": uid, "ds": ds, "y": value + np.arange(n, dtype=float)})


def test_round_trip_and_idempotent_upsert(tmp_path: Path) -> None:
    store = TelemetryStore(tmp_path / "state")
    batch = points("a100", "2024-01-01", 6)
    assert store.append(batch, source="test", labels={"unit": "gpus"}) == 6
    store.append(batch, source="test")
    out = store.query()
    pd.testing.assert_frame_equal(out, batch)
    # a later value for the same point replaces the earlier one
    store.append(batch.assign(y=99.0).iloc[:1])
    assert store.query()["y"].tolist()[:2] == [99.0, 2.0]
    info = store.series()
    assert info[["metric", "unique_id", "count"]].values.tolist() == [["gpu_demand", "a100", 6]]
    assert info["labels"][0] == {"unit": "gpus"}
    assert info["last"][0] == pd.Timestamp("2024-01-01 00:50")
    window = store.query(start="2024-01-01 00:10", end="2024-01-01 00:30", unique_ids=["a100"])
    assert len(window) == 3
    assert store.query(step="30min")["y"].tolist() == [99.0, 6.0]
    assert store.query(metric="other").empty


def test_label_columns_and_bad_batches(tmp_path: Path) -> None:
    store = TelemetryStore(tmp_path)
    store.append(points("t4", "2024-01-01", 3).assign(gpu_model="T4"), metric="demand")
    assert store.series("demand")["labels"][0] == {"gpu_model": "T4"}
    bad = [
        points("t4", "2024-01-01", 3).assign(y=[1.0, float("nan"), 2.0]),
        points("t4", "2024-01-01", 3).drop(columns="ds"),
        pd.concat([points("t4", "2024-01-01", 2), points("t4", "2024-01-01", 1)]),
        points("t4", "2024-01-01", 2).assign(gpu_model=["T4", "A100"]),
    ]
    for frame in bad:
        with pytest.raises(InputError):
            store.append(frame, metric="demand")
    assert store.count("demand") == 3


def test_gaps(tmp_path: Path) -> None:
    store = TelemetryStore(tmp_path)
    store.record_gap("prometheus", "2024-01-02", "2024-01-02 01:00", "connection refused")
    store.record_gap("nvml", "2024-01-01", "2024-01-01 00:10", "driver reset")
    gaps = store.gaps()
    assert gaps["source"].tolist() == ["nvml", "prometheus"]
    assert gaps["end"][1] == pd.Timestamp("2024-01-02 01:00")
    assert store.gaps("nvml")["reason"].tolist() == ["driver reset"]
    with pytest.raises(InputError):
        store.record_gap("x", "2024-01-02", "2024-01-01", "backwards")


def test_import_trace(traces_dir: Path, tmp_path: Path) -> None:
    trace = load_trace(f"helios-vc:{traces_dir / 'helios-earth' / 'vcJkd.csv.gz'}").resampled()
    store = TelemetryStore(tmp_path)
    written = store.import_traces([trace])
    assert written == 4 * len(trace.frame)
    store.import_traces([trace])
    assert store.count() == len(trace.frame)
    assert set(store.series()["metric"]) == {"gpu_demand", "capacity", "running", "pending"}
    demand = store.query()
    assert (demand["y"].to_numpy() == trace.frame["y"].to_numpy()).all()
    assert store.series("gpu_demand")["labels"][0]["unit"] == "gpus"


def test_killed_writer_leaves_no_partial_batch(tmp_path: Path) -> None:
    state = tmp_path / "state"
    TelemetryStore(state)
    writer = start_writer(state)
    assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
    # Kill once uncommitted pages of the big batch are spilling into the WAL.
    wal = state / "telemetry.sqlite-wal"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if wal.exists() and wal.stat().st_size > 2_000_000:
            break
        time.sleep(0.005)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert writer.returncode == -signal.SIGKILL
    store = TelemetryStore(state)
    assert store.count("small") == 10
    assert store.count("big") in (0, BIG)
    assert store.count("big") == 0, "killed before commit: the batch must be absent"


def test_concurrent_reader_sees_whole_batches_only(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = TelemetryStore(state)
    writer = start_writer(state)
    assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
    wal = state / "telemetry.sqlite-wal"
    seen, during_write = [], 0
    while writer.poll() is None:
        spilling = wal.exists() and wal.stat().st_size > 2_000_000
        seen.append(store.count("big"))
        during_write += spilling and seen[-1] == 0
    assert writer.returncode == 0
    seen.append(store.count("big"))
    assert set(seen) <= {0, BIG} and seen[-1] == BIG
    assert during_write > 0, "the reader ran while the batch was being written"


def test_readers_never_create_a_store_and_the_first_write_does(tmp_path: Path) -> None:
    state = tmp_path / "state"
    reader = TelemetryStore(state)
    assert reader.query().empty and reader.series().empty and reader.gaps().empty
    assert reader.count() == 0
    assert not state.exists()  # neither the file nor its folder
    with pytest.raises(InputError, match="no telemetry store here") as caught:
        TelemetryStore.existing(state)
    assert caught.value.path == str(state)

    TelemetryStore(state).append(points("a100", "2024-01-01", 3))
    assert reader.count() == 3  # the same reader sees the store once another made it
    assert TelemetryStore.existing(state).count() == 3


def test_store_show_on_an_empty_folder_says_so_and_leaves_it_empty(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from scaler.cli import app

    result = CliRunner().invoke(app, ["store", "show", "--state-dir", str(tmp_path), "--json"])
    assert isinstance(result.exception, InputError), result.output
    assert "no telemetry store here" in str(result.exception)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda p: p.write_bytes(b"garbage\n"), "not a SQLite database"),
        (lambda p: p.mkdir(), "is a folder"),
    ],
)
def test_a_store_file_that_is_no_database_is_refused_naming_it(
    tmp_path: Path, make: Callable[[Path], object], reason: str
) -> None:
    make(tmp_path / "telemetry.sqlite")
    for use in (
        lambda: TelemetryStore(tmp_path),
        lambda: TelemetryStore.existing(tmp_path),
    ):
        with pytest.raises(InputError, match=reason) as caught:
            use()
        assert caught.value.path == str(tmp_path / "telemetry.sqlite")


def test_a_series_keeps_its_unit(tmp_path: Path) -> None:
    store = TelemetryStore(tmp_path)
    store.append(points("pool", "2024-01-01", 3), labels={"unit": "nodes", "path": "a.csv"})
    relabelled = points("pool", "2024-01-01 00:30", 2, value=9.0)
    with pytest.raises(InputError, match=r"'pool' .* stored in nodes, not gpus") as caught:
        store.append(relabelled, labels={"unit": "gpus", "path": "b.csv"})
    assert caught.value.path == str(store.path)
    assert store.count() == 3  # nothing of the refused batch was written
    assert store.series()["labels"][0] == {"unit": "nodes", "path": "a.csv"}
    store.append(relabelled, labels={"unit": "nodes", "path": "b.csv"})  # same unit: fine
    assert store.count() == 5 and store.series()["labels"][0]["path"] == "b.csv"


def test_store_import_takes_a_trace_too_short_to_split(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from scaler.cli import app

    one = tmp_path / "one.csv"
    one.write_text("timestamp,value\n2024-01-01T00:00,1\n")
    state = tmp_path / "state"
    result = CliRunner().invoke(
        app, ["store", "import", "--state-dir", str(state), "--trace", f"series:{one}"]
    )
    assert result.exit_code == 0, result.output
    assert TelemetryStore(state).query()["y"].tolist() == [1.0]
