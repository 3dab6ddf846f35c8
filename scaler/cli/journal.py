"""`gpuscale journal`: the decision log of a state directory, read without sqlite3."""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from scaler.cli.output import table_console

if TYPE_CHECKING:
    from scaler.controller.journal_view import JournalView

STATE_DIR_HELP = "State directory holding decisions.sqlite (default: the config's state_dir)."
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add this module's commands to the app."""
    app.command("journal")(journal)


def journal(
    config: Annotated[
        Path | None,
        typer.Option("--config", envvar="GPUSCALE_CONFIG", help="Live config YAML (state_dir)."),
    ] = None,
    state_dir: Annotated[Path | None, typer.Option("--state-dir", help=STATE_DIR_HELP)] = None,
    pending: Annotated[
        bool,
        typer.Option(
            "--pending", help="Only actions still pending and decisions without an outcome."
        ),
    ] = False,
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            help="Only what happened since: a UTC time (2025-03-01T12:00) or an age (90s,"
            " 30m, 2h, 1d).",
        ),
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option("--limit", min=1, help="The newest N decisions (default: all)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the journal as JSON.")] = False,
) -> None:
    """Show the decision log: each decision of `gpuscale scale` (and `gpuscale defrag`)
    with its status, what it set each pool to and why, and each action it journaled
    with its status and result.

    A decision is done, failed (its pass ended with errors), dry run, superseded (a kill
    stopped its pass; the next pass settled its actions against the cloud and planned
    afresh) or open (no outcome yet: its pass is under way, or was killed and no pass has
    run since). An action is pending until it is carried out and completed, and a
    restart settles what a kill left pending: done when the cloud shows it applied,
    superseded otherwise.

    Reads the state directory of --config (or --state-dir); writes nothing.
    """
    from predictor.foundation.errors import InputError
    from scaler.controller.journal import FILENAME, DecisionJournal
    from scaler.controller.journal_view import read_journal

    folder = _state_dir(config, state_dir)
    if not (folder / FILENAME).is_file():
        raise InputError(
            f"no decision journal here ({FILENAME}): has `gpuscale scale` run on it?",
            path=folder,
        )
    view = read_journal(
        DecisionJournal(folder), since_ns=_since_ns(since), pending=pending, limit=limit
    )
    if as_json:
        typer.echo(json.dumps(view.to_dict(), default=str))
    else:
        _print(view)


def _state_dir(config: Path | None, state_dir: Path | None) -> Path:
    if state_dir is not None:
        return state_dir.expanduser()
    if config is None:
        raise typer.BadParameter("give --config or --state-dir", param_hint="--config")
    from scaler.controller.config import load_live_config

    return load_live_config(config).state_dir


def _since_ns(since: str | None) -> int | None:
    """`--since` in nanoseconds since the epoch: an age before now, or a UTC time."""
    if since is None:
        return None
    age = _DURATION.match(since.strip())
    if age is not None:
        return time.time_ns() - int(float(age.group(1)) * _UNIT_S[age.group(2)] * 1e9)
    try:
        at = datetime.fromisoformat(since.strip())
    except ValueError:
        raise typer.BadParameter(
            f"{since!r} is neither a time (2025-03-01T12:00) nor an age (30m, 2h, 1d)",
            param_hint="--since",
        ) from None
    at = at.replace(tzinfo=UTC) if at.tzinfo is None else at
    return min(int(at.timestamp() * 1e9), 2**63 - 1)  # SQLite's largest integer


def _print(view: JournalView) -> None:
    from rich.table import Table

    console = table_console()
    decisions = Table(title=f"decisions ({len(view.decisions)})")
    for column in ("id", "at (UTC)", "by", "mode", "status", "pools: target -> set, why"):
        decisions.add_column(column, justify="right" if column == "id" else "left")
    for d in view.decisions:
        pools = "\n".join(
            f"{p.pool} {'?' if p.target is None else p.target} -> {p.desired}: {p.reason}"
            for p in d.pools
        )
        status = d.status + "".join(f"\n{e}" for e in d.errors)
        mode = "applied" if d.applied else "dry run"
        decisions.add_row(str(d.id), d.at, d.identity, mode, status, pools or "-")
    console.print(decisions)
    actions = Table(title=f"actions ({len(view.actions)})")
    for column in ("id", "decision", "at (UTC)", "kind", "target", "change", "status", "result"):
        actions.add_column(column, justify="right" if column in ("id", "decision") else "left")
    for a in view.actions:
        change = ", ".join(f"{k} {v}" for k, v in sorted(a.params.items()) if k != "pool")
        actions.add_row(
            str(a.id),
            "-" if a.decision_id is None else str(a.decision_id),
            a.started or "",
            a.kind,
            a.target,
            change,
            a.status,
            a.result or "",
        )
    console.print(actions)
    waiting = sum(a.status == "pending" for a in view.actions)
    still_open = sum(d.status == "open" for d in view.decisions)
    console.print(f"{waiting} action(s) pending, {still_open} decision(s) open")
