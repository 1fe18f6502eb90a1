"""`agentjax serve --host-cache-gb X --disk-cache-dir D` with a device pool too small to keep a conversation
between its turns: the second turn's prefix comes back from the tiers (the openai SDK sees it in
cached_tokens, /metrics in agentjax:kv_offload_pages_loaded_total); a tier flag that cannot start
stops the server at start-up with the reason."""
from __future__ import annotations

import re
import subprocess
import sys

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
