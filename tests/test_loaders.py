"""Trace loaders on slices of the real traces, and every kind of bad input."""

from __future__ import annotations

import gzip
from pathlib import Path

import pandas as pd
import pytest

from predictor.data.loaders import (
    TRACE_KINDS,
    DemandTrace,
    load_openb_nodes,
    load_openb_pods,
    load_trace,
)
from predictor.data.series import STEP, gaps, regularize, resample
from predictor.foundation.errors import InputError


def head_lines(source: Path, n: int) -> list[str]:
    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rt") as handle:
        return [next(handle) for _ in range(n)]


def write(path: Path, lines: list[str], *, compress: bool = False) -> Path:
    data = "".join(lines).encode()
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


@pytest.fixture
def philly_slice(traces_dir: Path, tmp_path: Path) -> Path:
    # Two days and a bit: enough for a default (last 25%) window on a file of another period.
    lines = head_lines(traces_dir / "philly" / "philly_node_sequence.csv.gz", 3001)
    return write(tmp_path / "philly.csv.gz", lines, compress=True)


@pytest.fixture
def helios_slice(traces_dir: Path, tmp_path: Path) -> Path:
    lines = head_lines(traces_dir / "helios-earth" / "vc8Sj.csv.gz", 2001)
    return write(tmp_path / "vc8Sj.csv", lines)


def test_kinds() -> None:
    assert TRACE_KINDS == ("philly", "helios-vc", "series")


def test_philly_slice(philly_slice: Path) -> None:
    trace = load_trace(f"philly:{philly_slice}")
    assert isinstance(trace, DemandTrace)
    assert (trace.kind, trace.label, trace.unit) == ("philly", "philly", "nodes")
    frame = trace.frame
    assert list(frame.columns) == ["unique_id", "ds", "y", "capacity"]
    assert len(frame) == 3000
    assert frame["ds"].dtype == "datetime64[ns]"
    assert frame.iloc[0].to_dict() == {
        "unique_id": "philly",
        "ds": pd.Timestamp("2017-10-03 00:00"),
        "y": 312.0,
        "capacity": 420.0,
    }
    # Outside Dec 2017 the Philly window falls back to the last 25% of the range.
    first, last = frame["ds"].min(), frame["ds"].max()
    assert trace.test_start == (first + (last - first) * 0.75).floor(STEP)
    assert trace.test_end == last
    train, test = trace.split_frame()
    assert len(train) + len(test) == len(frame)
    assert train["ds"].max() < trace.test_start <= test["ds"].min()


def test_helios_slice(helios_slice: Path) -> None:
    trace = load_trace(f"helios-vc:{helios_slice}", split="2020-05-02T06:00")
    frame = trace.frame
    assert trace.unit == "gpus" and trace.series_ids == ["vc8Sj"]
    assert list(frame.columns) == ["unique_id", "ds", "y", "capacity", "running", "pending"]
    assert (frame["y"] == frame["running"] + frame["pending"]).all()
    assert (frame["capacity"] == 48).all()
    assert trace.test_start == pd.Timestamp("2020-05-02 06:00")


def test_full_traces_default_windows(traces_dir: Path) -> None:
    philly = load_trace(f"philly:{traces_dir / 'philly' / 'philly_node_sequence.csv.gz'}")
    assert len(philly.frame) == 105_644
    steps = philly.resampled()
    assert (steps.test_start, steps.test_end) == (
        pd.Timestamp("2017-12-01 00:00"),
        pd.Timestamp("2017-12-14 23:50"),
    )
    helios = load_trace(f"helios-vc:{traces_dir / 'helios-earth' / 'vcJkd.csv.gz'}").resampled()
    assert helios.test_start == pd.Timestamp("2020-05-22 00:00")
    assert helios.test_end == pd.Timestamp("2020-05-31 23:50")
    assert len(helios.frame) == 44_640 // 10


