"""The AgentX figures of a run of the official AgentX client, from its `profile_export.jsonl`.

Each line is one request: `metadata` (phase, `request_start_ns`, `request_end_ns`, ids, agent
depth), `metrics` (tag -> {value, unit}: TTFT, ITL, token counts, the server's usage) and `error`.
Warm-up and cancelled requests are left out; the rest become `RequestRecord`s for `summarize`.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from agentjax.bench.metrics import RequestRecord, summarize
from agentjax.bench.traces import nonblank_lines
from agentjax.errors import InvalidRequestError

logger = logging.getLogger(__name__)

PROFILE_EXPORT = "profile_export.jsonl"
_SECONDS_PER_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0,
                     "second": 1.0, "seconds": 1.0}


def _value(metrics: dict, *tags: str) -> Any:
    """The first present metric's raw value among `tags`, or None."""
    for tag in tags:
        entry = metrics.get(tag)
        if isinstance(entry, dict) and entry.get("value") is not None:
            return entry["value"]
    return None


def _seconds(metrics: dict, tag: str) -> float | list[float] | None:
    """A time metric in seconds (a list stays a list), converted by its unit."""
    entry = metrics.get(tag)
    if not isinstance(entry, dict) or entry.get("value") is None:
        return None
    unit = str(entry.get("unit", "ms")).lower()
    if unit not in _SECONDS_PER_UNIT:
        raise InvalidRequestError(f"metric {tag!r} has an unknown time unit {unit!r}")
    scale = _SECONDS_PER_UNIT[unit]
    value = entry["value"]
    return [float(v) * scale for v in value] if isinstance(value, list) else float(value) * scale


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return f"{error.get('code')} {error.get('type')}: {error.get('message')}"
    return str(error)


def record_from_line(entry: dict) -> RequestRecord:
    """One profile_export.jsonl object -> a RequestRecord (token counts from the server's usage
    when the client recorded it, as `--use-server-token-count` does)."""
    meta = entry.get("metadata") or {}
    metrics = entry.get("metrics") or {}
    start = int(meta["request_start_ns"]) * 1e-9
    end = int(meta.get("request_end_ns") or meta["request_start_ns"]) * 1e-9
    ids = dict(session_id=str(meta.get("x_correlation_id") or meta.get("conversation_id") or ""),
               turn_index=int(meta.get("turn_index") or 0))
    input_tokens = int(_value(metrics, "usage_prompt_tokens", "input_sequence_length", "error_isl") or 0)
    if entry.get("error"):
        return RequestRecord(start, None, end, input_tokens, 0, 0, error=_error_text(entry["error"]), **ids)
    output_tokens = int(_value(metrics, "usage_completion_tokens", "output_sequence_length",
                               "output_token_count") or 0)
    cached = int(_value(metrics, "usage_prompt_cache_read_tokens") or 0)
    ttft = _seconds(metrics, "time_to_first_token")
    latency = _seconds(metrics, "request_latency")
    if latency is not None:
        end = start + latency
    gaps = _seconds(metrics, "inter_chunk_latency")
    if not isinstance(gaps, list):
        itl = _seconds(metrics, "inter_token_latency")  # a per-request mean: repeat it per gap
        gaps = [itl] * max(0, output_tokens - 1) if isinstance(itl, float) else []
    return RequestRecord(start, None if ttft is None else start + ttft, end, input_tokens, cached,
                         output_tokens, tuple(gaps), **ids)


def load_profile_export(path: str | Path) -> tuple[list[RequestRecord], dict[str, int]]:
    """(profiled records, counts of the lines left out by reason)."""
    path = Path(path)
    if path.is_dir():
        path = path / PROFILE_EXPORT
    if not path.is_file():
        raise InvalidRequestError(f"{path} not found: give the AgentX run's --output-artifact-dir "
                                  f"(holding {PROFILE_EXPORT}) or the file itself")
    records: list[RequestRecord] = []
    skipped = {"warmup": 0, "cancelled": 0, "context_overflow": 0}
    for number, line in nonblank_lines(path):
        try:
            entry = json.loads(line)
            meta = entry.get("metadata") or {}
            phase = str(meta.get("phase_kind") or meta.get("benchmark_phase") or "profiling").lower()
            if phase == "warmup":
                skipped["warmup"] += 1
            elif meta.get("context_overflow_skip"):
                skipped["context_overflow"] += 1
            elif meta.get("was_cancelled"):
                skipped["cancelled"] += 1
            else:
                records.append(record_from_line(entry))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise InvalidRequestError(f"{path}:{number}: not an AgentX record ({error!r})") from error
    return records, skipped


def report_from_dir(path: str | Path, num_gpus: int = 1) -> dict:
    """The AgentX summary of a run: TPGS = (input + output tokens of the profiled requests) /
    (last end - first start) / GPUs, P90 E2E-normalised interactivity, hit rate, latencies."""
    records, skipped = load_profile_export(path)
    if not records:
        raise InvalidRequestError(f"{path}: no profiled requests ({skipped})")
    wall = max(r.end_time_s for r in records) - min(r.start_time_s for r in records)
    summary = summarize(records, max(wall, 1e-9), num_gpus)
    summary.update({f"skipped_{reason}": count for reason, count in skipped.items()})
    return summary
