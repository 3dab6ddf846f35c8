"""SQLite as the embedded database of the product (telemetry store, decision log).

WAL mode, because the collector, the reconcile loop and the service read and write the
same files at once: readers never block the writer and never see an uncommitted batch.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from predictor.foundation.errors import InputError

BUSY_TIMEOUT_S = 60.0
# Errors that say the file itself is unusable, not that a query failed or the database was
# busy: the operator's to fix, so they are bad input naming the file.
_BAD_FILE = {
    sqlite3.SQLITE_NOTADB: "not a SQLite database",
    sqlite3.SQLITE_CORRUPT: "damaged (SQLite finds it corrupt)",
    sqlite3.SQLITE_CANTOPEN: "cannot be opened",
    sqlite3.SQLITE_READONLY: "cannot be written (read-only)",
}


@dataclass(frozen=True)
class SqliteFile:
    """One database file; each call opens its own connection (safe across threads and
    processes, and nothing is left open by a caller that dies)."""

    path: Path

    def create(self, schema: str) -> None:
        """Switch to WAL and apply `schema` (idempotent `CREATE ... IF NOT EXISTS`)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.connect() as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(f"BEGIN IMMEDIATE; {schema} COMMIT;")

    @contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        if self.path.is_dir():  # SQLite would only say "unable to open database file"
            raise InputError("is a folder, not a database file", path=self.path)
        try:
            # isolation_level=None: transactions are begun explicitly, never implicitly.
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            try:
                # NORMAL is durable against a killed process in WAL mode; only a power loss
                # can drop the last transactions, never corrupt the file.
                conn.execute("PRAGMA synchronous=NORMAL")
                yield conn
            finally:
                conn.close()
        except sqlite3.DatabaseError as exc:
            # The primary result code is the low byte of the extended one.
            reason = _BAD_FILE.get(getattr(exc, "sqlite_errorcode", 0) & 0xFF)
            if reason is None:
                raise
            raise InputError(f"{reason} ({exc})", path=self.path) from None

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self.connect() as conn:
            # IMMEDIATE takes the write lock up front, so two writers queue rather than
            # deadlock on a lock upgrade.
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
