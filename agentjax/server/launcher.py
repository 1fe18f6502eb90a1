"""`agentjax serve`: its flags, and the start-up that loads the model and runs uvicorn.

Binds to 127.0.0.1 unless told otherwise. SIGTERM and Ctrl-C shut down gracefully: uvicorn stops
accepting, lets running requests finish (up to `--timeout-graceful-shutdown`), stops the engine
thread, and the process exits with status 0. jax is imported only when `serve` runs.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from agentjax.progress import Heartbeat
from agentjax.server.tenancy import API_KEY_ENV, OPERATOR_KEY_ENV
from agentjax.server.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS

logger = logging.getLogger(__name__)

WARMUP_ENV = "AGENTJAX_WARMUP"
WARMUP_LEVELS = ("none", "decode", "steps", "all")  # agentjax.runner.warmup's (this module never imports jax)
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `serve` adds to the engine flags (agentjax/engine_flags.py): vLLM's frontend group."""
    frontend = parser.add_argument_group("Frontend", "the HTTP server, its keys, its limits and how replies are read")
    add = frontend.add_argument
    add("--host", default="127.0.0.1", metavar="HOST", help="address to bind (default 127.0.0.1: this machine only)")
    add("--port", type=int, default=8000, help="port to listen on")
    add("--api-key", action="append", default=None, metavar="KEY",
        help=f"a key clients send ('Authorization: Bearer KEY' or 'x-api-key: KEY'); may repeat. With any key "
             f"set, every route but /health needs one, and each key gets its own prefix-cache namespace "
             f"(default: ${API_KEY_ENV}, else none: the server is open)")
    add("--api-keys-file", default=None, metavar="PATH",
        help='keys in a JSON file: {"keys": [{"key": "...", "namespace": "team-a", "operator": false}, ...]}; '
             "keys that name the same namespace share their prefix cache")
    add("--operator-key", action="append", default=None, metavar="KEY",
        help=f"a key that may also read /metrics, /kv/events and /kv/prompt_hashes (what is cached); may repeat "
             f"(default: ${OPERATOR_KEY_ENV}, else none)")
    add("--metrics-without-key", action="store_true",
        help="serve /metrics without a key even when keys are set (for a scraper that sends none)")
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


def key_ring_from_args(args: argparse.Namespace):
    """The server's keys: `--api-key` (else $AGENTJAX_API_KEY), `--operator-key` (else
    $AGENTJAX_OPERATOR_KEY) and `--api-keys-file`."""
    from agentjax.server.tenancy import KeyRing

    api_keys = args.api_key or [os.environ.get(API_KEY_ENV, "")]
    operator_keys = args.operator_key or [os.environ.get(OPERATOR_KEY_ENV, "")]
    return KeyRing.build(api_keys, operator_keys, args.api_keys_file)


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

    keys = key_ring_from_args(args)  # a bad keys file stops the server before the model loads
    if args.host not in ("127.0.0.1", "localhost", "::1") and not keys.enabled:
        logger.warning("binding to %s without --api-key: anyone who can reach it can use it", args.host)
    if keys.enabled:
        logger.warning("%d API key(s), %s operator key; each key's prefix cache is its own unless the keys "
                       "file names a shared namespace", len(keys), "with an" if keys.has_operator else "no")
    config = engine_config_from_args(args, engine_args)
    started = time.perf_counter()
    if config.num_processes > 1:
        from agentjax.runner.distributed import initialize

        initialize(config)  # before any device is used
    model_cfg, params, tokenizer = load_model(args.model, quantization=config.quantization, engine_config=config)
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
    app = create_app(engine, tokenizer, model_name=name, model_aliases=aliases, keys=keys,
                     metrics_without_key=args.metrics_without_key, limits=limits,
                     tool_call_parser=args.tool_call_parser)

    def ready() -> None:
        logger.info("%s", ready_line(engine, name, model_cfg.name, args.host, args.port,
                                     time.perf_counter() - started))

    server = graceful_server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                           timeout_graceful_shutdown=args.timeout_graceful_shutdown,
                                           access_log=False), on_ready=ready, on_deadline=lambda: end_requests(app))
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
    from agentjax.runner.distributed import follow

    logger.warning("process %d of %d: following process 0's steps", config.process_id, config.num_processes)
    message = follow(engine.runner)
    logger.warning("process %d: process 0 sent %r; stopping", config.process_id, message.get("call"))
    return 0


