"""Issue 14 acceptance 2: faults of the offload tiers on SmolLM2 under batch_invariant numerics. A corrupt or
truncated disk page is caught by its checksum and recomputed; a full disk (a real, tiny tmpfs)
degrades to the host tier; a SIGKILLed Mooncake master degrades to the local tiers. In each case the
tokens equal a plain run's, nothing crashes, and the fault shows in a log line and in
`agentjax:kv_offload_*` on the /metrics registry."""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from offload_conversation import expected_hits, make_engine, run_conversation  # noqa: E402

from agentjax.kv.offload.disk import HEADER  # noqa: E402
from agentjax.server.metrics import ServerMetrics  # noqa: E402

PAGE = 16


@pytest.fixture(scope="module")
def conversation(smollm2_invariant):
    tok = smollm2_invariant.tokenizer
    first = tok.encode_chat([{"role": "user", "content": "List five uses of a paperclip, with a sentence on "
                                                          "each, and explain which one is best. " * 3}])
    return first, [tok.encode(" Add two more."), tok.encode(" Which is the oddest?")]


@pytest.fixture(scope="module")
def reference(smollm2_invariant, conversation):
    llm = smollm2_invariant
    return run_conversation(make_engine(llm.model_config, llm.params, llm.tokenizer, enable_prefix_caching=False),
                            *conversation, evict=False)[0]


def _metrics(engine) -> str:
    return ServerMetrics(engine.stats, lambda: 0).render().decode()


@pytest.mark.slow
def test_corrupt_and_truncated_disk_pages_are_recomputed_exactly(smollm2_invariant, conversation, reference, tmp_path,
                                                                 caplog):
    llm = smollm2_invariant
    engine = make_engine(llm.model_config, llm.params, llm.tokenizer, disk_cache_dir=str(tmp_path / "kv"))
    hashes = engine.kv._prepare(conversation[0], None)[1]

    def damage(turn: int) -> None:
        if turn == 0:
            flipped = engine.offload.disk._path((0, hashes[2]))
            data = bytearray(flipped.read_bytes())
            data[HEADER.size + 1000] ^= 0x40
            flipped.write_bytes(bytes(data))
            truncated = engine.offload.disk._path((0, hashes[4]))
            truncated.write_bytes(truncated.read_bytes()[: HEADER.size + 10])

    with caplog.at_level(logging.WARNING):
        replies, cached, computed = run_conversation(engine, *conversation, between_turns=damage)
    assert replies == reference
    assert cached[1] == 2 * PAGE  # the hit stops at the first bad page; the rest is recomputed
    assert cached[2] == expected_hits(computed)[2]  # turn 1 stored the recomputed pages again
    assert engine.offload.stats.get("load_failures", "disk", reason="checksum") == 2
    assert sum("CRC-32 mismatch" in r.message for r in caplog.records) == 1
    assert sum("truncated" in r.message for r in caplog.records) == 1
    text = _metrics(engine)
    assert 'agentjax:kv_offload_load_failures_total{reason="checksum",tier="disk"} 2.0' in text
    assert not engine.offload.disk._path((0, hashes[2])).exists() or engine.offload.disk.contains((0, hashes[2]))


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1.5 MiB tmpfs: room for two of SmolLM2's 720 KiB pages."""
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.slow
def test_a_full_disk_degrades_to_the_host_tier(smollm2_invariant, conversation, reference, tiny_disk, caplog):
    llm = smollm2_invariant
    engine = make_engine(llm.model_config, llm.params, llm.tokenizer, host_cache_gb=0.25,
                         disk_cache_dir=str(tiny_disk))
    with caplog.at_level(logging.WARNING):
        replies, cached, computed = run_conversation(engine, *conversation)
    assert replies == reference
    assert cached == expected_hits(computed)  # every page came back, from the host tier
    stats = engine.offload.stats
    assert stats.get("store_failures", "disk", reason="disk_full") >= 1
    assert stats.get("pages_loaded", "host") == sum(cached) // PAGE
    assert any("KV offload tier disk degraded (disk_full)" in r.message for r in caplog.records)
    text = _metrics(engine)
    assert 'agentjax:kv_offload_store_failures_total{reason="disk_full",tier="disk"}' in text
    assert 'agentjax:kv_offload_tier_degraded{tier="disk"} 1.0' in text
    assert 'agentjax:kv_offload_tier_degraded{tier="host"} 0.0' in text


@pytest.mark.slow
@pytest.mark.parametrize("local_tier", [None, "disk"])
def test_a_killed_mooncake_master_degrades_to_the_local_tiers(smollm2_invariant, conversation, reference, tmp_path,
                                                              local_tier, caplog):
    pytest.importorskip("mooncake.store", reason="the Mooncake wheel (and libibverbs1) is not installed")
    from agentjax.kv.offload.mooncake import MooncakeMaster

    llm = smollm2_invariant
    settings = {"disk_cache_dir": str(tmp_path / "kv")} if local_tier == "disk" else {}
    with MooncakeMaster(log_path=tmp_path / "master.log") as master:
        engine = make_engine(llm.model_config, llm.params, llm.tokenizer, mooncake_master=master.address,
                             mooncake_segment_gb=0.25, **settings)

        def kill(turn: int) -> None:
            if turn == 0:
                assert engine.offload.stats.get("pages_stored", "mooncake") > 0
                master.kill()

        with caplog.at_level(logging.WARNING):
            replies, cached, computed = run_conversation(engine, *conversation, between_turns=kill)
    assert replies == reference
    stats = engine.offload.stats
    if local_tier == "disk":
        assert cached == expected_hits(computed)  # the disk served every page
        assert stats.get("pages_loaded", "disk") == sum(cached) // PAGE
    else:
        assert cached[1:] == [0, 0]  # nothing local to load: recomputed (the next turn's probe found the master gone)
    assert stats.get("pages_loaded", "mooncake") == 0
    assert any("KV offload tier mooncake degraded (unreachable)" in r.message for r in caplog.records)
    text = _metrics(engine)
    assert 'agentjax:kv_offload_degradations_total{reason="unreachable",tier="mooncake"}' in text
    assert 'agentjax:kv_offload_tier_degraded{tier="mooncake"} 1.0' in text
    engine.offload_worker.close()
