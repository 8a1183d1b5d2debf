"""Weaver: resource discovery, pools, the pure stage→pool planner, applying a plan, and the rollout balancer.

`weaver.plan` here is the planning function (as in ARCHITECTURE.md); import the rest of its module with
`from weaver.plan import Plan, StageNeed, ...`.
"""

from weaver.apply import ActorSpec, actor_specs
from weaver.balance import ThroughputBalancer
from weaver.discover import Gpu, Resources, discover
from weaver.errors import PlanError
from weaver.plan import Assignment, Placement, Plan, StageNeed, plan, stage_needs
from weaver.pools import Pool, autodetect_pools, pools_from_dicts

__all__ = [
    "ActorSpec",
    "actor_specs",
    "Assignment",
    "Gpu",
    "Placement",
    "Plan",
    "PlanError",
    "Pool",
    "Resources",
    "StageNeed",
    "ThroughputBalancer",
    "autodetect_pools",
    "discover",
    "plan",
    "pools_from_dicts",
    "stage_needs",
]
