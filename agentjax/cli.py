"""The `agentjax` command line: `serve`, `generate`, `bench` and `router`; `sweep` comes next.

    agentjax serve [--model M] [--host 127.0.0.1] [--port 8000] [--api-key K] ...
    agentjax generate --prompt "The capital of France is" [--model M] [--max-tokens N]
    agentjax router --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 [--policy sticky]
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
    parser.add_argument("--no-trim-prefill-to-buckets", dest="trim_prefill_to_buckets", action="store_false",
                        help="always run a step's whole prefill chunks, even when that pads far past a token bucket")
    parser.add_argument("--numerics", choices=("fast", "batch_invariant"), default="fast")
    parser.add_argument("--attention-impl", choices=("auto", "kernel", "reference"), default="auto",
                        help="the model's paged, sparse and MoE ops: the Pallas kernels or the jnp references (XLA); "
                             "auto (default): kernels on a GPU, references on a CPU")
    parser.add_argument("--quantization", "-q", default=None,
                        choices=("fp8", "deepseek_v4_fp8", "mxfp8", "modelopt_mxfp8", "modelopt_fp4", "compressed-tensors"),
                        help="the quantisation the HF checkpoint must declare (vLLM's names); default: the checkpoint's "
                             "quantization_config. Quantised weights stay quantised on the devices")
    parser.add_argument("--speculative-config", default=None,
                        help='speculative decoding as vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                             "(prompt_lookup_min/prompt_lookup_max for ngram); default: off")
    add_parallel_flags(parser)


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's parallel-layout flags (sharding/mesh.py) and the jax.distributed process flags."""
    add = parser.add_argument
    add("--tensor-parallel-size", "-tp", type=int, default=1, help="TP ranks (query heads, MLP and expert columns)")
    add("--data-parallel-size", "-dp", type=int, default=1,
        help="DP ranks, each with its own requests, stepping in lockstep")
    add("--enable-expert-parallel", action="store_true",
        help="shard whole experts over the DP x TP ranks (DEP with --data-parallel-size)")
    add("--decode-context-parallel-size", "-dcp", type=int, default=1,
        help="DCP ranks inside the TP group: KV interleaved token by token (divides --tensor-parallel-size)")
    add("--prefill-context-parallel-size", "-pcp", type=int, default=1,
        help="PCP ranks: a step's tokens split DualChunkSwap-style, KV all-gathered")
    add("--coordinator-address", default=None, help="jax.distributed coordinator HOST:PORT (several processes)")
    add("--num-processes", type=int, default=1, help="processes in the jax.distributed run")
    add("--process-id", type=int, default=0, help="this process's id (0 drives the engine; others follow)")


def _engine_args(args: argparse.Namespace) -> dict:
    return dict(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        trim_prefill_to_buckets=args.trim_prefill_to_buckets,
        numerics=args.numerics,
        attention_impl=args.attention_impl,
        quantization=args.quantization,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        decode_context_parallel_size=args.decode_context_parallel_size,
        prefill_context_parallel_size=args.prefill_context_parallel_size,
        coordinator_address=args.coordinator_address,
        num_processes=args.num_processes,
        process_id=args.process_id,
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
    from agentjax.router.launcher import add_router_arguments, cmd_router

    router = sub.add_parser("router", help="route OpenAI/Anthropic traffic over several agentjax serve replicas")
    add_router_arguments(router)
    router.set_defaults(handler=cmd_router)
    from agentjax.bench.sweep_cli import add_sweep_parser

    add_sweep_parser(sub)
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
