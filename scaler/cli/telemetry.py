"""CLI command `collect`: sample the cluster's telemetry sources into the store."""

from __future__ import annotations

import json
import logging
import signal
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from predictor.foundation.errors import InputError

if TYPE_CHECKING:
    from predictor.telemetry.collector import CollectorMetrics
    from predictor.telemetry.store import TelemetryStore

STATE_DIR_HELP = "State directory holding the telemetry store (created if missing)."


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add this module's commands to the app and the bench group."""
    app.command("collect")(collect)


def collect(
    config: Annotated[
        Path,
        typer.Option(
            "--config",
            envvar="GPUSCALE_COLLECT_CONFIG",
            help="Collector YAML: interval_s, retry, and a section per source (prometheus,"
            " kubernetes, nvml). GPUSCALE_* environment variables override it.",
        ),
    ],
    state_dir: Annotated[
        Path, typer.Option("--state-dir", envvar="GPUSCALE_STATE_DIR", help=STATE_DIR_HELP)
    ],
    once: Annotated[
        bool, typer.Option("--once", help="Backfill, take one sample of each source, exit.")
    ] = False,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            min=1,
            max=65535,
            help="Serve the collector's own /metrics on this port.",
        ),
    ] = None,
    metrics_addr: Annotated[
        str, typer.Option("--metrics-addr", help="Address the /metrics server binds.")
    ] = "0.0.0.0",  # nosec B104
    as_json: Annotated[
        bool, typer.Option("--json", help="With --once: print what was collected as JSON.")
    ] = False,
) -> None:
    """Collect GPU telemetry (Prometheus/DCGM, Kubernetes, NVML) into the telemetry store.

    Every source is sampled on the same grid (multiples of interval_s). On start, Prometheus
    history is backfilled from where the store stops (or over prometheus.backfill_s when it
    has nothing). A source that fails is retried with exponential backoff; if it stays
    down, each sample it owed is recorded as a gap (see `gpuscale store show`) and the
    other sources carry on. No value is ever made up.

    Runs until SIGTERM or Ctrl-C, or with --once takes one sample and exits (status 1 if a
    source failed). With --metrics-port it serves points written, source errors, gaps and
    lag per source on /metrics.
    """
    import pandas as pd
    from rich.progress import Progress

    from predictor.telemetry.collector import Collector, CollectorMetrics, build_sources
    from predictor.telemetry.config import load_config

    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings = load_config(config)
    sources = build_sources(settings)
    if not sources:
        raise InputError("names no source (prometheus, kubernetes or nvml)", path=config)
    metrics = CollectorMetrics()
    stop_metrics = None
    try:
        store = _store(state_dir)
        stop_metrics = _serve_metrics(metrics, metrics_port, metrics_addr)
        collector = Collector(
            store,
            sources,
            pd.Timedelta(seconds=settings.interval_s),
            settings.retry.policy(),
            metrics,
        )
        window = pd.Timedelta(
            seconds=settings.prometheus.backfill_s if settings.prometheus is not None else 0
        )
        now = collector.clock()
        with Progress(transient=True, disable=as_json) as progress:
            task = progress.add_task("backfilling history", total=None)
            backfilled = collector.backfill(
                window,
                now,
                progress=lambda done, total: progress.update(task, completed=done, total=total),
            )
        # Catch up on grid points that passed while backfilling, so that live samples
        # continue the history without a hole.
        caught_up = collector.clock()
        if collector.grid_floor(caught_up) > collector.grid_floor(now):
            backfilled += collector.backfill(window, caught_up)
        if once:
            outcomes = collector.collect_once(caught_up)
            _report(backfilled, outcomes, as_json)
            if any(o.error is not None for o in outcomes):
                raise typer.Exit(1)
            return
        logging.getLogger(__name__).info(
            "backfilled %d points; sampling %s every %d s",
            backfilled,
            ", ".join(s.name for s in collector.sources),
            settings.interval_s,
        )
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        for source in collector.sources:
            source.start()
        collector.run(stop, start_at=collector.grid_floor(caught_up))
    finally:
        for source in sources:
            source.close()
        if stop_metrics is not None:
            stop_metrics()


def _store(state_dir: Path) -> TelemetryStore:
    """The store, made before any source is asked: a state dir that cannot hold it failed
    at the first write, a traceback in the backfill or, in a sampling thread, every
    sample's points lost while the collector ran on."""
    from predictor.telemetry.store import TelemetryStore

    store = TelemetryStore(state_dir)
    try:
        store.create()
    except (OSError, sqlite3.Error) as exc:
        reason = "a file, not a folder" if isinstance(exc, FileExistsError) else _why(exc)
        raise typer.BadParameter(
            f"cannot keep the telemetry store in {state_dir}: {reason}", param_hint="--state-dir"
        ) from None
    return store


def _serve_metrics(
    metrics: CollectorMetrics, port: int | None, addr: str
) -> Callable[[], None] | None:
    """Start /metrics (None without a port); a port taken or an address that is not
    this machine's is a bad option, before any sampling."""
    if port is None:
        return None
    try:
        return metrics.serve(port, addr)
    except OSError as exc:
        raise typer.BadParameter(
            f"cannot serve /metrics on {addr}:{port}: {_why(exc)}", param_hint="--metrics-port"
        ) from None


def _why(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _report(backfilled: int, outcomes: list, as_json: bool) -> None:
    document = {
        "backfilled_points": backfilled,
        "samples": [
            {"source": o.source, "at": o.at.isoformat(), "points": o.points, "error": o.error}
            for o in outcomes
        ],
    }
    if as_json:
        typer.echo(json.dumps(document, indent=2))
        return
    typer.echo(f"backfilled {backfilled} points")
    for o in outcomes:
        status = f"{o.points} points" if o.error is None else f"FAILED ({o.error}); gap recorded"
        typer.echo(f"{o.source} at {o.at}: {status}")