def kv_capacity(engine) -> tuple[int, int, int, int]:
    """(tokens, pages, tokens per page, bytes) of the engine's KV pool (a data-parallel engine: every
    rank's pools together)."""
    from agentjax.runner.model_runner import kv_cache_bytes

    ranks = getattr(engine, "ranks", [engine])
    # tokens a page holds in the groups that keep a whole context (full attention, MLA latents): a page of
    # 128 tokens for MiniMax-M3, block_size x DCP ranks under decode context parallelism
    prefix = ranks[0].kv.prefix_group()
    page_tokens = prefix.tokens_per_page if prefix is not None else \
        engine.config.parallel.kv_page_tokens(engine.config.block_size)
    pages = sum(_whole_context_pages(rank.kv, prefix) for rank in ranks)
    return pages * page_tokens, pages, page_tokens, kv_cache_bytes(engine.runner.kv_pages)


def _whole_context_pages(kv, prefix) -> int:
    """Pages of the whole-context group `prefix` the pool holds: one per page id of a shared pool (page 0 is
    the null page), or, in a pool of slabs, that group's pages in every slab but the null one (the most it
    holds when the other groups take none)."""
    layout = getattr(kv, "layout", None)
    if layout is None or layout.mode != "pool" or prefix is None:
        return kv.num_pages - 1
    return (layout.num_slabs - 1) * layout.groups[prefix.group_id].pages_per_slab


def ready_line(engine, name: str, model: str, host: str, port: int, seconds: float) -> str:
    """The line `serve` logs once it accepts requests."""
    tokens, pages, page_tokens, kv_bytes = kv_capacity(engine)
    shown_host = f"[{host}]" if ":" in host else host
    memory = f"{kv_bytes / 2**30:.2f} GiB" if kv_bytes >= 2**29 else f"{kv_bytes / 2**20:.1f} MiB"
    return (f"ready on http://{shown_host}:{port}/v1 serving {name!r} ({model}); KV cache: {tokens:,} tokens "
            f"({pages:,} pages of {page_tokens}) in {memory}; started in {seconds:.1f} s")


def end_requests(app) -> None:
    """The graceful shutdown's time is up: every request still running ends now with a 503 (a stream
    with an error event, so its client knows it was cut) rather than being cancelled mid-write."""
    from agentjax.server.errors import ServerShuttingDownError

    logger.warning("graceful shutdown: ending %d request(s) still running", app.state.async_engine.num_in_flight)
    app.state.shutting_down = True
    app.state.async_engine.fail_all(ServerShuttingDownError("the server is shutting down and its "
                                                            "--timeout-graceful-shutdown has passed; retry the "
                                                            "request", code="shutting_down"))


def graceful_server(config, on_ready: Callable[[], None] | None = None,
                    on_deadline: Callable[[], None] | None = None):
    """uvicorn's server, but a handled SIGTERM ends in exit status 0 rather than being re-raised;
    `on_ready()` runs once it listens, and `on_deadline()` a moment before `timeout_graceful_shutdown`
    passes (so requests can end themselves before uvicorn cancels them)."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started and on_ready is not None:
                on_ready()

        async def shutdown(self, sockets=None) -> None:
            grace = self.config.timeout_graceful_shutdown
            timer = None
            if on_deadline is not None and grace:
                timer = asyncio.get_running_loop().call_later(max(0.0, grace - min(1.0, grace / 2)), on_deadline)
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

        def handle_exit(self, sig, frame) -> None:
            logger.warning("received signal %d: shutting down gracefully", sig)
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()  # uvicorn would re-raise it after the shutdown

    return GracefulServer(config)
