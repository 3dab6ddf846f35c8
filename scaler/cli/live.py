"""CLI commands of the live system: `scale` (the reconcile loop) and `serve` (the service).

Crash tests: with GPUSCALE_PAUSE_AT=journaled (or acted, or cordoned), `scale --apply`
stops for good right after journaling an action (or after carrying it out, before
completing its journal entry; or after cordoning the nodes it removes, before draining and
deleting them) and leaves the file `<state_dir>/paused-at-<point>`, so a test can kill it
there.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from scaler.cli.output import table_console

if TYPE_CHECKING:
    from scaler.controller.journal import DecisionJournal
    from scaler.controller.reconcile import PassOutcome
    from scaler.controller.system import LiveSystem
    from scaler.kube.watched import WatchedCluster

PAUSE_ENV = "GPUSCALE_PAUSE_AT"
# The Lease's leaseTransitions when this replica last acted, in its decision log's state.
LED_KEY = "led_at_transitions"
CONFIG_HELP = (
    "Live config YAML (state_dir, pools, provider, kubernetes, demand, model, policy, lease,"
    " placement, service, defrag). GPUSCALE_* environment variables override it."
)


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add this module's commands to the app."""
    app.command("scale")(scale)
    app.command("serve")(serve)
    bench.command("service")(bench_service)


def scale(
    config: Annotated[Path, typer.Option("--config", envvar="GPUSCALE_CONFIG", help=CONFIG_HELP)],
    apply: Annotated[
        bool, typer.Option("--apply", help="Act: resize pools, drain nodes, place placeholders.")
    ] = False,
    once: Annotated[bool, typer.Option("--once", help="One pass, then exit.")] = False,
    shadow: Annotated[
        bool,
        typer.Option(
            "--shadow",
            help="Beside the cluster's own autoscaler: act on nothing, and record per pass"
            " what gpuscale would set and what the cluster had (`gpuscale report`).",
        ),
    ] = False,
    interval: Annotated[
        float | None,
        typer.Option("--interval", min=0.05, help="Seconds between passes (default: config)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print each pass as JSON.")] = False,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            min=1,
            max=65535,
            help="Serve the loop's /metrics (forecast, fleet, decisions) on this port.",
        ),
    ] = None,
) -> None:
    """Run the reconcile loop: read the telemetry store, forecast demand, plan, act.

    Dry run by default: each pass prints the plan with the reason for every pool's size,
    the nodes it would remove and the placeholder pods it would keep, and changes nothing.
    With --apply it acts: it sets each pool's size through the provider (never increments,
    so a repeated pass launches nothing twice), cordons and drains nodes through the
    Eviction API before the provider deletes them (PodDisruptionBudgets respected), and
    keeps low-priority placeholder pods holding the capacity bought ahead of demand.
    With --shadow it runs beside the cluster's own autoscaler: dry runs, each recorded
    (what gpuscale would set, the nodes, GPUs in use and waiting pods the cluster had) in
    the state directory's shadow.sqlite, for `gpuscale report`.

    Safe to kill at any moment: actions are journaled before they are carried out and a
    restart settles what it finds pending. Stale or missing telemetry never leads to a
    scale-down. Every decision is stored with its inputs and outcome in the state
    directory (decisions.sqlite). With Kubernetes configured and lease.enabled, only the
    replica holding the Lease acts; the others wait.

    Exits 0 after --once if the pass succeeded, 1 if an action failed or this replica
    never got the lease; runs until SIGTERM or Ctrl-C otherwise.
    """
    from predictor.foundation.errors import InputError
    from scaler.controller.config import load_live_config
    from scaler.controller.leader import LeaderElector, NotLeader
    from scaler.controller.metrics import LoopMetrics
    from scaler.controller.reconcile import Reconciler
    from scaler.controller.system import LiveSystem
    from scaler.kube.errors import KubeError
    from scaler.providers.base import ProviderError

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if shadow and apply:
        raise typer.BadParameter("--shadow acts on nothing: it does not go with --apply")
    settings = load_live_config(config)
    system = LiveSystem.build(settings, source=config)
    shadow_log = None
    if shadow:
        from scaler.controller.shadow import ShadowLog

        shadow_log = ShadowLog(settings.state_dir)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    elector = None
    if apply and settings.lease.enabled and system.kube is not None:
        elector = LeaderElector(system.kube, settings.lease)
        elector.try_acquire_or_renew()
        threading.Thread(target=elector.run, args=(stop,), name="lease", daemon=True).start()
    reconciler = Reconciler(system, elector, pause=_pause_hook(settings.state_dir))
    watched = _watched(system)
    if watched is not None:
        reconciler.observe = watched
    metrics = LoopMetrics(elector.is_leader if elector is not None else None)
    stop_metrics = metrics.serve(metrics_port) if metrics_port is not None else None
    gpus_per_node = {p.name: p.gpus_per_node for p in settings.pools}
    every = interval if interval is not None else settings.reconcile_interval_s
    waited_since = time.monotonic()
    announced: str | None = None  # the lease holder last reported while standing by
    failed = False
    try:
        while not stop.is_set():
            if elector is not None and not elector.is_leader():
                metrics.stand_by()
                patience = settings.lease.duration_s + 2 * settings.lease.retry_s
                if once and time.monotonic() - waited_since > patience:
                    typer.echo(f"not the leader: lease held by {elector.holder}", err=True)
                    failed = True
                    break
                if elector.holder != announced:
                    announced = elector.holder
                    logging.getLogger(__name__).info("standby: lease held by %s", announced)
                stop.wait(min(settings.lease.retry_s, every))
                continue
            if elector is not None:
                own_loop_state(system.log, elector.transitions)
            try:
                outcome = reconciler.iterate(apply)
            except NotLeader as exc:
                logging.getLogger(__name__).warning("%s", exc)
                continue
            except (ProviderError, KubeError, InputError) as exc:
                # The cloud, the cluster or the store could not be read: nothing was decided
                # or done; the next pass starts over.
                logging.getLogger(__name__).error("pass failed: %s", exc)
                metrics.failed_pass()
                failed = True
            else:
                metrics.observe(outcome, gpus_per_node)
                if shadow_log is not None:
                    shadow_log.record(outcome.decision, settings.pools)
                _report(outcome, as_json)
                failed = bool(outcome.errors)
            if once:
                break
            stop.wait(every)
    finally:
        stop.set()
        if stop_metrics is not None:
            stop_metrics()
        if elector is not None:
            elector.release()
        if watched is not None:
            from scaler.kube.watched import forget_watched

            forget_watched(watched)
        system.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if failed:
        raise typer.Exit(1)


