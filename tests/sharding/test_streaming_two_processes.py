"""Two processes joined by jax.distributed (4 CPU devices each, one TP-8 layout over both) stream the same
checkpoint: each reads less than 60% of its bytes, and both generate the tokens one process with 8 devices
does."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints.synthetic import Sizes, minimax_m3

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, sys
import agentjax.models as models
from agentjax import LLM, SamplingParams
from checkpoints.lazy_reads import READS

def io():
    return {k: int(v) for k, v in (line.split(": ") for line in open("/proc/self/io").read().splitlines())}

LOAD = {}
streaming = models.load_hf_streaming

def measured(*args, **kwargs):  # /proc/self/io around the checkpoint's load alone
    LOAD["before"] = io()
    out = streaming(*args, **kwargs)
    LOAD["after"] = io()
    return out

models.load_hf_streaming = measured
pid, address, checkpoint = int(sys.argv[1]), sys.argv[2], sys.argv[3]
settings = dict(coordinator_address=address, num_processes=2, process_id=pid) if pid >= 0 else {}
llm = LLM(checkpoint, numerics="batch_invariant", block_size=16, num_kv_blocks=32, tensor_parallel_size=8, **settings)
before, after = LOAD["before"], LOAD["after"]
outs = llm.generate([[1, 5, 9, 200, 31, 77, 100, 4, 8, 15, 16, 23, 42], [7, 7, 7, 300, 12]],
                    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
print("RESULT " + json.dumps({"tokens": [o.token_ids for o in outs], "pread": READS.bytes_read,
                              "rchar": after["rchar"] - before["rchar"],
                              "read_bytes": after["read_bytes"] - before["read_bytes"]}), flush=True)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(pid: int, address: str, checkpoint: Path, devices: int) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(pid), address, str(checkpoint)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _result(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert lines, output[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.slow
def test_two_processes_each_read_under_60_percent_and_generate_one_process_tokens(tmp_path):
    checkpoint = minimax_m3(tmp_path / "nvfp4", Sizes(expert_inner=1024), "nvfp4", shards=8)
    total = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    address = f"127.0.0.1:{_free_port()}"
    processes = [_run(0, address, checkpoint, 4), _run(1, address, checkpoint, 4)]
    outputs = [p.communicate(timeout=900)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    alone = _result(_run(-1, "", checkpoint, 8).communicate(timeout=900)[0])
    results = [_result(o) for o in outputs]
    for result in results:
        assert result["tokens"] == alone["tokens"]
        assert result["pread"] < 0.6 * total, (result, total)  # checkpoint bytes this process read
        assert result["rchar"] < 0.6 * total, (result, total)  # every byte its read calls returned while loading
    assert alone["pread"] >= total * 0.95
