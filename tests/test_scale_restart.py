"""`gpuscale scale --apply` as real processes against moto (and the fake API server):

- killed with SIGKILL in the middle of a scale-up (right after journaling the action, or
  right after carrying it out), then restarted: no instance is launched twice and the
  fleet converges to the size an uninterrupted run reaches;
- two daemons against one API server: only the holder of the Lease acts; when it dies, the
  other takes over after the lease expires, never before.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from fake_kube import FakeKube
from live_fixtures import (
    Asg,
    aws_config,
    aws_env,
    scale_app,
    spawn_scale,
    wait_for,
    write_demand,
)
from typer.testing import CliRunner

from scaler.controller.journal import DecisionJournal

pytestmark = pytest.mark.integration

START_S = 60.0  # a cold Python start with pandas, boto3 and the kubernetes client


def restart_config(tmp_path: Path, moto: Any, asg: Asg, state_dir: Path, **extra: Any) -> Path:
    return aws_config(
        tmp_path / f"{state_dir.name}.yaml",
        moto.url,
        asg,
        state_dir,
        demand={"stale_after_s": 3600},
        **extra,
    )


@pytest.mark.parametrize("point", ["journaled", "acted"])
def test_killed_mid_scale_up_and_restarted_launches_nothing_twice(
    tmp_path: Path, moto: Any, point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moto_fixture import session

    asg = Asg.create(session(), moto.url, desired=1)
    state_dir = tmp_path / "state"
    write_demand(state_dir, "a100", [8.0] * 5 + [40.0])  # 40 GPUs: five 8-GPU nodes
    config = restart_config(tmp_path, moto, asg, state_dir)
    log = DecisionJournal(state_dir)

    first = spawn_scale(
        config,
        "--apply",
        "--once",
        output=tmp_path / "first.log",
        env=aws_env() | {"GPUSCALE_PAUSE_AT": point},
    )
    marker = state_dir / f"paused-at-{point}"
    try:
        wait_for(marker.exists, START_S, f"the loop to pause at {point}")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    assert first.returncode == -signal.SIGKILL
    (pending,) = log.pending()
    assert (pending.kind, pending.params) == ("set_target", {"from": 1, "to": 5})
    assert asg.desired == (1 if point == "journaled" else 5)

    second = spawn_scale(
        config, "--apply", "--once", "--json", output=tmp_path / "second.log", env=aws_env()
    )
    assert second.wait(timeout=START_S) == 0, (tmp_path / "second.log").read_text()
    report = json.loads((tmp_path / "second.log").read_text().strip().splitlines()[-1])
    actions = [(a["action"], a["status"]) for a in report["actions"]]
    if point == "journaled":  # the kill came before the cloud heard of it: do it now
        assert actions == [("resolve set_target", "superseded"), ("set_target", "done")]
    else:  # the cloud already had it: settle the journal, launch nothing
        assert actions == [("resolve set_target", "done")]

    assert asg.desired == 5
    launched = asg.launched()
    assert len(launched) == 5 and set(launched.values()) == {"running"}
    assert log.pending() == []

    # The fleet has converged: another pass (in this process) finds nothing to do.
    for key, value in aws_env().items():
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(
        scale_app(), ["scale", "--config", str(config), "--apply", "--once", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["actions"] == []
    assert asg.desired == 5 and len(asg.launched()) == 5


def lease_holder(fake: FakeKube) -> str | None:
    try:
        return fake.get("leases", "gpuscale-scaler", "gpuscale-system")["spec"].get(
            "holderIdentity"
        )
    except Exception:
        return None


def applied(state_dir: Path) -> list[int]:
    """Times (ns) of the decisions a replica applied, oldest first."""
    if not (state_dir / "decisions.sqlite").exists():
        return []
    return sorted(d.at_ns for d in DecisionJournal(state_dir).decisions() if d.applied)


def test_two_daemons_only_the_lease_holder_acts(tmp_path: Path, moto: Any) -> None:
    from moto_fixture import session

    fake = FakeKube().start()
    try:
        asg = Asg.create(session(), moto.url, desired=1)
        replicas = {}
        for name in ("replica-a", "replica-b"):
            state_dir = tmp_path / name
            write_demand(state_dir, "a100", [8.0] * 5 + [40.0])
            replicas[name] = (
                state_dir,
                restart_config(
                    tmp_path,
                    moto,
                    asg,
                    state_dir,
                    kubernetes={"host": fake.url},
                    lease={"duration_s": 2, "renew_deadline_s": 1.5, "retry_s": 0.25},
                ),
            )
        env = aws_env()
        a_dir, a_config = replicas["replica-a"]
        b_dir, b_config = replicas["replica-b"]
        a = spawn_scale(
            a_config,
            "--apply",
            "--interval",
            "0.3",
            output=tmp_path / "a.log",
            env=env | {"GPUSCALE_LEASE__IDENTITY": "replica-a"},
        )
        b = None
        try:
            wait_for(lambda: len(applied(a_dir)) >= 1, START_S, "replica-a to act")
            assert lease_holder(fake) == "replica-a"
            b = spawn_scale(
                b_config,
                "--apply",
                "--interval",
                "0.3",
                output=tmp_path / "b.log",
                env=env | {"GPUSCALE_LEASE__IDENTITY": "replica-b"},
            )
            wait_for(
                lambda: "standby: lease held by replica-a" in (tmp_path / "b.log").read_text(),
                START_S,
                "replica-b to stand by",
            )
            time.sleep(1.0)  # several passes of both
            assert applied(b_dir) == []  # the follower decided nothing, did nothing
            assert len(applied(a_dir)) >= 2
            assert asg.desired == 5 and len(asg.launched()) == 5
            (decided,) = {  # every pass of a asked for the same placeholders
                json.dumps(d.plan["placeholders"], sort_keys=True)
                for d in DecisionJournal(a_dir).decisions()
                if d.applied
            }
            wanted = sum(p["count"] for p in json.loads(decided))
            assert wanted > 0 and len(fake.objects("pods", "gpuscale-system")) == wanted

            a.send_signal(signal.SIGKILL)  # the leader dies without giving the lease up
            a.wait(timeout=10)
            killed_ns = time.time_ns()
            last_a = applied(a_dir)[-1]
            wait_for(lambda: lease_holder(fake) == "replica-b", 10.0, "replica-b to take over")
            waited = (time.time_ns() - killed_ns) / 1e9
            wait_for(lambda: len(applied(b_dir)) >= 1, 10.0, "replica-b to act")
            assert applied(b_dir)[0] > last_a  # never both at once
            assert waited >= 1.0  # not before the lease could have expired (2 s unrenewed)
            lease = fake.get("leases", "gpuscale-scaler", "gpuscale-system")
            assert lease["spec"]["leaseTransitions"] == 1
            assert asg.desired == 5 and len(asg.launched()) == 5  # nothing twice

            b.send_signal(signal.SIGTERM)
            assert b.wait(timeout=15) == 0, (tmp_path / "b.log").read_text()[-2000:]
            assert lease_holder(fake) is None  # released on the way out
        finally:
            for process in (a, b):
                if process is not None and process.poll() is None:
                    process.kill()
                    process.wait(timeout=10)
    finally:
        fake.stop()
