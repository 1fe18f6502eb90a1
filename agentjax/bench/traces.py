"""Agent traces as one stream of sessions and turns, and the token ids a replay sends for a turn.

Loads weka traces (sessions, turns, subagents, 64-token hash ids) and Mooncake FAST'25 JSONL (one
request a line, 512-token blocks, global hash ids), scales them by `context_scale`, and turns hash ids
into deterministic, lane-salted prompt token ids (statistics of a stream: `trace_stats`). Host only: never imports jax.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from agentjax.errors import InvalidRequestError
from agentjax.progress import Throttle

logger = logging.getLogger(__name__)

WEKA_BLOCK_SIZE = 64
MOONCAKE_BLOCK_SIZE = 512
GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
MIX_MULTIPLIER_1 = np.uint64(0xBF58476D1CE4E5B9)
MIX_MULTIPLIER_2 = np.uint64(0x94D049BB133111EB)
_SHIFT_27, _SHIFT_30, _SHIFT_31 = np.uint64(27), np.uint64(30), np.uint64(31)


def nonblank_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """The non-blank lines of a JSON-lines file, with their 1-based line numbers (for error messages)."""
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if line.strip():
                yield number, line


@dataclass(frozen=True)
class Turn:
    """One request of a session. `hash_ids[i]` names the content of tokens [i*B, (i+1)*B), B the
    session's block size; the last block may be cut short by `input_tokens` (Mooncake)."""

    index: int
    hash_ids: np.ndarray  # int64, one id per (possibly partial) block of the prompt
    input_tokens: int
    output_tokens: int
    think_time_s: float  # tool/user time between the previous turn's end and this turn's send
    offset_s: float  # recorded send time, seconds from the start of its session
    request_type: str = "n"  # weka: "n" main request, "s" side request; others use "n"
    recorded_api_time_s: float | None = None
    retries: int = 0  # identical re-sends after the first (a client retrying after a timeout)
    compacted: bool = False  # the first turn after a compaction: the context's tail became a summary


@dataclass
class Session:
    """A conversation: its turns in order, and subagent sessions forked from it."""

    session_id: str
    turns: list[Turn]
    block_size: int
    hash_scope: str  # equal (scope, hash id) means equal content; subagents share the parent's
    subagents: list[Session] = field(default_factory=list)
    parent_id: str | None = None
    fork_turn: int | None = None  # the parent turn after which this subagent starts
    start_offset_s: float = 0.0  # from the parent's start (root sessions: from the trace start)
    head_tokens: int = 0  # the system prompt and tool definitions every turn starts with (0: unknown)


@dataclass(frozen=True)
class TokenIdRange:
    """Prompt token ids lie in [low, vocab_size): low ids are the tokenizer's special tokens."""

    low: int = 256
    vocab_size: int = 49_152

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.vocab_size:
            raise InvalidRequestError(
                f"token id range [{self.low}, {self.vocab_size}) is empty or negative; "
                "need 0 <= low < vocab_size")


def scaled_block_size(block_size: int, context_scale: float) -> int:
    """A block of `block_size` tokens shrinks to max(1, round(block_size * context_scale))."""
    if not context_scale > 0:
        raise InvalidRequestError(f"context_scale={context_scale!r} must be > 0")
    return max(1, round(block_size * context_scale))


def scale_turn_lengths(input_tokens: int, output_tokens: int, block_size: int,
                       context_scale: float) -> tuple[int, int]:
    """Scaled (input, output) lengths. Every length shrinks by the block's effective ratio
    (scaled block / block), so whole blocks stay whole and the input/output mix is kept."""
    new_block = scaled_block_size(block_size, context_scale)
    ratio = new_block / block_size
    full_blocks, remainder = divmod(input_tokens, block_size)
    scaled_input = max(1, full_blocks * new_block + round(remainder * ratio))
    scaled_output = max(1, round(output_tokens * ratio))
    return scaled_input, scaled_output


