"""The AgentX benchmark metrics, computed from one record per replayed request.

TPGS, end-to-end-normalised P90 interactivity, 1 / inter-token latency, TTFT / ITL / E2E
percentiles, the token hit rate from the server's `cached_tokens`, and the error rate; written to a
JSON file and a printed table. Host only: never imports jax.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agentjax.errors import InvalidRequestError

logger = logging.getLogger(__name__)

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestRecord:
    """One replayed request as the client saw it. Times are seconds on one clock (wall or
    monotonic). A failed request keeps its `error` and counts in no token or latency figure."""

    start_time_s: float
    first_token_time_s: float | None
    end_time_s: float
    input_tokens: int  # the whole prompt, cached tokens included
    cached_tokens: int  # the server's usage.prompt_tokens_details.cached_tokens
    output_tokens: int
    inter_token_latencies_s: tuple[float, ...] = ()  # gaps between streamed tokens
    error: str | None = None
    session_id: str = ""
    turn_index: int = 0
    kind: str = ""  # the replay's label: first, turn, branch, compaction, retry ("" unlabelled)

    @classmethod
    def from_token_times(cls, start_time_s: float, token_times_s: Sequence[float],
                         end_time_s: float, input_tokens: int, cached_tokens: int,
                         **fields: Any) -> RequestRecord:
        """A successful record from the arrival time of each output token."""
        times = [float(time) for time in token_times_s]
        return cls(start_time_s=start_time_s, first_token_time_s=times[0] if times else None,
                   end_time_s=end_time_s, input_tokens=input_tokens, cached_tokens=cached_tokens,
                   output_tokens=len(times),
                   inter_token_latencies_s=tuple(float(gap) for gap in np.diff(times)), **fields)

    @property
    def succeeded(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time_s is None else self.first_token_time_s - self.start_time_s

    @property
    def e2e_latency_s(self) -> float:
        return self.end_time_s - self.start_time_s


def _percentile(values: Sequence[float], percent: float) -> float | None:
    """numpy's linear-interpolation percentile; None for no values."""
    return float(np.percentile(values, percent)) if len(values) else None


def _inverse(value: float | None) -> float | None:
    return None if value is None or value <= 0 else 1.0 / value


def summarize(records: Sequence[RequestRecord], wall_time_s: float, num_gpus: int) -> dict:
    """The AgentX figures of one run. Tokens and latencies count successful requests only.

    tpgs = (input tokens, cached included, + output tokens) / (wall_time_s * num_gpus)
    p90_interactivity = 1 / P90(E2E latency / output tokens), over requests with output
    p90_itl_interactivity = 1 / P90(inter-token latency), all streamed gaps pooled
    hit_rate = cached tokens / input tokens
    """
    if not wall_time_s > 0 or num_gpus < 1:
        raise InvalidRequestError(
            f"wall_time_s={wall_time_s} must be > 0 and num_gpus={num_gpus} must be >= 1")
    succeeded = [record for record in records if record.succeeded]
    input_tokens = sum(record.input_tokens for record in succeeded)
    cached_tokens = sum(record.cached_tokens for record in succeeded)
    output_tokens = sum(record.output_tokens for record in succeeded)
    seconds_per_output_token = [record.e2e_latency_s / record.output_tokens
                                for record in succeeded if record.output_tokens > 0]
    ttfts = [record.ttft_s for record in succeeded if record.ttft_s is not None]
    itls = [gap for record in succeeded for gap in record.inter_token_latencies_s]
    e2es = [record.e2e_latency_s for record in succeeded]
    errors = len(records) - len(succeeded)
    summary: dict[str, Any] = {
        "tpgs": (input_tokens + output_tokens) / (wall_time_s * num_gpus),
        "p90_interactivity": _inverse(_percentile(seconds_per_output_token, 90)),
        "hit_rate": cached_tokens / input_tokens if input_tokens else None,
        "requests": len(records),
        "errors": errors,
        "error_rate": errors / len(records) if records else None,
    }
    for percent in PERCENTILES:
        summary[f"ttft_p{percent}_s"] = _percentile(ttfts, percent)
        summary[f"itl_p{percent}_s"] = _percentile(itls, percent)
        summary[f"e2e_p{percent}_s"] = _percentile(e2es, percent)
    summary["p50_itl_interactivity"] = _inverse(summary["itl_p50_s"])
    summary["p90_itl_interactivity"] = _inverse(summary["itl_p90_s"])
    summary.update(input_tokens=input_tokens, cached_tokens=cached_tokens,
                   output_tokens=output_tokens, wall_time_s=wall_time_s, num_gpus=num_gpus)
    kinds = sorted({record.kind for record in succeeded if record.kind})
    if kinds:
        summary["hit_rate_by_kind"] = {kind: _hits([r for r in succeeded if r.kind == kind]) for kind in kinds}
    if errors:
        logger.warning("%d of %d requests failed", errors, len(records))
    return summary


def _hits(records: Sequence[RequestRecord]) -> dict:
    """Requests, input and cached tokens, and the token hit rate of `records`."""
    input_tokens = sum(record.input_tokens for record in records)
    cached_tokens = sum(record.cached_tokens for record in records)
    return {"requests": len(records), "input_tokens": input_tokens, "cached_tokens": cached_tokens,
            "hit_rate": cached_tokens / input_tokens if input_tokens else None}


def write_summary(summary: Mapping[str, Any], path: str | Path) -> None:
    """The summary as one JSON object (NaN-free: missing figures are null)."""
    clean = {key: (None if isinstance(value, float) and not math.isfinite(value) else value)
             for key, value in summary.items()}
    Path(path).write_text(json.dumps(clean, indent=2, sort_keys=False) + "\n", encoding="utf-8")


_TABLE_ROWS = (
    ("TPGS (tokens / GPU-s)", "tpgs", "{:,.1f}"),
    ("P90 interactivity (tok/s, E2E-normalised)", "p90_interactivity", "{:.2f}"),
    ("P50 interactivity (tok/s, 1/ITL)", "p50_itl_interactivity", "{:.2f}"),
    ("P90 interactivity (tok/s, 1/ITL)", "p90_itl_interactivity", "{:.2f}"),
    ("token hit rate", "hit_rate", "{:.2%}"),
    ("requests", "requests", "{:,}"),
    ("errors", "errors", "{:,}"),
    ("error rate", "error_rate", "{:.2%}"),
    *((f"TTFT P{p} (s)", f"ttft_p{p}_s", "{:.3f}") for p in PERCENTILES),
    *((f"ITL P{p} (ms)", f"itl_p{p}_s", "ms") for p in PERCENTILES),
    *((f"E2E P{p} (s)", f"e2e_p{p}_s", "{:.3f}") for p in PERCENTILES),
    ("input tokens (cached included)", "input_tokens", "{:,}"),
    ("cached tokens", "cached_tokens", "{:,}"),
    ("output tokens", "output_tokens", "{:,}"),
    ("wall time (s)", "wall_time_s", "{:.1f}"),
    ("GPUs", "num_gpus", "{}"),
)


def format_table(summary: Mapping[str, Any]) -> str:
    """A two-column text table of the summary; absent figures print as "-"."""
    lines = []
    for label, key, style in _TABLE_ROWS:
        value = summary.get(key)
        if value is None:
            text = "-"
        elif style == "ms":
            text = f"{value * 1000:.2f}"
        else:
            text = style.format(value)
        lines.append((label, text))
    width = max(len(label) for label, _ in lines)
    return "\n".join(f"{label:<{width}}  {text:>14}" for label, text in lines)
