"""The worker side's ledger of the load jobs in flight: which parts (a tier and a KV group) of each job
are still out, which pages failed and why, and when each tier last answered.

A job whose outstanding parts wait on a tier that has not answered (read or written a page, or
failed one) for `timeout_s`, counted from the job's start at the earliest, is given up (a part whose
pages have all been read waits on no tier, only on its copy to the device): the pages of its
outstanding parts fail with reason "timeout", it completes at once, and what a tier thread fetches for it
afterwards is dropped, never written (its pages may belong to another request by then). So a dead
peer costs a waiting request at most `timeout_s`, while a long load from a tier that keeps answering
runs to its end. Host only: never imports jax; tier threads call `answered` and `fetched` and read
`given_up`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agentjax.kv.offload.disk import TierKey

Part = tuple[str, int]  # (tier, KV group): one tier thread's share of a load job
Failure = tuple[str, str]  # (reason for the metrics: missing, checksum, error, degraded, timeout; detail for the log)


@dataclass
class _Job:
    started: float
    outstanding: dict[Part, list]  # part -> its page transfers, until the part reports
    failed: dict[TierKey, Failure] = field(default_factory=dict)
    fetched: set = field(default_factory=set)  # parts whose pages are all read (a tier thread adds them)
    given_up: bool = False


class InFlightLoads:
    """Load jobs whose remote parts (disk, Mooncake) have not all reported, and the tiers' last answers."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s
        self.clock = clock
        self._jobs: dict[int, _Job] = {}
        self._answered: dict[str, float] = {}  # tier -> when its thread last finished a page

    def answered(self, tier: str) -> None:
        """A tier thread finished a page (loaded, stored or failed): the tier is alive."""
        self._answered[tier] = self.clock()

    def fetched(self, job_id: int, part: Part) -> None:
        """A tier thread has read every page of `part`; what is left is host work (the device copy)."""
        job = self._jobs.get(job_id)
        if job is not None:
            job.fetched.add(part)

    def __len__(self) -> int:
        return len(self._jobs)

    def open(self, job_id: int, parts: dict[Part, list]) -> None:
        """A job whose `parts` (part -> page transfers) go to tier threads, from now."""
        self._jobs[job_id] = _Job(self.clock(), dict(parts))

    def given_up(self, job_id: int) -> bool:
        job = self._jobs.get(job_id)
        return job is not None and job.given_up

    def part_done(self, job_id: int, part: Part, failed: dict[TierKey, Failure]) -> dict[TierKey, Failure] | None:
        """Record a part's outcome. Returns the job's failed pages when this was its last part; None while
        parts are out, and always for a job given up (it completed at its deadline)."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        job.outstanding.pop(part, None)
        if job.given_up:
            if not job.outstanding:
                del self._jobs[job_id]
            return None
        job.failed.update(failed)
        if job.outstanding:
            return None
        del self._jobs[job_id]
        return job.failed

    def expire(self) -> list[tuple[int, dict[TierKey, Failure], dict[str, int]]]:
        """Give up the jobs that wait on a tier silent for `timeout_s`: `(job id, its failed pages, pages
        per silent tier)` for each. All their outstanding pages fail with reason "timeout" (the request
        goes on without them); only the silent tiers are to blame."""
        now = self.clock()
        expired = []
        for job_id, job in self._jobs.items():
            if job.given_up:
                continue
            silent = {tier for tier, group in job.outstanding if (tier, group) not in job.fetched
                      and now - max(job.started, self._answered.get(tier, job.started)) >= self.timeout_s}
            if not silent:
                continue
            job.given_up = True
            late: dict[str, int] = {}
            for (tier, group), transfers in job.outstanding.items():
                if tier in silent:
                    detail = f"the {tier} tier did not answer for {self.timeout_s:g} s"
                    late[tier] = late.get(tier, 0) + len(transfers)
                else:
                    detail = f"given up with the rest of its load ({', '.join(sorted(silent))} silent)"
                for transfer in transfers:
                    job.failed[(group, transfer.key)] = ("timeout", detail)
            expired.append((job_id, dict(job.failed), late))
        return expired
