"""`agentjax serve`: its flags, and the start-up that loads the model and runs uvicorn.

Binds to 127.0.0.1 unless told otherwise. SIGTERM and Ctrl-C shut down gracefully: uvicorn stops
accepting, lets running requests finish (up to `--timeout-graceful-shutdown`), stops the engine
thread, and the process exits with status 0. jax is imported only when `serve` runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from pathlib import Path

from agentjax.server.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS

logger = logging.getLogger(__name__)

API_KEY_ENV = "AGENTJAX_API_KEY"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `serve` adds to the shared engine flags (`--model`, `--block-size`, ...)."""
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    add("--port", type=int, default=8000)
    add("--api-key", default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV}, else none)")
    add("--served-model-name", default=None, help="the model id clients send (default: from --model)")
    add("--max-model-len", type=int, default=None, help="longest prompt plus output (default: the model's)")
    add("--max-num-seqs", type=int, default=64, help="requests in one step")
    add("--prefill-schedule-interval", type=int, default=1, help="steps between prefill admissions")
    add("--kv-cache-memory-gb", type=float, default=1.0, help="KV pool size when --num-kv-blocks is unset")
    add("--host-cache-gb", type=float, default=0.0,
        help="host-memory KV offload tier: GB of pinned host pages (default 0: off)")
    add("--disk-cache-dir", default=None,
        help="disk KV offload tier: a directory of page files with checksums, kept across restarts (default: off)")
    add("--disk-cache-gb", type=float, default=16.0, help="size cap of the disk tier (oldest pages go first)")
    add("--mooncake-master", default=None,
        help="distributed KV offload tier: HOST:PORT of a Mooncake Store master (default: off)")
    add("--mooncake-segment-gb", type=float, default=1.0, help="memory this server lends to the Mooncake pool")
    add("--kv-offload-retention", choices=("interval", "marconi"), default="interval",
        help="which pages a finished turn stores in the tiers: interval (all of them) or marconi "
             "(the prefix a second turn shared, and branch points)")
    add("--kv-policy", choices=("lru", "hints", "marconi"), default="hints",
        help="which cached KV pages stay on the device: hints (default: the agent hints' session pins, then "
             "the pages whose next turn is expected farthest away go first), lru, or marconi (reused and "
             "branch-point content kept longer)")
    add("--max-tokens-limit", type=int, default=None,
        help="an operator's cap on max_tokens (and max_completion_tokens, max_output_tokens); default: none, "
             "only the context left after the prompt bounds it, as in vLLM")
    add("--default-max-tokens", type=int, default=None,
        help="output budget of a request that sets none (as a model's generation config gives vLLM one); "
             "default: the context left after the prompt")
    add("--logprobs-mode", choices=("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"),
        default="raw_logprobs", help="what logprobs report (vLLM's names): the model's log probabilities "
        "(default) or logits, before or after penalties, temperature and top-k/top-p")
    add("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=DEFAULT_TOOL_PARSER,
        help="how tool calls are read from replies: hermes (JSON in <tool_call> tags) or json (a JSON reply)")
    add("--max-queued-requests", type=int, default=256, help="requests queued or running before 429")
    add("--max-request-body-bytes", type=int, default=8 * 2**20, help="largest request body (413 beyond)")
    add("--timeout-graceful-shutdown", type=float, default=30.0, help="seconds to let requests finish on SIGTERM")


def engine_config_from_args(args: argparse.Namespace, base: dict):
    """An `EngineConfig`; settings it has no field for yet travel in `extra`."""
    from agentjax.config import EngineConfig

    wanted = dict(base, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  prefill_schedule_interval=args.prefill_schedule_interval,
                  kv_cache_memory_gb=args.kv_cache_memory_gb, host_cache_gb=args.host_cache_gb,
                  disk_cache_dir=args.disk_cache_dir, disk_cache_gb=args.disk_cache_gb,
                  mooncake_master=args.mooncake_master, mooncake_segment_gb=args.mooncake_segment_gb,
                  kv_offload_retention=args.kv_offload_retention, kv_policy=args.kv_policy,
                  logprobs_mode=args.logprobs_mode)
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    known = {k: v for k, v in wanted.items() if k in fields}
    extra = {k: v for k, v in wanted.items() if k not in fields and v not in (None, 0, 0.0)}
    if extra:
        logger.warning("engine settings %s are accepted but not used by this engine yet", sorted(extra))
        known["extra"] = extra
    return EngineConfig(**known)


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model in (None, "default"):
        return DEFAULT_MODEL_NAME
    if args.model.startswith("preset:"):
        return args.model
    return Path(args.model).stem if Path(args.model).exists() else args.model


def cmd_serve(args: argparse.Namespace, engine_args: dict) -> int:
    import uvicorn

    from agentjax.data_parallel import make_engine
    from agentjax.models import load_model
    from agentjax.server.app import create_app
    from agentjax.server.serving import ServerLimits

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("binding to %s without --api-key: anyone who can reach it can use it", args.host)
    config = engine_config_from_args(args, engine_args)
    started = time.perf_counter()
    if config.num_processes > 1:
        from sharding.distributed import initialize

        initialize(config)  # before any device is used
    model_cfg, params, tokenizer = load_model(args.model, quantization=config.quantization, engine_config=config)
    engine = make_engine(model_cfg, params, config, tokenizer)
    if config.num_processes > 1 and config.process_id != 0:
        return follow_driver(engine, config)
    name = served_model_name(args)
    logger.warning("loaded %s in %.1fs; serving it as %r on http://%s:%d", model_cfg.name,
                   time.perf_counter() - started, name, args.host, args.port)
    limits = ServerLimits(max_tokens_limit=args.max_tokens_limit, default_max_tokens=args.default_max_tokens,
                          max_request_body_bytes=args.max_request_body_bytes,
                          max_queued_requests=args.max_queued_requests)
    aliases = tuple(a for a in (model_cfg.name, args.model) if a)
    app = create_app(engine, tokenizer, model_name=name, model_aliases=aliases, api_key=args.api_key,
                     limits=limits, tool_call_parser=args.tool_call_parser)
    server = graceful_server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                           timeout_graceful_shutdown=args.timeout_graceful_shutdown,
                                           access_log=False))
    server.run()
    if config.num_processes > 1:
        engine.runner.send({"call": "stop"})  # the other processes' follow loops end too
    return 0


def follow_driver(engine, config) -> int:
    """A process other than 0 serves no HTTP: it repeats process 0's steps until that one stops."""
    from sharding.distributed import follow

    logger.warning("process %d of %d: following process 0's steps", config.process_id, config.num_processes)
    message = follow(engine.runner)
    logger.warning("process %d: process 0 sent %r; stopping", config.process_id, message.get("call"))
    return 0


def graceful_server(config):
    """uvicorn's server, but a handled SIGTERM ends in exit status 0 rather than being re-raised."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            logger.warning("received signal %d: shutting down gracefully", sig)
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()  # uvicorn would re-raise it after the shutdown

    return GracefulServer(config)
