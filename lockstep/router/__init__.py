"""A router across lockstep servers: the same HTTP API, requests routed by prefix affinity and
load (`lockstep router --worker-urls URL ... --policy cache_aware`)."""

from lockstep.router.policies import POLICIES, CacheAware, Policy, RadixTree, make_policy
from lockstep.router.router import Router, RouterConfig
from lockstep.router.server import create_app, main

__all__ = ["POLICIES", "CacheAware", "Policy", "RadixTree", "Router", "RouterConfig",
           "create_app", "main", "make_policy"]
