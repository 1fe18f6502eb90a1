"""The tensors of an HF directory as families see them: read on demand, every read recorded.

`HFTensors.open(directory)` reads every safetensors header (through the index file when there is
one) and fails on a truncated or corrupt file before any data is read. A family `take`s the
tensors it converts and `ignore`s the ones it knowingly drops; whatever it neither took nor
ignored is reported as unexpected. With a quantisation scheme (checkpoints/quant_config.py) a
quantised matrix is taken by its `.weight` name together with its scales. `lazy=True` hands out
recipes (checkpoints/lazy_tensors.py) that read their bytes only when a region is asked for; else
`take` returns float32 host copies (quantised matrices decoded). `rename_tensors` converts the common
one-tensor-per-parameter case from a table of name patterns. Host only: never imports jax.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentjax.errors import CorruptCheckpointError, ModelLoadError, TensorMismatchError, UnsupportedModelError
from checkpoints.safetensors_reader import TensorEntry, read_header, read_tensor

INDEX_FILE = "model.safetensors.index.json"
# Tensors stored beside a quantised matrix's `.weight` (see checkpoints/quant_config.py).
COMPANIONS = ("weight_packed", "weight_scale", "weight_scale_inv", "scale", "weight_scale_2", "input_scale")


def safetensors_files(directory: Path) -> list[Path]:
    """The directory's weight files: those its index names, else every *.safetensors file."""
    index_path = directory / INDEX_FILE
    if not index_path.is_file():
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{directory} has no .safetensors files")
        return files
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = sorted({directory / name for name in weight_map.values()})
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{index_path} is not a safetensors index ({exc!r})") from None
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        named = sorted(t for t, f in weight_map.items() if f in absent)
        raise ModelLoadError(f"{index_path} names weight files that {directory} lacks: {', '.join(absent)} "
                             f"(holding {len(named)} tensors, e.g. {', '.join(named[:3])})")
    return files


def contiguous(array):
    """`np.ascontiguousarray` for host arrays; a lazy recipe (checkpoints/lazy_tensors.py) stays a recipe."""
    return array if hasattr(array, "read") or hasattr(array, "codec") else np.ascontiguousarray(array)


