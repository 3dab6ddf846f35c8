"""The scheduling simulation: which node and which GPUs each job gets, and everything that
asks "where would this go?" on the same engine: gangs, preemption, queue admission,
defragmentation, the scale-up estimate on pool templates and the scale-down check.

from scaler.placement import ClusterState, Job, Placement, place, POLICIES
"""

from scaler.cluster.job import Job
from scaler.cluster.snapshot import Allocation, ClusterState, NodeSpec
from scaler.placement.decision import Placement, Unschedulable
from scaler.placement.defrag import DefragPlan, apply_plan, plan_defrag
from scaler.placement.engine import commit, place
from scaler.placement.gang import GangPlacement, commit_gang, place_gang
from scaler.placement.mix import WorkloadMix
from scaler.placement.policies import DEFAULT_POLICY, POLICIES, Policy, make_policy
from scaler.placement.preemption import preempt
from scaler.placement.queue import QueuePolicy, admission_order, admit
from scaler.placement.repartition import RepartitionPlan, apply_repartition, plan_repartition

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "Allocation",
    "ClusterState",
    "DefragPlan",
    "GangPlacement",
    "Job",
    "NodeSpec",
    "Placement",
    "Policy",
    "QueuePolicy",
    "RepartitionPlan",
    "Unschedulable",
    "WorkloadMix",
    "admission_order",
    "admit",
    "apply_plan",
    "apply_repartition",
    "commit",
    "commit_gang",
    "make_policy",
    "place",
    "place_gang",
    "plan_defrag",
    "plan_repartition",
    "preempt",
]
