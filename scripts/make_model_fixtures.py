"""Write tiny random Kimi-Linear, MiniMax-M3 and DeepSeek-V4 checkpoints plus transformers' reference outputs.

The `fuzz-*` fixtures are configs drawn by scripts/fuzz_parity.py that exposed a bug
(fuzz_parity_configs.FIXTURES), with the fuzzer's own weights and prompt.

Run with the torch venv (never from project tests): each fixture directory gets config.json,
generation_config.json and model.safetensors exactly as transformers' `save_pretrained` writes them
(plus the MiniMax MTP tensors transformers ignores on load), and reference.npz with prompt logits and
greedy tokens (DeepSeek-V4's builder and extra diagnostics live in dsv4_fixtures.py). Everything is
seeded, so re-running rewrites byte-identical files.
"""
from __future__ import annotations

import argparse
import io
import json
import logging
import zipfile
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import dsv4_fixtures
import fuzz_parity_configs
from fixture_weights import TINY_VISION, mtp_tensor_shapes, random_value, randomize
from fuzz_parity_reference import greedy_generate, top2_margins

log = logging.getLogger("make_model_fixtures")
NEW_TOKENS = 24
VOCAB = 512
CHECKPOINT_LIMIT_BYTES = 2 * 1024 * 1024

KIMI_FIXTURES = {
    "kimi-linear-a": dict(
        seed=11, prompt_len=72, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
        linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 2,
                            "head_dim": 32, "short_conv_kernel_size": 4},
        first_k_dense_replace=1, num_experts=8, num_experts_per_token=2, num_shared_experts=2,
        num_expert_group=1, topk_group=1, routed_scaling_factor=2.5, rms_norm_eps=1e-5,
    ),
    "kimi-linear-b": dict(
        seed=12, prompt_len=77, hidden_size=80, intermediate_size=128, moe_intermediate_size=24,
        num_hidden_layers=5, num_attention_heads=3, num_key_value_heads=3,
        q_lora_rank=None, kv_lora_rank=48, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16,
        linear_attn_config={"kda_layers": [2, 3, 5], "full_attn_layers": [1, 4], "num_heads": 3,
                            "head_dim": 16, "short_conv_kernel_size": 3},
        first_k_dense_replace=2, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
        num_expert_group=2, topk_group=1, routed_scaling_factor=1.5, rms_norm_eps=1e-6,
    ),
}

MINIMAX_FIXTURES = {
    # Saved through the VL wrapper (MiniMaxM3SparseForConditionalGeneration, model_type minimax_m3_vl).
    "minimax-m3-a": dict(
        # prompt_seed: the default prompt (seed 2021) left a 7e-4 top-1 margin at generated step 3.
        seed=21, prompt_seed=2022, prompt_len=70, wrapper=True, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5,
        rope_theta=10000.0, intermediate_size=32, shared_intermediate_size=32,
        dense_intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
        routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=2.0, rms_norm_eps=1e-6,
        index_n_heads=2, index_head_dim=32, index_block_size=4, index_topk_blocks=2,
        index_local_blocks=1, dense_layers=1,
    ),
    # Saved as the text model alone (MiniMaxM3VLForCausalLM, model_type minimax_m3_vl_text).
    "minimax-m3-b": dict(
        seed=22, prompt_len=75, wrapper=False, hidden_size=64, num_hidden_layers=5,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
        rope_theta=5000000.0, intermediate_size=32, shared_intermediate_size=48,
        dense_intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
        routed_scaling_factor=2.0, swiglu_alpha=1.5, swiglu_limit=1.75, rms_norm_eps=1e-5,
        index_n_heads=2, index_head_dim=24, index_block_size=8, index_topk_blocks=3,
        index_local_blocks=2, dense_layers=2,
    ),
}

# ---------------------------------------------------------------- model builders

def build_kimi(spec: dict):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    kwargs = {k: v for k, v in spec.items() if k not in ("seed", "prompt_seed", "prompt_len")}
    config = KimiLinearConfig(
        vocab_size=VOCAB, model_max_length=4096, hidden_act="silu", moe_renormalize=True,
        moe_router_activation_func="sigmoid", use_grouped_topk=True, mla_use_nope=True,
        moe_layer_freq=1, num_nextn_predict_layers=0, tie_word_embeddings=False,
        pad_token_id=None, bos_token_id=None, eos_token_id=None, **kwargs,
    )
    torch.manual_seed(spec["seed"])
    model = KimiLinearForCausalLM(config)
    randomize(model, spec["seed"], gemma_norms=False, lm_head_gain=2.0)
    return model, KimiLinearForCausalLM, {}


