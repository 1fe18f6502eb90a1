"""The processes `scripts/bench_generate.py` measures beside its own agentjax: the transformers peer
(`bench_generate_hf_peer.py`, in its own Python), agentjax at another revision
(`bench_generate_agentjax_peer.py`, from a git worktree), and fresh `LLM()` starts, cold and warm.
Nothing here times agentjax's own generate calls or writes BENCHMARKS.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEER = Path(__file__).resolve().parent / "bench_generate_hf_peer.py"
BASELINE_PEER = Path(__file__).resolve().parent / "bench_generate_agentjax_peer.py"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---- the transformers peer ---------------------------------------------------------------------
class PeerError(RuntimeError):
    pass


class Peer:
    """A peer process (transformers, or agentjax at another revision): one JSON request a line in,
    one JSON reply a line out."""

    def __init__(self, command: list[str], env: dict | None = None, cwd: Path | None = None):
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="bench-peer-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log_file,
                                     text=True, bufsize=1, env=env, cwd=cwd)
        self.info = self._read()

    @classmethod
    def transformers(cls, python: str, gguf: Path, threads: int) -> "Peer":
        return cls([python, str(PEER), "--gguf", str(gguf), "--threads", str(threads)])

    @classmethod
    def agentjax_at(cls, worktree: Path, revision: str, threads: int, engine_args: dict) -> "Peer":
        env = dict(os.environ, PYTHONPATH=str(worktree))
        return cls([sys.executable, str(BASELINE_PEER), "--threads", str(threads), "--engine-args",
                    json.dumps(engine_args), "--revision", revision], env=env, cwd=worktree)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log_file.seek(0)
            tail = self.log_file.read()[-2000:]
            raise PeerError(f"the peer exited ({self.proc.returncode}); its log ends:\n{tail}")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        self.proc.stdin.write(json.dumps({"op": "generate", "prompts": prompts, "max_new_tokens": new_tokens}) + "\n")
        reply = self._read()
        return reply["seconds"], reply["new_token_ids"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        os.unlink(self.log_file.name)


# ---- LLM() start, cold and warm ------------------------------------------------------------------
START_CHILD = """
import json, time
t0 = time.perf_counter()
from agentjax.llm import LLM
t1 = time.perf_counter()
llm = LLM(None, numerics="fast")
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "llm_s": t2 - t1}))
"""


def time_starts() -> list[dict]:
    """Two fresh subprocesses sharing one empty AGENTJAX_CACHE: the first converts, the second restores."""
    results = []
    with tempfile.TemporaryDirectory(prefix="agentjax-bench-cache-") as cache:
        env = dict(os.environ, AGENTJAX_CACHE=cache)
        for label in ("cold", "warm"):
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", START_CHILD], cwd=REPO, env=env,
                                  capture_output=True, text=True)
            wall = time.perf_counter() - started
            if done.returncode:
                raise RuntimeError(f"the {label} LLM() start failed:\n{done.stderr[-2000:]}")
            figures = json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1])
            figures.update(label=label, process_s=wall,
                           cache_entries=sorted(p.name for p in (Path(cache) / "converted").glob("*")))
            results.append(figures)
            log(f"LLM() {label}: {figures['llm_s']:.1f}s (+{figures['import_s']:.1f}s import, "
                f"{wall:.1f}s whole process)")
    return results
