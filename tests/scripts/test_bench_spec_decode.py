"""scripts/bench_spec_decode.py's prompts and table, without running a model: every one of its eight
standard-library files (100-300 lines) becomes a chat prompt asking for one function or method, defined
in that file, renamed; the table puts each batch's n-gram arm beside its arm without drafts."""
from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_spec_decode as bench  # noqa: E402


def test_every_file_becomes_a_prompt_to_rename_one_of_its_functions():
    from checkpoints.embedded import smollm2_path
    from checkpoints.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm2_path())
    prompts = bench.editing_prompts(tokenizer)
    assert [name for name, _ in prompts] == bench.FILES
    for name, ids in prompts:
        text = tokenizer.decode(ids)
        renamed = re.search(r"Rename the function `(\w+)` to `\1_renamed`", text).group(1)
        source = inspect.getsource(__import__(name))
        assert 100 <= len(source.splitlines()) <= 300
        assert re.search(rf"^\s*def {renamed}\(", source, re.MULTILINE) and source.strip()[-40:] in text


def test_the_table_shows_each_batch_with_drafts_beside_it_without():
    off = {"k": None, "batch": 8, "tokens_per_step": 1.0, "decode_tok_s": 50.0}
    on = {"k": 4, "batch": 8, "tokens_per_step": 2.5, "decode_tok_s": 100.0,
          "spec_decode": {"num_accepted_tokens": 30, "num_draft_tokens": 40, "accepted_per_position": [9, 8, 7, 6]}}
    lines = bench.table([off, on]).splitlines()
    assert lines[2].startswith("| 8 | off | 1.00 | 50.0 | 1.00x | - |")
    assert lines[3] == "| 8 | k=4 | 2.50 | 100.0 | 2.00x | 30/40 (75%) | 9 / 8 / 7 / 6 |"