def _minimax_text_config(spec: dict) -> dict:
    n, dense = spec["num_hidden_layers"], spec["dense_layers"]
    skip = ("seed", "prompt_seed", "prompt_len", "wrapper", "dense_layers", "partial_rotary_factor", "rope_theta")
    text = {k: v for k, v in spec.items() if k not in skip}
    text.update(
        vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=False,
        rotary_dim=int(spec["head_dim"] * spec["partial_rotary_factor"]),
        rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"],
                         "partial_rotary_factor": spec["partial_rotary_factor"]},
        layer_types=["full_attention"] * dense + ["minimax_m3_sparse"] * (n - dense),
        mlp_layer_types=["dense"] * dense + ["sparse"] * (n - dense),
        num_mtp_modules=1, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        # Fields real checkpoints carry and vLLM reads; transformers keeps them as plain attributes.
        scoring_func="sigmoid", use_routing_bias=True, n_shared_experts=1, swiglu_beta=1.0,
        use_qk_norm=True, qk_norm_type="per_head", use_gemma_norm=True, attention_output_gate=False,
    )
    return text


def build_minimax(spec: dict):
    from transformers import (MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig,
                              MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig)

    text = _minimax_text_config(spec)
    if spec["wrapper"]:
        config = MiniMaxM3VLConfig(text_config=text, vision_config=TINY_VISION, projector_hidden_size=32,
                                   image_token_index=VOCAB - 2, video_token_index=VOCAB - 1)
        cls, prefix = MiniMaxM3SparseForConditionalGeneration, "language_model.model."
    else:
        config = MiniMaxM3VLTextConfig(**text)
        cls, prefix = MiniMaxM3VLForCausalLM, "model."
    torch.manual_seed(spec["seed"])
    model = cls(config)
    randomize(model, spec["seed"], gemma_norms=True, lm_head_gain=2.0)
    gen = torch.Generator().manual_seed(spec["seed"] + 1000)
    mtp = {name: random_value(name, shape, gen, gemma_norms=True, lm_head_gain=2.0)
           for name, shape in sorted(mtp_tensor_shapes(text, prefix).items())}
    return model, cls, mtp


