"""The embedded telemetry store: demand and other metrics as points, under a state directory.

SQLite in WAL mode, one file (`telemetry.sqlite`) in the state directory. SQLite rather
than a single-writer engine because several processes use the store at once: the collector
writes samples, the scaler and the service read history and write decisions. In WAL mode
readers never block the writer and always see the last committed state; writers queue on
a lock (with a generous busy timeout) instead of failing.

Every batch is one transaction: a reader sees all of it or none of it, and a process killed
mid-write leaves the store as it was before the batch (SQLite ignores WAL frames after the
last commit on recovery). Points are upserted on (metric, series, timestamp), so ingesting
the same data twice changes nothing. The store records only what was observed: an outage of
a source is recorded as a gap, never filled with made-up values.

Timestamps are naive UTC, stored as integer nanoseconds since the epoch.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from predictor.data.loaders import DemandTrace
from predictor.data.series import resample
from predictor.foundation.errors import InputError
from predictor.foundation.sqlite_db import SqliteFile

FILENAME = "telemetry.sqlite"
SCHEMA_VERSION = 1
DEFAULT_METRIC = "gpu_demand"
# What each column of a trace becomes in the store; its unit travels in the labels.
TRACE_METRICS = {
    "y": DEFAULT_METRIC,
    "capacity": "capacity",
    "running": "running",
    "pending": "pending",
}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS series (
    id INTEGER PRIMARY KEY,
    metric TEXT NOT NULL,
    name TEXT NOT NULL,
    source TEXT NOT NULL,
    labels TEXT NOT NULL,
    UNIQUE (metric, name)
);
CREATE TABLE IF NOT EXISTS points (
    series_id INTEGER NOT NULL REFERENCES series (id),
    ts INTEGER NOT NULL,
    value REAL NOT NULL,
    PRIMARY KEY (series_id, ts)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS gaps (
    id INTEGER PRIMARY KEY,
    source TEXT NOT NULL,
    start INTEGER NOT NULL,
    end INTEGER NOT NULL,
    reason TEXT NOT NULL,
    recorded INTEGER NOT NULL
);
"""


@dataclass(frozen=True, eq=False)
class _Batch:
    """Validated points of one metric, ready to write."""

    metric: str
    source: str
    names: np.ndarray
    ts: np.ndarray
    values: np.ndarray
    labels: dict[str, dict[str, str]]


