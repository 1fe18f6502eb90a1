"""Random-config parity fuzzing of agentjax against transformers 5.24.0 (DeepSeek-V4, Kimi-Linear, MiniMax-M3).

Runs in the transformers environment (`../shared/bench/hf_reference/setup.sh` builds it and prints its
python); agentjax runs beside it in the project's environment as a worker process
(`scripts/fuzz_parity_agentjax.py`, `--agentjax-python`). Until `--minutes` have passed it draws a
config of `--family` (scripts/fuzz_parity_configs.py; seeded by `--seed` and the config's number),
writes the checkpoint, a random prompt of 1-2,000 tokens, transformers' reference (uncached prompt
logits, cached greedy generate, the uncached forward over its tokens; scripts/fuzz_parity_reference.py)
and agentjax's ("batch_invariant": greedy alone and in prefill chunks, and the logits of every position
of the prompt and transformers' tokens in one prefill). Per config it reports the first generated token
where agentjax leaves transformers, transformers' top-1 margin there, whether transformers' cached and
uncached paths agree there, and the largest logit differences; a config transformers or agentjax's
loader refuses is counted as excluded, with the reason. Verdicts:

    match          every token equal
    near-tie       first difference where transformers' margin < 2e-3
    hf-paths-part  first difference where transformers' own cached and uncached paths disagree
    indexer-tie    DeepSeek-V4: transformers' indexer met tied scores at its top-k boundary, and agentjax
                   equals transformers rerun with ties broken toward the lower entry (agentjax's rule)
    DIVERGENCE     anything else: a bug to fix
    exactness      agentjax's chunked run differs from its run alone (a bug to fix)
    error          agentjax raised on a config its loader accepted (a bug to fix)

    $HF_PY scripts/fuzz_parity.py --family deepseek-v4 --minutes 60 --seed 1 --agentjax-python .venv/bin/python

writes runs/fuzz-<family>-<seed>.jsonl (a row per config) and .md (the summary table) under `--out`,
keeps the checkpoints of failing configs there, and with `--benchmarks` adds the run's row to
BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

import fuzz_parity_configs as configs
import fuzz_parity_reference as hf
import fuzz_parity_report as report
import make_model_fixtures

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 24
LOGIT_TOLERANCE = 1e-4


class Worker:
    """The agentjax worker process (one for the whole run: jax is imported once)."""

    def __init__(self, python: str):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        self.proc = subprocess.Popen([python, str(ROOT / "scripts/fuzz_parity_agentjax.py")], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        ready = json.loads(self.proc.stdout.readline() or "{}")
        if not ready.get("ready"):
            raise RuntimeError(f"the agentjax worker ({python}) did not start")

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the agentjax worker died (exit code {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def write_checkpoint(d: configs.Draw, directory: Path):
    model, cls, extra = configs.build(d)
    model.save_pretrained(directory)
    make_model_fixtures.add_tensors(directory / "model.safetensors", extra)
    return model


def _first_difference(ours: list[int], theirs: np.ndarray) -> int | None:
    for step, (a, b) in enumerate(zip(ours, theirs.tolist())):
        if a != b:
            return step
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def judge(d: configs.Draw, ref: dict, stable: dict | None, reply: dict, scored: dict) -> dict:
    """One config's row: the first difference, margins there, logit differences, the verdict."""
    length = d.prompt_len
    ids = ref["generated_ids"]
    alone, chunked = reply["alone"], reply["chunked"]
    logits = scored["logits_0"]
    row = {"prompt_logits_max_diff": float(np.abs(logits[:length] - ref["prompt_logits"]).max()),
           "step_logits_max_diff": float(np.abs(logits[length - 1:] - ref["generated_logits"]).max()),
           "uncached_vs_cached_max_diff": ref["uncached_max_abs_diff"],
           "min_margin": float(ref["margins"].min()), "chunked_equals_alone": alone == chunked,
           "block_size": reply["block_size"]}
    first = _first_difference(alone, ids)
    row["first_difference"] = first
    if first is not None:
        row["margin_there"] = float(ref["margins"][first])
        row["hf_paths_agree_there"] = bool(ref["uncached_ids"][first] == ids[first])
    if "tie_steps" in ref:
        row["indexer_tie_steps"], row["indexer_tie_rows"] = ref["tie_steps"], ref["tie_rows"]
    if stable is not None:
        stable_logits = scored["logits_1"]
        row["stable_prompt_logits_max_diff"] = float(np.abs(stable_logits[:length] - stable["prompt_logits"]).max())
        row["stable_step_logits_max_diff"] = float(np.abs(stable_logits[length - 1:] - stable["generated_logits"]).max())
        stable_first = _first_difference(alone, stable["generated_ids"])
        row["stable_first_difference"] = stable_first
        row["stable_agrees"] = stable_first is None or bool(stable["margins"][stable_first] < hf.MIN_MARGIN)
    row["verdict"] = verdict(row, stable is not None)
    return row


