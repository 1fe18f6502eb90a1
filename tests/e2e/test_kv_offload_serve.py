"""`agentjax serve --host-cache-gb X --disk-cache-dir D` with a device pool too small to keep a conversation
between its turns: the second turn's prefix comes back from the tiers (the openai SDK sees it in
cached_tokens, /metrics in agentjax:kv_offload_pages_loaded_total); a tier flag that cannot start
stops the server at start-up with the reason; page files corrupted or deleted while the server runs
cost a re-sent prompt a recompute, never a wedge, and the request queued behind it still runs."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import REPO, running_server

SYSTEM = "You are a careful coding agent working in a large repository. " * 30  # ~400 tokens


@pytest.fixture(scope="module")
def tiered_server(tmp_path_factory):
    disk = tmp_path_factory.mktemp("kv-disk")
    with running_server(tmp_path_factory, "--model", "preset:tiny-dense", "--num-kv-blocks", "48",
                        "--host-cache-gb", "0.05", "--disk-cache-dir", str(disk)) as server:
        server.disk = disk
        yield server


def _samples(server, name: str) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {labels: float(value) for labels, value in re.findall(rf"^{re.escape(name)}\{{(.*?)\}} (\S+)$", text,
                                                                   re.MULTILINE)}


@pytest.mark.slow
def test_a_turn_evicted_from_the_device_comes_back_from_the_tiers(tiered_server):
    client = tiered_server.openai()
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the files."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    flood = "Unrelated build log line with a checksum 0x5f3a and a path /var/cache/x. " * 25  # ~40 pages
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": flood}], max_tokens=1)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Open the first one."}]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16 * 20
    loaded = _samples(tiered_server, "agentjax:kv_offload_pages_loaded_total")
    stored = _samples(tiered_server, "agentjax:kv_offload_pages_stored_total")
    assert sum(loaded.values()) >= 10, loaded
    assert stored['tier="host"'] > 0 and stored['tier="disk"'] > 0
    assert list(tiered_server.disk.glob("*/g0/*.kvp"))  # page files on disk
    assert "KV offload tiers: host, disk" in tiered_server.log_path.read_text()


@pytest.mark.slow
def test_a_tier_that_cannot_start_stops_the_server_at_start_up(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    done = subprocess.run([sys.executable, "-m", "agentjax.cli", "serve", "--model", "preset:tiny-dense",
                           "--port", "1", "--disk-cache-dir", str(blocker)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0
    assert "not a writable directory" in done.stderr + done.stdout


@pytest.fixture(scope="module")
def small_pool_disk_server(tmp_path_factory):
    """tiny-dense, batch-invariant, a 14-page pool (13 usable): a 165-token prompt fills 11 pages."""
    disk = tmp_path_factory.mktemp("kv-disk-faults")
    with running_server(tmp_path_factory, "--model", "preset:tiny-dense", "--num-kv-blocks", "14",
                        "--numerics", "batch_invariant", "--disk-cache-dir", str(disk)) as server:
        server.disk = disk
        yield server


def _complete(client, model: str, prompt: list[int]) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0).choices[0].text


def _page_files(server) -> set:
    return set(server.disk.glob("*/g0/*.kvp"))


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["corrupt", "delete"])
def test_page_files_damaged_while_serving_are_recomputed_and_the_request_behind_still_runs(
        small_pool_disk_server, fault):
    server = small_pool_disk_server
    client = server.openai()
    model = client.models.list().data[0].id
    base = 2000 if fault == "corrupt" else 9000
    prompt, behind, flood = (list(range(base, base + 165)), list(range(base + 200, base + 260)),
                             list(range(base + 300, base + 490)))
    before = _page_files(server)
    cold = _complete(client, model, prompt)
    _wait_for(lambda: len(_page_files(server) - before) == 10)  # its 10 whole pages reached the disk
    own_files = sorted(_page_files(server) - before)
    cold_behind = _complete(client, model, behind)
    _complete(client, model, flood)  # 12 pages: nothing of the prompt stays on the device
    for path in own_files[3:6]:
        if fault == "delete":
            path.unlink()
        else:
            data = bytearray(path.read_bytes())
            data[-100] ^= 0x10
            path.write_bytes(bytes(data))
    failures = sum(_samples(server, "agentjax:kv_offload_load_failures_total").values())
    with ThreadPoolExecutor(2) as pool:  # the prompt again, and a request queued behind it
        again = pool.submit(_complete, client, model, prompt)
        time.sleep(0.05)
        queued = pool.submit(_complete, client, model, behind)
        assert again.result(timeout=60) == cold and queued.result(timeout=60) == cold_behind
    assert sum(_samples(server, "agentjax:kv_offload_load_failures_total").values()) > failures
    _wait_for(lambda: server.metric("agentjax:num_requests_running") == 0
              and server.metric("agentjax:num_requests_waiting") == 0
              and server.metric("agentjax:kv_cache_usage_perc") == 0)  # every page back in the pool
    assert "KV load for request" in server.log_path.read_text()
    server.assert_healthy()