def test_resample_takes_the_peak_minute_and_keeps_gaps_absent() -> None:
    ds = pd.to_datetime(
        ["2024-01-01 00:00", "2024-01-01 00:04", "2024-01-01 00:09", "2024-01-01 00:31"]
    )
    frame = pd.DataFrame({"unique_id": "a", "ds": ds, "y": [1.0, 5.0, 2.0, 3.0]})
    steps = resample(frame)
    assert steps["ds"].tolist() == [
        pd.Timestamp("2024-01-01 00:00"),
        pd.Timestamp("2024-01-01 00:30"),
    ]
    assert steps["y"].tolist() == [5.0, 3.0]
    grid = regularize(steps)
    assert len(grid) == 4 and grid["y"].isna().sum() == 2
    filled = regularize(steps, fill="ffill")
    assert filled["y"].tolist() == [5.0, 5.0, 5.0, 3.0]
    assert filled["filled"].tolist() == [False, True, True, False]
    holes = gaps(steps)
    assert holes.iloc[0][["start", "end", "steps"]].tolist() == [
        pd.Timestamp("2024-01-01 00:10"),
        pd.Timestamp("2024-01-01 00:20"),
        2,
    ]


def test_resampled_window_never_mixes_train_and_test(helios_slice: Path) -> None:
    trace = load_trace(f"helios-vc:{helios_slice}", split="2020-05-02T06:05")
    steps = trace.resampled()
    assert steps.test_start == pd.Timestamp("2020-05-02 06:10")


def test_series_wide_and_long(tmp_path: Path) -> None:
    wide = write(
        tmp_path / "demand.csv",
        ["timestamp,value\n"] + [f"2024-01-01T{h:02d}:00,{h}\n" for h in range(8)],
    )
    trace = load_trace(f"series:{wide}")
    assert trace.series_ids == ["demand"] and trace.unit == "nodes"
    assert trace.test_start == pd.Timestamp("2024-01-01 05:10")
    assert trace.test_end == pd.Timestamp("2024-01-01 07:00")
    long = write(
        tmp_path / "pools.csv.gz",
        ["series_id,timestamp,value\n"]
        + [f"b,2024-01-01T{h:02d}:00,{h}\n" for h in range(4)]
        + [f"a,2024-01-01T{h:02d}:00,{2 * h}\n" for h in range(4)],
        compress=True,
    )
    trace = load_trace(f"series:{long}", split="2024-01-01T02:00", unit="gpus")
    assert trace.series_ids == ["a", "b"] and trace.unit == "gpus"
    assert trace.frame["y"].tolist() == [0, 2, 4, 6, 0, 1, 2, 3]


def test_openb(traces_dir: Path) -> None:
    openb = traces_dir / "alibaba-openb"
    nodes = load_openb_nodes(openb / "openb_node_list_gpu_node.csv")
    assert len(nodes) == 1213 and nodes["gpu"].sum() == 6212
    pods = load_openb_pods(openb / "openb_pod_list_gpuspec20.csv")
    assert len(pods) == 8152
    assert set(pods["gpu_spec"]) >= {"", "T4", "V100M16|V100M32"}
    assert pods["num_gpu"].between(0, 8).all() and pods["gpu_milli"].between(0, 1000).all()
    lean = load_openb_pods(openb / "openb_pod_list_multigpu20.csv")  # no gpu_spec, no qos
    assert (lean["gpu_spec"] == "").all() and lean["creation_time"].isna().all()


PHILLY_HEADER = "time,active,total\n"
GOOD = ["2017-10-03 00:00:00,312,420\n", "2017-10-03 00:01:00,309,420\n"]


@pytest.mark.parametrize(
    ("lines", "line", "column", "words"),
    [
        (["time,active\n", "2017-10-03 00:00:00,1\n"], 1, "total", "missing column"),
        ([PHILLY_HEADER, GOOD[0], "yesterday,1,420\n"], 3, "time", "timestamp"),
        ([PHILLY_HEADER, GOOD[1], GOOD[0]], 3, "time", "out of order"),
        ([PHILLY_HEADER, GOOD[0], GOOD[0]], 3, "time", "duplicate"),
        ([PHILLY_HEADER, *GOOD, "2017-10-03 00:02:00,,420\n"], 4, "active", "missing"),
        ([PHILLY_HEADER, *GOOD, "2017-10-03 00:02:00,NaN,420\n"], 4, "active", "missing"),
        ([PHILLY_HEADER, GOOD[0], "2017-10-03 00:01:00,-3,420\n"], 3, "active", "minimum"),
        ([PHILLY_HEADER, GOOD[0], "2017-10-03 00:01:00,abc,420\n"], 3, "active", "not a number"),
        ([PHILLY_HEADER, GOOD[0], "\n", GOOD[1]], 3, "time", "missing"),
        ([PHILLY_HEADER, GOOD[0], "2017-10-03 00:01:00,1,420,7\n"], 3, None, "fields"),
        ([PHILLY_HEADER], 2, None, "no data rows"),
        ([], 1, None, "empty file"),
    ],
)
def test_bad_philly_input(
    tmp_path: Path, lines: list[str], line: int, column: str | None, words: str
) -> None:
    path = write(tmp_path / "bad.csv", lines)
    with pytest.raises(InputError) as caught:
        load_trace(f"philly:{path}")
    error = caught.value
    assert (error.path, error.line, error.column) == (str(path), line, column)
    assert words in str(error) and f"{path}:{line}" in str(error)


