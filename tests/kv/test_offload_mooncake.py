"""The Mooncake tier (agentjax/kv/offload/mooncake.py) against a real master and storage client from the
mooncake-transfer-engine-non-cuda wheel, on loopback: pages by name, shared across clients (a restart
or another replica), refusals at start-up, and failures once the master is killed."""
from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from agentjax.errors import OffloadTierError
from agentjax.kv.offload.mooncake import MooncakeError, MooncakeMaster, MooncakeStorageServer, MooncakeTier, free_port

pytest.importorskip("mooncake.store", reason="the Mooncake wheel (and libibverbs1) is not installed")

PAGE = 64 * 1024


def _key(i: int, group: int = 0) -> tuple[int, bytes]:
    return group, hashlib.sha256(str(i).encode()).digest()


@pytest.fixture
def master(tmp_path):
    with MooncakeMaster(log_path=tmp_path / "master.log") as master:
        yield master


def test_pages_put_by_one_client_are_found_by_another(master, tmp_path):
    with MooncakeStorageServer(master.address, 32 << 20, log_path=tmp_path / "storage.log"):
        first = MooncakeTier(master.address, "ns", segment_bytes=0)
        payload = np.arange(PAGE // 4, dtype=np.float32)
        first.put(_key(1), payload.view(np.uint8))
        first.close()  # the engine that stored it is gone; the storage client keeps the bytes
        second = MooncakeTier(master.address, "ns", segment_bytes=0)
        assert second.exists([_key(1), _key(2), _key(1, group=1)]) == [True, False, False]
        assert np.array_equal(np.frombuffer(second.get(_key(1), PAGE), np.float32), payload)
        with pytest.raises(KeyError):
            second.get(_key(2), PAGE)
        assert not MooncakeTier(master.address, "other-model", 0).exists([_key(1)])[0]
        second.close()


def test_an_object_of_the_wrong_size_is_refused(master):
    tier = MooncakeTier(master.address, "ns", segment_bytes=16 << 20)
    tier.put(_key(3), np.zeros(PAGE, np.uint8))
    with pytest.raises(MooncakeError, match="expected"):
        tier.get(_key(3), PAGE * 2)
    tier.close()


def test_no_master_is_a_start_up_error():
    with pytest.raises(OffloadTierError, match="no Mooncake master answers"):
        MooncakeTier(f"127.0.0.1:{free_port()}", "ns", segment_bytes=0)
    with pytest.raises(OffloadTierError, match="HOST:PORT"):
        MooncakeTier("just-a-host", "ns", segment_bytes=0)


@pytest.mark.slow
def test_calls_fail_with_an_error_once_the_master_is_killed(master):
    tier = MooncakeTier(master.address, "ns", segment_bytes=16 << 20)
    tier.put(_key(4), np.ones(PAGE, np.uint8))
    master.kill()
    started = time.monotonic()
    with pytest.raises(MooncakeError):
        tier.put(_key(5), np.ones(PAGE, np.uint8))
    assert time.monotonic() - started < 10
