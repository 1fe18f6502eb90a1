"""Several processes (hosts) through `jax.distributed`: process 0 drives, the others follow its steps.

`initialize` joins the run (coordinator address, process count and id from the engine settings)
before any device is used; the layout's mesh then spans every process's devices. Process 0 runs the
engine; its runner is a `DriverRunner`, which sends each runner call (as JSON, through a broadcast
over the devices: nothing is unpickled) before running it, and every other process runs
`follow(runner)`, which repeats the same calls on its own runner, so every process enters the same
collectives with the same inputs. `LLM.generate` and `agentjax serve` use this. Host-side glue: the
step itself is sharded_step.py's.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from agentjax.errors import ParallelLayoutError
from agentjax.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)

# Runner calls a driver sends; a follower runs exactly these.
CALLS = ("execute", "execute_extended", "execute_ranks", "execute_ranks_extended", "copy_pages", "reset_kv")


def initialize(engine_cfg) -> None:
    """`jax.distributed.initialize` for a multi-process engine (once per process; no-op for one)."""
    if engine_cfg.num_processes <= 1:
        return
    import jax

    if jax.distributed.is_initialized():
        return
    logger.info("joining %s as process %d of %d", engine_cfg.coordinator_address, engine_cfg.process_id,
                engine_cfg.num_processes)
    jax.distributed.initialize(engine_cfg.coordinator_address, engine_cfg.num_processes, engine_cfg.process_id)
    if jax.process_count() != engine_cfg.num_processes:
        raise ParallelLayoutError(f"jax.distributed reports {jax.process_count()} processes, the settings say "
                                  f"{engine_cfg.num_processes}")


def broadcast_message(message: Any | None) -> Any:
    """Process 0's JSON-able `message`, on every process (others pass None): its length, then its bytes."""
    from jax.experimental import multihost_utils

    import jax

    payload = json.dumps(message).encode() if jax.process_index() == 0 else b""
    size = int(multihost_utils.broadcast_one_to_all(np.asarray([len(payload)], np.int32))[0])
    data = np.zeros(size, np.uint8)
    if jax.process_index() == 0:
        data[:] = np.frombuffer(payload, np.uint8)
    data = np.asarray(multihost_utils.broadcast_one_to_all(data), np.uint8)
    return json.loads(data.tobytes().decode())


def _plain(value):
    """JSON-able form of runner arguments (numpy arrays and sets as lists, dataclasses as dicts)."""
    import dataclasses

    if isinstance(value, np.ndarray):
        return {"__array__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (set, frozenset)):
        return {"__set__": sorted(_plain(v) for v in value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"__dataclass__": type(value).__name__,
                "fields": {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, dict):
        return {"__dict__": [[_plain(k), _plain(v)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _restore(value):
    from agentjax.runner.extras import RowPenalties, StepExtras

    kinds = {"StepExtras": StepExtras, "RowPenalties": RowPenalties}
    if isinstance(value, list):
        return [_restore(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__array__" in value:
        return np.asarray(value["__array__"], dtype=value["dtype"])
    if "__set__" in value:
        return set(value["__set__"])
    if "__dict__" in value:
        return {_restore(k): _restore(v) for k, v in value["__dict__"]}
    if "__dataclass__" in value:
        if value["__dataclass__"] not in kinds:
            raise ParallelLayoutError(f"a runner call carries an unknown type {value['__dataclass__']!r}")
        return kinds[value["__dataclass__"]](**{k: _restore(v) for k, v in value["fields"].items()})
    return {k: _restore(v) for k, v in value.items()}


class DriverRunner:
    """Process 0's runner: announces each call to the followers, then runs it on its own devices."""

    def __init__(self, runner):
        self._runner = runner

    def __getattr__(self, name):
        attribute = getattr(self._runner, name)
        if name not in CALLS:
            return attribute

        def announced(*args, **kwargs):
            broadcast_message({"call": name, "args": _plain(list(args)), "kwargs": _plain(kwargs)})
            return attribute(*args, **kwargs)

        return announced

    @property
    def kv_pages(self):
        return self._runner.kv_pages

    def send(self, message: dict) -> None:
        """A message that is not a runner call (the end of a generate, a stop) to every follower."""
        broadcast_message(message)


def follow(runner) -> dict:
    """Repeat the driver's runner calls until it sends anything else; returns that message."""
    while True:
        message = broadcast_message(None)
        name = message.get("call")
        if name not in CALLS:
            return message
        args = [_restore(a) for a in message["args"]]
        kwargs = {k: _restore(v) for k, v in _restore(message["kwargs"]).items()}
        if name in ("execute", "execute_extended"):
            args[0] = [tuple(row) for row in args[0]]
            args[1] = [tuple(s) for s in args[1]]
        if "kv_copies" in kwargs:
            kwargs["kv_copies"] = [tuple(c) for c in kwargs["kv_copies"]]
        getattr(runner, name)(*args, **kwargs)


def generate_across_processes(llm, generate, *args) -> list:
    """`LLM.generate` on several processes: process 0 runs `generate(*args)` (its runner announcing
    every call) and sends the outputs; the others follow and return them."""
    import jax

    if jax.process_index() == 0:
        outputs = generate(*args)
        llm.engine.runner.send({"call": "done", "outputs": [_output_fields(o) for o in outputs]})
        return outputs
    message = follow(llm.engine.runner)
    if message.get("call") != "done":
        raise ParallelLayoutError(f"the driver ended the run with {message.get('call')!r}, expected 'done'")
    return [RequestOutput(**{**fields, "outputs": [CompletionOutput(**c) for c in fields["outputs"]]})
            for fields in message["outputs"]]


def _output_fields(output) -> dict:
    """A RequestOutput's tokens, texts and reasons (log probabilities stay on process 0)."""
    return {"request_id": output.request_id, "prompt_token_ids": list(output.prompt_token_ids),
            "token_ids": list(output.token_ids), "text": output.text, "finish_reason": output.finish_reason,
            "num_cached_tokens": output.num_cached_tokens,
            "outputs": [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                         "finish_reason": c.finish_reason} for c in output.outputs]}


def distributed_runner(runner, engine_cfg):
    """Process 0's runner announces its calls; the others' run them when `follow` says (as they are)."""
    if engine_cfg.num_processes <= 1 or engine_cfg.process_id != 0:
        return runner
    return DriverRunner(runner)
