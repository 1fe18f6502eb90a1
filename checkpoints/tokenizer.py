"""Builds the text tokenizer, its chat template and its stop tokens from a GGUF file's metadata.

The request path uses it at both ends: prompts and chat messages become token ids, and generated ids
become streamed text through `IncrementalDetokenizer`. Backed by the `tokenizers` library; supports
llama.cpp's `gpt2` (byte-level BPE) and `llama` (SentencePiece BPE) vocabularies. Host only: never
imports jax.
"""
from __future__ import annotations

import logging
import mmap
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from agentjax.errors import TokenizerError, TokenLimitError
from checkpoints.chat_template import END_OF_TURN_TOKENS, ChatTemplate, builtin_chat_template
from checkpoints.gguf_file import parse_metadata

logger = logging.getLogger(__name__)

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SENTENCEPIECE_SPACE = "\u2581"

# llama.cpp's `tokenizer.ggml.pre` names whose splitting is "each digit alone, then GPT-2's regex".
DIGIT_SPLITTING_PRE_TOKENIZERS = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva"}
LLAMA3_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PRE_TOKENIZERS = {"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"}


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------

def read_tokenizer_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The `tokenizer.*` and `general.architecture` keys of a GGUF file, without its tensors.

    A direct reader of the key-value section (`checkpoints.gguf_file`): `gguf.GGUFReader` takes tens of
    seconds on a 262K-token vocabulary because it builds a numpy view per string; this takes well
    under a second.
    """
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            return parse_metadata(buffer, keep=_is_tokenizer_key)[0]
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as error:
        raise TokenizerError(f"cannot read tokenizer metadata from {path}: {error}") from error


def _is_tokenizer_key(key: str) -> bool:
    return key.startswith("tokenizer.") or key == "general.architecture"


def _metadata_from_reader(reader: Any) -> dict[str, Any]:
    if hasattr(reader, "metadata"):  # checkpoints.gguf_file.GGUFFile
        return {key: value for key, value in reader.metadata.items() if _is_tokenizer_key(key)}
    return {key: field.contents() for key, field in reader.fields.items() if _is_tokenizer_key(key)}


def _required(metadata: Mapping[str, Any], key: str) -> Any:
    if key not in metadata:
        raise TokenizerError(f"the GGUF metadata has no {key!r}; cannot build its tokenizer")
    return metadata[key]


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------

def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (the alphabet its byte-level vocabularies use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    spelling = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling


def _byte_level_pre_tokenizer(pre_name: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_name in DIGIT_SPLITTING_PRE_TOKENIZERS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre_name in LLAMA3_PRE_TOKENIZERS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre_name not in ("gpt2", "default", ""):
        logger.warning("pre-tokenizer %r is not known here; splitting with GPT-2's regex", pre_name)
    return byte_level


def _build_byte_level_bpe(metadata: Mapping[str, Any]) -> tuple[tokenizers.Tokenizer, list[str]]:
    tokens = list(_required(metadata, "tokenizer.ggml.tokens"))
    merges = _required(metadata, "tokenizer.ggml.merges")
    alphabet = _byte_level_alphabet()
    spelled = set(alphabet.values())
    vocab_tokens = [token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode())
                    for token in tokens]
    vocab = {token: index for index, token in enumerate(vocab_tokens)}
    merge_pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    return backend, vocab_tokens


def _sentencepiece_merges(vocab_tokens: Sequence[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split (a, b) of a piece into two pieces.

    Pieces earlier in the vocabulary merge first (for Gemma the file order, not the score, is the
    merge order); among splits of one piece the longer left part wins, as in Hugging Face's extractor.
    Emitted already in that order, so no sort is needed (about 2 s for Gemma's 262K pieces).
    """
    known_pieces = set(vocab_tokens)
    merges: list[tuple[str, str]] = []
    append_merge = merges.append
    for piece in vocab_tokens:
        for cut in range(len(piece) - 1, 0, -1):
            left = piece[:cut]
            if left in known_pieces:
                right = piece[cut:]
                if right in known_pieces:
                    append_merge((left, right))
    return merges


