"""CLI command: `gpuscale defrag` (the bounded move and repartition plan, and with --apply
the moves and repartitions)."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from scaler.cli.live import CONFIG_HELP
from scaler.cli.output import table_console

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from scaler.controller.defrag import DefragOutcome
    from scaler.controller.defrag_plan import ShapeGain


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add this module's command to the app."""
    app.command("defrag")(defrag)


def defrag(
    config: Annotated[Path, typer.Option("--config", envvar="GPUSCALE_CONFIG", help=CONFIG_HELP)],
    apply: Annotated[
        bool,
        typer.Option(
            "--apply", help="Evict the planned pods (PDBs respected) and ask the repartitions."
        ),
    ] = False,
    goal: Annotated[
        Literal["nodes", "gpus"] | None,
        typer.Option("--goal", help="Empty whole nodes or whole GPUs (default: defrag.goal)."),
    ] = None,
    max_moves: Annotated[
        int | None,
        typer.Option("--max-moves", min=0, help="Moves per window (default: defrag.max_moves)."),
    ] = None,
    window: Annotated[
        float | None,
        typer.Option("--window", min=1.0, help="Window in seconds (default: defrag.window_s)."),
    ] = None,
    every: Annotated[
        float | None,
        typer.Option("--every", min=1.0, help="Repeat every this many seconds until stopped."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print each pass as JSON.")] = False,
    metrics_port: Annotated[
        int | None,
        typer.Option("--metrics-port", min=1, max=65535, help="Serve /metrics on this port."),
    ] = None,
) -> None:
    """Plan defragmentation moves on the live cluster and, with --apply, make them.

    Lists the cluster as the live loop does and plans at most --max-moves moves per
    --window (the moves made are kept in the state directory, so repeated runs never exceed
    it) with the service's placement policy: whole nodes emptied (--goal nodes) or whole
    GPUs freed of their sharing pods (--goal gpus). Only pods labelled
    gpuscale.io/movable=true, or of a priority class in defrag.priority_classes, that a
    controller recreates, are moved. Prints every move with its reason, the idle GPUs per
    node before and after, and which pending pods and job-mix shapes then fit.

    With defrag.mig.configs (the cluster's mig-parted configs), pending pods asking
    nvidia.com/mig-<profile> that no free instance serves are served by repartitions too:
    a node given another named config by the GPU operator's MIG manager, only where every
    GPU the change clears runs no pod. Each is printed with the node, its GPUs, the config
    and layout from and to, the reason and the pods it serves; repartitions and moves
    share the --max-moves budget.

    Dry run by default: nothing in the cluster changes. Each planned eviction is asked as
    the API server's dry run (dryRun=All), so a node or GPU one of whose moves a
    PodDisruptionBudget refuses is skipped with the reason, and planned around, in a dry
    run as with --apply ('would be refused: ...'); the plan and what it frees count only
    the moves that would be made. With --apply, the other moves are noted
    on their target nodes, so the extender steers each evicted pod's successor there, and
    evicted through the Eviction API. A repartition sets the node's nvidia.com/mig.config
    label once its pods, listed again, leave the GPUs idle, and the pass waits up to
    defrag.mig.wait_s for nvidia.com/mig.config.state. Moves and repartitions are
    journaled in decisions.sqlite.

    Exits 0 when the pass ran (moves a budget blocked included), 1 when the cluster could
    not be read, an eviction failed or the MIG manager failed a repartition.
    """
    from predictor.foundation.errors import InputError
    from scaler.controller.config import load_live_config
    from scaler.controller.defrag import Defragmenter
    from scaler.controller.journal import DecisionJournal
    from scaler.controller.metrics import DefragMetrics
    from scaler.controller.system import in_state_dir, kube_client
    from scaler.kube.errors import KubeError

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = load_live_config(config)
    if settings.kubernetes is None:
        raise InputError("gpuscale defrag needs the config's kubernetes section", path=config)
    overrides = {"goal": goal, "max_moves": max_moves, "window_s": window}
    section = settings.defrag.model_copy(
        update={k: v for k, v in overrides.items() if v is not None}
    )
    journal = in_state_dir(settings, DecisionJournal, source=config)
    api = kube_client(settings.kubernetes)
    defragmenter = Defragmenter(settings, api, journal)
    metrics = DefragMetrics()
    stop_metrics = metrics.serve(metrics_port) if metrics_port is not None else None
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    failed = False
    try:
        while not stop.is_set():
            try:
                outcome = defragmenter.run(apply, section)
            except KubeError as exc:
                logging.getLogger(__name__).error("defragmentation failed: %s", exc)
                metrics.failed_run()
                failed = True
            else:
                metrics.observe(outcome, time.time())
                _report(outcome, as_json)
                failed = bool(outcome.errors)
            if every is None:
                break
            stop.wait(every)
    finally:
        if stop_metrics is not None:
            stop_metrics()
        api.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if failed:
        raise typer.Exit(1)


def _report(outcome: DefragOutcome, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(outcome.to_dict(), default=str))
        return
    console = table_console()
    _print_plan(console, outcome)
    for entry in outcome.settled:
        what = entry.get("job") or entry.get("node")
        console.print(f"settled from an earlier run: {what} {entry['status']}: {entry['result']}")
    if outcome.results:
        rows = [(r.step.job, r.status, r.result) for r in outcome.results]
        title = "moves made" if outcome.applied else "moves that would not be made"
        console.print(_table(title, ("pod", "status", "result"), rows))
    if outcome.repartitions:
        rows = [(c.step.node, c.step.config, c.status, c.result) for c in outcome.repartitions]
        console.print(_table("repartitions asked", ("node", "config", "status", "result"), rows))
    for error in outcome.errors:
        console.print(f"[red]error[/]: {error}")


def _table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> Table:
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right" if column in ("#", "nodes") else "left")
    for row in rows:
        table.add_row(*row)
    return table


def _print_plan(console: Console, outcome: DefragOutcome) -> None:
    """The planned moves and repartitions, what they free, and what the window allows."""
    report = outcome.report
    mode = "applied" if outcome.applied else "dry run"
    title = (
        f"defragmentation plan (goal {report.goal}, {report.policy} policy, {mode}):"
        f" {len(report.steps)} moves; {report.made_in_window} of {report.max_moves} made in"
        f" the last {report.window_s:g} s"
    )
    moves = [
        (str(i), s.job, s.controller, s.source, s.target,
         ",".join(map(str, s.target_gpus)) or "-", s.frees, s.reason)
        for i, s in enumerate(report.steps, start=1)
    ]  # fmt: skip
    columns = ("#", "pod", "controller", "from", "to", "GPUs", "frees", "reason")
    console.print(_table(title, columns, moves))
    if report.repartitions:
        changes = [
            (r.node, ",".join(map(str, r.gpus)), f"{r.config_before or '(none)'} -> {r.config}",
             f"{_counted(r.layout_before)} -> {_counted(r.layout_after)}", r.frees, r.reason)
            for r in report.repartitions
        ]  # fmt: skip
        columns = ("node", "GPUs", "config", "layout", "serves", "reason")
        console.print(_table(f"MIG repartitions: {len(changes)}", columns, changes))
    for refused in report.mig_refused:
        console.print(
            f"not repartitioned: {refused.node} ({refused.config}, would serve"
            f" {', '.join(refused.would_serve)}): {refused.why}"
        )
    for pod, why in report.mig_unserved:
        console.print(f"MIG pod left waiting: {pod}: {why}")
    if report.nodes:
        freed = [
            (n.node, f"{n.idle_gpus_before} -> {n.idle_gpus_after}",
             f"{n.free_share_before / 1000:g} -> {n.free_share_after / 1000:g} GPU")
            for n in report.nodes
        ]  # fmt: skip
        columns = ("node", "idle GPUs", "free shares on partly used GPUs")
        console.print(_table("what it frees, per node", columns, freed))
    console.print(
        f"idle GPUs {report.idle_gpus_before} -> {report.idle_gpus_after}; nodes with every"
        f" GPU idle {report.idle_nodes_before} -> {report.idle_nodes_after}; most idle GPUs"
        f" on one node {report.largest_idle_before} -> {report.largest_idle_after}"
    )
    if report.shapes:
        shapes = [
            (s.label, f"{s.nodes_before} -> {s.nodes_after}{_placeable_change(s)}")
            for s in report.shapes
        ]
        title = "nodes that can take one more (pending pods, the job mix)"
        console.print(_table(title, ("shape", "nodes"), shapes))
    for why, count in sorted(report.unmovable.items()):
        console.print(f"left in place: {count} pod(s): {why}")
    if report.budget == 0:
        console.print("[yellow]no move left in this window[/]")


def _placeable_change(shape: ShapeGain) -> str:
    if shape.nodes_before == 0 < shape.nodes_after:
        return "  (now placeable)"
    if shape.nodes_before > 0 == shape.nodes_after:
        return "  (no longer placeable)"
    return ""


def _counted(layout: str) -> str:
    """`1=1g.10gb@0,1g.10gb@1` as `GPU 1: 1g.10gb x2`: what people compare."""
    gpus = []
    for part in filter(None, layout.split(";")):
        gpu, _, rest = part.partition("=")
        names = [item.partition("@")[0] for item in rest.split(",") if item]
        counts = {n: names.count(n) for n in dict.fromkeys(names)}
        listed = ", ".join(f"{n} x{c}" for n, c in counts.items()) or "none"
        gpus.append(f"GPU {gpu}: {listed}")
    return "; ".join(gpus)