def serve(
    config: Annotated[Path, typer.Option("--config", envvar="GPUSCALE_CONFIG", help=CONFIG_HELP)],
    host: Annotated[str, typer.Option("--host", help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port to bind.")] = 8080,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level.")] = "info",
    tls_cert: Annotated[
        Path | None,
        typer.Option("--tls-cert", envvar="GPUSCALE_TLS_CERT", help="PEM certificate: HTTPS."),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option("--tls-key", envvar="GPUSCALE_TLS_KEY", help="PEM private key of --tls-cert."),
    ] = None,
) -> None:
    """Serve placement, the kube-scheduler extender, forecasts and the plan over HTTP.

    POST /v1/placements places a job (node and GPU indices, or 409 with the reason it
    cannot fit); /v1/extender/filter, /prioritize and /bind speak the kube-scheduler
    extender JSON; GET /v1/forecasts, /v1/plan and /v1/nodepools show what the reconcile
    loop sees and would do; /healthz, /readyz and /metrics for probes and Prometheus;
    OpenAPI docs on /docs. Calls that change state need the bearer token of
    service.token or service.token_file.
    """
    import uvicorn

    from scaler.controller.config import load_live_config
    from scaler.service import create_app

    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter("--tls-cert and --tls-key go together")
    if tls_cert is not None and tls_key is not None:
        _check_tls(tls_cert, tls_key)
    app = create_app(load_live_config(config))
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
    )


def bench_service(
    nodes: Annotated[
        Path,
        typer.Option("--nodes", help="Node list CSV (openb_node_list_gpu_node.csv: 1,213 nodes)."),
    ],
    seconds: Annotated[float, typer.Option("--seconds", min=0.5, help="Measured time.")] = 20.0,
    concurrency: Annotated[
        int, typer.Option("--concurrency", min=1, help="Requests in flight.")
    ] = 8,
    fill: Annotated[
        float,
        typer.Option("--fill", min=0.0, max=0.95, help="GPU share placed before measuring."),
    ] = 0.5,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result row as JSON.")] = False,
) -> None:
    """Load the placement service over loopback and report requests/s and latency.

    Starts `gpuscale serve` (uvicorn, one worker) in a subprocess over the nodes of
    --nodes, fills the cluster to --fill of its GPUs with committed placements, then
    drives --concurrency keep-alive connections, each with one POST /v1/placements in
    flight (dry runs: decided, not committed, so the state stays the same), for --seconds.
    Reports requests/s, p50, p90, p99 and max latency as the client saw them, and the
    errors (any answer other than 201 or 409). Client and server share the machine's
    cores. Exits 1 on any error.
    """
    from scaler.evaluation.service_bench import openb_nodes, run_service_bench

    result = run_service_bench(openb_nodes(nodes), seconds, concurrency, fill)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        typer.echo(
            f"{result.nodes} nodes, {result.gpus} GPUs, {result.filled_gpu_ratio:.0%} allocated;"
            f" {result.requests} placements in {result.seconds:.1f} s with {concurrency} in"
            f" flight: {result.requests_per_s:.0f} req/s, p50 {result.p50_ms:.1f} ms,"
            f" p99 {result.p99_ms:.1f} ms, max {result.max_ms:.1f} ms;"
            f" {result.unschedulable} unschedulable, {result.errors} errors"
        )
    if result.errors:
        raise typer.Exit(1)


