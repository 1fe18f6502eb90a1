"""Issue 14 acceptance 1: a conversation whose pages were evicted from the device to the host tier, the disk
tier or a real Mooncake pool gives tokens identical to a plain run (prefix caching off) under
numerics="batch_invariant", on SmolLM2, on preset:tiny-kimi-k3 (MLA latents and a recurrent KDA
state) and on preset:tiny-dsv4 (compressed entries, indexer keys, window groups; host tier), and the
engine reports the pages loaded per tier. A paused session's pages are prefetched back before its
next turn when the KV policy says it is due."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from offload_conversation import (  # noqa: E402
    GREEDY, evict_device_cache, expected_hits, make_engine, make_llm_engine, run_conversation,
)

from agentjax import LLM  # noqa: E402
from agentjax.errors import OffloadTierError  # noqa: E402
from agentjax.models import load_model  # noqa: E402
from agentjax.scheduler.request import AgentHints  # noqa: E402

TIERS = ["host", "disk", "mooncake"]


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    pytest.importorskip("mooncake.store", reason="the Mooncake wheel (and libibverbs1) is not installed")
    from agentjax.kv.offload.mooncake import MooncakeMaster

    with MooncakeMaster(log_path=tmp_path_factory.mktemp("mooncake") / "master.log") as master:
        yield master


def _tier_settings(tier: str, tmp_path, request) -> dict:
    if tier == "host":
        return {"host_cache_gb": 0.25}
    if tier == "disk":
        return {"disk_cache_dir": str(tmp_path / "kv")}
    master = request.getfixturevalue("mooncake_master")
    return {"mooncake_master": master.address, "mooncake_segment_gb": 0.25}


@pytest.fixture(scope="module")
def smollm2_turns(smollm2_invariant):
    tok = smollm2_invariant.tokenizer
    first = tok.encode_chat([{"role": "user", "content": "Write a short poem about a lighthouse keeper who "
                                                          "counts the ships at night. " * 4}])
    follow_ups = [tok.encode(" Now make it rhyme."), tok.encode(" Translate it to French, please.")]
    return first, follow_ups


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_invariant, smollm2_turns):
    llm = smollm2_invariant
    engine = make_llm_engine(llm, enable_prefix_caching=False)
    return run_conversation(engine, *smollm2_turns, evict=False)[0]


@pytest.mark.slow
@pytest.mark.parametrize("tier", TIERS)
def test_smollm2_conversation_from_each_tier_is_token_exact(smollm2_invariant, smollm2_turns, smollm2_reference,
                                                            tier, tmp_path, request):
    llm = smollm2_invariant
    engine = make_llm_engine(llm, **_tier_settings(tier, tmp_path, request))
    replies, cached, computed = run_conversation(engine, *smollm2_turns)
    assert replies == smollm2_reference
    offload = engine.stats()["kv_offload"]
    assert offload["tiers"] == [tier]
    assert cached == expected_hits(computed)  # every page of the earlier turns came back from the tier
    assert offload["pages_loaded"][tier] == sum(cached) // 16  # the device held none of them
    assert offload["pages_stored"][tier] > 0
    engine.offload_worker.close()


@pytest.fixture(scope="module")
def kimi():
    return load_model("preset:tiny-kimi-k3")


KIMI_FIRST = [(7919 * i) % 40000 + 3 for i in range(150)]
KIMI_FOLLOW_UPS = [[(104729 * i) % 40000 + 3 for i in range(40)], [(1299709 * i) % 40000 + 3 for i in range(40)]]


@pytest.fixture(scope="module")
def kimi_reference(kimi):
    engine = make_engine(*kimi, enable_prefix_caching=False)
    return run_conversation(engine, KIMI_FIRST, KIMI_FOLLOW_UPS, evict=False)[0]


@pytest.mark.slow
@pytest.mark.parametrize("tier", TIERS)
def test_kimi_conversation_with_recurrent_state_from_each_tier_is_token_exact(kimi, kimi_reference, tier, tmp_path,
                                                                              request):
    engine = make_engine(*kimi, state_checkpoint_tokens=64, **_tier_settings(tier, tmp_path, request))
    replies, cached, computed = run_conversation(engine, KIMI_FIRST, KIMI_FOLLOW_UPS)
    assert replies == kimi_reference
    assert cached == expected_hits(computed, checkpoint=64) == [0, 128, 192]  # the last state checkpoints
    offload = engine.stats()["kv_offload"]
    assert offload["pages_loaded"][tier] == sum(cached) // 16 + 2  # MLA latent pages plus one state per turn
    assert offload["pages_stored"][tier] > 0
    engine.offload_worker.close()


@pytest.mark.slow
def test_llm_takes_the_tier_settings_by_name_and_refuses_a_tier_that_cannot_start(tmp_path):
    llm = LLM("preset:tiny-kimi-k3", numerics="batch_invariant", host_cache_gb=0.01,
              disk_cache_dir=str(tmp_path / "kv"), disk_cache_gb=0.5, kv_offload_retention="marconi")
    assert llm.engine.offload.tiers == ["host", "disk"]
    assert llm.engine_config.disk_cache_gb == 0.5
    # over its cap the disk tier drops the files of lowest recompute cost per byte and recency first (scored),
    # not simply the oldest: what --disk-cache-gb's help and docs/kv-cache.md say
    assert llm.engine.offload.disk._order is not None
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OffloadTierError, match="not a writable directory"):
        LLM("preset:tiny-kimi-k3", disk_cache_dir=str(blocker))
    with pytest.raises(OffloadTierError, match="no Mooncake master answers|mooncake"):
        LLM("preset:tiny-kimi-k3", mooncake_master="127.0.0.1:1")


@pytest.fixture(scope="module")
def dsv4():
    return load_model("preset:tiny-dsv4")


DSV4_FIRST = [(7919 * i) % 40000 + 3 for i in range(100)]
DSV4_FOLLOW_UPS = [[(104729 * i) % 40000 + 3 for i in range(40)]]
DSV4_POOL = {"num_kv_blocks": 160}  # seven KV groups share the pool


@pytest.mark.slow
def test_dsv4_compressed_entries_and_window_groups_come_back_from_the_host_tier_token_exact(dsv4):
    """DeepSeek-V4's kinds: compressed latents (ratios 4 and 16) and indexer keys (one packed prefix page
    group), sliding latents and the compressors' rolling states (window groups), all through the host tier."""
    reference = run_conversation(make_engine(*dsv4, enable_prefix_caching=False, **DSV4_POOL), DSV4_FIRST,
                                 DSV4_FOLLOW_UPS, evict=False)[0]
    engine = make_engine(*dsv4, host_cache_gb=0.05, **DSV4_POOL)
    replies, cached, computed = run_conversation(engine, DSV4_FIRST, DSV4_FOLLOW_UPS)
    assert replies == reference
    assert cached == expected_hits(computed) == [0, 96]
    layout = engine.kv.layout  # the pool packs the prefix kinds into one page group
    prefix_groups = [g for g in layout.groups if g.hit_rule == "prefix"]
    window = sum(g.hit_rule == "window" for g in layout.groups)
    assert (len(prefix_groups), window) == (1, 4)
    assert sorted((layout.kinds[k].role, layout.kinds[k].spec.tokens_per_entry) for k in prefix_groups[0].kinds) \
        == [("entries", 4), ("entries", 16), ("index_entries", 4)]
    prefix = len(prefix_groups)
    # every prefix group's pages up to the hit, and each window group's last page before it
    assert engine.stats()["kv_offload"]["pages_loaded"]["host"] == cached[1] // 16 * prefix + window
    engine.offload_worker.close()