class HFTensors:
    """Every tensor of a directory by HF name; tracks which ones a family took or ignored."""

    def __init__(self, entries: Mapping[str, TensorEntry], where: str,
                 expected: Mapping[str, tuple[int, ...]] | None = None, scheme=None, lazy: bool = False):
        self.entries = dict(entries)
        self.where = where
        self.scheme, self.lazy = scheme, lazy
        # a quantised matrix by its `.weight` name (compressed-tensors stores `.weight_packed`)
        self.virtual = {name.removesuffix("_packed"): entry for name, entry in self.entries.items()
                        if scheme is not None and name.endswith(".weight_packed")}
        # The model's parameter shapes by agentjax name, when the loader knows them.
        self.expected = expected
        self.taken: set[str] = set()
        self.ignored: set[str] = set()
        # agentjax parameter name -> the HF tensor(s) it was made from, for messages.
        self.origins: dict[str, str] = {}

    @classmethod
    def open(cls, directory: str | Path, expected: Mapping[str, tuple[int, ...]] | None = None, scheme=None,
             lazy: bool = False) -> "HFTensors":
        directory = Path(directory)
        entries: dict[str, TensorEntry] = {}
        for file in safetensors_files(directory):
            for name, entry in read_header(file).items():
                if name in entries:
                    raise CorruptCheckpointError(
                        f"tensor {name!r} appears in both {entries[name].file.name} and {file.name}"
                    )
                entries[name] = entry
        return cls(entries, str(directory), expected, scheme, lazy)

    @property
    def names(self) -> list[str]:
        return sorted(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries or name in self.virtual

    def shape(self, name: str) -> tuple[int, ...]:
        quant = self._quantized(name)
        return quant.shape if quant is not None else self._entry(name).shape

    def _quantized(self, name: str):
        """The parts of a quantised matrix taken by its `.weight` name (None: a plain tensor)."""
        if self.scheme is None or not name.endswith(".weight") or name not in self:
            return None
        return self.scheme.quantized(name.removesuffix(".weight"), self.entries)

    def _entry(self, name: str) -> TensorEntry:
        if name not in self.entries:
            files = sorted({e.file.name for e in self.entries.values()})
            raise TensorMismatchError(f"{self.where} lacks tensor {name!r} (looked in {', '.join(files)})")
        return self.entries[name]

    def take(self, name: str, *, shape: Sequence[int] | None = None, param: str | None = None) -> np.ndarray:
        """The tensor as a float32 host copy. `shape` (when given) is checked first; `param` names
        the agentjax parameter it becomes, for later messages."""
        quant = self._quantized(name)
        entry = quant.values if quant is not None else self._entry(name)
        if self.scheme is None and name.endswith(".weight") and entry.dtype.itemsize == 1:
            raise TensorMismatchError(f"tensor {name!r} in {entry.file} is stored as {entry.dtype} (a quantised "
                                      f"matrix) but {self.where}/config.json declares no quantization_config")
        found = quant.shape if quant is not None else entry.shape
        if shape is not None and found != tuple(shape):
            raise TensorMismatchError(
                f"tensor {name!r} in {entry.file} has shape {found}, the model expects {tuple(shape)}"
            )
        self.taken.update([name] if quant is None else [e.name for e in quant.entries])
        if param is not None:
            self.origins[param] = name
        if quant is not None:
            from checkpoints.lazy_quant import LazyQuant, global_scale_of
            from checkpoints.lazy_reads import Source

            glob = None if quant.global_scale is None else global_scale_of(Source(quant.global_scale).materialize())
            lazy = LazyQuant(Source(quant.values), Source(quant.scales), glob, quant.codec, quant.shape, name)
            return lazy if self.lazy else np.asarray(lazy)
        if self.lazy:
            from checkpoints.lazy_reads import Source

            return Source(entry)
        return np.array(read_tensor(entry), dtype=np.float32)  # a copy: never tied to the file

    def ignore(self, *names: str) -> None:
        """Mark tensors the family knowingly drops (absent names are fine); a matrix's scales go with it."""
        for name in names:
            base = name.removesuffix(".weight")
            parts = [name] + ([f"{base}.{s}" for s in COMPANIONS] if name.endswith(".weight") else [])
            self.ignored.update(n for n in parts if n in self.entries)

    def ignore_matching(self, pattern: str) -> None:
        """Mark every tensor whose name matches the regular expression `pattern` as dropped."""
        regex = re.compile(pattern)
        self.ignored.update(n for n in self.entries if regex.fullmatch(n))

    def unread(self) -> list[str]:
        """Tensors neither taken nor ignored: present in the files but not part of the model."""
        return sorted(set(self.entries) - self.taken - self.ignored)

    def describe(self, param: str) -> str:
        """A parameter name for messages, with the HF tensor (and its shape) behind it when known."""
        origin = self.origins.get(param)
        if origin is None:
            return param
        if origin not in self.entries:
            return f"{param} (HF tensor {origin})"
        return f"{param} (from HF tensor {origin} of shape {self.entries[origin].shape})"


@dataclass(frozen=True)
class Rename:
    """One HF tensor that becomes one agentjax parameter.

    `hf` and `param` are patterns where `{i}` stands for the layer index, e.g.
    `Rename("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attn.q_proj.kernel", transpose=True)`.
    `transpose` turns HF's `[out, in]` linear weight into agentjax's `[in, out]` kernel; `convert`
    (applied last) rewrites values, e.g. Gemma's `1 + w` RMSNorm scale.
    """

    hf: str
    param: str
    transpose: bool = False
    convert: Callable[[np.ndarray], np.ndarray] | None = None

    def _regex(self, pattern: str) -> re.Pattern:
        return re.compile(re.escape(pattern).replace(re.escape("{i}"), r"(?P<i>\d+)"))

    def match_param(self, name: str) -> str | None:
        """The HF name behind agentjax parameter `name`, or None if this rule does not make it."""
        match = self._regex(self.param).fullmatch(name)
        return None if match is None else self.hf.format(**match.groupdict())

    def match_hf(self, name: str) -> str | None:
        match = self._regex(self.hf).fullmatch(name)
        return None if match is None else self.param.format(**match.groupdict())


def rename_tensors(tensors: HFTensors, rules: Sequence[Rename], family: str) -> dict[str, np.ndarray]:
    """Convert with one rule per parameter. With the model's expected shapes known, every expected
    parameter is pulled from its HF tensor (one that is absent is left out, and recorded as its
    origin, so the loader's check names it in HF terms); without them, every HF tensor a rule
    matches is converted."""

    def convert(rule: Rename, hf_name: str, param: str) -> np.ndarray:
        array = tensors.take(hf_name, param=param)
        if rule.transpose:
            array = contiguous(array.T)
        return rule.convert(array) if rule.convert else array

    arrays: dict[str, np.ndarray] = {}
    if tensors.expected is not None:
        for param in tensors.expected:
            found = next(((rule, hf) for rule in rules if (hf := rule.match_param(param))), None)
            if found is None:
                raise UnsupportedModelError(f"the {family} family has no HF tensor for parameter {param}")
            rule, hf_name = found
            if hf_name in tensors:
                arrays[param] = convert(rule, hf_name, param)
            else:
                tensors.origins[param] = hf_name
        return arrays
    for hf_name in tensors.names:
        found = next(((rule, p) for rule in rules if (p := rule.match_hf(hf_name))), None)
        if found is not None:
            arrays[found[1]] = convert(found[0], hf_name, found[1])
    return arrays