class TelemetryStore:
    """Metrics as (metric, series, timestamp, value) points in `state_dir/telemetry.sqlite`.

    Safe to use from several processes at once; each call opens its own connection, so an
    instance holds no open handle between calls. The file is made by the first write: a
    reader of a store that is not there yet finds it empty and leaves nothing behind
    (`existing` refuses it instead, for commands that only read).
    """

    def __init__(self, state_dir: str | Path) -> None:
        self.state_dir = Path(state_dir).expanduser()
        self.path = self.state_dir / FILENAME
        self._db = SqliteFile(self.path)
        self._ready = False
        if self.path.exists():
            self._open()  # a damaged or newer store fails here, before any work

    @classmethod
    def existing(cls, state_dir: str | Path) -> TelemetryStore:
        """The store in `state_dir`, which must be there: for commands that only read."""
        store = cls(state_dir)
        if not store._ready:
            raise InputError(f"no telemetry store here ({FILENAME} missing)", path=store.state_dir)
        return store

    def _open(self) -> None:
        """Check the file's schema version, and give a new file the schema."""
        with self._db.connect() as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise InputError(
                    f"store schema version {version} is newer than this gpuscale understands"
                    f" ({SCHEMA_VERSION})",
                    path=self.path,
                )
            if version < SCHEMA_VERSION:
                # WAL is a property of the file (it persists) and cannot change in a transaction.
                conn.execute("PRAGMA journal_mode=WAL")
                conn.executescript(
                    f"BEGIN IMMEDIATE; {_SCHEMA} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;"
                )
        self._ready = True

    def create(self) -> None:
        """Make the store now, for a writer at its start: a state_dir that cannot hold it
        (a file, a read-only folder) fails here (OSError, sqlite3.Error), before any work."""
        self._writable()

    def _writable(self) -> SqliteFile:
        """The database, created on the first write: a store is never made by a reader."""
        if not self._ready:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._open()
        return self._db

    def _rows(self, sql: str, args: Sequence[object] = ()) -> list[tuple]:
        """The rows of a read; a store not yet written (by another process, say) has none."""
        if not self._ready and self.path.exists():
            self._open()
        if not self._ready:
            return []
        with self._db.connect() as conn:
            return conn.execute(sql, args).fetchall()

    def append(
        self,
        points: pd.DataFrame,
        *,
        metric: str = DEFAULT_METRIC,
        source: str = "api",
        labels: Mapping[str, str] | None = None,
    ) -> int:
        """Upsert a long table (`unique_id`, `ds`, `y`; any other column is a label of its
        series and must be constant within it) in one transaction; returns rows written.

        The whole batch is validated before the write begins: bad input raises `InputError`
        and writes nothing.
        """
        batch = _validate(points, metric, source, labels or {})
        with self._writable().transaction() as conn:
            _write(conn, batch, self.path)
        return len(batch.ts)

    def append_metrics(
        self, batches: Sequence[tuple[str, pd.DataFrame]], *, source: str = "api"
    ) -> int:
        """Upsert the points of several metrics, (metric, points) pairs as `append` takes
        them, in one transaction: a reader sees all of them or none, and a batch refused
        (bad input, a unit conflict) writes nothing of the others. Returns rows written."""
        validated = [_validate(points, metric, source, {}) for metric, points in batches]
        with self._writable().transaction() as conn:
            for batch in validated:
                _write(conn, batch, self.path)
        return sum(len(b.ts) for b in validated)

    def import_traces(self, traces: Sequence[DemandTrace], *, source: str = "trace") -> int:
        """Write every column of every trace (see TRACE_METRICS) in one transaction; series
        are labelled with the trace kind, unit and file. Returns the points written."""
        batches = []
        for trace in traces:
            labels = {"trace": trace.label, "unit": trace.unit, "path": trace.path}
            for column, metric in TRACE_METRICS.items():
                if column in trace.frame.columns:
                    part = trace.frame[["unique_id", "ds", column]].rename(columns={column: "y"})
                    batches.append(_validate(part, metric, source, labels))
        with self._writable().transaction() as conn:
            for batch in batches:
                _write(conn, batch, self.path)
        return sum(len(b.ts) for b in batches)

    def query(
        self,
        metric: str = DEFAULT_METRIC,
        unique_ids: Sequence[str] | None = None,
        start: pd.Timestamp | str | None = None,
        end: pd.Timestamp | str | None = None,
        *,
        step: pd.Timedelta | str | None = None,
    ) -> pd.DataFrame:
        """Points of `metric` with `start <= ds <= end` as a long table (`unique_id`, `ds`,
        `y`) sorted by series and time; with `step`, resampled (max per step)."""
        sql = (
            "SELECT s.name, p.ts, p.value FROM points p JOIN series s ON s.id = p.series_id"
            " WHERE s.metric = ?"
        )
        args: list[object] = [metric]
        if unique_ids is not None:
            sql += f" AND s.name IN ({','.join('?' * len(unique_ids))})"
            args.extend(unique_ids)
        if start is not None:
            sql += " AND p.ts >= ?"
            args.append(_ns(start))
        if end is not None:
            sql += " AND p.ts <= ?"
            args.append(_ns(end))
        sql += " ORDER BY s.name, p.ts"
        rows = self._rows(sql, args)
        names, ts, values = zip(*rows, strict=True) if rows else ((), (), ())
        frame = pd.DataFrame(
            {
                "unique_id": pd.Series(names, dtype=object),
                "ds": pd.to_datetime(np.asarray(ts, dtype="int64"), unit="ns"),
                "y": np.asarray(values, dtype="float64"),
            }
        )
        return frame if step is None else resample(frame, pd.Timedelta(step))

    def count(self, metric: str = DEFAULT_METRIC) -> int:
        """Points stored for `metric`."""
        rows = self._rows(
            "SELECT COUNT(*) FROM points p JOIN series s ON s.id = p.series_id WHERE s.metric = ?",
            (metric,),
        )
        return rows[0][0] if rows else 0

    def series(self, metric: str | None = None) -> pd.DataFrame:
        """One row per series: `metric`, `unique_id`, `source`, `labels` (dict), `first`,
        `last` (timestamps), `count` (points)."""
        sql = (
            "SELECT s.metric, s.name, s.source, s.labels, MIN(p.ts), MAX(p.ts), COUNT(p.ts)"
            " FROM series s JOIN points p ON p.series_id = s.id"
        )
        args: tuple[str, ...] = ()
        if metric is not None:
            sql += " WHERE s.metric = ?"
            args = (metric,)
        sql += " GROUP BY s.id ORDER BY s.metric, s.name"
        rows = self._rows(sql, args)
        columns = ["metric", "unique_id", "source", "labels", "first", "last", "count"]
        frame = pd.DataFrame(rows, columns=columns)
        frame["labels"] = [json.loads(text) for text in frame["labels"]]
        for column in ("first", "last"):
            frame[column] = pd.to_datetime(frame[column].astype("int64"), unit="ns")
        frame["count"] = frame["count"].astype("int64")
        return frame

    def record_gap(
        self, source: str, start: pd.Timestamp | str, end: pd.Timestamp | str, reason: str
    ) -> None:
        """Record that `source` delivered nothing from `start` to `end` (inclusive)."""
        first, last = _ns(start), _ns(end)
        if last < first:
            raise InputError(f"gap end {end} is before its start {start}")
        with self._writable().transaction() as conn:
            conn.execute(
                "INSERT INTO gaps (source, start, end, reason, recorded) VALUES (?, ?, ?, ?, ?)",
                (source, first, last, reason, time.time_ns()),
            )

    def gaps(self, source: str | None = None) -> pd.DataFrame:
        """Recorded gaps, oldest first: `source`, `start`, `end`, `reason`, `recorded_at`."""
        sql = "SELECT source, start, end, reason, recorded FROM gaps"
        args: tuple[str, ...] = ()
        if source is not None:
            sql += " WHERE source = ?"
            args = (source,)
        rows = self._rows(sql + " ORDER BY start, id", args)
        frame = pd.DataFrame(rows, columns=["source", "start", "end", "reason", "recorded_at"])
        for column in ("start", "end", "recorded_at"):
            frame[column] = pd.to_datetime(frame[column].astype("int64"), unit="ns")
        return frame


