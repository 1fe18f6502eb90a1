"""Tests for checkpoints/tokenizer.py and checkpoints/chat_template.py on the two embedded models.

Golden ids come from an independent reference: transformers 5.24.0's own GGUF tokenizer conversion
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`), run in a separate Python 3.11 venv with
`pip install transformers sentencepiece protobuf gguf torch==2.13.0`, calling `tok(text)["input_ids"]`.
For SmolLM2 the reference's pre-tokenizer was set to SmolLM2's upstream one (each digit alone, then
GPT-2's byte-level regex; llama.cpp's `smollm`), because transformers' GGUF path leaves out the digit
split; see `SMOLLM2_WITHOUT_DIGIT_SPLIT`. Chat texts came from the reference's apply_chat_template.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentjax.errors import TokenizerError
from checkpoints.chat_template import GEMMA3_CHAT_TEMPLATE
from checkpoints.embedded import gemma3_path, smollm2_path
from checkpoints.tokenizer import IncrementalDetokenizer, Tokenizer, read_tokenizer_metadata

# (text, SmolLM2 ids, Gemma-3 ids with its BOS); generated, see the module docstring.
GOLDEN_ENCODINGS = [
    ('Hello, world!',
     [19556, 28, 905, 17],
     [2, 9259, 236764, 1902, 236888]),
    ('The quick brown fox jumps over the lazy dog.',
     [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30],
     [2, 818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761]),
    ('1234567890',
     [33, 34, 35, 36, 37, 38, 39, 40, 41, 32],
     [2, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828, 236819, 236771]),
    ('Pi is 3.14159 and e is 2.71828.',
     [41967, 314, 216, 35, 30, 33, 36, 33, 37, 41, 284, 297, 314, 216, 34, 30, 39, 33, 40, 34, 40, 30],
     [2, 14762, 563, 236743, 236800, 236761, 236770, 236812, 236770, 236810, 236819, 532, 545, 563,
      236743, 236778, 236761, 236832, 236770, 236828, 236778, 236828, 236761]),
    ('  1 and   22 and\t333',
     [256, 33, 284, 333, 34, 34, 284, 197, 35, 35, 35],
     [2, 138, 236770, 532, 139, 236778, 236778, 532, 255968, 236800, 236800, 236800]),
    ('def add(a, b):\n    return a + b\n',
     [1604, 803, 24, 81, 28, 278, 727, 472, 1003, 253, 1232, 278, 198],
     [2, 2063, 1138, 236769, 236746, 236764, 518, 1473, 107, 140, 2060, 496, 900, 518, 107]),
    ('class Foo:\n\tdef bar(self):\n\t\tpass\n\n\n',
     [2064, 426, 568, 42, 198, 197, 1604, 2753, 24, 771, 727, 3354, 197, 5467, 16506],
     [2, 1999, 104558, 236787, 107, 255968, 2063, 3029, 236769, 1508, 1473, 107, 255969, 4373, 109]),
    ('if (x != 0) { y = x * 2; }  // comment',
     [342, 365, 104, 6541, 216, 32, 25, 1662, 329, 446, 1792, 1672, 216, 34, 43, 4029, 216, 13241, 5189],
     [2, 584, 568, 236781, 2843, 236743, 236771, 236768, 642, 570, 578, 1123, 808, 236743, 236778,
      236793, 682, 138, 715, 5739]),
    ('   leading spaces',
     [256, 2899, 5600],
     [2, 139, 26016, 9952]),
    ('trailing spaces   ',
     [4861, 4966, 5600, 333],
     [2, 136697, 9952, 139]),
    (' ',
     [216],
     [2, 236743]),
    ('  ',
     [256],
     [2, 138]),
    ('\n',
     [198],
     [2, 107]),
    ('\n\n\n',
     [16506],
     [2, 109]),
    ('\t\t',
     [1656],
     [2, 255969]),
    ('',
     [],
     [2]),
    ('café naïve résumé über Straße',
     [83, 1939, 2756, 15486, 46494, 412, 2756, 5422, 2756, 5549, 137, 593, 19144, 34878, 85],
     [2, 123125, 236859, 120362, 118515, 8046, 80176]),
    ('你好，世界！今天天气很好。',
     [18645, 250, 48392, 138, 12831, 7906, 240, 178, 239, 230, 8083, 219, 15076, 228, 18614, 119, 18614,
      119, 177, 125, 238, 29157, 226, 48392, 138, 19076],
     [2, 144626, 236900, 12811, 237354, 22601, 122362, 55824, 236924]),
    ('こんにちは世界 مرحبا بالعالم Привет мир',
     [7365, 237, 10391, 237, 41152, 7365, 111, 7365, 124, 7906, 240, 178, 239, 230, 36395, 20602, 44626,
      31462, 10805, 45726, 22208, 34966, 22208, 21706, 5470, 249, 46879, 16464, 32547, 41337, 7872, 9175],
     [2, 85141, 12811, 150423, 107602, 17193, 15745, 8362, 58562]),
    ('Emoji: 😀👍🏽 👨\u200d👩\u200d👧 🤖',
     [10809, 33777, 42, 40303, 218, 10813, 235, 231, 10813, 233, 138, 15107, 235, 118, 321, 231, 10813,
      235, 119, 321, 231, 10813, 235, 117, 15107, 114, 240],
     [2, 127268, 236787, 163543, 240493, 242713, 236743, 243874, 237243, 243767, 237243, 244814, 236743,
      246143]),
    ('rare: 𐍈 ☃ §¶ ∑∫√ 𝄞',
     [42386, 42, 216, 187, 234, 231, 226, 4636, 242, 221, 20850, 141, 131, 19995, 235, 22052, 121, 22052,
      244, 216, 23159, 222, 248],
     [2, 43128, 236787, 236743, 478, 382, 379, 374, 236743, 246690, 7215, 239422, 76689, 240842, 239176,
      236743, 246859]),
    ('<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n',
     [1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198],
     [2, 236820, 236909, 548, 236779, 3041, 111038, 2364, 107, 3689, 563, 236743, 236778, 236862, 236778,
      145912, 236909, 548, 236779, 643, 111038, 107, 236820, 236909, 548, 236779, 3041, 111038, 111457,
      107]),
    ('<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n',
     [44, 3738, 79, 1714, 79, 20589, 46, 4093, 198, 26843, 665, 44, 486, 79, 1714, 79, 20589, 46, 198,
      44, 3738, 79, 1714, 79, 20589, 46, 3980, 198],
     [2, 105, 2364, 107, 10979, 993, 106, 107, 105, 4368, 107]),
    ('<bos><eos><pad> <|endoftext|> <unk>',
     [44, 34761, 21198, 85, 395, 21198, 16384, 46, 216, 0, 2067, 5131, 46],
     [2, 2, 1, 0, 655, 236909, 643, 1340, 1005, 111038, 236743, 3]),
    ('He said "don\'t" and she\'ll\'ve we\'re I\'m it\'s',
     [3681, 1137, 476, 12420, 982, 18, 284, 1041, 3060, 3543, 392, 2316, 339, 5248, 357, 506],
     [2, 2209, 1176, 623, 13246, 236789, 236745, 236775, 532, 1304, 236789, 859, 236789, 560, 692,
      236789, 500, 564, 236789, 236757, 625, 236789, 236751]),
    ('URL: https://example.com/path?query=1&x=y#frag',
     [14492, 42, 5141, 1742, 7434, 30, 824, 31, 1537, 47, 8433, 45, 33, 22, 104, 45, 105, 19, 28082],
     [2, 6738, 236787, 4560, 1411, 8358, 236761, 854, 236786, 2337, 236881, 3278, 236784, 236770, 236880,
      236781, 236784, 236762, 236865, 45265]),
    ('JSON: {"a": [1, 2, 3], "b": null}',
     [27936, 42, 9583, 81, 1799, 933, 33, 28, 216, 34, 28, 216, 35, 1750, 476, 82, 1799, 10034, 109],
     [2, 12324, 236787, 3714, 236746, 1083, 870, 236770, 236764, 236743, 236778, 236764, 236743, 236800,
      1604, 623, 236763, 1083, 2303, 236783]),
    ('    indented    with    many    spaces',
     [333, 641, 6574, 333, 351, 333, 800, 333, 5600],
     [2, 140, 724, 16764, 140, 4060, 140, 34717, 140, 35220]),
    ('line1\r\nline2\rline3',
     [1311, 33, 201, 198, 1311, 34, 201, 1311, 35],
     [2, 1257, 236770, 251, 107, 1257, 236778, 251, 1257, 236800]),
    ('MixedCASE camelCase snake_case SCREAMING_CASE',
     [61, 13609, 51, 13108, 32782, 10802, 14321, 79, 7544, 15341, 48815, 4728, 79, 51, 13108],
     [2, 105367, 49710, 51657, 9818, 22825, 236779, 4925, 65340, 1936, 2850, 236779, 49710]),
    ('a\xa0b\u2003c\u200bd',
     [81, 15442, 82, 321, 221, 83, 321, 229, 84],
     [2, 236746, 432, 398, 236763, 464, 366, 369, 236755, 237141, 236753]),
    ('The year 2024 had 366 days; 1,000,000 people.',
     [504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 38, 2009, 43, 216, 33, 28, 32, 32, 32, 28, 32, 32,
      32, 701, 30],
     [2, 818, 1051, 236743, 236778, 236771, 236778, 236812, 1053, 236743, 236800, 236825, 236825, 2668,
      236793, 236743, 236770, 236764, 236771, 236771, 236771, 236764, 236771, 236771, 236771, 1331,
      236761]),
    ('<think>reasoning</think> answer',
     [44, 17400, 46, 23759, 274, 9617, 17400, 46, 2988],
     [2, 236820, 36345, 236813, 27388, 522, 954, 36345, 236813, 3890]),
    ('\x00\x01\x7f control chars',
     [190, 191, 217, 1533, 42040],
     [2, 238, 249732, 251541, 2256, 56256]),
    ('Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich',
     [74, 103, 7466, 46610, 13637, 91, 9023, 4062, 2344, 544, 9767, 24753, 25126, 31562, 5549, 137, 593,
      4017, 11102, 34878, 264, 29776, 352, 1413, 485],
     [2, 141536, 188371, 9622, 55281, 2720, 821, 673, 5451, 104925, 12245, 8046, 2034, 55500, 40148, 589,
      1783, 734]),
    ('    ',
     [289],
     [2, 140]),
    ('x  \n  y',
     [104, 256, 3805, 329],
     [2, 236781, 138, 107, 138, 236762]),
    ('<start_of_image> image <end_of_image>',
     [44, 3738, 79, 1714, 79, 5028, 46, 2443, 2067, 486, 79, 1714, 79, 5028, 46],
     [2, 255999, 2471, 236743, 256000]),
]
# transformers' unmodified GGUF conversion of SmolLM2 (no per-digit split) gives instead:
SMOLLM2_WITHOUT_DIGIT_SPLIT = ('  1 and   22 and\t333',
                               [216, 216, 33, 284, 256, 216, 34, 34, 284, 197, 35, 35, 35])
# encode_chat(CONVERSATION) as the reference's apply_chat_template(tokenize=True) gives it.
SMOLLM2_CHAT_IDS = [1, 9690, 198, 6077, 5453, 30, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 27, 34,
                    47, 2, 198, 1, 520, 9531, 198, 36, 2, 198, 1, 4093, 3805, 1350, 216, 35, 27, 35,
                    47, 256, 2, 198, 1, 520, 9531, 198]
GEMMA3_CHAT_IDS = [2, 105, 2364, 107, 3912, 8652, 236761, 108, 3689, 563, 236743, 236778, 236862,
                   236778, 236881, 106, 107, 105, 4368, 107, 236812, 106, 107, 105, 2364, 107, 3133,
                   236743, 236800, 236862, 236800, 236881, 106, 107, 105, 4368, 107]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path())


@pytest.fixture(scope="module")
def gemma3() -> Tokenizer:
    return Tokenizer.from_gguf(gemma3_path())


@pytest.mark.parametrize("text,smollm2_ids,gemma3_ids", GOLDEN_ENCODINGS,
                         ids=[repr(text)[:30] for text, _, _ in GOLDEN_ENCODINGS])
def test_encode_matches_reference_token_ids(smollm2, gemma3, text, smollm2_ids, gemma3_ids):
    assert smollm2.encode(text) == smollm2_ids
    assert gemma3.encode(text) == gemma3_ids


def test_smollm2_splits_digits_one_by_one_before_byte_level_regex(smollm2):
    text, ids_without_digit_split = SMOLLM2_WITHOUT_DIGIT_SPLIT
    assert smollm2.encode(text) != ids_without_digit_split
    assert smollm2.encode("  1") == [256, 33]  # "ĠĠ" then "1", never "Ġ" "Ġ1"


def test_special_tokens_as_text_encode_to_single_ids(smollm2, gemma3):
    assert smollm2.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert gemma3.encode("<start_of_turn>model<end_of_turn>", add_special_tokens=False) == [105, 4368, 106]
    assert gemma3.encode("<bos>", add_special_tokens=False) == [2]


def test_bos_is_added_only_when_the_model_asks(smollm2, gemma3):
    assert smollm2.encode("Hi")[0] != smollm2.bos_token_id
    assert gemma3.encode("Hi")[0] == gemma3.bos_token_id == 2
    assert gemma3.encode("Hi", add_special_tokens=False) == gemma3.encode("Hi")[1:]


def test_token_ids_and_sizes_come_from_metadata(smollm2, gemma3):
    assert (smollm2.vocab_size, smollm2.bos_token_id, smollm2.eos_token_id, smollm2.pad_token_id) == (
        49152, 1, 2, 2)
    assert (gemma3.vocab_size, gemma3.bos_token_id, gemma3.eos_token_id, gemma3.pad_token_id) == (
        262144, 2, 1, 0)


def test_stop_tokens_are_eos_and_end_of_turn(smollm2, gemma3):
    assert smollm2.stop_token_ids == (2,)  # eos is <|im_end|> itself
    assert gemma3.token_to_id("<end_of_turn>") == 106
    assert gemma3.stop_token_ids == (1, 106)


def test_decode_skips_special_tokens_unless_asked(gemma3):
    ids = gemma3.encode("<start_of_turn>user\nHi<end_of_turn>")
    assert gemma3.decode(ids) == "user\nHi"
    assert gemma3.decode(ids, skip_special_tokens=False) == "<bos><start_of_turn>user\nHi<end_of_turn>"


def _text_without(excluded: str):
    # Planes 4 to 16 are left out: SmolLM2 has no token for their UTF-8 lead bytes (0xF1 to 0xF4).
    return st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters=excluded,
                                          max_codepoint=0x3FFFF), max_size=60)


# SmolLM2's byte-level vocabulary has no token for these six control characters (nor for bytes 0xF1 to
# 0xFF), so like the reference, a BPE without an unknown token, it drops them.
SMOLLM2_UNENCODABLE = "\x04\x06\x13\x14\x16\x1d"


def test_smollm2_drops_characters_its_vocabulary_lacks(smollm2):
    assert smollm2.decode(smollm2.encode("a\x16b")) == "ab"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_text_without(SMOLLM2_UNENCODABLE))
def test_smollm2_decode_of_encode_round_trips(smollm2, text):
    assert smollm2.decode(smollm2.encode(text), skip_special_tokens=False) == text


# "▁" is SentencePiece's own spelling of a space, so it cannot survive a round trip.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_text_without("\u2581"))
def test_gemma3_decode_of_encode_round_trips(gemma3, text):
    assert gemma3.decode(gemma3.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


ROUND_TRIP_TEXTS = [text for text, _, _ in GOLDEN_ENCODINGS if "<" not in text]


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_decode_of_encode_round_trips_on_golden_texts(request, model):
    tokenizer = request.getfixturevalue(model)
    for text in ROUND_TRIP_TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def _stream(tokenizer: Tokenizer, ids: list[int], cuts: list[int]) -> tuple[str, list[str]]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    bounds = [0, *sorted(set(cuts)), len(ids)]
    deltas = [detokenizer.add_tokens(ids[start:stop]) for start, stop in zip(bounds, bounds[1:])]
    deltas.append(detokenizer.flush())
    return "".join(deltas), deltas


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_text_without("\u2581" + SMOLLM2_UNENCODABLE), seed=st.integers(0, 2**16))
def test_incremental_detokenizer_equals_full_decode_over_random_splits(smollm2, gemma3, text, seed):
    for tokenizer in (smollm2, gemma3):
        ids = tokenizer.encode(text, add_special_tokens=False)
        rng = random.Random(seed)
        cuts = [rng.randrange(len(ids) + 1) for _ in range(rng.randrange(len(ids) + 1))]
        streamed, _ = _stream(tokenizer, ids, cuts)
        assert streamed == tokenizer.decode(ids)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_incremental_detokenizer_holds_back_a_character_split_across_tokens(request, model):
    tokenizer = request.getfixturevalue(model)
    text = "ok \U0001f916\U00010348 done"  # a robot, and a Gothic letter that Gemma spells in byte tokens
    ids = tokenizer.encode(text, add_special_tokens=False)
    streamed, deltas = _stream(tokenizer, ids, cuts=list(range(len(ids))))
    assert streamed == text
    assert all("\ufffd" not in delta for delta in deltas)
    assert len(ids) > len(text.split()) + 2  # some character really was split over several tokens


def test_incremental_detokenizer_skips_special_tokens(gemma3):
    ids = gemma3.encode("Hi<end_of_turn>", add_special_tokens=False)
    streamed, _ = _stream(gemma3, ids, cuts=[1])
    assert streamed == "Hi"


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "  And 3+3?  "}]


def test_smollm2_chat_template_is_chatml_with_default_system_prompt(smollm2):
    assert smollm2.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert smollm2.apply_chat_template(CONVERSATION, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n  And 3+3?  <|im_end|>\n")


def test_gemma3_chat_template_folds_system_prompt_into_first_user_turn(gemma3):
    assert gemma3.chat_template.source == GEMMA3_CHAT_TEMPLATE
    assert gemma3.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    assert gemma3.apply_chat_template(CONVERSATION) == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n<start_of_turn>model\n")


def test_encode_chat_matches_reference_and_writes_one_bos(smollm2, gemma3):
    assert smollm2.encode_chat(CONVERSATION) == SMOLLM2_CHAT_IDS
    assert gemma3.encode_chat(CONVERSATION) == GEMMA3_CHAT_IDS
    assert gemma3.encode_chat(CONVERSATION).count(gemma3.bos_token_id) == 1


def test_chat_template_rejects_roles_that_do_not_alternate(gemma3):
    with pytest.raises(TokenizerError, match="alternate"):
        gemma3.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_chat_template_errors_are_tokenizer_errors(smollm2):
    with pytest.raises(TokenizerError, match="at least one message"):
        smollm2.apply_chat_template([])
    with pytest.raises(TokenizerError, match="role"):
        smollm2.apply_chat_template([{"content": "no role"}])


def _small_metadata(**overrides):
    metadata = {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": ["<eos>", "a", "b", "ab"],
                "tokenizer.ggml.token_type": [3, 1, 1, 1], "tokenizer.ggml.merges": ["a b"],
                "tokenizer.ggml.eos_token_id": 0}
    metadata.update(overrides)
    return {key: value for key, value in metadata.items() if value is not None}


def test_small_vocabulary_builds_and_encodes():
    tokenizer = Tokenizer.from_metadata(_small_metadata())
    assert tokenizer.encode("abba<eos>") == [3, 2, 1, 0]
    assert tokenizer.chat_template is None


def test_unsupported_tokenizer_model_is_rejected():
    with pytest.raises(TokenizerError, match="'bert'.*supported"):
        Tokenizer.from_metadata(_small_metadata(**{"tokenizer.ggml.model": "bert"}))


@pytest.mark.parametrize("missing", ["tokenizer.ggml.model", "tokenizer.ggml.tokens",
                                     "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id"])
def test_missing_metadata_field_is_named_in_the_error(missing):
    with pytest.raises(TokenizerError, match=missing.replace(".", r"\.")):
        Tokenizer.from_metadata(_small_metadata(**{missing: None}))


def test_out_of_range_special_token_id_is_rejected():
    with pytest.raises(TokenizerError, match="eos_token_id is 9"):
        Tokenizer.from_metadata(_small_metadata(**{"tokenizer.ggml.eos_token_id": 9}))


def test_broken_chat_template_is_a_tokenizer_error():
    with pytest.raises(TokenizerError, match="does not compile"):
        Tokenizer.from_metadata(_small_metadata(**{"tokenizer.chat_template": "{% for %}"}))
    tokenizer = Tokenizer.from_metadata(_small_metadata(**{
        "tokenizer.chat_template": "{{ raise_exception('no tools here') }}"}))
    with pytest.raises(TokenizerError, match="no tools here"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_model_without_chat_template_refuses_chat():
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.from_metadata(_small_metadata()).apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_sandbox_blocks_attribute_escape():
    tokenizer = Tokenizer.from_metadata(_small_metadata(**{
        "tokenizer.chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"}))
    with pytest.raises(TokenizerError):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_has_hugging_face_helpers():
    tokenizer = Tokenizer.from_metadata(_small_metadata(**{
        "tokenizer.chat_template": "{{ tools | tojson }}|{{ strftime_now('%Y') | length }}|{{ eos_token }}"}))
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"name": "é"}])
    assert rendered == '[{"name": "é"}]|4|<eos>'


def test_non_gguf_file_is_a_tokenizer_error(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(TokenizerError, match="not a little-endian GGUF"):
        Tokenizer.from_gguf(path)


@pytest.mark.slow  # gguf.GGUFReader alone takes 5 to 12 s on SmolLM2's file
def test_fast_metadata_reader_agrees_with_gguf_reader():
    import gguf

    reader = gguf.GGUFReader(str(smollm2_path()))
    from_reader = {key: field.contents() for key, field in reader.fields.items()
                   if key.startswith("tokenizer.") or key == "general.architecture"}
    assert read_tokenizer_metadata(smollm2_path()) == from_reader
    assert Tokenizer.from_gguf(reader).encode("Hi 123 <|im_end|>") == [26843, 216, 33, 34, 35, 216, 2]
