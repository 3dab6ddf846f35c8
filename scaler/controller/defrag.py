"""Defragmentation that runs: the bounded move plan over the live cluster and, with
`apply`, the moves carried out through the Eviction API and the repartitions asked of the
GPU operator's MIG manager.

One pass (`Defragmenter.run`):

1. Actions a killed run left pending in the journal are settled: a move's pod is gone
   (done) or not (superseded); a repartition as the MIG manager reports it now.
2. The cluster is listed once (`observe_cluster`, as the live loop lists it).
3. The moves made in the last `window_s` (`scaler.controller.defrag_journal`) leave
   `max_moves - made` for this pass; never more, however often it runs.
4. `plan_report` plans the moves, and with the budget they leave the repartitions
   (`scaler.controller.defrag_plan`, `scaler.controller.repartition_plan`), and says what
   they free.
5. Every eviction is first asked as a dry run (`dryRun=All`: the API server checks the
   PodDisruptionBudgets and changes nothing), in a pass without `apply` too, so that it
   shows what `apply` would do. A unit (the node or GPU a group of moves empties) with a
   move a budget refuses is not started, since moving the rest would disrupt pods without
   freeing anything: the refused move is reported blocked with the API server's reason
   and its budget (without `apply`: it "would be refused"), and the plan is made again
   with that pod left in place (up to `REPLANS` times), so the move budget goes to units
   that can go; where the replans run out, the units a refusal stops are taken out of the
   plan, so what the report says is freed is what the moves made free. With `apply`, the
   moves of the units that go are noted on their target nodes (`scaler.kube.moves`), the
   pass waits one `placement.sync_s` so the service has listed them, then evicts in plan
   order. Each pod is read again just before its eviction: one that has left its node,
   finished, become unmovable (safe-to-evict "false") or been replaced under its name is
   not evicted, which ends its unit; the eviction names the uid read, so it never takes
   another pod of that name. Each eviction is journaled pending and counted in the window
   before it is asked, so a run killed in between never exceeds the window. An eviction
   refused after all (a budget that changed since the dry run) ends its unit there; the
   moves not carried out are taken off their target nodes.
6. With `apply`, the repartitions are asked and awaited (`scaler.controller.repartitions`).

The evicted pods' successors are steered by the extender (`scaler.service.steering`).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s

from scaler.controller.config import DefragSection, LiveConfig, kube_names, mix_jobs, workload_mix
from scaler.controller.defrag_journal import MOVE, MoveWindow, pool_of
from scaler.controller.defrag_plan import (
    DefragReport,
    PlannedStep,
    plan_report,
    units,
    why_changed,
    without_units,
)
from scaler.controller.journal import Action, DecisionJournal
from scaler.controller.repartitions import Repartitioner, RepartitionResult
from scaler.kube.errors import KubeError
from scaler.kube.evictions import BlockingPod, read_pod_now, request_eviction
from scaler.kube.mig_manager import MigManagedNode
from scaler.kube.moves import PlannedMove, set_moves, shape_of
from scaler.kube.observed import ObserveCluster, ObservedCluster, observe_cluster
from scaler.placement import make_policy
from scaler.placement.defrag import DefragPlan

REPLANS = 3  # plans made again around pods whose eviction a dry run refused


@dataclass(frozen=True)
class MoveResult:
    step: PlannedStep
    # done, blocked (a budget refused it), skipped (its unit could not go, or its pod
    # changed since the listing), failed
    status: str
    result: str

    def to_dict(self) -> dict[str, Any]:
        return self.step.to_dict() | {"status": self.status, "result": self.result}


@dataclass
class DefragOutcome:
    report: DefragReport
    applied: bool
    decision_id: int
    results: list[MoveResult] = field(default_factory=list)  # a dry run: the moves not to be made
    repartitions: list[RepartitionResult] = field(default_factory=list)
    settled: list[dict[str, Any]] = field(default_factory=list)  # from a killed run
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision_id": self.decision_id,
            "applied": self.applied,
            "plan": self.report.to_dict(),
            "results": [r.to_dict() for r in self.results],
            "repartitions": [r.to_dict() for r in self.repartitions],
            "settled": self.settled,
            "errors": self.errors,
        }

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    def window_used(self) -> int:
        """What this pass added to the window: the evictions made and the repartitions
        asked (a change under way holds its place in the window too)."""
        return self.count("done") + sum(r.asked for r in self.repartitions)


class Defragmenter:
    """One pass at a time (see the module docstring); `run(apply=False)` changes nothing in
    the cluster (it records its decision in the journal, as a dry run of the loop does)."""

    def __init__(
        self,
        config: LiveConfig,
        api: k8s.ApiClient,
        journal: DecisionJournal,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        observe: ObserveCluster = observe_cluster,
    ) -> None:
        self.config = config
        self.api = api
        self.journal = journal
        self.names = kube_names(config.kubernetes)
        placement = config.placement
        self.policy = make_policy(
            placement.policy, mix=workload_mix(placement.mix), seed=placement.seed
        )
        self.mix = mix_jobs(placement.mix)
        self.clock = clock
        self.sleep = sleep
        self.observe = observe
        self.identity = f"defrag@{socket.gethostname()}"
        self.window = MoveWindow(journal)
        self.repartitioner = Repartitioner(api, journal, self.names, self.window, clock, sleep)

    def run(self, apply: bool, settings: DefragSection | None = None) -> DefragOutcome:
        """Plan and, with `apply`, move. Raises KubeError when the cluster cannot be read."""
        settings = settings or self.config.defrag
        settled = self._settle() if apply else []
        observed = self.observe(self.api, self.names)
        mig_nodes = self.repartitioner.mig_nodes(observed, settings.mig)
        made = self.window.made(self.clock(), settings.window_s)
        report, refused_earlier, stopped = self._plan(observed, settings, made, mig_nodes, apply)
        inputs = {
            "goal": settings.goal,
            "nodes": len(observed.nodes),
            "pending": len(observed.real_pending),
            "made_in_window": made,
            "mig_managed_nodes": len(mig_nodes),
        }
        decision_id = self.journal.record(self.identity, apply, inputs, report.to_dict())
        outcome = DefragOutcome(report, apply, decision_id, settled=settled)
        if not apply:
            outcome.results = [
                MoveResult(step, "blocked", f"would be refused: {why}")
                for step, why in refused_earlier
            ] + stopped
            self.journal.finish(decision_id, {"dry_run": True})
            return outcome
        try:
            for step, why in refused_earlier:
                outcome.results.append(self._journal_refusal(decision_id, step, why, observed))
            outcome.results.extend(stopped)
            self._move(observed, report.steps, units(report.plan.moves), settings, outcome)
            outcome.errors.extend(r.result for r in outcome.results if r.status == "failed")
            for result in self.repartitioner.carry_out(
                decision_id, observed, report.repartitions, settings.mig
            ):
                outcome.repartitions.append(result)
                if result.status == "failed":
                    outcome.errors.append(result.result)
        finally:
            self.journal.finish(decision_id, outcome.to_dict() | {"plan": None})
        return outcome

    # ---- planning around refusals -----------------------------------------------------------
    def _plan(
        self,
        observed: ObservedCluster,
        settings: DefragSection,
        made: int,
        mig_nodes: Mapping[str, MigManagedNode],
        apply: bool,
    ) -> tuple[DefragReport, list[tuple[PlannedStep, str]], list[MoveResult]]:
        """The plan to carry out: its evictions are asked as a dry run and the plan made
        again (up to `REPLANS` times) without the pods refused; returned with it, the steps
        earlier plans had refused, with why, and where the replans ran out, the results of
        the last plan's units a refusal stops (`apply`: whether the pass means to move). The
        plan returned is only the units that go, so what it says it frees is what the moves
        made free."""
        refused: dict[str, tuple[PlannedStep, str]] = {}  # job -> its refused step, why
        for attempt in range(REPLANS + 1):
            now = self.clock()
            report = self._report(observed, settings, made, refused, mig_nodes, now)
            refusals = self._ask(report, observed)
            if not refusals:
                return report, list(refused.values()), []
            if attempt < REPLANS:
                # Plan again without them: the move budget goes to units that can go.
                refused |= {
                    report.steps[i].job: (report.steps[i], why) for i, why in refusals.items()
                }
        stopped: list[MoveResult] = []
        for group in units(report.plan.moves):
            refusal = next((i for i in group if i in refusals), None)
            if refusal is not None:
                stopped.extend(_not_started(report.steps, group, refusal, refusals[refusal], apply))
        # The plan's figures are those of its moves; describe only the units that go, from
        # the cluster as that plan saw it (the same `now`: the same moves awaited).
        left = set(refused) | {report.steps[i].job for i in refusals}
        going = without_units(report.plan, refusals.keys())
        report = self._report(observed, settings, made, left, mig_nodes, now, going)
        return report, list(refused.values()), stopped

    def _report(
        self,
        observed: ObservedCluster,
        settings: DefragSection,
        made: int,
        refused: Collection[str],
        mig_nodes: Mapping[str, MigManagedNode],
        now: float,
        moves: DefragPlan | None = None,
    ) -> DefragReport:
        return plan_report(
            observed, self.policy, settings, self.names, self.mix, made, refused, mig_nodes,
            now, moves,
        )  # fmt: skip

    def _ask(self, report: DefragReport, observed: ObservedCluster) -> dict[int, str]:
        """Ask every move's eviction as a dry run, unit by unit; the first move of each
        unit that would be refused (step index -> why)."""
        refused: dict[int, str] = {}
        for group in units(report.plan.moves):
            for i in group:
                pod = observed.bound_pods[report.steps[i].job]
                blocked = request_eviction(self.api, pod, dry_run=True)
                if blocked is not None:
                    refused[i] = _refusal_text(blocked)
                    break
        return refused

    # ---- moving ---------------------------------------------------------------------------
    def _move(
        self,
        observed: ObservedCluster,
        steps: Sequence[PlannedStep],
        going: Sequence[list[int]],
        settings: DefragSection,
        outcome: DefragOutcome,
    ) -> None:
        """Note the units' moves on their target nodes, then evict unit by unit: a unit ends
        at its first move not made, and its moves not made are taken off their targets."""
        now = self.clock()
        notes = {
            i: planned_move(steps[i], observed, now, settings.steer_s)
            for group in going
            for i in group
        }
        targets = self._note(observed, [(steps[i].target, m) for i, m in notes.items()], now)
        if notes and self.config.placement.sync_s > 0:
            self.sleep(self.config.placement.sync_s)  # the service lists the notes first
        unused: list[PlannedMove] = []
        for group in going:
            for k, i in enumerate(group):
                result = self._evict(outcome.decision_id, steps[i], observed, settings)
                outcome.results.append(result)
                if result.status != "done":
                    why = f"{steps[i].unit} would not be freed: {result.result}"
                    outcome.results.extend(
                        MoveResult(steps[j], "skipped", why) for j in group[k + 1 :]
                    )
                    unused.extend(notes[j] for j in group[k:])
                    break
        if unused:
            self._unnote(targets, unused)

    def _note(
        self, observed: ObservedCluster, planned: Iterable[tuple[str, PlannedMove]], now: float
    ) -> dict[str, list[PlannedMove]]:
        """Write the new moves onto their target nodes beside the live ones already there;
        expired moves are dropped from every node that carries any."""
        targets: dict[str, list[PlannedMove]] = {
            node: [m for m in moves if m.live(now)] for node, moves in observed.moves.items()
        }
        changed = {n for n, moves in observed.moves.items() if len(moves) != len(targets[n])}
        for node, move in planned:
            targets.setdefault(node, []).append(move)
            changed.add(node)
        for node in sorted(changed):
            set_moves(self.api, node, targets[node], self.names)
        return targets

    def _unnote(self, targets: dict[str, list[PlannedMove]], unused: list[PlannedMove]) -> None:
        gone = {m.id for m in unused}
        for node, moves in sorted(targets.items()):
            kept = [m for m in moves if m.id not in gone]
            if len(kept) != len(moves):
                # An unused note that stays expires by itself; its pod is not coming.
                with contextlib.suppress(KubeError):
                    set_moves(self.api, node, kept, self.names)

    def _evict(
        self,
        decision_id: int,
        step: PlannedStep,
        observed: ObservedCluster,
        settings: DefragSection,
    ) -> MoveResult:
        """Read the pod again; if the plan still holds for it, count in the window, journal,
        then ask the eviction of that pod (its uid), not of whatever bears its name."""
        listed = observed.bound_pods[step.job]
        try:
            read = read_pod_now(self.api, listed.namespace, listed.name, self.names)
        except KubeError as exc:
            return MoveResult(step, "failed", str(exc))
        if read is None:
            return MoveResult(step, "skipped", "not evicted: gone since the listing")
        changed = why_changed(step, listed, read[0], settings, self.names)
        if changed is not None:
            return MoveResult(step, "skipped", f"not evicted: {changed}")
        at = self.clock()
        self.window.count(at)
        action = self._begin(decision_id, step, observed)
        try:
            blocked = request_eviction(self.api, read[0], uid=read[1])
        except KubeError as exc:
            status, why = "failed", str(exc)
        else:
            if blocked is None:
                status, why = "done", f"evicted from {step.source}; steered to {step.target}"
            else:
                status, why = "blocked", _refusal_text(blocked)
        if status != "done":
            self.window.uncount(at)
        self.journal.complete(action, status, why)
        return MoveResult(step, status, why)

    def _journal_refusal(
        self, decision_id: int, step: PlannedStep, why: str, observed: ObservedCluster
    ) -> MoveResult:
        """A move a dry run refused: journaled as blocked, never evicted."""
        action = self._begin(decision_id, step, observed)
        result = MoveResult(step, "blocked", f"not evicted: {why}")
        self.journal.complete(action, "blocked", result.result)
        return result

    def _begin(self, decision_id: int, step: PlannedStep, observed: ObservedCluster) -> int:
        pool = pool_of(observed, step.source)
        return self.journal.begin(decision_id, pool, MOVE, step.job, step.to_dict())

    # ---- what a killed run left -------------------------------------------------------------
    def _settle(self) -> list[dict[str, Any]]:
        """Actions a killed run left pending: moves, then repartitions."""
        pending = self.journal.pending()
        return self._settle_moves(pending) + self.repartitioner.settle(pending)

    def _settle_moves(self, pending: Sequence[Action]) -> list[dict[str, Any]]:
        """Done when the pod has gone, else superseded."""
        moves = [a for a in pending if a.kind == MOVE]
        if not moves:
            return []
        observed = self.observe(self.api, self.names)
        present = set(observed.bound_pods) | {j.id for j in observed.pending}
        settled = []
        for action in moves:
            if action.target in present:
                status, why = "superseded", "interrupted by a restart; re-planned"
            else:
                status, why = "done", "the pod was gone after a restart"
            self.journal.complete(action.id, status, why)
            settled.append({"job": action.target, "status": status, "result": why})
        return settled


def planned_move(
    step: PlannedStep, observed: ObservedCluster, now: float, steer_s: float
) -> PlannedMove:
    """The note for `step`'s target node: who the successor is (the evicted pod's
    namespace, controller and shape) and the GPUs it is to get."""
    assert observed.state is not None  # a move is planned only on a listed cluster
    pod = observed.bound_pods[step.job]
    return PlannedMove(
        id=f"{step.job}@{now:.3f}",
        namespace=pod.namespace,
        controller_uid=pod.controller_uid or "",
        controller=pod.controller or "",
        shape=shape_of(observed.state.jobs[step.job].job),
        gpus=step.target_gpus,
        at=now,
        expires=now + steer_s,
    )


def _refusal_text(blocked: BlockingPod) -> str:
    return (
        f"{blocked.reason} (PodDisruptionBudget {blocked.budget})"
        if blocked.budget
        else blocked.reason
    )


def _not_started(
    steps: Sequence[PlannedStep], group: list[int], i: int, why: str, applied: bool
) -> list[MoveResult]:
    """A unit not started because move `i` would be refused; `applied` says whether the
    pass meant to move (then its moves were not evicted) or was a dry run (they would not
    be)."""
    refused = "not evicted" if applied else "would be refused"
    skipped = "not evicted" if applied else "would not be moved"
    results = []
    for j in group:
        if j == i:
            results.append(MoveResult(steps[j], "blocked", f"{refused}: {why}"))
        else:
            stops = f"{steps[j].unit} would not be freed ({steps[i].job}: {why})"
            results.append(MoveResult(steps[j], "skipped", f"{skipped}: {stops}"))
    return results
