"""Benchmark: how many tokens of long sessions a fixed KV memory holds, against what the model must store.

For each model, long sessions (30K-32K-token prompts, then decoding) are added to an engine with a fixed
`kv_cache_memory_gb` until the scheduler first preempts. Then every session's tokens are looked up in
the prefix cache: the hittable tokens (what a re-send would find cached) per GB, against the ideal (the
memory over the bytes the model must store for those sessions: every KV tensor, windows limited to
their window, one state per request). A single prompt whose stored bytes are 0.85 of the memory is
admitted and run. Full-size presets (abstract shapes) get their tokens per GB from the engine's
accounting. Capacity is KV bookkeeping: the engine runs its real scheduler and KV manager over a
runner that returns a fixed token without computing, so the figures do not depend on the machine's load.

`--base-repo` runs the same measurements in another checkout (a subprocess whose imports come from
there) and writes both rows per model, "before" (that checkout) and "after" (this one), to the
"## KV memory capacity" section of BENCHMARKS.md:

    python scripts/bench_kv_capacity.py --base-repo ../i34-base
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTION = "## KV memory capacity"
# (label, model spec, session prompt tokens, kv_cache_memory_gb): about eight sessions' worth of memory each
MODELS = (
    ("SmolLM2-135M", "embedded:smollm2-135m-instruct", 30_000, 12.0),
    ("Gemma-3-270M", "embedded:gemma3-270m", 32_768, 1.5),
    ("tiny-minimax-m3", "preset:tiny-minimax-m3", 30_000, 0.5),
    ("tiny-kimi-k3", "preset:tiny-kimi-k3", 30_000, 0.02),
    ("tiny-dsv4", "preset:tiny-dsv4", 30_000, 0.1),
)
FULL_SIZE = ("minimax-m3", "kimi-k3", "deepseek-v4-pro")
FULL_SIZE_CONTEXTS = (32_768, 131_072)
FIXED_TOKEN = 7


class HostOnlyRunner:
    """The engine's runner for capacity runs: rows in, one fixed token per sampled position out."""

    def __init__(self, page_size: int = 16):
        self.compiled_shapes: set = set()
        self.last_device_s = 0.0
        self.page_size = page_size
        self.drafter = None

    def execute(self, rows, sampling, token_bitmask=None, kv_copies=(), sample_counts=None, next_tokens=None):
        import numpy as np

        return np.full(sum(sample_counts) if sample_counts else len(rows), FIXED_TOKEN, dtype=np.int64)


def model_config(spec: str):
    """A model's config without its weights (an embedded GGUF's metadata, or a preset)."""
    if spec.startswith("embedded:"):
        from checkpoints.embedded import embedded_model_path
        from checkpoints.gguf import config_from_metadata, metadata, open_gguf

        name = spec.removeprefix("embedded:")
        reader = open_gguf(embedded_model_path(name))
        embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab = int(max(embedding.shape))  # GGUF lists dims innermost first; the vocabulary is the larger
        return config_from_metadata(metadata(reader), name=name).replace(vocab_size=vocab)
    from agentjax.models import preset_config

    return preset_config(spec.removeprefix("preset:"))


def ideal_bytes(cfg, context: int) -> float:
    """Bytes one request of `context` tokens must store: every KV tensor's bytes for its tokens (windows:
    their last `window` tokens), one state per state tensor."""
    from agentjax.kv.cache_layout import kv_tensors

    total = 0
    for tensor in kv_tensors(cfg):
        spec = tensor.spec
        if spec.hit_rule == "checkpoint":
            total += spec.state_bytes
        else:
            total += spec.bytes_for_tokens(context if spec.window is None else min(context, spec.window))
    return float(total)


def _engine(cfg, memory_gb: float, max_len: int):
    from agentjax.config import EngineConfig
    from agentjax.engine import Engine

    engine_cfg = EngineConfig(kv_cache_memory_gb=memory_gb, max_model_len=max_len, max_num_batched_tokens=2048)
    return Engine(cfg, None, engine_cfg, runner=HostOnlyRunner(engine_cfg.block_size))


