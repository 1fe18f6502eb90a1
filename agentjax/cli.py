"""The `agentjax` command line: `serve` and `generate` now; `bench`, `sweep` and `router` come next.

    agentjax serve [--model M] [--host 127.0.0.1] [--port 8000] [--api-key K] ...
    agentjax generate --prompt "The capital of France is" [--model M] [--max-tokens N]
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from agentjax.errors import AgentjaxError


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file, HF directory, preset:NAME or embedded name (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV pages in the pool (default: sized from 1 GiB)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0, help="cap on prefill tokens per request per step (0: none)")
    parser.add_argument("--numerics", choices=("fast", "batch_invariant"), default="fast")


def _engine_args(args: argparse.Namespace) -> dict:
    return dict(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        numerics=args.numerics,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from agentjax import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(args.model, **_engine_args(args))
    print(f"[agentjax] loaded {llm.model_config.name} in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    started = time.perf_counter()
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], sampling)
    else:
        out = llm.generate([args.prompt], sampling)[0]
    elapsed = time.perf_counter() - started
    print(out.text)
    print(
        f"[agentjax] {len(out.token_ids)} tokens in {elapsed:.1f}s (first call includes compilation), "
        f"finish_reason={out.finish_reason}",
        file=sys.stderr,
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from agentjax.server.launcher import cmd_serve as serve

    return serve(args, _engine_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentjax", description="A JAX serving stack for agentic LLM traffic.")
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING...)")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline from one prompt")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    gen.add_argument("--seed", type=int, default=None)
    _add_engine_flags(gen)
    gen.set_defaults(handler=cmd_generate)
    from agentjax.server.launcher import add_serve_arguments

    srv = sub.add_parser("serve", help="serve the model over the OpenAI HTTP API")
    _add_engine_flags(srv)
    add_serve_arguments(srv)
    srv.set_defaults(handler=cmd_serve)
    from agentjax.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except AgentjaxError as exc:
        print(f"agentjax: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
