"""A long, randomised fault run of the live loop: the real `Reconciler` on a `LiveSystem`,
against the simulated cloud and the fake Kubernetes API server, for hundreds of passes with
demand moving under it and seeded faults drawn at random every pass:

- failed and slow launches (a window of the simulated cloud's `launch_failure_rate` and
  `boot_jitter_seconds`), spot interruptions, nodes registering late;
- Kubernetes API 500s and timeouts (`ApiFaults`: some timed-out requests took effect);
- the process killed at a pause point ("journaled", "acted") mid-action, or between
  passes, and restarted: a NEW LiveSystem and Reconciler on the same state directory.

The test plays the rest of the cluster between passes: kubelets register ready instances
as nodes with their providerID, the cloud controller deletes nodes whose instance is gone,
jobs (whole-GPU and GPU-sharing pods) arrive pending, a scheduler binds them (preempting
placeholders) and binds the loop's placeholders, jobs finish, and the demand the store sees
is the GPUs real pods ask for.

Checked after every pass: no node running a real pod is removed (nor a real pod evicted);
no more instances launched than the recorded decision asked for; after a pass that was not
killed, nothing is left pending in the journal (a restart's first pass settles what the
kill left). The run ends with fault-free passes in which the fleet must converge to the
plan within `CONVERGE_PASSES`.

GPUSCALE_FAULT_PASSES (default 500) and GPUSCALE_FAULT_SEED run it longer or otherwise;
the summary line (passes, faults by kind, invariant checks, violations) prints with -s or
-rA and goes to the JUnit report as properties. A run is reproducible from its seed: each
pass draws its faults from its own generator, so timing (how often a drain retries a
refused eviction within its timeout) can shift the per-request draws of that pass only,
never which faults later passes get.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from fake_kube import ApiFaults, FakeKube
from live_fixtures import GPU_PRODUCT, POOL_LABEL, fast_policy

from predictor.telemetry.kube_objects import KUBE_NAMES
from predictor.telemetry.store import TelemetryStore
from scaler.cluster.pools import NodePool
from scaler.controller.config import KubernetesSection, LiveConfig
from scaler.controller.journal import DecisionJournal
from scaler.controller.reconcile import Reconciler
from scaler.controller.system import LiveSystem, kube_client
from scaler.kube.errors import KubeError
from scaler.kube.placeholders import PLACEHOLDER_LABELS, PlaceholderSettings
from scaler.planning.demand import ForecastModel
from scaler.providers.base import NodeStatus, ProviderError
from scaler.providers.simulated import SimulatedCloud, SimulatedCloudConfig

PASSES = int(os.environ.get("GPUSCALE_FAULT_PASSES", "500"))
SEED = int(os.environ.get("GPUSCALE_FAULT_SEED", "20250301"))
TAIL_PASSES = 12  # fault-free, demand held, at the end
CONVERGE_PASSES = 5
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


class MortalLog(DecisionJournal):
    """The decision log of one process: once the process is killed it writes nothing
    more (the `finally` of a pass must not record what a killed process could not)."""

    dead = False

    def _alive(self) -> None:
        if self.dead:
            raise Killed("the process is dead")

    def record(self, *args: Any, **kwargs: Any) -> int:
        self._alive()
        return super().record(*args, **kwargs)

    def finish(self, *args: Any, **kwargs: Any) -> None:
        self._alive()
        super().finish(*args, **kwargs)

    def begin(self, *args: Any, **kwargs: Any) -> int:
        self._alive()
        return super().begin(*args, **kwargs)

    def complete(self, *args: Any, **kwargs: Any) -> None:
        self._alive()
        super().complete(*args, **kwargs)

    def save(self, *args: Any, **kwargs: Any) -> None:
        self._alive()
        super().save(*args, **kwargs)


@dataclass
class Killer:
    """The pause hook: kills the process at its `at`-th pause of the pass (0: never)."""

    log: MortalLog
    at: int = 0
    seen: int = 0
    point: str | None = None

    def __call__(self, point: str) -> None:
        self.seen += 1
        if self.seen == self.at:
            self.point = point
            self.log.dead = True
            raise Killed(point)


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


@dataclass
class Figures:
    seed: int
    passes: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    checks: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    events: Counter[str] = field(default_factory=Counter)
    tail_converged: list[bool] = field(default_factory=list)  # target == desired, per pass

    def check(self, name: str, ok: bool, at_pass: int, what: Callable[[], str]) -> None:
        self.checks[name] += 1
        if not ok:
            self.violations.append(f"pass {at_pass}: {name}: {what()}")

    @property
    def converged_after(self) -> int | None:
        """Fault-free passes until target == desired held for good (None: never)."""
        tail = self.tail_converged
        return next((i + 1 for i in range(len(tail)) if all(tail[i:])), None)

    def summary(self, seconds: float) -> str:
        def listed(counts: Counter[str]) -> str:
            return ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))

        return (
            f"fault run (seed {self.seed}): {self.passes} passes in {seconds:.1f} s; "
            f"faults: {listed(self.faults)}; events: {listed(self.events)}; "
            f"invariant checks: {sum(self.checks.values())} ({listed(self.checks)}); "
            f"violations: {len(self.violations)}; converged after {self.converged_after} "
            "fault-free passes"
        )


@dataclass
class PassStart:
    """What a pass starts from, to check it against afterwards."""

    busy: dict[str, list[str]]  # cloud instance -> real pods on its node
    events: int  # cloud events so far
    decision_id: int  # the newest decision so far


class FaultRun:
    def __init__(self, tmp_path: Path, kube: FakeKube, seed: int) -> None:
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
            log=MortalLog(cfg.state_dir),
            model=ForecastModel.from_settings(cfg.model),
        )
        return Reconciler(system, clock=lambda: self.cloud.now)

    def _note_eviction(self, pod: dict) -> None:
        if not is_placeholder(pod):
            self.evicted.append((pod["metadata"]["name"], pod["spec"].get("nodeName", "")))
        return None  # allowed: the check after the pass reports it

    # ---- the run ----------------------------------------------------------------------
    def run(self, passes: int, tail: int) -> Figures:
        """`passes` with faults and moving demand, then `tail` without either."""
        restarted = False
        for at in range(passes + tail):
            faulty = at < passes
            rng = random.Random(self.rng.random())
            self._move_world(at, faulty, rng)
            restarted = self._one_pass(at, FAULTY if faulty else CALM, rng, restarted)
            if not faulty:
                self._check_tail()
        self._final_checks()
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

    def _arm(self, at: int, odds: FaultOdds, rng: random.Random) -> tuple[ApiFaults | None, int]:
        """Set this pass's cloud and API faults; the pause (1, 2) to kill at, 0 for none."""
        fig = self.figures
        changes = {}
        for kind, setting, value in LAUNCH_FAULTS:  # a window of one to four passes
            if rng.random() < getattr(odds, kind):
                self.windows[kind] = at + rng.randint(0, 3)
                fig.faults[f"{kind}_windows"] += 1
            if odds is FAULTY and self.windows.get(kind, -1) >= at:
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
        return api, rng.randint(1, 2) if rng.random() < odds.kill else 0

    def _one_pass(self, at: int, odds: FaultOdds, rng: random.Random, restarted: bool) -> bool:
        """One pass of the loop under this pass's faults, checked; True when the process
        was killed (in the pass or after it) and a new one started."""
        fig = self.figures
        fig.passes += 1
        api, kill_at = self._arm(at, odds, rng)
        system = self.reconciler.system
        assert isinstance(system.log, MortalLog)
        killer = Killer(system.log, at=kill_at)
        self.reconciler.pause = killer
        newest = system.log.decisions(limit=1)
        start = PassStart(
            busy=self.cluster.real_pods_by_instance(),
            events=len(self.cloud.events),
            decision_id=newest[0].id if newest else 0,
        )
        self.evicted.clear()
        try:
            outcome = self.reconciler.iterate(apply=True)
            fig.events["loop_errors"] += len(outcome.errors)
        except Killed:
            fig.faults[f"killed_at_{killer.point}"] += 1
        except KubeError:
            fig.faults["passes_failed_on_the_api"] += 1
        finally:
            self.kube.faults = None
            self.cloud.reconfigure(launch_failure_rate=0.0, boot_jitter_seconds=0.0)
        if api is not None:
            fig.faults.update({f"api_{kind}": n for kind, n in api.injected.items()})
        killed = killer.point is not None
        self._check_pass(at, start, killed)
        if restarted and not killed:
            fig.check("journal_settled_on_restart", not system.log.pending(), at, lambda: "")
        if not kill_at:
            return False
        if not killed:  # its pause never came: the process dies after the pass
            fig.faults["killed_between_passes"] += 1
        system.close()
        self.reconciler = self._boot()
        return True

    # ---- invariants -------------------------------------------------------------------
    def _check_pass(self, at: int, start: PassStart, killed: bool) -> None:
        fig = self.figures
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
        plan = newest[0].plan if newest and newest[0].id > start.decision_id else None
        launched = Counter(e.pool for e in new if e.kind == "launched")
        for pool in BY_NAME:
            asked = 0 if plan is None else plan_launches(plan, pool)
            fig.check(
                "launches_within_the_plan",
                launched[pool] <= asked,
                at,
                lambda p=pool, a=asked: f"{p}: launched {launched[p]}, the plan asked {a}",
            )
        if not killed:
            pending = log.pending()
            fig.check(
                "journal_clean_after_pass",
                not pending,
                at,
                lambda: f"pending {[(a.kind, a.target, a.params) for a in pending]}",
            )

    def _check_tail(self) -> None:
        (decision,) = self.reconciler.system.log.decisions(limit=1)
        targets = {g.id(): g.target_size() for g in self.cloud.node_groups()}
        self.figures.tail_converged.append(targets == decision.plan["final_desired"])

    def _final_checks(self) -> None:
        fig = self.figures
        at = fig.passes
        fig.events.update(f"cloud_{e.kind}" for e in self.cloud.events)
        fig.events["jobs"] = len(self.cluster.ends)
        fig.events["jobs_lost_with_their_node"] = self.cluster.lost_with_node
        log = self.reconciler.system.log
        fig.events.update(f"journal_{a.kind}_{a.status}" for a in log.actions())
        fig.check(
            "converged_once_faults_stopped",
            fig.converged_after is not None and fig.converged_after <= CONVERGE_PASSES,
            at,
            lambda: (
                f"target == desired only from tail pass {fig.converged_after} on: "
                f"{fig.tail_converged}"
            ),
        )
        (decision,) = self.reconciler.system.log.decisions(limit=1)
        ready = {
            g.id(): sum(n.status is NodeStatus.READY for n in g.nodes())
            for g in self.cloud.node_groups()
        }
        fig.check(
            "all_desired_nodes_ready_at_the_end",
            ready == decision.plan["final_desired"],
            at,
            lambda: f"ready {ready}, desired {decision.plan['final_desired']}",
        )
        cordoned = [
            n["metadata"]["name"]
            for n in self.kube.objects("nodes")
            if KUBE_NAMES.removal_annotation in (n["metadata"].get("annotations") or {})
        ]
        fig.check("no_node_left_cordoned", not cordoned, at, lambda: f"cordoned {cordoned}")
        # Every launch the cloud made, against what all the recorded decisions asked.
        asked = sum(plan_launches(d.plan, p) for d in log.decisions() if d.applied for p in BY_NAME)
        launched = fig.events["cloud_launched"] - sum(INITIAL_SIZES.values())
        fig.check(
            "total_launches_within_the_plans",
            launched <= asked,
            at,
            lambda: f"launched {launched}, the decisions asked {asked}",
        )
        fig.check("journal_clean_at_the_end", not log.pending(), at, lambda: "")


def plan_launches(plan: dict[str, Any], pool: str) -> int:
    """Nodes a recorded decision asked the cloud for in `pool`: desired over the target."""
    return max(plan["final_desired"][pool] - plan["targets"][pool], 0)


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
    assert figures.passes == PASSES + TAIL_PASSES
    # The run saw trouble of every kind, and the loop acted under it.
    for kind in (
        "failed_launches_passes",
        "slow_launches_passes",
        "spot_interruption",
        "late_registration",
        "api_error",
        "api_timeout",
        "api_answer_lost",
        "killed_at_journaled",
        "killed_at_acted",
        "killed_between_passes",
    ):
        assert figures.faults[kind], f"no {kind}: {summary}"
    assert figures.events["cloud_deleted"] and figures.events["cloud_launch_failed"], summary
    assert figures.violations == [], summary + "\n" + "\n".join(figures.violations[:20])


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
