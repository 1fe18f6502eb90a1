"""The README's main command starts the server on the embedded model, and its curl example works as
written (only the port is changed, to a free one)."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.e2e.conftest import REPO


def readme_blocks() -> list[str]:
    text = (REPO / "README.md").read_text()
    setup = text[text.index("## Set-up"):]
    return re.findall(r"```bash\n(.*?)```", setup, re.DOTALL)


def test_readme_main_command_is_bootstrap_serve():
    assert readme_blocks()[0].strip() == "bash scripts/bootstrap.sh serve"


@pytest.mark.slow
def test_readme_curl_chat_request_works_against_the_main_command(main_server):
    """`main_server` is the README's main command, run with `--port` added."""
    curl = readme_blocks()[1]
    assert "curl" in curl and "127.0.0.1:8000" in curl
    result = subprocess.run(["bash", "-c", curl.replace("127.0.0.1:8000", f"127.0.0.1:{main_server.port}")],
                            capture_output=True, text=True, timeout=300, check=True)
    reply = json.loads(result.stdout)
    assert "Paris" in reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] > 0


@pytest.mark.slow
def test_the_main_command_shows_its_steps_and_ends_with_the_info_ready_line(main_server):
    """scripts/bootstrap.sh numbers its set-up steps; the server logs its start-up and, at INFO, a ready
    line with the URL, the served model, and the KV cache's capacity in tokens and its memory; the
    first request's new step shapes say that they compile."""
    main_server.openai().chat.completions.create(model="smollm2-135m-instruct", max_tokens=2, temperature=0,
                                                 messages=[{"role": "user", "content": "Hi"}])
    log = main_server.log_path.read_text()
    for step in ("[bootstrap] 1/4", "[bootstrap] 2/4", "[bootstrap] 3/4", "[bootstrap] 4/4 running: agentjax serve"):
        assert step in log, step
    assert "tests are skipped" not in log
    ready = re.search(rf"INFO agentjax\.server\.launcher: ready on http://127\.0\.0\.1:{main_server.port}/v1 serving "
                      r"'smollm2-135m-instruct' \(.+\); KV cache: ([\d,]+) tokens \(([\d,]+) pages of 16\) in "
                      r"([\d.]+) GiB; started in [\d.]+ s", log)
    assert ready, log[-3000:]
    tokens, pages, gib = int(ready[1].replace(",", "")), int(ready[2].replace(",", "")), float(ready[3])
    assert tokens == 16 * pages and 0.9 <= gib <= 1.1  # --kv-cache-memory-gb 1 by default
    assert "KV cache:" in log and "weights on the device" in log
    assert re.search(r"compiling the step for \d+ tokens x \d+ rows", log)
    assert re.search(r"the step for \d+ tokens x \d+ rows, \d+ pages a row: (compiled|loaded from the compilation "
                     r"cache) in [\d.]+ s", log)
