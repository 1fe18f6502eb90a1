"""The worker side's ledger of load jobs in flight (agentjax/kv/offload/inflight.py): a job completes when
its last part reports, with every part's failures; once a tier it waits on has not answered for the
timeout it is given up at once, its outstanding pages failed as "timeout" (only silent tiers blamed),
and the parts that report later are dropped; a tier that keeps answering keeps its loads going."""
from __future__ import annotations

from agentjax.kv.offload.inflight import InFlightLoads
from agentjax.kv.offload.transfers import PageTransfer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _transfers(tier: str, group: int, *keys: bytes) -> list[PageTransfer]:
    return [PageTransfer(group, key, 5 + i, tier) for i, key in enumerate(keys)]


def test_a_job_completes_with_its_parts_failures_when_the_last_part_reports():
    loads = InFlightLoads(1.0, Clock())
    loads.open(7, {("disk", 0): _transfers("disk", 0, b"a", b"b"), ("disk", 1): _transfers("disk", 1, b"c")})
    assert loads.part_done(7, ("disk", 0), {(0, b"b"): ("missing", "gone")}) is None  # a part still out
    assert loads.part_done(7, ("disk", 1), {}) == {(0, b"b"): ("missing", "gone")}
    assert len(loads) == 0 and loads.expire() == []


def test_a_job_past_its_deadline_is_given_up_and_its_late_parts_are_dropped():
    clock = Clock()
    loads = InFlightLoads(1.0, clock)
    loads.open(3, {("disk", 0): _transfers("disk", 0, b"a"), ("mooncake", 0): _transfers("mooncake", 0, b"b", b"c")})
    assert loads.part_done(3, ("disk", 0), {}) is None
    clock.now += 0.99
    assert loads.expire() == []
    clock.now += 0.02
    [(job_id, failed, late)] = loads.expire()
    assert job_id == 3 and late == {"mooncake": 2}
    assert set(failed) == {(0, b"b"), (0, b"c")} and {reason for reason, _ in failed.values()} == {"timeout"}
    assert "mooncake tier did not answer for 1 s" in failed[(0, b"b")][1]
    assert loads.given_up(3) and loads.expire() == []  # given up once
    assert loads.part_done(3, ("mooncake", 0), {}) is None  # what it fetched at last is dropped
    assert len(loads) == 0 and not loads.given_up(3)


def test_an_expired_job_keeps_the_failures_its_finished_parts_reported():
    clock = Clock()
    loads = InFlightLoads(0.5, clock)
    loads.open(1, {("disk", 0): _transfers("disk", 0, b"a"), ("disk", 1): _transfers("disk", 1, b"b")})
    loads.part_done(1, ("disk", 0), {(0, b"a"): ("checksum", "CRC-32 mismatch")})
    clock.now += 1
    [(_, failed, late)] = loads.expire()
    assert failed == {(0, b"a"): ("checksum", "CRC-32 mismatch"), (1, b"b"): ("timeout", failed[(1, b"b")][1])}
    assert late == {"disk": 1}


def test_a_tier_that_keeps_answering_keeps_a_long_load_going_and_only_silent_tiers_are_blamed():
    clock = Clock()
    loads = InFlightLoads(1.0, clock)
    loads.open(5, {("disk", 0): _transfers("disk", 0, b"a"), ("mooncake", 0): _transfers("mooncake", 0, b"b")})
    for _ in range(5):  # 4 s of pages from both tiers (another job's, or this one's): nothing expires
        clock.now += 0.8
        loads.answered("disk")
        loads.answered("mooncake")
        assert loads.expire() == []
    clock.now += 0.5
    loads.answered("disk")
    clock.now += 0.5  # Mooncake silent for 1 s now; the disk answered 0.5 s ago
    [(_, failed, late)] = loads.expire()
    assert late == {"mooncake": 1}  # the disk is not blamed
    assert failed[(0, b"a")][0] == "timeout" and "mooncake silent" in failed[(0, b"a")][1]


def test_a_part_whose_pages_are_all_read_waits_on_no_tier():
    clock = Clock()
    loads = InFlightLoads(1.0, clock)
    loads.open(9, {("disk", 0): _transfers("disk", 0, b"a", b"b")})
    loads.answered("disk")
    loads.fetched(9, ("disk", 0))  # its device copy is under way: slow on a busy host, but no tier's fault
    clock.now += 5
    assert loads.expire() == []
    assert loads.part_done(9, ("disk", 0), {}) == {}
