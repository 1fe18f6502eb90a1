"""HF model directories (config.json + safetensors, as transformers saves them) into agentjax's arrays.

`load_hf` finds the directory's family (checkpoints/hf_families/, by `model_type`), reads its
config, checks every safetensors header, converts the tensors on the host and checks them
against the model's expected names and shapes, so a bad checkpoint fails with an error naming the
field, tensor or file before any weight reaches a device. The tokenizer comes from tokenizer.json
and tokenizer_config.json when they exist. Host only: never imports jax.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from agentjax.config import ModelConfig
from agentjax.errors import InvalidRequestError, ModelConfigError, ModelLoadError, TensorMismatchError, TokenizerError
from checkpoints.hf_config import ConfigFields
from checkpoints.hf_families import HFFamily, family_for
from checkpoints.hf_tensors import HFTensors
from checkpoints.validate import check_tensors

ExpectedShapes = Callable[[ModelConfig], Mapping[str, tuple[int, ...]]]


def read_config(directory: Path) -> dict[str, Any]:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{directory} has no config.json")
    try:
        raw = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{config_path} holds a JSON {type(raw).__name__}, expected an object")
    return raw


def quant_scheme(directory: str | Path, quantization: str | None = None):
    """The checkpoint's quantisation scheme (checkpoints/quant_config.py; None for float weights), checked
    against a `--quantization` option (vLLM's names; None or "auto": whatever the checkpoint declares)."""
    from checkpoints.quant_config import QUANTIZATION_OPTIONS, read_scheme

    directory = Path(directory)
    if quantization not in (None, "auto", *QUANTIZATION_OPTIONS):
        raise ModelConfigError(f"--quantization {quantization!r} is not supported; choose one of "
                               f"{', '.join(QUANTIZATION_OPTIONS)} (or leave it out)")
    scheme = read_scheme(read_config(directory), directory)
    if scheme is None:
        if quantization not in (None, "auto"):
            raise ModelConfigError(f"--quantization {quantization} needs a quantised checkpoint; {directory} declares "
                                   f"no quantization_config (agentjax does not quantise float weights at load)")
        return None
    scheme.check_option(quantization)
    return scheme


def family_and_config(directory: str | Path) -> tuple[HFFamily, ModelConfig]:
    """The family of an HF directory (found from config.json) and its `ModelConfig`."""
    directory = Path(directory)
    raw = read_config(directory)
    source = str(directory / "config.json")
    family = family_for(raw, source)
    from checkpoints.quant_config import read_scheme

    read_scheme(raw, directory)  # a malformed or unsupported quantization_config is named here
    try:
        cfg = family.model_config(ConfigFields(raw, source))
    except InvalidRequestError as exc:  # ModelConfig's own consistency checks
        raise ModelConfigError(f"{source}: {exc}") from None
    return family, cfg.replace(name=directory.name)


def load_hf(
    directory: str | Path, expected_shapes: ExpectedShapes | None = None, *, quantization: str | None = None,
    lazy: bool = False,
) -> tuple[ModelConfig, dict[str, np.ndarray], Any]:
    """`(config, flat float32 arrays, tokenizer or None)` from an HF directory.

    `expected_shapes(cfg)` gives the model's `{parameter name: shape}`; with it, the arrays are
    checked all at once (missing, wrongly shaped and unexpected tensors in one error). Without
    it, only tensors that no parameter is made from are reported. Quantised checkpoints are decoded
    to float32; with `lazy`, the values are recipes instead (checkpoints/lazy_tensors.py, quantised
    matrices as `LazyQuant`) and no tensor data is read (quantisation scales aside) until asked for.
    """
    directory = Path(directory)
    scheme = quant_scheme(directory, quantization)
    family, cfg = family_and_config(directory)
    expected = dict(expected_shapes(cfg)) if expected_shapes is not None else None
    tensors = HFTensors.open(directory, expected, scheme=scheme, lazy=lazy)
    arrays = family.convert_tensors(cfg, tensors)
    where = f"HF checkpoint {directory} ({family.name} family)"
    if expected is not None:
        check_tensors(expected, arrays, where=where, describe=tensors.describe, unread=tensors.unread())
    elif tensors.unread():
        unread = tensors.unread()
        raise TensorMismatchError(f"{where} has {len(unread)} unexpected tensors: {', '.join(unread[:8])}")
    return cfg, arrays, _load_tokenizer(directory, cfg)


def _load_tokenizer(directory: Path, cfg: ModelConfig) -> Any:
    """The directory's tokenizer, or None when it ships without tokenizer.json."""
    import tokenizers

    from checkpoints.tokenizer import Tokenizer

    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    settings_path = directory / "tokenizer_config.json"
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
        settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
    except Exception as exc:  # the tokenizers library raises a bare Exception on a bad file
        raise TokenizerError(f"cannot read the tokenizer in {directory}: {exc}") from None
    tokens = [backend.id_to_token(i) or "" for i in range(backend.get_vocab_size(with_added_tokens=True))]
    return Tokenizer(
        backend,
        tokens=tokens,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_ids[0] if cfg.eos_token_ids else 0,
        pad_token_id=settings.get("pad_token_id"),
        add_bos_token=bool(settings.get("add_bos_token", False)),
        chat_template=settings.get("chat_template"),
        architecture=cfg.architecture,
    )
