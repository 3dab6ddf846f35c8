"""Placement engine: which node and which GPUs each job gets.

from scaler.placement import ClusterState, Job, Placement, place, POLICIES
"""

from scaler.placement.cluster import Allocation, ClusterState, NodeSpec
from scaler.placement.decision import Placement, Unschedulable
from scaler.placement.engine import commit, place
from scaler.placement.job import Job
from scaler.placement.mix import WorkloadMix
from scaler.placement.policies import DEFAULT_POLICY, POLICIES, Policy, make_policy

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "Allocation",
    "ClusterState",
    "Job",
    "NodeSpec",
    "Placement",
    "Policy",
    "Unschedulable",
    "WorkloadMix",
    "commit",
    "make_policy",
    "place",
]
