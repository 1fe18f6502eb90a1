"""`agentjax serve`: its flags, and the start-up that loads the model and runs uvicorn.

Binds to 127.0.0.1 unless told otherwise. SIGTERM and Ctrl-C shut down gracefully: uvicorn stops
accepting, lets running requests finish (up to `--timeout-graceful-shutdown`), stops the engine
thread, and the process exits with status 0. jax is imported only when `serve` runs.
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

from agentjax.progress import Heartbeat
from agentjax.server.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS

logger = logging.getLogger(__name__)

API_KEY_ENV = "AGENTJAX_API_KEY"
WARMUP_ENV = "AGENTJAX_WARMUP"
WARMUP_LEVELS = ("none", "decode", "steps", "all")  # agentjax.runner.warmup's (this module never imports jax)
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `serve` adds to the engine flags (agentjax/engine_flags.py): vLLM's frontend group."""
    frontend = parser.add_argument_group("Frontend", "the HTTP server, its limits and how replies are read")
    add = frontend.add_argument
    add("--host", default="127.0.0.1", metavar="HOST", help="address to bind (default 127.0.0.1: this machine only)")
    add("--port", type=int, default=8000, help="port to listen on")
    add("--api-key", default=None, metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV}, else none)")
    add("--served-model-name", default=None, metavar="NAME",
        help=f"the model id clients send and /v1/models lists (default: from --model; {DEFAULT_MODEL_NAME} "
             "for the embedded model)")
    add("--max-tokens-limit", type=int, default=None,
        help="an operator's cap on max_tokens (and max_completion_tokens, max_output_tokens); default: none, "
             "only the context left after the prompt bounds it, as in vLLM")
    add("--default-max-tokens", type=int, default=None,
        help="output budget of a request that sets none (as a model's generation config gives vLLM one); "
             "default: the context left after the prompt")
    add("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=DEFAULT_TOOL_PARSER,
        help="how tool calls are read from replies: hermes (JSON in <tool_call> tags) or json (a JSON reply)")
    add("--max-queued-requests", type=int, default=256, help="requests queued or running before a 429")
    add("--max-request-body-bytes", type=int, default=8 * 2**20, help="largest request body (413 beyond)")
    add("--timeout-graceful-shutdown", type=float, default=30.0, help="seconds to let requests finish on SIGTERM")
    add("--warmup", choices=WARMUP_LEVELS, default=None,
        help="before the ready line, build the step executables serving can reach: decode (every decode "
             "step shape, greedy and sampled), steps (every step shape), all (steps with the log-probability "
             f"and penalty variants and the KV offload page movers), none; default: ${WARMUP_ENV}, else decode")


def engine_config_from_args(args: argparse.Namespace, base: dict):
    """The `EngineConfig` of the engine flags' values `base` (agentjax.engine_flags.engine_args)."""
    from agentjax.config import EngineConfig

    return EngineConfig(**base)


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model in (None, "default"):
        return DEFAULT_MODEL_NAME
    if args.model.startswith("preset:"):
        return args.model
    return Path(args.model).stem if Path(args.model).exists() else args.model


