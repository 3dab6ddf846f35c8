"""Leader election on a coordination.k8s.io/v1 Lease, through the real client against the
fake API server, with each replica on a clock the test moves."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_kube import FakeKube
from kubernetes import client as k8s

from scaler.controller.config import LeaseSection
from scaler.controller.leader import LeaderElector, NotLeader

SETTINGS = dict(name="scaler", namespace="ops", duration_s=10, renew_deadline_s=8, retry_s=2)


class Replica:
    """An elector with its own clock."""

    def __init__(self, fake: FakeKube, identity: str) -> None:
        self.now = 0.0
        api = k8s.ApiClient(k8s.Configuration(host=fake.url))
        self.elector = LeaderElector(
            api, LeaseSection(identity=identity, **SETTINGS), clock=lambda: self.now
        )

    def round(self, at: float) -> bool:
        self.now = at
        return self.elector.try_acquire_or_renew()


def lease(fake: FakeKube) -> dict:
    return fake.get("leases", "scaler", "ops")


def test_one_leader_at_a_time_and_takeover_only_after_expiry(fake: FakeKube) -> None:
    a, b = Replica(fake, "a"), Replica(fake, "b")
    assert a.round(0.0) is True  # creates the lease
    assert b.round(0.0) is False
    assert lease(fake)["spec"]["holderIdentity"] == "a"
    assert b.elector.holder == "a"

    # While a renews, b never takes over, however long it waits.
    for t in range(2, 40, 2):
        assert a.round(float(t)) is True
        assert b.round(float(t) + 1) is False
    assert lease(fake)["spec"]["leaseTransitions"] == 0

    # a stops renewing at 38 (by b's clock it saw the last change at 39): b waits the
    # full lease duration from then, by its own clock.
    assert b.round(48.5) is False
    assert b.round(49.5) is True
    spec = lease(fake)["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("b", 1)

    # a's own deadline passed long ago: it may not act, and the lease is no longer its.
    a.now = 49.5
    assert a.elector.is_leader() is False
    with pytest.raises(NotLeader, match="not renewed within 8 s"):
        a.elector.check()
    assert a.round(50.0) is False
    with pytest.raises(NotLeader, match="held by b"):
        a.elector.check()


def test_a_leader_stops_acting_at_its_renew_deadline_before_anyone_may_take_over(
    fake: FakeKube,
) -> None:
    a = Replica(fake, "a")
    assert a.round(0.0)
    a.now = 7.9
    a.elector.check()  # within the renew deadline (8 s)
    a.now = 8.0
    with pytest.raises(NotLeader):
        a.elector.check()  # and another replica could only start at 10 s


def test_a_stale_write_loses_on_the_resource_version(fake: FakeKube) -> None:
    a, b = Replica(fake, "a"), Replica(fake, "b")
    assert a.round(0.0)
    seen = lease(fake)
    assert a.round(1.0)  # a renews: the version b would write against is gone
    assert b.round(12.0) is False  # b observed a's renewal only now
    # Replay b's read of the old version, as if it had raced a's renewal.
    stale = k8s.ApiClient(k8s.Configuration(host=fake.url)).deserialize(_Response(seen), "V1Lease")
    b.elector._api.read_namespaced_lease = lambda *_: stale
    b.elector._observed_version = stale.metadata.resource_version  # unchanged since 12 s
    puts = sum(m == "PUT" for m, _ in fake.requests)
    assert b.round(30.0) is False  # expired by its clock, but the write is refused (409)
    assert sum(m == "PUT" for m, _ in fake.requests) == puts + 1  # b did try
    assert lease(fake)["spec"]["holderIdentity"] == "a"
    assert not b.elector.is_leader()


def test_release_hands_over_at_once(fake: FakeKube) -> None:
    a, b = Replica(fake, "a"), Replica(fake, "b")
    assert a.round(0.0)
    assert b.round(1.0) is False
    a.elector.release()
    assert lease(fake)["spec"].get("holderIdentity") is None
    assert b.round(1.5) is True  # no waiting out the duration
    assert lease(fake)["spec"]["holderIdentity"] == "b"


class _Response:
    """What ApiClient.deserialize reads: a body in `data`."""

    def __init__(self, obj: dict) -> None:
        import json

        self.data = json.dumps(obj)


def test_a_store_keeps_its_loop_state_unless_another_replica_led_since(
    fake: FakeKube, tmp_path: Path
) -> None:
    """Each replica's store (its own claim in the chart) holds the loop state of its own
    turns: a replica taking the lease back after another's turn starts it afresh."""
    from scaler.cli.live import own_loop_state
    from scaler.controller.journal import DecisionJournal
    from scaler.controller.reconcile import KNOWN_KEY, PLANNER_KEY, UNREMOVABLE_KEY

    a, b = Replica(fake, "a"), Replica(fake, "b")
    log = DecisionJournal(tmp_path / "a")

    def a_leads_a_pass() -> None:
        own_loop_state(log, a.elector.transitions)
        log.save(KNOWN_KEY, {"a100": ["i-1", "i-2"]})
        log.save(UNREMOVABLE_KEY, {"i-2": 1e12})

    assert a.round(0.0)
    a_leads_a_pass()
    assert a.round(2.0)  # renewed: the same turn
    own_loop_state(log, a.elector.transitions)
    assert log.load(KNOWN_KEY) == {"a100": ["i-1", "i-2"]}

    a.elector.release()  # a rollout: a gives the lease up and takes it back
    assert a.round(3.0) and a.elector.transitions == 1
    own_loop_state(log, a.elector.transitions)
    assert log.load(KNOWN_KEY) == {"a100": ["i-1", "i-2"]}

    a.elector.release()  # b leads in between: what a knew is from before b's turn
    assert b.round(4.0)
    b.elector.release()
    assert a.round(5.0) and a.elector.transitions == 3
    own_loop_state(log, a.elector.transitions)
    assert log.load(KNOWN_KEY) == {} and log.load(UNREMOVABLE_KEY) == {}
    assert log.load(PLANNER_KEY).step is None
