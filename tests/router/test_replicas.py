"""Replica URLs, and the prefix index the router keeps from each replica's KV events."""
from __future__ import annotations

import pytest

from agentjax.errors import RouterConfigError
from agentjax.router.replicas import PrefixIndex, build_replicas


def test_replica_urls_are_normalized_and_checked():
    replicas = build_replicas(["http://127.0.0.1:8001/"], prefill=["http://h:2"], decode=["https://h:3"])
    assert [(r.url, r.role) for r in replicas] == [("http://127.0.0.1:8001", "mixed"), ("http://h:2", "prefill"),
                                                  ("https://h:3", "decode")]
    with pytest.raises(RouterConfigError, match="at least one replica"):
        build_replicas([])
    with pytest.raises(RouterConfigError, match="must look like http://HOST:PORT"):
        build_replicas(["127.0.0.1:8001"])
    with pytest.raises(RouterConfigError, match="must not have a path"):
        build_replicas(["http://h:1/v1"])
    with pytest.raises(RouterConfigError, match="named twice"):
        build_replicas(["http://h:1"], decode=["http://h:1/"])


def events_answer(epoch: str, next_change: int, events: list, snapshot: bool = False, hit_rule: str = "prefix") -> dict:
    return {"epoch": epoch, "block_size": 16, "hashes_per_page": 1, "hit_rule": hit_rule, "next": next_change,
            "snapshot": snapshot, "events": events}


def test_the_prefix_index_follows_stored_and_removed_events_and_resets_on_a_new_epoch():
    index = PrefixIndex()
    index.apply(events_answer("e1", 3, [["+", "a"], ["+", "b"], ["+", "c"]]))
    index.apply(events_answer("e1", 4, [["-", "b"]]))
    assert index.cached == {"a", "c"} and index.next_change == 4
    assert index.cached_keys(["a", "b", "c"]) == 1  # full attention: the leading run only
    index.apply(events_answer("e2", 1, [["+", "z"]], snapshot=True))  # the replica restarted
    assert index.cached == {"z"} and index.epoch == "e2"


def test_a_group_without_the_prefix_rule_scores_its_deepest_cached_key():
    index = PrefixIndex()
    index.apply(events_answer("e", 1, [["+", "c"]], hit_rule="checkpoint"))
    assert index.cached_keys(["a", "b", "c", "d"]) == 3
