"""The engine's command-line flags, shared by `serve` and `generate`, grouped as vLLM groups them.

Each flag is an `EngineConfig` field in kebab case with that field's default, so the CLI, `LLM(...)`
and the generated configuration reference (docs/configuration.md) agree. `engine_args(args)` gives the
`EngineConfig` keyword arguments. Never imports jax.
"""
from __future__ import annotations

import argparse
import dataclasses

from agentjax.config import EngineConfig
from agentjax.model_specs import model_spec_help

_DEFAULTS = EngineConfig()
GIB = "GiB (2^30 bytes)"


def _group(parser: argparse.ArgumentParser, title: str, description: str):
    return parser.add_argument_group(title, description)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    model = _group(parser, "Model", "what runs and how its numbers are computed")
    add = model.add_argument
    add("--model", default=None, metavar="SPEC", help=model_spec_help())
    add("--max-model-len", type=int, default=None,
        help="longest prompt plus output in tokens (default: the model's context)")
    add("--numerics", choices=("fast", "batch_invariant"), default=_DEFAULTS.numerics,
        help="fast: plain XLA matmuls; batch_invariant: a row's tokens never depend on what shares its batch "
             "(exact greedy tokens across batching and chunking, at a throughput cost)")
    add("--attention-impl", choices=("auto", "kernel", "reference"), default=_DEFAULTS.attention_impl,
        help="the paged, sparse and MoE ops: the Pallas kernels or the jnp references (the XLA path); "
             "auto: kernels on a GPU, references on a CPU")
    add("--logprobs-mode", choices=("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"),
        default=_DEFAULTS.logprobs_mode,
        help="what log probabilities report (vLLM's names): the model's log probabilities or logits, before "
             "(raw) or after (processed) penalties, temperature and top-k/top-p")
    add("--quantization", default=None, metavar="SCHEME",
        choices=("fp8", "deepseek_v4_fp8", "mxfp8", "modelopt_mxfp8", "modelopt_fp4", "compressed-tensors"),
        help="the quantisation the HF checkpoint must declare, by vLLM's names (fp8, deepseek_v4_fp8, mxfp8, "
             "modelopt_mxfp8, modelopt_fp4, compressed-tensors; vLLM's short -q is --quiet here); default: "
             "the checkpoint's quantization_config. Quantised weights stay quantised on the devices")
    add("--seed", type=int, default=_DEFAULTS.seed,
        help="base seed of requests that set none (request i of this process draws with seed + i)")


def add_cache_flags(parser: argparse.ArgumentParser) -> None:
    cache = _group(parser, "Cache", "the device's KV pool and which pages it keeps")
    add = cache.add_argument
    add("--block-size", type=int, default=_DEFAULTS.block_size,
        help="tokens per KV hash block and attention page; a page group whose kind needs more (whole "
             "compressed entries, a kernel's page) takes a multiple of it")
    add("--num-kv-blocks", type=int, default=None,
        help="size the KV pool as this many pages of the shared layout (default: from --kv-cache-memory-gb)")
    add("--kv-cache-memory-gb", type=float, default=_DEFAULTS.kv_cache_memory_gb,
        help=f"device memory for the KV pool in {GIB} (each device's under TP, DCP and PCP), when --num-kv-blocks "
             "is not given")
    add("--kv-layout", choices=("auto", "pool", "shared"), default=_DEFAULTS.kv_layout,
        help="pool: one pool of bytes whose slabs each page group carves into pages sized to what it stores; "
             "shared: one page id spans a page of every KV kind; auto: the pool wherever the engine runs it")
    add("--kv-cache-dtype", choices=("auto", "fp8"), default=_DEFAULTS.kv_cache_dtype,
        help="fp8: store the attention KV (GQA/MHA K/V, MLA latents) as float8_e4m3fn with a float32 scale per "
             "token and KV head (about half the bytes of bfloat16), on the XLA attention path (the Pallas "
             "kernels and decode context parallelism refuse it); recurrent states, indexer keys and "
             "DeepSeek-V4's kinds keep their formats (DeepSeek-V4 refuses fp8). auto: the model's dtype")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.enable_prefix_caching,
        help="reuse the cached pages of earlier prompts with the same prefix (default: on)")
    add("--kv-policy", choices=("hints", "lru", "marconi"), default=_DEFAULTS.kv_policy,
        help="which cached pages leave the device first: hints (session pins from the agent hints, then the "
             "pages whose next turn is expected farthest away), lru, or marconi (reused and branch-point "
             "content kept longer)")
    add("--state-checkpoint-tokens", type=int, default=_DEFAULTS.state_checkpoint_tokens, metavar="TOKENS",
        help="tokens between saved recurrent states (Kimi's KDA), a multiple of --block-size; a prefix hit "
             "resumes from the last state at or before the shared prefix, the state a turn ended with, or a "
             "branch state (default: the model's cost-aware interval, where the prefix KV of an interval "
             "outweighs a state: 16,816 tokens for Kimi-K3)")


