"""transformers' side of `scripts/fuzz_parity.py`: the reference outputs of one checkpoint and prompt.

Runs in the transformers environment (never in the project's tests). `reference(model, prompt, n)` gives
the uncached prompt logits, the cached greedy `generate` (tokens, logits, top-1 margins) and the
uncached forward over the prompt and those tokens (its argmax at each step: transformers' second path).
For DeepSeek-V4 it also records every lightning-indexer call and reports the rows whose top-k boundary
falls on equal scores (`IndexerTies`); torch.topk breaks such ties by its selection algorithm and the
row's length, so `stable_indexer_topk()` reruns transformers with ties broken toward the lower entry
(agentjax's rule) to tell a tie from a bug.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

MIN_MARGIN = 2e-3  # transformers' top-1 margin below which a greedy token may flip on rounding


def top2_margins(logits: torch.Tensor) -> np.ndarray:
    """Top-1 minus top-2 logit per row (float32): how far a greedy token is from flipping."""
    top = torch.topk(logits, 2, dim=-1).values
    return (top[..., 0] - top[..., 1]).numpy().astype(np.float32)


class IndexerTies:
    """Records, over every call of every CSA indexer's scorer, the query rows whose top-k boundary
    falls on tied scores among the entries the row may see, as `(phase, position)`; the caller sets
    `phase` and `position_offset` (the position of the call's first row) before each forward."""

    def __init__(self, model):
        self.rows_with_ties: list[tuple[str, int]] = []
        self.phase, self.position_offset = "", 0
        self._handles = []
        for layer in getattr(model, "model", model).layers:
            compressor = getattr(layer.self_attn, "compressor", None)
            indexer = getattr(compressor, "indexer", None)
            if indexer is not None:
                self._handles.append(indexer.scorer.register_forward_hook(self._hook(indexer)))

    def _hook(self, indexer):
        def hook(module, args, scores):
            rows, rate, top_k = scores[0], indexer.compress_rate, indexer.index_topk  # rows: [S, T]
            for row in range(rows.shape[0]):
                position = self.position_offset + row
                visible = (position + 1) // rate
                if visible <= top_k:
                    continue
                ordered = torch.sort(rows[row, :visible], descending=True).values
                if ordered[top_k - 1] == ordered[top_k]:
                    self.rows_with_ties.append((self.phase, position))
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def greedy_generate(model, prompt: torch.Tensor, new_tokens: int):
    """transformers' cached greedy `generate` of exactly `new_tokens` tokens, logits kept. A config's
    bos/eos ids reach generate through the model's generation_config (a None in the one passed means
    "the model's"), so they are cleared there for the call: the reference never stops at an eos."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, use_cache=True)
    defaults = model.generation_config
    saved = {k: getattr(defaults, k, None) for k in ("eos_token_id", "bos_token_id", "pad_token_id")}
    for key in saved:
        setattr(defaults, key, None)
    try:
        # No pad token and an explicit all-ones mask: generate must not mistake a prompt token for padding.
        return model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], generation_config=config)
    finally:
        for key, value in saved.items():
            setattr(defaults, key, value)


@contextlib.contextmanager
def stable_indexer_topk():
    """DeepSeek-V4's indexer picks its top-k with ties broken toward the lower entry (a stable sort)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4

    original_forward, original_topk = dsv4.DeepseekV4Indexer.forward, torch.Tensor.topk

    def stable_topk(self, k, dim=-1, largest=True, sorted=True):
        index = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
        return torch.return_types.topk((self.gather(dim, index), index))

    def forward(self, *args, **kwargs):
        torch.Tensor.topk = stable_topk
        try:
            return original_forward(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = original_topk

    dsv4.DeepseekV4Indexer.forward = forward
    try:
        yield
    finally:
        dsv4.DeepseekV4Indexer.forward = original_forward


@torch.no_grad()
def reference(model, prompt: torch.Tensor, new_tokens: int, count_ties: bool = False) -> dict:
    """transformers' outputs for `prompt` (see the module docstring); `ties` lists the (call, position)
    rows with an indexer boundary tie when `count_ties`."""
    ties = IndexerTies(model) if count_ties else None
    length = prompt.numel()
    if ties is not None:
        ties.phase = "prompt"
    prompt_logits = model(input_ids=prompt[None], use_cache=False).logits[0].float()
    original, forwards = model.forward, []

    def counted(*args, **kwargs):  # generate's first forward is the prefill, then one token a forward
        if ties is not None:
            ties.phase, ties.position_offset = "cached", 0 if not forwards else length - 1 + len(forwards)
        forwards.append(1)
        return original(*args, **kwargs)

    model.forward = counted
    try:
        out = greedy_generate(model, prompt, new_tokens)
    finally:
        model.forward = original
    generated = out.sequences[0, length:]
    step_logits = torch.stack([s[0].float() for s in out.logits])
    if generated.numel() != new_tokens or not torch.equal(step_logits.argmax(-1), generated):
        raise RuntimeError("generate did not produce the greedy tokens of its own logits")
    if ties is not None:
        ties.phase, ties.position_offset = "uncached", 0
    teacher = torch.cat([prompt, generated[:-1]])
    uncached = model(input_ids=teacher[None], use_cache=False).logits[0, length - 1:].float()
    result = {
        "prompt_logits": prompt_logits.numpy(),
        "generated_ids": generated.numpy().astype(np.int64),
        "generated_logits": step_logits.numpy(),
        "margins": top2_margins(step_logits),
        "uncached_ids": uncached.argmax(-1).numpy().astype(np.int64),
        "uncached_max_abs_diff": float((uncached - step_logits).abs().max()),
    }
    if ties is not None:
        ties.remove()
        cached = {p - (length - 1) for phase, p in ties.rows_with_ties if phase == "cached" and p >= length - 1}
        result["tie_steps"] = sorted(cached)
        result["tie_rows"] = {phase: sum(1 for f, _ in ties.rows_with_ties if f == phase)
                              for phase in ("prompt", "cached", "uncached")}
    return result
