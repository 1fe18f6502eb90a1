"""Soak: N minutes of the AgentX dev-trace replay through a real `agentjax serve` with the host and disk
KV tiers on and a small device pool, with random client disconnects and a tier fault every few minutes.

It starts the server itself, replays `../shared/traces/agentx-dev` with closed-loop lanes
(`agentjax.bench.agentx`), drops a fraction of the streams part-way (the client closes the
connection), and every `--fault-every-s` damages the disk tier's most recently written page files in
turn: flipped bytes, truncation, deletion (with `--mooncake`, also a Mooncake master killed and
restarted on its port). /metrics and the server's resident memory are sampled throughout. It passes
when, after the replay, no request is stuck (running and waiting back to 0), the KV pages in use are
back at their value before the replay, the resident memory is within 10% of its value after the
warm-up, and SIGTERM ends the server with status 0. Its figures go to BENCHMARKS.md.

    python scripts/soak_serve.py --minutes 30
    python scripts/soak_serve.py --minutes 3 --warmup-s 60 --model preset:tiny-dense --no-write
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from local_server import free_port, start_healthy  # noqa: E402
from agentjax.bench.agentx import DEFAULT_TRACES, AgentxConfig, AgentxRun, load_sessions  # noqa: E402
from agentjax.bench.backends import HttpBackend, TurnRequest, _failed  # noqa: E402

SECTION = "## Soak: AgentX replay through `agentjax serve` with tier faults and disconnects (issue 32)"
DISK_FAULTS = ("corrupt", "truncate", "delete")
RSS_TOLERANCE = 0.10


# -- the pieces a test can check without a server ------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} (labels as written; unlabelled names as they are)."""
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


def total(samples: dict[str, float], name: str) -> float:
    """The sum of a family's samples (every label set)."""
    return sum(value for key, value in samples.items() if key == name or key.startswith(name + "{"))


