"""Benchmark: how far an FP8 KV cache (`kv_cache_dtype="fp8"`) moves a model's outputs from the float KV cache.

Over held prompts, in batch-invariant numerics with the same weights:
- greedy token agreement: each prompt's `--new-tokens` greedy tokens through the engine (all prompts
  batched) with float KV and with FP8 KV: how many continuations are identical, the mean share of
  tokens before the first difference, and the first-token agreement;
- logit error: the float run's prompt + continuation scored in one prefill step with every position's
  logits (the queries attend over the K/V the step just wrote: FP8 rows or float rows); the largest
  absolute difference of any logit, with the largest absolute logit beside it for scale, and how often
  the argmax differs.

The held prompts are synthetic and seeded (documented, not a data set): `--prompts` chat turns built from
fixed word lists by `random.Random(--seed)`, each a question about two topics with a few clauses of
context, through the model's chat template. These are accuracy figures, not timings: the machine's
load does not change them. Writes the "## FP8 KV cache accuracy" section of BENCHMARKS.md:

    python scripts/bench_fp8_kv.py                          # SmolLM2-135M, 100 prompts
    python scripts/bench_fp8_kv.py --model preset:tiny-dense --no-write
"""
from __future__ import annotations

import argparse
import datetime
import platform
import random
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SECTION = "## FP8 KV cache accuracy"
TOPICS = ("tides", "bread", "jazz", "glaciers", "compilers", "bees", "trains", "maps", "tea", "volcanoes",
          "chess", "rivers", "satellites", "mushrooms", "typography", "bridges", "owls", "databases",
          "violins", "deserts")
ASKS = ("Explain how {a} relate to {b}.", "Write a short story about {a} and {b}.",
        "Compare {a} with {b} in three sentences.", "What would a child ask about {a} and {b}?",
        "List facts about {a}, then connect them to {b}.")
CLAUSES = ("Keep it simple.", "Use an example.", "Mention a number.", "Be precise.", "Avoid jargon.",
           "Start with a question.", "End with a summary.", "Think step by step.")


