"""`agentjax serve` under each parallel layout on 8 virtual CPU devices (TP, DEP, DCP, PCP), and on two
processes joined by jax.distributed: one greedy completion (prompt as token ids, batch-invariant
numerics) returns the tokens `LLM` gives on one device."""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import httpx
import pytest

from tests.e2e.conftest import CLIENT_TIMEOUT_S, REPO, free_port, running_server

PROMPT = [1, 5, 9, 200, 31, 77, 1000, 4, 8, 15, 16, 23, 42, 108, 4815, 1623, 42, 9, 99, 3, 12]
MAX_TOKENS = 6
LAYOUTS = [
    ("tiny-minimax-m3", ["--tensor-parallel-size", "4"]),
    ("tiny-kimi-k3", ["--data-parallel-size", "4", "--enable-expert-parallel"]),
    ("tiny-kimi-k3", ["--tensor-parallel-size", "2", "--decode-context-parallel-size", "2", "--block-size", "8"]),
    ("tiny-minimax-m3", ["--prefill-context-parallel-size", "4"]),
]


@functools.lru_cache(maxsize=None)
def one_device_tokens(preset: str) -> list[int]:
    from agentjax import LLM, SamplingParams

    llm = LLM(f"preset:{preset}", numerics="batch_invariant", block_size=16, num_kv_blocks=64)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return llm.generate([PROMPT], sampling)[0].token_ids


def _completion_tokens(base_url: str) -> list[int]:
    reply = httpx.post(f"{base_url}/v1/completions", timeout=CLIENT_TIMEOUT_S, json={
        "model": "m", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def _need_devices():
    import jax

    if len(jax.devices()) < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


@pytest.mark.slow
@pytest.mark.parametrize("preset, flags", LAYOUTS, ids=["tp4", "dep4", "tp2-dcp2", "pcp4"])
def test_serve_under_a_layout_gives_the_one_device_tokens(tmp_path_factory, preset, flags):
    _need_devices()
    want = one_device_tokens(preset)
    block = [] if "--block-size" in flags else ["--block-size", "16"]
    with running_server(tmp_path_factory, "--model", f"preset:{preset}", "--served-model-name", "m",
                        "--numerics", "batch_invariant", "--num-kv-blocks", "64", *block, *flags) as server:
        assert _completion_tokens(server.base_url) == want


@pytest.mark.slow
def test_two_processes_serve_one_request_with_one_process_tokens(tmp_path_factory, monkeypatch):
    """Process 0 serves HTTP; process 1 joins by jax.distributed and repeats its steps (TP over the
    two processes' devices, one each); SIGTERM to process 0 stops both."""
    want = one_device_tokens("tiny-dense")
    coordinator = f"127.0.0.1:{free_port()}"
    common = ["--model", "preset:tiny-dense", "--served-model-name", "m", "--numerics", "batch_invariant",
              "--block-size", "16", "--num-kv-blocks", "64", "--tensor-parallel-size", "2", "--coordinator-address", coordinator,
              "--num-processes", "2"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    log = tmp_path_factory.mktemp("follower") / "process-1.log"
    with log.open("wb") as out:
        follower = subprocess.Popen([sys.executable, "-m", "agentjax.cli", "--log-level", "INFO", "serve",
                                     "--port", str(free_port()), *common, "--process-id", "1"],
                                    cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        monkeypatch.setenv("XLA_FLAGS", env["XLA_FLAGS"])
        monkeypatch.setenv("JAX_PLATFORMS", "cpu")
        with running_server(tmp_path_factory, *common, "--process-id", "0") as server:
            assert _completion_tokens(server.base_url) == want
        assert follower.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
