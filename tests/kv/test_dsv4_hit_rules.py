"""DeepSeek-V4's KV tensors in the hybrid cache (agentjax/kv/cache_layout.py, specs.py, groups.py):
which tensors each layer kind stores, their device pages, the fp8_ds_mla sizing of the full-size model,
and the hit rules: compressed entries and indexer keys are hit in whole entries, the sliding window
and the compressors' rolling inputs only need the pages of their last window."""
from __future__ import annotations

import math

import pytest

from agentjax.config import CompressedAttentionConfig, ModelConfig
from agentjax.errors import InvalidRequestError
from agentjax.kv import KVCacheManager, block_hashes
from agentjax.kv.cache_layout import kv_buffer_specs, kv_slots, kv_tensors
from agentjax.kv.specs import plan_groups


def dsv4_config(layer_types=("swa_mqa", "csa", "hca", "csa"), *, csa_rate=4, hca_rate=8, window=8, head_dim=16,
                index_head_dim=8, kv_format="model_dtype", dtype="float32") -> ModelConfig:
    return ModelConfig(
        architecture="deepseek_v4", vocab_size=64, hidden_size=32, intermediate_size=32,
        num_layers=len(layer_types), num_heads=2, num_kv_heads=1, head_dim=head_dim, max_position_embeddings=1 << 20,
        rotary_dim=8, sliding_window=window, layer_types=tuple(layer_types), mlp_layer_types=("dense",) * len(layer_types),
        compressed_attention=CompressedAttentionConfig(
            q_lora_rank=16, o_lora_rank=8, o_groups=2, csa_rate=csa_rate, hca_rate=hca_rate, index_num_heads=2,
            index_head_dim=index_head_dim, index_topk=4, kv_format=kv_format),
        dtype=dtype, name="dsv4-kv")


def test_each_layer_kind_stores_its_window_entries_indexer_keys_and_rolling_inputs():
    cfg = dsv4_config()
    roles = [(t.layer, t.role) for t in kv_tensors(cfg)]
    assert roles == [(0, "window"),
                     (1, "window"), (1, "entries"), (1, "kv_state"), (1, "index_entries"), (1, "index_state"),
                     (2, "window"), (2, "entries"), (2, "kv_state"),
                     (3, "window"), (3, "entries"), (3, "kv_state"), (3, "index_entries"), (3, "index_state")]
    specs = {(t.layer, t.role): t.spec for t in kv_tensors(cfg)}
    assert [specs[(1, r)].hit_rule for r in ("window", "entries", "kv_state", "index_entries", "index_state")] == [
        "window", "prefix", "window", "prefix", "window"]
    assert specs[(1, "entries")].tokens_per_entry == 4 and specs[(2, "entries")].tokens_per_entry == 8
    # the compressors keep their inputs over the span an entry pools: 2 blocks for csa, 1 for hca
    assert specs[(1, "kv_state")].window == 8 and specs[(2, "kv_state")].window == 8
    assert specs[(1, "index_state")].window == 8 and specs[(0, "window")].window == 8
    slots = kv_slots(cfg)
    assert slots[(1, "window")][0] == slots[(3, "window")][0] == slots[(0, "window")][0]
    assert slots[(1, "entries")][0] == slots[(3, "entries")][0] != slots[(2, "entries")][0]


def test_device_pages_hold_rows_per_token_and_entries_per_rate():
    cfg = dsv4_config()
    shapes = {(b.kind, b.page_shape, b.dtype, b.num_slots) for b in kv_buffer_specs(cfg, 16)}
    assert shapes == {("sliding_latent", (16, 16), "float32", 4), ("compressed_latent", (4, 16), "float32", 2),
                      ("compressed_latent", (2, 16), "float32", 1), ("indexer_keys", (4, 8), "float32", 2),
                      # csa kv inputs [kv|gate] of 2 series x 16, csa indexer inputs 2 x 2 x 8, hca inputs 2 x 16:
                      # the last two have equal specs, so they share a group
                      ("rolling_state", (16, 64), "float32", 2), ("rolling_state", (16, 32), "float32", 3)}


def test_a_page_must_hold_whole_entries_of_every_rate():
    cfg = dsv4_config(csa_rate=4, hca_rate=32)
    kv_buffer_specs(cfg, 32)
    with pytest.raises(InvalidRequestError, match="multiple of 32 tokens.*page_size=16"):
        kv_buffer_specs(cfg, 16)
    only_sliding = dsv4_config(("swa_mqa",))
    assert kv_buffer_specs(only_sliding, 3)[0].page_shape == (3, 16)


