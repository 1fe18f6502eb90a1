"""The HF transformers side of `scripts/bench_generate.py`; runs in its own Python with torch.

It loads SmolLM2 from the same GGUF file as agentjax (`gguf_file=`, dequantised to float32), then
answers requests in the line protocol of `peer_protocol.py` (seconds: the wall time of model.generate).
The first line it writes is {"ready": true, ...versions...}. Prompts are token ids, so both sides
see the same ids; a batch is left-padded with an attention mask. Decoding is greedy
(`do_sample=False`) with the default KV cache of `generate`, and with no stop token
(`eos_token_id=[]`), so every row makes the full count like agentjax's `ignore_eos=True`.
(`min_new_tokens` would also make the full count, but it masks the EOS logit and so changes
which tokens greedy picks.) Everything else it prints goes to stderr.

Usage (normally started by bench_generate.py):
    HF_VENV/bin/python scripts/bench_generate_hf_peer.py --gguf PATH --threads 2
"""
from __future__ import annotations

import argparse
import os
import platform
import time

from peer_protocol import open_replies, serve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True, help="path of the GGUF file to load")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    args = parser.parse_args()
    replies = open_replies(args.threads)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    directory, name = os.path.split(os.path.abspath(args.gguf))
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - started
    config = model.generation_config
    pad_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    if isinstance(pad_id, list):
        pad_id = pad_id[0]
    ready = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
             "threads": torch.get_num_threads(), "dtype": str(next(model.parameters()).dtype), "load_s": load_s}

    def generate(prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt):] = 1
        with torch.inference_mode():
            started = time.perf_counter()
            output = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                                    do_sample=False, eos_token_id=[], pad_token_id=pad_id)
            seconds = time.perf_counter() - started
        return seconds, output[:, width:].tolist()

    serve(replies, ready, generate)


if __name__ == "__main__":
    main()