def add_offload_flags(parser: argparse.ArgumentParser) -> None:
    tiers = _group(parser, "KV offload", "tiers below the device that keep finished turns' pages "
                   "(each is off unless asked for; one that cannot start stops the engine at start)")
    add = tiers.add_argument
    add("--host-cache-gb", type=float, default=_DEFAULTS.host_cache_gb,
        help=f"host-memory tier: {GIB} of pinned host page slots (0: off)")
    add("--disk-cache-dir", default=None, metavar="DIR",
        help="disk tier: a directory of page files with a CRC-32 each, kept across restarts (default: off)")
    add("--disk-cache-gb", type=float, default=_DEFAULTS.disk_cache_gb,
        help=f"size cap of the disk tier in {GIB}; over it, the page files of lowest recompute cost per byte "
             "and recency go first")
    add("--mooncake-master", default=None, metavar="HOST:PORT",
        help="distributed tier: the Mooncake Store master to share pages through (default: off)")
    add("--mooncake-segment-gb", type=float, default=_DEFAULTS.mooncake_segment_gb,
        help=f"memory this engine lends to the Mooncake pool, in {GIB}")
    add("--kv-load-timeout-s", type=float, default=_DEFAULTS.kv_load_timeout_s, metavar="SECONDS",
        help="how long a KV load may wait on the disk or Mooncake tier without an answer before it is given "
             "up: those tokens are recomputed and the tier is out of use for 30 s")
    add("--kv-offload-retention", choices=("interval", "marconi"), default=_DEFAULTS.kv_offload_retention,
        help="which pages a finished turn stores in the tiers: interval (all of them) or marconi (the prefix "
             "a second turn shared, and branch points)")


def add_scheduler_flags(parser: argparse.ArgumentParser) -> None:
    scheduler = _group(parser, "Scheduler", "what one step runs")
    add = scheduler.add_argument
    add("--max-num-batched-tokens", type=int, default=_DEFAULTS.max_num_batched_tokens,
        help="token budget of one step (prefill chunks plus decodes)")
    add("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs, help="requests (rows) in one step")
    add("--long-prefill-token-threshold", type=int, default=_DEFAULTS.long_prefill_token_threshold,
        help="cap on one request's prefill tokens per step, so short turns overlap a long prefill "
             "(0: no cap; -1: the budget shared evenly among the requests that want tokens)")
    add("--prefill-schedule-interval", type=int, default=_DEFAULTS.prefill_schedule_interval,
        help="admit new requests only every Nth step (the steps between run decodes and continuations)")
    add("--no-trim-prefill-to-buckets", dest="trim_prefill_to_buckets", action="store_false",
        help="always run a step's whole prefill chunks, even when that pads far past a token bucket "
             "(default: trimmed)")
    add("--step-buckets", default=None, metavar="JSON",
        help='the sizes a step pads to, each shape one compiled executable, e.g. \'{"tokens": [256], "rows": [8]}\' '
             '(any of "tokens", "rows" and "pages"; past the largest a size doubles); fewer buckets compile '
             "less and pad more (default: agentjax/buckets.py's)")


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's parallel-layout flags (sharding/mesh.py) and the jax.distributed process flags."""
    parallel = _group(parser, "Parallel", "how the model is split over devices and processes")
    add = parallel.add_argument
    add("--tensor-parallel-size", "-tp", type=int, default=_DEFAULTS.tensor_parallel_size,
        help="TP ranks (query heads, MLP and expert columns)")
    add("--data-parallel-size", "-dp", type=int, default=_DEFAULTS.data_parallel_size,
        help="DP ranks, each with its own requests, stepping in lockstep")
    add("--enable-expert-parallel", action="store_true",
        help="shard whole experts over the DP x TP ranks (DEP with --data-parallel-size)")
    add("--decode-context-parallel-size", "-dcp", type=int, default=_DEFAULTS.decode_context_parallel_size,
        help="DCP ranks inside the TP group: KV interleaved token by token (divides --tensor-parallel-size)")
    add("--prefill-context-parallel-size", "-pcp", type=int, default=_DEFAULTS.prefill_context_parallel_size,
        help="PCP ranks: a step's tokens split DualChunkSwap-style, KV all-gathered")
    add("--coordinator-address", default=None, metavar="HOST:PORT",
        help="jax.distributed coordinator, to join several processes (default: one process)")
    add("--num-processes", type=int, default=_DEFAULTS.num_processes, help="processes in the jax.distributed run")
    add("--process-id", type=int, default=_DEFAULTS.process_id,
        help="this process's id (0 drives the engine; the others follow its steps)")


def add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    speculative = _group(parser, "Speculative decoding", "draft tokens verified in the same step")
    speculative.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help='vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; methods ngram, mtp and '
             "draft_model (default: off)")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Every engine flag, in vLLM's groups."""
    add_model_flags(parser)
    add_cache_flags(parser)
    add_offload_flags(parser)
    add_scheduler_flags(parser)
    add_parallel_flags(parser)
    add_speculative_flags(parser)


ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "extra")


def engine_args(args: argparse.Namespace) -> dict:
    """The `EngineConfig` keyword arguments the parsed flags give."""
    return {name: getattr(args, name) for name in ENGINE_FIELDS}
