"""The reconcile loop: read the store, forecast, plan, act. One call of `iterate` is one pass.

Every pass recomputes the desired state from scratch, from what the store, the cloud and
the cluster say now, so the loop is safe to kill and restart at any moment:

- Sizes are SET, never incremented: a pool grows by `desired - target`, with the
  provider's target counting nodes still booting, so a decision taken twice (before and
  after a restart) launches once.
- Every action is journaled as pending before it is carried out and completed after. A
  restart resolves what it finds pending against the cloud (a size already reached is
  marked done, anything else is re-planned) before deciding anything.
- Node removals resume: a node gpuscale cordoned is the first candidate again, and a node
  it cordoned that is no longer to go is uncordoned.
- Missing or stale telemetry, or a forecast that failed, never leads to a scale-down: the
  pool holds its size and the decision records why.
- The planner's memory advances once per demand step: passes within one step all plan
  from the memory at the start of that step, so repeating a pass repeats its decision.

Every decision is stored with its inputs (telemetry status, outlook, fleet) and its
outcome in the decision log. With leader election, no action starts unless this replica
holds the lease.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pandas as pd
from pydantic import ValidationError

from scaler.cluster.pools import NodePool
from scaler.controller.fleet import FleetView, NodeView, observe_fleet
from scaler.controller.leader import LeaderElector, NotLeader
from scaler.controller.system import LiveSystem
from scaler.kube.errors import KubeError
from scaler.kube.nodes import DrainSettings, NodeRemoval, RemovalStatus
from scaler.kube.placeholders import PlaceholderDemand, Placeholders
from scaler.planning.demand import DemandReading, Outlooks, outlooks, read_demand
from scaler.planning.planner import CapacityPlan, PlannerMemory, plan
from scaler.providers.base import NodeStatus, ProviderError

log = logging.getLogger(__name__)

PAUSE_POINTS = ("journaled", "acted")
PLANNER_KEY = "planner"
KNOWN_KEY = "known_nodes"
UNREMOVABLE_KEY = "unremovable"


def utc_now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


@dataclass(frozen=True)
class PlannerState:
    """The planner's memory across passes: `base` at the start of demand step `step`,
    `latest` after the newest pass in it."""

    step: str | None = None
    base: PlannerMemory | None = None
    latest: PlannerMemory | None = None

    def memory_for(self, step: str) -> PlannerMemory | None:
        return self.base if step == self.step else self.latest

    def after(self, step: str, memory: PlannerMemory) -> PlannerState:
        base = self.base if step == self.step else self.latest
        return PlannerState(step, base, memory)


@dataclass(frozen=True, slots=True)
class Removal:
    pool: str
    cloud_name: str
    kube_name: str | None
    booting: bool

    def to_dict(self) -> dict[str, object]:
        return {
            "pool": self.pool,
            "node": self.cloud_name,
            "kube_node": self.kube_name,
            "booting": self.booting,
        }


@dataclass(frozen=True, eq=False)
class Decision:
    """What one pass decided, with everything it decided on."""

    at: datetime
    step: str
    reading: DemandReading
    outlook: Outlooks
    fleet: FleetView
    plan: CapacityPlan
    desired: Mapping[str, int]  # after holding scale-downs the telemetry cannot justify
    held: Mapping[str, str]
    removals: tuple[Removal, ...]
    placeholders: tuple[PlaceholderDemand, ...]
    planner_state: PlannerState
    forecast_source: str

    @property
    def problems(self) -> list[str]:
        return self.reading.problems + ([self.outlook.problem] if self.outlook.problem else [])

    def inputs(self) -> dict[str, Any]:
        return {
            "at": self.at.isoformat(),
            "step": self.step,
            "telemetry": [s.to_dict() for s in self.reading.status],
            "problems": self.problems,
            "forecast_source": self.forecast_source,
            "outlooks": [
                {
                    "group": o.group,
                    "observed": o.observed,
                    "levels": list(o.levels),
                    "values": o.values.tolist(),
                    "gpu_models": None if o.gpu_models is None else sorted(o.gpu_models),
                }
                for o in self.outlook.outlooks
            ],
            "fleet": self.fleet.to_dict(),
        }

    def to_dict(self) -> dict[str, Any]:
        """The plan and what the pass will do (what `gpuscale scale --json` prints)."""
        return {
            **self.plan.to_dict(),
            "step": self.step,
            "problems": self.problems,
            "forecast_source": self.forecast_source,
            "targets": dict(self.fleet.targets),
            "final_desired": dict(self.desired),
            "held": dict(self.held),
            "removals": [r.to_dict() for r in self.removals],
            "placeholders": [p.model_dump() for p in self.placeholders],
        }


# ------------------------------------------------------------------ pure decision helpers


def hold_scale_downs(plan: CapacityPlan, problems: Sequence[str]) -> tuple[dict[str, int], dict]:
    """Desired sizes with every scale-down held when the inputs cannot justify one."""
    desired = dict(plan.desired)
    held: dict[str, str] = {}
    if not problems:
        return desired, held
    why = "scale-down held: " + "; ".join(problems)
    for d in plan.decisions:
        if d.desired < d.current:
            desired[d.pool] = d.current
            held[d.pool] = why
    return desired, held


def choose_removals(
    fleet: FleetView, pool: str, count: int, unremovable: frozenset[str]
) -> list[NodeView]:
    """The nodes of `pool` to take out: booting ones first (nothing runs there yet), then
    nodes gpuscale already cordoned (a removal a restart interrupted), then the idle and
    drainable ones with the fewest pods to move, newest first."""
    if count <= 0:
        return []
    nodes = fleet.nodes.get(pool, ())
    booting = sorted(
        (n for n in nodes if n.status is NodeStatus.BOOTING),
        key=lambda n: n.launched_at,
        reverse=True,
    )
    ready = sorted(
        fleet.removable(pool, unremovable),
        key=lambda n: (not n.cordoned_by_us, n.movable_pods, -n.launched_at.timestamp()),
    )
    return (booting + ready)[:count]


def placeholder_demand(
    pools: Sequence[NodePool],
    desired: Mapping[str, int],
    used_gpus: Mapping[str, int],
    gpus_per_placeholder: int | None,
) -> list[PlaceholderDemand]:
    """Placeholders holding the GPUs the plan provides beyond what real pods use, so the
    capacity bought ahead of demand stays warm until jobs preempt them."""
    out = []
    for pool in pools:
        size = min(gpus_per_placeholder or pool.gpus_per_node, pool.gpus_per_node)
        headroom = desired.get(pool.name, 0) * pool.gpus_per_node - used_gpus.get(pool.name, 0)
        out.append(PlaceholderDemand(pool=pool.name, count=max(headroom, 0) // size, gpus=size))
    return out


# ------------------------------------------------------------------ the loop


@dataclass
class PassOutcome:
    decision: Decision
    applied: bool
    decision_id: int | None = None
    actions: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    placeholders: dict[str, list[str]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision_id": self.decision_id,
            "applied": self.applied,
            "plan": self.decision.to_dict(),
            "actions": self.actions,
            "placeholder_changes": self.placeholders,
            "errors": self.errors,
        }


class Reconciler:
    """One pass at a time; `iterate(apply=False)` is a dry run that changes nothing."""

    def __init__(
        self,
        system: LiveSystem,
        elector: LeaderElector | None = None,
        pause: Callable[[str], None] = lambda point: None,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self.system = system
        self.config = system.config
        self.elector = elector
        self.pause = pause
        self.clock = clock
        self.identity = elector.identity if elector is not None else "local"
        self._dry_state: PlannerState | None = None  # a dry run's memory stays in memory

    # ---- deciding ------------------------------------------------------------------------
    def decide(self, state: PlannerState | None = None) -> Decision:
        """Read, forecast and plan; act on nothing."""
        cfg = self.config
        now = self.clock()
        if state is None:
            state = self._dry_state or self.system.log.load(PLANNER_KEY, PlannerState())
        reading = read_demand(
            self.system.store, cfg.demand, cfg.policy.step_seconds, pd.Timestamp(now)
        )
        outlook = outlooks(reading, self.system.model, cfg.pools, cfg.policy, cfg.demand)
        kube = cfg.kubernetes
        fleet = observe_fleet(
            self.system.provider,
            [p.name for p in cfg.pools],
            self.system.kube,
            pool_label=kube.pool_label if kube else "gpuscale.io/pool",
            gpu_resource=kube.gpu_resource if kube else "nvidia.com/gpu",
            assume_idle=self.system.provider.name() == "simulated",
        )
        unremovable = self._unremovable(now)
        known: dict[str, list[str]] = self.system.log.load(KNOWN_KEY, {})
        current = {pool: {n.cloud_name for n in nodes} for pool, nodes in fleet.nodes.items()}
        lost = {pool: len(set(known.get(pool, [])) - names) for pool, names in current.items()}
        step = str(reading.last_step or pd.Timestamp(now).floor(f"{cfg.policy.step_seconds}s"))
        planned = plan(
            outlook.outlooks,
            fleet.fleet_state(now, unremovable, lost),
            cfg.pools,
            cfg.policy,
            state.memory_for(step),
        )
        problems = reading.problems + ([outlook.problem] if outlook.problem else [])
        desired, held = hold_scale_downs(planned, problems)
        removals: list[Removal] = []
        for pool in cfg.pools:
            surplus = len(fleet.nodes.get(pool.name, ())) - desired[pool.name]
            for node in choose_removals(fleet, pool.name, surplus, unremovable):
                booting = node.status is NodeStatus.BOOTING
                removals.append(Removal(pool.name, node.cloud_name, node.kube_name, booting))
        placeholders: list[PlaceholderDemand] = []
        if kube is not None and kube.pre_position and self.system.kube is not None:
            placeholders = placeholder_demand(
                cfg.pools, desired, fleet.used_gpus, kube.placeholder_gpus
            )
        return Decision(
            at=now,
            step=step,
            reading=reading,
            outlook=outlook,
            fleet=fleet,
            plan=planned,
            desired=desired,
            held=held,
            removals=tuple(removals),
            placeholders=tuple(placeholders),
            planner_state=state.after(step, planned.memory),
            forecast_source=self.system.model.source,
        )

    # ---- one pass -------------------------------------------------------------------------
    def iterate(self, apply: bool) -> PassOutcome:
        """Decide and, with `apply`, act. Raises NotLeader when this replica may not act."""
        log_ = self.system.log
        if not apply:
            decision = self.decide()
            self._dry_state = decision.planner_state
            decision_id = log_.record(self.identity, False, decision.inputs(), decision.to_dict())
            log_.finish(decision_id, {"dry_run": True})
            return PassOutcome(decision, applied=False, decision_id=decision_id)

        self._check_leader()
        resolved = self.resolve_journal()
        decision = self.decide(log_.load(PLANNER_KEY, PlannerState()))
        decision_id = log_.record(
            self.identity,
            True,
            decision.inputs(),
            decision.to_dict(),
            state={PLANNER_KEY: decision.planner_state},
        )
        outcome = PassOutcome(decision, applied=True, decision_id=decision_id, actions=resolved)
        try:
            self._act(decision, decision_id, outcome)
        except NotLeader as exc:
            outcome.errors.append(f"stopped: {exc}")
        finally:
            removed = {a["node"] for a in outcome.actions if a.get("status") == "done"}
            known = {
                pool: sorted(n.cloud_name for n in nodes if n.cloud_name not in removed)
                for pool, nodes in decision.fleet.nodes.items()
            }
            log_.save(KNOWN_KEY, known)
            log_.finish(decision_id, outcome.to_dict() | {"plan": None})
        return outcome

    def resolve_journal(self) -> list[dict[str, Any]]:
        """Settle actions a killed process left pending, against the cloud's state now."""
        pending = self.system.log.pending()
        if not pending:
            return []
        provider = self.system.provider
        provider.refresh()
        groups = {g.id(): g for g in provider.node_groups()}
        settled = []
        for action in pending:
            if action.kind == "set_target" and action.pool in groups:
                target = groups[action.pool].target_size()
                wanted = int(action.params["to"])
                if target >= wanted:
                    status, why = "done", f"found applied after a restart (target {target})"
                else:
                    status = "superseded"
                    why = f"not applied before a restart (target {target}); re-planned"
            else:
                status, why = "superseded", "interrupted by a restart; re-planned"
            self.system.log.complete(action.id, status, why)
            settled.append(
                {"action": f"resolve {action.kind}", "node": action.target, "status": status}
                | {"result": why}
            )
        return settled

    # ---- acting ---------------------------------------------------------------------------
    def _act(self, decision: Decision, decision_id: int, outcome: PassOutcome) -> None:
        groups = {g.id(): g for g in self.system.provider.node_groups()}
        for pool in self.config.pools:
            target = decision.fleet.targets.get(pool.name, 0)
            wanted = decision.desired[pool.name]
            if wanted > target and pool.name in groups:
                outcome.actions.append(self._grow(decision_id, groups[pool.name], target, wanted))
        chosen = {r.cloud_name for r in decision.removals}
        for removal in decision.removals:
            outcome.actions.append(self._remove(decision_id, removal))
        for node in decision.fleet.all_nodes():
            if node.cordoned_by_us and node.cloud_name not in chosen and node.kube_name:
                outcome.actions.append(self._uncordon(decision_id, node))
        kube = self.config.kubernetes
        if kube is not None and kube.pre_position and self.system.kube is not None:
            self._check_leader()
            try:
                changes = Placeholders(self.system.kube, kube.placeholders).reconcile(
                    decision.placeholders
                )
            except (KubeError, ValidationError) as exc:
                outcome.errors.append(f"placeholders: {exc}")
            else:
                outcome.placeholders = {
                    "created": list(changes.created),
                    "replaced": list(changes.replaced),
                    "deleted": list(changes.deleted),
                    "waiting": list(changes.waiting),
                }
        outcome.errors.extend(a["result"] for a in outcome.actions if a["status"] == "failed")

    def _grow(self, decision_id: int, group: Any, target: int, wanted: int) -> dict[str, Any]:
        self._check_leader()
        pool = group.id()
        log_ = self.system.log
        action = log_.begin(decision_id, pool, "set_target", pool, {"from": target, "to": wanted})
        self.pause("journaled")
        try:
            group.increase_size(wanted - target)
        except ProviderError as exc:
            log_.complete(action, "failed", str(exc))
            return {"action": "set_target", "node": pool, "status": "failed", "result": str(exc)}
        self.pause("acted")
        why = f"target {target} -> {wanted}"
        log_.complete(action, "done", why)
        return {"action": "set_target", "node": pool, "status": "done", "result": why}

    def _remove(self, decision_id: int, removal: Removal) -> dict[str, Any]:
        self._check_leader()
        log_ = self.system.log
        action = log_.begin(
            decision_id, removal.pool, "remove_node", removal.cloud_name, removal.to_dict()
        )
        self.pause("journaled")
        entry: dict[str, Any] = {"action": "remove_node", "node": removal.cloud_name}
        entry["kube_node"] = removal.kube_name
        kube = self.config.kubernetes
        try:
            if removal.kube_name is not None and self.system.kube is not None and kube:
                drain = DrainSettings(kube.drain.timeout_s, kube.drain.poll_s)
                removing = NodeRemoval(self.system.kube, self.system.provider, drain)
                result = removing.remove(removal.kube_name)
                status, why = _status_of(result.status), result.reason
                if result.status is not RemovalStatus.REMOVED:
                    # A node that could not go serves again; it is not tried for a while.
                    removing.uncordon(removal.kube_name)
                    self._mark_unremovable(removal.cloud_name)
                    entry["blocking"] = [
                        {"pod": f"{b.namespace}/{b.name}", "budget": b.budget, "reason": b.reason}
                        for b in result.blocking
                    ]
            else:
                group = self.system.provider.node_group_for(removal.cloud_name)
                if group is None:
                    status, why = "done", "the cloud no longer holds it"
                else:
                    group.delete_nodes([removal.cloud_name])
                    status, why = "done", f"deleted from node group {group.id()}"
        except (ProviderError, KubeError) as exc:
            status, why = "failed", str(exc)
        self.pause("acted")
        log_.complete(action, status, why)
        return entry | {"status": status, "result": why}

    def _uncordon(self, decision_id: int, node: NodeView) -> dict[str, Any]:
        self._check_leader()
        assert self.system.kube is not None and node.kube_name is not None
        log_ = self.system.log
        action = log_.begin(decision_id, node.pool, "uncordon", node.cloud_name, {})
        try:
            NodeRemoval(self.system.kube, self.system.provider).uncordon(node.kube_name)
        except KubeError as exc:
            log_.complete(action, "failed", str(exc))
            return {"action": "uncordon", "node": node.cloud_name, "status": "failed"} | {
                "result": str(exc)
            }
        why = "no longer to be removed"
        log_.complete(action, "done", why)
        return {"action": "uncordon", "node": node.cloud_name, "status": "done", "result": why}

    # ---- state ------------------------------------------------------------------------------
    def _check_leader(self) -> None:
        if self.elector is not None:
            self.elector.check()

    def _unremovable(self, now: datetime) -> frozenset[str]:
        until: dict[str, float] = self.system.log.load(UNREMOVABLE_KEY, {})
        stamp = now.timestamp()
        return frozenset(node for node, t in until.items() if t > stamp)

    def _mark_unremovable(self, cloud_name: str) -> None:
        kube = self.config.kubernetes
        seconds = kube.drain.unremovable_s if kube is not None else 0.0
        until: dict[str, float] = self.system.log.load(UNREMOVABLE_KEY, {})
        now = self.clock().timestamp()
        until = {node: t for node, t in until.items() if t > now}
        until[cloud_name] = now + seconds
        self.system.log.save(UNREMOVABLE_KEY, until)


def _status_of(status: RemovalStatus) -> str:
    return {
        RemovalStatus.REMOVED: "done",
        RemovalStatus.BLOCKED: "blocked",
        RemovalStatus.REFUSED: "failed",
    }[status]