def _check_tls(cert: Path, key: Path) -> None:
    """Load the pair once before serving: uvicorn loads it after start-up and a missing or
    unusable file ends there in a traceback."""
    import ssl

    from predictor.foundation.errors import InputError

    for path in (cert, key):
        try:
            path.read_bytes()
        except OSError as exc:
            raise InputError(f"cannot read: {exc.strerror}", path=path) from None
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        reason = exc.reason or "no PEM data"
        raise InputError(
            f"not a PEM certificate matching the private key {key} ({reason})", path=cert
        ) from None


def own_loop_state(log: DecisionJournal, transitions: int) -> None:
    """Before a pass as leader: keep the loop state in this replica's store only if no
    other replica has led since this one last did, else start it afresh as a new store
    would. Each replica keeps a store of its own (the chart gives each a claim), and after
    another's turn this one's planner memory, nodes known and nodes not to retry are from
    before it: nodes removed meanwhile would count as lost, surplus as lasting. The Lease
    counts a transition each time a replica takes it that did not hold it, so this one's
    own re-take after a release is one more than the count it last led under; more means
    another took it in between."""
    from scaler.controller.reconcile import (
        KNOWN_KEY,
        PLANNER_KEY,
        UNREMOVABLE_KEY,
        PlannerState,
    )

    led = log.load(LED_KEY)
    if led == transitions:
        return
    if led is None or not led < transitions <= led + 1:
        log.save(PLANNER_KEY, PlannerState())
        log.save(KNOWN_KEY, {})
        log.save(UNREMOVABLE_KEY, {})
        logging.getLogger(__name__).info(
            "lease taken at transition %d (this store last led at %s): loop state afresh",
            transitions,
            led,
        )
    log.save(LED_KEY, transitions)


def _watched(system: LiveSystem) -> WatchedCluster | None:
    """With Kubernetes, the loop reads the process's watched cache (listed once, then
    watched), waiting for its first list up to the request timeout, and so does its
    provider where it can; without, nothing."""
    if system.kube is None or system.config.kubernetes is None:
        return None
    from scaler.controller.config import kube_names
    from scaler.kube.watched import watched_cluster

    section = system.config.kubernetes
    timeout = section.request_timeout_s
    watched = watched_cluster(
        system.kube, kube_names(section), timeout, section.cache_stale_after_s
    )
    watched.cache.wait_listed(timeout)
    system.read_through(watched.cache)
    return watched


def _pause_hook(state_dir: Path) -> Callable[[str], None]:
    """The crash-test hook (see the module docstring); a no-op unless the variable is set."""
    point = os.environ.get(PAUSE_ENV)

    def pause(at: str) -> None:
        if at != point:
            return
        (state_dir / f"paused-at-{at}").touch()
        while True:
            time.sleep(3600)

    return pause


def _report(outcome: PassOutcome, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(outcome.to_dict(), default=str))
        return
    from rich.table import Table

    d = outcome.decision
    mode = "applied" if outcome.applied else "dry run"
    table = Table(title=f"capacity plan ({d.plan.mode}, {mode}) at {d.at:%Y-%m-%d %H:%M:%S}")
    for column in ("pool", "nodes", "target", "desired", "action", "reason"):
        numeric = column in ("nodes", "target", "desired")
        table.add_column(column, justify="right" if numeric else "left")
    for p in d.plan.decisions:
        action = "hold" if p.pool in d.held else p.action
        table.add_row(
            p.pool,
            str(p.current),
            str(d.fleet.targets.get(p.pool, 0)),
            str(d.desired[p.pool]),
            action,
            d.held.get(p.pool, p.reason),
        )
    console = table_console()
    console.print(table)
    for problem in d.problems:
        console.print(f"[yellow]telemetry[/]: {problem}")
    for c in d.lowered:
        console.print(
            f"lower target {c.pool}: {c.target} -> {c.to} (launches not fulfilled: the group"
            f" holds {c.holds} nodes, {c.wanted} wanted)"
        )
    for r in d.removals:
        console.print(f"remove {r.pool}/{r.cloud_name} ({r.kube_name or 'not registered'})")
    for r in d.left_to_autoscaler:
        console.print(f"left to the node autoscaler {r.pool}/{r.cloud_name}")
    for p in d.placeholders:
        console.print(f"placeholders {p.pool}: {p.count} x {p.gpus} GPUs")
    for b in d.buffers:
        console.print(f"capacity buffer {b.pool}: {b.replicas} x {b.unit.gpus} GPUs ({b.reason})")
    for a in outcome.actions:
        console.print(f"{a['action']} {a['node']}: {a['status']} ({a['result']})")
    for e in outcome.errors:
        console.print(f"[red]error[/]: {e}")