def cmd_serve(args: argparse.Namespace, engine_args: dict) -> int:
    with Heartbeat(logger, f"agentjax serve: starting {args.model or DEFAULT_MODEL_NAME} (the ready line follows once "
                   "it accepts requests); importing jax and the model code", doing="importing"):
        import uvicorn

        from agentjax.data_parallel import make_engine
        from agentjax.models import load_model
        from agentjax.server.app import create_app
        from agentjax.server.serving import ServerLimits

    args.api_key = args.api_key or os.environ.get(API_KEY_ENV)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("binding to %s without --api-key: anyone who can reach it can use it", args.host)
    config = engine_config_from_args(args, engine_args)
    started = time.perf_counter()
    if config.num_processes > 1:
        from sharding.distributed import initialize

        initialize(config)  # before any device is used
    model_cfg, params, tokenizer = load_model(args.model)
    engine = make_engine(model_cfg, params, config, tokenizer)
    if config.num_processes > 1 and config.process_id != 0:
        return follow_driver(engine, config)
    name = served_model_name(args)
    logger.info("loaded %s in %.1f s", model_cfg.name, time.perf_counter() - started)
    warm_up_engine(engine, args.warmup or os.environ.get(WARMUP_ENV) or "decode")
    limits = ServerLimits(max_tokens_limit=args.max_tokens_limit, default_max_tokens=args.default_max_tokens,
                          max_request_body_bytes=args.max_request_body_bytes,
                          max_queued_requests=args.max_queued_requests)
    aliases = tuple(a for a in (model_cfg.name, args.model) if a)
    app = create_app(engine, tokenizer, model_name=name, model_aliases=aliases, api_key=args.api_key,
                     limits=limits, tool_call_parser=args.tool_call_parser)
    def ready() -> None:
        logger.info("%s", ready_line(engine, name, model_cfg.name, args.host, args.port,
                                     time.perf_counter() - started))

    server = graceful_server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                           timeout_graceful_shutdown=args.timeout_graceful_shutdown,
                                           access_log=False), on_ready=ready)
    server.run()
    if config.num_processes > 1:
        engine.runner.send({"call": "stop"})  # the other processes' follow loops end too
    return 0


def warm_up_engine(engine, level: str) -> None:
    """The warm-up `--warmup` asks for (agentjax/runner/warmup.py); a data-parallel engine has none yet."""
    if level not in WARMUP_LEVELS:
        raise SystemExit(f"agentjax serve: ${WARMUP_ENV}={level!r} is not one of {', '.join(WARMUP_LEVELS)}")
    if level == "none":
        return
    if hasattr(engine, "ranks"):  # a DataParallelEngine
        logger.warning("warm-up skipped: it covers single-rank engines only (data_parallel_size > 1)")
        return
    from agentjax.runner.warmup import warm_up

    warm_up(engine, level)


def follow_driver(engine, config) -> int:
    """A process other than 0 serves no HTTP: it repeats process 0's steps until that one stops."""
    from sharding.distributed import follow

    logger.warning("process %d of %d: following process 0's steps", config.process_id, config.num_processes)
    message = follow(engine.runner)
    logger.warning("process %d: process 0 sent %r; stopping", config.process_id, message.get("call"))
    return 0


def kv_capacity(engine) -> tuple[int, int, int, int]:
    """(tokens, pages, tokens per page, bytes) of the engine's KV pool (a data-parallel engine: every
    rank's pools together)."""
    from agentjax.runner.model_runner import kv_cache_bytes

    ranks = getattr(engine, "ranks", [engine])
    pages = sum(rank.kv.pool.num_pages - 1 for rank in ranks)  # page 0 is the null page
    # tokens a page holds in the groups that keep a whole context (full attention, MLA latents): a page of
    # 128 tokens for MiniMax-M3, block_size x DCP ranks under decode context parallelism
    page_tokens = next((group.tokens_per_page for group in ranks[0].kv.groups if group.group.spec.hit_rule == "prefix"),
                       engine.config.parallel.kv_page_tokens(engine.config.block_size))
    return pages * page_tokens, pages, page_tokens, kv_cache_bytes(engine.runner.kv_pages)


def ready_line(engine, name: str, model: str, host: str, port: int, seconds: float) -> str:
    """The line `serve` logs once it accepts requests."""
    tokens, pages, page_tokens, kv_bytes = kv_capacity(engine)
    shown_host = f"[{host}]" if ":" in host else host
    memory = f"{kv_bytes / 2**30:.2f} GiB" if kv_bytes >= 2**29 else f"{kv_bytes / 2**20:.1f} MiB"
    return (f"ready on http://{shown_host}:{port}/v1 serving {name!r} ({model}); KV cache: {tokens:,} tokens "
            f"({pages:,} pages of {page_tokens}) in {memory}; started in {seconds:.1f} s")


def graceful_server(config, on_ready=None):
    """uvicorn's server, but a handled SIGTERM ends in exit status 0 rather than being re-raised;
    `on_ready()` runs once it listens."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started and on_ready is not None:
                on_ready()

        def handle_exit(self, sig, frame) -> None:
            logger.warning("received signal %d: shutting down gracefully", sig)
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()  # uvicorn would re-raise it after the shutdown

    return GracefulServer(config)
