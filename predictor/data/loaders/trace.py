"""Demand traces: Philly nodes, Helios virtual clusters and generic series, as one long table.

A trace spec is `KIND:PATH` (the form every CLI `--trace` takes). Each kind has the test
window BENCHMARKS.md fixes for the public trace; a file of the same format covering other
dates falls back to the generic rule (test = last 25% of the time range), so the same
commands run on traces the project has never seen.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from predictor.data.loaders.csvfile import CsvTable, read_table
from predictor.data.series import STEP, resample
from predictor.foundation.errors import InputError

TRACE_KINDS: tuple[str, ...] = ("philly", "helios-vc", "series")
UNITS: tuple[str, ...] = ("nodes", "gpus")

PHILLY_TEST = (pd.Timestamp("2017-12-01 00:00"), pd.Timestamp("2017-12-15 00:00"))
HELIOS_TEST_START = pd.Timestamp("2020-05-22 00:00")
TEST_SHARE = 0.25


@dataclass(frozen=True, eq=False)
class DemandTrace:
    """Demand of one trace file at its native resolution.

    `frame`: long table sorted by `unique_id`, `ds`; columns `unique_id` (str), `ds`
    (datetime64[ns]), `y` (float demand in `unit`), optional `capacity` (float, same unit)
    and exogenous columns (Helios: `running`, `pending`). The test window is every step with
    `test_start <= ds <= test_end` (`test_end` labels the last step of the window, at the
    frame's own resolution); training data is everything before `test_start`.

    `test_window` is that window, or why the trace has none (too short to split): only what
    splits a trace (a backtest, a replay) needs it, so such a trace still imports, and
    `test_start` / `test_end` raise the reason.
    """

    kind: str
    path: str
    frame: pd.DataFrame
    unit: str
    test_window: tuple[pd.Timestamp, pd.Timestamp] | InputError

    @property
    def test_start(self) -> pd.Timestamp:
        return self._split_window()[0]

    @property
    def test_end(self) -> pd.Timestamp:
        return self._split_window()[1]

    def _split_window(self) -> tuple[pd.Timestamp, pd.Timestamp]:
        if isinstance(self.test_window, InputError):
            raise self.test_window
        return self.test_window

    @property
    def label(self) -> str:
        """The `trace` field of benchmark rows."""
        return self.kind

    @property
    def series_ids(self) -> list[str]:
        return list(self.frame["unique_id"].unique())

    @classmethod
    def from_frame(
        cls,
        frame: pd.DataFrame,
        *,
        kind: str = "series",
        unit: str = "nodes",
        path: str = "",
        split: str | pd.Timestamp | None = None,
    ) -> DemandTrace:
        """A trace of an in-memory long table (e.g. generated demand), with the generic
        test window (last 25% of the range) unless `split` sets its start."""
        if kind not in TRACE_KINDS or unit not in UNITS:
            raise InputError(f"kind {kind!r} or unit {unit!r} is not known")
        missing = {"unique_id", "ds", "y"} - set(frame.columns)
        if missing:
            raise InputError(f"frame lacks the column(s) {', '.join(sorted(missing))}")
        frame = frame.sort_values(["unique_id", "ds"], kind="stable").reset_index(drop=True)
        return cls(
            kind, path, frame, unit, _test_window(frame["ds"], (None, None), split, path or None)
        )

    def split_frame(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """(training rows before `test_start`, test rows in the window)."""
        ds = self.frame["ds"]
        train = self.frame[ds < self.test_start]
        test = self.frame[(ds >= self.test_start) & (ds <= self.test_end)]
        return train.reset_index(drop=True), test.reset_index(drop=True)

    def resampled(self, step: pd.Timedelta = STEP) -> DemandTrace:
        """The trace on regular steps (max of the minutes inside each, see `series.resample`).

        The test window moves to whole steps: it starts at the first step that lies wholly
        at or after `test_start` (no step mixes training and test minutes) and ends with the
        step holding `test_end`.
        """
        step = pd.Timedelta(step)
        window = self.test_window
        if not isinstance(window, InputError):
            window = (window[0].ceil(step), window[1].floor(step))
        return dataclasses.replace(self, frame=resample(self.frame, step), test_window=window)


def load_trace(
    spec: str, *, split: str | pd.Timestamp | None = None, unit: str | None = None
) -> DemandTrace:
    """Load `KIND:PATH` (kinds in TRACE_KINDS; `.csv` or gzip `.csv.gz`).

    `split` sets the test start (any kind); `unit` says what a generic series counts
    ("nodes" by default, or "gpus"); the public formats fix their own unit.
    """
    kind, sep, path = spec.partition(":")
    if not sep or kind not in TRACE_KINDS or not path:
        raise InputError(
            f"trace spec {spec!r} must be KIND:PATH with KIND one of {', '.join(TRACE_KINDS)}"
        )
    if unit is not None and unit not in UNITS:
        raise InputError(f"unit {unit!r} must be one of {', '.join(UNITS)}")
    if unit is not None and kind != "series" and unit != _NATIVE_UNIT[kind]:
        raise InputError(f"a {kind} trace counts {_NATIVE_UNIT[kind]}, not {unit}")
    file = Path(path).expanduser()
    if kind == "philly":
        frame = _philly(read_table(file, ["time", "active", "total"], text=["time"]))
        default = PHILLY_TEST
    elif kind == "helios-vc":
        table = read_table(
            file,
            ["time", "running_gpu_num", "pending_gpu_num", "total_gpu_num"],
            text=["time"],
        )
        frame = _helios(table, _stem(file))
        default = (HELIOS_TEST_START, None)
    else:
        frame = _series(file)
        default = (None, None)
    return DemandTrace(
        kind=kind,
        path=str(file),
        frame=frame,
        unit=unit or _NATIVE_UNIT[kind],
        test_window=_test_window(frame["ds"], default, split, file),
    )


_NATIVE_UNIT = {"philly": "nodes", "helios-vc": "gpus", "series": "nodes"}


def _philly(table: CsvTable) -> pd.DataFrame:
    ds = table.timestamps("time")
    table.check_increasing(ds, None, "time")
    return pd.DataFrame(
        {
            "unique_id": "philly",
            "ds": ds,
            "y": table.numbers("active"),
            "capacity": table.numbers("total"),
        }
    )


def _helios(table: CsvTable, uid: str) -> pd.DataFrame:
    ds = table.timestamps("time")
    table.check_increasing(ds, None, "time")
    running = table.numbers("running_gpu_num")
    pending = table.numbers("pending_gpu_num")
    return pd.DataFrame(
        {
            "unique_id": uid,
            "ds": ds,
            "y": running + pending,
            "capacity": table.numbers("total_gpu_num"),
            "running": running,
            "pending": pending,
        }
    )


def _series(file: Path) -> pd.DataFrame:
    """`timestamp,value` (one series named after the file) or `series_id,timestamp,value`."""
    table = read_table(
        file, ["timestamp", "value"], optional=["series_id"], text=["timestamp", "series_id"]
    )
    ds = table.timestamps("timestamp")
    if "series_id" in table.frame.columns:
        ids = table.text("series_id")
        table.check_increasing(ds, ids, "timestamp")
    else:
        ids = pd.Series(_stem(file), index=ds.index)
        table.check_increasing(ds, None, "timestamp")
    frame = pd.DataFrame({"unique_id": ids.astype(str), "ds": ds, "y": table.numbers("value")})
    return frame.sort_values(["unique_id", "ds"], kind="stable").reset_index(drop=True)


def _test_window(
    ds: pd.Series,
    default: tuple[pd.Timestamp | None, pd.Timestamp | None],
    split: str | pd.Timestamp | None,
    file: Path | str | None,
) -> tuple[pd.Timestamp, pd.Timestamp] | InputError:
    """The test window; a `split` that is no timestamp raises, and a window that leaves no
    training or test data is returned as the error, for whatever splits the trace."""
    first, last = ds.min(), ds.max()
    default_start, stop = default
    if split is not None:
        try:
            start = pd.Timestamp(split)
        except ValueError:
            raise InputError(f"split {split!r} is not a timestamp (YYYY-MM-DD[THH:MM])") from None
        if start.tzinfo is not None:
            start = start.tz_convert("UTC").tz_localize(None)
    elif default_start is not None and first < default_start <= last:
        start = default_start
    else:
        cut = first + (last - first) * (1 - TEST_SHARE)
        start = cut.floor(STEP)
        if start <= first:  # a span shorter than a step or two: split at the data's own step
            start = ds[ds >= cut].min()
    if not first < start <= last:
        return InputError(
            f"test start {start} leaves no {'training' if start <= first else 'test'} data"
            f" (the data run from {first} to {last})",
            path=file,
        )
    end = last if stop is None or stop <= start else ds[ds < stop].max()
    return start, end


def _stem(file: Path) -> str:
    name = file.name
    for suffix in (".gz", ".csv"):
        name = name.removesuffix(suffix)
    return name
