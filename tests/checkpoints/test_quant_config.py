"""checkpoints/quant_config.py and the loader's checks: each published scheme is read from its config, the
`--quantization` option must name it, and a checkpoint that lies (a scale missing, a wrong block size, an
index naming a missing shard, a truncated shard) fails with a ModelLoadError naming the file and the tensor
before anything reaches a device."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import pytest

from agentjax.errors import (CorruptCheckpointError, ModelConfigError, ModelLoadError, TensorMismatchError,
                             UnsupportedModelError)
from checkpoints.hf import quant_scheme
from checkpoints.lazy_reads import READS
from checkpoints.quant_config import parse_scheme
from checkpoints.quant_writer import quantize_checkpoint
from checkpoints.safetensors_reader import read_header

FIXTURE = Path(__file__).parents[1] / "models" / "data" / "minimax-m3-a"


@pytest.mark.parametrize("config, method", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}, "fp8"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
     "deepseek_v4_fp8"),
    ({"quant_method": "mxfp8", "ignored_layers": ["lm_head"]}, "modelopt_mxfp8"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": []}},
     "modelopt_fp4"),
    ({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 32}}}},
     "compressed-tensors"),
])
def test_each_published_scheme_is_read_by_its_vllm_name(config, method):
    scheme = parse_scheme(config, "config.json")
    assert scheme.method == method
    scheme.check_option(method)
    scheme.check_option(None)


@pytest.mark.parametrize("config, words", [
    ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "compressed-tensors"}, "'quantization_config.format' is missing"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "group_size"),
])
def test_unsupported_or_malformed_configs_are_named(config, words):
    with pytest.raises((ModelLoadError, UnsupportedModelError), match=words):
        parse_scheme(config, "config.json")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    return quantize_checkpoint(FIXTURE, tmp_path_factory.mktemp("q") / "fp8", "fp8", block=(16, 16), shards=3)


def test_the_quantization_option_must_match_the_checkpoint(fp8_dir):
    assert quant_scheme(fp8_dir, "fp8").method == "fp8"
    with pytest.raises(ModelConfigError, match="declares 'fp8'"):
        quant_scheme(fp8_dir, "modelopt_fp4")
    with pytest.raises(ModelConfigError, match="not supported"):
        quant_scheme(fp8_dir, "awq")
    with pytest.raises(ModelConfigError, match="declares no quantization_config"):
        quant_scheme(FIXTURE, "fp8")


def _lying_copy(source: Path, target: Path, edit) -> Path:
    shutil.copytree(source, target)
    edit(target)
    return target


def _rewrite_without(directory: Path, tensor: str) -> None:
    """Drop one tensor from the shard that holds it (rewriting the shard and the index)."""
    from checkpoints.quant_writer import write_safetensors
    from checkpoints.safetensors_reader import read_tensor

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    file = directory / index["weight_map"].pop(tensor)
    kept = {n: read_tensor(e).copy() for n, e in read_header(file).items() if n != tensor}
    write_safetensors(file, kept)
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def _shard_of(directory: Path, tensor: str) -> str:
    return json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"][tensor]


SCALE = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale_inv"


def _wrong_block(directory: Path) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [32, 32]
    (directory / "config.json").write_text(json.dumps(config))


def _truncate(directory: Path) -> None:
    file = directory / _shard_of(directory, SCALE)
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(size - 100)


def _missing_shard(directory: Path) -> None:
    (directory / _shard_of(directory, SCALE)).unlink()


@pytest.mark.parametrize("edit, error, words", [
    (lambda d: _rewrite_without(d, SCALE), TensorMismatchError,
     r"experts\.3\.w2\.weight in .*model-\d{5}-of-\d{5}\.safetensors is stored as F8_E4M3 but the checkpoint lacks "
     r"its scale tensor .*experts\.3\.w2\.weight_scale_inv"),
    (_wrong_block, TensorMismatchError,
     r"scale tensor .*weight_scale_inv in .*model-\d{5}-of-\d{5}\.safetensors has shape .* with blocks of 32 x 32"),
    (_missing_shard, ModelLoadError, r"names weight files that .* lacks: model-\d{5}-of-\d{5}\.safetensors "
                                     r"\(holding \d+ tensors, e\.g\. language_model"),
    (_truncate, CorruptCheckpointError, r"model-\d{5}-of-\d{5}\.safetensors is truncated or corrupt: tensor '"),
], ids=["scale-missing", "wrong-block-size", "missing-shard", "truncated-shard"])
def test_a_lying_checkpoint_fails_before_any_device_allocation(fp8_dir, tmp_path, edit, error, words):
    from agentjax.models import load_model

    lying = _lying_copy(fp8_dir, tmp_path / "lying", edit)
    arrays_before, bytes_before = len(jax.live_arrays()), READS.bytes_read
    with pytest.raises(error, match=words):
        load_model(str(lying))
    assert len(jax.live_arrays()) == arrays_before  # nothing was placed on a device
    assert READS.bytes_read - bytes_before < 4096  # and no weights were read (scalars at most)
