"""What defragmentation keeps in the decision journal beside its decisions: the kinds of
action it journals, and the window of moves made (the Unix times of the evictions made and
the repartitions asked, in the journal's state, in the state directory), so passes however
frequent never make more than `defrag.max_moves` in `defrag.window_s`."""

from __future__ import annotations

from scaler.controller.journal import DecisionJournal
from scaler.kube.observed import ObservedCluster

WINDOW_KEY = "defrag_window"
MOVE = "defrag_move"  # journal: a pod evicted so that its successor lands elsewhere
REPARTITION = "defrag_repartition"  # journal: a node given another mig-parted config


class MoveWindow:
    """The moves counted in the window. A move is counted before it is asked and uncounted
    when it was not made, so a run killed in between never exceeds the window."""

    def __init__(self, journal: DecisionJournal) -> None:
        self.journal = journal

    def made(self, now: float, window_s: float) -> int:
        return sum(t > now - window_s for t in self.journal.load(WINDOW_KEY, []))

    def count(self, at: float) -> None:
        self.journal.save(WINDOW_KEY, [*self.journal.load(WINDOW_KEY, []), at])

    def uncount(self, at: float) -> None:
        made = list(self.journal.load(WINDOW_KEY, []))
        if at in made:
            made.remove(at)
            self.journal.save(WINDOW_KEY, made)


def pool_of(observed: ObservedCluster, node: str) -> str:
    """The pool an action on `node` is journaled under ("" where it has none)."""
    found = observed.nodes.get(node)
    return (found.pool if found else None) or ""