def verdict(row: dict, has_stable: bool) -> str:
    if not row["chunked_equals_alone"]:
        return "exactness"
    first = row["first_difference"]
    if first is None:
        return "match"
    if row["margin_there"] < hf.MIN_MARGIN:
        return "near-tie"
    if not row["hf_paths_agree_there"]:
        return "hf-paths-part"
    if has_stable and row["stable_agrees"] and row["indexer_tie_rows"]["cached"] + row["indexer_tie_rows"]["prompt"]:
        return "indexer-tie"
    return "DIVERGENCE"


def run_one(d: configs.Draw, worker: Worker, work: Path) -> dict:
    directory = work / f"{d.family}-{d.seed}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    try:
        model = write_checkpoint(d, directory)
        vocab = d.fields["vocab_size"]
        prompt = torch.randint(0, vocab, (d.prompt_len,), generator=torch.Generator().manual_seed(d.seed))
        dsv4 = d.family == "deepseek-v4"
        ref = hf.reference(model, prompt, NEW_TOKENS, count_ties=dsv4)
        stable = None
        if dsv4 and sum(ref["tie_rows"].values()):
            with hf.stable_indexer_topk():
                stable = hf.reference(model, prompt, NEW_TOKENS)
    except Exception as err:  # noqa: BLE001 - transformers refusing a config is an exclusion, counted by reason
        return {"excluded": f"transformers: {type(err).__name__}: {str(err).splitlines()[0][:120]}"}
    score = [prompt.tolist() + ref["generated_ids"][:-1].tolist()]
    if stable is not None:
        score.append(prompt.tolist() + stable["generated_ids"][:-1].tolist())
    reply = worker.ask({"op": "run", "model": str(directory), "prompt": prompt.tolist(), "new_tokens": NEW_TOKENS,
                        "chunk": d.chunk, "score": score})
    if not reply["ok"]:
        if reply["kind"] == "rejected":  # the checkpoint's path left out, so equal reasons count together
            return {"excluded": "agentjax: " + reply["error"].replace(str(directory), "<checkpoint>").splitlines()[0][:160]}
        return {"verdict": "error", "error": reply["error"], "traceback": reply.get("traceback", ""),
                "checkpoint": str(directory)}
    row = judge(d, ref, stable, reply, dict(np.load(reply["scored"])))
    row["hf_generated_ids"], row["agentjax_ids"] = ref["generated_ids"].tolist(), reply["alone"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", required=True, choices=configs.FAMILIES)
    parser.add_argument("--minutes", type=float, required=True, help="draw configs until this much time has passed")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--agentjax-python", default=str(ROOT / ".venv/bin/python"),
                        help="the project environment's python (default: .venv/bin/python)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs", help="where rows, summary and failing checkpoints go")
    parser.add_argument("--max-configs", type=int, default=0, help="stop after this many configs (0: no limit)")
    parser.add_argument("--benchmarks", action="store_true", help="add this run's row to BENCHMARKS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"fuzz-{args.family}-{args.seed}"
    started, load_start = time.monotonic(), os.getloadavg()
    deadline = started + args.minutes * 60
    worker = Worker(args.agentjax_python)
    rows, excluded, loads = [], Counter(), [load_start[0]]
    with open(stem.with_suffix(".jsonl"), "w") as log, tempfile.TemporaryDirectory(prefix="fuzz-parity-") as tmp:
        number = 0
        while time.monotonic() < deadline and not (args.max_configs and number >= args.max_configs):
            d = configs.draw(args.family, args.seed * 1_000_000 + number)
            number += 1
            began = time.monotonic()
            row = run_one(d, worker, Path(tmp))
            row.update(config=number - 1, seed=d.seed, prompt_len=d.prompt_len, chunk=d.chunk, wrapper=d.wrapper,
                       mtp=d.mtp, seconds=round(time.monotonic() - began, 1), fields=d.fields)
            loads.append(os.getloadavg()[0])
            if "excluded" in row:
                excluded[row["excluded"]] += 1
            else:
                rows.append(row)
                if row["verdict"] not in report.PASSING:
                    kept = args.out / "failing" / f"{d.family}-{d.seed}"
                    shutil.rmtree(kept, ignore_errors=True)
                    shutil.copytree(Path(tmp) / f"{d.family}-{d.seed}", kept)
                    row["checkpoint"] = str(kept)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(report.line(row), flush=True)
            shutil.rmtree(Path(tmp) / f"{d.family}-{d.seed}", ignore_errors=True)
    worker.close()
    summary = report.summarize(args, rows, excluded, minutes=(time.monotonic() - started) / 60,
                               loads=(load_start[0], max(loads), os.getloadavg()[0]))
    stem.with_suffix(".md").write_text(report.markdown(summary, rows, excluded))
    print(report.markdown(summary, rows, excluded))
    if args.benchmarks:
        report.add_to_benchmarks(summary)
    sys.exit(0 if summary["failing"] == 0 else 1)


if __name__ == "__main__":
    main()
