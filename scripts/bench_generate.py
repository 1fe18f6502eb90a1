"""Generation benchmark: agentjax against HF transformers on SmolLM2-135M, CPU, written to BENCHMARKS.md.

Both sides load the same GGUF file (the embedded SmolLM2-135M-Instruct: float32 weights; transformers
dequantises them at load, agentjax keeps the Q4_1/Q8_0 blocks and dequantises inside the step), get
the same token ids (from agentjax's tokenizer), decode greedily with no early stop, and run on the
same number of CPU threads. transformers runs in a separate Python (`--hf-python`, torch CPU) through
`scripts/bench_generate_hf_peer.py`; the two sides take turns, one timed run each, round after round,
so that load from other processes on the machine falls on both alike. Figures are medians.

What it measures
  * decode tok/s at batch 1 and at batch 16: generated tokens / wall time of one generate call of
    `--new-tokens` tokens (the prefill of the short prompts is inside that time, on both sides);
  * prefill tok/s on a `--prefill-tokens` prompt: prompt tokens / wall time of a generate call that
    makes one token;
  * agentjax only: decode tok/s at batch 16 with numerics="batch_invariant" (its cost); how many of
    16 prompts of different lengths get other greedy tokens in a batch than alone, in plain float32
    ("fast") and in "batch_invariant"; and a first (cold, converting) against a second (warm,
    cache-restoring) `LLM()` start, each in a fresh subprocess with its own empty AGENTJAX_CACHE.

It prints a table and writes the section "## Generation (SmolLM2-135M, CPU)" of BENCHMARKS.md,
replacing only that section. agentjax runs with numerics="fast" and prefix caching off (so repeated
runs of one prompt are not served from cache).

Usage:
    python scripts/bench_generate.py --hf-python HF_VENV/bin/python
    python scripts/bench_generate.py --runs 5 --no-write      # print only
    python scripts/bench_generate.py --help

The transformers venv (Python 3.11, CPU torch):
    python3 -m venv HF_VENV && HF_VENV/bin/pip install torch==2.13.0 transformers accelerate gguf
Without it the agentjax side still runs and the transformers column reads "not run".
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts below, however this one is run

from bench_generate_peers import Peer, PeerError, log, time_starts  # noqa: E402
from bench_generate_prompts import build_prompts, compare, divergence  # noqa: E402
from benchmarks_md import write_section  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SECTION = "## Generation (SmolLM2-135M, CPU)"
VENV_HINT = (
    "python3 -m venv HF_VENV && HF_VENV/bin/pip install torch==2.13.0 transformers accelerate gguf"
)

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-python", default=os.environ.get("AGENTJAX_HF_PYTHON", ""),
                        help="Python of the transformers venv (default $AGENTJAX_HF_PYTHON)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per figure, after one warm-up (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for each side (default 2)")
    parser.add_argument("--batch", type=int, default=16, help="the large decode batch (default 16)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row (default 64)")
    parser.add_argument("--prefill-tokens", type=int, default=1024, help="long prompt length (default 1024)")
    parser.add_argument("--divergence-tokens", type=int, default=32,
                        help="greedy tokens per prompt in the batch-vs-alone check (default 32)")
    parser.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md", help="file to write the section to")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    parser.add_argument("--skip-start", action="store_true", help="skip the cold/warm LLM() start timing")
    parser.add_argument("--skip-divergence", action="store_true", help="skip the batch-vs-alone check")
    parser.add_argument("--baseline-rev", default="",
                        help="also time agentjax at this git revision (a worktree, in its own process), "
                             "alternating with this checkout")
    return parser.parse_args()


def limit_threads(threads: int) -> str:
    """Pin this process (and so jax's thread pools) to `threads` CPUs; say what was done."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) > threads:
        os.sched_setaffinity(0, allowed[:threads])
        return f"pinned to CPUs {allowed[:threads]}"
    return f"the process may use {len(allowed)} CPUs, no pinning needed"


# ---- measurements ------------------------------------------------------------------------------
@dataclass
class Figure:
    tokens: int
    seconds: list[float] = field(default_factory=list)

    @property
    def rates(self) -> list[float]:
        return [self.tokens / s for s in self.seconds]

    @property
    def median(self) -> float | None:
        return statistics.median(self.rates) if self.seconds else None


def fmt_rate(value: float | None) -> str:
    return "not run" if value is None else f"{value:.1f}"


def fmt_spread(fig: Figure) -> str:
    if not fig.seconds:
        return ""
    rates = fig.rates
    return f" ({min(rates):.1f}–{max(rates):.1f})" if len(rates) > 1 else ""


def fmt_positions(result: dict | None, what: str = "differ") -> str:
    if result is None:
        return "not run"
    text = f"{result['differ']} of {result['of']} {what}"
    if result["first_positions"]:
        text += "; first differing new token (prompt: position) " + ", ".join(
            f"{i}: {p}" for i, p in result["first_positions"])
    return text


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    args = parse_args()
    pinning = limit_threads(args.threads)
    load_start = os.getloadavg()
    log(f"threads: {args.threads} ({pinning}); load average {load_start[0]:.1f}")

    starts = None
    if not args.skip_start:
        log("timing a cold and a warm LLM() start in fresh subprocesses")
        starts = time_starts()

    import jax

    from agentjax import LLM, SamplingParams
    from checkpoints.embedded import smollm2_path

    gguf = smollm2_path()
    peer = None
    peer_note = ""
    if args.hf_python and Path(args.hf_python).exists():
        log(f"starting the transformers peer ({args.hf_python})")
        try:
            peer = Peer.transformers(args.hf_python, gguf, args.threads)
            log(f"transformers {peer.info['transformers']}, torch {peer.info['torch']}, "
                f"{peer.info['threads']} threads, loaded in {peer.info['load_s']:.1f}s")
        except PeerError as exc:
            peer_note = f"the transformers peer failed to start: {exc}"
            log(peer_note)
    else:
        peer_note = (f"no transformers venv at {args.hf_python}" if args.hf_python else
                     "no transformers venv given (--hf-python or AGENTJAX_HF_PYTHON)") + f"; create one with: {VENV_HINT}"
        log(peer_note)

    engine_args = dict(max_num_batched_tokens=2048, max_num_seqs=64, enable_prefix_caching=False)
    baseline = baseline_worktree = None
    if args.baseline_rev:
        baseline_worktree = Path(tempfile.mkdtemp(prefix="bench-generate-baseline-")) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(baseline_worktree),
                        args.baseline_rev], check=True, capture_output=True)
        log(f"starting agentjax at {args.baseline_rev} (worktree {baseline_worktree})")
        baseline = Peer.agentjax_at(baseline_worktree, args.baseline_rev, args.threads, engine_args)
        log(f"agentjax at {args.baseline_rev} loaded in {baseline.info['load_s']:.1f}s from {baseline.info['agentjax']}")
    llm = LLM(None, numerics="fast", **engine_args)
    llm_bi = LLM(None, numerics="batch_invariant", **engine_args)
    decode_prompts, long_prompt, divergence_prompts = build_prompts(llm.tokenizer, args)

    sp_decode = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    sp_prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    cases = [  # name, prompts, sampling, generated or prompt tokens counted
        ("decode_b1", decode_prompts[:1], sp_decode, args.new_tokens),
        (f"decode_b{args.batch}", decode_prompts, sp_decode, args.batch * args.new_tokens),
        ("prefill", [long_prompt], sp_prefill, len(long_prompt)),
    ]
    big = f"decode_b{args.batch}"
    aj = {name: Figure(count) for name, _, _, count in cases}
    hf = {name: Figure(count) for name, _, _, count in cases}
    base = {name: Figure(count) for name, _, _, count in cases}
    aj_bi = Figure(args.batch * args.new_tokens)
    outputs: dict[str, tuple[list, list]] = {}

    def run_aj(engine, prompts, sp) -> tuple[float, list[list[int]]]:
        started = time.perf_counter()
        outs = engine.generate(prompts, sp)
        return time.perf_counter() - started, [o.token_ids for o in outs]

    def run_hf(prompts, new_tokens) -> tuple[float, list[list[int]]] | None:
        nonlocal peer, peer_note
        if peer is None:
            return None
        try:
            return peer.generate(prompts, new_tokens)
        except PeerError as exc:
            peer_note = f"the transformers peer failed mid-run: {exc}"
            log(peer_note)
            peer = None
            return None

    shapes_after_warmup: dict[str, int] = {}
    for round_no in range(args.runs + 1):
        warm = round_no == 0
        log("warm-up round (untimed)" if warm else f"timed round {round_no} of {args.runs}")
        for name, prompts, sp, _count in cases:
            got_hf = run_hf(prompts, sp.max_tokens)
            got_base = baseline.generate(prompts, sp.max_tokens) if baseline else None
            seconds, tokens = run_aj(llm, prompts, sp)
            bi = run_aj(llm_bi, prompts, sp) if name == big else None
            if warm:
                outputs[name] = (tokens, got_hf[1] if got_hf else None)
                continue
            aj[name].seconds.append(seconds)
            if got_base:
                base[name].seconds.append(got_base[0])
            if got_hf:
                hf[name].seconds.append(got_hf[0])
            if bi:
                aj_bi.seconds.append(bi[0])
            log(f"  {name}: agentjax {aj[name].tokens / seconds:.1f} tok/s"
                + (f", transformers {hf[name].tokens / got_hf[0]:.1f} tok/s" if got_hf else "")
                + (f", agentjax at {args.baseline_rev} {base[name].tokens / got_base[0]:.1f} tok/s" if got_base else "")
                + (f", agentjax batch_invariant {aj_bi.tokens / bi[0]:.1f} tok/s" if bi else ""))
        if warm:
            shapes_after_warmup = {"fast": len(llm.engine.runner.compiled_shapes),
                                   "batch_invariant": len(llm_bi.engine.runner.compiled_shapes)}
    shapes_after_timing = {"fast": len(llm.engine.runner.compiled_shapes),
                           "batch_invariant": len(llm_bi.engine.runner.compiled_shapes)}
    hf_info = peer.info if peer else None
    if peer:
        peer.close()
    if baseline:
        baseline.close()
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline_worktree)], check=False)

    agreement = {}
    for name, (ours, theirs) in outputs.items():
        if theirs is not None and name != "prefill":
            agreement[name] = compare(ours, theirs)

    div_fast = div_bi = None
    if not args.skip_divergence:
        log(f"batch-vs-alone check: {len(divergence_prompts)} prompts of "
            f"{min(map(len, divergence_prompts))}-{max(map(len, divergence_prompts))} tokens, "
            f"{args.divergence_tokens} greedy tokens")
        div_fast = divergence(llm, divergence_prompts, args.divergence_tokens)
        log(f"  fast: {fmt_positions(div_fast)}")
        div_bi = divergence(llm_bi, divergence_prompts, args.divergence_tokens)
        log(f"  batch_invariant: {fmt_positions(div_bi)}")

    # ---- report ----
    load_end = os.getloadavg()
    labels = {
        "decode_b1": f"Decode tok/s, batch 1 ({args.new_tokens} new tokens)",
        big: f"Decode tok/s, batch {args.batch} ({args.new_tokens} new tokens each)",
        "prefill": f"Prefill tok/s, {len(long_prompt)}-token prompt",
    }
    rows = []
    for name, *_ in cases:
        a, h, b = aj[name].median, hf[name].median, base[name].median
        ratio = f"{a / h:.2f}x" if a and h else "—"
        row = f"| {labels[name]} | {fmt_rate(a)}{fmt_spread(aj[name])} | {fmt_rate(h)}{fmt_spread(hf[name])} | {ratio} |"
        if baseline:
            row += f" {fmt_rate(b)}{fmt_spread(base[name])} | " + (f"{a / b:.2f}x |" if a and b else "— |")
        rows.append(row)
    header = "| What | agentjax | transformers | agentjax / transformers |"
    rule = "|---|---|---|---|"
    if baseline:
        header += f" agentjax at {args.baseline_rev} | this / {args.baseline_rev} |"
        rule += "---|---|"
    fast_big, bi_big = aj[big].median, aj_bi.median
    if hf_info is None and not peer_note:
        peer_note = "the transformers peer did not run"
    versions = (f"Python {platform.python_version()}, jax {jax.__version__}"
                + (f"; transformers side: Python {hf_info['python']}, torch {hf_info['torch']}, "
                   f"transformers {hf_info['transformers']}" if hf_info else ""))
    # The transformers venv lives wherever its user built it: the command names it by its role.
    command = "python scripts/bench_generate.py " + shlex.join(
        "HF_VENV/bin/python" if arg == args.hf_python else arg for arg in sys.argv[1:])
    lines = [
        SECTION,
        "",
        f"Written by `scripts/bench_generate.py` on {datetime.date.today().isoformat()}. Command:",
        "",
        f"    {command.strip()}",
        "",
        f"Machine: {len(os.sched_getaffinity(0))} CPUs usable (`nproc` {os.cpu_count()}), {cpu_model()}; "
        f"{versions}. Shared with other jobs: load average {load_start[0]:.1f} at the start, "
        f"{load_end[0]:.1f} at the end, so figures are noisy.",
        "",
        f"Both sides: SmolLM2-135M-Instruct from the same GGUF file (`{gguf.name}`) with the same float32 weights: "
        f"transformers dequantises them at load; agentjax keeps the file's Q4_1/Q8_0 blocks on the device and "
        f"dequantises each matrix inside the step (bit-identical values, about a quarter of the bytes read). "
        f"The same prompt token ids, greedy, no early stop, {args.threads} threads each. transformers: "
        f"`from_pretrained(gguf_file=...)`, `generate(do_sample=False, eos_token_id=[])`, "
        f"default KV cache, batch left-padded. agentjax: `LLM(numerics=\"fast\", max_num_batched_tokens=2048, "
        f"max_num_seqs=64, enable_prefix_caching=False)`. Decode tok/s = generated tokens / wall time of the "
        f"whole generate call (the short prompts' prefill included); prefill tok/s = prompt tokens / wall time "
        f"of a generate call making 1 token. Each figure is the median of {args.runs} runs (range in brackets) "
        f"after one untimed warm-up; the sides alternate run by run"
        + (f" (agentjax at {args.baseline_rev}: the same settings, from a git worktree in its own process)."
           if baseline else "."),
        "",
        header,
        rule,
        *rows,
        "",
        "agentjax only:",
        "",
        "| What | Result |",
        "|---|---|",
        f"| Decode tok/s, batch {args.batch}, numerics=\"batch_invariant\" vs \"fast\" | "
        f"{fmt_rate(bi_big)}{fmt_spread(aj_bi)} vs {fmt_rate(fast_big)}"
        + (f" ({bi_big / fast_big:.2f}x of fast)" if bi_big and fast_big else "") + " |",
        f"| Greedy tokens batched vs alone, float32 \"fast\" ({len(divergence_prompts)} prompts of "
        f"{min(map(len, divergence_prompts))}-{max(map(len, divergence_prompts))} tokens, "
        f"{args.divergence_tokens} new tokens) | {fmt_positions(div_fast)} |",
        f"| Same, \"batch_invariant\" | {fmt_positions(div_bi)} |",
    ]
    for name, result in agreement.items():
        lines.append(f"| Same greedy tokens as transformers, {labels[name].split(', ', 1)[1]} | "
                     f"{fmt_positions(result, 'differ from transformers')} |")
    lines.append(f"| Compiled step shapes after warm-up → after timed runs (fast; batch_invariant) | "
                 f"{shapes_after_warmup['fast']} → {shapes_after_timing['fast']}; "
                 f"{shapes_after_warmup['batch_invariant']} → {shapes_after_timing['batch_invariant']} |")
    if starts:
        cold, warm = starts
        lines.append(
            f"| `LLM()` start, fresh process and empty AGENTJAX_CACHE: first (converts GGUF, caches) vs "
            f"second (restores) | {cold['llm_s']:.1f}s vs {warm['llm_s']:.1f}s "
            f"(plus {cold['import_s']:.1f}s / {warm['import_s']:.1f}s import; whole process "
            f"{cold['process_s']:.1f}s / {warm['process_s']:.1f}s) |")
    if peer_note:
        lines += ["", f"Note: {peer_note.splitlines()[0]}"]
    body = "\n".join(lines) + "\n"
    print()
    print(body)
    if not args.no_write:
        write_section(body, args.output)
        log(f"wrote the section to {args.output}")


if __name__ == "__main__":
    main()
