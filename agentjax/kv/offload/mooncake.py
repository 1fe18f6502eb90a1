"""The distributed tier: KV pages in a Mooncake Store pool, named by (namespace, group, block hash).

`MooncakeTier` is a client of a real Mooncake master (`--mooncake-master HOST:PORT`, TCP transport,
P2P handshake, so no separate metadata server); it lends `segment_bytes` of this process's memory to
the pool, and pages another replica or an earlier run stored are found by name. `MooncakeMaster`
starts the master binary that ships in the `mooncake-transfer-engine-non-cuda` wheel, on loopback
(tests, benchmarks, one-machine setups), and `MooncakeStorageServer` a standalone client that holds
pool memory across engine restarts. Pages travel as raw bytes; nothing is unpickled. Never imports jax.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import socket
import subprocess
import time
from pathlib import Path

from agentjax.errors import OffloadTierError
from agentjax.kv.offload.disk import TierKey

logger = logging.getLogger(__name__)

OBJECT_NOT_FOUND = -704  # Mooncake's error code for a missing key
CONNECT_TIMEOUT_S = 3.0


class MooncakeError(OSError):
    """A Mooncake Store call failed (the master is unreachable, the pool is full, ...)."""

    def __init__(self, operation: str, code: int):
        super().__init__(f"Mooncake {operation} failed with code {code}")
        self.code = code


def _parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise OffloadTierError(f"mooncake_master must be HOST:PORT, got {address!r}")
    return host, int(port)


def _reachable(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class MooncakeTier:
    """Pages as Mooncake objects `<namespace>/<group>/<hash hex>`; every call may raise `MooncakeError`."""

    def __init__(self, master: str, namespace: str, segment_bytes: int, local_buffer_bytes: int = 64 << 20):
        host, port = _parse_address(master)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as error:
            raise OffloadTierError(
                f"mooncake_master={master!r} needs the mooncake-transfer-engine-non-cuda package and the "
                f"libibverbs1 system library: {error}") from error
        if not _reachable(host, port, CONNECT_TIMEOUT_S):
            raise OffloadTierError(f"no Mooncake master answers at {master} (connection refused or timed out)")
        self.master = master
        self.namespace = namespace
        self.store = MooncakeDistributedStore()
        local_host = "127.0.0.1" if host in ("127.0.0.1", "localhost") else socket.gethostname()
        code = self.store.setup(local_host, "P2PHANDSHAKE", int(segment_bytes), int(local_buffer_bytes), "tcp",
                                "", master)
        if code != 0:
            raise OffloadTierError(f"Mooncake store setup against master {master} failed with code {code}")
        logger.info("Mooncake KV tier: master %s, %.0f MB lent to the pool", master, segment_bytes / 2**20)

    def name(self, key: TierKey) -> str:
        group, block_hash = key
        return f"{self.namespace}/{group}/{block_hash.hex()}"

    def put(self, key: TierKey, payload) -> None:
        code = self.store.put(self.name(key), payload)
        if code != 0:
            raise MooncakeError("put", code)

    def get(self, key: TierKey, expected_bytes: int) -> bytes:
        """The page's bytes; KeyError if the pool does not hold it (any more)."""
        data = self.store.get(self.name(key))
        if len(data) == 0:
            code = self.store.get_size(self.name(key))
            if code == OBJECT_NOT_FOUND:
                raise KeyError(key)
            raise MooncakeError("get", code if code < 0 else -1)
        if len(data) != expected_bytes:
            raise MooncakeError(f"get (an object of {len(data)} bytes, expected {expected_bytes})", -1)
        return data

    def exists(self, keys: list[TierKey]) -> list[bool]:
        if not keys:
            return []
        codes = self.store.batch_is_exist([self.name(k) for k in keys])
        if any(code < 0 for code in codes):
            raise MooncakeError("batch_is_exist", min(codes))
        return [code == 1 for code in codes]

    def close(self) -> None:
        self.store.close()


# -- real processes for tests, benchmarks and one-machine setups -------------------------------------
def _binary(name: str) -> str:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise OffloadTierError("the mooncake-transfer-engine-non-cuda package is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / name
    if not path.exists():
        raise OffloadTierError(f"the Mooncake wheel has no {name} binary at {path}")
    return str(path)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Process:
    def __init__(self, argv: list[str], port: int, log_path: str | os.PathLike | None, what: str):
        self.port = port
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20.0
        while not _reachable("127.0.0.1", port, 0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise OffloadTierError(f"{what} did not start listening on 127.0.0.1:{port}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash would end it."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self._log is not subprocess.DEVNULL:
            self._log.close()
            self._log = subprocess.DEVNULL

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class MooncakeMaster(_Process):
    """A real `mooncake_master` on 127.0.0.1 (its RPC port free unless given)."""

    def __init__(self, port: int | None = None, log_path: str | os.PathLike | None = None):
        port = port or free_port()
        argv = [_binary("mooncake_master"), f"--rpc_port={port}", "--rpc_address=127.0.0.1",
                f"--metrics_port={free_port()}", "--default_kv_lease_ttl=1000"]
        super().__init__(argv, port, log_path, "the Mooncake master")
        self.address = f"127.0.0.1:{port}"


class MooncakeStorageServer(_Process):
    """A standalone Mooncake client (`mooncake_client`) that lends `segment_bytes` to the pool, so pages
    outlive the engines that stored them."""

    def __init__(self, master: str, segment_bytes: int, log_path: str | os.PathLike | None = None):
        port = free_port()
        argv = [_binary("mooncake_client"), f"--master_server_address={master}", "--metadata_server=P2PHANDSHAKE",
                f"--global_segment_size={int(segment_bytes)}", "--host=127.0.0.1", f"--port={port}"]
        super().__init__(argv, port, log_path, "the Mooncake storage client")
