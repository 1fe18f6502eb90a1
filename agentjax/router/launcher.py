"""`agentjax router`: its flags, and the start-up that builds the replicas and the policy and runs uvicorn.

Binds to 127.0.0.1 unless told otherwise; SIGTERM and Ctrl-C stop it gracefully (exit status 0).
Needs no model and never imports jax.
"""
from __future__ import annotations

import argparse
import logging
import os

from agentjax.router.policies import POLICIES
from agentjax.server.tenancy import OPERATOR_KEY_ENV

logger = logging.getLogger(__name__)


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    frontend = parser.add_argument_group("Frontend", "where the router listens")
    frontend.add_argument("--host", default="127.0.0.1", metavar="HOST", help="address to bind (default 127.0.0.1: this machine only)")
    frontend.add_argument("--port", type=int, default=8080, help="port to listen on")
    frontend.add_argument("--timeout-graceful-shutdown", type=float, default=30.0,
                          help="seconds to let replies finish on SIGTERM")
    replicas = parser.add_argument_group("Replicas", "the agentjax serve processes behind the router")
    add = replicas.add_argument
    add("--replica", action="extend", nargs="+", default=[], metavar="URL",
        help="an agentjax serve replica (http://HOST:PORT) that serves any turn; several may follow one flag, and the flag may repeat")
    add("--prefill-replica", action="extend", nargs="+", default=[], metavar="URL",
        help="a replica that computes prompts' KV (--policy pd) or serves first turns (--policy pools)")
    add("--decode-replica", action="extend", nargs="+", default=[], metavar="URL",
        help="a replica that pulls that KV from Mooncake and replies (--policy pd), or serves later turns "
             "(--policy pools)")
    routing = parser.add_argument_group("Routing", "where each request goes and when sessions move")
    add = routing.add_argument
    add("--policy", choices=POLICIES, default=None,
        help="sticky: a session's turns stay on one replica (the default, unless both --prefill-replica and "
             "--decode-replica are given); pd: prefill/decode disaggregation over Mooncake (the default with "
             "prefill and decode replicas); prefix: the replica with the longest cached prefix (from its KV "
             "events); pools: first turns on prefill replicas, later turns on decode replicas; queue: the least "
             "loaded replica (the baseline)")
    add("--max-imbalance", type=int, default=None,
        help="sticky: move a session whose replica holds this many more requests than the least loaded "
             "(default: never); prefix: prefer the least loaded beyond it (default 8)")
    add("--migration-min-gap", type=float, default=0.0,
        help="a session moves with its KV prefetched only when its agent hints announce a tool gap "
             "(expected_next_turn_s) at least this long, or announce none")
    health = parser.add_argument_group("Health and timeouts", "when a replica counts as down")
    add = health.add_argument
    add("--health-interval", type=float, default=1.0, help="seconds between health checks of each replica")
    add("--unhealthy-after", type=int, default=2, help="failed health checks in a row before a replica is down "
        "(a refused connection counts at once)")
    add("--upstream-timeout", type=float, default=600.0, help="seconds to wait for a replica's reply")
    add("--kv-transfer-timeout", type=float, default=120.0,
        help="seconds to wait for a P/D prefill step or a migration's prefetch (the P/D request falls back to "
             "one replica beyond it)")
    add("--operator-key", default=os.environ.get(OPERATOR_KEY_ENV), metavar="KEY",
        help="the replicas' operator key: the router's health, metrics, KV event and prompt hash calls send it "
             "(replicas with keys answer those only to an operator), and the router's own /metrics and "
             f"/router/* routes then need it (default: ${OPERATOR_KEY_ENV}, else none)")


def default_policy(args: argparse.Namespace) -> str:
    """`--policy`, else pd when prefill and decode replicas are both named, else sticky."""
    if args.policy is not None:
        return args.policy
    return "pd" if args.prefill_replica and args.decode_replica else "sticky"


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from agentjax.router.policies import make_policy
    from agentjax.router.replicas import build_replicas
    from agentjax.router.router import CLIENT_KEEPALIVE_S, Router, create_router_app
    from agentjax.server.launcher import graceful_server

    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))  # a line per health check
    replicas = build_replicas(args.replica, args.prefill_replica, args.decode_replica)
    policy = make_policy(default_policy(args), replicas, args.max_imbalance)
    router = Router(replicas, policy, upstream_timeout_s=args.upstream_timeout,
                    health_interval_s=args.health_interval, unhealthy_after=args.unhealthy_after,
                    kv_transfer_timeout_s=args.kv_transfer_timeout, migration_min_gap_s=args.migration_min_gap,
                    operator_key=args.operator_key)
    policy_name = default_policy(args)

    def ready() -> None:
        logger.info("router ready on http://%s:%d/v1: %d replicas, policy %s", args.host, args.port,
                    len(replicas), policy_name)

    server = graceful_server(uvicorn.Config(create_router_app(router), host=args.host, port=args.port,
                                           log_level=args.log_level.lower(), access_log=False,
                                           timeout_keep_alive=CLIENT_KEEPALIVE_S,
                                           timeout_graceful_shutdown=args.timeout_graceful_shutdown),
                             on_ready=ready)
    server.run()
    return 0
