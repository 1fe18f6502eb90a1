"""Benchmark: the KV offload tiers side by side (issue 14, acceptance 4), written to BENCHMARKS.md.

Parts (`--parts`, all by default):
  copy       host<->device page copies through the offload worker (jitted gathers into pinned_host), GB/s
  disk       the disk tier's page files (CRC-32, temp file then rename), write and read GB/s
  mooncake   Mooncake Store put/get GB/s against a real master on loopback
  scheduler  the scheduler's step time with the offload connector on and off (no model)
  kv-manager scripts/bench_kv_manager.py's harness with the tiers' lookups and store preparation on,
             against vLLM's manager in the same process (needs the vLLM venv of that harness)
  ttft       SmolLM2's cached-turn TTFT with a 4K-token history: the prefix from the host tier,
             recomputed, and (for reference) still on the device

    python scripts/bench_kv_offload.py --parts copy disk mooncake scheduler ttft kv-manager
A benchmark, not a test: CI does not run it.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
SECTION = "## KV offload tiers (issue 14)"
PARTS = ("copy", "disk", "mooncake", "scheduler", "kv-manager", "ttft")


def _load() -> str:
    return open("/proc/loadavg").read().split()[0]


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _smollm2_config():
    from agentjax.models import load_model

    return load_model(None)


# -- copy -------------------------------------------------------------------------------------------
def bench_copy(args, model) -> list[str]:
    import jax
    import numpy as np

    from agentjax.kv import KVCacheManager
    from agentjax.kv.offload.connector import KVTransfers, LoadJob, OffloadConnector, PageTransfer, StoreJob
    from agentjax.kv.offload.host import HostPageIndex
    from agentjax.runner.offload_worker import OffloadWorker

    cfg = model[0]
    pages = args.pages
    kv = KVCacheManager.from_model_config(cfg, 2 * pages + 2, 16)
    connector = OffloadConnector(kv, host=HostPageIndex(1, pages + 1))
    worker = OffloadWorker(cfg, 16, connector, host_slots=pages + 1)
    runner = type("Runner", (), {})()
    runner.kv_pages = tuple(jax.numpy.ones(b.shape, b.dtype) for b in cfg.new_kv_pages(2 * pages + 2, 16))
    page_bytes = worker.specs[0].bytes_per_page
    keys = [bytes([i % 256, i // 256]) * 16 for i in range(pages)]
    store_job = StoreJob(1, 0, keys, list(range(1, pages + 1)), host_slots=list(range(1, pages + 1)))
    loads = [PageTransfer(0, key, pages + 1 + i, "host", slot=1 + i) for i, key in enumerate(keys)]

    def store():
        worker.run(runner, KVTransfers(stores=[store_job]))
        jax.block_until_ready(worker.host_pools[0])

    def load():
        worker.run(runner, KVTransfers(loads=[LoadJob(2, "r", loads)]))
        jax.block_until_ready(runner.kv_pages[0])
        connector.results.drain()

    store(), load()  # compile
    gigabytes = pages * page_bytes / 1e9
    device_to_host = gigabytes / _median_time(store, args.repeats)
    host_to_device = gigabytes / _median_time(load, args.repeats)
    worker.close()
    memories = ", ".join(str(m.kind) for m in jax.devices()[0].addressable_memories())
    return [f"| device -> host pool (gather + put, pinned_host) | {pages} x {page_bytes / 2**10:.0f} KiB | "
            f"{device_to_host:.2f} |",
            f"| host pool -> device (gather + scatter) | {pages} x {page_bytes / 2**10:.0f} KiB | "
            f"{host_to_device:.2f} |",
            f"<!-- {jax.devices()[0].platform} memories: {memories} -->"]


# -- disk -------------------------------------------------------------------------------------------
def bench_disk(args, page_bytes: int) -> list[str]:
    import numpy as np

    from agentjax.kv.offload.disk import DiskTier

    directory = Path(args.disk_dir or tempfile.mkdtemp(prefix="kv-bench-"))
    tier = DiskTier(directory, "bench", 1 << 40)
    payload = np.random.default_rng(0).integers(0, 255, page_bytes, dtype=np.uint8)
    keys = [(0, i.to_bytes(32, "little")) for i in range(args.pages)]
    gigabytes = args.pages * page_bytes / 1e9
    write = _median_time(lambda: [tier.write(k, payload) for k in keys], args.repeats)
    read = _median_time(lambda: [tier.read(k, page_bytes) for k in keys], args.repeats)
    cold = ""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        started = time.perf_counter()
        for key in keys:
            tier.read(key, page_bytes)
        cold = f"{gigabytes / (time.perf_counter() - started):.2f}"
    except OSError:
        cold = "n/a (cannot drop the page cache)"
    for key in keys:
        tier.drop(key)
    return [f"| disk write (header, CRC-32, temp file, rename) | {args.pages} x {page_bytes / 2**10:.0f} KiB | "
            f"{gigabytes / write:.2f} |",
            f"| disk read + CRC-32 check, page cache warm | same | {gigabytes / read:.2f} |",
            f"| disk read + CRC-32 check, page cache dropped | same | {cold} |"]


# -- mooncake ---------------------------------------------------------------------------------------
def bench_mooncake(args, page_bytes: int) -> list[str]:
    import numpy as np

    from agentjax.kv.offload.mooncake import MooncakeMaster, MooncakeTier

    payload = np.random.default_rng(1).integers(0, 255, page_bytes, dtype=np.uint8)
    keys = [(0, i.to_bytes(32, "little")) for i in range(args.pages)]
    gigabytes = args.pages * page_bytes / 1e9
    with MooncakeMaster() as master:
        tier = MooncakeTier(master.address, f"bench{time.time_ns()}", 4 * args.pages * page_bytes)
        started = time.perf_counter()
        for key in keys:
            tier.put(key, payload)
        put = gigabytes / (time.perf_counter() - started)
        get = gigabytes / _median_time(lambda: [tier.get(k, page_bytes) for k in keys], args.repeats)
        tier.close()
    return [f"| Mooncake put (one client, TCP on loopback) | {args.pages} x {page_bytes / 2**10:.0f} KiB | "
            f"{put:.2f} |",
            f"| Mooncake get | same | {get:.2f} |"]


def _split(section: str) -> tuple[str, list[str]]:
    """A section's text before its first `### ` subsection, and the subsections (each from its heading)."""
    head, *subsections = section.split("\n### ")
    return head.rstrip("\n") + "\n", ["### " + sub.rstrip("\n") + "\n" for sub in subsections]


