"""The decision log: every decision with its inputs and outcome, and the journal of actions.

One SQLite file (`decisions.sqlite`, WAL mode) in the state directory, beside the telemetry
store, so a decision can be replayed from what it saw and an operator can ask why a node
came or went. Three tables:

- `decisions`: when, by whom, whether it was applied, its inputs (telemetry status, demand
  outlook, fleet), the plan with the reason of each pool's size, and the outcome;
- `actions`: the journal. An action is written as `pending` BEFORE it is carried out and
  completed after, so a process killed in between finds it on restart and resolves it
  against the cloud instead of repeating it blindly;
- `state`: small named blobs the loop keeps between runs (the planner's memory, the nodes
  it knew, nodes it will not try to remove for a while), written in the same transaction
  as the decision they belong to.

Pickle is used only for the loop's own state, written and read by this package.
"""

from __future__ import annotations

import json
import pickle  # nosec B403
import sqlite3
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from predictor.foundation.json_values import json_value
from predictor.foundation.sqlite_db import SqliteFile

FILENAME = "decisions.sqlite"
ActionStatus = Literal["pending", "done", "failed", "blocked", "skipped", "superseded"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS decisions (
    id INTEGER PRIMARY KEY,
    at INTEGER NOT NULL,
    identity TEXT NOT NULL,
    applied INTEGER NOT NULL,
    inputs TEXT NOT NULL,
    plan TEXT NOT NULL,
    outcome TEXT
);
CREATE TABLE IF NOT EXISTS actions (
    id INTEGER PRIMARY KEY,
    decision_id INTEGER REFERENCES decisions (id),
    pool TEXT NOT NULL,
    kind TEXT NOT NULL,
    target TEXT NOT NULL,
    params TEXT NOT NULL,
    status TEXT NOT NULL,
    started INTEGER NOT NULL,
    finished INTEGER,
    result TEXT
);
CREATE INDEX IF NOT EXISTS actions_pending ON actions (status);
CREATE TABLE IF NOT EXISTS state (
    key TEXT PRIMARY KEY,
    value BLOB NOT NULL
);
"""


@dataclass(frozen=True)
class Action:
    id: int
    decision_id: int | None
    pool: str
    kind: str  # set_target, lower_target, remove_node, uncordon, set_buffer, ...
    target: str  # the pool, the node, ...
    params: dict[str, Any]
    status: str
    result: str | None = None
    started_ns: int | None = None
    finished_ns: int | None = None


@dataclass(frozen=True)
class JournalEntry:
    id: int
    at_ns: int
    identity: str
    applied: bool
    inputs: dict[str, Any]
    plan: dict[str, Any]
    outcome: dict[str, Any] | None


class DecisionJournal:
    """Decisions, the action journal and the loop's state in `state_dir/decisions.sqlite`.
    Each call opens its own connection, so several processes may share one log."""

    def __init__(self, state_dir: str | Path) -> None:
        self.state_dir = Path(state_dir).expanduser()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.state_dir / FILENAME
        self._db = SqliteFile(self.path)
        self._db.create(_SCHEMA)

    # ---- decisions -----------------------------------------------------------------------
    def record(
        self,
        identity: str,
        applied: bool,
        inputs: Mapping[str, Any],
        plan: Mapping[str, Any],
        state: Mapping[str, Any] | None = None,
        mark: str | None = None,
        outcome: Mapping[str, Any] | None = None,
    ) -> int:
        """Store a decision (before acting on it) and, in the same transaction, the loop
        state it leads to, the decision's id under the state key `mark` (so whoever
        started it finds it again after a kill) and, for a decision nothing acts on, its
        `outcome`; returns its id."""
        with self._db.transaction() as conn:
            cursor = conn.execute(
                "INSERT INTO decisions (at, identity, applied, inputs, plan, outcome)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (
                    time.time_ns(),
                    identity,
                    int(applied),
                    _json(inputs),
                    _json(plan),
                    None if outcome is None else _json(outcome),
                ),
            )
            decision_id = int(cursor.lastrowid)
            for key, value in (state or {}).items():
                _put(conn, key, value)
            if mark is not None:
                _put(conn, mark, decision_id)
            return decision_id

    def decision(self, decision_id: int) -> JournalEntry | None:
        with self._db.connect() as conn:
            row = conn.execute(
                "SELECT id, at, identity, applied, inputs, plan, outcome FROM decisions"
                " WHERE id = ?",
                (decision_id,),
            ).fetchone()
        return None if row is None else _entry(row)

    def finish(self, decision_id: int, outcome: Mapping[str, Any]) -> None:
        with self._db.transaction() as conn:
            conn.execute(
                "UPDATE decisions SET outcome = ? WHERE id = ?", (_json(outcome), decision_id)
            )

    def decisions(
        self, limit: int | None = None, since_ns: int | None = None, open_only: bool = False
    ) -> list[JournalEntry]:
        """Newest first; those made at or after `since_ns`; with `open_only`, those without
        an outcome."""
        where, args = [], []
        if since_ns is not None:
            where.append("at >= ?")
            args.append(since_ns)
        if open_only:
            where.append("outcome IS NULL")
        sql = "SELECT id, at, identity, applied, inputs, plan, outcome FROM decisions"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        with self._db.connect() as conn:
            rows = conn.execute(sql, args).fetchall()
        return [_entry(r) for r in rows]

    # ---- the action journal --------------------------------------------------------------
    def begin(
        self, decision_id: int | None, pool: str, kind: str, target: str, params: Mapping
    ) -> int:
        """Journal an action as pending, durably, before it is carried out."""
        with self._db.transaction() as conn:
            cursor = conn.execute(
                "INSERT INTO actions (decision_id, pool, kind, target, params, status, started)"
                " VALUES (?, ?, ?, ?, ?, 'pending', ?)",
                (decision_id, pool, kind, target, _json(params), time.time_ns()),
            )
            return int(cursor.lastrowid)

    def complete(self, action_id: int, status: ActionStatus, result: str) -> None:
        with self._db.transaction() as conn:
            conn.execute(
                "UPDATE actions SET status = ?, finished = ?, result = ? WHERE id = ?",
                (status, time.time_ns(), result, action_id),
            )

    def action(self, action_id: int) -> Action | None:
        with self._db.connect() as conn:
            row = conn.execute(
                "SELECT id, decision_id, pool, kind, target, params, status, result, started,"
                " finished FROM actions WHERE id = ?",
                (action_id,),
            ).fetchone()
        return None if row is None else Action(*row[:5], json.loads(row[5]), *row[6:])

    def pending(self) -> list[Action]:
        return self.actions(status="pending")

    def actions(
        self,
        status: str | None = None,
        decision_ids: Sequence[int] | None = None,
        since_ns: int | None = None,
    ) -> list[Action]:
        """Oldest first; those of `status`, of the decisions `decision_ids`, started at or
        after `since_ns`."""
        where: list[str] = []
        args: list[object] = []
        if status is not None:
            where.append("status = ?")
            args.append(status)
        if decision_ids is not None:
            where.append(f"decision_id IN ({', '.join('?' * len(decision_ids))})")
            args.extend(decision_ids)
        if since_ns is not None:
            where.append("started >= ?")
            args.append(since_ns)
        sql = (
            "SELECT id, decision_id, pool, kind, target, params, status, result, started,"
            " finished FROM actions"
        )
        if where:
            sql += " WHERE " + " AND ".join(where)
        with self._db.connect() as conn:
            rows = conn.execute(sql + " ORDER BY id", args).fetchall()
        return [Action(*r[:5], json.loads(r[5]), *r[6:]) for r in rows]

    # ---- loop state ----------------------------------------------------------------------
    def load(self, key: str, default: Any = None) -> Any:
        with self._db.connect() as conn:
            row = conn.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        # Only this class writes the state table, in the loop's private state directory.
        return default if row is None else pickle.loads(row[0])  # nosec B301

    def save(self, key: str, value: Any) -> None:
        with self._db.transaction() as conn:
            _put(conn, key, value)


def _entry(r: tuple) -> JournalEntry:
    return JournalEntry(
        id=r[0],
        at_ns=r[1],
        identity=r[2],
        applied=bool(r[3]),
        inputs=json.loads(r[4]),
        plan=json.loads(r[5]),
        outcome=None if r[6] is None else json.loads(r[6]),
    )


def _put(conn: sqlite3.Connection, key: str, value: Any) -> None:
    conn.execute(
        "INSERT INTO state (key, value) VALUES (?, ?)"
        " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (key, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)),
    )


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=json_value)
