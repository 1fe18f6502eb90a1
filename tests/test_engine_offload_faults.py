"""Faults of the offload tiers under batch_invariant numerics. On SmolLM2 (issue 14): a corrupt or truncated
disk page is caught by its checksum and recomputed; a full disk (a real, tiny tmpfs) degrades to the
host tier; a SIGKILLed Mooncake master degrades to the local tiers. In each case the tokens equal a
plain run's, nothing crashes, and the fault shows in a log line and in `agentjax:kv_offload_*` on the
/metrics registry. On preset:tiny-dense (issue 32), a matrix of tier x fault x pool pressure: a load
that fails releases its pages at once, the request is recomputed with a cold run's tokens after at
most 2 s waiting on the tiers, the request queued behind it finishes, and the pool is back at its
baseline."""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
import itertools
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from offload_conversation import evict_device_cache, expected_hits, make_engine, run_conversation  # noqa: E402

from agentjax.config import EngineConfig  # noqa: E402
from agentjax.engine import Engine  # noqa: E402
from agentjax.kv.offload.disk import HEADER  # noqa: E402
from agentjax.models import load_model  # noqa: E402
from agentjax.sampling_params import SamplingParams  # noqa: E402
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
    engine = make_engine(llm.model_config, llm.params, llm.tokenizer, step_buckets=None,
                         enable_prefix_caching=False)
    return run_conversation(engine, *conversation, evict=False)[0]


def _metrics(engine) -> str:
    return ServerMetrics(engine.stats, lambda: 0).render().decode()


