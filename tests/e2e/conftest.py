"""End-to-end fixtures: a real `agentjax serve` process on a free local port, stopped with SIGTERM.

Each test module starts one server (module-scoped) with the flags it needs, waits for /health,
and on teardown asserts that SIGTERM ends the process with exit status 0.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
# Servers the tests start skip the warm-up (every decode shape compiled before the ready line), which
# would cost each one its compiles up front; the tests of the warm-up ask for it by flag.
os.environ.setdefault("AGENTJAX_WARMUP", "none")
STARTUP_TIMEOUT_S = 240
CLIENT_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused",
                             timeout=CLIENT_TIMEOUT_S, max_retries=0, **kwargs)

    def async_openai(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused",
                                  timeout=CLIENT_TIMEOUT_S, max_retries=0, **kwargs)

    def metric(self, name: str) -> float:
        """One unlabelled sample from /metrics."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert match, f"{name} not in /metrics"
        return float(match.group(1))

    def assert_healthy(self) -> None:
        assert self.process.poll() is None, f"server exited:\n{self.log_tail()}"
        assert httpx.get(f"{self.base_url}/health", timeout=10).status_code == 200


def start_server(log_dir: Path, *flags: str, api_key: str | None = None,
                 command: list[str] | None = None, env: dict[str, str] | None = None) -> ServerProcess:
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    argv = command or [sys.executable, "-m", "agentjax.cli", "--log-level", "INFO", "serve"]
    argv = [*argv, "--port", str(port), *flags]
    env = dict(os.environ, **(env or {}))
    if api_key:
        env["AGENTJAX_API_KEY"] = api_key
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = ServerProcess(process, port, log_path, api_key)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} while starting:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        time.sleep(0.5)
    stop_server(server)
    raise RuntimeError(f"server did not become healthy in {STARTUP_TIMEOUT_S}s:\n{server.log_tail()}")


def stop_server(server: ServerProcess, timeout: float = 60) -> int:
    """SIGTERM, then wait; returns the exit status (kills and fails if it hangs)."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(timeout)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        raise AssertionError(f"server did not stop within {timeout}s of SIGTERM:\n{server.log_tail()}") from None


@contextlib.contextmanager
def running_server(tmp_path_factory, *flags: str, api_key: str | None = None,
                   command: list[str] | None = None, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("server"), *flags, api_key=api_key, command=command, env=env)
    try:
        yield server
    finally:
        status = stop_server(server)
        assert status == 0, f"server exited with {status} after SIGTERM:\n{server.log_tail()}"


def readme_main_command() -> list[str]:
    """The README's main command (the first bash block of its set-up section)."""
    text = (REPO / "README.md").read_text()
    setup = text[text.index("## Set-up"):]
    return re.findall(r"```bash\n(.*?)```", setup, re.DOTALL)[0].split()


def installed_venv(directory: Path) -> Path:
    """A virtual environment `scripts/bootstrap.sh` takes as set up (AGENTJAX_VENV): its python is this
    test process's, its `agentjax` runs this checkout's CLI, and its install stamp is fresh, so the
    script's set-up steps only check and its command runs here."""
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    scripts = {"python": f'exec "{sys.executable}" "$@"',  # a script, not a link: a venv's python finds
               # its environment from the path it was started by
               "agentjax": f'PYTHONPATH="{REPO}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" -m agentjax.cli "$@"'}
    for name, line in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{line}\n")
        (bin_dir / name).chmod(0o755)
    (directory / ".agentjax-installed").touch()
    return directory


@pytest.fixture(scope="session")
def main_server(tmp_path_factory):
    """The server the README's main command starts (embedded model, default flags), on a free port,
    through scripts/bootstrap.sh with this process's Python as its environment."""
    venv = installed_venv(tmp_path_factory.mktemp("venv"))
    with running_server(tmp_path_factory, command=readme_main_command(), env={"AGENTJAX_VENV": str(venv)}) as server:
        yield server


PROBERS = tuple(f"prober-{i}" for i in range(8))  # one fresh tenant per probe: a probe caches itself
TENANT_KEYS = {"alice": "key-alice", "bob": "key-bob", "team-1": "key-team-1", "team-2": "key-team-2",
               "operator": "key-operator", **{name: f"key-{name}" for name in PROBERS}}
KEYS_FILE = {"keys": [{"key": TENANT_KEYS["alice"]}, {"key": TENANT_KEYS["bob"]},
                      {"key": TENANT_KEYS["team-1"], "namespace": "team"},
                      {"key": TENANT_KEYS["team-2"], "namespace": "team"},
                      {"key": TENANT_KEYS["operator"], "operator": True},
                      *({"key": TENANT_KEYS[name]} for name in PROBERS)]}


@pytest.fixture(scope="session")
def tenant_server(tmp_path_factory):
    """A keyed server (`--api-keys-file`: alice, bob, probers, two keys sharing the namespace "team", an operator)
    with the host and disk tiers under a device pool too small to keep a few prompts, and an
    `agentjax router --policy prefix` in front of it with the operator key. Shared by the tenancy and
    edge-validation tests."""
    import json

    log_dir = tmp_path_factory.mktemp("tenants")
    keys_file = log_dir / "keys.json"
    keys_file.write_text(json.dumps(KEYS_FILE))
    disk = tmp_path_factory.mktemp("tenant-disk")
    server = start_server(log_dir, "--model", "preset:tiny-dense", "--num-kv-blocks", "48", "--host-cache-gb",
                          "0.05", "--disk-cache-dir", str(disk), "--api-keys-file", str(keys_file),
                          "--default-max-tokens", "4")  # a fuzzed body that loses its budget stays short
    server.api_key = TENANT_KEYS["alice"]
    router = None
    try:
        router = start_server(log_dir, "--policy", "prefix", "--health-interval", "0.2", "--replica",
                              server.base_url, "--operator-key", TENANT_KEYS["operator"],
                              command=[sys.executable, "-m", "agentjax.cli", "--log-level", "INFO", "router"])
        server.router = router
        yield server
    finally:
        if router is not None:
            assert stop_server(router) == 0, router.log_tail()
        assert stop_server(server) == 0, server.log_tail()