def _build_sentencepiece_bpe(metadata: Mapping[str, Any]) -> tuple[tokenizers.Tokenizer, list[str]]:
    tokens = list(_required(metadata, "tokenizer.ggml.tokens"))
    # Tokens made only of spaces are stored with real spaces; the model sees them as "▁▁...".
    vocab_tokens = [SENTENCEPIECE_SPACE * len(token) if token and not token.strip(" ") else token
                    for token in tokens]
    vocab = {token: index for index, token in enumerate(vocab_tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    else:
        merges = _sentencepiece_merges(vocab_tokens)
    unknown_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unknown_token = tokens[unknown_id] if unknown_id is not None else None
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=unknown_token,
                                       fuse_unk=True, byte_fallback=True))
    space_to_piece = normalizers.Replace(" ", SENTENCEPIECE_SPACE)
    piece_to_space = [decoders.Replace(SENTENCEPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if metadata.get("tokenizer.ggml.add_space_prefix", False):
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SENTENCEPIECE_SPACE), space_to_piece])
        piece_to_space.append(decoders.Strip(" ", 1, 0))
    else:
        backend.normalizer = space_to_piece
    backend.decoder = decoders.Sequence(piece_to_space)
    return backend, vocab_tokens


_BACKEND_BUILDERS = {"gpt2": _build_byte_level_bpe, "llama": _build_sentencepiece_bpe}


def _register_added_tokens(backend: tokenizers.Tokenizer, tokens: Sequence[str],
                           vocab_tokens: Sequence[str], token_types: Sequence[int]) -> None:
    """Control tokens become special added tokens and user-defined ones plain added tokens, so each
    is matched whole in text (like `<|im_start|>`), before the model splits the rest."""
    control, user_defined = [], []
    for token, vocab_token, token_type in zip(tokens, vocab_tokens, token_types):
        if token != vocab_token:
            continue  # respelled (byte-level or all-space) tokens are reached through merges instead
        if token_type == TOKEN_TYPE_CONTROL:
            control.append(AddedToken(token, special=True, normalized=False))
        elif token_type == TOKEN_TYPE_USER_DEFINED:
            user_defined.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------