def test_fp8_ds_mla_plans_are_sized_but_never_allocated():
    cfg = dsv4_config(kv_format="fp8_ds_mla")
    assert {t.spec.entry_bytes for t in kv_tensors(cfg) if t.role in ("window", "entries")} == {584}
    assert {t.spec.entry_bytes for t in kv_tensors(cfg) if t.role == "index_entries"} == {132}
    with pytest.raises(InvalidRequestError, match="fp8_ds_mla"):
        kv_buffer_specs(cfg, 16)


def test_deepseek_v4_pro_stores_5511_bytes_per_token_and_23_mb_per_sequence():
    """ARCHITECTURES.md: 30 CSA x (584/4 + 132/4) + 31 HCA x 584/128 = 5,511 B per token of context; the
    bounded part (windows and compressor inputs) about 23.3 MB per sequence."""
    layer_types = tuple("csa" if i >= 2 and i % 2 == 0 else "hca" for i in range(61))
    cfg = dsv4_config(layer_types, csa_rate=4, hca_rate=128, window=128, head_dim=512, index_head_dim=128,
                      kv_format="fp8_ds_mla", dtype="bfloat16")
    plan = plan_groups([t.spec for t in kv_tensors(cfg)], 256, scale_tokens_per_page=False)
    growing = sum(g.used_bytes_per_page / g.tokens_per_page for g in plan.groups if g.spec.hit_rule == "prefix")
    assert growing == pytest.approx(30 * (146 + 33) + 31 * 584 / 128)
    bounded = sum(g.num_layers * g.spec.bytes_for_tokens(g.spec.window) for g in plan.groups
                  if g.spec.hit_rule == "window")
    assert bounded / 1e6 == pytest.approx(23.27, abs=0.01)


def _serve_turn(m: KVCacheManager, req_id: str, tokens: list[int], chunk: int) -> int:
    """Admit, compute in chunks (caching after each), free; returns the tokens the admission reused."""
    assert m.allocate(req_id, tokens)
    cached = m.num_cached_tokens(req_id)
    done = cached
    while done < len(tokens):
        done = min(len(tokens), done + chunk)
        m.cache_blocks(req_id, done)
    m.free(req_id)
    m.check_invariants()
    return cached


@pytest.mark.parametrize("block_size, rates", [(4, (4, 8)), (8, (4, 8)), (8, (4, 16)), (16, (4, 16))])
def test_cached_tokens_of_every_turn_are_whole_entries_of_every_rate(block_size, rates):
    """A session of growing turns: each turn's cached-token count is the longest prefix that ends on a
    page and on an entry boundary of each rate (below the prompt's last token), so no compressed
    entry is ever half-cached; at block size 4 the compressed groups take 8- or 16-token pages."""
    cfg = dsv4_config(csa_rate=rates[0], hca_rate=rates[1])
    m = KVCacheManager.from_model_config(cfg, num_blocks=512, block_size=block_size)
    unit = math.lcm(block_size, *rates)
    tokens: list[int] = []
    computed = 0
    for turn, grow in enumerate([37, 11, 3, 29, 17, 1, 40]):
        tokens = tokens + [(turn * 7 + i) % 50 + 1 for i in range(grow)]
        cached = _serve_turn(m, f"turn{turn}", tokens, chunk=5)
        assert cached % unit == 0 and all(cached % r == 0 for r in rates)
        assert cached == min(computed, len(tokens) - 1) // unit * unit
        computed = len(tokens)


def test_only_the_last_windows_pages_are_needed_for_a_hit():
    cfg = dsv4_config(csa_rate=4, hca_rate=8, window=8)
    m = KVCacheManager.from_model_config(cfg, num_blocks=256, block_size=8)
    prompt = list(range(1, 49))
    _serve_turn(m, "a", prompt, chunk=16)
    follow_up = prompt + [60, 61, 62]
    assert m.lookup(follow_up) == 48
    kinds = {g.group_id: g.group.spec.kind for g in m.groups}
    hashes = block_hashes(follow_up, 8)

    def evict(kind: str, page: int) -> None:
        group = next(g for g in m.groups if kinds[g.group_id] == kind)
        m.pool.evict(m.pool.cached_page(group.group_id, group.page_keys(hashes)[page]))

    # a hit at 48 needs window rows 41..47 and compressor inputs 40..47: page 5 only
    for kind in ("sliding_latent", "rolling_state"):
        evict(kind, 2)
    assert m.lookup(follow_up) == 48
    evict("sliding_latent", 5)
    assert m.lookup(follow_up) == 40  # the window of a hit at 40 (page 4) is still cached
    evict("compressed_latent", 1)
    assert m.lookup(follow_up) == 8  # entries are a prefix: every page up to the hit
    m.check_invariants()
