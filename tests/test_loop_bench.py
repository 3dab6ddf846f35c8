"""`gpuscale bench loop` end to end at a small size: the loop reads the cluster through the
watched cache (no list after the first), and every figure the issue asks is reported."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from scaler.cli import app


def test_bench_loop_reports_its_figures_and_lists_only_once(tmp_path: Path) -> None:
    out = tmp_path / "loop.json"
    args = ["bench", "loop", "--nodes", "30", "--pods", "600", "--passes", "3"]
    result = CliRunner().invoke(app, [*args, "--extender-pods", "5", "--json", str(out)])
    assert result.exit_code == 0, result.output
    row = json.loads(out.read_text())
    assert (row["nodes"], row["pods"], row["passes"]) == (30, 600, 3)
    assert row["lists_after_first"] == 0 and row["requests_per_pass"]["list"] == 0
    assert row["watch_events_per_pass"] >= 100  # the churn arrived as watch events
    assert row["first_list_s"] > 0 and 0 < row["pass_median_s"] <= row["pass_p95_s"]
    assert 0 < row["update_median_s"] < row["pass_median_s"]
    assert row["peak_rss_mib"] > 0 and len(row["pass_s"]) == 3
    extender = row["extender"]
    assert extender["pods"] == 5 and extender["candidates"] == 30 + 3  # a node added a pass
    assert 0 < extender["filter_p50_ms"] <= extender["filter_p99_ms"]
    assert "filter + prioritize" in result.output
