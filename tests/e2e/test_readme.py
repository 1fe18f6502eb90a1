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