def damage_page_files(disk_dir: Path, kind: str, count: int, rng: np.random.Generator) -> int:
    """Damage the `count` most recently written page files under `disk_dir` (the pages the next turns of
    the running sessions are likely to load): flip a byte, truncate, or delete. Returns how many."""
    files = sorted(disk_dir.glob("*/g*/*.kvp"), key=lambda path: path.stat().st_mtime_ns)[-count:]
    damaged = 0
    for path in files:
        try:
            data = bytearray(path.read_bytes())
            if kind == "corrupt":
                data[int(rng.integers(64, len(data)))] ^= 0x20
                path.write_bytes(bytes(data))
            elif kind == "truncate":
                path.write_bytes(bytes(data[: len(data) // 2]))
            else:
                path.unlink()
        except (FileNotFoundError, ValueError):  # the tier evicted it meanwhile
            continue
        damaged += 1
    return damaged


def resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class DisconnectingBackend(HttpBackend):
    """`HttpBackend` whose client drops a fraction of its streams after a few chunks (or none)."""

    def __init__(self, *args, disconnect_rate: float, seed: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.disconnect_rate = disconnect_rate
        self.rng = np.random.default_rng(seed)
        self.disconnects = 0

    async def send(self, request: TurnRequest):
        if self.rng.random() >= self.disconnect_rate:
            return await super().send(request)
        start, keep = time.perf_counter(), int(self.rng.integers(0, 4))  # chunks read before hanging up
        try:
            stream = await self.client.completions.create(
                model=self.model, prompt=request.prompt, max_tokens=request.max_tokens, stream=True,
                temperature=0.0, extra_body={"ignore_eos": True, "session_id": request.session_id,
                                             "agent_hints": request.hints})
            seen = 0
            async for _ in stream:
                seen += 1
                if seen > keep:
                    break
            await stream.close()
        except Exception as error:  # noqa: BLE001 - a failed request is a record, not a crash
            return _failed(request, start, error)
        self.disconnects += 1
        return _failed(request, start, "disconnected by the soak client")


# -- the run -------------------------------------------------------------------------------------
def start_server(args, work: Path, port: int, mooncake_address: str | None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "agentjax.cli", "--log-level", "INFO", "serve", "--model", args.model,
            "--port", str(port), "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len",
            str(args.max_model_len), "--host-cache-gb", str(args.host_cache_gb), "--disk-cache-dir",
            str(work / "kv"), "--disk-cache-gb", str(args.disk_cache_gb)]
    if mooncake_address:
        argv += ["--mooncake-master", mooncake_address, "--mooncake-segment-gb", "0.25"]
    return start_healthy(argv, port, work / "server.log", REPO, timeout_s=600)


class Soak:
    def __init__(self, args, work: Path, port: int, process: subprocess.Popen, master=None):
        self.args, self.work, self.port, self.process, self.master = args, work, port, process, master
        self.url = f"http://127.0.0.1:{port}"
        self.samples: list[tuple[float, dict[str, float], int]] = []  # (seconds, metrics, RSS)
        self.faults: dict[str, int] = {}
        self.files_damaged = 0
        self.rng = np.random.default_rng(args.seed)
        self.start = time.monotonic()

    def sample(self) -> dict[str, float]:
        metrics = parse_metrics(httpx.get(f"{self.url}/metrics", timeout=30).text)
        self.samples.append((time.monotonic() - self.start, metrics, resident_bytes(self.process.pid)))
        return metrics

    async def sampler(self, stop: asyncio.Event) -> None:
        next_report = 60.0
        while not stop.is_set():
            metrics = await asyncio.to_thread(self.sample)
            seconds, _, rss = self.samples[-1]
            if seconds >= next_report:
                next_report += 60.0
                print(f"[soak] {seconds:6.0f}s running {total(metrics, 'agentjax:num_requests_running'):.0f} waiting "
                      f"{total(metrics, 'agentjax:num_requests_waiting'):.0f} load failures "
                      f"{total(metrics, 'agentjax:kv_offload_load_failures_total'):.0f} RSS {rss / 2**30:.2f} GiB",
                      file=sys.stderr, flush=True)
            try:
                await asyncio.wait_for(stop.wait(), self.args.sample_every_s)
            except asyncio.TimeoutError:
                pass

    async def injector(self, stop: asyncio.Event) -> None:
        kinds = list(DISK_FAULTS) + (["mooncake_master"] if self.master is not None else [])
        for index in range(1_000_000):
            try:
                await asyncio.wait_for(stop.wait(), self.args.fault_every_s)
                return
            except asyncio.TimeoutError:
                pass
            kind = kinds[index % len(kinds)]
            if kind == "mooncake_master":
                await asyncio.to_thread(self.restart_master)
            else:
                self.files_damaged += damage_page_files(self.work / "kv", kind, self.args.fault_files, self.rng)
            self.faults[kind] = self.faults.get(kind, 0) + 1
            print(f"[soak] {time.monotonic() - self.start:6.0f}s fault: {kind}", file=sys.stderr, flush=True)

    def restart_master(self) -> None:
        from agentjax.kv.offload.mooncake import MooncakeMaster

        port = self.master.port
        self.master.kill()
        time.sleep(5)
        self.master = MooncakeMaster(port=port, log_path=self.work / "master.log")

    async def replay(self, config: AgentxConfig, sessions: list) -> tuple[list, int, float]:
        """The replay's request records (all of them, warm-up included), the client's disconnects, and
        when (seconds from the soak's start) every lane had finished its warm-up request."""
        backend = DisconnectingBackend(self.url, disconnect_rate=self.args.disconnect_rate, seed=self.args.seed)
        stop = asyncio.Event()
        helpers = [asyncio.create_task(self.sampler(stop)), asyncio.create_task(self.injector(stop))]
        run = AgentxRun(config, sessions, backend, clock=time.monotonic)
        try:
            await run.run()
        finally:
            stop.set()
            await asyncio.gather(*helpers)
        return [record for record, _ in run.records], backend.disconnects, run.t_profile - self.start

    def drain(self) -> dict[str, float]:
        """Wait until nothing runs, waits or loads (at most `--drain-s`); the last sample."""
        deadline = time.monotonic() + self.args.drain_s
        while True:
            metrics = self.sample()
            busy = sum(total(metrics, name) for name in ("agentjax:num_requests_running",
                                                          "agentjax:num_requests_waiting",
                                                          "agentjax:kv_offload_requests_loading"))
            if not busy or time.monotonic() > deadline:
                return metrics
            time.sleep(1)


def verdict(soak: Soak, baseline: dict, final: dict, warm_rss: int) -> dict:
    final_rss = soak.samples[-1][2]
    stuck = total(final, "agentjax:num_requests_running") + total(final, "agentjax:num_requests_waiting")
    used = total(final, "agentjax:kv_cache_usage_perc")
    return {"stuck": stuck, "kv_usage_start": total(baseline, "agentjax:kv_cache_usage_perc"), "kv_usage_end": used,
            "rss_warm": warm_rss, "rss_end": final_rss, "rss_ratio": final_rss / warm_rss if warm_rss else float("nan"),
            "pass": {"no stuck request": stuck == 0,
                     "pages at baseline": used == total(baseline, "agentjax:kv_cache_usage_perc"),
                     "memory within 10%": final_rss <= (1 + RSS_TOLERANCE) * warm_rss}}


def longest_stall(samples: list, after_s: float) -> float:
    """The longest stretch of samples after `after_s` with requests waiting, none running and no token
    computed (a wedge grows it without bound; a long compile step can show as one too)."""
    longest, last_moving, progress = 0.0, None, None
    for seconds, metrics, _ in samples:
        done = total(metrics, "agentjax:generation_tokens_total") + total(metrics, "agentjax:prompt_tokens_computed_total")
        stalled = (seconds >= after_s and done == progress and total(metrics, "agentjax:num_requests_running") == 0
                   and total(metrics, "agentjax:num_requests_waiting") > 0)
        if not stalled:
            last_moving = seconds
        elif last_moving is not None:
            longest = max(longest, seconds - last_moving)
        progress = done
    return longest


def labelled(samples: dict[str, float], name: str) -> dict[str, int]:
    """A family's non-zero samples by their label values: {"disk checksum": 3, ...}."""
    out = {}
    for key, value in samples.items():
        if key.startswith(name + "{") and value:
            out[" ".join(re.findall(r'="([^"]*)"', key))] = int(value)
    return out


def markdown(args, command: str, records: list, disconnects: int, soak: Soak, result: dict, final: dict,
             exit_status: int, loads: tuple[str, str], warm_s: float) -> str:
    """The run's BENCHMARKS.md row."""
    failures = labelled(final, "agentjax:kv_offload_load_failures_total")
    loaded = labelled(final, "agentjax:kv_offload_pages_loaded_total")
    checks = ", ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in result["pass"].items())
    failed = sum(record.error is not None for record in records)
    faults = ", ".join(f"{kind} x{count}" for kind, count in soak.faults.items()) or "none"
    return (f"| {time.strftime('%Y-%m-%d')} | {args.minutes:g} | `{args.model}` | {loads[0]} / {loads[1]} | "
            f"{len(records) - failed} | {failed} ({disconnects} disconnects) | {faults} ({soak.files_damaged} files) | "
            f"{sum(failures.values())} ({', '.join(f'{k} {v}' for k, v in failures.items()) or 'none'}) | "
            f"{', '.join(f'{k} {v}' for k, v in loaded.items()) or 'none'} | {longest_stall(soak.samples, warm_s):.0f} | "
            f"{result['stuck']:.0f} | {result['kv_usage_start']:.3f} -> {result['kv_usage_end']:.3f} | "
            f"{result['rss_warm'] / 2**30:.2f} -> {result['rss_end'] / 2**30:.2f} GiB ({result['rss_ratio']:.3f}) | "
            f"{exit_status} | {checks} | `{command}` |")


def write_row(row: str, command: str, machine: str, path: Path) -> str:
    from benchmarks_md import section_lines, write_section

    rows = [line for line in section_lines(SECTION, path) if re.match(r"^\| \d{4}-\d\d-\d\d ", line)]
    body = "\n".join([
        SECTION, "",
        "`scripts/soak_serve.py` starts `agentjax serve` with the host and disk KV tiers and a small device pool,",
        "replays the AgentX dev traces with closed-loop lanes for the minutes given, drops a fraction of the",
        "streams part-way, and every few minutes damages the disk tier's newest page files (flipped byte,",
        "truncation, deletion in turn). Pass: no request stuck after the replay, KV pages in use back at their",
        "value before it, resident memory within 10% of its value after the warm-up, exit status 0 on SIGTERM.",
        "Longest stall: the longest stretch after the warm-up in which /metrics showed requests waiting, none",
        "running and no token computed; the engine publishes its figures after each step, so one long step (a",
        "compile of a new shape on a busy CPU) shows there too, while a wedge would last to the end (stuck > 0).",
        f"Machine of the last row: {machine}. Heavy load averages (2 shared CPUs) make the request counts low;",
        "the pass figures do not depend on speed.", "",
        "| date | minutes | model | load avg start / end | requests ok | failed | faults | load failures "
        "| pages loaded | longest stall (s) | stuck | KV usage start -> end | RSS warm -> end | exit | pass | command |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", *rows, row]) + "\n"
    write_section(body, path)
    return body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--minutes", type=float, default=30.0, help="replay length (default 30)")
    add("--model", default="default", help="what agentjax serve loads (default: the embedded SmolLM2-135M)")
    add("--traces", default=DEFAULT_TRACES, help=f"weka traces to replay (default {DEFAULT_TRACES})")
    add("--lanes", type=int, default=4)
    add("--context-scale", type=float, default=0.01, help="prompt lengths scaled by this (default 0.01)")
    add("--think-scale", type=float, default=0.0, help="recorded think times scaled by this")
    add("--num-kv-blocks", type=int, default=400, help="device pool pages: small, so the tiers work")
    add("--max-model-len", type=int, default=4096)
    add("--host-cache-gb", type=float, default=0.25)
    add("--disk-cache-gb", type=float, default=2.0)
    add("--mooncake", action="store_true", help="a Mooncake tier too, its master killed and restarted as a fault")
    add("--fault-every-s", type=float, default=180.0)
    add("--fault-files", type=int, default=24, help="newest page files a disk fault damages")
    add("--disconnect-rate", type=float, default=0.1, help="fraction of streams the client drops part-way")
    add("--warmup-s", type=float, default=300.0, help="the resident memory is compared with its value then")
    add("--sample-every-s", type=float, default=5.0)
    add("--drain-s", type=float, default=300.0, help="how long the end waits for the server to empty")
    add("--seed", type=int, default=0)
    add("--workdir", default=None, help="where the disk tier and the logs go (default: a temporary directory)")
    add("--no-write", action="store_true", help="print the BENCHMARKS.md row only")
    args = parser.parse_args(argv)
    command = "python scripts/soak_serve.py " + " ".join(argv if argv is not None else sys.argv[1:])
    config = AgentxConfig(traces=args.traces, lanes=args.lanes, context_scale=args.context_scale,
                          duration_s=args.minutes * 60, think_scale=args.think_scale, seed=args.seed)
    sessions = load_sessions(config)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="agentjax-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    load_start = "%.1f" % os.getloadavg()[0]
    master = None
    if args.mooncake:
        from agentjax.kv.offload.mooncake import MooncakeMaster

        master = MooncakeMaster(log_path=work / "master.log")
    port = free_port()
    process = start_server(args, work, port, master.address if master is not None else None)
    soak = Soak(args, work, port, process, master)
    try:
        baseline = soak.sample()
        records, disconnects, lanes_warm_s = asyncio.run(soak.replay(config, sessions))
        final = soak.drain()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            exit_status = process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()
            exit_status = process.wait()
        if soak.master is not None:
            soak.master.stop()
    warm_s = max(args.warmup_s, lanes_warm_s)
    warm = [rss for seconds, _, rss in soak.samples if seconds >= warm_s]
    warm_rss = warm[0] if warm else soak.samples[-1][2]
    result = verdict(soak, baseline, final, warm_rss)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    row = markdown(args, command, records, disconnects, soak, result, final, exit_status,
                   (load_start, "%.1f" % os.getloadavg()[0]), warm_s)
    passed = all(result["pass"].values()) and exit_status == 0
    print(row)
    print(f"[soak] {'PASS' if passed else 'FAIL'}: {result['pass']}, exit status {exit_status}; work dir {work}")
    if not args.no_write:
        write_row(row, command, machine, REPO / "BENCHMARKS.md")
    if args.workdir is None and passed:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