def scale_session(session: Session, original_block_size: int, context_scale: float) -> Session:
    """Shrinks a session and its subagents in place by `context_scale`; returns it."""
    if context_scale == 1.0:
        return session
    turns = []
    for turn in session.turns:
        scaled_input, scaled_output = scale_turn_lengths(
            turn.input_tokens, turn.output_tokens, original_block_size, context_scale)
        turns.append(replace(turn, input_tokens=scaled_input, output_tokens=scaled_output))
    session.turns = turns
    session.block_size = scaled_block_size(original_block_size, context_scale)
    session.head_tokens = session.head_tokens // original_block_size * session.block_size
    session.subagents = [scale_session(sub, original_block_size, context_scale)
                         for sub in session.subagents]
    return session


# ---------------------------------------------------------------- weka traces (agentx-dev)

def _weka_turns(requests: Sequence[dict], source: str) -> list[Turn]:
    turns = []
    for request in requests:
        try:
            api_time = request.get("api_time")
            turns.append(Turn(
                index=len(turns),
                hash_ids=np.asarray(request["hash_ids"], dtype=np.int64),
                input_tokens=int(request["in"]),
                output_tokens=int(request["out"]),
                think_time_s=float(request.get("think_time") or 0.0),
                offset_s=float(request["t"]),
                request_type=str(request["type"]),
                recorded_api_time_s=None if api_time is None else float(api_time)))
        except (KeyError, TypeError, ValueError) as error:
            raise InvalidRequestError(
                f"{source}: request {len(turns)} is not a weka request ({error!r})") from error
    return turns


def parse_weka_trace(trace: dict, source: str = "<trace>", context_scale: float = 1.0) -> Session:
    """One weka trace object -> a root Session whose subagents fork at their recorded time."""
    trace_id = str(trace.get("id", source))
    block_size = int(trace.get("block_size", WEKA_BLOCK_SIZE))
    scope = f"weka:{trace_id}"
    main_requests = [r for r in trace["requests"] if r.get("type") != "subagent"]
    head_tokens = int(trace.get("system_tokens") or 0) + int(trace.get("tool_tokens") or 0)
    session = Session(trace_id, _weka_turns(main_requests, source), block_size, scope,
                      head_tokens=head_tokens)
    main_offsets = [turn.offset_s for turn in session.turns]
    for entry in trace["requests"]:
        if entry.get("type") != "subagent":
            continue
        start = float(entry["t"])
        fork_turn = max(0, int(np.searchsorted(main_offsets, start, side="right")) - 1)
        session.subagents.append(Session(
            session_id=f"{trace_id}/{entry.get('agent_id', len(session.subagents))}",
            turns=_weka_turns(entry["requests"], source), block_size=block_size,
            hash_scope=scope, parent_id=trace_id, fork_turn=fork_turn, start_offset_s=start))
    return scale_session(session, block_size, context_scale)


def load_weka_trace_file(path: str | Path, context_scale: float = 1.0) -> Session:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as file:
        trace = json.loads(file.read())
    return parse_weka_trace(trace, source=str(path), context_scale=context_scale)


def load_weka_traces(directory: str | Path, context_scale: float = 1.0) -> list[Session]:
    """Every `*.json.gz` / `*.json` weka trace in `directory`, one root session each, by name."""
    directory = Path(directory)
    paths = sorted(directory.glob("*.json.gz")) + sorted(directory.glob("*.json"))
    if not paths:
        raise InvalidRequestError(f"no weka traces (*.json.gz, *.json) in {directory}")
    sessions, throttle = [], Throttle()
    for index, path in enumerate(paths):
        if throttle.due():
            logger.info("loading traces from %s: %d/%d files (%.0f s)", directory, index, len(paths), throttle.elapsed)
        sessions.append(load_weka_trace_file(path, context_scale))
    logger.info("loaded %d weka sessions from %s in %.1f s", len(sessions), directory, throttle.elapsed)
    return sessions


# ---------------------------------------------------------------- Mooncake FAST'25 JSONL