def test_bad_long_series_order_is_per_series(tmp_path: Path) -> None:
    ok = ["series_id,timestamp,value\n", "a,2024-01-01T01:00,1\n", "b,2024-01-01T00:00,1\n"]
    load_trace(f"series:{write(tmp_path / 'ok.csv', [*ok, 'a,2024-01-01T02:00,1'])}")
    path = write(tmp_path / "bad.csv", [*ok, "a,2024-01-01T00:30,1\n"])
    with pytest.raises(InputError, match="out of order of series 'a'") as caught:
        load_trace(f"series:{path}")
    assert caught.value.line == 4


def test_bad_specs_and_files(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="philly, helios-vc, series"):
        load_trace("alibaba:/x.csv")
    with pytest.raises(InputError, match="file not found"):
        load_trace(f"series:{tmp_path / 'absent.csv'}")
    fake = write(tmp_path / "fake.csv.gz", ["timestamp,value\n", "2024-01-01,1\n"])
    with pytest.raises(InputError, match="not gzip"):
        load_trace(f"series:{fake}")
    # gzip recognised by its bytes even under a plain name
    real = write(
        tmp_path / "real.csv",
        ["timestamp,value\n", "2024-01-01,1\n", "2024-01-02,2\n"],
        compress=True,
    )
    assert len(load_trace(f"series:{real}").frame) == 2
    truncated = tmp_path / "cut.csv.gz"
    truncated.write_bytes(gzip.compress(b"timestamp,value\n" + b"2024-01-01,1\n" * 500)[:-30])
    with pytest.raises(InputError, match="gzip"):
        load_trace(f"series:{truncated}")
    with pytest.raises(InputError, match="no training data"):
        load_trace(f"series:{real}", split="2023-01-01").split_frame()


def test_bad_openb(tmp_path: Path) -> None:
    header = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
    # Larger than any node is the cluster's verdict (a failed pod), not malformed input.
    big = load_openb_pods(write(tmp_path / "big.csv", [header, "p0,1000,1024,9,1000\n"]))
    assert big["num_gpu"].tolist() == [9]
    for row, column, words in [
        ("p1,1000,1024,1,1001\n", "gpu_milli", "maximum"),
        ("p1,1000,1024,2,500\n", "gpu_milli", "whole GPUs"),
        ("p1,-1,1024,0,0\n", "cpu_milli", "minimum"),
        ("p1,1.5,1024,0,0\n", "cpu_milli", "whole number"),
    ]:
        path = write(tmp_path / "pods.csv", [header, "p0,1000,1024,1,500\n", row])
        with pytest.raises(InputError, match=words) as caught:
            load_openb_pods(path)
        assert (caught.value.line, caught.value.column) == (3, column)
    nodes = write(
        tmp_path / "nodes.csv",
        ["sn,cpu_milli,memory_mib,gpu,model\n", "n0,1000,1024,2,T4\n", "n0,1000,1024,2,T4\n"],
    )
    with pytest.raises(InputError, match="duplicate") as caught:
        load_openb_nodes(nodes)
    assert (caught.value.line, caught.value.column) == (3, "sn")


def test_a_name_of_only_blanks_is_missing(tmp_path: Path) -> None:
    series = ["series_id,timestamp,value\n", "a,2024-01-01,1\n", "  ,2024-01-02,1\n"]
    nodes = ["sn,cpu_milli,memory_mib,gpu,model\n", "n0,1000,1024,2,T4\n", " ,1000,1024,2,T4\n"]
    for load, lines, column in [
        (lambda path: load_trace(f"series:{path}"), series, "series_id"),
        (load_openb_nodes, nodes, "sn"),
    ]:
        with pytest.raises(InputError, match="missing value") as caught:
            load(write(tmp_path / "names.csv", lines))
        assert (caught.value.line, caught.value.column) == (3, column)