def build_dsv4(spec: dict):
    def common(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        return random_value(name, shape, gen, gemma_norms=False, lm_head_gain=2.0)

    return dsv4_fixtures.build(spec, common)


def fuzzed_spec(family: str, config_seed: int) -> dict:
    """A fixture spec from one of scripts/fuzz_parity.py's configs (its prompt included)."""
    d = fuzz_parity_configs.draw(family, config_seed)
    return dict(family=family, config_seed=config_seed, seed=d.seed, prompt_seed=d.seed, prompt_len=d.prompt_len,
                vocab_size=d.fields["vocab_size"])


def build_fuzzed(spec: dict):
    return fuzz_parity_configs.build(fuzz_parity_configs.draw(spec["family"], spec["config_seed"]))


def dsv4_reference(model, prompt: torch.Tensor) -> dict[str, np.ndarray]:
    return dsv4_fixtures.reference_outputs(model, prompt, NEW_TOKENS)


# ---------------------------------------------------------------- saving and references

def add_tensors(safetensors_path: Path, extra: dict[str, torch.Tensor]) -> None:
    """Add tensors (MTP) to a saved checkpoint, keeping transformers' file metadata."""
    if not extra:
        return
    with safe_open(str(safetensors_path), "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    clash = set(tensors) & set(extra)
    if clash:
        raise ValueError(f"MTP tensors clash with saved tensors: {sorted(clash)[:3]}")
    tensors.update({k: v.contiguous() for k, v in extra.items()})
    save_file(tensors, str(safetensors_path), metadata=metadata)


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez-compatible archive with fixed timestamps, so identical arrays give identical bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


@torch.no_grad()
def reference_outputs(model, prompt: torch.Tensor) -> dict[str, np.ndarray]:
    prompt_logits = model(input_ids=prompt[None], use_cache=False).logits[0].float()
    out = greedy_generate(model, prompt, NEW_TOKENS)
    generated = out.sequences[0, prompt.numel():]
    step_logits = torch.stack([s[0].float() for s in out.logits])
    if generated.numel() != NEW_TOKENS or not torch.equal(step_logits.argmax(-1), generated):
        raise RuntimeError("generate did not produce the greedy tokens of its own logits")
    uncached_ids, max_abs_diff = [], []
    for t in range(NEW_TOKENS):  # uncached forward over prompt + the cached run's first t tokens
        seq = torch.cat([prompt, generated[:t]])
        last = model(input_ids=seq[None], use_cache=False).logits[0, -1].float()
        uncached_ids.append(int(last.argmax()))
        max_abs_diff.append(float((last - step_logits[t]).abs().max()))
    uncached = torch.tensor(uncached_ids)
    return {
        "prompt_ids": prompt.numpy().astype(np.int32),
        "prompt_logits": prompt_logits.numpy().astype(np.float32),
        "generated_ids": generated.numpy().astype(np.int32),
        "generated_logits": step_logits.numpy().astype(np.float32),
        "generated_margins": top2_margins(step_logits),
        "uncached_step_ids": uncached.numpy().astype(np.int32),
        "cached_uncached_agree": (uncached == generated).numpy(),
        "cached_uncached_max_abs_diff": np.asarray(max_abs_diff, np.float32),
    }


def check_reload(cls, out_dir: Path, model) -> torch.nn.Module:
    """Load the saved directory back; every tensor must round-trip and none may be missing."""
    loaded, info = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager",
                                       output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"} | (
        {"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {})
    if problems:
        raise RuntimeError(f"{out_dir.name}: reload reported {problems}")
    want, got = model.state_dict(), loaded.state_dict()
    for name, tensor in want.items():
        if not torch.equal(tensor, got[name]):
            raise RuntimeError(f"{out_dir.name}: {name} changed on save/load")
    return loaded.eval()


def write_tokenizer(out_dir: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer.json of `vocab` tokens, trained on a fixed text (the same bytes on every
    run): lets a server turn a fixture's token ids into text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    text = [" ".join(f"agent{i} calls tool{i * 7 % 97} in session {i % 13}; reads file{i % 29}.py" for i in range(600))]
    tokenizer.train_from_iterator(text, trainer)
    if tokenizer.get_vocab_size() > vocab:
        raise RuntimeError(f"the fixture tokenizer has {tokenizer.get_vocab_size()} tokens, over {vocab}")
    tokenizer.save(str(out_dir / "tokenizer.json"))


def make_fixture(name: str, spec: dict, build, out_root: Path, reference=None) -> dict:
    model, cls, extra = build(spec)
    out_dir = out_root / name
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.iterdir():
        stale.unlink()
    model.save_pretrained(out_dir)
    add_tensors(out_dir / "model.safetensors", extra)
    if spec.get("tokenizer"):
        write_tokenizer(out_dir, VOCAB)
    size = (out_dir / "model.safetensors").stat().st_size
    if size > CHECKPOINT_LIMIT_BYTES:
        raise RuntimeError(f"{name}: model.safetensors is {size} bytes, over {CHECKPOINT_LIMIT_BYTES}")
    model = check_reload(cls, out_dir, model)

    def prompt_from(seed: int) -> torch.Tensor:
        vocab = spec.get("vocab_size", VOCAB)
        return torch.randint(0, vocab, (spec["prompt_len"],), generator=torch.Generator().manual_seed(seed))

    ref = (reference or reference_outputs)(model, prompt_from(spec.get("prompt_seed", spec["seed"] + 2000)))
    write_npz(out_dir / "reference.npz", ref)
    for tag, seed in spec.get("extra_prompt_seeds", {}).items():  # more prompts on the same checkpoint
        extra_ref = (reference or reference_outputs)(model, prompt_from(seed))
        write_npz(out_dir / f"reference_{tag}.npz", extra_ref)
        if reference is dsv4_reference:
            log.info("%s", json.dumps({"fixture": f"{name}/{tag}", **dsv4_fixtures.summary(extra_ref)}))
    summary = {
        "fixture": name, "safetensors_bytes": size, "prompt_len": spec["prompt_len"],
        "prompt_logit_std": round(float(ref["prompt_logits"].std()), 3),
        "margins_below_2e-3": int((ref["generated_margins"] < 2e-3).sum()),
        "min_margin": round(float(ref["generated_margins"].min()), 5),
        "cached_uncached_disagree_steps": [int(i) for i in np.flatnonzero(~ref["cached_uncached_agree"])],
        "cached_uncached_max_abs_diff": float(ref["cached_uncached_max_abs_diff"].max()),
    }
    if reference is dsv4_reference:
        summary.update(dsv4_fixtures.summary(ref))
    log.info("%s", json.dumps(summary))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/models/data")
    parser.add_argument("--only", nargs="*", help="fixture names to (re)build; default all")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)  # fixed reduction order, so reruns give identical bytes
    torch.use_deterministic_algorithms(True)
    jobs = [(n, s, build_kimi) for n, s in KIMI_FIXTURES.items()]
    jobs += [(n, s, build_minimax) for n, s in MINIMAX_FIXTURES.items()]
    jobs += [(n, s, build_dsv4, dsv4_reference) for n, s in dsv4_fixtures.DSV4_FIXTURES.items()]
    for name, (family, config_seed) in fuzz_parity_configs.FIXTURES.items():
        reference = [dsv4_reference] if family == "deepseek-v4" else []
        jobs.append((name, fuzzed_spec(family, config_seed), build_fuzzed, *reference))
    for name, spec, build, *reference in jobs:
        if args.only and name not in args.only:
            continue
        make_fixture(name, spec, build, args.out, *reference)


if __name__ == "__main__":
    main()
