"""The main job end to end: `gpuscale demo` on a short synthetic workload."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from scaler.cli import app


def test_demo_leaves_a_report_with_forecast_and_scaling(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = CliRunner().invoke(app, ["demo", "--out", str(out), "--days", "9", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output)
    for name in ("report.md", "report.html", "forecast.png", "scaling.png", "figures.json"):
        assert (out / name).stat().st_size > 500, name
    assert figures["model"] == "gpuscale v1"
    assert [r["horizon_min"] for r in figures["forecast_summary"]] == [10, 30, 180]
    reactive, predictive = figures["scaling"]["reactive"], figures["scaling"]["predictive"]
    assert (reactive["mode"], predictive["mode"]) == ("reactive", "predictive")
    assert reactive["jobs"] == predictive["jobs"] > 0
    # Capacity asked for ahead of demand means jobs wait less for it.
    assert predictive["wait_p95_min"] <= reactive["wait_p95_min"]
    # Side by side with the buffer teams run instead: reactive plus k spare nodes per pool.
    headroom = figures["scaling"]["headroom"]
    assert headroom["mode"] == "headroom" and headroom["knob"] in (1, 2, 3, 4)
    assert headroom["gpu_hours"] > reactive["gpu_hours"]
    report = (out / "report.md").read_text()
    assert f"reactive + {headroom['knob']} spare node" in report
    assert "## 1. Forecasting demand" in report and "## 2. Scaling ahead of demand" in report
    assert (out / "models" / "gpuscale" / "1" / "metadata.json").is_file()
