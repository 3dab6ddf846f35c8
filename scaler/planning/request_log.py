"""The node requests a caller saw since its planner last took them in: the job-level input
of `DemandOutlook.requests`.

A request is a rise of a pool's reactive demand between two observations
(`ReactiveDemand.rises`: busy nodes plus the new nodes pending jobs pack onto), a gang all
at once, stamped with when it was seen. The job simulator observes every minute and the
live loop every pass; both hand the planner `requests(pool, at)` with the pool's outlook
and start over (`taken`) once the planner's memory has taken them in, so each rise is
replayed once (`planning.job_spare`).

Immutable, and small enough to persist with the live loop's planner state: the rises held
per pool are capped (a caller whose planner never takes them keeps the newest).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from scaler.planning.job_spare import NodeRequests
from scaler.planning.reactive import ReactiveDemand

# Rises kept per pool between two takes: far more than a demand step sees (the simulator's
# 10-minute step at most 10, the live loop one per pass).
MAX_RISES = 1024
MINUTE = timedelta(minutes=1)


@dataclass(frozen=True)
class RequestLog:
    seen: Mapping[str, int] = field(default_factory=dict)  # nodes per pool, last observed
    rises: Mapping[str, tuple[tuple[datetime, int], ...]] = field(default_factory=dict)

    def observe(self, demand: ReactiveDemand, at: datetime) -> RequestLog:
        """This log once the demand observed at `at` is in: its rises since the previous
        observation (pools seen then only) are requests."""
        new = demand.rises(self.seen)
        if not new:
            return RequestLog(dict(demand.nodes), self.rises)
        rises = dict(self.rises)
        for pool, nodes in new.items():
            rises[pool] = (*rises.get(pool, ()), (at, nodes))[-MAX_RISES:]
        return RequestLog(dict(demand.nodes), rises)

    def requests(self, pool: str, at: datetime) -> NodeRequests:
        """The pool's requests as the planner takes them at `at`: how long ago each came."""
        seen = self.rises.get(pool, ())
        return NodeRequests(tuple((at - t) / MINUTE for t, _ in seen), tuple(n for _, n in seen))

    def taken(self) -> RequestLog:
        """The log once the planner has taken its requests in: the last demand stays, to
        tell the next rise from."""
        return RequestLog(self.seen)