def held_prompts(tokenizer, count: int, seed: int, vocab: int) -> list[list[int]]:
    """`count` seeded prompts: chat turns through the tokenizer, or token ids when the model has none."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        a, b = rng.sample(TOPICS, 2)
        text = " ".join([rng.choice(ASKS).format(a=a, b=b), *rng.sample(CLAUSES, rng.randint(1, 4))])
        if tokenizer is not None:
            prompts.append(tokenizer.encode_chat([{"role": "user", "content": text}]))
        else:
            prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(20, 80))])
    return prompts


def greedy(cfg, params, prompts, kv_cache_dtype: str, new_tokens: int, block: int) -> list[list[int]]:
    from agentjax import SamplingParams
    from agentjax.config import EngineConfig
    from agentjax.engine import Engine

    longest = max(len(p) for p in prompts) + new_tokens
    settings = EngineConfig(numerics="batch_invariant", block_size=block, kv_cache_dtype=kv_cache_dtype,
                            num_kv_blocks=len(prompts) * (-(-longest // block) + 1) + 8, max_num_seqs=len(prompts),
                            max_num_batched_tokens=2048, enable_prefix_caching=False)
    engine = Engine(cfg, params, settings)
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, sampling) for p in prompts]
    tokens = {i: [] for i in ids}
    for output in engine.run_until_done():
        tokens[output.request_id].extend(output.new_token_ids)
    return [tokens[i] for i in ids]


def logit_errors(cfg, params, sequences, block: int, group: int = 8) -> tuple[list[float], int, float]:
    """Every position's logits of each sequence with float KV and with FP8 KV, `group` sequences per
    prefill step, compared as they come (all positions' logits of 100 prompts would take gigabytes):
    (max abs error per sequence, positions whose argmax differs, largest abs float logit)."""
    from agentjax.ragged_batch import RaggedBatch
    from agentjax.runner.step import make_step

    fp8_cfg = cfg.replace(kv_cache_dtype="fp8")
    steps = {c: make_step(c, "batch_invariant", all_positions=True) for c in (cfg, fp8_cfg)}
    errors, flips, largest = [], 0, 0.0
    for start in range(0, len(sequences), group):
        part = sequences[start:start + group]
        pages = 2 + sum(-(-len(s) // block) for s in part)
        batch = RaggedBatch.from_prompts(part, block)
        exact, fp8 = (np.asarray(steps[c](params, c.new_kv_pages(pages, block), batch)[0], np.float32)
                      for c in (cfg, fp8_cfg))
        offset = 0
        for sequence in part:
            a, b = exact[offset:offset + len(sequence)], fp8[offset:offset + len(sequence)]
            errors.append(float(np.abs(a - b).max()))
            flips += int((a.argmax(-1) != b.argmax(-1)).sum())
            largest = max(largest, float(np.abs(a).max()))
            offset += len(sequence)
    return errors, flips, largest


def measure(model: str, count: int, new_tokens: int, seed: int) -> dict:
    from agentjax.kv.cache_layout import page_tokens_multiple, required_page_tokens
    from agentjax.models import load_model

    cfg, params, tokenizer = load_model(model)
    cfg = cfg.replace(attention_impl="reference")
    block = required_page_tokens(cfg) or max(16, page_tokens_multiple(cfg))
    prompts = held_prompts(tokenizer, count, seed, cfg.vocab_size)
    exact = greedy(cfg, params, prompts, "auto", new_tokens, block)
    fp8 = greedy(cfg, params, prompts, "fp8", new_tokens, block)
    same_prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), new_tokens) for x, y in zip(exact, fp8)]
    sequences = [p + t for p, t in zip(prompts, exact)]
    errors, flips, largest = logit_errors(cfg, params, sequences, block)
    positions = sum(len(s) for s in sequences)
    lengths = [len(p) for p in prompts]
    return dict(model=model, prompts=count, new_tokens=new_tokens, seed=seed,
                prompt_tokens=(min(lengths), int(np.median(lengths)), max(lengths)),
                identical=sum(a == b for a, b in zip(exact, fp8)),
                agreement=float(np.mean(same_prefix)) / new_tokens,
                first_token=sum(a[0] == b[0] for a, b in zip(exact, fp8)) / count,
                max_logit_error=float(max(errors)), median_logit_error=float(np.median(errors)),
                max_abs_logit=largest,
                argmax_flips=flips, positions=positions)


def section(result: dict, command: str) -> str:
    r = result
    machine = f"{platform.machine()}, {platform.system()} (CPU, float32 model and KV words)"
    low, mid, high = r["prompt_tokens"]
    return "\n".join([
        SECTION, "",
        f"`{command}` on {datetime.date.today().isoformat()}; {machine}. `{r['model']}` in batch-invariant numerics, "
        f"{r['prompts']} seeded synthetic chat prompts (seed {r['seed']}, {low}/{mid}/{high} tokens min/median/max), "
        f"{r['new_tokens']} greedy tokens each, all prompts batched; FP8 KV = float8_e4m3fn K/V rows with a float32 "
        "scale per token and KV head, against the float32 KV cache. Accuracy figures (the load does not change them).",
        "",
        "| metric | value |", "|---|---|",
        f"| identical greedy continuations | {r['identical']} / {r['prompts']} |",
        f"| mean share of tokens before the first difference | {r['agreement']:.3f} |",
        f"| first-token agreement | {r['first_token']:.3f} |",
        f"| max abs logit error (every position of prompt + float continuation) | {r['max_logit_error']:.4f} "
        f"(largest abs logit {r['max_abs_logit']:.2f}) |",
        f"| median over prompts of the per-prompt max abs logit error | {r['median_logit_error']:.4f} |",
        f"| positions whose argmax differs | {r['argmax_flips']} / {r['positions']} |",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model spec (default: SmolLM2-135M)")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print the section without writing BENCHMARKS.md")
    args = parser.parse_args()
    result = measure(args.model, args.prompts, args.new_tokens, args.seed)
    command = "python scripts/bench_fp8_kv.py" + "".join(
        f" {flag} {value}" for flag, value, default in (("--model", args.model, "smollm2-135m-instruct"),
                                                       ("--prompts", args.prompts, 100),
                                                       ("--new-tokens", args.new_tokens, 32),
                                                       ("--seed", args.seed, 0)) if value != default)
    body = section(result, command)
    print(body)
    if not args.no_write:
        sys.path.insert(0, str(REPO / "scripts"))
        from benchmarks_md import write_section

        write_section(body)


if __name__ == "__main__":
    main()
