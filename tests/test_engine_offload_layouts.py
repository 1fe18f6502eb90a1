"""KV offload tiers under a parallel layout (agentjax/runner/page_mover.py's sharded movers, on 8 virtual
CPU devices): a conversation whose pages left the device between turns comes back from the host, disk or
Mooncake tier token-exact against one device without the cache (numerics="batch_invariant"), on
tiny-dense under TP2 and PCP2 x TP2 and on tiny-kimi-k3 (MLA latents and a recurrent state) under
TP2 x DCP2, over the byte pool's per-device slabs and (TP2) the shared layout's buffers; and the
layouts the tiers do not run with yet say so."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from offload_conversation import expected_hits, make_engine, run_conversation  # noqa: E402

from agentjax.errors import ParallelLayoutError  # noqa: E402
from agentjax.models import load_model  # noqa: E402
from agentjax.runner.page_mover import ShardedBufferPageMover, ShardedPoolPageMover  # noqa: E402
from tests.sharding.parity import need_devices  # noqa: E402

DENSE_FIRST = [(7919 * i) % 40000 + 3 for i in range(70)]
DENSE_FOLLOW_UPS = [[(104729 * i) % 40000 + 3 for i in range(20)]]
KIMI_FIRST = [(7919 * i) % 40000 + 3 for i in range(150)]
KIMI_FOLLOW_UPS = [[(104729 * i) % 40000 + 3 for i in range(40)]]


@pytest.fixture(scope="module")
def dense():
    return load_model("preset:tiny-dense")


@pytest.fixture(scope="module")
def kimi():
    return load_model("preset:tiny-kimi-k3")


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    pytest.importorskip("mooncake.store", reason="the Mooncake wheel (and libibverbs1) is not installed")
    from agentjax.kv.offload.mooncake import MooncakeMaster

    with MooncakeMaster(log_path=tmp_path_factory.mktemp("mooncake") / "master.log") as master:
        yield master


def _tier_settings(tier: str, tmp_path, request) -> dict:
    if tier == "host":
        return {"host_cache_gb": 0.01}
    if tier == "disk":
        return {"disk_cache_dir": str(tmp_path / "kv")}
    return {"mooncake_master": request.getfixturevalue("mooncake_master").address, "mooncake_segment_gb": 0.25}


@pytest.fixture(scope="module")
def dense_reference(dense):
    return run_conversation(make_engine(*dense, enable_prefix_caching=False), DENSE_FIRST, DENSE_FOLLOW_UPS,
                            evict=False)[0]


@pytest.mark.slow
@pytest.mark.parametrize("tier, layout", [("host", dict(tensor_parallel_size=2)),
                                          ("disk", dict(tensor_parallel_size=2)),
                                          ("mooncake", dict(tensor_parallel_size=2)),
                                          ("host", dict(prefill_context_parallel_size=2, tensor_parallel_size=2)),
                                          ("host", dict(tensor_parallel_size=2, kv_layout="shared"))],
                         ids=["tp2-host", "tp2-disk", "tp2-mooncake", "pcp2-tp2-host", "tp2-shared-host"])
def test_a_laid_out_conversation_from_a_tier_is_token_exact_against_one_device(dense, dense_reference, tier, layout,
                                                                              tmp_path, request):
    need_devices()
    reference = dense_reference
    engine = make_engine(*dense, **layout, **_tier_settings(tier, tmp_path, request))
    mover = engine.offload_worker.mover
    assert mover.num_devices == engine.config.parallel.num_devices
    # the byte pool's per-device slabs by default, per-kind buffers with the shared layout
    expected_mover = ShardedBufferPageMover if layout.get("kv_layout") == "shared" else ShardedPoolPageMover
    assert type(mover) is expected_mover
    replies, cached, computed = run_conversation(engine, DENSE_FIRST, DENSE_FOLLOW_UPS)
    assert replies == reference
    assert cached == expected_hits(computed) == [0, 64]  # every page of turn 1 came back from the tier
    offload = engine.stats()["kv_offload"]
    assert offload["pages_loaded"][tier] == cached[1] // 16  # the device held none of them
    engine.offload_worker.close()


@pytest.mark.slow
def test_kimi_tp2_dcp2_latents_and_recurrent_state_from_the_host_tier_are_token_exact(kimi):
    """Under DCP each device holds half of a 32-token page's tokens: a page leaves and returns as every
    device's part; the recurrent state (replicated over DCP, split over TP) with it."""
    need_devices()
    reference = run_conversation(make_engine(*kimi, enable_prefix_caching=False), KIMI_FIRST, KIMI_FOLLOW_UPS,
                                 evict=False)[0]
    engine = make_engine(*kimi, tensor_parallel_size=2, decode_context_parallel_size=2, host_cache_gb=0.02)
    assert type(engine.offload_worker.mover) is ShardedPoolPageMover
    replies, cached, computed = run_conversation(engine, KIMI_FIRST, KIMI_FOLLOW_UPS)
    assert replies == reference
    assert cached == expected_hits(computed, checkpoint=64) == [0, 128]  # the last state checkpoint
    offload = engine.stats()["kv_offload"]
    assert offload["pages_loaded"]["host"] == cached[1] // 32 + 1  # 32-token latent pages and one state
    engine.offload_worker.close()


def test_data_parallel_and_several_processes_refuse_the_tiers_in_one_line(dense):
    need_devices()
    from agentjax.config import EngineConfig
    from agentjax.runner.sharded_runner import check_engine_layout

    for layout in (dict(data_parallel_size=2), dict(num_processes=2, coordinator_address="127.0.0.1:1")):
        with pytest.raises(ParallelLayoutError, match="KV offload tiers do not run with data parallelism or several "
                                                      "processes yet"):
            check_engine_layout(dense[0], EngineConfig(host_cache_gb=0.01, **layout))