class Tokenizer:
    """Text <-> token ids for one model, with its chat template and stop tokens."""

    def __init__(self, backend: tokenizers.Tokenizer, *, tokens: Sequence[str], bos_token_id: int | None,
                 eos_token_id: int, pad_token_id: int | None, add_bos_token: bool,
                 chat_template: str | None, architecture: str | None = None):
        self.backend = backend
        self.architecture = architecture
        self._tokens = list(tokens)
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._pad_token_id = pad_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = ChatTemplate(chat_template) if chat_template else None
        token_ids = {token: index for index, token in reversed(list(enumerate(self._tokens)))}
        end_of_turn_ids = [token_ids[token] for token in END_OF_TURN_TOKENS
                           if token in token_ids and (chat_template is None or token in chat_template)]
        self._stop_token_ids = tuple(dict.fromkeys([eos_token_id, *end_of_turn_ids]))

    @classmethod
    def from_gguf(cls, path_or_reader: str | os.PathLike | Any) -> Tokenizer:
        """Build from a GGUF path, or from an open `checkpoints.gguf_file.GGUFFile` or `gguf.GGUFReader`."""
        if hasattr(path_or_reader, "fields") or hasattr(path_or_reader, "metadata"):
            return cls.from_metadata(_metadata_from_reader(path_or_reader))
        return cls.from_metadata(read_tokenizer_metadata(path_or_reader))

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata keys (`tokenizer.ggml.*`, `tokenizer.chat_template`, ...)."""
        model_name = _required(metadata, "tokenizer.ggml.model")
        if model_name not in _BACKEND_BUILDERS:
            raise TokenizerError(f"tokenizer.ggml.model {model_name!r} is not supported; "
                                 f"supported: {sorted(_BACKEND_BUILDERS)}")
        backend, vocab_tokens = _BACKEND_BUILDERS[model_name](metadata)
        tokens = list(metadata["tokenizer.ggml.tokens"])
        token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(token_types) != len(tokens):
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(token_types)} entries "
                                 f"but there are {len(tokens)} tokens")
        _register_added_tokens(backend, tokens, vocab_tokens, token_types)
        eos_token_id = _required(metadata, "tokenizer.ggml.eos_token_id")
        bos_token_id = metadata.get("tokenizer.ggml.bos_token_id")
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id",
                    "tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id"):
            if key in metadata and not 0 <= metadata[key] < len(tokens):
                raise TokenizerError(f"{key} is {metadata[key]}, outside the vocabulary [0, {len(tokens)})")
        architecture = metadata.get("general.architecture")
        chat_template = metadata.get("tokenizer.chat_template") or builtin_chat_template(architecture)
        return cls(backend, tokens=tokens, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                   pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
                   add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", model_name == "llama")),
                   chat_template=chat_template, architecture=architecture)

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: eos, and the template's end-of-turn tokens."""
        return self._stop_token_ids

    @property
    def special_tokens(self) -> dict[str, str | None]:
        """`bos_token`, `eos_token`, `pad_token` as strings, the names chat templates use."""
        def spelled(token_id: int | None) -> str | None:
            return self._tokens[token_id] if token_id is not None else None
        return {"bos_token": spelled(self._bos_token_id), "eos_token": spelled(self._eos_token_id),
                "pad_token": spelled(self._pad_token_id)}

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        return self._tokens[token_id]

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS first when the model asks for it. Over
        `max_tokens` ids, `TokenLimitError` (with the count) before any Python list is built.

        `encode_batch` releases the GIL while it encodes (`encode` holds it): a long prompt tokenized
        on a server's worker thread then leaves the event loop free."""
        encoding = self.backend.encode_batch([text], add_special_tokens=False)[0]
        bos = add_special_tokens and self.add_bos_token and self._bos_token_id is not None
        if max_tokens is not None and len(encoding) + bos > max_tokens:
            raise TokenLimitError(len(encoding) + bos, max_tokens)
        ids = encoding.ids
        return [self._bos_token_id, *ids] if bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text for chat `messages` (OpenAI-style dicts with role and content)."""
        if self.chat_template is None:
            raise TokenizerError(f"this model ({self.architecture}) has no chat template; "
                                 f"send a plain completion prompt instead")
        return self.chat_template.render(messages, special_tokens=self.special_tokens,
                                         add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None, max_tokens: int | None = None,
                    **kwargs: Any) -> list[int]:
        """Token ids of the chat prompt; BOS is added only if the template did not write it. Over
        `max_tokens`, `TokenLimitError` (see `encode`)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools, **kwargs)
        bos_token = self.special_tokens["bos_token"]
        template_wrote_bos = bos_token is not None and text.startswith(bos_token)
        return self.encode(text, add_special_tokens=not template_wrote_bos, max_tokens=max_tokens)


class IncrementalDetokenizer:
    """Turns generated ids into text deltas for streaming, holding back an incomplete character.

    A delta is emitted only once its text no longer ends in U+FFFD (a UTF-8 sequence, or a run of
    byte-fallback tokens, cut in the middle). Joined deltas plus `flush()` equal `decode` of all ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # start of the window that gives context to the next decode
        self._read_offset = 0  # ids before this are already emitted as text

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append generated ids; returns the text that became final (possibly "")."""
        self.token_ids.extend(new_token_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        full_text = decode(self.token_ids[self._prefix_offset:], self.skip_special_tokens)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever was held back, replacement characters included."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        full_text = decode(self.token_ids[self._prefix_offset:], self.skip_special_tokens)
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self.text += delta
        return delta
