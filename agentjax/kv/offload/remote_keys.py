"""What the connector knows the Mooncake pool holds: the keys its stores wrote and its probes found.

A bounded set, least recently confirmed first out. A key here is a hint, never a promise: another
replica or the pool's own eviction may have removed the object, so a load from it can still fail
(and then forgets the key). Host only: never imports jax.
"""
from __future__ import annotations

from collections import OrderedDict

from agentjax.kv.offload.disk import TierKey

MAX_KNOWN_KEYS = 1 << 20


class RemoteKeys:
    """Keys the Mooncake pool is believed to hold, at most `capacity` of them."""

    def __init__(self, capacity: int = MAX_KNOWN_KEYS):
        self.capacity = capacity
        self._keys: OrderedDict[TierKey, None] = OrderedDict()

    def __contains__(self, key: TierKey) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def remember(self, key: TierKey) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def forget(self, key: TierKey) -> None:
        self._keys.pop(key, None)

    def clear(self) -> None:
        self._keys.clear()