def load_mooncake_jsonl(path: str | Path, context_scale: float = 1.0) -> list[Session]:
    """One single-turn session per line; `timestamp` (ms) becomes the session's start offset.
    Hash ids are global across the file, so every session shares one hash scope."""
    path = Path(path)
    scope = f"mooncake:{path.name}"
    sessions = []
    for line_number, line in nonblank_lines(path):
        try:
            record = json.loads(line)
            input_tokens = int(record["input_length"])
            turn = Turn(index=0, hash_ids=np.asarray(record["hash_ids"], dtype=np.int64),
                        input_tokens=input_tokens, output_tokens=int(record["output_length"]),
                        think_time_s=0.0, offset_s=0.0)
            start = float(record["timestamp"]) / 1000.0
        except (KeyError, TypeError, ValueError) as error:
            raise InvalidRequestError(
                f"{path}:{line_number}: not a Mooncake request line ({error!r})") from error
        if len(turn.hash_ids) < input_tokens // MOONCAKE_BLOCK_SIZE:
            raise InvalidRequestError(
                f"{path}:{line_number}: {len(turn.hash_ids)} hash ids cannot cover "
                f"input_length={input_tokens} in {MOONCAKE_BLOCK_SIZE}-token blocks")
        session = Session(f"{path.stem}:{line_number}", [turn], MOONCAKE_BLOCK_SIZE, scope,
                          start_offset_s=start)
        sessions.append(scale_session(session, MOONCAKE_BLOCK_SIZE, context_scale))
    logger.info("loaded %d Mooncake requests from %s", len(sessions), path)
    return sessions


# ---------------------------------------------------------------- walking the stream

def iter_turns_in_time_order(session: Session) -> Iterator[tuple[Session, Turn, float]]:
    """(session, turn, seconds from the root's start) for a session and its subagents, by
    recorded send time; on a tie the parent's turn comes first."""
    entries = []

    def collect(node: Session, node_start: float, depth: int) -> None:
        for turn in node.turns:
            entries.append((node_start + turn.offset_s, depth, len(entries), node, turn))
        for sub in node.subagents:
            collect(sub, node_start + sub.start_offset_s, depth + 1)

    collect(session, 0.0, 0)
    entries.sort(key=lambda entry: entry[:3])
    for offset, _, _, node, turn in entries:
        yield node, turn, offset


def iter_all_sessions(sessions: Sequence[Session]) -> Iterator[Session]:
    """Every session, each followed by its subagents (depth first)."""
    for session in sessions:
        yield session
        yield from iter_all_sessions(session.subagents)


# ---------------------------------------------------------------- token ids from hash ids

def splitmix64(values: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser over a uint64 array (array arithmetic wraps without warning)."""
    z = values + GOLDEN_GAMMA
    z = (z ^ (z >> _SHIFT_30)) * MIX_MULTIPLIER_1
    z = (z ^ (z >> _SHIFT_27)) * MIX_MULTIPLIER_2
    return z ^ (z >> _SHIFT_31)


def stable_key(*parts: object) -> int:
    """A 64-bit key from the parts' text, equal across processes (never Python's `hash`)."""
    text = "\x1f".join(str(part) for part in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _counter_tokens(keys: np.ndarray, length: int, token_range: TokenIdRange) -> np.ndarray:
    """A (len(keys), length) array of ids in the range: token j of row k is mix(key_k + j*gamma)."""
    with np.errstate(over="ignore"):
        counters = keys[:, None] + np.arange(1, length + 1, dtype=np.uint64)[None, :] * GOLDEN_GAMMA
    span = np.uint64(token_range.vocab_size - token_range.low)
    return (splitmix64(counters) % span).astype(np.int64) + token_range.low


def prompt_token_ids(session: Session, turn: Turn, lane_salt: int | str = 0,
                     token_range: TokenIdRange = TokenIdRange()) -> np.ndarray:
    """The turn's prompt, `turn.input_tokens` int32 ids. Equal (scope, lane salt, hash id) give an
    equal block; tokens past the hash ids are fresh, keyed by (lane salt, session, turn)."""
    block_size = session.block_size
    covered_blocks = min(len(turn.hash_ids), -(-turn.input_tokens // block_size))
    lane_key = np.uint64(stable_key(session.hash_scope, lane_salt))
    with np.errstate(over="ignore"):
        block_keys = splitmix64(lane_key ^ splitmix64(
            turn.hash_ids[:covered_blocks].astype(np.uint64)))
    prompt = _counter_tokens(block_keys, block_size, token_range).reshape(-1)[:turn.input_tokens]
    missing = turn.input_tokens - len(prompt)
    if missing > 0:
        tail_key = np.array([stable_key(session.hash_scope, lane_salt, session.session_id,
                                        turn.index, "tail")], dtype=np.uint64)
        prompt = np.concatenate([prompt, _counter_tokens(tail_key, missing, token_range)[0]])
    return prompt.astype(np.int32)
