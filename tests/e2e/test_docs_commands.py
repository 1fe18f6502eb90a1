"""Every `bash` and `python` block in the README and docs/ runs as written, or says it needs a GPU.

`RUNS` says how each block runs; a block it does not name fails `test_every_block_is_run_or_needs_a_gpu`.
Blocks run from a sandbox that looks like the repository root (the packages, tests and scripts, with
`../shared` beside it), with `agentjax` on PATH running this checkout's CLI, so relative paths and the
outputs they write (r.json, plan/, sweep/) stay out of the checkout. Blocks that talk to
127.0.0.1:8000 run against the README's main server (shared with test_readme.py), on its port. A page's
Python blocks run in order in one process, sharing names, as in a notebook. Inline `agentjax ...`
commands are parsed by the CLI's parser. Replays and sweeps run with `--duration` cut to
`DOCS_DURATION_S` (every other flag as written): the block's flags are what is checked, and a full
duration only spends the suite's time sending more of the same turns.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agentjax.cli import build_parser, subcommands
from tests.docs.pages import GENERATED, Block, blocks, inline_commands, pages, relative
from tests.e2e.conftest import REPO, free_port, installed_venv, readme_main_command, running_server

TRACES_PARENT = Path(os.environ["AGENTJAX_TRACES"]).parent if os.environ.get("AGENTJAX_TRACES") else REPO.parent / "shared"
MAIN_PORT = "127.0.0.1:8000"
DOCS_DURATION_S = 3  # at most this --duration in the blocks the tests run (real or simulated seconds)

# (page, a line of the block, how it runs). Runs: "main server" (the README's main command, which
# main_server starts), "server shell" and "server python" (against the main server, port replaced),
# "python" (the page's blocks in one process), "cli" (bash in the sandbox), "serve" (a server of its
# own, started and stopped), "cluster" (background replicas and a router, queried, then stopped),
# "bootstrap test" (the test command on one small test file).
RUNS = [
    ("README.md", "bash scripts/bootstrap.sh serve", "main server"),
    ("README.md", "curl -s http://127.0.0.1:8000/v1/chat/completions", "server shell"),
    ("README.md", "bash scripts/bootstrap.sh test", "bootstrap test"),
    ("README.md", "llm = LLM()", "python"),
    ("docs/agent-harnesses.md", "export ANTHROPIC_BASE_URL", "server shell"),
    ("docs/agent-harnesses.md", "client = anthropic.Anthropic(", "server python"),
    ("docs/agent-harnesses.md", "curl -s http://127.0.0.1:8000/v1/messages", "server shell"),
    ("docs/agent-harnesses.md", "client.responses.create(", "server python"),
    ("docs/benchmarks.md", "--model preset:tiny-dense --out r.json", "cli"),
    ("docs/benchmarks.md", "--compaction --out r.json", "cli"),
    ("docs/benchmarks.md", "agentjax bench agentx --url http://127.0.0.1:8000", "server shell"),
    ("docs/benchmarks.md", "agentjax bench report", "cli"),
    ("docs/benchmarks.md", "agentjax bench sweep-concurrency", "cli"),
    ("docs/benchmarks.md", "agentjax bench kv-sim", "cli"),
    ("docs/development.md", "python scripts/gen_docs_reference.py", "cli"),
    ("docs/kv-cache.md", "agentjax serve --model preset:tiny-dense --host-cache-gb 1", "serve"),
    ("docs/kv-cache.md", "policy = HintAwarePolicy()", "python"),
    ("docs/layouts.md", "tp_dcp = LLM(", "python"),
    ("docs/planning.md", "agentjax sweep simulate --model minimax-m3 --gpu B300 --layout tp2 --lanes 24 --duration 60",
     "cli"),
    ("docs/planning.md", "agentjax sweep saturation", "cli"),
    ("docs/planning.md", "--spec-decode --offload", "cli"),
    ("docs/python.md", "llm = LLM()", "python"),
    ("docs/python.md", "StructuredOutput.json_schema(schema)", "python"),
    ("docs/python.md", "step = make_step(cfg)", "python"),
    ("docs/router.md", "agentjax router --port 8080 --replica", "cluster"),
    ("docs/router.md", "mooncake_master --rpc_port=50051", "cluster"),
    ("docs/serving.md", "-H \"X-Session-ID: agent-7\"", "server shell"),
    ("docs/serving.md", "client.chat.completions.create(", "server python"),
    ("docs/speculative-decoding.md", "speculative_config={\"method\": \"ngram\"", "python"),
]


def run_of(block: Block) -> str:
    matches = [run for page, line, run in RUNS if page == block.page and line in block.code]
    assert len(matches) == 1, f"{block.page}: a block matches {len(matches)} entries of RUNS:\n{block.code}"
    return matches[0]


def blocks_run_by(run: str) -> list[Block]:
    return [block for block in blocks() if not block.needs_gpu and run_of(block) == run]


def test_every_block_is_run_or_needs_a_gpu():
    runs = {(block.page, run_of(block)) for block in blocks() if not block.needs_gpu}
    for page, line, run in RUNS:
        assert any(block.page == page and line in block.code for block in blocks()), f"stale entry: {page} {line}"
    assert runs


def test_inline_agentjax_commands_use_real_subcommands_and_flags():
    parser = build_parser()
    commands = subcommands(parser)
    global_flags = {"--log-level", "-q", "--quiet", "--version", "--help", "-h"}
    for page in pages():
        if page.name in GENERATED:
            continue
        for span in inline_commands(page):
            words = shlex.split(span)[1:]
            if not words or words[0].isupper() or words[0].startswith(("-", "...")):
                continue  # `agentjax COMMAND --help`, `agentjax --version`
            path = tuple(words[:2]) if tuple(words[:2]) in commands else tuple(words[:1])
            if path not in commands:
                assert path[0] in {c[0] for c in commands}, f"{relative(page)}: `{span}`"
                continue  # `agentjax bench` names the command group
            known = {name for action in commands[path]._actions for name in action.option_strings}
            for word in words[len(path):]:
                flag = word.split("=")[0]
                if flag.startswith("-") and not re.fullmatch(r"-\d.*", flag):
                    assert flag in known | global_flags, f"{relative(page)}: `{span}` has no flag {flag}"


# ---------------------------------------------------------------- the sandbox

@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """(working directory, environment): a directory laid out like the repository root, beside
    `shared/`, with `agentjax` and `python` on PATH."""
    root = tmp_path_factory.mktemp("docs-sandbox")
    work = root / "agentjax"
    work.mkdir()
    for name in ("agentjax", "checkpoints", "sharding", "pallas_kernels", "tests", "README.md", "pyproject.toml",
                 "BENCHMARKS.md"):
        (work / name).symlink_to(REPO / name)
    for name in ("scripts", "docs"):  # copies: scripts find the root from their own path and write there
        shutil.copytree(REPO / name, work / name)
    if TRACES_PARENT.is_dir():
        (root / "shared").symlink_to(TRACES_PARENT)
    venv = installed_venv(root / "venv")
    shutil.copy(venv / "bin" / "python", venv / "bin" / "python3")
    env = dict(os.environ, PATH=f"{venv / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               PYTHONPATH=str(work), XLA_FLAGS="--xla_force_host_platform_device_count=8")
    return work, env


def run_bash(code: str, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"{code}\nexit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def short_durations(code: str) -> str:
    """The block with every `--duration N` above DOCS_DURATION_S cut to DOCS_DURATION_S."""
    def cut(match: re.Match) -> str:
        return f"--duration {min(float(match.group(1)), DOCS_DURATION_S):g}"
    return re.sub(r"--duration[ =]([0-9.]+)", cut, code)


def needs_traces(code: str) -> None:
    if "../shared/traces" in code and not TRACES_PARENT.is_dir():
        pytest.skip(f"the dev traces are not at {TRACES_PARENT} (set AGENTJAX_TRACES)")


# ---------------------------------------------------------------- the runs

def test_short_durations_cut_only_the_duration():
    code = "agentjax bench agentx --lanes 2 --duration 20 \\\n    --out r.json; sweep --duration=60 --x 1 --duration 2"
    assert short_durations(code) == f"agentjax bench agentx --lanes 2 --duration {DOCS_DURATION_S} \\\n" \
        f"    --out r.json; sweep --duration {DOCS_DURATION_S} --x 1 --duration 2"


def test_the_main_server_is_the_readme_command():
    (block,) = blocks_run_by("main server")
    assert block.code.split() == readme_main_command()


@pytest.mark.slow
@pytest.mark.parametrize("block", blocks_run_by("server shell"), ids=lambda b: f"{b.page}:{b.code.split()[0]}")
def test_server_shell_blocks(block, main_server, sandbox):
    work, env = sandbox
    needs_traces(block.code)
    code = short_durations(block.code.replace(MAIN_PORT, f"127.0.0.1:{main_server.port}"))
    result = run_bash(code, work, env, timeout=600)
    if block.code.startswith("curl"):
        reply = json.loads(result.stdout)
        assert "error" not in reply and (reply.get("choices") or reply.get("content")), reply


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted({b.page for b in blocks_run_by("server python")}))
def test_server_python_blocks(page, main_server, sandbox):
    work, env = sandbox
    code = "\n".join(b.code for b in blocks_run_by("server python") if b.page == page)
    code = code.replace(MAIN_PORT, f"127.0.0.1:{main_server.port}")
    result = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"{page}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted({b.page for b in blocks_run_by("python")}))
def test_python_blocks(page, sandbox):
    work, env = sandbox
    code = "\n".join(b.code for b in blocks_run_by("python") if b.page == page)
    result = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, f"{page}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("block", blocks_run_by("cli"), ids=lambda b: f"{b.page}:{b.code.strip().splitlines()[-1][:40]}")
def test_cli_blocks(block, sandbox):
    work, env = sandbox
    needs_traces(block.code)
    run_bash(short_durations(block.code), work, env, timeout=900)
    if "gen_docs_reference.py" in block.code:  # it rewrote the sandbox's copies: the same as the checkout's
        for name in GENERATED:
            assert (work / "docs" / name).read_text() == (REPO / "docs" / name).read_text(), name


@pytest.mark.slow
def test_the_serve_block_starts_serves_and_stops(sandbox, tmp_path_factory, tmp_path):
    work, env = sandbox
    (block,) = blocks_run_by("serve")
    words = shlex.split(block.code.replace("/tmp/agentjax-kv", str(tmp_path / "kv")))
    assert words[:2] == ["agentjax", "serve"]
    with running_server(tmp_path_factory, *words[2:], command=[str(Path(env["PATH"].split(":")[0]) / "agentjax"),
                                                                "serve"], env=env) as server:
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        assert 'agentjax:kv_offload_tier_pages{tier="host"}' in metrics
        assert "ready on http://127.0.0.1" in server.log_path.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("block", blocks_run_by("cluster"), ids=lambda b: "pd" if "mooncake" in b.code else "replicas")
def test_cluster_blocks(block, sandbox, tmp_path):
    work, env = sandbox
    if "mooncake_master" in block.code and not shutil.which("mooncake_master", path=env["PATH"]):
        pytest.skip("mooncake_master is not installed (the mooncake extra)")
    ports = {old: str(free_port()) for old in ("8001", "8002", "8080", "50051")}
    code = block.code
    for old, new in ports.items():
        code = re.sub(rf"(?<![0-9]){old}(?![0-9])", new, code)
    log = (tmp_path / "cluster.log").open("wb")
    process = subprocess.Popen(["bash", "-c", code], cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    router = f"http://127.0.0.1:{ports['8080']}"
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            assert process.poll() is None, (tmp_path / "cluster.log").read_text()[-4000:]
            with contextlib.suppress(httpx.HTTPError):
                health = httpx.get(f"{router}/health", timeout=5)
                if health.status_code == 200 and all(r["healthy"] for r in health.json()["replicas"]):
                    break
            time.sleep(1)
        else:
            raise AssertionError(f"the router never saw every replica healthy:\n{(tmp_path / 'cluster.log').read_text()[-4000:]}")
        reply = httpx.post(f"{router}/v1/chat/completions", timeout=300, json={
            "model": "preset:tiny-dense", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello"}]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] is not None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        time.sleep(2)  # the replicas' graceful shutdowns
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        log.close()


@pytest.mark.slow
def test_the_readme_test_command_runs_the_suite(tmp_path):
    (block,) = blocks_run_by("bootstrap test")
    venv = installed_venv(tmp_path / "venv")
    env = dict(os.environ, AGENTJAX_VENV=str(venv), AGENTJAX_TEST_WORKERS="1")
    result = subprocess.run(["bash", "-c", f"{block.code.strip()} tests/test_progress.py -q -p no:cacheprovider"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"\d+ passed", result.stdout) and "[bootstrap] 4/4 running the test suite" in result.stderr