NAMED_LIKE_MISSING = ("NA", "None", "null", "nan", "N/A", "NULL", "#N/A", "<NA>")


def test_a_name_that_pandas_reads_as_missing_is_that_name(tmp_path: Path) -> None:
    """Only an empty cell is a missing name: series, nodes and pods named NA, None, ... load
    as those names. A number column still reads pandas' NA strings as missing."""
    series = ["series_id,timestamp,value\n"] + [
        f"{name},2024-01-01T0{h}:00,{h}\n" for name in NAMED_LIKE_MISSING for h in (0, 1)
    ]
    trace = load_trace(f"series:{write(tmp_path / 'series.csv', series)}")
    assert trace.series_ids == sorted(NAMED_LIKE_MISSING)
    nodes = ["sn,cpu_milli,memory_mib,gpu,model\n"] + [
        f"{name},1000,1024,2,{name}\n" for name in NAMED_LIKE_MISSING
    ]
    loaded = load_openb_nodes(write(tmp_path / "nodes.csv", nodes))
    assert loaded["sn"].tolist() == loaded["model"].tolist() == list(NAMED_LIKE_MISSING)
    pods = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli,qos,deletion_time\n"] + [
        f"{name},1000,1024,1,500,{name},NaN\n" for name in NAMED_LIKE_MISSING
    ]
    loaded = load_openb_pods(write(tmp_path / "pods.csv", pods))
    assert loaded["name"].tolist() == loaded["qos"].tolist() == list(NAMED_LIKE_MISSING)
    assert loaded["deletion_time"].isna().all()
    bad = write(tmp_path / "bad.csv", [PHILLY_HEADER, *GOOD, "2017-10-03 00:02:00,NA,420\n"])
    with pytest.raises(InputError, match="missing value") as caught:
        load_trace(f"philly:{bad}")
    assert (caught.value.line, caught.value.column) == (4, "active")


def test_a_column_name_padded_with_blanks_is_still_read_as_text(tmp_path: Path) -> None:
    """The header `series_id ,timestamp`: its ids (here digits) stay names, as unpadded."""
    lines = ["series_id , timestamp,value\n", "1,2024-01-01T00:00,1\n", "NA,2024-01-01T00:00,2\n"]
    trace = load_trace(f"series:{write(tmp_path / 'padded.csv', lines)}")
    assert trace.series_ids == ["1", "NA"]


def test_short_series_still_splits(tmp_path: Path) -> None:
    two = write(
        tmp_path / "two.csv", ["timestamp,value\n", "2024-01-01T00:00,1\n", "2024-01-01T00:05,2\n"]
    )
    trace = load_trace(f"series:{two}")
    assert trace.test_start == trace.test_end == pd.Timestamp("2024-01-01 00:05")
    one = write(tmp_path / "one.csv", ["timestamp,value\n", "2024-01-01T00:00,1\n"])
    # A trace too short to split still loads (to be imported, say); only a split fails.
    single = load_trace(f"series:{one}").resampled()
    assert single.frame["y"].tolist() == [1.0]
    for window in (lambda: single.test_start, lambda: single.test_end, single.split_frame):
        with pytest.raises(InputError, match="no training data") as caught:
            window()
        assert caught.value.path == str(one)


def test_encodings(tmp_path: Path) -> None:
    windows = tmp_path / "excel.csv"  # byte-order mark and CRLF, as spreadsheets write them
    windows.write_bytes(
        b"\xef\xbb\xbftimestamp,value\r\n2024-01-01T00:00,1\r\n2024-01-01T00:10,2\r\n"
    )
    assert load_trace(f"series:{windows}").frame["y"].tolist() == [1.0, 2.0]
    latin = tmp_path / "latin.csv"
    latin.write_bytes(b"timestamp,value\n2024-01-01T00:00,1\n2024-01-01T00:10,\xe9\n")
    with pytest.raises(InputError, match="not UTF-8") as caught:
        load_trace(f"series:{latin}")
    assert caught.value.line == 3