def sessions_until_preemption(cfg, context: int, memory_gb: float) -> dict:
    """Long sessions until the first preemption: tokens held, hittable tokens and the ideal."""
    import random

    from agentjax.sampling_params import SamplingParams

    from agentjax.errors import OutOfPagesError

    per_session = ideal_bytes(cfg, context)
    count = int(memory_gb * 2**30 // per_session) + 3
    engine = _engine(cfg, memory_gb, 2 * context)
    rng = random.Random(0)
    # decoding an eighth more per session fills what the admitted prompts leave before the first preemption
    sampling = SamplingParams(max_tokens=context // 8, temperature=0.0, ignore_eos=True)
    requests, refused = {}, 0
    for _ in range(count):
        try:
            request_id = engine.add_request([rng.randrange(10, cfg.vocab_size) for _ in range(context)], sampling)
        except OutOfPagesError:  # one session alone does not fit this pool
            refused += 1
            continue
        requests[request_id] = engine.requests[request_id]
    steps = 0
    while engine.scheduler.num_preemptions == 0 and engine.has_unfinished():
        engine.step()
        steps += 1
    held = [r for r in requests.values() if r.num_computed_tokens > 0 or r.output_token_ids]
    hittable = contexts = 0
    ideal = 0.0
    for request in requests.values():
        tokens = request.prompt_token_ids + request.output_token_ids
        hit = engine.kv.lookup(tokens, request.cache_salt)
        if hit:
            hittable += hit
            contexts += len(tokens)
            ideal += ideal_bytes(cfg, len(tokens))
    if not ideal:  # nothing held: the ideal of full sessions
        contexts, ideal = context, per_session
    ideal_per_gb = contexts * 2**30 / ideal
    stats = engine.stats()
    return {"memory_gb": memory_gb, "context": context, "sessions": count, "refused": refused, "steps": steps,
            "sessions_held": len(held), "hittable_tokens": hittable,
            "hittable_per_gb": hittable / memory_gb, "ideal_per_gb": ideal_per_gb,
            "ratio": hittable / memory_gb / ideal_per_gb if ideal_per_gb else 0.0,
            "preempted": engine.scheduler.num_preemptions > 0,
            "layout": stats.get("kv_layout", "shared"), "groups": stats.get("kv_groups", [])}


def single_prompt(cfg, memory_gb: float, share: float = 0.85) -> dict:
    """One prompt whose stored bytes are `share` of the memory: admitted and run to its first tokens?"""
    from agentjax.errors import AgentjaxError
    from agentjax.sampling_params import SamplingParams

    per_token = (ideal_bytes(cfg, (1 << 20) + (1 << 16)) - ideal_bytes(cfg, 1 << 20)) / (1 << 16)
    fixed = ideal_bytes(cfg, 1 << 20) - per_token * (1 << 20)  # windows and states
    tokens = int((share * memory_gb * 2**30 - fixed) // per_token)
    engine = _engine(cfg, memory_gb, tokens + 64)
    try:
        request_id = engine.add_request([11 + i % 97 for i in range(tokens)],
                                        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        outputs = [o for o in engine.run_until_done() if o.request_id == request_id]
        ran = bool(outputs) and outputs[-1].finished and outputs[-1].finish_reason == "length"
        error = None
    except AgentjaxError as failure:
        ran, error = False, f"{type(failure).__name__}: {failure}"
    return {"prompt_tokens": tokens, "ran": ran, "error": error}


def full_size_rows() -> list[dict]:
    """Tokens per GB of the full-size presets (abstract shapes, KV in the model's dtype) by the engine's
    accounting, against the ideal, at each context of FULL_SIZE_CONTEXTS."""
    import dataclasses

    from agentjax.models import preset_config

    rows = []
    for name in FULL_SIZE:
        cfg = preset_config(name, abstract=True)
        if cfg.compressed_attention is not None:  # the KV format the engine runs: the model's dtype
            cfg = cfg.replace(compressed_attention=dataclasses.replace(cfg.compressed_attention,
                                                                       kv_format="model_dtype"))
        for context in FULL_SIZE_CONTEXTS:
            engine_bytes, layout = _engine_bytes_per_request(cfg, context)
            ideal = ideal_bytes(cfg, context)
            rows.append({"model": name, "context": context, "dtype": cfg.dtype, "layout": layout,
                         "tokens_per_gb": context * 2**30 / engine_bytes, "ideal_per_gb": context * 2**30 / ideal})
    return rows


def _engine_bytes_per_request(cfg, context: int) -> tuple[float, str]:
    """Device bytes the engine reserves for one request of `context` tokens: its layout's accounting, or
    in a checkout without one, pages per group times the bytes behind each page id."""
    try:
        from agentjax.config import EngineConfig
        from agentjax.engine_kv import engine_kv_layout
    except ImportError:
        from agentjax.kv import KVCacheManager
        from agentjax.kv.cache_layout import page_tokens_multiple, required_page_tokens

        block = required_page_tokens(cfg) or max(16, page_tokens_multiple(cfg))
        manager = KVCacheManager.from_model_config(cfg, 2, block)
        return manager.max_pages_for(context, 0) * cfg.kv_bytes_per_page(block), "shared"
    layout = engine_kv_layout(cfg, EngineConfig(kv_cache_memory_gb=100.0))
    return layout.bytes_per_request(context), layout.mode


def measure() -> dict:
    results = {"models": {}, "full_size": full_size_rows()}
    for label, spec, context, memory_gb in MODELS:
        cfg = model_config(spec)
        print(f"{label}: sessions of {context} tokens in {memory_gb} GB", file=sys.stderr, flush=True)
        results["models"][label] = {"sessions": sessions_until_preemption(cfg, context, memory_gb),
                                    "single": single_prompt(cfg, memory_gb), "dtype": cfg.dtype}
    return results


def markdown(after: dict, before: dict | None, command: str) -> str:
    from base_checkout import before_then_after

    lines = [SECTION, "", f"Command: `{command}`. Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
             f"{platform.python_version()}, run on {datetime.date.today().isoformat()}. Capacity is KV bookkeeping "
             "(the real scheduler and KV manager; the runner returns a fixed token without computing), so the "
             "figures do not depend on the machine's load.", "",
             "Long sessions (a prompt, then an eighth as many tokens decoded) fill a fixed `kv_cache_memory_gb` "
             "until the scheduler first "
             "preempts. *Hittable*: the tokens of every session a re-send would find in the prefix cache then, per "
             "GB; *ideal*: the memory over what the model must store for those sessions (every KV tensor, "
             "windows limited to their window, one state per request). *0.85 prompt*: one prompt whose stored "
             "bytes are 0.85 of the memory, admitted and run. KV in float32 (the CPU dtype)."
             + (f" *before*: the same measurements on the code at {before['commit']} (`--base-repo`); *after*: "
                "this checkout." if before else ""), "",
             "| model | code | layout | memory GB | session tokens | sessions held | measured at | hittable tokens/GB "
             "| ideal tokens/GB | hittable / ideal | 0.85 prompt |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, code, model in before_then_after(before, after, "models"):
        s, single = model["sessions"], model["single"]
        ran = "runs" if single["ran"] else f"refused ({single['error'] or 'not finished'})"
        held = f"{s['sessions_held']}" if not s.get("refused") else \
            f"{s['sessions_held']} ({s['refused']} refused: one alone does not fit)"
        when = "first preemption" if s["preempted"] else "all finished (no preemption)"
        lines.append(f"| {label} | {code} | {s['layout']} | {s['memory_gb']} | {s['context']:,} | "
                     f"{held} | {when} | {s['hittable_per_gb']:,.0f} | {s['ideal_per_gb']:,.0f} | "
                     f"**{s['ratio']:.3f}** | {single['prompt_tokens']:,} tokens: {ran} |")
    lines += ["", "Full-size presets (abstract shapes; KV in the model's dtype, the format the engine runs today: "
              "DeepSeek-V4's fp8_ds_mla rows are sized in plans only), one request of the stated context, by the "
              "engine's accounting (its pages, with their share of the layout's padding):", "",
              "| model | KV dtype | context | code | layout | tokens/GB | ideal tokens/GB | engine / ideal |",
              "|---|---|---|---|---|---|---|---|"]
    for _, code, r in before_then_after(before, after, "full_size"):
        lines.append(f"| {r['model']} | {r['dtype']} | {r['context']:,} | {code} | {r['layout']} | "
                     f"{r['tokens_per_gb']:,.0f} | {r['ideal_per_gb']:,.0f} | "
                     f"**{r['tokens_per_gb'] / r['ideal_per_gb']:.3f}** |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO / "scripts"))
    import base_checkout
    from benchmarks_md import publish

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base_checkout.add_arguments(parser, REPO / "BENCHMARKS.md")
    args = parser.parse_args(argv)
    before, after = base_checkout.before_and_after(args, __file__, measure)
    if after is None:
        return 0
    command = "python scripts/bench_kv_capacity.py" + (" --base-repo ../i34-base" if before else "")
    publish(markdown(after, before, command), not args.no_write, args.benchmarks_md)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or str(REPO))
    raise SystemExit(main())
