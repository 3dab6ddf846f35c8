"""`gpuscale bench loop`: the reconcile loop and the extender at a large cluster's size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from scaler.cli.output import output_file, table_console


def register(app: typer.Typer, bench: typer.Typer) -> None:
    bench.command("loop")(bench_loop)


def bench_loop(
    nodes: Annotated[int, typer.Option("--nodes", min=3, help="Nodes of the cluster.")] = 1000,
    pods: Annotated[
        int, typer.Option("--pods", min=10, help="Pods in all (DaemonSet pods included).")
    ] = 30_000,
    passes: Annotated[int, typer.Option("--passes", min=1, help="Passes measured (K).")] = 10,
    extender_pods: Annotated[
        int,
        typer.Option(
            "--extender-pods", min=0, help="Pods sent to filter and prioritize (0: none)."
        ),
    ] = 200,
    seed: Annotated[int, typer.Option("--seed", help="The cluster's and the churn's seed.")] = 0,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write the result (JSON) here.")
    ] = None,
) -> None:
    """Measure a reconcile pass against a fake API server holding a large cluster.

    The API server (loopback, a child process) serves --nodes nodes (a third CPU nodes,
    the rest 8-GPU A100 and H100 nodes) and --pods pods, most of them ordinary non-GPU
    pods, one in ten holding GPUs (whole GPUs of 1-8, GPU-sharing pods, gangs of 8-GPU
    pods), a few of each waiting. The loop reads it as `gpuscale scale` does, through the
    process's watched cluster cache: listed once in pages, then watched. Reports the first
    list, then --passes dry-run passes with churn between them (50 pods created, 50
    finished, about 20 changed, a node added): pass time (median, p95), the part spent
    updating the snapshot from the watch's events and the rest (deciding), API requests
    per pass by verb and list requests after the first list (0: watch events only), peak
    RSS; then kube-scheduler extender filter and prioritize per pod with every node a
    candidate by name (nodeCacheCapable: true), p50 and p99. Long at 5,000 nodes and
    150,000 pods (minutes, most of it building the cluster and the first list).
    """
    from predictor.foundation.atomic_files import write_text
    from scaler.evaluation.loop_bench import run_loop_bench

    output_file(json_out, "--json")
    console = table_console()
    result = run_loop_bench(
        nodes,
        pods,
        passes=passes,
        seed=seed,
        extender_pods=extender_pods,
        progress=lambda line: console.print(f"[dim]{line}[/]"),
    )
    rows = [
        (
            "nodes / pods (GPU pods, pending)",
            f"{result.nodes} / {result.pods} ({result.gpu_pods}, {result.pending_pods})",
        ),
        ("first list (CPU)", f"{result.first_list_s:.2f} s ({result.first_list_cpu_s:.2f} s)"),
        ("first snapshot", f"{result.first_snapshot_s:.2f} s"),
        ("first pass", f"{result.first_pass_s:.2f} s"),
        ("pass, median / p95", f"{result.pass_median_s:.3f} / {result.pass_p95_s:.3f} s"),
        ("  CPU time, median", f"{result.pass_cpu_median_s:.3f} s"),
        ("  snapshot update, median", f"{result.update_median_s:.3f} s"),
        ("  deciding, median / p95", f"{result.decide_median_s:.3f} / {result.decide_p95_s:.3f} s"),
        (
            "API requests per pass",
            ", ".join(f"{v} {n:g}" for v, n in result.requests_per_pass.items()),
        ),
        ("list requests after the first list", str(result.lists_after_first)),
        ("watch events per pass", f"{result.watch_events_per_pass:.0f}"),
        ("peak RSS", f"{result.peak_rss_mib:.0f} MiB"),
    ]
    if result.extender is not None:
        e = result.extender
        rows += [
            ("extender candidates (names)", str(e.candidates)),
            ("  filter p50 / p99", f"{e.filter_p50_ms:.1f} / {e.filter_p99_ms:.1f} ms"),
            ("  prioritize p50 / p99", f"{e.prioritize_p50_ms:.1f} / {e.prioritize_p99_ms:.1f} ms"),
            ("  filter + prioritize p50 / p99", f"{e.both_p50_ms:.1f} / {e.both_p99_ms:.1f} ms"),
            ("    CPU time p50 / p99", f"{e.both_cpu_p50_ms:.1f} / {e.both_cpu_p99_ms:.1f} ms"),
        ]
    from rich.table import Table

    table = Table(title="gpuscale bench loop")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if json_out is not None:
        write_text(json_out, json.dumps(result.to_dict(), indent=1))
        console.print(f"wrote {json_out}")
