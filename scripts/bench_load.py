"""Benchmark: streaming a sharded checkpoint onto 8 virtual CPU devices (sharding/streaming_load.py).

For each layout (TP-8, DEP-8) a fresh process loads the checkpoint with a cold page cache (every file
`posix_fadvise(DONTNEED)` first) and reports the load time, the read rate against the disk's sequential
read rate of the same files (also cold, one thread, 16 MiB reads), and its peak RSS less the bytes of the
device arrays it holds (CPU devices live in host memory). With `--two-processes`, two processes of 4
devices each (jax.distributed) load one TP-8 layout, and each reports how many of the checkpoint's bytes it
read (its own pread count, and /proc/self/io's rchar and read_bytes over the load). Writes the
"## Streaming checkpoint loads" section of BENCHMARKS.md with `--write`. A benchmark, not a test.

    python scripts/make_quantized_checkpoints.py medium --out /data/ckpt/nvfp4
    python scripts/bench_load.py --checkpoint /data/ckpt/nvfp4 --two-processes --write
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

from benchmarks_md import publish

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Streaming checkpoint loads"
LAYOUTS = {"tp8": dict(tensor_parallel_size=8), "dep8": dict(data_parallel_size=8, enable_expert_parallel=True)}


def files_of(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.glob("*.safetensors"))


def drop_cache(files: list[Path]) -> None:
    os.sync()
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_rate(files: list[Path]) -> float:
    """Bytes per second reading every file start to end, one thread, cold cache."""
    drop_cache(files)
    buffer, total = bytearray(16 * 2**20), 0
    started = time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total / (time.perf_counter() - started)


def io() -> dict[str, int]:
    return {k: int(v) for k, v in (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())}


def child(args) -> None:
    """One loading process: prints a JSON line of its figures."""
    import jax

    if args.process_id is not None:
        jax.distributed.initialize(args.coordinator, 2, args.process_id)
    from agentjax.config import EngineConfig
    from agentjax.models.params import expected_shapes
    from checkpoints.hf import load_hf
    from checkpoints.lazy_reads import READS
    from sharding.streaming_load import load_params

    parallel = EngineConfig(**LAYOUTS[args.layout]).parallel
    before, started = io(), time.perf_counter()
    cfg, recipes, _ = load_hf(args.checkpoint, expected_shapes, lazy=True)
    params = load_params(cfg, recipes, parallel=parallel, threads=args.threads)
    jax.block_until_ready(jax.tree.leaves(params))
    seconds, after = time.perf_counter() - started, io()
    held = sum(shard.data.nbytes for leaf in jax.tree.leaves(params) for shard in leaf.addressable_shards)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps({"seconds": seconds, "pread": READS.bytes_read, "peak_rss": peak, "held": held,
                                  "rchar": after["rchar"] - before["rchar"],
                                  "read_bytes": after["read_bytes"] - before["read_bytes"]}), flush=True)


def spawn(args, layout: str, devices: int, process_id: int | None = None, coordinator: str = "") -> subprocess.Popen:
    command = [sys.executable, __file__, "--child", "--checkpoint", str(args.checkpoint), "--layout", layout,
               "--threads", str(args.threads)]
    if process_id is not None:
        command += ["--process-id", str(process_id), "--coordinator", coordinator]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def result_of(process: subprocess.Popen) -> dict:
    output = process.communicate(timeout=3600)[0]
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    if process.returncode or not lines:
        raise SystemExit(f"a loading process failed:\n{output[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--two-processes", action="store_true")
    parser.add_argument("--write", action="store_true", help="write the BENCHMARKS.md section")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="tp8", help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        sys.path.insert(0, str(REPO))
        child(args)
        return 0
    files = files_of(args.checkpoint)
    total = sum(f.stat().st_size for f in files)
    load_before = os.getloadavg()
    disk = sequential_rate(files)
    print(f"checkpoint {total / 1e9:.2f} GB in {len(files)} files; sequential read {disk / 1e9:.2f} GB/s (cold)")
    rows = []
    for layout in args.layouts:
        drop_cache(files)
        r = result_of(spawn(args, layout, 8))
        rate = r["pread"] / r["seconds"]
        rows.append(f"| {layout}, 1 process x 8 devices | {r['seconds']:.1f} | {r['pread'] / 1e9:.2f} | "
                    f"{rate / 1e9:.2f} ({rate / disk:.0%} of disk) | {r['peak_rss'] / 1e9:.2f} | {r['held'] / 1e9:.2f} | "
                    f"{(r['peak_rss'] - r['held']) / 1e9:.2f} |")
        print(rows[-1], flush=True)
    shares = []
    if args.two_processes:
        drop_cache(files)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{sock.getsockname()[1]}"
        pair = [spawn(args, "tp8", 4, pid, address) for pid in (0, 1)]
        for pid, r in enumerate(result_of(p) for p in pair):
            shares.append(f"| process {pid} of 2 (4 devices, tp8) | {r['seconds']:.1f} | {r['pread'] / total:.1%} | "
                          f"{r['rchar'] / total:.1%} | {r['read_bytes'] / total:.1%} | "
                          f"{(r['peak_rss'] - r['held']) / 1e9:.2f} |")
            print(shares[-1], flush=True)
    load_after = os.getloadavg()
    body = [SECTION, "",
            f"`python scripts/bench_load.py --checkpoint DIR{' --two-processes' if args.two_processes else ''} --write` "
            f"on {datetime.date.today()}, {platform.machine()} with {os.cpu_count()} CPUs; checkpoint from "
            f"`scripts/make_quantized_checkpoints.py medium` ({total / 1e9:.2f} GB in {len(files)} shards, MiniMax-M3 "
            f"shaped, NVFP4 matrices, bfloat16 embeddings). Load average {load_before[0]:.1f} before, "
            f"{load_after[0]:.1f} after: the machine is shared, so rates are indicative (disk reads suffer less than "
            f"CPU). Cold page cache (posix_fadvise DONTNEED) before every run; the disk reads the same files "
            f"sequentially at {disk / 1e9:.2f} GB/s. {args.threads} reading threads, slabs of at most 64 MiB: the "
            f"host holds at most about threads x 3 x 64 MiB of checkpoint data at once.", "",
            "| layout | load s | GB read | read rate GB/s | peak RSS GB | device arrays GB | RSS less device arrays GB |",
            "|---|---|---|---|---|---|---|", *rows]
    if shares:
        body += ["", "Two processes (jax.distributed on one machine, one TP-8 layout): the share of the checkpoint's "
                 "bytes each read: its own pread count, and /proc/self/io over the load (rchar: bytes its read calls "
                 "returned; read_bytes: bytes fetched from the disk, lower when the other process had the page "
                 "cached).", "",
                 "| process | load s | pread / checkpoint | rchar / checkpoint | read_bytes / checkpoint | "
                 "RSS less device arrays GB |", "|---|---|---|---|---|---|", *shares]
    publish("\n".join(body) + "\n", args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
