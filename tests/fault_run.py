"""A long, randomised fault run of the live loop: the real `Reconciler` on a `LiveSystem`,
against the simulated cloud and the fake Kubernetes API server, for hundreds of passes with
demand moving under it and seeded faults drawn at random every pass:

- failed and slow launches (a window of the simulated cloud's `launch_failure_rate` and
  `boot_jitter_seconds`), spot interruptions, nodes registering late;
- Kubernetes API 500s and timeouts (`ApiFaults`: some timed-out requests took effect);
- the process killed at a pause point, or between passes, and restarted: a NEW LiveSystem
  and Reconciler on the same state directory. A dying pass dies at each pause point with
  a chance, so kills land anywhere in it: before or after any action (the journal entry
  written, the change made), between cordoning the nodes to remove and deleting them,
  after a scale-up and before a later removal.

The run plays the rest of the cluster between passes: kubelets register ready instances
as nodes with their providerID, the cloud controller deletes nodes whose instance is gone,
jobs (whole-GPU and GPU-sharing pods) arrive pending, a scheduler binds them (preempting
placeholders) and binds the loop's placeholders, jobs finish, and the demand the store sees
is the GPUs real pods ask for.

Safety, checked after every pass: no node running a real pod is removed (nor a real pod
evicted); no more instances launched than the recorded decision asked for; after a pass
that was not killed, nothing is left pending in the journal; a restart's first pass
settles what the kill left (its pending actions, its decision superseded). As each action
is journaled complete: one marked done is done in the cloud (the target reached, the node
gone, the node uncordoned), one marked failed is not.

Liveness: while launches succeed, no pool stays below its reactive floor (what pending pods
and the job-level spare need) for more than FLOOR_PASSES passes; no node carries
gpuscale's cordon for more than CORDON_PASSES; once faults stop, every pool's ready nodes
reach the plan's target (the planner's size raised to the floor, not the pass's own final
size) within CONVERGE_PASSES of it being set, and stay while the plan holds. At the end:
one decision per pass that decided, none without an outcome, and the launches within what
the passes asked and carried out.

A run can be given a planted bug (`BUGS`), which the invariants must catch.

GPUSCALE_FAULT_PASSES (default 500) and GPUSCALE_FAULT_SEED run it longer or otherwise;
the summary line (passes, faults by kind, invariant checks, violations) prints with -s or
-rA and goes to the JUnit report as properties. A run is reproducible from its seed: each
pass draws its faults from its own generator, so timing (how often a drain retries a
refused eviction within its timeout) can shift the per-request draws of that pass only,
never which faults later passes get.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import unittest.mock
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd
from fake_kube import ApiFaults, FakeKube
from live_fixtures import GPU_PRODUCT, POOL_LABEL, fast_policy

from predictor.telemetry.kube_objects import KUBE_NAMES
from predictor.telemetry.store import TelemetryStore
from scaler.cluster.pools import NodePool
from scaler.controller.config import LiveConfig
from scaler.controller.journal import Action, ActionStatus, DecisionJournal
from scaler.controller.reconcile import DECIDING_KEY, PassDecision, PlannerState, Reconciler
from scaler.controller.system import LiveSystem, kube_client
from scaler.kube.errors import KubeError
from scaler.kube.placeholders import PLACEHOLDER_LABELS, PlaceholderSettings
from scaler.planning.demand import ForecastModel
from scaler.providers.base import NodeStatus
from scaler.providers.simulated import SimulatedCloud, SimulatedCloudConfig

PASSES = int(os.environ.get("GPUSCALE_FAULT_PASSES", "500"))
SEED = int(os.environ.get("GPUSCALE_FAULT_SEED", "20250301"))
TAIL_PASSES = 12  # fault-free, demand held, at the end
CONVERGE_PASSES = 5  # tail passes a pool may take to reach its plan's target
FLOOR_PASSES = 4  # passes a pool may stay below the reactive floor while launches succeed
CORDON_PASSES = 3  # passes a node may carry gpuscale's cordon
STEP_S = 60.0
START = datetime(2025, 3, 1)
REQUEST_TIMEOUT_S = 0.2
HOLD_S = 0.4  # a timed-out request's answer is held this long, past the client's timeout
ZONE = "sim-zone-a"
JOBS_NS = "ml"
SHARE_ANNOTATION = "gpuscale.io/gpu-milli"
PLACEHOLDER_NS = PlaceholderSettings().namespace

POOLS = (
    NodePool(
        name="a100",
        gpu_model="A100",
        gpus_per_node=8,
        price_per_hour=32.0,
        boot_seconds=120.0,
        min_size=1,
        max_size=12,
    ),
    NodePool(
        name="t4",
        gpu_model="T4",
        gpus_per_node=4,
        price_per_hour=2.0,
        boot_seconds=60.0,
        min_size=0,
        max_size=10,
        capacity_type="spot",
    ),
)
BY_NAME = {p.name: p for p in POOLS}
# Jobs per pool: (GPUs, GPU share in thousandths for a one-GPU job, weight).
SHAPES = {
    "a100": ((1, 1000, 3), (1, 500, 2), (2, 1000, 2), (4, 1000, 2), (8, 1000, 1)),
    "t4": ((1, 1000, 3), (1, 250, 2), (1, 500, 2), (2, 1000, 2), (4, 1000, 1)),
}
ARRIVALS = {"a100": 1.0, "t4": 0.8}  # mean jobs a pass, at the middle of the demand swing
INITIAL_SIZES = {"a100": 2, "t4": 1}


@dataclass(frozen=True)
class FaultOdds:
    """Chance per pass of each fault (a launch fault opens a window)."""

    failed_launches: float = 0.0
    slow_launches: float = 0.0
    spot_interruption: float = 0.0
    late_registration: float = 0.0
    api_500: float = 0.0
    api_timeout: float = 0.0
    kill: float = 0.0


CALM = FaultOdds()
FAULTY = FaultOdds(
    failed_launches=0.06,
    slow_launches=0.06,
    spot_interruption=0.06,
    late_registration=0.15,
    api_500=0.08,
    api_timeout=0.06,
    kill=0.15,
)


# A launch fault's window sets the simulated cloud's setting to the value while it lasts.
LAUNCH_FAULTS = (
    ("failed_launches", "launch_failure_rate", 0.6),
    ("slow_launches", "boot_jitter_seconds", 300.0),
)


class Killed(BaseException):
    """A kill at a pause point: nothing in the loop may catch it."""


@dataclass(frozen=True)
class Begun:
    """The action a process journaled last: what a pause point after it is about."""

    id: int
    kind: str
    pool: str


class MortalLog(DecisionJournal):
    """The decision log of one process: once the process is killed it writes nothing
    more (the `finally` of a pass must not record what a killed process could not).

    `verify` is called with each action as it is completed, its status as written, while
    the cloud is as the loop left it; with `every_action_done` (a planted bug) every
    action is completed as done, whatever the loop found."""

    def __init__(
        self,
        state_dir: Path,
        verify: Callable[[Action], None] | None = None,
        every_action_done: bool = False,
    ) -> None:
        super().__init__(state_dir)
        self.dead = False
        self.verify = verify
        self.every_action_done = every_action_done
        self.last: Begun | None = None

    def _alive(self) -> None:
        if self.dead:
            raise Killed("the process is dead")

    def record(self, *args: Any, **kwargs: Any) -> int:
        self._alive()
        return super().record(*args, **kwargs)

    def finish(self, *args: Any, **kwargs: Any) -> None:
        self._alive()
        super().finish(*args, **kwargs)

    def begin(
        self, decision_id: int | None, pool: str, kind: str, target: str, params: Mapping
    ) -> int:
        self._alive()
        action = super().begin(decision_id, pool, kind, target, params)
        self.last = Begun(action, kind, pool)
        return action

    def complete(self, action_id: int, status: ActionStatus, result: str) -> None:
        self._alive()
        super().complete(action_id, "done" if self.every_action_done else status, result)
        done = self.action(action_id)
        if self.verify is not None and done is not None:
            self.verify(done)

    def save(self, *args: Any, **kwargs: Any) -> None:
        self._alive()
        super().save(*args, **kwargs)


@dataclass
class Killer:
    """The pause hook of one pass. With a generator it kills the process at each pause
    point with chance `odds`, so a kill may land at any of them: before or after any
    action, between cordoning the nodes to remove and deleting them, after a scale-up and
    before a removal. Without one it never kills. Records where it killed (`point`:
    the pause and the kind of action it follows) and which pools' growths the cloud had
    carried out by then (`grown`)."""

    log: MortalLog
    rng: random.Random | None = None
    odds: float = 0.35
    cordoned_odds: float = 0.35  # the chance at the pause between cordon and delete
    point: str | None = None
    after_scale_up: bool = False  # killed at a removal's pause, after a growth of the pass
    grown: set[str] = field(default_factory=set)

    def __call__(self, point: str) -> None:
        last = self.log.last
        kind = last.kind if last is not None else "none"
        if point == "acted" and last is not None and kind == "set_target":
            self.grown.add(last.pool)  # carried out, whether the kill comes now or later
        odds = self.cordoned_odds if point == "cordoned" else self.odds
        if self.rng is None or self.rng.random() >= odds:
            return
        self.point = "cordoned" if point == "cordoned" else f"{point}_{kind}"
        self.after_scale_up = bool(self.grown) and kind == "remove_node"
        self.log.dead = True
        raise Killed(self.point)


class NeverGrows(Reconciler):
    """A planted bug: `pool` is never set above its cloud target, whatever the plan and
    the pending pods need (the pass's desired size is capped there, so the decision it
    records agrees with what the cloud has)."""

    pool = "t4"

    def decide(self, state: PlannerState | None = None) -> PassDecision:
        decision = super().decide(state)
        target = decision.fleet.targets.get(self.pool, 0)
        capped = dict(decision.desired) | {self.pool: min(decision.desired[self.pool], target)}
        return replace(decision, desired=capped)


# ------------------------------------------------------------------ the rest of the cluster


def kube_name(instance: str) -> str:
    return f"node-{instance}"


def pod_milli(pod: dict) -> int:
    """GPU thousandths a pod holds: its share annotation for a one-GPU job, else whole GPUs."""
    share = (pod["metadata"].get("annotations") or {}).get(SHARE_ANNOTATION)
    if share is not None:
        return int(share)
    requests = pod["spec"]["containers"][0]["resources"].get("requests", {})
    return 1000 * int(requests.get("nvidia.com/gpu", 0))


def is_placeholder(pod: dict) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in PLACEHOLDER_LABELS.items())


def holds_gpus(pod: dict) -> bool:
    phase = (pod.get("status") or {}).get("phase")
    return phase in ("Pending", "Running") and not pod["metadata"].get("deletionTimestamp")


@dataclass
class Cluster:
    """The cloud and the Kubernetes side the loop does not run: kubelets, the cloud
    controller, the scheduler and the jobs."""

    cloud: SimulatedCloud
    kube: FakeKube
    rng: random.Random
    ends: dict[str, int] = field(default_factory=dict)  # job -> pass it finishes at
    ids: Iterator[int] = field(default_factory=itertools.count)
    lost_with_node: int = 0  # real pods whose node went (a spot reclaim, not gpuscale)

    def sync_nodes(self, register_share: float) -> None:
        """Nodes whose instance is gone are deleted, with their pods (the pod GC); ready
        instances register, each with chance `register_share` this pass."""
        alive = {n.name for g in self.cloud.node_groups() for n in g.nodes()}
        ready = {
            n.name: g.id()
            for g in self.cloud.node_groups()
            for n in g.nodes()
            if n.status is NodeStatus.READY
        }
        known = set()
        for node in self.kube.objects("nodes"):
            instance = node["spec"]["providerID"].rsplit("/", 1)[-1]
            if instance in alive:
                known.add(instance)
                continue
            name = node["metadata"]["name"]
            for pod in self.pods_on(name):
                self.lost_with_node += not is_placeholder(pod) and holds_gpus(pod)
                self.kube.delete("pods", pod["metadata"]["name"], pod["metadata"]["namespace"])
            self.kube.delete("nodes", name)
        for instance, pool in sorted(ready.items()):
            if instance in known or self.rng.random() >= register_share:
                continue
            spec = BY_NAME[pool]
            self.kube.create(
                "nodes",
                {
                    "metadata": {
                        "name": kube_name(instance),
                        "labels": {POOL_LABEL: pool, GPU_PRODUCT: spec.gpu_model},
                    },
                    "spec": {"providerID": f"sim:///{ZONE}/{instance}"},
                    "status": {
                        "allocatable": {
                            "cpu": "64",
                            "memory": "512Gi",
                            "nvidia.com/gpu": str(spec.gpus_per_node),
                        },
                        "conditions": [{"type": "Ready", "status": "True"}],
                    },
                },
            )

    def pods_on(self, node: str) -> list[dict]:
        return [p for p in self.kube.objects("pods") if p["spec"].get("nodeName") == node]

    def jobs_move(self, at_pass: int, level: dict[str, float]) -> None:
        """Finished jobs go (they finished last pass), running ones due finish, new ones
        arrive pending (Poisson with mean `level` per pool)."""
        for pod in self.kube.objects("pods", JOBS_NS):
            name = pod["metadata"]["name"]
            if pod["status"]["phase"] == "Succeeded":
                self.kube.delete("pods", name, JOBS_NS)
            elif pod["status"]["phase"] == "Running" and self.ends[name] <= at_pass:
                self.kube.patch("pods", name, {"status": {"phase": "Succeeded"}}, JOBS_NS)
        for pool, mean in level.items():
            for _ in range(poisson(self.rng, mean)):
                gpus, share, _ = self.rng.choices(
                    SHAPES[pool], weights=[s[2] for s in SHAPES[pool]]
                )[0]
                self.submit(pool, gpus, share, at_pass + 1 + int(self.rng.expovariate(1 / 8)))

    def submit(self, pool: str, gpus: int, share: int, ends: int) -> str:
        name = f"job-{next(self.ids):05d}"
        resources = {"requests": {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": str(gpus)}}
        resources["limits"] = {"nvidia.com/gpu": str(gpus)}
        annotations = {SHARE_ANNOTATION: str(share)} if share < 1000 else {}
        self.kube.create(
            "pods",
            {
                "metadata": {
                    "name": name,
                    "namespace": JOBS_NS,
                    "labels": {"app": "train"},
                    "annotations": annotations,
                },
                "spec": {
                    "nodeSelector": {POOL_LABEL: pool},
                    "containers": [{"name": "main", "image": "busybox", "resources": resources}],
                },
                "status": {"phase": "Pending"},
            },
        )
        self.ends[name] = ends
        return name

    def schedule(self) -> None:
        """Bind pending pods, real ones first (oldest first, best fit, preempting
        placeholders when nothing else fits), then placeholders first fit."""
        nodes = {
            n["metadata"]["name"]: n
            for n in self.kube.objects("nodes")
            if not n["spec"].get("unschedulable")
        }
        pods = self.kube.objects("pods")
        free = {
            name: 1000 * int(n["status"]["allocatable"]["nvidia.com/gpu"])
            for name, n in nodes.items()
        }
        held: dict[str, list[dict]] = {name: [] for name in nodes}
        for pod in pods:
            node = pod["spec"].get("nodeName")
            if node in free and holds_gpus(pod):
                free[node] -= pod_milli(pod)
                if is_placeholder(pod):
                    held[node].append(pod)
        pending = [p for p in pods if not p["spec"].get("nodeName") and holds_gpus(p)]
        pending.sort(key=lambda p: (is_placeholder(p), p["metadata"]["name"]))
        for pod in pending:
            pool = pod["spec"]["nodeSelector"][POOL_LABEL]
            need = pod_milli(pod)
            mine = sorted(n for n, node in nodes.items() if node_pool(node) == pool)
            fits = [n for n in mine if free[n] >= need]
            if not fits and not is_placeholder(pod):
                fits = [n for n in mine if free[n] + sum(map(pod_milli, held[n])) >= need]
                if fits:
                    self._preempt(fits[0], need, free, held)
            if fits:
                node = min(fits, key=lambda n: (free[n], n))
                self._bind(pod, node)
                free[node] -= need
                if is_placeholder(pod):
                    held[node].append(pod)

    def _preempt(self, node: str, need: int, free: dict, held: dict) -> None:
        while free[node] < need:
            victim = held[node].pop()
            self.kube.delete("pods", victim["metadata"]["name"], PLACEHOLDER_NS)
            free[node] += pod_milli(victim)

    def _bind(self, pod: dict, node: str) -> None:
        running = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        meta = pod["metadata"]
        patch = {"spec": {"nodeName": node}, "status": running}
        self.kube.patch("pods", meta["name"], patch, meta["namespace"])

    def demand(self) -> dict[str, float]:
        """GPUs the real pods of each pool ask for (running and pending), as
        kube-state-metrics would show them."""
        nodes = {n["metadata"]["name"]: node_pool(n) for n in self.kube.objects("nodes")}
        total = dict.fromkeys(BY_NAME, 0.0)
        for pod in self.kube.objects("pods", JOBS_NS):
            if holds_gpus(pod):
                node = pod["spec"].get("nodeName")
                pool = nodes.get(node) if node else pod["spec"]["nodeSelector"][POOL_LABEL]
                if pool in total:
                    total[pool] += pod_milli(pod) / 1000
        return total

    def real_pods_by_instance(self) -> dict[str, list[str]]:
        """Cloud instance -> the real pods holding GPUs on its node."""
        instance = {
            n["metadata"]["name"]: n["spec"]["providerID"].rsplit("/", 1)[-1]
            for n in self.kube.objects("nodes")
        }
        found: dict[str, list[str]] = {}
        for pod in self.kube.objects("pods", JOBS_NS):
            node = pod["spec"].get("nodeName")
            if node in instance and holds_gpus(pod):
                found.setdefault(instance[node], []).append(pod["metadata"]["name"])
        return found


def node_pool(node: dict) -> str:
    return node["metadata"]["labels"][POOL_LABEL]


def poisson(rng: random.Random, mean: float) -> int:
    count, t = 0, rng.expovariate(1.0)
    while t < mean:
        count += 1
        t += rng.expovariate(1.0)
    return count


def demand_level(at_pass: int, rng: random.Random) -> dict[str, float]:
    """Mean arrivals per pool this pass: a slow swing (a day in 240 passes), out of phase
    between pools, with bursts."""
    out = {}
    for i, (pool, mean) in enumerate(ARRIVALS.items()):
        swing = 1 + 0.8 * math.sin(2 * math.pi * at_pass / 240 + i * 2.0)
        burst = 3.0 if rng.random() < 0.03 else 1.0
        out[pool] = mean * swing * burst
    return out


# ------------------------------------------------------------------ the run

# Planted bugs a run can be given, each one the invariants must catch (tests/test_fault_run.py).
BUGS = ("pool_never_grows", "every_action_done", "cordon_left_after_a_kill")


@dataclass
class Figures:
    seed: int
    passes: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    checks: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    events: Counter[str] = field(default_factory=Counter)
    longest: Counter[str] = field(default_factory=Counter)  # the longest streaks seen

    def check(self, name: str, ok: bool, at_pass: int, what: Callable[[], str]) -> None:
        self.checks[name] += 1
        if not ok:
            self.violations.append(f"pass {at_pass}: {name}: {what()}")

    @property
    def violated(self) -> set[str]:
        """The invariants that failed."""
        return {v.split(": ", 2)[1] for v in self.violations}

    def summary(self, seconds: float) -> str:
        def listed(counts: Counter[str]) -> str:
            return ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))

        return (
            f"fault run (seed {self.seed}): {self.passes} passes in {seconds:.1f} s; "
            f"faults: {listed(self.faults)}; events: {listed(self.events)}; "
            f"longest streaks: {listed(self.longest)}; "
            f"invariant checks: {sum(self.checks.values())} ({listed(self.checks)}); "
            f"violations: {len(self.violations)}"
        )


@dataclass
class PassStart:
    """What a pass starts from, to check it against afterwards."""

    busy: dict[str, list[str]]  # cloud instance -> real pods on its node
    events: int  # cloud events so far
    decision_id: int  # the newest decision so far
    left_pending: frozenset[int] = frozenset()  # actions a killed process left pending
    left_open: int | None = None  # the decision a killed process left without an outcome


@dataclass
class PlanTarget:
    """A pool's target in the tail: the plan's size (the planner's, raised to the
    reactive floor), since which tail pass it holds, and whether the cloud reached it."""

    size: int
    since: int
    reached: bool = False


class FaultRun:
    def __init__(
        self,
        tmp_path: Path,
        kube: FakeKube,
        seed: int,
        bug: str | None = None,
        cordoned_odds: float = 0.35,
    ) -> None:
        assert bug is None or bug in BUGS, bug
        self.bug = bug
        self.cordoned_odds = cordoned_odds  # a dying pass's chance to die once cordoned
        self.rng = random.Random(seed)
        self.kube = kube
        self.config = LiveConfig(
            state_dir=tmp_path / "state",
            pools=POOLS,
            kubernetes={
                "host": kube.url,
                "request_timeout_s": REQUEST_TIMEOUT_S,
                "drain": {"timeout_s": 0.1, "poll_s": 0.02, "unremovable_s": 300},
            },
            model={"name": "persistence"},
            policy=fast_policy(STEP_S),
            demand={"stale_after_s": 300},
            lease={"enabled": False},
        )
        self.store = TelemetryStore(self.config.state_dir)
        self.cloud = SimulatedCloud(POOLS, SimulatedCloudConfig(seed=seed), start=START)
        groups = {g.id(): g for g in self.cloud.node_groups()}
        for pool, size in INITIAL_SIZES.items():
            groups[pool].increase_size(size)
        self.cloud.advance(max(p.boot_seconds for p in POOLS))
        # An hour of quiet history, so the first decision forecasts on a grid.
        history = pd.date_range(end=self.cloud.now, periods=60, freq=f"{STEP_S:g}s")
        for pool in BY_NAME:
            self.store.append(pd.DataFrame({"unique_id": pool, "ds": history, "y": 4.0}))
        self.cluster = Cluster(self.cloud, kube, random.Random(self.rng.random()))
        self.evicted: list[tuple[str, str]] = []  # real pods evicted in a pass: (pod, node)
        kube.eviction_policy = self._note_eviction
        self.figures = Figures(seed)
        self.windows: dict[str, int] = {}  # launch fault -> the last pass it lasts
        self.below: Counter[str] = Counter()  # pool -> passes in a row below the floor
        self.cordoned: Counter[str] = Counter()  # node -> passes in a row carrying our cordon
        self.targets: dict[str, PlanTarget] = {}  # pool -> its plan's target in the tail
        self.asked = 0  # launches of the decisions, as far as their passes carried them out
        self.reconciler = self._boot()

    # ---- the process ------------------------------------------------------------------
    def _boot(self) -> Reconciler:
        """A new process on the state directory: its own log, API client and model; the
        cloud is the same cloud."""
        cfg = self.config
        assert cfg.kubernetes is not None
        system = LiveSystem(
            config=cfg,
            provider=self.cloud,
            kube=kube_client(cfg.kubernetes),
            store=TelemetryStore(cfg.state_dir),
            log=MortalLog(
                cfg.state_dir, self._verify, every_action_done=self.bug == "every_action_done"
            ),
            model=ForecastModel.from_settings(cfg.model),
        )
        loop = NeverGrows if self.bug == "pool_never_grows" else Reconciler
        return loop(system, clock=lambda: self.cloud.now)

    def _note_eviction(self, pod: dict) -> None:
        if not is_placeholder(pod):
            self.evicted.append((pod["metadata"]["name"], pod["spec"].get("nodeName", "")))
        return None  # allowed: the check after the pass reports it

    # ---- the run ----------------------------------------------------------------------
    def run(self, passes: int, tail: int, odds: FaultOdds = FAULTY) -> Figures:
        """`passes` with faults and moving demand, then `tail` without either."""
        with contextlib.ExitStack() as planted:
            if self.bug == "cordon_left_after_a_kill":
                # The loop no longer undoes a cordon it left: a node a killed pass cordoned
                # and the next pass no longer removes stays cordoned.
                planted.enter_context(
                    unittest.mock.patch(
                        "scaler.controller.reconcile.stale_cordons", lambda fleet, removals: []
                    )
                )
            restarted = False
            for at in range(passes + tail):
                faulty = at < passes
                rng = random.Random(self.rng.random())
                self._move_world(at, faulty, rng)
                restarted = self._one_pass(at, odds if faulty else CALM, rng, restarted)
                if not faulty:
                    self._check_tail(at, at - passes)
            self._final_checks(passes + tail)
        return self.figures

    def _move_world(self, at: int, faulty: bool, rng: random.Random) -> None:
        """A step of time: the cloud boots and loses nodes, nodes register (some late),
        jobs finish and arrive (not in the tail), pods are scheduled, demand is recorded."""
        self.cloud.advance(STEP_S)
        late = faulty and rng.random() < FAULTY.late_registration
        self.figures.faults["late_registration"] += late
        self.cluster.sync_nodes(register_share=0.3 if late else 1.0)
        if faulty:
            self.cluster.jobs_move(at, demand_level(at, rng))
        self.cluster.schedule()
        demand = self.cluster.demand()
        now = pd.Timestamp(self.cloud.now)
        self.store.append(
            pd.DataFrame({"unique_id": list(demand), "ds": now, "y": list(demand.values())})
        )

    def _arm(self, at: int, odds: FaultOdds, rng: random.Random) -> tuple[ApiFaults | None, bool]:
        """Set this pass's cloud and API faults; whether the process dies in this pass."""
        fig = self.figures
        changes = {}
        for kind, setting, value in LAUNCH_FAULTS:  # a window of one to four passes
            if rng.random() < getattr(odds, kind):
                self.windows[kind] = at + rng.randint(0, 3)
                fig.faults[f"{kind}_windows"] += 1
            if odds is not CALM and self.windows.get(kind, -1) >= at:
                changes[setting] = value
                fig.faults[f"{kind}_passes"] += 1
        self.cloud.reconfigure(**changes)
        if rng.random() < odds.spot_interruption:
            spot = [
                n.name for g in self.cloud.node_groups() if g.template().is_spot for n in g.nodes()
            ]
            if spot:
                self.cloud.interrupt(rng.choice(sorted(spot)))
                fig.faults["spot_interruption"] += 1
        api = None
        if rng.random() < odds.api_500:
            api = ApiFaults(error_rate=0.25, seed=rng.randrange(2**32))
            fig.faults["api_500_passes"] += 1
        elif rng.random() < odds.api_timeout:
            api = ApiFaults(
                timeout_rate=0.2, applied_share=0.5, hold_s=HOLD_S, seed=rng.randrange(2**32)
            )
            fig.faults["api_timeout_passes"] += 1
        self.kube.faults = api
        return api, rng.random() < odds.kill

    def _one_pass(self, at: int, odds: FaultOdds, rng: random.Random, restarted: bool) -> bool:
        """One pass of the loop under this pass's faults, checked; True when the process
        was killed (in the pass or after it) and a new one started."""
        fig = self.figures
        fig.passes += 1
        api, dies = self._arm(at, odds, rng)
        launch_faults = bool(self.cloud.config.launch_failure_rate)
        system = self.reconciler.system
        assert isinstance(system.log, MortalLog)
        killer = Killer(
            system.log,
            random.Random(rng.random()) if dies else None,
            cordoned_odds=self.cordoned_odds,
        )
        self.reconciler.pause = killer
        newest = system.log.decisions(limit=1)
        start = PassStart(
            busy=self.cluster.real_pods_by_instance(),
            events=len(self.cloud.events),
            decision_id=newest[0].id if newest else 0,
        )
        if restarted:
            left = system.log.load(DECIDING_KEY)
            entry = system.log.decision(left) if left is not None else None
            start.left_pending = frozenset(a.id for a in system.log.pending())
            start.left_open = entry.id if entry is not None and entry.outcome is None else None
        self.evicted.clear()
        try:
            outcome = self.reconciler.iterate(apply=True)
            fig.events["loop_errors"] += len(outcome.errors)
        except Killed:
            fig.faults[f"killed_at_{killer.point}"] += 1
            fig.faults["killed_after_a_scale_up_before_a_removal"] += killer.after_scale_up
        except KubeError:
            fig.faults["passes_failed_on_the_api"] += 1
        finally:
            self.kube.faults = None
            self.cloud.reconfigure(launch_failure_rate=0.0, boot_jitter_seconds=0.0)
        if api is not None:
            fig.faults.update({f"api_{kind}": n for kind, n in api.injected.items()})
        killed = killer.point is not None
        self._check_pass(at, start, killer, launch_faults)
        if restarted:
            self._check_restart(at, start)
        if not dies:
            return False
        if not killed:  # its pause never came: the process dies after the pass
            fig.faults["killed_between_passes"] += 1
        system.close()
        self.reconciler = self._boot()
        return True

    # ---- invariants -------------------------------------------------------------------
    def _verify(self, action: Action) -> None:
        """An action completed as done is done in the cloud (or the cluster), one completed
        as failed is not: checked as the journal is written, on the cloud as it is then.
        A failed uncordon is not checked: a timed-out request may have been carried out."""
        fig, at = self.figures, self.figures.passes
        status, kind = action.status, action.kind
        what = f"{kind} {action.target} {action.params} {status}: {action.result}"
        if kind in ("set_target", "lower_target"):
            group = next(g for g in self.cloud.node_groups() if g.id() == action.pool)
            to, target = int(action.params["to"]), group.target_size()
            grown = kind == "set_target"
            landed = target >= min(to, group.max_size()) if grown else target <= to
            found = f"{what}; the cloud's target is {target}"
        elif kind == "remove_node":
            landed = self.cloud.node_group_for(action.target) is None
            found = f"{what}; the cloud {'no longer holds' if landed else 'holds'} it"
        elif kind == "uncordon" and status == "done":
            node = self.kube_node(action.target)
            landed = node is None or not node["spec"].get("unschedulable")
            found = f"{what}; the node is still cordoned"
        else:
            return
        if status == "done":
            fig.check("done_is_done_in_the_cloud", landed, at, lambda: found)
        elif status in ("failed", "blocked", "skipped") and kind != "uncordon":
            fig.check("failed_is_not_done", not landed, at, lambda: found)

    def kube_node(self, instance: str) -> dict | None:
        name = kube_name(instance)
        return next((n for n in self.kube.objects("nodes") if n["metadata"]["name"] == name), None)

    def _check_pass(self, at: int, start: PassStart, killer: Killer, launch_faults: bool) -> None:
        fig = self.figures
        killed = killer.point is not None
        new = self.cloud.events[start.events :]
        for event in (e for e in new if e.kind == "deleted"):
            pods = start.busy.get(event.node, [])
            fig.check(
                "no_busy_node_removed",
                not pods,
                at,
                lambda e=event, p=pods: f"{e.node} removed with real pods {p}",
            )
        fig.check("no_real_pod_evicted", not self.evicted, at, lambda: f"evicted {self.evicted}")

        log = self.reconciler.system.log
        newest = log.decisions(limit=1)
        decision = newest[0] if newest and newest[0].id > start.decision_id else None
        plan = decision.plan if decision is not None else None
        launched = Counter(e.pool for e in new if e.kind == "launched")
        for pool in BY_NAME:
            asked = 0 if plan is None else plan_launches(plan, pool)
            fig.check(
                "launches_within_the_plan",
                launched[pool] <= asked,
                at,
                lambda p=pool, a=asked: f"{p}: launched {launched[p]}, the plan asked {a}",
            )
            # A killed pass asked the cloud only for the growths it carried out.
            if plan is not None and (not killed or pool in killer.grown):
                self.asked += asked
        if not killed:
            pending = log.pending()
            fig.check(
                "journal_clean_after_pass",
                not pending,
                at,
                lambda: f"pending {[(a.kind, a.target, a.params) for a in pending]}",
            )
        if plan is not None:
            self._check_floor(at, plan, launch_faults or bool(self.windows_open(at)))
        self._check_cordons(at, completed=not killed and decision is not None)

    def windows_open(self, at: int) -> list[str]:
        """The launch faults whose window covers pass `at`, or launches of one still booting
        (a node launched in a failed-launch window fails when its boot ends)."""
        return [k for k, last in self.windows.items() if last >= at - 8]

    def _check_floor(self, at: int, plan: dict[str, Any], launch_faults: bool) -> None:
        """While launches succeed, no pool stays below its reactive floor (the nodes the
        pending pods, and the job-level spare, need) for more than FLOOR_PASSES passes."""
        floor = (plan.get("reactive") or {}).get("floor") or {}
        held = {g.id(): len(g.nodes()) for g in self.cloud.node_groups()}
        for pool in BY_NAME:
            if launch_faults:
                self.below[pool] = 0
                continue
            below = held[pool] < min(floor.get(pool, 0), BY_NAME[pool].max_size)
            self.below[pool] = self.below[pool] + 1 if below else 0
            self.figures.longest[f"below_floor_{pool}"] = max(
                self.figures.longest[f"below_floor_{pool}"], self.below[pool]
            )
            self.figures.check(
                "not_below_the_floor_for_long",
                self.below[pool] <= FLOOR_PASSES,
                at,
                lambda p=pool: (
                    f"{p}: {held[p]} nodes, floor {floor[p]}, for {self.below[p]} passes"
                    " with launches succeeding"
                ),
            )

    def _check_cordons(self, at: int, completed: bool) -> None:
        """No node carries gpuscale's cordon through more than CORDON_PASSES passes that
        ran to their end: a pass that does not remove it uncordons it, whatever killed the
        pass that cordoned it (a pass killed again, or failed on the API before deciding,
        is not counted)."""
        marked = {
            n["metadata"]["name"]
            for n in self.kube.objects("nodes")
            if KUBE_NAMES.removal_annotation in (n["metadata"].get("annotations") or {})
        }
        for node in list(self.cordoned):
            if node not in marked:
                del self.cordoned[node]
        for node in sorted(marked):
            if not completed:
                continue
            self.cordoned[node] += 1
            self.figures.longest["cordoned"] = max(
                self.figures.longest["cordoned"], self.cordoned[node]
            )
            self.figures.check(
                "no_node_cordoned_for_long",
                self.cordoned[node] <= CORDON_PASSES,
                at,
                lambda n=node: f"{n} cordoned by gpuscale for {self.cordoned[n]} passes",
            )

    def _check_restart(self, at: int, start: PassStart) -> None:
        """The first pass of a restarted process settles what the killed one left: no
        action it left pending stays pending, and its open decision is superseded."""
        if not start.left_pending and start.left_open is None:
            return
        log = self.reconciler.system.log
        still = sorted(start.left_pending & {a.id for a in log.pending()})
        entry = log.decision(start.left_open) if start.left_open is not None else None
        settled = entry is None or bool((entry.outcome or {}).get("superseded"))
        self.figures.check(
            "journal_settled_on_restart",
            not still and settled,
            at,
            lambda: (
                f"still pending {still}; decision {start.left_open} outcome "
                f"{entry.outcome if entry is not None else None}"
            ),
        )

    def _check_tail(self, at: int, tail_pass: int) -> None:
        """Once faults stop, every pool reaches its plan's target (the planner's size,
        raised to the reactive floor: not the pass's own final size) within
        CONVERGE_PASSES passes of that target being set, with all its nodes ready, and
        stays there while the plan holds."""
        newest = self.reconciler.system.log.decisions(limit=1)
        if not newest:
            return
        plan = newest[0].plan
        floor = (plan.get("reactive") or {}).get("floor") or {}
        ready = {
            g.id(): sum(n.status is NodeStatus.READY for n in g.nodes())
            for g in self.cloud.node_groups()
        }
        held = {g.id(): len(g.nodes()) for g in self.cloud.node_groups()}
        for pool in BY_NAME:
            size = max(int(plan["desired"][pool]), int(floor.get(pool, 0)))
            known = self.targets.get(pool)
            if known is None or known.size != size:
                known = self.targets[pool] = PlanTarget(size, tail_pass)
            there = ready[pool] == held[pool] == size
            left = known.reached and not there
            known.reached = known.reached or there
            waited = tail_pass - known.since + 1
            self.figures.check(
                "reaches_the_plans_target",
                there or (not left and waited < CONVERGE_PASSES),
                at,
                lambda p=pool, k=known, w=waited, gone=left: (
                    f"{p}: {ready[p]} ready of {held[p]} nodes, the plan's target {k.size}"
                    + (" (reached, then left)" if gone else f" for {w} tail passes")
                ),
            )

    def _final_checks(self, at: int) -> None:
        fig = self.figures
        fig.events.update(f"cloud_{e.kind}" for e in self.cloud.events)
        fig.events["jobs"] = len(self.cluster.ends)
        fig.events["jobs_lost_with_their_node"] = self.cluster.lost_with_node
        log = self.reconciler.system.log
        fig.events.update(f"journal_{a.kind}_{a.status}" for a in log.actions())
        cordoned = [
            n["metadata"]["name"]
            for n in self.kube.objects("nodes")
            if KUBE_NAMES.removal_annotation in (n["metadata"].get("annotations") or {})
        ]
        fig.check("no_node_left_cordoned", not cordoned, at, lambda: f"cordoned {cordoned}")
        # Every launch the cloud made, against what the decisions asked and their passes
        # carried out (a killed pass's growths only as far as it got).
        launched = fig.events["cloud_launched"] - sum(INITIAL_SIZES.values())
        fig.check(
            "total_launches_within_the_plans",
            launched <= self.asked,
            at,
            lambda: f"launched {launched}, the passes asked {self.asked}",
        )
        decisions = log.decisions()
        # One decision per pass that got as far as deciding, each with its outcome.
        decided = fig.passes - fig.faults["passes_failed_on_the_api"]
        fig.check(
            "one_decision_per_pass",
            len(decisions) == decided,
            at,
            lambda: f"{len(decisions)} decisions for {decided} passes that decided",
        )
        left_open = [d.id for d in decisions if d.outcome is None]
        fig.check("no_decision_left_open", not left_open, at, lambda: f"open {left_open}")
        fig.check("journal_clean_at_the_end", not log.pending(), at, lambda: "")


def plan_launches(plan: dict[str, Any], pool: str) -> int:
    """Nodes a recorded decision asked the cloud for in `pool`: desired over the target."""
    return max(plan["final_desired"][pool] - plan["targets"][pool], 0)
