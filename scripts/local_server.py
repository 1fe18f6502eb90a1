"""Starts an `agentjax serve` or `agentjax router` process for a script on a free local port and waits for
its /health, the way the soak, router benchmark and harness check need it. It never stops what it started:
the caller owns the process (and its log file)."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_healthy(argv: list[str], port: int, log_path: Path, cwd: Path, timeout_s: float = 300,
                  poll_s: float = 0.5) -> subprocess.Popen:
    """Start `argv` (which listens on `port`) with its output in `log_path`; return once GET /health
    answers 200. Exits the script if the process ends first or is not healthy in `timeout_s`."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    shown = " ".join(argv[1:])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"{shown} exited with {process.returncode}; see {log_path}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        time.sleep(poll_s)
    process.kill()
    sys.exit(f"{shown} did not become healthy in {timeout_s:.0f} s; see {log_path}")
