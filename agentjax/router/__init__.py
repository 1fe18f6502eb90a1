"""agentjax's control plane across replicas: `agentjax router` (session-sticky, prefix-aware, first-turn
and later-turn pools, prefill/decode disaggregation over Mooncake, queue-depth balancing, session KV
migration in the tool gap) in front of several `agentjax serve` replicas.

Modules: routing_request (what a request says about its session and turn), replicas (health, load,
prefix index), policies, health (checks and KV-event polling), proxy (forwarding and streaming),
disagg (the replicas' KV transfer calls: the P/D prefill step, flush, prefetch), migration (moving a
session with its KV), metrics, router (the app), launcher (the command). Never imports jax.
"""
from agentjax.router.policies import POLICIES, RoutingDecision, RoutingPolicy, SessionTable, make_policy
from agentjax.router.replicas import Replica, build_replicas
from agentjax.router.router import Router, create_router_app

__all__ = ["POLICIES", "Replica", "Router", "RoutingDecision", "RoutingPolicy", "SessionTable", "build_replicas",
           "create_router_app", "make_policy"]