def merge_section(current: str | None, preamble: str | None, subsections: list[str]) -> str:
    """The section with `preamble` (None: the current one's) and each of `subsections` in place of the
    current subsection of the same heading; the parts not run this time stay as they were."""
    old_preamble, old_subsections = _split(current) if current else (None, [])
    fresh = {sub.splitlines()[0]: sub for sub in subsections}
    merged = [fresh.pop(sub.splitlines()[0], sub) for sub in old_subsections] + list(fresh.values())
    return "\n".join([(preamble or old_preamble or SECTION + "\n").rstrip("\n") + "\n", *merged])


def _current_section(path: Path) -> str | None:
    from benchmarks_md import section_lines

    lines = section_lines(SECTION, path)
    return "\n".join(lines) + "\n" if lines else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--pages", type=int, default=128, help="pages per copy, disk and Mooncake measurement")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--disk-dir", default=None, help="where the disk tier writes (default: a temp dir)")
    parser.add_argument("--history-tokens", type=int, default=4096)
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    args = parser.parse_args(argv)
    from bench_kv_offload_parts import bench_kv_manager, bench_scheduler, bench_ttft
    from benchmarks_md import BENCHMARKS

    started_load = _load()
    model = _smollm2_config() if {"copy", "ttft", "disk", "mooncake"} & set(args.parts) else None
    from agentjax.kv.cache_layout import kv_buffer_specs

    page_bytes = kv_buffer_specs(model[0], 16)[0].bytes_per_page if model else 737_280
    rows = []
    if "copy" in args.parts:
        rows += bench_copy(args, model)
    if "disk" in args.parts:
        rows += bench_disk(args, page_bytes)
    if "mooncake" in args.parts:
        rows += bench_mooncake(args, page_bytes)
    subsections = []
    if "scheduler" in args.parts:
        subsections.append(bench_scheduler(args))
    if "kv-manager" in args.parts:
        subsections.append(bench_kv_manager(args))
    if "ttft" in args.parts:
        subsections.append(bench_ttft(args, model))
    command = "python scripts/bench_kv_offload.py " + " ".join(argv if argv is not None else sys.argv[1:])
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs shared with other agents, Python "
               f"{platform.python_version()}, run on {time.strftime('%Y-%m-%d')}; load average {started_load} at the "
               f"start and {_load()} at the end")
    preamble = None
    if rows:
        preamble = "\n".join([
            SECTION, "", f"Written by `{command.strip()}`.",
            f"Machine: {machine}. On this CPU-only machine `device` and `pinned_host` memory are both host RAM: the "
            "copy rows measure the jitted gather/scatter path, not PCIe.", "",
            "| transfer | pages | GB/s (median) |", "|---|---|---|", *[r for r in rows if r.startswith("|")]]) + "\n"
    # Each subsection says which run wrote it: a run of some parts leaves the others as they were.
    stamp = f"Written by `{command.strip()}`; {machine}."
    subsections = ["\n".join([lines[0], "", stamp, *lines[1:]]).rstrip("\n") + "\n" for lines in subsections]
    body = merge_section(_current_section(BENCHMARKS), preamble, subsections)
    print(body)
    if not args.no_write:
        from benchmarks_md import write_section

        write_section(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
