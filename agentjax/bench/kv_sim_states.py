"""Recurrent states in `agentjax bench kv-sim`: a hybrid model's prefix hit lands on a saved state.

A Kimi-style model hits a prefix only where its device holds the recurrent state after exactly that
prefix, and each state costs `state_tokens` tokens of prefix KV in memory (Kimi-K3 at full size: 16.8K).
`StateStore` keeps states at trace-block positions (named by the chained key of the block before them),
in LRU order, within `max_share` of the device memory; the attention pages get the rest. What is
saved per request, by `retention`:
  - "end": the state at the prompt's end (its last full block: the next turn's and a re-send's prefix);
  - "interval": that, and one every `interval_tokens` of the tokens the request computes;
  - "marconi": the end, and the state where the request's cached prefix ended when that prefix was
    seen before (a branch or a rewrite: the Marconi rule), which it passes as it prefills.
Host only: never sleeps; never imports jax but in `model_state_tokens`, which reads a preset's shapes.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from agentjax.errors import InvalidRequestError

STATE_RETENTIONS = ("end", "interval", "marconi")


@dataclass(frozen=True)
class StatePlan:
    """What the simulated device keeps of a recurrent-state model's states."""

    state_tokens: float  # one state's bytes, in tokens of the model's prefix KV
    retention: str = "interval"
    interval_tokens: int = 0  # "interval": tokens between saved states (a multiple of the trace block)
    max_share: float = 0.5  # the most of the device memory states may hold

    def __post_init__(self) -> None:
        if self.retention not in STATE_RETENTIONS:
            raise InvalidRequestError(f"state retention must be one of {STATE_RETENTIONS}, got {self.retention!r}")
        if not self.state_tokens > 0 or not 0 < self.max_share <= 1:
            raise InvalidRequestError(f"state_tokens={self.state_tokens} must be > 0 and max_share={self.max_share} "
                                      "in (0, 1]")
        if self.retention == "interval" and self.interval_tokens < 1:
            raise InvalidRequestError("the interval retention needs interval_tokens >= 1")

    def describe(self) -> dict:
        return {"state_tokens": self.state_tokens, "retention": self.retention,
                "interval_tokens": self.interval_tokens if self.retention == "interval" else None,
                "max_share": self.max_share}


class StateStore:
    """Saved states by the chained hash of the block before them, least recently used first."""

    def __init__(self, plan: StatePlan, hbm_tokens: int, block_tokens: int):
        self.plan = plan
        self.block_tokens = block_tokens
        self.capacity = int(plan.max_share * hbm_tokens // plan.state_tokens)
        self.interval_blocks = max(1, plan.interval_tokens // block_tokens) if plan.retention == "interval" else 0
        self._states: OrderedDict[bytes, None] = OrderedDict()
        self.saved = self.evictions = 0
        self.peak = 0

    @property
    def used_tokens(self) -> float:
        """Device memory the states hold, in tokens of prefix KV."""
        return len(self._states) * self.plan.state_tokens

    def hit(self, keys: list[bytes], attention_blocks: int) -> int:
        """The longest prefix, at most `attention_blocks` blocks, whose state is saved (0: start over)."""
        states = self._states
        for blocks in range(attention_blocks, 0, -1):
            key = keys[blocks - 1]
            if key in states:
                states.move_to_end(key)
                return blocks
        return 0

    def save(self, keys: list[bytes], hit: int, attention_blocks: int) -> None:
        """The states a request of `len(keys)` blocks that resumed at `hit` leaves, then evict to capacity."""
        end = len(keys)
        positions = [end]
        if self.interval_blocks:
            first = (hit // self.interval_blocks + 1) * self.interval_blocks
            positions += range(first, end, self.interval_blocks)
        if self.plan.retention == "marconi" and hit < attention_blocks < end:
            positions.append(attention_blocks)  # a prefix seen before: the branch point
        states = self._states
        for blocks in sorted(set(positions)):
            if blocks > 0:
                key = keys[blocks - 1]
                if key not in states:
                    self.saved += 1
                states[key] = None
                states.move_to_end(key)
        while len(states) > self.capacity:
            states.popitem(last=False)
            self.evictions += 1
        self.peak = max(self.peak, len(states))

    def summary(self, hbm_tokens: int) -> dict:
        return {**self.plan.describe(), "states_saved": self.saved, "state_evictions": self.evictions,
                "capacity_states": self.capacity, "peak_state_share": self.peak * self.plan.state_tokens / hbm_tokens,
                "final_state_share": self.used_tokens / hbm_tokens}


def model_state_tokens(preset: str, block_size: int = 16) -> tuple[float, int]:
    """(one state in tokens of prefix KV, the engine's default interval) of a preset at full size
    (abstract shapes)."""
    from agentjax.kv.cache_layout import cost_aware_checkpoint_tokens, kv_tensors
    from agentjax.models import preset_config

    cfg = preset_config(preset, abstract=True)
    tensors = kv_tensors(cfg)
    state = sum(t.spec.state_bytes for t in tensors if t.spec.hit_rule == "checkpoint")
    if not state:
        raise InvalidRequestError(f"model {preset!r} keeps no recurrent state")
    sample = 1024 * block_size
    per_token = sum(t.spec.bytes_for_tokens(sample) for t in tensors if t.spec.hit_rule == "prefix") / sample
    return state / per_token, cost_aware_checkpoint_tokens(cfg, block_size)
