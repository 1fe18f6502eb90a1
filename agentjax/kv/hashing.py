"""Chained prefix-block hashes: the names under which KV pages are cached, routed and offloaded.

`block_hashes` is the one function the router and the offload tiers call; the manager computes the
same values incrementally (`PrefixHashMemo`). Deterministic across processes and machines: SHA-256
over a fixed seed, little-endian uint32 tokens and no per-process randomness. Host only: never imports jax.
"""
from __future__ import annotations

import array
import hashlib
import sys
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from agentjax.errors import InvalidRequestError

BlockHash = bytes  # 32-byte SHA-256 digest
HASH_SEED = b"agentjax.kv.block_hash.v1"
_sha256 = hashlib.sha256
_EMPTY_SHA256 = _sha256()
_LITTLE_ENDIAN = sys.byteorder == "little"


def root_hash(cache_salt: str | None = None, extra_keys: Sequence[str | int] = ()) -> BlockHash:
    """The parent hash of a sequence's first block.

    `cache_salt` isolates tenants (a different salt gives disjoint hashes); `extra_keys` hold
    whatever else changes the KV of every token, such as a LoRA adapter's name.
    """
    parts = [HASH_SEED, b"\x00salt\x00", (cache_salt or "").encode(), b"\x00"]
    for key in extra_keys:
        parts.append(repr(key).encode())
        parts.append(b"\x00")
    return _sha256(b"".join(parts)).digest()


ROOT_HASH = root_hash()


def namespaced_salt(namespace: str | None, cache_salt: str | None) -> str | None:
    """The salt a request's blocks are hashed under: its tenant's cache namespace, then its own
    `cache_salt`. None namespace (a server without keys) leaves the salt as it is. A request's own
    salt never holds NUL (the server rejects it), so no request salt can spell another tenant's."""
    if namespace is None:
        return cache_salt
    return f"\x00tenant\x00{namespace}\x00{cache_salt or ''}"


