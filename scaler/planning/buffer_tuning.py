"""The spare capacity a demand group holds, tuned online on the group's own recent demand.

What a platform team runs instead of a forecast is a fixed buffer: Cluster Autoscaler plus
k spare nodes (overprovisioning pods, a `CapacityBuffer`), or the peak of the last W steps
plus b nodes. Each such rule, tuned by hand on a validation week, is hard to beat; but the
right setting differs from cluster to cluster and drifts. So the planner tunes it itself:
it replays a family of buffer rules, and the forecast's own upper bound plus b nodes, over
the demand it has observed (in whole nodes of the group's pool, with the pool's boot lag)
and follows the cheapest rule whose share of short steps stayed within the service-level
knob. The knob then means the same on every cluster: the realised share of short steps.

Replaying a rule needs nothing but the observed demand: at call i the planner had seen
demand h[0..i] and a rule asks for T[i] nodes; a node requested at i is ready from i+L and
a removed one stops at once, so the capacity ready for the step decided at i is
min(T[i-L..i]), and that step was short when its demand h[i+1] exceeded it. Everything
here is a pure function of arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from scaler.cluster.pools import whole_nodes_each

RuleKind = Literal["headroom", "rolling-max", "sustained", "forecast"]
WINDOWED: frozenset[RuleKind] = frozenset({"rolling-max", "sustained"})


@dataclass(frozen=True, slots=True)
class BufferRule:
    """One way to size a group, in nodes: the last demand (`headroom`), the peak of the
    last `window` steps (`rolling-max`), the demand sustained over the last `window` steps
    (`sustained`: their minimum, so a rise is met only once it has lasted) or the forecast's
    upper bound (`forecast`), plus `spare` nodes."""

    kind: RuleKind
    spare: int
    window: int = 1

    @property
    def label(self) -> str:
        if self.kind == "rolling-max":
            return f"peak of the last {self.window} steps + {self.spare} node(s)"
        if self.kind == "sustained":
            return f"demand sustained over the last {self.window} steps + {self.spare} node(s)"
        if self.kind == "forecast":
            return f"forecast upper bound + {self.spare} node(s)"
        return f"last demand + {self.spare} spare node(s)"


# The family replayed: what teams tune by hand (BENCHMARKS.md `headroom` and `rolling-max`,
# on a finer grid), the forecast with a few spare nodes, and, for a knob that accepts more
# short steps than Cluster Autoscaler's own lag gives (a share of 3-10 % on clusters whose
# demand is flat most of the time), rises met only once they have lasted: the one way to
# pay less than the demand seen is to wait before following it. Spare nodes on top of a
# sustained level made the low knobs dearer on the validation windows (more switching).
RULES: tuple[BufferRule, ...] = (
    *(BufferRule("headroom", k) for k in range(33)),
    *(BufferRule("rolling-max", b, w) for w in (2, 3, 4, 6, 9, 12, 18, 24, 36) for b in range(21)),
    *(BufferRule("forecast", b) for b in range(11)),
    *(BufferRule("sustained", 0, w) for w in (2, 3, 4, 6, 9, 12)),
)
# The rules that read nothing but the observed demand: what the planner tunes among with
# its forecast rules off (`PlannerPolicy.forecast_rules`), so that the bench can price what
# the forecast adds (`predictive-no-forecast`).
DEMAND_ONLY: tuple[int, ...] = tuple(i for i, r in enumerate(RULES) if r.kind != "forecast")


@dataclass(frozen=True, slots=True)
class RuleRecord:
    """How one rule would have done over the replayed steps."""

    rule: int  # index into the rules
    short_share: float  # share of steps its capacity fell short of demand
    mean_nodes: float  # nodes it paid per step
    steps: int


def rule_targets(
    observed: np.ndarray, forecast: np.ndarray, rules: Sequence[BufferRule] = RULES
) -> np.ndarray:
    """[rule, i]: the nodes each rule asks for at call i, from demand `observed[:i+1]`
    (nodes, fractional allowed) and the forecast bound issued at call i (nodes)."""
    demand, bound = whole_nodes_each(observed), np.maximum(whole_nodes_each(forecast), 0.0)
    return np.array([_base(rule, demand, bound) + rule.spare for rule in rules])


def replay_rules(
    observed: np.ndarray,
    forecast: np.ndarray,
    lead: int,
    rules: Sequence[BufferRule] = RULES,
) -> list[RuleRecord]:
    """Each rule over the history: calls lead..n-2 are scored (before `lead` a rule had no
    fleet of its own; the last call has no outcome yet).

    Rules sharing a base (the last demand, one peak window, the forecast) differ only by
    their spare nodes s, so a step is short under spare s exactly when its demand exceeds
    the base's lowest target over the lead by more than s: one pass per base, not per rule.
    """
    demand = whole_nodes_each(observed)
    steps = max(demand.size - 1 - lead, 0)
    if steps == 0:
        return [RuleRecord(r, 0.0, 0.0, 0) for r in range(len(rules))]
    bound = np.maximum(whole_nodes_each(forecast), 0.0)
    bases: dict[tuple[RuleKind, int], tuple[np.ndarray, float]] = {}
    out = []
    for r, rule in enumerate(rules):
        key = (rule.kind, rule.window if rule.kind in WINDOWED else 1)
        if key not in bases:
            base = _base(rule, demand, bound)
            lowest = base.copy()
            for j in range(1, lead + 1):
                lowest[j:] = np.minimum(lowest[j:], base[:-j])
            gap = demand[lead + 1 :] - lowest[lead : demand.size - 1]
            bases[key] = (np.sort(gap), float(base[lead : demand.size - 1].mean()))
        gaps, mean_base = bases[key]
        short = steps - int(np.searchsorted(gaps, rule.spare + 1e-9, side="right"))
        out.append(RuleRecord(r, short / steps, mean_base + rule.spare, steps))
    return out


def _base(rule: BufferRule, demand: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """What a rule adds its spare nodes to, at every call (nodes)."""
    if rule.kind == "headroom":
        return demand
    if rule.kind == "forecast":
        return bound
    # The peak (or the floor) of the last `window` calls: one running maximum per step back
    # (cheaper than a sliding window's reduction for windows this short).
    combine = np.maximum if rule.kind == "rolling-max" else np.minimum
    level = demand.copy()
    for back in range(1, min(rule.window, demand.size)):
        combine(level[back:], demand[:-back], out=level[back:])
    return level


def tune(
    observed: np.ndarray, forecast: np.ndarray, lead: int, knob: float, forecast_rules: bool
) -> RuleRecord:
    """The rule to follow now (`cheapest_within` over the replayed history), its `rule` an
    index into RULES whichever rules were replayed: a memory saved under one setting of
    `forecast_rules` then names the same rule under the other."""
    chosen = RULES if forecast_rules else tuple(RULES[i] for i in DEMAND_ONLY)
    best = cheapest_within(replay_rules(observed, forecast, lead, chosen), knob)
    index = best.rule if forecast_rules else DEMAND_ONLY[best.rule]
    return RuleRecord(index, best.short_share, best.mean_nodes, best.steps)


def cheapest_within(records: Sequence[RuleRecord], knob: float) -> RuleRecord:
    """The cheapest rule whose share of short steps is within the knob; when none is, the
    one short least often (cheapest among those)."""
    within = [r for r in records if r.short_share <= knob + 1e-12]
    if within:
        return min(within, key=lambda r: (r.mean_nodes, r.rule))
    return min(records, key=lambda r: (r.short_share, r.mean_nodes, r.rule))


def target_of(rule: BufferRule, observed: np.ndarray, forecast: np.ndarray) -> int:
    """The nodes `rule` asks for now: the last of its targets over the history (demand
    observed and forecast bounds issued, nodes; only the rule's window is read)."""
    tail = slice(-rule.window, None)
    return int(rule_targets(observed[tail], forecast[tail], (rule,))[0, -1])
