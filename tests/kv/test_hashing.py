"""Tests of agentjax/kv/hashing.py: chained, deterministic, salted block hashes and their memo."""
import subprocess
import sys

import numpy as np
import pytest

from agentjax.errors import InvalidRequestError
from agentjax.kv.hashing import PrefixHashMemo, block_hashes, hash_block_tokens, root_hash, tokens_as_uint32

_CHILD = """
import sys
from agentjax.kv import block_hashes
salt = sys.argv[1] or None
print(",".join(h.hex() for h in block_hashes(list(range(1000, 1100)), 16, cache_salt=salt)))
"""


def _hashes_in_fresh_process(salt: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _CHILD, salt], check=True, capture_output=True, text=True,
                         env={"PYTHONHASHSEED": "random"})
    return out.stdout.strip().split(",")


def test_hashes_are_equal_across_two_processes_and_differ_with_the_salt():
    first = _hashes_in_fresh_process("tenant-a")
    second = _hashes_in_fresh_process("tenant-a")
    other_salt = _hashes_in_fresh_process("tenant-b")
    no_salt = _hashes_in_fresh_process("")
    assert len(first) == 100 // 16
    assert first == second
    assert not set(first) & set(other_salt)
    assert not set(first) & set(no_salt)
    assert [h.hex() for h in block_hashes(list(range(1000, 1100)), 16, cache_salt="tenant-a")] == first


def test_each_hash_chains_its_parent_and_only_full_blocks_are_hashed():
    tokens = list(range(50))
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 3
    assert hashes[0] == hash_block_tokens(root_hash(), tokens[:16])
    assert hashes[2] == hash_block_tokens(hashes[1], tokens[32:48])
    changed = block_hashes([99] + tokens[1:], 16)
    assert all(a != b for a, b in zip(hashes, changed)), "a change in block 0 must change every later hash"


def test_extra_keys_change_the_root_and_block_extra_keys_change_one_block():
    assert root_hash(extra_keys=("lora-a",)) != root_hash(extra_keys=("lora-b",)) != root_hash()
    assert hash_block_tokens(root_hash(), [1, 2], ("image-7",)) != hash_block_tokens(root_hash(), [1, 2])


def test_token_ids_out_of_uint32_range_are_rejected_with_the_value():
    with pytest.raises(InvalidRequestError, match="-5"):
        tokens_as_uint32([1, -5, 3])
    with pytest.raises(InvalidRequestError):
        tokens_as_uint32(np.array([2**33]))


def test_memo_gives_the_same_hashes_as_hashing_from_scratch_and_skips_old_blocks():
    rng = np.random.default_rng(0)
    memo = PrefixHashMemo(block_size=16)
    root = root_hash()
    turn = rng.integers(0, 50_000, 1000).astype(np.uint32)
    for _ in range(5):
        assert memo.hashes(turn, root) == block_hashes(turn, 16)
        turn = np.concatenate([turn, rng.integers(0, 50_000, 200).astype(np.uint32)])
    assert memo.blocks_reused > memo.blocks_hashed  # later turns hashed only their new blocks
    diverged = turn.copy()
    diverged[500] += 1
    assert memo.hashes(diverged, root) == block_hashes(diverged, 16)


def test_memo_picks_the_longest_matching_sequence_among_sessions_with_one_system_prompt():
    rng = np.random.default_rng(1)
    system = rng.integers(0, 1000, 64).astype(np.uint32)
    sessions = [np.concatenate([system, rng.integers(0, 1000, 320).astype(np.uint32)]) for _ in range(3)]
    memo = PrefixHashMemo(block_size=16)
    for seq in sessions:
        memo.hashes(seq, root_hash())
    before = memo.blocks_hashed
    longer = np.concatenate([sessions[1], rng.integers(0, 1000, 32).astype(np.uint32)])
    assert memo.hashes(longer, root_hash()) == block_hashes(longer, 16)
    assert memo.blocks_hashed - before == 2


def test_one_token_converts_like_many_and_out_of_range_is_rejected():
    assert tokens_as_uint32([7]).tolist() == [7] and tokens_as_uint32([7]).dtype == np.dtype("<u4")
    assert tokens_as_uint32([2**32 - 1]).tolist() == [2**32 - 1]
    for bad in ([-1], [2**32], [True, 2**32], ["x"]):
        with pytest.raises(InvalidRequestError):
            tokens_as_uint32(bad)