@pytest.mark.slow
def test_a_paused_sessions_prefix_is_prefetched_from_the_host_tier_before_its_next_turn():
    """The KV policy's prefetch: the session's next turn is due at once (expected_next_turn_s=0), so idle
    engine steps bring its evicted pages back from the host tier, and the turn then hits on the device
    (no load staged for it) with the tokens of a run without the cache."""
    cfg, params, tokenizer = load_model("preset:tiny-dense")
    first = [(7919 * i) % 40000 + 3 for i in range(70)]
    second_extra = [11, 12, 13]
    plain = make_engine(cfg, params, tokenizer, enable_prefix_caching=False)
    reference, _, _ = run_conversation(plain, first, [second_extra], evict=False)
    engine = make_engine(cfg, params, tokenizer, host_cache_gb=0.01)
    hints = AgentHints(session_id="paused", expected_next_turn_s=0.0)
    replies, cached = [], []
    prompt = list(first)
    for turn in range(2):
        request_id = engine.add_request(prompt, GREEDY, hints=hints)
        outputs = [out for out in engine.run_until_done() if out.request_id == request_id]
        replies.append([token for out in outputs for token in out.new_token_ids])
        cached.append(outputs[-1].num_cached_tokens)
        if turn == 0:
            engine.offload_worker.flush(engine.runner)  # the turn's stores reach the host tier
            evict_device_cache(engine)
            deadline = time.monotonic() + 30.0
            while engine.stats()["kv_offload"]["prefetches"] == 0 or engine.offload.prefetcher.num_loading:
                assert time.monotonic() < deadline, "the paused session's pages were never prefetched"
                engine.step()  # idle steps: the connector asks the policy, stages the load, completes it
                time.sleep(0.05)
            prompt = prompt + replies[0] + second_extra
    assert replies == reference
    offload = engine.stats()["kv_offload"]
    assert cached[1] == (len(first) + len(reference[0]) - 1) // 16 * 16  # every page of turn 1, from the device
    assert offload["pages_prefetched"] == offload["pages_loaded"]["host"] == cached[1] // 16
    assert offload["counters"].get(("load_requests", "all", ""), 0) == 0
    engine.offload_worker.close()
