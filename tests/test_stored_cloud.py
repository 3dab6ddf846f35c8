"""The simulated cloud kept in the state directory: it passes the provider contract, and it
outlives the process that made it (another process on the same directory, as `scale` and
`serve` are, or a restart after SIGKILL, finds the nodes and targets where they were)."""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path

from provider_contract import ContractCloud, ProviderContract, contract_pools

from scaler.cluster.pools import NodePool
from scaler.providers.base import NodeStatus
from scaler.providers.simulated import SimulatedCloud, SimulatedCloudConfig
from scaler.providers.stored_cloud import FILENAME, StoredCloud


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2025, 3, 1)

    def __call__(self) -> datetime:
        return self.now

    def wait(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


class TestStoredCloudContract(ProviderContract):
    def make(self, pools: Sequence[NodePool]) -> ContractCloud:
        import tempfile

        clock = Clock()
        state_dir = tempfile.mkdtemp(prefix="stored-cloud-")
        cloud = StoredCloud(
            pools, SimulatedCloudConfig(), state_dir, {p.name: 0 for p in pools}, clock
        )

        def limit(pool: str, nodes: int | None) -> None:
            capacity = {p: n for p, n in cloud.config.capacity.items() if p != pool}
            cloud.reconfigure(capacity=capacity | ({} if nodes is None else {pool: nodes}))

        return ContractCloud(provider=cloud, wait=clock.wait, limit=limit)


def _open(state_dir: Path, clock: Clock, seed: int = 0) -> StoredCloud:
    return StoredCloud(contract_pools(), SimulatedCloudConfig(seed=seed), state_dir, {}, clock)


def test_first_open_makes_the_initial_sizes_booted(tmp_path: Path) -> None:
    clock = Clock()
    cloud = StoredCloud(contract_pools(), SimulatedCloudConfig(), tmp_path, {"a100": 3}, clock)
    a100, spot = cloud.node_groups()
    assert a100.target_size() == 3 and spot.target_size() == 1  # spot: its min size
    assert {n.status for n in a100.nodes()} == {NodeStatus.READY}
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILENAME, "simulated-cloud.lock"]
    assert json.loads((tmp_path / FILENAME).read_text())["next_id"] == 4


def test_reading_writes_nothing(tmp_path: Path) -> None:
    clock = Clock()
    cloud = _open(tmp_path, clock)
    cloud.node_groups()[0].increase_size(1)
    written = (tmp_path / FILENAME).stat().st_mtime_ns, (tmp_path / FILENAME).read_text()
    clock.wait(600)  # the node boots meanwhile: a change of status, not of state
    assert [n.status for n in cloud.node_groups()[0].nodes()] == [NodeStatus.READY]
    assert ((tmp_path / FILENAME).stat().st_mtime_ns, (tmp_path / FILENAME).read_text()) == written


def test_another_process_sees_what_one_did(tmp_path: Path) -> None:
    """Two opens of one state directory (the loop and the service) are one cloud."""
    clock = Clock()
    loop, service = _open(tmp_path, clock), _open(tmp_path, clock)
    loop.node_groups()[0].increase_size(2)
    (a100, _) = service.node_groups()
    assert a100.target_size() == 2
    assert {n.status for n in a100.nodes()} == {NodeStatus.BOOTING}
    clock.wait(121)  # boots complete on the shared clock, whoever reads
    assert {n.status for n in loop.node_groups()[0].nodes()} == {NodeStatus.READY}
    name = a100.nodes()[0].name
    group = service.node_group_for(name)
    assert group is not None and group.id() == "a100"
    group.delete_nodes([name])
    assert [n.name for n in loop.node_groups()[0].nodes()] != [name]
    assert loop.node_groups()[0].target_size() == 1


def test_a_restarted_cloud_goes_on_as_one_never_stopped(tmp_path: Path) -> None:
    """Restored from the file at each call, the cloud draws the same launches (failures,
    jitter, ids) as one object kept in memory through the same calls."""
    config = SimulatedCloudConfig(seed=7, launch_failure_rate=0.4, boot_jitter_seconds=90)
    clock = Clock()
    stored = StoredCloud(contract_pools(), config, tmp_path, {"a100": 0, "t4-spot": 0}, clock)
    memory = SimulatedCloud(contract_pools(), config, start=clock.now - timedelta(seconds=121))
    memory.advance(121)
    for step in range(6):
        for cloud in (stored, memory):
            cloud.node_groups()[0].increase_size(step % 3 + 1)
        clock.wait(100)
        memory.advance(100)
    seen = [(n.name, n.status, n.ready_at) for n in stored.node_groups()[0].nodes()]
    assert seen == [(n.name, n.status, n.ready_at) for n in memory.node_groups()[0].nodes()]


def _grow(state_dir: str, times: int) -> None:
    clock = Clock()
    cloud = _open(Path(state_dir), clock)
    group = cloud.node_groups()[0]
    for _ in range(times):
        group.increase_size(1)


def test_processes_growing_at_once_lose_no_change(tmp_path: Path) -> None:
    """The lock makes each call whole: two processes taking turns at read-grow-write."""
    _open(tmp_path, Clock()).node_groups()  # made, empty a100
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_grow, args=(str(tmp_path), 2)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert [w.exitcode for w in workers] == [0, 0]
    # increase_size(1) sets the target one above what that call read: 4 in all.
    assert _open(tmp_path, Clock()).node_groups()[0].target_size() == 4


def test_serve_shows_what_scale_did(tmp_path: Path) -> None:
    """`scale --apply` and `serve` on one config: /v1/nodepools shows the loop's nodes."""
    import warnings

    import pandas as pd
    from live_fixtures import pool

    from predictor.telemetry.store import TelemetryStore
    from scaler.controller.config import LiveConfig
    from scaler.controller.reconcile import Reconciler
    from scaler.controller.system import LiveSystem
    from scaler.service import create_app

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # starlette's note about httpx versions
        from fastapi.testclient import TestClient

    config = LiveConfig(
        state_dir=tmp_path / "state",
        pools=[pool(min_size=2, max_size=6)],
        model={"name": "persistence"},
        policy={"step_seconds": 60, "drop_hold_steps": 0},
    )
    end = pd.Timestamp.now(tz="UTC").tz_localize(None).floor("60s")
    ds = pd.date_range(end=end, periods=6, freq="60s")
    TelemetryStore(config.state_dir).append(
        pd.DataFrame({"unique_id": "a100", "ds": ds, "y": [8.0] * 5 + [40.0]})
    )
    with TestClient(create_app(config)) as client:
        (before,) = client.get("/v1/nodepools").json()
        assert before["target_size"] == 2
        outcome = Reconciler(LiveSystem.build(config)).iterate(apply=True)
        assert [a["result"] for a in outcome.actions] == ["target 2 -> 5"]
        (after,) = client.get("/v1/nodepools").json()
        assert (after["target_size"], after["ready"], len(after["nodes"])) == (5, 5, 5)
