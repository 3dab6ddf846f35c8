"""What `gpuscale journal` shows of the decision log: each decision with its status, the
size and reason it chose for each pool and its outcome, and each action with its status
and result (what the cloud or the cluster said, or how a restart settled it).

A decision's status is read off its outcome: `open` (no outcome: its pass is under way, or
a kill stopped it and no pass has run since to settle it), `dry run`, `superseded` (a kill
stopped its pass; the next pass settled its actions and planned afresh), `failed` (the pass
ended with errors) or `done`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from scaler.controller.journal import Action, DecisionJournal, JournalEntry


@dataclass(frozen=True)
class PoolChoice:
    pool: str
    target: int | None  # the cloud's target the pass saw
    desired: int  # what the pass set (floor applied, scale-downs held)
    reason: str


@dataclass(frozen=True)
class DecisionRow:
    id: int
    at: str  # UTC, ISO 8601
    identity: str
    applied: bool
    status: str
    pools: tuple[PoolChoice, ...]
    errors: tuple[str, ...]
    outcome: Mapping[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"pools": [asdict(p) for p in self.pools]}


@dataclass(frozen=True)
class ActionRow:
    id: int
    decision_id: int | None
    pool: str
    kind: str
    target: str
    params: Mapping[str, Any]
    status: str
    result: str | None
    started: str | None
    finished: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class JournalView:
    decisions: tuple[DecisionRow, ...]  # oldest first
    actions: tuple[ActionRow, ...]  # oldest first

    def to_dict(self) -> dict[str, Any]:
        return {
            "decisions": [d.to_dict() for d in self.decisions],
            "actions": [a.to_dict() for a in self.actions],
            "pending": sum(a.status == "pending" for a in self.actions),
            "open": sum(d.status == "open" for d in self.decisions),
        }


def read_journal(
    journal: DecisionJournal,
    since_ns: int | None = None,
    pending: bool = False,
    limit: int | None = None,
) -> JournalView:
    """The newest `limit` decisions made since `since_ns` and the actions started since
    then (all of them without `since_ns`); with `pending`, only the actions still pending
    and the decisions still open, whenever they were made."""
    entries = journal.decisions(limit=limit, since_ns=since_ns, open_only=pending)
    if pending:
        actions = journal.actions(status="pending", since_ns=since_ns)
    elif limit is not None:
        actions = journal.actions(decision_ids=[e.id for e in entries])
    else:
        actions = journal.actions(since_ns=since_ns)
    return JournalView(
        decisions=tuple(decision_row(e) for e in reversed(entries)),
        actions=tuple(action_row(a) for a in actions),
    )


def decision_status(entry: JournalEntry) -> str:
    outcome = entry.outcome
    if outcome is None:
        return "open"
    if outcome.get("dry_run"):
        return "dry run"
    if outcome.get("superseded"):
        return "superseded"
    return "failed" if outcome.get("errors") else "done"


def decision_row(entry: JournalEntry) -> DecisionRow:
    plan = entry.plan
    targets: Mapping[str, int] = plan.get("targets") or {}
    final: Mapping[str, int] = plan.get("final_desired") or plan.get("desired") or {}
    held: Mapping[str, str] = plan.get("held") or {}
    floor = ((plan.get("reactive") or {}).get("floor")) or {}
    pools = []
    for d in plan.get("decisions") or []:
        pool = d["pool"]
        desired = int(final.get(pool, d["desired"]))
        reason = held.get(pool) or d["reason"]
        if pool not in held and desired > d["desired"] and floor.get(pool) == desired:
            reason = f"pending pods need {desired} (reactive floor); the plan said {d['desired']}"
        pools.append(PoolChoice(pool, targets.get(pool), desired, reason))
    errors = tuple((entry.outcome or {}).get("errors") or ())
    return DecisionRow(
        id=entry.id,
        at=_iso(entry.at_ns) or "",
        identity=entry.identity,
        applied=entry.applied,
        status=decision_status(entry),
        pools=tuple(pools),
        errors=errors,
        outcome=entry.outcome,
    )


def action_row(action: Action) -> ActionRow:
    return ActionRow(
        id=action.id,
        decision_id=action.decision_id,
        pool=action.pool,
        kind=action.kind,
        target=action.target,
        params=action.params,
        status=action.status,
        result=action.result,
        started=_iso(action.started_ns),
        finished=_iso(action.finished_ns),
    )


def _iso(ns: int | None) -> str | None:
    if ns is None:
        return None
    return datetime.fromtimestamp(ns / 1e9, UTC).replace(tzinfo=None).isoformat(timespec="seconds")
