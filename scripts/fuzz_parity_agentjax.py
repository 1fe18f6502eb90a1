"""agentjax's side of `scripts/fuzz_parity.py`: runs in the project's environment, one checkpoint a request.

fuzz_parity.py (in the transformers environment) starts this script once and speaks one JSON object a
line on its stdin/stdout:

    {"op": "run", "model": DIR, "prompt": [ids], "new_tokens": N, "chunk": C, "score": [[ids], ...]}
        -> {"ok": true, "block_size": B, "alone": [ids], "chunked": [ids], "scored": "DIR/agentjax_logits.npz"}
        -> {"ok": false, "kind": "rejected" | "error", "error": "..."}
    {"op": "quit"}

For each checkpoint it loads the directory (a loader refusal is "rejected": agentjax does not take that
config), then runs greedy decoding in "batch_invariant" numerics twice through the engine, the prompt
alone in one prefill and in prefill chunks of C tokens (prefix caching off), and computes the logits of
every position of each `score` sequence in one prefill step (written as `logits_<i>` to the npz). The
page size is what the model needs: a multiple of DeepSeek-V4's compression rates, MiniMax-M3's 128.
It never imports torch.
"""
from __future__ import annotations

import gc
import json
import math
import os
import sys
import traceback
from pathlib import Path

import numpy as np


def page_size(cfg) -> int:
    from agentjax.kv.cache_layout import page_tokens_multiple, required_page_tokens

    return required_page_tokens(cfg) or math.lcm(16, page_tokens_multiple(cfg))


def greedy(cfg, params, prompt: list[int], new_tokens: int, block: int, chunk: int) -> list[int]:
    from agentjax import SamplingParams
    from agentjax.config import EngineConfig
    from agentjax.engine import Engine

    pages = 8 + 2 * math.ceil((len(prompt) + new_tokens) / block)
    settings = EngineConfig(numerics="batch_invariant", block_size=block, num_kv_blocks=pages * 4,
                            enable_prefix_caching=False, long_prefill_token_threshold=chunk,
                            max_num_batched_tokens=max(2048, len(prompt) + 16))
    engine = Engine(cfg, params, settings)
    engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    for out in engine.run_until_done():
        tokens.extend(out.new_token_ids)
    if chunk and max((n for record in engine.step_log for _, n, prefill in record.rows if prefill), default=0) > chunk:
        raise RuntimeError(f"a prefill chunk exceeded {chunk} tokens")
    return tokens


def all_logits(cfg, params, ids: list[int], block: int) -> np.ndarray:
    from agentjax.ragged_batch import RaggedBatch
    from agentjax.runner.step import make_step

    step = make_step(cfg, "batch_invariant", all_positions=True)
    kv = cfg.new_kv_pages(2 + len(ids) // block + 1, block)
    logits, _ = step(params, kv, RaggedBatch.from_prompts([ids], block))
    return np.asarray(logits, dtype=np.float32)[: len(ids)]


def run(request: dict) -> dict:
    from agentjax.errors import AgentjaxError
    from agentjax.models import load_model

    try:
        cfg, params, _ = load_model(request["model"])
    except AgentjaxError as err:
        return {"ok": False, "kind": "rejected", "error": f"{type(err).__name__}: {err}"}
    block = page_size(cfg)
    prompt, new_tokens = request["prompt"], int(request["new_tokens"])
    alone = greedy(cfg, params, prompt, new_tokens, block, 0)
    chunked = greedy(cfg, params, prompt, new_tokens, block, int(request["chunk"]))
    scored = Path(request["model"]) / "agentjax_logits.npz"
    np.savez(scored, **{f"logits_{i}": all_logits(cfg, params, ids, block) for i, ids in enumerate(request["score"])})
    return {"ok": True, "block_size": block, "alone": alone, "chunked": chunked, "scored": str(scored)}


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything agentjax or jax prints goes to stderr, never into the protocol
    sys.stdout = sys.stderr
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        try:
            reply = run(request)
        except Exception as err:  # noqa: BLE001 - any failure is a finding, reported, and the worker goes on
            reply = {"ok": False, "kind": "error", "error": f"{type(err).__name__}: {err}",
                     "traceback": traceback.format_exc()[-4000:]}
        replies.write(json.dumps(reply) + "\n")
        forget_compiled()


def forget_compiled() -> None:
    """Drop jax's compiled programs after each checkpoint: every config compiles its own, and keeping
    them all grew the process by about 90 MB a minute."""
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()


if __name__ == "__main__":
    main()
