"""The main job end to end: `gpuscale demo` on a short synthetic workload.

This is also what `make demo` runs (tests/test_docs.py checks the recipe), here on 8 days
and one knob point besides the default, to keep the suite short."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from scaler.cli import app
from scaler.evaluation.demo import against_tuned, headline


def test_demo_leaves_a_report_with_the_frontier_against_the_tuned_buffer(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    args = ["demo", "--out", str(out), "--days", "8", "--knob", "0.5", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output)
    for name in ("report.md", "report.html", "frontier.png", "forecast.png", "scaling.png"):
        assert (out / name).stat().st_size > 500, name
    assert figures["model"] == "gpuscale v1"
    assert [r["horizon_min"] for r in figures["forecast_summary"]] == [10, 30, 180]
    rows = figures["scaling"]["rows"]
    modes = [r["mode"] for r in rows]
    # The frontier: reactive, 1-8 spare nodes per pool, the per-pool tuned spares and
    # predictive at its knob points with the default marked.
    assert modes.count("reactive") == 1
    assert sorted(r["knob"] for r in rows if r["mode"] == "headroom") == list(range(1, 9))
    assert sorted(r["knob"] for r in rows if r["mode"] == "predictive") == [0.1, 0.5]
    assert [r["knob"] for r in rows if r["mode"] == "predictive" and r["default"]] == [0.1]
    tuned = [r for r in rows if r["mode"] == "headroom-tuned"]
    assert tuned and all(set(r["spares"]) == set(figures["pools"]) for r in tuned)
    # Job counts: all jobs of the workload, and the scored ones every row covers.
    assert len({r["jobs"] for r in rows}) == 1
    assert figures["scored_jobs"] == rows[0]["jobs"] < figures["jobs"]
    report = (out / "report.md").read_text()
    assert f"ran {figures['jobs']:,} jobs" in report
    assert f"{figures['scored_jobs']:,} of those jobs" in report
    # The headline is the matched comparison against the tuned buffer, first thing.
    assert report.splitlines()[2] == headline(figures)
    assert figures["against_tuned"] == json.loads(json.dumps(against_tuned(rows)))
    assert "tuned per pool on the week before" in report.splitlines()[2]
    # The forecast section says plainly whether it met its aims.
    met = figures["forecast_met"]
    assert met == all(r["met"] for r in figures["forecast_summary"])
    verdict = "met its aims at every horizon" if met else "did not meet its aims"
    assert verdict in report
    # Units on every figure.
    assert "| scaler | GPU-hours | cost ($) | GPU-minutes waited | mean wait (min)" in report
    assert (out / "models" / "gpuscale" / "1" / "metadata.json").is_file()


def test_the_headline_reads_the_tuned_line_whichever_way_it_comes_out() -> None:
    def row(mode: str, hours: float, waited: float, **extra: object) -> dict[str, object]:
        return {"mode": mode, "gpu_hours": hours, "gpu_minutes_waited": waited,
                "knob": None, "default": False, **extra}  # fmt: skip

    tuned = [
        row("headroom-tuned", 100.0, 1000.0, spares={"a": 1}),
        row("headroom-tuned", 120.0, 500.0, spares={"a": 2}),
    ]
    # Halfway between the tuned points in waiting (750): the line pays 110 there.
    cheaper = [*tuned, row("predictive", 105.0, 750.0, knob=0.2, default=True)]
    text = headline({"seed": 3, "against_tuned": against_tuned(cheaper)})
    assert "pay 110: predictive pays 4.5% fewer GPU-hours" in text
    assert "the tuned buffer waits 875 GPU-minutes, so predictive waits 14.3% less" in text
    dearer = [*tuned, row("predictive", 115.0, 750.0, knob=0.2, default=True)]
    text = headline({"seed": 3, "against_tuned": against_tuned(dearer)})
    assert "predictive pays 4.5% more GPU-hours" in text
    assert "so predictive waits 20.0% more" in text
    outside = [*tuned, row("predictive", 130.0, 100.0, knob=0.2, default=True)]
    text = headline({"seed": 3, "against_tuned": against_tuned(outside)})
    assert "outside the range of the spare nodes tuned per pool" in text