def tokens_as_uint32(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """A little-endian uint32 copy of the token ids (the bytes that are hashed)."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() > 0xFFFFFFFF):
            raise InvalidRequestError(
                f"token ids must lie in [0, 2**32), got range [{token_ids.min()}, {token_ids.max()}]")
        return token_ids.astype("<u4")
    if type(token_ids) is list and len(token_ids) == 1 and type(token_ids[0]) is int and 0 <= token_ids[0] < 2**32:
        return np.array(token_ids, dtype="<u4")  # a decode step's token: cheaper than the buffer below
    try:
        buffer = array.array("I", token_ids)
    except (OverflowError, TypeError) as error:
        bad = next((t for t in token_ids if not isinstance(t, (int, np.integer)) or not 0 <= t < 2**32), None)
        raise InvalidRequestError(f"token ids must be ints in [0, 2**32), got {bad!r}") from error
    if buffer.itemsize != 4:  # pragma: no cover - no mainstream platform
        return np.asarray(token_ids, dtype="<u4")
    tokens = np.frombuffer(buffer, dtype=np.uint32)
    return tokens if _LITTLE_ENDIAN else tokens.astype("<u4")


def hash_block_tokens(parent: BlockHash, block_tokens: Sequence[int] | np.ndarray | bytes,
                      block_extra_keys: Sequence[str | int] = ()) -> BlockHash:
    """H(parent, tokens, extra_keys): the hash of one block given the hash of the block before it."""
    if not isinstance(block_tokens, bytes):
        block_tokens = tokens_as_uint32(block_tokens).tobytes()
    if block_extra_keys:
        block_tokens += b"\x00extra\x00" + repr(tuple(block_extra_keys)).encode()
    return _sha256(parent + block_tokens).digest()


def chain_hashes(token_bytes: bytes, block_size: int, parent: BlockHash, first_block: int,
                 num_blocks: int) -> list[BlockHash]:
    """Hashes of blocks [first_block, num_blocks) of `token_bytes` (uint32 LE), chained from `parent`."""
    stride = 4 * block_size
    out: list[BlockHash] = []
    append = out.append
    fresh = _EMPTY_SHA256.copy  # copying an empty context is cheaper than creating one
    for start in range(first_block * stride, num_blocks * stride, stride):
        sha = fresh()
        sha.update(parent + token_bytes[start:start + stride])
        parent = sha.digest()
        append(parent)
    return out


def block_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int, cache_salt: str | None = None,
                 extra_keys: Sequence[str | int] = ()) -> list[BlockHash]:
    """The chained hash of every full block of `token_ids` (a partial tail block has none).

    This is the function the router and the offload tiers use; a KV group with pages of
    `m * block_size` tokens names its page j by hash number `(j + 1) * m - 1`.
    """
    if block_size < 1:
        raise InvalidRequestError(f"block_size must be >= 1, got {block_size}")
    tokens = tokens_as_uint32(token_ids)
    return chain_hashes(tokens.tobytes(), block_size, root_hash(cache_salt, extra_keys), 0,
                        len(tokens) // block_size)


class _Memo:
    __slots__ = ("tokens", "hashes")

    def __init__(self, tokens: np.ndarray, hashes: list[BlockHash]):
        self.tokens = tokens
        self.hashes = hashes


class PrefixHashMemo:
    """Hashes a sequence's blocks, reusing the hashes of the longest matching recent sequence.

    Agent turns re-send a growing prefix: the new turn's tokens are compared (in C, via numpy) with
    recent sequences that start with the same first block, and only the blocks past the common
    prefix are hashed. Memory is bounded by `max_sequences` remembered sequences.
    """

    def __init__(self, block_size: int, max_sequences: int = 512, candidates_per_key: int = 4):
        self.block_size = block_size
        self.max_sequences = max_sequences
        self.candidates_per_key = candidates_per_key
        self._by_first_block: OrderedDict[BlockHash, list[_Memo]] = OrderedDict()
        self.blocks_hashed = 0
        self.blocks_reused = 0

    def hashes(self, tokens: np.ndarray, parent: BlockHash, remember: bool = True) -> list[BlockHash]:
        """Chained hashes of all full blocks of `tokens` (uint32 LE) under root `parent`."""
        block_size = self.block_size
        num_blocks = len(tokens) // block_size
        if num_blocks == 0:
            return []
        token_bytes = tokens.tobytes()
        first = _sha256(parent + token_bytes[:4 * block_size]).digest()
        best: _Memo | None = None
        best_blocks = 1  # the first block matched by its hash
        candidates = self._by_first_block.get(first)
        if candidates:
            self._by_first_block.move_to_end(first)
            for memo in candidates:
                most = min(len(memo.tokens) // block_size, num_blocks, len(memo.hashes))
                if best is not None and most <= best_blocks:
                    continue  # it cannot share more blocks than the best so far: no need to compare
                common = _common_full_blocks(memo.tokens, tokens, token_bytes, block_size, len(memo.hashes))
                if best is None or common > best_blocks:
                    best, best_blocks = memo, max(common, 1)
        reused = best.hashes[:best_blocks] if best is not None else [first]
        rest = chain_hashes(token_bytes, block_size, reused[-1], len(reused), num_blocks)
        self.blocks_reused += len(reused) if best is not None else 0
        self.blocks_hashed += len(rest) + (best is None)
        result = reused + rest if rest else reused
        if remember and not (best is not None and best_blocks == num_blocks):
            self.remember(first, tokens, result)  # unless an already-known sequence contains this one
        return result

    def remember(self, first: BlockHash, tokens: np.ndarray, hashes: list[BlockHash]) -> None:
        """Store a sequence; remembered sequences that it extends are dropped (it contains them)."""
        candidates = self._by_first_block.get(first)
        if candidates is None:
            candidates = self._by_first_block[first] = []
            if len(self._by_first_block) > self.max_sequences:
                self._by_first_block.popitem(last=False)
        # Equal chained hashes at the same depth mean equal prefixes.
        candidates[:] = [memo for memo in candidates
                         if not (len(memo.hashes) <= len(hashes) and memo.hashes[-1] == hashes[len(memo.hashes) - 1])]
        candidates.insert(0, _Memo(tokens, hashes))
        del candidates[self.candidates_per_key:]

    def forget_all(self) -> None:
        self._by_first_block.clear()


def _common_full_blocks(a: np.ndarray, b: np.ndarray, b_bytes: bytes, block_size: int, max_blocks: int) -> int:
    """How many leading full blocks `a` and `b` (whose bytes are `b_bytes`) share (at most `max_blocks`)."""
    blocks = min(len(a) // block_size, len(b) // block_size, max_blocks)
    length = blocks * block_size
    if length == 0:
        return 0
    if b_bytes.startswith(a[:length]):  # the usual case, one memcmp: `a` starts `b`
        return blocks
    mismatch = np.flatnonzero(a[:length] != b[:length])
    return blocks if mismatch.size == 0 else int(mismatch[0]) // block_size