def _validate(points: pd.DataFrame, metric: str, source: str, labels: Mapping[str, str]) -> _Batch:
    for column in ("unique_id", "ds", "y"):
        if column not in points.columns:
            raise InputError(f"points lack the column {column!r}", column=column)
    if not metric or not source:
        raise InputError("metric and source must be non-empty")
    names = points["unique_id"].astype(str).to_numpy()
    if (names == "").any() or points["unique_id"].isna().any():
        raise InputError("empty series name", column="unique_id")
    ds = pd.to_datetime(points["ds"], errors="coerce")
    if ds.isna().any():
        raise InputError("missing or unparsable timestamp", column="ds")
    if getattr(ds.dt, "tz", None) is not None:
        ds = ds.dt.tz_convert("UTC").dt.tz_localize(None)
    values = pd.to_numeric(points["y"], errors="coerce").to_numpy(dtype="float64")
    if not np.isfinite(values).all():
        raise InputError("missing or non-finite value", column="y")
    ts = ds.to_numpy(dtype="datetime64[ns]").astype("int64")
    keys = pd.DataFrame({"name": names, "ts": ts})
    duplicated = keys.duplicated()
    if duplicated.any():
        row = int(duplicated.to_numpy().argmax())
        raise InputError(
            f"series {names[row]!r} has two points at {ds.iloc[row]} in one batch", column="ds"
        )
    extra = [c for c in points.columns if c not in ("unique_id", "ds", "y")]
    per_series: dict[str, dict[str, str]] = {}
    label_frame = points[extra].astype(str).assign(unique_id=names)
    for name, group in label_frame.groupby("unique_id", sort=False):
        own = {str(k): str(v) for k, v in labels.items()}
        for column in extra:
            distinct = group[column].unique()
            if len(distinct) > 1:
                raise InputError(
                    f"label {column!r} of series {name!r} changes within the batch", column=column
                )
            own[column] = distinct[0]
        per_series[str(name)] = own
    return _Batch(metric, source, names, ts, values, per_series)


def _write(conn: sqlite3.Connection, batch: _Batch, path: Path) -> None:
    ids: dict[str, int] = {}
    for name, labels in batch.labels.items():
        row = conn.execute(
            "SELECT id, labels FROM series WHERE metric = ? AND name = ?", (batch.metric, name)
        ).fetchone()
        if row is None:
            cursor = conn.execute(
                "INSERT INTO series (metric, name, source, labels) VALUES (?, ?, ?, ?)",
                (batch.metric, name, batch.source, json.dumps(labels, sort_keys=True)),
            )
            ids[name] = int(cursor.lastrowid)
        else:
            stored = json.loads(row[1])
            _check_unit(batch.metric, name, stored.get("unit"), labels.get("unit"), path)
            merged = {**stored, **labels}
            conn.execute(
                "UPDATE series SET source = ?, labels = ? WHERE id = ?",
                (batch.source, json.dumps(merged, sort_keys=True), row[0]),
            )
            ids[name] = int(row[0])
    series_ids = pd.Series(batch.names).map(ids).to_numpy(dtype="int64")
    conn.executemany(
        "INSERT INTO points (series_id, ts, value) VALUES (?, ?, ?)"
        " ON CONFLICT (series_id, ts) DO UPDATE SET value = excluded.value",
        zip(series_ids.tolist(), batch.ts.tolist(), batch.values.tolist(), strict=True),
    )


def _check_unit(metric: str, name: str, stored: str | None, new: str | None, path: Path) -> None:
    """A series keeps its unit: relabelling it would change what its stored points mean."""
    if stored is not None and new is not None and stored != new:
        raise InputError(
            f"series {name!r} ({metric}) is stored in {stored}, not {new}: import it in"
            f" {stored}, or under another series name",
            path=path,
        )


def _ns(moment: pd.Timestamp | str) -> int:
    stamp = pd.Timestamp(moment)
    if stamp.tzinfo is not None:
        stamp = stamp.tz_convert("UTC").tz_localize(None)
    return int(stamp.as_unit("ns").value)
