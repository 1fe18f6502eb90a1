"""The prompts of `scripts/bench_generate.py` (its decode batch, long prefill prompt and batch-vs-alone
prompts, as token ids) and the batch-vs-alone comparison of greedy tokens. No timing here.
"""
from __future__ import annotations

import argparse

# Sixteen short instructions for the throughput batches (one each; batch 1 uses the first).
REQUESTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table handles collisions, with an example.",
    "List five things to check before deploying a web service to production.",
    "What causes the seasons on Earth? Answer for a ten-year-old.",
    "Describe the water cycle in a few sentences.",
    "Give me a recipe for a simple vegetable soup.",
    "Summarise the plot of a detective novel you would like to read.",
    "How does a binary search work, and when does it fail?",
    "Write a polite email asking a colleague to review a pull request.",
    "Why do programmers write unit tests? Give three reasons.",
    "Describe a quiet morning in a small mountain village.",
    "What is the difference between a process and a thread?",
    "Suggest a plan for learning to play the guitar in three months.",
    "Explain what a compiler does, step by step.",
    "Write a haiku about autumn rain and then explain it.",
    "How do bees make honey? Keep it short.",
]

# Filler for long prompts: a plain-English paragraph, repeated and cut to length.
CONTEXT = (
    "The old harbour town woke slowly. Fishing boats came in with the tide, gulls circled the market, "
    "and the baker opened his shutters while the streets were still wet from the night rain. Children "
    "ran past the church on their way to school, and the ferry to the island sounded its horn twice. "
    "In the library on the hill, a retired engineer was sorting notes about the bridge he had built "
    "forty years earlier: load tables, sketches of the foundations, letters from the council, and a "
    "photograph of the opening day. He wanted to write down what had gone right, what had nearly gone "
    "wrong, and what he would do differently if he were young again and the river were still wild. "
)

DIVERGENCE_LENGTHS = [3, 9, 14, 22, 31, 40, 52, 63, 77, 90, 108, 126, 149, 173, 201, 236]


def build_prompts(tokenizer, args: argparse.Namespace) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Token ids: the decode batch, the long prefill prompt, and the divergence prompts."""
    requests = [tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)
                for text in REQUESTS]
    decode = [requests[i % len(requests)] for i in range(args.batch)]
    context = tokenizer.encode(CONTEXT)
    repeats = -(-max(args.prefill_tokens, max(DIVERGENCE_LENGTHS) + len(context)) // len(context)) + 1
    stream = context * repeats
    long_prompt = stream[: args.prefill_tokens]
    divergence = []
    for i, length in enumerate(DIVERGENCE_LENGTHS):
        offset = (i * 37) % len(context)
        divergence.append(stream[offset : offset + length] + requests[i % len(requests)])
    return decode, long_prompt, divergence


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(batch: list[list[int]], alone: list[list[int]]) -> dict:
    firsts = [first_difference(x, y) for x, y in zip(batch, alone)]
    differ = [(i, p) for i, p in enumerate(firsts) if p is not None]
    return {"differ": len(differ), "of": len(batch), "first_positions": differ}


def divergence(llm, prompts: list[list[int]], new_tokens: int) -> dict:
    from agentjax import SamplingParams

    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    batch = [o.token_ids for o in llm.generate(prompts, sp)]
    alone = [llm.generate([p], sp)[0].token_ids for p in prompts]
    return compare(batch, alone)
