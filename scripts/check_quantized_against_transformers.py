"""Greedy tokens of quantised checkpoints: agentjax against transformers 5.24 on the CPU, where it loads the format.

Two steps, two venvs (the project's tests never import torch):

    python scripts/make_quantized_checkpoints.py tiny --out DIR
    python scripts/check_quantized_against_transformers.py agentjax DIR          # the project's venv
    HF_PY=$(bash ../shared/bench/hf_reference/setup.sh)
    $HF_PY scripts/check_quantized_against_transformers.py transformers DIR      # the torch venv

The first writes `DIR/agentjax_tokens.json` (greedy tokens of every quantised directory, batch-invariant
numerics); the second loads each directory with `from_pretrained(dtype=float32)` on the CPU, generates
greedily from the same prompt and prints, per directory, "match", "differs" or why transformers could not
load it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPT = [1, 5, 9, 200, 31, 77, 100, 4, 8, 15, 3, 3, 3, 3, 3, 3, 3, 3, 3, 90, 44, 12]
NEW_TOKENS = 8


def quantised_dirs(root: Path) -> list[Path]:
    return sorted(d for d in root.iterdir() if (d / "config.json").is_file() and not d.name.endswith("-float32"))


def run_agentjax(root: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from agentjax import LLM, SamplingParams

    tokens = {}
    for directory in quantised_dirs(root):
        llm = LLM(str(directory), numerics="batch_invariant", block_size=16, num_kv_blocks=64)
        out = llm.generate([PROMPT], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
        tokens[directory.name] = out[0].token_ids
        print(directory.name, tokens[directory.name], flush=True)
    (root / "agentjax_tokens.json").write_text(json.dumps(tokens, indent=1))


def run_transformers(root: Path) -> None:
    import torch
    import transformers

    mine = root / "agentjax_tokens.json"
    ours = json.loads(mine.read_text()) if mine.is_file() else {}
    for directory in quantised_dirs(root):
        try:
            architecture = json.loads((directory / "config.json").read_text())["architectures"][0]
            model = getattr(transformers, architecture).from_pretrained(directory, dtype=torch.float32)
            model.eval()
            with torch.no_grad():
                out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     min_new_tokens=NEW_TOKENS)
            theirs = out[0, len(PROMPT):].tolist()
            want = ours.get(directory.name)
            verdict = ("match" if theirs == want else f"loads; tokens {theirs}" if want is None
                       else f"differs: {theirs} vs agentjax {want}")
        except Exception as exc:  # noqa: BLE001 (report whatever stops transformers)
            verdict = f"transformers cannot load it: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        print(f"{directory.name}: {verdict}", flush=True)


if __name__ == "__main__":
    engine, root = sys.argv[1], Path(sys.argv[2])
    run_agentjax(root) if engine == "agentjax" else run_transformers(root)
