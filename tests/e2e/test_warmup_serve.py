"""`agentjax serve --warmup decode`: the decode step shapes are built before the ready line, /metrics counts
them, and a short completion (its prefill fits the smallest decode shape) builds nothing more."""
from __future__ import annotations

import pytest

from tests.e2e.conftest import running_server

COMPILED = "agentjax:compiled_executables_total"


@pytest.mark.slow
def test_serve_warms_the_decode_shapes_before_it_is_ready(tmp_path_factory):
    flags = ("--model", "preset:tiny-dense", "--warmup", "decode", "--max-num-seqs", "8",
             "--max-model-len", "256", "--num-kv-blocks", "64")
    with running_server(tmp_path_factory, *flags) as server:
        log = server.log_path.read_text()
        assert "warm-up (decode): 2 step shapes (0 unreachable)" in log, server.log_tail()
        assert log.index("warm-up (decode)") < log.index("ready on")
        built = server.metric(COMPILED)
        assert built >= 4  # 2 shapes (8 rows at 8 and 32 pages a row), greedy and sampled
        client = server.openai()
        for temperature in (0.0, 0.8):
            reply = client.completions.create(model="preset:tiny-dense", prompt="Hi", max_tokens=5,
                                              temperature=temperature)
            assert reply.usage.completion_tokens == 5
        assert server.metric(COMPILED) == built