@pytest.mark.slow
def test_corrupt_and_truncated_disk_pages_are_recomputed_exactly(smollm2_invariant, conversation, reference, tmp_path,
                                                                 caplog):
    llm = smollm2_invariant
    engine = make_engine(llm.model_config, llm.params, llm.tokenizer, step_buckets=None,
                         disk_cache_dir=str(tmp_path / "kv"))
    hashes = engine.kv.prepare(conversation[0], None)[1]

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
    engine = make_engine(llm.model_config, llm.params, llm.tokenizer, step_buckets=None, host_cache_gb=0.25,
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
        engine = make_engine(llm.model_config, llm.params, llm.tokenizer, step_buckets=None,
                             mooncake_master=master.address, mooncake_segment_gb=0.25, **settings)

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


# -- issue 32: a load that fails releases its pages at once, and nothing waits on it -----------------
# A matrix on preset:tiny-dense (8 KiB pages, fast steps): each tier x each fault x pool pressure. In the
# small pool the failed load's own pages are needed for the recompute (11 of its 12 usable pages) and
# a second request queued behind it fits only once the first is done; the roomy pool has room for both.
SMALL_POOL, ROOMY_POOL = 13, 64
TINY_GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
IDLE_LIMIT_S = 2.0  # what a fault may add to a request's compute (acceptance: "within 2 s plus compute")


_PROMPT_STARTS = itertools.count(1000, 200)


def _case_prompts() -> tuple[list[int], list[int]]:
    """Fresh prompts for one case, sharing no prefix with any other: the one whose load fails (165
    tokens: 10 full pages and a part page) and the one queued behind it (40 tokens)."""
    start = next(_PROMPT_STARTS)
    return list(range(start, start + 165)), list(range(start + 165, start + 205))


@pytest.fixture(scope="module")
def tiny_dense():
    return load_model("preset:tiny-dense")


@pytest.fixture(scope="module")
def cold_tokens(tiny_dense):
    """Greedy tokens of a prompt run alone on an engine without prefix caching (memoised)."""
    engine = Engine(*tiny_dense[:2], EngineConfig(numerics="batch_invariant", max_num_batched_tokens=256,
                                                  num_kv_blocks=ROOMY_POOL, enable_prefix_caching=False),
                    tiny_dense[2])
    memo: dict[tuple, list[int]] = {}

    def cold(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in memo:
            memo[tuple(prompt)] = _drive(engine, [prompt], limit_s=120)[0][0]
        return memo[tuple(prompt)]

    return cold


def _tiny_engine(tiny_dense, pool: int, **tiers) -> Engine:
    return Engine(*tiny_dense[:2], EngineConfig(numerics="batch_invariant", max_num_batched_tokens=256,
                                                num_kv_blocks=pool, **tiers), tiny_dense[2])


def _drive(engine: Engine, prompts: list[list[int]], limit_s: float = 60.0,
           during=None) -> tuple[list[list[int]], float]:
    """Run `prompts` to the end: (tokens per prompt, seconds spent in steps that ran no model step: the
    time the requests waited for the tiers). Fails if they are not done within `limit_s` (a wedge).
    `during(step_index)` runs after each step (a fault injected mid-load)."""
    ids = [engine.add_request(prompt, TINY_GREEDY) for prompt in prompts]
    tokens = {request_id: [] for request_id in ids}
    start, idle, index = time.monotonic(), 0.0, 0
    while engine.has_unfinished():
        steps, began = engine.num_steps, time.monotonic()
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if engine.num_steps == steps:
            idle += time.monotonic() - began
        if during is not None:
            during(index)
        index += 1
        stats = engine.stats()
        assert time.monotonic() - start < limit_s, \
            f"wedged: running {stats['num_running']}, waiting {stats['num_waiting']} after {limit_s} s"
    return [tokens[request_id] for request_id in ids], idle


def _store_then_evict(engine: Engine, prompt: list[int], cold) -> None:
    assert _drive(engine, [prompt])[0] == [cold(prompt)]
    engine.offload_worker.flush(engine.runner)  # the turn's stores land
    evict_device_cache(engine)


def _assert_pool_at_baseline(engine: Engine) -> None:
    pool = engine.kv.pool
    engine.kv.check_invariants()
    # every page free again: a one-size pool's ids, or a slab pool's pages and its slabs no group owns
    assert engine.kv.num_free_blocks == engine.kv.capacity_units, "pages still referenced after every request ended"
    if pool.num_groups_share_ids:
        assert np.count_nonzero(pool.ref_counts[1:]) == 0 and pool.num_free == pool.num_pages - 1
    else:
        assert pool.group_usage()[1].sum() == 0  # no page held in any group's slabs
    assert engine.offload.num_held == 0 and not engine.offload._held


def _run_faulted(engine: Engine, prompt: list[int], behind: list[int], cold, caplog, during=None) -> float:
    """Send the faulted prompt and a request queued behind it; check tokens, the warning and the pool.
    Returns the seconds the requests waited for the tiers."""
    stats = engine.offload.stats
    loads_before, failures_before = stats.get("load_requests", "all"), stats.total("load_failures")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        tokens, idle = _drive(engine, [prompt, behind], during=during)
    assert tokens == [cold(prompt), cold(behind)]
    assert idle <= IDLE_LIMIT_S, f"the requests waited {idle:.2f} s for the tiers"
    assert stats.get("load_requests", "all") == loads_before + 1  # one load, never planned again
    assert stats.total("load_failures") > failures_before
    warnings = [r.message for r in caplog.records if r.message.startswith("KV load for request")]
    assert len(warnings) == 1 and "recomputed" in warnings[0], warnings
    _assert_pool_at_baseline(engine)
    return idle


def _flip(engine, hashes) -> None:
    path = engine.offload.disk._path((0, hashes[2]))
    data = bytearray(path.read_bytes())
    data[HEADER.size + 100] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(engine, hashes) -> None:
    path = engine.offload.disk._path((0, hashes[4]))
    path.write_bytes(path.read_bytes()[: HEADER.size + 10])


def _delete(engine, hashes) -> None:
    for block_hash in hashes[2:5]:
        engine.offload.disk._path((0, block_hash)).unlink()


def _delete_all(engine, hashes) -> None:
    for block_hash in hashes:
        engine.offload.disk._path((0, block_hash)).unlink(missing_ok=True)


DISK_FAULTS = {"flip": (_flip, "checksum"), "truncate": (_truncate, "checksum"), "delete": (_delete, "missing")}


@pytest.fixture(scope="module", params=[SMALL_POOL, ROOMY_POOL], ids=["small-pool", "roomy-pool"])
def disk_engine(tiny_dense, tmp_path_factory, request):
    engine = _tiny_engine(tiny_dense, request.param, disk_cache_dir=str(tmp_path_factory.mktemp("kv")))
    yield engine
    engine.offload_worker.close()


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(DISK_FAULTS))
def test_a_failed_disk_load_is_recomputed_at_once_and_the_queue_behind_it_runs(disk_engine, cold_tokens, fault,
                                                                               caplog):
    engine, (inject, reason) = disk_engine, DISK_FAULTS[fault]
    prompt, behind = _case_prompts()
    _store_then_evict(engine, prompt, cold_tokens)
    hashes = engine.kv.prepare(prompt, None)[1]
    inject(engine, hashes)
    failures = engine.offload.stats.get("load_failures", "disk", reason=reason)
    _run_faulted(engine, prompt, behind, cold_tokens, caplog)
    assert engine.offload.stats.get("load_failures", "disk", reason=reason) > failures
    assert engine.offload.stats.get("pages_loaded", "disk") > 0 or fault == "flip"


@pytest.mark.parametrize("pool", [SMALL_POOL, ROOMY_POOL], ids=["small-pool", "roomy-pool"])
def test_a_load_from_host_and_disk_keeps_the_host_pages_when_the_disk_files_are_gone(tiny_dense, cold_tokens, pool,
                                                                                     tmp_path, caplog):
    engine = _tiny_engine(tiny_dense, pool, host_cache_gb=32 * 8192 / 2**30, disk_cache_dir=str(tmp_path / "kv"))
    prompt, behind = _case_prompts()
    _store_then_evict(engine, prompt, cold_tokens)
    hashes = engine.kv.prepare(prompt, None)[1]
    for block_hash in hashes[5:10]:  # the host tier let the tail go (other traffic): it is on disk only
        engine.offload.host.drop((0, block_hash))
    assert engine.offload.lookup(prompt) == {"device": 0, "host": 5, "disk": 5, "mooncake": 0}
    _delete_all(engine, hashes)
    host_loaded = engine.offload.stats.get("pages_loaded", "host")
    _run_faulted(engine, prompt, behind, cold_tokens, caplog)
    assert engine.offload.stats.get("pages_loaded", "host") == host_loaded + 5  # the hit the host gave back
    assert engine.offload.stats.get("load_failures", "disk", reason="missing") == 5
    engine.offload_worker.close()


def _mooncake_fault(name: str, engine: Engine, master, peer):
    """Inject a Mooncake fault; returns the `during` hook for `_drive` (or None) and the reasons it may
    be counted under."""
    if name == "peer_killed":  # the process whose memory held the pages dies; the master still lists them
        peer.kill()
        return None, ("error",)
    master.process.send_signal(signal.SIGSTOP)  # the master stops answering: probes and loads hang
    if name == "master_hung":
        return None, ("timeout",)

    def kill_during_the_load(step: int) -> None:
        if master.process.poll() is None and len(engine.offload_worker.loads):
            master.kill()  # a load is in flight: the master dies under it

    return kill_during_the_load, ("timeout", "degraded", "error")


MOONCAKE_FAULTS = ["master_killed_during_load", "master_hung", "peer_killed"]


@pytest.mark.slow
@pytest.mark.parametrize("pool", [SMALL_POOL, ROOMY_POOL], ids=["small-pool", "roomy-pool"])
@pytest.mark.parametrize("fault", MOONCAKE_FAULTS)
def test_a_failed_mooncake_load_costs_at_most_the_deadline(tiny_dense, cold_tokens, fault, pool, tmp_path, caplog):
    pytest.importorskip("mooncake.store", reason="the Mooncake wheel (and libibverbs1) is not installed")
    from agentjax.kv.offload.mooncake import MooncakeMaster, MooncakeStorageServer

    master = MooncakeMaster(log_path=tmp_path / "master.log")
    peer = MooncakeStorageServer(master.address, 16 << 20, log_path=tmp_path / "peer.log") \
        if fault == "peer_killed" else None
    # With a peer, the engine lends no memory: every page lands in the peer's segment.
    engine = _tiny_engine(tiny_dense, pool, mooncake_master=master.address,
                          mooncake_segment_gb=0.0 if peer is not None else 0.02)
    try:
        prompt, behind = _case_prompts()
        _store_then_evict(engine, prompt, cold_tokens)
        during, reasons = _mooncake_fault(fault, engine, master, peer)
        idle = _run_faulted(engine, prompt, behind, cold_tokens, caplog, during=during)
        stats = engine.offload.stats
        assert sum(stats.get("load_failures", "mooncake", reason=reason) for reason in reasons) > 0
        assert stats.get("pages_loaded", "mooncake") == 0
        if fault == "master_killed_during_load":
            assert master.process.poll() is not None  # the hook found the load in flight and killed the master
        if fault == "master_hung":
            assert idle >= engine.config.kv_load_timeout_s * 0.9  # it waited for the deadline, no longer
            assert any("degraded (timeout)" in r.message for r in caplog.records)
    finally:
        if master.process.poll() is None:
            master.kill()
        restarted = MooncakeMaster(port=master.port)  # the client's close then finds a master (no 10 s timeout)
        engine.offload_worker.close()
        restarted.stop()
        master.stop()
        if peer is not None:
            peer.stop()
