"""`gpuscale journal`, and the documented simulated setup killed and restarted.

The README's commands on `deploy/live-simulated.yaml` (history generated and imported into
the store, then `gpuscale scale --apply --once`), killed with SIGKILL three times mid-pass
and started again: the simulated cloud lives in the state directory, so each restart finds
the targets the killed process set, settles the journal against them and repeats nothing;
`gpuscale journal` shows every action once, none pending, and each killed pass's decision
superseded. The history is two days instead of the README's fourteen, to keep it short.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from live_fixtures import spawn_scale, wait_for
from typer.testing import CliRunner

from scaler.cli import app
from scaler.controller.journal import DecisionJournal

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deploy" / "live-simulated.yaml"
START_S = 120.0  # a cold start, the model's fit and the warm start on a loaded machine


def gpuscale(*args: str, cwd: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "scaler", *args], cwd=cwd, check=True, capture_output=True
    )


def journal(*args: str) -> dict:
    result = CliRunner().invoke(app, ["journal", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def killed_three_times(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The state directory after three kill -9 rounds and a clean pass, and the outputs."""
    work = tmp_path_factory.mktemp("live-simulated")
    state_dir = work / ".gpuscale" / "state"
    gpuscale("generate", "--out", "demo-data", "--days", "2", cwd=work)
    gpuscale(
        "store", "import", "--state-dir", str(state_dir),
        "--trace", "series:demo-data/demand.csv", "--unit", "gpus",
        cwd=work,
    )  # fmt: skip
    env = {"GPUSCALE_STATE_DIR": str(state_dir)}
    for round_, point in enumerate(("acted", "journaled", "acted")):
        marker = state_dir / f"paused-at-{point}"
        marker.unlink(missing_ok=True)
        proc = spawn_scale(
            CONFIG,
            "--apply",
            "--once",
            output=work / f"round-{round_}.log",
            env=env | {"GPUSCALE_PAUSE_AT": point},
        )
        try:
            wait_for(marker.exists, START_S, f"round {round_} to pause at {point}")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL
    last = spawn_scale(CONFIG, "--apply", "--once", "--json", output=work / "last.log", env=env)
    assert last.wait(timeout=START_S) == 0, (work / "last.log").read_text()
    return state_dir, (work / "last.log").read_text().splitlines()


def test_three_kills_repeat_no_action_and_leave_none_pending(
    killed_three_times: tuple[Path, list[str]],
) -> None:
    state_dir, _ = killed_three_times
    shown = journal("--state-dir", str(state_dir))
    assert shown["pending"] == 0 and shown["open"] == 0
    decisions = shown["decisions"]
    assert [d["status"] for d in decisions] == ["superseded"] * 3 + ["done"]
    # Carried out once each: the growths that reached the cloud are one per pool, and the
    # only one journaled twice is the one the kill at `journaled` stopped before the cloud.
    actions = shown["actions"]
    assert {a["kind"] for a in actions} == {"set_target"}
    done = Counter(a["pool"] for a in actions if a["status"] == "done")
    assert set(done.values()) == {1}
    (superseded,) = [a for a in actions if a["status"] == "superseded"]
    assert superseded["result"].startswith("not applied before a restart")
    # The cloud holds what the done actions asked for: nothing launched twice.
    cloud = json.loads((state_dir / "simulated-cloud.json").read_text())
    held = Counter(i["pool"] for i in cloud["instances"])
    for a in actions:
        if a["status"] == "done":
            assert held[a["pool"]] == a["params"]["to"], (a, held)
    # Each killed pass's decision lists how its actions ended.
    for d in decisions[:3]:
        assert d["outcome"]["superseded"] and d["outcome"]["actions"]
    assert journal("--state-dir", str(state_dir), "--pending")["actions"] == []


def test_the_next_pass_finds_nothing_to_do(killed_three_times: tuple[Path, list[str]]) -> None:
    _, lines = killed_three_times
    report = json.loads(lines[-1])
    assert [(a["action"], a["status"]) for a in report["actions"]][:1] == [
        ("resolve set_target", "done")
    ]
    assert all(a["status"] == "done" for a in report["actions"])


def test_journal_filters_and_tables(tmp_path: Path) -> None:
    log = DecisionJournal(tmp_path)
    plan = {
        "targets": {"a100": 2},
        "final_desired": {"a100": 5},
        "held": {},
        "decisions": [{"pool": "a100", "desired": 5, "reason": "forecast bound 40 GPUs"}],
    }
    old = log.record("local", True, {}, plan, mark="deciding")
    action = log.begin(old, "a100", "set_target", "a100", {"from": 2, "to": 5})
    log.complete(action, "done", "target 2 -> 5")
    log.finish(old, {"errors": []})
    new = log.record("local", True, {}, plan)
    log.begin(new, "a100", "set_target", "a100", {"from": 5, "to": 6})

    table = CliRunner().invoke(app, ["journal", "--state-dir", str(tmp_path)])
    assert table.exit_code == 0, table.output
    assert "a100 2 -> 5: forecast bound 40 GPUs" in table.stdout
    assert "1 action(s) pending, 1 decision(s) open" in table.stdout
    pending = journal("--state-dir", str(tmp_path), "--pending")
    assert [d["id"] for d in pending["decisions"]] == [new]
    assert [(a["status"], a["params"]) for a in pending["actions"]] == [
        ("pending", {"from": 5, "to": 6})
    ]
    assert journal("--state-dir", str(tmp_path), "--since", "1h")["open"] == 1
    assert journal("--state-dir", str(tmp_path), "--since", "2200-01-01")["decisions"] == []
    assert [
        d["id"] for d in journal("--state-dir", str(tmp_path), "--limit", "1")["decisions"]
    ] == [new]

    bad = CliRunner().invoke(app, ["journal", "--state-dir", str(tmp_path), "--since", "lately"])
    assert bad.exit_code == 2 and "--since" in bad.output
    missing = CliRunner().invoke(app, ["journal", "--state-dir", str(tmp_path / "none")])
    assert missing.exit_code != 0
