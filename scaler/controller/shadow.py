"""Shadow mode: the loop beside the cluster's own autoscaler, acting on nothing, recording
per pass what gpuscale would set and what the cluster had.

A team runs `gpuscale scale --shadow` next to Cluster Autoscaler or Karpenter before it
lets gpuscale act (AWS predictive scaling's forecast-only mode serves the same purpose).
Each pass is one `ShadowPass` in `<state_dir>/shadow.sqlite`: per pool, the size gpuscale
would set, the nodes the cluster had (ready and booting), the GPUs its pods used, the
GPUs demand asked (the store's series of the pool, else what pods use and wait for), and
the pods waiting with how long each had waited. `gpuscale report` reads them
(`scaler.evaluation.shadow_report`).

Where the loop sees the cluster (`kubernetes` configured), the waiting pods are the
cluster's pending ones, each timed from the first pass that saw it pending. Without it
(the simulated cloud), the pods are not seen: what demand asks beyond the ready nodes is
the GPUs waiting, timed from the pass its shortage began, and the pod count is None.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from predictor.foundation.sqlite_db import SqliteFile
from scaler.cluster.pools import NodePool
from scaler.controller.reconcile import PassDecision

SHADOW_FILE = "shadow.sqlite"
_SHORT = "shortage/"  # the waiting table's key of a pool's shortage (pods not seen)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS passes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at TEXT NOT NULL,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS waiting (
    pod TEXT PRIMARY KEY,
    pool TEXT NOT NULL,
    since TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class PoolShadow:
    """One pool at one shadow pass."""

    pool: str
    gpus_per_node: int
    boot_seconds: float
    would_set: int  # the size gpuscale would set
    target: int  # the cloud's target (what the cluster's autoscaler set)
    ready: int
    booting: int
    used_gpus: float
    demand_gpus: float
    pending_pods: int | None  # None: the loop does not see the pods
    pending_gpus: float
    waited_s: tuple[float, ...]  # how long each waiting pod (or the shortage) had waited
    sizing: str | None = None  # how gpuscale sized the pool's group (`GroupNeed.sizing`)

    @property
    def nodes(self) -> int:
        return self.ready + self.booting


@dataclass(frozen=True)
class ShadowPass:
    at: datetime
    step: str
    pools: tuple[PoolShadow, ...]

    def to_json(self) -> str:
        return json.dumps(
            {"at": self.at.isoformat(), "step": self.step, "pools": [asdict(p) for p in self.pools]}
        )

    @classmethod
    def from_json(cls, text: str) -> ShadowPass:
        raw = json.loads(text)
        pools = tuple(PoolShadow(**(p | {"waited_s": tuple(p["waited_s"])})) for p in raw["pools"])
        return cls(datetime.fromisoformat(raw["at"]), raw["step"], pools)


def shadow_pass(
    decision: PassDecision,
    pools: Sequence[NodePool],
    waiting_since: Mapping[str, tuple[str, datetime]],
    short_since: Mapping[str, datetime],
) -> ShadowPass:
    """What the pass saw and would do, per pool. `waiting_since`: pod id -> (pool, the
    first pass that saw it pending); `short_since`: pool -> the pass its shortage began
    (used where the pods are not seen)."""
    fleet = decision.fleet
    observed = {o.group: o.observed for o in decision.outlook.outlooks}
    sizing = decision.sizing()
    cluster = fleet.cluster
    out = []
    for pool in pools:
        nodes = fleet.nodes.get(pool.name, ())
        ready = sum(not n.unregistered for n in nodes)
        gpus = pool.gpus_per_node
        if cluster is not None:
            # `used_gpus` counts the pods waiting for the pool too: in use is what runs.
            used = float(
                sum(
                    cluster.nodes[n.kube_name].gpus_used
                    for n in nodes
                    if n.kube_name in cluster.nodes
                )
            )
            pending = [
                j
                for j in cluster.real_pending
                if j.id in waiting_since and waiting_since[j.id][0] == pool.name
            ]
            pending_gpus = sum(j.gpu_request_milli for j in pending) / 1000
            waited = tuple((decision.at - waiting_since[j.id][1]).total_seconds() for j in pending)
            demand = observed.get(pool.name, fleet.used_gpus.get(pool.name, used + pending_gpus))
            count: int | None = len(pending)
        else:
            demand = observed.get(pool.name, 0.0)
            pending_gpus = max(demand - ready * gpus, 0.0)
            since = short_since.get(pool.name, decision.at)
            waited = ((decision.at - since).total_seconds(),) if pending_gpus > 0 else ()
            used = min(demand, ready * gpus)
            count = None
        out.append(
            PoolShadow(
                pool=pool.name,
                gpus_per_node=gpus,
                boot_seconds=pool.boot_seconds,
                would_set=int(decision.desired.get(pool.name, len(nodes))),
                target=int(fleet.targets.get(pool.name, len(nodes))),
                ready=ready,
                booting=len(nodes) - ready,
                used_gpus=used,
                demand_gpus=float(demand) if not math.isnan(demand) else 0.0,
                pending_pods=count,
                pending_gpus=pending_gpus,
                waited_s=waited,
                sizing=sizing.get(pool.name),
            )
        )
    return ShadowPass(decision.at, decision.step, tuple(out))


class ShadowLog:
    """The shadow passes of a state directory, and the pods seen waiting."""

    def __init__(self, state_dir: Path) -> None:
        self.db = SqliteFile(Path(state_dir) / SHADOW_FILE)
        self.db.create(_SCHEMA)

    def record(self, decision: PassDecision, pools: Sequence[NodePool]) -> ShadowPass:
        """Record one pass: the pods waiting now are timed from the first pass that saw
        them (those no longer waiting are forgotten); without the pods, a pool's shortage
        from the pass it began."""
        cluster = decision.fleet.cluster
        with self.db.transaction() as conn:
            known = {
                pod: (pool, datetime.fromisoformat(since))
                for pod, pool, since in conn.execute("SELECT pod, pool, since FROM waiting")
            }
            waiting: dict[str, tuple[str, datetime]] = {}
            for job in cluster.real_pending if cluster is not None else ():
                pool = cluster.pending_pools.get(job.id) or _pool_of(decision, job.id)
                waiting[job.id] = known.get(job.id, (pool, decision.at))
            # A shortage goes on from the pass it began; one seen now for the first time
            # began now (`shadow_pass` times none where the pool is not short).
            short = {p.name: known.get(_SHORT + p.name, (p.name, decision.at))[1] for p in pools}
            record = shadow_pass(decision, pools, waiting, short)
            rows = [(pod, pool, since.isoformat()) for pod, (pool, since) in waiting.items()]
            if cluster is None:
                rows += [
                    (_SHORT + p.pool, p.pool, short[p.pool].isoformat())
                    for p in record.pools
                    if p.pending_gpus > 0
                ]
            conn.execute("DELETE FROM waiting")
            conn.executemany("INSERT INTO waiting (pod, pool, since) VALUES (?, ?, ?)", rows)
            conn.execute(
                "INSERT INTO passes (at, record) VALUES (?, ?)",
                (record.at.isoformat(), record.to_json()),
            )
        return record

    def passes(self) -> list[ShadowPass]:
        with self.db.connect() as conn:
            rows = conn.execute("SELECT record FROM passes ORDER BY id").fetchall()
        return [ShadowPass.from_json(r[0]) for r in rows]


def _pool_of(decision: PassDecision, job_id: str) -> str:
    """The pool the scale-up estimate sends a pending pod to ('' where none)."""
    reactive = decision.reactive
    if reactive is None or reactive.demand.estimate is None:
        return ""
    for pool, estimate in reactive.demand.estimate.pools.items():
        if job_id in estimate.jobs:
            return pool
    return ""
