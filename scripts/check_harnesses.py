"""Run real agent harnesses (Claude Code, Codex CLI) against `agentjax serve` and count what happened.

Installs `@anthropic-ai/claude-code` and `@openai/codex` (pinned versions) with npm into a
temporary folder (or reuses `--npm-dir`), starts `agentjax serve --model preset:tiny-long` on a
free port, and runs each harness non-interactively for a two-turn task in its own scratch project
(the second turn continues the first conversation). It prints, per harness, every request the
server logged (route, status, prompt and cached tokens) and a summary: requests, 4xx/5xx, cached
tokens. Exit status 0 only if no request of either harness got a 4xx or 5xx and a later request
of each read the prefix cache.

The server runs with its default flags. A random-weight model never samples end-of-sequence, and
decodes at a few tokens a second on a CPU, so each harness is bounded on its own side: Claude Code
by its CLAUDE_CODE_MAX_OUTPUT_TOKENS, Codex (which sends no output budget and ignores
`model_max_output_tokens`, so the server's budget is the context left, as in vLLM) by a time limit
per invocation, after which this script stops it: the server sees the client leave, aborts the
reply and frees its pages, and the next invocation resumes the conversation.

    .venv/bin/python scripts/check_harnesses.py [--npm-dir DIR] [--output-tokens 96] [--codex-seconds 150] [--keep]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from local_server import free_port, start_healthy  # noqa: E402

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.328"
CODEX = "@openai/codex@0.169.0"
MODEL = "preset:tiny-long"
TURNS = ("Create a file hello.py that prints hello.", "Now add a function add(a, b) to hello.py.")
ACCESS_LINE = re.compile(r"agentjax\.server\.access: (?P<method>\S+) (?P<path>\S+) (?P<status>\d+) (?P<seconds>\S+)s"
                         r"(?P<counts>.*)$")


@dataclass
class Harness:
    name: str
    route: str  # the API route its model requests use
    results: list[dict] = field(default_factory=list)  # the access log entries of its run
    exit_codes: list[int] = field(default_factory=list)
    seconds: float = 0.0


def start_server(log_path: Path, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "agentjax.cli", "--log-level", "INFO", "serve", "--model", MODEL,
               "--port", str(port)]
    print("server:", " ".join(command[1:]), flush=True)
    return start_healthy(command, port, log_path, REPO, timeout_s=300, poll_s=1)


def access_entries(log_path: Path, start: int) -> tuple[list[dict], int]:
    """Access log entries from byte `start` on, and where the log ends now."""
    data = log_path.read_bytes()
    entries = []
    for line in data[start:].decode(errors="replace").splitlines():
        match = ACCESS_LINE.search(line)
        if match:
            entry = {"method": match["method"], "path": match["path"], "status": int(match["status"]),
                     "seconds": float(match["seconds"])}
            for pair in match["counts"].split():
                key, _, value = pair.partition("=")
                entry[key] = int(value) if value.isdigit() else value
            entries.append(entry)
    return entries, len(data)


def run(command: list[str], env: dict, cwd: Path, log: Path, timeout: float) -> int:
    """Run one harness invocation; past `timeout`, stop it and every process it started (Codex's npm
    launcher runs the real binary as a child, which would otherwise keep its request open)."""
    with log.open("ab") as out:
        out.write(f"$ {' '.join(command)}\n".encode())
        out.flush()
        process = subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            out.write(b"(timed out)\n")
            return 124


def claude_code(npm: Path, work: Path, base_url: str, output_tokens: int, timeout: float) -> tuple[list[list[str]], dict]:
    home = work / "claude-home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "unused",
           "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
           "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL, "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(output_tokens), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1", "API_TIMEOUT_MS": str(int(timeout * 1000))}
    wrapper = str(npm / "node_modules" / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs")
    first = ["node", wrapper, "-p", TURNS[0], "--max-turns", "3"]
    second = ["node", wrapper, "-p", "--continue", TURNS[1], "--max-turns", "3"]
    return [first, second], env


def codex(npm: Path, work: Path, base_url: str, timeout: float) -> tuple[list[list[str]], dict]:
    home = work / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "agentjax"\n\n[model_providers.agentjax]\nname = "agentjax"\n'
        f'base_url = "{base_url}/v1"\nwire_api = "responses"\nenv_key = "AGENTJAX_API_KEY"\n'
        f"stream_idle_timeout_ms = {int(timeout * 1000)}\nrequest_max_retries = 0\nstream_max_retries = 0\n")
    env = {**os.environ, "HOME": str(work / "codex-user"), "CODEX_HOME": str(home), "AGENTJAX_API_KEY": "unused"}
    binary = str(npm / "node_modules" / ".bin" / "codex")
    first = [binary, "exec", "--skip-git-repo-check", TURNS[0]]
    second = [binary, "exec", "--skip-git-repo-check", "resume", "--last", TURNS[1]]
    return [first, second], env


def budget_probe(base_url: str) -> bool:
    """Claude Code's own budget (max_tokens=32000, with its thinking, context_management and
    output_config settings and a system turn inside messages): the reply starts (200) and is then
    dropped, since a random-weight model would fill the whole budget."""
    body = {"model": MODEL, "max_tokens": 32000, "stream": True, "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Create hello.py."}]},
                         {"role": "system", "content": [{"type": "text", "text": "Environment: linux."}]}]}
    with httpx.stream("POST", f"{base_url}/v1/messages", json=body, timeout=300,
                      headers={"x-api-key": "unused", "anthropic-version": "2023-06-01"}) as response:
        first_delta = next((line for line in response.iter_lines() if "content_block_delta" in line), None)
        status = response.status_code
    print(f"\n== budget probe: /v1/messages with max_tokens=32000 (Claude Code's default): status {status}, "
          f"first text delta {'received' if first_delta else 'missing'}")
    return status == 200 and first_delta is not None


def report(harness: Harness) -> bool:
    print(f"\n== {harness.name} ({harness.seconds:.0f} s, exit codes {harness.exit_codes})")
    print(f"{'#':>3} {'route':<22} {'status':>6} {'prompt':>7} {'cached':>7} {'output':>6} {'finish':<10} {'seconds':>7}")
    for number, entry in enumerate(harness.results, 1):
        print(f"{number:>3} {entry['method'] + ' ' + entry['path']:<22} {entry['status']:>6} "
              f"{entry.get('prompt_tokens', '-'):>7} {entry.get('cached_tokens', '-'):>7} "
              f"{entry.get('completion_tokens', '-'):>6} {entry.get('finish_reason', '-'):<10} {entry['seconds']:>7.1f}")
    errors = sum(entry["status"] >= 400 for entry in harness.results)
    model_requests = [e for e in harness.results if e["path"] == harness.route]
    cached = sum(e.get("cached_tokens", 0) for e in harness.results)
    later_hits = sum(e.get("cached_tokens", 0) > 0 for e in model_requests[1:])
    print(f"requests {len(harness.results)} ({len(model_requests)} on {harness.route}), 4xx/5xx {errors}, "
          f"cached tokens {cached} (later requests reading the cache: {later_hits} of {max(0, len(model_requests) - 1)})")
    return errors == 0 and later_hits > 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--npm-dir", type=Path, default=None, help="install the harnesses here (kept) instead of a "
                                                                   "temporary folder")
    parser.add_argument("--output-tokens", type=int, default=96,
                        help="Claude Code's output budget (its CLAUDE_CODE_MAX_OUTPUT_TOKENS)")
    parser.add_argument("--codex-seconds", type=float, default=150,
                        help="time limit per Codex invocation (Codex sends no output budget)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per harness invocation")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, projects)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="agentjax-harnesses-"))
    npm = args.npm_dir or work / "npm"
    print(f"scratch folder: {work}", flush=True)
    npm_install(npm)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    server_log = work / "server.log"
    server = start_server(server_log, port)
    ok = True
    try:
        _, offset = access_entries(server_log, 0)
        for harness, (commands, env, limit) in (
                (Harness("Claude Code 2.1.328 (/v1/messages)", "/v1/messages"),
                 claude_code(npm, work, base_url, args.output_tokens, args.timeout) + (args.timeout,)),
                (Harness("Codex CLI 0.169.0 (/v1/responses)", "/v1/responses"),
                 codex(npm, work, base_url, args.timeout) + (args.codex_seconds,))):
            project = work / f"project-{harness.route.strip('/').replace('/', '-')}"
            project.mkdir()
            started = time.monotonic()
            for command in commands:
                harness.exit_codes.append(run(command, env, project, work / "harness.log", limit))
            harness.seconds = time.monotonic() - started
            time.sleep(1)  # the last access line is written once its response has ended
            entries, offset = access_entries(server_log, offset)
            harness.results = [e for e in entries if e["path"] != "/health"]
            ok = report(harness) and ok
        ok = budget_probe(base_url) and ok
    finally:
        server.terminate()
        server.wait(60)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'PASS' if ok else 'FAIL'}: no 4xx/5xx, and later requests read the cache" if ok else "\nFAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
