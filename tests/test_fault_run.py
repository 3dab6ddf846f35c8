"""The fault run (tests/fault_run.py): the live loop through hundreds of passes of random
faults, checked for safety and liveness after every pass; and the same run with a planted
bug, which its invariants must catch.

GPUSCALE_FAULT_PASSES (default 500) and GPUSCALE_FAULT_SEED run it longer or otherwise;
the summary line (passes, faults by kind, invariant checks, violations) prints with -s or
-rA and goes to the JUnit report as properties.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from fake_kube import ApiFaults, FakeKube
from fault_run import (
    FAULTY,
    HOLD_S,
    PASSES,
    POOLS,
    REQUEST_TIMEOUT_S,
    SEED,
    TAIL_PASSES,
    FaultRun,
)

from scaler.controller.config import KubernetesSection
from scaler.controller.system import kube_client
from scaler.providers.base import ProviderError
from scaler.providers.simulated import SimulatedCloud, SimulatedCloudConfig

# Shorter runs for the planted bugs: long enough that each shows (the cordon's needs a
# kill between cordon and delete after which the node is no longer to go).
BUG_PASSES = 150
CORDON_BUG_PASSES = 200


def test_the_loop_survives_a_long_run_of_random_faults(
    tmp_path: Path, fake: FakeKube, record_property: Callable[[str, object], None]
) -> None:
    started = time.monotonic()
    run = FaultRun(tmp_path, fake, SEED)
    try:
        figures = run.run(PASSES, TAIL_PASSES)
    finally:
        run.reconciler.system.close()
    seconds = time.monotonic() - started
    summary = figures.summary(seconds)
    print(summary)  # shown with -s or -rA
    record_property("passes", figures.passes)
    record_property("faults", dict(figures.faults))
    record_property("invariant_checks", dict(figures.checks))
    record_property("violations", len(figures.violations))
    record_property("seconds", round(seconds, 1))
    # The run saw trouble of every kind, and the loop acted under it; kills landed at
    # every pause point of a pass.
    for kind in (
        "failed_launches_passes",
        "slow_launches_passes",
        "spot_interruption",
        "late_registration",
        "api_error",
        "api_timeout",
        "api_answer_lost",
        "killed_at_journaled_set_target",
        "killed_at_acted_set_target",
        "killed_at_journaled_remove_node",
        "killed_at_cordoned",
        "killed_at_acted_remove_node",
        "killed_after_a_scale_up_before_a_removal",
        "killed_between_passes",
    ):
        assert figures.faults[kind], f"no {kind}: {summary}"
    assert figures.events["cloud_deleted"] and figures.events["cloud_launch_failed"], summary
    # Every invariant was checked, the liveness ones included, and none was violated.
    for name in (
        "done_is_done_in_the_cloud",
        "failed_is_not_done",
        "not_below_the_floor_for_long",
        "no_node_cordoned_for_long",
        "reaches_the_plans_target",
        "journal_settled_on_restart",
        "one_decision_per_pass",
    ):
        assert figures.checks[name], f"{name} never checked: {summary}"
    assert figures.violations == [], summary + "\n" + "\n".join(figures.violations[:20])


@pytest.mark.parametrize(
    ("bug", "caught_by"),
    [
        # The pass's own final size agrees with the cloud: only the plan's target and the
        # reactive floor tell that the pool should have grown.
        ("pool_never_grows", {"not_below_the_floor_for_long", "reaches_the_plans_target"}),
        ("every_action_done", {"done_is_done_in_the_cloud"}),
        ("cordon_left_after_a_kill", {"no_node_cordoned_for_long"}),
    ],
)
def test_a_planted_bug_is_caught(
    tmp_path: Path,
    fake: FakeKube,
    bug: str,
    caught_by: set[str],
    record_property: Callable[[str, object], None],
) -> None:
    """Each bug in a shorter run; the cordon's in one whose dying passes die between cordon
    and delete whenever they get there, so that a node is left cordoned by a kill often
    enough that some are no longer to be removed after it."""
    cordons = bug == "cordon_left_after_a_kill"
    run = FaultRun(tmp_path, fake, SEED, bug=bug, cordoned_odds=1.0 if cordons else 0.35)
    odds = replace(FAULTY, kill=0.5) if cordons else FAULTY
    try:
        figures = run.run(CORDON_BUG_PASSES if cordons else BUG_PASSES, TAIL_PASSES, odds)
    finally:
        run.reconciler.system.close()
    caught = Counter(v.split(": ", 2)[1] for v in figures.violations)
    print(f"{bug}: caught by {dict(caught)}; first: {figures.violations[:1]}")
    record_property("caught_by", dict(caught))
    shown = figures.summary(0.0) + "\n" + "\n".join(figures.violations[:10])
    assert caught_by <= set(caught), shown


def test_the_cordon_run_without_the_bug_is_clean(tmp_path: Path, fake: FakeKube) -> None:
    """The run that catches the cordon bug, on the loop as it is: no violation (so what
    catches the bug is the bug)."""
    run = FaultRun(tmp_path, fake, SEED, cordoned_odds=1.0)
    try:
        figures = run.run(CORDON_BUG_PASSES, TAIL_PASSES, replace(FAULTY, kill=0.5))
    finally:
        run.reconciler.system.close()
    assert figures.faults["killed_at_cordoned"] >= 5, figures.summary(0.0)
    assert figures.violations == [], "\n".join(figures.violations[:10])


# ------------------------------------------------------------------ the fault hooks


def test_reconfigure_changes_later_launches_only() -> None:
    (pool,) = POOLS[:1]
    cloud = SimulatedCloud([pool], SimulatedCloudConfig(seed=1))
    (group,) = cloud.node_groups()
    group.increase_size(4)
    cloud.reconfigure(launch_failure_rate=1.0, boot_jitter_seconds=300.0)
    group.increase_size(4)
    cloud.reconfigure(launch_failure_rate=0.0, boot_jitter_seconds=0.0)
    events = cloud.advance(pool.boot_seconds)
    assert [e.kind for e in events] == ["ready"] * 4  # the later four boot slowly
    events = cloud.advance(300.0)
    assert [e.kind for e in events] == ["launch_failed"] * 4
    assert group.target_size() == 4
    with pytest.raises(ValueError):
        cloud.reconfigure(launch_failure_rate=2.0)


def test_interrupt_reclaims_a_node_now() -> None:
    cloud = SimulatedCloud(POOLS)
    spot = cloud.node_groups()[1]
    spot.increase_size(2)
    name = spot.nodes()[0].name
    event = cloud.interrupt(name)
    assert (event.kind, event.node, event.at) == ("interrupted", name, cloud.now)
    assert spot.target_size() == 1 and cloud.events[-1] == event
    with pytest.raises(ProviderError):
        cloud.interrupt(name)


def test_api_faults_answer_500_or_time_out(fake: FakeKube) -> None:
    from kubernetes import client as k8s

    fake.create("namespaces", {"metadata": {"name": "ml"}})
    api = kube_client(KubernetesSection(host=fake.url, request_timeout_s=REQUEST_TIMEOUT_S))
    core = k8s.CoreV1Api(api)
    try:
        fake.faults = ApiFaults(error_rate=1.0)
        with pytest.raises(k8s.ApiException) as failed:
            core.read_namespace("ml")
        assert failed.value.status == 500
        # Lost answers: the change is made, the client hears nothing in time.
        fake.faults = ApiFaults(timeout_rate=1.0, applied_share=1.0, hold_s=HOLD_S)
        started = time.monotonic()
        with pytest.raises(Exception, match=r"(?i)timed? ?out"):
            core.patch_namespace("ml", {"metadata": {"labels": {"seen": "yes"}}})
        assert time.monotonic() - started < HOLD_S
        assert fake.get("namespaces", "ml")["metadata"]["labels"] == {"seen": "yes"}
        assert fake.faults.injected == Counter(answer_lost=1)
        fake.faults = None
        assert core.read_namespace("ml").metadata.labels == {"seen": "yes"}
    finally:
        fake.faults = None
        api.close()
