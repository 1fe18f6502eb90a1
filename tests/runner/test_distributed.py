"""agentjax/runner/distributed.py: runner calls travel as JSON (nothing unpickled), and two processes joined
by jax.distributed (one CPU device each, TP over both) generate the tokens one process does."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agentjax.runner.extras import RowPenalties, StepExtras
from agentjax.runner.distributed import _plain, _restore

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, sys
from agentjax import LLM, SamplingParams
pid, address = int(sys.argv[1]), sys.argv[2]
settings = dict(coordinator_address=address, num_processes=2, process_id=pid, tensor_parallel_size=2) if pid >= 0 else {}
llm = LLM("preset:tiny-dense", numerics="batch_invariant", block_size=16, num_kv_blocks=32, **settings)
outs = llm.generate([[1, 5, 9, 200, 31, 77, 1000, 4, 8, 15, 16, 23, 42], [7, 7, 7, 300, 12]],
                    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
print("TOKENS " + json.dumps([o.token_ids for o in outs]), flush=True)
"""


def test_runner_calls_round_trip_through_json():
    extras = StepExtras(logprobs={0, 2}, penalties={1: RowPenalties(0.5, 0.1, 1.2, np.array([3, 4], np.int32),
                                                                    np.array([1, 0], np.int32),
                                                                    np.array([1, 1], np.int32),
                                                                    np.array([0.0, -1.5], np.float32))},
                        prompt_positions=[(0, np.array([1, 2], np.int32), np.array([7, 8], np.int32))])
    args = [[([1, 2, 3], 0, [[1], [2]])], [(0.0, 0, 1.0, 7, 0)], extras]
    restored = _restore(json.loads(json.dumps(_plain(args))))
    assert restored[0] == [[[1, 2, 3], 0, [[1], [2]]]] and restored[1] == [[0.0, 0, 1.0, 7, 0]]
    got = restored[2]
    assert isinstance(got, StepExtras) and got.logprobs == {0, 2}
    np.testing.assert_array_equal(got.penalties[1].bias, np.array([0.0, -1.5], np.float32))
    assert got.penalties[1].token_ids.dtype == np.int32 and got.prompt_positions[0][0] == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(pid: int, address: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(pid), address], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _tokens(output: str) -> list:
    lines = [line for line in output.splitlines() if line.startswith("TOKENS ")]
    assert lines, output[-3000:]
    return json.loads(lines[-1].removeprefix("TOKENS "))


@pytest.mark.slow
def test_two_processes_generate_the_tokens_of_one():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    address = f"127.0.0.1:{_free_port()}"
    processes = [_run(0, address, env), _run(1, address, env)]
    outputs = [p.communicate(timeout=900)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    alone = _run(-1, "", env)
    want = _tokens(alone.communicate(timeout=900)[0])
    assert _tokens(outputs[0]) == want and _tokens(outputs[1]) == want
